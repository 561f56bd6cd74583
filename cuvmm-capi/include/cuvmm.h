/*
 * cuvmm.h: the C ABI of libcuvmm.so, a stream-ordered caching allocator for CUDA device memory
 * built on the driver's virtual memory management.
 *
 * Every function may be called from any thread. Nothing unwinds out of these functions: a failure
 * is logged once to stderr (when logging is on, once per entry point and code) and reported by the
 * return value; the calling thread's last error is available as text from cuvmm_last_error() and
 * as a code from cuvmm_last_error_code().
 *
 * Configuration comes from one environment variable, read at the first call:
 *   CUVMM_ALLOC_CONF="page=128MiB,reserve=160GiB,tag_page=128MiB,log=1,lend=1,trace=/tmp/cuvmm.trace,oom=null"
 * (export_threshold=256MiB: untagged blocks of that size or more are one physical allocation each,
 * exportable as a POSIX descriptor and, with an IMEX channel, a fabric handle; 0, the default: off)
 * (see the README for every key).
 */
#ifndef CUVMM_H
#define CUVMM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA stream (cudaStream_t / CUstream): the same handle for the runtime and the driver. */
typedef struct CUstream_st *cuvmm_stream_t;

/*
 * The allocation functions of PyTorch's pluggable allocator (CUDAPluggableAllocator), for
 * torch.cuda.memory.change_current_allocator: every tensor comes from here. Memory is
 * stream-ordered: a block freed on a stream is reused at once on that stream, and on another
 * stream only once the work queued before the free has completed. Capture-aware: memory handed
 * out while `stream` is being captured into a CUDA graph is kept for that graph (see
 * cuvmm_release_graph_memory), and nothing illegal during capture is called.
 * A stream must be alive during a call that passes it, and may be destroyed at any time after:
 * blocks it freed come back to the others once its work has run (streams are told apart by the
 * driver's stream id, never by handle, and a handle is passed to the driver only during a call
 * that passes it). The per-thread default stream is refused.
 * Returns NULL on failure (out of memory included, unless oom=abort stops the process); size 0
 * returns NULL without error. A size larger than the device's memory is refused (NULL, with
 * cuvmm_last_error) before anything is built for it: no size aborts the process.
 */
void *cuvmm_malloc(ssize_t size, int device, cuvmm_stream_t stream);
void cuvmm_free(void *ptr, ssize_t size, int device, cuvmm_stream_t stream);

/*
 * The same for torch.cuda.MemPool: PyTorch caches blocks inside the segments it gets here and
 * manages CUDA graphs itself, so memory obtained during a capture is not held back for the graph.
 * Out of memory it returns NULL whatever oom= says: PyTorch raises OutOfMemoryError for it.
 */
void *cuvmm_pool_malloc(ssize_t size, int device, cuvmm_stream_t stream);
void cuvmm_pool_free(void *ptr, ssize_t size, int device, cuvmm_stream_t stream);

/* Statistics of one device's allocator; bytes unless named a count. */
typedef struct cuvmm_stats {
    uint64_t live;          /* bytes handed out (block sizes) */
    uint64_t live_peak;
    uint64_t requested;     /* bytes asked for by live allocations */
    uint64_t mapped;        /* physical memory held: mapped pages plus spare ones */
    uint64_t mapped_peak;
    uint64_t reserved;      /* virtual address space reserved */
    uint64_t allocations;   /* count of successful allocations */
    uint64_t frees;
    uint64_t cache_hits;    /* allocations served without mapping memory */
    uint64_t pages_created;
    uint64_t pages_released;
    uint64_t pages_remapped;/* pages moved to where they were needed (idle, or lent) */
    uint64_t events_recorded;
    uint64_t oom_retries;   /* out-of-memory answers retried after releasing idle memory */
    uint64_t graph_held;    /* bytes kept for captured CUDA graphs */
    uint64_t exported;      /* bytes of live blocks shared with other processes (see cuvmm_export) */
    uint64_t freed_shared;  /* bytes of blocks freed while shared, held until their importers let go */
} cuvmm_stats_t;

