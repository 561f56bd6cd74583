//! `libcuvmm.so`: cuvmm's [`StreamAllocator`] behind the C ABI declared in `include/cuvmm.h`.
//!
//! Every exported function catches panics (nothing unwinds into C), turns errors into a NULL or
//! -1 return, keeps the text for [`cuvmm_last_error`] and writes each kind of error to stderr once
//! (or, after [`cuvmm_set_error_log`], only the errors that no return value reports).
//! One allocator per device, created at its first use with the configuration of
//! `CUVMM_ALLOC_CONF` (see [`config`]).

#![deny(unsafe_op_in_unsafe_fn)]

mod config;
mod failure;
#[cfg(test)]
#[path = "../../tests/common/fake.rs"]
mod fake;
mod handoff;
mod hooks;
mod memory_history;
#[cfg(test)]
#[path = "pair_tests.rs"]
mod pair_tests;
mod ready;
mod trace;

use config::Config;
use cuvmm_lib::alloc::{
    AllocatorConfig, AllocatorStats, BackupKind, BackupOptions, BlockRange, BlockShare, DevicePtr,
    GraphMemory, SleepMode, StreamAllocator, Tag, TagPhase, TagStats,
};
use cuvmm_lib::driver::sys::CUstream;
use cuvmm_lib::{Context, Device};
use failure::{ErrorCode, Failure, Group};
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use trace::Trace;

struct Global {
    config: Config,
    trace: Option<Trace>,
    devices: Vec<OnceLock<Result<StreamAllocator, Failure>>>,
}

/// Everything the C ABI keeps for the whole process.
struct Process {
    /// The configuration and the devices' allocators, set up at the first call that needs them;
    /// a failed set-up (a bad `CUVMM_ALLOC_CONF`, no driver) is kept and answers every call.
    global: OnceLock<Result<Global, Failure>>,
    /// The allocators of `global` once made, found with one load.
    ready: ready::Ready,
    /// The groups of errors already written to stderr. Apart from `global`, so that a set-up that
    /// failed is written once too, not at every call.
    logged: Mutex<Option<HashSet<(String, Group)>>>,
    /// Whether errors that a return value reports go unwritten (`cuvmm_set_error_log`): a caller
    /// that raises them, as the Python package does, would otherwise show each one twice.
    returned_unwritten: AtomicBool,
    /// Whether any thread has set a tag: until then a request reads no thread-local for it (a
    /// call into the dynamic loader in a shared library, on every request).
    tagged: AtomicBool,
    /// The address of the function told of each allocation and free
    /// (`cuvmm_set_alloc_observer`), 0 for none: the one load every malloc and free pay while no
    /// memory history is recorded.
    observer: AtomicUsize,
}

static PROCESS: Process = Process {
    global: OnceLock::new(),
    ready: ready::Ready::new(),
    logged: Mutex::new(None),
    returned_unwritten: AtomicBool::new(false),
    tagged: AtomicBool::new(false),
    observer: AtomicUsize::new(0),
};

/// What the C ABI keeps for each thread.
struct PerThread {
    /// The last error's code and text (`cuvmm_last_error_code`, `cuvmm_last_error`).
    last_error: RefCell<Option<(ErrorCode, CString)>>,
    /// The tag of this thread's next allocations (`cuvmm_set_tag`).
    tag: Cell<Option<Tag>>,
}

thread_local! {
    static THREAD: PerThread =
        const { PerThread { last_error: RefCell::new(None), tag: Cell::new(None) } };
}

/// Whether an error of `function` reaches no caller through its return value: the frees return
/// nothing, and PyTorch answers a pool's NULL with an out-of-memory message of its own.
fn unreturned(function: &str) -> bool {
    matches!(function, "cuvmm_free" | "cuvmm_pool_free" | "cuvmm_pool_malloc")
}

/// The calling thread's tag (`cuvmm_set_tag`), if any.
#[inline]
fn tag() -> Option<Tag> {
    if !PROCESS.tagged.load(Ordering::Relaxed) {
        return None;
    }
    THREAD.try_with(|t| t.tag.get()).ok().flatten()
}

/// The set-up, if it was made and succeeded.
fn set_up() -> Option<&'static Global> {
    PROCESS.global.get()?.as_ref().ok()
}

extern "C" fn flush_trace_at_exit() {
    if let Some(Global { trace: Some(t), .. }) = set_up() {
        t.flush();
    }
}

fn global() -> Result<&'static Global, Failure> {
    let invalid = |msg: String| Failure::new(ErrorCode::InvalidArgument, msg);
    PROCESS
        .global
        .get_or_init(|| {
            let var = match std::env::var("CUVMM_ALLOC_CONF") {
                Ok(v) => Some(v),
                Err(std::env::VarError::NotPresent) => None,
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(invalid("CUVMM_ALLOC_CONF: not UTF-8".into()))
                }
            };
            let config =
                Config::parse(var.as_deref()).map_err(|e| invalid(format!("CUVMM_ALLOC_CONF: {e}")))?;
            let count = Device::count()?;
            let trace = match &config.trace {
                Some(p) => {
                    let t = Trace::create(p).map_err(|e| {
                        Failure::new(ErrorCode::Os, format!("trace file {}: {e}", p.display()))
                    })?;
                    // SAFETY: registers a function without arguments that only flushes a buffer.
                    unsafe { libc::atexit(flush_trace_at_exit) };
                    Some(t)
                }
                None => None,
            };
            Ok(Global { config, trace, devices: (0..count).map(|_| OnceLock::new()).collect() })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// `device`'s allocator, made at its first use. Once made it is found without the set-up's checks
/// (see [`ready`]): every request and free asks.
#[inline]
fn allocator(device: c_int) -> Result<&'static StreamAllocator, Failure> {
    match PROCESS.ready.get(device) {
        Some(a) => Ok(a),
        None => allocator_slow(device),
    }
}

#[cold]
fn allocator_slow(device: c_int) -> Result<&'static StreamAllocator, Failure> {
    let g = global()?;
    let slot = usize::try_from(device).ok().and_then(|d| g.devices.get(d)).ok_or_else(|| {
        Failure::new(ErrorCode::InvalidArgument, format!("no device {device} ({} present)", g.devices.len()))
    })?;
    slot.get_or_init(|| {
        let ctx = Context::for_ordinal(device as usize)?;
        let cfg = AllocatorConfig {
            page: g.config.page,
            reserve: g.config.reserve,
            tag_page: g.config.tag_page,
            lend: g.config.lend,
            export_threshold: g.config.export_threshold,
        };
        Ok(StreamAllocator::with_config(&ctx, cfg)?)
    })
    .as_ref()
    .inspect(|a| PROCESS.ready.set(device, a))
    .map_err(Clone::clone)
}

/// Keeps the failure for `cuvmm_last_error_code` and `cuvmm_last_error` and writes it to stderr
/// the first time its group is seen for `function`. Never panics: it runs where nothing may
/// unwind (a failed write to stderr, a thread whose thread-locals are gone).
fn fail(function: &str, failure: Failure) {
    use std::io::Write;
    let text = format!("{function}: {}", failure.message);
    let code = failure.code();
    let enabled = !matches!(PROCESS.global.get(), Some(Ok(g)) if !g.config.log)
        && (unreturned(function) || !PROCESS.returned_unwritten.load(Ordering::Relaxed));
    if enabled {
        let mut logged = PROCESS.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.get_or_insert_with(HashSet::new).insert((function.to_owned(), failure.group)) {
            let line = format!("cuvmm: {text}");
            #[cfg(test)]
            if tests::captured(&line) {
                return record_last_error(code, text);
            }
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    }
    record_last_error(code, text);
}

fn record_last_error(code: ErrorCode, text: String) {
    let _ = THREAD.try_with(|t| {
        if let Ok(mut slot) = t.last_error.try_borrow_mut() {
            *slot = CString::new(text.replace('\0', " ")).ok().map(|s| (code, s));
        }
    });
}

/// Runs `f`, turning an error or a panic into `on_error` after recording it. Nothing unwinds out
/// of it: recording the error is guarded too.
fn guard<T>(function: &str, on_error: T, f: impl FnOnce() -> Result<T, Failure>) -> T {
    let failure = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return v,
        Ok(Err(e)) => e,
        Err(_) => Failure::new(ErrorCode::Internal, "internal error (panic caught at the C boundary)"),
    };
    let _ = catch_unwind(AssertUnwindSafe(|| fail(function, failure)));
    on_error
}

