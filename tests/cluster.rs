//! Multi-process clusters: every role a real process of the `falcon` binary.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");

fn local(policy: &str, medium: &str) -> Output {
    Command::new(FALCON)
        .args(["local", "--servers", "2", "--workers", "4", "--iters", "40"])
        .args(["--floats", "100000", "--shard-bytes", "65536"])
        .args(["--policy", policy, "--medium", medium])
        .output()
        .expect("run falcon local")
}

fn check(policy: &str, medium: &str) {
    let out = local(policy, medium);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{policy} over {medium} failed:\n{stdout}\n{stderr}"
    );
    for w in 0..4 {
        assert!(
            stdout.contains(&format!("worker {w}: 40 iterations")),
            "worker {w} missing:\n{stdout}"
        );
    }
    for s in 0..2 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("server {s}:")))
            .expect("server report");
        // 100000 floats in 64 KiB shards, spread over both servers: each gets gradients.
        assert!(!line.contains(" 0 gradients"), "server {s} idle: {line}");
    }
    assert!(stdout.contains("job finished"), "{stdout}");
    assert!(
        !stderr.contains("WARN"),
        "a clean run logs no warning:\n{stderr}"
    );
}

#[test]
fn bsp_over_shm() {
    check("bsp", "shm");
}
#[test]
fn bsp_over_tcp() {
    check("bsp", "tcp");
}
#[test]
fn asp_over_shm() {
    check("asp", "shm");
}
#[test]
fn asp_over_tcp() {
    check("asp", "tcp");
}
#[test]
fn ssp_over_shm() {
    check("ssp(2)", "shm");
}
#[test]
fn ssp_over_tcp() {
    check("ssp(2)", "tcp");
}
/// `syncopt(1,fold)` over real processes: no gradient is dropped; the late ones (the last of
/// each step's four, as the workers run alike) are folded, counted per worker in the servers'
/// reports, and every worker still makes its iterations.
#[test]
fn syncopt_with_folding_drops_nothing_and_folds_the_late_gradients() {
    let out = Command::new(FALCON)
        .args(["local", "--servers", "2", "--workers", "4", "--iters", "40"])
        .args(["--floats", "100000", "--shard-bytes", "65536"])
        .args(["--policy", "syncopt(1,fold)", "--medium", "shm"])
        .output()
        .expect("run falcon local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("job finished"), "{stdout}");
    let (mut folded, mut reports) = (0u64, 0);
    for line in stdout.lines().filter(|l| l.contains(" transfer offers, ")) {
        reports += 1;
        let tail = line.rsplit(", ").next().unwrap();
        let dropped = line.split(", ").find(|p| p.ends_with(" dropped")).unwrap();
        assert_eq!(dropped, "0 dropped", "{line}");
        folded += tail.trim_end_matches(" folded").parse::<u64>().expect(line);
    }
    assert_eq!(reports, 8, "4 workers on each of 2 servers:\n{stdout}");
    assert!(
        folded > 0,
        "the slowed worker's late gradients are folded:\n{stdout}"
    );
}

#[test]
fn syncopt_with_one_backup_counts_three_gradients_per_step() {
    let out = local("syncopt(1)", "shm");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in stdout
        .lines()
        .filter(|l| l.starts_with("server ") && l.contains(" updates,"))
    {
        // "server r: G gradients, U updates, …, D dropped gradients": with 4 workers and one
        // backup, each step of each shard counts 3 gradients. A backup's gradient counts for
        // the step of the parameters it was computed on, so it is dropped only when that
        // step is full: at most one drop per step, and every clock still makes its step.
        let num = |tag: &str| -> u64 {
            let before = &line[..line.find(tag).expect(tag)];
            before
                .rsplit(|c: char| !c.is_ascii_digit())
                .find(|w| !w.is_empty())
                .unwrap()
                .parse()
                .unwrap()
        };
        let (grads, updates, dropped) = (
            num(" gradients,"),
            num(" updates"),
            num(" dropped gradients"),
        );
        assert!(updates >= grads / 4, "fewer steps than clocks: {line}");
        assert!(dropped <= updates, "{line}");
        let counted = grads - dropped;
        assert!(
            (3 * updates..3 * updates + 3 * 4).contains(&counted),
            "each step counts 3 (a few left in steps the job ended before): {line}"
        );
    }
}
#[test]
fn dssp_over_shm() {
    check("dssp(2,6)", "shm");
}
#[test]
fn fluentps_sigmoid_over_shm() {
    check("fluentps(2,sigmoid)", "shm");
}
#[test]
fn epsp_over_shm() {
    check("epsp", "shm");
}
#[test]
fn epsp_over_tcp() {
    check("epsp(2,no-transfer)", "tcp");
}
#[test]
fn flexrr_over_shm() {
    check("flexrr", "shm");
}
#[test]
fn elasticbsp_over_shm() {
    check("elasticbsp(4)", "shm");
}
#[test]
fn elasticbsp_over_tcp() {
    check("elasticbsp(4)", "tcp");
}

/// A free loopback port.
/// Parts of one push or pull for different servers in flight at once (one thread per
/// server, forced on whatever this host's cores): every gradient is applied once, every
/// server's shard reaches the exact BSP answer.
fn fan_out_is_exact(medium: &str) {
    bsp_is_exact(medium, &[("FALCON_FAN_OUT", "on")]);
}

/// [`bsp_is_exact`] with one push_pull per iteration: each worker's pulls of the two shards
/// all went through the servers (80), but for the first and the last (4, lock-free).
fn push_pull_is_exact(medium: &str, env: &[(&str, &str)]) {
    let mut env = env.to_vec();
    env.push(("FALCON_LOOP", "push-pull"));
    let stdout = bsp_is_exact(medium, &env);
    for w in 0..4 {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("worker {w}: 40 iterations"))
                    && l.contains("pulls 4 lock-free / 80 via the server")),
            "worker {w}:\n{stdout}"
        );
    }
}