/* Fills *out for `device`. Returns 0, or -1 (see cuvmm_last_error). */
int cuvmm_get_stats(int device, cuvmm_stats_t *out);
/* Writes the stats of every device used so far as JSON into buf (NUL-terminated when it fits).
 * Returns the length the JSON needs (without the NUL), or -1. */
ssize_t cuvmm_stats_json(char *buf, size_t len);
/* Resets live_peak and mapped_peak to the current values. device -1: every device. */
int cuvmm_reset_peaks(int device);
/* Waits for the device's queued work, then unmaps and releases every idle page. device -1: every
 * device. Refused (-1) while a stream of the device is being captured: the driver refuses the
 * wait, which also ends that capture in error, so do not call it during a capture. */
int cuvmm_empty_cache(int device);
/* Releases the memory kept for CUDA graphs captured through cuvmm_malloc; the caller promises
 * that those graphs were destroyed. device -1: every device. */
int cuvmm_release_graph_memory(int device);

/* PyTorch's pluggable-allocator hooks, each with its hook's signature (they return nothing; a
 * refusal is kept for cuvmm_last_error).
 * cuvmm_empty_cache_all (set_reset_fn, torch.cuda.empty_cache): cuvmm_empty_cache(-1).
 * cuvmm_record_stream (set_record_stream_fn, Tensor.record_stream): the block at `ptr`, of
 *   cuvmm_malloc, is used on `stream` too. Its free records an event on each such stream other
 *   than the free's and the block goes to no request, on any stream, until they have completed
 *   (checked at each request of the device; cuvmm_empty_cache and a request out of memory wait
 *   for them), as PyTorch's caching allocator does; it then is freed on the free's stream, so
 *   that stream and the recorded ones must still be alive then. A recorded stream being
 *   captured runs nothing, so the free does not wait for it; a free captured with it makes its
 *   stream join it in the graph. A `ptr` that is not the start of a live block of cuvmm_malloc
 *   (memory received from another process, inside a block, or freed) is ignored, as PyTorch's
 *   allocator ignores memory it did not hand out; what a block recorded goes with its free.
 * cuvmm_set_memory_fraction (set_memory_fraction_fn, torch.cuda.set_per_process_memory_fraction):
 *   requests that would take the bytes handed out on `device` (cuvmm_stats_t.live) past
 *   `fraction` of its memory fail as out of memory; 1 removes the limit, 0 (or a fraction
 *   rounding to 0 bytes) refuses every request as PyTorch's allocator does, a value outside
 *   0..1 is refused. */
void cuvmm_empty_cache_all(void);
void cuvmm_record_stream(void *ptr, cuvmm_stream_t stream);
void cuvmm_set_memory_fraction(double fraction, int device);

/* Sleep and wake of tagged memory (every device).
 * A tag is asleep from a cuvmm_sleep that returned 0 until a cuvmm_wake that returned 0, for the
 * whole process: on every device, those used before the sleep and those used after it alike,
 * and whether or not it holds memory (a tag never used sleeps too, as in the Rust API).
 * Allocating with a sleeping tag fails (NULL); freeing is allowed.
 * Calls for one tag from several threads: a cuvmm_sleep or cuvmm_wake waits while another sleep
 *   or wake of the same tag is under way, then answers for the state that one left (a wake racing
 *   a sleep wakes the tag the sleep put to sleep; a second sleep is refused as already asleep); a
 *   sleep also waits for allocations with the tag already under way, and allocations that start
 *   after it are refused. cuvmm_get_tag_stats reports a tag asleep from the start of a sleep until
 *   the end of the wake that succeeds.
 * cuvmm_set_tag: later allocations of the calling thread carry this tag (copied; NULL: none).
 *   0; -1 for a name that is empty, too long or not UTF-8 (the thread's tag stays as it was).
 * cuvmm_sleep: waits for queued work, then releases the device memory of every allocation
 *   tagged `tag`, first copying it to the tag's backup (cuvmm_set_backup) when `offload` is
 *   non-zero; addresses stay reserved. 0 on success; -1 when already asleep, during a capture,
 *   or on failure (then the tag is awake, and the devices this call put to sleep are woken again:
 *   an offload's contents come back, discarded ones do not; if waking one of them failed too,
 *   the tag stays asleep until a cuvmm_wake wakes it).
 * cuvmm_wake: on every device where the tag holds sleeping memory, maps memory again at the same
 *   addresses and restores offloaded contents. 0 on success; -1 when the tag is not asleep
 *   (never put to sleep, or woken already), or on failure (out of memory included): the devices
 *   woken before the failure stay awake, the others stay asleep with nothing lost, the tag stays
 *   asleep, and a later call wakes the rest. */
