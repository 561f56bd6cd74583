/*
 * cuvmm.h: the C ABI of libcuvmm.so, a stream-ordered caching allocator for CUDA device memory
 * built on the driver's virtual memory management.
 *
 * Every function may be called from any thread. Nothing unwinds out of these functions: a failure
 * is logged once to stderr (when logging is on) and reported by the return value; the text of the
 * calling thread's last error is available from cuvmm_last_error().
 *
 * Configuration comes from one environment variable, read at the first call:
 *   CUVMM_ALLOC_CONF="page=128MiB,reserve=160GiB,tag_page=128MiB,log=1,lend=1,trace=/tmp/cuvmm.trace,oom=null"
 * (export_threshold=256MiB: untagged blocks of that size or more are one physical allocation each,
 * exportable as a POSIX descriptor and, with an IMEX channel, a fabric handle; 0, the default: off)
 * (see the README for every key).
 */

#ifndef CUVMM_H
#define CUVMM_H

/* Generated from cuvmm-capi/src by cbindgen (tools/gen-header): edit the Rust declarations, not this file. */

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
/* A CUDA stream (cudaStream_t / CUstream): the same handle for the runtime and the driver. */
typedef struct CUstream_st *cuvmm_stream_t;

/* Modes of cuvmm_set_error_log. */
#define CUVMM_LOG_ALL 0
#define CUVMM_LOG_UNRETURNED 1

/* What the calling thread's last error was (cuvmm_last_error_code). The numbers are the ABI:
 * never renumbered, only added to (treat an unknown one as CUVMM_ERROR_INTERNAL). */
typedef enum cuvmm_error {
    CUVMM_OK = 0,                       /* no error on this thread yet */
    CUVMM_ERROR_INVALID_ARGUMENT = 1,   /* refused, nothing changed (a tag asleep included) */
    CUVMM_ERROR_OUT_OF_MEMORY = 2,      /* the driver's, larger than the device, or past the memory fraction */
    CUVMM_ERROR_DRIVER = 3,             /* another error of a driver call */
    CUVMM_ERROR_NO_DRIVER = 4,          /* no usable CUDA driver */
    CUVMM_ERROR_UNSUPPORTED = 5,        /* the driver, device or machine lacks a feature */
    CUVMM_ERROR_OS = 6,                 /* an operating-system call failed */
    CUVMM_ERROR_PROTOCOL = 7,           /* a peer's message or connection was malformed or refused */
    CUVMM_ERROR_PEER_REFUSED = 8,       /* a peer's credentials are not those the policy accepts */
    CUVMM_ERROR_TIMEOUT = 9,            /* a peer did not answer in time */
    CUVMM_ERROR_IN_HOST_FUNCTION = 10,  /* a driver call from a stream host function */
    CUVMM_ERROR_INTERNAL = 11           /* an internal error (a panic caught) */
} cuvmm_error_t;

/**
 * What a tag holds on every device together (cuvmm_get_tag_stats).
 */
typedef struct {
    /**
     * Bytes handed out under the tag.
     */
    uint64_t live;
    /**
     * Device memory the tag holds now (0 while asleep).
     */
    uint64_t mapped;
    /**
     * Bytes held in the tag's backup while asleep.
     */
    uint64_t offloaded;
    /**
     * 1 while asleep (see cuvmm_sleep).
     */
    int32_t asleep;
    /**
     * Padding, 0.
     */
    int32_t reserved_;
} cuvmm_tag_stats_t;

/**
 * Where a shared block lies (cuvmm_export, cuvmm_export_pages, cuvmm_export_mark).
 */
typedef struct {
    /**
     * The block's address.
     */
    uint64_t block;
    /**
     * Its size.
     */
    uint64_t len;
    /**
     * Address of the first page under it; the others follow without gaps.
     */
    uint64_t first_page;
    /**
     * Bytes per page.
     */
    uint64_t page;
    /**
     * Pages.
     */
    uint64_t count;
} cuvmm_export_t;

/**
 * The hand-off's counters in this process (cuvmm_handoff_stats): the sender's, then the receiver's.
 */
