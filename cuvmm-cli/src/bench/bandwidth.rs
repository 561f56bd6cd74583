//! `cuvmm bench bandwidth`: host↔device copies from pageable, pinned and registered memory, and the
//! staged pageable path, 1 MiB to 1 GiB, with the references the staged path is judged against
//! measured in the same run: the pinned DMA and host memcpy on the staging ring's threads. A sweep
//! mode runs the staged path alone for every ring shape asked for, back to back or with the host
//! idle for a while before every timed transfer.

use super::{median, timed};
use crate::common::size::{parse_counts, parse_sizes, show};
use crate::common::CliResult;
use cuvmm::context::Context;
use cuvmm::driver::{driver, result};
use cuvmm::error::Result;
use cuvmm::host::{HostCopy, Staging, StagingConfig, StagingTrace};
use cuvmm::host::{PinnedBuffer, RegisterFlags, Registered};
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::scope;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use serde_json::json;
use std::io::Write;
use std::time::Duration;

/// GB/s (10^9 bytes per second) for one transfer size; `None` where not measured.
#[derive(Clone, Debug, Default)]
pub struct BandwidthRow {
    /// Bytes per transfer.
    pub size: usize,
    /// Repetitions (medians are over these).
    pub reps: usize,
    /// Driver copy from a plain `Vec` (pageable), host→device and device→host (host clock, to completion).
    pub pageable: [f64; 2],
    /// Raw `cuMemcpy*Async` on pinned memory (device events).
    pub pinned_raw: [f64; 2],
    /// cuvmm's scoped copy on the same pinned memory (device events).
    pub pinned: [f64; 2],
    /// cuvmm's scoped copy on registered (formerly pageable) memory (device events).
    pub registered: [f64; 2],
    /// Both directions at once on pinned memory, total bytes moved per second (device events).
    pub bidirectional: f64,
    /// cuvmm's staged pageable path (host clock, to completion), with the first of the host
    /// copies measured.
    pub staged: [f64; 2],
    /// The staged path with each host copy measured, taking turns in the same rounds (the first
    /// is `staged`).
    pub staged_by_copy: Vec<(HostCopy, [f64; 2])>,
    /// The slowest timed staged transfer each way, when the ring traces
    /// ([`Staging::set_tracing`]).
    pub slowest: [Option<StagingTrace>; 2],
    /// Registering plus unregistering `size` bytes, microseconds.
    pub register_us: f64,
    /// Host memcpy on the staging ring's threads in its pieces, pageable to pinned and pinned to
    /// pageable: the staged path's copying side alone (host clock). Not a strict bound: the copy
    /// writes a destination as large as the transfer, the ring a few slots that stay in cache.
    pub memcpy: [f64; 2],
}

fn gbs(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Bytes read to push earlier data out of the host's caches (twice the 300 MiB last-level cache
/// of the largest host this ran on).
const EVICT: usize = 600 << 20;

/// Reads a buffer larger than the host's last-level cache on 8 threads, so that a host-side copy
/// timed next reads its source from memory, as a transfer of data written long ago would: a
/// 64 MiB source copied again and again stays in a large cache and flatters the host copy
/// (docs/PERFORMANCE.md, "Figures behind the defaults").
pub struct Evictor(Vec<u64>);

impl Evictor {
    pub fn new() -> Evictor {
        Evictor((0..EVICT as u64 / 8).collect())
    }

    pub fn evict(&self) {
        let part = self.0.len().div_ceil(8);
        let sum: u64 = std::thread::scope(|sc| {
            let parts: Vec<_> =
                self.0.chunks(part).map(|c| sc.spawn(move || c.iter().fold(0u64, |a, &x| a ^ x))).collect();
            parts.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, |a, x| a ^ x)
        });
        std::hint::black_box(sum);
    }
}

impl Default for Evictor {
    fn default() -> Self {
        Evictor::new()
    }
}

/// No pause before a timed round.
pub const NO_IDLE: Duration = Duration::ZERO;

/// Sleeps `idle` (if any): the host's cores idle before the next timed round, as they do when a
/// program copies now and then rather than back to back.
fn pause(idle: Duration) {
    if !idle.is_zero() {
        std::thread::sleep(idle);
    }
}

fn fresh(v: &mut [u8], seed: u8) {
    for (i, b) in v.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed) | 1;
    }
}

/// Measures every size in `sizes` (bytes), each `reps` times after one warm-up; the staged path
/// with each of `copies` (the ring's own when empty), taking turns. The largest size bounds the
/// buffers allocated: two pinned, two pageable, one device buffer of that size.
pub fn run(
    ctx: &Context,
    sizes: &[usize],
    reps: usize,
    staging: &mut Staging,
    copies: &[HostCopy],
) -> Result<Vec<BandwidthRow>> {
    let max = *sizes.iter().max().ok_or_else(|| crate::bench::invalid("no sizes"))?;
    if reps == 0 || sizes.contains(&0) {
        return Err(crate::bench::invalid("sizes and reps must be positive"));
    }
    let own = [staging.config().host_copy];
    let copies = if copies.is_empty() { &own[..] } else { copies };
    let mut paths = Paths::new(ctx, max)?;
    let evictor = Evictor::new();
    let mut rows = Vec::new();
    for &size in sizes {
        let mut row = BandwidthRow { size, reps, ..Default::default() };
        let Paths { pin_src, pin_dst, page_src, page_dst, .. } = &mut paths;
        let host = HostTurns {
            threads: staging.threads(),
            piece: staging.config().piece,
            reps,
            evictor: &evictor,
            idle: NO_IDLE,
        };
        row.memcpy = [
            host.memcpy_gbs(&page_src[..size], &mut pin_dst[..size]),
            host.memcpy_gbs(&pin_src[..size], &mut page_dst[..size]),
        ];
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 10];
        for rep in 0..=reps {
            let [pageable_h2d, pageable_d2h] = paths.pageable(size)?;
            let [raw_h2d, raw_d2h] = paths.pinned_raw(size)?;
            let [pinned_h2d, pinned_d2h] = paths.pinned(size)?;
            let both = paths.both_ways(size)?;
            let ([registered_h2d, registered_d2h], register_us) = paths.registered(size)?;
            // The first round warms up.
            if rep > 0 {
                let round = [
                    pageable_h2d,
                    pageable_d2h,
                    raw_h2d,
                    raw_d2h,
                    pinned_h2d,
                    pinned_d2h,
                    both,
                    registered_h2d,
                    registered_d2h,
                    register_us,
                ];
                for (sample, value) in samples.iter_mut().zip(round) {
                    sample.push(value);
                }
            }
        }
        let staged = paths.staged(staging, size, reps, &evictor, copies)?;
        (row.staged, row.slowest) = staged[0].1.clone();
        row.staged_by_copy = staged.iter().map(|(c, (gbs, _))| (*c, *gbs)).collect();
        let m = |i: usize| median(&samples[i]);
        row.pageable = [m(0), m(1)];
        row.pinned_raw = [m(2), m(3)];
        row.pinned = [m(4), m(5)];
        row.bidirectional = m(6);
        row.registered = [m(7), m(8)];
        row.register_us = m(9);
        rows.push(row);
    }
    Ok(rows)
}