int cuvmm_set_tag(const char *tag);
int cuvmm_sleep(const char *tag, int offload);
int cuvmm_wake(const char *tag);
/* Where `tag`'s later offloading sleeps keep its contents, on every device:
 *   backend 0: pageable host memory, through a staging ring (the default; no memory pinned
 *              beyond the ring);
 *   backend 1: pinned host memory as large as the tag;
 *   backend 2: a file in directory `dir` (created at sleep, removed at wake).
 * `retain` non-zero keeps the backup (host memory or file) after a wake, for the next sleep;
 * zero releases it at wake. 0, or -1 (unknown backend, no `dir` for backend 2, `dir` not a
 * directory), changing nothing. */
int cuvmm_set_backup(const char *tag, int backend, int retain, const char *dir);
/* Gets `tag`'s backup ready for its first offloading sleep, in the background, on every device
 * where it holds memory: pageable host memory as large as that sleep would copy now is faulted in
 * and left for the kernel to take back only if it needs it (as a wake leaves a backup), so that
 * the first sleep writes into pages the kernel kept; for a pageable or disk backup it also makes
 * the staging ring those sleeps copy through (64 MiB pinned, kept as after a first sleep), on a
 * thread of its own. Call it once the tag holds what it will sleep with. The bytes being prepared
 * (0: nothing to copy, a backup that is not pageable memory or is retained, or not that much host
 * memory available), or -1 (the tag asleep, a bad name).
 * Where it pays: the first offloading sleep of a process into pageable memory. Unprepared, that
 * sleep faults fresh host memory in (the kernel zeroes every page) and pins the ring while it
 * copies: 1.9-2.3x the pinned copy of the same bytes on a 16-core H200 host, against 1.15-1.22x
 * prepared and about 1.1x for later sleeps, which write into the backup the last wake released
 * lazily. It pins nothing beyond the ring; until the first sleep the process holds the memory
 * as a lazily released backup, counted as resident, which the kernel takes back first when it
 * needs memory. Nothing is gained for a tag only ever discarded, a pinned backup, or a retained
 * one after its first sleep. */
int64_t cuvmm_prepare_backup(const char *tag);
/* Bytes of host memory cuvmm holds pinned now: staging rings and pinned backups. */
uint64_t cuvmm_pinned_bytes(void);

typedef struct cuvmm_tag_stats {
    uint64_t live;       /* bytes handed out under the tag */
    uint64_t mapped;     /* device memory the tag holds now (0 while asleep) */
    uint64_t offloaded;  /* bytes held in the tag's backup while asleep */
    int32_t asleep;      /* 1 while asleep (see cuvmm_sleep) */
    int32_t reserved_;
} cuvmm_tag_stats_t;
int cuvmm_get_tag_stats(const char *tag, cuvmm_tag_stats_t *out);

/* Sharing blocks with other processes (what cuvmm.torch's torch.multiprocessing support uses).
 * cuvmm_owner: 1 when the live block holding `ptr` (anywhere inside it) came from this library on
 *   `device`, with its address and size in *block and *len (each may be NULL); 0 when not (also
 *   in a process that never allocated through cuvmm); -1 on failure.
 * cuvmm_export: shares that block: one POSIX file descriptor per physical page under it in fds
 *   (the caller owns and closes them; pages also hold the block's neighbours, as legacy CUDA IPC
 *   shares a whole segment) and the layout in *out. Each page's first export is kept with the page
 *   until the allocator gives it back, so sharing the same block again costs no driver export.
 *   Returns the page count; when it is larger than `cap` nothing is shared and the call may be
 *   repeated. -1 on failure (a tag asleep, a device without POSIX-fd export). Once its importers have released it, call cuvmm_unexport (once per
 *   export). Until then its bytes count in cuvmm_stats_t.exported and its tag refuses to sleep.
 *   A shared block may be freed before then: its memory (addresses and pages) stays out of every
 *   later allocation, its bytes move to cuvmm_stats_t.freed_shared, and the last cuvmm_unexport
 *   frees it, so that no new block lands on memory an importer still reads and writes.
 * cuvmm_import: maps `count` exported pages of `page` bytes (fds, in address order) side by side
 *   on `device`, the device they were made on, with read-write access for it and for the `npeers`
 *   devices in `peers` (each must reach it; a peer's primary context is retained, so name only
 *   devices the process uses); *base gets the address of the first page. Returns a handle, or
 *   NULL. The descriptors stay the caller's.
 * cuvmm_import_release: waits for the work of those devices, then unmaps. */
