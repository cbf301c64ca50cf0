//! The scheduler's job membership as sans-IO state machines: who is admitted, who is alive,
//! who finished, which barriers fell, and when the job ends.
//!
//! Like the synchronization policies ([`crate::sync`]), they do no I/O, read no clock and
//! start no thread. The scheduler ([`crate::scheduler`]) turns what its transport delivers
//! into inputs, hands each in with the time, and carries out the [`Action`]s that come out;
//! it keeps the links, the admission challenges and the job token (a machine is told whether
//! a hello's proof was right, never checks it).
//!
//! Two machines: [`Rendezvous`] admits the job's nodes before it starts and assigns their
//! ranks; [`Membership`] runs the job: heartbeats and eviction, deaths, workers done, job
//! barriers, ElasticBSP supersteps, servers restarting from their checkpoint, workers
//! rejoining, task-transfer relays, and the job's end.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use crate::config::{JobConfig, OnCheckpointFailure};
use crate::error::Error;
use crate::proto::{Msg, Role};
use crate::sync::zipline::{predict, zipline};

/// A node of the job: its role and rank.
pub type Node = (Role, u32);

/// A connection the driver has not yet tied to a node (the transport's link id).
pub type Peer = u64;

/// Where the machines log: the scheduler's target, which users filter on.
const LOG: &str = "falcon_engine::scheduler";

/// A hello admitted at rendezvous, before ranks are assigned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Joiner {
    peer: Peer,
    role: Role,
    asked: Option<u32>,
}

/// Rendezvous: admits S servers and W workers, each by hello, and assigns their ranks.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    servers: u32,
    workers: u32,
    joined: Vec<Joiner>,
}

impl Rendezvous {
    /// A rendezvous for `servers` servers and `workers` workers, nobody admitted yet.
    pub fn new(servers: u32, workers: u32) -> Rendezvous {
        Rendezvous {
            servers,
            workers,
            joined: Vec::new(),
        }
    }

    fn want(&self, role: Role) -> u32 {
        match role {
            Role::Server => self.servers,
            Role::Worker => self.workers,
            Role::Scheduler => 0,
        }
    }

    fn count(&self, role: Role) -> u32 {
        self.joined.iter().filter(|j| j.role == role).count() as u32
    }

    /// Whether every place is taken: the job can start.
    pub fn complete(&self) -> bool {
        self.count(Role::Server) >= self.servers && self.count(Role::Worker) >= self.workers
    }

    /// Whether `peer` was admitted.
    pub fn admitted(&self, peer: Peer) -> bool {
        self.joined.iter().any(|j| j.peer == peer)
    }

    /// A hello from `peer` as `role`, asking for `rank` (or any), whose proof of the job
    /// token was right or not: admitted, or the reason it is refused.
    pub fn hello(
        &mut self,
        peer: Peer,
        role: Role,
        rank: Option<u32>,
        proof_ok: bool,
    ) -> Result<(), String> {
        if let Some(reason) = self.refusal(role, rank, proof_ok) {
            return Err(reason);
        }
        self.joined.push(Joiner {
            peer,
            role,
            asked: rank,
        });
        Ok(())
    }

    /// Why a hello cannot be admitted, if it cannot.
    fn refusal(&self, role: Role, rank: Option<u32>, proof_ok: bool) -> Option<String> {
        if !proof_ok {
            return Some(
                "wrong answer to the admission challenge: wrong job token (a process of another \
                 job, or a stale one?)"
                    .into(),
            );
        }
        if role == Role::Scheduler {
            return Some("a job has one scheduler".into());
        }
        let want = self.want(role);
        if self.count(role) >= want {
            return Some(format!("the job already has its {want} {}s", role.name()));
        }
        let r = rank?;
        if r >= want {
            return Some(format!(
                "{} rank {r} is out of range 0..{want}",
                role.name()
            ));
        }
        if self
            .joined
            .iter()
            .any(|j| j.role == role && j.asked == Some(r))
        {
            return Some(format!(
                "duplicate rank: {} rank {r} is already taken",
                role.name()
            ));
        }
        None
    }

