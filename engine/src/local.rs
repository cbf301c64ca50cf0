//! The embedded local cluster, in-process: a scheduler and the servers on threads of this
//! process, the workers as handles. For tests and for programs that embed falcon; the
//! multi-process form is `falcon local`.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::TensorSpec;
use crate::scheduler::{Scheduler, SchedulerReport};
use crate::server::{Server, ServerHooks, ServerReport};
use crate::worker::Worker;

/// A running in-process cluster.
pub struct LocalCluster {
    /// One handle per worker, by rank.
    pub workers: Vec<Worker>,
    scheduler: JoinHandle<Result<SchedulerReport>>,
    servers: Vec<JoinHandle<Result<ServerReport>>>,
    failures: FirstFailure,
}

/// A role of an in-process cluster that failed: its error, or its thread's panic.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RoleFailure {
    /// The role ended with an error.
    #[error("{role} {rank} failed: {error}")]
    Failed {
        /// `scheduler`, `server` or `worker`.
        role: &'static str,
        /// Its rank.
        rank: u32,
        /// What it reported.
        error: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// The role's thread panicked.
    #[error("{role} {rank} panicked: {message}")]
    Panicked {
        /// `scheduler`, `server` or `worker`.
        role: &'static str,
        /// Its rank.
        rank: u32,
        /// The panic's message.
        message: String,
    },
}

impl RoleFailure {
    /// A role's error.
    pub fn failed(
        role: &'static str,
        rank: u32,
        error: impl std::error::Error + Send + Sync + 'static,
    ) -> RoleFailure {
        RoleFailure::Failed {
            role,
            rank,
            error: Arc::new(error),
        }
    }

    /// A role's panic, from the payload `catch_unwind` or `JoinHandle::join` gave.
    pub fn panicked(role: &'static str, rank: u32, payload: &(dyn Any + Send)) -> RoleFailure {
        RoleFailure::Panicked {
            role,
            rank,
            message: panic_message(payload),
        }
    }
}

/// The message of a panic's payload (`panic!` with a literal or a formatted message).
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// The first role failure of a cluster, shared by its role threads (and whatever runs the
/// workers, which records theirs with [`FirstFailure::record`]): the cause of a failed job,
/// not the failures that followed from it.
#[derive(Clone, Debug, Default)]
pub struct FirstFailure(Arc<Mutex<Option<RoleFailure>>>);

impl FirstFailure {
    /// Records `f` unless a failure is recorded already; true when it was the first.
    pub fn record(&self, f: RoleFailure) -> bool {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return false;
        }
        tracing::debug!("first role failure: {f}");
        *slot = Some(f);
        true
    }

    /// The first failure, if any.
    pub fn get(&self) -> Option<RoleFailure> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Runs a role's body on this thread, recording its error or panic in `failures` (a panic
/// goes on unwinding after, so that the thread's join still sees it).
fn run_role<T>(
    failures: &FirstFailure,
    role: &'static str,
    rank: u32,
    body: impl FnOnce() -> Result<T>,
) -> Result<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            failures.record(RoleFailure::failed(role, rank, e.clone()));
            Err(e)
        }
        Err(payload) => {
            failures.record(RoleFailure::panicked(role, rank, &*payload));
            std::panic::resume_unwind(payload)
        }
    }
}

/// The scheduler's thread, its error or panic recorded in `failures`.
fn spawn_scheduler(
    sched: Scheduler,
    failures: &FirstFailure,
) -> Result<JoinHandle<Result<SchedulerReport>>> {
    let failures = failures.clone();
    std::thread::Builder::new()
        .name("falcon-scheduler".into())
        .spawn(move || run_role(&failures, "scheduler", 0, || sched.run()))
        .map_err(|e| Error::os("cannot start the scheduler's thread", e))
}

/// Server `r`'s thread (joining the job of `cfg`), its error or panic recorded in `failures`.
fn spawn_server(
    cfg: &JobConfig,
    r: u32,
    hooks: &ServerHooks,
    failures: &FirstFailure,
) -> Result<JoinHandle<Result<ServerReport>>> {
    let (cfg, hooks, failures) = (cfg.clone(), hooks.clone(), failures.clone());
    std::thread::Builder::new()
        .name(format!("falcon-server-{r}"))
        .spawn(move || {
            run_role(&failures, "server", r, || {
                Server::join(cfg, Some(r), hooks)?.run()
            })
        })
        .map_err(|e| Error::os(format!("cannot start the thread of server {r}"), e))
}