/// The streams, events and buffers (of the largest size) that every path of [`run`] is timed with.
struct Paths<'c> {
    ctx: &'c Context,
    s1: Stream,
    s2: Stream,
    e0: Event,
    e1: Event,
    e2: Event,
    dev: DeviceBuffer<u8>,
    dev2: DeviceBuffer<u8>,
    pin_src: PinnedBuffer<u8>,
    pin_dst: PinnedBuffer<u8>,
    page_src: Vec<u8>,
    page_dst: Vec<u8>,
    // Registration gets buffers of its own: pinning and unpinning must not change the pageable
    // buffers the driver's and the staged paths are measured on.
    reg_src: Vec<u8>,
    reg_dst: Vec<u8>,
}

impl<'c> Paths<'c> {
    fn new(ctx: &'c Context, max: usize) -> Result<Paths<'c>> {
        let mut paths = Paths {
            ctx,
            s1: Stream::non_blocking(ctx)?,
            s2: Stream::non_blocking(ctx)?,
            e0: Event::new(ctx)?,
            e1: Event::new(ctx)?,
            e2: Event::new(ctx)?,
            dev: DeviceBuffer::<u8>::new(ctx, max)?,
            dev2: DeviceBuffer::<u8>::new(ctx, max)?,
            pin_src: PinnedBuffer::<u8>::new(ctx, max)?,
            pin_dst: PinnedBuffer::<u8>::new(ctx, max)?,
            page_src: vec![0u8; max],
            page_dst: vec![0u8; max],
            reg_src: vec![0u8; max],
            reg_dst: vec![0u8; max],
        };
        fresh(&mut paths.pin_src, 3);
        fresh(&mut paths.page_src, 5);
        fresh(&mut paths.reg_src, 7);
        fresh(&mut paths.reg_dst, 9);
        Ok(paths)
    }

    /// Device-timed, seconds: records e0, queues the copy, records e1, waits.
    fn timed_on(&self, stream: &Stream, go: &dyn Fn() -> Result<()>) -> Result<f64> {
        self.e0.record(stream)?;
        go()?;
        self.e1.record(stream)?;
        self.e1.synchronize()?;
        Ok(self.e0.elapsed_ms(&self.e1)? as f64 / 1e3)
    }

    /// Pageable, through the driver, each way: host clock to completion, GB/s.
    fn pageable(&mut self, size: usize) -> Result<[f64; 2]> {
        let api = driver()?.api();
        let Paths { s1, dev, page_src, page_dst, .. } = self;
        let dptr = dev.ptr();
        let (r, t) = timed(|| -> Result<()> {
            // SAFETY: page_src holds `size` bytes; dev holds `max` >= size; the stream is synced.
            unsafe { result::mem::memcpy_htod_async(api, dptr, page_src.as_ptr().cast(), size, s1.raw()) }?;
            s1.synchronize()
        });
        r?;
        let h2d = gbs(size, t.as_secs_f64());
        let (r, t) = timed(|| -> Result<()> {
            // SAFETY: page_dst holds `size` bytes; synced before page_dst is touched again.
            unsafe {
                result::mem::memcpy_dtoh_async(api, page_dst.as_mut_ptr().cast(), dptr, size, s1.raw())
            }?;
            s1.synchronize()
        });
        r?;
        Ok([h2d, gbs(size, t.as_secs_f64())])
    }

    /// Pinned, raw driver calls, each way: GB/s.
    fn pinned_raw(&mut self, size: usize) -> Result<[f64; 2]> {
        let api = driver()?.api();
        let (s1, dptr, pin_src) = (&self.s1, self.dev.ptr(), &self.pin_src);
        // SAFETY: pinned buffers of `max` bytes; each timing synchronises before the next use.
        let t = self.timed_on(s1, &|| unsafe {
            result::mem::memcpy_htod_async(api, dptr, pin_src.as_ptr().cast(), size, s1.raw())
        })?;
        let h2d = gbs(size, t);
        let pd = self.pin_dst.as_mut_ptr() as usize;
        // SAFETY: as above.
        let t = self.timed_on(s1, &|| unsafe {
            result::mem::memcpy_dtoh_async(api, pd as *mut _, dptr, size, s1.raw())
        })?;
        Ok([h2d, gbs(size, t)])
    }

    /// Pinned, through cuvmm's scope, each way: GB/s.
    fn pinned(&mut self, size: usize) -> Result<[f64; 2]> {
        let Paths { s1, e0, e1, dev, pin_src, pin_dst, .. } = self;
        let t = scope(|s| {
            e0.record(s1)?;
            s.copy_to_device(s1, &pin_src[..size], dev.as_mut_slice().slice_mut(0..size)?)?;
            e1.record(s1)?;
            Ok(())
        })
        .and_then(|()| e0.elapsed_ms(e1))?;
        let h2d = gbs(size, t as f64 / 1e3);
        let t = scope(|s| {
            e0.record(s1)?;
            let _ = s.copy_to_host(s1, dev.as_slice().slice(0..size)?, &mut pin_dst[..size])?;
            e1.record(s1)?;
            Ok(())
        })
        .and_then(|()| e0.elapsed_ms(e1))?;
        Ok([h2d, gbs(size, t as f64 / 1e3)])
    }

    /// Both directions at once, H2D on s1 and D2H on s2, from one start to the later end: GB/s
    /// of both together.
    fn both_ways(&mut self, size: usize) -> Result<f64> {
        let Paths { s1, s2, e0, e1, e2, dev, dev2, pin_src, pin_dst, .. } = self;
        let t = scope(|s| {
            e0.record(s1)?;
            s2.wait_event(e0)?;
            s.copy_to_device(s1, &pin_src[..size], dev.as_mut_slice().slice_mut(0..size)?)?;
            let _ = s.copy_to_host(s2, dev2.as_slice().slice(0..size)?, &mut pin_dst[..size])?;
            e2.record(s2)?;
            s1.wait_event(e2)?;
            e1.record(s1)?;
            Ok(())
        })
        .and_then(|()| e0.elapsed_ms(e1))?;
        Ok(gbs(2 * size, t as f64 / 1e3))
    }

    /// Registered, each way (GB/s), and what registering and unregistering cost (µs): register
    /// the registration buffers (cost timed apart), copy, unregister.
    ///
    /// Registration is closure-scoped: the time to enter the closure is the registration's, the
    /// time from its end until `with` returns the unregistration's.
    fn registered(&mut self, size: usize) -> Result<([f64; 2], f64)> {
        let Paths { ctx, s1, e0, e1, dev, reg_src, reg_dst, .. } = self;
        let start = std::time::Instant::now();
        let (t_reg, left, t) =
            Registered::with(ctx, &mut reg_src[..size], RegisterFlags::default(), |reg| {
                let t_reg = start.elapsed();
                let t = scope(|s| {
                    e0.record(s1)?;
                    s.copy_to_device(s1, reg, dev.as_mut_slice().slice_mut(0..size)?)?;
                    e1.record(s1)?;
                    Ok(())
                })
                .and_then(|()| e0.elapsed_ms(e1));
                (t_reg, std::time::Instant::now(), t)
            })?;
        let t_unreg = left.elapsed();
        let h2d = gbs(size, t? as f64 / 1e3);
        let t = Registered::with(ctx, &mut reg_dst[..size], RegisterFlags::default(), |reg_dst| {
            scope(|s| {
                e0.record(s1)?;
                let _ = s.copy_to_host(s1, dev.as_slice().slice(0..size)?, reg_dst)?;
                e1.record(s1)?;
                Ok(())
            })
            .and_then(|()| e0.elapsed_ms(e1))
        })??;
        Ok(([h2d, gbs(size, t as f64 / 1e3)], (t_reg + t_unreg).as_secs_f64() * 1e6))
    }

    /// The staged path's rounds, each way, and its slowest transfers, per host copy (taking
    /// turns); each host copy's last round trip must bring back exactly what went in.
    ///
    /// The rounds follow one another (after a warm-up), as a program streaming data through the
    /// ring runs them. Timed in turn with the driver's copies, each staged transfer followed
    /// ~0.1 s in which the ring's threads slept, and a host whose cores idled that long starts a
    /// copy slower: `--sweep --idle-ms` measures that case.
    fn staged(
        &mut self,
        staging: &mut Staging,
        size: usize,
        reps: usize,
        evictor: &Evictor,
        copies: &[HostCopy],
    ) -> Result<Vec<(HostCopy, Staged)>> {
        let Paths { s1, dev, page_src, page_dst, .. } = self;
        let mut turns = Turns { s1, dev, evictor, idle: NO_IDLE };
        let staged = turns.rounds(staging, &page_src[..size], &mut page_dst[..size], reps, copies)?;
        fresh(page_dst, 0);
        Ok(staged)
    }
}

/// What the staged path's timed rounds share: the stream, the device buffer, the cache-emptying
/// read and the pause before each transfer.
struct Turns<'a> {
    s1: &'a Stream,
    dev: &'a mut DeviceBuffer<u8>,
    evictor: &'a Evictor,
    idle: Duration,
}

