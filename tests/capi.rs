//! The C ABI end to end, with real processes: the test builds libfalcon (the `falcon-capi`
//! package, in this test's profile), compiles the C programs of `examples/c/` against it with
//! gcc (`train.c` against libfalcon.so, `errors.c` against libfalcon.a), and runs them as
//! workers of jobs whose scheduler and servers are `falcon role` processes.
//!
//! - Two C workers train a tensor for a few clocks (one clock through async handles), each
//!   checking every value it pulls against the exact BSP values; the test checks what they
//!   print and that every process of the job ends successfully.
//! - The error paths: an unknown tensor, a wrong length, a bad clock, null pointers, a push
//!   after finishing, each a negative code with a readable message from
//!   `falcon_last_error()`; and a join of a scheduler that is not there, which fails within
//!   its short rendezvous timeout.
//!
//! gcc is required: without it these tests fail, saying so.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How long a whole job may take before its processes are killed and the test fails.
const JOB_LIMIT: Duration = Duration::from_secs(120);

/// The C compiler: `$CC`, else gcc.
fn cc() -> String {
    std::env::var("CC")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "gcc".into())
}

/// The directory where libfalcon.so and libfalcon.a are, built once per test process.
fn library() -> &'static Path {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match LIB.get_or_init(build_library) {
        Ok(dir) => dir,
        Err(e) => panic!("{e}"),
    }
}

/// Builds the `falcon-capi` package with cargo, in the profile and target directory this
/// test was built in (where the `falcon` binary is).
fn build_library() -> Result<PathBuf, String> {
    let out = Path::new(FALCON)
        .parent()
        .ok_or("the falcon binary has no directory")?
        .to_path_buf();
    let profile_dir = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("the profile directory has no name")?
        .to_string();
    let profile = match profile_dir.as_str() {
        "debug" => "dev".to_string(),
        p => p.to_string(),
    };
    let parent = out.parent().ok_or("no target directory")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "falcon-capi", "--profile", &profile])
        .arg("--manifest-path")
        .arg(Path::new(ROOT).join("Cargo.toml"));
    // target/<profile>, or target/<triple>/<profile> when built for an explicit target.
    if parent.join("CACHEDIR.TAG").exists() {
        cmd.env("CARGO_TARGET_DIR", parent);
    } else {
        let triple = parent
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or("no target triple")?;
        let target_dir = parent.parent().ok_or("no target directory")?;
        cmd.args(["--target", triple])
            .env("CARGO_TARGET_DIR", target_dir);
    }
    // Not the test run's jobserver: the build gets its own.
    for var in ["CARGO_MAKEFLAGS", "MAKEFLAGS", "MFLAGS"] {
        cmd.env_remove(var);
    }
    let done = cmd
        .output()
        .map_err(|e| format!("cannot run cargo to build falcon-capi: {e}"))?;
    if !done.status.success() {
        return Err(format!(
            "cargo build -p falcon-capi failed ({}):\n{}",
            done.status,
            String::from_utf8_lossy(&done.stderr)
        ));
    }
    for lib in ["libfalcon.so", "libfalcon.a"] {
        if !out.join(lib).exists() {
            return Err(format!(
                "cargo built falcon-capi but {lib} is not in {out:?}"
            ));
        }
    }
    Ok(out)
}

/// Compiles `examples/c/{name}.c` into an executable, against libfalcon.so (`shared`) or
/// libfalcon.a; warnings are errors. Once per test process (tests run in parallel, and an
/// executable being written cannot be started).
fn compile(name: &str, shared: bool) -> PathBuf {
    static BUILT: Mutex<Vec<(String, bool, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, _, exe)) = built.iter().find(|(n, s, _)| n == name && *s == shared) {
        return exe.clone();
    }
    let exe = compile_now(name, shared);
    built.push((name.to_string(), shared, exe.clone()));
    exe
}

