//! The launch contract with processes of one's own as workers: `falcon role` runs the
//! scheduler and the server, and the workers are the `own_worker` example's program (not
//! `falcon role`), which reads its part with `falcon_engine::launch::Launch::from_env()` and
//! joins with `Worker::join`. Each worker checks every value it pulls; the test checks the
//! final values each reports, the server's, and that the job ends.
//!
//! The worker processes run the example's code: this test's own executable, started again
//! with `OWN_WORKER_CHILD` set, runs only [`worker_process`], which calls the example's
//! `main` (a test built alone, `cargo test --test own_worker`, has no example binary beside
//! it).

#[path = "../examples/own_worker.rs"]
mod own_worker;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");
const CHILD: &str = "OWN_WORKER_CHILD";

/// In a worker process: the example's program. Elsewhere: nothing.
#[test]
fn worker_process() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    if let Err(e) = own_worker::main() {
        panic!("own worker: {e}");
    }
}

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The processes of one job, killed if the test fails before they end.
struct Job(Vec<(String, Child)>);

impl Job {
    fn start(&mut self, what: &str, mut c: Command, vars: &[(String, String)]) {
        // Nothing of the test's own environment decides a role.
        for var in falcon_engine::launch::VARIABLES {
            c.env_remove(var);
        }
        c.envs(vars.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        self.0.push((what.to_string(), c.spawn().expect("spawn")));
    }

    fn falcon_role(&mut self, what: &str, vars: &[(String, String)]) {
        let mut c = Command::new(FALCON);
        c.arg("role");
        self.start(what, c, vars);
    }

    fn own_worker(&mut self, what: &str, vars: &[(String, String)]) {
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.args([
            "worker_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1");
        self.start(what, c, vars);
    }

    /// Waits for every process to end successfully; their standard outputs by name.
    fn finish(mut self) -> Vec<(String, String)> {
        let start = Instant::now();
        let mut outs = Vec::new();
        for (what, mut child) in std::mem::take(&mut self.0) {
            while child.try_wait().unwrap().is_none() {
                if start.elapsed() > Duration::from_secs(90) {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let out = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "{what} failed ({}):\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            outs.push((what, stdout));
        }
        outs
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn vars(list: &[(&str, String)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// The job ended with the values BSP gives: after 8 clocks of the mean of the gradients
/// −1·k and −2·k at rate 0.5, w[i] = 8 · 0.5 · 1.5 · k = 6k (k = i mod 4 + 1).
fn check(outs: &[(String, String)]) {
    check_workers(outs);
    let out = |name: &str| &outs.iter().find(|(w, _)| w == name).unwrap().1;
    let server = out("server");
    assert!(
        server.contains("server 0: 16 gradients"),
        "8 clocks of 2 workers:\n{server}"
    );
    assert!(
        server.contains("first parameter 6.000000"),
        "the server holds the final values:\n{server}"
    );
    assert!(out("scheduler").contains("scheduler: job done"));
}

/// Both workers (ranks 0 and 1) pulled what BSP gives at every clock.
fn check_workers(outs: &[(String, String)]) {
    let out = |name: &str| &outs.iter().find(|(w, _)| w == name).unwrap().1;
    let mut ranks = Vec::new();
    for w in ["worker a", "worker b"] {
        // After the test harness's "test worker_process ... " on the same line.
        let line = out(w)
            .lines()
            .find_map(|l| l.find("own worker ").map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("{w} says nothing:\n{}", out(w)));
        assert!(
            line.ends_with(
                " of 2: 8 iterations, every pull as expected; final w[0..4] = 6 12 18 24"
            ),
            "{line}"
        );
        ranks.push(
            line["own worker ".len()..]
                .split(' ')
                .next()
                .unwrap()
                .to_string(),
        );
    }
    ranks.sort();
    assert_eq!(ranks, ["0", "1"], "two workers, ranks 0 and 1");
}

fn common(p: u16, name: &str) -> Vec<(&'static str, String)> {
    vec![
        ("FALCON_JOB", format!("own-{name}-{p}")),
        ("FALCON_TOKEN", "t0ken".into()),
        ("FALCON_LR", "0.5".into()),
    ]
}

/// ps-lite's arrangement: DMLC_* variables only, the scheduler named by host and port.
#[test]
fn own_workers_join_a_job_from_ps_lite_variables() {
    let p = port();
    let role = |r: &str| {
        let mut v = common(p, "dmlc");
        v.extend([
            ("DMLC_ROLE", r.to_string()),
            ("DMLC_PS_ROOT_URI", "127.0.0.1".into()),
            ("DMLC_PS_ROOT_PORT", p.to_string()),
            ("DMLC_NUM_SERVER", "1".into()),
            ("DMLC_NUM_WORKER", "2".into()),
        ]);
        vars(&v)
    };
    let mut job = Job(Vec::new());
    job.falcon_role("scheduler", &role("scheduler"));
    job.falcon_role("server", &role("server"));
    job.own_worker("worker a", &role("worker"));
    job.own_worker("worker b", &role("worker"));
    check(&job.finish());
}

/// torchrun's arrangement: global ranks 0 and 1 are one's own workers, rank 0 hosting the
/// scheduler and the server on threads; MASTER_ADDR a host name.
#[test]
fn own_workers_join_a_job_from_torchrun_variables() {
    let p = port();
    let rank = |r: u32| {
        let mut v = common(p, "torchrun");
        v.extend([
            ("RANK", r.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "localhost".into()),
            ("MASTER_PORT", p.to_string()),
        ]);
        vars(&v)
    };
    let mut job = Job(Vec::new());
    job.own_worker("worker a", &rank(0));
    job.own_worker("worker b", &rank(1));
    let outs = job.finish();
    check_workers(&outs);
    let a = &outs[0].1;
    assert!(a.contains("own worker 0 of 2"), "{a}");
    assert!(a.contains("hosted scheduler: job done"), "{a}");
    assert!(
        a.contains("hosted server 0: 16 gradients, first parameter 6.000000"),
        "{a}"
    );
    assert!(!outs[1].1.contains("hosted"), "rank 1 hosts nothing");
}

/// FALCON_SCHEDULER as plain HOST:PORT on every process, the scheduler's included (it
/// listens there); a host name for the others.
#[test]
fn own_workers_join_a_job_given_the_scheduler_as_host_and_port() {
    let p = port();
    let role = |r: &str, scheduler: String| {
        let mut v = common(p, "plain");
        v.extend([
            ("FALCON_ROLE", r.to_string()),
            ("FALCON_SCHEDULER", scheduler),
            ("FALCON_NUM_WORKER", "2".into()),
        ]);
        vars(&v)
    };
    let mut job = Job(Vec::new());
    job.falcon_role("scheduler", &role("scheduler", format!("127.0.0.1:{p}")));
    job.falcon_role("server", &role("server", format!("localhost:{p}")));
    job.own_worker("worker a", &role("worker", format!("localhost:{p}")));
    job.own_worker("worker b", &role("worker", format!("127.0.0.1:{p}")));
    check(&job.finish());
}
