//! Liveness in-process: without a suspicion timeout (roles sharing one process, as `falcon
//! train` runs them) no silence evicts anyone; with one, a silent worker is evicted and told
//! why. Heartbeats here are slower than the test, so every role is silent while it idles.

use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::{Error, JobConfig};

fn cfg(suspicion: Option<Duration>) -> JobConfig {
    JobConfig {
        job: format!("liveness-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers: 1,
        workers: 2,
        policy: PolicySpec::Ssp { s: 1 },
        heartbeat: Duration::from_secs(60),
        suspicion,
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    }
}

fn tensors() -> Vec<TensorSpec> {
    vec![TensorSpec::new("w", 256)]
}

/// Every worker idles `idle`, then runs `iters` iterations; the first error, if any.
fn idle_then_train(c: JobConfig, idle: Duration, iters: u64) -> Result<(), Error> {
    let cluster = LocalCluster::start(c, tensors())?;
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|w| {
            std::thread::spawn(move || -> Result<(), Error> {
                std::thread::sleep(idle);
                let buf = w.buffer("w")?;
                for t in 0..iters {
                    w.pull("w", &buf, t)?;
                    w.push("w", &buf, t)?;
                }
                w.finish()
            })
        })
        .collect();
    let mut first = Ok(());
    for t in threads {
        let r = t.join().expect("worker thread");
        if first.is_ok() {
            first = r;
        }
    }
    drop(cluster);
    first
}

#[test]
fn without_a_suspicion_timeout_silence_evicts_nobody() {
    // Silent for 1.5 s: five times the heartbeat rule of old (3 missed beats of 100 ms).
    idle_then_train(cfg(None), Duration::from_millis(1500), 20)
        .expect("nobody is evicted for silence");
}

#[test]
fn with_a_suspicion_timeout_a_silent_worker_is_evicted_and_told_why() {
    let r = idle_then_train(
        cfg(Some(Duration::from_millis(400))),
        Duration::from_millis(1500),
        20,
    );
    match r {
        Err(Error::Evicted { reason, .. }) => {
            assert!(reason.contains("silent for"), "{reason}")
        }
        Err(Error::PeerGone { .. }) => {} // the silent server was evicted first
        other => panic!("a silent worker is evicted: {other:?}"),
    }
}