fn compile_now(name: &str, shared: bool) -> PathBuf {
    let lib = library();
    let cc = cc();
    match Command::new(&cc).arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => panic!(
            "{cc} (a C compiler) is needed to compile examples/c/{name}.c for the C ABI tests, \
             and it does not run: install it (Debian: apt-get install gcc), or set CC"
        ),
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("capi");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(if shared {
        name.to_string()
    } else {
        format!("{name}-static")
    });
    let mut c = Command::new(&cc);
    c.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-O1",
        "-o",
    ])
    .arg(&exe)
    .arg("-I")
    .arg(Path::new(ROOT).join("capi/include"))
    .arg(Path::new(ROOT).join(format!("examples/c/{name}.c")));
    if shared {
        c.arg("-L").arg(lib).arg("-lfalcon");
        c.arg(format!("-Wl,-rpath,{}", lib.display()));
    } else {
        // What rustc names for a staticlib on Linux (`--print native-static-libs`).
        c.arg(lib.join("libfalcon.a")).args([
            "-lgcc_s",
            "-lutil",
            "-lrt",
            "-lpthread",
            "-lm",
            "-ldl",
            "-lc",
        ]);
    }
    let out = c.output().expect("run the C compiler");
    assert!(
        out.status.success(),
        "{cc} could not compile examples/c/{name}.c:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How a process ended: its status and what it printed.
struct Ended {
    what: String,
    ok: bool,
    status: String,
    stdout: String,
    stderr: String,
}

/// The processes of one job, killed if the test fails before they end.
struct Job {
    running: Vec<(String, Child)>,
}

impl Job {
    fn new() -> Job {
        Job {
            running: Vec::new(),
        }
    }

    /// Starts `program` with `args`, its launch variables `vars` only (nothing of the test's
    /// own environment decides a role).
    fn start(&mut self, what: &str, program: &Path, args: &[&str], vars: &[(&str, String)]) {
        let mut c = Command::new(program);
        c.args(args);
        for var in falcon_engine::launch::VARIABLES {
            c.env_remove(var);
        }
        c.envs(vars.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = c
            .spawn()
            .unwrap_or_else(|e| panic!("start {what} ({program:?}): {e}"));
        self.running.push((what.to_string(), child));
    }

    fn role(&mut self, what: &str, vars: &[(&str, String)]) {
        self.start(what, Path::new(FALCON), &["role"], vars);
    }

    /// Waits for every process to end (each on a thread of its own that drains its output,
    /// so none blocks on a full pipe); past `limit`, kills the ones left and fails.
    fn wait(mut self, limit: Duration) -> Vec<Ended> {
        let (tx, rx) = mpsc::channel();
        let mut pids = Vec::new();
        for (what, mut child) in std::mem::take(&mut self.running) {
            pids.push((what.clone(), child.id()));
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut stdout = String::new();
                let mut stderr = String::new();
                let mut err = child.stderr.take().unwrap();
                let drain = std::thread::spawn(move || {
                    let _ = err.read_to_string(&mut stderr);
                    stderr
                });
                let _ = child.stdout.take().unwrap().read_to_string(&mut stdout);
                let stderr = drain.join().unwrap_or_default();
                let status = child.wait().unwrap();
                let _ = tx.send(Ended {
                    what,
                    ok: status.success(),
                    status: status.to_string(),
                    stdout,
                    stderr,
                });
            });
        }
        drop(tx);
        let deadline = Instant::now() + limit;
        let mut ended: Vec<Ended> = Vec::new();
        while ended.len() < pids.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(e) => ended.push(e),
                Err(_) => {
                    let left: Vec<&(String, u32)> = pids
                        .iter()
                        .filter(|(w, _)| !ended.iter().any(|e| &e.what == w))
                        .collect();
                    for (_, pid) in &left {
                        kill(*pid);
                    }
                    let said: String = ended
                        .iter()
                        .map(|e| {
                            format!("--- {} ({}):\n{}{}", e.what, e.status, e.stdout, e.stderr)
                        })
                        .collect();
                    panic!(
                        "still running after {} s (killed): {:?}\n{said}",
                        limit.as_secs(),
                        left.iter().map(|(w, _)| w).collect::<Vec<_>>()
                    );
                }
            }
        }
        ended
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (_, c) in &mut self.running {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn kill(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// Every process ended successfully; their outputs by name.
fn all_ok(ended: &[Ended]) {
    for e in ended {
        assert!(
            e.ok,
            "{} failed ({}):\n{}\n{}",
            e.what, e.status, e.stdout, e.stderr
        );
    }
}

fn out<'a>(ended: &'a [Ended], what: &str) -> &'a Ended {
    ended
        .iter()
        .find(|e| e.what == what)
        .unwrap_or_else(|| panic!("no process named {what}"))
}

/// The line each C worker of a finished job prints, checked; their ranks.
fn check_workers(ended: &[Ended], lr: &str, finals: &str) {
    let mut ranks = Vec::new();
    for w in ["c worker a", "c worker b"] {
        let e = out(ended, w);
        let line = e
            .stdout
            .lines()
            .find(|l| l.starts_with("c worker "))
            .unwrap_or_else(|| panic!("{w} says nothing:\n{}\n{}", e.stdout, e.stderr));
        let want = format!(
            " of 2: 6 iterations at lr {lr}, every pull as expected; final w[0..4] = {finals}"
        );
        assert!(line.ends_with(&want), "{w}: {line}\nexpected …{want}");
        ranks.push(
            line["c worker ".len()..]
                .split(' ')
                .next()
                .unwrap()
                .to_string(),
        );
    }
    ranks.sort();
    assert_eq!(ranks, ["0", "1"], "two workers, ranks 0 and 1");
    assert!(
        out(ended, "scheduler")
            .stdout
            .contains("scheduler: job done"),
        "{}",
        out(ended, "scheduler").stdout
    );
}

