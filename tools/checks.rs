//! Checks of the settings before anything starts: each value on its own (clap value
//! parsers, so the flag, its environment variable and the configuration file are checked
//! alike), the values that only make sense together (a policy and the worker count, a
//! heterogeneity spec's ranks), and what the job needs of this machine (open files,
//! threads) against its limits.
//!
//! Every refusal says what is wrong and what is allowed.

use std::time::Duration;

use falcon_engine::checks::{Conflict, number};
use falcon_engine::sync::PolicySpec;
use falcon_transport::Medium;

// The values a role's environment holds are checked by the engine's launch contract
// (`falcon_engine::launch`); the flags, their variables and the configuration file use the
// same checks.
pub use falcon_engine::checks::{
    BadValue, at_least_one_u32, at_least_one_u64, at_least_one_usize, heartbeat_ms, learning_rate,
    shard_bytes, suspicion_ms, timeout_ms, whole,
};

/// A momentum: a number in [0, 1).
pub fn momentum(s: &str) -> Result<f32, BadValue> {
    let m: f32 = number(s, "a number")?;
    if (0.0..1.0).contains(&m) {
        Ok(m)
    } else {
        Err(BadValue::OutOfRange {
            what: "the momentum",
            allowed: "a number from 0 up to, not including, 1 (e.g. 0.9)",
            value: s.trim().to_string(),
        })
    }
}

/// An accuracy target: a fraction in (0, 1].
pub fn accuracy_target(s: &str) -> Result<f64, BadValue> {
    let t: f64 = number(s, "a number")?;
    if t > 0.0 && t <= 1.0 {
        Ok(t)
    } else {
        Err(BadValue::OutOfRange {
            what: "the accuracy target",
            allowed: "a fraction in (0, 1], e.g. 0.75 for 75 %",
            value: s.trim().to_string(),
        })
    }
}

/// A positive finite number (epochs).
pub fn positive(s: &str) -> Result<f64, BadValue> {
    let x: f64 = number(s, "a number")?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(BadValue::OutOfRange {
            what: "the value",
            allowed: "a finite number greater than 0",
            value: s.trim().to_string(),
        })
    }
}

/// A finite number ≥ 0 (a latency).
pub fn non_negative(s: &str) -> Result<f64, BadValue> {
    let x: f64 = number(s, "a number")?;
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(BadValue::OutOfRange {
            what: "the value",
            allowed: "a finite number ≥ 0",
            value: s.trim().to_string(),
        })
    }
}

/// A fraction in [0, 1].
pub fn fraction(s: &str) -> Result<f64, BadValue> {
    let x: f64 = number(s, "a number")?;
    if (0.0..=1.0).contains(&x) {
        Ok(x)
    } else {
        Err(BadValue::OutOfRange {
            what: "the fraction",
            allowed: "in [0, 1]",
            value: s.trim().to_string(),
        })
    }
}

/// A jitter: a fraction in [0, 1).
pub fn jitter(s: &str) -> Result<f64, BadValue> {
    let x: f64 = number(s, "a number")?;
    if (0.0..1.0).contains(&x) {
        Ok(x)
    } else {
        Err(BadValue::OutOfRange {
            what: "the jitter",
            allowed: "a fraction in [0, 1)",
            value: s.trim().to_string(),
        })
    }
}

/// The `[role]` section of the configuration file, as variables (see [`var`]).
static FILE_VARS: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();

/// Makes the configuration file's `[role]` settings visible to [`var`] (once, at start).
pub fn set_file_vars(vars: Vec<(String, String)>) {
    let _ = FILE_VARS.set(vars);
}

/// Variables that say the same thing (a variable and its aliases, and what launchers set in
/// their place): one set in the environment keeps the file's value for any of them out.
const SAME: &[&[&str]] = &[
    &["FALCON_NUM_SERVER", "DMLC_NUM_SERVER"],
    &[
        "FALCON_NUM_WORKER",
        "DMLC_NUM_WORKER",
        "WORLD_SIZE",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
    ],
    &[
        "FALCON_SCHEDULER",
        "FALCON_SCHEDULER_URI",
        "DMLC_PS_ROOT_URI",
        "MASTER_ADDR",
        "SLURM_NODELIST",
        "SLURM_JOB_NODELIST",
    ],
    &[
        "FALCON_SCHEDULER",
        "FALCON_SCHEDULER_PORT",
        "DMLC_PS_ROOT_PORT",
        "MASTER_PORT",
    ],
    &["FALCON_NODE_HOST", "DMLC_NODE_HOST"],
    &[
        "FALCON_RANK",
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ],
];

fn env_var(name: &str) -> Option<String> {
    std::env::var_os(name)
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.is_empty())
}

