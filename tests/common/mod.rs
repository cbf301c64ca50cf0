//! Helpers of the multi-process fault tests: jobs of real `falcon role` processes started
//! from ps-lite's variables, and their reports.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub const FALCON: &str = env!("CARGO_BIN_EXE_falcon");

/// A free port for a job's scheduler, below the kernel's ephemeral range (32768 and up on
/// Linux): a port the kernel picked and the test released can be handed to another process's
/// outgoing connection before the scheduler binds it (seen once in CI as a job that never
/// started). Each call of a test process starts at a different place, and the port is
/// checked free.
pub fn port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let offset = u64::from(std::process::id()) * 7919;
    for _ in 0..12_000 {
        let p = (20_000 + (offset + NEXT.fetch_add(13, Ordering::Relaxed)) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
    panic!("no free port between 20000 and 32000")
}

/// Where each process a job started writes, by pid: files, not pipes, so that a process that
/// logs a lot (a worker logging every dropped link) never blocks on a full pipe while the
/// test waits on another one.
static OUTPUT: Mutex<BTreeMap<u32, (PathBuf, PathBuf)>> = Mutex::new(BTreeMap::new());
static STARTED: AtomicU64 = AtomicU64::new(0);

/// What `child` (started by [`Job::start`]) wrote so far: stdout and stderr (looked up by
/// pid: ask before this test starts another process, which could reuse a reaped child's).
pub fn output_of(child: &Child) -> (String, String) {
    read_output(OUTPUT.lock().unwrap().get(&child.id()).cloned())
}

fn read_output(paths: Option<(PathBuf, PathBuf)>) -> (String, String) {
    let read = |p: &PathBuf| {
        std::fs::read(p)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    };
    paths.map_or_else(Default::default, |(o, e)| (read(&o), read(&e)))
}

/// A job's shared settings: ps-lite's variables, checkpoints in `dir`.
pub struct Job {
    pub port: u16,
    pub dir: PathBuf,
    pub vars: Vec<(String, String)>,
}

impl Job {
    pub fn new(name: &str, servers: u32, workers: u32, vars: &[(&str, &str)]) -> Job {
        let port = port();
        let dir = std::env::temp_dir().join(format!("falcon-{name}-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        let mut all: Vec<(String, String)> = [
            ("DMLC_PS_ROOT_URI", "127.0.0.1".to_string()),
            ("DMLC_PS_ROOT_PORT", port.to_string()),
            ("DMLC_NUM_SERVER", servers.to_string()),
            ("DMLC_NUM_WORKER", workers.to_string()),
            ("DMLC_NODE_HOST", "127.0.0.1".to_string()),
            ("FALCON_JOB", format!("{name}-{port}")),
            ("FALCON_TOKEN", "t0ken".to_string()),
            ("FALCON_CHECKPOINT_DIR", dir.display().to_string()),
            ("FALCON_CHECKPOINT_MS", "100".to_string()),
            ("FALCON_HEARTBEAT_MS", "300".to_string()),
            ("FALCON_SUSPICION_MS", "5000".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Job {
            port,
            dir,
            vars: all,
        }
    }

    pub fn start(&self, role: &str, rank: Option<u32>) -> Child {
        let logs = self.logs();
        std::fs::create_dir_all(&logs).expect("a folder for the output");
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        let (out, err) = (
            logs.join(format!("{role}-{n}.out")),
            logs.join(format!("{role}-{n}.err")),
        );
        let mut c = Command::new(FALCON);
        c.arg("role")
            .env("DMLC_ROLE", role)
            .envs(self.vars.iter().map(|(k, v)| (k, v)))
            .stdout(std::fs::File::create(&out).expect("stdout file"))
            .stderr(std::fs::File::create(&err).expect("stderr file"));
        if let Some(r) = rank {
            c.env("FALCON_RANK", r.to_string());
        }
        let child = c.spawn().expect("spawn role");
        OUTPUT.lock().unwrap().insert(child.id(), (out, err));
        child
    }

    /// Where the job's processes write (beside `dir`, which a test may replace by a file);
    /// the test process's id keeps test binaries run side by side apart.
    fn logs(&self) -> PathBuf {
        std::env::temp_dir().join(format!("falcon-logs-{}-{}", std::process::id(), self.port))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        // A failing test keeps its processes' output to look at.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(self.logs());
        }
    }
}

pub fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    None
}

/// Waits for `child` (started by [`Job::start`]) to end successfully; returns its stdout and
/// stderr.
pub fn succeeds(mut child: Child, what: &str, limit: Duration) -> (String, String) {
    let paths = OUTPUT.lock().unwrap().get(&child.id()).cloned();
    let status = wait_for(&mut child, limit);
    let _ = child.wait();
    let (stdout, stderr) = read_output(paths);
    assert!(
        status.is_some_and(|s| s.success()),
        "{what} failed ({status:?}):\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

/// The number after `key` in `text` (first occurrence).
pub fn number_after(text: &str, key: &str) -> Option<u64> {
    let i = text.find(key)? + key.len();
    text[i..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The first line of `text` containing `needle`.
pub fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    text.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"))
}

/// Kills `child` outright (SIGKILL) once its checkpoint file exists.
pub fn kill_after_checkpoint(child: &mut Child, ckpt: &std::path::Path) {
    let start = Instant::now();
    while !ckpt.exists() {
        if start.elapsed() > Duration::from_secs(60) || child.try_wait().unwrap().is_some() {
            let ended = child.try_wait().unwrap();
            let _ = child.kill();
            let (out, err) = output_of(child);
            panic!(
                "no checkpoint at {} after {:?} (the server {}):\n{out}\n{err}",
                ckpt.display(),
                start.elapsed(),
                ended.map_or("still ran".to_string(), |s| format!("ended: {s}"))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Let a few more updates land after the checkpoint: some are then lost.
    std::thread::sleep(Duration::from_millis(400));
    assert!(child.try_wait().unwrap().is_none(), "still running");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The value after `first parameter ` in a server's shard line (`server R: shard S first
/// parameter X, …`).
pub fn first_parameter(line: &str) -> f64 {
    line.split("first parameter ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no first parameter in: {line}"))
}