typedef struct cuvmm_export {
    uint64_t block;       /* the block's address */
    uint64_t len;         /* its size */
    uint64_t first_page;  /* address of the first page under it; the others follow without gaps */
    uint64_t page;        /* bytes per page */
    uint64_t count;       /* pages */
} cuvmm_export_t;
int cuvmm_owner(int device, const void *ptr, uint64_t *block, uint64_t *len);
ssize_t cuvmm_export(int device, const void *ptr, cuvmm_export_t *out, int *fds, size_t cap);
/* cuvmm_export, also writing each page's serial into pages (room for cap): the same serial names
 * the same physical memory of this process, and a serial never comes back, so an importer that
 * kept a mapping of pages with these serials from this process may use it again. */
ssize_t cuvmm_export_pages(int device, const void *ptr, cuvmm_export_t *out, int *fds, uint64_t *pages,
                           size_t cap);
/* cuvmm_export_mark: marks the block holding ptr shared as cuvmm_export_pages does (one
 * cuvmm_unexport each), but writes no descriptor: the layout in *out and each page's serial in
 * pages. An importer that already maps pages of these serials from this process needs nothing
 * more; for one that does not, cuvmm_export_fds gives the descriptors (one per page, in address
 * order; the caller closes them) of a block still marked, freed meanwhile or not. Each returns
 * the page count; more than cap: nothing done, call again with room enough. -1 on failure. */
ssize_t cuvmm_export_mark(int device, const void *ptr, cuvmm_export_t *out, uint64_t *pages, size_t cap);
ssize_t cuvmm_export_fds(int device, uint64_t block, int *fds, size_t cap);
int cuvmm_unexport(int device, uint64_t block);
void *cuvmm_import(int device, const int *fds, size_t count, uint64_t page, const int *peers, size_t npeers,
                   uint64_t *base);
int cuvmm_import_release(void *import);

/* The hand-off: a block handed to another process as PyTorch's CUDA IPC hands a tensor over,
 * without pidfd_getfd or privileges (docs/WIRE.md, "The hand-off"; what cuvmm.torch uses).
 * cuvmm_offer: offers the live block of `device` holding `ptr` to one receiver; its ticket (the
 *   bytes that take it: send them to that receiver only) goes into `ticket` and the block's
 *   address into *block (may be NULL). Offers of one non-zero `group` go together to the first
 *   receiver that takes any of them. The block stays out of every later allocation, even once
 *   freed here, until its receiver lets go or exits. Returns the ticket's length; more than cap:
 *   nothing offered, call again with room enough. -1 on failure.
 * cuvmm_withdraw: lets go of an offer nobody has taken (its ticket was never sent). 1 if it did,
 *   0 if it was taken already, -1 on failure.
 * cuvmm_take: takes a ticket's offer, waiting at most timeout_s for its sender, and maps the
 *   block on the device that holds it (written to *device), granting the `npeers` devices in
 *   `peers` access too; *block gets its address here. The same block handed over again is
 *   claimed with one message: the mapping is kept while the sender keeps the pages, and unmapped
 *   as soon as the sender gives them back to the device. Returns a lease, or NULL.
 * cuvmm_lease_release: lets go of a lease once the work queued so far on the `n` streams at
 *   `streams` is done (n == 0: the device's work). Never blocks: the library's thread waits on
 *   events, then tells the sender. If that wait fails, the memory stays held and mapped.
 * cuvmm_let_go: tells a ticket's sender it will not be taken.
 * cuvmm_ticket_len: the size of the block a ticket offers (its fields checked), in *block_len.
 * cuvmm_handoff_prepare: starts the hand-off's threads (and room for descriptors) now, so that a
 *   first hand-off does not wait for them. */