/// The library's error as the C ABI reports it.
fn reported(e: cuvmm_lib::Error) -> Failure {
    e.into()
}

/// A refusal of the C ABI's own checks.
fn plain(msg: String) -> Failure {
    Failure::new(ErrorCode::InvalidArgument, msg)
}

/// Who receives a NULL from an allocation entry point.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// `change_current_allocator`: PyTorch makes a tensor at address 0 of a NULL, so `oom=abort`
    /// may stop the process instead.
    Tensors,
    /// `MemPool`: PyTorch frees cached segments of the pool if it can and asks again, or raises
    /// `OutOfMemoryError`; a NULL is always returned.
    Pool,
}

fn malloc_with(function: &str, size: isize, device: c_int, stream: CUstream, caller: Caller) -> *mut c_void {
    let ptr = guard(function, 0u64, || {
        if size <= 0 {
            return if size == 0 { Ok(0) } else { Err(plain(format!("negative size {size}"))) };
        }
        let tag = tag();
        if let Some(t) = tag {
            // Refused before any device is asked for: a tag asleep is asleep for the process.
            t.check_awake().map_err(reported)?;
        }
        request(function, size, device, stream, caller, tag)
    });
    if let Some(Global { trace: Some(t), .. }) = set_up() {
        t.record('a', device, stream as usize, size, ptr);
    }
    memory_history::observe(b'a', device, ptr, size, stream);
    ptr as usize as *mut c_void
}

/// The request of [`malloc_with`], `size` positive (inlined in both its places: it is on the cached
/// pair's path, where a call of its own shows in the pair's instruction count).
#[inline(always)]
fn request(
    function: &str,
    size: isize,
    device: c_int,
    stream: CUstream,
    caller: Caller,
    tag: Option<Tag>,
) -> Result<u64, Failure> {
    let graphs = match caller {
        Caller::Tensors => GraphMemory::Keep,
        Caller::Pool => GraphMemory::Share,
    };
    let a = allocator(device)?;
    // SAFETY: the C contract (cuvmm.h) makes `stream` a live stream of the device's primary
    // context that outlives the blocks freed on it.
    let got = unsafe { a.allocate_raw_tagged(size as usize, stream, graphs, tag) };
    got.map(u64::from).map_err(|e| {
        if caller == Caller::Tensors
            && e.is_out_of_memory()
            && set_up().is_some_and(|g| g.config.abort_on_oom)
        {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "cuvmm: {function}: out of memory for {size} bytes on device {device}: {e} (oom=abort)"
            );
            std::process::abort();
        }
        reported(e)
    })
}

fn free_with(function: &str, ptr: *mut c_void, size: isize, device: c_int, stream: CUstream) {
    if ptr.is_null() {
        return;
    }
    if let Some(Global { trace: Some(t), .. }) = set_up() {
        t.record('f', device, stream as usize, size, ptr as usize as u64);
    }
    memory_history::observe(b'f', device, ptr as usize as u64, size, stream);
    guard(function, (), || {
        let a = allocator(device)?;
        // SAFETY: the C contract: `ptr` came from this library's malloc for `device` and every use
        // on other streams is ordered before the work queued on `stream`, or recorded with
        // `cuvmm_record_stream` on a stream live until the free is made.
        unsafe { a.free_raw(DevicePtr::new(ptr as usize as u64), stream) }.map_err(reported)
    })
}

/// Allocates `size` bytes on `device` for work on `stream`: the allocation function of PyTorch's
/// pluggable allocator (CUDAPluggableAllocator), for torch.cuda.memory.change_current_allocator:
/// every tensor comes from here. Memory is stream-ordered: a block freed on a stream is reused at
/// once on that stream, and on another stream only once the work queued before the free has
/// completed. Capture-aware: memory handed out while `stream` is being captured into a CUDA graph
/// is kept for that graph (see cuvmm_release_graph_memory), and nothing illegal during capture is
/// called.
/// A stream must be alive during a call that passes it, and may be destroyed at any time after:
/// blocks it freed come back to the others once its work has run (streams are told apart by the
/// driver's stream id, never by handle, and a handle is passed to the driver only during a call
/// that passes it). The per-thread default stream is refused.
/// Returns NULL on failure (out of memory included, unless oom=abort stops the process); size 0
/// returns NULL without error. A size larger than the device's memory is refused (NULL, with
/// cuvmm_last_error) before anything is built for it: no size aborts the process.
#[no_mangle]
pub extern "C" fn cuvmm_malloc(size: isize, device: c_int, stream: CUstream) -> *mut c_void {
    malloc_with("cuvmm_malloc", size, device, stream, Caller::Tensors)
}

/// Frees a block of cuvmm_malloc on `stream` (the free function of the same pair).
#[no_mangle]
pub extern "C" fn cuvmm_free(ptr: *mut c_void, size: isize, device: c_int, stream: CUstream) {
    free_with("cuvmm_free", ptr, size, device, stream)
}

/// cuvmm_malloc for torch.cuda.MemPool: PyTorch caches blocks inside the segments it gets here and
/// manages CUDA graphs itself, so memory obtained during a capture is not held back for the graph.
/// Out of memory it returns NULL whatever oom= says: PyTorch raises OutOfMemoryError for it.
#[no_mangle]
pub extern "C" fn cuvmm_pool_malloc(size: isize, device: c_int, stream: CUstream) -> *mut c_void {
    malloc_with("cuvmm_pool_malloc", size, device, stream, Caller::Pool)
}

/// Frees a segment of cuvmm_pool_malloc.
#[no_mangle]
pub extern "C" fn cuvmm_pool_free(ptr: *mut c_void, size: isize, device: c_int, stream: CUstream) {
    free_with("cuvmm_pool_free", ptr, size, device, stream)
}

/// `cuvmm_stats_t` of cuvmm.h: the library's counters are laid out as C declares them.
pub type CuvmmStats = AllocatorStats;

/// Fills `*out` with the statistics of `device`'s allocator. Returns 0, or -1 (see
/// cuvmm_last_error).
///
/// # Safety
/// `out` must be valid for writing a `cuvmm_stats_t` (or null, which is refused).
#[no_mangle]
pub unsafe extern "C" fn cuvmm_get_stats(device: c_int, out: *mut CuvmmStats) -> c_int {
    guard("cuvmm_get_stats", -1, || {
        if out.is_null() {
            return Err(plain("null output pointer".into()));
        }
        let s = allocator(device)?.stats();
        // SAFETY: the caller gives a writable `cuvmm_stats_t`; checked non-null.
        unsafe { out.write(s) };
        Ok(0)
    })
}

/// The allocators made so far, with their device ordinals.
fn allocators() -> Vec<(usize, &'static StreamAllocator)> {
    match set_up() {
        Some(g) => {
            g.devices.iter().enumerate().filter_map(|(d, s)| Some((d, s.get()?.as_ref().ok()?))).collect()
        }
        _ => Vec::new(),
    }
}

fn stats_json() -> String {
    let devices: Vec<String> = allocators()
        .into_iter()
        .map(|(d, a)| {
            let s = a.stats();
            format!(
                "\"{d}\":{{\"live\":{},\"live_peak\":{},\"requested\":{},\"mapped\":{},\"mapped_peak\":{},\"reserved\":{},\"allocations\":{},\"frees\":{},\"cache_hits\":{},\"pages_created\":{},\"pages_released\":{},\"pages_remapped\":{},\"events_recorded\":{},\"oom_retries\":{},\"graph_held\":{},\"exported\":{},\"freed_shared\":{}}}",
                s.live, s.live_peak, s.requested, s.mapped, s.mapped_peak, s.reserved, s.allocations, s.frees,
                s.cache_hits, s.pages_created, s.pages_released, s.pages_remapped, s.events_recorded,
                s.oom_retries, s.graph_held, s.exported, s.freed_shared
            )
        })
        .collect();
    format!("{{{}}}", devices.join(","))
}