/// A variable of `falcon role`: the environment's value (unless empty), else the
/// configuration file's `[role]` setting for it, unless the environment sets another name
/// for the same thing (the environment wins over the file whatever name it uses).
pub fn var(name: &str) -> Option<String> {
    if let Some(v) = env_var(name) {
        return Some(v);
    }
    let said_otherwise = SAME
        .iter()
        .filter(|group| group.contains(&name))
        .flat_map(|group| group.iter())
        .any(|other| env_var(other).is_some());
    if said_otherwise {
        return None;
    }
    FILE_VARS
        .get()?
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// The value of the first of `names` that is set (and not empty), read with `parse`; none
/// set: `default`. A value `parse` refuses is an [`Invalid::Env`] naming the variable.
pub fn env_value<T, E: std::fmt::Display>(
    names: &[&'static str],
    default: T,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<T, Invalid> {
    for &var in names {
        if let Some(value) = self::var(var) {
            return parse(&value).map_err(|e| Invalid::Env {
                var,
                value,
                why: e.to_string(),
            });
        }
    }
    Ok(default)
}

/// A medium, parsed.
pub fn medium(s: &str) -> Result<Medium, falcon_transport::Error> {
    s.parse()
}

/// Values that are wrong together, or a job this machine cannot hold.
#[derive(Debug, thiserror::Error)]
pub enum Invalid {
    /// Values wrong together: a policy and the workers, a suspicion timeout and the
    /// heartbeat.
    #[error(transparent)]
    Conflict(#[from] Conflict),
    /// A setting refused by its parser (a policy, a model, a heterogeneity spec…), before
    /// anything started: the parser's message.
    #[error("{0}")]
    Setting(String),
    /// A list of configurations with none in it.
    #[error("{flag}: no configuration given (e.g. {flag} {example})")]
    NoConfiguration {
        /// The flag.
        flag: &'static str,
        /// An example of its value.
        example: &'static str,
    },
    /// More tasks per iteration than examples.
    #[error(
        "{tasks} tasks per iteration cut a batch of {batch} example(s): tasks must be between \
         1 and the batch"
    )]
    TasksAboveBatch {
        /// Tasks.
        tasks: u64,
        /// Batch.
        batch: u64,
    },
    /// An environment variable a role reads has a value it cannot use.
    #[error("{var}={value}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what is allowed.
        why: String,
    },
    /// More than the machine's limits allow.
    #[error("{0}")]
    Limits(Box<Limits>),
}

/// A parser's refusal as a setting refused before anything started.
pub fn setting<T, E: std::fmt::Display>(r: Result<T, E>) -> Result<T, Invalid> {
    r.map_err(|e| Invalid::Setting(e.to_string()))
}

/// Sync-opt's backups must be fewer than the workers (the engine would otherwise quietly
/// use workers − 1).
pub fn policy_fits(policy: &PolicySpec, text: &str, workers: u32) -> Result<(), Invalid> {
    Ok(falcon_engine::checks::policy_fits(policy, text, workers)?)
}

/// Tasks per iteration must be between 1 and the batch.
pub fn tasks_fit(tasks: u64, batch: u64) -> Result<(), Invalid> {
    if tasks == 0 || tasks > batch {
        return Err(Invalid::TasksAboveBatch { tasks, batch });
    }
    Ok(())
}

/// The heartbeat interval and the roles' timeouts, for `train` and `local` (`falcon role`
/// reads the same variables).
#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct TimeoutArgs {
    /// Heartbeat interval of every role, in milliseconds (at least 10).
    #[arg(long, value_name = "MS", env = "FALCON_HEARTBEAT_MS",
          default_value_t = default_ms(|d| d.heartbeat), value_parser = heartbeat_ms)]
    pub heartbeat_ms: u64,
    /// How long the scheduler waits for a silent role before it declares it dead, in
    /// milliseconds; 0: never. Default: 15000 for `local` (roles are processes: a hung one is
    /// evicted); never for `train`, whose roles are threads of one process (a role cannot die
    /// alone there, its error or panic ends the job at once, and a busy machine could delay
    /// healthy roles' heartbeats past any timeout).
    #[arg(long, value_name = "MS", env = "FALCON_SUSPICION_MS", value_parser = suspicion_ms)]
    pub suspicion_ms: Option<u64>,
    /// How long the roles may take to meet at the scheduler, in milliseconds.
    #[arg(long, value_name = "MS", env = "FALCON_RENDEZVOUS_TIMEOUT_MS",
          default_value_t = default_ms(|d| d.rendezvous_timeout), value_parser = timeout_ms)]
    pub rendezvous_timeout_ms: u64,
    /// Deadline of one transport operation (a read's answer, a full ring, a stuck socket),
    /// in milliseconds.
    #[arg(long, value_name = "MS", env = "FALCON_OP_TIMEOUT_MS",
          default_value_t = default_ms(|d| d.transport.op_timeout), value_parser = timeout_ms)]
    pub op_timeout_ms: u64,
    /// Deadline of one connection handshake, in milliseconds.
    #[arg(long, value_name = "MS", env = "FALCON_HANDSHAKE_TIMEOUT_MS",
          default_value_t = default_ms(|d| d.transport.handshake_timeout),
          value_parser = timeout_ms)]
    pub handshake_timeout_ms: u64,
}

