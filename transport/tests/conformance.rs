//! The transport conformance suite: the same tests against every medium.
//!
//! Each `conformance!(medium)` expands to the whole suite for that medium. Cross-process cases
//! re-execute this test binary as a child (`child_main`, selected by `FALCON_TEST_CHILD`), so
//! they run over real process boundaries.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use falcon_transport::{
    Completion, Error, Link, Medium, Op, PeerAddr, ReadOp, Region, RemoteKey, Transport,
};

/// Grants `region` on `link` and sends its key as a message.
fn share(link: &Link, region: &Region) -> RemoteKey {
    let key = link.grant(region).expect("grant");
    link.send(&key.to_bytes()).expect("send key");
    key
}

fn recv_key(t: &Transport) -> RemoteKey {
    RemoteKey::from_bytes(&next_message(t.cq())).expect("key")
}

/// Writes arrive in order, each visible when its immediate is delivered.
fn ordering_of_writes_and_immediates(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    const CHUNK: usize = 4096 + 8;
    const N: usize = 300;
    let target = Region::new((CHUNK * N) as u64).unwrap();
    share(&ba, &target);
    let key = recv_key(&a);
    let src = Region::new((CHUNK * N) as u64).unwrap();
    let data = pattern(1, CHUNK * N);
    src.write_at(0, &data).unwrap();
    let writer = std::thread::spawn(move || {
        for i in 0..N {
            let off = (i * CHUNK) as u64;
            ab.write(&src, off, &key, off, CHUNK as u64, Some(i as u32))
                .unwrap();
        }
        ab
    });
    let mut got = vec![0u8; CHUNK];
    for i in 0..N {
        match next(b.cq()) {
            Completion::WriteImm { link, imm } => {
                assert_eq!(link, ba.id());
                assert_eq!(imm as usize, i, "immediates arrive in issue order");
                target.read_at((i * CHUNK) as u64, &mut got).unwrap();
                assert_eq!(
                    got,
                    data[i * CHUNK..(i + 1) * CHUNK],
                    "chunk {i} visible at its immediate"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let _ab = writer.join().unwrap();
}

/// Over shm the peer's granted memory is mapped here and read in place, with the key's and the
/// mapping's bounds checked, also after the link closed; other media refuse such a read.
fn mapped_reads(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    let target = Region::new(2 * 4096).unwrap();
    share(&ba, &target);
    let key = recv_key(&a);
    let data = pattern(5, 2 * 4096);
    target.write_at(0, &data).unwrap();
    let mut out = vec![0u8; 1000];
    if !matches!(medium, Medium::Shm) {
        assert!(!ab.maps_peer_memory());
        let err = ab.read_mapped(&key, 0, &mut out).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        return;
    }
    assert!(ab.maps_peer_memory());
    ab.read_mapped(&key, 100, &mut out).unwrap();
    assert_eq!(out, data[100..1100]);
    // The peer's later writes are what the next read sees.
    let again = pattern(6, 2 * 4096);
    target.write_at(0, &again).unwrap();
    ab.read_mapped(&key, 4096, &mut out).unwrap();
    assert_eq!(out, again[4096..5096]);
    // Past the region's end, another node's key, a region never granted: refused.
    let err = ab.read_mapped(&key, 2 * 4096 - 4, &mut out).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let err = ab.read_mapped(&key, u64::MAX - 2, &mut out).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let other = RemoteKey {
        owner: key.owner ^ 1,
        ..key
    };
    let err = ab.read_mapped(&other, 0, &mut out).unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let unknown = RemoteKey {
        region: key.region + 1000,
        ..key
    };
    let err = ab.read_mapped(&unknown, 0, &mut out).unwrap_err();
    assert!(matches!(err, Error::UnknownRegion(_)), "{err}");
    // A key that claims more than the mapping holds is held to the mapping.
    let longer = RemoteKey {
        len: 1 << 30,
        ..key
    };
    let err = ab.read_mapped(&longer, 2 * 4096, &mut out).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    // Closed, the mapping still reads until the link is dropped.
    ab.close();
    ab.read_mapped(&key, 0, &mut out).unwrap();
    assert_eq!(out, again[..1000]);
    drop(b);
}

/// A submitted batch takes effect as its ops one by one would: writes visible by the
/// immediate that follows them, the message after both; a bad write fails the whole batch
/// before anything is sent, and the link stays usable.
fn submitted_batches(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    let target = Region::new(3 * 4096).unwrap();
    share(&ba, &target);
    let key = recv_key(&a);
    let src = Region::new(3 * 4096).unwrap();
    for round in 0..50u64 {
        let data = pattern(round, 3 * 4096);
        src.write_at(0, &data).unwrap();
        let msg = round.to_le_bytes();
        // A trailer-like write without an immediate, a write with one, then a message.
        ab.submit(&[
            Op::Write {
                src: &src,
                src_off: 2 * 4096,
                dst: &key,
                dst_off: 2 * 4096,
                len: 4096,
                imm: None,
            },
            Op::Write {
                src: &src,
                src_off: 0,
                dst: &key,
                dst_off: 0,
                len: 2 * 4096,
                imm: Some(round as u32),
            },
            Op::Send(&msg),
        ])
        .unwrap();
        match next(b.cq()) {
            Completion::WriteImm { link, imm } => {
                assert_eq!((link, imm), (ba.id(), round as u32));
                let mut got = vec![0u8; 3 * 4096];
                target.read_at(0, &mut got).unwrap();
                assert_eq!(
                    got, data,
                    "round {round}: both writes visible at the immediate"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(next_message(b.cq()), msg, "the message after the writes");
    }
    // A write beyond the target: nothing of the batch is sent.
    let before = pattern(999, 3 * 4096);
    src.write_at(0, &before).unwrap();
    let err = ab
        .submit(&[
            Op::Send(b"first"),
            Op::Write {
                src: &src,
                src_off: 0,
                dst: &key,
                dst_off: 4096,
                len: 3 * 4096,
                imm: Some(7),
            },
        ])
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    assert!(
        b.cq().wait(Some(Duration::from_millis(200))).is_err(),
        "nothing of a refused batch arrives"
    );
    // An empty batch is nothing; the link still carries a batch.
    ab.submit(&[]).unwrap();
    ab.submit(&[Op::Send(b"after")]).unwrap();
    assert_eq!(next_message(b.cq()), b"after");
}

/// A read issued after a write sees it; reads return exactly the remote bytes.
fn read_after_write(medium: Medium) {
    let (a, _b, ab, ba) = pair(medium);
    let remote = Region::new(1 << 20).unwrap();
    share(&ba, &remote);
    let key = recv_key(&a);
    let src = Region::new(1 << 20).unwrap();
    let back = Region::new(1 << 20).unwrap();
    for round in 0..20u64 {
        let data = pattern(100 + round, 1 << 20);
        src.write_at(0, &data).unwrap();
        let off = round * 4093 % 4096;
        let len = (1 << 20) - 4096;
        ab.write(&src, off, &key, 4096 - off, len, None).unwrap();
        ab.read(&back, 0, &key, 4096 - off, len).unwrap();
        let mut got = vec![0u8; len as usize];
        back.read_at(0, &mut got).unwrap();
        assert_eq!(
            got,
            data[off as usize..(off + len) as usize],
            "round {round}"
        );
    }
}

/// A batch of reads lands whole, each read in its own destination, also when reads are
/// posted on the same link before any is awaited; a bad read fails the batch before
/// anything is sent, and the link stays usable.
fn batched_reads(medium: Medium) {
    let (a, _b, ab, ba) = pair(medium);
    const LEN: usize = 300_000;
    let remote = Region::new(LEN as u64).unwrap();
    let data = pattern(77, LEN);
    remote.write_at(0, &data).unwrap();
    share(&ba, &remote);
    let key = recv_key(&a);
    let back = Region::new(LEN as u64 + 64).unwrap();
    let small = Region::new(16).unwrap();
    for round in 0..20u64 {
        let off = round * 997 % 4096;
        let reads = [
            ReadOp {
                dst: &small,
                dst_off: 0,
                src: &key,
                src_off: off,
                len: 8,
            },
            ReadOp {
                dst: &back,
                dst_off: 64,
                src: &key,
                src_off: off,
                len: LEN as u64 - off,
            },
            ReadOp {
                dst: &small,
                dst_off: 8,
                src: &key,
                src_off: LEN as u64 - 8,
                len: 8,
            },
        ];
        // Two batches under way at once, then both awaited.
        let first = ab.post_reads(&reads[..2]);
        let second = ab.post_reads(&reads[2..]);
        first.wait().unwrap();
        second.wait().unwrap();
        let mut got = vec![0u8; LEN - off as usize];
        back.read_at(64, &mut got).unwrap();
        assert!(got == data[off as usize..], "round {round}: the large read");
        let mut ends = [0u8; 16];
        small.read_at(0, &mut ends).unwrap();
        assert_eq!(
            ends[..8],
            data[off as usize..off as usize + 8],
            "round {round}"
        );
        assert_eq!(ends[8..], data[LEN - 8..], "round {round}");
        ab.read_batch(&reads).unwrap();
    }
    // One read past the remote region: the batch fails, typed, and nothing was sent.
    let bad = [
        ReadOp {
            dst: &small,
            dst_off: 0,
            src: &key,
            src_off: 0,
            len: 8,
        },
        ReadOp {
            dst: &small,
            dst_off: 0,
            src: &key,
            src_off: LEN as u64 - 4,
            len: 8,
        },
    ];
    let err = ab.read_batch(&bad).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    assert!(ab.is_open(), "a locally refused batch leaves the link open");
    ab.read_batch(&bad[..1]).unwrap();
    assert!(ab.read_batch(&[]).is_ok(), "an empty batch is done at once");
}

/// Zero-length writes, reads and messages are legal and ordered like any other.
fn zero_length(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    let empty = Region::new(0).unwrap();
    assert!(empty.is_empty());
    share(&ba, &empty);
    let key = recv_key(&a);
    assert_eq!(key.len, 0);
    let src = Region::new(0).unwrap();
    ab.write(&src, 0, &key, 0, 0, Some(42)).unwrap();
    ab.read(&src, 0, &key, 0, 0).unwrap();
    ab.send(&[]).unwrap();
    assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 42, .. }));
    assert_eq!(next_message(b.cq()), Vec::<u8>::new());
    let err = ab.write(&src, 0, &key, 0, 1, None).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    assert!(
        ab.is_open(),
        "a locally rejected access leaves the link open"
    );
}

/// 64 MiB each way, every byte checked; messages larger than any internal buffer. Over shm
/// a long copy is shared with helper threads: a ragged one at odd offsets, and two at once
/// from two threads, arrive whole too.
fn large_transfers(medium: Medium) {
    falcon_transport::spread::set_helpers(2);
    let (a, b, ab, ba) = pair(medium);
    const LEN: usize = 64 << 20;
    let remote = Region::new(LEN as u64).unwrap();
    share(&ba, &remote);
    let key = recv_key(&a);
    let src = Region::new(LEN as u64).unwrap();
    let data = pattern(9, LEN);
    src.write_at(0, &data).unwrap();
    let shared = falcon_transport::spread::shared_passes();
    ab.write(&src, 0, &key, 0, LEN as u64, Some(1)).unwrap();
    if medium == Medium::Shm {
        // Other tests of this process may hold the helpers for a moment (a pass that finds
        // them busy runs alone): a few more tries.
        for _ in 0..50 {
            if falcon_transport::spread::shared_passes() > shared {
                break;
            }
            assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 1, .. }));
            ab.write(&src, 0, &key, 0, LEN as u64, Some(1)).unwrap();
        }
        assert!(
            falcon_transport::spread::shared_passes() > shared,
            "a long shm copy is shared with the helpers"
        );
    }
    assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 1, .. }));
    let mut got = vec![0u8; LEN];
    remote.read_at(0, &mut got).unwrap();
    assert!(got == data, "64 MiB write intact");
    let back = Region::new(LEN as u64).unwrap();
    ab.read(&back, 0, &key, 0, LEN as u64).unwrap();
    back.read_at(0, &mut got).unwrap();
    assert!(got == data, "64 MiB read intact");

    // Ragged: not a whole number of the copy's chunks, at odd offsets both ends.
    let ragged = (5 << 20) + 17;
    ab.write(&src, 3, &key, 5, ragged as u64, Some(2)).unwrap();
    assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 2, .. }));
    let mut got = vec![0u8; ragged];
    remote.read_at(5, &mut got).unwrap();
    assert!(got == data[3..3 + ragged], "a ragged write intact");
    ab.read(&back, 7, &key, 5, ragged as u64).unwrap();
    back.read_at(7, &mut got).unwrap();
    assert!(got == data[3..3 + ragged], "a ragged read intact");

    // Two threads, each its own half, at once.
    let half = LEN / 2;
    let fresh = pattern(10, LEN);
    src.write_at(0, &fresh).unwrap();
    std::thread::scope(|s| {
        for (k, imm) in [(0, 3u32), (1, 4)] {
            let (ab, src, key) = (&ab, &src, &key);
            s.spawn(move || {
                let at = (k * half) as u64;
                ab.write(src, at, key, at, half as u64, Some(imm)).unwrap();
            });
        }
    });
    for _ in 0..2 {
        assert!(matches!(next(b.cq()), Completion::WriteImm { .. }));
    }
    let mut got = vec![0u8; LEN];
    remote.read_at(0, &mut got).unwrap();
    assert!(got == fresh, "two writes at once intact");

    for len in [1usize, 255, 4096, 300_000, 3 << 20] {
        let msg = pattern(len as u64, len);
        ab.send(&msg).unwrap();
        assert_eq!(next_message(b.cq()), msg, "{len}-byte message");
    }
}

