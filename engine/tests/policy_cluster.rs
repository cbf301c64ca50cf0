//! Policies in a real in-process cluster: EPSP's and FlexRR's task-transfer offers reach the
//! helper workers, and the per-worker and per-shard counters add up.

use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::{LocalCluster, LocalReport};
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::UpdateMode;
use falcon_engine::{JobConfig, Offer, Worker, WorkerStats};

const W: u32 = 3;
const ITERS: u64 = 12;
const LEN: u64 = 600;

fn cfg(policy: &str) -> JobConfig {
    JobConfig {
        job: format!("test-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers: 2,
        workers: W,
        policy: policy.parse().unwrap(),
        max_shard_bytes: 1024,
        heartbeat: Duration::from_secs(1),
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    }
}

/// Worker 2 is a persistent straggler (40 ms per iteration, far above scheduling noise on a
/// loaded machine); 0 and 1 do not sleep.
fn mode_of(policy: &str) -> UpdateMode {
    policy.parse::<PolicySpec>().unwrap().update_mode()
}

fn train(policy: &str) -> (Vec<(WorkerStats, Vec<Offer>)>, LocalReport, u64) {
    let tensors = vec![TensorSpec::new("w", LEN)];
    let cluster = LocalCluster::start(cfg(policy), tensors).unwrap();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker: Worker| {
            std::thread::spawn(move || {
                let mut p = vec![0f32; LEN as usize];
                let g = vec![0.001f32; LEN as usize];
                let mut offers = Vec::new();
                for t in 0..ITERS {
                    worker.pull_slice("w", &mut p, t).unwrap();
                    if worker.rank() == 2 {
                        std::thread::sleep(Duration::from_millis(40));
                    }
                    worker.push_slice("w", &g, t).unwrap();
                    offers.extend(worker.offers());
                }
                offers.extend(worker.offers());
                (worker.stats(), offers)
            })
        })
        .collect();
    let per_worker: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    let shards = cluster.workers[0].keymap().shards_of(0).count() as u64;
    let report = cluster.finish().unwrap();
    (per_worker, report, shards)
}

/// Counters that must add up whatever the policy: bytes in per shard, bytes out (server
/// answers plus one-sided reads) per pull, staleness samples per asynchronously applied
/// gradient (none under synchronous updates, whose steps are never stale).
fn check_counters(
    per_worker: &[(WorkerStats, Vec<Offer>)],
    report: &LocalReport,
    shards: u64,
    mode: UpdateMode,
) {
    let bytes_in: u64 = report
        .servers
        .iter()
        .flat_map(|s| &s.per_shard)
        .map(|c| c.bytes_in)
        .sum();
    assert_eq!(bytes_in, u64::from(W) * ITERS * LEN * 4);
    let grads: u64 = report
        .servers
        .iter()
        .flat_map(|s| &s.per_shard)
        .map(|c| c.gradients)
        .sum();
    assert_eq!(grads, u64::from(W) * ITERS * shards);
    let bytes_out: u64 = report
        .servers
        .iter()
        .flat_map(|s| &s.per_shard)
        .map(|c| c.bytes_out)
        .sum();
    let fast: u64 = per_worker.iter().map(|(s, _)| s.fast_pull_bytes).sum();
    assert_eq!(
        bytes_out + fast,
        u64::from(W) * ITERS * LEN * 4,
        "every pulled byte is counted once, by the server or by the reader"
    );
    for (w, (stats, _)) in per_worker.iter().enumerate() {
        let staleness: u64 = report
            .servers
            .iter()
            .flat_map(|s| s.per_worker[w].staleness.values())
            .sum();
        let want = match mode {
            UpdateMode::Async => ITERS * shards,
            UpdateMode::Sync => 0,
        };
        assert_eq!(
            staleness, want,
            "worker {w}: one sample per asynchronously applied gradient"
        );
        let parked: u64 = report
            .servers
            .iter()
            .map(|s| s.per_worker[w].parked_pulls)
            .sum();
        assert!(parked <= stats.slow_pulls, "parked pulls are slow pulls");
    }
}

