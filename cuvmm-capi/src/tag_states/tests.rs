//! Sleeps, wakes and tagged allocations of one tag from several threads, against devices that
//! behave as the allocator does: a sleep falls asleep first (the wait for the device, paused here
//! at will), a wake is refused unless the tag is asleep there, an allocation unless it is awake.

use super::{Phase, TagStates};
use crate::{sleep_tag, wake_tag};
use cuvmm_lib::alloc::Tag;
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

    fn sleep(&self) -> cuvmm_lib::Result<()> {
        {
            let mut s = self.state.lock().unwrap();
            if *s != DevState::Awake {
                return Err(cuvmm_lib::Error::InvalidArgument("already asleep or going to sleep".into()));
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

    fn wake(&self) -> cuvmm_lib::Result<()> {
        let mut s = self.state.lock().unwrap();
        if *s != DevState::Asleep {
            return Err(cuvmm_lib::Error::InvalidArgument("the tag is not asleep".into()));
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

fn sleep(states: &TagStates<Tag>, t: Tag, devs: &[Arc<Dev>]) -> Result<(), (String, String)> {
    sleep_tag(states, t, || devs.to_vec(), |d| d.sleep(), |d| d.wake(), |d| d.state() == DevState::Asleep)
}

fn wake(states: &TagStates<Tag>, t: Tag, devs: &[Arc<Dev>]) -> Result<(), (String, String)> {
    wake_tag(states, t, || devs.to_vec(), |d| d.state() == DevState::Asleep, |d| d.wake())
}

/// What the header promises between calls: the tag is recorded asleep exactly when some device
/// holds it asleep, and no device is left falling asleep.
fn assert_consistent(states: &TagStates<Tag>, t: Tag, devs: &[Arc<Dev>]) {
    let dev: Vec<DevState> = devs.iter().map(|d| d.state()).collect();
    assert!(!dev.contains(&DevState::Falling), "{dev:?}");
    let any_asleep = dev.contains(&DevState::Asleep);
    assert_eq!(states.phase(t), any_asleep.then_some(Phase::Asleep), "devices {dev:?}");
}

#[test]
fn a_wake_racing_a_sleep_waits_for_it_and_wakes_every_device() {
    let states = TagStates::new();
    let t = Tag::new("race-wake").unwrap();
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
    let states = TagStates::new();
    let t = Tag::new("race-sleep").unwrap();
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
        assert!(e.1.contains("already asleep"), "{e:?}");
    });
    assert_consistent(&states, t, &devs);
    wake(&states, t, &devs).unwrap();
    assert_consistent(&states, t, &devs);
}

#[test]
fn a_sleep_waits_for_tagged_allocations_under_way_and_later_ones_are_refused() {
    let states = TagStates::new();
    let t = Tag::new("race-alloc").unwrap();
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
    assert!(states.begin_allocation(t).is_none());
    assert_eq!(devs[0].misplaced.load(Ordering::Relaxed), 0);
    wake(&states, t, &devs).unwrap();
    assert!(states.begin_allocation(t).is_some());
}

#[test]
fn allocations_arriving_while_a_sleep_waits_are_refused_and_cannot_hold_it_off() {
    let states = TagStates::new();
    let t = Tag::new("busy-alloc").unwrap();
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
                Some(next) => held = next,
                None => {
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
    assert!(states.begin_allocation(t).is_some());
}

#[test]
fn a_failed_sleep_whose_undo_fails_stays_asleep_and_can_be_woken() {
    let states = TagStates::new();
    let t = Tag::new("undo-fails").unwrap();
    let devs = vec![Dev::new(), Dev::new()];
    let woke_back = AtomicBool::new(false);
    // The second device refuses the sleep; waking the first back fails once.
    let e = sleep_tag(
        &states,
        t,
        || devs.to_vec(),
        |d| {
            if Arc::ptr_eq(d, &devs[1]) {
                Err(cuvmm_lib::Error::InvalidArgument("refused".into()))
            } else {
                d.sleep()
            }
        },
        |d| {
            if woke_back.swap(true, Ordering::SeqCst) {
                d.wake()
            } else {
                Err(cuvmm_lib::Error::InvalidArgument("out of memory".into()))
            }
        },
        |d| d.state() == DevState::Asleep,
    )
    .unwrap_err();
    assert!(e.1.contains("failed too"), "{e:?}");
    assert_consistent(&states, t, &devs);
    wake(&states, t, &devs).unwrap();
    assert_consistent(&states, t, &devs);
    assert_eq!(states.phase(t), None);
}

#[test]
fn a_transition_dropped_by_a_panic_leaves_the_tag_wakeable() {
    let states = TagStates::<u32>::new();
    drop(states.begin_sleep(7).unwrap());
    assert_eq!(states.phase(7), Some(Phase::Asleep));
    states.begin_wake(7).unwrap().finish(false);
    assert_eq!(states.phase(7), None);
    assert!(states.begin_allocation(7).is_some());
}

/// Threads sleeping, waking and allocating with one tag at random: every call ends in a state the
/// header describes, no allocation lands on a device where the tag is not awake, and a last wake
/// always brings the tag back.
#[test]
fn random_interleavings_of_sleep_wake_and_allocate_end_consistent() {
    let states = TagStates::new();
    let t = Tag::new("interleave").unwrap();
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
                            if let Some(_a) = states.begin_allocation(t) {
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
    if states.phase(t).is_some() {
        wake(&states, t, &devs).unwrap();
    }
    assert!(devs.iter().all(|d| d.state() == DevState::Awake));
    assert_eq!(states.phase(t), None);
}