/// Writes the stats of every device used so far as JSON into `buf` (NUL-terminated when it fits).
/// Returns the length the JSON needs (without the NUL), or -1.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes (or null with `len` 0, to ask the length).
#[no_mangle]
pub unsafe extern "C" fn cuvmm_stats_json(buf: *mut c_char, len: usize) -> isize {
    // SAFETY: the caller's contract on `buf` and `len` is this function's.
    guard("cuvmm_stats_json", -1, || Ok(unsafe { write_text(buf, len, &stats_json()) }))
}

/// Writes `text` and a NUL into `buf` when both fit in its `len` bytes; returns the length `text`
/// needs (without the NUL), so that a caller may ask again with room enough.
///
/// # Safety
/// `buf` must be valid for writing `len` bytes, or null.
pub(crate) unsafe fn write_text(buf: *mut c_char, len: usize, text: &str) -> isize {
    if !buf.is_null() && text.len() < len {
        // SAFETY: `buf` holds `len` > text.len() bytes (the caller's contract); the regions cannot
        // overlap, `text` being ours.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            *buf.add(text.len()) = 0;
        }
    }
    text.len() as isize
}

fn each_device(
    function: &str,
    device: c_int,
    f: impl Fn(&StreamAllocator) -> cuvmm_lib::Result<()>,
) -> c_int {
    guard(function, -1, || {
        if device == -1 {
            for (_, a) in allocators() {
                f(a).map_err(reported)?;
            }
            return Ok(0);
        }
        f(allocator(device)?).map_err(reported)?;
        Ok(0)
    })
}

/// Resets live_peak and mapped_peak to the current values. device -1: every device.
#[no_mangle]
pub extern "C" fn cuvmm_reset_peaks(device: c_int) -> c_int {
    each_device("cuvmm_reset_peaks", device, |a| {
        a.reset_peaks();
        Ok(())
    })
}

/// Waits for the device's queued work, then unmaps and releases every idle page. device -1: every
/// device. Refused (-1) while a stream of the device is being captured: the driver refuses the
/// wait, which also ends that capture in error, so do not call it during a capture.
#[no_mangle]
pub extern "C" fn cuvmm_empty_cache(device: c_int) -> c_int {
    each_device("cuvmm_empty_cache", device, |a| a.empty_cache().map(|_| ()))
}

/// Releases the memory kept for CUDA graphs captured through cuvmm_malloc; the caller promises
/// that those graphs were destroyed. device -1: every device.
#[no_mangle]
pub extern "C" fn cuvmm_release_graph_memory(device: c_int) -> c_int {
    each_device("cuvmm_release_graph_memory", device, |a| {
        // SAFETY: the C contract: the caller destroyed the graphs captured with this memory.
        unsafe { a.release_graph_memory() };
        Ok(())
    })
}

/// Reads a C string argument.
///
/// # Safety
/// `s` must be null or a NUL-terminated string.
unsafe fn c_str<'a>(s: *const c_char) -> Result<Option<&'a str>, Failure> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, and NUL-terminated by the caller's contract.
    let c = unsafe { std::ffi::CStr::from_ptr(s) };
    c.to_str().map(Some).map_err(|_| plain("the tag is not UTF-8".into()))
}

fn tag_of(name: Option<&str>) -> Result<Tag, Failure> {
    let name = name.ok_or_else(|| plain("no tag given".into()))?;
    Ok(Tag::new(name)?)
}

/// Sleep and wake of tagged memory (every device).
/// A tag is asleep from a cuvmm_sleep that returned 0 until a cuvmm_wake that returned 0, for the
/// whole process: on every device, those used before the sleep and those used after it alike,
/// and whether or not it holds memory (a tag never used sleeps too, as in the Rust API).
/// Allocating with a sleeping tag fails (NULL); freeing is allowed.
/// Calls for one tag from several threads: a cuvmm_sleep or cuvmm_wake waits while another sleep
/// or wake of the same tag is under way, then answers for the state that one left (a wake racing
/// a sleep wakes the tag the sleep put to sleep; a second sleep is refused as already asleep); a
/// sleep also waits for allocations with the tag already under way, and allocations that start
/// after it are refused. cuvmm_get_tag_stats reports a tag asleep from the start of a sleep until
/// the end of the wake that succeeds.
///
/// cuvmm_set_tag: later allocations of the calling thread carry this tag (copied; NULL: none).
/// 0; -1 for a name that is empty, too long or not UTF-8 (the thread's tag stays as it was).
///
/// # Safety
/// `tag` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_set_tag(tag: *const c_char) -> c_int {
    guard("cuvmm_set_tag", -1, || {
        // SAFETY: the caller's contract.
        let name = unsafe { c_str(tag) }?;
        let t = match name {
            Some(n) => Some(tag_of(Some(n))?),
            None => None,
        };
        if t.is_some() {
            // Before the thread's own tag: its next request, which reads the flag first, sees it.
            PROCESS.tagged.store(true, Ordering::Relaxed);
        }
        THREAD.try_with(|c| c.tag.set(t)).map_err(|_| plain("the thread is exiting".into()))?;
        Ok(0)
    })
}

fn all_allocators() -> Vec<&'static StreamAllocator> {
    allocators().into_iter().map(|(_, a)| a).collect()
}

/// Waits for queued work, then releases the device memory of every allocation tagged `tag`, first
/// copying it to the tag's backup (cuvmm_set_backup) when `offload` is non-zero; addresses stay
/// reserved. 0 on success; -1 when already asleep, during a capture, or on failure (then the tag
/// is awake, and the devices this call put to sleep are woken again: an offload's contents come
/// back, discarded ones do not; if waking one of them failed too, cuvmm_last_error says so and the
/// tag stays asleep until a cuvmm_wake wakes it).
///
/// # Safety
/// `tag` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_sleep(tag: *const c_char, offload: c_int) -> c_int {
    guard("cuvmm_sleep", -1, || {
        // SAFETY: the caller's contract.
        let t = tag_of(unsafe { c_str(tag) }?)?;
        let mode = if offload != 0 { SleepMode::Offload } else { SleepMode::Discard };
        t.sleep_on(all_allocators, mode).map_err(reported)?;
        Ok(0)
    })
}

/// On every device where the tag holds sleeping memory, maps memory again at the same addresses
/// and restores offloaded contents. 0 on success; -1 when the tag is not asleep (never put to
/// sleep, or woken already), or on failure (out of memory included): the devices woken before the
/// failure stay awake, the others stay asleep with nothing lost, the tag stays asleep, and a later
/// call wakes the rest.
///
/// # Safety
/// `tag` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_wake(tag: *const c_char) -> c_int {
    guard("cuvmm_wake", -1, || {
        // SAFETY: the caller's contract.
        let t = tag_of(unsafe { c_str(tag) }?)?;
        t.wake_on(all_allocators).map_err(reported)?;
        Ok(0)
    })
}

/// Where `tag`'s later offloading sleeps keep its contents, on every device:
///   backend 0: pageable host memory, through a staging ring (the default; no memory pinned
///              beyond the ring);
///   backend 1: pinned host memory as large as the tag;
///   backend 2: a file in directory `dir` (created at sleep, removed at wake).
/// `retain` non-zero keeps the backup (host memory or file) after a wake, for the next sleep;
/// zero releases it at wake. 0, or -1 (unknown backend, no `dir` for backend 2, `dir` not a
/// directory), changing nothing.
///
/// # Safety
/// `tag` must be a NUL-terminated string; `dir` null or one.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_set_backup(
    tag: *const c_char,
    backend: c_int,
    retain: c_int,
    dir: *const c_char,
) -> c_int {
    guard("cuvmm_set_backup", -1, || {
        // SAFETY: the caller's contract.
        let t = tag_of(unsafe { c_str(tag) }?)?;
        // SAFETY: the caller's contract.
        let dir = unsafe { c_str(dir) }.map_err(|_| plain("the directory is not UTF-8".into()))?;
        let kind = match (backend, dir) {
            (0, _) => BackupKind::Pageable,
            (1, _) => BackupKind::Pinned,
            (2, Some(d)) if !d.is_empty() => BackupKind::Disk(d.into()),
            (2, _) => return Err(plain("a disk backup needs a directory".into())),
            (b, _) => {
                return Err(plain(format!("unknown backup backend {b} (0 pageable, 1 pinned, 2 disk)")))
            }
        };
        t.set_backup(BackupOptions { kind, retain: retain != 0 }).map_err(reported)?;
        Ok(0)
    })
}

