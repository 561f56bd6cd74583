//! `cuvmm bench ipc`: an allocation shared with a child process over a Unix socket, through cuvmm
//! and through the raw driver and socket calls a hand-written C program makes, in the same run.
//!
//! The exporter (this process) allocates (untimed), then exports and sends; the importer (a child)
//! receives, imports, reserves, maps and grants access. Each step is stamped on CLOCK_MONOTONIC,
//! which both processes share. Both paths export the same kind of allocation (a `PeerAllocator`
//! one, fresh for every exchange), and the importer is already waiting in `recvmsg` when the
//! exporter's clock starts:
//!
//! | step | cuvmm | raw |
//! |---|---|---|
//! | export + send | `PeerAllocation::share` | `cuMemExportToShareableHandle`, `sendmsg` (SCM_RIGHTS), `close` |
//! | receive | `ipc::recv` (peer check, validated frame) | `recvmsg` |
//! | import | `PhysicalMemory::import_fd` | `cuMemImportFromShareableHandle` |
//! | reserve + map | `Reservation::new`, `Reservation::map` | `cuMemAddressReserve`, `cuMemMap` |
//! | set access | `Mapping::set_access` | `cuMemSetAccess` |
//!
//! Each importer process runs one exchange of each path first (its very first exchange is reported
//! apart: the first use of each driver call in a fresh process, which falls on whichever path goes
//! first, so processes take turns), then alternates the two. Then it measures device-to-device
//! bandwidth on imported memory against a local allocation, and the legacy cuIpcGetMemHandle /
//! cuIpcOpenMemHandle path.

use super::median;
use crate::common::size::{parse_size, show};
use crate::common::CliResult;
use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::context::Context;
use cuvmm::driver::{driver, result, sys::*};
use cuvmm::error::{Error, Result};
use cuvmm::ipc::wire::Message;
use cuvmm::ipc::{recv_message, Incoming, PeerPolicy, SharedMemory};
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use serde_json::json;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Nanoseconds on CLOCK_MONOTONIC.
pub fn now_ns() -> Result<u64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_err(|errno| Error::Os { call: "clock_gettime", errno })?;
    Ok(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

/// Which way an exchange goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// cuvmm's types.
    Cuvmm,
    /// Raw driver and socket calls.
    Raw,
}

impl Path {
    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Path::Cuvmm => "cuvmm",
            Path::Raw => "raw",
        }
    }

    fn code(self) -> u8 {
        match self {
            Path::Cuvmm => CODE_CUVMM,
            Path::Raw => CODE_RAW,
        }
    }
}

/// What the exporter tells the importer before each exchange, and when they are over.
const CODE_CUVMM: u8 = 0;
const CODE_RAW: u8 = 1;
const CODE_END: u8 = 2;

/// The path of exchange `round` in importer process `child`: one of each first, the first one
/// alternating between processes, then turn about.
pub fn path_of(child: usize, round: usize) -> Path {
    if (child + round) % 2 == 0 {
        Path::Cuvmm
    } else {
        Path::Raw
    }
}

/// Exchanges per importer process: one of each path to begin with, then `pairs` of each.
pub fn rounds_per_child(pairs: usize) -> usize {
    2 + 2 * pairs
}

/// The exporter's clock for one exchange (CLOCK_MONOTONIC ns).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Exported {
    /// The path.
    pub path: Path,
    /// Start of the export.
    pub t0: u64,
    /// The send returned.
    pub sent: u64,
}

/// The importer's clock for one exchange (CLOCK_MONOTONIC ns at the end of each step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Imported {
    /// The path.
    pub path: Path,
    /// The message and its fd received.
    pub received: u64,
    /// Imported.
    pub imported: u64,
    /// Reserved and mapped.
    pub mapped: u64,
    /// Access granted.
    pub accessible: u64,
}

/// The steps of one exchange, as [`steps_us`] measures them.
pub const STEPS: [&str; 6] =
    ["export + send", "export → received", "import", "reserve + map", "set access", "export → mapped"];

/// One exchange's steps in microseconds, in the order of [`STEPS`].
pub fn steps_us(e: &Exported, i: &Imported) -> [f64; 6] {
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
    [
        us(e.t0, e.sent),
        us(e.t0, i.received),
        us(i.received, i.imported),
        us(i.imported, i.mapped),
        us(i.mapped, i.accessible),
        us(e.t0, i.accessible),
    ]
}