typedef struct cuvmm_handoff_stats {
    uint64_t offered;       /* sender: offers not taken yet */
    uint64_t held;          /* sender: offers taken and not let go */
    uint64_t connections;   /* sender: receiving processes connected */
    uint64_t expired;       /* sender: offers let go untaken after their time to live */
    uint64_t revocations;   /* sender: pages revoked from receivers (given back while mapped there) */
    uint64_t let_go;        /* sender: offers let go */
    uint64_t leases;        /* receiver: leases not released */
    uint64_t kept;          /* receiver: mappings kept (in use, or idle while the sender keeps them) */
    uint64_t kept_bytes;    /* receiver: their bytes */
    uint64_t releasing;     /* receiver: releases waiting for the work that used their memory */
    uint64_t held_for_good; /* receiver: releases whose wait failed, held until exit */
    uint64_t revoked;       /* receiver: mappings unmapped because their sender gave the pages back */
    uint64_t senders;       /* receiver: connections to sending processes */
} cuvmm_handoff_stats_t;
int cuvmm_handoff_prepare(void);
ssize_t cuvmm_offer(int device, const void *ptr, uint64_t group, uint8_t *ticket, size_t cap, uint64_t *block);
int cuvmm_withdraw(const uint8_t *ticket, size_t len);
void *cuvmm_take(const uint8_t *ticket, size_t len, const int *peers, size_t npeers, double timeout_s, int *device,
                 uint64_t *block);
int cuvmm_lease_release(void *lease, const cuvmm_stream_t *streams, size_t n);
int cuvmm_let_go(const uint8_t *ticket, size_t len, double timeout_s);
int cuvmm_ticket_len(const uint8_t *ticket, size_t len, uint64_t *block_len);
int cuvmm_handoff_stats(cuvmm_handoff_stats_t *out);

/* Memory snapshots. cuvmm_snapshot_json writes every heap and block of `device` (-1: every device
 * used so far) as JSON into buf (NUL-terminated when it fits): {"<device>": [{"address", "small",
 * "tag" (name or null), "asleep", "page", "blocks": [{"address", "size", "requested", "graph_pool",
 * "stream", "state": "live" | "free" | "freed_shared"}]}]}. Returns the length the JSON needs
 * (without the NUL), or -1. cuvmm_set_alloc_observer: `observer` is called after every allocation
 * that succeeds and before every free (kind 'a' or 'f'), on the calling thread, with no lock of
 * cuvmm held, until it is replaced (NULL: none). Returns 0. */
typedef void (*cuvmm_alloc_observer_t)(int kind, int device, uint64_t ptr, ssize_t size, cuvmm_stream_t stream);
ssize_t cuvmm_snapshot_json(int device, char *buf, size_t len);
int cuvmm_set_alloc_observer(cuvmm_alloc_observer_t observer);

/* Writes the allocation trace (trace= in CUVMM_ALLOC_CONF) out now; it is also written at exit. */
void cuvmm_trace_flush(void);

/* Which errors are written to stderr (each kind once, when logging is on): CUVMM_LOG_ALL (the
 * default), or CUVMM_LOG_UNRETURNED, for a caller that reports every error a return value gives
 * (the Python package raises them): then only those of cuvmm_free, cuvmm_pool_free and
 * cuvmm_pool_malloc, whose callers never see the text. Returns 0, or -1 for another mode. */
#define CUVMM_LOG_ALL 0
#define CUVMM_LOG_UNRETURNED 1
int cuvmm_set_error_log(int mode);

/* The calling thread's last error as text (valid until its next cuvmm call), or NULL. */
const char *cuvmm_last_error(void);

/* What kind of error the calling thread's last one is (the one cuvmm_last_error describes), for
 * a caller that acts on it rather than on its text. The numbers never change; new codes may be
 * added (treat an unknown one as CUVMM_ERROR_INTERNAL). */
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

/* The code of the calling thread's last error (a cuvmm_error_t), CUVMM_OK when it has met none. */
int cuvmm_last_error_code(void);

#ifdef __cplusplus
}
#endif
#endif
