//! The receive path with arbitrary bytes, up to the kernel's maximum of descriptors, split sends,
//! credentials or a pidfd in the control data, and senders that fall silent inside a frame or
//! before one while the receiver is bounded by a deadline, a receive timeout or a non-blocking
//! socket: never a panic, never a wait on a silent sender past its bound, never a descriptor left
//! open after a refusal, an accepted message, of any kind, owns exactly the descriptors it
//! announces, and a pause changes nothing of what arrives. `cuvmm_fuzz::RecvInput` documents how the input bytes are read.
#![no_main]
use cuvmm_fuzz::{run_recv, RecvInput};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = run_recv(&RecvInput::decode(data));
});
