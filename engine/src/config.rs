//! Job configuration.

use std::time::Duration;

use falcon_transport::{Medium, TransportConfig};

use crate::keys::DEFAULT_MAX_SHARD_BYTES;
use crate::sync::PolicySpec;
use crate::update::{Aggregate, Optimizer, ScaleSpec, UpdateMode};

/// Default suspicion timeout (see [`JobConfig::suspicion`]).
pub const DEFAULT_SUSPICION: Duration = Duration::from_secs(15);

/// How long a link that passed the transport's admission wall (its peer proved the job token)
/// may take to finish a role's own admission (knock, challenge, hello or attach) before the
/// role drops it: the operation timeout, at least the handshake deadline. Strangers never get
/// this far; this only keeps a stuck or buggy token holder from holding a link forever, so it
/// is generous (an emulated or heavily loaded machine is slow).
pub fn admission_deadline(cfg: &JobConfig) -> Duration {
    cfg.transport
        .op_timeout
        .max(cfg.transport.handshake_timeout)
}

/// How long an evicted node (or one cut off from the scheduler) tries to join again before it
/// gives the job up.
pub const REJOIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything a node of a job needs to know before rendezvous.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// Job id: processes of other jobs are refused by the transport.
    pub job: String,
    /// Secret token every node must present at rendezvous.
    pub token: String,
    /// Number of servers.
    pub servers: u32,
    /// Number of workers.
    pub workers: u32,
    /// The scheduler's address: `HOST:PORT` or `IP:PORT` (a remote tcp endpoint), or the
    /// transport's `PeerAddr` text (`host=ID;tcp=IP:PORT;shm=PATH`); see
    /// [`launch::scheduler_address`](crate::launch::scheduler_address). Ignored by the
    /// scheduler itself.
    pub scheduler: String,
    /// Synchronization policy.
    pub policy: PolicySpec,
    /// Update mode (`None`: Sync for BSP, Async otherwise).
    pub mode: Option<UpdateMode>,
    /// How aggregated gradients combine.
    pub aggregate: Aggregate,
    /// Server-side optimizer.
    pub optimizer: Optimizer,
    /// Staleness scaling of asynchronously applied gradients (DynSGD, ConSGD).
    pub scale: ScaleSpec,
    /// Largest shard.
    pub max_shard_bytes: u64,
    /// Heartbeat interval: every node sends one this often, from a thread that never waits on
    /// training, on a peer or on a lock held across I/O.
    pub heartbeat: Duration,
    /// How long the scheduler waits for a silent node before it declares it dead (`None`:
    /// never, for roles that share one process, where a hung role is a bug reported as
    /// such). The default, 15 s, survives a heavily loaded machine and a short pause
    /// (`SIGSTOP`); killed processes are seen at once anyway (their links close).
    pub suspicion: Option<Duration>,
    /// How long rendezvous may take.
    pub rendezvous_timeout: Duration,
    /// The transport of this node.
    pub transport: TransportConfig,
    /// Where this node's host holds more of the job's workers and servers than this process
    /// has cores, its waits park at once instead of spinning for `transport.spin` (see
    /// [`host_spin`]): there a spin takes the core a busy peer needs. On by default, so a
    /// `transport.spin` set in code is overridden on such a host unless this is false;
    /// `FALCON_SPIN_US` turns it off, so the spin it sets holds everywhere.
    pub spin_auto: bool,
    /// Over shm, a push of a dense f32 shard of at least 64 KiB leaves the gradient where the
    /// worker holds it and the server reads it there, instead of copying it into the slot
    /// (one memory pass fewer per pushed byte). On by default; `FALCON_SHM_IN_PLACE=0` turns
    /// it off (a worker's setting; servers read whichever way a push says).
    pub shm_in_place: bool,
    /// Helper threads that share a node's large memory passes (an shm copy of a large shard,
    /// a server's apply of one) with the thread that makes them, see
    /// [`falcon_transport::spread`]. `None` (the default): one fewer than the cores, at most
    /// three, and none where the host holds more of the job's workers and servers than it has
    /// cores (see [`host_helpers`]); `FALCON_HELPER_THREADS` sets it.
    pub helper_threads: Option<usize>,
    /// The scheduler's supervisor and parallelism manager.
    pub supervisor: SupervisorSettings,
    /// Server checkpoints and recovery (`None`: a dead server ends the job).
    pub checkpoint: Option<CheckpointSettings>,
    /// Memory cap of a server shard's gradients waiting for their step (sync mode): above
    /// it the server holds back acknowledgements, so the pushers' next pushes wait.
    pub max_pending_bytes: u64,
    /// Whether a worker's push or pull puts its parts for different servers in flight at once,
    /// one thread per server (see [`FanOut`]).
    pub fan_out: FanOut,
    /// The precision of gradients and pulled values on the wire (the scheduler's decides).
    pub wire: crate::precision::Wire,
    /// Where the scheduler serves its metrics for Prometheus (`http://ADDR/metrics`; see
    /// [`crate::metrics`]); `None`: nowhere. Workers and servers send their counters to the
    /// scheduler with their heartbeats either way.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// How a worker issues the per-server parts of one push or pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FanOut {
    /// At once, one thread per server, when each server's part is at least 256 KiB and the
    /// host has at least 4 cores (on fewer, the threads compete with co-located servers).
    #[default]
    Auto,
    /// At once whenever more than one server is involved and each part is at least 256 KiB,
    /// whatever the cores.
    On,
    /// One after the other on the caller's thread.
    Off,
}