/// What a finished cluster reports.
#[derive(Debug)]
pub struct LocalReport {
    /// The scheduler's report.
    pub scheduler: SchedulerReport,
    /// Each server's report, by rank.
    pub servers: Vec<ServerReport>,
}

impl LocalReport {
    /// The final values of `tensor`, gathered from the servers' shards.
    pub fn tensor(&self, keymap: &crate::keys::KeyMap, name: &str) -> Result<Vec<f32>> {
        let t = keymap.tensor(name)?;
        let mut out = vec![0f32; keymap.tensors[t].len as usize];
        for s in keymap.shards_of(t) {
            let vals = self
                .servers
                .iter()
                .find_map(|r| r.params.get(&s.id))
                .ok_or_else(|| Error::Config(format!("no server reported shard {}", s.id)))?;
            out[s.offset as usize..(s.offset + s.len) as usize].copy_from_slice(vals);
        }
        Ok(out)
    }
}

fn join<T>(h: JoinHandle<Result<T>>, role: &'static str, rank: u32) -> Result<T> {
    h.join().map_err(|payload| Error::PeerGone {
        role,
        rank,
        why: format!("its thread panicked: {}", panic_message(&*payload)),
    })?
}

/// A failure as the engine's error, for the callers of [`LocalCluster::start`].
fn gone(f: RoleFailure) -> Error {
    match f {
        RoleFailure::Failed { role, rank, error } => Error::PeerGone {
            role,
            rank,
            why: format!("it failed: {error}"),
        },
        RoleFailure::Panicked {
            role,
            rank,
            message,
        } => Error::PeerGone {
            role,
            rank,
            why: format!("its thread panicked: {message}"),
        },
    }
}

impl LocalCluster {
    /// Starts a scheduler, `cfg.servers` servers and `cfg.workers` workers training `tensors`.
    pub fn start(cfg: JobConfig, tensors: Vec<TensorSpec>) -> Result<LocalCluster> {
        Self::start_with(cfg, tensors, ServerHooks::default())
    }

