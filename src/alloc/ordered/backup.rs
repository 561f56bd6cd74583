//! Where a sleeping tag's contents wait: pageable host memory reached through the staging ring
//! (the default), pinned host memory, or a file.
//!
//! A pinned backup as large as the tag costs a first sleep its pinning (page faults, zeroing and
//! locking of every page on the driver's side) and holds that memory locked for as long as it is
//! kept. A pageable backup is an anonymous mapping, huge pages advised, faulted in by most of the
//! cores ahead of the staging ring's drain (the faults, not the copies, bound such a sleep:
//! [`fresh_backup_memory`] measures them): the only pinned memory is the ring's. A disk
//! backup goes through the same ring and a bounce buffer into a file in a directory the user
//! names, for tags larger than host memory.
//!
//! After a wake the backup is released unless the tag's options say `retain`: a file is
//! removed, pinned memory unpinned and freed, and pageable memory given back lazily
//! (`MADV_FREE`, see the `lazy` module), so that the next sleep writes into whatever pages the
//! kernel has not needed meanwhile. A retained backup serves the next sleep without faulting or
//! pinning anything, whatever the kernel needs.

use super::Tag;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Where a tag's contents go when it sleeps with offload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BackupKind {
    /// Pageable host memory, moved through the staging ring (no memory pinned beyond the ring).
    #[default]
    Pageable,
    /// Pinned host memory as large as the tag, copied to and from by the copy engines directly.
    Pinned,
    /// A file in this directory, created at sleep and removed at wake (unless retained).
    Disk(PathBuf),
}

/// How a tag's offloading sleeps keep its contents: [`Tag::set_backup`](super::Tag::set_backup).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackupOptions {
    /// Where the contents go.
    pub kind: BackupKind,
    /// Keeps the backup (host memory, or the file) after a wake, for the next sleep: repeated
    /// cycles fault, pin or create nothing, at the cost of holding it while awake.
    pub retain: bool,
}

impl BackupOptions {
    /// Refuses a disk backup whose directory is not one.
    pub(crate) fn check(&self) -> Result<()> {
        if let BackupKind::Disk(dir) = &self.kind {
            if !dir.is_dir() {
                return Err(Error::invalid(format!("backup directory {} is not a directory", dir.display())));
            }
        }
        Ok(())
    }
}

static OPTIONS: Mutex<Option<HashMap<Tag, BackupOptions>>> = Mutex::new(None);

/// Sets the options of tag `tag` (its process-wide number) for its later sleeps on every allocator.
pub(crate) fn set_options(tag: Tag, options: BackupOptions) -> Result<()> {
    options.check()?;
    OPTIONS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(tag, options);
    Ok(())
}

/// The options of tag `tag`: the default when none were set.
pub(crate) fn options_of(tag: Tag) -> BackupOptions {
    let g = OPTIONS.lock().unwrap_or_else(|e| e.into_inner());
    g.as_ref().and_then(|m| m.get(&tag).cloned()).unwrap_or_default()
}

/// Pages below this are left to the kernel's own faults: one populate call per range.
const TOUCH_UNIT: usize = 2 << 20;