/// A staged path's median GB/s each way, and its slowest transfer each way when the ring traces.
type Staged = ([f64; 2], [Option<StagingTrace>; 2]);

impl Turns<'_> {
    /// Median GB/s host to device and back of `src` through `staging` into `dst` with each of
    /// `copies`, `reps` round trips each after a warm-up, the host copies taking turns in every
    /// round, each transfer timed on the host clock to completion, from and to memory out of
    /// cache, after the pause; and, if `staging` traces, the slowest timed transfer's trace each
    /// way. Each host copy's last round trip must bring back exactly what went in. Leaves the
    /// ring with its own host copy.
    fn rounds(
        &mut self,
        staging: &mut Staging,
        src: &[u8],
        dst: &mut [u8],
        reps: usize,
        copies: &[HostCopy],
    ) -> Result<Vec<(HostCopy, Staged)>> {
        let own = staging.config().host_copy;
        let mut out = Vec::with_capacity(copies.len());
        let mut turns: Vec<_> = copies.iter().map(|&c| (c, Round::default())).collect();
        for rep in 0..=reps {
            for (copy, round) in &mut turns {
                staging.set_host_copy(*copy);
                let r = self.round(staging, src, dst, rep, round);
                staging.set_host_copy(own);
                r?;
                if rep == reps && dst != src {
                    return Err(crate::bench::invalid(format!(
                        "staged round trip of {} bytes with {copy} host copies corrupted the data",
                        src.len()
                    )));
                }
            }
        }
        for (copy, r) in turns {
            out.push((copy, ([median(&r.samples[0]), median(&r.samples[1])], r.slowest)));
        }
        Ok(out)
    }

    /// One round trip of [`Turns::rounds`] (`rep` 0 warms up), its figures added to `round`.
    fn round(
        &mut self,
        staging: &mut Staging,
        src: &[u8],
        dst: &mut [u8],
        rep: usize,
        round: &mut Round,
    ) -> Result<()> {
        let size = src.len();
        let Round { samples, slowest } = round;
        let mut keep = |dir: usize, staging: &Staging| {
            if let (true, Some(t)) = (rep > 0, staging.last_trace()) {
                if slowest[dir].as_ref().is_none_or(|s| s.total < t.total) {
                    slowest[dir] = Some(t.clone());
                }
            }
        };
        self.evictor.evict();
        pause(self.idle);
        let (r, t) = timed(|| staging.to_device(self.s1, src, self.dev.as_mut_slice().slice_mut(0..size)?));
        r?;
        let h2d = gbs(size, t.as_secs_f64());
        keep(0, staging);
        // Zeroes (the sources never hold one), so that the check of the last round trip sees
        // what this transfer wrote and not what an earlier copy left there.
        dst.fill(0);
        self.evictor.evict();
        pause(self.idle);
        let (r, t) = timed(|| staging.to_host(self.s1, self.dev.as_slice().slice(0..size)?, dst));
        r?;
        keep(1, staging);
        if rep > 0 {
            samples[0].push(h2d);
            samples[1].push(gbs(size, t.as_secs_f64()));
        }
        Ok(())
    }
}

/// One host copy's timed round trips so far: GB/s each way, and the slowest transfers' traces.
#[derive(Default)]
struct Round {
    samples: [Vec<f64>; 2],
    slowest: [Option<StagingTrace>; 2],
}

/// How the host-side references are timed: on `threads` threads in pieces of `piece` bytes, each
/// thread taking the next piece not yet taken, `reps` times after a warm-up, the host's caches
/// emptied by `evictor` and then `idle` slept before each time.
pub struct HostTurns<'a> {
    pub threads: usize,
    pub piece: usize,
    pub reps: usize,
    pub evictor: &'a Evictor,
    pub idle: Duration,
}

impl HostTurns<'_> {
    /// Median GB/s of copying `src` into `dst` as the staging ring's threads copy, without its
    /// DMA. The threads are started once and released together for each copy, as the ring's
    /// threads are: host clock from the release to the last one done.
    ///
    /// Taking pieces in turn, rather than one equal part each, keeps one slow thread (a core busy
    /// with something else) from holding up the end, as it does not hold up the ring.
    pub fn memcpy_gbs(&self, src: &[u8], dst: &mut [u8]) -> f64 {
        let bytes = src.len().min(dst.len());
        let piece = self.piece.max(1);
        // A lock per piece: taken once per copy of a piece (hundreds of microseconds), uncontended.
        let pieces: Vec<std::sync::Mutex<(&[u8], &mut [u8])>> = src[..bytes]
            .chunks(piece)
            .zip(dst[..bytes].chunks_mut(piece))
            .map(std::sync::Mutex::new)
            .collect();
        self.run(bytes, pieces.len(), &|i| {
            let mut p = pieces[i].lock().unwrap_or_else(|e| e.into_inner());
            let (from, to) = &mut *p;
            to.copy_from_slice(from);
        })
    }

    /// Median GB/s of reading `src` (and nothing else), out of memory as [`Self::memcpy_gbs`]
    /// reads it. Host to device, the staged path must read every byte of its source once: on as
    /// many threads, this is as fast as it can go.
    pub fn read_gbs(&self, src: &[u8]) -> f64 {
        let pieces: Vec<&[u8]> = src.chunks(self.piece.max(1)).collect();
        self.run(src.len(), pieces.len(), &|i| {
            std::hint::black_box(fold_words(pieces[i]));
        })
    }

    fn run(&self, bytes: usize, pieces: usize, work: &(dyn Fn(usize) + Sync)) -> f64 {
        in_turns(bytes, pieces, self.threads, self.reps, self.evictor, self.idle, work)
    }
}

