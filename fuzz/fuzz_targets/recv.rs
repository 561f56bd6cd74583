//! The receive path with arbitrary bytes and an arbitrary number of descriptors: never a panic,
//! and never a descriptor left open after a refusal.
#![no_main]
use cuvmm::ipc::{recv, PeerPolicy};
use libfuzzer_sys::fuzz_target;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;

fuzz_target!(|input: (u8, Vec<u8>)| {
    let (nfds, bytes) = input;
    let (a, b) = UnixStream::pair().unwrap();
    let fds: Vec<std::fs::File> = (0..nfds % 5).map(|_| std::fs::File::open("/dev/null").unwrap()).collect();
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs = if raw.is_empty() { vec![] } else { vec![ControlMessage::ScmRights(&raw)] };
    if !bytes.is_empty() {
        let _ = sendmsg::<()>(a.as_raw_fd(), &[IoSlice::new(&bytes)], &cmsgs, MsgFlags::empty(), None);
    }
    drop(a); // the reader sees the end of the stream after the bytes
    let before = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let r = recv(b.as_fd(), PeerPolicy::SameUid);
    let ok = r.is_ok();
    drop(r);
    let after = std::fs::read_dir("/proc/self/fd").unwrap().count();
    assert!(ok || after <= before, "a refused message left descriptors open");
});
