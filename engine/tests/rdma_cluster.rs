//! The cluster smoke test over rdma: 2 workers, 1 server, SSP, one-sided pushes and pulls on
//! real verbs. Runs in the soft-RoCE guest that tools/test.sh boots; elsewhere it skips and
//! says so (and fails instead if RDMA_TEST_DEVICE names a device that does not work).
#![cfg(feature = "rdma")]

use std::time::Duration;

use falcon_engine::JobConfig;
use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::{Optimizer, UpdateMode};
use falcon_transport::{Medium, Transport, TransportConfig};

#[test]
fn two_workers_one_server_ssp_over_rdma() {
    if std::env::var_os("RDMA_TEST_DEVICE").is_none()
        && let Some(e) = Transport::new(TransportConfig::default())
            .unwrap()
            .rdma_error()
            .cloned()
    {
        eprintln!(
            "SKIPPED (rdma): {e} — this test runs for real in the soft-RoCE guest (tools/rxe-vm.sh)"
        );
        return;
    }
    const N: u64 = 25;
    let mut cfg = JobConfig {
        job: "rdma-smoke".into(),
        token: "t".into(),
        servers: 1,
        workers: 2,
        policy: PolicySpec::Ssp { s: 1 },
        mode: Some(UpdateMode::Async),
        optimizer: Optimizer::Sgd { lr: 1.0 },
        heartbeat: Duration::from_secs(1),
        ..JobConfig::default()
    };
    cfg.transport.medium = Medium::Rdma;
    let tensors = vec![TensorSpec::new("count", 2), TensorSpec::new("w", 100_000)];
    let cluster = LocalCluster::start(cfg, tensors).unwrap();
    for w in &cluster.workers {
        assert_eq!(
            w.server_media(),
            vec!["rdma"],
            "the data path runs over rdma"
        );
    }
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker| {
            std::thread::spawn(move || {
                let me = worker.rank() as usize;
                let mut count = vec![0f32; 2];
                let mut g = vec![0f32; 2];
                g[me] = -1.0;
                let big = worker.buffer("w").unwrap();
                for t in 0..N {
                    worker.pull_slice("count", &mut count, t).unwrap();
                    let min = count.iter().cloned().fold(f32::INFINITY, f32::min) as u64;
                    assert!(
                        min + 1 >= t,
                        "SSP(1) bound violated over rdma: min {min} at clock {t}"
                    );
                    worker.pull("w", &big, t).unwrap();
                    worker.push_slice("count", &g, t).unwrap();
                    worker.push("w", &big, t).unwrap();
                }
                worker.stats()
            })
        })
        .collect();
    let mut fast = 0;
    for h in threads {
        fast += h.join().unwrap().fast_pulls;
    }
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    assert_eq!(
        report.tensor(&keymap, "count").unwrap(),
        vec![N as f32; 2],
        "every push applied exactly once"
    );
    assert!(fast > 0, "some pulls were served by one-sided RDMA reads");
}