/// A default of [`JobConfig`](falcon_engine::JobConfig), in milliseconds.
pub fn default_ms(f: impl Fn(&falcon_engine::JobConfig) -> Duration) -> u64 {
    f(&falcon_engine::JobConfig::default()).as_millis() as u64
}

impl TimeoutArgs {
    /// The timeouts, with `default_suspicion` when none is given; checked together (a
    /// suspicion timeout must be longer than the heartbeat interval).
    pub fn resolve(
        &self,
        default_suspicion: Option<Duration>,
    ) -> Result<falcon_trainer::job::Timeouts, Invalid> {
        let t = falcon_trainer::job::Timeouts {
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            suspicion: match self.suspicion_ms {
                None => default_suspicion,
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
            },
            rendezvous: Duration::from_millis(self.rendezvous_timeout_ms),
            op: Duration::from_millis(self.op_timeout_ms),
            handshake: Duration::from_millis(self.handshake_timeout_ms),
        };
        check_timeouts(&t)?;
        Ok(t)
    }
}

/// A suspicion timeout must be longer than the heartbeat interval.
pub fn check_timeouts(t: &falcon_trainer::job::Timeouts) -> Result<(), Invalid> {
    Ok(falcon_engine::checks::suspicion_fits(
        t.heartbeat,
        t.suspicion,
    )?)
}

/// How a job's roles are placed, for [`Limits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Every role a thread of this process (`falcon train`).
    OneProcess,
    /// Every role a process of this host, started by this one (`falcon local`).
    Processes,
}

/// What the job would need of this machine and what it may have, when it needs more.
#[derive(Debug)]
pub struct Limits {
    /// Said first: the job, e.g. "falcon train with 100000 workers and 2 servers".
    pub job: String,
    /// Each limit the job exceeds, one sentence each.
    pub exceeded: Vec<String>,
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is more than this machine allows: {}",
            self.job,
            self.exceeded.join("; ")
        )
    }
}

/// File descriptors and threads of one end of a link between two roles (measured on this
/// code: an shm end holds its Unix socket and a duplicate, its ring's memfd, the peer's ring
/// and doorbell memfds, and a region's memfd, with one control thread; a tcp end holds its
/// socket, a reader's and a writer's clone and a region's memfd, with a receiving and a
/// responding thread).
fn link_end(medium: Medium) -> (u64, u64) {
    match medium {
        Medium::Tcp => (4, 2),
        // RDMA links keep a tcp control link and a completion thread besides.
        Medium::Rdma => (5, 3),
        // On one host `auto` is shm.
        Medium::Shm | Medium::Auto => (6, 1),
    }
}

/// Descriptors and threads of every role apart from its links (its transport's listeners,
/// completion queue, progress and heartbeat threads).
const ROLE_FDS: u64 = 4;
const ROLE_THREADS: u64 = 2;
/// Of the process itself (standard streams, the runtime).
const PROCESS_FDS: u64 = 12;
const PROCESS_THREADS: u64 = 3;