/// Eight threads write disjoint ranges of one region through one link.
fn many_threads_disjoint_ranges(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    const THREADS: usize = 8;
    const PER: usize = 50;
    const CHUNK: usize = 16 << 10;
    let remote = Region::new((THREADS * PER * CHUNK) as u64).unwrap();
    share(&ba, &remote);
    let key = recv_key(&a);
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let ab = ab.clone();
            std::thread::spawn(move || {
                let src = Region::new(CHUNK as u64).unwrap();
                for i in 0..PER {
                    let slot = t * PER + i;
                    src.write_at(0, &pattern(slot as u64, CHUNK)).unwrap();
                    let off = (slot * CHUNK) as u64;
                    ab.write(&src, 0, &key, off, CHUNK as u64, Some(slot as u32))
                        .unwrap();
                }
            })
        })
        .collect();
    let mut seen = vec![false; THREADS * PER];
    let mut last = [None::<usize>; THREADS];
    let mut got = vec![0u8; CHUNK];
    for _ in 0..THREADS * PER {
        let Completion::WriteImm { imm, .. } = next(b.cq()) else {
            panic!("expected an immediate")
        };
        let slot = imm as usize;
        assert!(!seen[slot], "immediate {slot} delivered twice");
        seen[slot] = true;
        let t = slot / PER;
        assert!(
            last[t].is_none_or(|p| p < slot),
            "one thread's writes stay in order"
        );
        last[t] = Some(slot);
        remote.read_at((slot * CHUNK) as u64, &mut got).unwrap();
        assert!(
            got == pattern(slot as u64, CHUNK),
            "slot {slot} intact at its immediate"
        );
    }
    for h in handles {
        h.join().unwrap();
    }
    drop(ba);
}

