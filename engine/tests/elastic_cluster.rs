//! ElasticBSP in real in-process clusters (scheduler and servers on threads, workers as
//! handles, shared-memory transport): the scheduler plans job-wide superstep barriers with
//! ZipLine, workers wait at theirs, and neither a worker that finishes early nor one that dies
//! holds the others back.

use std::sync::mpsc;
use std::time::Duration;

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::{LocalCluster, LocalReport};
use falcon_engine::proto::Role;
use falcon_engine::sync::PolicySpec;
use falcon_engine::{JobConfig, Worker, WorkerStats};

const R: u32 = 4;

fn cfg(workers: u32) -> JobConfig {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    JobConfig {
        job: format!("elastic-{}", fastrand::u64(..)),
        token: "secret".into(),
        servers: 2,
        workers,
        policy: PolicySpec::ElasticBsp { r: R },
        max_shard_bytes: 1024, // several shards per tensor, over both servers
        heartbeat: Duration::from_secs(1),
        rendezvous_timeout: Duration::from_secs(30),
        ..JobConfig::default()
    }
}

fn tensors() -> Vec<TensorSpec> {
    vec![TensorSpec::new("w", 1000), TensorSpec::new("b", 10)]
}

/// Runs `body` on a thread and fails the test if it takes longer than `limit` (a deadlock
/// shows up as a failure, not as a hung test run).
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::thread::Builder::new().spawn(body).unwrap().join());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("the job did not finish within {limit:?}: deadlock?"),
    }
}

/// What one worker saw: for each ElasticBSP barrier it passed, (its clock there, the planned
/// next barrier), in order, and the interval estimate it reported there.
struct Seen {
    rank: u32,
    barriers: Vec<(u64, u64)>,
    estimates: Vec<Option<Duration>>,
    stats: WorkerStats,
    clocks: (u64, u64),
}

/// `iters` iterations of `pause` each: pull both tensors concurrently (two threads at the same
/// clock: one superstep report, not two), sleep, push both. Finishes itself at the end.
fn train(worker: &Worker, iters: u64, pause: Duration) -> Seen {
    let mut barriers = Vec::new();
    let mut estimates = Vec::new();
    let mut w = vec![0f32; 1000];
    let mut b = vec![0f32; 10];
    for t in 0..iters {
        let before = worker.superstep_until().expect("ElasticBSP has a gate");
        // What a report at this clock carries (only pushes add samples).
        let estimate = worker.interval_estimate();
        std::thread::scope(|s| {
            let other = s.spawn(|| worker.pull_slice("w", &mut w, t));
            worker.pull_slice("b", &mut b, t).unwrap();
            other.join().unwrap().unwrap();
        });
        let after = worker.superstep_until().unwrap();
        if t >= before {
            assert!(
                after > t,
                "passed a barrier at {t} with the next one at {after}"
            );
            barriers.push((t, after));
            estimates.push(estimate);
        } else {
            assert_eq!(after, before, "the barrier moved without a superstep");
        }
        std::thread::sleep(pause);
        worker.push_slice("w", &w, t).unwrap();
        worker.push_slice("b", &b, t).unwrap();
    }
    let clocks = (worker.clock_of("w").unwrap(), worker.clock_of("b").unwrap());
    let stats = worker.stats();
    worker.finish().unwrap();
    Seen {
        rank: worker.rank(),
        barriers,
        estimates,
        stats,
        clocks,
    }
}

/// Checks what holds for every worker: its barriers follow each other (it pulls at every
/// clock, so it arrives exactly at its planned barrier; the first is at clock 1), each
/// superstep is 1..=R iterations, and it counted one superstep per barrier passed.
fn check_worker(seen: &Seen, iters: u64) {
    let mut expect = 1;
    for &(clock, until) in &seen.barriers {
        assert_eq!(clock, expect, "worker {}: {:?}", seen.rank, seen.barriers);
        assert!(
            (1..=u64::from(R)).contains(&(until - clock)),
            "worker {}: a superstep of {} iterations",
            seen.rank,
            until - clock
        );
        expect = until;
    }
    assert!(
        expect >= iters,
        "worker {}: ran past its barrier",
        seen.rank
    );
    assert_eq!(seen.stats.supersteps, seen.barriers.len() as u64);
    if seen.stats.supersteps > 0 {
        assert!(seen.stats.barrier_wait > Duration::ZERO);
    }
    assert_eq!(seen.clocks, (iters, iters), "worker {}", seen.rank);
}