    /// As `start`, with server hooks (learning-rate schedule, gradient scaling).
    pub fn start_with(
        mut cfg: JobConfig,
        tensors: Vec<TensorSpec>,
        hooks: ServerHooks,
    ) -> Result<LocalCluster> {
        let failures = FirstFailure::default();
        let sched = Scheduler::bind(cfg.clone())?;
        cfg.scheduler = sched.address();
        let scheduler = spawn_scheduler(sched, &failures)?;
        let servers = (0..cfg.servers)
            .map(|r| spawn_server(&cfg, r, &hooks, &failures))
            .collect::<Result<Vec<_>>>()?;
        let joining = (0..cfg.workers)
            .map(|r| {
                let (cfg, tensors, failures) = (cfg.clone(), tensors.clone(), failures.clone());
                std::thread::Builder::new()
                    .name(format!("falcon-join-{r}"))
                    .spawn(move || {
                        run_role(&failures, "worker", r, || {
                            Worker::join(&cfg, tensors, Some(r))
                        })
                    })
                    .map_err(|e| Error::os(format!("cannot start the thread of worker {r}"), e))
            })
            .collect::<Result<Vec<_>>>()?;
        // Wait for the workers to join; a role that fails meanwhile (a server that cannot
        // start, say) fails the start at once instead of after the rendezvous timeout.
        while !joining.iter().all(JoinHandle::is_finished) {
            if let Some(f) = failures.get() {
                return Err(gone(f));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut workers = Vec::new();
        for (r, h) in joining.into_iter().enumerate() {
            workers.push(join(h, "worker", r as u32)?);
        }
        Ok(LocalCluster {
            workers,
            scheduler,
            servers,
            failures,
        })
    }

    /// The first failure of a role (the scheduler, a server, a worker's join, or what was
    /// recorded in [`LocalCluster::failures`]), if any so far.
    pub fn failure(&self) -> Option<RoleFailure> {
        self.failures.get()
    }

    /// The cluster's record of its first role failure: whatever runs the workers records
    /// their errors and panics there, so that the cause of a failed job is known.
    pub fn failures(&self) -> &FirstFailure {
        &self.failures
    }

    /// Tells every worker it is done and waits at most `limit` for the scheduler and the
    /// servers to finish; threads still running then are left to end on their own (a job
    /// that failed should not wait on roles its failure may have stranded).
    pub fn finish_within(self, limit: Duration) -> Result<LocalReport> {
        for w in &self.workers {
            let _ = w.finish();
        }
        let start = Instant::now();
        while !(self.scheduler.is_finished() && self.servers.iter().all(|h| h.is_finished())) {
            if start.elapsed() >= limit {
                return Err(Error::Timeout("the cluster's shutdown", limit));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.finish()
    }

    /// Tells every worker it is done and waits for the scheduler and servers to finish.
    pub fn finish(self) -> Result<LocalReport> {
        for w in &self.workers {
            w.finish()?;
        }
        let scheduler = join(self.scheduler, "scheduler", 0)?;
        let servers = self
            .servers
            .into_iter()
            .enumerate()
            .map(|(r, h)| join(h, "server", r as u32))
            .collect::<Result<Vec<_>>>()?;
        Ok(LocalReport { scheduler, servers })
    }
}

/// The roles a launched rank runs beside its worker ([`crate::launch::Launch::hosted`]): the
/// scheduler on rank 0, servers on each node's first rank, on threads of its process. They
/// serve the whole job, so the hosting process waits for them ([`HostedRoles::finish_within`])
/// after its own worker finished.
pub struct HostedRoles {
    scheduler: Option<JoinHandle<Result<SchedulerReport>>>,
    servers: Vec<(u32, JoinHandle<Result<ServerReport>>)>,
    failures: FirstFailure,
}

/// What the roles a rank hosted report.
#[derive(Debug, Default)]
pub struct HostedReport {
    /// The scheduler's, where it was hosted here.
    pub scheduler: Option<SchedulerReport>,
    /// Each hosted server's, with its rank.
    pub servers: Vec<(u32, ServerReport)>,
}

impl HostedRoles {
    /// Starts what `launch` says this process hosts (nothing: an empty set). The scheduler
    /// is bound before this returns, so a bind error (a port in use) is this call's error.
    pub fn start(launch: &crate::launch::Launch) -> Result<HostedRoles> {
        Self::start_with(launch, ServerHooks::default())
    }

    /// As `start`, with the servers' hooks (a learning-rate schedule).
    pub fn start_with(launch: &crate::launch::Launch, hooks: ServerHooks) -> Result<HostedRoles> {
        let failures = FirstFailure::default();
        let scheduler = match &launch.hosted.scheduler {
            Some(cfg) => Some(spawn_scheduler(Scheduler::bind(cfg.clone())?, &failures)?),
            None => None,
        };
        let servers = launch
            .hosted
            .servers
            .iter()
            .map(|&r| Ok((r, spawn_server(&launch.config, r, &hooks, &failures)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(HostedRoles {
            scheduler,
            servers,
            failures,
        })
    }

    /// Whether it hosts nothing.
    pub fn is_empty(&self) -> bool {
        self.scheduler.is_none() && self.servers.is_empty()
    }

    /// The first failure of a hosted role so far.
    pub fn failure(&self) -> Option<RoleFailure> {
        self.failures.get()
    }

    /// Whether every hosted role has ended.
    pub fn is_finished(&self) -> bool {
        self.scheduler.as_ref().is_none_or(JoinHandle::is_finished)
            && self.servers.iter().all(|(_, h)| h.is_finished())
    }

    /// Waits for the hosted roles to end: the job's end, when every worker has finished.
    pub fn finish(self) -> Result<HostedReport> {
        self.finish_within(Duration::MAX)
    }

    /// Waits at most `limit` for the hosted roles to end (the job ends when every worker has
    /// finished) and returns their reports; a role's error is the error, and a role still
    /// running at the deadline a timeout (its thread is left to end with the process).
    pub fn finish_within(self, limit: Duration) -> Result<HostedReport> {
        let start = Instant::now();
        while !self.is_finished() {
            if start.elapsed() >= limit {
                return Err(Error::Timeout("the hosted scheduler and servers", limit));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let scheduler = match self.scheduler {
            Some(h) => Some(join(h, "scheduler", 0)?),
            None => None,
        };
        let servers = self
            .servers
            .into_iter()
            .map(|(r, h)| join(h, "server", r).map(|rep| (r, rep)))
            .collect::<Result<Vec<_>>>()?;
        Ok(HostedReport { scheduler, servers })
    }
}