/// Gets `tag`'s backup ready for its first offloading sleep, in the background, on every device
/// where it holds memory: pageable host memory as large as that sleep would copy now is faulted in
/// and left for the kernel to take back only if it needs it (as a wake leaves a backup), so that
/// the first sleep writes into pages the kernel kept; for a pageable or disk backup it also makes
/// the staging ring those sleeps copy through (64 MiB pinned, kept as after a first sleep), on a
/// thread of its own. Call it once the tag holds what it will sleep with. The bytes being prepared
/// (0: nothing to copy, a backup that is not pageable memory or is retained, or not that much host
/// memory available), or -1 (the tag asleep, a bad name).
/// Where it pays: the first offloading sleep of a process into pageable memory. Unprepared, that
/// sleep faults fresh host memory in (the kernel zeroes every page) and pins the ring while it
/// copies, where later sleeps write into the backup the last wake released lazily into a ring
/// already pinned; prepared, it starts as they do (docs/DECISIONS.md, "Preparing the first
/// sleep's backup"). It pins nothing beyond the ring; until the first sleep the process holds the
/// memory as a lazily released backup, counted as resident, which the kernel takes back first
/// when it needs memory. Nothing is gained for a tag only ever discarded, a pinned backup, or a
/// retained one after its first sleep.
///
/// # Safety
/// `tag` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_prepare_backup(tag: *const c_char) -> i64 {
    guard("cuvmm_prepare_backup", -1, || {
        // SAFETY: the caller's contract.
        let t = tag_of(unsafe { c_str(tag) }?)?;
        let mut bytes = 0i64;
        for a in all_allocators() {
            let b = a.prepare_backup(t).map_err(reported)?;
            bytes = bytes.saturating_add(i64::try_from(b).unwrap_or(i64::MAX));
        }
        Ok(bytes)
    })
}

/// Bytes of host memory cuvmm holds pinned now: staging rings and pinned backups.
#[no_mangle]
pub extern "C" fn cuvmm_pinned_bytes() -> u64 {
    cuvmm_lib::host::pinned_bytes()
}

/// What a tag holds on every device together (cuvmm_get_tag_stats).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CuvmmTagStats {
    /// Bytes handed out under the tag.
    pub live: u64,
    /// Device memory the tag holds now (0 while asleep).
    pub mapped: u64,
    /// Bytes held in the tag's backup while asleep.
    pub offloaded: u64,
    /// 1 while asleep (see cuvmm_sleep).
    pub asleep: i32,
    /// Padding, 0.
    pub reserved_: i32,
}

/// Fills `*out` with what `tag` holds on every device together. 0, or -1.
///
/// # Safety
/// `tag` must be a NUL-terminated string; `out` valid for writing a `cuvmm_tag_stats_t`.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_get_tag_stats(tag: *const c_char, out: *mut CuvmmTagStats) -> c_int {
    guard("cuvmm_get_tag_stats", -1, || {
        if out.is_null() {
            return Err(plain("null output pointer".into()));
        }
        // SAFETY: the caller's contract.
        let t = tag_of(unsafe { c_str(tag) }?)?;
        let mut sum = CuvmmTagStats { asleep: i32::from(t.phase() != TagPhase::Awake), ..Default::default() };
        for (_, a) in allocators() {
            let TagStats { live, mapped, offloaded, asleep } = a.tag_stats(t);
            sum.live += live;
            sum.mapped += mapped;
            sum.offloaded += offloaded;
            sum.asleep |= i32::from(asleep);
        }
        // SAFETY: checked non-null; the caller gives a writable struct.
        unsafe { out.write(sum) };
        Ok(0)
    })
}

/// The allocator of `device` if one was made already: asking whether a pointer is cuvmm's must
/// not make one (nor read `CUVMM_ALLOC_CONF`) in a process that never allocated through cuvmm.
fn existing_allocator(device: c_int) -> Option<&'static StreamAllocator> {
    let g = set_up()?;
    g.devices.get(usize::try_from(device).ok()?)?.get()?.as_ref().ok()
}

/// Sharing blocks with other processes (what cuvmm.torch's torch.multiprocessing support uses).
///
/// cuvmm_owner: 1 when the live block holding `ptr` (anywhere inside it) came from this library on
/// `device`, with its address and size in `*block` and `*len` (each may be NULL); 0 when not (also
/// in a process that never allocated through cuvmm); -1 on failure.
///
/// # Safety
/// `block` and `len` must each be null or valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_owner(
    device: c_int,
    ptr: *const c_void,
    block: *mut u64,
    len: *mut u64,
) -> c_int {
    guard("cuvmm_owner", -1, || {
        let Some(BlockRange { start, len: n }) =
            existing_allocator(device).and_then(|a| a.owner_of(DevicePtr::new(ptr as usize as u64)))
        else {
            return Ok(0);
        };
        // SAFETY: the caller's contract: null or writable.
        unsafe {
            if !block.is_null() {
                block.write(start.get());
            }
            if !len.is_null() {
                len.write(n);
            }
        }
        Ok(1)
    })
}

/// Where a shared block lies (cuvmm_export, cuvmm_export_pages, cuvmm_export_mark).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CuvmmExport {
    /// The block's address.
    pub block: u64,
    /// Its size.
    pub len: u64,
    /// Address of the first page under it; the others follow without gaps.
    pub first_page: u64,
    /// Bytes per page.
    pub page: u64,
    /// Pages.
    pub count: u64,
}

impl From<&BlockShare> for CuvmmExport {
    fn from(s: &BlockShare) -> CuvmmExport {
        CuvmmExport {
            block: s.block.get(),
            len: s.len,
            first_page: s.first_page,
            page: s.page as u64,
            count: s.pages.len() as u64,
        }
    }
}

/// Shares the live block of `device` holding `ptr`: one POSIX file descriptor per physical page
/// under it in `fds` (the caller owns and closes them; pages also hold the block's neighbours, as
/// legacy CUDA IPC shares a whole segment) and the layout in `*out`. Each page's first export is
/// kept with the page until the allocator gives it back, so sharing the same block again costs no
/// driver export. Returns the page count; when it is larger than `cap` nothing is shared (no
/// descriptor written, no mark kept) and the call may be repeated. -1 on failure (a tag asleep, a
/// device without POSIX-fd export). Once its importers have released it, call cuvmm_unexport (once
/// per export). Until then its bytes count in cuvmm_stats_t.exported and its tag refuses to sleep.
/// A shared block may be freed before then: its memory (addresses and pages) stays out of every
/// later allocation, its bytes move to cuvmm_stats_t.freed_shared, and the last cuvmm_unexport
/// frees it, so that no new block lands on memory an importer still reads and writes.
///
/// # Safety
/// `out` must be valid for writing a `cuvmm_export_t`; `fds` for writing `cap` ints.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_export(
    device: c_int,
    ptr: *const c_void,
    out: *mut CuvmmExport,
    fds: *mut c_int,
    cap: usize,
) -> isize {
    // SAFETY: the caller's contract, with no serials asked for.
    unsafe { export_with("cuvmm_export", device, ptr, out, fds, None, cap) }
}

/// cuvmm_export, also writing each page's serial into `pages` (room for `cap`): the same serial
/// names the same physical memory of this process, and a serial never comes back, so an importer
/// that kept a mapping of pages with these serials from this process may use it again.
///
/// # Safety
/// As [`cuvmm_export`]; `pages` must be valid for writing `cap` u64s.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_export_pages(
    device: c_int,
    ptr: *const c_void,
    out: *mut CuvmmExport,
    fds: *mut c_int,
    pages: *mut u64,
    cap: usize,
) -> isize {
    // SAFETY: the caller's contract.
    unsafe { export_with("cuvmm_export_pages", device, ptr, out, fds, Some(pages), cap) }
}

