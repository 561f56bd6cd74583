//! Pageable backups given back lazily at wake, and taken up again by a later sleep.
//!
//! A backup released at wake the usual way (unmapped) costs the next sleep fresh host memory:
//! the kernel faults and zeroes every page again, which bounds such a sleep well above the copy
//! itself. Left with `MADV_FREE` instead, the pages stay where they are until the kernel needs
//! the memory; the next sleep writes into them without a fault. Pages the kernel took meanwhile
//! come back zeroed as fresh ones would, and a sleep writes every byte its wake reads, so the
//! contents never depend on what the kernel did.
//!
//! While awake the process holds such a backup only in name: `top` and `VmRSS` count its pages
//! as resident until the kernel takes them, but they are `LazyFree` in `/proc/self/smaps`, and
//! the kernel reclaims them before swapping or failing anything. `CUVMM_BACKUP_RELEASE=eager`
//! unmaps at wake instead.

use super::backup::{available_host_memory, BackupKind, BackupOptions, HostMap, Staged, Store};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Lazily released backups kept at once, per allocator; past it the smallest goes.
const KEPT: usize = 4;

/// Whether wakes give pageable backups back lazily: unless `CUVMM_BACKUP_RELEASE` says `eager`.
pub(crate) fn lazy_release() -> bool {
    std::env::var("CUVMM_BACKUP_RELEASE").map_or(true, |v| v.trim() != "eager")
}

/// A lazily released map: advised on a thread of its own, or done.
enum Freed {
    Freeing {
        len: usize,
        /// The map, or `None` when it could not be made (a prepared one, see
        /// [`LazyBackups::prepare`]).
        thread: JoinHandle<Option<HostMap>>,
    },
    #[cfg_attr(not(test), allow(dead_code))]
    Ready(HostMap),
}

impl Freed {
    fn len(&self) -> usize {
        match self {
            Freed::Freeing { len, .. } => *len,
            Freed::Ready(m) => m.len(),
        }
    }

    /// The map, once its advice is done; `None` if that thread panicked (the map went with it) or
    /// could not make the map.
    fn wait(self) -> Option<HostMap> {
        match self {
            Freed::Freeing { thread, .. } => thread.join().ok().flatten(),
            Freed::Ready(m) => Some(m),
        }
    }
}

/// The lazily released backups of one allocator.
#[derive(Default)]
pub(crate) struct LazyBackups {
    kept: Vec<Freed>,
}

impl LazyBackups {
    /// Keeps `staged`, a backup its wake has done with, released lazily, when it is pageable
    /// host memory nothing else refers to and lazy release is on. Returns what the caller is to
    /// release the usual way: `staged` when not kept, or a smaller backup it displaced.
    pub(crate) fn keep(&mut self, staged: Staged) -> Option<Staged> {
        if staged.options.kind != BackupKind::Pageable || !lazy_release() {
            return Some(staged);
        }
        let map = match staged.store {
            Store::Memory(m) => m,
            store => return Some(Staged { store, options: staged.options }),
        };
        let mut map = match Arc::try_unwrap(map) {
            Ok(m) => m,
            Err(m) => return Some(Staged { store: Store::Memory(m), options: staged.options }),
        };
        let len = map.len();
        // Advising gigabytes takes milliseconds a wake need not wait for.
        let freed = match std::thread::Builder::new().name("cuvmm-backup-free".into()).spawn(move || {
            map.free_lazily();
            Some(map)
        }) {
            Ok(thread) => Freed::Freeing { len, thread },
            // The closure, and the map with it, came back in no form: nothing was kept.
            Err(_) => return None,
        };
        self.kept.push(freed);
        if self.kept.len() <= KEPT {
            return None;
        }
        let smallest = (0..self.kept.len()).min_by_key(|&i| self.kept[i].len()).expect("not empty");
        let gone = self.kept.swap_remove(smallest).wait()?;
        Some(Staged { store: Store::Memory(Arc::new(gone)), options: BackupOptions::default() })
    }

    /// Makes, on a thread of its own, a backup of `bytes` faulted in and then released lazily, as
    /// a wake leaves one: the first sleep of a tag this large then writes into pages the kernel
    /// kept instead of faulting fresh memory in (which bounds a sleep well above the copy). Not
    /// when lazy release is off, when a kept backup fits already or the pool is full, or when the
    /// host has not that much memory available (then a sleep makes its own, or is refused).
    /// Whether one is on its way. A sleep that comes before it is done waits for it.
    pub(crate) fn prepare(&mut self, bytes: u64) -> bool {
        let Ok(len) = usize::try_from(bytes) else { return false };
        if len == 0
            || !lazy_release()
            || self.kept.len() >= KEPT
            || self.kept.iter().any(|k| k.len() >= len)
            || available_host_memory().is_some_and(|avail| bytes > avail)
        {
            return false;
        }
        let made = std::thread::Builder::new().name("cuvmm-backup-prepare".into()).spawn(move || {
            let mut map = HostMap::fresh(len).ok()?;
            map.finish_touching();
            map.free_lazily();
            Some(map)
        });
        match made {
            Ok(thread) => {
                self.kept.push(Freed::Freeing { len, thread });
                true
            }
            Err(_) => false,
        }
    }