/// `falcon local` with 2 servers and 4 workers under BSP, with `env`: every gradient is
/// applied once and every server's shard reaches the exact BSP answer. Returns its stdout.
fn bsp_is_exact(medium: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(FALCON)
        .args(["local", "--servers", "2", "--workers", "4", "--iters", "40"])
        .args(["--floats", "400000", "--policy", "bsp", "--medium", medium])
        .envs(env.iter().copied())
        .output()
        .expect("run falcon local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // 1.6 MB: one 800 KB slice on each server, above the fan-out's 256 KiB per server.
    assert!(
        stdout.contains("bytes per server [800000, 800000]"),
        "{stdout}"
    );
    for s in 0..2 {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("server {s}: 160 gradients, 40 updates,"))),
            "server {s}: every gradient once:\n{stdout}"
        );
        // BSP with the mean of targets 1..=4: every parameter ends at 2.5.
        assert!(
            stdout.contains(&format!("server {s}: shard {s} first parameter 2.500000, sequence numbers 160 = applied + 0 skipped")),
            "server {s}:\n{stdout}"
        );
    }
    assert!(stdout.contains("job finished"), "{stdout}");
    stdout.into_owned()
}

#[test]
fn per_server_parts_in_flight_at_once_over_tcp() {
    fan_out_is_exact("tcp");
}

#[test]
fn per_server_parts_in_flight_at_once_over_shm() {
    fan_out_is_exact("shm");
}

#[test]
fn push_pull_loops_reach_the_exact_bsp_answer_over_tcp() {
    // Each iteration one push_pull: every shard's pull right behind its push, parked by BSP
    // until the step is applied. Fanned out to both servers at once.
    push_pull_is_exact("tcp", &[("FALCON_FAN_OUT", "on")]);
}

#[test]
fn push_pull_loops_reach_the_exact_bsp_answer_over_shm() {
    push_pull_is_exact("shm", &[]);
}

#[test]
fn an_unknown_worker_loop_is_a_clear_error() {
    let p = port();
    let mut c = role("worker", p, 5, &[("FALCON_LOOP", "pipelined")]);
    let status = wait_for(&mut c, Duration::from_secs(30)).expect("exits at once");
    let out = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(
        err.contains("FALCON_LOOP=pipelined: the loop is pull-push (the default) or push-pull"),
        "{err}"
    );
}

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One role started the way a multi-host launcher would: nothing but environment variables,
/// with ps-lite's names.
fn role(role: &str, port: u16, iters: u64, extra: &[(&str, &str)]) -> Child {
    let mut c = Command::new(FALCON);
    c.arg("role")
        .env("DMLC_ROLE", role)
        .env("DMLC_PS_ROOT_URI", "127.0.0.1")
        .env("DMLC_PS_ROOT_PORT", port.to_string())
        .env("DMLC_NUM_SERVER", "1")
        .env("DMLC_NUM_WORKER", "2")
        .env("DMLC_NODE_HOST", "127.0.0.1")
        .env("FALCON_JOB", format!("envjob-{port}"))
        .env("FALCON_TOKEN", "t0ken")
        .env("FALCON_ITERS", iters.to_string())
        .env("FALCON_FLOATS", "50000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra {
        c.env(k, v);
    }
    c.spawn().expect("spawn role")
}

fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn a_job_starts_from_environment_variables_alone() {
    let p = port();
    let mut procs = vec![role("scheduler", p, 20, &[]), role("server", p, 20, &[])];
    procs.push(role("worker", p, 20, &[]));
    procs.push(role("worker", p, 20, &[]));
    for mut c in procs {
        let status = wait_for(&mut c, Duration::from_secs(60)).expect("finishes");
        let out = c.wait_with_output().unwrap();
        assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// The row-sparse workload of `falcon role` (the key-value loop the ps-lite benchmark runs),
/// rows drawn in each iteration or in sets before the loop: both workers finish every
/// iteration with the rows they asked for; too many rows drawn ahead is refused by name.
#[test]
fn the_rows_workload_runs_with_rows_drawn_in_the_loop_or_ahead() {
    for sets in ["0", "3"] {
        let p = port();
        let env = [
            ("FALCON_WORKLOAD", "rows"),
            ("FALCON_ROWS", "700"),
            ("FALCON_ROWS_SETS", sets),
        ];
        let mut procs = vec![role("scheduler", p, 30, &env), role("server", p, 30, &env)];
        procs.push(role("worker", p, 30, &env));
        procs.push(role("worker", p, 30, &env));
        let mut stdout = String::new();
        for mut c in procs {
            let status = wait_for(&mut c, Duration::from_secs(60)).expect("finishes");
            let out = c.wait_with_output().unwrap();
            assert!(
                status.success(),
                "sets {sets}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            stdout.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        for w in 0..2 {
            assert!(
                stdout
                    .lines()
                    .any(|l| l.starts_with(&format!("worker {w}: 30 iterations"))
                        && l.contains("700 rows pulled and pushed each")),
                "sets {sets}, worker {w}:\n{stdout}"
            );
        }
    }
    let p = port();
    let env = [
        ("FALCON_WORKLOAD", "rows"),
        ("FALCON_ROWS", "50000"),
        ("FALCON_ROWS_SETS", "3000"),
    ];
    let mut procs = vec![role("scheduler", p, 5, &env), role("server", p, 5, &env)];
    let mut worker = role("worker", p, 5, &env);
    let status = wait_for(&mut worker, Duration::from_secs(30)).expect("exits at once");
    let out = worker.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(
        err.contains("FALCON_ROWS_SETS=3000 sets of FALCON_ROWS=50000 rows: at most 2^27 rows"),
        "{err}"
    );
    for c in &mut procs {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[test]
fn a_dead_server_is_a_prompt_typed_error_for_the_workers() {
    let p = port();
    let mut sched = role("scheduler", p, 100_000, &[]);
    let mut server = role("server", p, 100_000, &[]);
    let mut workers = vec![
        role("worker", p, 100_000, &[]),
        role("worker", p, 100_000, &[]),
    ];
    // Let the job get going, then kill the server outright.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        server.try_wait().unwrap().is_none(),
        "the server is still running"
    );
    server.kill().unwrap();
    server.wait().unwrap();
    let killed = Instant::now();
    for w in workers.iter_mut() {
        let status =
            wait_for(w, Duration::from_secs(20)).expect("a worker notices within a bounded time");
        assert!(!status.success(), "a worker whose server died must fail");
    }
    let noticed = killed.elapsed();
    for w in workers {
        let err = String::from_utf8_lossy(&w.wait_with_output().unwrap().stderr).into_owned();
        assert!(
            err.contains("server 0 is gone"),
            "the error names the dead server: {err}"
        );
    }
    let status = wait_for(&mut sched, Duration::from_secs(20)).expect("the scheduler ends too");
    assert!(!status.success());
    eprintln!("workers noticed the dead server within {noticed:?}");
}

/// Starts `world` processes with one launcher's variables only (no FALCON_ROLE): each is the
/// worker of its rank, rank 0 hosting the scheduler and the server; each says so.
fn launch(world: u32, vars: impl Fn(u32) -> Vec<(String, String)>) {
    let mut procs = Vec::new();
    for rank in 0..world {
        let mut c = Command::new(FALCON);
        c.arg("role")
            .env("FALCON_JOB", format!("launcher-{}", std::process::id()))
            .env("FALCON_ITERS", "15")
            .env("FALCON_FLOATS", "20000")
            .env("FALCON_NODE_HOST", "127.0.0.1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in vars(rank) {
            c.env(k, v);
        }
        procs.push(c.spawn().expect("spawn"));
    }
    for (rank, mut c) in procs.into_iter().enumerate() {
        let status = wait_for(&mut c, Duration::from_secs(60)).expect("finishes");
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            text.contains(&format!("worker {rank}: 15 iterations")),
            "rank {rank} is worker {rank}: {text}"
        );
        // Rank 0 hosts the scheduler and the server, which report at the job's end.
        assert_eq!(
            text.contains("scheduler: ") && text.contains("server 0: "),
            rank == 0,
            "rank {rank}: {text}"
        );
    }
}

#[test]
fn a_job_starts_from_torchrun_variables() {
    let p = port();
    launch(4, |rank| {
        vec![
            ("RANK".into(), rank.to_string()),
            ("WORLD_SIZE".into(), "4".into()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), p.to_string()),
        ]
    });
}

#[test]
fn a_job_starts_from_slurm_variables() {
    // Slurm names hosts, not addresses, and no port: "localhost" resolves; the port is
    // falcon's default unless FALCON_SCHEDULER_PORT is given (it is here, to run in parallel).
    let p = port();
    launch(4, |rank| {
        vec![
            ("SLURM_PROCID".into(), rank.to_string()),
            ("SLURM_NTASKS".into(), "4".into()),
            ("SLURM_NODELIST".into(), "localhost".into()),
            ("FALCON_SCHEDULER_PORT".into(), p.to_string()),
        ]
    });
}

/// The trainer as real processes: every worker a `falcon role` process training Fashion-MNIST
/// (the bundled sample) under EPSP with a slowed worker; tasks move between processes
/// through the scheduler and each is processed once.
#[test]
fn training_runs_as_separate_processes() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");
    let out = Command::new(FALCON)
        .args([
            "local",
            "--workload",
            "train",
            "--servers",
            "2",
            "--workers",
            "3",
        ])
        .args([
            "--iters",
            "30",
            "--policy",
            "epsp(0,fixed)",
            "--data",
            sample,
        ])
        .env("FALCON_HETERO", "2:h=0.2")
        .output()
        .expect("run falcon local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let mut given = 0;
    let mut helped = 0;
    let mut own = 0;
    for w in 0..3 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("worker {w} [")))
            .unwrap_or_else(|| panic!("worker {w} missing:\n{stdout}"));
        assert!(line.contains(": 30 iterations"), "{line}");
        let num = |tag: &str| -> u64 {
            let rest = &line[line.find(tag).expect(tag) + tag.len()..];
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        own += num("tasks own ");
        given += num(" / given ");
        helped += num(" / helped ");
        let acc: f64 = line[line.find("test accuracy ").unwrap() + 14..]
            .split('%')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(acc > 40.0, "worker {w} learnt nothing: {line}");
    }
    assert_eq!(own + helped, 3 * 30 * 4, "every task once:\n{stdout}");
    assert_eq!(given, helped, "{stdout}");
    assert!(stdout.contains("[h=0.2]"), "{stdout}");
}

