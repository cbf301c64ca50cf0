//! Lengths are u64 end to end: one write and one read of more than 4 GiB, per medium.
//! Needs about 8.5 GiB of memory; the media run one after the other to stay there.

mod common;

use common::*;
use falcon_transport::{Completion, Medium, Region, RemoteKey};

#[test]
fn transfers_over_4_gib() {
    const LEN: u64 = (4 << 30) + 8192 + 3;
    let src = Region::new(LEN).unwrap();
    // Marks at the start, across the 4 GiB line, and at the very end; the rest stays zero.
    let marks: [(u64, &[u8]); 3] = [(0, b"head"), ((4 << 30) - 2, b"across"), (LEN - 4, b"tail")];
    for (off, m) in marks {
        src.write_at(off, m).unwrap();
    }
    for medium in [Medium::Shm, Medium::Tcp] {
        let (a, b, ab, ba) = pair(medium);
        let dst = Region::new(LEN).unwrap();
        let key = ba.grant(&dst).unwrap();
        ba.send(&key.to_bytes()).unwrap();
        let key = RemoteKey::from_bytes(&next_message(a.cq())).unwrap();
        assert_eq!(key.len, LEN);
        ab.write(&src, 0, &key, 0, LEN, Some(9)).unwrap();
        assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 9, .. }));
        for (off, m) in marks {
            let mut got = vec![0u8; m.len()];
            dst.read_at(off, &mut got).unwrap();
            assert_eq!(got, m, "{medium}: mark at {off}");
        }
        // Read it back over the source, whose marks are wiped first.
        for (off, m) in marks {
            src.write_at(off, &vec![0; m.len()]).unwrap();
        }
        ab.read(&src, 0, &key, 0, LEN).unwrap();
        for (off, m) in marks {
            let mut got = vec![0u8; m.len()];
            src.read_at(off, &mut got).unwrap();
            assert_eq!(got, m, "{medium}: read-back mark at {off}");
        }
    }
}
