//! `falcon local`: a cluster of role processes of this binary on this host (`falcon role`,
//! configured through the environment), watched until the job ends.
//!
//! The job ends when every role process has ended. It fails at once when one fails: the
//! others get SIGTERM, then SIGKILL after a short grace, and the failed role's error (its last
//! `falcon: error:` line) is the job's error. SIGINT, SIGTERM and SIGHUP sent to `falcon
//! local` are forwarded to the role processes; it exits (128 + the signal) once they are
//! gone. Each role also dies with `falcon local` should it be killed outright (its
//! parent-death signal, see [`crate::hygiene::die_with_parent`]).

use std::io::{BufRead, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use falcon_engine::sync::PolicySpec;
use falcon_transport::Medium;

use crate::checks::{self, Layout, TimeoutArgs};
use crate::hygiene::{self, Interrupts};

/// Options of `falcon local`.
#[derive(clap::Args, Clone)]
pub struct LocalArgs {
    /// Server processes.
    #[arg(long, default_value_t = 1, env = "FALCON_NUM_SERVER",
          value_parser = checks::at_least_one_u32)]
    servers: u32,
    /// Worker processes (2 by default, with 1 server: one process per core of a small host;
    /// `train` runs 4 worker threads in one process).
    #[arg(long, default_value_t = 2, env = "FALCON_NUM_WORKER",
          value_parser = checks::at_least_one_u32)]
    workers: u32,
    /// Synchronization policy: bsp, asp, ssp(N), dssp(L,U), syncopt(B|auto[,fold]),
    /// fluentps(N[,p=P|sigmoid|fastest-sigmoid]), epsp[(S[,fixed][,no-transfer])],
    /// flexrr[(S[,theta=T][,group=G])], elasticbsp[(R)].
    #[arg(long, default_value = "bsp", env = "FALCON_POLICY")]
    policy: String,
    /// Medium between processes: auto (shm on one host), shm, tcp, rdma.
    #[arg(long, default_value = "auto", env = "FALCON_MEDIUM", value_parser = checks::medium)]
    medium: Medium,
    /// Iterations each worker runs (at least 1).
    #[arg(long, default_value_t = 100, env = "FALCON_ITERS",
          value_parser = checks::at_least_one_u64)]
    iters: u64,
    /// Model size in f32 parameters.
    #[arg(long, default_value_t = 1 << 20, env = "FALCON_FLOATS",
          value_parser = checks::at_least_one_u64)]
    floats: u64,
    /// Learning rate of the server-side SGD (finite, > 0): per round for the synthetic
    /// workload (default 0.5; async policies apply each worker's gradient with lr /
    /// workers), per gradient for the trainer (default 0.05).
    #[arg(long, env = "FALCON_LR", value_parser = checks::learning_rate,
          allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Largest shard in bytes (tensors are cut into shards spread over the servers; at
    /// least 4, one float).
    #[arg(long, default_value_t = 4 << 20, env = "FALCON_MAX_SHARD_BYTES",
          value_parser = checks::shard_bytes)]
    shard_bytes: u64,
    /// Staleness scaling of asynchronously applied gradients: none, dynsgd, consgd(F).
    #[arg(long, default_value = "none", env = "FALCON_SCALE")]
    scale: String,
    /// What the workers run: synthetic (½‖w − target‖², exact answer under BSP) or train
    /// (the trainer on Fashion-MNIST, each worker a process; see FALCON_MODEL, FALCON_DATA,
    /// and FALCON_BATCH, FALCON_TASKS, FALCON_THREADS, FALCON_SEED).
    #[arg(long, default_value = "synthetic", value_parser = ["synthetic", "train"])]
    workload: String,
    /// With --workload train: the model.
    #[arg(long, default_value = "mlp:784-256-10", env = "FALCON_MODEL")]
    model: String,
    /// With --workload train: the dataset directory (default: Debian's, else the sample).
    #[arg(long, env = "FALCON_DATA")]
    data: Option<std::path::PathBuf>,
    /// With --workload train: heterogeneity of workers, RANKS:SPEC (RANKS: N, A-B or *;
    /// SPEC: h=0.25, gauss(5,2), episodes(10,3,4), contention(2), none); repeatable, or
    /// `;`-separated.
    #[arg(long, env = "FALCON_HETERO", value_delimiter = ';')]
    hetero: Vec<String>,
    /// Workers held to a CPU quota the kernel enforces, RANKS:CPUS[,...] (RANKS: N, A-B or
    /// *; CPUS > 0: 3:0.25 gives worker 3 a quarter of one CPU's time): each such worker
    /// process in a control group of its own (cgroup v1 `cpu` or v2 `cpu.max`), made and
    /// removed by falcon. Where cgroups are not writable, said so and skipped.
    #[arg(long, env = "FALCON_CPU_QUOTA", value_name = "RANKS:CPUS")]
    cpu_quota: Option<String>,
    /// With server checkpoints (FALCON_CHECKPOINT_DIR): how long the job waits for a dead
    /// server to restart from its checkpoint, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 60_000,
          env = "FALCON_RECOVERY_TIMEOUT_MS", value_parser = checks::timeout_ms)]
    recovery_timeout_ms: u64,
    #[command(flatten)]
    timeouts: TimeoutArgs,
}