/// `madvise` advice that faults a range in writable without writing it (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Threads that fault a fresh pageable backup in ahead of the copies into it: three quarters of
/// the cores (at most 12), unless `CUVMM_BACKUP_TOUCH_THREADS` says otherwise (0 leaves the faults
/// to the copies). The kernel's zeroing of fresh pages bounds a first sleep, not the copies, so
/// most cores go to the faults (docs/DECISIONS.md, "The sleep's thread split").
fn touchers() -> usize {
    env_threads("CUVMM_BACKUP_TOUCH_THREADS").unwrap_or_else(|| (cores() * 3 / 4).clamp(1, 12))
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Of the staging ring's threads, those that drain a sleep's copies into host memory: half the
/// cores (at most 8), leaving the rest to the threads faulting the backup in; all of the ring's
/// when `CUVMM_BACKUP_COPY_THREADS` sets them. A wake fills the ring with all of them.
pub(crate) fn to_host_threads() -> usize {
    copy_threads_set().unwrap_or_else(|| (cores() / 2).clamp(1, 8))
}

/// The ring's threads `CUVMM_BACKUP_COPY_THREADS` sets, if it does (0 does not).
fn copy_threads_set() -> Option<usize> {
    env_threads("CUVMM_BACKUP_COPY_THREADS").filter(|&n| n > 0)
}

/// A wake's kernel lane ([`KernelLane`](crate::host::KernelLane)): the default, with its bias set
/// by `CUVMM_WAKE_KERNEL_BIAS` (0 turns the lane off) and its slowdown by
/// `CUVMM_WAKE_KERNEL_SLOWDOWN` (0 sends chunks through it whenever the copy engines are behind).
pub(crate) fn kernel_lane() -> Option<crate::host::KernelLane> {
    let mut lane = crate::host::KernelLane::default();
    match env_threads("CUVMM_WAKE_KERNEL_BIAS") {
        Some(0) => return None,
        Some(n) => lane.bias = n,
        None => {}
    }
    if let Some(x) =
        std::env::var("CUVMM_WAKE_KERNEL_SLOWDOWN").ok().and_then(|v| v.trim().parse::<f32>().ok())
    {
        lane.slowdown = x.max(0.0);
    }
    Some(lane)
}

/// A thread count from the environment: a tuning knob for hosts whose core count misleads.
pub(crate) fn env_threads(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse::<usize>().ok().filter(|&n| n <= 256)
}

/// The staging ring that moves staged backups: [`backup_ring`]'s shape, with
/// `CUVMM_BACKUP_COPY_THREADS` copying threads if set, writing as [`backup_host_copy`] says.
pub(crate) fn ring_config() -> crate::host::StagingConfig {
    let env = |name| std::env::var(name).ok();
    let mut config = backup_ring(env("CUVMM_BACKUP_CHUNK_KIB"), env("CUVMM_BACKUP_SLOTS"));
    if let Some(n) = copy_threads_set() {
        config.threads = n;
    }
    config.host_copy = backup_host_copy();
    config
}

/// Bytes per chunk of a backup's staging ring unless `CUVMM_BACKUP_CHUNK_KIB` says otherwise.
const BACKUP_CHUNK: usize = 16 << 20;
/// Pinned slots of a backup's staging ring unless `CUVMM_BACKUP_SLOTS` says otherwise.
const BACKUP_SLOTS: usize = 4;

/// The shape of a backup's ring: [`BACKUP_SLOTS`] chunks of [`BACKUP_CHUNK`] (64 MiB pinned)
/// unless the two values (chunk KiB, at least 64; slots, 2 to 256) say otherwise; anything else
/// keeps the default. A sleep moves tens of GiB through it, one chunk per DMA: chunks this large
/// keep every cycle near the pinned copy's speed, alone or with other processes sleeping at once,
/// where the general ring's smaller ones let whole sleeps halve from one cycle to the next
/// (docs/DECISIONS.md, "The backup ring's shape").
fn backup_ring(chunk_kib: Option<String>, slots: Option<String>) -> crate::host::StagingConfig {
    let mut config = crate::host::StagingConfig::default();
    let chunk_kib =
        chunk_kib.and_then(|v| v.trim().parse::<usize>().ok()).filter(|k| (64..=1 << 20).contains(k));
    config.chunk = chunk_kib.map_or(BACKUP_CHUNK, |k| k << 10);
    config.piece = config.piece.min(config.chunk);
    let slots = slots.and_then(|v| v.trim().parse::<usize>().ok()).filter(|n| (2..=256).contains(n));
    config.slots = slots.unwrap_or(BACKUP_SLOTS);
    config
}

/// [`backup_host_copy`]'s value, [`HOST_COPY_UNSET`] until the first call or a
/// [`set_backup_host_copy`].
static HOST_COPY: AtomicU8 = AtomicU8::new(HOST_COPY_UNSET);
const HOST_COPY_UNSET: u8 = u8::MAX;

/// Sets how the staging rings that move pageable and disk backups write
/// ([`HostCopy`](crate::host::HostCopy)), for every sleep and wake of this process from now on,
/// on every allocator: `cuvmm bench sleep --host-copy both` compares the two, taking turns.
pub fn set_backup_host_copy(copy: crate::host::HostCopy) {
    HOST_COPY.store(copy as u8, Ordering::Relaxed);
}

/// How the staging rings that move backups write: what [`set_backup_host_copy`] set last, else
/// what `CUVMM_HOST_COPY` says (`plain` or `streaming`), else the ring's default.
pub fn backup_host_copy() -> crate::host::HostCopy {
    use crate::host::HostCopy;
    let known = HostCopy::ALL.into_iter().find(|&c| c as u8 == HOST_COPY.load(Ordering::Relaxed));
    known.unwrap_or_else(|| {
        let copy = std::env::var("CUVMM_HOST_COPY").ok().and_then(|v| v.parse().ok()).unwrap_or_default();
        // A set that raced this read wins: it is the caller's word.
        let _ = HOST_COPY.compare_exchange(HOST_COPY_UNSET, copy as u8, Ordering::Relaxed, Ordering::Relaxed);
        copy
    })
}

/// An anonymous private mapping of host memory, unmapped when dropped.
pub(crate) struct HostMap {
    /// The first byte, on a huge-page boundary.
    pub(super) base: usize,
    len: usize,
    /// The whole mapping (address, length), a huge page longer so that `base` can be aligned.
    mapping: (usize, usize),
    stop: Arc<AtomicBool>,
    touch: Vec<JoinHandle<()>>,
    /// Huge-page units the threads faulted in.
    touched: Arc<AtomicUsize>,
}

impl HostMap {
    /// `len` bytes (rounded up to whole huge pages), huge pages advised; with `touchers` > 0,
    /// that many threads fault it in, in address order, in the background, without writing it.
    pub(crate) fn new(len: usize, touchers: usize) -> Result<HostMap> {
        if len == 0 {
            return Err(Error::invalid("a host backup needs at least one byte"));
        }
        let too_large = || Error::invalid("host backup too large");
        let len = len.checked_next_multiple_of(TOUCH_UNIT).ok_or_else(too_large)?;
        let map_len = len.checked_add(TOUCH_UNIT).ok_or_else(too_large)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let mapped = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(Error::Os { call: "mmap (host backup)", errno: nix::errno::Errno::last() });
        }
        // Huge pages only back whole aligned huge pages of a mapping.
        let base = (mapped as usize).next_multiple_of(TOUCH_UNIT);
        // SAFETY: [base, base + len) lies inside the mapping just made; the advice changes how the
        // kernel backs it and failing (no transparent huge pages) leaves ordinary pages.
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        let mut map = HostMap {
            base,
            len,
            mapping: (mapped as usize, map_len),
            stop: Arc::new(AtomicBool::new(false)),
            touch: Vec::new(),
            touched: Arc::new(AtomicUsize::new(0)),
        };
        map.start_touching(touchers);
        Ok(map)
    }

    /// Starts `touchers` threads faulting the map in, in address order, in the background,
    /// without writing it: pages already there cost them a walk of the page tables, pages the
    /// kernel took back (see [`free_lazily`](Self::free_lazily)) come back zeroed, ahead of the
    /// copies that fill them.
    fn start_touching(&mut self, touchers: usize) {
        self.stop_touching();
        self.stop.store(false, Ordering::Relaxed);
        self.touched.store(0, Ordering::Relaxed);
        let next = Arc::new(AtomicUsize::new(0));
        let len = self.len;
        for _ in 0..touchers {
            let (next, stop, base) = (Arc::clone(&next), Arc::clone(&self.stop), self.base);
            let touched = Arc::clone(&self.touched);
            let spawned = std::thread::Builder::new().name("cuvmm-backup-touch".into()).spawn(move || {
                let units = len / TOUCH_UNIT;
                while !stop.load(Ordering::Relaxed) {
                    let u = next.fetch_add(1, Ordering::Relaxed);
                    if u >= units {
                        return;
                    }
                    // SAFETY: inside the mapping, which outlives this thread (joined before the
                    // unmap). Populating writes no byte, so copies into the same pages meanwhile
                    // lose nothing.
                    let r = unsafe {
                        libc::madvise(
                            (base + u * TOUCH_UNIT) as *mut libc::c_void,
                            TOUCH_UNIT,
                            MADV_POPULATE_WRITE,
                        )
                    };
                    if r != 0 {
                        // An older kernel: the copies fault the pages in themselves.
                        return;
                    }
                    touched.fetch_add(1, Ordering::Relaxed);
                }
            });
            // Without a thread the copies fault the pages in themselves.
            if let Ok(t) = spawned {
                self.touch.push(t);
            }
        }
    }

    /// Gives the pages back the way the kernel takes them only when it needs the memory
    /// (`MADV_FREE`): until then they stay in place, and a later write keeps them, without a
    /// fault or the kernel zeroing them again. A page the kernel did take reads back as zero, so
    /// whatever is written next must not count on the bytes that were there: a sleep writes
    /// every byte a wake reads. Kernels without `MADV_FREE` (before 4.5) drop the pages at once
    /// (`MADV_DONTNEED`). Whether the pages were left lazily.
    pub(crate) fn free_lazily(&mut self) -> bool {
        self.stop_touching();
        // SAFETY: the map's own range; its threads are joined and no copy runs into it (the
        // allocator gives a backup back only after its copies finished). The advice frees pages
        // and nothing that follows counts on their contents.
        let r = unsafe { libc::madvise(self.ptr().cast(), self.len, libc::MADV_FREE) };
        if r == 0 {
            return true;
        }
        // SAFETY: as above.
        unsafe { libc::madvise(self.ptr().cast(), self.len, libc::MADV_DONTNEED) };
        false
    }

    /// A lazily freed map taken up again for a sleep: faulted in by the backup's threads
    /// whatever the kernel took back meanwhile.
    pub(crate) fn reuse(&mut self) {
        self.start_touching(touchers());
    }

    /// A fresh backup of `len` bytes, faulted in by the backup's threads; refused with `ENOMEM`
    /// when the host has not that much memory available, before anything is mapped: the faults
    /// would otherwise wake the kernel's out-of-memory killer in the middle of a sleep.
    pub(crate) fn fresh(len: usize) -> Result<HostMap> {
        if let Some(avail) = available_host_memory() {
            if len as u64 > avail {
                return Err(Error::Os { call: "mmap (host backup)", errno: nix::errno::Errno::ENOMEM });
            }
        }
        HostMap::new(len, touchers())
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }

    /// Stops the threads faulting it in and waits for them.
    pub(crate) fn stop_touching(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.join_touching();
    }

    /// Waits for the threads faulting it in.
    fn join_touching(&mut self) {
        for t in self.touch.drain(..) {
            let _ = t.join();
        }
    }

    /// Waits for the threads faulting it in to finish, then faults in on this thread whatever they
    /// left (a kernel without `MADV_POPULATE_WRITE`) by writing a zero to each small page: only
    /// for a map nothing has written yet.
    pub(crate) fn finish_touching(&mut self) {
        self.join_touching();
        if self.touched.load(Ordering::Relaxed) * TOUCH_UNIT < self.len {
            for off in (0..self.len).step_by(4096) {
                // SAFETY: inside the mapping, which nothing else uses (the threads are joined);
                // the bytes are fresh anonymous memory, zero already.
                unsafe { (self.ptr().add(off)).write_volatile(0) };
            }
        }
    }

    /// The bytes `[off, off + len)`, readable and writable, as a raw slice: whoever makes a
    /// reference of it must be the range's only user meanwhile.
    pub(crate) fn range(&self, off: usize, len: usize) -> Result<*mut [u8]> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => {
                Ok(std::ptr::slice_from_raw_parts_mut(self.ptr().wrapping_add(off), len))
            }
            _ => Err(Error::invalid("range past the end of the host backup")),
        }
    }
}