/// The two exports; `pages` None: no serials asked for.
///
/// # Safety
/// As [`cuvmm_export_pages`] (as [`cuvmm_export`] with `pages` None).
unsafe fn export_with(
    function: &str,
    device: c_int,
    ptr: *const c_void,
    out: *mut CuvmmExport,
    fds: *mut c_int,
    pages: Option<*mut u64>,
    cap: usize,
) -> isize {
    use std::os::fd::IntoRawFd;
    guard(function, -1, || {
        if out.is_null() || (cap > 0 && (fds.is_null() || pages.is_some_and(|p| p.is_null()))) {
            return Err(plain("null output pointer".into()));
        }
        let a = existing_allocator(device)
            .ok_or_else(|| plain(format!("no cuvmm allocation on device {device}")))?;
        let e = a.export(DevicePtr::new(ptr as usize as u64)).map_err(reported)?;
        // SAFETY: checked non-null; the caller gives a writable struct.
        unsafe { out.write(CuvmmExport::from(&e.share)) };
        let n = e.fds.len();
        if n > cap {
            a.unexport(e.share.block).map_err(reported)?;
            return Ok(n as isize);
        }
        for (i, (fd, serial)) in e.fds.into_iter().zip(e.share.pages).enumerate() {
            // SAFETY: i < n <= cap, inside the caller's arrays (checked non-null).
            unsafe {
                fds.add(i).write(fd.into_raw_fd());
                if let Some(pages) = pages {
                    pages.add(i).write(serial);
                }
            }
        }
        Ok(n as isize)
    })
}

/// Marks the block holding `ptr` shared as cuvmm_export_pages does (one cuvmm_unexport each), but
/// writes no descriptor: the layout in `*out` and each page's serial in `pages`. An importer that
/// already maps pages of these serials from this process needs nothing more; for one that does
/// not, cuvmm_export_fds gives the descriptors. Returns the page count; more than `cap`: nothing
/// marked, call again with room enough. -1 on failure.
///
/// # Safety
/// `out` must be valid for writing a `cuvmm_export_t`; `pages` for writing `cap` u64s.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_export_mark(
    device: c_int,
    ptr: *const c_void,
    out: *mut CuvmmExport,
    pages: *mut u64,
    cap: usize,
) -> isize {
    guard("cuvmm_export_mark", -1, || {
        if out.is_null() || (cap > 0 && pages.is_null()) {
            return Err(plain("null output pointer".into()));
        }
        let a = existing_allocator(device)
            .ok_or_else(|| plain(format!("no cuvmm allocation on device {device}")))?;
        let m = a.export_mark(DevicePtr::new(ptr as usize as u64)).map_err(reported)?;
        let n = m.pages.len();
        // SAFETY: checked non-null; the caller gives a writable struct.
        unsafe { out.write(CuvmmExport::from(&m)) };
        if n > cap {
            a.unexport(m.block).map_err(reported)?;
            return Ok(n as isize);
        }
        // SAFETY: n <= cap u64s, inside the caller's array (checked non-null when cap > 0).
        unsafe { std::ptr::copy_nonoverlapping(m.pages.as_ptr(), pages, n) };
        Ok(n as isize)
    })
}

/// One POSIX descriptor per page under the block at `block` on `device` that cuvmm_export_mark (or
/// cuvmm_export) shared and no cuvmm_unexport has let go yet, in address order, into `fds` (the
/// caller closes them); the block may have been freed since. Returns the page count; more than
/// `cap`: no descriptor written, call again with room enough. -1 on failure (not shared).
///
/// # Safety
/// `fds` must be valid for writing `cap` ints.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_export_fds(device: c_int, block: u64, fds: *mut c_int, cap: usize) -> isize {
    use std::os::fd::IntoRawFd;
    guard("cuvmm_export_fds", -1, || {
        if cap > 0 && fds.is_null() {
            return Err(plain("null output pointer".into()));
        }
        let a =
            existing_allocator(device).ok_or_else(|| plain(format!("nothing shared on device {device}")))?;
        let got = a.exported_fds(DevicePtr::new(block)).map_err(reported)?;
        let n = got.len();
        if n > cap {
            // Dropped: closed here.
            return Ok(n as isize);
        }
        for (i, fd) in got.into_iter().enumerate() {
            // SAFETY: i < n <= cap, inside the caller's array (checked non-null).
            unsafe { fds.add(i).write(fd.into_raw_fd()) };
        }
        Ok(n as isize)
    })
}

/// One sharing of the block at `block` on `device` (cuvmm_export_t.block) is over: its importers
/// released it. 0, or -1 (not shared).
#[no_mangle]
pub extern "C" fn cuvmm_unexport(device: c_int, block: u64) -> c_int {
    guard("cuvmm_unexport", -1, || {
        let a =
            existing_allocator(device).ok_or_else(|| plain(format!("nothing shared on device {device}")))?;
        a.unexport(DevicePtr::new(block)).map_err(reported)?;
        Ok(0)
    })
}

/// Maps `count` exported pages of `page` bytes (`fds`, in address order) side by side on
/// `device`, the device they were made on, with read-write access for it and for the `npeers`
/// devices in `peers` (each must reach it; a peer's primary context is retained, so name only
/// devices the process uses); `*base` gets the address of the first page. Returns a handle for
/// cuvmm_import_release, or NULL. The descriptors stay the caller's.
///
/// # Safety
/// `fds` must be valid for reading `count` ints, each an open descriptor; `peers` for reading
/// `npeers` ints (or null with 0); `base` for writing.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_import(
    device: c_int,
    fds: *const c_int,
    count: usize,
    page: u64,
    peers: *const c_int,
    npeers: usize,
    base: *mut u64,
) -> *mut c_void {
    use std::os::fd::BorrowedFd;
    guard("cuvmm_import", std::ptr::null_mut(), || {
        if fds.is_null() || base.is_null() || count == 0 {
            return Err(plain("null pointer or no page to import".into()));
        }
        let page = usize::try_from(page).map_err(|_| plain(format!("page size {page}")))?;
        // SAFETY: the caller's contract: `count` readable ints.
        let raw = unsafe { std::slice::from_raw_parts(fds, count) };
        if raw.iter().any(|&fd| fd < 0) {
            return Err(plain("a negative descriptor".into()));
        }
        // SAFETY: each is an open descriptor the caller holds for the length of this call.
        let borrowed: Vec<BorrowedFd<'_>> =
            raw.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();
        // SAFETY: the caller's contract: `npeers` readable ints.
        let peers = unsafe { peer_devices(peers, npeers) }?;
        let a = allocator(device)?;
        let imported =
            cuvmm_lib::alloc::BlockImport::import(a.context(), &borrowed, page, &peers).map_err(reported)?;
        // SAFETY: checked non-null; the caller gives a writable u64.
        unsafe { base.write(imported.ptr()) };
        Ok(Box::into_raw(Box::new(imported)).cast::<c_void>())
    })
}

/// The devices named by the `n` ordinals at `peers` (NULL when `n` is 0).
///
/// # Safety
/// `peers` readable for `n` ints.
unsafe fn peer_devices(peers: *const c_int, n: usize) -> Result<Vec<Device>, Failure> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if peers.is_null() {
        return Err(plain("null peer list".into()));
    }
    // SAFETY: the caller's contract.
    let ordinals = unsafe { std::slice::from_raw_parts(peers, n) };
    ordinals
        .iter()
        .map(|&d| {
            usize::try_from(d)
                .ok()
                .and_then(|d| Device::get(d).ok())
                .ok_or_else(|| plain(format!("no device {d}")))
        })
        .collect()
}

