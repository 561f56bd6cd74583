//! Sleep backups on a GPU: every kind (pageable host memory through the staging ring, pinned host
//! memory, a file) brings the contents back, holds pinned memory only as it says, and is released
//! at wake unless retained; a disk backup that cannot be written leaves the tag awake; a tag on two
//! devices sleeps and wakes on both at once; a pageable backup released lazily at wake is
//! written again by the next sleep without new memory.

mod common;

use cuvmm::alloc::{BackupKind, BackupOptions, SleepMode, StreamAllocator, StreamBlock, Tag};
use cuvmm::host::pinned_bytes;
use cuvmm::kernels::Kernels;
use cuvmm::{Context, DeviceSlice, DeviceSliceMut, Stream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const BLOCK: usize = 256 << 20;
/// The backup ring's pinned slots (64 MiB by default), with room to spare.
const RING: u64 = 128 << 20;

struct Tagged {
    k: Kernels,
    alloc: StreamAllocator,
    s: Stream,
    blocks: Vec<StreamBlock>,
}

impl Tagged {
    fn new(ctx: &Context, tag: Tag, blocks: usize) -> Tagged {
        let k = Kernels::load(ctx).unwrap();
        let alloc = StreamAllocator::new(ctx).unwrap();
        let s = Stream::non_blocking(ctx).unwrap();
        let blocks = (0..blocks).map(|_| alloc.allocate_tagged(BLOCK, &s, tag).unwrap()).collect();
        Tagged { k, alloc, s, blocks }
    }

    fn fill(&self, seed: u32) {
        for (i, b) in self.blocks.iter().enumerate() {
            // SAFETY: a live block of BLOCK bytes, used only on `s`.
            let mut v = unsafe { DeviceSliceMut::<u32>::from_raw_parts(b.ptr(), BLOCK / 4) };
            self.k.pattern_u32(&self.s, &mut v, (i * BLOCK / 4) as u64, seed).unwrap();
        }
        self.s.synchronize().unwrap();
    }

    fn mismatches(&self, seed: u32) -> u64 {
        self.blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                // SAFETY: as in `fill`.
                let v = unsafe { DeviceSlice::<u32>::from_raw_parts(b.ptr(), BLOCK / 4) };
                self.k.count_pattern_mismatches(&self.s, &v, (i * BLOCK / 4) as u64, seed).unwrap()
            })
            .sum()
    }
}

