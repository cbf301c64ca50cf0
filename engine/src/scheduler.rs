//! The scheduler: rendezvous (ranks, address book, key map, job token), barriers, heartbeats
//! and membership. One per job; it moves no parameters.
//!
//! Under ElasticBSP (`PolicySpec::job_barriers`) it also plans the job-wide superstep
//! barriers: each worker reports at its barrier ([`Msg::Superstep`]) with its clock and
//! estimated iteration interval; once every live worker that has not finished is there, the
//! scheduler runs ZipLine over their predicted iteration end times ([`plan_superstep`]) and
//! tells each its next barrier ([`Msg::Plan`]). One planner for the whole job, so every shard
//! and worker agrees on the barriers (per-shard planning disagreed and could deadlock).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Transport};

use crate::auth::{self, Purpose};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::{KeyMap, TensorSpec};
use crate::proto::{Book, Msg, Role};
use crate::supervisor::{Manager, ManagerConfig};
use crate::sync::zipline::{predict, zipline};

/// What the scheduler saw, returned when the job ends.
#[derive(Clone, Debug, Default)]
pub struct SchedulerReport {
    /// Bytes of parameters per server.
    pub bytes_per_server: Vec<u64>,
    /// Processes refused at rendezvous, with the reason.
    pub refused: Vec<String>,
    /// Nodes declared dead (role, rank).
    pub dead: Vec<(Role, u32)>,
    /// Nodes evicted for silence (role, rank, why): a subset of `dead`.
    pub evicted: Vec<(Role, u32, String)>,
    /// Servers whose checkpoint writes failed, by rank: (rank, failed writes, the last
    /// failure in words).
    pub checkpoint_failures: Vec<(u32, u64, String)>,
    /// ElasticBSP supersteps planned (barriers that fell); 0 under other policies.
    pub supersteps: u64,
    /// The last ElasticBSP plan, one entry per worker that took part, by rank.
    pub last_plan: Vec<SuperstepPlan>,
    /// Task-transfer steals relayed (or answered "none").
    pub steals: u64,
    /// Times the parallelism manager re-planned.
    pub parallelism_plans: u64,
    /// The last thread count advised to each worker.
    pub threads: Vec<usize>,
    /// The straggler projection's last class of each worker (pioneer, transient,
    /// persistent, unknown).
    pub classes: Vec<String>,
    /// Tasks moved from stragglers to helpers.
    pub tasks_transferred: u64,
    /// Nodes admitted into the running job: servers restarted from their checkpoint,
    /// workers rejoining (role, rank).
    pub rejoined: Vec<(Role, u32)>,
}

/// One worker's part of an ElasticBSP superstep plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SuperstepPlan {
    /// The worker's rank.
    pub worker: u32,
    /// The clock it reported at its barrier (the iteration it is about to start).
    pub clock: u64,
    /// The interval estimate the plan used for it, in nanoseconds (0: nobody's was known, so
    /// everyone runs one iteration).
    pub interval_ns: u64,
    /// Its next barrier: it runs iterations `clock..until` (`1 ≤ until − clock ≤ R`).
    pub until: u64,
}

/// Plans one ElasticBSP superstep for the workers at the barrier, given as
/// `(rank, clock, interval_ns)` with `interval_ns` 0 when unknown. Every worker starts now, so
/// worker `w`'s next `r` iterations end at `j·I_w`, `j = 1..=r`; ZipLine picks one end time per
/// worker minimizing the spread and worker `w` runs `picks[w] + 1` iterations. A worker without
/// an estimate is given the mean of the known ones; if none is known, everyone runs one
/// iteration. `r` is taken as at least 1. The result is in the order of `arrivals`.
pub fn plan_superstep(arrivals: &[(u32, u64, u64)], r: u32) -> Vec<SuperstepPlan> {
    let known: Vec<u64> = arrivals.iter().map(|a| a.2).filter(|&i| i > 0).collect();
    let one_each = || {
        arrivals
            .iter()
            .map(|&(worker, clock, _)| SuperstepPlan {
                worker,
                clock,
                interval_ns: 0,
                until: clock.saturating_add(1),
            })
            .collect()
    };
    if known.is_empty() {
        return one_each();
    }
    let sum: u128 = known.iter().map(|&i| u128::from(i)).sum();
    // The mean of values that fit a u64 fits a u64.
    let mean = u64::try_from(sum / known.len() as u128).unwrap_or(u64::MAX);
    let intervals: Vec<u64> = arrivals
        .iter()
        .map(|a| if a.2 > 0 { a.2 } else { mean.max(1) })
        .collect();
    let r = r.max(1) as usize;
    let candidates: Vec<Vec<u64>> = intervals.iter().map(|&i| predict(0, i, r)).collect();
    let Some(zip) = zipline(&candidates) else {
        // Only when there is nobody to plan for.
        return one_each();
    };
    arrivals
        .iter()
        .zip(&intervals)
        .zip(&zip.picks)
        .map(
            |((&(worker, clock, _), &interval_ns), &pick)| SuperstepPlan {
                worker,
                clock,
                interval_ns,
                until: clock.saturating_add(pick as u64 + 1),
            },
        )
        .collect()
}

