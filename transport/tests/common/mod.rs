//! Helpers shared by the transport's integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use falcon_transport::{Completion, CompletionQueue, Link, Medium, Transport, TransportConfig};

pub const T: Duration = Duration::from_secs(20);

pub fn transport(job: u64) -> Transport {
    Transport::new(TransportConfig {
        job,
        ..TransportConfig::default()
    })
    .expect("transport")
}

/// Two transports and a link between them: (a, b, a→b, b→a).
pub fn pair(medium: Medium) -> (Transport, Transport, Link, Link) {
    let a = transport(7);
    let b = transport(7);
    let ab = a.connect_with(b.address(), medium).expect("connect");
    let ba = b.accept(Some(T)).expect("accept");
    assert_eq!(ab.medium(), medium.name());
    assert_eq!(ba.medium(), medium.name());
    (a, b, ab, ba)
}

/// Next completion, failing the test after `T`.
pub fn next(cq: &CompletionQueue) -> Completion {
    cq.wait(Some(T)).expect("a completion within the deadline")
}

pub fn next_message(cq: &CompletionQueue) -> Vec<u8> {
    match next(cq) {
        Completion::Message { data, .. } => data,
        other => panic!("expected a message, got {other:?}"),
    }
}

/// Waits for the `Closed` completion of `link`, skipping others.
pub fn wait_closed(cq: &CompletionQueue, link: u64) -> Option<falcon_transport::Error> {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < T,
            "link {link} did not report Closed within {T:?}"
        );
        match cq.wait(Some(T)) {
            Ok(Completion::Closed { link: l, error }) if l == link => return error,
            Ok(_) => {}
            Err(e) => panic!("no Closed for link {link}: {e}"),
        }
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

pub fn checksum(bytes: &[u8]) -> u64 {
    // FNV-1a: order-sensitive, enough to catch misplaced or torn bytes.
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

pub fn medium_from_env() -> Medium {
    std::env::var("FALCON_TEST_MEDIUM")
        .expect("medium")
        .parse()
        .expect("medium name")
}

/// Whether a test of `medium` must be skipped here, saying so on stderr. rdma runs wherever a
/// device exists, and must run (never skip) when `RDMA_TEST_DEVICE` names one, as in the
/// soft-RoCE guest that `tools/test.sh` boots.
pub fn skip(medium: Medium) -> bool {
    if medium != Medium::Rdma {
        return false;
    }
    if std::env::var_os("RDMA_TEST_DEVICE").is_some() {
        return false;
    }
    let t = transport(7);
    match t.rdma_error() {
        None => false,
        Some(e) => {
            eprintln!(
                "SKIPPED (rdma): {e} — these tests run for real in the soft-RoCE guest (tools/rxe-vm.sh)"
            );
            true
        }
    }
}