impl std::str::FromStr for FanOut {
    type Err = &'static str;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(FanOut::Auto),
            "on" => Ok(FanOut::On),
            "off" => Ok(FanOut::Off),
            _ => Err("not a fan-out setting: auto, on or off"),
        }
    }
}

/// Server checkpoints: where, how often, and how long the job waits for a dead server to
/// come back from its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSettings {
    /// Directory of the checkpoint files (`server-RANK.ckpt`), shared by a server and its
    /// restarted successor.
    pub dir: std::path::PathBuf,
    /// How often a server checkpoints.
    pub every: Duration,
    /// How long the scheduler waits for a dead server to restart before it ends the job
    /// (workers wait as long; their pushes time out after the transport's op_timeout).
    pub recovery_timeout: Duration,
    /// What a failed checkpoint write does: every failure is reported to the scheduler, and
    /// the scheduler's setting decides (a server's only words its log line).
    pub on_failure: OnCheckpointFailure,
    /// Start from the checkpoints in `dir` of an earlier run of this job (a job stopped and
    /// started again): each server restores its shards and every worker goes on at the clock
    /// they hold. A checkpoint of another job is refused.
    pub resume: bool,
}

/// What the job does when a server cannot write its checkpoint (a full disk, a directory
/// gone): without checkpoints a server that dies takes its data with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnCheckpointFailure {
    /// Train on: the server logs the failures (at most one line per 10 s, with their count)
    /// and the scheduler's report lists them.
    #[default]
    Warn,
    /// The scheduler ends the job at the first failure, naming the server and the reason.
    Stop,
}

impl OnCheckpointFailure {
    /// Its name, as [`std::str::FromStr`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            OnCheckpointFailure::Warn => "warn",
            OnCheckpointFailure::Stop => "stop",
        }
    }
}

impl std::str::FromStr for OnCheckpointFailure {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> crate::error::Result<OnCheckpointFailure> {
        match s.trim().to_ascii_lowercase().as_str() {
            "warn" => Ok(OnCheckpointFailure::Warn),
            "stop" => Ok(OnCheckpointFailure::Stop),
            _ => Err(crate::error::Error::Config(format!(
                "'{s}' is not an action on a checkpoint failure (warn, stop)"
            ))),
        }
    }
}

impl CheckpointSettings {
    /// Checkpoints in `dir` every second; a dead server has 60 s to come back; a failed
    /// checkpoint is a warning.
    pub fn new(dir: impl Into<std::path::PathBuf>) -> CheckpointSettings {
        CheckpointSettings {
            dir: dir.into(),
            every: Duration::from_secs(1),
            recovery_timeout: Duration::from_secs(60),
            on_failure: OnCheckpointFailure::Warn,
            resume: false,
        }
    }
}

/// How the scheduler's parallelism manager may change the workers' thread counts (see
/// [`crate::supervisor`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SupervisorSettings {
    /// Send thread-count advice at all (the straggler projection runs either way).
    pub elastic: bool,
    /// Threads each worker's machine can run at once (0: the scheduler host's cores).
    pub budget: usize,
    /// The over-subscription knee: the most threads one worker may get (0: the budget).
    pub knee: usize,
    /// The thread count workers start with.
    pub initial: usize,
}

impl Default for SupervisorSettings {
    fn default() -> Self {
        SupervisorSettings {
            elastic: true,
            budget: 0,
            knee: 0,
            initial: 1,
        }
    }
}

