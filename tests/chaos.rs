//! The chaos run: 4 workers and 2 servers, every role a real process, while a driver kills
//! (SIGKILL) and restarts random workers and one server, and every worker's server links are
//! dropped every ~1.5 s. The job must finish; no update may be applied twice; the trained
//! model's accuracy must be within 1 point of an undisturbed run of the same job.
//!
//! `FALCON_CHAOS_ITERS` sets the length (CI runs a short one; `tools/chaos.sh` the 2-minute
//! one), `FALCON_CHAOS_SEED` the driver's choices. `FALCON_CHAOS=0` skips it, visibly (a
//! `SKIPPED:` line): `tools/test.sh` runs it in a stage of its own, in a release build.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::{Job, first_parameter, line_with, number_after, succeeds};

const SERVERS: u32 = 2;
const WORKERS: u32 = 4;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What a run left: the last incarnation of every role, finished, with its output.
struct Run {
    secs: f64,
    workers: Vec<String>,
    servers: Vec<String>,
    scheduler: String,
    actions: Vec<String>,
}

/// Runs a job; with `chaos`, the driver acts every `every` during the first 60% of
/// `expected` (so restarted workers find the job still running).
fn run(job: &Job, chaos: bool, expected: Duration, seed: u64) -> Run {
    let mut rng = fastrand::Rng::with_seed(seed);
    let start = Instant::now();
    let sched = job.start("scheduler", None);
    let mut servers: Vec<Child> = (0..SERVERS).map(|r| job.start("server", Some(r))).collect();
    let mut workers: Vec<Child> = (0..WORKERS).map(|r| job.start("worker", Some(r))).collect();
    let mut actions = Vec::new();
    if chaos {
        // Nothing happens before the first checkpoint exists.
        let ckpt = job.dir.join("server-1.ckpt");
        while !ckpt.exists() && start.elapsed() < expected {
            std::thread::sleep(Duration::from_millis(20));
        }
        let every = (expected / 8).max(Duration::from_millis(1500));
        let mut server_done = false;
        let mut next = Instant::now() + every / 2;
        while start.elapsed() < expected.mul_f64(0.6) {
            if workers.iter_mut().any(|w| w.try_wait().unwrap().is_some()) {
                break;
            }
            if Instant::now() < next {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            next = Instant::now() + every;
            let t = start.elapsed().as_secs_f64();
            if !server_done && start.elapsed() > expected / 4 {
                server_done = true;
                servers[1].kill().unwrap();
                servers[1].wait().unwrap();
                actions.push(format!("{t:6.1} s  kill -9 server 1, restart it"));
                std::thread::sleep(Duration::from_millis(300));
                servers[1] = job.start("server", Some(1));
            } else {
                let r = rng.u32(0..WORKERS);
                workers[r as usize].kill().unwrap();
                workers[r as usize].wait().unwrap();
                actions.push(format!("{t:6.1} s  kill -9 worker {r}, restart it"));
                // The scheduler sees it gone at once (its links close); then it rejoins.
                std::thread::sleep(Duration::from_millis(400));
                workers[r as usize] = job.start("worker", Some(r));
            }
        }
    }
    // A deadline, not a speed: a debug build of the calm run takes about a minute on a
    // quiet 2-core machine, and several on a loaded one.
    let limit = expected * 4 + Duration::from_secs(300);
    let workers: Vec<String> = workers
        .into_iter()
        .enumerate()
        .map(|(r, w)| succeeds(w, &format!("worker {r}"), limit).0)
        .collect();
    let servers: Vec<String> = servers
        .into_iter()
        .enumerate()
        .map(|(r, s)| succeeds(s, &format!("server {r}"), Duration::from_secs(60)).0)
        .collect();
    let (scheduler, _) = succeeds(sched, "the scheduler", Duration::from_secs(60));
    Run {
        secs: start.elapsed().as_secs_f64(),
        workers,
        servers,
        scheduler,
        actions,
    }
}

fn accuracy(out: &str) -> f64 {
    let line = line_with(out, "test accuracy");
    let i = line.find("test accuracy ").unwrap() + "test accuracy ".len();
    line[i..].split('%').next().unwrap().parse().unwrap()
}

/// Every shard's parameters count the gradients applied (constant gradients, step 1/8):
/// they must equal the sequence numbers applied, no more (a double apply), no less.
fn check_exactly_once(servers: &[String]) -> u64 {
    let mut applied_total = 0;
    for out in servers {
        for line in out.lines().filter(|l| l.contains("first parameter")) {
            let first = first_parameter(line);
            let seqs = number_after(line, "sequence numbers").unwrap();
            let skipped = number_after(line, "applied +").unwrap();
            let applied = (first / 0.125).round() as u64;
            assert_eq!(
                applied,
                seqs - skipped,
                "the values count {applied} gradients applied; the sequence numbers say {}: {line}",
                seqs - skipped
            );
            applied_total += applied;
        }
    }
    applied_total
}

#[test]
fn the_job_survives_kills_restarts_and_dropped_links() {
    if std::env::var("FALCON_CHAOS").as_deref() == Ok("0") {
        println!(
            "SKIPPED: the_job_survives_kills_restarts_and_dropped_links: FALCON_CHAOS=0 (the chaos run has a stage of its own)"
        );
        return;
    }
    let common_vars = |name: &str, chaos: bool, workload: &str, iters: u64| {
        let mut v = vec![
            ("FALCON_POLICY".to_string(), "ssp(2)".to_string()),
            ("FALCON_MEDIUM".into(), "tcp".into()),
            ("FALCON_ITERS".into(), iters.to_string()),
            ("FALCON_WORKLOAD".into(), workload.into()),
            ("FALCON_SEED".into(), "1".into()),
            // Three times the default rate, then a tenth of it for the last quarter of the
            // updates (each shard takes one per push: 4 × iters): the model nears its
            // plateau sooner, and its final values no longer swing by a point or more from
            // one update to the next, as they do at a constant rate.
            ("FALCON_LR".into(), "0.15".into()),
            ("FALCON_LR_DECAY".into(), format!("{}:0.1", 3 * iters)),
            // Shards on both servers (the model is 0.8 MB), so the killed one holds some.
            ("FALCON_MAX_SHARD_BYTES".into(), "131072".into()),
        ];
        if chaos {
            v.push(("FALCON_FAULT_DROP_MS".into(), "1500".into()));
        }
        if workload == "count" {
            v.retain(|(k, _)| k != "FALCON_LR_DECAY");
            v.push(("FALCON_FLOATS".into(), "4096".into()));
            v.retain(|(k, _)| k != "FALCON_MAX_SHARD_BYTES");
            v.push(("FALCON_MAX_SHARD_BYTES".into(), "4096".into()));
        }
        let v: Vec<(&str, &str)> = v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Job::new(name, SERVERS, WORKERS, &v)
    };

    let seed = env_u64("FALCON_CHAOS_SEED", 7);
    // FALCON_CHAOS_SECS: size the run to last about that long here (a short calibration run
    // first); else FALCON_CHAOS_ITERS iterations (default: CI's short run, 1200 with the
    // rates above: long enough that the model is near its plateau, so the iterations a
    // killed worker skips and the updates lost with the killed server move the accuracy by
    // less than the 1-point bound. At the default constant rate, undisturbed runs of 900
    // iterations ended anywhere from 84.6 to 85.0 %, and chaos runs 83.5 to 84.9 %; at 0.15
    // constant, undisturbed runs of 1200 ended at 84.0 and 86.9 %.)
    let iters = match std::env::var("FALCON_CHAOS_SECS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    {
        Some(secs) => {
            // Two probes: the difference is the iterations' time, the rest is start-up.
            let t = |n: u64| {
                run(
                    &common_vars("probe", false, "train", n),
                    false,
                    Duration::ZERO,
                    seed,
                )
                .secs
            };
            let (short, long) = (t(50), t(450));
            let per = ((long - short) / 400.0).max(1e-4);
            let iters = ((secs - (short - 50.0 * per)) / per).max(100.0) as u64;
            eprintln!(
                "calibration: 50 iterations in {short:.1} s, 450 in {long:.1} s; {iters} iterations for ~{secs} s"
            );
            iters
        }
        None => env_u64("FALCON_CHAOS_ITERS", 1200),
    };
    // 1. Training: the undisturbed run, then the same job under chaos.
    let calm = run(
        &common_vars("calm", false, "train", iters),
        false,
        Duration::ZERO,
        seed,
    );
    let expected = Duration::from_secs_f64(calm.secs);
    let stormy = run(
        &common_vars("chaos", true, "train", iters),
        true,
        expected,
        seed,
    );
    eprintln!("chaos driver:\n{}", stormy.actions.join("\n"));
    let (a_calm, a_storm) = (accuracy(&calm.workers[0]), accuracy(&stormy.workers[0]));
    let reconnects: u64 = stormy
        .workers
        .iter()
        .map(|w| number_after(w, "reconnects ").unwrap_or(0))
        .sum();
    let lost: u64 = stormy
        .servers
        .iter()
        .filter_map(|s| number_after(s, "restarted from checkpoint").and(Some(s)))
        .filter_map(|s| {
            let l = line_with(s, "acknowledged updates lost");
            l.rsplit("; ")
                .next()?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    eprintln!(
        "undisturbed: {:.1} s, accuracy {a_calm:.2}%; chaos: {:.1} s, accuracy {a_storm:.2}%, {} actions, {reconnects} reattachments, {lost} updates lost with the killed server",
        calm.secs,
        stormy.secs,
        stormy.actions.len()
    );
    assert!(
        stormy.actions.iter().any(|a| a.contains("server 1"))
            && stormy.actions.iter().any(|a| a.contains("worker")),
        "the driver killed a server and a worker: {:?}",
        stormy.actions
    );
    assert!(
        stormy.scheduler.contains("rejoined: [") && !stormy.scheduler.contains("rejoined: []"),
        "{}",
        stormy.scheduler
    );
    assert!(reconnects > 0, "links were dropped and reattached");
    assert!(
        (a_calm - a_storm).abs() <= 1.0,
        "accuracy within 1 point of the undisturbed run: {a_calm:.2}% vs {a_storm:.2}%\n\
         the chaos run's last workers:\n{}\nservers:\n{}\nscheduler:\n{}",
        stormy.workers.join("\n"),
        stormy.servers.join("\n"),
        stormy.scheduler
    );

    // 2. Exactly once: constant gradients under the same chaos; the values count them. The
    // driver kills within the first 60 % of the training run's time, so the counting run must
    // outlast that by a margin: a worker killed once the others are done finds the job over
    // (the scheduler ends a job whose every live worker finished) and cannot rejoin it.
    let counted = run(
        &common_vars("chaos-count", true, "count", iters * 16),
        true,
        expected,
        seed + 1,
    );
    eprintln!("chaos driver (counting):\n{}", counted.actions.join("\n"));
    let applied = check_exactly_once(&counted.servers);
    let duplicates: u64 = counted
        .servers
        .iter()
        .map(|s| number_after(s, "dropped gradients, ").unwrap_or(0))
        .sum();
    eprintln!(
        "counting run: {applied} gradients applied once each; {duplicates} repeated pushes recognized and not applied again"
    );
    assert!(applied > 0);
}
