//! The hand-off's message and ticket decoders with arbitrary bytes and descriptor counts: never a
//! panic, whatever either accepts encodes back to the same bytes, a message accepted announces
//! exactly the descriptors that came, and a ticket accepted describes a block that lies on its
//! pages. `cuvmm_fuzz::run_handoff` documents how the input bytes are read.
#![no_main]
use cuvmm_fuzz::run_handoff;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = run_handoff(data);
});