/// Two C workers (train.c on libfalcon.so) and `falcon role` for the scheduler and two
/// servers, the scheduler given as HOST:PORT; the tensor cut into shards across both
/// servers. Rank 0 sets w0[i] = (i mod 8)/4; after 6 clocks of the mean of the gradients
/// −1·k and −2·k (k = i mod 4 + 1) at rate 0.5, w[i] = w0[i] + 6 · 0.5 · 1.5 · k.
#[test]
fn c_workers_train_a_job_of_falcon_roles() {
    let train = compile("train", true);
    let p = free_port();
    let vars = |role: &str| {
        vec![
            ("FALCON_ROLE", role.to_string()),
            ("FALCON_SCHEDULER", format!("127.0.0.1:{p}")),
            ("FALCON_NUM_SERVER", "2".into()),
            ("FALCON_NUM_WORKER", "2".into()),
            ("FALCON_JOB", format!("capi-{p}")),
            ("FALCON_TOKEN", "t0ken".into()),
            ("FALCON_LR", "0.5".into()),
            // 1000 floats in shards of at most 256: four shards on two servers.
            ("FALCON_MAX_SHARD_BYTES", "1024".into()),
        ]
    };
    let mut job = Job::new();
    job.role("scheduler", &vars("scheduler"));
    job.role("server a", &vars("server"));
    job.role("server b", &vars("server"));
    job.start("c worker a", &train, &[], &vars("worker"));
    job.start("c worker b", &train, &[], &vars("worker"));
    let ended = job.wait(JOB_LIMIT);
    all_ok(&ended);
    check_workers(&ended, "0.5", "4.5 9.25 14 18.75");
    for s in ["server a", "server b"] {
        let text = &out(&ended, s).stdout;
        assert!(
            text.contains(" gradients,") && !text.contains(" 0 gradients,"),
            "{s} received gradients:\n{text}"
        );
    }
}

/// ps-lite's variables (DMLC_*), one server, another learning rate: the C workers compute
/// what they expect with the rate the job announces (falcon_learning_rate).
#[test]
fn c_workers_join_from_ps_lite_variables() {
    let train = compile("train", true);
    let p = free_port();
    let vars = |role: &str| {
        vec![
            ("DMLC_ROLE", role.to_string()),
            ("DMLC_PS_ROOT_URI", "127.0.0.1".into()),
            ("DMLC_PS_ROOT_PORT", p.to_string()),
            ("DMLC_NUM_SERVER", "1".into()),
            ("DMLC_NUM_WORKER", "2".into()),
            ("FALCON_JOB", format!("capi-dmlc-{p}")),
            ("FALCON_TOKEN", "t0ken".into()),
            ("FALCON_LR", "0.25".into()),
        ]
    };
    let mut job = Job::new();
    job.role("scheduler", &vars("scheduler"));
    job.role("server", &vars("server"));
    job.start("c worker a", &train, &[], &vars("worker"));
    job.start("c worker b", &train, &[], &vars("worker"));
    let ended = job.wait(JOB_LIMIT);
    all_ok(&ended);
    // w[i] = w0[i] + 6 · 0.25 · 1.5 · k.
    check_workers(&ended, "0.25", "2.25 4.75 7.25 9.75");
    assert!(
        out(&ended, "server")
            .stdout
            .contains("first parameter 2.250000"),
        "the server holds the final values:\n{}",
        out(&ended, "server").stdout
    );
}