    /// `peer` left before the job started: its place is free again.
    pub fn left(&mut self, peer: Peer) {
        self.joined.retain(|j| j.peer != peer);
    }

    /// The ranks that have not joined yet, for a rendezvous that timed out ("server 1;
    /// workers 2, 3"; ranks a node asked for count as taken, unasked places fill the lowest
    /// free ranks, as the plan will), or "none".
    pub fn missing(&self) -> String {
        let mut parts = Vec::new();
        for role in [Role::Server, Role::Worker] {
            let asked: HashSet<u32> = self
                .joined
                .iter()
                .filter(|j| j.role == role)
                .filter_map(|j| j.asked)
                .collect();
            let unasked = self
                .joined
                .iter()
                .filter(|j| j.role == role && j.asked.is_none())
                .count();
            let mut free: Vec<u32> = (0..self.want(role))
                .filter(|r| !asked.contains(r))
                .collect();
            free.drain(..unasked.min(free.len()));
            if !free.is_empty() {
                let list: Vec<String> = free.iter().map(u32::to_string).collect();
                let what = if free.len() == 1 {
                    role.name().to_string()
                } else {
                    format!("{}s", role.name())
                };
                parts.push(format!("{what} {}", list.join(", ")));
            }
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    }

    /// Every admitted peer's rank: the one it asked for, else the lowest free one, in order
    /// of arrival; servers first.
    pub fn ranks(&self) -> Vec<(Node, Peer)> {
        let mut out = Vec::with_capacity(self.joined.len());
        for role in [Role::Server, Role::Worker] {
            let mine = || self.joined.iter().filter(move |j| j.role == role);
            let mut taken: HashSet<u32> = mine().filter_map(|j| j.asked).collect();
            let mut next = 0;
            for j in mine() {
                let rank = j.asked.unwrap_or_else(|| {
                    while taken.contains(&next) {
                        next += 1;
                    }
                    taken.insert(next);
                    next
                });
                out.push(((role, rank), j.peer));
            }
        }
        out
    }
}

/// What the membership needs to know of the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Servers in the job (ranks `0..servers`).
    pub servers: u32,
    /// Workers in the job (ranks `0..workers`).
    pub workers: u32,
    /// A node silent for longer is evicted; `None`: silence evicts nobody.
    pub suspicion: Option<Duration>,
    /// How long a dead server may take to restart from its checkpoint; `None`: the job has
    /// no checkpoints, and a dead server ends it.
    pub recovery: Option<Duration>,
    /// ElasticBSP's R, when the scheduler plans supersteps.
    pub elastic: Option<u32>,
    /// What a server's failed checkpoint write does to the job.
    pub on_checkpoint_failure: OnCheckpointFailure,
}

impl Settings {
    /// The settings of a job.
    pub fn of(cfg: &JobConfig) -> Settings {
        Settings {
            servers: cfg.servers,
            workers: cfg.workers,
            suspicion: cfg.suspicion,
            recovery: cfg.checkpoint.as_ref().map(|c| c.recovery_timeout),
            elastic: cfg.policy.job_barriers(),
            on_checkpoint_failure: cfg
                .checkpoint
                .as_ref()
                .map(|c| c.on_failure)
                .unwrap_or_default(),
        }
    }
}

/// What the membership is told, with the time, by [`Membership::on_event`].
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Time passes.
    Tick,
    /// A message came from `node`, which is alive; `None` when it could not be decoded.
    Message {
        /// Its sender.
        node: Node,
        /// The message.
        msg: Option<Msg>,
    },
    /// `node`'s link closed: it left, crashed, or was cut off.
    Closed {
        /// The node.
        node: Node,
    },
    /// `node`, admitted by [`Membership::admit`], was sent its book: it is in the job again.
    Joined {
        /// The node.
        node: Node,
        /// A server's new address (ignored for a worker).
        addr: String,
    },
}

