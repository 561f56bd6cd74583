//! The streams the [`Core`](super::Core) knows: each one's numbering and the events that stand
//! for it, its front, and the identities of those the driver cannot name.
//!
//! Kept apart from the heaps so that what makes a stream's number complete (an event, an idle
//! query, a device-wide wait) is said in one place: a number is complete only once every event
//! recorded before it has completed, and a stream is forgotten only once nothing waits on it.

use super::super::front::{Front, Fronts};
use super::super::heap::KeyMap;
use super::super::ids::{Caller, Epoch, Handle, StreamId};
use super::parts::Identities;
use super::{published, Capture};
use crate::error::Result;
use std::collections::VecDeque;
use std::ops::Index;
use std::sync::Arc;

pub(crate) struct Stream<E> {
    /// The stream's numbering (`next`, `last_free`, `seen_demand`) and the blocks of its fast
    /// paths. Its `next` is read and advanced under its lock only, in the same critical section
    /// as the event (or the idle query) that number stands for.
    pub(super) front: Arc<Front>,
    /// Largest event number known complete.
    pub(super) done: Epoch,
    /// Events recorded here, by number; `None` stands for one known complete when recorded (the
    /// stream had run all its work), whose blocks become idle at the next poll.
    pub(super) fences: VecDeque<(Epoch, Option<E>)>,
    /// Whether the fast paths may find the front: since an allocation, whose call asked the driver
    /// that the handle names this stream (a free through a destroyed stream's handle must not make
    /// the fast paths of the stream now holding that handle find the destroyed one's front).
    pub(super) published: bool,
}

impl<E> Stream<E> {
    fn new(c: Caller) -> Self {
        Stream {
            front: Arc::new(Front::new(c.id, c.raw)),
            done: Epoch::NONE,
            fences: VecDeque::new(),
            published: false,
        }
    }
}

/// Every stream the core knows, by identity (see [`Caller`]), with the events no stream waits
/// for any more, kept for the next fence (creating one is a driver call).
pub(crate) struct Streams<E> {
    by_id: KeyMap<StreamId, Stream<E>>,
    idle_events: Vec<E>,
    /// Identities made up for streams the driver could not name.
    pub(super) ids: Identities,
    /// Every stream's front, and the demand counter the fast paths read (see
    /// [`Core::free`](super::Core::free)).
    pub(super) fronts: Arc<Fronts>,
}

impl<E> Default for Streams<E> {
    fn default() -> Self {
        Streams {
            by_id: KeyMap::default(),
            idle_events: Vec::new(),
            ids: Identities::default(),
            fronts: Arc::new(Fronts::default()),
        }
    }
}

impl<E> Index<&StreamId> for Streams<E> {
    type Output = Stream<E>;
    fn index(&self, id: &StreamId) -> &Stream<E> {
        &self.by_id[id]
    }
}

impl<E> Streams<E> {
    pub(super) fn get(&self, id: &StreamId) -> Option<&Stream<E>> {
        self.by_id.get(id)
    }

    #[cfg(test)]
    pub(super) fn get_mut(&mut self, id: &StreamId) -> Option<&mut Stream<E>> {
        self.by_id.get_mut(id)
    }

    pub(super) fn contains_key(&self, id: &StreamId) -> bool {
        self.by_id.contains_key(id)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&StreamId, &Stream<E>)> {
        self.by_id.iter()
    }

    /// A copy, so that the caller may poll (and forget) streams while going through them.
    pub(super) fn ids(&self) -> Vec<StreamId> {
        self.by_id.keys().copied().collect()
    }

    /// The stream `c` names, its front made if new.
    pub(super) fn entry(&mut self, c: Caller) -> &mut Stream<E> {
        self.by_id.entry(c.id).or_insert_with(|| Stream::new(c))
    }

    /// The front of the stream `c` names, made if new and from now on found by the fast paths;
    /// `None` when that stream's front answers to another handle (the one it was made with
    /// stays the only one its fast paths serve).
    pub(super) fn publish(&mut self, c: Caller) -> Option<&Front> {
        let st = self.by_id.entry(c.id).or_insert_with(|| Stream::new(c));
        if st.front.raw != c.raw {
            return None;
        }
        if !st.published {
            self.fronts.publish(&st.front);
            st.published = true;
        }
        Some(&st.front)
    }

    /// The stream of a call passing handle `raw`, which the driver named `id` (see
    /// [`Core::caller`](super::Core::caller)).
    pub(super) fn caller(&mut self, raw: Handle, id: Option<StreamId>, capture: Capture) -> Caller {
        if let Some(id) = id.filter(|&i| published(i)) {
            return Caller { id, raw };
        }
        let id = match capture.id() {
            Some(c) => self.ids.in_capture(c, raw),
            None => self.ids.fresh(),
        };
        Caller { id, raw }
    }