/// What holds for the offers a worker received whatever the machine's load (who is behind at
/// each moment depends on it): distinct, never naming the receiver, within the run.
fn check_offers(w: usize, offers: &[Offer]) {
    let mut distinct = offers.to_vec();
    distinct.sort_by_key(|o| (o.straggler, o.clock));
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        offers.len(),
        "worker {w}: each offer once: {offers:?}"
    );
    assert!(
        offers
            .iter()
            .all(|o| o.straggler as usize != w && o.clock < ITERS),
        "worker {w}: {offers:?}"
    );
}

#[test]
fn epsp_offers_the_straggler_s_tasks_to_the_blocked_pioneers() {
    // Enforced (a barrier per iteration) with transfer: a pioneer waits at every iteration
    // for the 15 ms straggler, and each parked pull brings an offer.
    let (per_worker, report, shards) = train("epsp(0,fixed)");
    check_counters(&per_worker, &report, shards, mode_of("epsp(0,fixed)"));
    for (w, (stats, offers)) in per_worker.iter().enumerate() {
        assert_eq!(stats.offers, offers.len() as u64);
        check_offers(w, offers);
        let parked: u64 = report
            .servers
            .iter()
            .map(|s| s.per_worker[w].parked_pulls)
            .sum();
        if parked > 0 {
            assert!(
                !offers.is_empty(),
                "worker {w}: parked {parked} times, no offer"
            );
            assert!(stats.pull_wait > Duration::ZERO && stats.slow_pulls > 0);
        }
    }
    let pioneers: Vec<&Offer> = per_worker[..2].iter().flat_map(|(_, o)| o).collect();
    // How often a pioneer's pull reaches the server before the straggler's push depends on
    // the machine's load; every parked pull brings an offer (checked above).
    assert!(
        pioneers.iter().any(|o| o.straggler == 2),
        "blocked pioneers must be offered the straggler's tasks: {pioneers:?}"
    );
    let offered: u64 = report
        .servers
        .iter()
        .flat_map(|s| &s.per_worker)
        .map(|c| c.transfers_offered)
        .sum();
    assert!(offered >= per_worker.iter().map(|(_, o)| o.len() as u64).sum());
}

#[test]
fn epsp_without_transfer_and_ssp_make_no_offers() {
    for policy in ["epsp(4,no-transfer)", "ssp(1)"] {
        let (per_worker, report, shards) = train(policy);
        check_counters(&per_worker, &report, shards, mode_of(policy));
        assert!(
            per_worker
                .iter()
                .all(|(s, o)| o.is_empty() && s.offers == 0),
            "{policy} made offers"
        );
    }
}

#[test]
fn flexrr_offers_reach_helpers_ahead_of_the_straggler() {
    let (per_worker, report, shards) = train("flexrr(1)");
    check_counters(&per_worker, &report, shards, mode_of("flexrr(1)"));
    for (w, (stats, offers)) in per_worker.iter().enumerate() {
        assert_eq!(stats.offers, offers.len() as u64);
        check_offers(w, offers);
    }
    let to_2 = per_worker[..2]
        .iter()
        .flat_map(|(_, o)| o)
        .filter(|o| o.straggler == 2)
        .count();
    assert!(to_2 > 0, "nobody offered help to the straggler");
}

#[test]
fn dssp_grants_are_reported_per_worker() {
    let (per_worker, report, shards) = train("dssp(0,3)");
    check_counters(&per_worker, &report, shards, mode_of("dssp(0,3)"));
    let grants: Vec<u64> = (0..W as usize)
        .map(|w| report.servers.iter().map(|s| s.per_worker[w].grants).sum())
        .collect();
    // A fastest worker blocked past s_L = 0 is granted extra iterations (who is fastest at
    // each moment depends on the machine's load).
    assert!(
        grants.iter().sum::<u64>() > 0,
        "no grant at all: {grants:?}"
    );
}