/// Why the job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every live worker finished, at least one of them did: the job is done.
    Finished,
    /// Every worker left (died) before finishing.
    EveryWorkerLeft,
    /// Server `rank` died in a job without checkpoints: its data is gone with it.
    ServerDied {
        /// Its rank.
        rank: u32,
    },
    /// Server `rank` died and did not restart from its checkpoint within the recovery timeout.
    ServerNotBack {
        /// Its rank.
        rank: u32,
    },
    /// Worker `rank` stopped the job (interrupted, terminated, or its script failed).
    Aborted {
        /// Its rank.
        rank: u32,
        /// Why, in its words.
        why: String,
    },
    /// Server `rank` could not write its checkpoint and the job stops on that.
    CheckpointFailed {
        /// Its rank.
        rank: u32,
        /// Its failed writes so far.
        failures: u64,
        /// The last failure, in words.
        reason: String,
    },
}

impl Ending {
    /// The error the job ends with, if it failed.
    pub fn error(&self) -> Option<Error> {
        let gone = |role: &'static str, rank: u32, why: &str| Error::PeerGone {
            role,
            rank,
            why: why.into(),
        };
        match self {
            Ending::Finished => None,
            Ending::EveryWorkerLeft => {
                Some(gone("worker", 0, "every worker left before finishing"))
            }
            Ending::ServerDied { rank } => Some(gone("server", *rank, "it died during the job")),
            Ending::ServerNotBack { rank } => Some(gone(
                "server",
                *rank,
                "it died and did not restart from its checkpoint in time",
            )),
            Ending::Aborted { rank, why } => {
                Some(gone("worker", *rank, &format!("it stopped the job: {why}")))
            }
            Ending::CheckpointFailed {
                rank,
                failures,
                reason,
            } => Some(Error::CheckpointFailed {
                rank: *rank,
                failures: *failures,
                reason: reason.clone(),
            }),
        }
    }

    /// Whether the nodes should be given a moment to read the shutdown before the
    /// scheduler's links close (a server lost ends the job at once).
    pub fn lingers(&self) -> bool {
        !matches!(
            self,
            Ending::ServerDied { .. } | Ending::ServerNotBack { .. }
        )
    }
}

/// What the membership decides; the driver carries the actions out in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send `msg` to `to`.
    Send {
        /// The node.
        to: Node,
        /// The message.
        msg: Msg,
    },
    /// Send `msg` to each of `to` (the live nodes, or the live workers, as they are now).
    Broadcast {
        /// The nodes, in order.
        to: Vec<Node>,
        /// The message.
        msg: Msg,
    },
    /// Close `node`'s link: it is dead.
    Close {
        /// The node.
        node: Node,
    },
    /// The job is over (a shutdown was broadcast just before); nothing more comes out.
    End(Ending),
}

/// The job's membership once it runs: every node joined at rendezvous.
///
/// Rules, applied after every event:
/// - a live node not heard from for longer than the suspicion timeout is evicted (told why,
///   then dead), unless it is a worker that finished;
/// - a node that dies (evicted, or its link closed) is closed, reported dead once and
///   announced to the live nodes; a dead server of a job with checkpoints is waited for up to
///   the recovery timeout, one without checkpoints ends the job;
/// - a job barrier falls when every live worker has arrived at it or finished;
/// - under ElasticBSP a superstep is planned when every live worker that has not finished
///   has reported at its barrier (or waits at a job barrier), at least one has;
/// - the job ends when every live worker has finished.
#[derive(Clone, Debug)]
pub struct Membership {
    s: Settings,
    live: BTreeSet<Node>,
    /// When each node was last heard from.
    seen: BTreeMap<Node, Instant>,
    /// Workers that finished.
    done: BTreeSet<u32>,
    /// Dead servers that may come back from their checkpoint, with their deadline.
    down: BTreeMap<u32, Instant>,
    /// Job barriers not fallen: seq → workers arrived.
    barriers: BTreeMap<u64, BTreeSet<u32>>,
    /// The highest barrier fallen.
    fallen: u64,
    /// ElasticBSP: the workers at their barrier, rank → (clock, interval_ns).
    arrivals: BTreeMap<u32, (u64, u64)>,
    /// Steals relayed and not answered yet: straggler → (helper, clock) of each.
    steals: BTreeMap<u32, Vec<(u32, u64)>>,
    report: SchedulerReport,
    ended: bool,
}