/// The job's nodes: (role, rank) → link.
type Nodes = BTreeMap<(Role, u32), Link>;

/// A scheduler bound to its address, not yet running.
pub struct Scheduler {
    cfg: JobConfig,
    t: Transport,
}

struct Joined {
    link: Link,
    role: Role,
    asked: Option<u32>,
    addr: String,
    tensors: Vec<TensorSpec>,
}

/// The ranks that have not joined yet, for a rendezvous that timed out ("server 1, workers
/// 2 and 3"; ranks a node asked for count as taken, unasked places as "any").
fn missing_ranks(cfg: &JobConfig, joined: &[Joined]) -> String {
    let mut parts = Vec::new();
    for (role, want) in [(Role::Server, cfg.servers), (Role::Worker, cfg.workers)] {
        let asked: HashSet<u32> = joined
            .iter()
            .filter(|j| j.role == role)
            .filter_map(|j| j.asked)
            .collect();
        let unasked = joined
            .iter()
            .filter(|j| j.role == role && j.asked.is_none())
            .count();
        // Places taken without a rank fill the lowest free ranks, as the plan will.
        let mut free: Vec<u32> = (0..want).filter(|r| !asked.contains(r)).collect();
        free.drain(..unasked.min(free.len()));
        if !free.is_empty() {
            let list: Vec<String> = free.iter().map(u32::to_string).collect();
            parts.push(format!(
                "{} {}",
                if free.len() == 1 {
                    role.name().to_string()
                } else {
                    format!("{}s", role.name())
                },
                list.join(", ")
            ));
        }
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("; ")
    }
}

/// Why a hello cannot be admitted, if it cannot.
fn admission_error(
    cfg: &JobConfig,
    joined: &[Joined],
    role: Role,
    rank: Option<u32>,
    proof_ok: bool,
) -> Option<String> {
    if !proof_ok {
        return Some(
            "wrong answer to the admission challenge: wrong job token (a process of another \
             job, or a stale one?)"
                .into(),
        );
    }
    let want = match role {
        Role::Server => cfg.servers,
        Role::Worker => cfg.workers,
        Role::Scheduler => return Some("a job has one scheduler".into()),
    };
    let have = joined.iter().filter(|j| j.role == role).count() as u32;
    if have >= want {
        return Some(format!("the job already has its {want} {}s", role.name()));
    }
    let r = rank?;
    if r >= want {
        return Some(format!(
            "{} rank {r} is out of range 0..{want}",
            role.name()
        ));
    }
    if joined.iter().any(|j| j.role == role && j.asked == Some(r)) {
        return Some(format!(
            "duplicate rank: {} rank {r} is already taken",
            role.name()
        ));
    }
    None
}

/// The job's supervisor, as configured: each worker stands for one machine of `budget`
/// threads (the scheduler host's cores when unset).
fn supervisor_for(cfg: &JobConfig) -> Manager {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let st = cfg.supervisor;
    let budget = if st.budget == 0 { cores } else { st.budget };
    let knee = if st.knee == 0 { budget } else { st.knee };
    let workers = cfg.workers.max(1);
    Manager::new(ManagerConfig {
        enabled: st.elastic,
        initial: st.initial.max(1),
        hosts: (0..workers).collect(),
        ..ManagerConfig::one_host(workers, budget, knee, 1)
    })
}