impl Drop for HostMap {
    fn drop(&mut self) {
        self.stop_touching();
        // SAFETY: the mapping made in `new`; nothing refers to it any more (no slice outlives a
        // borrow of the map and the touching threads are joined).
        unsafe { libc::munmap(self.mapping.0 as *mut libc::c_void, self.mapping.1) };
    }
}

// SAFETY: the mapping is plain memory owned by the map; accesses through `range` are
// serialised by its callers (one job of the mover at a time).
unsafe impl Send for HostMap {}
// SAFETY: as above; `&HostMap` gives out memory only as raw pointers (`range`).
unsafe impl Sync for HostMap {}

/// How long this host takes to provide `bytes` of fresh host memory at best: one anonymous
/// mapping, huge pages advised, each core writing a byte to every page of a contiguous slice of
/// its own. A sleep into a fresh pageable backup (the first of a process, or one after the kernel
/// took a lazily released backup back) cannot take less, so `cuvmm bench sleep` reports it
/// beside the copy bounds. The memory is given back before this returns.
///
/// A sleep's own fault-in differs in two ways that cost it: its threads share the cores with the
/// staging ring's, and they take 2 MiB units in address order from one counter, so that the
/// copies, which go in that order, find their pages ready; neighbouring units then share the
/// page-table pages and their locks, where a slice per core shares nothing.
///
/// # Errors
/// [`Error::Os`] with `ENOMEM` when the host has less memory available than `bytes` (nothing is
/// mapped then), or when the mapping fails; [`Error::InvalidArgument`] for no bytes.
///
/// ```no_run
/// # fn main() -> cuvmm::Result<()> {
/// let t = cuvmm::alloc::fresh_backup_memory(16 << 30)?;
/// println!("16 GiB of fresh host memory: {t:?}");
/// # Ok(()) }
/// ```
pub fn fresh_backup_memory(bytes: usize) -> Result<std::time::Duration> {
    let t = std::time::Instant::now();
    if let Some(avail) = available_host_memory() {
        if bytes as u64 > avail {
            return Err(Error::Os { call: "mmap (host backup)", errno: nix::errno::Errno::ENOMEM });
        }
    }
    let map = HostMap::new(bytes, 0)?;
    let threads = cores().min(map.len() / TOUCH_UNIT).max(1);
    let slice = (map.len() / TOUCH_UNIT).div_ceil(threads) * TOUCH_UNIT;
    std::thread::scope(|s| {
        for k in 0..threads {
            let (from, to) = ((k * slice).min(map.len()), ((k + 1) * slice).min(map.len()));
            let base = map.base;
            s.spawn(move || {
                for off in (from..to).step_by(4096) {
                    // SAFETY: inside the map, which outlives the scope; each thread writes its
                    // own slice, and the bytes are fresh anonymous memory, zero already.
                    unsafe { ((base + off) as *mut u8).write_volatile(0) };
                }
            });
        }
    });
    Ok(t.elapsed())
}