/// What an importer process reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImporterReport {
    /// Each exchange, in order.
    pub rounds: Vec<Imported>,
    /// Device-to-device copy bandwidth inside the imported memory, GB/s.
    pub imported_gbs: f64,
    /// The same copy inside a local allocation, GB/s.
    pub local_gbs: f64,
    /// cuIpcOpenMemHandle on a legacy handle, µs.
    pub legacy_open_us: f64,
    /// Copy bandwidth inside the legacy-opened memory, GB/s.
    pub legacy_gbs: f64,
}

impl ImporterReport {
    /// As JSON, for the exporter to read.
    pub fn to_json(&self) -> serde_json::Value {
        let rounds: Vec<serde_json::Value> = self
            .rounds
            .iter()
            .map(|r| {
                serde_json::json!({"path": r.path.name(), "received": r.received, "imported": r.imported,
                                   "mapped": r.mapped, "accessible": r.accessible})
            })
            .collect();
        serde_json::json!({"rounds": rounds, "imported_gbs": self.imported_gbs, "local_gbs": self.local_gbs,
                           "legacy_open_us": self.legacy_open_us, "legacy_gbs": self.legacy_gbs})
    }

    /// Reads what [`to_json`](Self::to_json) wrote.
    pub fn from_json(v: &serde_json::Value) -> Result<ImporterReport> {
        let bad = || Error::Protocol(format!("the importer's report is malformed: {v}"));
        let f = |k: &str| v[k].as_f64().ok_or_else(bad);
        let round = |r: &serde_json::Value| -> Result<Imported> {
            let t = |k: &str| r[k].as_u64().ok_or_else(bad);
            let path = match r["path"].as_str() {
                Some("cuvmm") => Path::Cuvmm,
                Some("raw") => Path::Raw,
                _ => return Err(bad()),
            };
            Ok(Imported {
                path,
                received: t("received")?,
                imported: t("imported")?,
                mapped: t("mapped")?,
                accessible: t("accessible")?,
            })
        };
        Ok(ImporterReport {
            rounds: v["rounds"].as_array().ok_or_else(bad)?.iter().map(round).collect::<Result<_>>()?,
            imported_gbs: f("imported_gbs")?,
            local_gbs: f("local_gbs")?,
            legacy_open_us: f("legacy_open_us")?,
            legacy_gbs: f("legacy_gbs")?,
        })
    }
}

/// Medians over the exchanges of one path.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PathStats {
    /// Exchanges after each importer's first two, in the order of [`STEPS`].
    pub warm_us: [f64; 6],
    /// How many.
    pub warm_n: usize,
    /// Importers' very first exchanges, where this path went first.
    pub first_us: [f64; 6],
    /// How many.
    pub first_n: usize,
}

/// The comparison over every importer process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IpcSummary {
    /// cuvmm's path.
    pub cuvmm: PathStats,
    /// The raw path.
    pub raw: PathStats,
    /// Importer processes.
    pub children: usize,
    /// Medians over the processes: D2D bandwidth in imported memory, GB/s.
    pub imported_gbs: f64,
    /// In a local allocation, GB/s.
    pub local_gbs: f64,
    /// cuIpcOpenMemHandle, µs.
    pub legacy_open_us: f64,
    /// D2D bandwidth in legacy-opened memory, GB/s.
    pub legacy_gbs: f64,
}

impl IpcSummary {
    /// cuvmm's time over the raw time from export to mapped and accessible, warm.
    pub fn ratio(&self) -> f64 {
        self.cuvmm.warm_us[5] / self.raw.warm_us[5]
    }

    /// The same over importers' first exchanges.
    pub fn first_ratio(&self) -> f64 {
        self.cuvmm.first_us[5] / self.raw.first_us[5]
    }
}