/// Marks the line with which a scheduler started by `falcon local` announces its address.
pub const ANNOUNCE: &str = "falcon-scheduler-address: ";

/// After a role fails (or a signal is forwarded), how long the others get to end before
/// SIGKILL.
const GRACE: Duration = Duration::from_millis(1000);

/// How `falcon local` ended, when not well.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// A role process failed: the job's error is its error.
    #[error(
        "{role} failed ({status}){}; the job was stopped",
        match error {
            Some(e) => format!(": {e}"),
            None => " without a message".to_string(),
        }
    )]
    RoleFailed {
        /// The role and its rank, e.g. `worker 1`.
        role: String,
        /// How its process ended.
        status: ExitStatus,
        /// Its last `falcon: error:` line (else its last line on stderr).
        error: Option<String>,
    },
    /// A signal stopped the job.
    #[error("stopped by {name}: the job's {roles} role process(es) were stopped")]
    Interrupted {
        /// The signal's number.
        signal: i32,
        /// Its name.
        name: &'static str,
        /// Role processes there were.
        roles: usize,
    },
    /// A role process could not be started.
    #[error("cannot start {role}: {source}")]
    Spawn {
        /// The role.
        role: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The scheduler ended before it announced its address.
    #[error("the scheduler ended before announcing its address")]
    NoAnnouncement,
}

impl LocalError {
    /// The exit status of `falcon` for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            LocalError::Interrupted { signal, .. } => (128 + signal).clamp(1, 255) as u8,
            _ => 1,
        }
    }
}

/// What a role process last said on stderr.
#[derive(Default)]
struct Said {
    /// Its last `falcon: error: …` message.
    error: Option<String>,
    /// Its last non-empty line.
    last: Option<String>,
}

/// One role process and the thread forwarding its stderr.
struct Proc {
    name: String,
    child: Child,
    said: Arc<Mutex<Said>>,
    forward: Option<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

impl Proc {
    /// What it said, once its stderr is read to the end (it is, promptly, once the process
    /// has ended).
    fn error(&mut self) -> Option<String> {
        if let Some(h) = self.forward.take() {
            let start = Instant::now();
            while !h.is_finished() && start.elapsed() < Duration::from_millis(500) {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
        let said = self.said.lock().unwrap_or_else(|e| e.into_inner());
        said.error.clone().or_else(|| said.last.clone())
    }
}

/// The role processes of a job. Dropping it kills and reaps those still running, so that an
/// error in `falcon local` never leaves one behind.
#[derive(Default)]
struct Procs {
    procs: Vec<Proc>,
}

impl Procs {
    /// Starts a role process, its stderr forwarded to ours (and remembered).
    fn spawn(&mut self, name: String, mut cmd: Command) -> Result<&mut Proc, LocalError> {
        cmd.stderr(Stdio::piped())
            .env(hygiene::PARENT_PID_VAR, std::process::id().to_string());
        let mut child = cmd.spawn().map_err(|source| LocalError::Spawn {
            role: name.clone(),
            source,
        })?;
        let said = Arc::new(Mutex::new(Said::default()));
        let forward = match child.stderr.take() {
            Some(err) => {
                let said = said.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("falcon-stderr-{name}"))
                    .spawn(move || forward_stderr(err, &said));
                match spawned {
                    Ok(h) => Some(h),
                    Err(source) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Err(LocalError::Spawn { role: name, source });
                    }
                }
            }
            None => None,
        };
        self.procs.push(Proc {
            name,
            child,
            said,
            forward,
            status: None,
        });
        Ok(self.procs.last_mut().expect("just pushed"))
    }

