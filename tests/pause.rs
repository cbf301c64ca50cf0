//! A pause is not a death: real `falcon role` processes stopped with SIGSTOP and resumed.
//!
//! - A server paused for 10 s under the default heartbeat and suspicion timeout: nothing is
//!   decided in its absence, the job goes on, nothing is lost or applied twice.
//! - A server paused past the suspicion timeout (checkpoints on) is fenced: it learns so when
//!   it resumes, restarts itself from its checkpoint under its rank, the workers reattach, and
//!   the job finishes with every gradient accounted for.
//! - A worker paused within the suspicion timeout goes on; one paused past it is evicted, is
//!   told why, and rejoins under its rank at the current clock.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::{Job, line_with, number_after, succeeds};

fn signal(child: &Child, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill {sig} {}", child.id());
}

/// Pauses `child` for `pause`, once it has run for `after`.
fn pause(child: &mut Child, after: Duration, pause: Duration) {
    std::thread::sleep(after);
    assert!(child.try_wait().unwrap().is_none(), "still running");
    signal(child, "-STOP");
    std::thread::sleep(pause);
    signal(child, "-CONT");
}

/// The gradients a server applied, from its report ("server R: N gradients ...").
fn applied(out: &str, rank: u32) -> u64 {
    number_after(out, &format!("server {rank}:")).expect("server report")
}

fn shards(out: &str) -> u64 {
    number_after(line_with(out, " shards, "), ":").unwrap()
}