/// Pairs each importer's exchanges with the exporter's and takes medians per path.
pub fn summarize(children: &[(Vec<Exported>, ImporterReport)]) -> Result<IpcSummary> {
    let mut warm: [Vec<[f64; 6]>; 2] = Default::default();
    let mut first: [Vec<[f64; 6]>; 2] = Default::default();
    for (exported, report) in children {
        if exported.len() != report.rounds.len() {
            return Err(Error::Protocol(format!(
                "the exporter counted {} exchanges, the importer {}",
                exported.len(),
                report.rounds.len()
            )));
        }
        for (k, (e, i)) in exported.iter().zip(&report.rounds).enumerate() {
            if e.path != i.path {
                return Err(Error::Protocol(format!("exchange {k}: the two sides disagree on the path")));
            }
            let slot = usize::from(e.path == Path::Raw);
            match k {
                0 => first[slot].push(steps_us(e, i)),
                1 => {} // the other path's first exchange in a process that already made one
                _ => warm[slot].push(steps_us(e, i)),
            }
        }
    }
    let med = |v: &[[f64; 6]]| -> [f64; 6] {
        std::array::from_fn(|s| median(&v.iter().map(|a| a[s]).collect::<Vec<_>>()))
    };
    let stats = |slot: usize| PathStats {
        warm_us: med(&warm[slot]),
        warm_n: warm[slot].len(),
        first_us: med(&first[slot]),
        first_n: first[slot].len(),
    };
    let over =
        |f: fn(&ImporterReport) -> f64| median(&children.iter().map(|(_, r)| f(r)).collect::<Vec<_>>());
    Ok(IpcSummary {
        cuvmm: stats(0),
        raw: stats(1),
        children: children.len(),
        imported_gbs: over(|r| r.imported_gbs),
        local_gbs: over(|r| r.local_gbs),
        legacy_open_us: over(|r| r.legacy_open_us),
        legacy_gbs: over(|r| r.legacy_gbs),
    })
}

/// Copies the first half of `base` onto the second half, repeatedly; median GB/s (read + write).
fn d2d_gbs(ctx: &Context, base: CUdeviceptr, bytes: usize) -> Result<f64> {
    let api = driver()?.api();
    let s = Stream::non_blocking(ctx)?;
    let (a, b) = (Event::new(ctx)?, Event::new(ctx)?);
    let half = bytes / 2;
    let mut samples = Vec::new();
    for rep in 0..8 {
        a.record(&s)?;
        // SAFETY: both halves lie inside a mapped, accessible range of `bytes` bytes.
        unsafe { result::mem::memcpy_dtod_async(api, base + half as u64, base, half, s.raw()) }?;
        b.record(&s)?;
        b.synchronize()?;
        if rep > 0 {
            samples.push(2.0 * half as f64 / (a.elapsed_ms(&b)? as f64 / 1e3) / 1e9);
        }
    }
    Ok(median(&samples))
}

/// The raw path's frame: the allocation's size (u64, little-endian) and 8 bytes of padding.
const RAW_FRAME_LEN: usize = 16;

/// Room for the control data of one fd: CMSG_SPACE(sizeof(int)), a `cmsghdr` and an int rounded
/// up to `size_t`.
const FD_CONTROL: usize =
    cmsg_align(std::mem::size_of::<libc::cmsghdr>()) + cmsg_align(std::mem::size_of::<i32>());

/// `CMSG_ALIGN`.
const fn cmsg_align(n: usize) -> usize {
    (n + std::mem::size_of::<usize>() - 1) & !(std::mem::size_of::<usize>() - 1)
}

/// Control data for one fd, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct FdControl([u8; FD_CONTROL]);

/// `sendmsg` of the raw frame with `fd` as SCM_RIGHTS, as a C program writes it.
fn raw_send(sock: &UnixStream, frame: &[u8; RAW_FRAME_LEN], fd: i32) -> Result<()> {
    let mut control = FdControl([0; FD_CONTROL]);
    let mut iov = libc::iovec { iov_base: frame.as_ptr() as *mut libc::c_void, iov_len: RAW_FRAME_LEN };
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = FD_CONTROL as _;
    // SAFETY: the control buffer holds CMSG_SPACE(sizeof(int)) bytes aligned for cmsghdr, so
    // CMSG_FIRSTHDR is not null and CMSG_DATA has room for one int; `msg` points at live locals
    // for the call (the frame is only read).
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
        libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if n != RAW_FRAME_LEN as isize {
        return Err(Error::Os { call: "sendmsg", errno: nix::errno::Errno::last() });
    }
    Ok(())
}

