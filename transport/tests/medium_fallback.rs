//! Medium selection when RDMA is absent: `Auto` falls back to tcp for a peer on another host,
//! and asking for rdma explicitly gets a typed error that says why.

mod common;

use common::*;
use falcon_transport::{Error, Medium};

#[test]
fn auto_falls_back_to_tcp_and_rdma_says_why() {
    let a = transport(7);
    let b = transport(7);
    // The same listener, presented as a peer on another host: shm is out of the question.
    let mut elsewhere = b.address().clone();
    elsewhere.host = "another-host-0000".into();
    elsewhere.shm = None;
    let link = a.connect_with(&elsewhere, Medium::Auto).unwrap();
    let _accepted = b.accept(Some(T)).unwrap();
    if a.rdma_available() {
        assert_eq!(
            link.medium(),
            "rdma",
            "with a device, peers on other hosts use rdma"
        );
    } else {
        assert_eq!(
            link.medium(),
            "tcp",
            "without a device, peers on other hosts use tcp"
        );
        let err = a.connect_with(b.address(), Medium::Rdma).unwrap_err();
        assert!(
            matches!(err, Error::MediumUnavailable { medium: "rdma", .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("--features rdma") || text.contains("RDMA"),
            "the error says why: {text}"
        );
    }
    // Same host: shm, whatever RDMA can do.
    let local = a.connect_with(b.address(), Medium::Auto).unwrap();
    assert_eq!(local.medium(), "shm");
}