impl Scheduler {
    /// Creates the scheduler's transport (listening).
    pub fn bind(cfg: JobConfig) -> Result<Scheduler> {
        if cfg.servers == 0 || cfg.workers == 0 {
            return Err(Error::Config(
                "a job needs at least one server and one worker".into(),
            ));
        }
        let t = Transport::new(cfg.transport_config())?;
        Ok(Scheduler { cfg, t })
    }

    /// The address nodes connect to.
    pub fn address(&self) -> String {
        self.t.address().to_string()
    }

    /// Runs the job to its end: rendezvous, then barriers, heartbeats and membership until every
    /// worker is done; then shuts the servers down.
    pub fn run(self) -> Result<SchedulerReport> {
        let mut report = SchedulerReport::default();
        let (nodes, book) = self.rendezvous(&mut report)?;
        self.serve(nodes, book, report)
    }

    fn refuse(link: &Link, reason: String, report: &mut SchedulerReport) {
        tracing::warn!("scheduler: refusing {}: {reason}", link.peer());
        let _ = link.send(
            &Msg::Refused {
                reason: reason.clone(),
            }
            .encode(),
        );
        report.refused.push(reason);
        link.close();
    }

    /// Admits S servers and W workers; returns (role, rank) → link, and the book (rank 0).
    fn rendezvous(&self, report: &mut SchedulerReport) -> Result<(Nodes, Book)> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        // Accepted links, with when they came (unadmitted ones expire).
        let mut links: HashMap<LinkId, (Link, Instant)> = HashMap::new();
        let admission = crate::config::admission_deadline(cfg);
        // The challenge sent to each accepted link, used once.
        let mut nonces: HashMap<LinkId, Vec<u8>> = HashMap::new();
        let mut joined: Vec<Joined> = Vec::new();
        while joined.iter().filter(|j| j.role == Role::Server).count() < cfg.servers as usize
            || joined.iter().filter(|j| j.role == Role::Worker).count() < cfg.workers as usize
        {
            if Instant::now() > deadline {
                return Err(Error::Rendezvous {
                    after: cfg.rendezvous_timeout,
                    missing: missing_ranks(cfg, &joined),
                });
            }
            crate::worker::drain_accepted(&self.t, &mut links);
            crate::worker::expire_unadmitted(
                &mut links,
                admission,
                |id| joined.iter().any(|j| j.link.id() == id),
                "scheduler",
            );
            let c = match self.t.cq().wait(Some(Duration::from_millis(20))) {
                Ok(c) => c,
                Err(_) => continue,
            };
            match c {
                Completion::Message { link, data } => {
                    let Some(l) = crate::worker::known_link(&self.t, &mut links, link) else {
                        continue;
                    };
                    let refuse = |reason: String, report: &mut SchedulerReport| {
                        Self::refuse(&l, reason, report);
                    };
                    let forget =
                        |links: &mut HashMap<LinkId, (Link, Instant)>,
                         nonces: &mut HashMap<LinkId, Vec<u8>>| {
                            links.remove(&link);
                            nonces.remove(&link);
                        };
                    if joined.iter().any(|j| j.link.id() == link) {
                        // A joined node speaks again before the job starts: nothing to say yet.
                        tracing::debug!("scheduler: early message from {}", l.peer());
                        continue;
                    }
                    match Msg::decode(&data) {
                        Ok(Msg::Knock) => auth::challenge(&l, &mut nonces)?,
                        Ok(Msg::Hello {
                            role,
                            rank,
                            proof,
                            addr,
                            tensors,
                        }) => {
                            let proof_ok = nonces.remove(&link).is_some_and(|n| {
                                auth::check(&cfg.token, Purpose::Hello, &n, &proof)
                            });
                            let reason = admission_error(cfg, &joined, role, rank, proof_ok);
                            match reason {
                                Some(r) => {
                                    refuse(r, report);
                                    forget(&mut links, &mut nonces);
                                }
                                None => joined.push(Joined {
                                    link: l,
                                    role,
                                    asked: rank,
                                    addr,
                                    tensors,
                                }),
                            }
                        }
                        Ok(other) => {
                            refuse(format!("expected a hello, got {}", other.name()), report);
                            forget(&mut links, &mut nonces);
                        }
                        Err(e) => {
                            refuse(e.to_string(), report);
                            forget(&mut links, &mut nonces);
                        }
                    }
                }
                Completion::Closed { link, .. } => {
                    // A node that left before the job started frees its place.
                    crate::worker::drain_accepted(&self.t, &mut links);
                    joined.retain(|j| j.link.id() != link);
                    links.remove(&link);
                    nonces.remove(&link);
                }
                Completion::WriteImm { .. } => {}
            }
        }
        // Ranks: requested ones first, then the lowest free, in arrival order.
        let mut nodes = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for role in [Role::Server, Role::Worker] {
            let mut taken: HashSet<u32> = joined
                .iter()
                .filter(|j| j.role == role)
                .filter_map(|j| j.asked)
                .collect();
            let mut next = 0;
            for j in joined.iter().filter(|j| j.role == role) {
                let rank = j.asked.unwrap_or_else(|| {
                    while taken.contains(&next) {
                        next += 1;
                    }
                    taken.insert(next);
                    next
                });
                nodes.insert((role, rank), j.link.clone());
                addrs.insert((role, rank), (j.addr.clone(), j.tensors.clone()));
            }
        }
        // Every worker must train the same tensors (an empty list defers to the others).
        let declared: Vec<&Vec<TensorSpec>> = addrs
            .iter()
            .filter(|((r, _), _)| *r == Role::Worker)
            .map(|(_, (_, t))| t)
            .filter(|t| !t.is_empty())
            .collect();
        let tensors = declared.first().map(|t| (*t).clone()).unwrap_or_default();
        if declared.iter().any(|t| **t != tensors) || tensors.is_empty() {
            let reason = if tensors.is_empty() {
                "no worker declared any tensor".to_string()
            } else {
                "workers declared different tensors".to_string()
            };
            for l in nodes.values() {
                Self::refuse(l, reason.clone(), report);
            }
            return Err(Error::Refused(reason));
        }
        let keymap = KeyMap::plan(tensors, cfg.servers, cfg.max_shard_bytes)?;
        report.bytes_per_server = keymap.bytes_per_server();
        tracing::info!(
            "scheduler: job {} placed, bytes per server {}",
            cfg.job,
            report
                .bytes_per_server
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let servers: Vec<String> = (0..cfg.servers)
            .map(|r| addrs[&(Role::Server, r)].0.clone())
            .collect();
        let instance = u64::from_le_bytes(auth::nonce()?[..8].try_into().expect("8 bytes"));
        let template = Book {
            rank: 0,
            servers,
            workers: cfg.workers,
            keymap,
            policy: cfg.policy,
            mode: cfg.update_mode(),
            aggregate: cfg.aggregate,
            optimizer: cfg.optimizer,
            scale: cfg.scale,
            recovery: cfg.checkpoint.is_some(),
            rejoin: false,
            instance,
            barriers: 0,
        };
        for ((role, rank), link) in &nodes {
            let book = Book {
                rank: *rank,
                ..template.clone()
            };
            link.send(&Msg::Book(book).encode())
                .map_err(|e| Error::PeerGone {
                    role: role.name(),
                    rank: *rank,
                    why: e.to_string(),
                })?;
        }
        Ok((nodes, template))
    }