/// Releases an import of cuvmm_import: waits for the work of the devices that could use it, then
/// unmaps. 0, or -1 for NULL.
///
/// # Safety
/// `import` must be a handle `cuvmm_import` returned, released once.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_import_release(import: *mut c_void) -> c_int {
    guard("cuvmm_import_release", -1, || {
        if import.is_null() {
            return Err(plain("null import".into()));
        }
        // SAFETY: the caller's contract: a live handle from `cuvmm_import`, released once.
        drop(unsafe { Box::from_raw(import.cast::<cuvmm_lib::alloc::BlockImport>()) });
        Ok(0)
    })
}

/// Writes the allocation trace (trace= in CUVMM_ALLOC_CONF) out now; it is also written at exit.
#[no_mangle]
pub extern "C" fn cuvmm_trace_flush() {
    flush_trace_at_exit()
}

/// Which errors are written to stderr (each kind once, when logging is on): CUVMM_LOG_ALL (the
/// default), or CUVMM_LOG_UNRETURNED, for a caller that reports every error a return value gives
/// (the Python package raises them): then only those of cuvmm_free, cuvmm_pool_free and
/// cuvmm_pool_malloc, whose callers never see the text. Returns 0, or -1 for another mode, which
/// changes nothing.
#[no_mangle]
pub extern "C" fn cuvmm_set_error_log(mode: c_int) -> c_int {
    guard("cuvmm_set_error_log", -1, || {
        let quiet = match mode {
            0 => false,
            1 => true,
            other => return Err(plain(format!("unknown error log mode {other} (0 or 1)"))),
        };
        PROCESS.returned_unwritten.store(quiet, Ordering::Relaxed);
        Ok(0)
    })
}

/// The calling thread's last error as text (valid until its next cuvmm call), or NULL.
#[no_mangle]
pub extern "C" fn cuvmm_last_error() -> *const c_char {
    THREAD
        .try_with(|t| t.last_error.try_borrow().ok().and_then(|s| s.as_ref().map(|(_, s)| s.as_ptr())))
        .ok()
        .flatten()
        .unwrap_or(std::ptr::null())
}

