//! The hand-off between processes (`cuvmm::ipc::handoff`) as C functions: offer a block, take a
//! ticket, release a lease after the work of some streams. What Python's `torch.multiprocessing`
//! reductions call, and what a C program calls to hand blocks to another process.

use super::{allocator, existing_allocator, guard, peer_devices, plain, reported};

use cuvmm_lib::driver::sys::CUstream;
use cuvmm_lib::ipc::handoff::{Lease, Receiver, Sender, Ticket};
use cuvmm_lib::Device;
use std::ffi::{c_int, c_void};
use std::time::Duration;

/// The hand-off's counters in this process (cuvmm_handoff_stats): the sender's, then the receiver's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CuvmmHandoffStats {
    /// Sender: offers not taken yet.
    pub offered: u64,
    /// Sender: offers taken and not let go.
    pub held: u64,
    /// Sender: receiving processes connected.
    pub connections: u64,
    /// Sender: offers let go untaken after their time to live.
    pub expired: u64,
    /// Sender: pages revoked from receivers (given back while mapped there).
    pub revocations: u64,
    /// Sender: offers let go.
    pub let_go: u64,
    /// Receiver: leases not released.
    pub leases: u64,
    /// Receiver: mappings kept (in use, or idle while the sender keeps them).
    pub kept: u64,
    /// Receiver: their bytes.
    pub kept_bytes: u64,
    /// Receiver: releases waiting for the work that used their memory.
    pub releasing: u64,
    /// Receiver: releases whose wait failed, held until exit.
    pub held_for_good: u64,
    /// Receiver: mappings unmapped because their sender gave the pages back.
    pub revoked: u64,
    /// Receiver: connections to sending processes.
    pub senders: u64,
}

/// A lease handed to C: the lease and the device it maps on.
struct CLease {
    lease: Lease,
    device: c_int,
}

fn timeout(seconds: f64) -> Result<Duration, crate::Failure> {
    Duration::try_from_secs_f64(seconds).map_err(|_| plain(format!("timeout {seconds} s")))
}

/// # Safety
/// `p` readable for `len` bytes.
unsafe fn ticket(p: *const u8, len: usize) -> Result<Ticket, crate::Failure> {
    if p.is_null() || len == 0 {
        return Err(plain("no ticket".into()));
    }
    // SAFETY: the caller's contract.
    Ticket::from_bytes(unsafe { std::slice::from_raw_parts(p, len) }).map_err(reported)
}

/// The device of this process whose UUID the ticket names.
fn device_of(t: &Ticket) -> Result<c_int, crate::Failure> {
    for d in Device::all().map_err(reported)? {
        if d.uuid().map_err(reported)?.0 == t.device_uuid() {
            return Ok(d.ordinal() as c_int);
        }
    }
    Err(plain(
        "the ticket's memory lives on a device this process does not see (CUDA_VISIBLE_DEVICES?)".into(),
    ))
}

/// The size of the block a ticket (`len` bytes at `ticket`) offers, its fields checked, in
/// `*block_len`. 0, or -1 for something that is not a ticket.
///
/// # Safety
/// `ticket` readable for `len` bytes; `block_len` writable.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_ticket_len(ticket: *const u8, len: usize, block_len: *mut u64) -> c_int {
    guard("cuvmm_ticket_len", -1, || {
        if block_len.is_null() {
            return Err(plain("null output pointer".into()));
        }
        // SAFETY: the caller's contract.
        let t = unsafe { self::ticket(ticket, len) }?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { block_len.write(t.len()) };
        Ok(0)
    })
}

/// Starts the hand-off's threads (and room in the descriptor table for a hand-off's page
/// descriptors) now, so that a first hand-off does not wait for them. 0, or -1 on failure.
#[no_mangle]
pub extern "C" fn cuvmm_handoff_prepare() -> c_int {
    guard("cuvmm_handoff_prepare", -1, || {
        Sender::global().map_err(reported)?;
        Receiver::global().map_err(reported)?;
        Ok(0)
    })
}

/// Lets go of an offer nobody has taken (its ticket was never sent). 1 if it did, 0 if it was
/// taken (or let go) already, -1 on failure.
///
/// # Safety
/// `ticket` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_withdraw(ticket: *const u8, len: usize) -> c_int {
    guard("cuvmm_withdraw", -1, || {
        // SAFETY: the caller's contract.
        let t = unsafe { self::ticket(ticket, len) }?;
        let s = Sender::started().ok_or_else(|| plain("this process offered nothing".into()))?;
        Ok(c_int::from(s.withdraw(&t)))
    })
}

/// The hand-off: a block handed to another process as PyTorch's CUDA IPC hands a tensor over,
/// without pidfd_getfd or privileges (docs/WIRE.md, "The hand-off"; what cuvmm.torch uses).
///
/// cuvmm_offer: offers the live block of `device` holding `ptr` to one receiver; its ticket (the
/// bytes that take it: send them to that receiver only) goes into `ticket` (`cap` bytes) and the
/// block's address into `*block` (may be NULL). Offers of one non-zero `group` go together to the
/// first receiver that takes any of them. The block stays out of every later allocation, even once
/// freed here, until its receiver lets go or exits. Returns the ticket's length; more than `cap`:
/// nothing offered, call again with room enough. -1 on failure.
///
/// # Safety
/// `ticket` writable for `cap` bytes; `block` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_offer(
    device: c_int,
    ptr: *const c_void,
    group: u64,
    ticket: *mut u8,
    cap: usize,
    block: *mut u64,
) -> isize {
    guard("cuvmm_offer", -1, || {
        if ticket.is_null() && cap > 0 {
            return Err(plain("null ticket buffer".into()));
        }
        let a = existing_allocator(device)
            .ok_or_else(|| plain(format!("no cuvmm allocation on device {device}")))?;
        let sender = Sender::global().map_err(reported)?;
        let t = sender.offer(a, ptr as usize as u64, (group != 0).then_some(group)).map_err(reported)?;
        let bytes = t.to_bytes();
        if bytes.len() > cap {
            // Not offered after all: the caller asks again with room enough.
            sender.withdraw(&t);
            return Ok(bytes.len() as isize);
        }
        // SAFETY: bytes.len() <= cap bytes, inside the caller's buffer (checked non-null).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ticket, bytes.len()) };
        if !block.is_null() {
            // SAFETY: the caller's contract.
            unsafe { block.write(t.block()) };
        }
        Ok(bytes.len() as isize)
    })
}