/// A sum of `bytes` read as 64-bit words, in eight lanes so that the loads need not wait on one
/// another.
fn fold_words(bytes: &[u8]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut blocks = bytes.chunks_exact(64);
    for b in &mut blocks {
        for (lane, w) in lanes.iter_mut().zip(b.chunks_exact(8)) {
            *lane = lane.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap_or_default()));
        }
    }
    let tail = blocks.remainder().iter().fold(0u64, |a, &b| a.wrapping_add(u64::from(b)));
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// Runs `work(i)` for every piece `i < pieces` on `threads` threads, each taking the next piece
/// not yet taken, `reps` times after a warm-up, the host's caches emptied and then `idle` slept
/// before each; returns the median GB/s for `bytes`. The threads are started once and released
/// together each time, as the ring's threads are: host clock from the release to the last one done.
fn in_turns(
    bytes: usize,
    pieces: usize,
    threads: usize,
    reps: usize,
    evictor: &Evictor,
    idle: Duration,
    work: &(dyn Fn(usize) + Sync),
) -> f64 {
    if bytes == 0 || pieces == 0 {
        return 0.0;
    }
    let threads = threads.clamp(1, pieces);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let start = std::sync::Barrier::new(threads + 1);
    let end = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            let (start, end, next) = (&start, &end, &next);
            sc.spawn(move || {
                for _ in 0..=reps {
                    start.wait();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= pieces {
                            break;
                        }
                        work(i);
                    }
                    end.wait();
                }
            });
        }
        let mut samples = Vec::new();
        for rep in 0..=reps {
            evictor.evict();
            pause(idle);
            // Published to the threads by the barrier.
            next.store(0, std::sync::atomic::Ordering::Relaxed);
            let t = std::time::Instant::now();
            start.wait();
            end.wait();
            if rep > 0 {
                samples.push(gbs(bytes, t.elapsed().as_secs_f64()));
            }
        }
        median(&samples)
    })
}

/// Every combination of the values given, invalid ones (a piece larger than its chunk) left out.
/// Without pieces, each chunk gets the default piece, or the chunk itself if that is smaller.
pub fn ring_shapes(
    chunks: &[usize],
    pieces: Option<&[usize]>,
    slots: &[usize],
    threads: &[usize],
) -> Vec<StagingConfig> {
    let mut out = Vec::new();
    for &chunk in chunks {
        let own = [StagingConfig::default().piece.min(chunk)];
        for &piece in pieces.unwrap_or(&own) {
            for &slots in slots {
                for &threads in threads {
                    if piece > 0 && piece <= chunk && slots >= 2 && threads > 0 {
                        out.push(StagingConfig { chunk, piece, slots, threads, ..StagingConfig::default() });
                    }
                }
            }
        }
    }
    out
}

/// The staged path with one ring shape at one size: median GB/s each way.
#[derive(Clone, Debug)]
pub struct SweepRow {
    /// The ring.
    pub config: StagingConfig,
    /// Bytes per transfer.
    pub size: usize,
    /// Staged pageable H2D and D2H, GB/s (host clock, to completion).
    pub staged: [f64; 2],
    /// The slowest timed staged transfer each way, when traced.
    pub slowest: [Option<StagingTrace>; 2],
}

/// What the sweep is judged against, per size (and thread count for memcpy).
#[derive(Clone, Debug)]
pub struct SweepReference {
    /// Bytes per transfer.
    pub size: usize,
    /// Raw `cuMemcpy*Async` from and to pinned memory, H2D and D2H, GB/s (device events).
    pub pinned: [f64; 2],
    /// The same copies on the host clock, from the call to its completion, as the staged path
    /// is timed: what the device events leave out (the time before the copy starts on the
    /// device) counts here.
    pub pinned_host: [f64; 2],
    /// Host memcpy pageable→pinned and pinned→pageable per thread count swept, GB/s.
    pub memcpy: Vec<(usize, [f64; 2])>,
    /// Reading the pageable source alone, per thread count swept and on every core, GB/s: what
    /// host to device can reach on as many threads.
    pub read: Vec<(usize, f64)>,
}

