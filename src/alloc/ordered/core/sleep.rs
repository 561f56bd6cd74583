//! Sleep and wake of tagged memory: a tag's pages are given back to the driver (their contents
//! first copied to host memory, or dropped) while its addresses stay reserved, and brought back at
//! the same addresses later.
//!
//! A tag is [`Awake`](State::Awake), [`Falling`](State::Falling) asleep (a sleep waits for the
//! device, without the allocator's lock: a host function the device waits for may need it) or
//! [`Asleep`](State::Asleep), moving as [`TagPhase::on`] says (a wake runs under the lock, so
//! no other call sees a tag waking here); every other request is refused with a typed error and
//! changes nothing: sleeping twice, waking a tag that is not asleep, allocating with a tag that is not
//! awake, sleeping while a stream is being captured. Frees are allowed while
//! asleep (the block's pages are simply not brought back). Memory of captured graphs in the tag's
//! heaps is kept like live blocks: saved, and mapped again at wake. A wake that runs out of memory
//! gives back what it had mapped and leaves the tag asleep with its saved contents, so a later wake
//! can succeed; a sleep that fails while releasing wakes the tag again.

use super::{Backend, Core, SlotId, Tag};
use crate::alloc::ordered::phase::{Next, Step, TagPhase};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ops::Range;

/// What a sleep does with the contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    /// Copies the contents of every live block to host memory; wake restores them.
    Offload,
    /// Drops the contents: after wake the blocks hold undefined bytes.
    Discard,
}

/// One tag's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Bytes handed out under the tag.
    pub live: u64,
    /// Device memory the tag's heaps hold now (0 while asleep).
    pub mapped: u64,
    /// Bytes kept in host memory while asleep.
    pub offloaded: u64,
    /// Whether the tag is asleep.
    pub asleep: bool,
}

/// Bytes per copy: small enough that two lanes overlap, large enough to run at full speed.
const CHUNK: u64 = 64 << 20;

/// Bytes of an offloading sleep's copies after which the pages they read go back to the driver
/// while the next ones copy: unmapping and releasing a page costs the driver microseconds, which a
/// sleep would otherwise add after its last copy (docs/DECISIONS.md, "A sleep releases pages while
/// it copies"). Each batch ends a staged transfer, whose start and end cost a chunk's time.
pub(crate) const SLEEP_BATCH: u64 = 2 << 30;

pub(crate) enum State {
    Awake,
    /// A sleep waits for the device; then the tag is asleep, or awake again if the wait failed.
    Falling,
    Asleep {
        mode: SleepMode,
        /// (slot, page, offset in the backup) of every page whose contents were saved.
        saved: Vec<(SlotId, u64, u64)>,
    },
}

impl State {
    fn phase(&self) -> TagPhase {
        match self {
            State::Awake => TagPhase::Awake,
            State::Falling => TagPhase::Falling,
            State::Asleep { .. } => TagPhase::Asleep,
        }
    }
}

pub(crate) struct Sleeper<H> {
    state: State,
    /// While asleep, the saved contents; while awake, a backup its options retain for the next
    /// sleep.
    backup: Option<H>,
}

impl<B: Backend> Core<B> {
    /// Where `tag` stands on this allocator (untagged memory is always awake).
    fn phase_of(&self, tag: Tag) -> TagPhase {
        self.sleepers.get(&tag).map_or(TagPhase::Awake, |t| t.state.phase())
    }

    /// Whether `step` may begin for `tag` now: the core never waits for another sleep or wake
    /// (each runs under its lock but for a sleep's wait, during which the tag is falling asleep),
    /// so a step that would wait is refused too.
    fn may(&self, tag: Tag, step: Step) -> bool {
        matches!(self.phase_of(tag).on(step), Next::Go(_))
    }

    pub(crate) fn is_asleep(&self, tag: Option<Tag>) -> bool {
        match tag {
            Some(tag) => self.phase_of(tag) == TagPhase::Asleep,
            None => false,
        }
    }

    pub(crate) fn is_awake(&self, tag: Option<Tag>) -> bool {
        match tag {
            Some(tag) => self.may(tag, Step::Allocate),
            None => true,
        }
    }

    /// The heaps of `tag`.
    fn slots_of(&self, tag: Tag) -> Vec<SlotId> {
        (0..self.slots.len()).filter(|&i| self.slots[i].kind.tag() == Some(tag)).map(SlotId::of).collect()
    }