/// Keys are checked: out-of-bounds and unknown regions are refused without touching memory.
fn bounds_and_grants(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    let remote = Region::new(8192).unwrap();
    remote.fill(0xAA);
    share(&ba, &remote);
    let key = recv_key(&a);
    let src = Region::new(16384).unwrap();
    src.fill(0x55);
    // Local checks: the key says 8192 bytes.
    assert!(matches!(
        ab.write(&src, 0, &key, 8000, 4096, None),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        ab.write(&src, 16000, &key, 0, 4096, None),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        ab.read(&src, 0, &key, u64::MAX - 10, 20),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(ab.is_open());
    // A forged key that lies about the length: the owner's checks hold.
    let forged = RemoteKey {
        len: 1 << 20,
        ..key
    };
    let r = ab.write(&src, 0, &forged, 8192, 4096, Some(7));
    match medium {
        // shm checks against the mapping it received: refused at once, link stays usable.
        Medium::Shm => assert!(matches!(r, Err(Error::OutOfBounds { .. })), "{r:?}"),
        // rdma: the owner's adapter checks the registration and refuses the access; the queue
        // pair is then in error, so the link fails on both sides.
        Medium::Rdma => {
            assert!(matches!(r, Err(Error::Remote(_))), "{r:?}");
            assert!(
                wait_closed(b.cq(), ba.id()).is_some(),
                "the owner reports the failed link"
            );
        }
        // tcp: the owner refuses the frame and closes the link with a typed error.
        _ => {
            let err = wait_closed(b.cq(), ba.id()).expect("an error");
            assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
        }
    }
    let mut after = vec![0u8; 8192];
    remote.read_at(0, &mut after).unwrap();
    assert!(after.iter().all(|&x| x == 0xAA), "nothing written");
    // A key for a region never granted.
    let (a2, _b2, ab2, ba2) = pair(medium);
    let r2 = Region::new(4096).unwrap();
    share(&ba2, &r2);
    let k2 = recv_key(&a2);
    // Every identity field forged: region id (tcp, shm) and address/rkey (rdma).
    let bogus = RemoteKey {
        region: k2.region + 1000,
        rkey: k2.rkey ^ 0x5a5a_5a5a,
        addr: k2.addr.wrapping_add(1 << 40),
        ..k2
    };
    let r = ab2.read(&src, 0, &bogus, 0, 16);
    assert!(r.is_err(), "read of an ungranted region must fail");
    // And revoking a grant ends access.
    let (a3, b3, ab3, ba3) = pair(medium);
    let r3 = Region::new(4096).unwrap();
    share(&ba3, &r3);
    let k3 = recv_key(&a3);
    ab3.write(&src, 0, &k3, 0, 16, Some(1)).unwrap();
    // The write has landed (its immediate is delivered) before the grant is withdrawn; a write
    // still in flight when its region is revoked would fail the link instead.
    loop {
        if let Completion::WriteImm { link, imm: 1 } = next(b3.cq())
            && link == ba3.id()
        {
            break;
        }
    }
    ba3.revoke(&r3).unwrap();
    // Revocation is asynchronous for the peer; a round trip through it orders it.
    ba3.send(b"sync").unwrap();
    assert_eq!(next_message(a3.cq()), b"sync");
    std::thread::sleep(Duration::from_millis(50));
    let r = ab3.read(&src, 0, &k3, 0, 16);
    assert!(r.is_err(), "access after revoke must fail: {r:?}");
}

/// A grant keeps its region alive: the owner may drop its own handle, the peer's key stays
/// good until the grant is revoked.
fn grant_keeps_region_alive(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    let region = Region::new(1 << 20).unwrap();
    region.fill(0x33);
    share(&ba, &region);
    drop(region);
    let key = recv_key(&a);
    // Other regions come and go meanwhile (on rdma: registrations are made and purged).
    for _ in 0..4 {
        let other = Region::new(1 << 20).unwrap();
        let _ = ba.grant(&other).unwrap();
        ba.revoke(&other).unwrap();
    }
    let buf = Region::new(1 << 20).unwrap();
    ab.read(&buf, 0, &key, 0, 1 << 20).unwrap();
    let mut got = vec![0u8; 1 << 20];
    buf.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&x| x == 0x33),
        "the granted bytes are still there"
    );
    buf.fill(0x44);
    ab.write(&buf, 0, &key, 0, 1 << 20, Some(3)).unwrap();
    assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 3, .. }));
}