/// The staged path alone for every ring shape in `shapes` and every size, `reps` times after a
/// warm-up each; then the references, in the same run. Before every timed transfer, staged or
/// reference, the host sleeps `idle` (after emptying its caches). Checks that the last round trip
/// of each shape brought back what went in. With `trace`, each row keeps its slowest transfers'
/// traces.
pub fn sweep(
    ctx: &Context,
    sizes: &[usize],
    reps: usize,
    shapes: &[StagingConfig],
    idle: Duration,
    trace: bool,
) -> Result<(Vec<SweepRow>, Vec<SweepReference>)> {
    let max = *sizes.iter().max().ok_or_else(|| crate::bench::invalid("no sizes"))?;
    if reps == 0 || sizes.contains(&0) || shapes.is_empty() {
        return Err(crate::bench::invalid("sizes, reps and ring shapes must be positive"));
    }
    let api = driver()?.api();
    let s1 = Stream::non_blocking(ctx)?;
    let (e0, e1) = (Event::new(ctx)?, Event::new(ctx)?);
    let mut dev = DeviceBuffer::<u8>::new(ctx, max)?;
    let mut page_src = vec![0u8; max];
    let mut page_dst = vec![0u8; max];
    fresh(&mut page_src, 5);
    fresh(&mut page_dst, 0);
    let evictor = Evictor::new();
    let mut rows = Vec::new();
    for &config in shapes {
        let mut staging = Staging::with_config(ctx, config)?;
        staging.set_tracing(trace);
        for &size in sizes {
            let mut turns = Turns { s1: &s1, dev: &mut dev, evictor: &evictor, idle };
            let mut staged = turns.rounds(
                &mut staging,
                &page_src[..size],
                &mut page_dst[..size],
                reps,
                &[config.host_copy],
            )?;
            let (_, (staged, slowest)) = staged.remove(0);
            fresh(&mut page_dst[..size], 0);
            rows.push(SweepRow { config, size, staged, slowest });
        }
    }
    // References.
    let mut pin_src = PinnedBuffer::<u8>::new(ctx, max)?;
    let mut pin_dst = PinnedBuffer::<u8>::new(ctx, max)?;
    fresh(&mut pin_src, 3);
    let mut threads: Vec<usize> = shapes.iter().map(|c| c.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    // The default ring's piece: the references are per thread count, not per shape.
    let piece = StagingConfig::default().piece;
    let mut refs = Vec::new();
    for &size in sizes {
        let dptr = dev.ptr();
        let mut pinned = [Vec::new(), Vec::new()];
        let mut pinned_host = [Vec::new(), Vec::new()];
        for rep in 0..=reps {
            for (dir, p) in pinned.iter_mut().enumerate() {
                pause(idle);
                let start = std::time::Instant::now();
                e0.record(&s1)?;
                // SAFETY: pinned buffers and the device buffer hold `max` >= size bytes; the
                // stream is synchronised (through e1) before they are touched again.
                unsafe {
                    if dir == 0 {
                        result::mem::memcpy_htod_async(api, dptr, pin_src.as_ptr().cast(), size, s1.raw())
                    } else {
                        result::mem::memcpy_dtoh_async(api, pin_dst.as_mut_ptr().cast(), dptr, size, s1.raw())
                    }
                }?;
                e1.record(&s1)?;
                e1.synchronize()?;
                let host = start.elapsed();
                if rep > 0 {
                    p.push(gbs(size, e0.elapsed_ms(&e1)? as f64 / 1e3));
                    pinned_host[dir].push(gbs(size, host.as_secs_f64()));
                }
            }
        }
        let on = |threads: usize| HostTurns { threads, piece, reps, evictor: &evictor, idle };
        let memcpy = threads
            .iter()
            .map(|&t| {
                let h = on(t).memcpy_gbs(&page_src[..size], &mut pin_dst[..size]);
                let d = on(t).memcpy_gbs(&pin_src[..size], &mut page_dst[..size]);
                (t, [h, d])
            })
            .collect();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut readers = threads.clone();
        if !readers.contains(&cores) {
            readers.push(cores);
        }
        let read = readers.iter().map(|&t| (t, on(t).read_gbs(&page_src[..size]))).collect();
        refs.push(SweepReference {
            size,
            pinned: [median(&pinned[0]), median(&pinned[1])],
            pinned_host: [median(&pinned_host[0]), median(&pinned_host[1])],
            memcpy,
            read,
        });
    }
    Ok((rows, refs))
}

// The options of `cuvmm bench bandwidth` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Transfer sizes.
    #[arg(long, default_value = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB", value_parser = parse_sizes)]
    sizes: std::vec::Vec<usize>,
    /// Timed repetitions per size.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Host threads of the staged path (default: three quarters of the cores, at most 12); a list sweeps.
    #[arg(long, value_parser = parse_counts)]
    threads: Option<std::vec::Vec<usize>>,
    /// Bytes per chunk (per DMA and pinned slot) of the staged path (default 4MiB); a list sweeps.
    #[arg(long, value_parser = parse_sizes)]
    chunk: Option<std::vec::Vec<usize>>,
    /// Bytes per piece a thread copies (default 256KiB, or the chunk if smaller); a list sweeps.
    #[arg(long, value_parser = parse_sizes)]
    piece: Option<std::vec::Vec<usize>>,
    /// Pinned slots in the staging ring (default 8); a list sweeps.
    #[arg(long, value_parser = parse_counts)]
    slots: Option<std::vec::Vec<usize>>,
    /// Only the staged path, for every combination of --threads, --chunk, --piece and
    /// --slots, with its references (pinned DMA, host memcpy per thread count).
    #[arg(long)]
    sweep: bool,
    /// With --sweep: milliseconds the host sleeps before each timed transfer, staged and
    /// references alike (a program that copies now and then rather than back to back).
    #[arg(long, default_value_t = 0, requires = "sweep")]
    idle_ms: u64,
    /// How the staged path's threads write: plain (ordinary stores), streaming (non-temporal
    /// stores, the default) or both (taking turns in every round, each reported).
    #[arg(long, default_value = "streaming", value_parser = crate::bench::parse_host_copies)]
    host_copy: std::vec::Vec<HostCopy>,
    /// Print, for each size (and shape) and direction, the slowest timed staged transfer's
    /// timeline: when each chunk was filled, its DMA queued, landed, drained.
    #[arg(long)]
    trace: bool,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON lines instead of tables.
    #[arg(long)]
    json: bool,
}

/// `cuvmm bench bandwidth`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { sizes, reps, threads, chunk, piece, slots, sweep, idle_ms, host_copy, trace, device, json } =
        args;
    let ctx = Context::for_ordinal(device)?;
    let d = StagingConfig::default();
    let mut shapes = ring_shapes(
        &chunk.unwrap_or_else(|| vec![d.chunk]),
        piece.as_deref(),
        &slots.unwrap_or_else(|| vec![d.slots]),
        &threads.unwrap_or_else(|| vec![d.threads]),
    );
    if sweep {
        let [copy] = host_copy[..] else {
            return Err("--sweep takes one --host-copy (plain or streaming)".into());
        };
        for s in &mut shapes {
            s.host_copy = copy;
        }
        let idle = std::time::Duration::from_millis(idle_ms);
        let (rows, refs) = self::sweep(&ctx, &sizes, reps, &shapes, idle, trace)?;
        print_sweep(out, &ctx.device().name()?, &rows, &refs, reps, idle_ms, json)?;
        for r in &rows {
            print_slowest(out, r.size, Some(&r.config), &r.slowest, json)?;
        }
        return Ok(());
    }
    let [shape] = shapes[..] else {
        return Err(format!(
            "{} ring shapes given (a piece larger than its chunk is left out); several need --sweep",
            shapes.len()
        )
        .into());
    };
    let mut staging = Staging::with_config(&ctx, shape)?;
    staging.set_tracing(trace);
    let rows = run(&ctx, &sizes, reps, &mut staging, &host_copy)?;
    print_bandwidth(out, &ctx, &rows, &staging, json)?;
    for r in &rows {
        print_slowest(out, r.size, None, &r.slowest, json)?;
    }
    Ok(())
}

