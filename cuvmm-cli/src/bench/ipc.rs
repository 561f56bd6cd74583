//! `cuvmm bench ipc`: an allocation shared with a child process over a Unix socket. The exporter
//! (this process) exports and sends; the importer (a child) receives, imports, maps and grants
//! access, timing each step on CLOCK_MONOTONIC (comparable across processes), then measures
//! device-to-device bandwidth on the imported memory against a local allocation of its own. The
//! legacy cuIpcGetMemHandle / cuIpcOpenMemHandle path runs in the same session.

use super::median;
use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::context::Context;
use cuvmm::driver::{driver, sys::*};
use cuvmm::error::{Error, Result};
use cuvmm::ipc::{recv, PeerPolicy};
use cuvmm::memory::DeviceBuffer;
use cuvmm::stream::Event;
use cuvmm::stream::Stream;
use cuvmm::vmm::{Access, PhysicalMemory, Reservation};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

/// Nanoseconds on CLOCK_MONOTONIC.
pub fn now_ns() -> Result<u64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_err(|errno| Error::Os { call: "clock_gettime", errno })?;
    Ok(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

/// What the importer reports, in microseconds and GB/s.
#[derive(Clone, Copy, Debug, Default)]
pub struct ImporterReport {
    /// From the exporter's start of export to the end of receive (incl. export and send).
    pub export_to_received_us: f64,
    /// cuMemImportFromShareableHandle.
    pub import_us: f64,
    /// Reserve and map.
    pub map_us: f64,
    /// cuMemSetAccess.
    pub access_us: f64,
    /// Exporter's start of export to importer's mapping being accessible.
    pub export_to_mapped_us: f64,
    /// Device-to-device copy bandwidth inside the imported memory.
    pub imported_gbs: f64,
    /// The same copy inside a local allocation.
    pub local_gbs: f64,
    /// cuIpcOpenMemHandle on a legacy handle.
    pub legacy_open_us: f64,
    /// Copy bandwidth inside the legacy-opened memory.
    pub legacy_gbs: f64,
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
        unsafe { api.cuMemcpyDtoDAsync(base + half as u64, base, half, s.raw()) }?;
        b.record(&s)?;
        b.synchronize()?;
        if rep > 0 {
            samples.push(2.0 * half as f64 / (a.elapsed_ms(&b)? as f64 / 1e3) / 1e9);
        }
    }
    Ok(median(&samples))
}

/// The exporter's side: shares `bytes` twice (VMM, then legacy IPC) with the process at `sock`.
pub fn export_side(ctx: &Context, sock: &mut UnixStream, bytes: usize) -> Result<()> {
    let alloc = PeerAllocator::new(ctx, &[], ExportMode::PosixFd)?;
    let a = alloc.allocate(bytes)?;
    // Start time first, so the importer can measure export-to-mapped.
    let t0 = now_ns()?;
    sock.write_all(&t0.to_le_bytes()).map_err(|e| Error::Protocol(format!("send start time: {e}")))?;
    a.share(sock.as_fd(), 0, a.len(), 1)?;
    let mut ack = [0u8; 1];
    sock.read_exact(&mut ack).map_err(|e| Error::Protocol(format!("wait for the importer: {e}")))?;
    // Legacy path: cuMemAlloc + cuIpcGetMemHandle, the handle and the length over the socket. The
    // buffer is as large as the VMM allocation (`bytes` rounded up to the granularity), which is
    // the length the importer copies in both.
    let api = driver()?.api();
    ctx.bind()?;
    let legacy = DeviceBuffer::<u8>::new(ctx, a.len())?;
    let mut h = CUipcMemHandle::default();
    // SAFETY: out-pointer valid; the buffer is a live cuMemAlloc allocation.
    unsafe { api.cuIpcGetMemHandle(&mut h, legacy.ptr()) }?;
    sock.write_all(&legacy_frame(&h, a.len()))
        .map_err(|e| Error::Protocol(format!("send legacy handle: {e}")))?;
    sock.read_exact(&mut ack).map_err(|e| Error::Protocol(format!("wait for the importer: {e}")))?;
    Ok(())
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
    let (mut base, mut size) = (0, 0usize);
    // SAFETY: out-pointers are valid locals; `p` was just opened in the current context.
    unsafe { driver()?.api().cuMemGetAddressRange(&mut base, &mut size, p) }?;
    let available = (base + size as u64).saturating_sub(p);
    if available < len as u64 {
        return Err(Error::Protocol(format!(
            "the legacy allocation holds {available} bytes from its start, fewer than the {len} announced"
        )));
    }
    Ok(())
}

