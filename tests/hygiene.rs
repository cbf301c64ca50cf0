//! Process hygiene, with the real binary: `falcon local` takes its role processes with it
//! when it is interrupted or killed, stops the whole job at once when one of them fails (and
//! says which and why), `falcon train` ends at once when a role fails or panics, and a closed
//! standard output ends the program quietly.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");
const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");

/// The exit status `falcon` documents for a closed standard output.
const STDOUT_CLOSED: i32 = 141;

/// The state and parent of a process (`None`: it is gone).
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid …": comm may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 2..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// The live children of `parent`.
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some((state, ppid)) = stat(pid)
            && ppid == parent
            && state != 'Z'
        {
            out.push(pid);
        }
    }
    out
}

/// True while `pid` runs (a zombie has ended: only its exit status is left to collect).
fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _)| state != 'Z')
}

/// The role a process of `falcon local` plays (from its environment).
fn role_of(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix("FALCON_ROLE=").map(str::to_string))
}

fn wait_for(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// A long `falcon local` job (synthetic workload, small model), running: returns once worker
/// 0 reports progress, with the pids of its role processes.
fn running_local(workers: u32) -> (Child, Vec<u32>) {
    let mut child = Command::new(FALCON)
        .args(["local", "--servers", "1", "--workers", &workers.to_string()])
        .args([
            "--iters",
            "100000000",
            "--floats",
            "1000",
            "--medium",
            "shm",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn falcon local");
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let start = Instant::now();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("worker 0 iteration") => break,
            Some(Ok(_)) => {}
            _ => panic!(
                "falcon local ended before its job ran: {}",
                stderr_of(&mut child)
            ),
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no progress");
    }
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let roles = children(child.id());
    assert_eq!(
        roles.len(),
        2 + workers as usize,
        "a scheduler, a server and the workers: {roles:?}"
    );
    (child, roles)
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), sig)
        .unwrap();
}

/// Waits until none of `pids` runs; how long that took.
fn all_gone(pids: &[u32], limit: Duration) -> Duration {
    let start = Instant::now();
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            start.elapsed() < limit,
            "role processes still running {:?} after {limit:?}: {:?}",
            start.elapsed(),
            pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

fn interrupting_local_stops_its_roles(sig: rustix::process::Signal, code: i32, name: &str) {
    let (mut local, roles) = running_local(2);
    let sent = Instant::now();
    signal(local.id(), sig);
    let status = wait_for(&mut local, Duration::from_secs(10)).expect("falcon local ends");
    let ended = sent.elapsed();
    // Its roles are gone by the time it exits (it waits for them).
    assert!(
        roles.iter().all(|p| !alive(*p)),
        "role processes outlived falcon local: {:?}",
        roles.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
    );
    assert_eq!(status.code(), Some(code), "{status}");
    let err = stderr_of(&mut local);
    assert!(err.contains(&format!("stopped by {name}")), "{err}");
    assert!(ended < Duration::from_secs(5), "{ended:?}");
    eprintln!("{name} to falcon local: it and its roles were gone in {ended:?}");
}

#[test]
fn sigint_to_local_stops_its_role_processes_and_exits_130() {
    interrupting_local_stops_its_roles(rustix::process::Signal::INT, 130, "SIGINT");
}

#[test]
fn sigterm_to_local_stops_its_role_processes_and_exits_143() {
    interrupting_local_stops_its_roles(rustix::process::Signal::TERM, 143, "SIGTERM");
}

#[test]
fn role_processes_die_with_a_killed_local() {
    let (mut local, roles) = running_local(2);
    signal(local.id(), rustix::process::Signal::KILL);
    local.wait().unwrap();
    // Nobody forwards anything now: each role's parent-death signal ends it.
    let took = all_gone(&roles, Duration::from_secs(5));
    eprintln!("roles of a SIGKILLed falcon local were gone {took:?} after it");
}

#[test]
fn a_failed_role_stops_the_local_job_at_once_and_is_its_error() {
    let (mut local, roles) = running_local(3);
    let victim = *roles
        .iter()
        .find(|p| role_of(**p).as_deref() == Some("worker"))
        .expect("a worker process");
    signal(victim, rustix::process::Signal::KILL);
    let killed = Instant::now();
    let status = wait_for(&mut local, Duration::from_secs(10)).expect("the job ends");
    let took = killed.elapsed();
    assert_eq!(status.code(), Some(1), "{status}");
    let err = stderr_of(&mut local);
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("falcon: error: worker ") && last.contains("SIGKILL"),
        "the error names the worker and how it ended: {last}\n{err}"
    );
    assert!(roles.iter().all(|p| !alive(*p)), "every role stopped");
    assert!(took < Duration::from_secs(5), "{took:?}");
    eprintln!("a killed worker ended the local job in {took:?}");
}

#[test]
fn a_missing_dataset_fails_the_local_job_at_once_with_the_workers_error() {
    let start = Instant::now();
    let out = Command::new(FALCON)
        .args([
            "local",
            "--workload",
            "train",
            "--workers",
            "2",
            "--iters",
            "5",
        ])
        .args(["--data", "/nonexistent/falcon-data"])
        .output()
        .unwrap();
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    // The worker refuses its setting before it starts anything (a usage error, status 2).
    assert!(
        last.contains("worker ")
            && last.contains("failed (exit status: 2)")
            && last.contains("FALCON_DATA=/nonexistent/falcon-data")
            && last.contains("dataset /nonexistent/falcon-data: does not exist"),
        "the job's error is the worker's: {last}"
    );
    // Not after the scheduler's 60 s rendezvous timeout.
    assert!(took < Duration::from_secs(10), "{took:?}");
    eprintln!("missing dataset: the local job failed in {took:?}");
}

