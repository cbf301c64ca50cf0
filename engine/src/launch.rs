//! The launch contract: how a process learns its part in a job from its environment.
//!
//! `falcon role` reads its configuration here, and so can a process of one's own (a
//! program embedding [`Worker`](crate::Worker), say) that joins a job whose scheduler and
//! servers are `falcon role` processes, the arrangement of ps-lite and BytePS:
//!
//! ```no_run
//! use falcon_engine::{Worker, keys::TensorSpec, launch::Launch};
//! let launch = Launch::from_env()?; // FALCON_*, DMLC_*, torchrun's, Slurm's or mpirun's
//! let w = Worker::join(&launch.config, vec![TensorSpec::new("w", 4)], launch.rank)?;
//! let mut values = vec![0f32; 4];
//! for clock in 0..10 {
//!     w.pull_slice("w", &mut values, clock)?;
//!     w.push_slice("w", &[1.0; 4], clock)?;
//! }
//! w.finish()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The variables ([`VARIABLES`] lists every one read here):
//!
//! - the role: `FALCON_ROLE` (`DMLC_ROLE`), `scheduler`, `server` or `worker`, and
//!   `FALCON_RANK`, the rank within the role (default: the scheduler assigns one). Without
//!   a role, a launcher's ranks are the workers: torchrun's `RANK`/`WORLD_SIZE`, Slurm's
//!   `SLURM_PROCID`/`SLURM_NTASKS` or Open MPI's `OMPI_COMM_WORLD_RANK`/`_SIZE` make the
//!   process worker `RANK` of `WORLD_SIZE`, and the scheduler and the servers run beside
//!   them on threads ([`Launch::hosted`]): rank 0 hosts the scheduler, the first rank of
//!   each node a server (nodes from `LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE` or
//!   `SLURM_NNODES`); `FALCON_HOST_ROLES=0` hosts none (they are started apart);
//! - the job's size: `FALCON_NUM_SERVER` (`DMLC_NUM_SERVER`; default 1, under a launcher
//!   one per node) and `FALCON_NUM_WORKER` (`DMLC_NUM_WORKER`, default 1; under a launcher,
//!   the world);
//! - the scheduler: `FALCON_SCHEDULER`, an address (`HOST:PORT`, `IP:PORT`, or the
//!   transport's `host=ID;tcp=IP:PORT` text), or a host and a port:
//!   `FALCON_SCHEDULER_URI` (`DMLC_PS_ROOT_URI`; torchrun's `MASTER_ADDR`; the first node of
//!   Slurm's `SLURM_NODELIST`/`SLURM_JOB_NODELIST`) and `FALCON_SCHEDULER_PORT`
//!   (`DMLC_PS_ROOT_PORT`, `MASTER_PORT` — plus one when torchrun says its agent holds it,
//!   `TORCHELASTIC_USE_AGENT_STORE`; under a launcher that names none,
//!   [`DEFAULT_SCHEDULER_PORT`]);
//! - this node's addresses: `FALCON_NODE_HOST` (`DMLC_NODE_HOST`), `FALCON_BIND`,
//!   `FALCON_ADVERTISE`;
//! - the job: `FALCON_JOB`, `FALCON_TOKEN`, `FALCON_POLICY`, `FALCON_LR`, `FALCON_OPTIMIZER`,
//!   `FALCON_AGGREGATE`, `FALCON_SCALE`,
//!   `FALCON_MAX_SHARD_BYTES`, `FALCON_FAN_OUT`, `FALCON_WIRE`, `FALCON_MEDIUM`,
//!   `FALCON_SHM_IN_PLACE`;
//! - the scheduler's metrics endpoint: `FALCON_METRICS_ADDR` (`IP:PORT`);
//! - the heartbeat and the timeouts: `FALCON_HEARTBEAT_MS`, `FALCON_SUSPICION_MS`,
//!   `FALCON_RENDEZVOUS_TIMEOUT_MS`, `FALCON_OP_TIMEOUT_MS`, `FALCON_HANDSHAKE_TIMEOUT_MS`,
//!   `FALCON_MAX_HANDSHAKES`, `FALCON_MAX_HANDSHAKES_PER_SOURCE`; how long a hand-off between
//!   threads spins before it parks: `FALCON_SPIN_US` (unset: 50 µs, or none on a host where
//!   the job's workers and servers outnumber the cores); the threads that share a large
//!   copy or apply: `FALCON_HELPER_THREADS` (unset: one fewer than the cores, at most three,
//!   or none on such a host); TCP connections per tcp link a worker opens to a server:
//!   `FALCON_TCP_STREAMS` (1 to 8, default 2);
//! - server checkpoints: `FALCON_CHECKPOINT_DIR`, `FALCON_CHECKPOINT_MS`,
//!   `FALCON_RECOVERY_TIMEOUT_MS`, `FALCON_CHECKPOINT_ON_FAILURE`, and `FALCON_RESUME` (start
//!   from them: a job stopped and started again).
//!
//! A variable set to the empty string counts as unset; of a variable and its aliases, the
//! first set one counts. Every value is checked before anything starts: a refusal is a
//! [`LaunchError`] naming the variable, its value and what is allowed.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use falcon_transport::{Medium, PeerAddr};

use crate::checks::{self, Conflict};
use crate::config::{
    CheckpointSettings, DEFAULT_SUSPICION, FanOut, JobConfig, OnCheckpointFailure,
};
use crate::proto::Role;
use crate::sync::PolicySpec;
use crate::update::{Aggregate, Optimizer, ScaleSpec, UpdateMode};

/// The scheduler's port when a launcher (Slurm, mpirun) names none.
pub const DEFAULT_SCHEDULER_PORT: u16 = 9091;

/// The learning rate when `FALCON_LR` is unset.
pub const DEFAULT_LR: f32 = 0.5;

/// The host identity of a scheduler address given as `HOST:PORT`: not this host's (nor any
/// host's), so the control link to the scheduler is always tcp.
const REMOTE_HOST: &str = "remote";

/// Every variable [`Launch::from_vars`] reads, aliases included.
pub const VARIABLES: &[&str] = &[
    "FALCON_ROLE",
    "DMLC_ROLE",
    "FALCON_RANK",
    "FALCON_NUM_SERVER",
    "DMLC_NUM_SERVER",
    "FALCON_NUM_WORKER",
    "DMLC_NUM_WORKER",
    "FALCON_SCHEDULER",
    "FALCON_SCHEDULER_URI",
    "DMLC_PS_ROOT_URI",
    "FALCON_SCHEDULER_PORT",
    "DMLC_PS_ROOT_PORT",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_NNODES",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "FALCON_HOST_ROLES",
    "FALCON_NODE_HOST",
    "DMLC_NODE_HOST",
    "FALCON_BIND",
    "FALCON_ADVERTISE",
    "FALCON_JOB",
    "FALCON_TOKEN",
    "FALCON_POLICY",
    "FALCON_LR",
    "FALCON_OPTIMIZER",
    "FALCON_AGGREGATE",
    "FALCON_SCALE",
    "FALCON_MAX_SHARD_BYTES",
    "FALCON_FAN_OUT",
    "FALCON_WIRE",
    "FALCON_METRICS_ADDR",
    "FALCON_MEDIUM",
    "FALCON_HEARTBEAT_MS",
    "FALCON_SUSPICION_MS",
    "FALCON_RENDEZVOUS_TIMEOUT_MS",
    "FALCON_OP_TIMEOUT_MS",
    "FALCON_HANDSHAKE_TIMEOUT_MS",
    "FALCON_SPIN_US",
    "FALCON_SHM_IN_PLACE",
    "FALCON_HELPER_THREADS",
    "FALCON_TCP_STREAMS",
    "FALCON_MAX_HANDSHAKES",
    "FALCON_MAX_HANDSHAKES_PER_SOURCE",
    "FALCON_MAX_CONTROL_BYTES",
    "FALCON_CHECKPOINT_DIR",
    "FALCON_CHECKPOINT_MS",
    "FALCON_RECOVERY_TIMEOUT_MS",
    "FALCON_CHECKPOINT_ON_FAILURE",
    "FALCON_RESUME",
];