/// The estimate of what a job of `servers` and `workers` (each with `threads` compute
/// threads) needs, against this machine's limits: an error naming each limit exceeded, the
/// need and how to raise the limit. Links: the scheduler has one to every server and worker,
/// every worker one to every server.
pub fn check_limits(
    layout: Layout,
    job: &str,
    servers: u32,
    workers: u32,
    threads: u64,
    medium: Medium,
) -> Result<(), Invalid> {
    let (s, w) = (u64::from(servers), u64::from(workers));
    let (end_fds, end_threads) = link_end(medium);
    let roles = 1 + s + w;
    let links = s + w + s * w;
    // A worker's own thread is the first of its pool's.
    let worker_threads = w * threads.max(1);
    // The most descriptors one process needs, and the threads of all of them.
    let (fds, all_threads) = match layout {
        Layout::OneProcess => (
            PROCESS_FDS + roles * ROLE_FDS + 2 * links * end_fds,
            PROCESS_THREADS + roles * ROLE_THREADS + 2 * links * end_threads + worker_threads,
        ),
        Layout::Processes => {
            // The scheduler's process (S + W link ends) or a server's (1 + W); this one holds
            // a pipe of each role's error output, read by a thread each.
            let scheduler = PROCESS_FDS + ROLE_FDS + (s + w) * end_fds;
            let server = PROCESS_FDS + ROLE_FDS + (1 + w) * end_fds;
            let launcher = PROCESS_FDS + 2 * roles;
            (
                scheduler.max(server).max(launcher),
                (PROCESS_THREADS + roles)
                    + roles * (PROCESS_THREADS + ROLE_THREADS)
                    + 2 * links * end_threads
                    + worker_threads,
            )
        }
    };
    let mut exceeded = Vec::new();
    let per = match layout {
        Layout::OneProcess => "in this process",
        Layout::Processes => "in its largest process",
    };
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if let Some(soft) = nofile.current
        && fds > soft
    {
        let raise = match nofile.maximum {
            Some(h) if h < fds => format!(
                "raise it (`ulimit -n {}`; above the hard limit, {h}, only root can: \
                 limits.conf, or systemd's LimitNOFILE)",
                round_up(fds)
            ),
            _ => format!("raise it (`ulimit -n {}`)", round_up(fds)),
        };
        exceeded.push(format!(
            "it needs about {fds} open files {per} and the limit of open files (ulimit -n) \
             is {soft}: {raise} or use fewer workers"
        ));
    }
    if let Some(max) = read_number("/proc/sys/kernel/threads-max")
        && all_threads > max
    {
        exceeded.push(format!(
            "it needs about {all_threads} threads and this system allows {max} in all \
             (/proc/sys/kernel/threads-max): use fewer workers, or spread them over hosts"
        ));
    } else if !rustix::process::geteuid().is_root()
        && let Some(soft) = rustix::process::getrlimit(rustix::process::Resource::Nproc).current
        && all_threads > soft
    {
        exceeded.push(format!(
            "it needs about {all_threads} threads and the limit of processes and threads of \
             this user (ulimit -u) is {soft}: raise it with `ulimit -u {}`, or use fewer \
             workers",
            round_up(all_threads + 1000)
        ));
    }
    if exceeded.is_empty() {
        Ok(())
    } else {
        Err(Invalid::Limits(Box::new(Limits {
            job: job.to_string(),
            exceeded,
        })))
    }
}

/// `n` rounded up to two significant digits, for a limit to suggest.
fn round_up(n: u64) -> u64 {
    let mut unit = 1;
    while n / unit >= 100 {
        unit *= 10;
    }
    n.div_ceil(unit) * unit
}

fn read_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_checks_are_the_flags_checks() {
        // Shared with the launch contract: one type, one message.
        let e: BadValue = learning_rate("nan").unwrap_err();
        assert!(
            e.to_string()
                .contains("the learning rate must be a finite number greater than 0")
        );
        assert_eq!(learning_rate("x").unwrap_err().to_string(), "not a number");
    }

    #[test]
    fn targets_are_fractions() {
        assert_eq!(accuracy_target("1").unwrap(), 1.0);
        for bad in ["2", "0", "-0.5", "nan", "75"] {
            let e = accuracy_target(bad).unwrap_err().to_string();
            assert!(e.contains("a fraction in (0, 1]"), "{bad}: {e}");
        }
    }

    #[test]
    fn positives() {
        assert!(positive("0").is_err() && positive("inf").is_err());
        assert_eq!(positive("2.5").unwrap(), 2.5);
    }

    #[test]
    fn a_suspicion_timeout_must_outlast_the_heartbeat() {
        let t = falcon_trainer::job::Timeouts {
            heartbeat: Duration::from_millis(1000),
            suspicion: Some(Duration::from_millis(500)),
            ..Default::default()
        };
        let e = check_timeouts(&t).unwrap_err().to_string();
        assert!(
            e.contains("must be longer than the heartbeat interval"),
            "{e}"
        );
        assert!(
            check_timeouts(&falcon_trainer::job::Timeouts {
                suspicion: None,
                ..t
            })
            .is_ok()
        );
    }

    #[test]
    fn a_hundred_thousand_workers_exceed_the_limits() {
        let e = check_limits(
            Layout::OneProcess,
            "falcon train with 100000 workers",
            2,
            100_000,
            1,
            Medium::Auto,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("falcon train with 100000 workers is more than"),
            "{e}"
        );
        assert!(e.contains("ulimit -n"), "{e}");
        // A small job fits anywhere.
        check_limits(Layout::OneProcess, "small", 2, 4, 1, Medium::Auto).unwrap();
        check_limits(Layout::Processes, "small", 2, 4, 1, Medium::Tcp).unwrap();
        assert_eq!(round_up(3_600_012), 3_600_000 + 100_000);
        assert_eq!(round_up(99), 99);
    }
}
