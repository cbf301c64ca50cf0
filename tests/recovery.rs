//! Fault tolerance with real processes: a server killed with SIGKILL restarts from its last
//! checkpoint and the workers reattach; a killed worker restarts and rejoins at the current
//! clock; dropped connections are re-established and nothing is applied twice.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::{Job, kill_after_checkpoint, line_with, number_after, succeeds};

fn server_killed_and_restarted(policy: &str, medium: &str) {
    let job = Job::new(
        &format!("ckpt-{}", policy.replace(['(', ')', ','], "")),
        2,
        2,
        &[
            ("FALCON_POLICY", policy),
            ("FALCON_MEDIUM", medium),
            ("FALCON_ITERS", "2500"),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
        ],
    );
    let sched = job.start("scheduler", None);
    let s0 = job.start("server", Some(0));
    let mut s1 = job.start("server", Some(1));
    let workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    kill_after_checkpoint(&mut s1, &job.dir.join("server-1.ckpt"));
    let killed = Instant::now();
    let s1 = job.start("server", Some(1));
    for (r, w) in workers.into_iter().enumerate() {
        let (out, _) = succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
        assert!(out.contains("iterations in"), "{out}");
    }
    eprintln!("workers finished {:?} after the kill", killed.elapsed());
    let (out1, err1) = succeeds(s1, "the restarted server", Duration::from_secs(30));
    assert!(
        out1.contains("restarted from checkpoint"),
        "the report says where it restarted from:\n{out1}\n{err1}"
    );
    let line = line_with(&out1, "acknowledged updates lost");
    let lost: u64 = line
        .rsplit("; ")
        .next()
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the report counts the lost updates: {line}"));
    eprintln!("{line} ({lost} lost)");
    let (out0, _) = succeeds(s0, "server 0", Duration::from_secs(30));
    assert!(
        out0.contains("restarted from checkpoint none; 0 acknowledged updates lost"),
        "server 0 ran through: {out0}"
    );
    // Exactly once on the server that ran through, retries and reattachments included.
    let gradients = number_after(&out0, "server 0:").unwrap();
    let shards = number_after(line_with(&out0, " shards, "), ":").unwrap();
    assert_eq!(gradients, shards * 2 * 2500, "{out0}");
    succeeds(sched, "the scheduler", Duration::from_secs(30));
}

#[test]
fn a_killed_server_restarts_from_its_checkpoint_under_bsp_over_tcp() {
    // BSP: the synthetic workload checks the model reached the targets' mean exactly.
    server_killed_and_restarted("bsp", "tcp");
}

#[test]
fn a_killed_server_restarts_from_its_checkpoint_under_ssp_over_shm() {
    server_killed_and_restarted("ssp(2)", "shm");
}

#[test]
fn a_killed_worker_restarts_and_rejoins_at_the_current_clock() {
    // Long enough that the victim is still at work when it is killed: an optimized build
    // runs the job about ten times as fast.
    let iters: u64 = if cfg!(debug_assertions) { 3000 } else { 30_000 };
    let iters_var = iters.to_string();
    let job = Job::new(
        "rejoin",
        1,
        3,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_ITERS", iters_var.as_str()),
            ("FALCON_FLOATS", "20000"),
        ],
    );
    let sched = job.start("scheduler", None);
    let server = job.start("server", Some(0));
    let mut workers: Vec<Child> = (0..3).map(|r| job.start("worker", Some(r))).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut victim = workers.pop().unwrap();
    assert!(victim.try_wait().unwrap().is_none(), "still running");
    victim.kill().unwrap();
    victim.wait().unwrap();
    // Give the scheduler a moment to see it gone (its links close at once).
    std::thread::sleep(Duration::from_millis(500));
    let back = job.start("worker", Some(2));
    for (r, w) in workers.into_iter().enumerate() {
        succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
    }
    let (out, err) = succeeds(back, "the rejoined worker", Duration::from_secs(120));
    let done = number_after(&out, "worker 2:").expect("its summary");
    assert!(
        done < iters,
        "it ran only the iterations left after rejoining, not all {iters}: {out}\n{err}"
    );
    succeeds(server, "the server", Duration::from_secs(30));
    let (out, _) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    assert!(
        line_with(&out, "job done").contains("dead: [worker 2]; rejoined: [worker 2]"),
        "{out}"
    );
}

