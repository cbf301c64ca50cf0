//! A tcp link over several TCP connections (`TransportConfig::tcp_streams`): large writes and
//! read answers split over them arrive whole, in the link's order, with their completion
//! after their last byte; a peer that abuses the split frames loses its link with a typed
//! error, and nothing waits forever.

mod common;

use std::time::{Duration, Instant};

use common::*;
use falcon_transport::{
    Completion, Error, Link, Medium, Op, Region, RemoteKey, Transport, TransportConfig,
};

fn with_streams(streams: u32, op_timeout: Duration) -> Transport {
    Transport::new(TransportConfig {
        job: 7,
        tcp_streams: streams,
        op_timeout,
        ..TransportConfig::default()
    })
    .expect("transport")
}

/// Waits until `link` sends on `n` connections (the peer's others join the accepting side a
/// moment after it accepted the link).
fn wait_connections(link: &Link, n: usize) {
    let start = Instant::now();
    while link.tcp_connections() != n {
        assert!(
            start.elapsed() < T,
            "the link has {} connections, not {n}",
            link.tcp_connections()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn key_of(t: &Transport) -> RemoteKey {
    RemoteKey::from_bytes(&next_message(t.cq())).expect("key")
}

/// The split counter is the process's: the tests that read it take turns.
static COUNTED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Large payloads both ways, split over `streams` connections.
fn split_both_ways(streams: u32) {
    let _turn = COUNTED.lock().unwrap_or_else(|p| p.into_inner());
    falcon_transport::spread::set_helpers(3);
    let a = with_streams(streams, Duration::from_secs(30));
    let b = with_streams(1, Duration::from_secs(30));
    let ab = a.connect_with(b.address(), Medium::Tcp).unwrap();
    let ba = b.accept(Some(T)).unwrap();
    assert_eq!(
        ab.tcp_connections(),
        streams as usize,
        "the connecting side"
    );
    wait_connections(&ba, streams as usize);

    const LEN: usize = (8 << 20) + 4099;
    let at_b = Region::new(LEN as u64).unwrap();
    ba.send(&ba.grant(&at_b).unwrap().to_bytes()).unwrap();
    let key_b = key_of(&a);
    let at_a = Region::new(LEN as u64).unwrap();
    ab.send(&ab.grant(&at_a).unwrap().to_bytes()).unwrap();
    let key_a = key_of(&b);

    // a → b: a large write, then a small one and a message behind it. The large write's
    // completion comes first, and its bytes are all there when it does.
    let splits = falcon_transport::tcp_split_sends();
    let src = Region::new(LEN as u64).unwrap();
    let data = pattern(streams.into(), LEN);
    src.write_at(0, &data).unwrap();
    for round in 0..3u32 {
        ab.write(&src, 1, &key_b, 3, (LEN - 4) as u64, Some(10 + round))
            .unwrap();
        ab.write(&src, 0, &key_b, 0, 2, Some(20 + round)).unwrap();
        ab.send(b"behind").unwrap();
        match next(b.cq()) {
            Completion::WriteImm { imm, .. } => assert_eq!(imm, 10 + round),
            other => panic!("expected the large write's completion, got {other:?}"),
        }
        // The last piece first: it travels on another connection than the first.
        let mut tail = vec![0u8; 4096];
        at_b.read_at((LEN - 1 - 4096) as u64, &mut tail).unwrap();
        assert!(
            tail == data[LEN - 3 - 4096..LEN - 3],
            "the last piece landed"
        );
        let mut got = vec![0u8; LEN - 4];
        at_b.read_at(3, &mut got).unwrap();
        assert!(
            got == data[1..LEN - 3],
            "every piece landed before the completion"
        );
        // The next round's bytes must land again to be seen.
        at_b.fill(0);
        assert!(matches!(next(b.cq()), Completion::WriteImm { imm, .. } if imm == 20 + round));
        assert_eq!(next_message(b.cq()), b"behind");
    }

    // A batch: a large write and a message right behind it, in one submission.
    ab.submit(&[
        Op::Write {
            src: &src,
            src_off: 0,
            dst: &key_b,
            dst_off: 0,
            len: (1 << 20) + 5,
            imm: Some(30),
        },
        Op::Send(b"after the batch's write"),
    ])
    .unwrap();
    assert!(matches!(next(b.cq()), Completion::WriteImm { imm: 30, .. }));
    assert_eq!(next_message(b.cq()), b"after the batch's write");

    assert!(
        falcon_transport::tcp_split_sends() >= splits + 4,
        "the large writes went out split"
    );

    // Reads both ways: b answers a's reads over a's connections, and a answers b's.
    at_b.write_at(0, &data).unwrap();
    let back = Region::new(LEN as u64).unwrap();
    for (off, len) in [
        (0, LEN),
        (7, LEN - 9),
        (0, 256 << 10),
        (11, (256 << 10) + 1),
    ] {
        back.fill(0);
        ab.read(&back, 0, &key_b, off as u64, len as u64).unwrap();
        let mut got = vec![0u8; len];
        back.read_at(0, &mut got).unwrap();
        assert!(
            got == data[off..off + len],
            "a read of {len} at {off} intact"
        );
    }
    at_a.write_at(0, &data).unwrap();
    ba.read(&back, 5, &key_a, 2, (LEN - 5) as u64).unwrap();
    let mut got = vec![0u8; LEN - 5];
    back.read_at(5, &mut got).unwrap();
    assert!(got == data[2..LEN - 3], "a read the other way intact");

    let splits = falcon_transport::tcp_split_sends();
    // Several reads in flight at once on one link, from several threads.
    std::thread::scope(|s| {
        for k in 0..4usize {
            let (ab, key_b, data) = (&ab, &key_b, &data);
            s.spawn(move || {
                let mine = Region::new(LEN as u64).unwrap();
                for _ in 0..3 {
                    ab.read(&mine, 0, key_b, k as u64, (LEN - k) as u64)
                        .unwrap();
                    let mut got = vec![0u8; LEN - k];
                    mine.read_at(0, &mut got).unwrap();
                    assert!(got == data[k..], "thread {k}'s read intact");
                }
            });
        }
    });

    assert!(
        falcon_transport::tcp_split_sends() >= splits + 12,
        "the answers to large reads went out split"
    );

    // An orderly close carries no error, on either side.
    ab.close();
    assert!(wait_closed(b.cq(), ba.id()).is_none());
    assert!(wait_closed(a.cq(), ab.id()).is_none());
}

#[test]
fn large_payloads_split_over_two_connections_arrive_whole_and_in_order() {
    split_both_ways(2);
}

#[test]
fn large_payloads_split_over_four_connections_arrive_whole_and_in_order() {
    split_both_ways(4);
}

/// A one-connection link from a raw-frame injector `a` to `b` (whose operations time out
/// after `op_timeout`), and the key of a 4 KiB region `b` granted on it; the transports and
/// the region stay alive with the links.
struct Injected {
    _a: Transport,
    b: Transport,
    ab: Link,
    ba: Link,
    _region: Region,
    key: RemoteKey,
}

fn injected(op_timeout: Duration) -> Injected {
    let b = with_streams(1, op_timeout);
    let a = with_streams(1, Duration::from_secs(30));
    let ab = a.connect_with(b.address(), Medium::Tcp).unwrap();
    let ba = b.accept(Some(T)).unwrap();
    let region = Region::new(4096).unwrap();
    let key = ba.grant(&region).unwrap();
    Injected {
        _a: a,
        b,
        ab,
        ba,
        _region: region,
        key,
    }
}

/// The first of two pieces of a 16-byte write into `region` with an immediate, whose other
/// piece never comes.
fn first_of_two(region: u64) -> Vec<u8> {
    let mut f = header(WRITE, 1, 1 | 2 | (2 << 8), region, 0, 16, 9);
    f.extend_from_slice(&[5u8; 16]);
    f
}

#[test]
fn closing_a_link_while_a_split_write_waits_for_its_pieces_is_an_orderly_close_at_once() {
    // The operation deadline is long: the close must not wait for it.
    let t = injected(Duration::from_secs(30));
    let (b, ab, ba) = (&t.b, &t.ab, &t.ba);
    ab.inject_raw(&first_of_two(t.key.region)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    ba.close();
    assert!(
        wait_closed(b.cq(), ba.id()).is_none(),
        "the close is orderly"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "closed in {:?}",
        start.elapsed()
    );
    assert!(
        !matches!(b.cq().poll(), Some(Completion::WriteImm { .. })),
        "the unfinished write is not completed"
    );
}

#[test]
fn one_stream_means_one_connection_and_a_bad_count_is_refused() {
    let a = with_streams(1, Duration::from_secs(30));
    let b = with_streams(1, Duration::from_secs(30));
    let ab = a.connect_with(b.address(), Medium::Tcp).unwrap();
    let ba = b.accept(Some(T)).unwrap();
    assert_eq!(ab.tcp_connections(), 1);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(ba.tcp_connections(), 1);
    // A control link keeps to one connection whatever the setting.
    let c = with_streams(3, Duration::from_secs(30));
    let cb = c.connect_control(b.address()).unwrap();
    assert_eq!(cb.medium(), "shm", "same host: the control link takes shm");
    let d = Transport::new(TransportConfig {
        job: 7,
        shm: false,
        tcp_streams: 3,
        ..TransportConfig::default()
    })
    .unwrap();
    let e = Transport::new(TransportConfig {
        job: 7,
        shm: false,
        ..TransportConfig::default()
    })
    .unwrap();
    let de = d.connect_control(e.address()).unwrap();
    assert_eq!((de.medium(), de.tcp_connections()), ("tcp", 1));
    for bad in [0, 9] {
        let err = Transport::new(TransportConfig {
            tcp_streams: bad,
            ..TransportConfig::default()
        })
        .unwrap_err();
        assert!(
            matches!(&err, Error::Config(why) if why.contains("tcp_streams") && why.contains("1 to 8")),
            "{err}"
        );
    }
}

/// A frame header as the wire has it (little-endian fields).
fn header(op: u16, imm: u32, flags: u32, region: u64, offset: u64, len: u64, req: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(48);
    h.extend_from_slice(b"FLCN");
    h.extend_from_slice(&3u16.to_le_bytes());
    h.extend_from_slice(&op.to_le_bytes());
    h.extend_from_slice(&imm.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    for v in [region, offset, len, req] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h
}

const WRITE: u16 = 2;
const READ_RESP: u16 = 5;
const PART: u16 = 9;
const LANES: u16 = 10;
const BIND: u16 = 11;

#[test]
fn split_frames_abused_by_a_peer_close_its_link_with_a_typed_error() {
    // A granted region of 4 KiB, and what each abuse is expected to end in.
    type Check = fn(&Error) -> bool;
    type Frame = Box<dyn Fn(u64) -> Vec<u8>>;
    let cases: Vec<(&str, Frame, Check)> = vec![
        (
            "a split write whose other pieces never come",
            Box::new(first_of_two),
            |e| matches!(e, Error::Timeout(..)),
        ),
        (
            "a split write announcing 9 pieces",
            Box::new(|region| header(WRITE, 0, 2 | (9 << 8), region, 0, 16, 1)),
            |e| matches!(e, Error::Malformed(_)),
        ),
        (
            "a piece count without the split flag",
            Box::new(|region| header(WRITE, 0, 2 << 8, region, 0, 16, 1)),
            |e| matches!(e, Error::Malformed(_)),
        ),
        (
            "a piece for a region never granted",
            Box::new(|_| header(PART, 0, 0, 999_999, 0, 16, 1)),
            |e| matches!(e, Error::UnknownRegion(999_999)),
        ),
        (
            "a piece past the region's end",
            Box::new(|region| header(PART, 0, 0, region, 4090, 16, 1)),
            |e| matches!(e, Error::OutOfBounds { .. }),
        ),
        (
            "a piece of an answer nobody asked for",
            Box::new(|_| header(READ_RESP, 2, 0, 0, 0, 16, 77)),
            |e| matches!(e, Error::Malformed(_)),
        ),
        (
            "a binding on the link's first connection",
            Box::new(|_| header(BIND, 1, 0, 0, 0, 0, 5)),
            |e| matches!(e, Error::Malformed(_)),
        ),
        (
            "lanes announced twice",
            Box::new(|_| {
                let mut f = header(LANES, 1, 0, 0, 0, 0, 5);
                f.extend(header(LANES, 1, 0, 0, 0, 0, 6));
                f
            }),
            |e| matches!(e, Error::Malformed(_)),
        ),
    ];
    for (what, frame, expected) in cases {
        let t = injected(Duration::from_millis(500));
        let (b, ab, ba, key) = (&t.b, &t.ab, &t.ba, &t.key);
        let start = Instant::now();
        ab.inject_raw(&frame(key.region)).unwrap();
        let err = wait_closed(b.cq(), ba.id());
        let err = err.unwrap_or_else(|| panic!("{what}: the link closed without an error"));
        assert!(expected(&err), "{what}: got {err}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: the link ended late"
        );
    }
}