/// `straggler`'s answer "no task" to `helper`'s steal of its iteration `clock`.
fn no_tasks(straggler: u32, helper: u32, clock: u64) -> Msg {
    Msg::Tasks {
        straggler,
        helper,
        clock,
        start: 0,
        end: 0,
    }
}

impl Membership {
    /// The membership of a job that starts `now` with every server and worker alive;
    /// `report` is what rendezvous recorded.
    pub fn new(s: Settings, report: SchedulerReport, now: Instant) -> Membership {
        let live: BTreeSet<Node> = (0..s.servers)
            .map(|r| (Role::Server, r))
            .chain((0..s.workers).map(|r| (Role::Worker, r)))
            .collect();
        Membership {
            s,
            seen: live.iter().map(|&n| (n, now)).collect(),
            live,
            done: BTreeSet::new(),
            down: BTreeMap::new(),
            barriers: BTreeMap::new(),
            fallen: 0,
            arrivals: BTreeMap::new(),
            steals: BTreeMap::new(),
            report,
            ended: false,
        }
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &Settings {
        &self.s
    }

    /// Whether `node` is alive (in the job, not declared dead). A worker that finished stays
    /// alive.
    pub fn is_live(&self, node: Node) -> bool {
        self.live.contains(&node)
    }

    /// Whether worker `rank` finished.
    pub fn is_done(&self, rank: u32) -> bool {
        self.done.contains(&rank)
    }

    /// Whether `node` is a worker that finished (its silence or leaving is no death).
    pub fn finished(&self, node: Node) -> bool {
        node.0 == Role::Worker && self.done.contains(&node.1)
    }

    /// The live nodes, in order.
    pub fn live(&self) -> impl Iterator<Item = Node> + '_ {
        self.live.iter().copied()
    }

