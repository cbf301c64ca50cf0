//! The scheduler: rendezvous (ranks, address book, key map, job token), barriers, heartbeats
//! and membership. One per job; it moves no parameters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Transport};

use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::{KeyMap, TensorSpec};
use crate::proto::{Book, Msg, Role};

/// What the scheduler saw, returned when the job ends.
#[derive(Clone, Debug, Default)]
pub struct SchedulerReport {
    /// Bytes of parameters per server.
    pub bytes_per_server: Vec<u64>,
    /// Processes refused at rendezvous, with the reason.
    pub refused: Vec<String>,
    /// Nodes declared dead (role, rank).
    pub dead: Vec<(Role, u32)>,
}

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

/// Why a hello cannot be admitted, if it cannot.
fn admission_error(
    cfg: &JobConfig,
    joined: &[Joined],
    role: Role,
    rank: Option<u32>,
    token: &str,
) -> Option<String> {
    if token != cfg.token {
        return Some("wrong job token (a process of another job, or a stale one?)".into());
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
        let nodes = self.rendezvous(&mut report)?;
        self.serve(nodes, report)
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

    /// Admits S servers and W workers; returns (role, rank) → link.
    fn rendezvous(&self, report: &mut SchedulerReport) -> Result<BTreeMap<(Role, u32), Link>> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        let mut links: HashMap<LinkId, Link> = HashMap::new();
        let mut joined: Vec<Joined> = Vec::new();
        while joined.iter().filter(|j| j.role == Role::Server).count() < cfg.servers as usize
            || joined.iter().filter(|j| j.role == Role::Worker).count() < cfg.workers as usize
        {
            if Instant::now() > deadline {
                return Err(Error::Timeout(
                    "rendezvous (not every server and worker joined)",
                    cfg.rendezvous_timeout,
                ));
            }
            while let Ok(l) = self.t.accept(Some(Duration::ZERO)) {
                links.insert(l.id(), l);
            }
            let c = match self.t.cq().wait(Some(Duration::from_millis(20))) {
                Ok(c) => c,
                Err(_) => continue,
            };
            match c {
                Completion::Message { link, data } => {
                    let Some(l) = links
                        .get(&link)
                        .cloned()
                        .or_else(|| crate::worker::await_link(&self.t, &mut links, link))
                    else {
                        continue;
                    };
                    match Msg::decode(&data) {
                        Ok(Msg::Hello {
                            role,
                            rank,
                            token,
                            addr,
                            tensors,
                        }) => {
                            let reason = admission_error(cfg, &joined, role, rank, &token);
                            match reason {
                                Some(r) => Self::refuse(&l, r, report),
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
                            Self::refuse(&l, format!("expected a hello, got {other:?}"), report)
                        }
                        Err(e) => Self::refuse(&l, e.to_string(), report),
                    }
                }
                Completion::Closed { link, .. } => {
                    // A node that left before the job started frees its place.
                    joined.retain(|j| j.link.id() != link);
                    links.remove(&link);
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
            "scheduler: job {} placed, bytes per server {:?}",
            cfg.job,
            report.bytes_per_server
        );
        let servers: Vec<String> = (0..cfg.servers)
            .map(|r| addrs[&(Role::Server, r)].0.clone())
            .collect();
        for ((role, rank), link) in &nodes {
            let book = Book {
                rank: *rank,
                servers: servers.clone(),
                workers: cfg.workers,
                keymap: keymap.clone(),
                policy: cfg.policy,
                mode: cfg.update_mode(),
                aggregate: cfg.aggregate,
                optimizer: cfg.optimizer,
                scale: cfg.scale,
            };
            link.send(&Msg::Book(book).encode())
                .map_err(|e| Error::PeerGone {
                    role: role.name(),
                    rank: *rank,
                    why: e.to_string(),
                })?;
        }
        Ok(nodes)
    }

    fn serve(
        self,
        nodes: BTreeMap<(Role, u32), Link>,
        mut report: SchedulerReport,
    ) -> Result<SchedulerReport> {
        let by_link: HashMap<LinkId, (Role, u32)> =
            nodes.iter().map(|(k, l)| (l.id(), *k)).collect();
        let mut live: HashSet<(Role, u32)> = nodes.keys().copied().collect();
        let mut seen: HashMap<(Role, u32), Instant> =
            nodes.keys().map(|k| (*k, Instant::now())).collect();
        let mut done: HashSet<u32> = HashSet::new();
        let mut barriers: BTreeMap<u64, HashSet<u32>> = BTreeMap::new();
        let silence = self.cfg.heartbeat * 3;
        let broadcast = |live: &HashSet<(Role, u32)>, m: &Msg| {
            let bytes = m.encode();
            for k in live {
                let _ = nodes[k].send(&bytes);
            }
        };
        loop {
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
                for w in &live_workers {
                    let _ = nodes[&(Role::Worker, *w)].send(&Msg::BarrierDone { seq }.encode());
                }
            }
            if live_workers.iter().all(|w| done.contains(w)) {
                broadcast(&live, &Msg::Shutdown);
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
            match self.t.cq().wait(Some(self.cfg.heartbeat)) {
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
                        Ok(Msg::Done) if node.0 == Role::Worker => {
                            done.insert(node.1);
                        }
                        Ok(other) => {
                            tracing::warn!("scheduler: unexpected {other:?} from {node:?}")
                        }
                        Err(e) => tracing::warn!("scheduler: {e} from {node:?}"),
                    }
                }
                Ok(Completion::Closed { link, error }) => {
                    if let Some(&node) = by_link.get(&link)
                        && !(node.0 == Role::Worker && done.contains(&node.1))
                    {
                        tracing::warn!("scheduler: {} {} left: {error:?}", node.0.name(), node.1);
                        gone.push(node);
                    }
                }
                Ok(Completion::WriteImm { .. }) | Err(_) => {}
            }
            for (node, at) in &seen {
                if live.contains(node)
                    && at.elapsed() > silence
                    && !(node.0 == Role::Worker && done.contains(&node.1))
                {
                    tracing::warn!(
                        "scheduler: {} {} silent for {:?}",
                        node.0.name(),
                        node.1,
                        at.elapsed()
                    );
                    gone.push(*node);
                }
            }
            for node in gone {
                if live.remove(&node) {
                    nodes[&node].close();
                    report.dead.push(node);
                    broadcast(
                        &live,
                        &Msg::Dead {
                            role: node.0,
                            rank: node.1,
                        },
                    );
                    if node.0 == Role::Server {
                        // The servers' data is gone with them: the job cannot finish (server
                        // recovery is checkpoint-based, issue 8). Tell everyone and stop.
                        broadcast(&live, &Msg::Shutdown);
                        return Err(Error::PeerGone {
                            role: "server",
                            rank: node.1,
                            why: "it died during the job".into(),
                        });
                    }
                }
            }
        }
    }
}