    /// Pages of `slot` under live blocks and graph memory, in order: what a sleep saves and a
    /// wake maps again.
    fn live_pages(&self, slot: SlotId) -> Vec<u64> {
        let page = self.slots[slot].page;
        let s = &self.slots[slot];
        let base = s.heap.base();
        let mut pages: Vec<u64> = s
            .heap
            .kept_blocks()
            .flat_map(|(a, n)| (a - base) / page..(a + n - base).div_ceil(page))
            .collect();
        pages.sort_unstable();
        pages.dedup();
        pages
    }

    /// Releases the device memory of `tag`, first copying its live contents to host memory when
    /// `mode` is [`SleepMode::Offload`]. Returns the bytes released. (The tests' path: the
    /// allocator waits for the device without its lock, between [`sleep_begin`](Self::sleep_begin)
    /// and [`sleep_finish`](Self::sleep_finish).)
    #[cfg(test)]
    pub(crate) fn sleep(&mut self, tag: Tag, mode: SleepMode) -> Result<u64> {
        let settle = self.sleep_begin(tag)?;
        let waited = self.backend.synchronize();
        self.sleep_finish(tag, mode, settle, waited)
    }

    /// Starts a sleep of `tag`: refused unless it is awake; else it is falling asleep (no
    /// allocation with it, no other sleep or wake) until [`sleep_finish`](Self::sleep_finish),
    /// and what the caller's wait for the whole device covers is returned.
    pub(crate) fn sleep_begin(&mut self, tag: Tag) -> Result<super::Settle> {
        if !self.may(tag, Step::Sleep) {
            return Err(Error::invalid("the tag is already asleep or going to sleep"));
        }
        if self.tag_shared(tag) {
            return Err(Error::invalid(
                "a block of the tag is shared with another process: its importers must let go first",
            ));
        }
        self.sleepers.entry(tag).or_insert(Sleeper { state: State::Awake, backup: None }).state =
            State::Falling;
        Ok(self.settle_begin())
    }

    /// Ends a sleep of `tag` begun with [`sleep_begin`](Self::sleep_begin), once the caller's wait
    /// for the whole device (the tag's blocks may be in use by any stream) returned `waited`: a
    /// failed wait (the driver refuses one while a stream is being captured) leaves the tag awake.
    pub(crate) fn sleep_finish(
        &mut self,
        tag: Tag,
        mode: SleepMode,
        settle: super::Settle,
        waited: Result<()>,
    ) -> Result<u64> {
        let settled = self.settled(settle, waited.is_ok());
        let r = waited.and(settled).and_then(|()| self.fall_asleep(tag, mode));
        if r.is_err() {
            let t = self.sleepers.get_mut(&tag).expect("marked falling");
            if t.state.phase().on(Step::Slept { asleep: false }) == Next::Go(TagPhase::Awake) {
                t.state = State::Awake;
            }
        }
        r
    }