    /// Dead servers waiting to restart, with their deadline.
    pub fn down(&self) -> impl Iterator<Item = (u32, Instant)> + '_ {
        self.down.iter().map(|(&r, &d)| (r, d))
    }

    /// When `node` was last heard from.
    pub fn last_heard(&self, node: Node) -> Option<Instant> {
        self.seen.get(&node).copied()
    }

    /// The workers arrived at job barrier `seq`, if it has not fallen.
    pub fn arrived(&self, seq: u64) -> Option<&BTreeSet<u32>> {
        self.barriers.get(&seq)
    }

    /// The highest job barrier fallen (0: none), for the book of a node joining.
    pub fn barriers_fallen(&self) -> u64 {
        self.fallen
    }

    /// Whether the job ended.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// What it recorded.
    pub fn report(&self) -> &SchedulerReport {
        &self.report
    }

    /// The report, for the driver's own entries (refusals, the supervisor's plans).
    pub fn report_mut(&mut self) -> &mut SchedulerReport {
        &mut self.report
    }

    /// The report, at the end.
    pub fn into_report(self) -> SchedulerReport {
        self.report
    }

    /// How long the driver may wait for an event before it ticks: silence is noticed within
    /// a quarter of the suspicion timeout, however long the heartbeat interval.
    pub fn tick_every(&self, heartbeat: Duration) -> Duration {
        self.s
            .suspicion
            .map_or(heartbeat, |s| heartbeat.min(s / 4))
            .max(Duration::from_millis(10))
    }

    /// Whether a node may join the running job as `role`, asking for `rank`, its proof of the
    /// job token right or not: the rank it takes, or why not. Only a dead server of a job
    /// with checkpoints (waiting for its restart), or a dead worker that had not finished,
    /// each by its rank. Once its book is sent, the driver hands in [`Event::Joined`].
    pub fn admit(&self, role: Role, rank: Option<u32>, proof_ok: bool) -> Result<u32, String> {
        match (role, rank) {
            _ if !proof_ok => Err("wrong answer to the challenge (wrong job token)".to_string()),
            (Role::Server, Some(r)) if self.down.contains_key(&r) => Ok(r),
            (Role::Worker, Some(r))
                if r < self.s.workers
                    && !self.live.contains(&(Role::Worker, r))
                    && !self.done.contains(&r) =>
            {
                Ok(r)
            }
            _ => Err(format!(
                "{} {} cannot join the running job (only a dead server of a job with \
                 checkpoints, or a dead worker, each by its rank)",
                role.name(),
                rank.map_or("without a rank".to_string(), |r| format!("rank {r}"))
            )),
        }
    }

    /// Hands in `ev`, which happened at `now`; the actions to carry out are appended to `out`.
    /// After the job ended, nothing happens.
    pub fn on_event(&mut self, ev: Event, now: Instant, out: &mut Vec<Action>) {
        if self.ended {
            return;
        }
        match ev {
            Event::Tick => {}
            Event::Message { node, msg } => self.on_message(node, msg, now, out),
            Event::Closed { node } => {
                if !self.finished(node) {
                    self.die(node, now, out);
                }
            }
            Event::Joined { node, addr } => self.joined(node, addr, now, out),
        }
        self.settle(now, out);
    }

    fn on_message(&mut self, node: Node, msg: Option<Msg>, now: Instant, out: &mut Vec<Action>) {
        self.seen.insert(node, now);
        let Some(msg) = msg else {
            return;
        };
        let (role, rank) = node;
        let worker = role == Role::Worker;
        match msg {
            Msg::Heartbeat => {
                tracing::trace!(target: LOG, "scheduler: heartbeat from {} {rank}", role.name())
            }
            // The metrics board's, which the driver keeps.
            Msg::Metrics(_) if role != Role::Scheduler => {}
            Msg::Barrier { seq } if worker => {
                self.barriers.entry(seq).or_default().insert(rank);
            }
            Msg::Superstep { clock, interval_ns } if worker && self.s.elastic.is_some() => {
                self.arrivals.insert(rank, (clock, interval_ns));
            }
            // A worker stops the job: everyone is told who and why, then the job ends.
            Msg::Abort { why } if worker && !self.ended => {
                tracing::warn!(target: LOG, "scheduler: worker {rank} stopped the job: {why}");
                self.broadcast(
                    Msg::Aborted {
                        rank,
                        why: why.clone(),
                    },
                    out,
                );
                self.end(Ending::Aborted { rank, why }, out);
            }
            Msg::Done if worker => {
                self.done.insert(rank);
                // It has no task left to give: the steals relayed to it are answered now, or
                // a helper whose steal crossed its last push would wait for ever.
                self.answer_steals(rank, out);
            }
            // A server could not write its checkpoint: counted, and the job ends if it is set
            // to stop on that.
            Msg::CheckpointFailed {
                reason, failures, ..
            } if role == Role::Server => {
                if let Some(Error::CheckpointFailed {
                    rank,
                    failures,
                    reason,
                }) = crate::checkpoint::failure_reported(
                    self.s.on_checkpoint_failure,
                    &mut self.report.checkpoint_failures,
                    rank,
                    failures,
                    reason,
                ) {
                    self.end(
                        Ending::CheckpointFailed {
                            rank,
                            failures,
                            reason,
                        },
                        out,
                    );
                }
            }
            // The supervisor's, which the driver runs.
            Msg::IterationDone { .. } if worker => {}
            Msg::Steal {
                straggler,
                clock,
                want,
                ..
            } if worker => self.steal(rank, straggler, clock, want, out),
            Msg::Tasks {
                helper,
                clock,
                start,
                end,
                ..
            } if worker => self.tasks(rank, helper, clock, (start, end), out),
            other => tracing::warn!(
                target: LOG,
                "scheduler: unexpected {} message from {} {rank}",
                other.name(),
                role.name()
            ),
        }
    }

    /// Task transfer: relays `helper`'s steal to the straggler, or answers "none" at once
    /// when the straggler cannot give any (itself, dead, or finished).
    fn steal(&mut self, helper: u32, straggler: u32, clock: u64, want: u32, out: &mut Vec<Action>) {
        let to = (Role::Worker, straggler);
        let open =
            straggler != helper && self.live.contains(&to) && !self.done.contains(&straggler);
        let (to, msg) = if open {
            self.steals
                .entry(straggler)
                .or_default()
                .push((helper, clock));
            let msg = Msg::Steal {
                straggler,
                helper,
                clock,
                want,
            };
            (to, msg)
        } else {
            ((Role::Worker, helper), no_tasks(straggler, helper, clock))
        };
        self.report.steals += 1;
        out.push(Action::Send { to, msg });
    }

    /// Task transfer: relays the straggler's answer to its helper, if the helper is alive.
    fn tasks(
        &mut self,
        straggler: u32,
        helper: u32,
        clock: u64,
        (start, end): (u32, u32),
        out: &mut Vec<Action>,
    ) {
        if let Some(open) = self.steals.get_mut(&straggler)
            && let Some(i) = open.iter().position(|&s| s == (helper, clock))
        {
            open.remove(i);
        }
        let to = (Role::Worker, helper);
        if self.live.contains(&to) {
            self.report.tasks_transferred += u64::from(end.saturating_sub(start));
            let msg = Msg::Tasks {
                straggler,
                helper,
                clock,
                start,
                end,
            };
            out.push(Action::Send { to, msg });
        }
    }

    /// Answers "none" to every steal relayed to `straggler` and not answered: it finished or
    /// died, so it will not answer.
    fn answer_steals(&mut self, straggler: u32, out: &mut Vec<Action>) {
        for (helper, clock) in self.steals.remove(&straggler).unwrap_or_default() {
            let to = (Role::Worker, helper);
            if self.live.contains(&to) {
                let msg = no_tasks(straggler, helper, clock);
                out.push(Action::Send { to, msg });
            }
        }
    }

    /// A node admitted into the running job is alive again.
    fn joined(&mut self, node: Node, addr: String, now: Instant, out: &mut Vec<Action>) {
        let (role, rank) = node;
        self.live.insert(node);
        self.seen.insert(node, now);
        self.report.rejoined.push(node);
        tracing::info!(target: LOG, "scheduler: {} {rank} rejoined the job", role.name());
        if role == Role::Worker {
            self.broadcast(Msg::Rejoined { rank }, out);
        }
        if role == Role::Server {
            // It restarts knowing nobody's death: tell it who is gone.
            for w in 0..self.s.workers {
                if !self.live.contains(&(Role::Worker, w)) {
                    let msg = Msg::Dead {
                        role: Role::Worker,
                        rank: w,
                    };
                    out.push(Action::Send { to: node, msg });
                }
            }
            self.down.remove(&rank);
            self.broadcast(Msg::ServerBack { rank, addr }, out);
        }
    }

    /// `node` is dead, if it was alive: closed, reported, announced; a server is waited for
    /// or ends the job.
    fn die(&mut self, node: Node, now: Instant, out: &mut Vec<Action>) {
        if !self.live.remove(&node) {
            return;
        }
        let (role, rank) = node;
        out.push(Action::Close { node });
        self.report.dead.push(node);
        self.broadcast(Msg::Dead { role, rank }, out);
        if role != Role::Server {
            self.answer_steals(rank, out);
            return;
        }
        let Some(recovery) = self.s.recovery else {
            // Its data is gone with it: without checkpoints the job cannot finish.
            self.end(Ending::ServerDied { rank }, out);
            return;
        };
        tracing::warn!(
            target: LOG,
            "scheduler: waiting up to {:.1} s for server {rank} to restart from its checkpoint",
            recovery.as_secs_f64(),
        );
        self.down.insert(rank, now + recovery);
    }

    /// The rules that follow from the state, in order: silence, recovery deadlines, job
    /// barriers, supersteps, the job's end.
    fn settle(&mut self, now: Instant, out: &mut Vec<Action>) {
        self.evict_silent(now, out);
        if self.ended {
            return;
        }
        if let Some((&rank, _)) = self.down.iter().find(|(_, d)| now > **d) {
            self.end(Ending::ServerNotBack { rank }, out);
            return;
        }
        self.fall_barriers(out);
        self.plan(out);
        let live_workers = self.live_workers();
        if live_workers.iter().all(|w| self.done.contains(w)) {
            // Workers that died are tolerated while others finish; a job whose every worker
            // left before finishing has failed.
            let how = if self.done.is_empty() {
                Ending::EveryWorkerLeft
            } else {
                Ending::Finished
            };
            self.end(how, out);
        }
    }

    /// Evicts the live nodes silent past the suspicion timeout (a worker that finished may be
    /// silent): each is told why, then dies.
    fn evict_silent(&mut self, now: Instant, out: &mut Vec<Action>) {
        let Some(limit) = self.s.suspicion else {
            return;
        };
        let silent: Vec<(Node, Duration)> = self
            .seen
            .iter()
            .map(|(&node, &at)| (node, now.saturating_duration_since(at)))
            .filter(|&(node, quiet)| {
                quiet > limit && self.live.contains(&node) && !self.finished(node)
            })
            .collect();
        for &(node, quiet) in &silent {
            let reason = format!(
                "silent for {:.1} s (suspicion timeout {:.1} s)",
                quiet.as_secs_f64(),
                limit.as_secs_f64()
            );
            tracing::warn!(
                target: LOG,
                "scheduler: {} {} evicted: {reason}",
                node.0.name(),
                node.1
            );
            // Tell it why: a paused node reads this when it resumes (a worker then rejoins, a
            // server restarts from its checkpoint).
            let msg = Msg::Evicted {
                reason: reason.clone(),
            };
            out.push(Action::Send { to: node, msg });
            self.report.evicted.push((node.0, node.1, reason));
        }
        for (node, _) in silent {
            if self.ended {
                return;
            }
            self.die(node, now, out);
        }
    }

    fn live_workers(&self) -> Vec<u32> {
        self.live
            .iter()
            .filter(|(r, _)| *r == Role::Worker)
            .map(|&(_, n)| n)
            .collect()
    }

    /// Barriers every live worker has reached (or finished) fall.
    fn fall_barriers(&mut self, out: &mut Vec<Action>) {
        let live_workers = self.live_workers();
        let ready: Vec<u64> = self
            .barriers
            .iter()
            .filter(|(_, arrived)| {
                live_workers
                    .iter()
                    .all(|w| arrived.contains(w) || self.done.contains(w))
            })
            .map(|(&seq, _)| seq)
            .collect();
        for seq in ready {
            self.barriers.remove(&seq);
            self.fallen = self.fallen.max(seq);
            out.push(Action::Broadcast {
                to: live_workers.iter().map(|&w| (Role::Worker, w)).collect(),
                msg: Msg::BarrierDone { seq },
            });
        }
    }

    /// The ElasticBSP barrier falls when every live worker that has not finished is at it (a
    /// worker that died or finished no longer holds it). A worker waiting at a job barrier
    /// does not hold it either: it waits for the others, who could otherwise never reach that
    /// barrier. It reports at its next pull.
    fn plan(&mut self, out: &mut Vec<Action>) {
        let Some(r) = self.s.elastic else {
            return;
        };
        let live_workers = self.live_workers();
        self.arrivals
            .retain(|w, _| live_workers.contains(w) && !self.done.contains(w));
        let at_job_barrier = |w: &u32| self.barriers.values().any(|a| a.contains(w));
        let all_there = live_workers
            .iter()
            .all(|w| self.arrivals.contains_key(w) || self.done.contains(w) || at_job_barrier(w));
        if self.arrivals.is_empty() || !all_there {
            return;
        }
        let at: Vec<(u32, u64, u64)> = std::mem::take(&mut self.arrivals)
            .into_iter()
            .map(|(w, (c, i))| (w, c, i))
            .collect();
        let plan = plan_superstep(&at, r);
        self.report.supersteps += 1;
        tracing::debug!(
            target: LOG,
            "scheduler: superstep {} (R = {r}): {}",
            self.report.supersteps,
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
            let msg = Msg::Plan { until: p.until };
            out.push(Action::Send {
                to: (Role::Worker, p.worker),
                msg,
            });
        }
        self.report.last_plan = plan;
    }

    /// Every live node, in order.
    fn broadcast(&self, msg: Msg, out: &mut Vec<Action>) {
        out.push(Action::Broadcast {
            to: self.live.iter().copied().collect(),
            msg,
        });
    }

    /// The job ends: shutdown to every live node, then the ending.
    fn end(&mut self, how: Ending, out: &mut Vec<Action>) {
        self.broadcast(Msg::Shutdown, out);
        out.push(Action::End(how));
        self.ended = true;
    }
}

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