    /// Notes the processes that ended; the first of them that failed, if any.
    fn reap(&mut self) -> Option<usize> {
        let mut failed = None;
        for (i, p) in self.procs.iter_mut().enumerate() {
            if p.status.is_some() {
                continue;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                p.status = Some(status);
                if !status.success() && failed.is_none() {
                    failed = Some(i);
                }
            }
        }
        failed
    }

    fn all_ended(&self) -> bool {
        self.procs.iter().all(|p| p.status.is_some())
    }

    /// Sends `signal` to every role process still running, waits up to [`GRACE`] for them
    /// to end, then kills (SIGKILL) and reaps the rest.
    fn stop(&mut self, signal: rustix::process::Signal) {
        for p in &mut self.procs {
            if p.status.is_none()
                && let Some(pid) = rustix::process::Pid::from_raw(p.child.id() as i32)
            {
                let _ = rustix::process::kill_process(pid, signal);
            }
        }
        let start = Instant::now();
        while start.elapsed() < GRACE {
            self.reap();
            if self.all_ended() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill_all();
    }

    /// Kills (SIGKILL) and reaps every role process still running.
    fn kill_all(&mut self) {
        for p in &mut self.procs {
            if p.status.is_none() {
                let _ = p.child.kill();
                p.status = p.child.wait().ok();
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Copies a role's stderr to ours line by line, remembering its last error message.
fn forward_stderr(err: std::process::ChildStderr, said: &Mutex<Said>) {
    let mut reader = std::io::BufReader::new(err);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        // Our stderr closed is no reason to stop reading theirs (they would block).
        let _ = std::io::stderr().lock().write_all(&line);
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end();
        if text.is_empty() {
            continue;
        }
        let mut said = said.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = text.strip_prefix("falcon: error: ") {
            said.error = Some(e.to_string());
        }
        said.last = Some(text.to_string());
    }
}

/// Runs `falcon local`.
pub fn local(a: LocalArgs) -> crate::Res {
    let timeouts = check_local(&a)?;
    let job = format!("local-{}", std::process::id());
    let token = format!(
        "{:016x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64
            ^ 0x5eed
    );
    outln!(
        "falcon: local cluster, {} server(s), {} worker(s), policy {}, medium {}, {} floats ({:.1} MiB), {} iterations",
        a.servers,
        a.workers,
        a.policy,
        a.medium.name(),
        a.floats,
        a.floats as f64 * 4.0 / (1 << 20) as f64,
        a.iters
    );
    let roles = Roles {
        exe: std::env::current_exe()?,
        job,
        token,
        a: &a,
        timeouts,
    };
    let command = |role: &str, rank: Option<u32>| roles.command(role, rank);
    // From here on, SIGINT and SIGTERM are forwarded to the role processes.
    let interrupts = Interrupts::catch()?;
    let mut procs = Procs::default();
    let start = Instant::now();
    // The scheduler binds a free port itself (no window in which another process could take
    // it) and announces its full address, which the other roles are given.
    let mut sched = command("scheduler", None);
    sched
        .env("FALCON_SCHEDULER_URI", "127.0.0.1")
        .env("FALCON_SCHEDULER_PORT", "0")
        .env("FALCON_ANNOUNCE", "1")
        .stdout(Stdio::piped());
    let scheduler = procs.spawn("scheduler".into(), sched)?;
    let out = scheduler
        .child
        .stdout
        .take()
        .ok_or(LocalError::NoAnnouncement)?;
    let (addr_tx, addr_rx) = mpsc::channel();
    let forward = std::thread::Builder::new()
        .name("falcon-scheduler-out".into())
        .spawn(move || forward_scheduler(out, &addr_tx))?;
    let addr = announced(&mut procs, &interrupts, &addr_rx)?;
    let quotas = match &a.cpu_quota {
        Some(q) => falcon_engine::quota::parse_quotas(q, a.workers)?,
        None => Vec::new(),
    };
    // The groups live until the job has ended (then they are empty and removed).
    let mut groups = Vec::new();
    let roles = (0..a.servers)
        .map(|r| ("server", r))
        .chain((0..a.workers).map(|r| ("worker", r)));
    for (role, r) in roles {
        if let Some(sig) = interrupts.received() {
            return Err(interrupted(&mut procs, sig).into());
        }
        let mut c = command(role, Some(r));
        c.env("FALCON_SCHEDULER", &addr);
        let pid = match procs.spawn(format!("{role} {r}"), c) {
            Ok(p) => p.child.id(),
            Err(e) => {
                procs.stop(rustix::process::Signal::TERM);
                return Err(e.into());
            }
        };
        if let (true, Some(Some(cpus))) = (role == "worker", quotas.get(r as usize)) {
            let name = format!("falcon-{}-worker{r}", std::process::id());
            match falcon_engine::quota::CpuQuota::new(&name, *cpus)
                .and_then(|q| q.add(pid).map(|()| q))
            {
                Ok(q) => {
                    outln!(
                        "falcon: worker {r} held to {cpus} CPUs ({})",
                        q.dir().display()
                    );
                    groups.push(q);
                }
                Err(e) => outln!("falcon: SKIPPED: worker {r}'s CPU quota: {e}"),
            }
        }
    }
    let watched = watch(&mut procs, &interrupts);
    drop(groups);
    watched?;
    let _ = forward.join();
    for p in &mut procs.procs {
        if let Some(h) = p.forward.take() {
            let _ = h.join();
        }
    }
    outln!(
        "falcon: job finished in {:.2} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// What every role process of a local job is started with.
struct Roles<'a> {
    exe: std::path::PathBuf,
    job: String,
    token: String,
    a: &'a LocalArgs,
    timeouts: falcon_trainer::job::Timeouts,
}

impl Roles<'_> {
    /// `falcon role` as `role` (of `rank`), configured from the job's settings.
    fn command(&self, role: &str, rank: Option<u32>) -> Command {
        let ms = |d: Duration| (d.as_millis() as u64).to_string();
        let mut c = Command::new(&self.exe);
        c.arg("role")
            .env("FALCON_ROLE", role)
            .env("FALCON_JOB", &self.job)
            .env("FALCON_TOKEN", &self.token)
            .env("FALCON_NUM_SERVER", self.a.servers.to_string())
            .env("FALCON_NUM_WORKER", self.a.workers.to_string())
            .env("FALCON_POLICY", &self.a.policy)
            .env("FALCON_MEDIUM", self.a.medium.name())
            .env("FALCON_ITERS", self.a.iters.to_string())
            .env("FALCON_FLOATS", self.a.floats.to_string())
            .env("FALCON_MAX_SHARD_BYTES", self.a.shard_bytes.to_string())
            .env("FALCON_SCALE", &self.a.scale)
            .env("FALCON_WORKLOAD", &self.a.workload)
            .env("FALCON_MODEL", &self.a.model)
            .env("FALCON_HETERO", self.a.hetero.join(";"))
            .env("FALCON_HEARTBEAT_MS", ms(self.timeouts.heartbeat))
            .env(
                "FALCON_SUSPICION_MS",
                self.timeouts.suspicion.map_or("0".into(), ms),
            )
            .env("FALCON_RENDEZVOUS_TIMEOUT_MS", ms(self.timeouts.rendezvous))
            .env("FALCON_OP_TIMEOUT_MS", ms(self.timeouts.op))
            .env("FALCON_HANDSHAKE_TIMEOUT_MS", ms(self.timeouts.handshake))
            .env(
                "FALCON_RECOVERY_TIMEOUT_MS",
                self.a.recovery_timeout_ms.to_string(),
            );
        if let Some(d) = &self.a.data {
            c.env("FALCON_DATA", d);
        }
        if let Some(lr) = self.a.lr {
            c.env("FALCON_LR", lr.to_string());
        }
        if let Some(r) = rank {
            c.env("FALCON_RANK", r.to_string());
        }
        c
    }
}

/// Everything `falcon local` checks before a process starts; the job's timeouts.
fn check_local(a: &LocalArgs) -> Result<falcon_trainer::job::Timeouts, Box<dyn std::error::Error>> {
    let policy: PolicySpec = checks::setting(a.policy.parse())?;
    checks::policy_fits(&policy, &a.policy, a.workers)?;
    let _: falcon_engine::update::ScaleSpec = checks::setting(a.scale.parse())?;
    let timeouts = a
        .timeouts
        .resolve(Some(falcon_engine::config::DEFAULT_SUSPICION))?;
    let train = a.workload == "train";
    if train {
        let model: falcon_trainer::model::ModelSpec = checks::setting(a.model.parse())?;
        checks::setting(model.build())?;
        // What the workers will read: FALCON_BATCH, FALCON_TASKS, FALCON_THREADS, …
        crate::train_cmd::trainer_env(a.workers)?;
    }
    // The heterogeneity's ranks must be workers of this job, and so must the quotas'.
    checks::setting(falcon_trainer::hetero::assign(a.workers, &a.hetero))?;
    if let Some(q) = &a.cpu_quota {
        checks::setting(falcon_engine::quota::parse_quotas(q, a.workers))?;
    }
    let threads = if train {
        checks::env_value(&["FALCON_THREADS"], 1, checks::at_least_one_u64)?
    } else {
        0
    };
    checks::check_limits(
        Layout::Processes,
        &format!(
            "falcon local with {} worker(s) and {} server(s)",
            a.workers, a.servers
        ),
        a.servers,
        a.workers,
        threads,
        a.medium,
    )?;

    Ok(timeouts)
}

/// Waits for the scheduler's announcement of its address (or its failure, or an interrupt).
fn announced(
    procs: &mut Procs,
    interrupts: &Interrupts,
    addr_rx: &mpsc::Receiver<String>,
) -> Result<String, Box<dyn std::error::Error>> {
    loop {
        if let Some(sig) = interrupts.received() {
            return Err(interrupted(procs, sig).into());
        }
        if let Some(i) = procs.reap() {
            return Err(failed(procs, i).into());
        }
        match addr_rx.recv_timeout(Duration::from_millis(20)) {
            Ok(addr) => return Ok(addr),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Its output ended without the announcement: it ended, or is ending.
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    if let Some(i) = procs.reap() {
                        return Err(failed(procs, i).into());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                return Err(LocalError::NoAnnouncement.into());
            }
        }
    }
}

/// Watches the role processes: the job ends when every one has; the first that fails (or
/// an interrupt) ends it.
fn watch(procs: &mut Procs, interrupts: &Interrupts) -> crate::Res {
    loop {
        let failure = procs.reap();
        // A role killed by the signal that reached us too (Ctrl-C reaches the whole process
        // group) is the signal's doing, not a failure.
        if let Some(sig) = interrupts.received() {
            return Err(interrupted(procs, sig).into());
        }
        if let Some(i) = failure {
            return Err(failed(procs, i).into());
        }
        if procs.all_ended() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A role failed: stop the others; its error is the job's. A role that ended because our
/// shared standard output closed (`falcon local | head`) ends the job quietly, as it would
/// have ended `falcon local` itself.
fn failed(procs: &mut Procs, i: usize) -> LocalError {
    procs.stop(rustix::process::Signal::TERM);
    if procs.procs[i].status.and_then(|s| s.code()) == Some(hygiene::EXIT_STDOUT_CLOSED) {
        std::process::exit(hygiene::EXIT_STDOUT_CLOSED);
    }
    let p = &mut procs.procs[i];
    LocalError::RoleFailed {
        role: p.name.clone(),
        status: p.status.expect("reaped"),
        error: p.error(),
    }
}

/// A signal came: forward it, wait for the role processes to end.
fn interrupted(procs: &mut Procs, sig: i32) -> LocalError {
    procs.stop(hygiene::rustix_signal(sig));
    LocalError::Interrupted {
        signal: sig,
        name: hygiene::signal_name(sig),
        roles: procs.procs.len(),
    }
}

/// Reads the scheduler's output: its announcement goes to `addr`, the rest to our stdout.
fn forward_scheduler(out: std::process::ChildStdout, addr: &mpsc::Sender<String>) {
    let mut lines = std::io::BufReader::new(out).lines();
    for l in lines.by_ref().map_while(Result::ok) {
        match l.strip_prefix(ANNOUNCE) {
            Some(a) => {
                let _ = addr.send(a.to_string());
                break;
            }
            None => outln!("{l}"),
        }
    }
    for l in lines.map_while(Result::ok) {
        outln!("{l}");
    }
}
