//! Where a tag stands between a sleep and a wake, and the one rule every sleep, wake and tagged
//! allocation follows: [`TagPhase::on`]. Two records keep a phase by that rule: each allocator's
//! own (its core, under its lock, for [`StreamAllocator::sleep`](super::StreamAllocator::sleep)),
//! and the process's ([`Phases`], for [`Tag::sleep_on`](super::Tag::sleep_on) and
//! [`Tag::wake_on`](super::Tag::wake_on) across allocators, those made later included).
//!
//! The process's record orders sleeps, wakes and tagged allocations of one tag coming from several
//! threads. A sleep or wake of a tag waits while another of the same tag is under way, then
//! decides on the phase that one left: two calls never work on one tag at once, so a wake cannot
//! pass over allocators still falling asleep and call the tag awake. A sleep also waits for the
//! tagged allocations already past their check, so that none lands, on an allocator the sleep did
//! not see, after it; allocations that come later are refused as for a tag falling asleep, so a
//! stream of them cannot hold the sleep off for ever. None of these waits is for the device: an
//! allocation refuses a tag that is not awake at once, and the lock is never held across a
//! sleep's or a wake's own work.

use crate::error::{Error, Result};
use std::sync::{Condvar, Mutex, MutexGuard};

/// Where a tag is between a sleep and a wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagPhase {
    /// Allocations with the tag are served.
    Awake,
    /// A sleep is under way: allocations are refused, other sleeps and wakes wait.
    Falling,
    /// Asleep: allocations are refused; a wake may start.
    Asleep,
    /// A wake is under way: allocations are still refused, other sleeps and wakes wait.
    Waking,
}

/// What happens to a tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A sleep begins.
    Sleep,
    /// A wake begins.
    Wake,
    /// An allocation with the tag passes its check.
    Allocate,
    /// The sleep under way ended, leaving the tag `asleep` somewhere (a failed sleep whose undo
    /// failed too still holds memory asleep), or awake everywhere.
    Slept { asleep: bool },
    /// The wake under way ended, leaving the tag `asleep` somewhere (it failed part-way), or
    /// awake everywhere.
    Woke { asleep: bool },
}

/// What a step does to a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// The tag moves to this phase (or stays in it).
    Go(TagPhase),
    /// Another sleep or wake is under way: the step waits for it to end, then asks again.
    Wait,
    /// The step is refused, changing nothing.
    Refuse(Why),
}

/// Why a step was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    AlreadyAsleep,
    NotAsleep,
    NotAwake,
    /// The end of a sleep or wake that is not under way.
    NothingUnderWay,
}

impl Why {
    pub(crate) fn error(self) -> Error {
        Error::invalid(match self {
            Why::AlreadyAsleep => "the tag is already asleep",
            Why::NotAsleep => "the tag is not asleep",
            Why::NotAwake => "cannot allocate with a tag that is asleep: wake it first",
            Why::NothingUnderWay => "no sleep or wake of the tag is under way",
        })
    }
}

impl TagPhase {
    /// The rule: where `step` takes a tag in this phase.
    pub(crate) fn on(self, step: Step) -> Next {
        use Next::{Go, Refuse, Wait};
        use TagPhase::{Asleep, Awake, Falling, Waking};
        match (self, step) {
            (Awake, Step::Sleep) => Go(Falling),
            (Asleep, Step::Sleep) => Refuse(Why::AlreadyAsleep),
            (Asleep, Step::Wake) => Go(Waking),
            (Awake, Step::Wake) => Refuse(Why::NotAsleep),
            (Falling | Waking, Step::Sleep | Step::Wake) => Wait,
            (Awake, Step::Allocate) => Go(Awake),
            (Falling | Asleep | Waking, Step::Allocate) => Refuse(Why::NotAwake),
            (Falling, Step::Slept { asleep }) | (Waking, Step::Woke { asleep }) => {
                Go(if asleep { Asleep } else { Awake })
            }
            (_, Step::Slept { .. } | Step::Woke { .. }) => Refuse(Why::NothingUnderWay),
        }
    }
}