impl SchedulerReport {
    /// Workers declared dead that did not come back before the job ended (a worker that
    /// died twice and rejoined once is among them).
    pub fn lost_workers(&self) -> Vec<u32> {
        let mut lost: Vec<u32> = Vec::new();
        let count = |v: &[(Role, u32)], w: u32| {
            v.iter()
                .filter(|&&(r, n)| r == Role::Worker && n == w)
                .count()
        };
        for &(r, w) in &self.dead {
            if r == Role::Worker
                && !lost.contains(&w)
                && count(&self.dead, w) > count(&self.rejoined, w)
            {
                lost.push(w);
            }
        }
        lost.sort_unstable();
        lost
    }

    /// The bytes of parameters each server holds, as a list (`40000, 40000`).
    pub fn bytes_per_server_list(&self) -> String {
        self.bytes_per_server
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// How the job ended, in one line: who died, was evicted, rejoined, and who was lost for
    /// good (`scheduler: job done; dead: [worker 3]; …`).
    pub fn ending(&self) -> String {
        let nodes = |v: &[(Role, u32)]| {
            v.iter()
                .map(|(r, n)| format!("{} {n}", r.name()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let evicted = self
            .evicted
            .iter()
            .map(|(r, n, why)| format!("{} {n} ({why})", r.name()))
            .collect::<Vec<_>>()
            .join(", ");
        let lost = self
            .lost_workers()
            .iter()
            .map(|w| format!("worker {w}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "job done; dead: [{}]; rejoined: [{}]; evicted: [{evicted}]; lost for good: [{lost}]",
            nodes(&self.dead),
            nodes(&self.rejoined)
        )
    }

    /// Whether losing workers for good fails the job, and why: under a synchronous update
    /// (BSP, Sync-opt, enforced EPSP) each step stood for every worker's batch, so steps
    /// taken without a worker are not the job asked for; asynchronous and bounded-staleness
    /// policies take whichever gradients arrive, and their job goes on by design.
    pub fn loss_fails_job(&self, mode: crate::update::UpdateMode) -> Option<String> {
        let lost = self.lost_workers();
        if lost.is_empty() || mode != crate::update::UpdateMode::Sync {
            return None;
        }
        Some(format!(
            "worker(s) {} died and never came back: the synchronous steps after that went on without them, so the job did not train as asked (under asynchronous and bounded-staleness policies the job goes on by design)",
            lost.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
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
