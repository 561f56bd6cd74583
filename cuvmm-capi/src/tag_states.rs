//! The C ABI's record of which tags are asleep, for the whole process, and the order it puts on
//! sleeps, wakes and tagged allocations of one tag coming from several threads.
//!
//! A tag is awake (not recorded), [`Falling`](Phase::Falling) asleep, [`Asleep`](Phase::Asleep) or
//! [`Waking`](Phase::Waking). A sleep or wake of a tag waits while another of the same tag is under
//! way, then decides on the state that one left: two calls never work on one tag at once, so a
//! wake can no longer pass over devices still falling asleep and call the tag awake. A sleep also
//! waits for the tagged allocations already past their check, so that none lands, on a device the
//! sleep did not see, after it; allocations that come later are ordered after the sleep (refused
//! as for a tag falling asleep), so a stream of them cannot hold the sleep off for ever. None of
//! these waits is for the device: an allocation refuses a tag that is not awake at once, and the
//! lock is never held across a sleep's or a wake's own work.

use std::sync::{Condvar, Mutex, MutexGuard};

/// Where a tag is between `cuvmm_sleep` and `cuvmm_wake`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A sleep is under way: allocations with the tag are refused, other sleeps and wakes wait.
    Falling,
    /// Asleep: allocations are refused; a wake may start.
    Asleep,
    /// A wake is under way: allocations are still refused, other sleeps and wakes wait.
    Waking,
}

/// What a sleep or a wake was refused for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    AlreadyAsleep,
    NotAsleep,
}

impl Refusal {
    pub(crate) fn message(self) -> &'static str {
        match self {
            Refusal::AlreadyAsleep => "the tag is already asleep",
            Refusal::NotAsleep => "the tag is not asleep",
        }
    }
}

struct Entry<K> {
    tag: K,
    /// `None`: awake (kept while allocations are counted).
    phase: Option<Phase>,
    /// Allocations with the tag between their check and their return.
    allocating: usize,
}

struct Table<K>(Vec<Entry<K>>);

impl<K: Copy + Eq> Table<K> {
    fn find(&self, tag: K) -> Option<&Entry<K>> {
        self.0.iter().find(|e| e.tag == tag)
    }

    fn entry(&mut self, tag: K) -> &mut Entry<K> {
        let i = match self.0.iter().position(|e| e.tag == tag) {
            Some(i) => i,
            None => {
                self.0.push(Entry { tag, phase: None, allocating: 0 });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    /// Drops the entry of a tag awake and without allocations under way: the table holds only
    /// tags in use.
    fn prune(&mut self, tag: K) {
        self.0.retain(|e| e.tag != tag || e.phase.is_some() || e.allocating > 0);
    }

    fn phase(&self, tag: K) -> Option<Phase> {
        self.find(tag).and_then(|e| e.phase)
    }
}

/// Every tag's phase (see the module's documentation).
pub(crate) struct TagStates<K> {
    table: Mutex<Table<K>>,
    changed: Condvar,
}

impl<K: Copy + Eq> TagStates<K> {
    pub(crate) const fn new() -> Self {
        TagStates { table: Mutex::new(Table(Vec::new())), changed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Table<K>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tag's phase now (`None`: awake).
    pub(crate) fn phase(&self, tag: K) -> Option<Phase> {
        self.lock().phase(tag)
    }

    /// Waits until no sleep or wake of `tag` is under way.
    fn settled(&self, tag: K) -> MutexGuard<'_, Table<K>> {
        let busy = |t: &Table<K>| matches!(t.phase(tag), Some(Phase::Falling | Phase::Waking));
        let mut t = self.lock();
        while busy(&t) {
            t = self.changed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        t
    }

    /// Starts a sleep of `tag` once no other sleep or wake of it is under way (refused when it is
    /// asleep then), and returns once the allocations with it already under way have returned:
    /// the tag is falling asleep from the start of that wait, so later ones are refused.
    pub(crate) fn begin_sleep(&self, tag: K) -> Result<Transition<'_, K>, Refusal> {
        let mut t = self.settled(tag);
        let e = t.entry(tag);
        if e.phase.is_some() {
            return Err(Refusal::AlreadyAsleep);
        }
        e.phase = Some(Phase::Falling);
        let falling = Transition { states: self, tag, done: false };
        while t.find(tag).is_some_and(|e| e.allocating > 0) {
            t = self.changed.wait(t).unwrap_or_else(|e| e.into_inner());
        }
        Ok(falling)
    }

    /// Starts a wake of `tag` once no other sleep or wake of it is under way: refused when it is
    /// not asleep then.
    pub(crate) fn begin_wake(&self, tag: K) -> Result<Transition<'_, K>, Refusal> {
        let mut t = self.settled(tag);
        match t.find(tag).and_then(|e| e.phase) {
            Some(Phase::Asleep) => {}
            _ => return Err(Refusal::NotAsleep),
        }
        t.entry(tag).phase = Some(Phase::Waking);
        Ok(Transition { states: self, tag, done: false })
    }

    /// Counts an allocation with `tag` until the returned guard drops; `None` when the tag is not
    /// awake (the allocation must be refused).
    pub(crate) fn begin_allocation(&self, tag: K) -> Option<Allocating<'_, K>> {
        let mut t = self.lock();
        let e = t.entry(tag);
        if e.phase.is_some() {
            return None;
        }
        e.allocating += 1;
        Some(Allocating { states: self, tag })
    }

    fn set(&self, tag: K, phase: Option<Phase>) {
        let mut t = self.lock();
        t.entry(tag).phase = phase;
        t.prune(tag);
        drop(t);
        self.changed.notify_all();
    }
}

/// A sleep or wake under way; [`finish`](Self::finish) records how it ended. Dropped unfinished
/// (a panic caught at the C boundary), the tag is recorded asleep: devices may have fallen asleep,
/// and a wake then wakes those (it skips the devices where the tag is awake), so the tag can
/// always be woken.
pub(crate) struct Transition<'a, K: Copy + Eq> {
    states: &'a TagStates<K>,
    tag: K,
    done: bool,
}

impl<K: Copy + Eq> Transition<'_, K> {
    /// Records the tag `asleep` or awake, and lets the calls waiting for it go on.
    pub(crate) fn finish(mut self, asleep: bool) {
        self.done = true;
        self.states.set(self.tag, asleep.then_some(Phase::Asleep));
    }
}

impl<K: Copy + Eq> Drop for Transition<'_, K> {
    fn drop(&mut self) {
        if !self.done {
            self.states.set(self.tag, Some(Phase::Asleep));
        }
    }
}

/// An allocation with a tag, counted until dropped.
pub(crate) struct Allocating<'a, K: Copy + Eq> {
    states: &'a TagStates<K>,
    tag: K,
}

impl<K: Copy + Eq> Drop for Allocating<'_, K> {
    fn drop(&mut self) {
        let mut t = self.states.lock();
        t.entry(self.tag).allocating -= 1;
        t.prune(self.tag);
        drop(t);
        self.states.changed.notify_all();
    }
}

#[cfg(test)]
mod tests;