/// The largest message a role takes from a peer that connected to it until it knows what
/// the peer may send: control messages (a hello with its tensor list, heartbeats with their
/// counters) are far smaller. A server raises it for an attached worker to what that
/// worker's row requests may need ([`crate::Server`]).
pub const DEFAULT_MAX_CONTROL_MESSAGE: u64 = 4 << 20;

impl Default for JobConfig {
    fn default() -> Self {
        JobConfig {
            job: "falcon".into(),
            token: String::new(),
            servers: 1,
            workers: 1,
            scheduler: String::new(),
            policy: PolicySpec::Bsp,
            mode: None,
            aggregate: Aggregate::Mean,
            optimizer: Optimizer::Sgd { lr: 0.1 },
            scale: ScaleSpec::Unscaled,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            heartbeat: Duration::from_secs(1),
            suspicion: Some(DEFAULT_SUSPICION),
            rendezvous_timeout: Duration::from_secs(60),
            transport: TransportConfig {
                medium: Medium::Auto,
                max_accepted_message: DEFAULT_MAX_CONTROL_MESSAGE,
                ..TransportConfig::default()
            },
            spin_auto: true,
            shm_in_place: true,
            helper_threads: None,
            supervisor: SupervisorSettings::default(),
            checkpoint: None,
            max_pending_bytes: 256 << 20,
            fan_out: FanOut::Auto,
            wire: crate::precision::Wire::F32,
            metrics_addr: None,
        }
    }
}

impl JobConfig {
    /// The update mode in force.
    pub fn update_mode(&self) -> UpdateMode {
        self.mode.unwrap_or(self.policy.update_mode())
    }

    /// The transport configuration of a node of this job (job id hashed in).
    pub fn transport_config(&self) -> TransportConfig {
        TransportConfig {
            job: job_hash(&self.job),
            token: self.token.clone(),
            ..self.transport.clone()
        }
    }
}

/// How long a node's waits spin: `configured`, except where `auto` is on and the job's
/// workers and servers on this node's host (`host_peers`, the node included) outnumber the
/// `cores` this process may run on: then none (a wait parks at once), since each spinning
/// wait would take a core that a peer with work needs. Open MPI's oversubscribed mode (yield
/// when idle) rests on the same observation.
pub fn host_spin(configured: Duration, auto: bool, host_peers: u32, cores: usize) -> Duration {
    if auto && host_peers as usize > cores {
        Duration::ZERO
    } else {
        configured
    }
}

/// The helper threads a node uses ([`JobConfig::helper_threads`]): as set, else one fewer
/// than `cores` (at most three), and none where the job's workers and servers on this host
/// (`host_peers`) outnumber the cores: there every core has a busy process, and a helper
/// would only take turns with one.
pub fn host_helpers(configured: Option<usize>, host_peers: u32, cores: usize) -> usize {
    match configured {
        Some(n) => n,
        None if host_peers as usize > cores => 0,
        None => falcon_transport::spread::helpers_for_cores(cores),
    }
}

/// The transport-level job id of a job name (FNV-1a: stable across builds and hosts).
pub fn job_hash(job: &str) -> u64 {
    job.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crowded_host_parks_at_once_unless_the_spin_was_set() {
        let spin = Duration::from_micros(50);
        // As many processes as cores, or fewer: the configured spin.
        assert_eq!(host_spin(spin, true, 2, 2), spin);
        assert_eq!(host_spin(spin, true, 1, 16), spin);
        // More than cores: none.
        assert_eq!(host_spin(spin, true, 3, 2), Duration::ZERO);
        assert_eq!(host_spin(spin, true, 64, 8), Duration::ZERO);
        // A spin the user set holds.
        assert_eq!(host_spin(spin, false, 64, 8), spin);
        assert!(JobConfig::default().spin_auto);
    }

    #[test]
    fn helpers_follow_the_free_cores_unless_set() {
        // One process a core or fewer: one fewer than the cores, at most three.
        assert_eq!(host_helpers(None, 2, 2), 1);
        assert_eq!(host_helpers(None, 1, 1), 0);
        assert_eq!(host_helpers(None, 4, 16), 3);
        // A crowded host: none.
        assert_eq!(host_helpers(None, 4, 2), 0);
        // Set: as set, crowded or not.
        assert_eq!(host_helpers(Some(2), 4, 2), 2);
        assert_eq!(host_helpers(Some(0), 1, 16), 0);
        assert_eq!(JobConfig::default().helper_threads, None);
    }
}
