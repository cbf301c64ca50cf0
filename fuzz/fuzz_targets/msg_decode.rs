//! Control and rendezvous messages (`engine/src/proto.rs` `Msg::decode`: Hello, Book, Keys,
//! …), the remote keys they carry and a row pull's index. A decoded message must survive a
//! round trip: encoding it and decoding that gives the same message (compared by encoding,
//! so NaN floats compare).
#![no_main]

use falcon_engine::proto::Msg;
use falcon_transport::RemoteKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = Msg::decode(data) else {
        return;
    };
    let bytes = msg.encode();
    let again = Msg::decode(&bytes).expect("a re-encoded message decodes");
    assert_eq!(again.encode(), bytes, "decode(encode(m)) == m");
    // What a worker or server does next with the keys a message names.
    match &msg {
        Msg::Keys { shards } => {
            for s in shards {
                for k in [&s.params, &s.meta, &s.slot] {
                    if let Ok(key) = RemoteKey::from_bytes(k) {
                        assert_eq!(&key.to_bytes()[..], &k[..]);
                    }
                }
            }
        }
        Msg::PullReq { dst, .. } => {
            let _ = RemoteKey::from_bytes(dst);
        }
        // A row pull's index, as the server reads it: parts within u32, or a typed error.
        Msg::PullRows { ranges, .. } => {
            if let Ok(parts) = falcon_engine::rows::index_of_pull(ranges) {
                assert!(
                    parts
                        .iter()
                        .all(|&(o, n)| u64::from(o) + u64::from(n) <= u64::from(u32::MAX))
                );
            }
        }
        _ => {}
    }
});
