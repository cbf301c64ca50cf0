//! Checkpoint failures with real processes: a server that cannot write its checkpoint (the
//! path taken by a directory, the checkpoint directory replaced by a file: both fail for
//! root too) tells the scheduler; under `warn` the job finishes with the failures in both
//! reports, the logs rate-limited and no temporary file left; under `stop` the scheduler ends
//! the job at once, naming the server and the reason.

mod common;

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::{Job, line_with, number_after, output_of, succeeds, wait_for};

/// Waits for `file` to exist (a checkpoint written).
fn wait_for_file(file: &Path) {
    let start = Instant::now();
    while !file.is_file() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no checkpoint at {}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Makes `p` a non-empty directory, whatever the server writing it does meanwhile: no file
/// can be renamed over it, for root either.
fn block(p: &Path) {
    let start = Instant::now();
    loop {
        let _ = std::fs::remove_file(p);
        if std::fs::create_dir_all(p.join("blocker")).is_ok() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "cannot block {p:?}"
        );
    }
}

/// Replaces the directory `d` by a regular file of the same name.
fn replace_by_a_file(d: &Path) {
    let start = Instant::now();
    loop {
        let _ = std::fs::remove_dir_all(d);
        if std::fs::write(d, b"not a directory").is_ok() && d.is_file() {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "cannot replace {d:?}"
        );
    }
}

/// Lines of `text` that speak of checkpoints.
fn checkpoint_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.contains("checkpoint")).collect()
}

/// Temporary checkpoint files left in `dir`.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect()
}

#[test]
fn under_warn_the_job_finishes_and_reports_its_checkpoint_failures() {
    let job = Job::new(
        "ckptfail-warn",
        2,
        2,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_ITERS", "6000"),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
            ("FALCON_CHECKPOINT_ON_FAILURE", "warn"),
            ("RUST_LOG", "warn"),
        ],
    );
    // Server 0 cannot write a single checkpoint; server 1 fails once it has written one.
    block(&job.dir.join("server-0.ckpt"));
    let start = Instant::now();
    let sched = job.start("scheduler", None);
    let servers: Vec<Child> = (0..2).map(|r| job.start("server", Some(r))).collect();
    let workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    wait_for_file(&job.dir.join("server-1.ckpt"));
    block(&job.dir.join("server-1.ckpt"));
    let blocked = Instant::now();
    for (r, w) in workers.into_iter().enumerate() {
        succeeds(w, &format!("worker {r}"), Duration::from_secs(180));
    }
    let mut failed = Vec::new();
    for (r, s) in servers.into_iter().enumerate() {
        let (out, err) = succeeds(s, &format!("server {r}"), Duration::from_secs(30));
        let n = number_after(line_with(&out, "checkpoint writes failed"), ":")
            .unwrap_or_else(|| panic!("server {r} counts its failures:\n{out}"));
        let lines = checkpoint_lines(&err);
        failed.push((n, lines.len(), err.clone()));
    }
    let (out, err) = succeeds(sched, "the scheduler", Duration::from_secs(30));
    let secs = start.elapsed().as_secs_f64();
    // The scheduler's report: per server, the count and the last reason.
    for (r, (n, lines, serr)) in failed.iter().enumerate() {
        let line = line_with(&out, &format!("scheduler: server {r}: "));
        let reported = number_after(line, &format!("server {r}:")).unwrap();
        assert!(
            line.contains("checkpoint writes failed")
                && line.contains("rename into place")
                && line.contains(&format!("server-{r}.ckpt")),
            "{line}"
        );
        // The last failure may have been reported after the report was taken.
        assert!(
            reported + 1 >= *n && reported <= *n && reported >= 3,
            "scheduler {reported}, server {n}"
        );
        // At most a line at the first failure and one per 10 s after it.
        let most = 1 + (secs / 10.0) as usize;
        assert!(
            *lines <= most,
            "server {r}: {lines} log lines for {n} failures in {secs:.1} s:\n{serr}"
        );
        eprintln!(
            "warn: server {r}: {n} failed checkpoint writes, {lines} log lines in {secs:.1} s:"
        );
        for l in checkpoint_lines(serr) {
            eprintln!("    {l}");
        }
    }
    // The scheduler says each server's failure once (its reason did not change).
    let sched_lines = checkpoint_lines(&err);
    assert_eq!(sched_lines.len(), 2, "{err}");
    assert!(
        sched_lines
            .iter()
            .any(|l| l.contains("server 1 could not write its checkpoint")),
        "{err}"
    );
    eprintln!(
        "warn: scheduler: {} log lines; server 1 failing for {:.1} s",
        sched_lines.len(),
        blocked.elapsed().as_secs_f64()
    );
    assert_eq!(
        temporaries(&job.dir),
        Vec::<String>::new(),
        "no temporary file is left"
    );
}