#[test]
fn dropped_connections_are_reestablished_and_nothing_is_applied_twice() {
    dropped_connections("pull-push", &[]);
}

#[test]
fn dropped_connections_under_push_pull_resend_the_pushes_and_their_pulls() {
    // A push-pull's pull rides in its push's trailer; after a reconnection the push goes
    // again without it and the pull as a request of its own: every answer still comes. A
    // thread also drops links every few milliseconds, mid-flight.
    dropped_connections("push-pull", &[("FALCON_FAULT_DROP_MS", "7")]);
}

#[test]
fn dropped_shm_links_under_push_pull_resend_the_pushes_and_their_pulls() {
    // Over shm a link closed under a push-pull can fail the pull's grant too: the pull then
    // waits for the reconnection with its push.
    dropped_connections(
        "push-pull",
        &[("FALCON_FAULT_DROP_MS", "7"), ("FALCON_MEDIUM", "shm")],
    );
}

#[test]
fn dropped_shm_links_while_servers_read_gradients_in_the_workers_memory() {
    // Shards of 64 KiB over shm: each server reads a gradient where its worker holds it. A
    // push whose link closed goes again, in place again, on the new link; applied once.
    for worker_loop in ["pull-push", "push-pull"] {
        let outs = dropped_connections(
            worker_loop,
            &[
                ("FALCON_FAULT_DROP_MS", "7"),
                ("FALCON_MEDIUM", "shm"),
                ("FALCON_FLOATS", "32768"),
                ("FALCON_MAX_SHARD_BYTES", "65536"),
            ],
        );
        for out in outs {
            let in_place = number_after(&out, "pushed in place ").expect("counted");
            assert!(in_place >= 2 * 600, "{worker_loop}: {out}");
        }
    }
}

/// Workers of the `worker_loop` drop a server link every 25 iterations (and as `extra`
/// says): every drop is reattached, and every push is applied exactly once. Returns what
/// the workers printed.
fn dropped_connections(worker_loop: &str, extra: &[(&str, &str)]) -> Vec<String> {
    let iters = 600u64;
    let job = Job::new(
        "drops",
        2,
        2,
        &[
            ("FALCON_POLICY", "asp"),
            ("FALCON_MEDIUM", "tcp"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
            ("FALCON_FAULT_DROP_EVERY", "25"),
            ("FALCON_LOOP", worker_loop),
        ]
        .iter()
        .chain(extra)
        .copied()
        .collect::<Vec<_>>(),
    );
    let sched = job.start("scheduler", None);
    let servers: Vec<Child> = (0..2).map(|r| job.start("server", Some(r))).collect();
    let workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    let mut reconnects = 0;
    let mut outs = Vec::new();
    for (r, w) in workers.into_iter().enumerate() {
        let (out, _) = succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
        reconnects += number_after(&out, "reconnects ").expect("reconnects counted");
        outs.push(out);
    }
    assert!(
        reconnects >= 2 * (iters / 25 - 1),
        "every drop was reattached: {reconnects}"
    );
    if !extra.is_empty() {
        assert!(
            reconnects > 2 * (iters / 25),
            "the dropping thread dropped links too: {reconnects}"
        );
    }
    for (r, s) in servers.into_iter().enumerate() {
        let (out, _) = succeeds(s, &format!("server {r}"), Duration::from_secs(30));
        let gradients = number_after(&out, &format!("server {r}:")).unwrap();
        let shards = number_after(line_with(&out, " shards, "), ":").unwrap();
        // Exactly once: every push of every worker to every shard applied one time, no
        // more (retries are counted as duplicates), no less.
        assert_eq!(gradients, shards * 2 * iters, "{out}");
    }
    succeeds(sched, "the scheduler", Duration::from_secs(30));
    outs
}

#[test]
fn a_killed_server_restarts_from_its_checkpoint_under_syncopt_over_shm() {
    // Sync-opt resumes from the checkpoint's steps: pulls of the next clocks are answered
    // (every pull reaches the policy when there are backups).
    server_killed_and_restarted("syncopt(1)", "shm");
}