/// `recvmsg` of the raw frame and its fd, as a C program reads it: one call, and no checks
/// beyond the fd being there.
fn raw_recv(sock: &UnixStream) -> Result<(usize, OwnedFd)> {
    let mut control = FdControl([0; FD_CONTROL]);
    let mut frame = [0u8; RAW_FRAME_LEN];
    let mut iov = libc::iovec { iov_base: frame.as_mut_ptr().cast(), iov_len: RAW_FRAME_LEN };
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = FD_CONTROL as _;
    // SAFETY: `msg` describes `frame` and `control`, live locals the kernel writes at most to
    // their lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    // SAFETY: the kernel wrote msg_controllen bytes of control data into `control`; CMSG_FIRSTHDR
    // is null when there are none, and a SCM_RIGHTS message of CMSG_LEN(sizeof(int)) bytes holds
    // exactly one descriptor, which the kernel installed for this process and nothing else owns.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null()
            || (*c).cmsg_level != libc::SOL_SOCKET
            || (*c).cmsg_type != libc::SCM_RIGHTS
            || (*c).cmsg_len as usize != libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize
        {
            return Err(Error::Protocol(format!("raw frame without exactly one fd (recvmsg returned {n})")));
        }
        OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>()))
    };
    if n != RAW_FRAME_LEN as isize {
        return Err(Error::Protocol(format!("raw frame: recvmsg returned {n}")));
    }
    let size = u64::from_le_bytes(frame[..8].try_into().expect("8 bytes"));
    let size = usize::try_from(size).map_err(|_| Error::Protocol("size does not fit".into()))?;
    Ok((size, fd))
}

fn protocol(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| Error::Protocol(format!("{what}: {e}"))
}

/// The exporter's side with importer process number `child`: `rounds_per_child(pairs)`
/// exchanges, each of a fresh allocation of at least `bytes` bytes, then the bandwidth and legacy
/// measurements.
pub fn export_side(
    ctx: &Context,
    sock: &mut UnixStream,
    bytes: usize,
    child: usize,
    pairs: usize,
) -> Result<Vec<Exported>> {
    let alloc = PeerAllocator::new(ctx, &[], ExportMode::PosixFd)?;
    let api = driver()?.api();
    let mut ack = [0u8; 1];
    let mut out = Vec::new();
    for round in 0..rounds_per_child(pairs) {
        let path = path_of(child, round);
        let a = alloc.allocate(bytes)?;
        sock.write_all(&[path.code()]).map_err(protocol("announce the exchange"))?;
        // The importer answers right before it waits in recvmsg: the clock starts then.
        sock.read_exact(&mut ack).map_err(protocol("wait for the importer"))?;
        ctx.bind()?;
        let t0 = now_ns()?;
        match path {
            Path::Cuvmm => {
                a.share(sock.as_fd(), 0, a.len(), round as u64)?;
            }
            Path::Raw => {
                let fd = result::mem::export_fd(api, a.physical().handle())?;
                let mut frame = [0u8; RAW_FRAME_LEN];
                frame[..8].copy_from_slice(&(a.len() as u64).to_le_bytes());
                raw_send(sock, &frame, fd.as_raw_fd())?;
                drop(fd); // close(2) once sent, as the C program does and `share` does
            }
        }
        let sent = now_ns()?;
        out.push(Exported { path, t0, sent });
        // The importer has mapped, granted access and let go of the memory.
        sock.read_exact(&mut ack).map_err(protocol("wait for the importer"))?;
        drop(a);
    }
    sock.write_all(&[CODE_END]).map_err(protocol("end the exchanges"))?;
    // Bandwidth on imported memory.
    let a = alloc.allocate(bytes)?;
    a.share(sock.as_fd(), 0, a.len(), 1)?;
    sock.read_exact(&mut ack).map_err(protocol("wait for the importer"))?;
    // Legacy path: cuMemAlloc + cuIpcGetMemHandle, the handle and the length over the socket. The
    // buffer is as large as the VMM allocation (`bytes` rounded up to the granularity), which is
    // the length the importer copies in both.
    ctx.bind()?;
    let legacy = DeviceBuffer::<u8>::new(ctx, a.len())?;
    // SAFETY: the buffer is a live cuMemAlloc allocation.
    let h = unsafe { result::ipc::get_mem_handle(api, legacy.ptr()) }?;
    sock.write_all(&legacy_frame(&h, a.len())).map_err(protocol("send legacy handle"))?;
    sock.read_exact(&mut ack).map_err(protocol("wait for the importer"))?;
    Ok(out)
}

/// The exporter's next message, which must come.
fn recv_next(sock: &UnixStream) -> Result<Incoming> {
    recv_message(sock.as_fd(), PeerPolicy::SameUid)?
        .ok_or_else(|| Error::Protocol("the exporter closed the socket".into()))
}

