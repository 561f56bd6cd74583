//! `CachingAllocator` on the CPU, against the fake driver's FAKE_VMM device (VMM calls succeed and
//! are counted).

mod common;

use cuvmm::alloc::{CachingAllocator, ExportMode, PeerAllocator};
use cuvmm::driver::driver;
use cuvmm::Context;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

const MIB: usize = 1 << 20;

#[test]
fn sharing_a_block_over_a_slow_socket_holds_up_no_other_allocation() {
    let lib = common::fake_driver("FAKE_VMM");
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, &lib);
    driver().expect("the fake driver loads");
    let ctx = Context::for_ordinal(0).unwrap();
    let cache =
        CachingAllocator::new(PeerAllocator::new(&ctx, &[], ExportMode::PosixFd).unwrap(), 2 * MIB).unwrap();
    // A peer that does not read yet: the share's send waits until it does.
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    while (&a).write(&[0u8; 4096]).is_ok() {}
    a.set_nonblocking(false).unwrap();
    let block = cache.allocate_shareable(1).unwrap();
    let sharing = std::thread::spawn(move || block.share(a.as_fd(), 7).map(|_| ()));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!sharing.is_finished(), "the send did not wait for the peer");
    // Meanwhile every other use of the cache goes on.
    let (tx, rx) = std::sync::mpsc::channel();
    let other = cache.clone();
    std::thread::spawn(move || {
        let small = other.allocate(512).map(|b| b.len());
        let _ = tx.send((small, other.stats().in_use));
    });
    let (small, in_use) = rx.recv_timeout(Duration::from_secs(10)).expect("the cache is held by a send");
    assert_eq!(small.unwrap(), 512);
    assert!(in_use >= 2 * MIB);
    drop(b); // the peer goes: the send fails, and the block is released as shared memory is
    assert!(sharing.join().unwrap().is_err());
    cache.trim();
    assert_eq!(cache.stats().in_use, 0);
}