/// A directory of its own under the system's temporary directory, removed when dropped.
struct Dir(PathBuf);
impl Dir {
    fn new(name: &str) -> Dir {
        let p = std::env::temp_dir().join(format!("cuvmm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
    fn files(&self) -> usize {
        std::fs::read_dir(&self.0).map_or(0, |d| d.count())
    }
}
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits up to two seconds for `cond` (a released backup goes on a thread of its own).
fn soon(mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_backup_kind_restores_the_contents_and_is_released_at_wake_unless_retained() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let dir = Dir::new("gpu-sleep-backup");
    let kinds = [BackupKind::Pageable, BackupKind::Pinned, BackupKind::Disk(dir.0.clone())];
    for (n, kind) in kinds.iter().enumerate() {
        for retain in [false, true] {
            let opts = BackupOptions { kind: kind.clone(), retain };
            let tag = Tag::new(&format!("backup-{n}-{retain}")).unwrap();
            tag.set_backup(opts.clone()).unwrap();
            let t = Tagged::new(&ctx, tag, 3);
            let bytes = t.alloc.tag_stats(tag).mapped;
            for cycle in 0..2u32 {
                let seed = 7 + cycle;
                t.fill(seed);
                let pinned_awake = pinned_bytes();
                t.alloc.sleep(tag, SleepMode::Offload).unwrap();
                let st = t.alloc.tag_stats(tag);
                assert!(st.asleep && st.offloaded == bytes, "{opts:?}: {st:?}");
                let pinned_asleep = pinned_bytes();
                if *kind == BackupKind::Pinned {
                    assert!(pinned_asleep >= bytes, "{opts:?}: {pinned_asleep} pinned for {bytes}");
                } else {
                    assert!(pinned_asleep <= pinned_awake + RING, "{opts:?}: {pinned_asleep} pinned");
                }
                if matches!(kind, BackupKind::Disk(_)) {
                    assert_eq!(dir.files(), 1, "{opts:?}: one backup file while asleep");
                }
                t.alloc.wake(tag).unwrap();
                assert_eq!(t.mismatches(seed), 0, "{opts:?}: cycle {cycle} changed the contents");
                if matches!(kind, BackupKind::Disk(_)) {
                    assert!(
                        soon(|| dir.files() == usize::from(retain)),
                        "{opts:?}: {} files after wake",
                        dir.files()
                    );
                }
                if *kind == BackupKind::Pinned && !retain {
                    assert!(soon(|| pinned_bytes() < bytes), "{opts:?}: {} still pinned", pinned_bytes());
                }
            }
            drop(t);
            assert!(soon(|| dir.files() == 0), "a retained file goes with its allocator");
        }
    }
    // Awake, with nothing retained: at most the rings stay pinned.
    assert!(soon(|| pinned_bytes() <= 6 * RING), "{} pinned while awake", pinned_bytes());
}

/// A pageable backup's ring writes with either kind of store, switched between cycles of one
/// allocator, and every cycle restores the contents.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pageable_backup_restores_the_contents_with_either_host_copy() {
    use cuvmm::alloc::{backup_host_copy, set_backup_host_copy};
    use cuvmm::host::HostCopy;
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let tag = Tag::new("backup-host-copy").unwrap();
    let t = Tagged::new(&ctx, tag, 3);
    let was = backup_host_copy();
    for (cycle, copy) in [HostCopy::Plain, HostCopy::Streaming, HostCopy::Plain].into_iter().enumerate() {
        set_backup_host_copy(copy);
        let seed = 31 + cycle as u32;
        t.fill(seed);
        t.alloc.sleep(tag, SleepMode::Offload).unwrap();
        t.alloc.wake(tag).unwrap();
        assert_eq!(t.mismatches(seed), 0, "{copy}: cycle {cycle} changed the contents");
    }
    set_backup_host_copy(was);
}

/// Resident memory of this process (VmRSS), bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).unwrap();
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// Address ranges of this process's mappings with pages the kernel may take back at will
/// (`LazyFree` in /proc/self/smaps), and those bytes in all.
fn lazily_freed() -> (Vec<(usize, usize)>, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let (mut ranges, mut bytes, mut range) = (Vec::new(), 0, (0, 0));
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = head.split_once('-').filter(|_| !head.ends_with(':')) {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                range = (lo, hi - lo);
            }
        } else if let Some(kib) = line.strip_prefix("LazyFree:") {
            let kib: u64 = kib.trim().trim_end_matches("kB").trim().parse().unwrap();
            if kib > 0 {
                ranges.push(range);
                bytes += kib * 1024;
            }
        }
    }
    (ranges, bytes)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_released_pageable_backup_serves_the_next_sleeps_and_is_right_when_the_kernel_took_it() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let tag = Tag::new("lazily-released").unwrap();
    let t = Tagged::new(&ctx, tag, 4);
    let bytes = t.alloc.tag_stats(tag).mapped;
    for cycle in 0..3u32 {
        let seed = 21 + cycle;
        t.fill(seed);
        let before = rss();
        t.alloc.sleep(tag, SleepMode::Offload).unwrap();
        let grew = rss().saturating_sub(before);
        t.alloc.wake(tag).unwrap();
        assert_eq!(t.mismatches(seed), 0, "cycle {cycle} changed the contents");
        match cycle {
            0 => assert!(grew >= bytes / 2, "the first sleep faults its backup in: {grew} for {bytes}"),
            // The pages given back lazily at the last wake are still this process's; the sleep
            // writes into them rather than into new ones.
            1 => assert!(grew < bytes / 4, "cycle {cycle}: {grew} new resident bytes for {bytes}"),
            _ => {}
        }
        // The backup is given back lazily on a thread of its own.
        assert!(soon(|| lazily_freed().1 >= bytes / 2), "cycle {cycle}: {:?} lazily freed", lazily_freed());
        if cycle == 1 {
            // The kernel takes the backup back, as under memory pressure: the next sleep gets
            // zeroed pages in its place, and every byte must still come back.
            const MADV_PAGEOUT: libc::c_int = 21;
            for (addr, len) in lazily_freed().0 {
                // SAFETY: a mapping of this process the kernel may already drop at will: paging
                // it out changes no content that anything counts on.
                unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_PAGEOUT) };
            }
            assert!(lazily_freed().1 < bytes / 2, "reclaimed: {:?}", lazily_freed());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_disk_backup_that_cannot_be_made_fails_the_sleep_with_the_tag_awake_and_whole() {
    let ctx = Context::for_ordinal(0).expect("a CUDA device");
    let dir = Dir::new("gpu-sleep-backup-gone");
    let tag = Tag::new("backup-gone").unwrap();
    tag.set_backup(BackupOptions { kind: BackupKind::Disk(dir.0.clone()), retain: false }).unwrap();
    let t = Tagged::new(&ctx, tag, 2);
    t.fill(3);
    let mapped = t.alloc.tag_stats(tag).mapped;
    std::fs::remove_dir(&dir.0).unwrap();
    let e = t.alloc.sleep(tag, SleepMode::Offload).unwrap_err();
    assert!(matches!(e, cuvmm::Error::Os { .. }), "{e}");
    let st = t.alloc.tag_stats(tag);
    assert!(!st.asleep && st.mapped == mapped, "{st:?}");
    assert_eq!(t.mismatches(3), 0);
    // Pageable instead, and it sleeps and wakes.
    tag.set_backup(BackupOptions::default()).unwrap();
    t.alloc.sleep(tag, SleepMode::Offload).unwrap();
    t.alloc.wake(tag).unwrap();
    assert_eq!(t.mismatches(3), 0);
}

#[test]
#[ignore = "needs two CUDA GPUs"]
fn a_tag_on_two_devices_sleeps_and_wakes_on_both_at_once() {
    let Some(_) = common::two_gpus() else { return };
    let tag = Tag::new("two-devices").unwrap();
    let devs: Vec<Tagged> = (0..2).map(|d| Tagged::new(&Context::for_ordinal(d).unwrap(), tag, 4)).collect();
    for cycle in 0..2u32 {
        for (d, t) in devs.iter().enumerate() {
            t.fill(20 + cycle + d as u32);
        }
        std::thread::scope(|s| {
            for t in &devs {
                s.spawn(|| t.alloc.sleep(tag, SleepMode::Offload).unwrap());
            }
        });
        assert!(devs.iter().all(|t| t.alloc.tag_stats(tag).asleep && t.alloc.tag_stats(tag).mapped == 0));
        std::thread::scope(|s| {
            for t in &devs {
                s.spawn(|| t.alloc.wake(tag).unwrap());
            }
        });
        for (d, t) in devs.iter().enumerate() {
            assert_eq!(t.mismatches(20 + cycle + d as u32), 0, "device {d}, cycle {cycle}");
        }
    }
}