fn gradients(report: &LocalReport) -> u64 {
    report.servers.iter().map(|s| s.gradients).sum()
}

#[test]
fn elasticbsp_plans_longer_supersteps_for_faster_workers() {
    const ITERS: u64 = 40;
    let (seen, report, shards) = within(Duration::from_secs(30), || {
        let mut cluster = LocalCluster::start(cfg(3), tensors()).unwrap();
        let shards = cluster.workers[0].keymap().shards.len() as u64;
        let threads: Vec<_> = std::mem::take(&mut cluster.workers)
            .into_iter()
            .map(|worker| {
                // Rank 0 takes 1 ms per iteration, rank 1 2 ms, rank 2 4 ms.
                let pause = Duration::from_millis(1 << worker.rank());
                std::thread::spawn(move || train(&worker, ITERS, pause))
            })
            .collect();
        let seen: Vec<Seen> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        (seen, cluster.finish().unwrap(), shards)
    });
    for s in &seen {
        check_worker(s, ITERS);
    }
    // Every iteration of every worker pushed, every shard's gradient applied once.
    assert_eq!(gradients(&report), 3 * ITERS * shards);
    let sched = &report.scheduler;
    assert!(sched.dead.is_empty(), "{:?}", sched.dead);
    assert!(sched.supersteps >= 2, "{} supersteps", sched.supersteps);
    // Every worker takes part in every superstep until it finishes, so its n-th barrier is
    // the job's n-th superstep, and the job's last plan is the last barrier of each worker in it.
    let most = seen.iter().map(|s| s.barriers.len()).max().unwrap() as u64;
    assert_eq!(sched.supersteps, most);
    assert!(!sched.last_plan.is_empty());
    for p in &sched.last_plan {
        assert!((1..=u64::from(R)).contains(&(p.until - p.clock)), "{p:?}");
        assert_eq!(
            seen[p.worker as usize].barriers.last(),
            Some(&(p.clock, p.until)),
            "{p:?}"
        );
    }
    // Every estimate was measured (the first iteration gives the first sample) and covers at
    // least the worker's sleep (a one-sided bound: sleeps never end early).
    for s in &seen {
        let pause = Duration::from_millis(1 << s.rank);
        for e in &s.estimates {
            assert!(e.is_some_and(|e| e >= pause), "worker {}: {e:?}", s.rank);
        }
    }
    // In the supersteps all three took part in, the plan followed the reported speeds (a
    // worker that reported a shorter interval was never planned fewer iterations; which one
    // is faster is the machine's business, so this holds under any load), and the superstep
    // lengths differ by less than R.
    let common = seen.iter().map(|s| s.barriers.len()).min().unwrap();
    assert!(common >= 1, "every worker passed at least one barrier");
    for n in 0..common {
        let ks: Vec<u64> = seen
            .iter()
            .map(|s| s.barriers[n].1 - s.barriers[n].0)
            .collect();
        let (lo, hi) = (ks.iter().min().unwrap(), ks.iter().max().unwrap());
        assert!(hi - lo < u64::from(R), "superstep {n}: {ks:?}");
        for (a, b) in seen.iter().flat_map(|a| seen.iter().map(move |b| (a, b))) {
            if a.estimates[n] < b.estimates[n] {
                assert!(
                    a.barriers[n].1 - a.barriers[n].0 >= b.barriers[n].1 - b.barriers[n].0,
                    "superstep {n}: worker {} reported {:?} and was planned {:?}, worker {} \
                     reported {:?} and was planned {:?}",
                    a.rank,
                    a.estimates[n],
                    a.barriers[n],
                    b.rank,
                    b.estimates[n],
                    b.barriers[n]
                );
            }
        }
    }
}