/// The importer's side.
pub fn import_side(ctx: &Context, sock: &mut UnixStream) -> Result<ImporterReport> {
    let io = |e: std::io::Error| Error::Protocol(format!("socket: {e}"));
    let mut t0 = [0u8; 8];
    sock.read_exact(&mut t0).map_err(io)?;
    let t0 = u64::from_le_bytes(t0);
    let msg = recv(sock.as_fd(), PeerPolicy::SameUid)?;
    let t_recv = now_ns()?;
    let (header, fd, _) = msg.into_parts();
    let size = usize::try_from(header.size())
        .map_err(|_| Error::Protocol("the allocation size does not fit this machine".into()))?;
    let fd = fd.ok_or_else(|| Error::Protocol("no fd".into()))?;
    let phys = PhysicalMemory::import_fd(ctx, fd.as_fd(), size)?;
    let t_import = now_ns()?;
    let va = Reservation::new(ctx, size)?;
    // Succeeds only if the allocation holds `size` bytes: from here on `size` is the driver's word
    // too, not only the peer's.
    let m = va.map(0, &phys, 0, size)?;
    let t_map = now_ns()?;
    m.set_access(&[(ctx.device(), Access::ReadWrite)])?;
    let t_access = now_ns()?;
    let us = |a: u64, b: u64| (b.saturating_sub(a)) as f64 / 1e3;
    let imported_gbs = d2d_gbs(ctx, m.ptr(), size)?;
    let local = DeviceBuffer::<u8>::new(ctx, size)?;
    let local_gbs = d2d_gbs(ctx, local.ptr(), size)?;
    drop(local);
    sock.write_all(&[1]).map_err(io)?;
    // Legacy.
    let mut frame = [0u8; LEGACY_FRAME_LEN];
    sock.read_exact(&mut frame).map_err(io)?;
    let (handle, legacy_len) = legacy_handle(&frame, size)?;
    let api = driver()?.api();
    ctx.bind()?;
    let mut p = 0;
    let t = now_ns()?;
    // SAFETY: a handle from cuIpcGetMemHandle in the exporter, which keeps the memory alive until
    // we acknowledge below.
    unsafe { api.cuIpcOpenMemHandle(&mut p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) }?;
    let legacy_open_us = us(t, now_ns()?);
    let legacy_gbs = match opened_size(p, legacy_len) {
        Ok(()) => d2d_gbs(ctx, p, legacy_len),
        Err(e) => Err(e),
    };
    if legacy_gbs.is_err() {
        // SAFETY: opened above, closed once.
        let _ = unsafe { api.cuIpcCloseMemHandle(p) };
    }
    let legacy_gbs = legacy_gbs?;
    // SAFETY: opened above, closed once.
    unsafe { api.cuIpcCloseMemHandle(p) }?;
    sock.write_all(&[2]).map_err(io)?;
    Ok(ImporterReport {
        export_to_received_us: us(t0, t_recv),
        import_us: us(t_recv, t_import),
        map_us: us(t_import, t_map),
        access_us: us(t_map, t_access),
        export_to_mapped_us: us(t0, t_access),
        imported_gbs,
        local_gbs,
        legacy_open_us,
        legacy_gbs,
    })
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
}
