//! A `ulimit -l` too low for a registration gets an error naming memlock, the bytes needed and
//! how to raise the limit. Its own test binary: it lowers the process's limit.
#![cfg(feature = "rdma")]

mod common;

use common::*;
use falcon_transport::{Error, Medium, Region};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use rustix::thread::{CapabilitySet, capabilities, set_capabilities};

#[test]
fn memlock_too_low_is_explained() {
    if skip(Medium::Rdma) {
        return;
    }
    let (_a, _b, _ab, ba) = pair(Medium::Rdma);
    // Root's CAP_IPC_LOCK ignores the limit: drop it from this thread, then lower the limit
    // below what is already pinned.
    let mut caps = capabilities(None).unwrap();
    caps.effective.remove(CapabilitySet::IPC_LOCK);
    set_capabilities(None, caps).unwrap();
    let old = getrlimit(Resource::Memlock);
    setrlimit(
        Resource::Memlock,
        Rlimit {
            current: Some(64 << 10),
            maximum: old.maximum,
        },
    )
    .unwrap();
    let region = Region::new(4 << 20).unwrap();
    let err = ba.grant(&region).unwrap_err();
    setrlimit(Resource::Memlock, old).unwrap();
    match &err {
        Error::Memlock { needed, limit } => {
            assert_eq!(*needed, 4 << 20);
            assert_eq!(*limit, 64 << 10);
        }
        other => panic!("expected a memlock error, got {other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("memlock") && text.contains("ulimit -l"),
        "{text}"
    );
}