typedef struct {
    /**
     * Sender: offers not taken yet.
     */
    uint64_t offered;
    /**
     * Sender: offers taken and not let go.
     */
    uint64_t held;
    /**
     * Sender: receiving processes connected.
     */
    uint64_t connections;
    /**
     * Sender: offers let go untaken after their time to live.
     */
    uint64_t expired;
    /**
     * Sender: pages revoked from receivers (given back while mapped there).
     */
    uint64_t revocations;
    /**
     * Sender: offers let go.
     */
    uint64_t let_go;
    /**
     * Receiver: leases not released.
     */
    uint64_t leases;
    /**
     * Receiver: mappings kept (in use, or idle while the sender keeps them).
     */
    uint64_t kept;
    /**
     * Receiver: their bytes.
     */
    uint64_t kept_bytes;
    /**
     * Receiver: releases waiting for the work that used their memory.
     */
    uint64_t releasing;
    /**
     * Receiver: releases whose wait failed, held until exit.
     */
    uint64_t held_for_good;
    /**
     * Receiver: mappings unmapped because their sender gave the pages back.
     */
    uint64_t revoked;
    /**
     * Receiver: connections to sending processes.
     */
    uint64_t senders;
} cuvmm_handoff_stats_t;

/**
 * Told of an allocation (`kind` 'a') or a free ('f'): device, address, size and stream handle.
 */
typedef void (*cuvmm_alloc_observer_t)(int kind,
                                       int device,
                                       uint64_t ptr,
                                       ptrdiff_t size,
                                       cuvmm_stream_t stream);

/**
 * Counters, in bytes unless named a count. Laid out as `cuvmm_stats_t` of the C header.
 */
typedef struct {
    /**
     * Bytes handed out (block sizes, multiples of 512).
     */
    uint64_t live;
    /**
     * The largest `live` since the last reset. Requests and frees served by a stream's own
     * cache count there, with the highest and lowest point they reached, until the allocator
     * adds them up (at each request or free that takes its device-wide lock, and at each read
     * of the counters); the peak is then each stream's highest point with every other stream at
     * its lowest. Exact while requests come from one stream at a time; otherwise a lower bound.
     */
    uint64_t live_peak;
    /**
     * Bytes asked for by live allocations.
     */
    uint64_t requested;
    /**
     * Physical memory held: pages mapped plus spare pages.
     */
    uint64_t mapped;
    /**
     * The largest `mapped` since the last reset.
     */
    uint64_t mapped_peak;
    /**
     * Address space reserved.
     */
    uint64_t reserved;
    /**
     * Successful allocations.
     */
    uint64_t allocations;
    /**
     * Frees.
     */
    uint64_t frees;
    /**
     * Allocations served without mapping a page.
     */
    uint64_t cache_hits;
    /**
     * Pages created with the driver.
     */
    uint64_t pages_created;
    /**
     * Pages given back to the driver.
     */
    uint64_t pages_released;
    /**
     * Pages moved to where they were needed: idle ones unmapped, or pages of blocks a stream
     * freed lent to that stream's next blocks.
     */
    uint64_t pages_remapped;
    /**
     * Events recorded to learn when freed blocks became idle.
     */
    uint64_t events_recorded;
    /**
     * Page creations refused for lack of memory and retried after freeing idle memory.
     */
    uint64_t oom_retries;
    /**
     * Bytes kept for captured CUDA graphs (free inside graph pools, or live there).
     */
    uint64_t graph_held;
    /**
     * Bytes of live blocks shared with other processes (exported, not yet let go by their
     * importers): counted in `live` too, since the exporter keeps them allocated meanwhile.
     */
    uint64_t exported;
    /**
     * Bytes of blocks freed while still shared: neither live nor exported, and kept (their
     * addresses and pages) out of every later allocation until their importers let go, so that
     * no new block lands on memory another process still reads and writes.
     */
    uint64_t freed_shared;
} cuvmm_stats_t;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Allocates `size` bytes on `device` for work on `stream`: the allocation function of PyTorch's
 * pluggable allocator (CUDAPluggableAllocator), for torch.cuda.memory.change_current_allocator:
 * every tensor comes from here. Memory is stream-ordered: a block freed on a stream is reused at
 * once on that stream, and on another stream only once the work queued before the free has
 * completed. Capture-aware: memory handed out while `stream` is being captured into a CUDA graph
 * is kept for that graph (see cuvmm_release_graph_memory), and nothing illegal during capture is
 * called.
 * A stream must be alive during a call that passes it, and may be destroyed at any time after:
 * blocks it freed come back to the others once its work has run (streams are told apart by the
 * driver's stream id, never by handle, and a handle is passed to the driver only during a call
 * that passes it). The per-thread default stream is refused.
 * Returns NULL on failure (out of memory included, unless oom=abort stops the process); size 0
 * returns NULL without error. A size larger than the device's memory is refused (NULL, with
 * cuvmm_last_error) before anything is built for it: no size aborts the process.
 */