/// One region granted on one link by several threads at once: every grant returns (each at
/// once, none waiting out the operation timeout for an acknowledgement another took).
fn concurrent_grants_of_one_region(medium: Medium) {
    let (_a, _b, ab, _ba) = pair(medium);
    let region = Region::new(4096).unwrap();
    region.fill(0x5a);
    for _ in 0..20 {
        let keys: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| ab.grant(&region).expect("granted")))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(keys.len(), 4);
    }
}

/// Garbage from a peer closes that link with a typed error; other links keep working.
fn malformed_input_closes_only_that_link(medium: Medium) {
    for seed in 0..8u64 {
        let b = transport(7);
        let a = transport(7);
        let bad = a.connect_with(b.address(), medium).unwrap();
        let bad_b = b.accept(Some(T)).unwrap();
        let good = a.connect_with(b.address(), medium).unwrap();
        let good_b = b.accept(Some(T)).unwrap();
        let region = Region::new(4096).unwrap();
        share(&good_b, &region);
        let key = loop {
            if let Completion::Message { link, data } = next(a.cq())
                && link == good.id()
            {
                break RemoteKey::from_bytes(&data).unwrap();
            }
        };
        let mut junk = pattern(seed, 64 + seed as usize * 97);
        if seed % 2 == 0 {
            // Start with a valid magic/version so deeper checks are exercised too.
            junk[..4].copy_from_slice(b"FLCN");
            junk[4] = 1;
            junk[5] = 0;
            // A bogus op or absurd length follows.
        }
        bad.inject_raw(&junk).unwrap();
        let err = wait_closed(b.cq(), bad_b.id());
        assert!(
            matches!(
                err,
                Some(
                    Error::Malformed(_)
                        | Error::Version { .. }
                        | Error::UnknownRegion(_)
                        | Error::OutOfBounds { .. }
                )
            ),
            "seed {seed}: expected a typed input error, got {err:?}"
        );
        let src = Region::new(4096).unwrap();
        src.fill(seed as u8 + 1);
        good.write(&src, 0, &key, 0, 4096, Some(5)).unwrap();
        loop {
            match next(b.cq()) {
                Completion::WriteImm { link, imm: 5 } if link == good_b.id() => break,
                Completion::Closed { link, .. } if link == good_b.id() => {
                    panic!("good link closed")
                }
                _ => {}
            }
        }
        let mut got = [0u8; 4096];
        region.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == seed as u8 + 1));
    }
}

