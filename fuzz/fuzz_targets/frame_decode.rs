//! Fuzz target: the whole decoder surface a peer can reach (frame headers, handshake
//! messages). Must never panic; an accepted frame lies within the input.
#![no_main]

use diphoma_ring::frame::{self, HEADER_LEN, Header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(used) = frame::decode_any(data) {
        assert!(used >= HEADER_LEN && used <= data.len());
    }
    if let Some(h) = data.first_chunk::<HEADER_LEN>() {
        if let Ok(hd) = Header::decode(h) {
            assert!(hd.len as usize <= hd.kind.max_payload());
            assert_eq!(Header::decode(&hd.encode()), Ok(hd));
        }
    }
});