void *cuvmm_malloc(ptrdiff_t size, int device, cuvmm_stream_t stream);

/**
 * Frees a block of cuvmm_malloc on `stream` (the free function of the same pair).
 */
void cuvmm_free(void *ptr, ptrdiff_t size, int device, cuvmm_stream_t stream);

/**
 * cuvmm_malloc for torch.cuda.MemPool: PyTorch caches blocks inside the segments it gets here and
 * manages CUDA graphs itself, so memory obtained during a capture is not held back for the graph.
 * Out of memory it returns NULL whatever oom= says: PyTorch raises OutOfMemoryError for it.
 */
void *cuvmm_pool_malloc(ptrdiff_t size, int device, cuvmm_stream_t stream);

/**
 * Frees a segment of cuvmm_pool_malloc.
 */
void cuvmm_pool_free(void *ptr, ptrdiff_t size, int device, cuvmm_stream_t stream);

/**
 * Fills `*out` with the statistics of `device`'s allocator. Returns 0, or -1 (see
 * cuvmm_last_error).
 *
 * # Safety
 * `out` must be valid for writing a `cuvmm_stats_t` (or null, which is refused).
 */
int cuvmm_get_stats(int device, cuvmm_stats_t *out);

/**
 * Writes the stats of every device used so far as JSON into `buf` (NUL-terminated when it fits).
 * Returns the length the JSON needs (without the NUL), or -1.
 *
 * # Safety
 * `buf` must be valid for writing `len` bytes (or null with `len` 0, to ask the length).
 */
ptrdiff_t cuvmm_stats_json(char *buf, size_t len);

/**
 * Resets live_peak and mapped_peak to the current values. device -1: every device.
 */
int cuvmm_reset_peaks(int device);

/**
 * Waits for the device's queued work, then unmaps and releases every idle page. device -1: every
 * device. Refused (-1) while a stream of the device is being captured: the driver refuses the
 * wait, which also ends that capture in error, so do not call it during a capture.
 */
int cuvmm_empty_cache(int device);

/**
 * Releases the memory kept for CUDA graphs captured through cuvmm_malloc; the caller promises
 * that those graphs were destroyed. device -1: every device.
 */
int cuvmm_release_graph_memory(int device);

/**
 * Sleep and wake of tagged memory (every device).
 * A tag is asleep from a cuvmm_sleep that returned 0 until a cuvmm_wake that returned 0, for the
 * whole process: on every device, those used before the sleep and those used after it alike,
 * and whether or not it holds memory (a tag never used sleeps too, as in the Rust API).
 * Allocating with a sleeping tag fails (NULL); freeing is allowed.
 * Calls for one tag from several threads: a cuvmm_sleep or cuvmm_wake waits while another sleep
 * or wake of the same tag is under way, then answers for the state that one left (a wake racing
 * a sleep wakes the tag the sleep put to sleep; a second sleep is refused as already asleep); a
 * sleep also waits for allocations with the tag already under way, and allocations that start
 * after it are refused. cuvmm_get_tag_stats reports a tag asleep from the start of a sleep until
 * the end of the wake that succeeds.
 *
 * cuvmm_set_tag: later allocations of the calling thread carry this tag (copied; NULL: none).
 * 0; -1 for a name that is empty, too long or not UTF-8 (the thread's tag stays as it was).
 *
 * # Safety
 * `tag` must be null or a NUL-terminated string.
 */