    /// A kept backup of at least `bytes` for a sleep under `options` (the smallest that fits),
    /// its threads faulting back in what the kernel took; `None` when none fits, or when the host
    /// has no longer that much memory available (the backup is then unmapped here, so that a
    /// fresh one is refused, or made, on what the host really has).
    pub(crate) fn take(&mut self, bytes: u64, options: &BackupOptions) -> Option<Staged> {
        if options.kind != BackupKind::Pageable {
            return None;
        }
        let fits = (0..self.kept.len())
            .filter(|&i| self.kept[i].len() as u64 >= bytes)
            .min_by_key(|&i| self.kept[i].len())?;
        let mut map = self.kept.swap_remove(fits).wait()?;
        if available_host_memory().is_some_and(|avail| map.len() as u64 > avail) {
            return None;
        }
        map.reuse();
        Some(Staged { store: Store::Memory(Arc::new(map)), options: options.clone() })
    }

    /// Whether no backup is still being prepared or released (see [`prepare`](Self::prepare)).
    pub(crate) fn settled(&self) -> bool {
        self.kept.iter().all(|k| match k {
            Freed::Freeing { thread, .. } => thread.is_finished(),
            Freed::Ready(_) => true,
        })
    }

    /// Bytes of the backups kept.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.kept.iter().map(Freed::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEN: usize = 16 << 20;

    impl LazyBackups {
        /// Waits for every advice under way; the kept maps (base address, length).
        fn settle(&mut self) -> Vec<(usize, usize)> {
            let kept = std::mem::take(&mut self.kept);
            self.kept = kept.into_iter().filter_map(Freed::wait).map(Freed::Ready).collect();
            self.kept
                .iter()
                .map(|f| match f {
                    Freed::Ready(m) => (m.ptr() as usize, m.len()),
                    Freed::Freeing { .. } => unreachable!("settled"),
                })
                .collect()
        }
    }

    fn map_of(s: &Staged) -> &HostMap {
        match &s.store {
            Store::Memory(m) => m,
            Store::File(_) => panic!("a host backup"),
        }
    }

