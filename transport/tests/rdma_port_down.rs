//! A port that is down gets a clear error, not a hang or a crash. Runs in the soft-RoCE guest
//! only (it takes the device's network interface down and up again); its own test binary.
#![cfg(feature = "rdma")]

mod common;

use std::time::{Duration, Instant};

use common::*;
use falcon_transport::Medium;

fn port_state(dev: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/state"))
        .unwrap_or_default()
}

fn set_link(netdev: &str, state: &str) {
    let ok = std::process::Command::new("/usr/sbin/ip")
        .args(["link", "set", netdev, state])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "ip link set {netdev} {state}");
}

fn wait_port(dev: &str, active: bool) {
    let start = Instant::now();
    while port_state(dev).contains("ACTIVE") != active {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "port of {dev} never became active={active}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn port_down_is_a_clear_error() {
    let Some(dev) = std::env::var("RDMA_TEST_DEVICE").ok() else {
        eprintln!(
            "SKIPPED (rdma): the port-down test runs only in the soft-RoCE guest (tools/rxe-vm.sh)"
        );
        return;
    };
    let netdev = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/0"
    ))
    .unwrap()
    .trim()
    .to_string();
    wait_port(&dev, true);
    set_link(&netdev, "down");
    wait_port(&dev, false);
    let t = transport(7);
    let err = t.rdma_error().map(|e| e.to_string()).unwrap_or_default();
    set_link(&netdev, "up");
    wait_port(&dev, true);
    assert!(
        err.contains("port 1") && err.contains("DOWN"),
        "error names the port and its state: {err:?}"
    );
    // And once the port is back, rdma works again.
    assert!(!skip(Medium::Rdma));
    let (_a, _b, ab, _ba) = pair(Medium::Rdma);
    assert_eq!(ab.medium(), "rdma");
}