int cuvmm_set_tag(const char *tag);

/**
 * Waits for queued work, then releases the device memory of every allocation tagged `tag`, first
 * copying it to the tag's backup (cuvmm_set_backup) when `offload` is non-zero; addresses stay
 * reserved. 0 on success; -1 when already asleep, during a capture, or on failure (then the tag
 * is awake, and the devices this call put to sleep are woken again: an offload's contents come
 * back, discarded ones do not; if waking one of them failed too, cuvmm_last_error says so and the
 * tag stays asleep until a cuvmm_wake wakes it).
 *
 * # Safety
 * `tag` must be a NUL-terminated string.
 */
int cuvmm_sleep(const char *tag, int offload);

/**
 * On every device where the tag holds sleeping memory, maps memory again at the same addresses
 * and restores offloaded contents. 0 on success; -1 when the tag is not asleep (never put to
 * sleep, or woken already), or on failure (out of memory included): the devices woken before the
 * failure stay awake, the others stay asleep with nothing lost, the tag stays asleep, and a later
 * call wakes the rest.
 *
 * # Safety
 * `tag` must be a NUL-terminated string.
 */
int cuvmm_wake(const char *tag);

/**
 * Where `tag`'s later offloading sleeps keep its contents, on every device:
 *   backend 0: pageable host memory, through a staging ring (the default; no memory pinned
 *              beyond the ring);
 *   backend 1: pinned host memory as large as the tag;
 *   backend 2: a file in directory `dir` (created at sleep, removed at wake).
 * `retain` non-zero keeps the backup (host memory or file) after a wake, for the next sleep;
 * zero releases it at wake. 0, or -1 (unknown backend, no `dir` for backend 2, `dir` not a
 * directory), changing nothing.
 *
 * # Safety
 * `tag` must be a NUL-terminated string; `dir` null or one.
 */
int cuvmm_set_backup(const char *tag, int backend, int retain, const char *dir);

/**
 * Gets `tag`'s backup ready for its first offloading sleep, in the background, on every device
 * where it holds memory: pageable host memory as large as that sleep would copy now is faulted in
 * and left for the kernel to take back only if it needs it (as a wake leaves a backup), so that
 * the first sleep writes into pages the kernel kept; for a pageable or disk backup it also makes
 * the staging ring those sleeps copy through (64 MiB pinned, kept as after a first sleep), on a
 * thread of its own. Call it once the tag holds what it will sleep with. The bytes being prepared
 * (0: nothing to copy, a backup that is not pageable memory or is retained, or not that much host
 * memory available), or -1 (the tag asleep, a bad name).
 * Where it pays: the first offloading sleep of a process into pageable memory. Unprepared, that
 * sleep faults fresh host memory in (the kernel zeroes every page) and pins the ring while it
 * copies, where later sleeps write into the backup the last wake released lazily into a ring
 * already pinned; prepared, it starts as they do (docs/DECISIONS.md, "Preparing the first
 * sleep's backup"). It pins nothing beyond the ring; until the first sleep the process holds the
 * memory as a lazily released backup, counted as resident, which the kernel takes back first
 * when it needs memory. Nothing is gained for a tag only ever discarded, a pinned backup, or a
 * retained one after its first sleep.
 *
 * # Safety
 * `tag` must be a NUL-terminated string.
 */
int64_t cuvmm_prepare_backup(const char *tag);

/**
 * Bytes of host memory cuvmm holds pinned now: staging rings and pinned backups.
 */
uint64_t cuvmm_pinned_bytes(void);

/**
 * Fills `*out` with what `tag` holds on every device together. 0, or -1.
 *
 * # Safety
 * `tag` must be a NUL-terminated string; `out` valid for writing a `cuvmm_tag_stats_t`.
 */
int cuvmm_get_tag_stats(const char *tag, cuvmm_tag_stats_t *out);