#[test]
fn under_stop_the_scheduler_ends_the_job_naming_the_server_and_the_reason() {
    let job = Job::new(
        "ckptfail-stop",
        2,
        2,
        &[
            ("FALCON_POLICY", "ssp(2)"),
            // Far more than the test waits for: the job ends by the failure.
            ("FALCON_ITERS", "1000000"),
            ("FALCON_FLOATS", "20000"),
            ("FALCON_MAX_SHARD_BYTES", "16384"),
            ("FALCON_CHECKPOINT_ON_FAILURE", "stop"),
        ],
    );
    let mut sched = job.start("scheduler", None);
    let mut servers: Vec<Child> = (0..2).map(|r| job.start("server", Some(r))).collect();
    let mut workers: Vec<Child> = (0..2).map(|r| job.start("worker", Some(r))).collect();
    // Both servers checkpoint fine, then the checkpoint directory becomes a file.
    wait_for_file(&job.dir.join("server-0.ckpt"));
    wait_for_file(&job.dir.join("server-1.ckpt"));
    replace_by_a_file(&job.dir);
    let broken = Instant::now();
    let status = wait_for(&mut sched, Duration::from_secs(20)).expect("the scheduler ended");
    let after = broken.elapsed();
    let (_, err) = output_of(&sched);
    assert!(!status.success(), "the job failed: {err}");
    let line = line_with(&err, "falcon: error:");
    // The directory became a file before a write began (its directory cannot be made) or
    // while one was under way (its finished file cannot be renamed into place).
    assert!(
        line.contains("could not write its checkpoint")
            && (line.contains("create the directory of") || line.contains("rename into place"))
            && (line.contains("server 0") || line.contains("server 1"))
            && line.contains("stopped"),
        "{line}"
    );
    assert!(
        after < Duration::from_secs(3),
        "the job ended {after:?} after the failure"
    );
    // Everyone else ends too: the servers cleanly, the workers told the job was shut down.
    for (r, s) in servers.iter_mut().enumerate() {
        let st = wait_for(s, Duration::from_secs(10));
        assert!(st.is_some_and(|s| s.success()), "server {r}: {st:?}");
    }
    for (r, w) in workers.iter_mut().enumerate() {
        let st = wait_for(w, Duration::from_secs(10));
        assert!(st.is_some_and(|s| !s.success()), "worker {r}: {st:?}");
    }
    eprintln!(
        "stop: the scheduler ended {:.3} s after the checkpoint directory was replaced by a file; {line}",
        after.as_secs_f64()
    );
    let _ = std::fs::remove_file(&job.dir);
}

#[test]
fn an_unknown_failure_action_is_refused_naming_the_allowed_ones() {
    let job = Job::new(
        "ckptfail-bad",
        1,
        1,
        &[("FALCON_CHECKPOINT_ON_FAILURE", "ignore")],
    );
    let mut sched = job.start("scheduler", None);
    let status = wait_for(&mut sched, Duration::from_secs(10)).expect("it exits at once");
    let (_, err) = output_of(&sched);
    assert!(!status.success());
    let line = line_with(&err, "falcon: error:");
    assert!(
        line.contains("FALCON_CHECKPOINT_ON_FAILURE=ignore") && line.contains("warn or stop"),
        "{line}"
    );
}