#[test]
fn a_worker_that_finishes_early_does_not_hold_the_barrier() {
    const ITERS: u64 = 30;
    const EARLY: u64 = 5;
    let (seen, report, shards) = within(Duration::from_secs(30), || {
        let mut cluster = LocalCluster::start(cfg(3), tensors()).unwrap();
        let shards = cluster.workers[0].keymap().shards.len() as u64;
        let threads: Vec<_> = std::mem::take(&mut cluster.workers)
            .into_iter()
            .map(|worker| {
                let iters = if worker.rank() == 2 { EARLY } else { ITERS };
                let pause = Duration::from_millis(1 + u64::from(worker.rank()));
                std::thread::spawn(move || (iters, train(&worker, iters, pause)))
            })
            .collect();
        let seen: Vec<(u64, Seen)> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        (seen, cluster.finish().unwrap(), shards)
    });
    for (iters, s) in &seen {
        check_worker(s, *iters);
    }
    assert_eq!(gradients(&report), (2 * ITERS + EARLY) * shards);
    let sched = &report.scheduler;
    assert!(sched.dead.is_empty(), "{:?}", sched.dead);
    assert!(sched.supersteps >= 2);
    // The others went on planning without the finished worker.
    assert!(
        sched.last_plan.iter().all(|p| p.worker != 2),
        "{:?}",
        sched.last_plan
    );
    assert!(seen[0].1.barriers.len() > seen[2].1.barriers.len());
}

#[test]
fn a_dead_worker_does_not_hold_the_barrier_forever() {
    const ITERS: u64 = 20;
    const DIES_AT: u64 = 4;
    let (seen, report) = within(Duration::from_secs(30), || {
        let mut cluster = LocalCluster::start(cfg(3), tensors()).unwrap();
        let threads: Vec<_> = std::mem::take(&mut cluster.workers)
            .into_iter()
            .map(|worker| {
                std::thread::spawn(move || {
                    if worker.rank() != 2 {
                        return Some(train(&worker, ITERS, Duration::from_millis(1)));
                    }
                    // Rank 2 works a few iterations, then vanishes mid-superstep: no `finish`,
                    // its handle (the last one) dropped, so its links close and its heartbeats
                    // stop.
                    let mut b = vec![0f32; 10];
                    for t in 0..DIES_AT {
                        worker.pull_slice("b", &mut b, t).unwrap();
                        worker.push_slice("b", &b, t).unwrap();
                    }
                    drop(worker);
                    None
                })
            })
            .collect();
        let seen: Vec<Option<Seen>> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        (seen, cluster.finish().unwrap())
    });
    for s in seen.iter().flatten() {
        check_worker(s, ITERS);
        // They went past the superstep in which the dead worker vanished.
        assert!(s.barriers.last().is_some_and(|&(c, _)| c >= DIES_AT));
    }
    let sched = &report.scheduler;
    assert_eq!(sched.dead, vec![(Role::Worker, 2)]);
    assert!(sched.last_plan.iter().all(|p| p.worker != 2));
}

#[test]
fn a_worker_waiting_at_a_job_barrier_does_not_hold_the_superstep() {
    // As `falcon local` does: train, meet at a job barrier, pull the final model, finish. The
    // fast worker waits at the job barrier while the slow ones still need supersteps.
    const ITERS: u64 = 16;
    let report = within(Duration::from_secs(30), || {
        let mut cluster = LocalCluster::start(cfg(3), tensors()).unwrap();
        let threads: Vec<_> = std::mem::take(&mut cluster.workers)
            .into_iter()
            .map(|worker| {
                std::thread::spawn(move || {
                    worker.barrier().unwrap();
                    let pause = Duration::from_millis(1 << worker.rank());
                    let mut b = vec![0f32; 10];
                    for t in 0..ITERS {
                        worker.pull_slice("b", &mut b, t).unwrap();
                        std::thread::sleep(pause);
                        worker.push_slice("b", &b, t).unwrap();
                    }
                    worker.barrier().unwrap();
                    worker.pull_slice("b", &mut b, ITERS).unwrap();
                    worker.finish().unwrap();
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        cluster.finish().unwrap()
    });
    assert!(report.scheduler.dead.is_empty());
    assert!(report.scheduler.supersteps >= 2);
}
