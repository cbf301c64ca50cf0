//! Server checkpoint files (`engine/src/checkpoint.rs` `decode`): header, checksum and body.
//! Mode byte 0: the rest is a whole file (mostly refused by the checksum). Mode 1: the rest
//! is a body, wrapped in a valid header and checksum first, so the postcard decoder and the
//! shape checks see arbitrary bodies. A decoded checkpoint encodes back to a file that
//! decodes to the same value.
#![no_main]

use std::path::Path;

use falcon_engine::checkpoint::{decode, encode};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let file = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut f = b"FALCONCK".to_vec();
        f.extend_from_slice(&1u32.to_le_bytes());
        f.extend_from_slice(&(rest.len() as u64).to_le_bytes());
        f.extend_from_slice(&Sha256::digest(rest));
        f.extend_from_slice(rest);
        f
    };
    if let Ok(c) = decode(&file, Path::new("fuzz.ckpt")) {
        let again = encode(&c).expect("a decoded checkpoint encodes");
        let back = decode(&again, Path::new("fuzz.ckpt")).expect("and decodes again");
        // NaN parameters compare unequal: compare the encodings instead.
        assert_eq!(encode(&back).expect("encodes"), again);
    }
});