/// One exchange through cuvmm, on the importer's side; the memory is let go (untimed) after.
fn import_cuvmm(ctx: &Context, sock: &UnixStream) -> Result<Imported> {
    let msg = recv_next(sock)?;
    let received = now_ns()?;
    let (Message::Share(header), fd, _) = msg.into_parts() else {
        return Err(Error::Protocol("the exporter sent something other than a share".into()));
    };
    let size = usize::try_from(header.size())
        .map_err(|_| Error::Protocol("the allocation size does not fit this machine".into()))?;
    let fd = fd.ok_or_else(|| Error::Protocol("no fd".into()))?;
    let phys = PhysicalMemory::import_fd(ctx, fd.as_fd(), size)?;
    let imported = now_ns()?;
    let va = Reservation::new(ctx, size)?;
    // Succeeds only if the allocation holds `size` bytes: from here on `size` is the driver's word
    // too, not only the peer's.
    let m = va.map(0, &phys, 0, size)?;
    let mapped = now_ns()?;
    m.set_access(&[(ctx.device(), Access::ReadWrite)])?;
    let accessible = now_ns()?;
    Ok(Imported { path: Path::Cuvmm, received, imported, mapped, accessible })
}

/// One exchange through raw calls, on the importer's side (the context is current); the memory
/// is let go (untimed) after.
fn import_raw(ctx: &Context, sock: &UnixStream) -> Result<Imported> {
    let api = driver()?.api();
    let (size, fd) = raw_recv(sock)?;
    let received = now_ns()?;
    let h = result::mem::import_fd(api, fd.as_fd())?;
    let imported = now_ns()?;
    let desc = CUmemAccessDesc {
        location: CUmemLocation { type_: CUmemLocationType::DEVICE, id: ctx.device().raw() },
        flags: CUmemAccess_flags::PROT_READWRITE,
    };
    let va = result::mem::address_reserve(api, size, 0, 0)?;
    // SAFETY: the range is reserved, mapped, made accessible and undone below, in order, with
    // nothing queued on the device that uses it; the handle is released once.
    unsafe { result::mem::map(api, va, size, 0, h) }?;
    let mapped = now_ns()?;
    // SAFETY: as above.
    unsafe { result::mem::set_access(api, va, size, &[desc]) }?;
    let accessible = now_ns()?;
    // SAFETY: as above.
    unsafe {
        result::mem::unmap(api, va, size)?;
        result::mem::release(api, h)?;
        result::mem::address_free(api, va, size)?;
    }
    drop(fd);
    Ok(Imported { path: Path::Raw, received, imported, mapped, accessible })
}

/// The importer's side: exchanges until the exporter says they are over, then the bandwidth and
/// legacy measurements.
pub fn import_side(ctx: &Context, sock: &mut UnixStream) -> Result<ImporterReport> {
    let io = protocol("socket");
    let mut rounds = Vec::new();
    // The raw path assumes the context current, as a C program binds once at its start.
    ctx.bind()?;
    loop {
        let mut code = [0u8; 1];
        sock.read_exact(&mut code).map_err(&io)?;
        let path = match code[0] {
            CODE_CUVMM => Path::Cuvmm,
            CODE_RAW => Path::Raw,
            CODE_END => break,
            other => return Err(Error::Protocol(format!("unknown exchange code {other}"))),
        };
        sock.write_all(&[1]).map_err(&io)?;
        rounds.push(match path {
            Path::Cuvmm => import_cuvmm(ctx, sock)?,
            Path::Raw => import_raw(ctx, sock)?,
        });
        sock.write_all(&[1]).map_err(&io)?;
    }
    // Bandwidth on imported memory, against a local allocation.
    let shared = SharedMemory::import(ctx, recv_next(sock)?, &[])?;
    let size = shared.len();
    let imported_gbs = d2d_gbs(ctx, shared.ptr(), size)?;
    let local = DeviceBuffer::<u8>::new(ctx, size)?;
    let local_gbs = d2d_gbs(ctx, local.ptr(), size)?;
    drop(local);
    // Legacy.
    sock.write_all(&[1]).map_err(&io)?;
    let mut frame = [0u8; LEGACY_FRAME_LEN];
    sock.read_exact(&mut frame).map_err(&io)?;
    let (handle, legacy_len) = legacy_handle(&frame, size)?;
    drop(shared);
    let api = driver()?.api();
    ctx.bind()?;
    let t = now_ns()?;
    // SAFETY: a handle from cuIpcGetMemHandle in the exporter, which keeps the memory alive until
    // we acknowledge below; closed once below.
    let p = unsafe { result::ipc::open_mem_handle(api, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) }?;
    let legacy_open_us = now_ns()?.saturating_sub(t) as f64 / 1e3;
    let legacy_gbs = match opened_size(p, legacy_len) {
        Ok(()) => d2d_gbs(ctx, p, legacy_len),
        Err(e) => Err(e),
    };
    if legacy_gbs.is_err() {
        // SAFETY: opened above, closed once.
        let _ = unsafe { result::ipc::close_mem_handle(api, p) };
    }
    let legacy_gbs = legacy_gbs?;
    // SAFETY: opened above, closed once.
    unsafe { result::ipc::close_mem_handle(api, p) }?;
    sock.write_all(&[2]).map_err(&io)?;
    Ok(ImporterReport { rounds, imported_gbs, local_gbs, legacy_open_us, legacy_gbs })
}