    /// What a sleep writes: every byte of `[0, len)`, from `seed`.
    fn sleep_into(s: &Staged, len: usize, seed: u8) {
        // SAFETY: inside the map; this test is its only user.
        let bytes = unsafe { &mut *map_of(s).range(0, len).unwrap() };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i / 4096) as u8 ^ (i as u8).wrapping_mul(31) ^ seed;
        }
    }

    /// What a wake reads back: bytes of `[0, len)` that differ from what `seed` wrote.
    fn differing(s: &Staged, len: usize, seed: u8) -> usize {
        // SAFETY: as in `sleep_into`.
        let bytes = unsafe { &*map_of(s).range(0, len).unwrap() };
        bytes
            .iter()
            .enumerate()
            .filter(|&(i, &b)| b != (i / 4096) as u8 ^ (i as u8).wrapping_mul(31) ^ seed)
            .count()
    }

    /// Pages of `[addr, addr + len)` the kernel has in memory.
    fn resident(addr: usize, len: usize) -> usize {
        let mut v = vec![0u8; len / 4096];
        // SAFETY: a range of a live map, page aligned; `v` has a byte per page.
        assert_eq!(unsafe { libc::mincore(addr as *mut libc::c_void, len, v.as_mut_ptr()) }, 0);
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn a_lazily_released_backup_serves_the_next_sleep_in_the_pages_the_kernel_kept() {
        let mut lazy = LazyBackups::default();
        let first = Staged::new(LEN as u64, BackupOptions::default()).unwrap();
        sleep_into(&first, LEN, 1);
        assert!(lazy.keep(first).is_none(), "a pageable backup is kept");
        let [(addr, len)] = lazy.settle()[..] else { panic!("one kept") };
        assert_eq!(
            resident(addr, len),
            len / 4096,
            "released lazily, the pages stay until the kernel needs them"
        );
        // Neither a larger sleep nor another kind takes it.
        assert!(lazy.take(LEN as u64 + 1, &BackupOptions::default()).is_none());
        assert!(lazy.take(4096, &BackupOptions { kind: BackupKind::Pinned, retain: false }).is_none());
        assert_eq!(lazy.bytes(), LEN);
        let next = lazy.take(LEN as u64 / 2, &BackupOptions::default()).expect("kept, and it fits");
        assert_eq!(map_of(&next).ptr() as usize, addr, "the next sleep writes into the same pages");
        assert_eq!(lazy.bytes(), 0);
        sleep_into(&next, LEN / 2, 2);
        assert_eq!(differing(&next, LEN / 2, 2), 0);
        assert_eq!(resident(addr, len), len / 4096, "no page was given back and taken again");
    }

    #[test]
    fn a_prepared_backup_is_faulted_in_ahead_and_serves_the_first_sleep_in_those_pages() {
        let mut lazy = LazyBackups::default();
        assert!(lazy.prepare(LEN as u64));
        assert!(!lazy.prepare(LEN as u64 / 2), "one that fits is on its way already");
        assert!(!lazy.prepare(u64::MAX / 2), "more than the host has");
        while !lazy.settled() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let [(addr, len)] = lazy.settle()[..] else { panic!("one prepared") };
        assert_eq!(len, LEN);
        assert_eq!(resident(addr, len), len / 4096, "faulted in, then left for the kernel to take");
        let first = lazy.take(LEN as u64, &BackupOptions::default()).expect("prepared, and it fits");
        assert_eq!(map_of(&first).ptr() as usize, addr, "the first sleep writes into those pages");
        sleep_into(&first, LEN, 3);
        assert_eq!(differing(&first, LEN, 3), 0);
        assert_eq!(resident(addr, len), len / 4096);
    }

    #[test]
    fn a_backup_the_kernel_took_back_in_part_still_brings_every_byte_back() {
        let mut lazy = LazyBackups::default();
        let first = Staged::new(LEN as u64, BackupOptions::default()).unwrap();
        sleep_into(&first, LEN, 1);
        assert_eq!(differing(&first, LEN, 1), 0);
        assert!(lazy.keep(first).is_none());
        let [(addr, len)] = lazy.settle()[..] else { panic!("one kept") };
        // The kernel reclaims the first half, as under memory pressure: lazily freed pages are
        // dropped, not written to swap. Kernels without MADV_PAGEOUT (before 5.4) have the range
        // dropped the way reclaim leaves it.
        const MADV_PAGEOUT: libc::c_int = 21;
        let half = (addr as *mut libc::c_void, len / 2);
        // SAFETY: the first half of a kept map that nothing uses until it is taken below; the
        // contents of a lazily freed map are not counted on.
        if unsafe { libc::madvise(half.0, half.1, MADV_PAGEOUT) } != 0 || resident(addr, len / 2) > 0 {
            // SAFETY: as above.
            assert_eq!(unsafe { libc::madvise(half.0, half.1, libc::MADV_DONTNEED) }, 0);
        }
        assert_eq!(resident(addr, len / 2), 0, "the kernel took the first half");
        // SAFETY: the map is alive and unused; reading a reclaimed page maps the zero page.
        let zero = unsafe { std::slice::from_raw_parts(addr as *const u8, 4096) };
        assert!(zero.iter().all(|&b| b == 0), "what the kernel took reads back as zero");
        // The next sleep writes while the backup's threads fault the first half in again.
        let next = lazy.take(LEN as u64, &BackupOptions::default()).expect("kept");
        assert_eq!(map_of(&next).ptr() as usize, addr);
        sleep_into(&next, LEN, 7);
        assert_eq!(differing(&next, LEN, 7), 0, "every byte of the second sleep, none of the first");
    }

    #[test]
    fn no_more_than_a_few_backups_are_kept_and_the_smallest_goes_first() {
        let mut lazy = LazyBackups::default();
        for k in 0..KEPT {
            let s = Staged::new(((k + 2) << 21) as u64, BackupOptions::default()).unwrap();
            assert!(lazy.keep(s).is_none());
        }
        let s = Staged::new(8 << 21, BackupOptions::default()).unwrap();
        let gone = lazy.keep(s).expect("one too many");
        assert_eq!(gone.store.len(), 2 << 21, "the smallest");
        // A retained or pinned backup is not this pool's, nor is a file.
        let pinned =
            Staged { store: gone.store, options: BackupOptions { kind: BackupKind::Pinned, retain: false } };
        assert!(lazy.keep(pinned).is_some());
        // The smallest that fits serves a sleep.
        let s = lazy.take(3 << 21, &BackupOptions { kind: BackupKind::Pageable, retain: true }).unwrap();
        assert_eq!((s.store.len(), s.options.retain), (3 << 21, true));
    }
}