/// A process's part in a job, read from its environment.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Launch {
    /// The job's configuration, as this process should join it ([`Worker::join`],
    /// [`Server::join`], [`Scheduler::bind`]).
    ///
    /// [`Worker::join`]: crate::Worker::join
    /// [`Server::join`]: crate::Server::join
    /// [`Scheduler::bind`]: crate::Scheduler::bind
    pub config: JobConfig,
    /// This process's role.
    pub role: Role,
    /// Its rank within the role, if the environment names one (`FALCON_RANK`, or the
    /// launcher's global rank); `None`: the scheduler assigns one.
    pub rank: Option<u32>,
    /// The roles this process runs beside its own, on threads: under a launcher, rank 0
    /// hosts the scheduler and each node's first rank servers (none with
    /// `FALCON_HOST_ROLES=0`, nor with a role named).
    pub hosted: Hosted,
}

/// The roles a launched rank hosts beside its worker ([`Launch::hosted`]); started with
/// [`crate::local::HostedRoles::start`].
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Hosted {
    /// The job's scheduler, as it runs: its configuration (it listens on the job's
    /// scheduler address).
    pub scheduler: Option<JobConfig>,
    /// These servers' ranks (they run with [`Launch::config`]).
    pub servers: Vec<u32>,
}

impl Hosted {
    /// Whether it hosts anything.
    pub fn is_empty(&self) -> bool {
        self.scheduler.is_none() && self.servers.is_empty()
    }
}

/// A launch refused: which variable, its value, and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// A variable whose value cannot be used.
    #[error("{var}={value}: {why}")]
    Value {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what is allowed.
        why: String,
    },
    /// Neither a role nor a launcher's rank.
    #[error(
        "no role: set FALCON_ROLE (or DMLC_ROLE) to scheduler, server or worker, or launch \
         with srun, torchrun or mpirun (SLURM_PROCID/SLURM_NTASKS, RANK/WORLD_SIZE, \
         OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE)"
    )]
    NoRole,
    /// No scheduler address.
    #[error(
        "no scheduler: set FALCON_SCHEDULER (HOST:PORT), or FALCON_SCHEDULER_URI and \
         FALCON_SCHEDULER_PORT (DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT, MASTER_ADDR and \
         MASTER_PORT)"
    )]
    NoScheduler,
    /// A rank outside its launch.
    #[error(
        "{rank_var}={rank} with {world_var}={world}: the rank must be below the world size \
         (each rank is a worker)"
    )]
    Launcher {
        /// The launcher's rank variable.
        rank_var: &'static str,
        /// The rank.
        rank: u32,
        /// The launcher's world-size variable.
        world_var: &'static str,
        /// The world size.
        world: u32,
    },
    /// Values wrong together (a policy and the workers, a suspicion timeout and the
    /// heartbeat).
    #[error(transparent)]
    Conflict(#[from] Conflict),
}

/// A scheduler (or bind) address refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// Neither `HOST:PORT` nor the transport's `host=…;tcp=…` text.
    #[error("no port: expected HOST:PORT, IP:PORT or host=ID;tcp=IP:PORT")]
    NoPort,
    /// The part after the last `:` is not a port.
    #[error("{port} is not a port (a whole number from 0 to 65535)")]
    BadPort {
        /// What was given as the port.
        port: String,
    },
    /// A host name that does not resolve.
    #[error("cannot resolve {host}:{port}: {why}")]
    Unresolved {
        /// The host.
        host: String,
        /// The port.
        port: u16,
        /// The resolver's answer.
        why: String,
    },
    /// A host name that resolves to nothing.
    #[error("{host} has no address")]
    NoAddress {
        /// The host.
        host: String,
    },
    /// The transport's `host=ID;tcp=IP:PORT;shm=PATH` text, refused.
    #[error("{0} (expected HOST:PORT, IP:PORT or host=ID;tcp=IP:PORT)")]
    PeerAddr(String),
}

/// A scheduler's address: `HOST:PORT` (a name that resolves, preferring IPv4), `IP:PORT`
/// (`[IPV6]:PORT` too), each a remote tcp endpoint, or the transport's text form
/// `host=ID;tcp=IP:PORT;shm=PATH` ([`PeerAddr`]'s `FromStr`).
pub fn scheduler_address(text: &str) -> Result<PeerAddr, AddressError> {
    let text = text.trim();
    if text.contains('=') {
        return text.parse().map_err(|e| {
            AddressError::PeerAddr(match e {
                falcon_transport::Error::Config(why) => why,
                other => other.to_string(),
            })
        });
    }
    Ok(PeerAddr {
        host: REMOTE_HOST.into(),
        tcp: Some(socket_address(text)?),
        shm: None,
    })
}

/// `HOST:PORT` or `IP:PORT` (`[IPV6]:PORT` too) as a socket address, a host name resolved
/// (preferring IPv4).
pub fn socket_address(text: &str) -> Result<SocketAddr, AddressError> {
    let text = text.trim();
    if let Ok(a) = text.parse::<SocketAddr>() {
        return Ok(a);
    }
    let (host, port) = text.rsplit_once(':').ok_or(AddressError::NoPort)?;
    let port: u16 = port.parse().map_err(|_| AddressError::BadPort {
        port: port.to_string(),
    })?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(AddressError::NoPort);
    }
    resolve(host, port)
}