/// Length of the legacy message: the 64 bytes of `CUipcMemHandle`, then the allocation's length
/// in bytes (u64, little-endian).
const LEGACY_FRAME_LEN: usize = 64 + 8;

fn legacy_frame(h: &CUipcMemHandle, len: usize) -> [u8; LEGACY_FRAME_LEN] {
    let mut f = [0u8; LEGACY_FRAME_LEN];
    f[..64].copy_from_slice(&h.reserved);
    f[64..].copy_from_slice(&(len as u64).to_le_bytes());
    f
}

/// The handle in a legacy message and the number of bytes the importer may copy in what it opens.
///
/// The length is accepted only when it equals `imported`, the size of the VMM allocation received
/// before: the exporter makes both the same size, and that one the driver confirmed by mapping all
/// of it. Anything else (a peer announcing more than it shared, or an old exporter that sent no
/// length) is refused rather than copied. Once opened, the driver's own size of the allocation
/// (`cuMemGetAddressRange`) is checked too: see [`opened_size`].
pub(crate) fn legacy_handle(
    frame: &[u8; LEGACY_FRAME_LEN],
    imported: usize,
) -> Result<(CUipcMemHandle, usize)> {
    let mut reserved = [0u8; 64];
    reserved.copy_from_slice(&frame[..64]);
    let announced = u64::from_le_bytes(frame[64..].try_into().expect("8 bytes"));
    if announced == 0 || announced != imported as u64 {
        return Err(Error::Protocol(format!(
            "the legacy allocation is announced as {announced} bytes; expected {imported}, the size \
             of the shared VMM allocation"
        )));
    }
    Ok((CUipcMemHandle { reserved }, imported))
}

/// Refuses memory opened at `p` unless the driver reports at least `len` bytes from `p` on: the
/// peer's announced length is never trusted alone.
fn opened_size(p: CUdeviceptr, len: usize) -> Result<()> {
    let (base, size) = result::mem::get_address_range(driver()?.api(), p)?;
    let available = (base + size as u64).saturating_sub(p);
    if available < len as u64 {
        return Err(Error::Protocol(format!(
            "the legacy allocation holds {available} bytes from its start, fewer than the {len} announced"
        )));
    }
    Ok(())
}

// The options of `cuvmm bench ipc` (their help is the CLI's).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Bytes shared.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: usize,
    /// Importer processes, one after the other (each starts with one exchange of each path,
    /// half of them with cuvmm's first).
    #[arg(long, default_value_t = 4)]
    processes: usize,
    /// Further exchanges of each path per importer process, taking turns.
    #[arg(long, default_value_t = 4)]
    pairs: usize,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Run as the importer, connecting to this socket (used by the benchmark itself).
    #[arg(long, hide = true)]
    child: Option<std::path::PathBuf>,
}