/// Bytes of host memory this process may still use: the host's `MemAvailable` within the limits
/// of its memory cgroups (see [`host_memory`](super::host_memory)), if the kernel says.
pub(crate) fn available_host_memory() -> Option<u64> {
    super::host_memory::available()
}

static SPILLS: AtomicU64 = AtomicU64::new(0);

/// A file a backup spills into, removed when dropped.
pub(crate) struct SpillFile {
    file: File,
    path: PathBuf,
    len: u64,
    direct: bool,
}

impl SpillFile {
    /// A new file of `len` bytes in `dir`, space allocated up front, so that a full disk is found
    /// before any copy. Written with `O_DIRECT` where the file system accepts it (the contents
    /// then occupy no page cache, which the host may not have room for).
    pub(crate) fn create(dir: &Path, len: u64) -> Result<SpillFile> {
        let n = SPILLS.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("cuvmm-backup-{}-{n}.bin", std::process::id()));
        let open = |direct: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                .open(&path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(false).map_err(|e| os("open (disk backup)", &e))?, false)
            }
            Err(e) => return Err(os("open (disk backup)", &e)),
        };
        let spill = SpillFile { file, path, len, direct };
        spill.allocate()?;
        Ok(spill)
    }

    /// A backup over an open file (tests: `/dev/full`); `path` is removed when dropped.
    #[cfg(test)]
    pub(crate) fn from_file(file: File, path: PathBuf, len: u64) -> SpillFile {
        SpillFile { file, path, len, direct: false }
    }

    fn allocate(&self) -> Result<()> {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(self.len).map_err(|_| Error::invalid("disk backup too large"))?;
        // SAFETY: a plain call on a descriptor this file owns.
        let r = unsafe { libc::posix_fallocate(self.file.as_raw_fd(), 0, len) };
        match r {
            0 => Ok(()),
            // File systems without it: the writes find a full disk instead.
            libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
            e => Err(Error::Os {
                call: "posix_fallocate (disk backup)",
                errno: nix::errno::Errno::from_raw(e),
            }),
        }
    }

    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Writes `buf` at `off`.
    pub(crate) fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        self.file.write_all_at(buf, off).map_err(|e| os("write (disk backup)", &e))
    }

    /// Fills `buf` from `off`.
    pub(crate) fn read_at(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.file.read_exact_at(buf, off).map_err(|e| os("read (disk backup)", &e))
    }

    /// Makes what was written durable, and (without `O_DIRECT`) drops it from the page cache.
    pub(crate) fn flush(&self) -> Result<()> {
        if self.direct {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        self.file.sync_data().map_err(|e| os("fdatasync (disk backup)", &e))?;
        // SAFETY: a plain call on a descriptor this file owns; the advice only drops clean cache.
        unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        Ok(())
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn os(call: &'static str, e: &std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(n) => Error::Os { call, errno: nix::errno::Errno::from_raw(n) },
        None => Error::invalid(format!("{call}: {e}")),
    }
}

/// Where a staged backup's bytes are.
#[derive(Clone)]
pub(crate) enum Store {
    Memory(Arc<HostMap>),
    File(Arc<SpillFile>),
}

impl Store {
    pub(crate) fn len(&self) -> u64 {
        match self {
            Store::Memory(m) => m.len() as u64,
            Store::File(f) => f.len(),
        }
    }

    fn same(&self, other: &Store) -> bool {
        match (self, other) {
            (Store::Memory(a), Store::Memory(b)) => Arc::ptr_eq(a, b),
            (Store::File(a), Store::File(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// Moves bytes between device addresses and host memory, returning once they have arrived.
pub(crate) trait Copier: Send + 'static {
    fn to_host(&mut self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn to_device(&mut self, src: &[u8], dst: u64) -> Result<()>;
}

/// One copy between the device and a staged backup.
struct Job {
    out: bool,
    dev: u64,
    off: u64,
    len: u64,
    store: Store,
}

impl Job {
    /// Whether `next` continues this job on both sides.
    fn extends(&self, next: &Job) -> bool {
        self.out == next.out
            && self.dev + self.len == next.dev
            && self.off + self.len == next.off
            && self.store.same(&next.store)
    }
}

enum Msg {
    Job(Job),
    /// Replies with the first failure since the last `Finish`.
    Finish,
    /// Replies (on its own channel) with the mark and whether every copy since the last
    /// `Finish` succeeded so far.
    Mark(u64),
}

/// Bytes of the bounce buffer between the staging ring and a file.
const BOUNCE: usize = 64 << 20;

/// A thread that runs staged copies in the order queued, so that the allocator's thread maps the
/// next pages of a wake meanwhile. Copies queued while it is busy, adjacent on the device and in
/// the backup, run as one transfer: the ring's start and end cost each transfer the same.
pub(crate) struct Mover {
    tx: Option<Sender<Msg>>,
    done: Receiver<Result<()>>,
    marks: Receiver<(u64, bool)>,
    thread: Option<JoinHandle<()>>,
}

impl Mover {
    pub(crate) fn new(copier: impl Copier) -> Result<Mover> {
        let (tx, rx) = channel::<Msg>();
        let (done_tx, done) = channel();
        let (marks_tx, marks) = channel();
        let thread = std::thread::Builder::new()
            .name("cuvmm-backup".into())
            .spawn(move || run(copier, rx, done_tx, marks_tx))
            .map_err(|e| Error::invalid(format!("cannot start the backup thread: {e}")))?;
        Ok(Mover { tx: Some(tx), done, marks, thread: Some(thread) })
    }

    fn send(&self, m: Msg) -> Result<()> {
        self.tx
            .as_ref()
            .and_then(|t| t.send(m).ok())
            .ok_or_else(|| Error::invalid("the backup thread has stopped"))
    }

    /// Queues a copy of `len` bytes at `dev` to `store` at `off` (`out`), or back.
    pub(crate) fn queue(&self, out: bool, dev: u64, store: &Store, off: u64, len: u64) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= store.len() => {}
            _ => return Err(Error::invalid("copy past the end of the backup")),
        }
        self.send(Msg::Job(Job { out, dev, off, len, store: store.clone() }))
    }

    /// Marks the copies queued so far as `mark` (larger than every earlier one), for
    /// [`reached`](Self::reached). Copies queued after it never run as one transfer with those
    /// before.
    pub(crate) fn mark(&self, mark: u64) -> Result<()> {
        self.send(Msg::Mark(mark))
    }

    /// Waits for the copies queued before `mark`: whether every copy since the last
    /// [`finish`](Self::finish) has succeeded so far.
    pub(crate) fn reached(&self, mark: u64) -> Result<bool> {
        loop {
            // (Marks nobody waited for come first: passed over.)
            match self.marks.recv() {
                Ok((m, ok)) if m >= mark => return Ok(ok),
                Ok(_) => {}
                Err(_) => return Err(Error::invalid("the backup thread has stopped")),
            }
        }
    }

    /// Waits for every copy queued so far: the first failure among them, if any.
    pub(crate) fn finish(&self) -> Result<()> {
        self.send(Msg::Finish)?;
        self.done.recv().unwrap_or_else(|_| Err(Error::invalid("the backup thread has stopped")))
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut copier: impl Copier, rx: Receiver<Msg>, done: Sender<Result<()>>, marks: Sender<(u64, bool)>) {
    let mut failed: Option<Error> = None;
    let mut bounce: Option<HostMap> = None;
    let mut held: Option<Msg> = None;
    loop {
        let msg = match held.take() {
            Some(m) => m,
            None => match rx.recv() {
                Ok(m) => m,
                Err(_) => return,
            },
        };
        let mut job = match msg {
            Msg::Finish => {
                let _ = done.send(failed.take().map_or(Ok(()), Err));
                continue;
            }
            Msg::Mark(m) => {
                let _ = marks.send((m, failed.is_none()));
                continue;
            }
            Msg::Job(j) => j,
        };
        while let Ok(m) = rx.try_recv() {
            match m {
                Msg::Job(next) if job.extends(&next) => job.len += next.len,
                other => {
                    held = Some(other);
                    break;
                }
            }
        }
        if failed.is_none() {
            if let Err(e) = copy(&mut copier, &job, &mut bounce) {
                failed = Some(e);
            }
        }
    }
}

fn copy(copier: &mut impl Copier, job: &Job, bounce: &mut Option<HostMap>) -> Result<()> {
    let len = usize::try_from(job.len).map_err(|_| Error::invalid("copy too large"))?;
    match &job.store {
        Store::Memory(m) => {
            // SAFETY: inside the map (checked when queued); the allocator neither reads nor
            // frees the backup before `finish`, and jobs run one at a time.
            let host = unsafe { &mut *m.range(job.off as usize, len)? };
            if job.out {
                copier.to_host(job.dev, host)
            } else {
                copier.to_device(host, job.dev)
            }
        }
        Store::File(f) => {
            let b = match bounce {
                Some(b) => b,
                None => bounce.insert(HostMap::new(BOUNCE, 0)?),
            };
            let mut at = 0;
            while at < len {
                let n = BOUNCE.min(len - at);
                // SAFETY: the bounce buffer is this thread's alone.
                let buf = unsafe { &mut *b.range(0, n)? };
                if job.out {
                    copier.to_host(job.dev + at as u64, buf)?;
                    f.write_at(buf, job.off + at as u64)?;
                } else {
                    f.read_at(buf, job.off + at as u64)?;
                    copier.to_device(buf, job.dev + at as u64)?;
                }
                at += n;
            }
            if job.out {
                f.flush()?;
            }
            Ok(())
        }
    }
}

/// A staged backup of a sleeping tag, with its options.
pub(crate) struct Staged {
    pub(crate) store: Store,
    pub(crate) options: BackupOptions,
}

impl Staged {
    /// A fresh store for `bytes` under `options` (not [`BackupKind::Pinned`]).
    pub(crate) fn new(bytes: u64, options: BackupOptions) -> Result<Staged> {
        let store = match &options.kind {
            BackupKind::Disk(dir) => Store::File(Arc::new(SpillFile::create(dir, bytes)?)),
            _ => {
                let len = usize::try_from(bytes).map_err(|_| Error::invalid("host backup too large"))?;
                Store::Memory(Arc::new(HostMap::fresh(len)?))
            }
        };
        Ok(Staged { store, options })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backup_ring_is_four_16_mib_slots_unless_the_environment_names_a_valid_shape() {
        let shape = |c: Option<&str>, s: Option<&str>| {
            let r = backup_ring(c.map(str::to_owned), s.map(str::to_owned));
            (r.chunk, r.piece, r.slots)
        };
        let general = crate::host::StagingConfig::default();
        assert_eq!(shape(None, None), (16 << 20, general.piece, 4));
        assert_eq!(shape(Some(" 8192 "), Some("8")), (8 << 20, general.piece, 8));
        assert_eq!(shape(Some("64"), Some("2")), (64 << 10, 64 << 10, 2));
        for (c, s) in [("32", "1"), ("lots", "257"), ("", "-3"), ("2097152", "x")] {
            assert_eq!(shape(Some(c), Some(s)), (16 << 20, general.piece, 4), "{c:?} {s:?}");
        }
    }

    /// Device memory as a host vector at address `BASE`; fails the copy after `fail_after` bytes
    /// moved, if set.
    struct FakeDevice {
        mem: Arc<Mutex<Vec<u8>>>,
        fail_after: Option<usize>,
        moved: usize,
        transfers: Arc<AtomicUsize>,
        /// Held by a test to stop every copy until it lets go.
        hold: Arc<Mutex<()>>,
    }

    const BASE: u64 = 1 << 40;

    impl FakeDevice {
        fn step(&mut self, n: usize) -> Result<()> {
            drop(self.hold.lock().unwrap());
            self.transfers.fetch_add(1, Ordering::Relaxed);
            self.moved += n;
            match self.fail_after {
                Some(k) if self.moved > k => Err(Error::invalid("injected copy failure")),
                _ => Ok(()),
            }
        }
    }

    impl Copier for FakeDevice {
        fn to_host(&mut self, src: u64, dst: &mut [u8]) -> Result<()> {
            self.step(dst.len())?;
            let at = (src - BASE) as usize;
            dst.copy_from_slice(&self.mem.lock().unwrap()[at..at + dst.len()]);
            Ok(())
        }
        fn to_device(&mut self, src: &[u8], dst: u64) -> Result<()> {
            self.step(src.len())?;
            let at = (dst - BASE) as usize;
            self.mem.lock().unwrap()[at..at + src.len()].copy_from_slice(src);
            Ok(())
        }
    }

    type Fake = (Mover, Arc<Mutex<Vec<u8>>>, Arc<AtomicUsize>, Arc<Mutex<()>>);

    fn device(len: usize, fail_after: Option<usize>) -> Fake {
        let mem: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let mem = Arc::new(Mutex::new(mem));
        let transfers = Arc::new(AtomicUsize::new(0));
        let hold = Arc::new(Mutex::new(()));
        let d = FakeDevice {
            mem: Arc::clone(&mem),
            fail_after,
            moved: 0,
            transfers: Arc::clone(&transfers),
            hold: Arc::clone(&hold),
        };
        (Mover::new(d).unwrap(), mem, transfers, hold)
    }

    /// A directory of its own under the system's temporary directory, removed when dropped.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(name: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!("cuvmm-backup-test-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn files(&self) -> usize {
            std::fs::read_dir(&self.0).unwrap().count()
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Out to the backup in pieces, the device overwritten, back in other pieces: every byte
    /// returns, for a host backup and a file.
    fn round_trip(options: BackupOptions) {
        let len = 3 * BOUNCE / 2 + 8192;
        let (mover, mem, transfers, _) = device(len, None);
        let before = mem.lock().unwrap().clone();
        let staged = Staged::new(len as u64, options).unwrap();
        assert!(staged.store.len() >= len as u64);
        // Queued as the allocator does, in adjacent runs: they may merge.
        let runs =
            [(0u64, 4096u64), (4096, BOUNCE as u64), (BOUNCE as u64 + 4096, (len - BOUNCE - 4096) as u64)];
        for &(off, n) in &runs {
            mover.queue(true, BASE + off, &staged.store, off, n).unwrap();
        }
        mover.finish().unwrap();
        assert!(transfers.load(Ordering::Relaxed) >= 1);
        mem.lock().unwrap().fill(0);
        for &(off, n) in runs.iter().rev() {
            mover.queue(false, BASE + off, &staged.store, off, n).unwrap();
        }
        mover.finish().unwrap();
        assert!(*mem.lock().unwrap() == before, "the contents did not come back");
    }

    /// Pages of `map` the kernel reports resident.
    fn resident(map: &HostMap) -> usize {
        let pages = map.len() / 4096;
        let mut v = vec![0u8; pages];
        // SAFETY: the range is the map's, page aligned; `v` has a byte per page.
        let r = unsafe { libc::mincore(map.ptr().cast(), map.len(), v.as_mut_ptr()) };
        assert_eq!(r, 0);
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn the_backups_host_copy_is_what_was_set_last_and_the_ring_takes_it() {
        use crate::host::HostCopy;
        // Other tests of this process may sleep meanwhile: either kind of store is correct for
        // them, and this test ends on the default.
        for copy in [HostCopy::Plain, HostCopy::Streaming, HostCopy::Plain, HostCopy::default()] {
            set_backup_host_copy(copy);
            assert_eq!(backup_host_copy(), copy);
            assert_eq!(ring_config().host_copy, copy);
        }
    }

    #[test]
    fn fresh_memory_is_faulted_in_whole_with_or_without_threads() {
        for threads in [0, 3] {
            let mut m = HostMap::new(6 << 20, threads).unwrap();
            m.finish_touching();
            assert_eq!(resident(&m), m.len() / 4096, "{threads} threads");
        }
        let t = fresh_backup_memory(8 << 20).unwrap();
        assert!(t > std::time::Duration::ZERO);
        assert!(fresh_backup_memory(0).is_err(), "no byte asked for is refused, as a backup of none is");
        // More than the host has: refused before anything is mapped or faulted.
        let too_much = available_host_memory().unwrap() as usize + (1 << 30);
        let e = fresh_backup_memory(too_much).unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::Os(nix::errno::Errno::ENOMEM), "{e}");
        let e = Staged::new(too_much as u64, BackupOptions::default()).err().expect("refused");
        assert_eq!(e.kind(), crate::error::ErrorKind::Os(nix::errno::Errno::ENOMEM), "{e}");
    }

    #[test]
    fn a_host_backup_brings_every_byte_back() {
        round_trip(BackupOptions::default());
    }

    #[test]
    fn a_disk_backup_brings_every_byte_back_and_its_file_goes_with_it() {
        let dir = TempDir::new("roundtrip");
        round_trip(BackupOptions { kind: BackupKind::Disk(dir.0.clone()), retain: false });
        assert_eq!(dir.files(), 0, "the backup's file is removed when the backup is");
    }

    #[test]
    fn adjacent_copies_queued_together_run_as_one_transfer() {
        let (mover, _mem, transfers, hold) = device(1 << 20, None);
        let staged = Staged::new(1 << 20, BackupOptions::default()).unwrap();
        // Held up by a first job, the rest pile up and merge.
        let held = hold.lock().unwrap();
        for k in 0..16u64 {
            mover.queue(true, BASE + k * 65536, &staged.store, k * 65536, 65536).unwrap();
        }
        drop(held);
        mover.finish().unwrap();
        let n = transfers.load(Ordering::Relaxed);
        assert!(n <= 2, "{n} transfers for 16 adjacent copies queued while the first ran");
        // Not adjacent in the backup: never merged.
        transfers.store(0, Ordering::Relaxed);
        for k in 0..4u64 {
            mover.queue(true, BASE + k * 65536, &staged.store, (3 - k) * 65536, 65536).unwrap();
        }
        mover.finish().unwrap();
        assert_eq!(transfers.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_mark_is_reached_once_the_copies_before_it_land_and_splits_what_would_merge() {
        let (mover, mem, transfers, hold) = device(1 << 20, None);
        let staged = Staged::new(1 << 20, BackupOptions::default()).unwrap();
        let held = hold.lock().unwrap();
        for k in 0..8u64 {
            mover.queue(true, BASE + k * 65536, &staged.store, k * 65536, 65536).unwrap();
            if k == 3 {
                mover.mark(7).unwrap();
            }
        }
        mover.mark(8).unwrap();
        drop(held);
        assert!(mover.reached(7).unwrap());
        // Landed: the backup holds the first four copies' bytes.
        let Store::Memory(m) = &staged.store else { panic!("a memory backup") };
        // SAFETY: the mover wrote this range before the mark and touches it no more.
        let got = unsafe { &*m.range(0, 4 * 65536).unwrap() }.to_vec();
        assert!(got == mem.lock().unwrap()[..4 * 65536], "the copies before the mark landed");
        assert!(mover.reached(8).unwrap());
        mover.finish().unwrap();
        let n = transfers.load(Ordering::Relaxed);
        assert!((2..=3).contains(&n), "{n} transfers: the mark splits the adjacent copies in two");
        // A failure before a mark: reached, not successful; finish reports it.
        let (mover, _mem, _, _) = device(1 << 20, Some(4096));
        mover.queue(true, BASE, &staged.store, 0, 8192).unwrap();
        mover.mark(1).unwrap();
        assert!(!mover.reached(1).unwrap());
        assert!(mover.finish().is_err());
        // A mark nobody waited for is passed over by the next wait.
        mover.mark(2).unwrap();
        mover.mark(3).unwrap();
        assert!(mover.reached(3).unwrap());
    }

    #[test]
    fn a_failed_copy_is_reported_by_the_next_finish_and_the_one_after_starts_clean() {
        let (mover, _mem, _, _) = device(1 << 20, Some(4096));
        let staged = Staged::new(1 << 20, BackupOptions::default()).unwrap();
        mover.queue(true, BASE, &staged.store, 0, 4096).unwrap();
        mover.queue(true, BASE + 8192, &staged.store, 0, 4096).unwrap();
        let e = mover.finish().unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        // Later copies fail in the fake too, but a finish with nothing queued is clean.
        mover.finish().unwrap();
        let end = staged.store.len();
        let e = mover.queue(true, BASE, &staged.store, end - 4096, 8192).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
    }

    #[test]
    fn a_full_disk_is_an_os_error_not_a_panic() {
        let full = std::fs::OpenOptions::new().read(true).write(true).open("/dev/full").unwrap();
        let dir = TempDir::new("full");
        let keep = dir.0.join("stand-in");
        std::fs::write(&keep, b"").unwrap();
        let spill = SpillFile::from_file(full, keep.clone(), 1 << 20);
        let (mover, _mem, _, _) = device(1 << 20, None);
        let store = Store::File(Arc::new(spill));
        mover.queue(true, BASE, &store, 0, 1 << 20).unwrap();
        let e = mover.finish().unwrap_err();
        assert!(matches!(e, Error::Os { errno: nix::errno::Errno::ENOSPC, .. }), "{e}");
        drop(store);
        assert!(!keep.exists(), "the file is removed with the backup");
    }

    #[test]
    fn a_missing_or_unusable_directory_is_refused_with_a_typed_error() {
        let dir = TempDir::new("refused");
        let missing = dir.0.join("missing");
        let e = Staged::new(4096, BackupOptions { kind: BackupKind::Disk(missing.clone()), retain: false })
            .err()
            .expect("no such directory");
        assert!(matches!(e, Error::Os { errno: nix::errno::Errno::ENOENT, .. }), "{e}");
        assert!(BackupOptions { kind: BackupKind::Disk(missing), retain: false }.check().is_err());
        let file = dir.0.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let e = Staged::new(4096, BackupOptions { kind: BackupKind::Disk(file.clone()), retain: false })
            .err()
            .expect("a file is no directory");
        assert!(matches!(e, Error::Os { errno: nix::errno::Errno::ENOTDIR, .. }), "{e}");
        assert!(BackupOptions { kind: BackupKind::Disk(file), retain: false }.check().is_err());
        assert_eq!(dir.files(), 1, "nothing left behind but the test's own file");
    }

    #[test]
    fn a_host_map_is_faulted_in_without_changing_what_was_written() {
        let len = 64 << 20;
        let m = HostMap::new(len, 4).unwrap();
        // Written while the threads populate the same pages.
        for off in (0..len).step_by(4096) {
            // SAFETY: inside the map; nothing else reads or writes these bytes.
            unsafe { (*m.range(off, 1).unwrap())[0] = (off / 4096) as u8 | 1 };
        }
        let mut m = m;
        m.stop_touching();
        for off in (0..len).step_by(4096) {
            // SAFETY: as above.
            assert_eq!(unsafe { (*m.range(off, 1).unwrap())[0] }, (off / 4096) as u8 | 1);
        }
    }
}
