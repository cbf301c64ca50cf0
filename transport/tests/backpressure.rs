//! Bounded completion queue: a tcp peer that sends faster than the receiver polls is held back
//! (its sends block, then time out) instead of growing the receiver's memory without bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Error, Link, Medium, Transport, TransportConfig};

/// The receiver's cap.
const CAP: u64 = 1 << 20;
/// Bytes per message.
const MSG: usize = 256 << 10;
/// Messages sent: 64 MiB in all, more than loopback's socket buffers can absorb (receive
/// buffers autotune up to `tcp_rmem`'s 32 MiB at most, send buffers 4 MiB).
const COUNT: usize = 256;
/// Deadline for anything the tests wait for.
const T: Duration = Duration::from_secs(60);

fn transport(max_queued_bytes: u64, op_timeout: Duration) -> Transport {
    Transport::new(TransportConfig {
        job: 7,
        shm: false,
        max_queued_bytes,
        op_timeout,
        ..TransportConfig::default()
    })
    .expect("transport")
}

/// Message `i`: its index, then a pattern that depends on it.
fn message(i: usize) -> Vec<u8> {
    let mut m: Vec<u8> = (0..MSG).map(|j| (i * 31 + j * 7) as u8).collect();
    m[..8].copy_from_slice(&(i as u64).to_le_bytes());
    m
}

/// A sender (op_timeout as given) and a receiver capped at `CAP`, linked over tcp:
/// (sender, receiver, sender→receiver link, receiver's end).
fn pair(op_timeout: Duration) -> (Transport, Transport, Link, Link) {
    let rx = transport(CAP, T);
    let tx = transport(u64::MAX, op_timeout);
    let link = tx.connect_with(rx.address(), Medium::Tcp).expect("connect");
    let back = rx.accept(Some(T)).expect("accept");
    assert_eq!(link.medium(), "tcp");
    (tx, rx, link, back)
}

/// Sends `COUNT` messages on a thread, counting those sent; returns the first error.
fn send_all(link: Link, sent: Arc<AtomicUsize>) -> JoinHandle<Result<(), Error>> {
    std::thread::spawn(move || {
        for i in 0..COUNT {
            link.send(&message(i))?;
            sent.fetch_add(1, Ordering::Release);
        }
        Ok(())
    })
}

/// Waits until `sent` has not moved for `quiet` (the sender is stuck), up to `T`.
fn wait_until_stuck(sent: &AtomicUsize, quiet: Duration) -> usize {
    let start = Instant::now();
    let mut last = sent.load(Ordering::Acquire);
    let mut since = Instant::now();
    while start.elapsed() < T {
        std::thread::sleep(Duration::from_millis(50));
        let now = sent.load(Ordering::Acquire);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    last
}

#[test]
fn sender_is_held_back_until_the_receiver_drains() {
    let (_tx, rx, link, _back) = pair(T);
    let sent = Arc::new(AtomicUsize::new(0));
    let sender = send_all(link, sent.clone());

    // The receiver does not poll: its queue fills to the cap (4 messages), and the sender gets
    // stuck well short of the end, since the queue and the socket buffers together hold far
    // less than everything.
    let cq = rx.cq();
    let start = Instant::now();
    while cq.queued_bytes() < CAP && start.elapsed() < T {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(cq.queued_bytes(), CAP, "the queue fills exactly to its cap");
    let stuck = wait_until_stuck(&sent, Duration::from_millis(500));
    assert!(stuck < COUNT, "the sender was never held back");
    assert!(!sender.is_finished(), "the sender finished all its sends");
    assert!(
        cq.queued_bytes() <= CAP + MSG as u64,
        "{} bytes queued",
        cq.queued_bytes()
    );

    // Draining lets everything through, intact and in order.
    for i in 0..COUNT {
        let q = cq.queued_bytes();
        assert!(q <= CAP + MSG as u64, "{q} bytes queued");
        match cq.wait(Some(T)).expect("a message") {
            Completion::Message { data, .. } => {
                let idx = u64::from_le_bytes(data[..8].try_into().unwrap());
                assert_eq!(idx, i as u64, "out of order");
                assert!(data == message(i), "message {i} corrupted");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    sender
        .join()
        .unwrap()
        .expect("every send succeeds once drained");
    assert_eq!(sent.load(Ordering::Acquire), COUNT);
    assert_eq!(cq.queued_bytes(), 0);
    let peak = cq.peak_queued_bytes();
    assert!(peak <= CAP + MSG as u64, "peak of {peak} bytes queued");
    // Messages no larger than the cap never take the queue past it.
    assert_eq!(peak, CAP);
}

#[test]
fn send_times_out_when_the_receiver_never_drains() {
    let (_tx, rx, link, _back) = pair(Duration::from_secs(2));
    let sent = Arc::new(AtomicUsize::new(0));
    let sender = send_all(link, sent.clone());
    let err = sender
        .join()
        .unwrap()
        .expect_err("some send must fail while nobody drains");
    assert!(matches!(err, Error::Timeout(..)), "got {err:?}");
    let n = sent.load(Ordering::Acquire);
    assert!(n < COUNT);
    let cq = rx.cq();
    assert!(cq.peak_queued_bytes() <= CAP + MSG as u64);

    // What arrived before the sender gave up is intact and in order; then the link ends.
    let mut i = 0;
    loop {
        match cq.wait(Some(T)).expect("a completion") {
            Completion::Message { data, .. } => {
                assert!(i < n, "more messages than sends that succeeded");
                assert!(data == message(i), "message {i} corrupted or out of order");
                i += 1;
            }
            Completion::Closed { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(cq.peak_queued_bytes() <= CAP + MSG as u64);
}

#[test]
fn zero_cap_is_refused() {
    let err = Transport::new(TransportConfig {
        max_queued_bytes: 0,
        ..TransportConfig::default()
    })
    .expect_err("a zero cap");
    assert!(matches!(err, Error::Config(_)), "got {err:?}");
}