#[test]
fn a_server_paused_for_10_s_under_the_defaults_is_not_declared_dead() {
    let iters = 1500u64;
    let job = Job::new(
        "pause-server",
        2,
        2,
        &[
            ("FALCON_POLICY", "bsp"),
            ("FALCON_MEDIUM", "tcp"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
            // The defaults a user gets.
            ("FALCON_HEARTBEAT_MS", "1000"),
            ("FALCON_SUSPICION_MS", "15000"),
        ],
    );
    let sched = job.start("scheduler", None);
    let s0 = job.start("server", Some(0));
    let mut s1 = job.start("server", Some(1));
    let workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    let t = Instant::now();
    pause(
        &mut s1,
        Duration::from_millis(1500),
        Duration::from_secs(10),
    );
    for (r, w) in workers.into_iter().enumerate() {
        succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
    }
    eprintln!(
        "PAUSE server 10 s: job finished {:.1} s after the start",
        t.elapsed().as_secs_f64()
    );
    let (out1, _) = succeeds(s1, "the paused server", Duration::from_secs(30));
    let (out0, _) = succeeds(s0, "server 0", Duration::from_secs(30));
    let (out, _) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    assert!(
        line_with(&out, "job done").contains("dead: []"),
        "nobody was declared dead: {out}"
    );
    // Nothing lost, nothing applied twice, on either server: BSP's exact mean is checked by
    // the workers themselves.
    for (r, o) in [(0, &out0), (1, &out1)] {
        assert_eq!(applied(o, r), shards(o) * 2 * iters, "server {r}: {o}");
        assert!(o.contains("restarted from checkpoint none"), "{o}");
    }
}

#[test]
fn a_server_paused_past_the_suspicion_timeout_is_fenced_and_restarts_from_its_checkpoint() {
    let iters = 2500u64;
    let job = Job::new(
        "fence-server",
        2,
        2,
        &[
            ("FALCON_POLICY", "bsp"),
            ("FALCON_MEDIUM", "tcp"),
            ("FALCON_ITERS", &iters.to_string()),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
            ("FALCON_HEARTBEAT_MS", "300"),
            ("FALCON_SUSPICION_MS", "1500"),
        ],
    );
    let sched = job.start("scheduler", None);
    let s0 = job.start("server", Some(0));
    let mut s1 = job.start("server", Some(1));
    let workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    let paused = Instant::now();
    pause(&mut s1, Duration::from_millis(1500), Duration::from_secs(4));
    for (r, w) in workers.into_iter().enumerate() {
        succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
    }
    eprintln!(
        "PAUSE server past suspicion: workers finished {:.1} s after the pause began",
        paused.elapsed().as_secs_f64()
    );
    // Resumed, it learnt it was fenced, stopped serving, and restarted itself from its
    // checkpoint under its rank: the same process, never two servers for one rank.
    let (out1, err1) = succeeds(s1, "the fenced server", Duration::from_secs(30));
    assert!(
        err1.contains("fenced by the scheduler"),
        "it says it was fenced:\n{err1}"
    );
    assert!(
        out1.contains("restarted from checkpoint") && !out1.contains("checkpoint none"),
        "it restarted from its checkpoint:\n{out1}"
    );
    let (out0, _) = succeeds(s0, "server 0", Duration::from_secs(30));
    // The server that ran through applied every push exactly once (and BSP's exact mean is
    // checked by the workers).
    assert_eq!(applied(&out0, 0), shards(&out0) * 2 * iters, "{out0}");
    let (out, _) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    let done = line_with(&out, "job done");
    assert!(
        done.contains("dead: [server 1]")
            && done.contains("rejoined: [server 1]")
            && done.contains("evicted: [server 1 (silent for"),
        "{out}"
    );
    eprintln!("PAUSE server past suspicion: {}", line_with(&out1, "lost"));
}

#[test]
fn a_worker_paused_within_the_suspicion_timeout_goes_on() {
    let job = Job::new(
        "pause-worker",
        1,
        2,
        &[
            ("FALCON_POLICY", "bsp"),
            ("FALCON_ITERS", "1500"),
            ("FALCON_FLOATS", "20000"),
            // The defaults a user gets: before, 3 silent heartbeats (3 s) evicted it.
            ("FALCON_HEARTBEAT_MS", "1000"),
            ("FALCON_SUSPICION_MS", "15000"),
        ],
    );
    let sched = job.start("scheduler", None);
    let server = job.start("server", Some(0));
    let mut workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    pause(
        &mut workers[1],
        Duration::from_millis(1000),
        Duration::from_secs(5),
    );
    for (r, w) in workers.into_iter().enumerate() {
        let (out, _) = succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
        assert!(out.contains("1500 iterations"), "{out}");
    }
    succeeds(server, "the server", Duration::from_secs(30));
    let (out, _) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    assert!(line_with(&out, "job done").contains("dead: []"), "{out}");
}

#[test]
fn a_worker_paused_past_the_suspicion_timeout_is_evicted_told_why_and_rejoins() {
    let job = Job::new(
        "evict-worker",
        1,
        3,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_ITERS", "12000"),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_HEARTBEAT_MS", "300"),
            ("FALCON_SUSPICION_MS", "1500"),
        ],
    );
    let sched = job.start("scheduler", None);
    let server = job.start("server", Some(0));
    let mut workers: Vec<Child> = (0..3).map(|r| job.start("worker", Some(r))).collect();
    let paused = Instant::now();
    // Long enough to be evicted, short enough that the others still work after it.
    pause(
        &mut workers[2],
        Duration::from_millis(1000),
        Duration::from_millis(2500),
    );
    let victim = workers.pop().unwrap();
    for (r, w) in workers.into_iter().enumerate() {
        succeeds(w, &format!("worker {r}"), Duration::from_secs(120));
    }
    let (out, err) = succeeds(victim, "the evicted worker", Duration::from_secs(120));
    eprintln!(
        "PAUSE worker past suspicion: it finished {:.1} s after its pause began",
        paused.elapsed().as_secs_f64()
    );
    assert!(
        err.contains("evicted by the scheduler") && err.contains("silent for"),
        "it is told why:\n{err}"
    );
    assert!(err.contains("rejoining"), "it rejoins:\n{err}");
    let done = number_after(&out, "worker 2:").expect("its summary");
    assert!(
        done < 12000,
        "after rejoining it ran only the iterations left, at the current clock: {out}"
    );
    succeeds(server, "the server", Duration::from_secs(30));
    let (out, _) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    let line = line_with(&out, "job done");
    assert!(
        line.contains("dead: [worker 2]") && line.contains("rejoined: [worker 2]"),
        "{out}"
    );
    assert!(line.contains("evicted: [worker 2"), "{out}");
}