    fn fall_asleep(&mut self, tag: Tag, mode: SleepMode) -> Result<u64> {
        self.flush_cached();
        let slots = self.slots_of(tag);
        let mut saved = Vec::new();
        // Bytes given back to the driver, while copying and after.
        let mut released = 0;
        if mode == SleepMode::Offload {
            let mut at = 0;
            for &slot in &slots {
                let page = self.slots[slot].page;
                for p in self.live_pages(slot) {
                    saved.push((slot, p, at));
                    at += page;
                }
            }
            let entry = self.sleepers.entry(tag).or_insert(Sleeper { state: State::Awake, backup: None });
            let mut host = entry.backup.take();
            if at > 0 {
                // The backup the tag's options ask for: a retained one when it still fits.
                host = Some(self.backend.host_alloc(tag, at, host)?);
            }
            let r = self.copy_out_releasing(&saved, host.as_mut(), &mut released);
            self.sleepers.get_mut(&tag).expect("inserted").backup = host;
            if let Err(e) = r {
                return Err(self.undo_sleep(tag, saved, released, e));
            }
        }
        // Everything of the tag goes back to the driver, idle pages included.
        let mut failed = None;
        'slots: for &slot in &slots {
            for p in 0..self.slots[slot].pages.len() as u64 {
                match self.release_page(slot, p) {
                    Ok(n) => released += n,
                    Err(e) => {
                        failed = Some(e);
                        break 'slots;
                    }
                }
            }
        }
        self.note_mapped();
        let t = self.sleepers.entry(tag).or_insert(Sleeper { state: State::Awake, backup: None });
        t.state = State::Asleep { mode, saved };
        if let Some(e) = failed {
            // All or nothing: the pages released so far come back (with their contents when
            // they were offloaded), and the tag is awake as before the call.
            return Err(self.wake_again(tag, e));
        }
        Ok(released)
    }

    /// Copies `saved` (slot, page, offset) into `host`, in batches of [`SLEEP_BATCH`] bytes:
    /// once a batch has been copied (while the next one copies), its pages go back to the driver,
    /// counted in `released`. Every copy has landed or failed when it returns.
    fn copy_out_releasing(
        &mut self,
        saved: &[(SlotId, u64, u64)],
        host: Option<&mut B::Host>,
        released: &mut u64,
    ) -> Result<()> {
        let Some(host) = host else { return Ok(()) };
        let r = self.queue_releasing(saved, host, released);
        // Whatever was queued has to land (or fail) before the backup is used or let go.
        let finished = self.backend.finish_copies();
        r.and(finished)
    }

    /// Queues [`copy_out_releasing`](Self::copy_out_releasing)'s batches and releases each one's
    /// pages once the next is queued and its own copies have landed. Stops at a copy that failed
    /// (finishing the copies reports it), the last batch not released.
    fn queue_releasing(
        &mut self,
        saved: &[(SlotId, u64, u64)],
        host: &mut B::Host,
        released: &mut u64,
    ) -> Result<()> {
        let mut lane = 0;
        // The batch queued before the last: its mark and its pages in `saved`.
        let mut previous: Option<(u64, Range<usize>)> = None;
        let mut start = 0;
        while start < saved.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < saved.len() && bytes < self.sleep_batch {
                bytes += self.slots[saved[end].0].page;
                end += 1;
            }
            self.queue_copies(&saved[start..end], host, true, &mut lane)?;
            let mark = self.backend.mark_copies()?;
            if let Some((mark, batch)) = previous.replace((mark, start..end)) {
                if !self.release_copied(&saved[batch], mark, released)? {
                    return Ok(());
                }
            }
            start = end;
        }
        Ok(())
    }

    /// Releases the pages of `batch` once the copies queued before `mark` (theirs) have landed;
    /// false, releasing nothing, when one of those copies failed (finishing them reports it).
    fn release_copied(
        &mut self,
        batch: &[(SlotId, u64, u64)],
        mark: u64,
        released: &mut u64,
    ) -> Result<bool> {
        if !self.backend.wait_copies(mark)? {
            return Ok(false);
        }
        for &(slot, p, _) in batch {
            *released += self.release_page(slot, p)?;
        }
        self.note_mapped();
        Ok(true)
    }

    /// A sleep that failed after its copies began, with `released` bytes given back already: the
    /// tag wakes again (those pages come back with their saved contents) and keeps or lets go of
    /// its backup as after a wake; the error to return.
    fn undo_sleep(&mut self, tag: Tag, saved: Vec<(SlotId, u64, u64)>, released: u64, e: Error) -> Error {
        if released == 0 {
            // Nothing released: the tag is awake with its contents; a backup it would not keep goes.
            let host = self.sleepers.get_mut(&tag).and_then(|t| t.backup.take());
            self.keep_or_release(tag, host);
            return e;
        }
        self.sleepers.get_mut(&tag).expect("inserted").state =
            State::Asleep { mode: SleepMode::Offload, saved };
        self.wake_again(tag, e)
    }

    /// Wakes `tag` after its sleep failed half way with `e`: the error to return.
    fn wake_again(&mut self, tag: Tag, e: Error) -> Error {
        match self.wake(tag) {
            Ok(()) => e,
            Err(w) => {
                Error::invalid(format!("{e}; waking the tag again failed too, so it stays asleep: {w}"))
            }
        }
    }

    /// Queues the copies of `pages` (slot, page, offset in `host`), in runs of pages adjacent both
    /// on the device and in the backup of up to [`CHUNK`] bytes, alternating lanes from `lane`.
    fn queue_copies(
        &mut self,
        pages: &[(SlotId, u64, u64)],
        host: &mut B::Host,
        out: bool,
        lane: &mut usize,
    ) -> Result<()> {
        let mut i = 0;
        while i < pages.len() {
            let (slot, p0, h0) = pages[i];
            let page = self.slots[slot].page;
            let mut j = i + 1;
            while j < pages.len()
                && pages[j].0 == slot
                && pages[j].1 == p0 + (j - i) as u64
                && pages[j].2 == h0 + (j - i) as u64 * page
                && (j - i) as u64 * page < CHUNK
            {
                j += 1;
            }
            let dev = self.slots[slot].heap.base() + p0 * page;
            let len = (j - i) as u64 * page;
            if out {
                self.backend.copy_out(host, h0, dev, len, *lane)?;
            } else {
                self.backend.copy_in(dev, host, h0, len, *lane)?;
            }
            *lane ^= 1;
            i = j;
        }
        Ok(())
    }

    /// Maps `tag`'s live blocks again at their addresses and restores what was offloaded. Each
    /// page's copy is queued as soon as the page is mapped, so that making and mapping the next
    /// pages overlaps the copies.
    ///
    /// Out of memory, it takes back every page known idle before it fails (see
    /// [`wake_with`](Self::wake_with) for the wake that may also wait for the device).
    pub(crate) fn wake(&mut self, tag: Tag) -> Result<()> {
        self.wake_with(tag, false)
    }

    /// [`wake`](Self::wake); with `may_settle`, out of memory when a wait for the whole device
    /// could make more memory idle, it fails with [`wants_settle`](Self::wants_settle) set, as
    /// [`try_allocate`](Self::try_allocate) does: the caller waits without the lock, gives back
    /// every idle page ([`release_idle`](Self::release_idle)) and wakes again without it. Never
    /// the flag an earlier allocation left: a wake must not take an exit nothing retries.
    pub(crate) fn wake_with(&mut self, tag: Tag, may_settle: bool) -> Result<()> {
        self.settle.asked = false;
        if !self.may(tag, Step::Wake) {
            return Err(Error::invalid("the tag is not asleep"));
        }
        self.settle.may_ask = may_settle;
        let r = self.backend.relax().and_then(|old| {
            let r = self.wake_relaxed(tag);
            self.backend.restore(old);
            r
        });
        self.settle.may_ask = false;
        r
    }

    /// A wake that waits for the whole device when out of memory and gives back every idle
    /// page before it asks again (the tests' path: the allocator waits without its lock).
    #[cfg(test)]
    pub(crate) fn wake_settling(&mut self, tag: Tag) -> Result<()> {
        let r = self.wake_with(tag, true);
        if r.is_err() && self.wants_settle() {
            self.flush_cached();
            let settle = self.settle_begin();
            let waited = self.backend.synchronize();
            self.settled(settle, waited.is_ok())?;
            self.release_idle()?;
            return self.wake_with(tag, false);
        }
        r
    }

    fn wake_relaxed(&mut self, tag: Tag) -> Result<()> {
        self.flush_cached();
        let slots = self.slots_of(tag);
        let saved: HashMap<(SlotId, u64), u64> = match &self.sleepers[&tag].state {
            State::Asleep { saved, .. } => saved.iter().map(|&(s, p, h)| ((s, p), h)).collect(),
            State::Awake | State::Falling => unreachable!("checked asleep"),
        };
        let mut host = self.sleepers.get_mut(&tag).and_then(|t| t.backup.take());
        let mut mapped: Vec<(SlotId, u64)> = Vec::new();
        let r = self.wake_map(&slots, &saved, host.as_mut(), &mut mapped);
        // Whatever was queued has to land (or fail) before anything is unmapped or reused: waited
        // for once, whether the mapping failed or not.
        let finished = self.backend.finish_copies();
        let r = r.and(finished);
        self.sleepers.get_mut(&tag).expect("known").backup = host;
        if let Err(e) = r {
            // Back to asleep as it was: nothing half-mapped stays behind; the backup is intact.
            for (slot, p) in mapped {
                let base = self.slots[slot].heap.base();
                let page = self.slots[slot].page;
                let _ = self.backend.unmap(base + p * page, page);
                drop(self.slots[slot].pages[p as usize].take());
                self.held.mapped -= page;
                self.stats.pages_released += 1;
            }
            self.note_mapped();
            return Err(e);
        }
        self.sleepers.get_mut(&tag).expect("known").state = State::Awake;
        let host = self.sleepers.get_mut(&tag).and_then(|t| t.backup.take());
        self.keep_or_release(tag, host);
        Ok(())
    }

    /// Keeps `host` as `tag`'s backup when its options say so, else gives it back.
    fn keep_or_release(&mut self, tag: Tag, host: Option<B::Host>) {
        match host {
            Some(h) if B::host_retained(&h) => {
                if let Some(t) = self.sleepers.get_mut(&tag) {
                    t.backup = Some(h);
                }
            }
            Some(h) => self.backend.host_release(h),
            None => {}
        }
    }

    /// Maps the pages under `slots`' live blocks, recording each in `mapped`, and queues the copy
    /// back of each whose contents `saved` holds (page -> offset in `host`), a run at a time.
    fn wake_map(
        &mut self,
        slots: &[SlotId],
        saved: &HashMap<(SlotId, u64), u64>,
        mut host: Option<&mut B::Host>,
        mapped: &mut Vec<(SlotId, u64)>,
    ) -> Result<()> {
        let mut lane = 0;
        let mut run: Vec<(SlotId, u64, u64)> = Vec::new();
        for &slot in slots {
            let want = self.live_pages(slot);
            let page = self.slots[slot].page;
            let base = self.slots[slot].heap.base();
            let missing = want.iter().filter(|&&p| self.slots[slot].pages[p as usize].is_none()).count();
            let mut first = true;
            for p in want {
                if self.slots[slot].pages[p as usize].is_some() {
                    continue;
                }
                let h = self.page_for(if first { missing } else { 0 }, super::Capture::None, page)?;
                first = false;
                if let Err(e) = self.backend.map(base + p * page, &h, page) {
                    self.give_back(h, page);
                    return Err(e);
                }
                self.slots[slot].pages[p as usize] = Some(h);
                self.held.mapped += page;
                mapped.push((slot, p));
                self.backend.set_access(base + p * page, page)?;
                let (Some(host), Some(&at)) = (host.as_deref_mut(), saved.get(&(slot, p))) else { continue };
                run.push((slot, p, at));
                if run.len() as u64 * page >= CHUNK {
                    self.queue_copies(&run, host, false, &mut lane)?;
                    run.clear();
                }
            }
            if let Some(host) = host.as_deref_mut() {
                self.queue_copies(&run, host, false, &mut lane)?;
            }
            run.clear();
        }
        self.note_mapped();
        Ok(())
    }

    /// Starts getting a backup ready for `tag`'s next offloading sleep, as large as that sleep
    /// would copy now (see [`Backend::host_prepare`]); returns those bytes, 0 when nothing was
    /// started (nothing to copy, a retained backup, or the backend declined). Refused for a tag
    /// not awake.
    pub(crate) fn prepare_backup(&mut self, tag: Tag) -> Result<u64> {
        if !self.is_awake(Some(tag)) {
            return Err(Error::invalid("the tag is asleep or going to sleep: its backup is in use"));
        }
        if self.sleepers.get(&tag).is_some_and(|t| t.backup.is_some()) {
            return Ok(0);
        }
        self.flush_cached();
        let bytes: u64 = self
            .slots_of(tag)
            .into_iter()
            .map(|slot| self.live_pages(slot).len() as u64 * self.slots[slot].page)
            .sum();
        Ok(if bytes > 0 && self.backend.host_prepare(tag, bytes) { bytes } else { 0 })
    }

    /// Whether every backup [`prepare_backup`](Self::prepare_backup) started is ready.
    pub(crate) fn backups_prepared(&self) -> bool {
        self.backend.host_prepared()
    }

    pub(crate) fn tag_stats(&self, tag: Tag) -> TagStats {
        let mut s = TagStats { asleep: self.is_asleep(Some(tag)), ..TagStats::default() };
        for slot in self.slots.iter().filter(|x| x.kind.tag() == Some(tag)) {
            s.live += slot.heap.live_blocks().map(|(_, n)| n).sum::<u64>();
            s.mapped += slot.pages.iter().filter(|p| p.is_some()).count() as u64 * slot.page;
        }
        if let Some(Sleeper { state: State::Asleep { mode: SleepMode::Offload, saved }, .. }) =
            self.sleepers.get(&tag)
        {
            s.offloaded = saved.iter().map(|&(slot, ..)| self.slots[slot].page).sum();
        }
        s
    }
}