/// Resolves a host (a name or an address) and a port to a socket address, preferring IPv4.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, AddressError> {
    let all: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| AddressError::Unresolved {
            host: host.to_string(),
            port,
            why: e.to_string(),
        })?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| AddressError::NoAddress {
            host: host.to_string(),
        })
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` → `node01`.
pub fn first_host(list: &str) -> String {
    let first = match list.find('[') {
        Some(open) if list[..open].find(',').is_none() => {
            let inner = &list[open + 1..list[open..].find(']').map_or(list.len(), |c| open + c)];
            let token = inner.split([',', '-']).next().unwrap_or("");
            format!("{}{token}", &list[..open])
        }
        _ => list.split(',').next().unwrap_or("").to_string(),
    };
    first.trim().to_string()
}

/// A variable that was set: its name and value.
#[derive(Clone, Debug)]
struct Set {
    var: &'static str,
    value: String,
}

impl Set {
    /// This value refused, saying `why`.
    fn refused(&self, why: impl std::fmt::Display) -> LaunchError {
        LaunchError::Value {
            var: self.var,
            value: self.value.clone(),
            why: why.to_string(),
        }
    }
}

/// Where the scheduler is, as a host: the variable that named it and the host.
#[derive(Clone, Debug)]
struct SchedulerHost {
    from: Set,
    host: String,
}

/// The environment, through a lookup function.
struct Env<F>(F);

impl<F: Fn(&str) -> Option<String>> Env<F> {
    /// The first of `names` that is set and not empty.
    fn get(&self, names: &[&'static str]) -> Option<Set> {
        names.iter().find_map(|&var| {
            (self.0)(var)
                .filter(|v| !v.is_empty())
                .map(|value| Set { var, value })
        })
    }

    /// The first of `names` that is set, read with `parse`; none set: `default`.
    fn value<T, E: std::fmt::Display>(
        &self,
        names: &[&'static str],
        default: T,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> Result<T, LaunchError> {
        match self.get(names) {
            None => Ok(default),
            Some(set) => parse(&set.value).map_err(|e| set.refused(e)),
        }
    }

    /// A yes or no (1, true, yes, on; 0, false, no, off); unset: `default`; anything else
    /// refused, `meaning` saying what each answer does.
    fn yes_no(&self, var: &'static str, default: bool, meaning: &str) -> Result<bool, LaunchError> {
        let Some(set) = self.get(&[var]) else {
            return Ok(default);
        };
        match set.value.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(set.refused(format!("not a yes or no: {meaning}"))),
        }
    }

    /// A duration in milliseconds.
    fn millis(
        &self,
        var: &'static str,
        default: Duration,
        parse: impl Fn(&str) -> Result<u64, checks::BadValue>,
    ) -> Result<Duration, LaunchError> {
        self.value(&[var], default.as_millis() as u64, parse)
            .map(Duration::from_millis)
    }
}

/// Where a launcher put this process: a worker of its global rank.
struct Placed {
    /// The global rank, the worker's rank.
    rank: u32,
    /// Processes in the launch: the job's workers.
    world: u32,
    /// The job's servers.
    servers: u32,
    /// The scheduler's host, if the launcher names it.
    host: Option<SchedulerHost>,
    /// Whether this rank hosts the scheduler (rank 0), and the servers it hosts.
    hosts_scheduler: bool,
    hosted_servers: Vec<u32>,
}

/// One launcher line for every process (Slurm's `srun`, torchrun, mpirun): every rank is a
/// worker of that rank (N processes, N trainers, as under DDP and Horovod). The scheduler
/// and the servers run beside them on threads ([`Hosted`]): rank 0 hosts the scheduler, and
/// server `s` is hosted by the first rank of node `s mod nodes` (ranks are placed node by
/// node, `per_node` of them on each: torchrun's `LOCAL_WORLD_SIZE`, Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm's tasks over `SLURM_NNODES`). With
/// `FALCON_HOST_ROLES=0` the ranks host nothing: the scheduler and the servers are started
/// apart (`falcon role`) and the ranks are the workers alone. The scheduler's host comes
/// from MASTER_ADDR or the first node of SLURM_NODELIST.
fn launcher_layout<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    servers: Option<u32>,
) -> Result<Option<Placed>, LaunchError> {
    let (rank, world, host, per_node) = if let (Some(r), Some(w)) =
        (env.get(&["RANK"]), env.get(&["WORLD_SIZE"]))
    {
        let host = env.get(&["MASTER_ADDR"]).map(|from| SchedulerHost {
            host: from.value.trim().to_string(),
            from,
        });
        (r, w, host, env.get(&["LOCAL_WORLD_SIZE"]))
    } else if let (Some(r), Some(w)) = (env.get(&["SLURM_PROCID"]), env.get(&["SLURM_NTASKS"])) {
        let host = env
            .get(&["SLURM_NODELIST", "SLURM_JOB_NODELIST"])
            .map(|from| SchedulerHost {
                host: first_host(&from.value),
                from,
            });
        (r, w, host, None)
    } else if let (Some(r), Some(w)) = (
        env.get(&["OMPI_COMM_WORLD_RANK"]),
        env.get(&["OMPI_COMM_WORLD_SIZE"]),
    ) {
        (r, w, None, env.get(&["OMPI_COMM_WORLD_LOCAL_SIZE"]))
    } else {
        return Ok(None);
    };
    let n: u32 = checks::number(&rank.value, "")
        .map_err(|_| rank.refused("not a whole number (the launcher's global rank)"))?;
    let size: u32 = checks::number(&world.value, "")
        .map_err(|_| world.refused("not a whole number (the launcher's world size)"))?;
    if size == 0 || n >= size {
        return Err(LaunchError::Launcher {
            rank_var: rank.var,
            rank: n,
            world_var: world.var,
            world: size,
        });
    }
    // Ranks on each node: named by torchrun and Open MPI; Slurm's tasks over its nodes.
    let per_node = match per_node {
        Some(set) => {
            let k: u32 = checks::number(&set.value, "")
                .map_err(|_| set.refused("not a whole number (the ranks on each node)"))?;
            if k == 0 || k > size {
                return Err(set.refused(format!(
                    "the ranks on each node are 1 to the world size ({size})"
                )));
            }
            k
        }
        None => match env.get(&["SLURM_NNODES"]) {
            Some(set) => {
                let nodes: u32 = checks::number(&set.value, "")
                    .map_err(|_| set.refused("not a whole number (the job's nodes)"))?;
                if nodes == 0 {
                    return Err(set.refused("a job runs on at least one node"));
                }
                size.div_ceil(nodes.min(size))
            }
            None => size,
        },
    };
    let nodes = size.div_ceil(per_node);
    let servers = servers.unwrap_or(nodes);
    let host_roles = env.yes_no(
        "FALCON_HOST_ROLES",
        true,
        "1 (rank 0 hosts the scheduler and each node's first rank servers, on threads) or 0 \
         (the scheduler and the servers run apart, as `falcon role` processes)",
    )?;
    Ok(Some(Placed {
        rank: n,
        world: size,
        servers,
        host,
        hosts_scheduler: host_roles && n == 0,
        hosted_servers: (0..servers)
            .filter(|s| host_roles && (s % nodes) * per_node == n)
            .collect(),
    }))
}

impl Launch {
    /// This process's part in a job, from its environment (see the [module](self)'s list).
    pub fn from_env() -> Result<Launch, LaunchError> {
        Launch::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As [`Launch::from_env`], with `var` answering for the environment: `var(NAME)` is the
    /// value of the variable NAME, `None` when unset.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Launch, LaunchError> {
        let env = Env(var);
        let named_servers = match env.get(&["FALCON_NUM_SERVER", "DMLC_NUM_SERVER"]) {
            Some(set) => Some(checks::at_least_one_u32(&set.value).map_err(|e| set.refused(e))?),
            None => None,
        };
        let (role, placed) = role_of(&env, named_servers)?;
        let servers = placed
            .as_ref()
            .map_or(named_servers.unwrap_or(1), |p| p.servers);
        let uri = env
            .get(&["FALCON_SCHEDULER_URI", "DMLC_PS_ROOT_URI"])
            .map(|from| SchedulerHost {
                host: from.value.trim().to_string(),
                from,
            })
            .or_else(|| placed.as_ref().and_then(|p| p.host.clone()));
        // Launched by Slurm or mpirun, which name no port: falcon's default.
        let port = scheduler_port(&env)?.or(placed.as_ref().map(|_| DEFAULT_SCHEDULER_PORT));
        // The scheduler's address; given as HOST:PORT, also where a scheduler listens.
        let (scheduler, scheduler_tcp) = match (env.get(&["FALCON_SCHEDULER"]), &uri, port) {
            (Some(set), _, _) => {
                let addr = scheduler_address(&set.value).map_err(|e| set.refused(e))?;
                let plain = (!set.value.contains('=')).then_some(addr.tcp).flatten();
                (addr.to_string(), plain)
            }
            (None, Some(u), Some(p)) => {
                let addr = resolve(&u.host, p).map_err(|e| u.from.refused(e))?;
                (format!("host={REMOTE_HOST};tcp={addr}"), None)
            }
            _ => return Err(LaunchError::NoScheduler),
        };
        let workers = match &placed {
            Some(p) => p.world,
            None => env.value(
                &["FALCON_NUM_WORKER", "DMLC_NUM_WORKER"],
                1,
                checks::at_least_one_u32,
            )?,
        };
        let mut cfg = job_config(&env, servers, workers, scheduler)?;
        checkpoints(&env, &mut cfg)?;
        timeouts(&env, &mut cfg)?;
        cfg.transport.medium = env.value(&["FALCON_MEDIUM"], Medium::Auto, |s| {
            s.trim()
                .parse::<Medium>()
                .map_err(|_| "not a medium: auto, shm, tcp or rdma")
        })?;
        cfg.shm_in_place = env.yes_no(
            "FALCON_SHM_IN_PLACE",
            cfg.shm_in_place,
            "1 (over shm a large gradient is read where the worker holds it) or 0 (copied into the slot)",
        )?;
        cfg.transport.bind = Some(bind_address(&env, role, (&uri, port), scheduler_tcp)?);
        // The scheduler this rank hosts listens where the job's address says.
        let hosted_scheduler = match &placed {
            Some(p) if p.hosts_scheduler => {
                let mut c = cfg.clone();
                c.transport.bind = Some(bind_address(
                    &env,
                    Role::Scheduler,
                    (&uri, port),
                    scheduler_tcp,
                )?);
                Some(c)
            }
            _ => None,
        };
        if let Some(set) = env.get(&["FALCON_ADVERTISE"]) {
            cfg.transport.advertise = Some(set.value.trim().parse().map_err(|_| {
                set.refused("not a socket address: expected IP:PORT, e.g. 10.0.0.5:9000")
            })?);
        }
        let hosted = Hosted {
            scheduler: hosted_scheduler,
            servers: placed
                .as_ref()
                .map_or_else(Vec::new, |p| p.hosted_servers.clone()),
        };
        let rank =
            match placed {
                Some(p) => Some(p.rank),
                None => match env.get(&["FALCON_RANK"]) {
                    Some(set) => Some(checks::number(&set.value, "").map_err(|_| {
                        set.refused("not a whole number (the rank within the role)")
                    })?),
                    None => None,
                },
            };
        Ok(Launch {
            config: cfg,
            role,
            rank,
            hosted,
        })
    }
}

/// The role: named (FALCON_ROLE, DMLC_ROLE), or placed by a launcher (Slurm, mpirun) from the
/// process's global rank.
fn role_of<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    servers: Option<u32>,
) -> Result<(Role, Option<Placed>), LaunchError> {
    match env.get(&["FALCON_ROLE", "DMLC_ROLE"]) {
        Some(set) => Ok((
            set.value
                .trim()
                .parse::<Role>()
                .map_err(|_| set.refused("not a role: scheduler, server or worker"))?,
            None,
        )),
        None => match launcher_layout(env, servers)? {
            Some(p) => Ok((Role::Worker, Some(p))),
            None => Err(LaunchError::NoRole),
        },
    }
}

/// The scheduler's port, if one is named.
fn scheduler_port<F: Fn(&str) -> Option<String>>(env: &Env<F>) -> Result<Option<u16>, LaunchError> {
    let Some(set) = env.get(&["FALCON_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT", "MASTER_PORT"]) else {
        return Ok(None);
    };
    let p = checks::port(&set.value).map_err(|e| set.refused(e))?;
    // torchrun's agent keeps its own store on MASTER_PORT under its default (static)
    // rendezvous, and tells its ranks so: the scheduler takes the next port, the same on
    // every rank.
    let agent_store = env
        .get(&["TORCHELASTIC_USE_AGENT_STORE"])
        .is_some_and(|s| s.value.trim().eq_ignore_ascii_case("true"));
    if set.var == "MASTER_PORT" && agent_store {
        return Ok(Some(p.checked_add(1).ok_or_else(|| {
            set.refused(
                "torchrun's agent holds this port and falcon's scheduler takes the next one, \
                 past 65535: set FALCON_SCHEDULER_PORT",
            )
        })?));
    }
    Ok(Some(p))
}

/// The job: its name and token, its roles, its policy and update rule.
fn job_config<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    servers: u32,
    workers: u32,
    scheduler: String,
) -> Result<JobConfig, LaunchError> {
    let policy_set = env.get(&["FALCON_POLICY"]);
    let d = JobConfig::default();
    let mut cfg = JobConfig {
        job: env
            .get(&["FALCON_JOB"])
            .map_or_else(|| "falcon".into(), |s| s.value),
        token: env
            .get(&["FALCON_TOKEN"])
            .map(|s| s.value)
            .unwrap_or_default(),
        servers,
        workers,
        scheduler,
        policy: env.value(&["FALCON_POLICY"], PolicySpec::Bsp, str::parse)?,
        optimizer: {
            let lr = env.value(&["FALCON_LR"], DEFAULT_LR, checks::learning_rate)?;
            env.value(&["FALCON_OPTIMIZER"], Optimizer::Sgd { lr }, |s| {
                Optimizer::parse(s, lr)
            })?
        },
        aggregate: env.value(&["FALCON_AGGREGATE"], Aggregate::Mean, |s| {
            match s.trim().to_ascii_lowercase().as_str() {
                "mean" => Ok(Aggregate::Mean),
                "sum" => Ok(Aggregate::Sum),
                _ => Err("not an aggregate of a clock's gradients: mean or sum"),
            }
        })?,
        max_shard_bytes: env.value(
            &["FALCON_MAX_SHARD_BYTES"],
            d.max_shard_bytes,
            checks::shard_bytes,
        )?,
        scale: env.value(&["FALCON_SCALE"], ScaleSpec::Unscaled, str::parse)?,
        fan_out: env.value(&["FALCON_FAN_OUT"], FanOut::Auto, str::parse)?,
        wire: env.value(&["FALCON_WIRE"], crate::precision::Wire::F32, str::parse)?,
        metrics_addr: env.value(&["FALCON_METRICS_ADDR"], None, |s| {
            s.trim()
                .parse::<std::net::SocketAddr>()
                .map(Some)
                .map_err(|_| "not an address to serve metrics on: IP:PORT, e.g. 0.0.0.0:9464")
        })?,
        ..JobConfig::default()
    };
    checks::policy_fits(
        &cfg.policy,
        policy_set.as_ref().map_or("bsp", |s| s.value.as_str()),
        cfg.workers,
    )?;
    // Async policies apply each worker's gradient on its own: lr / workers keeps the step of a
    // round equal to BSP's (mean of W gradients) and delayed-gradient descent stable. The
    // optimizer stays the one configured (momentum and Adam apply per arrival).
    if cfg.update_mode() == UpdateMode::Async {
        let lr = cfg.optimizer.lr() / cfg.workers.max(1) as f32;
        cfg.optimizer = cfg.optimizer.with_lr(lr);
    }
    Ok(cfg)
}

/// Server checkpoints and recovery: a dead server restarts from its checkpoint. A failed
/// checkpoint write warns, or stops the job.
fn checkpoints<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    cfg: &mut JobConfig,
) -> Result<(), LaunchError> {
    let on_failure = env.value(
        &["FALCON_CHECKPOINT_ON_FAILURE"],
        OnCheckpointFailure::default(),
        |s| {
            s.parse::<OnCheckpointFailure>()
                .map_err(|_| "not an action on a failed checkpoint write: warn or stop")
        },
    )?;
    let resume = env.yes_no(
        "FALCON_RESUME",
        false,
        "1 (resume from FALCON_CHECKPOINT_DIR) or 0",
    )?;
    if resume
        && env.get(&["FALCON_CHECKPOINT_DIR"]).is_none()
        && let Some(set) = env.get(&["FALCON_RESUME"])
    {
        return Err(set.refused("there is nothing to resume from: set FALCON_CHECKPOINT_DIR too"));
    }
    if let Some(dir) = env.get(&["FALCON_CHECKPOINT_DIR"]) {
        let c = CheckpointSettings::new(dir.value);
        cfg.checkpoint = Some(CheckpointSettings {
            every: env.millis("FALCON_CHECKPOINT_MS", c.every, checks::checkpoint_ms)?,
            recovery_timeout: env.millis(
                "FALCON_RECOVERY_TIMEOUT_MS",
                c.recovery_timeout,
                checks::timeout_ms,
            )?,
            on_failure,
            resume,
            ..c
        });
    }
    Ok(())
}

/// The heartbeat, the timeouts (FALCON_SUSPICION_MS: 0 never) and the admission wall's caps on
/// connections waiting to prove the job token.
fn timeouts<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    cfg: &mut JobConfig,
) -> Result<(), LaunchError> {
    let d = JobConfig::default();
    cfg.heartbeat = env.millis("FALCON_HEARTBEAT_MS", d.heartbeat, checks::heartbeat_ms)?;
    cfg.suspicion = match env.millis(
        "FALCON_SUSPICION_MS",
        DEFAULT_SUSPICION,
        checks::suspicion_ms,
    )? {
        Duration::ZERO => None,
        s => Some(s),
    };
    cfg.rendezvous_timeout = env.millis(
        "FALCON_RENDEZVOUS_TIMEOUT_MS",
        d.rendezvous_timeout,
        checks::timeout_ms,
    )?;
    cfg.transport.op_timeout = env.millis(
        "FALCON_OP_TIMEOUT_MS",
        d.transport.op_timeout,
        checks::timeout_ms,
    )?;
    cfg.transport.handshake_timeout = env.millis(
        "FALCON_HANDSHAKE_TIMEOUT_MS",
        d.transport.handshake_timeout,
        checks::timeout_ms,
    )?;
    cfg.spin_auto = env.get(&["FALCON_SPIN_US"]).is_none();
    cfg.transport.spin = Duration::from_micros(env.value(
        &["FALCON_SPIN_US"],
        d.transport.spin.as_micros() as u64,
        checks::spin_us,
    )?);
    cfg.helper_threads = env.value(&["FALCON_HELPER_THREADS"], cfg.helper_threads, |s| {
        checks::helper_threads(s).map(Some)
    })?;
    cfg.transport.tcp_streams = env.value(
        &["FALCON_TCP_STREAMS"],
        cfg.transport.tcp_streams,
        checks::tcp_streams,
    )?;
    checks::suspicion_fits(cfg.heartbeat, cfg.suspicion)?;
    cfg.transport.max_handshakes = env.value(
        &["FALCON_MAX_HANDSHAKES"],
        cfg.transport.max_handshakes,
        checks::at_least_one_usize,
    )?;
    cfg.transport.max_handshakes_per_source = env.value(
        &["FALCON_MAX_HANDSHAKES_PER_SOURCE"],
        cfg.transport.max_handshakes_per_source,
        checks::at_least_one_usize,
    )?;
    cfg.transport.max_accepted_message = env.value(
        &["FALCON_MAX_CONTROL_BYTES"],
        cfg.transport.max_accepted_message,
        |s| checks::at_least_one_u64(s).map(|n| n.max(64 << 10)),
    )?;
    Ok(())
}

/// Where this process listens: the scheduler on its advertised address; other roles on any
/// port of their interface (FALCON_NODE_HOST / DMLC_NODE_HOST), or FALCON_BIND.
fn bind_address<F: Fn(&str) -> Option<String>>(
    env: &Env<F>,
    role: Role,
    (uri, port): (&Option<SchedulerHost>, Option<u16>),
    scheduler_tcp: Option<SocketAddr>,
) -> Result<SocketAddr, LaunchError> {
    if let (Role::Scheduler, Some(u), Some(p)) = (role, uri, port) {
        return resolve(&u.host, p).map_err(|e| u.from.refused(e));
    }
    Ok(match (env.get(&["FALCON_BIND"]), role, scheduler_tcp) {
        (Some(set), _, _) => socket_address(&set.value).map_err(|e| set.refused(e))?,
        (None, Role::Scheduler, Some(addr)) => addr,
        _ => match env.get(&["FALCON_NODE_HOST", "DMLC_NODE_HOST"]) {
            Some(set) => resolve(set.value.trim(), 0).map_err(|e| set.refused(e))?,
            None => match uri {
                Some(u) => resolve(&u.host, 0).map_err(|e| u.from.refused(e))?,
                None => SocketAddr::from(([127, 0, 0, 1], 0)),
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::BTreeSet;

    fn launch(vars: &[(&str, &str)]) -> Result<Launch, LaunchError> {
        Launch::from_vars(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    fn refused(vars: &[(&str, &str)]) -> String {
        let e = launch(vars).expect_err("refused").to_string();
        assert!(
            !e.contains("Some(") && !e.contains("None") && !e.contains('"'),
            "no Rust debug output: {e}"
        );
        e
    }

    const LOCAL: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        0,
    ));

    #[test]
    fn ps_lite_variables_configure_a_role() {
        let l = launch(&[
            ("DMLC_ROLE", "server"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", "9000"),
            ("DMLC_NUM_SERVER", "2"),
            ("DMLC_NUM_WORKER", "3"),
            ("DMLC_NODE_HOST", "127.0.0.1"),
        ])
        .unwrap();
        assert_eq!(l.role, Role::Server);
        assert_eq!(l.rank, None);
        assert_eq!(l.config.servers, 2);
        assert_eq!(l.config.workers, 3);
        assert_eq!(l.config.scheduler, "host=remote;tcp=127.0.0.1:9000");
        assert_eq!(l.config.transport.bind, Some(LOCAL));
        // The defaults.
        let d = JobConfig::default();
        assert_eq!(l.config.job, "falcon");
        assert_eq!(l.config.token, "");
        assert_eq!(l.config.policy, PolicySpec::Bsp);
        assert_eq!(l.config.optimizer.lr(), DEFAULT_LR);
        assert_eq!(l.config.max_shard_bytes, d.max_shard_bytes);
        assert_eq!(l.config.heartbeat, d.heartbeat);
        assert!(l.config.spin_auto);
        assert!(l.config.shm_in_place);
        assert_eq!(l.config.helper_threads, None);
        assert_eq!(l.config.suspicion, Some(DEFAULT_SUSPICION));
        assert_eq!(l.config.rendezvous_timeout, d.rendezvous_timeout);
        assert_eq!(l.config.transport.op_timeout, d.transport.op_timeout);
        assert_eq!(
            l.config.transport.handshake_timeout,
            d.transport.handshake_timeout
        );
        assert_eq!(l.config.transport.medium, Medium::Auto);
        assert_eq!(l.config.transport.advertise, None);
        assert!(l.config.checkpoint.is_none());
        // The scheduler listens on the address the others are given.
        let s = launch(&[
            ("DMLC_ROLE", "scheduler"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_PORT", "9000"),
        ])
        .unwrap();
        assert_eq!(s.role, Role::Scheduler);
        assert_eq!(
            s.config.transport.bind,
            Some("127.0.0.1:9000".parse().unwrap())
        );
    }

    #[test]
    fn falcon_names_win_over_their_aliases_and_empty_is_unset() {
        let l = launch(&[
            ("FALCON_ROLE", "Worker"),
            ("DMLC_ROLE", "server"),
            ("FALCON_RANK", "3"),
            ("FALCON_NUM_WORKER", "4"),
            ("DMLC_NUM_WORKER", "9"),
            ("FALCON_NUM_SERVER", ""),
            ("DMLC_NUM_SERVER", "2"),
            ("FALCON_SCHEDULER_URI", "127.0.0.1"),
            ("DMLC_PS_ROOT_URI", "10.9.9.9"),
            ("FALCON_SCHEDULER_PORT", "7000"),
            ("MASTER_PORT", "8000"),
            ("FALCON_JOB", "j"),
            ("FALCON_TOKEN", "t"),
        ])
        .unwrap();
        assert_eq!(l.role, Role::Worker);
        assert_eq!(l.rank, Some(3));
        assert_eq!((l.config.servers, l.config.workers), (2, 4));
        assert_eq!(l.config.scheduler, "host=remote;tcp=127.0.0.1:7000");
        assert_eq!((l.config.job.as_str(), l.config.token.as_str()), ("j", "t"));
    }

    #[test]
    fn every_setting_is_read() {
        let l = launch(&[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
            ("FALCON_NUM_WORKER", "4"),
            ("FALCON_POLICY", "ssp(2)"),
            ("FALCON_LR", "0.4"),
            ("FALCON_SCALE", "dynsgd"),
            ("FALCON_MAX_SHARD_BYTES", "4096"),
            ("FALCON_FAN_OUT", " Off"),
            ("FALCON_WIRE", "bf16"),
            ("FALCON_METRICS_ADDR", "127.0.0.1:9464"),
            ("FALCON_MEDIUM", "tcp"),
            ("FALCON_HEARTBEAT_MS", "100"),
            ("FALCON_SUSPICION_MS", "0"),
            ("FALCON_RENDEZVOUS_TIMEOUT_MS", "1500"),
            ("FALCON_OP_TIMEOUT_MS", "2500"),
            ("FALCON_HANDSHAKE_TIMEOUT_MS", "300"),
            ("FALCON_SPIN_US", "0"),
            ("FALCON_SHM_IN_PLACE", "Off"),
            ("FALCON_HELPER_THREADS", "2"),
            ("FALCON_MAX_HANDSHAKES", "7"),
            ("FALCON_MAX_HANDSHAKES_PER_SOURCE", "3"),
            ("FALCON_CHECKPOINT_DIR", "/tmp/ckpt"),
            ("FALCON_CHECKPOINT_MS", "100"),
            ("FALCON_RESUME", "yes"),
            ("FALCON_RECOVERY_TIMEOUT_MS", "2000"),
            ("FALCON_CHECKPOINT_ON_FAILURE", "stop"),
            ("FALCON_BIND", "127.0.0.1:5555"),
            ("FALCON_ADVERTISE", "10.0.0.5:5555"),
        ])
        .unwrap();
        let c = &l.config;
        assert_eq!(c.policy, "ssp(2)".parse().unwrap());
        // An asynchronous policy applies each of the 4 workers' gradients with lr / 4.
        assert_eq!(c.optimizer.lr(), 0.1);
        assert_eq!(c.scale, "dynsgd".parse().unwrap());
        assert_eq!(c.max_shard_bytes, 4096);
        assert_eq!(c.fan_out, FanOut::Off);
        assert_eq!(c.wire, crate::precision::Wire::Bf16);
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(c.transport.medium, Medium::Tcp);
        assert_eq!(c.heartbeat, Duration::from_millis(100));
        assert_eq!(c.suspicion, None);
        assert_eq!(c.rendezvous_timeout, Duration::from_millis(1500));
        assert_eq!(c.transport.op_timeout, Duration::from_millis(2500));
        assert_eq!(c.transport.handshake_timeout, Duration::from_millis(300));
        assert_eq!(c.transport.spin, Duration::ZERO);
        assert!(
            !c.spin_auto,
            "a spin the user set holds on a crowded host too"
        );
        assert!(!c.shm_in_place);
        assert_eq!(c.helper_threads, Some(2));
        assert_eq!(c.transport.max_handshakes, 7);
        assert_eq!(c.transport.max_handshakes_per_source, 3);
        assert_eq!(
            c.checkpoint,
            Some(CheckpointSettings {
                dir: "/tmp/ckpt".into(),
                every: Duration::from_millis(100),
                recovery_timeout: Duration::from_millis(2000),
                on_failure: OnCheckpointFailure::Stop,
                resume: true,
            })
        );
        assert_eq!(c.transport.bind, Some("127.0.0.1:5555".parse().unwrap()));
        assert_eq!(
            c.transport.advertise,
            Some("10.0.0.5:5555".parse().unwrap())
        );
        // BSP keeps the learning rate as given.
        let l = launch(&[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "127.0.0.1:9"),
            ("FALCON_NUM_WORKER", "4"),
            ("FALCON_LR", "0.4"),
        ])
        .unwrap();
        assert_eq!(l.config.optimizer.lr(), 0.4);
        // An asynchronous policy divides the rate by the workers and keeps the optimizer.
        let l = launch(&[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "127.0.0.1:9"),
            ("FALCON_NUM_WORKER", "4"),
            ("FALCON_POLICY", "ssp(3)"),
            ("FALCON_OPTIMIZER", "adam(0.8,0.99,1e-6)"),
            ("FALCON_LR", "0.4"),
        ])
        .unwrap();
        assert_eq!(
            l.config.optimizer,
            Optimizer::Adam {
                lr: 0.1,
                beta1: 0.8,
                beta2: 0.99,
                eps: 1e-6,
                wd: 0.0,
            }
        );
    }

    #[test]
    fn under_torchruns_agent_store_the_scheduler_takes_the_next_port() {
        let vars = |store: &'static str| {
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", store),
            ]
        };
        let l = launch(&vars("True")).unwrap();
        assert!(
            l.config.scheduler.ends_with(":29501"),
            "{}",
            l.config.scheduler
        );
        let l = launch(&vars("False")).unwrap();
        assert!(
            l.config.scheduler.ends_with(":29500"),
            "{}",
            l.config.scheduler
        );
        // A port named for falcon is taken as it is.
        let mut v = vars("True");
        v.push(("FALCON_SCHEDULER_PORT", "7000"));
        assert!(launch(&v).unwrap().config.scheduler.ends_with(":7000"));
    }

    #[test]
    fn launchers_ranks_are_workers_and_host_the_other_roles() {
        // torchrun, 2 nodes of 3: every rank the worker of its rank; rank 0 hosts the
        // scheduler, each node's first rank a server.
        let torchrun = |rank: &str, extra: &[(&'static str, &'static str)]| {
            let mut v = vec![
                ("RANK", rank),
                ("WORLD_SIZE", "6"),
                ("LOCAL_WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
            ];
            v.extend_from_slice(extra);
            launch(&v).unwrap()
        };
        let placed: Vec<(Role, Option<u32>, bool, Vec<u32>)> = ["0", "1", "2", "3", "4", "5"]
            .iter()
            .map(|r| {
                let l = torchrun(r, &[]);
                (
                    l.role,
                    l.rank,
                    l.hosted.scheduler.is_some(),
                    l.hosted.servers,
                )
            })
            .collect();
        assert_eq!(
            placed,
            [
                (Role::Worker, Some(0), true, vec![0]),
                (Role::Worker, Some(1), false, vec![]),
                (Role::Worker, Some(2), false, vec![]),
                (Role::Worker, Some(3), false, vec![1]),
                (Role::Worker, Some(4), false, vec![]),
                (Role::Worker, Some(5), false, vec![]),
            ]
        );
        let w = torchrun("4", &[]);
        assert_eq!((w.config.servers, w.config.workers), (2, 6));
        assert_eq!(w.config.scheduler, "host=remote;tcp=127.0.0.1:29500");
        assert!(w.hosted.scheduler.is_none());
        // The hosted scheduler listens on the job's address; the worker beside it does not.
        let r0 = torchrun("0", &[]);
        assert_eq!(
            r0.hosted.scheduler.unwrap().transport.bind,
            Some("127.0.0.1:29500".parse().unwrap())
        );
        assert_eq!(r0.config.transport.bind, Some(LOCAL));
        // More servers than nodes go round the nodes.
        let four = |r| torchrun(r, &[("FALCON_NUM_SERVER", "4")]).hosted.servers;
        assert_eq!(
            (four("0"), four("3"), four("1")),
            (vec![0, 2], vec![1, 3], vec![])
        );
        // Hosting nothing: the scheduler and the servers were started apart.
        let apart = torchrun("0", &[("FALCON_HOST_ROLES", "0")]);
        assert!(apart.hosted.is_empty());
        assert_eq!((apart.role, apart.rank), (Role::Worker, Some(0)));
        // No node size named: one node, everything on rank 0.
        let l = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((l.config.servers, l.config.workers), (1, 4));
        assert!(l.hosted.scheduler.is_some() && l.hosted.servers == [0]);
        // Slurm names hosts and no port: the first node, falcon's default port.
        let l = launch(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "localhost,node[2-3]"),
        ])
        .unwrap();
        assert_eq!((l.role, l.rank), (Role::Worker, Some(2)));
        assert_eq!(l.config.workers, 4);
        let tcp = scheduler_address(&l.config.scheduler).unwrap().tcp.unwrap();
        assert!(tcp.ip().is_loopback(), "{tcp}");
        assert_eq!(tcp.port(), DEFAULT_SCHEDULER_PORT);
        // Open MPI names neither: FALCON_SCHEDULER_URI does.
        let l = launch(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("FALCON_SCHEDULER_URI", "127.0.0.1"),
        ])
        .unwrap();
        assert_eq!(
            (l.role, l.rank, l.hosted.is_empty()),
            (Role::Worker, Some(1), true)
        );
        assert_eq!(l.config.scheduler, "host=remote;tcp=127.0.0.1:9091");
        // Slurm's nodes: 8 tasks on 2 nodes, 4 on each; task 4 hosts the second server.
        let slurm = |rank: &'static str| {
            launch(&[
                ("SLURM_PROCID", rank),
                ("SLURM_NTASKS", "8"),
                ("SLURM_NNODES", "2"),
                ("SLURM_JOB_NODELIST", "localhost"),
            ])
            .unwrap()
        };
        assert_eq!(slurm("4").hosted.servers, [1]);
        assert_eq!(slurm("4").config.servers, 2);
        assert!(slurm("3").hosted.is_empty());
        // An explicit role wins over the launcher's rank.
        let l = launch(&[
            ("DMLC_ROLE", "worker"),
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("FALCON_SCHEDULER", "127.0.0.1:9"),
        ])
        .unwrap();
        assert_eq!((l.role, l.rank, l.config.workers), (Role::Worker, None, 1));
    }

    #[test]
    fn a_plain_scheduler_address_is_where_the_scheduler_listens() {
        let l = launch(&[
            ("FALCON_ROLE", "scheduler"),
            ("FALCON_SCHEDULER", "127.0.0.1:7000"),
        ])
        .unwrap();
        assert_eq!(
            l.config.transport.bind,
            Some("127.0.0.1:7000".parse().unwrap())
        );
        let l = launch(&[
            ("FALCON_ROLE", "scheduler"),
            ("FALCON_SCHEDULER", "127.0.0.1:7000"),
            ("FALCON_BIND", "127.0.0.1:7001"),
        ])
        .unwrap();
        assert_eq!(
            l.config.transport.bind,
            Some("127.0.0.1:7001".parse().unwrap())
        );
        // The transport's text form keeps its meaning: not the scheduler's own address.
        let l = launch(&[
            ("FALCON_ROLE", "scheduler"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:7000"),
        ])
        .unwrap();
        assert_eq!(l.config.transport.bind, Some(LOCAL));
        let w = launch(&[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "127.0.0.1:7000"),
        ])
        .unwrap();
        assert_eq!(w.config.scheduler, "host=remote;tcp=127.0.0.1:7000");
        assert_eq!(w.config.transport.bind, Some(LOCAL));
    }

    #[test]
    fn refusals_name_the_variable_the_value_and_what_is_allowed() {
        let worker = [
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "127.0.0.1:9"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = worker.to_vec();
            v.extend_from_slice(extra);
            refused(&v)
        };
        assert!(refused(&[]).starts_with("no role: set FALCON_ROLE (or DMLC_ROLE)"));
        assert!(
            refused(&[("FALCON_ROLE", "worker")]).starts_with("no scheduler: set FALCON_SCHEDULER")
        );
        assert_eq!(
            refused(&[("DMLC_ROLE", "boss")]),
            "DMLC_ROLE=boss: not a role: scheduler, server or worker"
        );
        assert_eq!(
            with(&[("DMLC_NUM_SERVER", "0")]),
            "DMLC_NUM_SERVER=0: the count must be at least 1; 0 is not"
        );
        assert_eq!(
            with(&[("FALCON_WIRE", "int8")]),
            "FALCON_WIRE=int8: not a wire precision: f32, bf16 or f16"
        );
        assert_eq!(
            with(&[("FALCON_RESUME", "1")]),
            "FALCON_RESUME=1: there is nothing to resume from: set FALCON_CHECKPOINT_DIR too"
        );
        assert_eq!(
            with(&[
                ("FALCON_RESUME", "maybe"),
                ("FALCON_CHECKPOINT_DIR", "/tmp/c")
            ]),
            "FALCON_RESUME=maybe: not a yes or no: 1 (resume from FALCON_CHECKPOINT_DIR) or 0"
        );
        assert_eq!(
            with(&[("FALCON_SHM_IN_PLACE", "2")]),
            "FALCON_SHM_IN_PLACE=2: not a yes or no: 1 (over shm a large gradient is read where \
             the worker holds it) or 0 (copied into the slot)"
        );
        assert_eq!(
            with(&[("FALCON_METRICS_ADDR", "localhost")]),
            "FALCON_METRICS_ADDR=localhost: not an address to serve metrics on: IP:PORT, e.g. \
             0.0.0.0:9464"
        );
        assert_eq!(
            with(&[("FALCON_FAN_OUT", "maybe")]),
            "FALCON_FAN_OUT=maybe: not a fan-out setting: auto, on or off"
        );
        assert_eq!(
            with(&[("FALCON_NUM_WORKER", "two")]),
            "FALCON_NUM_WORKER=two: not a whole number"
        );
        assert_eq!(
            with(&[("FALCON_LR", "nan")]),
            "FALCON_LR=nan: the learning rate must be a finite number greater than 0 (e.g. 0.05); nan is not"
        );
        assert_eq!(
            with(&[("FALCON_HEARTBEAT_MS", "5")]),
            "FALCON_HEARTBEAT_MS=5: the heartbeat interval must be at least 10 ms; 5 ms is not"
        );
        assert_eq!(
            with(&[("FALCON_OP_TIMEOUT_MS", "0")]),
            "FALCON_OP_TIMEOUT_MS=0: a timeout must be at least 1 ms (0 would give up at once); 0 ms is not"
        );
        assert_eq!(
            with(&[("FALCON_SPIN_US", "20000")]),
            "FALCON_SPIN_US=20000: a spin must be 0 to 10000 µs (longer burns a core for nothing); 20000 µs is not"
        );
        assert_eq!(
            with(&[("FALCON_HELPER_THREADS", "17")]),
            "FALCON_HELPER_THREADS=17: a number of helper threads must be 0 to 16; 17 is not"
        );
        assert_eq!(
            with(&[("FALCON_HELPER_THREADS", "-1")]),
            "FALCON_HELPER_THREADS=-1: not a whole number of threads"
        );
        assert!(
            with(&[
                ("FALCON_HEARTBEAT_MS", "1000"),
                ("FALCON_SUSPICION_MS", "500")
            ])
            .contains("the suspicion timeout must be longer than the heartbeat interval")
        );
        assert!(
            with(&[("FALCON_POLICY", "syncopt(2)"), ("FALCON_NUM_WORKER", "2")])
                .contains("policy syncopt(2) with 2 worker(s): the backups must be fewer")
        );
        assert!(with(&[("FALCON_POLICY", "nope")]).starts_with("FALCON_POLICY=nope: "));
        assert_eq!(
            with(&[("FALCON_MEDIUM", "pigeon")]),
            "FALCON_MEDIUM=pigeon: not a medium: auto, shm, tcp or rdma"
        );
        assert_eq!(
            with(&[("FALCON_CHECKPOINT_ON_FAILURE", "panic")]),
            "FALCON_CHECKPOINT_ON_FAILURE=panic: not an action on a failed checkpoint write: warn or stop"
        );
        assert_eq!(
            with(&[
                ("FALCON_CHECKPOINT_DIR", "/tmp/x"),
                ("FALCON_CHECKPOINT_MS", "1")
            ]),
            "FALCON_CHECKPOINT_MS=1: the checkpoint interval must be at least 10 ms; 1 ms is not"
        );
        assert_eq!(
            with(&[("FALCON_RANK", "-1")]),
            "FALCON_RANK=-1: not a whole number (the rank within the role)"
        );
        assert_eq!(
            with(&[("FALCON_BIND", "127.0.0.1")]),
            "FALCON_BIND=127.0.0.1: no port: expected HOST:PORT, IP:PORT or host=ID;tcp=IP:PORT"
        );
        assert_eq!(
            with(&[("FALCON_ADVERTISE", "nowhere")]),
            "FALCON_ADVERTISE=nowhere: not a socket address: expected IP:PORT, e.g. 10.0.0.5:9000"
        );
        assert_eq!(
            refused(&[
                ("FALCON_ROLE", "worker"),
                ("FALCON_SCHEDULER", "127.0.0.1:99999")
            ]),
            "FALCON_SCHEDULER=127.0.0.1:99999: 99999 is not a port (a whole number from 0 to 65535)"
        );
        assert!(
            refused(&[("FALCON_ROLE", "worker"), ("FALCON_SCHEDULER", "host=x")])
                .starts_with("FALCON_SCHEDULER=host=x: ")
        );
        assert_eq!(
            refused(&[
                ("FALCON_ROLE", "worker"),
                ("DMLC_PS_ROOT_URI", "127.0.0.1"),
                ("DMLC_PS_ROOT_PORT", "http"),
            ]),
            "DMLC_PS_ROOT_PORT=http: not a port (a whole number from 0 to 65535)"
        );
        assert_eq!(
            refused(&[("RANK", "first"), ("WORLD_SIZE", "4")]),
            "RANK=first: not a whole number (the launcher's global rank)"
        );
        assert_eq!(
            refused(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "n")]),
            "SLURM_NTASKS=n: not a whole number (the launcher's world size)"
        );
        assert_eq!(
            refused(&[
                ("RANK", "4"),
                ("WORLD_SIZE", "4"),
                ("MASTER_ADDR", "127.0.0.1")
            ]),
            "RANK=4 with WORLD_SIZE=4: the rank must be below the world size (each rank is a worker)"
        );
        assert_eq!(
            refused(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_WORLD_SIZE", "8"),
                ("MASTER_ADDR", "127.0.0.1")
            ]),
            "LOCAL_WORLD_SIZE=8: the ranks on each node are 1 to the world size (4)"
        );
        assert_eq!(
            refused(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "4"),
                ("FALCON_HOST_ROLES", "maybe"),
                ("MASTER_ADDR", "127.0.0.1")
            ]),
            "FALCON_HOST_ROLES=maybe: not a yes or no: 1 (rank 0 hosts the scheduler and each \
             node's first rank servers, on threads) or 0 (the scheduler and the servers run apart, \
             as `falcon role` processes)"
        );
        // A launcher that names no scheduler host (mpirun) needs FALCON_SCHEDULER_URI.
        assert!(
            refused(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "3")])
                .starts_with("no scheduler")
        );
        let e = refused(&[
            ("FALCON_ROLE", "worker"),
            ("MASTER_ADDR", "no-such-host.invalid"),
            ("FALCON_SCHEDULER_URI", "no-such-host.invalid"),
            ("FALCON_SCHEDULER_PORT", "9000"),
        ]);
        assert!(
            e.starts_with("FALCON_SCHEDULER_URI=no-such-host.invalid: cannot resolve no-such-host.invalid:9000"),
            "{e}"
        );
    }

    #[test]
    fn scheduler_addresses_may_be_host_and_port() {
        let a = scheduler_address("10.1.2.3:9000").unwrap();
        assert_eq!(
            a,
            PeerAddr {
                host: "remote".into(),
                tcp: Some("10.1.2.3:9000".parse().unwrap()),
                shm: None,
            }
        );
        // Its text is the transport's form, read back the same.
        assert_eq!(a.to_string(), "host=remote;tcp=10.1.2.3:9000");
        assert_eq!(scheduler_address(&a.to_string()).unwrap(), a);
        assert_eq!(
            scheduler_address(" [::1]:9000 ").unwrap().tcp,
            Some("[::1]:9000".parse().unwrap())
        );
        // A host name that resolves; IPv4 first.
        let l = scheduler_address("localhost:9000").unwrap();
        assert_eq!(l.host, "remote");
        let tcp = l.tcp.unwrap();
        assert!(tcp.ip().is_loopback() && tcp.port() == 9000, "{tcp}");
        // The transport's text form, as before.
        let p = scheduler_address("host=n1-abc;tcp=10.0.0.1:9000;shm=/run/falcon/x.sock").unwrap();
        assert_eq!(p.host, "n1-abc");
        assert_eq!(p.shm, Some("/run/falcon/x.sock".into()));
        assert_eq!(
            scheduler_address("node01").unwrap_err(),
            AddressError::NoPort
        );
        assert_eq!(
            scheduler_address(":9000").unwrap_err(),
            AddressError::NoPort
        );
        assert_eq!(
            scheduler_address("node01:http").unwrap_err(),
            AddressError::BadPort {
                port: "http".into()
            }
        );
        assert!(matches!(
            scheduler_address("no-such-host.invalid:9000").unwrap_err(),
            AddressError::Unresolved { port: 9000, .. }
        ));
        let e = scheduler_address("host=x").unwrap_err();
        assert!(matches!(e, AddressError::PeerAddr(_)), "{e}");
        assert!(
            e.to_string()
                .ends_with("(expected HOST:PORT, IP:PORT or host=ID;tcp=IP:PORT)")
        );
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07],gpu5"), "node01");
        assert_eq!(first_host("gpu5,node[1-2]"), "gpu5");
        assert_eq!(first_host("single"), "single");
        assert_eq!(first_host("n[7]"), "n7");
    }

    /// `VARIABLES` is exactly what `from_vars` asks for, over every branch.
    #[test]
    fn the_variables_listed_are_the_variables_read() {
        let asked = RefCell::new(BTreeSet::new());
        let run = |vars: &[(&str, &str)]| {
            let _ = Launch::from_vars(|name| {
                asked.borrow_mut().insert(name.to_string());
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            });
        };
        // No role, no launcher: every launcher's variables.
        run(&[]);
        // A role, ps-lite's names (each FALCON_* name unset, so its alias is read), with
        // checkpoints.
        run(&[
            ("DMLC_ROLE", "worker"),
            ("DMLC_PS_ROOT_URI", "127.0.0.1"),
            ("MASTER_PORT", "9000"),
            ("FALCON_CHECKPOINT_DIR", "/tmp/x"),
        ]);
        run(&[("RANK", "1"), ("WORLD_SIZE", "3"), ("MASTER_PORT", "9000")]);
        run(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "3")]);
        run(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "3")]);
        let listed: BTreeSet<String> = VARIABLES.iter().map(|v| v.to_string()).collect();
        assert_eq!(listed.len(), VARIABLES.len(), "no duplicates");
        assert_eq!(asked.into_inner(), listed);
    }
}