/// Each mistake through the C ABI (errors.c on libfalcon.a, a worker of a real job) is its
/// negative code with a readable message, and the worker trains on after them.
#[test]
fn c_errors_are_typed_codes_with_readable_messages() {
    let errors = compile("errors", false);
    let p = free_port();
    let vars = |role: &str| {
        vec![
            ("FALCON_ROLE", role.to_string()),
            ("FALCON_SCHEDULER", format!("127.0.0.1:{p}")),
            ("FALCON_NUM_WORKER", "1".into()),
            ("FALCON_JOB", format!("capi-errors-{p}")),
            ("FALCON_TOKEN", "t0ken".into()),
        ]
    };
    let mut job = Job::new();
    job.role("scheduler", &vars("scheduler"));
    job.role("server", &vars("server"));
    job.start("c errors", &errors, &["job"], &vars("worker"));
    let ended = job.wait(JOB_LIMIT);
    all_ok(&ended);
    let said = &out(&ended, "c errors").stdout;
    for line in [
        "push on a null worker: FALCON_ERR_NULL: the worker must not be NULL",
        "push to an unknown tensor: FALCON_ERR_UNKNOWN_TENSOR: unknown tensor \"nope\"",
        "push of the wrong length: FALCON_ERR_WRONG_LENGTH: tensor \"w\" has 8 floats; the buffer has 9",
        "push at a clock not the next: FALCON_ERR_BAD_CLOCK: clock 3 is not valid here: tensor \"w\" has 0 gradients pushed; the next push is clock 0",
        "pull from the future: FALCON_ERR_BAD_CLOCK: clock 1 is not valid here",
        "push of a null array: FALCON_ERR_NULL: the gradient must not be NULL",
        "pull into a null array: FALCON_ERR_NULL: the pull's destination must not be NULL",
        "wait on a null handle: FALCON_ERR_NULL: the handle must not be NULL",
        "a tensor name that is not UTF-8: FALCON_ERR_ARGUMENT: the tensor name is not UTF-8 text",
        "push after finishing: FALCON_ERR_CONFIG: invalid configuration: this worker has finished",
        "push of a row outside the table: FALCON_ERR_CONFIG: invalid configuration: row 4 of tensor \"w\": it has 4 rows of 2",
        "push of rows of a width that does not divide the tensor: FALCON_ERR_CONFIG: invalid configuration: tensor \"w\" of 8 floats cannot be rows of 3",
        "push of rows from a null array: FALCON_ERR_NULL: the gradients must not be NULL",
        "push-pull into a null array: FALCON_ERR_NULL: the pull's destination must not be NULL",
        "push-pull of the wrong length: FALCON_ERR_WRONG_LENGTH: tensor \"w\" has 8 floats; the buffer has 9",
        "push-pull at a clock not the next: FALCON_ERR_BAD_CLOCK: clock 5 is not valid here: tensor \"w\" has 2 gradients pushed; the next push is clock 2",
        "errors job: every error as expected (worker 0)",
    ] {
        assert!(
            said.lines().any(|l| l.starts_with(line)),
            "no line starting {line:?} in:\n{said}"
        );
    }
    assert!(
        !said.contains("{ ") && !said.contains("Some("),
        "Rust Debug output:\n{said}"
    );
}

/// A join of a scheduler that is not there, and of one that accepts connections but never
/// answers, fails within its rendezvous timeout (0.5 s here, the transport's handshake 0.3
/// s), as FALCON_ERR_PEER_GONE with a message saying where it tried; a join from an
/// environment that names no role, and bad join arguments, fail at once.
#[test]
fn c_join_of_an_unreachable_scheduler_fails_promptly() {
    let errors = compile("errors", false);
    // A port that nothing listens on any more.
    let p = free_port();
    // One whose connections the kernel accepts, and nobody answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = listener.local_addr().unwrap().to_string();
    let start = Instant::now();
    let mut job = Job::new();
    job.start(
        "c errors",
        &errors,
        &["unreachable", &format!("127.0.0.1:{p}"), &silent],
        &[
            ("FALCON_RENDEZVOUS_TIMEOUT_MS", "500".into()),
            ("FALCON_HANDSHAKE_TIMEOUT_MS", "300".into()),
        ],
    );
    let ended = job.wait(Duration::from_secs(30));
    let took = start.elapsed();
    all_ok(&ended);
    let said = &out(&ended, "c errors").stdout;
    for line in [
        "join from an environment with no role: FALCON_ERR_CONFIG: no role: set FALCON_ROLE",
        "join with a negative worker count: FALCON_ERR_ARGUMENT: workers = -2",
        "join with a scheduler address without a port: FALCON_ERR_CONFIG: FALCON_SCHEDULER=127.0.0.1: no port",
        "join a scheduler that is not there: FALCON_ERR_PEER_GONE: scheduler 0 is gone: unreachable at",
        "join a scheduler that never answers: FALCON_ERR_PEER_GONE: scheduler 0 is gone: unreachable at",
        "errors unreachable: every error as expected",
    ] {
        assert!(
            said.lines().any(|l| l.starts_with(line)),
            "no line starting {line:?} in:\n{said}"
        );
    }
    assert!(
        said.contains(&format!("127.0.0.1:{p} after "))
            && said.contains(&format!("{silent} after ")),
        "the messages name the addresses:\n{said}"
    );
    assert!(said.contains("handshake timed out"), "{said}");
    assert!(
        took < Duration::from_secs(15),
        "a 0.5 s rendezvous timeout took {took:?}"
    );
}
