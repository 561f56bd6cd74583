//! The header decoder must never panic, and whatever it accepts must re-encode to the same bytes.
#![no_main]
use cuvmm::ipc::wire::Header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(&h.encode().expect("a decoded header is valid")[..], data);
    }
});
