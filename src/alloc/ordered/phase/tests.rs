//! Sleeps, wakes and tagged allocations of one tag from several threads, against devices that
//! behave as the allocator does: a sleep falls asleep first (the wait for the device, paused here
//! at will), a wake is refused unless the tag is asleep there, an allocation unless it is awake;
//! and the rule itself, step by step.

use super::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DevState {
    Awake,
    Falling,
    Asleep,
}

struct Dev {
    state: Mutex<DevState>,
    /// When set, a sleep meets this barrier twice while falling asleep: once on arrival, once
    /// before it goes on.
    pause: Mutex<Option<Arc<Barrier>>>,
    /// Allocations made while the tag was not awake here (must stay 0).
    misplaced: AtomicUsize,
}

impl Dev {
    fn new() -> Arc<Dev> {
        Arc::new(Dev {
            state: Mutex::new(DevState::Awake),
            pause: Mutex::new(None),
            misplaced: AtomicUsize::new(0),
        })
    }

    fn state(&self) -> DevState {
        *self.state.lock().unwrap()
    }

    fn sleep(&self) -> Result<()> {
        {
            let mut s = self.state.lock().unwrap();
            if *s != DevState::Awake {
                return Err(Error::InvalidArgument("already asleep or going to sleep".into()));
            }
            *s = DevState::Falling;
        }
        let pause = self.pause.lock().unwrap().clone();
        if let Some(b) = pause {
            b.wait();
            b.wait();
        }
        *self.state.lock().unwrap() = DevState::Asleep;
        Ok(())
    }