    /// Forgets `s` if nothing is left to wait for there: no event pending, everything freed on
    /// it covered by a completed one, and its front empty. Whether it did. A fast path still
    /// holding the front finds it retired and goes to the core.
    pub(super) fn retire_if_done(&mut self, s: StreamId) -> bool {
        let st = &self.by_id[&s];
        if !st.fences.is_empty() {
            return false;
        }
        let front = st.front.clone();
        let mut f = front.lock();
        if !(f.last_free < f.next && f.is_empty()) {
            return false;
        }
        f.retired = true;
        drop(f);
        if st.published {
            self.fronts.withdraw(&front);
        }
        self.by_id.remove(&s);
        true
    }

    /// Takes in the events of `s` that `complete` finds complete, oldest first: the latest
    /// number now known complete, if any moved.
    pub(super) fn poll(
        &mut self,
        s: StreamId,
        mut complete: impl FnMut(&E) -> Result<bool>,
    ) -> Result<Option<Epoch>> {
        let st = self.by_id.get_mut(&s).expect("known stream");
        let mut done = None;
        while let Some((n, ev)) = st.fences.front() {
            let n = *n;
            if let Some(ev) = ev {
                if !complete(ev)? {
                    break;
                }
            }
            let (_, ev) = st.fences.pop_front().expect("front");
            st.done = n;
            self.idle_events.extend(ev);
            done = Some(n);
        }
        Ok(done)
    }

    /// The stream `s` was found to have run all its work queued before its number `n` (taken
    /// just then): every event recorded there has completed too. `now`: `n` is complete at
    /// once; otherwise at the next poll.
    pub(super) fn found_idle(&mut self, s: StreamId, n: Epoch, now: bool) {
        let st = self.by_id.get_mut(&s).expect("known stream");
        self.idle_events.extend(st.fences.drain(..).filter_map(|(_, ev)| ev));
        if now {
            st.done = n;
        } else {
            st.fences.push_back((n, None));
        }
    }

    /// An event to record, if one is kept (else the caller creates one).
    pub(super) fn spare_event(&mut self) -> Option<E> {
        self.idle_events.pop()
    }

    /// Keeps an event that stands for no number (its record failed).
    pub(super) fn keep_event(&mut self, ev: E) {
        self.idle_events.push(ev);
    }

    /// `ev`, just recorded on `s`, stands for its number `n`.
    pub(super) fn fenced(&mut self, s: StreamId, n: Epoch, ev: E) {
        self.by_id.get_mut(&s).expect("known stream").fences.push_back((n, Some(ev)));
    }

    /// Moves every stream's numbering past its frees so far, for a device-wide wait about to
    /// begin: the number each stream's work queued before the wait reaches.
    pub(super) fn advance_all(&self) -> Vec<(StreamId, Epoch)> {
        self.by_id
            .iter()
            .map(|(&s, st)| {
                let mut f = st.front.lock();
                (s, f.next.take())
            })
            .collect()
    }

    /// The device-wide wait behind `upto` failed: no event stands behind the numbers skipped, so
    /// a stream whose latest free had none after it is left so, to be covered by the next event
    /// recorded there.
    pub(super) fn unskip(&self, upto: &[(StreamId, Epoch)]) {
        for &(s, n) in upto {
            if let Some(st) = self.by_id.get(&s) {
                let mut f = st.front.lock();
                if f.last_free == n {
                    f.last_free = f.next;
                }
            }
        }
    }

    /// The work queued on `s` before its number `n` has run (a device-wide wait returned): the
    /// events up to it have completed.
    pub(super) fn ran_to(&mut self, s: StreamId, n: Epoch) {
        if let Some(st) = self.by_id.get_mut(&s) {
            while st.fences.front().is_some_and(|&(m, _)| m <= n) {
                let (_, ev) = st.fences.pop_front().expect("front");
                self.idle_events.extend(ev);
            }
            st.done = st.done.max(n);
        }
    }

    /// Each stream's numbering: its front is keyed by its identity, published only where the
    /// fast paths may serve it, and every event number waited for lies between the latest one
    /// known complete and the next.
    #[cfg(test)]
    pub(super) fn check(&self) {
        for (&id, st) in &self.by_id {
            assert_eq!(st.front.id, id, "a stream's front is keyed by its identity");
            assert!(!st.published || published(id), "{id:?}: a made-up identity's front is published");
            let f = st.front.lock();
            assert!(st.done < f.next, "{id:?}: done {:?}, next {:?}", st.done, f.next);
            let mut last = st.done;
            for &(n, _) in &st.fences {
                assert!(last < n && n < f.next, "{id:?}: event {n:?} after {last:?}, next {:?}", f.next);
                last = n;
            }
        }
    }
}