/// The slowest staged transfers' timelines (`--trace`), one line (or JSON line) per direction.
fn print_slowest(
    out: &mut impl Write,
    size: usize,
    shape: Option<&cuvmm::host::StagingConfig>,
    slowest: &[Option<cuvmm::host::StagingTrace>; 2],
    json: bool,
) -> CliResult {
    let us = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64() * 1e6);
    for t in slowest.iter().flatten() {
        let dir = if t.to_device { "h2d" } else { "d2h" };
        if json {
            let chunks: Vec<_> = t
                .chunks
                .iter()
                .map(|c| {
                    json!({"offset": c.offset, "len": c.len, "filled_us": us(c.filled), "queued_us": us(c.queued),
                           "landed_us": us(c.landed), "drained_us": us(c.drained)})
                })
                .collect();
            let shape = shape
                .map(|c| json!({"chunk": c.chunk, "piece": c.piece, "slots": c.slots, "threads": c.threads}));
            writeln!(
                out,
                "{}",
                json!({"bench": "bandwidth-trace", "size": size, "shape": shape, "direction": dir,
                       "total_us": t.total.as_secs_f64() * 1e6, "first_piece_us": us(t.first_piece), "chunks": chunks})
            )?;
            continue;
        }
        let step = |d: Option<std::time::Duration>| us(d).map_or("-".to_string(), |v| format!("{v:.0}"));
        let (what, steps): (&str, Vec<String>) = if t.to_device {
            (
                "filled/queued",
                t.chunks.iter().map(|c| format!("{}/{}", step(c.filled), step(c.queued))).collect(),
            )
        } else {
            (
                "queued/landed/drained",
                t.chunks
                    .iter()
                    .map(|c| format!("{}/{}/{}", step(c.queued), step(c.landed), step(c.drained)))
                    .collect(),
            )
        };
        let shape = shape.map_or(String::new(), |c| {
            format!(
                " ({} chunks, {} pieces, {} slots, {} threads)",
                show(c.chunk),
                show(c.piece),
                c.slots,
                c.threads
            )
        });
        writeln!(
            out,
            "slowest staged {} of {}{shape}: {:.0} µs, first piece at {} µs; per chunk, µs from the call, {what}: {}",
            if t.to_device { "host to device" } else { "device to host" },
            show(size),
            t.total.as_secs_f64() * 1e6,
            step(t.first_piece),
            steps.join(" ")
        )?;
    }
    Ok(())
}

pub fn print_bandwidth(
    out: &mut impl Write,
    ctx: &Context,
    rows: &[BandwidthRow],
    staging: &Staging,
    json: bool,
) -> CliResult {
    let name = ctx.device().name()?;
    if json {
        return print_bandwidth_json(out, &name, rows, staging);
    }
    writeln!(out, "GB/s on {name} (median of {} reps; H2D / D2H)", rows.first().map_or(0, |r| r.reps))?;
    writeln!(
        out,
        "{:>9} {:>15} {:>15} {:>15} {:>15} {:>9} {:>15} {:>15} {:>12}",
        "size",
        "pageable",
        "pinned (raw)",
        "pinned (cuvmm)",
        "registered",
        "both",
        "staged",
        "memcpy",
        "register µs"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:>9} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>9.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>12.0}",
            show(r.size),
            r.pageable[0],
            r.pageable[1],
            r.pinned_raw[0],
            r.pinned_raw[1],
            r.pinned[0],
            r.pinned[1],
            r.registered[0],
            r.registered[1],
            r.bidirectional,
            r.staged[0],
            r.staged[1],
            r.memcpy[0],
            r.memcpy[1],
            r.register_us
        )?;
    }
    let c = staging.config();
    let copies =
        rows.first().map_or(Vec::new(), |r| r.staged_by_copy.iter().map(|(c, _)| c.name()).collect());
    writeln!(
        out,
        "staged: {} threads, {} chunks in {} pieces, {} slots, {} host copies; memcpy: host memcpy on the \
         same threads in the same pieces, taken in turn, pageable → pinned / pinned → pageable (the \
         staged path's copying side alone, without its DMA)",
        c.threads,
        show(c.chunk),
        show(c.piece),
        c.slots,
        copies.first().copied().unwrap_or(c.host_copy.name())
    )?;
    print_by_host_copy(out, rows)?;
    let big: Vec<_> = rows.iter().filter(|r| r.size >= 64 << 20).collect();
    if !big.is_empty() {
        let worst = |i: usize| big.iter().map(|r| r.staged[i]).fold(f64::INFINITY, f64::min);
        let (h, d) = (worst(0), worst(1));
        writeln!(
            out,
            "staged at ≥ 64 MiB, slowest size: {h:.1} GB/s H2D, {d:.1} GB/s D2H (goal ≥ 39 both ways: {}); \
             over memcpy on the same threads {:.3}x / {:.3}x, over pinned DMA {:.3}x / {:.3}x",
            if h >= 39.0 && d >= 39.0 { "met" } else { "not met" },
            big.iter().map(|r| r.staged[0] / r.memcpy[0]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[1] / r.memcpy[1]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[0] / r.pinned_raw[0]).fold(f64::INFINITY, f64::min),
            big.iter().map(|r| r.staged[1] / r.pinned_raw[1]).fold(f64::INFINITY, f64::min),
        )?;
    }
    if let Some(r) = rows.iter().max_by_key(|r| r.size) {
        print_largest(out, r, staging)?;
    }
    Ok(())
}

/// With more than one host copy measured, each one's staged GB/s per size, and each over the
/// first's.
fn print_by_host_copy(out: &mut impl Write, rows: &[BandwidthRow]) -> CliResult {
    for r in rows.iter().filter(|r| r.staged_by_copy.len() > 1) {
        let [h0, d0] = r.staged_by_copy[0].1;
        let each: Vec<String> = r
            .staged_by_copy
            .iter()
            .map(|(c, [h, d])| format!("{c} {h:.1} / {d:.1} ({:.3}x / {:.3}x)", h / h0, d / d0))
            .collect();
        writeln!(
            out,
            "staged at {} by host copy, taking turns, GB/s H2D / D2H (over {}): {}",
            show(r.size),
            r.staged_by_copy[0].0,
            each.join(", ")
        )?;
    }
    Ok(())
}

/// [`print_bandwidth`] as JSON lines, one per size.
fn print_bandwidth_json(
    out: &mut impl Write,
    name: &str,
    rows: &[BandwidthRow],
    staging: &Staging,
) -> CliResult {
    for r in rows {
        let by_copy: serde_json::Map<String, serde_json::Value> =
            r.staged_by_copy.iter().map(|(c, g)| (c.name().to_string(), json!(g))).collect();
        writeln!(
            out,
            "{}",
            json!({"bench": "bandwidth", "device": name, "size": r.size, "reps": r.reps,
            "staged_by_host_copy": by_copy,
            "pageable_h2d": r.pageable[0], "pageable_d2h": r.pageable[1],
            "pinned_raw_h2d": r.pinned_raw[0], "pinned_raw_d2h": r.pinned_raw[1],
            "pinned_h2d": r.pinned[0], "pinned_d2h": r.pinned[1],
            "registered_h2d": r.registered[0], "registered_d2h": r.registered[1],
            "bidirectional": r.bidirectional, "staged_h2d": r.staged[0], "staged_d2h": r.staged[1],
            "memcpy_h2d": r.memcpy[0], "memcpy_d2h": r.memcpy[1],
            "register_us": r.register_us, "staging_threads": staging.threads(), "staging_chunk": staging.chunk(),
            "staging_piece": staging.config().piece, "staging_slots": staging.config().slots})
        )?;
    }
    Ok(())
}