    fn wake(&self) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        if *s != DevState::Asleep {
            return Err(Error::InvalidArgument("the tag is not asleep".into()));
        }
        *s = DevState::Awake;
        Ok(())
    }

    fn allocate(&self) {
        if self.state() != DevState::Awake {
            self.misplaced.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn sleep(states: &Phases, t: u32, devs: &[Arc<Dev>]) -> Result<()> {
    sleep_tag(states, t, || devs.to_vec(), |d| d.sleep(), |d| d.wake(), |d| d.state() == DevState::Asleep)
}

fn wake(states: &Phases, t: u32, devs: &[Arc<Dev>]) -> Result<()> {
    wake_tag(states, t, || devs.to_vec(), |d| d.state() == DevState::Asleep, |d| d.wake())
}

/// What the header promises between calls: the tag is recorded asleep exactly when some device
/// holds it asleep, and no device is left falling asleep.
fn assert_consistent(states: &Phases, t: u32, devs: &[Arc<Dev>]) {
    let dev: Vec<DevState> = devs.iter().map(|d| d.state()).collect();
    assert!(!dev.contains(&DevState::Falling), "{dev:?}");
    let any_asleep = dev.contains(&DevState::Asleep);
    assert_eq!(
        states.phase(t),
        if any_asleep { TagPhase::Asleep } else { TagPhase::Awake },
        "devices {dev:?}"
    );
}

#[test]
fn a_wake_racing_a_sleep_waits_for_it_and_wakes_every_device() {
    let states = Phases::new();
    let t = 8u32;
    let devs = vec![Dev::new(), Dev::new()];
    let pause = Arc::new(Barrier::new(2));
    *devs[1].pause.lock().unwrap() = Some(pause.clone());
    std::thread::scope(|s| {
        let sleeper = s.spawn(|| sleep(&states, t, &devs));
        // The first device is asleep, the second falling asleep.
        pause.wait();
        let waker = s.spawn(|| wake(&states, t, &devs));
        // Gives the wake time to run ahead if nothing stops it (a wake that passed over a device
        // still falling asleep would return 0 here, and that device would stay asleep for good).
        std::thread::sleep(Duration::from_millis(50));
        *devs[1].pause.lock().unwrap() = None;
        pause.wait();
        sleeper.join().unwrap().unwrap();
        waker.join().unwrap().unwrap();
    });
    assert_eq!(devs.iter().map(|d| d.state()).collect::<Vec<_>>(), [DevState::Awake; 2]);
    assert_consistent(&states, t, &devs);
    // The tag sleeps and wakes again as usual.
    sleep(&states, t, &devs).unwrap();
    wake(&states, t, &devs).unwrap();
    assert_consistent(&states, t, &devs);
}

#[test]
fn a_sleep_racing_a_sleep_waits_and_is_refused_as_already_asleep() {
    let states = Phases::new();
    let t = 486u32;
    let devs = vec![Dev::new()];
    let pause = Arc::new(Barrier::new(2));
    *devs[0].pause.lock().unwrap() = Some(pause.clone());
    std::thread::scope(|s| {
        let first = s.spawn(|| sleep(&states, t, &devs));
        pause.wait();
        let second = s.spawn(|| sleep(&states, t, &devs));
        std::thread::sleep(Duration::from_millis(50));
        *devs[0].pause.lock().unwrap() = None;
        pause.wait();
        first.join().unwrap().unwrap();
        let e = second.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("already asleep"), "{e}");
    });
    assert_consistent(&states, t, &devs);
    wake(&states, t, &devs).unwrap();
    assert_consistent(&states, t, &devs);
}

#[test]
fn a_sleep_waits_for_tagged_allocations_under_way_and_later_ones_are_refused() {
    let states = Phases::new();
    let t = 210u32;
    let allocating = states.begin_allocation(t).unwrap();
    let devs = vec![Dev::new()];
    let allocated = AtomicBool::new(false);
    std::thread::scope(|s| {
        let sleeper = s.spawn(|| {
            sleep(&states, t, &devs).unwrap();
            allocated.load(Ordering::SeqCst)
        });
        std::thread::sleep(Duration::from_millis(50));
        // The allocation lands on a device the sleep then covers.
        devs[0].allocate();
        allocated.store(true, Ordering::SeqCst);
        drop(allocating);
        assert!(sleeper.join().unwrap(), "the sleep did not wait for the allocation under way");
    });
    assert!(states.begin_allocation(t).is_err());
    assert_eq!(devs[0].misplaced.load(Ordering::Relaxed), 0);
    wake(&states, t, &devs).unwrap();
    assert!(states.begin_allocation(t).is_ok());
}

#[test]
fn allocations_arriving_while_a_sleep_waits_are_refused_and_cannot_hold_it_off() {
    let states = Phases::new();
    let t = 372u32;
    let devs = vec![Dev::new()];
    let slept = AtomicBool::new(false);
    std::thread::scope(|s| {
        let first = states.begin_allocation(t).unwrap();
        let sleeper = s.spawn(|| {
            sleep(&states, t, &devs).unwrap();
            slept.store(true, Ordering::SeqCst);
        });
        // Allocations overlapping one another: with them let in, the sleep waits for ever.
        let mut held = first;
        let mut refused = false;
        for _ in 0..200 {
            std::thread::sleep(Duration::from_millis(5));
            match states.begin_allocation(t) {
                Ok(next) => held = next,
                Err(_) => {
                    refused = true;
                    break;
                }
            }
        }
        assert!(refused, "allocations kept arriving after the sleep began waiting");
        assert!(!slept.load(Ordering::SeqCst), "the sleep went on past an allocation under way");
        drop(held);
        sleeper.join().unwrap();
    });
    assert!(slept.load(Ordering::SeqCst));
    assert_eq!(devs[0].state(), DevState::Asleep);
    wake(&states, t, &devs).unwrap();
    assert!(states.begin_allocation(t).is_ok());
}

#[test]
fn a_failed_sleep_whose_undo_fails_stays_asleep_and_can_be_woken() {
    let states = Phases::new();
    let t = 747u32;
    let devs = vec![Dev::new(), Dev::new()];
    let woke_back = AtomicBool::new(false);
    let missed_before = crate::error::drop_error_count();
    // The second device refuses the sleep; waking the first back fails once.
    let e = sleep_tag(
        &states,
        t,
        || devs.to_vec(),
        |d| {
            if Arc::ptr_eq(d, &devs[1]) {
                Err(Error::InvalidArgument("refused".into()))
            } else {
                d.sleep()
            }
        },
        |d| {
            if woke_back.swap(true, Ordering::SeqCst) {
                d.wake()
            } else {
                Err(Error::InvalidArgument("out of memory".into()))
            }
        },
        |d| d.state() == DevState::Asleep,
    )
    .unwrap_err();
    assert!(e.to_string().contains("refused"), "the sleep's own error: {e}");
    assert!(crate::error::drop_error_count() > missed_before, "the failed undo is recorded");
    assert_consistent(&states, t, &devs);
    wake(&states, t, &devs).unwrap();
    assert_consistent(&states, t, &devs);
    assert_eq!(states.phase(t), TagPhase::Awake);
}

#[test]
fn a_transition_dropped_by_a_panic_leaves_the_tag_wakeable() {
    let states = Phases::new();
    drop(states.begin_sleep(7).unwrap());
    assert_eq!(states.phase(7), TagPhase::Asleep);
    states.begin_wake(7).unwrap().finish(false);
    assert_eq!(states.phase(7), TagPhase::Awake);
    assert!(states.begin_allocation(7).is_ok());
}

/// Threads sleeping, waking and allocating with one tag at random: every call ends in a state the
/// header describes, no allocation lands on a device where the tag is not awake, and a last wake
/// always brings the tag back.
#[test]
fn random_interleavings_of_sleep_wake_and_allocate_end_consistent() {
    let states = Phases::new();
    let t = 145u32;
    let devs = vec![Dev::new(), Dev::new(), Dev::new()];
    let threads = 6;
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        for i in 0..threads {
            let (states, devs, start) = (&states, &devs, &start);
            s.spawn(move || {
                start.wait();
                let mut x = 0x9e37_79b9_u32.wrapping_mul(i as u32 + 1);
                for _ in 0..400 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    match x % 3 {
                        0 => drop(sleep(states, t, devs)),
                        1 => drop(wake(states, t, devs)),
                        _ => {
                            if let Ok(_a) = states.begin_allocation(t) {
                                devs[x as usize % devs.len()].allocate();
                            }
                        }
                    }
                }
            });
        }
    });
    assert_consistent(&states, t, &devs);
    assert!(devs.iter().all(|d| d.misplaced.load(Ordering::Relaxed) == 0));
    if states.phase(t) != TagPhase::Awake {
        wake(&states, t, &devs).unwrap();
    }
    assert!(devs.iter().all(|d| d.state() == DevState::Awake));
    assert_eq!(states.phase(t), TagPhase::Awake);
}

