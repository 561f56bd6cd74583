//! An exporter and an importer process meeting at a Unix socket. The exporter writes a pattern
//! into a shared allocation and sends it; the importer checks the pattern with a kernel and writes
//! an answer, which the exporter then reads.
//!
//! `cargo run --release --example ipc_share` runs both (it starts itself as the importer);
//! `ipc_share export PATH` and `ipc_share import PATH` run one side each.

mod common;

use cuvmm::alloc::{ExportMode, PeerAllocator};
use cuvmm::ipc::{recv_message, PeerPolicy, SharedMemory};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, Stream};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};

type R = common::Side;

fn export(path: &str, spawn_importer: bool) -> R {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::new(&ctx)?;
    let alloc = PeerAllocator::new(&ctx, &[], ExportMode::Auto)?;
    println!("exporter: handle type chosen by Auto: {:?}", alloc.handle_types());
    let mut a = alloc.allocate(32 << 20)?;
    k.pattern_u32(&st, &mut a.as_mut_slice::<u32>(), 0, 1234)?;
    st.synchronize()?;
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    let child = if spawn_importer {
        Some(std::process::Command::new(std::env::current_exe()?).args(["import", path]).spawn()?)
    } else {
        None
    };
    let (mut s, _) = listener.accept()?;
    let how = a.share(s.as_fd(), 0, a.len(), 1234)?;
    println!("exporter: sent {} MiB as {how:?}", a.len() >> 20);
    let mut done = [0u8];
    s.read_exact(&mut done)?;
    let bad = k.count_pattern_mismatches(&st, &a.as_slice::<u32>(), 0, 1235)?;
    println!("exporter: the importer's answer has {bad} wrong elements");
    if let Some(mut c) = child {
        c.wait()?;
    }
    let _ = std::fs::remove_file(path);
    if bad != 0 {
        return Err("the answer is wrong".into());
    }
    Ok(())
}

fn import(path: &str) -> R {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::new(&ctx)?;
    let mut s = UnixStream::connect(path)?;
    let msg = recv_message(s.as_fd(), PeerPolicy::SameUid)?.ok_or("the exporter closed the socket")?;
    let share = *msg.share().ok_or("the exporter sent something other than a share")?;
    let seed = share.tag() as u32;
    println!("importer: got {} bytes from pid {}", share.length(), msg.peer().pid);
    let mut shm = SharedMemory::import(&ctx, msg, &[])?;
    let bad = k.count_pattern_mismatches(&st, &shm.as_slice::<u32>(), 0, seed)?;
    println!("importer: the exporter's pattern has {bad} wrong elements");
    k.pattern_u32(&st, &mut shm.as_mut_slice::<u32>(), 0, seed + 1)?;
    st.synchronize()?;
    s.write_all(&[1])?;
    if bad != 0 {
        return Err("the pattern is wrong".into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("ipc_share", common::two_sides("cuvmm-ipc-share.sock", export, import))
}
