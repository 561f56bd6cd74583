//! Sequences of frames on a connection that follows a growing region, checked and applied as a
//! `GrowableImport` does: never a panic, `check` and `apply` agree, a refused frame changes
//! nothing, and the layout always holds chunks that follow each other from offset 0, on the
//! importer's granularity, inside a capacity within its limit. `cuvmm_fuzz::GrowthInput`
//! documents how the input bytes are read.
#![no_main]
use cuvmm_fuzz::{run_growth, GrowthInput};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = run_growth(&GrowthInput::decode(data));
});