/// Every step from every phase, as the module's documentation describes them.
#[test]
fn every_step_from_every_phase_goes_where_the_rule_says() {
    use Next::{Go, Refuse, Wait};
    use TagPhase::{Asleep, Awake, Falling, Waking};
    let steps = [
        Step::Sleep,
        Step::Wake,
        Step::Allocate,
        Step::Slept { asleep: true },
        Step::Slept { asleep: false },
        Step::Woke { asleep: true },
        Step::Woke { asleep: false },
    ];
    let table: [(TagPhase, [Next; 7]); 4] = [
        (
            Awake,
            [
                Go(Falling),
                Refuse(Why::NotAsleep),
                Go(Awake),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
            ],
        ),
        (
            Falling,
            [
                Wait,
                Wait,
                Refuse(Why::NotAwake),
                Go(Asleep),
                Go(Awake),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
            ],
        ),
        (
            Asleep,
            [
                Refuse(Why::AlreadyAsleep),
                Go(Waking),
                Refuse(Why::NotAwake),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
            ],
        ),
        (
            Waking,
            [
                Wait,
                Wait,
                Refuse(Why::NotAwake),
                Refuse(Why::NothingUnderWay),
                Refuse(Why::NothingUnderWay),
                Go(Asleep),
                Go(Awake),
            ],
        ),
    ];
    for (phase, nexts) in table {
        for (step, want) in steps.iter().zip(nexts) {
            assert_eq!(phase.on(*step), want, "{phase:?} on {step:?}");
        }
    }
    // What each refusal says, for the messages callers see.
    assert!(Why::AlreadyAsleep.error().to_string().contains("already asleep"));
    assert!(Why::NotAsleep.error().to_string().contains("the tag is not asleep"));
    assert!(Why::NotAwake.error().to_string().contains("wake it first"));
}