/**
 * Sharing blocks with other processes (what cuvmm.torch's torch.multiprocessing support uses).
 *
 * cuvmm_owner: 1 when the live block holding `ptr` (anywhere inside it) came from this library on
 * `device`, with its address and size in `*block` and `*len` (each may be NULL); 0 when not (also
 * in a process that never allocated through cuvmm); -1 on failure.
 *
 * # Safety
 * `block` and `len` must each be null or valid for writing a `uint64_t`.
 */
int cuvmm_owner(int device, const void *ptr, uint64_t *block, uint64_t *len);

/**
 * Shares the live block of `device` holding `ptr`: one POSIX file descriptor per physical page
 * under it in `fds` (the caller owns and closes them; pages also hold the block's neighbours, as
 * legacy CUDA IPC shares a whole segment) and the layout in `*out`. Each page's first export is
 * kept with the page until the allocator gives it back, so sharing the same block again costs no
 * driver export. Returns the page count; when it is larger than `cap` nothing is shared (no
 * descriptor written, no mark kept) and the call may be repeated. -1 on failure (a tag asleep, a
 * device without POSIX-fd export). Once its importers have released it, call cuvmm_unexport (once
 * per export). Until then its bytes count in cuvmm_stats_t.exported and its tag refuses to sleep.
 * A shared block may be freed before then: its memory (addresses and pages) stays out of every
 * later allocation, its bytes move to cuvmm_stats_t.freed_shared, and the last cuvmm_unexport
 * frees it, so that no new block lands on memory an importer still reads and writes.
 *
 * # Safety
 * `out` must be valid for writing a `cuvmm_export_t`; `fds` for writing `cap` ints.
 */
ptrdiff_t cuvmm_export(int device, const void *ptr, cuvmm_export_t *out, int *fds, size_t cap);

/**
 * cuvmm_export, also writing each page's serial into `pages` (room for `cap`): the same serial
 * names the same physical memory of this process, and a serial never comes back, so an importer
 * that kept a mapping of pages with these serials from this process may use it again.
 *
 * # Safety
 * As [`cuvmm_export`]; `pages` must be valid for writing `cap` u64s.
 */
ptrdiff_t cuvmm_export_pages(int device,
                             const void *ptr,
                             cuvmm_export_t *out,
                             int *fds,
                             uint64_t *pages,
                             size_t cap);

/**
 * Marks the block holding `ptr` shared as cuvmm_export_pages does (one cuvmm_unexport each), but
 * writes no descriptor: the layout in `*out` and each page's serial in `pages`. An importer that
 * already maps pages of these serials from this process needs nothing more; for one that does
 * not, cuvmm_export_fds gives the descriptors. Returns the page count; more than `cap`: nothing
 * marked, call again with room enough. -1 on failure.
 *
 * # Safety
 * `out` must be valid for writing a `cuvmm_export_t`; `pages` for writing `cap` u64s.
 */
ptrdiff_t cuvmm_export_mark(int device, const void *ptr, cuvmm_export_t *out, uint64_t *pages, size_t cap);

/**
 * One POSIX descriptor per page under the block at `block` on `device` that cuvmm_export_mark (or
 * cuvmm_export) shared and no cuvmm_unexport has let go yet, in address order, into `fds` (the
 * caller closes them); the block may have been freed since. Returns the page count; more than
 * `cap`: no descriptor written, call again with room enough. -1 on failure (not shared).
 *
 * # Safety
 * `fds` must be valid for writing `cap` ints.
 */
ptrdiff_t cuvmm_export_fds(int device, uint64_t block, int *fds, size_t cap);

/**
 * One sharing of the block at `block` on `device` (cuvmm_export_t.block) is over: its importers
 * released it. 0, or -1 (not shared).
 */
int cuvmm_unexport(int device, uint64_t block);

/**
 * Maps `count` exported pages of `page` bytes (`fds`, in address order) side by side on
 * `device`, the device they were made on, with read-write access for it and for the `npeers`
 * devices in `peers` (each must reach it; a peer's primary context is retained, so name only
 * devices the process uses); `*base` gets the address of the first page. Returns a handle for
 * cuvmm_import_release, or NULL. The descriptors stay the caller's.
 *
 * # Safety
 * `fds` must be valid for reading `count` ints, each an open descriptor; `peers` for reading
 * `npeers` ints (or null with 0); `base` for writing.
 */
