//! The frame decoder must never panic, whatever it accepts must re-encode to the same bytes (a
//! version-1 share as version 2), and the share decoder must accept exactly the share frames.
#![no_main]
use cuvmm::ipc::wire::{Header, Message, VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = Message::decode(data);
    if let Ok(m) = &decoded {
        let mut expect = data.to_vec();
        expect[8..10].copy_from_slice(&VERSION.to_le_bytes());
        assert_eq!(&m.encode().expect("a decoded message is valid")[..], &expect[..]);
    }
    assert_eq!(Header::decode(data).is_ok(), matches!(decoded, Ok(Message::Share(_))));
});