/// A peer of another job is refused at the handshake.
fn other_job_is_refused(medium: Medium) {
    let b = transport(1);
    let a = transport(2);
    let err = a.connect_with(b.address(), medium).unwrap_err();
    assert!(
        matches!(err, Error::WrongJob { theirs: 1, ours: 2 }),
        "{err}"
    );
    assert!(matches!(
        b.accept(Some(Duration::from_millis(300))),
        Err(Error::Timeout(..))
    ));
}

/// An orderly close is reported to both sides without an error; later operations fail.
fn orderly_close(medium: Medium) {
    let (a, b, ab, ba) = pair(medium);
    ab.send(b"last words").unwrap();
    ab.close();
    assert_eq!(
        next_message(b.cq()),
        b"last words",
        "messages before a close are delivered"
    );
    assert!(
        wait_closed(b.cq(), ba.id()).is_none(),
        "orderly close carries no error"
    );
    assert!(wait_closed(a.cq(), ab.id()).is_none());
    assert!(ab.send(b"x").is_err());
    assert!(ba.send(b"x").is_err());
}

/// A waiting completion queue parks: an idle wait costs next to no CPU.
fn idle_wait_burns_no_cpu(medium: Medium) {
    let (_a, b, _ab, _ba) = pair(medium);
    let cpu = || rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    let before = cpu();
    let r = b.cq().wait(Some(Duration::from_millis(1000)));
    assert!(matches!(r, Err(Error::Timeout(..))), "{r:?}");
    let after = cpu();
    let used =
        (after.tv_sec - before.tv_sec) as f64 + (after.tv_nsec - before.tv_nsec) as f64 * 1e-9;
    assert!(
        used < 0.05,
        "an idle 1 s wait used {used:.3} s of CPU: the queue must park, not spin"
    );
}

