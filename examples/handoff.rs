//! Blocks of a `StreamAllocator` handed back and forth between two processes, zero copy, with
//! `cuvmm::ipc::handoff`. Each round, A fills a block with a pattern, offers it and sends the
//! ticket's bytes to B through B's standard input; B takes it, checks the pattern with a kernel
//! and writes the next one, fills a block of its own, offers that back through its standard output,
//! and releases A's block once its kernel is done. A takes B's block, checks it, releases it, and
//! checks that B's writes are in its own block. Both print what they did and A the time each
//! hand-off took.
//!
//! `cargo run --release --example handoff [ROUNDS]` (100 rounds by default) runs A, which starts
//! this program again as B.

mod common;

use cuvmm::alloc::StreamAllocator;
use cuvmm::ipc::handoff::{Receiver, Sender, Ticket};
use cuvmm::kernels::Kernels;
use cuvmm::{Context, DeviceSlice, DeviceSliceMut, Stream};
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type R = common::Side;

/// Bytes per block.
const SIZE: usize = 64 << 20;
/// How long a take waits for the other process.
const WAIT: Duration = Duration::from_secs(30);

/// One record: a little-endian u32 length, then the bytes.
fn send(w: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(&(bytes.len() as u32).to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

/// The next record, or `None` at the end of the stream.
fn recv(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        r => r?,
    }
    let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut b)?;
    Ok(Some(b))
}

/// The words of a lease, whose memory the other process handed over.
fn lease_words(ptr: u64, len: usize) -> DeviceSliceMut<'static, u32> {
    // SAFETY: a live lease of `len` bytes; the work on it is ordered on one stream and released
    // after that stream's work.
    unsafe { DeviceSliceMut::from_raw_parts(ptr, len / 4) }
}

fn lease_view(ptr: u64, len: usize) -> DeviceSlice<'static, u32> {
    // SAFETY: as for `lease_words`.
    unsafe { DeviceSlice::from_raw_parts(ptr, len / 4) }
}

fn a(rounds: u32) -> R {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::non_blocking(&ctx)?;
    let alloc = StreamAllocator::new(&ctx)?;
    let (sender, receiver) = (Sender::global()?, Receiver::global()?);
    let mut b = Command::new(std::env::current_exe()?)
        .arg("b")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let (mut to_b, mut from_b) =
        (b.stdin.take().ok_or("no pipe to B")?, b.stdout.take().ok_or("no pipe from B")?);
    let (mut there, mut back) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut block = alloc.allocate(SIZE, &st)?;
        k.pattern_u32(&st, &mut block.as_mut_slice(), 0, round)?;
        st.synchronize()?;
        let let_go = sender.stats().let_go;
        let start = Instant::now();
        let ticket = sender.offer(&alloc, block.ptr(), None)?;
        send(&mut to_b, &ticket.to_bytes())?;
        let answer = recv(&mut from_b)?.ok_or("B ended before it answered")?;
        let (taken, bad) =
            (u64::from_le_bytes(answer[..8].try_into()?), u64::from_le_bytes(answer[8..16].try_into()?));
        there.push(Duration::from_nanos(taken));
        if bad != 0 {
            return Err(format!("round {round}: B saw {bad} words other than A wrote").into());
        }
        // B's own block, handed the other way.
        let t = Ticket::from_bytes(&answer[16..])?;
        let start_back = Instant::now();
        let lease = receiver.take(&ctx, &t, &[], WAIT)?;
        back.push(start_back.elapsed());
        let bad = k.count_pattern_mismatches(&st, &lease_view(lease.ptr(), lease.len()), 0, round + 2000)?;
        if bad != 0 {
            return Err(format!("round {round}: A saw {bad} words other than B wrote").into());
        }
        lease.release_after(&st)?;
        // B's writes to A's block, there once B has let go (after its kernel).
        let end = Instant::now() + WAIT;
        while sender.stats().let_go == let_go {
            if Instant::now() > end {
                return Err(format!("round {round}: B never let go of A's block").into());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let bad = k.count_pattern_mismatches(&st, &block.as_slice(), 0, round + 1000)?;
        if bad != 0 {
            return Err(format!("round {round}: {bad} of B's writes are not in A's block").into());
        }
        if round < 3 {
            println!(
                "A: round {round}: {} MiB at {:#x} to B and back in {:?}; B's block taken in {:?}",
                SIZE >> 20,
                block.ptr(),
                start.elapsed(),
                back[round as usize],
            );
        }
    }
    drop(to_b); // B ends at the end of its input
    let status = b.wait()?;
    if !status.success() {
        return Err(format!("B failed: {status}").into());
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    if rounds > 0 {
        println!(
            "A: {rounds} rounds, each block checked on both sides; median take: A to B {:?}, B to A {:?} \
             (the first, which maps the pages: {:?} and {:?})",
            median(&mut there.clone()),
            median(&mut back.clone()),
            there[0],
            back[0],
        );
    }
    let s = sender.stats();
    println!(
        "A: sender: {} offers let go, {} held, {} offered; receiver: {:?}",
        s.let_go,
        s.held,
        s.offered,
        receiver.stats()
    );
    Ok(())
}

fn b() -> R {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::non_blocking(&ctx)?;
    let alloc = StreamAllocator::new(&ctx)?;
    let (sender, receiver) = (Sender::global()?, Receiver::global()?);
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut round = 0u32;
    while let Some(bytes) = recv(&mut input)? {
        let ticket = Ticket::from_bytes(&bytes)?;
        let start = Instant::now();
        let lease = receiver.take(&ctx, &ticket, &[], WAIT)?;
        let taken = start.elapsed();
        let bad = k.count_pattern_mismatches(&st, &lease_view(lease.ptr(), lease.len()), 0, round)?;
        k.pattern_u32(&st, &mut lease_words(lease.ptr(), lease.len()), 0, round + 1000)?;
        // A block of B's own, offered back.
        let mut block = alloc.allocate(SIZE, &st)?;
        k.pattern_u32(&st, &mut block.as_mut_slice(), 0, round + 2000)?;
        st.synchronize()?;
        let back = sender.offer(&alloc, block.ptr(), None)?;
        lease.release_after(&st)?;
        let mut answer = (taken.as_nanos() as u64).to_le_bytes().to_vec();
        answer.extend_from_slice(&bad.to_le_bytes());
        answer.extend_from_slice(&back.to_bytes());
        send(&mut output, &answer)?;
        // Freed now: its memory stays out of B's later blocks until A lets go.
        drop(block);
        if round < 3 {
            eprintln!(
                "B: round {round}: took A's block ({:#x} in A) in {taken:?}, {bad} wrong words",
                ticket.block()
            );
        }
        round += 1;
    }
    eprintln!("B: {round} rounds; receiver: {:?}", receiver.stats());
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let outcome = match args.get(1).map(String::as_str) {
        Some("b") => b(),
        Some(n) => match n.parse() {
            Ok(rounds) => a(rounds),
            Err(_) => Err(format!("usage: {} [ROUNDS]", args[0]).into()),
        },
        None => a(100),
    };
    common::report("handoff", outcome)
}