#[test]
fn the_end_of_a_sleep_or_wake_not_under_way_changes_nothing() {
    let states = Phases::new();
    states.end(901, Step::Slept { asleep: true });
    assert_eq!(states.phase(901), TagPhase::Awake);
    let falling = states.begin_sleep(901).unwrap();
    assert_eq!(states.phase(901), TagPhase::Falling);
    states.end(901, Step::Woke { asleep: false });
    assert_eq!(states.phase(901), TagPhase::Falling, "a wake's end does not end a sleep");
    falling.finish(false);
    assert_eq!(states.phase(901), TagPhase::Awake);
}

/// A fake device for the sleep and wake of every device: whether the tag is asleep there, and
/// how many of its next sleeps or wakes fail.
struct Fake {
    asleep: std::cell::Cell<bool>,
    fail_sleep: std::cell::Cell<u32>,
    fail_wake: std::cell::Cell<u32>,
}

fn fakes(n: usize) -> Vec<Fake> {
    (0..n).map(|_| Fake { asleep: false.into(), fail_sleep: 0.into(), fail_wake: 0.into() }).collect()
}

fn refused(d: &std::cell::Cell<u32>) -> bool {
    let n = d.get();
    d.set(n.saturating_sub(1));
    n > 0
}

fn fake_sleep(d: &Fake) -> Result<()> {
    if d.asleep.get() {
        return Err(Error::InvalidArgument("the tag is already asleep".into()));
    }
    if refused(&d.fail_sleep) {
        return Err(Error::InvalidArgument("sleep refused".into()));
    }
    d.asleep.set(true);
    Ok(())
}

fn fake_wake(d: &Fake) -> Result<()> {
    if !d.asleep.get() {
        return Err(Error::InvalidArgument("the tag is not asleep".into()));
    }
    if refused(&d.fail_wake) {
        return Err(Error::InvalidArgument("out of memory".into()));
    }
    d.asleep.set(false);
    Ok(())
}

fn fake_states(d: &[Fake]) -> Vec<bool> {
    d.iter().map(|d| d.asleep.get()).collect()
}

#[test]
fn a_sleep_that_fails_on_one_device_wakes_the_others_it_put_to_sleep() {
    let d = fakes(3);
    d[2].fail_sleep.set(1);
    let e = sleep_all(&d, fake_sleep, fake_wake).unwrap_err();
    assert!(e.to_string().contains("sleep refused"), "{e}");
    assert_eq!(fake_states(&d), [false, false, false]);
    // ...and records it when waking one of them fails as well.
    let missed = crate::error::drop_error_count();
    d[1].fail_wake.set(1);
    d[2].fail_sleep.set(1);
    let e = sleep_all(&d, fake_sleep, fake_wake).unwrap_err();
    assert!(e.to_string().contains("sleep refused"), "{e}");
    assert!(crate::error::drop_error_count() > missed);
    assert_eq!(fake_states(&d), [false, true, false]);
}

#[test]
fn a_wake_skips_devices_where_the_tag_is_awake_and_a_later_wake_finishes_a_failed_one() {
    let d = fakes(3);
    sleep_all(&d, fake_sleep, fake_wake).unwrap();
    // A wake that runs out of memory on the second device: the first stays awake, the rest
    // asleep.
    d[1].fail_wake.set(1);
    assert!(wake_all(&d, |d| d.asleep.get(), fake_wake).is_err());
    assert_eq!(fake_states(&d), [false, true, true]);
    // The next call does not fail on the first device ("not asleep"): it wakes the rest.
    wake_all(&d, |d| d.asleep.get(), fake_wake).unwrap();
    assert_eq!(fake_states(&d), [false, false, false]);
    // Awake everywhere, or no device at all: nothing to do (a wake of a tag that is not asleep
    // is refused before it comes here).
    wake_all(&d, |d| d.asleep.get(), fake_wake).unwrap();
    assert_eq!(fake_states(&d), [false, false, false]);
    wake_all(&fakes(0), |d| d.asleep.get(), fake_wake).unwrap();
    // A device that appeared after the sleep (an allocator made later) is left alone.
    let mut d = fakes(1);
    sleep_all(&d, fake_sleep, fake_wake).unwrap();
    d.extend(fakes(1));
    wake_all(&d, |d| d.asleep.get(), fake_wake).unwrap();
    assert_eq!(fake_states(&d), [false, false]);
}