/// Takes a ticket's offer (`len` bytes at `ticket`), waiting at most `timeout_s` seconds for its
/// sender, and maps the block on the device that holds it (its ordinal written to `*device`),
/// granting the `npeers` devices in `peers` access too; `*block` gets its address here (the
/// sender's address `p` inside the block is `*block + p - b`, `b` the block's address there). The
/// same block handed over again is claimed with one message: the mapping is kept while the sender
/// keeps the pages, and unmapped as soon as the sender gives them back to the device. Returns a
/// lease, held until cuvmm_lease_release, or NULL.
///
/// # Safety
/// `ticket` readable for `len` bytes; `peers` for `npeers` ints; `device` and `block` writable.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_take(
    ticket: *const u8,
    len: usize,
    peers: *const c_int,
    npeers: usize,
    timeout_s: f64,
    device: *mut c_int,
    block: *mut u64,
) -> *mut c_void {
    guard("cuvmm_take", std::ptr::null_mut(), || {
        if device.is_null() || block.is_null() {
            return Err(plain("null pointer".into()));
        }
        // SAFETY: the caller's contract.
        let t = unsafe { self::ticket(ticket, len) }?;
        let d = device_of(&t)?;
        // SAFETY: the caller's contract: `npeers` readable ints.
        let peers = unsafe { peer_devices(peers, npeers) }?;
        let a = allocator(d)?;
        let wait = timeout(timeout_s)?;
        let lease =
            Receiver::global().and_then(|r| r.take(a.context(), &t, &peers, wait)).map_err(reported)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe {
            device.write(d);
            block.write(lease.ptr());
        }
        Ok(Box::into_raw(Box::new(CLease { lease, device: d })).cast::<c_void>())
    })
}

/// Lets go of a lease once the work queued so far on the `n` streams at `streams` is done (n == 0:
/// the device's work). Never blocks: the library's thread waits on events, then tells the sender.
/// If that wait fails, the memory stays held and mapped. 0, or -1 on failure (the lease is released
/// all the same, waiting for the device).
///
/// # Safety
/// `lease` a handle [`cuvmm_take`] returned, released once; `streams` readable for `n` handles,
/// each a live stream of the lease's device (or NULL, the legacy default stream).
#[no_mangle]
pub unsafe extern "C" fn cuvmm_lease_release(
    lease: *mut c_void,
    streams: *const CUstream,
    n: usize,
) -> c_int {
    guard("cuvmm_lease_release", -1, || {
        if lease.is_null() || (streams.is_null() && n > 0) {
            return Err(plain("null lease or stream list".into()));
        }
        // SAFETY: the caller's contract: a box from cuvmm_take, released once.
        let CLease { lease, device } = *unsafe { Box::from_raw(lease.cast::<CLease>()) };
        if n == 0 {
            drop(lease); // waits for the device, on the library's thread
            return Ok(0);
        }
        // SAFETY: the caller's contract: `n` readable handles.
        let streams = unsafe { std::slice::from_raw_parts(streams, n) };
        let a = allocator(device)?;
        // SAFETY: live streams of this device, per the caller's contract. On failure the lease
        // is dropped, which waits for the whole device instead.
        unsafe { lease.release_after_raw(a.context(), streams) }.map_err(reported)?;
        Ok(0)
    })
}

/// Tells a ticket's sender it will not be taken. 0, or -1 on failure.
///
/// # Safety
/// `ticket` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_let_go(ticket: *const u8, len: usize, timeout_s: f64) -> c_int {
    guard("cuvmm_let_go", -1, || {
        // SAFETY: the caller's contract.
        let t = unsafe { self::ticket(ticket, len) }?;
        let wait = timeout(timeout_s)?;
        Receiver::global().and_then(|r| r.let_go(&t, wait)).map_err(reported)?;
        Ok(0)
    })
}

/// The hand-off's counters in this process. 0, or -1 for NULL.
///
/// # Safety
/// `out` writable.
#[no_mangle]
pub unsafe extern "C" fn cuvmm_handoff_stats(out: *mut CuvmmHandoffStats) -> c_int {
    guard("cuvmm_handoff_stats", -1, || {
        if out.is_null() {
            return Err(plain("null output pointer".into()));
        }
        let s = Sender::started().map(|s| s.stats()).unwrap_or_default();
        let r = Receiver::started().map(|r| r.stats()).unwrap_or_default();
        let v = CuvmmHandoffStats {
            offered: s.offered as u64,
            held: s.held as u64,
            connections: s.connections as u64,
            expired: s.expired,
            revocations: s.revocations,
            let_go: s.let_go,
            leases: r.leases as u64,
            kept: r.kept as u64,
            kept_bytes: r.kept_bytes,
            releasing: r.releasing as u64,
            held_for_good: r.held_for_good,
            revoked: r.revoked,
            senders: r.connections as u64,
        };
        // SAFETY: checked non-null; the caller's contract.
        unsafe { out.write(v) };
        Ok(0)
    })
}