    fn serve(
        self,
        mut nodes: Nodes,
        mut book: Book,
        mut report: SchedulerReport,
    ) -> Result<SchedulerReport> {
        let mut by_link: HashMap<LinkId, (Role, u32)> =
            nodes.iter().map(|(k, l)| (l.id(), *k)).collect();
        // Links of nodes asking to join the running job, and the challenge sent to each.
        let mut joining: HashMap<LinkId, (Link, Instant)> = HashMap::new();
        let admission = crate::config::admission_deadline(&self.cfg);
        let mut nonces: HashMap<LinkId, Vec<u8>> = HashMap::new();
        // Dead servers that may come back from their checkpoint, with the deadline.
        let mut down: BTreeMap<u32, Instant> = BTreeMap::new();
        let mut live: HashSet<(Role, u32)> = nodes.keys().copied().collect();
        let mut seen: HashMap<(Role, u32), Instant> =
            nodes.keys().map(|k| (*k, Instant::now())).collect();
        let mut done: HashSet<u32> = HashSet::new();
        let mut barriers: BTreeMap<u64, HashSet<u32>> = BTreeMap::new();
        // ElasticBSP: R, and the workers at their barrier: rank → (clock, interval_ns).
        let elastic = self.cfg.policy.job_barriers();
        let mut arrivals: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        let silence = self.cfg.suspicion;
        // How long the loop may sleep: silence is noticed within a quarter of the suspicion
        // timeout, however long the heartbeat interval.
        let tick = silence
            .map_or(self.cfg.heartbeat, |s| self.cfg.heartbeat.min(s / 4))
            .max(Duration::from_millis(10));
        let supervisor = supervisor_for(&self.cfg);
        let mut advised: Vec<usize> = supervisor.all_threads();
        let broadcast = |nodes: &Nodes, live: &HashSet<(Role, u32)>, m: &Msg| {
            let bytes = m.encode();
            for k in live {
                let _ = nodes[k].send(&bytes);
            }
        };
        loop {
            crate::worker::drain_accepted(&self.t, &mut joining);
            crate::worker::expire_unadmitted(&mut joining, admission, |_| false, "scheduler");
            if let Some((&rank, _)) = down.iter().find(|(_, d)| Instant::now() > **d) {
                broadcast(&nodes, &live, &Msg::Shutdown);
                return Err(Error::PeerGone {
                    role: "server",
                    rank,
                    why: "it died and did not restart from its checkpoint in time".into(),
                });
            }
            let live_workers: HashSet<u32> = live
                .iter()
                .filter(|(r, _)| *r == Role::Worker)
                .map(|(_, n)| *n)
                .collect();
            // Barriers every live worker has reached fall.
            let ready: Vec<u64> = barriers
                .iter()
                .filter(|(_, arrived)| {
                    live_workers
                        .iter()
                        .all(|w| arrived.contains(w) || done.contains(w))
                })
                .map(|(s, _)| *s)
                .collect();
            for seq in ready {
                barriers.remove(&seq);
                book.barriers = book.barriers.max(seq);
                for w in &live_workers {
                    let _ = nodes[&(Role::Worker, *w)].send(&Msg::BarrierDone { seq }.encode());
                }
            }
            // The ElasticBSP barrier falls when every live worker that has not finished is at
            // it (a worker that died or finished no longer holds it). A worker waiting at a
            // job barrier (`Worker::barrier`) does not hold it either: it waits for the others,
            // who could otherwise never reach that barrier. It reports at its next pull.
            if let Some(r) = elastic {
                arrivals.retain(|w, _| live_workers.contains(w) && !done.contains(w));
                let at_job_barrier = |w: &u32| barriers.values().any(|a| a.contains(w));
                if !arrivals.is_empty()
                    && live_workers
                        .iter()
                        .all(|w| arrivals.contains_key(w) || done.contains(w) || at_job_barrier(w))
                {
                    let at: Vec<(u32, u64, u64)> =
                        arrivals.iter().map(|(&w, &(c, i))| (w, c, i)).collect();
                    arrivals.clear();
                    let plan = plan_superstep(&at, r);
                    report.supersteps += 1;
                    tracing::debug!(
                        "scheduler: superstep {} (R = {r}): {}",
                        report.supersteps,
                        plan.iter()
                            .map(|p| format!(
                                "worker {} clock {} interval {:.3} ms → until {}",
                                p.worker,
                                p.clock,
                                p.interval_ns as f64 / 1e6,
                                p.until
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                    for p in &plan {
                        if let Some(l) = nodes.get(&(Role::Worker, p.worker)) {
                            let _ = l.send(&Msg::Plan { until: p.until }.encode());
                        }
                    }
                    report.last_plan = plan;
                }
            }
            if live_workers.iter().all(|w| done.contains(w)) {
                broadcast(&nodes, &live, &Msg::Shutdown);
                // Give the servers a moment to read it before our links close.
                std::thread::sleep(Duration::from_millis(50));
                // Workers that died are tolerated while others finish; a job whose every
                // worker left before finishing has failed.
                if done.is_empty() {
                    return Err(Error::PeerGone {
                        role: "worker",
                        rank: 0,
                        why: "every worker left before finishing".into(),
                    });
                }
                return Ok(report);
            }
            let mut gone = Vec::new();
            match self.t.cq().wait(Some(tick)) {
                Ok(Completion::Message { link, data }) if !by_link.contains_key(&link) => {
                    let Some(l) = crate::worker::known_link(&self.t, &mut joining, link) else {
                        continue;
                    };
                    let hello = match Msg::decode(&data) {
                        Ok(Msg::Knock) => {
                            auth::challenge(&l, &mut nonces)?;
                            continue;
                        }
                        Ok(Msg::Hello {
                            role,
                            rank,
                            proof,
                            addr,
                            ..
                        }) => (role, rank, proof, addr),
                        Ok(other) => {
                            joining.remove(&link);
                            Self::refuse(
                                &l,
                                format!("expected a hello, got {}", other.name()),
                                &mut report,
                            );
                            continue;
                        }
                        Err(e) => {
                            joining.remove(&link);
                            Self::refuse(&l, e.to_string(), &mut report);
                            continue;
                        }
                    };
                    let (role, rank, proof, addr) = hello;
                    joining.remove(&link);
                    let proof_ok = nonces
                        .remove(&link)
                        .is_some_and(|n| auth::check(&self.cfg.token, Purpose::Hello, &n, &proof));
                    let admitted = match (role, rank) {
                        _ if !proof_ok => {
                            Err("wrong answer to the challenge (wrong job token)".to_string())
                        }
                        (Role::Server, Some(r)) if down.contains_key(&r) => Ok(r),
                        (Role::Worker, Some(r))
                            if r < self.cfg.workers
                                && !live.contains(&(Role::Worker, r))
                                && !done.contains(&r) =>
                        {
                            Ok(r)
                        }
                        _ => Err(format!(
                            "{} {} cannot join the running job (only a dead server of a job with checkpoints, or a dead worker, each by its rank)",
                            role.name(),
                            rank.map_or("without a rank".to_string(), |r| format!("rank {r}"))
                        )),
                    };
                    let r = match admitted {
                        Ok(r) => r,
                        Err(reason) => {
                            Self::refuse(&l, reason, &mut report);
                            continue;
                        }
                    };
                    if role == Role::Server {
                        book.servers[r as usize] = addr.clone();
                    }
                    let b = Book {
                        rank: r,
                        rejoin: true,
                        ..book.clone()
                    };
                    if l.send(&Msg::Book(b).encode()).is_err() {
                        continue;
                    }
                    if let Some(old) = nodes.insert((role, r), l.clone()) {
                        by_link.remove(&old.id());
                    }
                    by_link.insert(link, (role, r));
                    live.insert((role, r));
                    seen.insert((role, r), Instant::now());
                    report.rejoined.push((role, r));
                    tracing::info!("scheduler: {} {r} rejoined the job", role.name());
                    if role == Role::Worker {
                        broadcast(&nodes, &live, &Msg::Rejoined { rank: r });
                    }
                    if role == Role::Server {
                        // It restarts knowing nobody's death: tell it who is gone.
                        for w in 0..self.cfg.workers {
                            if !live.contains(&(Role::Worker, w)) {
                                let _ = l.send(
                                    &Msg::Dead {
                                        role: Role::Worker,
                                        rank: w,
                                    }
                                    .encode(),
                                );
                            }
                        }
                        down.remove(&r);
                        broadcast(&nodes, &live, &Msg::ServerBack { rank: r, addr });
                    }
                }
                Ok(Completion::Message { link, data }) => {
                    let Some(&node) = by_link.get(&link) else {
                        continue;
                    };
                    seen.insert(node, Instant::now());
                    match Msg::decode(&data) {
                        Ok(Msg::Heartbeat) => tracing::trace!("scheduler: heartbeat from {node:?}"),
                        Ok(Msg::Barrier { seq }) if node.0 == Role::Worker => {
                            barriers.entry(seq).or_default().insert(node.1);
                        }
                        Ok(Msg::Superstep { clock, interval_ns })
                            if node.0 == Role::Worker && elastic.is_some() =>
                        {
                            arrivals.insert(node.1, (clock, interval_ns));
                        }
                        Ok(Msg::Done) if node.0 == Role::Worker => {
                            done.insert(node.1);
                        }
                        // A server could not write its checkpoint: counted, and the job ends
                        // if it is set to stop on that.
                        Ok(Msg::CheckpointFailed {
                            reason, failures, ..
                        }) if node.0 == Role::Server => {
                            let on = self.cfg.checkpoint.as_ref().map(|c| c.on_failure);
                            if let Some(e) = crate::checkpoint::failure_reported(
                                on.unwrap_or_default(),
                                &mut report.checkpoint_failures,
                                node.1,
                                failures,
                                reason,
                            ) {
                                broadcast(&nodes, &live, &Msg::Shutdown);
                                // Give the nodes a moment to read it before our links close.
                                std::thread::sleep(Duration::from_millis(50));
                                return Err(e);
                            }
                        }
                        // The supervisor: project, re-plan, advise whose count changed.
                        Ok(Msg::IterationDone {
                            threads,
                            tasks,
                            nanos,
                        }) if node.0 == Role::Worker => {
                            supervisor.report(
                                node.1,
                                threads as usize,
                                tasks,
                                Duration::from_nanos(nanos),
                            );
                            let now = supervisor.all_threads();
                            for (w, (&new, old)) in now.iter().zip(advised.iter_mut()).enumerate() {
                                let to = (Role::Worker, w as u32);
                                if new != *old && live.contains(&to) {
                                    let m = Msg::Threads {
                                        threads: new as u32,
                                    };
                                    let _ = nodes[&to].send(&m.encode());
                                }
                                *old = new;
                            }
                            report.parallelism_plans = supervisor.plans();
                            report.threads = now;
                            report.classes = supervisor
                                .verdict()
                                .classes
                                .iter()
                                .map(|c| format!("{c:?}").to_lowercase())
                                .collect();
                        }
                        // Task transfer: relay a helper's steal to the straggler, or answer
                        // "none" at once when the straggler cannot give any.
                        Ok(Msg::Steal {
                            straggler,
                            clock,
                            want,
                            ..
                        }) if node.0 == Role::Worker => {
                            let to = (Role::Worker, straggler);
                            let open = straggler != node.1
                                && live.contains(&to)
                                && !done.contains(&straggler);
                            let (dest, msg) = if open {
                                (
                                    to,
                                    Msg::Steal {
                                        straggler,
                                        helper: node.1,
                                        clock,
                                        want,
                                    },
                                )
                            } else {
                                (
                                    node,
                                    Msg::Tasks {
                                        straggler,
                                        helper: node.1,
                                        clock,
                                        start: 0,
                                        end: 0,
                                    },
                                )
                            };
                            report.steals += 1;
                            let _ = nodes[&dest].send(&msg.encode());
                        }
                        Ok(Msg::Tasks {
                            helper,
                            clock,
                            start,
                            end,
                            ..
                        }) if node.0 == Role::Worker => {
                            let to = (Role::Worker, helper);
                            if live.contains(&to) {
                                report.tasks_transferred += u64::from(end.saturating_sub(start));
                                let m = Msg::Tasks {
                                    straggler: node.1,
                                    helper,
                                    clock,
                                    start,
                                    end,
                                };
                                let _ = nodes[&to].send(&m.encode());
                            }
                        }
                        Ok(other) => {
                            tracing::warn!(
                                "scheduler: unexpected {} message from {} {}",
                                other.name(),
                                node.0.name(),
                                node.1
                            )
                        }
                        Err(e) => {
                            tracing::warn!("scheduler: {e} from {} {}", node.0.name(), node.1)
                        }
                    }
                }
                Ok(Completion::Closed { link, error }) => {
                    crate::worker::drain_accepted(&self.t, &mut joining);
                    joining.remove(&link);
                    nonces.remove(&link);
                    if let Some(&node) = by_link.get(&link)
                        && !(node.0 == Role::Worker && done.contains(&node.1))
                    {
                        tracing::warn!(
                            "scheduler: {} {} left: {}",
                            node.0.name(),
                            node.1,
                            crate::worker::closed_why(&error)
                        );
                        gone.push(node);
                    }
                }
                Ok(Completion::WriteImm { .. }) | Err(_) => {}
            }
            for (node, at) in &seen {
                if let Some(limit) = silence
                    && live.contains(node)
                    && at.elapsed() > limit
                    && !(node.0 == Role::Worker && done.contains(&node.1))
                {
                    let reason = format!(
                        "silent for {:.1} s (suspicion timeout {:.1} s)",
                        at.elapsed().as_secs_f64(),
                        limit.as_secs_f64()
                    );
                    tracing::warn!("scheduler: {} {} evicted: {reason}", node.0.name(), node.1);
                    // Tell it why: a paused node reads this when it resumes (a worker then
                    // rejoins, a server restarts from its checkpoint).
                    let _ = nodes[node].send(
                        &Msg::Evicted {
                            reason: reason.clone(),
                        }
                        .encode(),
                    );
                    report.evicted.push((node.0, node.1, reason));
                    gone.push(*node);
                }
            }
            for node in gone {
                if live.remove(&node) {
                    nodes[&node].close();
                    report.dead.push(node);
                    broadcast(
                        &nodes,
                        &live,
                        &Msg::Dead {
                            role: node.0,
                            rank: node.1,
                        },
                    );
                    if node.0 == Role::Server {
                        let Some(c) = &self.cfg.checkpoint else {
                            // Its data is gone with it: without checkpoints the job cannot
                            // finish. Tell everyone and stop.
                            broadcast(&nodes, &live, &Msg::Shutdown);
                            return Err(Error::PeerGone {
                                role: "server",
                                rank: node.1,
                                why: "it died during the job".into(),
                            });
                        };
                        tracing::warn!(
                            "scheduler: waiting up to {:.1} s for server {} to restart from its checkpoint",
                            c.recovery_timeout.as_secs_f64(),
                            node.1
                        );
                        down.insert(node.1, Instant::now() + c.recovery_timeout);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn untils(plan: &[SuperstepPlan]) -> Vec<u64> {
        plan.iter().map(|p| p.until).collect()
    }

    #[test]
    fn superstep_plans_equalize_the_barrier_and_stay_within_r() {
        // 1, 2 and 4 ms per iteration, R = 4: all three can end together at 4 ms.
        let ms = 1_000_000;
        let plan = plan_superstep(&[(0, 10, ms), (1, 7, 2 * ms), (2, 3, 4 * ms)], 4);
        assert_eq!(untils(&plan), vec![14, 9, 4]);
        // Unknown intervals take the mean of the known ones (here 2 ms for worker 2).
        let plan = plan_superstep(&[(0, 5, ms), (1, 5, 3 * ms), (2, 5, 0)], 3);
        assert_eq!(plan[2].interval_ns, 2 * ms);
        // Nobody known: one iteration each.
        let plan = plan_superstep(&[(0, 5, 0), (1, 9, 0)], 8);
        assert_eq!(untils(&plan), vec![6, 10]);
        assert!(plan_superstep(&[], 4).is_empty());
        // Predictions saturate rather than overflow.
        let plan = plan_superstep(&[(0, 3, u64::MAX), (1, 4, u64::MAX / 3)], 5);
        assert!(plan.iter().all(|p| (1..=5).contains(&(p.until - p.clock))));
        // Always 1 ≤ until − clock ≤ R, whatever the intervals (R = 0 is taken as 1).
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..500 {
            let r = rng.u32(0..9);
            let at: Vec<(u32, u64, u64)> = (0..rng.u32(1..7))
                .map(|w| {
                    (
                        w,
                        rng.u64(0..1000),
                        rng.u64(0..5) * rng.u64(0..100) * [1, 1_000, 1_000_000][rng.usize(0..3)],
                    )
                })
                .collect();
            let plan = plan_superstep(&at, r);
            assert_eq!(plan.len(), at.len());
            for (p, a) in plan.iter().zip(&at) {
                assert_eq!((p.worker, p.clock), (a.0, a.1));
                assert!((1..=u64::from(r.max(1))).contains(&(p.until - p.clock)));
            }
            // A faster worker is never planned fewer iterations than a slower one.
            for p in &plan {
                for q in &plan {
                    if p.interval_ns < q.interval_ns {
                        assert!(p.until - p.clock >= q.until - q.clock, "{p:?} vs {q:?}");
                    }
                }
            }
        }
    }
}