// ---- cross-process cases ----

fn spawn_child(mode: &str, medium: Medium, peer: &PeerAddr) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["child_main", "--exact", "--nocapture", "--test-threads=1"])
        .env("FALCON_TEST_CHILD", mode)
        .env("FALCON_TEST_MEDIUM", medium.name())
        .env("FALCON_TEST_PEER", peer.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// The child side of the cross-process tests (a no-op in a normal run).
#[test]
fn child_main() {
    let Ok(mode) = std::env::var("FALCON_TEST_CHILD") else {
        return;
    };
    let medium = medium_from_env();
    let peer: PeerAddr = std::env::var("FALCON_TEST_PEER").unwrap().parse().unwrap();
    let t = Transport::new(falcon_transport::TransportConfig {
        job: 7,
        bind: None,
        shm: false,
        ..Default::default()
    })
    .unwrap();
    let link = t.connect_with(&peer, medium).unwrap();
    match mode.as_str() {
        // Grants a region; for each immediate i, reports the checksum of chunk i.
        "echo" => {
            let region = Region::new(XP_LEN as u64).unwrap();
            share(&link, &region);
            let mut buf = vec![0u8; XP_CHUNK];
            loop {
                match next(t.cq()) {
                    Completion::WriteImm { imm, .. } => {
                        region
                            .read_at((imm as usize * XP_CHUNK) as u64, &mut buf)
                            .unwrap();
                        let mut reply = imm.to_le_bytes().to_vec();
                        reply.extend_from_slice(&checksum(&buf).to_le_bytes());
                        link.send(&reply).unwrap();
                    }
                    Completion::Message { data, .. } if data == b"bye" => {
                        link.close();
                        return;
                    }
                    other => panic!("child: unexpected {other:?}"),
                }
            }
        }
        // Streams 8 MiB writes into the parent's region until killed.
        "writer" => {
            let key = recv_key(&t);
            let src = Region::new(key.len).unwrap();
            src.fill(0x5A);
            let mut i = 0u32;
            loop {
                link.write(&src, 0, &key, 0, key.len, Some(i)).unwrap();
                i += 1;
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// Size of the region the cross-process test moves, and of its chunks.
const XP_LEN: usize = 64 << 20;
const XP_CHUNK: usize = 8 << 20;

/// Parent and child processes move a 64 MiB region with one-sided writes (each chunk's
/// checksum confirmed by the child at its immediate) and one-sided reads; every byte checked.
fn cross_process_exchange(medium: Medium) {
    let t = transport(7);
    let mut child = spawn_child("echo", medium, t.address());
    let link = t.accept(Some(T)).unwrap();
    assert_eq!(link.medium(), medium.name());
    let key = recv_key(&t);
    let src = Region::new(XP_LEN as u64).unwrap();
    let data = pattern(77, XP_LEN);
    src.write_at(0, &data).unwrap();
    let chunks = (XP_LEN / XP_CHUNK) as u32;
    for i in 0..chunks {
        let off = (i as usize * XP_CHUNK) as u64;
        link.write(&src, off, &key, off, XP_CHUNK as u64, Some(i))
            .unwrap();
    }
    for i in 0..chunks {
        let reply = next_message(t.cq());
        assert_eq!(u32::from_le_bytes(reply[..4].try_into().unwrap()), i);
        let expect = checksum(&data[i as usize * XP_CHUNK..(i as usize + 1) * XP_CHUNK]);
        assert_eq!(
            u64::from_le_bytes(reply[4..12].try_into().unwrap()),
            expect,
            "chunk {i} as seen by the child"
        );
    }
    let back = Region::new(XP_LEN as u64).unwrap();
    link.read(&back, 0, &key, 0, XP_LEN as u64).unwrap();
    let mut got = vec![0u8; XP_LEN];
    back.read_at(0, &mut got).unwrap();
    assert!(got == data);
    link.send(b"bye").unwrap();
    assert!(
        wait_closed(t.cq(), link.id()).is_none(),
        "child closed in order"
    );
    assert!(child.wait().unwrap().success());
}

/// A peer killed mid-transfer: the survivor gets a Closed error, operations fail, no hang.
fn peer_death_mid_transfer(medium: Medium) {
    let t = transport(7);
    let mut child = spawn_child("writer", medium, t.address());
    let link = t.accept(Some(T)).unwrap();
    let region = Region::new(8 << 20).unwrap();
    share(&link, &region);
    // Let some writes land, then kill the writer while it streams.
    for _ in 0..3 {
        assert!(matches!(next(t.cq()), Completion::WriteImm { .. }));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let err = wait_closed(t.cq(), link.id());
    assert!(
        matches!(err, Some(Error::Closed { .. })),
        "death is an error, not an orderly close: {err:?}"
    );
    assert!(!link.is_open());
    assert!(link.send(b"anyone?").is_err());
    let r = Region::new(16).unwrap();
    let k = RemoteKey {
        owner: link.peer_node(),
        region: 1,
        len: 16,
        addr: 0,
        rkey: 0,
        reserved: 0,
    };
    assert!(link.read(&r, 0, &k, 0, 16).is_err());
}

macro_rules! conformance {
    ($m:ident, $medium:expr) => {
        mod $m {
            use super::*;
            #[test]
            fn ordering_of_writes_and_immediates() {
                if skip($medium) {
                    return;
                }
                super::ordering_of_writes_and_immediates($medium)
            }
            #[test]
            fn read_after_write() {
                if skip($medium) {
                    return;
                }
                super::read_after_write($medium)
            }
            #[test]
            fn batched_reads() {
                if skip($medium) {
                    return;
                }
                super::batched_reads($medium)
            }
            #[test]
            fn zero_length() {
                if skip($medium) {
                    return;
                }
                super::zero_length($medium)
            }
            #[test]
            fn large_transfers() {
                if skip($medium) {
                    return;
                }
                super::large_transfers($medium)
            }
            #[test]
            fn many_threads_disjoint_ranges() {
                if skip($medium) {
                    return;
                }
                super::many_threads_disjoint_ranges($medium)
            }
            #[test]
            fn bounds_and_grants() {
                if skip($medium) {
                    return;
                }
                super::bounds_and_grants($medium)
            }
            #[test]
            fn mapped_reads() {
                if skip($medium) {
                    return;
                }
                super::mapped_reads($medium)
            }
            #[test]
            fn submitted_batches() {
                if skip($medium) {
                    return;
                }
                super::submitted_batches($medium)
            }
            #[test]
            fn concurrent_grants_of_one_region() {
                if skip($medium) {
                    return;
                }
                super::concurrent_grants_of_one_region($medium)
            }
            #[test]
            fn grant_keeps_region_alive() {
                if skip($medium) {
                    return;
                }
                super::grant_keeps_region_alive($medium)
            }
            #[test]
            fn malformed_input_closes_only_that_link() {
                if skip($medium) {
                    return;
                }
                super::malformed_input_closes_only_that_link($medium)
            }
            #[test]
            fn other_job_is_refused() {
                if skip($medium) {
                    return;
                }
                super::other_job_is_refused($medium)
            }
            #[test]
            fn orderly_close() {
                if skip($medium) {
                    return;
                }
                super::orderly_close($medium)
            }
            #[test]
            fn idle_wait_burns_no_cpu() {
                if skip($medium) {
                    return;
                }
                super::idle_wait_burns_no_cpu($medium)
            }
            #[test]
            fn cross_process_exchange() {
                if skip($medium) {
                    return;
                }
                super::cross_process_exchange($medium)
            }
            #[test]
            fn peer_death_mid_transfer() {
                if skip($medium) {
                    return;
                }
                super::peer_death_mid_transfer($medium)
            }
        }
    };
}

conformance!(shm, Medium::Shm);
conformance!(tcp, Medium::Tcp);
#[cfg(feature = "rdma")]
conformance!(rdma, Medium::Rdma);

/// NCCL's dma-buf probe (`ibv_reg_dmabuf_mr` with fd -1) answers per device; soft-RoCE has
/// no dma-buf registration (rxe implements no `reg_user_mr_dmabuf`), so the GPUDirect plan
/// leaves dma-buf out there for peer memory or staging.
#[cfg(feature = "rdma")]
#[test]
fn rdma_dma_buf_probe_answers_per_device() {
    let Ok(dev) = std::env::var("RDMA_TEST_DEVICE") else {
        eprintln!(
            "SKIPPED (rdma): the dma-buf probe runs in the soft-RoCE guest (tools/rxe-vm.sh)"
        );
        return;
    };
    let found = falcon_transport::rdma_dmabuf_support().expect("the probe runs where RDMA is");
    let (_, supported) = found
        .iter()
        .find(|(name, _)| *name == dev)
        .unwrap_or_else(|| panic!("{dev} is not among the probed devices {found:?}"));
    assert!(
        !supported,
        "soft-RoCE ({dev}) answered the dma-buf probe as supported"
    );
    let plan = falcon_transport::gdr::gdr_plan(&falcon_transport::gdr::GdrProbe {
        enabled: true,
        cuda_version: (12, 8),
        device_gpu_direct_rdma: true,
        device_dma_buf: true,
        verbs_dma_buf: Some(*supported),
        peer_memory: false,
    });
    assert_eq!(plan.tries, vec![falcon_transport::gdr::GdrPath::Staging]);
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn is<T: Send + Sync>() {}
    is::<Link>();
    is::<Region>();
    is::<Arc<Transport>>();
}