/// `falcon train` with a fault injected into worker 1 (`FALCON_FAULT_WORKER`) 300 ms after
/// its thread starts, in a job that would otherwise run for minutes.
fn train_with_fault(kind: &str, policy: &str) -> (std::process::Output, Duration) {
    let dir = std::env::temp_dir().join(format!("falcon-hygiene-{kind}-{}", std::process::id()));
    let start = Instant::now();
    let mut child = Command::new(FALCON)
        .args([
            "train",
            "--workers",
            "3",
            "--servers",
            "1",
            "--iters",
            "1000000",
        ])
        .args(["--policy", policy, "--quiet", "--data", SAMPLE])
        .arg("--out")
        .arg(&dir)
        .env("FALCON_FAULT_WORKER", format!("1:{kind}@300"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_for(&mut child, Duration::from_secs(30));
    let took = start.elapsed();
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.is_some(),
        "the job went on after its worker failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, took)
}

#[test]
fn a_failed_worker_ends_the_train_job_at_once_with_its_error() {
    for policy in ["bsp", "asp"] {
        let (out, took) = train_with_fault("error", policy);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.lines()
                .last()
                .unwrap_or_default()
                .contains("worker 1 failed: configuration: injected fault: worker 1 fails"),
            "{err}"
        );
        assert!(took < Duration::from_secs(10), "{policy}: {took:?}");
        eprintln!("{policy}: a failed worker ended the train job {took:?} after it started");
    }
}

#[test]
fn a_panicking_worker_ends_the_train_job_at_once_as_a_panic() {
    let (out, took) = train_with_fault("panic", "bsp");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap_or_default()
            .contains("worker 1 panicked: injected fault: worker 1 panics"),
        "reported as the worker's panic, not as a silence: {err}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
}

/// Runs `falcon ARGS` with standard output closed before it writes anything.
fn with_stdout_closed(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(FALCON)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let status = wait_for(&mut child, Duration::from_secs(60)).expect("it ends");
    let mut out = child.wait_with_output().unwrap();
    out.status = status;
    out
}

#[test]
fn a_closed_stdout_ends_each_command_quietly() {
    let out_dir = std::env::temp_dir().join(format!("falcon-pipe-{}", std::process::id()));
    let out = out_dir.to_str().unwrap();
    for args in [
        &[
            "train",
            "--iters",
            "5",
            "--workers",
            "2",
            "--servers",
            "1",
            "--data",
            SAMPLE,
            "--out",
            out,
        ][..],
        &[
            "sim",
            "--workers",
            "2",
            "--iters",
            "5",
            "--no-compute",
            "--data",
            SAMPLE,
            "--out",
            out,
        ],
        &["local", "--iters", "5", "--floats", "100"],
        &["doctor"],
    ] {
        let o = with_stdout_closed(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(STDOUT_CLOSED), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("error"), "quietly: {args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn the_exit_statuses_are_documented() {
    let out = Command::new(FALCON).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("141 standard output closed"), "{help}");
    assert!(
        help.contains("130, 143, 129 `falcon local` stopped"),
        "{help}"
    );
}

#[test]
fn train_piped_into_head_ends_quietly() {
    let dir = std::env::temp_dir().join(format!("falcon-head-{}", std::process::id()));
    let mut child = Command::new(FALCON)
        .args(["train", "--iters", "5", "--workers", "2", "--servers", "1"])
        .args(["--data", SAMPLE, "--out"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // `| head -1`: read a line, close the pipe.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("epsp"), "{first}");
    let status = wait_for(&mut child, Duration::from_secs(60)).expect("it ends");
    let err = stderr_of(&mut child);
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(status.code(), Some(101), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // 141 when it wrote after the reader left; 0 if it had said everything before.
    assert!(
        matches!(status.code(), Some(0) | Some(STDOUT_CLOSED)),
        "{status}: {err}"
    );
}

#[test]
fn local_piped_into_head_ends_quietly_with_its_roles() {
    let mut child = Command::new(FALCON)
        .args(["local", "--servers", "1", "--workers", "2"])
        .args([
            "--iters",
            "100000000",
            "--floats",
            "1000",
            "--medium",
            "shm",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(Ok(l)) = lines.next() {
        if l.contains("worker 0 iteration") {
            break;
        }
    }
    let roles = children(child.id());
    assert_eq!(roles.len(), 4, "{roles:?}");
    // The reader leaves: the roles' next lines (on the same pipe) cannot be written.
    drop(lines);
    let status = wait_for(&mut child, Duration::from_secs(10)).expect("it ends");
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(STDOUT_CLOSED), "{status}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("falcon: error"),
        "{err}"
    );
    all_gone(&roles, Duration::from_secs(5));
}

#[test]
fn log_lines_name_the_role_and_rank_and_carry_no_colour_off_a_terminal() {
    // A worker whose scheduler never answers logs its waiting (after 3 s) and gives up.
    let o = Command::new(FALCON)
        .arg("role")
        .env("FALCON_ROLE", "worker")
        .env("FALCON_RANK", "1")
        .env("FALCON_SCHEDULER", "127.0.0.1:1")
        .env("FALCON_RENDEZVOUS_TIMEOUT_MS", "4000")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    let logged: Vec<&str> = err.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(!logged.is_empty(), "a warning while waiting: {err}");
    assert!(
        logged.iter().all(|l| l.starts_with("[worker 1] ")),
        "every log line names its role and rank: {err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "no terminal colour codes in a pipe: {err:?}"
    );
}