void *cuvmm_import(int device,
                   const int *fds,
                   size_t count,
                   uint64_t page,
                   const int *peers,
                   size_t npeers,
                   uint64_t *base);

/**
 * Releases an import of cuvmm_import: waits for the work of the devices that could use it, then
 * unmaps. 0, or -1 for NULL.
 *
 * # Safety
 * `import` must be a handle `cuvmm_import` returned, released once.
 */
int cuvmm_import_release(void *import);

/**
 * Writes the allocation trace (trace= in CUVMM_ALLOC_CONF) out now; it is also written at exit.
 */
void cuvmm_trace_flush(void);

/**
 * Which errors are written to stderr (each kind once, when logging is on): CUVMM_LOG_ALL (the
 * default), or CUVMM_LOG_UNRETURNED, for a caller that reports every error a return value gives
 * (the Python package raises them): then only those of cuvmm_free, cuvmm_pool_free and
 * cuvmm_pool_malloc, whose callers never see the text. Returns 0, or -1 for another mode, which
 * changes nothing.
 */
int cuvmm_set_error_log(int mode);

/**
 * The calling thread's last error as text (valid until its next cuvmm call), or NULL.
 */
const char *cuvmm_last_error(void);

/**
 * The code of the calling thread's last error, the one [`cuvmm_last_error`] describes
 * (`cuvmm_error_t` of cuvmm.h); `CUVMM_OK` (0) when it has met none.
 */
int cuvmm_last_error_code(void);

/**
 * The size of the block a ticket (`len` bytes at `ticket`) offers, its fields checked, in
 * `*block_len`. 0, or -1 for something that is not a ticket.
 *
 * # Safety
 * `ticket` readable for `len` bytes; `block_len` writable.
 */
int cuvmm_ticket_len(const uint8_t *ticket, size_t len, uint64_t *block_len);

/**
 * Starts the hand-off's threads (and room in the descriptor table for a hand-off's page
 * descriptors) now, so that a first hand-off does not wait for them. 0, or -1 on failure.
 */
int cuvmm_handoff_prepare(void);

/**
 * Lets go of an offer nobody has taken (its ticket was never sent). 1 if it did, 0 if it was
 * taken (or let go) already, -1 on failure.
 *
 * # Safety
 * `ticket` readable for `len` bytes.
 */
int cuvmm_withdraw(const uint8_t *ticket, size_t len);

/**
 * The hand-off: a block handed to another process as PyTorch's CUDA IPC hands a tensor over,
 * without pidfd_getfd or privileges (docs/WIRE.md, "The hand-off"; what cuvmm.torch uses).
 *
 * cuvmm_offer: offers the live block of `device` holding `ptr` to one receiver; its ticket (the
 * bytes that take it: send them to that receiver only) goes into `ticket` (`cap` bytes) and the
 * block's address into `*block` (may be NULL). Offers of one non-zero `group` go together to the
 * first receiver that takes any of them. The block stays out of every later allocation, even once
 * freed here, until its receiver lets go or exits. Returns the ticket's length; more than `cap`:
 * nothing offered, call again with room enough. -1 on failure.
 *
 * # Safety
 * `ticket` writable for `cap` bytes; `block` NULL or writable.
 */
ptrdiff_t cuvmm_offer(int device,
                      const void *ptr,
                      uint64_t group,
                      uint8_t *ticket,
                      size_t cap,
                      uint64_t *block);

/**
 * Takes a ticket's offer (`len` bytes at `ticket`), waiting at most `timeout_s` seconds for its
 * sender, and maps the block on the device that holds it (its ordinal written to `*device`),
 * granting the `npeers` devices in `peers` access too; `*block` gets its address here (the
 * sender's address `p` inside the block is `*block + p - b`, `b` the block's address there). The
 * same block handed over again is claimed with one message: the mapping is kept while the sender
 * keeps the pages, and unmapped as soon as the sender gives them back to the device. Returns a
 * lease, held until cuvmm_lease_release, or NULL.
 *
 * # Safety
 * `ticket` readable for `len` bytes; `peers` for `npeers` ints; `device` and `block` writable.
 */