/// The largest size: cuvmm against the driver, and pinned against pageable memory.
fn print_largest(out: &mut impl Write, r: &BandwidthRow, staging: &Staging) -> CliResult {
    writeln!(
        out,
        "at {}: cuvmm pinned / raw driver {:.3}x H2D, {:.3}x D2H; staged / driver pageable {:.2}x H2D, {:.2}x D2H ({} threads, {} chunks)",
        show(r.size),
        r.pinned[0] / r.pinned_raw[0],
        r.pinned[1] / r.pinned_raw[1],
        r.staged[0] / r.pageable[0],
        r.staged[1] / r.pageable[1],
        staging.threads(),
        show(staging.chunk())
    )?;
    // The pinned-vs-pageable comparison, with this machine's numbers beside the usual rule of thumb.
    writeln!(out, "\n=== Pinned vs Pageable Memory Transfer (measured, {}) ===", show(r.size))?;
    writeln!(out, "[Pageable (malloc) Memory]")?;
    writeln!(out, "  Allocation:   let v = vec![0u8; bytes]")?;
    writeln!(out, "  Copy path:    CPU_RAM -> [driver staging buffer] -> GPU")?;
    writeln!(out, "  Synchronous:  YES (the copy call returns once the data is staged or landed)")?;
    writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.pageable[0], r.pageable[1])?;
    writeln!(out, "[Pinned (cuMemHostAlloc) Memory]")?;
    writeln!(out, "  Allocation:   PinnedBuffer::<u8>::new(&ctx, bytes)")?;
    writeln!(out, "  Copy path:    CPU_RAM -> GPU (direct DMA)")?;
    writeln!(out, "  Asynchronous: YES (scope(|s| s.copy_to_device(..)))")?;
    writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.pinned[0], r.pinned[1])?;
    writeln!(
        out,
        "  Speedup:      {:.2}x H2D, {:.2}x D2H",
        r.pinned[0] / r.pageable[0],
        r.pinned[1] / r.pageable[1]
    )?;
    writeln!(out, "[Staged pageable (cuvmm)]")?;
    writeln!(out, "  Transfer BW:  {:.1} GB/s H2D, {:.1} GB/s D2H", r.staged[0], r.staged[1])?;
    Ok(())
}

/// The staged path's sweep: GB/s per ring shape and size, the references, the best shapes.
pub fn print_sweep(
    out: &mut impl Write,
    name: &str,
    rows: &[SweepRow],
    refs: &[SweepReference],
    reps: usize,
    idle_ms: u64,
    json: bool,
) -> CliResult {
    if json {
        return print_sweep_json(out, name, rows, refs, idle_ms);
    }
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut shapes: Vec<StagingConfig> = Vec::new();
    for r in rows {
        if !shapes.contains(&r.config) {
            shapes.push(r.config);
        }
    }
    print_sweep_table(out, name, rows, &sizes, &shapes, reps, idle_ms)?;
    print_sweep_references(out, refs)?;
    print_best_shape(out, rows, &sizes, &shapes)
}

/// The sweep as JSON lines: one per ring shape and size, then one per reference size.
fn print_sweep_json(
    out: &mut impl Write,
    name: &str,
    rows: &[SweepRow],
    refs: &[SweepReference],
    idle_ms: u64,
) -> CliResult {
    for r in rows {
        let c = r.config;
        writeln!(
            out,
            "{}",
            json!({"bench": "bandwidth-sweep", "device": name, "idle_ms": idle_ms, "size": r.size, "chunk": c.chunk, "piece": c.piece,
                   "slots": c.slots, "threads": c.threads, "staged_h2d": r.staged[0], "staged_d2h": r.staged[1]})
        )?;
    }
    for f in refs {
        let memcpy: Vec<_> =
            f.memcpy.iter().map(|(t, m)| json!({"threads": t, "h2d": m[0], "d2h": m[1]})).collect();
        let read: Vec<_> = f.read.iter().map(|(t, r)| json!({"threads": t, "gbps": r})).collect();
        writeln!(
            out,
            "{}",
            json!({"bench": "bandwidth-sweep", "idle_ms": idle_ms, "size": f.size, "pinned_h2d": f.pinned[0],
                   "pinned_d2h": f.pinned[1], "pinned_host_clock_h2d": f.pinned_host[0],
                   "pinned_host_clock_d2h": f.pinned_host[1], "memcpy": memcpy, "read_source": read})
        )?;
    }
    Ok(())
}

/// Staged GB/s, a line per ring shape and a column per size (`-` where a shape skipped a size).
fn print_sweep_table(
    out: &mut impl Write,
    name: &str,
    rows: &[SweepRow],
    sizes: &[usize],
    shapes: &[StagingConfig],
    reps: usize,
    idle_ms: u64,
) -> CliResult {
    writeln!(out, "staged pageable GB/s on {name}, H2D / D2H, median of {reps} (host clock, to completion)")?;
    if idle_ms > 0 {
        writeln!(
            out,
            "every timed transfer, staged and references alike, after the host slept {idle_ms} ms"
        )?;
    }
    write!(out, "{:>9} {:>9} {:>6} {:>8}", "chunk", "piece", "slots", "threads")?;
    for &s in sizes {
        write!(out, " {:>15}", show(s))?;
    }
    writeln!(out)?;
    for c in shapes {
        write!(out, "{:>9} {:>9} {:>6} {:>8}", show(c.chunk), show(c.piece), c.slots, c.threads)?;
        for &s in sizes {
            match rows.iter().find(|r| r.config == *c && r.size == s) {
                Some(r) => write!(out, " {:>7.1} /{:>6.1}", r.staged[0], r.staged[1])?,
                None => write!(out, " {:>15}", "-")?,
            }
        }
        writeln!(out)?;
    }
    Ok(())
}