struct Entry {
    tag: u32,
    phase: TagPhase,
    /// Allocations with the tag between their check and their return.
    allocating: usize,
}

/// The entries of tags not awake or with allocations under way: the table holds only tags in use.
struct Table(Vec<Entry>);

impl Table {
    fn phase(&self, tag: u32) -> TagPhase {
        self.0.iter().find(|e| e.tag == tag).map_or(TagPhase::Awake, |e| e.phase)
    }

    fn allocating(&self, tag: u32) -> usize {
        self.0.iter().find(|e| e.tag == tag).map_or(0, |e| e.allocating)
    }

    fn entry(&mut self, tag: u32) -> &mut Entry {
        let i = match self.0.iter().position(|e| e.tag == tag) {
            Some(i) => i,
            None => {
                self.0.push(Entry { tag, phase: TagPhase::Awake, allocating: 0 });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    fn prune(&mut self, tag: u32) {
        self.0.retain(|e| e.tag != tag || e.phase != TagPhase::Awake || e.allocating > 0);
    }
}

/// Every tag's phase for the whole process (see the module's documentation).
pub(crate) struct Phases {
    table: Mutex<Table>,
    changed: Condvar,
}

/// The process's record, which [`Tag::sleep_on`](super::Tag::sleep_on), [`Tag::wake_on`](super::Tag::wake_on)
/// and every tagged allocation consult.
pub(crate) static PROCESS: Phases = Phases::new();

impl Phases {
    pub(crate) const fn new() -> Self {
        Phases { table: Mutex::new(Table(Vec::new())), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, t: MutexGuard<'a, Table>) -> MutexGuard<'a, Table> {
        self.changed.wait(t).unwrap_or_else(|e| e.into_inner())
    }

    /// The tag's phase now.
    pub(crate) fn phase(&self, tag: u32) -> TagPhase {
        self.lock().phase(tag)
    }

    /// Takes `step` (a sleep or a wake beginning) once no other sleep or wake of `tag` is under
    /// way, per the rule.
    fn begin(&self, tag: u32, step: Step) -> Result<(MutexGuard<'_, Table>, Transition<'_>)> {
        let mut t = self.lock();
        loop {
            match t.phase(tag).on(step) {
                Next::Wait => t = self.wait(t),
                Next::Refuse(why) => return Err(why.error()),
                Next::Go(phase) => {
                    t.entry(tag).phase = phase;
                    return Ok((t, Transition { phases: self, tag, step, done: false }));
                }
            }
        }
    }

    /// Starts a sleep of `tag` (refused when it is asleep once no other sleep or wake is under
    /// way), and returns once the allocations with it already under way have returned: the tag
    /// is falling asleep from the start of that wait, so later ones are refused.
    pub(crate) fn begin_sleep(&self, tag: u32) -> Result<Transition<'_>> {
        let (mut t, falling) = self.begin(tag, Step::Sleep)?;
        while t.allocating(tag) > 0 {
            t = self.wait(t);
        }
        Ok(falling)
    }

    /// Starts a wake of `tag` once no other sleep or wake of it is under way: refused when it is
    /// not asleep then.
    pub(crate) fn begin_wake(&self, tag: u32) -> Result<Transition<'_>> {
        self.begin(tag, Step::Wake).map(|(_, waking)| waking)
    }

    /// Counts an allocation with `tag` until the returned guard drops; refused when the tag is
    /// not awake.
    pub(crate) fn begin_allocation(&self, tag: u32) -> Result<Allocating<'_>> {
        let mut t = self.lock();
        match t.phase(tag).on(Step::Allocate) {
            Next::Go(_) => {
                t.entry(tag).allocating += 1;
                Ok(Allocating { phases: self, tag })
            }
            Next::Refuse(why) => Err(why.error()),
            Next::Wait => unreachable!("an allocation never waits"),
        }
    }

    fn end(&self, tag: u32, step: Step) {
        let mut t = self.lock();
        let e = t.entry(tag);
        if let Next::Go(phase) = e.phase.on(step) {
            e.phase = phase;
        }
        t.prune(tag);
        drop(t);
        self.changed.notify_all();
    }
}

/// A sleep or wake under way; [`finish`](Self::finish) records how it ended. Dropped unfinished
/// (a panic), the tag is recorded asleep: allocators may have fallen asleep, and a wake then
/// wakes those (it skips those where the tag is awake), so the tag can always be woken.
pub(crate) struct Transition<'a> {
    phases: &'a Phases,
    tag: u32,
    /// The step that began it.
    step: Step,
    done: bool,
}

impl Transition<'_> {
    fn ended(&self, asleep: bool) -> Step {
        match self.step {
            Step::Sleep => Step::Slept { asleep },
            _ => Step::Woke { asleep },
        }
    }