#[test]
fn a_killed_worker_leaves_the_job_and_the_others_finish() {
    // SSP(2): without the dead worker leaving every policy's minimum clock, the survivors
    // would wait for it forever.
    let p = port();
    let extra = [("DMLC_NUM_WORKER", "3"), ("FALCON_POLICY", "ssp(2)")];
    // Long enough that the victim is still at work when it is killed: an optimized build
    // runs the job about ten times as fast.
    let iters = if cfg!(debug_assertions) { 1500 } else { 15_000 };
    let mut sched = role("scheduler", p, iters, &extra);
    let mut server = role("server", p, iters, &extra);
    let mut workers: Vec<Child> = (0..3).map(|_| role("worker", p, iters, &extra)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut victim = workers.pop().unwrap();
    assert!(victim.try_wait().unwrap().is_none(), "still running");
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed = Instant::now();
    for mut w in workers {
        let status = wait_for(&mut w, Duration::from_secs(60)).expect("the survivors finish");
        let out = w.wait_with_output().unwrap();
        assert!(
            status.success(),
            "a survivor failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("survivors finished {:?} after the kill", killed.elapsed());
    for c in [&mut server, &mut sched] {
        let status = wait_for(c, Duration::from_secs(30)).expect("the job ends");
        assert!(status.success());
    }
    let log = String::from_utf8_lossy(&sched.wait_with_output().unwrap().stderr).into_owned();
    assert!(
        log.contains("scheduler: worker ") && log.contains(" left: ") && log.contains("peer died"),
        "the scheduler says who left and why: {log}"
    );
}

#[test]
fn a_worker_lost_for_good_under_bsp_is_said_on_every_rank_and_fails_the_job() {
    let p = port();
    // The count workload: the synthetic one checks that BSP reached its mean, which it
    // cannot without a worker.
    let extra = [
        ("DMLC_NUM_WORKER", "3"),
        ("FALCON_POLICY", "bsp"),
        ("FALCON_WORKLOAD", "count"),
    ];
    let iters = if cfg!(debug_assertions) { 1500 } else { 15_000 };
    let mut sched = role("scheduler", p, iters, &extra);
    let mut server = role("server", p, iters, &extra);
    let ranks = ["0", "1", "2"];
    let mut workers: Vec<Child> = ranks
        .iter()
        .map(|r| {
            let mut e = extra.to_vec();
            e.push(("FALCON_RANK", r));
            role("worker", p, iters, &e)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut victim = workers.pop().unwrap();
    assert!(victim.try_wait().unwrap().is_none(), "still running");
    victim.kill().unwrap();
    victim.wait().unwrap();
    // The survivors finish, and say that a worker died.
    for mut w in workers {
        let status = wait_for(&mut w, Duration::from_secs(60)).expect("the survivors finish");
        let out = w.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(status.success(), "a survivor failed: {err}");
        assert!(
            err.contains("worker 2 died; the job goes on without it"),
            "a survivor is told: {err}"
        );
    }
    // The server ends well, naming the worker lost.
    let status = wait_for(&mut server, Duration::from_secs(30)).expect("the server ends");
    let out = server.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(status.success(), "{text}");
    assert!(
        text.contains("server 0: workers dead: [2]; rejoined: []; lost for good: [2]"),
        "{text}"
    );
    // The scheduler names it too, and fails the job: BSP's steps went on without it.
    let status = wait_for(&mut sched, Duration::from_secs(30)).expect("the scheduler ends");
    let out = sched.wait_with_output().unwrap();
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(status.code(), Some(1), "{text}{err}");
    assert!(
        text.contains("dead: [worker 2]; rejoined: []")
            && text.contains("lost for good: [worker 2]"),
        "{text}"
    );
    assert!(
        err.contains("worker(s) 2 died and never came back"),
        "the scheduler says why the job failed: {err}"
    );
}

#[test]
fn workers_whose_scheduler_died_are_told_it_is_gone() {
    let p = port();
    let extra = [("DMLC_NUM_WORKER", "2"), ("FALCON_POLICY", "ssp(2)")];
    let iters = if cfg!(debug_assertions) { 3000 } else { 30_000 };
    let mut sched = role("scheduler", p, iters, &extra);
    let mut server = role("server", p, iters, &extra);
    let workers: Vec<Child> = (0..2).map(|_| role("worker", p, iters, &extra)).collect();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(sched.try_wait().unwrap().is_none(), "still running");
    sched.kill().unwrap();
    sched.wait().unwrap();
    let killed = Instant::now();
    for mut w in workers {
        let status = wait_for(&mut w, Duration::from_secs(60)).expect("the workers end");
        let out = w.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!status.success(), "{err}");
        assert!(
            err.contains("the scheduler is gone, and the job with it")
                && !err.contains("can rejoin"),
            "a worker is told the scheduler is gone, not to rejoin: {err}"
        );
    }
    eprintln!(
        "the workers ended {:?} after the scheduler's death",
        killed.elapsed()
    );
    let _ = server.kill();
    let _ = server.wait();
}

/// Runs `falcon train` (BSP, uniform workers, the bundled sample, tcp) with `args`, writing
/// its report under `out`; returns its stdout and the report's JSON text.
fn train_bsp(args: &[&str], out: &std::path::Path) -> (String, String) {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");
    let o = Command::new(FALCON)
        .args(["train", "--quiet", "--uniform", "--policy", "bsp"])
        .args(args)
        .args(["--data", sample, "--medium", "tcp", "--out"])
        .arg(out)
        .output()
        .expect("run falcon train");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let json = std::fs::read_to_string(out.join("bsp.json")).expect("the JSON report");
    (stdout, json)
}

/// A top-level field of a JSON report, as text (quotes trimmed).
fn report_field(json: &str, name: &str) -> String {
    let at = json.find(&format!("\"{name}\": ")).expect(name) + name.len() + 4;
    json[at..]
        .split([',', '\n'])
        .next()
        .unwrap()
        .trim_matches('"')
        .to_string()
}

#[test]
fn falcon_train_runs_the_servers_optimizer_it_is_given() {
    // Same job, same seed, at a small rate: momentum 0.9 moves about ten times as far per
    // step once it has built up, so after 40 iterations its loss is clearly the lower.
    let run = |optimizer: &str| -> (String, f64) {
        let out = std::env::temp_dir().join(format!(
            "falcon-optimizer-{}-{}",
            optimizer.replace(['(', ')', '.'], "_"),
            std::process::id()
        ));
        let (stdout, json) = train_bsp(
            &[
                "--workers",
                "2",
                "--servers",
                "1",
                "--iters",
                "40",
                "--lr",
                "0.005",
                "--aggregate",
                "mean",
                "--optimizer",
                optimizer,
            ],
            &out,
        );
        assert_eq!(report_field(&json, "optimizer"), optimizer, "{json}");
        assert_eq!(report_field(&json, "aggregate"), "Mean", "{json}");
        assert!(
            stdout.contains(&format!("{optimizer} at lr 0.005 (mean of a step)")),
            "{stdout}"
        );
        let _ = std::fs::remove_dir_all(&out);
        (stdout, report_field(&json, "final_loss").parse().unwrap())
    };
    let (_, sgd) = run("sgd");
    let (out, momentum) = run("momentum(0.9)");
    assert!(
        momentum < 0.9 * sgd,
        "momentum's loss {momentum:.3} is not clearly below SGD's {sgd:.3}:\n{out}"
    );
}

#[test]
fn a_servers_learning_rate_decays_in_steps_when_asked() {
    // The counting workload: every gradient is −1 at rate 1/8, so the values add up the
    // rates applied. 20 updates, halved after 10: 10 × 0.125 + 10 × 0.0625.
    let p = port();
    let extra = [
        ("DMLC_NUM_WORKER", "1"),
        ("FALCON_WORKLOAD", "count"),
        ("FALCON_FLOATS", "64"),
        ("FALCON_LR_DECAY", "10:0.5"),
    ];
    let children: Vec<Child> = ["scheduler", "server", "worker"]
        .into_iter()
        .map(|r| role(r, p, 20, &extra))
        .collect();
    let mut outs = Vec::new();
    for mut c in children {
        let status = wait_for(&mut c, Duration::from_secs(60)).expect("the job ends");
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(status.success(), "{text}");
        outs.push(text);
    }
    let line = outs[1]
        .lines()
        .find(|l| l.contains("first parameter"))
        .unwrap_or_else(|| panic!("{}", outs[1]));
    let first = common::first_parameter(line);
    assert!((first - 1.875).abs() < 1e-5, "{line}");
}

#[test]
fn falcon_train_saves_the_trained_model_for_numpy() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");
    let base = std::env::temp_dir().join(format!("falcon-save-{}", std::process::id()));
    let (out, saved) = (base.join("out"), base.join("models"));
    let saved_arg = saved.to_str().unwrap();
    let (stdout, json) = train_bsp(
        &[
            "--workers",
            "2",
            "--servers",
            "2",
            "--iters",
            "20",
            "--save",
            saved_arg,
        ],
        &out,
    );
    assert!(stdout.contains("model saved: "), "{stdout}");
    // NumPy's format 1.0: magic, version, header length, a header dict, float32 data.
    let npy = std::fs::read(saved.join("bsp.npy")).expect("the saved model");
    assert_eq!(&npy[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([npy[8], npy[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0, "the data starts 64-byte aligned");
    let header = std::str::from_utf8(&npy[10..10 + hlen]).unwrap();
    let spec = std::fs::read_to_string(saved.join("bsp.model")).unwrap();
    let spec: falcon_trainer::model::ModelSpec = spec.trim().parse().unwrap();
    let model = spec.build().unwrap();
    let n = model.num_params();
    assert!(
        header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (")
            && header.contains(&format!("({n},)"))
            && header.ends_with('\n'),
        "{header:?}"
    );
    let values: Vec<f32> = npy[10 + hlen..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(values.len(), n);
    // They are the trained model: evaluated here, the report's final accuracy to the bit.
    let data = falcon_trainer::data::Dataset::load(std::path::Path::new(sample)).unwrap();
    let (acc, _) = falcon_trainer::train::evaluate(&*model, &values, &data.test, 0).unwrap();
    let reported: f64 = report_field(&json, "final_accuracy").parse().unwrap();
    assert_eq!(
        acc, reported,
        "the saved values are the ones the report evaluated"
    );
    assert!(acc > 0.5, "trained: {acc}");
    let _ = std::fs::remove_dir_all(&base);
}

/// `GET /metrics` from `addr`; `None` while nothing listens there.
fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: falcon\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    c.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The value of the sample `series` (name and labels) in a scrape.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn the_scheduler_serves_the_jobs_metrics_while_it_runs() {
    let (p, addr) = (port(), format!("127.0.0.1:{}", port()));
    let extra = [
        ("FALCON_METRICS_ADDR", addr.as_str()),
        ("FALCON_HEARTBEAT_MS", "100"),
        ("FALCON_POLICY", "ssp(2)"),
    ];
    let mut procs = vec![
        role("scheduler", p, 1_000_000, &extra),
        role("server", p, 1_000_000, &extra),
        role("worker", p, 1_000_000, &extra),
        role("worker", p, 1_000_000, &extra),
    ];
    let iterations = |t: &str, w: u32| {
        sample(
            t,
            &format!("falcon_worker_iterations_total{{worker=\"{w}\"}}"),
        )
        .unwrap_or(0.0)
    };
    let start = Instant::now();
    let mut first = None;
    let mut last = String::new();
    while start.elapsed() < Duration::from_secs(60) {
        if let Some(t) = scrape(&addr) {
            let moving = iterations(&t, 0) > 5.0
                && iterations(&t, 1) > 5.0
                && sample(&t, "falcon_server_bytes_in_total{server=\"0\"}").unwrap_or(0.0) > 0.0
                && sample(&t, "falcon_server_gradients_total{server=\"0\"}").unwrap_or(0.0) > 0.0;
            last = t;
            if moving {
                first = Some(last.clone());
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let Some(first) = first else {
        for c in &mut procs {
            let _ = c.kill();
        }
        panic!("no scrape showed the job moving within 60 s; the last:\n{last}");
    };
    assert!(first.starts_with("HTTP/1.1 200 OK"), "{first}");
    for series in [
        "falcon_up{role=\"worker\",rank=\"0\"} 1",
        "falcon_up{role=\"server\",rank=\"0\"} 1",
        "# TYPE falcon_worker_blocked_seconds counter",
        "# TYPE falcon_server_parked_pulls gauge",
        "# EOF",
    ] {
        assert!(
            first.lines().any(|l| l == series),
            "{series:?} missing:\n{first}"
        );
    }
    // Counters only grow while the job runs.
    std::thread::sleep(Duration::from_millis(500));
    let later = scrape(&addr).expect("still served");
    assert!(
        iterations(&later, 0) > iterations(&first, 0),
        "{first}\n---\n{later}"
    );
    // One worker dies (whichever rank the scheduler gave it): the endpoint says so once the
    // scheduler has seen it go, and the other is still up.
    procs[3].kill().unwrap();
    let start = Instant::now();
    let gone = loop {
        let t = scrape(&addr).expect("still served");
        let up = |w: u32| sample(&t, &format!("falcon_up{{role=\"worker\",rank=\"{w}\"}}"));
        if let (Some(a), Some(b)) = (up(0), up(1))
            && a + b == 1.0
        {
            break true;
        }
        if start.elapsed() > Duration::from_secs(30) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for c in &mut procs {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(gone, "worker 1 killed, still up in the metrics");
}

#[test]
fn falcon_role_reads_its_variables_from_the_config_files_role_section() {
    // The file gives every role the iteration count and the model's size; the environment
    // still wins where it says something, whichever name it uses: DMLC_NUM_WORKER=1 below
    // beats the file's `num_worker = 3` (which would have the job wait for two more workers).
    let dir = std::env::temp_dir().join(format!("falcon-role-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.toml");
    std::fs::write(
        &file,
        "[role]\niters = 7\nfalcon_floats = 1000\npolicy = \"ssp(1)\"\nnum_worker = 3\n",
    )
    .unwrap();
    let p = port();
    let start = |r: &str| {
        let mut c = Command::new(FALCON);
        c.arg("--config")
            .arg(&file)
            .arg("role")
            .env("DMLC_ROLE", r)
            .env("DMLC_PS_ROOT_URI", "127.0.0.1")
            .env("DMLC_PS_ROOT_PORT", p.to_string())
            .env("DMLC_NUM_SERVER", "1")
            .env("DMLC_NUM_WORKER", "1")
            .env("DMLC_NODE_HOST", "127.0.0.1")
            .env("FALCON_JOB", format!("cfgjob-{p}"))
            .env_remove("FALCON_ITERS")
            .env_remove("FALCON_FLOATS")
            .env_remove("FALCON_POLICY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn().unwrap()
    };
    let procs = vec![start("scheduler"), start("server"), start("worker")];
    let mut outs = Vec::new();
    for mut c in procs {
        let status = wait_for(&mut c, Duration::from_secs(60)).expect("finishes");
        let out = c.wait_with_output().unwrap();
        assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        outs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let _ = std::fs::remove_dir_all(&dir);
    let worker = &outs[2];
    assert!(worker.contains("worker 0: 7 iterations in"), "{worker}");
    // 1000 floats, from the file: 4000 bytes on the one server.
    assert!(outs[0].contains("bytes per server [4000]"), "{}", outs[0]);
    // A bad key is refused before anything starts, naming the file and line.
    let bad = std::env::temp_dir().join(format!("falcon-role-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, "[role]\niters = 7\nitres = 8\n").unwrap();
    let o = Command::new(FALCON)
        .arg("--config")
        .arg(&bad)
        .arg("role")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bad);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(":3: unknown key `itres` in [role]"), "{err}");
}

#[test]
fn a_stopped_train_run_resumes_from_its_checkpoints_and_refuses_another_jobs() {
    let root = std::env::temp_dir().join(format!("falcon-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (save, out) = (root.join("save"), root.join("out"));
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");
    // Long enough to outlast the servers' first checkpoint (they checkpoint every second)
    // by well over the time the kill waits after it, on a fast machine too.
    const ITERS: u64 = 6000;
    let iters = ITERS.to_string();
    let train = |extra: &[&str]| {
        let mut c = Command::new(FALCON);
        c.args(["train", "--quiet", "--uniform", "--policy", "bsp"])
            .args(["--iters", &iters])
            .args([
                "--model",
                "mlp:784-10",
                "--batch",
                "16",
                "--tasks",
                "2",
                "--medium",
                "tcp",
            ])
            .args(["--data", sample, "--out"])
            .arg(&out)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    // A run stopped hard once its servers have checkpointed.
    let mut first = train(&["--save", save.to_str().unwrap()]).spawn().unwrap();
    common::kill_after_checkpoint(&mut first, &save.join("checkpoints/bsp/server-1.ckpt"));
    // Goes on where the checkpoints are, to the end, and saves the model.
    let o = train(&["--resume", save.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let at: u64 = common::number_after(
        &stdout,
        "resumed from the servers' checkpoints at iteration ",
    )
    .unwrap_or_else(|| panic!("no resume line:\n{stdout}"));
    assert!(0 < at && at < ITERS, "resumed at {at}");
    let json = std::fs::read_to_string(out.join("bsp.json")).unwrap();
    assert_eq!(report_field(&json, "resumed_at"), at.to_string());
    let accuracy: f64 = report_field(&json, "final_accuracy").parse().unwrap();
    assert!(accuracy > 0.6, "final accuracy {accuracy}");
    let npy = std::fs::metadata(save.join("bsp.npy"))
        .expect("the saved model")
        .len();
    assert_eq!(npy, 128 + 4 * (784 * 10 + 10));
    // Another configuration's checkpoints are refused before anything starts.
    let o = train(&["--resume", save.to_str().unwrap(), "--workers", "3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("is a checkpoint of another job"),
        "{stderr}"
    );
    // Nothing to resume from: a clear usage error.
    let o = train(&["--resume", root.join("none").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no checkpoints there"));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_stopped_role_job_resumes_from_its_checkpoints() {
    let dir = std::env::temp_dir().join(format!("falcon-role-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The same job both times (its name, not the port, is what checkpoints belong to).
    let job = format!("resumed-{}", std::process::id());
    let ckpt = [
        ("FALCON_CHECKPOINT_DIR", dir.to_str().unwrap()),
        ("FALCON_CHECKPOINT_MS", "200"),
        ("FALCON_POLICY", "bsp"),
        ("FALCON_JOB", job.as_str()),
        ("FALCON_FLOATS", "1000"),
    ];
    let iters = 20_000;
    // Every process of the job stopped hard once the server has checkpointed.
    let p = port();
    let mut first = vec![
        role("scheduler", p, iters, &ckpt),
        role("worker", p, iters, &ckpt),
        role("worker", p, iters, &ckpt),
    ];
    let mut server = role("server", p, iters, &ckpt);
    common::kill_after_checkpoint(&mut server, &dir.join("server-0.ckpt"));
    for c in &mut first {
        let _ = c.kill();
        let _ = c.wait();
    }
    // Started again with FALCON_RESUME: the workers go on from the checkpoint's clock.
    let mut resumed = ckpt.to_vec();
    resumed.push(("FALCON_RESUME", "1"));
    let p = port();
    let procs = vec![
        role("scheduler", p, iters, &resumed),
        role("server", p, iters, &resumed),
        role("worker", p, iters, &resumed),
        role("worker", p, iters, &resumed),
    ];
    let mut outs = Vec::new();
    for mut c in procs {
        let status = wait_for(&mut c, Duration::from_secs(120)).expect("finishes");
        let out = c.wait_with_output().unwrap();
        assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        outs.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let _ = std::fs::remove_dir_all(&dir);
    for w in &outs[2..] {
        let summary = common::line_with(w, "iterations in");
        let ran = common::number_after(summary, ": ").unwrap_or(iters);
        assert!(
            0 < ran && ran < iters,
            "a resumed worker runs the rest only: {w}"
        );
        // The synthetic job still converges to the targets' mean (1.5).
        assert!(w.contains("w[0] = 1.5000"), "{w}");
    }
}
