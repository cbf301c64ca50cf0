//! Memory limits: a worker pushing faster than the server applies slows down instead of
//! growing the server's memory.

use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::LocalCluster;
use falcon_engine::sync::PolicySpec;
use falcon_engine::{JobConfig, Worker};

const LEN: u64 = 1000;

#[test]
fn a_worker_pushing_ahead_of_the_step_is_held_back_by_the_servers_memory_cap() {
    // BSP, 2 workers, one shard: a step applies once both pushed. Worker 0 pushes clock after
    // clock without pulling (a trainer bug, or an embedder pipelining too far); worker 1 is
    // idle. The shard may hold 3 gradients waiting for their step.
    let gradient = LEN * 4;
    let cfg = JobConfig {
        job: format!("limits-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers: 1,
        workers: 2,
        policy: PolicySpec::Bsp,
        max_pending_bytes: 3 * gradient,
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    };
    let tensors = vec![TensorSpec::new("w", LEN)];
    let cluster = LocalCluster::start(cfg, tensors).unwrap();
    let (w0, w1): (Worker, Worker) = (cluster.workers[0].clone(), cluster.workers[1].clone());
    let g = vec![1.0f32; LEN as usize];
    // The first pushes go through: each one's ack comes while the shard is within its cap.
    let mut pushed = 0u64;
    let mut last = None;
    for c in 0..10u64 {
        let region = w0.buffer("w").unwrap();
        region
            .write_at(0, falcon_engine::worker::f32_bytes(&g))
            .unwrap();
        // A push waits for the previous one's ack before it writes: run it on a thread and
        // see whether it completes.
        let w = w0.clone();
        let h = std::thread::spawn(move || w.push("w", &region, c));
        // A push within the cap completes in milliseconds; a held one never does until the
        // step falls (the generous wait keeps a loaded machine from looking held).
        let t = std::time::Instant::now();
        while !h.is_finished() && t.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !h.is_finished() {
            last = Some(h);
            break;
        }
        h.join().unwrap().unwrap();
        pushed += 1;
    }
    let blocked = last.expect("worker 0 was held back before 10 pushes ahead of the step");
    assert!(
        (3..=5).contains(&pushed),
        "held back once the shard held about 3 waiting gradients, not after {pushed}"
    );
    // Worker 1 catches up: steps apply, memory frees, worker 0 goes on.
    for c in 0..=pushed {
        w1.push_slice("w", &g, c).unwrap();
    }
    blocked.join().unwrap().unwrap();
    for c in pushed + 1..pushed + 3 {
        w1.push_slice("w", &g, c).unwrap();
        w0.push_slice("w", &g, c).unwrap();
    }
    let report = cluster.finish().unwrap();
    let s = &report.servers[0];
    // The cap, plus the one gradient whose ack is held, plus one arriving that completes a
    // step (counted before the step applies).
    assert!(
        s.peak_pending_bytes <= 5 * gradient,
        "the shard never held much more than its cap: {} bytes",
        s.peak_pending_bytes
    );
    assert!(s.held_acks > 0, "acknowledgements were held back");
    assert_eq!(s.updates, pushed + 3, "every step applied once");
}