/// `cuvmm bench ipc`: runs the benchmark with `args` and writes its report to `out`.
pub fn cli(args: Args, out: &mut impl Write) -> CliResult {
    let Args { size, processes, pairs, device, json, child } = args;
    let ctx = Context::for_ordinal(device)?;
    if let Some(path) = child {
        let mut sock = std::os::unix::net::UnixStream::connect(path)?;
        let r = import_side(&ctx, &mut sock)?;
        writeln!(out, "{}", r.to_json())?;
        return Ok(());
    }
    if processes == 0 {
        return Err("--processes must be at least 1".into());
    }
    let dir = std::env::temp_dir().join(format!("cuvmm-bench-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("sock");
    let listener = std::os::unix::net::UnixListener::bind(&path)?;
    let me = std::env::current_exe()?;
    let mut children = Vec::new();
    for c in 0..processes {
        let child = std::process::Command::new(&me)
            .args(["bench", "ipc", "--device", &device.to_string(), "--child"])
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let (mut sock, _) = listener.accept()?;
        let exported = export_side(&ctx, &mut sock, size, c, pairs)?;
        let o = child.wait_with_output()?;
        if !o.status.success() {
            return Err("the importer process failed".into());
        }
        let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
        children.push((exported, ImporterReport::from_json(&v)?));
    }
    let _ = std::fs::remove_dir_all(&dir);
    let r = summarize(&children)?;
    print_ipc(out, &ctx.device().name()?, size, &r, json)?;
    Ok(())
}

/// The sharing benchmark's report: cuvmm's steps beside the raw ones, and the ratio.
pub fn print_ipc(out: &mut impl Write, name: &str, size: usize, r: &IpcSummary, json: bool) -> CliResult {
    if json {
        let path = |p: &PathStats| {
            let steps = |v: &[f64; 6]| {
                let m: serde_json::Map<String, serde_json::Value> =
                    STEPS.iter().zip(v).map(|(k, x)| (k.to_string(), json!(x))).collect();
                serde_json::Value::Object(m)
            };
            json!({"warm_us": steps(&p.warm_us), "warm_n": p.warm_n, "first_us": steps(&p.first_us), "first_n": p.first_n})
        };
        writeln!(
            out,
            "{}",
            json!({"bench": "ipc", "device": name, "size": size, "processes": r.children,
                   "cuvmm": path(&r.cuvmm), "raw": path(&r.raw),
                   "ratio_export_to_mapped": r.ratio(),
                   "ratio_first_export_to_mapped": (r.cuvmm.first_n > 0 && r.raw.first_n > 0).then(|| r.first_ratio()),
                   "imported_gbs": r.imported_gbs, "local_gbs": r.local_gbs,
                   "legacy_open_us": r.legacy_open_us, "legacy_gbs": r.legacy_gbs})
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{} shared with {} child processes on {name}: median µs over {} exchanges per path \
         (raw = cuMemExportToShareableHandle, sendmsg, recvmsg, cuMemImportFromShareableHandle, \
         cuMemAddressReserve, cuMemMap, cuMemSetAccess, same run)",
        show(size),
        r.children,
        r.cuvmm.warm_n.min(r.raw.warm_n)
    )?;
    writeln!(out, "{:<24} {:>10} {:>10} {:>8}", "step", "cuvmm", "raw", "ratio")?;
    for (i, step) in STEPS.iter().enumerate() {
        let (c, w) = (r.cuvmm.warm_us[i], r.raw.warm_us[i]);
        writeln!(out, "{step:<24} {c:>10.1} {w:>10.1} {:>7.3}x", c / w)?;
    }
    if r.cuvmm.first_n > 0 && r.raw.first_n > 0 {
        writeln!(
            out,
            "export → mapped, first exchange of a fresh importer ({} / {} processes): cuvmm {:.1} µs, raw {:.1} µs, {:.3}x",
            r.cuvmm.first_n,
            r.raw.first_n,
            r.cuvmm.first_us[5],
            r.raw.first_us[5],
            r.first_ratio()
        )?;
    } else {
        // The importer processes take turns starting on either path: one alone gives one path no
        // first exchange to compare.
        writeln!(out, "first exchange of a fresh importer: needs --processes 2 or more to compare")?;
    }
    writeln!(
        out,
        "export → mapped and accessible: cuvmm / raw = {:.3}x (goal ≤ 1.05x: {})",
        r.ratio(),
        if r.ratio() <= 1.05 { "met" } else { "not met" }
    )?;
    writeln!(out, "legacy cuIpcOpenMemHandle {:.1} µs", r.legacy_open_us)?;
    writeln!(
        out,
        "importer D2D bandwidth: imported {:.0} GB/s, local {:.0} GB/s ({:.3}x), legacy-opened {:.0} GB/s",
        r.imported_gbs,
        r.local_gbs,
        r.imported_gbs / r.local_gbs,
        r.legacy_gbs
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_legacy_length_other_than_the_shared_size_is_refused() {
        let h = CUipcMemHandle { reserved: [3; 64] };
        let size = 4 << 20;
        let (back, len) = legacy_handle(&legacy_frame(&h, size), size).unwrap();
        assert_eq!((back.reserved, len), (h.reserved, size));
        for announced in [0, 1, size - 1, size + 1, 2 * size, usize::MAX] {
            assert!(
                matches!(legacy_handle(&legacy_frame(&h, announced), size), Err(Error::Protocol(_))),
                "{announced} bytes accepted"
            );
        }
    }

    fn exported(path: Path, t0: u64) -> Exported {
        Exported { path, t0, sent: t0 + 700_000 }
    }

    fn imported(path: Path, t0: u64, extra_ns: u64) -> Imported {
        let received = t0 + 710_000;
        Imported {
            path,
            received,
            imported: received + 50_000 + extra_ns,
            mapped: received + 80_000 + extra_ns,
            accessible: received + 180_000 + extra_ns,
        }
    }

    #[test]
    fn each_process_starts_with_one_of_each_and_processes_take_turns() {
        assert_eq!(rounds_per_child(4), 10);
        assert_eq!((path_of(0, 0), path_of(0, 1), path_of(0, 2)), (Path::Cuvmm, Path::Raw, Path::Cuvmm));
        assert_eq!((path_of(1, 0), path_of(1, 1)), (Path::Raw, Path::Cuvmm));
        for child in 0..4 {
            let n = rounds_per_child(3);
            let cuvmm = (0..n).filter(|&r| path_of(child, r) == Path::Cuvmm).count();
            assert_eq!(cuvmm, n / 2);
        }
    }

    #[test]
    fn the_summary_pairs_both_sides_and_keeps_first_exchanges_apart() {
        let mut children = Vec::new();
        for child in 0..2 {
            let (mut e, mut i) = (Vec::new(), Vec::new());
            for round in 0..rounds_per_child(2) {
                let path = path_of(child, round);
                let t0 = 1_000_000_000 * (round as u64 + 1);
                // The first exchange of each process is slow; cuvmm's import 10 µs slower.
                let extra =
                    if round == 0 { 500_000 } else { 0 } + if path == Path::Cuvmm { 10_000 } else { 0 };
                e.push(exported(path, t0));
                i.push(imported(path, t0, extra));
            }
            let report =
                ImporterReport { rounds: i, imported_gbs: 2900.0, local_gbs: 3000.0, ..Default::default() };
            let back = ImporterReport::from_json(&report.to_json()).unwrap();
            assert_eq!(back, report);
            children.push((e, back));
        }
        let s = summarize(&children).unwrap();
        assert_eq!((s.cuvmm.warm_n, s.raw.warm_n, s.cuvmm.first_n, s.raw.first_n), (4, 4, 1, 1));
        assert_eq!(s.raw.warm_us, [700.0, 710.0, 50.0, 30.0, 100.0, 890.0]);
        assert_eq!(s.cuvmm.warm_us[2], 60.0);
        assert_eq!(s.cuvmm.warm_us[5], 900.0);
        assert_eq!(s.raw.first_us[5], 1390.0);
        assert!((s.ratio() - 900.0 / 890.0).abs() < 1e-12);
        // Mismatched sides are refused.
        let mut bad = children.clone();
        bad[0].0.pop();
        assert!(summarize(&bad).is_err());
        let mut bad = children;
        bad[0].0[2].path = Path::Raw; // the importer took the cuvmm path there
        assert!(summarize(&bad).is_err());
    }

    #[test]
    fn the_raw_frame_carries_its_size_and_one_fd() {
        // SAFETY: CMSG_SPACE is arithmetic on its argument.
        assert_eq!(FD_CONTROL, unsafe { libc::CMSG_SPACE(4) } as usize);
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut frame = [0u8; RAW_FRAME_LEN];
        frame[..8].copy_from_slice(&(3u64 << 30).to_le_bytes());
        raw_send(&a, &frame, file.as_raw_fd()).unwrap();
        let (size, fd) = raw_recv(&b).unwrap();
        assert_eq!(size, 3 << 30);
        assert_ne!(fd.as_raw_fd(), file.as_raw_fd());
        // A frame without an fd is refused.
        (&a).write_all(&frame).unwrap();
        assert!(matches!(raw_recv(&b), Err(Error::Protocol(_))));
    }
}
