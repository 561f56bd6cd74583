//! A growing vector shared with other processes (`VmmVec::share_growth`, `GrowableImport`) on a
//! GPU. A multi-process test re-executes itself for the other side (`common::rerun_this_test`),
//! which `growth_child` plays when the environment names its role.

mod common;

use cuvmm::ipc::wire::{Grow, HandleType, Kind, Message, Region, WireHandle};
use cuvmm::ipc::{send_message, GrowableImport, PeerPolicy, RegionRefusal, Update};
use cuvmm::kernels::{pattern_value, Kernels};
use cuvmm::vmm::{ChunkPolicy, HandleTypes, PhysicalMemory};
use cuvmm::{Context, Error, Stream, VmmVec};
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Child;
use std::sync::Mutex;
use std::time::Duration;

const MIB: usize = 1 << 20;
const ROLE: &str = "CUVMM_GROWTH_ROLE";
const SOCK: &str = "CUVMM_GROWTH_SOCKET";
/// The largest region the importers here accept.
const LIMIT: usize = 1 << 30;
/// fd counts and device memory are per process: these tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn ctx() -> Context {
    Context::for_ordinal(0).expect("a CUDA device")
}

fn used(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().used()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The driver may open descriptors and memory of its own at a process's first export and
/// import, and keep them: one of each first, so that counts taken afterwards see only the test's.
fn warm_up(ctx: &Context) {
    let phys = PhysicalMemory::builder(ctx).handle_types(HandleTypes::POSIX_FD).create(2 * MIB).unwrap();
    let fd = phys.export_fd().unwrap();
    drop(PhysicalMemory::import_fd(ctx, fd.as_fd(), 2 * MIB).unwrap());
}

/// `s` with a read timeout far above any step of these tests: a message that never comes fails the
/// test with a receive error instead of hanging it.
fn timed(s: UnixStream) -> UnixStream {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// A connected pair whose receiving end (the second) times out.
fn pair() -> (UnixStream, UnixStream) {
    let (x, y) = UnixStream::pair().unwrap();
    (x, timed(y))
}

/// Chunks of exactly `chunk` bytes, so that each growth maps a known number of them.
fn fixed(chunk: usize) -> ChunkPolicy {
    ChunkPolicy { min_chunk: chunk, max_chunk: chunk, growth_percent: 0 }
}

fn shared_vec(ctx: &Context, policy: ChunkPolicy, reserve: usize) -> VmmVec<u32> {
    VmmVec::builder(ctx)
        .handle_types(HandleTypes::POSIX_FD)
        .chunk_policy(policy)
        .reserve_address_space(reserve)
        .build()
        .unwrap()
}

fn pattern(range: std::ops::Range<usize>, seed: u32) -> Vec<u32> {
    range.map(|i| pattern_value(i as u64, seed)).collect()
}

/// Starts this binary as the other side in `role` and returns it with its connection.
fn child_on_socket(role: &str) -> (Child, UnixStream) {
    let path = std::env::temp_dir().join(format!("cuvmm-growth-{}-{role}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path).unwrap();
    let child = common::rerun_this_test().env(ROLE, role).env(SOCK, &path).spawn().unwrap();
    let (s, _) = l.accept().unwrap();
    let _ = std::fs::remove_file(path);
    (child, timed(s))
}

/// What the importing child reports after each note: mismatches against the pattern in the
/// written part, bytes mapped, chunks mapped, whether its base address is the first one it had,
/// and its reservation's size.
const REPORT: usize = 5;

fn send_report(s: &mut UnixStream, r: [u64; REPORT]) {
    let bytes: Vec<u8> = r.iter().flat_map(|x| x.to_le_bytes()).collect();
    s.write_all(&bytes).unwrap();
}

fn read_report(s: &mut UnixStream) -> [u64; REPORT] {
    let mut b = [0u8; REPORT * 8];
    s.read_exact(&mut b).unwrap();
    let mut r = [0u64; REPORT];
    for (i, x) in r.iter_mut().enumerate() {
        *x = u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    }
    r
}

/// The other side of a multi-process test, in the copy of it that `child_on_socket` started:
/// plays the role the environment names and returns true, or returns false at once in the test
/// itself.
fn growth_child() -> bool {
    let Some(role) = std::env::var_os(ROLE) else { return false };
    let s = timed(UnixStream::connect(std::env::var_os(SOCK).unwrap()).unwrap());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    match role.to_str().unwrap() {
        "importer" => {
            let mut out = s.try_clone().unwrap();
            let mut imp = GrowableImport::accept(&ctx, s, PeerPolicy::SameUid, LIMIT, &[]).unwrap();
            let base = imp.ptr();
            let seed = imp.region().tag() as u32;
            let mut written = 0;
            let mut report = |imp: &GrowableImport, written: usize| {
                let part = imp.as_slice::<u32>().slice(0..written).unwrap();
                let mismatches = k.count_pattern_mismatches(&st, &part, 0, seed).unwrap();
                let stable = u64::from(imp.ptr() == base);
                send_report(
                    &mut out,
                    [
                        mismatches,
                        imp.mapped() as u64,
                        imp.chunks().len() as u64,
                        stable,
                        imp.capacity() as u64,
                    ],
                );
            };
            while let Some(w) = imp.next_note().unwrap() {
                written = w as usize;
                report(&imp, written);
            }
            // The exporter dropped its vector and closed the connection: what is mapped here is
            // still there, and still holds what it wrote.
            assert!(imp.is_closed());
            assert_eq!(imp.next_update().unwrap(), Update::Closed);
            std::thread::sleep(Duration::from_millis(200));
            report(&imp, written);
        }
        "exporter-grows-until-killed" | "exporter-stops-inside-a-grow" => {
            let mut raw = s.try_clone().unwrap();
            let mut v = shared_vec(&ctx, fixed(2 * MIB), 256 * MIB);
            let seed = 0x6e0 ^ std::process::id();
            v.share_growth(s, seed as u64).unwrap();
            let mut written = 0;
            for n in [1000, 600_000, 900_000] {
                v.extend_from_slice(&pattern(written..written + n, seed)).unwrap();
                written += n;
                v.notify_importers(written as u64).unwrap();
            }
            if role == "exporter-stops-inside-a-grow" {
                // Half a grow message, its fd never sent: then nothing until killed.
                let at = v.mapped_bytes() as u64;
                let g =
                    Grow::new(WireHandle::PosixFd, 2 * MIB as u64, 2 * MIB as u64, at, [0; 16], 0).unwrap();
                raw.write_all(&Message::Grow(g).encode().unwrap()[..70]).unwrap();
            } else {
                // One chunk at a time, as long as the reservation lasts, each announced before
                // the data is written to it.
                while v.mapped_bytes() + 2 * MIB <= v.raw().reserved() {
                    v.extend_from_slice(&pattern(written..written + MIB / 2, seed)).unwrap();
                    written += MIB / 2;
                }
            }
            loop {
                std::thread::sleep(Duration::from_secs(1)); // until SIGKILLed
            }
        }
        other => panic!("unknown role {other}"),
    }
    true
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_importer_reads_what_was_written_after_each_growth_and_follows_shrinks() {
    if growth_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    let seed = 0x5eed ^ std::process::id();
    // Chunks from 2 to 8 MiB, each half of what is mapped: several per growth, of several sizes.
    let policy = ChunkPolicy { min_chunk: 2 * MIB, max_chunk: 8 * MIB, growth_percent: 50 };
    let mut v = shared_vec(&ctx, policy, 256 * MIB);
    let base = v.device_ptr();
    let (mut child, s) = child_on_socket("importer");
    let mut back = s.try_clone().unwrap();
    v.share_growth(s, seed as u64).unwrap();
    assert_eq!(v.importer_count(), 1);
    let check = |v: &VmmVec<u32>, back: &mut UnixStream, written: usize, what: &str| {
        let [mismatches, mapped, chunks, stable, capacity] = read_report(back);
        assert_eq!(mismatches, 0, "{what}: the importer read other data than was written");
        assert_eq!(mapped as usize, v.mapped_bytes(), "{what}: mapped bytes");
        assert_eq!(chunks as usize, v.raw().chunk_count(), "{what}: chunks");
        assert_eq!(stable, 1, "{what}: the importer's base address moved");
        assert_eq!(capacity as usize, 256 * MIB, "{what}: the importer reserved the region once");
        assert_eq!(written, v.len());
    };
    let mut written = 0;
    // Six growths, from one chunk's worth of elements to many; odd steps are written by a kernel
    // still queued when the note is sent (the note waits for it), even ones by host copies.
    for (step, n) in [1000, 700_000, 1_500_000, 3_000_000, 5_000_000, 8_000_000].into_iter().enumerate() {
        let chunks = v.raw().chunk_count();
        if step % 2 == 0 {
            v.extend_from_slice(&pattern(written..written + n, seed)).unwrap();
        } else {
            v.resize(written + n, 0).unwrap();
            let part = v.as_mut_slice().slice_mut(written..written + n).unwrap();
            k.pattern_u32(&st, &mut { part }, written as u64, seed).unwrap();
        }
        assert!(v.raw().chunk_count() > chunks, "step {step} mapped no chunk");
        written += n;
        v.notify_importers(written as u64).unwrap();
        check(&v, &mut back, written, &format!("growth {step}"));
    }
    assert_eq!(v.device_ptr(), base, "the exporter did not move either");
    // Shrink to a quarter: the importer unmaps what the exporter unmapped.
    let chunks = v.raw().chunk_count();
    v.truncate(written / 4);
    v.shrink_to_fit().unwrap();
    assert!(v.raw().chunk_count() < chunks, "the shrink unmapped nothing");
    written = v.len();
    v.notify_importers(written as u64).unwrap();
    check(&v, &mut back, written, "shrink");
    // Grow again: new chunks at the offsets of the ones released.
    for n in [2_000_000, 6_000_000] {
        v.extend_from_slice(&pattern(written..written + n, seed)).unwrap();
        written += n;
        v.notify_importers(written as u64).unwrap();
        check(&v, &mut back, written, "growth after the shrink");
    }
    // The exporter drops the vector (its chunks released on this side) and closes: the importer
    // still reads everything written. The shutdown ends the stream that `back` keeps open.
    drop(v);
    back.shutdown(Shutdown::Write).unwrap();
    let [mismatches, mapped, ..] = read_report(&mut back);
    assert_eq!(mismatches, 0, "the importer lost data when the exporter dropped the vector");
    assert!(mapped as usize >= written * 4);
    assert!(child.wait().unwrap().success(), "the importer's checks failed");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_exporter_killed_mid_growth_leaves_the_importers_mapped_part_intact() {
    if growth_child() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    warm_up(&ctx);
    let fds = open_fds();
    for role in ["exporter-grows-until-killed", "exporter-stops-inside-a-grow"] {
        let (mut child, s) = child_on_socket(role);
        let mut imp = GrowableImport::accept(&ctx, s, PeerPolicy::SameUid, LIMIT, &[]).unwrap();
        assert_eq!(imp.capacity(), 256 * MIB);
        let seed = imp.region().tag() as u32;
        let mut written = 0;
        for _ in 0..3 {
            written = imp.next_note().unwrap().expect("a note") as usize;
            let part = imp.as_slice::<u32>().slice(0..written).unwrap();
            assert_eq!(k.count_pattern_mismatches(&st, &part, 0, seed).unwrap(), 0, "{role}");
        }
        let base = imp.ptr();
        if role == "exporter-grows-until-killed" {
            // Kill it while it grows: after two more chunks have arrived.
            let mut grew = 0;
            while grew < 2 {
                if let Update::Grew { .. } = imp.next_update().unwrap() {
                    grew += 1;
                }
            }
        } else {
            // Half a grow message follows the last note at once.
            std::thread::sleep(Duration::from_millis(300));
        }
        let mapped_at_kill = imp.mapped();
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Whatever it sent before dying arrives and is mapped; then the stream ends, between two
        // messages or inside one.
        let end = loop {
            match imp.next_update() {
                Ok(Update::Grew { .. }) => continue,
                other => break other,
            }
        };
        match (role, end) {
            ("exporter-grows-until-killed", Ok(Update::Closed)) => {}
            ("exporter-grows-until-killed", Err(Error::PeerClosed { .. })) => {}
            ("exporter-stops-inside-a-grow", Err(Error::PeerClosed { received: 70, expected: 144 })) => {}
            (_, other) => panic!("{role}: the stream ended with {other:?}"),
        }
        // The error or the end stays; nothing more is mapped or unmapped.
        let again = imp.next_update();
        assert!(
            matches!(&again, Ok(Update::Closed)) || again.as_ref().is_err_and(Error::is_protocol),
            "{role}: {again:?}"
        );
        assert!(imp.mapped() >= mapped_at_kill, "{role}: chunks were unmapped");
        assert_eq!(imp.ptr(), base);
        // The mapped part is intact and readable, now and a while after the exporter's death.
        for _ in 0..3 {
            let part = imp.as_slice::<u32>().slice(0..written).unwrap();
            assert_eq!(k.count_pattern_mismatches(&st, &part, 0, seed).unwrap(), 0, "{role}: data lost");
            k.checksum_u32(&st, &imp.as_slice::<u32>()).unwrap(); // every mapped chunk reads
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut last = [0u32; 1];
        imp.copy_to_host(written * 4 - 4, &mut last).unwrap();
        assert_eq!(last[0], pattern_value(written as u64 - 1, seed));
        // And writable: it is this process's memory as much as anyone's.
        k.pattern_u32(&st, &mut imp.as_mut_slice::<u32>(), 0, seed + 1).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &imp.as_slice::<u32>(), 0, seed + 1).unwrap(), 0);
        eprintln!(
            "{role}: {} bytes mapped at the kill, {} after, {written} elements checked",
            mapped_at_kill,
            imp.mapped()
        );
    }
    assert_eq!(open_fds(), fds, "an fd leaked");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_late_importer_gets_every_chunk_shrinks_unmap_and_memory_comes_back() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    let k = Kernels::load(&ctx).unwrap();
    let st = Stream::new(&ctx).unwrap();
    warm_up(&ctx);
    let baseline = used(&ctx);
    let fds = open_fds();
    {
        // A vector whose chunks cannot be exported is not shared.
        let mut plain = VmmVec::<u32>::builder(&ctx).reserve_address_space(64 * MIB).build().unwrap();
        let (x, _y) = pair();
        assert!(matches!(plain.share_growth(x, 0), Err(Error::InvalidArgument(_))));
        drop(plain);

        let mut v = shared_vec(&ctx, fixed(2 * MIB), 64 * MIB);
        let (x, y) = pair();
        v.share_growth(x, 1).unwrap();
        let mut a = GrowableImport::accept(&ctx, y, PeerPolicy::SameUid, LIMIT, &[]).unwrap();
        assert_eq!((a.capacity(), a.mapped(), a.region().tag()), (64 * MIB, 0, 1));
        assert_eq!(a.region().handle_type(), HandleType::PosixFd);
        let n = 3 * MIB / 4; // 3 MiB: two chunks
        v.extend_from_slice(&pattern(0..n, 41)).unwrap();
        v.notify_importers(n as u64).unwrap();
        assert_eq!(a.next_update().unwrap(), Update::Grew { offset: 0, size: 2 * MIB, tag: 0 });
        assert_eq!(a.next_update().unwrap(), Update::Grew { offset: 2 * MIB, size: 2 * MIB, tag: 0 });
        assert_eq!(a.next_update().unwrap(), Update::Note { tag: n as u64 });
        assert_ne!(a.ptr(), v.device_ptr(), "the importer maps at its own addresses");
        let part = a.as_slice::<u32>().slice(0..n).unwrap();
        assert_eq!(k.count_pattern_mismatches(&st, &part, 0, 41).unwrap(), 0);

        // A late importer gets the region and both chunks at once.
        let (x, y) = pair();
        v.share_growth(x, 2).unwrap();
        assert_eq!(v.importer_count(), 2);
        let mut b = GrowableImport::accept(&ctx, y, PeerPolicy::SameUid, LIMIT, &[]).unwrap();
        assert!(matches!(b.next_update().unwrap(), Update::Grew { offset: 0, .. }));
        assert!(matches!(b.next_update().unwrap(), Update::Grew { offset, .. } if offset == 2 * MIB));
        assert_eq!(b.layout().chunks(), a.layout().chunks());
        // One memory: what an importer writes, the exporter and the other importer read.
        b.copy_from_host(4, &[7u32, 8, 9]).unwrap();
        assert_eq!(v.get(2).unwrap(), Some(8));
        let mut three = [0u32; 3];
        a.copy_to_host(4, &mut three).unwrap();
        assert_eq!(three, [7, 8, 9]);

        // A shrink to one chunk: both importers unmap the second.
        v.truncate(1);
        v.shrink_to_fit().unwrap();
        assert_eq!(v.mapped_bytes(), 2 * MIB);
        for imp in [&mut a, &mut b] {
            assert_eq!(imp.next_update().unwrap(), Update::Shrank { length: 2 * MIB, tag: 0 });
            assert_eq!((imp.mapped(), imp.chunks().len()), (2 * MIB, 1));
            let mut word = [0u32; 1];
            assert!(matches!(imp.copy_to_host(2 * MIB, &mut word), Err(Error::InvalidArgument(_))));
            imp.copy_to_host(2 * MIB - 4, &mut word).unwrap();
        }
        // Growth resumes at the released offset, with new memory.
        v.resize(MIB, 5).unwrap();
        for imp in [&mut a, &mut b] {
            assert_eq!(imp.next_update().unwrap(), Update::Grew { offset: 2 * MIB, size: 2 * MIB, tag: 0 });
            let mut word = [0u32; 1];
            imp.copy_to_host(4 * MIB - 4, &mut word).unwrap();
            assert_eq!(word[0], 5);
        }

        // While importers are connected the vector refuses to move, and changes nothing.
        let (ptr, mapped) = (v.device_ptr(), v.mapped_bytes());
        match v.reserve(100 * MIB / 4) {
            Err(e) if e.kind() == cuvmm::ErrorKind::Refused(cuvmm::Refusal::WouldMove) => {}
            other => panic!("a vector with importers moved: {other:?}"),
        }
        assert_eq!((v.device_ptr(), v.mapped_bytes(), v.len()), (ptr, mapped, MIB));
        // An importer that has gone is dropped at the next message, without an error here.
        drop(b);
        v.notify_importers(3).unwrap();
        assert_eq!(v.importer_count(), 1);
        assert_eq!(a.next_note().unwrap(), Some(3));
        drop(a);
        v.notify_importers(4).unwrap();
        assert_eq!(v.importer_count(), 0);
        // With no importer left it may move again.
        v.reserve(100 * MIB / 4).unwrap();
        assert_ne!(v.device_ptr(), ptr);
        assert_eq!(v.get(MIB - 1).unwrap(), Some(5));
    }
    assert_eq!(open_fds(), fds, "an fd leaked");
    let after = used(&ctx);
    assert!(after.abs_diff(baseline) <= 2 * MIB, "baseline {baseline}, after {after}");
}

/// Sends `messages` on a fresh connection (a grow's fd: a 2 MiB allocation of ours) and accepts
/// an import from it.
fn forged(ctx: &Context, messages: &[Message]) -> (Result<GrowableImport, Error>, UnixStream) {
    let (x, y) = pair();
    let chunk = PhysicalMemory::builder(ctx).handle_types(HandleTypes::POSIX_FD).create(2 * MIB).unwrap();
    for m in messages {
        let fd = (m.fd_count() == 1).then(|| chunk.export_fd().unwrap());
        send_message(x.as_fd(), m, fd.as_ref().map(|f| f.as_fd())).unwrap();
    }
    (GrowableImport::accept(ctx, y, PeerPolicy::SameUid, 64 * MIB, &[]), x)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn forged_growth_messages_are_refused_and_leave_the_mapped_part_intact() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = ctx();
    warm_up(&ctx);
    let fds = open_fds();
    let uuid = ctx.device().uuid().unwrap().0;
    let region = |capacity: usize| {
        Message::Region(Region::new(HandleType::PosixFd, capacity as u64, 2 * MIB as u64, uuid, 0).unwrap())
    };
    let grow = |size: usize, offset: usize| {
        Message::Grow(
            Grow::new(WireHandle::PosixFd, size as u64, 2 * MIB as u64, offset as u64, uuid, 0).unwrap(),
        )
    };
    // Before anything is reserved: a region over the importer's limit, or no region first.
    let over = RegionRefusal::OverLimit { capacity: 128 * MIB as u64, limit: 64 * MIB as u64 };
    for (first, why) in
        [(region(128 * MIB), over), (grow(2 * MIB, 0), RegionRefusal::BeforeRegion(Kind::Grow))]
    {
        match forged(&ctx, &[first]).0 {
            Err(Error::RegionRefused(w)) if w == why => {}
            other => panic!("{why:?}: {other:?}"),
        }
    }
    // After one good chunk: each forged message is refused, and the first chunk stays.
    let (m2, m8) = (2 * MIB as u64, 8 * MIB as u64);
    // `None`: the layout allows it, and mapping 4 MiB of a 2 MiB allocation fails, a protocol error.
    let cases: [(&str, Message, Option<RegionRefusal>); 5] = [
        ("a chunk over the first", grow(2 * MIB, 0), Some(RegionRefusal::NotAtTheEnd { offset: 0, end: m2 })),
        ("a gap", grow(2 * MIB, 4 * MIB), Some(RegionRefusal::NotAtTheEnd { offset: 2 * m2, end: m2 })),
        (
            "a chunk past the region",
            grow(8 * MIB, 2 * MIB),
            Some(RegionRefusal::PastTheRegion { offset: m2, size: m8, capacity: m8 }),
        ),
        ("a chunk larger than the allocation sent", grow(4 * MIB, 2 * MIB), None),
        (
            "a shrink inside a chunk",
            Message::Shrink { length: MIB as u64, tag: 0 },
            Some(RegionRefusal::ShrinkInsideAChunk { length: MIB as u64 }),
        ),
    ];
    let refused = |e: &Error, why: Option<RegionRefusal>| match (e, why) {
        (Error::RegionRefused(w), Some(why)) => *w == why,
        (e, None) => e.is_protocol() && !matches!(e, Error::RegionRefused(_)),
        _ => false,
    };
    for (what, bad, why) in cases {
        let (imp, _x) = forged(&ctx, &[region(8 * MIB), grow(2 * MIB, 0), bad, grow(2 * MIB, 2 * MIB)]);
        let mut imp = imp.unwrap();
        assert!(matches!(imp.next_update().unwrap(), Update::Grew { offset: 0, .. }));
        imp.copy_from_host(0, &[1u32, 2, 3]).unwrap();
        match imp.next_update() {
            Err(e) => assert!(refused(&e, why), "{what}: {e:?}"),
            other => panic!("{what} was accepted: {other:?}"),
        }
        // The error stays: the valid chunk after the forged message is not mapped.
        assert!(imp.next_update().is_err_and(|e| refused(&e, why)), "{what}");
        assert_eq!((imp.mapped(), imp.chunks().len()), (2 * MIB, 1), "{what}");
        let mut back = [0u32; 3];
        imp.copy_to_host(0, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3], "{what}");
    }
    assert_eq!(open_fds(), fds, "an fd leaked");
}
