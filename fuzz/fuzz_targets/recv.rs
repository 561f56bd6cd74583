//! The receive path with arbitrary bytes, up to the kernel's maximum of descriptors, split sends,
//! and credentials or a pidfd in the control data: never a panic, never a descriptor left open
//! after a refusal, and an accepted message, of any kind, owns exactly the descriptors it
//! announces. `cuvmm_fuzz::RecvInput` documents how the input bytes are read.
#![no_main]
use cuvmm_fuzz::{run_recv, RecvInput};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = run_recv(&RecvInput::decode(data));
});
