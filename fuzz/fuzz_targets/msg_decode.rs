//! Control and rendezvous messages (`engine/src/proto.rs` `Msg::decode`: Hello, Book, Keys,
//! …), the remote keys they carry, a row pull's index and a row answer read in place. A
//! decoded message must survive a round trip: encoding it and decoding that gives the same
//! message (compared by encoding, so NaN floats compare).
#![no_main]

use falcon_engine::proto::Msg;
use falcon_transport::RemoteKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A row answer read in place (as a worker reads one) is what decoding it gives.
    if let Some((req, at)) = Msg::rows_in(data) {
        match Msg::decode(data) {
            Ok(Msg::Rows { req: r, values }) => {
                assert_eq!((r, &values[..]), (req, &data[at..]), "rows in place");
            }
            _ => panic!("read in place as rows, but does not decode as rows"),
        }
    }
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
            if let Ok(index) = falcon_engine::rows::index_of_pull(ranges.clone()) {
                let parts = index.to_vec();
                assert_eq!(parts.len() as u64, index.count());
                let ends = parts.iter().map(|&(o, n)| u64::from(o) + u64::from(n));
                assert_eq!(ends.max().unwrap_or(0), index.reach());
                assert!(index.reach() <= u64::from(u32::MAX));
                let floats: u64 = parts.iter().map(|&(_, n)| u64::from(n)).sum();
                assert_eq!(floats, index.floats());
            }
        }
        _ => {}
    }
});