    /// Records the tag `asleep` somewhere or awake everywhere, and lets the calls waiting for it
    /// go on.
    pub(crate) fn finish(mut self, asleep: bool) {
        self.done = true;
        self.phases.end(self.tag, self.ended(asleep));
    }
}

impl Drop for Transition<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.phases.end(self.tag, self.ended(true));
        }
    }
}

/// An allocation with a tag, counted until dropped.
pub(crate) struct Allocating<'a> {
    phases: &'a Phases,
    tag: u32,
}

impl Drop for Allocating<'_> {
    fn drop(&mut self) {
        let mut t = self.phases.lock();
        t.entry(self.tag).allocating -= 1;
        t.prune(self.tag);
        drop(t);
        self.phases.changed.notify_all();
    }
}

/// Puts a tag to sleep on each of `devices`, all or nothing: when one fails, those this call put
/// to sleep are woken again (an offload's contents come back; discarded ones do not). A wake that
/// fails there is recorded as a destructor's failure is ([`crate::error::take_drop_error`]), and
/// that device stays asleep.
fn sleep_all<A>(
    devices: &[A],
    sleep: impl Fn(&A) -> Result<()>,
    wake: impl Fn(&A) -> Result<()>,
) -> Result<()> {
    for (i, a) in devices.iter().enumerate() {
        if let Err(e) = sleep(a) {
            for b in &devices[..i] {
                crate::error::record_drop(wake(b));
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Wakes a tag on each of `devices` where it is asleep (none, for a tag that held nothing there).
/// A failure stops the call: the devices woken before stay awake, the rest asleep with nothing
/// lost, and a later call wakes those.
fn wake_all<A>(devices: &[A], asleep: impl Fn(&A) -> bool, wake: impl Fn(&A) -> Result<()>) -> Result<()> {
    devices.iter().filter(|a| asleep(a)).try_for_each(wake)
}

/// Sleeps `tag` on the `devices` there are once no other sleep or wake of it is under way. On a
/// failure the tag is awake again, unless waking a device the call had put to sleep failed too:
/// then it is recorded asleep, so that a wake finishes it.
pub(crate) fn sleep_tag<A>(
    phases: &Phases,
    tag: u32,
    devices: impl FnOnce() -> Vec<A>,
    sleep: impl Fn(&A) -> Result<()>,
    wake: impl Fn(&A) -> Result<()>,
    asleep: impl Fn(&A) -> bool,
) -> Result<()> {
    let falling = phases.begin_sleep(tag)?;
    // Listed once the tag is falling asleep: an allocator made after this refuses the tag.
    let all = devices();
    let slept = sleep_all(&all, sleep, wake);
    falling.finish(slept.is_ok() || all.iter().any(asleep));
    slept
}

/// Wakes `tag` on the `devices` there are once no other sleep or wake of it is under way; a
/// failure leaves it asleep (see [`wake_all`]).
pub(crate) fn wake_tag<A>(
    phases: &Phases,
    tag: u32,
    devices: impl FnOnce() -> Vec<A>,
    asleep: impl Fn(&A) -> bool,
    wake: impl Fn(&A) -> Result<()>,
) -> Result<()> {
    let waking = phases.begin_wake(tag)?;
    let woke = wake_all(&devices(), asleep, wake);
    waking.finish(woke.is_err());
    woke
}

#[cfg(test)]
mod tests;