/// Task transfer end to end: every iteration is `M` tasks, each adding exactly 1 to every
/// parameter (SGD with lr 1 on a gradient of −1 per task). The straggler's tasks are slow;
/// blocked pioneers take tasks off its queue through the scheduler and push them with
/// `push_for`. Every task must be processed exactly once: the ledger sees each (worker,
/// iteration, task) once and the parameters count every task once.
#[test]
fn transferred_tasks_are_processed_exactly_once() {
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    const M: u32 = 8;
    // Enforced EPSP: synchronous steps, each the sum of its gradients (so the parameters
    // count tasks), the helpers' parts joining their straggler's step.
    let mut c = cfg("epsp(0,fixed)");
    c.optimizer = falcon_engine::update::Optimizer::Sgd { lr: 1.0 };
    c.aggregate = falcon_engine::update::Aggregate::Sum;
    let tensors = vec![TensorSpec::new("w", 10)];
    let cluster = LocalCluster::start(c, tensors).unwrap();
    let done: Arc<Mutex<HashSet<(u32, u64, u32)>>> = Arc::default();
    let threads: Vec<_> = cluster
        .workers
        .iter()
        .cloned()
        .map(|worker: Worker| {
            let done = done.clone();
            std::thread::spawn(move || {
                let me = worker.rank();
                // This worker's queue for its current iteration: (clock, next, end).
                let queue = Arc::new(Mutex::new((u64::MAX, 0u32, 0u32)));
                let q = queue.clone();
                worker.on_steal(move |clock, want| {
                    let mut g = q.lock().unwrap();
                    if g.0 != clock || g.2 <= g.1 {
                        return 0..0;
                    }
                    let k = want.min(g.2 - g.1);
                    g.2 -= k;
                    g.2..g.2 + k
                });
                let mut p = vec![0f32; 10];
                let mut stolen = 0u64;
                let mut empty = 0u64;
                for t in 0..ITERS {
                    let out = worker.buffer("w").unwrap();
                    let h = worker.pull_async("w", &out, t).unwrap();
                    while !h.ready() {
                        for o in worker.offers() {
                            let r = worker.steal(o.straggler, o.clock, 3).unwrap();
                            if r.is_empty() {
                                empty += 1;
                                continue;
                            }
                            for task in r.clone() {
                                assert!(
                                    done.lock().unwrap().insert((o.straggler, o.clock, task)),
                                    "task {task} of worker {} iteration {} done twice",
                                    o.straggler,
                                    o.clock
                                );
                            }
                            stolen += u64::from(r.end - r.start);
                            let g = vec![-((r.end - r.start) as f32); 10];
                            let region = worker.buffer("w").unwrap();
                            region
                                .write_at(0, falcon_engine::worker::f32_bytes(&g))
                                .unwrap();
                            worker.push_for("w", &region, o.straggler, o.clock).unwrap();
                        }
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    h.wait().unwrap();
                    out.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut p))
                        .unwrap();
                    *queue.lock().unwrap() = (t, 0, M);
                    if me == 2 && t == 1 {
                        // Make sure the path runs whatever the load: in iteration 1 the
                        // straggler starts only once a blocked pioneer took some of its tasks.
                        let deadline = std::time::Instant::now() + Duration::from_secs(5);
                        while queue.lock().unwrap().2 == M && std::time::Instant::now() < deadline {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    let mut mine = 0u32;
                    loop {
                        let task = {
                            let mut g = queue.lock().unwrap();
                            if g.1 >= g.2 {
                                break;
                            }
                            g.1 += 1;
                            g.1 - 1
                        };
                        if me == 2 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        assert!(done.lock().unwrap().insert((me, t, task)));
                        mine += 1;
                    }
                    worker.push_slice("w", &[-(mine as f32); 10], t).unwrap();
                }
                (stolen, empty, worker.stats())
            })
        })
        .collect();
    let out: Vec<(u64, u64, falcon_engine::WorkerStats)> =
        threads.into_iter().map(|h| h.join().unwrap()).collect();
    let stolen: Vec<u64> = out.iter().map(|o| o.0).collect();
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish().unwrap();
    let total = u64::from(W) * ITERS * u64::from(M);
    assert_eq!(done.lock().unwrap().len() as u64, total, "every task once");
    let w = report.tensor(&keymap, "w").unwrap();
    assert!(
        w.iter().all(|&x| x == total as f32),
        "every task applied once: {w:?} vs {total}"
    );
    assert_eq!(stolen[2], 0, "the straggler helps nobody");
    assert_eq!(
        report.scheduler.tasks_transferred,
        stolen.iter().sum::<u64>(),
        "the scheduler relayed what the helpers got"
    );
    assert!(
        stolen.iter().sum::<u64>() > 0,
        "blocked pioneers took none of the straggler's tasks: (stolen, empty steals, stats) {out:?}"
    );
}