void *cuvmm_take(const uint8_t *ticket,
                 size_t len,
                 const int *peers,
                 size_t npeers,
                 double timeout_s,
                 int *device,
                 uint64_t *block);

/**
 * Lets go of a lease once the work queued so far on the `n` streams at `streams` is done (n == 0:
 * the device's work). Never blocks: the library's thread waits on events, then tells the sender.
 * If that wait fails, the memory stays held and mapped. 0, or -1 on failure (the lease is released
 * all the same, waiting for the device).
 *
 * # Safety
 * `lease` a handle [`cuvmm_take`] returned, released once; `streams` readable for `n` handles,
 * each a live stream of the lease's device (or NULL, the legacy default stream).
 */
int cuvmm_lease_release(void *lease, const cuvmm_stream_t *streams, size_t n);

/**
 * Tells a ticket's sender it will not be taken. 0, or -1 on failure.
 *
 * # Safety
 * `ticket` readable for `len` bytes.
 */
int cuvmm_let_go(const uint8_t *ticket, size_t len, double timeout_s);

/**
 * The hand-off's counters in this process. 0, or -1 for NULL.
 *
 * # Safety
 * `out` writable.
 */
int cuvmm_handoff_stats(cuvmm_handoff_stats_t *out);

/**
 * PyTorch's pluggable-allocator hooks, each with its hook's signature (they return nothing; a
 * refusal is kept for cuvmm_last_error).
 *
 * cuvmm_empty_cache_all (set_reset_fn, torch.cuda.empty_cache): cuvmm_empty_cache(-1): frees the
 * blocks whose frees waited for other streams once that work is done, then gives every idle page
 * of every device used back to the driver.
 */
void cuvmm_empty_cache_all(void);

/**
 * set_record_stream_fn, Tensor.record_stream: the block at `ptr`, of cuvmm_malloc, is used on
 * `stream` too. Its free records an event on each such stream other than the free's and the
 * block goes to no request, on any stream, until they have completed (checked at each request of
 * the device; cuvmm_empty_cache and a request out of memory wait for them), as PyTorch's caching
 * allocator does; it then is freed on the free's stream, so that stream and the recorded ones
 * must still be alive then. A recorded stream being captured runs nothing, so the free does not
 * wait for it; a free captured with it makes its stream join it in the graph. A `ptr` that is not
 * the start of a live block of cuvmm_malloc (memory received from another process, inside a
 * block, or freed) is ignored, as PyTorch's allocator ignores memory it did not hand out; what a
 * block recorded goes with its free.
 */
void cuvmm_record_stream(void *ptr, cuvmm_stream_t stream);

/**
 * set_memory_fraction_fn, torch.cuda.set_per_process_memory_fraction: requests that would take
 * the bytes handed out on `device` (cuvmm_stats_t.live) past `fraction` of its memory fail as out
 * of memory; 1 removes the limit, 0 (or a fraction rounding to 0 bytes) refuses every request as
 * PyTorch's allocator does, a value outside 0..1 is refused.
 */
void cuvmm_set_memory_fraction(double fraction, int device);

/**
 * Calls `observer` after every allocation that succeeds and before every free, on the calling
 * thread, with no lock of cuvmm held; NULL stops. Returns 0.
 *
 * # Safety
 * `observer` must stay callable, from any thread, until it is replaced; it must not unwind.
 */
int cuvmm_set_alloc_observer(cuvmm_alloc_observer_t observer);

/**
 * Writes every heap and block of `device` (-1: every device used so far) as JSON into `buf`
 * (NUL-terminated when it fits): `{"<device>": [segment, ...], ...}`, each segment
 * `{"address", "small", "tag" (name or null), "asleep", "page", "blocks": [{"address", "size",
 * "requested", "graph_pool", "stream", "state": "live" | "free" | "freed_shared"}]}`. Returns
 * the length the JSON needs (without the NUL), or -1.
 *
 * # Safety
 * `buf` must be valid for writing `len` bytes (or null with `len` 0, to ask the length).
 */
ptrdiff_t cuvmm_snapshot_json(int device, char *buf, size_t len);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* CUVMM_H */