/// What the sweep is judged against, per size: pinned DMA, host memcpy, reading the source.
fn print_sweep_references(out: &mut impl Write, refs: &[SweepReference]) -> CliResult {
    writeln!(out, "references, same run (H2D / D2H): pinned DMA (raw cuMemcpy*Async, device events, and on the host clock from the call to completion as the staged path is timed); host memcpy pageable → pinned / pinned → pageable in the default ring's pieces, taken in turn; reading the source alone (host to device cannot be faster on as many threads)")?;
    for f in refs {
        write!(
            out,
            "{:>9}  pinned {:>5.1} /{:>5.1} (host clock {:>5.1} /{:>5.1})",
            show(f.size),
            f.pinned[0],
            f.pinned[1],
            f.pinned_host[0],
            f.pinned_host[1]
        )?;
        for (t, m) in &f.memcpy {
            write!(out, "   memcpy {t} threads {:>5.1} /{:>5.1}", m[0], m[1])?;
        }
        writeln!(out)?;
        write!(out, "{:>9}  reading the pageable source alone:", "")?;
        for (t, r) in &f.read {
            write!(out, "   {t} threads {r:>5.1}")?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// The shape whose slower direction at its slowest size ≥ 64 MiB (or at all sizes) is fastest.
fn print_best_shape(
    out: &mut impl Write,
    rows: &[SweepRow],
    sizes: &[usize],
    shapes: &[StagingConfig],
) -> CliResult {
    let judged: Vec<usize> = if sizes.iter().any(|&s| s >= 64 << 20) {
        sizes.iter().copied().filter(|&s| s >= 64 << 20).collect()
    } else {
        sizes.to_vec()
    };
    let floor = |c: &StagingConfig| {
        rows.iter()
            .filter(|r| r.config == *c && judged.contains(&r.size))
            .map(|r| r.staged[0].min(r.staged[1]))
            .fold(f64::INFINITY, f64::min)
    };
    if let Some(best) = shapes.iter().max_by(|a, b| floor(a).total_cmp(&floor(b))) {
        let f = floor(best);
        writeln!(
            out,
            "best shape: {} chunks, {} pieces, {} slots, {} threads: at least {f:.1} GB/s both ways at {} (goal ≥ 39: {})",
            show(best.chunk),
            show(best.piece),
            best.slots,
            best.threads,
            judged.iter().map(|&s| show(s)).collect::<Vec<_>>().join(", "),
            if f >= 39.0 { "met" } else { "not met" }
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::assert_report;

    #[test]
    fn each_host_copy_is_reported_over_the_first_and_one_alone_is_not() {
        let row = |by: Vec<(HostCopy, [f64; 2])>| BandwidthRow {
            size: 1 << 30,
            staged_by_copy: by,
            ..Default::default()
        };
        let mut out = Vec::new();
        print_by_host_copy(&mut out, &[row(vec![(HostCopy::Streaming, [40.0, 50.0])])]).unwrap();
        assert!(out.is_empty(), "one host copy has nothing to compare");
        let both = row(vec![(HostCopy::Streaming, [40.0, 50.0]), (HostCopy::Plain, [44.0, 25.0])]);
        print_by_host_copy(&mut out, &[both]).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "staged at 1 GiB by host copy, taking turns, GB/s H2D / D2H (over streaming): streaming 40.0 / 50.0 \
             (1.000x / 1.000x), plain 44.0 / 25.0 (1.100x / 0.500x)\n"
        );
    }

    fn sweep_input() -> (Vec<SweepRow>, Vec<SweepReference>) {
        let shape = |chunk: usize, slots| StagingConfig {
            chunk,
            piece: 256 << 10,
            slots,
            threads: 12,
            ..StagingConfig::default()
        };
        let row =
            |config, size, h2d, d2h| SweepRow { config, size, staged: [h2d, d2h], slowest: [None, None] };
        let rows = vec![
            row(shape(4 << 20, 8), 16 << 20, 30.04, 31.96),
            row(shape(4 << 20, 8), 64 << 20, 43.15, 52.7),
            row(shape(2 << 20, 16), 64 << 20, 40.25, 38.95),
            row(shape(4 << 20, 8), 1 << 30, 49.2, 51.05),
        ];
        let refs = vec![SweepReference {
            size: 64 << 20,
            pinned: [53.1, 54.25],
            pinned_host: [50.05, 51.9],
            memcpy: vec![(8, [47.0, 60.5]), (12, [55.55, 70.0])],
            read: vec![(8, 47.25), (16, 70.1)],
        }];
        (rows, refs)
    }

    #[test]
    fn the_sweep_report_keeps_its_layout() {
        let (rows, refs) = sweep_input();
        let mut out = Vec::new();
        print_sweep(&mut out, "NVIDIA H100", &rows, &refs, 5, 0, false).unwrap();
        print_sweep(&mut out, "NVIDIA H100", &rows[..1], &[], 3, 40, false).unwrap();
        assert_report("sweep.txt", &out);
        let mut out = Vec::new();
        print_sweep(&mut out, "NVIDIA H100", &rows, &refs, 5, 40, true).unwrap();
        assert_report("sweep.jsonl", &out);
    }

    #[test]
    fn memcpy_reference_copies_everything() {
        let src: Vec<u8> = (0..1_000_003u32).map(|i| (i % 251) as u8).collect();
        // Pieces that do not divide the length, more threads than pieces.
        for (threads, piece) in [(3, 4096), (16, 300_000), (2, 1 << 30)] {
            let mut dst = vec![0u8; src.len()];
            let evictor = Evictor(vec![1; 1000]);
            let host = HostTurns { threads, piece, reps: 2, evictor: &evictor, idle: NO_IDLE };
            assert!(host.memcpy_gbs(&src, &mut dst) > 0.0);
            assert!(dst == src);
        }
    }

    #[test]
    fn every_piece_is_worked_once_a_round() {
        let seen: Vec<std::sync::atomic::AtomicUsize> = (0..37).map(|_| Default::default()).collect();
        // More threads than pieces, and fewer.
        for threads in [64, 5] {
            seen.iter().for_each(|s| s.store(0, std::sync::atomic::Ordering::Relaxed));
            let gbs = in_turns(37 << 10, 37, threads, 3, &Evictor(vec![1; 1000]), NO_IDLE, &|i| {
                seen[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            });
            assert!(gbs > 0.0);
            // A warm-up and three timed rounds.
            assert!(seen.iter().all(|s| s.load(std::sync::atomic::Ordering::Relaxed) == 4));
        }
        let evictor = Evictor(vec![1; 10]);
        let host = HostTurns { threads: 3, piece: 4096, reps: 2, evictor: &evictor, idle: NO_IDLE };
        assert_eq!(host.read_gbs(&[]), 0.0);
    }

    #[test]
    fn the_idle_pause_comes_before_each_round_and_outside_its_time() {
        let idle = Duration::from_millis(40);
        let start = std::time::Instant::now();
        let gbs = in_turns(1 << 20, 4, 2, 2, &Evictor(vec![1; 10]), idle, &|_| {});
        // A warm-up and two timed rounds, each after the pause...
        assert!(start.elapsed() >= 3 * idle);
        // ...which the rounds' times leave out: a round of empty work takes far less than it.
        let round = Duration::from_secs_f64((1 << 20) as f64 / (gbs * 1e9));
        assert!(round < idle, "{round:?}");
    }

    #[test]
    fn words_are_summed_whole_and_the_tail_by_bytes() {
        assert_eq!(fold_words(&[7u8; 5]), 35);
        assert_eq!(fold_words(&[1u8; 64]), 8 * u64::from_ne_bytes([1; 8]));
        let mut v = vec![0u8; 67];
        v[63] = 2; // the last byte of the eighth word
        v[66] = 5; // in the tail
        assert_eq!(fold_words(&v), u64::from_ne_bytes([0, 0, 0, 0, 0, 0, 0, 2]) + 5);
    }

    #[test]
    fn ring_shapes_are_every_valid_combination() {
        let shapes = ring_shapes(&[1 << 20, 4 << 20], Some(&[512 << 10, 2 << 20]), &[8], &[4, 16]);
        // 1 MiB chunks with 2 MiB pieces are left out.
        assert_eq!(shapes.len(), 6);
        assert!(shapes.iter().all(|c| c.piece <= c.chunk));
        // Without pieces, the default one, or the chunk if smaller.
        let own = StagingConfig::default().piece;
        let shapes = ring_shapes(&[own / 2, 4 << 20], None, &[8], &[4]);
        assert_eq!(shapes.iter().map(|c| c.piece).collect::<Vec<_>>(), [own / 2, own]);
    }
}