/// The code of the calling thread's last error, the one [`cuvmm_last_error`] describes
/// (`cuvmm_error_t` of cuvmm.h); `CUVMM_OK` (0) when it has met none.
#[no_mangle]
pub extern "C" fn cuvmm_last_error_code() -> c_int {
    let code = THREAD.try_with(|t| t.last_error.try_borrow().ok().and_then(|s| s.as_ref().map(|(c, _)| *c)));
    code.ok().flatten().unwrap_or(ErrorCode::None) as c_int
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use cuvmm_lib::driver::sys::CUresult;

    thread_local! {
        /// The lines `fail` writes to stderr, kept instead while a test of this thread captures.
        static CAPTURED: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
    }

    /// Takes `line` when this thread captures: the test asserts on it, and the terminal of a
    /// passing run shows no error line (libtest captures `eprintln!`, not writes to stderr).
    pub(super) fn captured(line: &str) -> bool {
        CAPTURED
            .try_with(|c| match c.try_borrow_mut().as_deref_mut() {
                Ok(Some(lines)) => {
                    lines.push(line.to_owned());
                    true
                }
                _ => false,
            })
            .unwrap_or(false)
    }

    /// Runs `f`, returning what it wrote to stderr through `fail`.
    fn stderr_of<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
        CAPTURED.with(|c| *c.borrow_mut() = Some(Vec::new()));
        let v = f();
        (v, CAPTURED.with(|c| c.borrow_mut().take().unwrap_or_default()))
    }

    pub(crate) fn last_error() -> String {
        let p = cuvmm_last_error();
        assert!(!p.is_null());
        // SAFETY: a non-null result is the thread's NUL-terminated message, alive until its next
        // call into the library.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    }

    #[test]
    fn set_backup_takes_each_backend_and_refuses_bad_ones_changing_nothing() {
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (tag, dir) = (c("capi-backup"), std::env::temp_dir());
        let set = |tag: *const c_char, backend: c_int, retain: c_int, dir: *const c_char| {
            // SAFETY: every caller below passes NUL-terminated strings or null.
            unsafe { cuvmm_set_backup(tag, backend, retain, dir) }
        };
        let t = Tag::new("capi-backup").unwrap();
        let d = c(dir.to_str().unwrap());
        assert_eq!(set(tag.as_ptr(), 2, 1, d.as_ptr()), 0);
        let want = BackupOptions { kind: BackupKind::Disk(dir.clone()), retain: true };
        assert_eq!(t.backup(), want);
        let missing = c("/nonexistent/cuvmm-backup-dir");
        for (backend, dir, says) in [
            (3, std::ptr::null(), "unknown backup backend"),
            (-1, std::ptr::null(), "unknown backup backend"),
            (2, std::ptr::null(), "needs a directory"),
            (2, missing.as_ptr(), "not a directory"),
        ] {
            let (rc, lines) = stderr_of(|| set(tag.as_ptr(), backend, 0, dir));
            assert_eq!(rc, -1);
            let msg = last_error();
            assert!(msg.contains("cuvmm_set_backup") && msg.contains(says), "{msg}");
            assert!(lines.iter().all(|l| l.contains("cuvmm_set_backup")), "{lines:?}");
            assert_eq!(t.backup(), want, "a refused call changes nothing");
        }
        let (rc, lines) = stderr_of(|| set(std::ptr::null(), 0, 0, std::ptr::null()));
        assert_eq!(rc, -1);
        assert!(lines.iter().all(|l| l.contains("no tag given")), "{lines:?}");
        assert_eq!(set(tag.as_ptr(), 1, 0, std::ptr::null()), 0);
        assert_eq!(t.backup(), BackupOptions { kind: BackupKind::Pinned, retain: false });
        assert_eq!(set(tag.as_ptr(), 0, 0, std::ptr::null()), 0);
        assert_eq!(t.backup(), BackupOptions::default());
    }

    #[test]
    fn a_panic_inside_becomes_the_error_value_and_a_message() {
        let (v, lines) = stderr_of(|| guard("test_fn", -7, || -> Result<i32, Failure> { panic!("boom") }));
        assert_eq!(v, -7);
        assert_eq!(cuvmm_last_error_code(), ErrorCode::Internal as c_int);
        let msg = last_error();
        assert!(msg.contains("test_fn") && msg.contains("panic"), "{msg}");
        assert_eq!(lines, ["cuvmm: test_fn: internal error (panic caught at the C boundary)"]);
    }

    #[test]
    fn the_same_error_with_other_numbers_is_written_once() {
        // Without a driver GLOBAL holds an error here, which must not make every call write.
        let _ = global();
        let f = "test_written_once";
        let oom = |n: u64| {
            let mut e = Failure::from(cuvmm_lib::Error::driver("cuMemCreate", CUresult::ERROR_OUT_OF_MEMORY));
            e.message = format!("size {n} at {n:#x}0");
            e
        };
        let ((), lines) = stderr_of(|| {
            for n in [1, 22, 333] {
                fail(f, oom(n));
            }
            fail(f, Failure::from(cuvmm_lib::Error::driver("cuMemMap", CUresult::ERROR_OUT_OF_MEMORY)));
            fail(f, plain("x".into()));
            fail(f, plain("y".into()));
        });
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0], "cuvmm: test_written_once: size 1 at 0x10");
        assert!(lines[1].contains("cuMemMap"), "another call is another group: {lines:?}");
        assert_eq!(lines[2], "cuvmm: test_written_once: x");
        // Each call keeps its own text and code for cuvmm_last_error, written or not.
        assert_eq!(last_error(), "test_written_once: y");
        assert_eq!(cuvmm_last_error_code(), ErrorCode::InvalidArgument as c_int);
        let logged = PROCESS.logged.lock().unwrap();
        let mine = logged.as_ref().unwrap().iter().filter(|(g, _)| g == f).count();
        assert_eq!(mine, 3);
    }

    #[test]
    fn a_refused_tag_name_is_an_error_and_keeps_the_tag_in_force() {
        let a = CString::new("weights").unwrap();
        // SAFETY: NUL-terminated strings and null.
        unsafe {
            assert_eq!(cuvmm_set_tag(a.as_ptr()), 0);
            let (rc, lines) = stderr_of(|| cuvmm_set_tag(c"".as_ptr()));
            assert_eq!(rc, -1);
            assert_eq!(lines, ["cuvmm: cuvmm_set_tag: invalid argument: a tag needs a name"]);
            assert!(last_error().contains("cuvmm_set_tag"));
            assert_eq!(THREAD.with(|t| t.tag.get()), Some(Tag::new("weights").unwrap()));
            assert_eq!(cuvmm_set_tag(std::ptr::null()), 0);
        }
        assert_eq!(THREAD.with(|t| t.tag.get()), None);
    }

    const CHILD: &str = "CUVMM_CAPI_TEST_CHILD";

    /// Runs `child`, the work of the test `test`, in a child process: this executable again, told
    /// to run only `test`, which in the child (where `CHILD` names it) runs `child` instead.
    /// No helper shows as a test of its own.
    fn in_child(test: &str, child: fn()) {
        in_child_with(test, None, child);
    }

    /// The same with `CUVMM_LIBCUDA` set to what `driver` returns. The child's stderr comes back,
    /// not to the terminal: it is shown only when the child fails (an abort, a failed assertion).
    pub(crate) fn in_child_with(test: &str, driver: Option<fn() -> std::path::PathBuf>, child: fn()) {
        if is_child(test) {
            child();
            println!("child done");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let mut run = std::process::Command::new(exe);
        run.args(["--exact", &test_path(test), "--nocapture", "--test-threads=1", "--include-ignored"])
            .env(CHILD, test);
        if let Some(driver) = driver {
            run.env(cuvmm_lib::driver::LIBRARY_ENV, driver());
        }
        let out = run.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("child done"),
            "{:?}\n{stdout}\n{stderr}",
            out.status
        );
    }

    /// The test's path: `name` of this module, or a path of another (`hooks::tests::name`).
    fn test_path(name: &str) -> String {
        if name.contains("::") {
            name.to_owned()
        } else {
            format!("tests::{name}")
        }
    }

    pub(crate) fn is_child(name: &str) -> bool {
        std::env::var(CHILD).as_deref() == Ok(name)
    }

    #[test]
    fn errors_a_return_value_reports_can_go_unwritten() {
        let (rc, lines) = stderr_of(|| cuvmm_set_error_log(2));
        assert_eq!(rc, -1);
        assert!(last_error().contains("unknown error log mode 2"), "{}", last_error());
        assert_eq!(lines.len(), 1, "{lines:?}");
        // The process-wide switch is flipped in a child, not under the other tests' feet.
        in_child("errors_a_return_value_reports_can_go_unwritten", returned_errors_unwritten);
    }

    #[test]
    fn a_page_size_no_gpu_maps_names_the_variable_the_key_and_a_size_that_works() {
        in_child("a_page_size_no_gpu_maps_names_the_variable_the_key_and_a_size_that_works", page_3mib);
    }

    /// The child of the test above: the variable is read at the first call, before any driver.
    fn page_3mib() {
        std::env::set_var("CUVMM_ALLOC_CONF", "page=3MiB");
        let (p, lines) = stderr_of(|| cuvmm_malloc(1 << 20, 0, std::ptr::null_mut()));
        assert!(p.is_null());
        assert_eq!(
            lines,
            ["cuvmm: cuvmm_malloc: CUVMM_ALLOC_CONF: page=3MiB is not a multiple of 2MiB, the page \
              granularity of CUDA GPUs: use a multiple such as page=4MiB"]
        );
    }

    /// The child of the test above.
    fn returned_errors_unwritten() {
        assert_eq!(cuvmm_set_error_log(1), 0);
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (rc, lines) = stderr_of(|| {
            // SAFETY: a NUL-terminated tag and a null directory.
            unsafe { cuvmm_set_backup(c("unwritten").as_ptr(), 9, 0, std::ptr::null()) }
        });
        assert_eq!(rc, -1);
        assert!(lines.is_empty(), "{lines:?}");
        assert!(last_error().contains("unknown backup backend"), "{}", last_error());
        for f in ["cuvmm_free", "cuvmm_pool_free", "cuvmm_pool_malloc"] {
            let ((), lines) = stderr_of(|| fail(f, plain("lost".into())));
            assert_eq!(lines, [format!("cuvmm: {f}: lost")]);
        }
        assert_eq!(cuvmm_set_error_log(0), 0);
        let ((), lines) = stderr_of(|| fail("cuvmm_sleep", plain("written".into())));
        assert_eq!(lines, ["cuvmm: cuvmm_sleep: written"]);
    }

    #[test]
    fn an_error_written_to_a_closed_stderr_does_not_unwind_into_c() {
        in_child("an_error_written_to_a_closed_stderr_does_not_unwind_into_c", closed_stderr);
    }

    /// The child of the test above: stderr is a pipe nobody reads and SIGPIPE is ignored, as under
    /// `python train.py 2>&1 | head` once head has exited.
    fn closed_stderr() {
        let mut fds = [0; 2];
        // SAFETY: plain descriptor calls on descriptors this process owns.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            libc::close(fds[0]);
            assert_eq!(libc::dup2(fds[1], 2), 2);
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        assert!(cuvmm_malloc(-3, 0, std::ptr::null_mut()).is_null());
    }

    #[test]
    fn an_error_while_a_thread_exits_does_not_unwind_into_c() {
        in_child("an_error_while_a_thread_exits_does_not_unwind_into_c", thread_exit);
    }

    extern "C" fn free_at_thread_exit(_: *mut c_void) {
        // Runs after the thread's Rust thread-locals are gone.
        assert!(cuvmm_malloc(-2, 0, std::ptr::null_mut()).is_null());
        let _ = cuvmm_last_error();
    }

    /// The child of the test above: a thread whose pthread key destructor calls the library.
    fn thread_exit() {
        std::thread::spawn(|| {
            assert!(cuvmm_malloc(-1, 0, std::ptr::null_mut()).is_null());
            let mut key: libc::pthread_key_t = 0;
            // SAFETY: a key with a destructor that takes no ownership; its value is a non-null
            // marker so that the destructor runs.
            unsafe {
                assert_eq!(libc::pthread_key_create(&mut key, Some(free_at_thread_exit)), 0);
                assert_eq!(
                    libc::pthread_setspecific(key, std::ptr::NonNull::<u8>::dangling().as_ptr().cast()),
                    0
                );
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn bad_arguments_return_null_or_minus_one_without_a_gpu() {
        // Negative sizes are refused before any device is touched; a null pointer is ignored.
        let (p, lines) = stderr_of(|| cuvmm_malloc(-5, 0, std::ptr::null_mut()));
        assert!(p.is_null());
        assert_eq!(lines, ["cuvmm: cuvmm_malloc: negative size -5"]);
        let msg = last_error();
        assert!(msg.contains("negative size"), "{msg}");
        let ((), lines) = stderr_of(|| {
            assert!(cuvmm_malloc(0, 0, std::ptr::null_mut()).is_null());
            cuvmm_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
        });
        assert!(lines.is_empty(), "{lines:?}");
        // SAFETY: a null output pointer is part of the contract (refused).
        let (rc, lines) = stderr_of(|| unsafe { cuvmm_get_stats(0, std::ptr::null_mut()) });
        assert_eq!(rc, -1);
        assert_eq!(lines, ["cuvmm: cuvmm_get_stats: null output pointer"]);
    }

    /// A tag's stats on every device together.
    fn tag_stats(tag: &std::ffi::CStr) -> CuvmmTagStats {
        let mut out = CuvmmTagStats::default();
        // SAFETY: a NUL-terminated name and a writable struct.
        assert_eq!(unsafe { cuvmm_get_tag_stats(tag.as_ptr(), &mut out) }, 0);
        out
    }

    /// What cuvmm.h says of sleep and wake, where no device was used: a tag that holds nothing
    /// sleeps, allocating with it is refused until it wakes, and a wake of a tag asleep nowhere is
    /// refused (it returned 0 when no device was used).
    #[test]
    fn a_tag_sleeps_and_wakes_as_the_header_says_with_no_device_used() {
        let t = c"capi-test-unused";
        let ((), lines) = stderr_of(|| {
            // SAFETY: NUL-terminated names.
            unsafe {
                assert_eq!(cuvmm_wake(t.as_ptr()), -1, "never put to sleep");
                assert!(last_error().contains("not asleep"), "{}", last_error());
                assert_eq!(cuvmm_sleep(t.as_ptr(), 1), 0);
                assert_eq!(tag_stats(t).asleep, 1);
                assert_eq!(cuvmm_sleep(t.as_ptr(), 0), -1);
                assert!(last_error().contains("already asleep"), "{}", last_error());
                assert_eq!(cuvmm_set_tag(t.as_ptr()), 0);
                assert!(cuvmm_pool_malloc(4096, 0, std::ptr::null_mut()).is_null());
                assert!(last_error().contains("asleep"), "{}", last_error());
                assert_eq!(cuvmm_set_tag(std::ptr::null()), 0);
                assert_eq!(cuvmm_wake(t.as_ptr()), 0);
                assert_eq!(tag_stats(t).asleep, 0);
                assert_eq!(cuvmm_wake(t.as_ptr()), -1, "woken already");
            }
        });
        // Each kind written once: the second refused wake is not.
        assert_eq!(
            lines,
            [
                "cuvmm: cuvmm_wake: invalid argument: the tag is not asleep",
                "cuvmm: cuvmm_sleep: invalid argument: the tag is already asleep",
                "cuvmm: cuvmm_pool_malloc: invalid argument: cannot allocate with a tag that is asleep: wake \
                 it first",
            ]
        );
    }

    /// The fake driver (tests/fixtures/fake_libcuda.c), built for this process.
    pub(crate) fn fake_vmm() -> std::path::PathBuf {
        crate::fake::fake_driver("FAKE_VMM")
    }

    #[test]
    fn the_same_sleep_and_wake_with_a_device_used_before_and_after() {
        in_child_with(
            "the_same_sleep_and_wake_with_a_device_used_before_and_after",
            Some(fake_vmm),
            sleep_wake,
        );
    }

    /// The child of the test above, on the fake driver's device.
    fn sleep_wake() {
        let (before, after) = (c"slept-before-first-use", c"slept-after-first-use");
        let mut stats = CuvmmStats::default();
        // SAFETY: NUL-terminated names, writable structs.
        unsafe {
            // Asleep before any device was used: a device used later refuses its allocations too.
            assert_eq!(cuvmm_sleep(before.as_ptr(), 0), 0);
            assert_eq!(cuvmm_get_stats(0, &mut stats), 0, "{}", last_error());
            assert_eq!(cuvmm_set_tag(before.as_ptr()), 0);
            assert!(cuvmm_malloc(4096, 0, std::ptr::null_mut()).is_null());
            assert!(last_error().contains("asleep"), "{}", last_error());
            assert_eq!(cuvmm_set_tag(std::ptr::null()), 0);
            assert_eq!(tag_stats(before).asleep, 1);
            assert_eq!(cuvmm_wake(before.as_ptr()), 0, "{}", last_error());
            assert_eq!(cuvmm_wake(before.as_ptr()), -1);
            // A tag never used on the device in use sleeps there as the Rust API's sleep does.
            assert_eq!(cuvmm_sleep(after.as_ptr(), 1), 0, "{}", last_error());
            assert_eq!(tag_stats(after).asleep, 1);
            assert_eq!(cuvmm_sleep(after.as_ptr(), 1), -1);
            assert_eq!(cuvmm_wake(after.as_ptr()), 0, "{}", last_error());
            assert_eq!(cuvmm_wake(after.as_ptr()), -1);
            assert_eq!(tag_stats(after).asleep, 0);
        }
    }

    #[test]
    fn sleeps_wakes_and_tagged_allocations_from_several_threads_end_in_a_state_the_header_describes() {
        in_child_with(
            "sleeps_wakes_and_tagged_allocations_from_several_threads_end_in_a_state_the_header_describes",
            Some(fake_vmm),
            sleep_wake_threads,
        );
    }

    /// The child of the test above: threads sleep, wake, allocate under and free one tag at
    /// random through the C ABI on the fake driver's device. Every call succeeds or refuses with
    /// -1 or NULL; afterwards the tag's reported state is the devices' and one wake (if asleep)
    /// brings it back, and it sleeps and wakes again.
    fn sleep_wake_threads() {
        // Each sleep's wait for the device takes a while, as on a busy GPU: wakes and sleeps of
        // the other threads come meanwhile. (Set before any thread or driver call.)
        std::env::set_var("FAKE_SYNC_SLEEP_US", "2000");
        let t = c"threads";
        let start = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            for i in 0..4u32 {
                let start = &start;
                s.spawn(move || {
                    let mut x = 0x2545_f491_u32.wrapping_mul(i + 1);
                    let mut held = Vec::new();
                    start.wait();
                    for _ in 0..150 {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        // SAFETY: a NUL-terminated name; blocks of this thread's cuvmm_malloc.
                        unsafe {
                            match x % 4 {
                                0 => drop(cuvmm_sleep(t.as_ptr(), 0)),
                                1 => drop(cuvmm_wake(t.as_ptr())),
                                2 => {
                                    assert_eq!(cuvmm_set_tag(t.as_ptr()), 0);
                                    let p = cuvmm_malloc(64 << 10, 0, std::ptr::null_mut());
                                    assert_eq!(cuvmm_set_tag(std::ptr::null()), 0);
                                    if !p.is_null() {
                                        held.push(p);
                                    }
                                }
                                _ => {
                                    if let Some(p) = held.pop() {
                                        cuvmm_free(p, 64 << 10, 0, std::ptr::null_mut());
                                    }
                                }
                            }
                        }
                    }
                    for p in held {
                        cuvmm_free(p, 64 << 10, 0, std::ptr::null_mut());
                    }
                });
            }
        });
        let a = allocator(0).unwrap();
        let tag = Tag::new("threads").unwrap();
        let dev_asleep = a.tag_stats(tag).asleep;
        assert_eq!(tag_stats(t).asleep, i32::from(dev_asleep), "the C ABI and the device disagree");
        // SAFETY: a NUL-terminated name.
        unsafe {
            if dev_asleep {
                assert_eq!(cuvmm_wake(t.as_ptr()), 0, "{}", last_error());
            }
            assert_eq!(tag_stats(t).asleep, 0);
            assert!(!a.tag_stats(tag).asleep);
            assert_eq!(cuvmm_sleep(t.as_ptr(), 0), 0, "{}", last_error());
            assert_eq!(cuvmm_wake(t.as_ptr()), 0, "{}", last_error());
        }
    }

    #[test]
    fn sizes_larger_than_the_device_return_null_and_an_error_not_an_abort() {
        in_child_with(
            "sizes_larger_than_the_device_return_null_and_an_error_not_an_abort",
            Some(fake_vmm),
            huge_sizes,
        );
    }

    /// The child of the test above: `cuvmm_malloc(PTRDIFF_MAX)` aborted the process ("memory
    /// allocation of 17592186044416 bytes failed") before the size was checked.
    fn huge_sizes() {
        let memory = 80isize << 30; // the fake device's
        for size in [isize::MAX, isize::MAX - 4095, 1 << 62, 1 << 50, memory + 1] {
            for f in [cuvmm_malloc, cuvmm_pool_malloc] {
                assert!(f(size, 0, std::ptr::null_mut()).is_null(), "{size}");
                let e = last_error();
                assert!(e.contains("more than the device's"), "{size}: {e}");
            }
        }
        let mut stats = CuvmmStats::default();
        // SAFETY: a writable struct.
        assert_eq!(unsafe { cuvmm_get_stats(0, &mut stats) }, 0);
        assert_eq!((stats.reserved, stats.allocations), (0, 0));
        // What the device holds is still served.
        let p = cuvmm_malloc(1 << 20, 0, std::ptr::null_mut());
        assert!(!p.is_null(), "{}", last_error());
        cuvmm_free(p, 1 << 20, 0, std::ptr::null_mut());
        // SAFETY: as above.
        assert_eq!(unsafe { cuvmm_get_stats(0, &mut stats) }, 0);
        assert_eq!((stats.allocations, stats.frees), (1, 1));
    }
}
