//! A server: owns shards, applies updates, runs one sync-policy instance per shard.
//!
//! Each shard has three kinds of region, all granted to every worker: the parameters (read
//! one-sided by workers whose lock-free check passes), the meta block (version and per-worker
//! clocks under a seqlock, see `meta`), and one gradient slot per worker (written one-sided by
//! that worker, with an immediate naming the shard). The event loop is single-threaded: it
//! owns every shard, so no lock is taken on the data path.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Op, Region, RemoteKey, Transport};

use crate::auth::{self, Purpose};
use crate::checkpoint::Checkpoint;
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::ShardSpec;
use crate::proto::{Book, Immediate, Msg, PushKind, ResumeShard, Role, ShardKeys, SlotTrailer};
pub use crate::shard::WorkerCounters;
use crate::shard::{Input, Output, RegionParams, ShardConfig, ShardCore, ShardParams};
use crate::update::{Constant, GradientScale, LrSchedule, ShardOptimizer, Unscaled};

/// The name of the cap on an attached worker's messages (`KeyMap::worker_message_cap`).
const WORKER_CAP: &str = "the cap on an attached worker's messages (16 bytes per float of this server's shards, at least the control cap)";

/// Hooks an embedding program may set on a server.
#[derive(Clone)]
pub struct ServerHooks {
    /// The learning-rate schedule.
    pub schedule: Arc<dyn LrSchedule>,
    /// The staleness scaling of gradients (DynSGD/ConSGD seam).
    pub scale: Arc<dyn GradientScale>,
}

impl Default for ServerHooks {
    fn default() -> Self {
        ServerHooks {
            schedule: Arc::new(Constant),
            scale: Arc::new(Unscaled),
        }
    }
}

/// What a server did, returned when the job ends.
#[derive(Clone, Debug, Default)]
pub struct ServerReport {
    /// This server's rank.
    pub rank: u32,
    /// Gradients applied (async) or aggregated into an update (sync), per shard.
    pub gradients: u64,
    /// Updates applied to parameters.
    pub updates: u64,
    /// Pulls that waited for the policy ("delayed pulls").
    pub delayed_pulls: u64,
    /// Pulls answered by the server (slow path).
    pub answered_pulls: u64,
    /// Gradients the policy dropped (Sync-opt: late ones).
    pub dropped_gradients: u64,
    /// Late gradients added to a later step (`syncopt(…,fold)`).
    pub folded_gradients: u64,
    /// Pushes received again (retries) and not applied again.
    pub duplicate_pushes: u64,
    /// Per shard: what an outside check of exactly-once needs (see [`ShardAccount`]).
    pub accounts: Vec<ShardAccount>,
    /// Sync mode: the most gradient bytes one shard held waiting for their step.
    pub peak_pending_bytes: u64,
    /// Sync mode: acknowledgements held back because a shard was over its memory cap.
    pub held_acks: u64,
    /// Checkpoints written.
    pub checkpoints: u64,
    /// Checkpoint writes that failed (each one reported to the scheduler).
    pub checkpoint_failures: u64,
    /// The last checkpoint failure, in words.
    pub last_checkpoint_failure: Option<String>,
    /// The checkpoint this server restarted from (its number), if it did.
    pub restored_from: Option<u64>,
    /// Acknowledged updates lost with the previous incarnation of this server (applied after
    /// its last checkpoint), as the reattaching workers counted them.
    pub lost_updates: u64,
    /// Asynchronously applied gradients: the sum and the maximum of their version staleness.
    pub staleness_sum: u64,
    /// The largest version staleness of an applied gradient.
    pub staleness_max: u64,
    /// Final parameters of each shard, by global shard id.
    pub params: BTreeMap<u32, Vec<f32>>,
    /// Per worker (by rank), what the policies of this server's shards did to it.
    pub per_worker: Vec<WorkerCounters>,
    /// Per shard of this server.
    pub per_shard: Vec<ShardCounters>,
    /// Workers the scheduler declared dead while this server served, in order (a worker
    /// that died twice is there twice).
    pub workers_dead: Vec<u32>,
    /// Workers that rejoined after being declared dead, in order.
    pub workers_rejoined: Vec<u32>,
    /// Workers still dead when the job ended: lost for good.
    pub workers_lost: Vec<u32>,
}

impl ServerReport {
    /// Who the scheduler declared dead while this server served, who rejoined and who was
    /// lost for good, in one line (`server 0: workers dead: [3]; rejoined: []; lost for good: [3]`).
    pub fn ending(&self) -> String {
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        format!(
            "server {}: workers dead: [{}]; rejoined: [{}]; lost for good: [{}]",
            self.rank,
            list(&self.workers_dead),
            list(&self.workers_rejoined),
            list(&self.workers_lost)
        )
    }
}

/// One shard's push accounting at the end: every sequence number of every worker up to
/// `pushes` was applied once or passed over once (`skipped`), so with a constant gradient the
/// parameters reveal whether any was applied twice.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardAccount {
    /// Global shard id.
    pub shard: u32,
    /// Its first parameter.
    pub first: f32,
    /// Sum over workers of the last sequence number applied or passed over.
    pub pushes: u64,
    /// Sum over workers of the sequence numbers passed over.
    pub skipped: u64,
    /// Transferred-task gradients applied (sum over workers of the last help sequence).
    pub helps: u64,
}

/// Traffic of one shard.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardCounters {
    /// Global shard id.
    pub shard: u32,
    /// Gradient bytes received (pushes).
    pub bytes_in: u64,
    /// Parameter bytes the server wrote to answer pulls (one-sided fast-path reads by the
    /// workers are counted by them, in `WorkerStats`).
    pub bytes_out: u64,
    /// Gradients received.
    pub gradients: u64,
    /// Pulls the server answered.
    pub answered_pulls: u64,
}

/// One shard of this server: its state machine, the regions workers read (parameters and
/// meta block) and the slots they write their gradients into.
struct Shard {
    spec: ShardSpec,
    core: ShardCore,
    params: RegionParams,
    slots: Vec<Region>,
}

/// A pull waiting for its shard's policy: where the answer goes.
struct ParkedPull {
    link: LinkId,
    to: PullTo,
    req: u32,
}

/// A gradient in a worker's slot, read a block at a time while it is applied.
struct SlotGrad<'a> {
    slot: &'a falcon_transport::Region,
    /// Its floats (the slot was checked to hold them).
    floats: usize,
}

impl crate::shard::GradSlot for SlotGrad<'_> {
    fn len(&self) -> usize {
        self.floats
    }

    fn read(&self, at: usize, out: &mut [f32]) {
        // In bounds (checked when the push arrived), so the read cannot fail; were it to,
        // the block would count as a zero gradient rather than as stale bytes.
        let bytes = zerocopy::IntoBytes::as_mut_bytes(out);
        if let Err(e) = self.slot.read_at(4 * at as u64, bytes) {
            tracing::warn!("reading a gradient in its slot: {e}; the block counts as zero");
            out.fill(0.0);
        }
    }
}

/// A gradient left in the worker's memory (shm), read a block at a time out of its mapping
/// while it is applied.
struct PeerGrad<'a> {
    link: &'a Link,
    key: RemoteKey,
    /// Where its first float lies in the worker's region.
    off: u64,
    /// Its floats (the range was checked to lie in the worker's mapping).
    floats: usize,
    /// A block already failed (its warning given: one a push).
    failed: std::sync::atomic::AtomicBool,
}

impl PeerGrad<'_> {
    /// The gradient a trailer names, once its key is the worker's and its whole range lies in
    /// the worker's mapping: what is wrong otherwise.
    fn checked<'a>(
        link: &'a Link,
        src: &crate::proto::TrailerSrc,
        floats: usize,
    ) -> std::result::Result<PeerGrad<'a>, String> {
        let key = RemoteKey::from_bytes(&src.key).map_err(|e| e.to_string())?;
        let grad = PeerGrad {
            link,
            key,
            off: src.off,
            floats,
            failed: std::sync::atomic::AtomicBool::new(false),
        };
        // Its first and last float, read through the mapping's own bounds.
        let last = src
            .off
            .checked_add(4 * floats.saturating_sub(1) as u64)
            .ok_or("its range overflows")?;
        let mut probe = [0u8; 4];
        for at in [src.off, last] {
            link.read_mapped(&key, at, &mut probe)
                .map_err(|e| e.to_string())?;
        }
        Ok(grad)
    }
}

impl crate::shard::GradSlot for PeerGrad<'_> {
    fn len(&self) -> usize {
        self.floats
    }

    fn read(&self, at: usize, out: &mut [f32]) {
        // In the mapping (checked when the push arrived); were the worker to revoke its region
        // meanwhile, the block would count as a zero gradient rather than as stale bytes.
        let bytes = zerocopy::IntoBytes::as_mut_bytes(out);
        if let Err(e) = self
            .link
            .read_mapped(&self.key, self.off + 4 * at as u64, bytes)
        {
            if !self.failed.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "reading a gradient in the worker's memory: {e}; its unreadable blocks count as zero"
                );
            }
            out.fill(0.0);
        }
    }
}

/// Tells the worker on `l` that its pull `req` was refused, and why.
fn refuse_pull(l: &Link, req: u32, reason: String) {
    let _ = l.send(&Msg::PullFailed { req, reason }.encode());
}

/// Where a released pull's values go.
enum PullTo {
    /// Written one-sided into the worker's region.
    Write { dst: RemoteKey, dst_off: u64 },
    /// Some ranges of the shard, gathered into a [`Msg::Rows`] message.
    Rows(crate::rows::RowIndex),
}

/// A server joined to its job, not yet serving.
pub struct Server {
    cfg: JobConfig,
    t: Transport,
    sched: Link,
    book: Book,
    hooks: ServerHooks,
    /// Completions that arrived before the book (workers attaching early).
    early: Vec<Completion>,
}

impl Server {
    /// Creates the server's transport and joins the job (blocks until rendezvous completes).
    pub fn join(cfg: JobConfig, rank: Option<u32>, hooks: ServerHooks) -> Result<Server> {
        let t = Transport::new(cfg.transport_config())?;
        let (sched, book, early) =
            crate::postoffice::rendezvous(&t, &cfg, Role::Server, rank, Vec::new())?;
        Ok(Server {
            cfg,
            t,
            sched,
            book,
            hooks,
            early,
        })
    }

    /// This server's rank.
    pub fn rank(&self) -> u32 {
        self.book.rank
    }

    /// Serves until the scheduler ends the job. A server the scheduler fenced (declared dead
    /// while it was paused or cut off; with checkpoints on, it is replaced by a restart from
    /// its checkpoint) stops serving at once with [`Error::Fenced`]: its process must end, and
    /// a successor started under its rank restores the checkpoint — so there are never two
    /// servers for one rank.
    pub fn run(self) -> Result<ServerReport> {
        let (cfg, hooks, rank) = (self.cfg.clone(), self.hooks.clone(), self.book.rank);
        let mut server = self;
        loop {
            let recovery = server.book.recovery;
            match server.serve() {
                Err(Error::Fenced { reason, .. }) if recovery => {
                    tracing::warn!(
                        "server {rank}: fenced by the scheduler ({reason}); restarting from its checkpoint"
                    );
                    // A scheduler that is really gone is given up on soon.
                    let cfg = JobConfig {
                        rendezvous_timeout: cfg
                            .rendezvous_timeout
                            .min(crate::config::REJOIN_TIMEOUT),
                        ..cfg.clone()
                    };
                    server = Server::join(cfg, Some(rank), hooks.clone())?;
                }
                other => return other,
            }
        }
    }

    fn serve(self) -> Result<ServerReport> {
        let Server {
            cfg,
            t,
            sched,
            book,
            hooks,
            early,
        } = self;
        let mut s = Serving::new(cfg, t, sched, book, &hooks)?;
        // Heartbeats from their own thread, which ends with this incarnation.
        let serving = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let _stop_beats = StopOnDrop(serving.clone(), s.sched.clone());
        crate::heartbeat::start(
            &format!("falcon-server-{}-heartbeat", s.book.rank),
            s.sched.clone(),
            s.cfg.heartbeat,
            move || serving.load(std::sync::atomic::Ordering::Acquire),
            // The serving loop sends its own counters (`metrics_when_due`).
            || None,
        )?;
        let mut early = early.into_iter();
        loop {
            s.checkpoint_when_due();
            s.metrics_when_due();
            s.accept_and_expire();
            let c = match early.next() {
                Some(c) => c,
                None => match s.t.cq().wait(Some(s.cfg.heartbeat)) {
                    Ok(c) => c,
                    Err(_) => continue,
                },
            };
            if let Flow::Stop = s.on_completion(c)? {
                break;
            }
        }
        Ok(s.finish())
    }
}

/// An acknowledgement or answer held in the outbox, for the link it goes on.
struct Queued {
    link: LinkId,
    what: Out,
}

/// What an outbox holds.
enum Out {
    /// A control message.
    Msg(Vec<u8>),
    /// A pull's answer: local shard `shard`'s values as pulled, `len` bytes into the
    /// worker's `dst` from `dst_off`, with the request id as immediate.
    Answer {
        shard: usize,
        dst: RemoteKey,
        dst_off: u64,
        len: u64,
        imm: u32,
    },
}

/// Sends `msg` on `link` now, or holds it in `outbox` while a push with a pull riding on it
/// is handled.
fn send_or_hold(
    outbox: Option<&mut Vec<Queued>>,
    links: &HashMap<LinkId, Link>,
    link: LinkId,
    msg: Vec<u8>,
) -> std::result::Result<(), falcon_transport::Error> {
    match (outbox, links.get(&link)) {
        (Some(ob), _) => {
            ob.push(Queued {
                link,
                what: Out::Msg(msg),
            });
            Ok(())
        }
        (None, Some(l)) => l.send(&msg),
        (None, None) => Ok(()),
    }
}

/// Whether the event loop goes on.
enum Flow {
    Go,
    Stop,
}

/// A serving incarnation: the driver around this server's shard cores. It owns the links,
/// admission (challenge and attach), the pulls waiting for an answer, the checkpoint timer
/// and the report; every decision about a shard is its [`ShardCore`]'s.
struct Serving {
    cfg: JobConfig,
    t: Transport,
    sched: Link,
    book: Book,
    shards: Vec<Shard>,
    /// Global shard id → index in `shards`.
    local_of: HashMap<u32, usize>,
    links: HashMap<LinkId, Link>,
    /// Accepted links not attached yet, with when they came.
    unattached: HashMap<LinkId, Instant>,
    /// The challenge sent to each accepted link, used once by its attach.
    nonces: HashMap<LinkId, Vec<u8>>,
    worker_of: HashMap<LinkId, u32>,
    link_of: HashMap<u32, LinkId>,
    /// Pulls waiting for their shard's policy, by (worker << 32 | request id).
    parked: HashMap<u64, ParkedPull>,
    /// While a push with a pull riding on it is handled: the acknowledgements and answers it
    /// brings, sent after it together, one write per link (its acknowledgement and answer go
    /// as one).
    outbox: Option<Vec<Queued>>,
    /// When the counters go to the scheduler's metrics next.
    next_metrics: Instant,
    /// Per helper, the last task-transfer offer sent to it (each shard's policy may make the
    /// same offer: the worker hears it once).
    offered: HashMap<u32, (u32, u64)>,
    transfers_offered: Vec<u64>,
    dead: HashSet<u32>,
    /// Workers declared dead, and those that rejoined, in order (for the report).
    deaths: Vec<u32>,
    rejoins: Vec<u32>,
    start: Instant,
    checkpointer: Option<(Duration, Checkpointer)>,
    /// Checkpoints handed to the writer.
    taken: u64,
    last_checkpoint: Instant,
    restored_from: Option<u64>,
    lost_updates: u64,
    job: u64,
}

impl Serving {
    fn new(
        cfg: JobConfig,
        t: Transport,
        sched: Link,
        book: Book,
        hooks: &ServerHooks,
    ) -> Result<Serving> {
        // The job's rule (from the book) unless it is none and the embedder set one.
        let scale = match book.scale {
            crate::update::ScaleSpec::Unscaled => hooks.scale.clone(),
            spec => spec.build(),
        };
        let workers = book.workers as usize;
        let mut shards = Vec::new();
        let mut local_of = HashMap::new();
        for spec in book.keymap.shards_on(book.rank) {
            local_of.insert(spec.id, shards.len());
            let len = spec.len as usize;
            let shard_cfg = ShardConfig {
                id: spec.id,
                len,
                workers: book.workers,
                mode: book.mode,
                aggregate: book.aggregate,
                max_pending_bytes: cfg.max_pending_bytes,
            };
            let opt = ShardOptimizer::new(book.optimizer, hooks.schedule.clone(), len);
            let policy = book.policy.build_for(book.workers, spec.id);
            shards.push(Shard {
                spec: *spec,
                core: ShardCore::new(shard_cfg, policy, opt, scale.clone()),
                params: RegionParams::with_wire(len, book.workers, book.wire_of(spec.tensor))?,
                // Each slot holds the gradient and its trailer (`SlotTrailer`).
                slots: (0..workers)
                    .map(|_| Region::new(spec.bytes() + SlotTrailer::BYTES))
                    .collect::<Result<_, _>>()?,
            });
        }
        let checkpointer = match (&cfg.checkpoint, book.recovery) {
            (Some(c), true) => Some((c.every, Checkpointer::start(c, book.rank, sched.clone())?)),
            _ => None,
        };
        let job = crate::config::job_hash(&cfg.job);
        let mut s = Serving {
            cfg,
            t,
            sched,
            book,
            shards,
            local_of,
            links: HashMap::new(),
            unattached: HashMap::new(),
            nonces: HashMap::new(),
            worker_of: HashMap::new(),
            link_of: HashMap::new(),
            parked: HashMap::new(),
            outbox: None,
            next_metrics: Instant::now(),
            offered: HashMap::new(),
            transfers_offered: vec![0; workers],
            dead: HashSet::new(),
            deaths: Vec::new(),
            rejoins: Vec::new(),
            start: Instant::now(),
            checkpointer,
            taken: 0,
            last_checkpoint: Instant::now(),
            restored_from: None,
            lost_updates: 0,
            job,
        };
        let resume = s.cfg.checkpoint.as_ref().is_some_and(|c| c.resume);
        if s.book.rejoin || resume {
            s.restore_checkpoint(s.book.rejoin)?;
        }
        Ok(s)
    }

    /// A server admitted into a running job restarts from its checkpoint of this run
    /// (`this_run`); a server of a resumed job starts from its checkpoint of an earlier run
    /// of the same job.
    fn restore_checkpoint(&mut self, this_run: bool) -> Result<()> {
        let (rank, workers) = (self.book.rank, self.book.workers);
        let Some(c) = self
            .cfg
            .checkpoint
            .as_ref()
            .filter(|_| self.checkpointer.is_some())
        else {
            return Err(Error::Config(
                "admitted into a running job as a restarted server, but no checkpoint directory is configured".into(),
            ));
        };
        let saved = if this_run {
            // A resumed run's server that dies before its first checkpoint of this run
            // restarts from the earlier run's, as the run itself started.
            crate::checkpoint::load(&c.dir, rank, self.job, workers)?
                .filter(|k| k.instance == self.book.instance || c.resume)
                .ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "server {rank} restarted into a running job, but {} holds no checkpoint of this run",
                        c.dir.display()
                    ))
                })?
        } else {
            crate::checkpoint::load_to_resume(&c.dir, rank, self.job, workers)?
        };
        let bad = |why: String| Error::Checkpoint(format!("does not fit this server: {why}"));
        if saved.shards.len() != self.shards.len() {
            return Err(bad(format!(
                "{} shards saved, {} here",
                saved.shards.len(),
                self.shards.len()
            )));
        }
        for (s, st) in self.shards.iter_mut().zip(&saved.shards) {
            s.core.restore(st, &mut s.params).map_err(bad)?;
        }
        self.restored_from = Some(saved.number);
        if this_run {
            tracing::warn!(
                "server {rank}: restarted from checkpoint {} ({} shards)",
                saved.number,
                saved.shards.len()
            );
        } else {
            tracing::info!(
                "server {rank}: resumed from checkpoint {} ({} shards)",
                saved.number,
                saved.shards.len()
            );
        }
        Ok(())
    }

    /// Hands a snapshot to the checkpoint writer when one is due (and the writer is free).
    fn checkpoint_when_due(&mut self) {
        let Some((every, writer)) = &self.checkpointer else {
            return;
        };
        if self.last_checkpoint.elapsed() < *every {
            return;
        }
        // Numbered on from the checkpoint this server restarted from.
        let number = self.restored_from.unwrap_or(0) + self.taken + 1;
        let taken_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let snapshot = Checkpoint {
            job: self.job,
            instance: self.book.instance,
            rank: self.book.rank,
            workers: self.book.workers,
            number,
            taken_ms,
            shards: self
                .shards
                .iter()
                .map(|s| s.core.state(&s.params))
                .collect(),
        };
        if writer.offer(snapshot) {
            self.taken += 1;
            self.last_checkpoint = Instant::now();
        }
    }

    /// Takes the links the transport accepted; drops those that did not attach in time.
    fn accept_and_expire(&mut self) {
        self.drain_accepted();
        let admission = crate::config::admission_deadline(&self.cfg);
        let (rank, links, nonces) = (self.book.rank, &mut self.links, &mut self.nonces);
        self.unattached.retain(|id, at| {
            let who = format_args!("server {rank}");
            if !crate::postoffice::overdue(links.get(id), *at, admission, who) {
                return true;
            }
            links.remove(id);
            nonces.remove(id);
            false
        });
    }

    /// Moves every link the transport has accepted into `links`, noting it as not attached.
    fn drain_accepted(&mut self) {
        let (links, unattached) = (&mut self.links, &mut self.unattached);
        crate::postoffice::each_accepted(&self.t, |l| {
            unattached.insert(l.id(), Instant::now());
            links.insert(l.id(), l);
        });
    }

    fn on_completion(&mut self, c: Completion) -> Result<Flow> {
        match c {
            Completion::Message { link, data } if link == self.sched.id() => {
                return self.on_scheduler(&data);
            }
            Completion::Message { link, data } => self.on_message(link, &data)?,
            Completion::WriteImm { link, imm } => self.on_push(link, imm),
            Completion::Closed { link, error } if link == self.sched.id() => {
                let why = crate::postoffice::closed_why(&error);
                if self.book.recovery {
                    // Cut off, or declared dead while paused: this incarnation must stop.
                    return Err(Error::Fenced {
                        rank: self.book.rank,
                        reason: format!("the link to the scheduler closed ({why})"),
                    });
                }
                return Err(Error::PeerGone {
                    role: "scheduler",
                    rank: 0,
                    why: format!("its link closed ({why})"),
                });
            }
            Completion::Closed { link, .. } => {
                self.drain_accepted();
                self.forget_link(link);
            }
        }
        Ok(Flow::Go)
    }

    /// Forgets `link` and what is kept for it: its worker, its pulls waiting for a policy.
    fn forget_link(&mut self, link: LinkId) {
        self.links.remove(&link);
        self.unattached.remove(&link);
        self.nonces.remove(&link);
        if let Some(w) = self.worker_of.remove(&link) {
            self.link_of.remove(&w);
        }
        self.parked.retain(|_, p| p.link != link);
    }

    /// A handshake step on `l` failed. That concerns this link alone (most often a peer
    /// that closed it mid-handshake): the link goes, the server goes on.
    fn handshake_failed(&mut self, l: &Link, e: &Error) {
        match e {
            Error::Transport(falcon_transport::Error::Closed { .. }) => tracing::debug!(
                "server {}: a handshake ended with its link: {e}",
                self.book.rank
            ),
            _ => tracing::warn!(
                "server {}: a handshake failed: {e}; closing that link",
                self.book.rank
            ),
        }
        l.close();
        self.forget_link(l.id());
    }

    fn on_scheduler(&mut self, data: &[u8]) -> Result<Flow> {
        match Msg::decode(data) {
            Ok(Msg::Shutdown) => {
                // Transferred tasks late for the last step are applied, not dropped.
                for i in 0..self.shards.len() {
                    self.feed(i, Input::End);
                }
                return Ok(Flow::Stop);
            }
            Ok(Msg::Evicted { reason }) => {
                return Err(Error::Fenced {
                    rank: self.book.rank,
                    reason,
                });
            }
            Ok(Msg::Dead {
                role: Role::Worker,
                rank,
            }) => {
                if self.dead.insert(rank) {
                    self.deaths.push(rank);
                }
                for i in 0..self.shards.len() {
                    self.feed(i, Input::Leave { worker: rank });
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(
                "server {}: bad message from the scheduler: {e}",
                self.book.rank
            ),
        }
        Ok(Flow::Go)
    }

    fn on_message(&mut self, link: LinkId, data: &[u8]) -> Result<()> {
        if !self.links.contains_key(&link) {
            // The transport hands a link over before its first completion: one still unknown
            // was refused or forgotten here already.
            self.drain_accepted();
        }
        let Some(l) = self.links.get(&link).cloned() else {
            return Ok(());
        };
        match Msg::decode(data) {
            Ok(Msg::Knock) => {
                if let Err(e) = auth::challenge(&l, &mut self.nonces) {
                    self.handshake_failed(&l, &e);
                }
            }
            Ok(Msg::Attach { rank, proof }) => {
                if let Err(e) = self.on_attach(&l, rank, &proof) {
                    self.handshake_failed(&l, &e);
                }
            }
            Ok(Msg::PullReq {
                shard,
                clock,
                req,
                dst,
                dst_off,
            }) => self.on_pull_req(&l, shard, clock, req, (&dst, dst_off)),
            Ok(Msg::PullRows {
                shard,
                clock,
                req,
                ranges,
            }) => match crate::rows::index_of_pull(ranges) {
                Ok(r) => self.on_pull_rows(&l, shard, clock, req, r),
                Err(e) => refuse_pull(&l, req, e.to_string()),
            },
            Ok(Msg::Resume {
                rejoin,
                shards: resume,
            }) => self.on_resume(&l, rejoin, resume),
            Ok(other) => tracing::warn!(
                "server {}: unexpected {} message",
                self.book.rank,
                other.name()
            ),
            Err(e) => {
                tracing::warn!("server {}: {e}; closing that link", self.book.rank);
                l.close();
            }
        }
        Ok(())
    }

    /// A worker attaches: its answer to the challenge is checked, then it gets every shard's
    /// keys and where it starts.
    fn on_attach(&mut self, l: &Link, rank: u32, proof: &[u8]) -> Result<()> {
        let link = l.id();
        let proof_ok = self
            .nonces
            .remove(&link)
            .is_some_and(|n| auth::check(&self.cfg.token, Purpose::Attach, &n, proof));
        tracing::debug!("server {}: worker {rank} attaches", self.book.rank);
        if !proof_ok || rank >= self.book.workers {
            let m = Msg::Failed {
                what: "attach".into(),
                reason: format!(
                    "worker {rank} refused (wrong answer to the challenge: wrong job token; or a bad or duplicate rank)"
                ),
            };
            let _ = l.send(&m.encode());
            l.close();
            self.forget_link(link);
            return Ok(());
        }
        // A worker reconnecting (its old link dropped, perhaps not yet noticed here): the new
        // link replaces the old one.
        if let Some(old) = self.link_of.get(&rank).copied()
            && old != link
        {
            if let Some(o) = self.links.remove(&old) {
                o.close();
            }
            self.worker_of.remove(&old);
            self.parked.retain(|_, p| p.link != old);
        }
        let mut keys = Vec::new();
        for s in &self.shards {
            keys.push(ShardKeys {
                shard: s.spec.id,
                params: l.grant(s.params.pull_region())?.to_bytes().to_vec(),
                meta: l.grant(s.params.meta_region())?.to_bytes().to_vec(),
                clock: s.core.start_clock(rank),
                slot: l.grant(&s.slots[rank as usize])?.to_bytes().to_vec(),
            });
        }
        self.worker_of.insert(link, rank);
        self.link_of.insert(rank, link);
        self.unattached.remove(&link);
        // An attached worker may send row requests larger than a control message.
        l.limit_messages(
            self.book
                .keymap
                .worker_message_cap(self.book.rank, self.cfg.transport.max_accepted_message),
            WORKER_CAP,
        );
        let _ = l.send(&Msg::Keys { shards: keys }.encode());
        Ok(())
    }

    /// A pull the worker's lock-free check did not allow: parked here, answered when its
    /// shard's policy releases it.
    fn on_pull_req(&mut self, l: &Link, shard: u32, clock: u64, req: u32, dst: (&[u8], u64)) {
        let Some((w, i)) = self.pull_target(l, shard, req) else {
            return;
        };
        let fail = |reason: String| refuse_pull(l, req, reason);
        let (dst, dst_off) = dst;
        let bytes = self.shards[i].spec.bytes();
        let dst = match RemoteKey::from_bytes(dst) {
            Ok(k) if k.owner != l.peer_node() => {
                fail("pull destination key is not of the worker asking".into());
                return;
            }
            Ok(k) if dst_off.checked_add(bytes).is_some_and(|e| e <= k.len) => k,
            _ => {
                fail("pull destination key is malformed or too short".into());
                return;
            }
        };
        self.park(l, (w, i), clock, req, PullTo::Write { dst, dst_off });
    }

    /// Parks a pull of worker `w` on local shard `i` and hands it to the shard's policy,
    /// which answers it now or later.
    fn park(&mut self, l: &Link, (w, i): (u32, usize), clock: u64, req: u32, to: PullTo) {
        let id = (u64::from(w) << 32) | u64::from(req);
        self.parked.insert(
            id,
            ParkedPull {
                link: l.id(),
                to,
                req,
            },
        );
        self.feed(
            i,
            Input::Pull {
                worker: w,
                clock,
                req: id,
            },
        );
    }

    /// The worker a pull on `l` comes from and the local index of its shard; a shard not
    /// here is refused (`PullFailed`), an unattached link ignored.
    fn pull_target(&self, l: &Link, shard: u32, req: u32) -> Option<(u32, usize)> {
        let &w = self.worker_of.get(&l.id())?;
        let Some(&i) = self.local_of.get(&shard) else {
            refuse_pull(
                l,
                req,
                format!("shard {shard} is not on server {}", self.book.rank),
            );
            return None;
        };
        Some((w, i))
    }

    /// Some rows of a shard: parked like any pull, answered with the rows alone.
    fn on_pull_rows(
        &mut self,
        l: &Link,
        shard: u32,
        clock: u64,
        req: u32,
        ranges: crate::rows::RowIndex,
    ) {
        let Some((w, i)) = self.pull_target(l, shard, req) else {
            return;
        };
        let fail = |reason: String| refuse_pull(l, req, reason);
        let len = self.shards[i].spec.len;
        if ranges.reach() > len {
            fail(format!(
                "rows up to float {} lie outside shard {shard} of {len} floats",
                ranges.reach()
            ));
            return;
        }
        // Repeated rows may ask for more floats than the shard holds, but never for an answer
        // larger than one message may be.
        let floats = ranges.floats();
        let limit = self.cfg.transport.max_message / 4;
        if floats > limit {
            fail(format!(
                "a row pull of {floats} floats from shard {shard}: an answer holds at most {limit}"
            ));
            return;
        }
        self.park(l, (w, i), clock, req, PullTo::Rows(ranges));
    }

    /// A worker reattached (or rejoined) says where it stands on each shard.
    fn on_resume(&mut self, l: &Link, rejoin: bool, resume: Vec<ResumeShard>) {
        let Some(&w) = self.worker_of.get(&l.id()) else {
            return;
        };
        if rejoin && self.dead.remove(&w) {
            self.rejoins.push(w);
            tracing::info!("server {}: worker {w} rejoined", self.book.rank);
        }
        let mut lost = 0;
        for r in resume {
            let Some(&i) = self.local_of.get(&r.shard) else {
                continue;
            };
            let input = Input::Resume {
                worker: w,
                pushes: r.pushes,
                helps: r.helps,
                rejoin,
            };
            lost += self.feed(i, input);
        }
        self.lost_updates += lost;
        if lost > 0 {
            tracing::warn!(
                "server {}: worker {w} had {lost} acknowledged updates this server lost (taken after its last checkpoint)",
                self.book.rank
            );
        }
        let _ = l.send(&Msg::Resumed { lost }.encode());
    }

    /// A one-sided push landed in a worker's slot. One with a pull riding on it has its
    /// acknowledgement and answers go out together once it is handled; any other's go at
    /// once (a gradient copied out of its slot is acknowledged before its apply, so the
    /// worker goes on while the server applies).
    fn on_push(&mut self, link: LinkId, v: u32) {
        self.take_push(link, v);
        self.flush_outbox();
    }

    /// Sends what the outbox holds, one batch per link in the order the links first appear.
    /// A batch refused by its checks before anything was sent (an answer's destination the
    /// link does not take) goes again item by item, so the others still go; after any other
    /// failure (some ops may have gone out) nothing goes again.
    fn flush_outbox(&mut self) {
        let Some(queued) = self.outbox.take() else {
            return;
        };
        let mut order: Vec<LinkId> = Vec::new();
        for q in &queued {
            if !order.contains(&q.link) {
                order.push(q.link);
            }
        }
        for link in order {
            let Some(l) = self.links.get(&link) else {
                continue;
            };
            let ops: Vec<Op<'_>> = queued
                .iter()
                .filter(|q| q.link == link)
                .map(|q| match &q.what {
                    Out::Msg(bytes) => Op::Send(bytes),
                    Out::Answer {
                        shard,
                        dst,
                        dst_off,
                        len,
                        imm,
                    } => Op::Write {
                        src: self.shards[*shard].params.pull_region(),
                        src_off: 0,
                        dst,
                        dst_off: *dst_off,
                        len: *len,
                        imm: Some(*imm),
                    },
                })
                .collect();
            match l.submit(&ops) {
                Ok(()) => continue,
                // Refused by the checks before anything went out: each op on its own.
                Err(
                    falcon_transport::Error::Config(_)
                    | falcon_transport::Error::OutOfBounds { .. },
                ) => {}
                Err(e) => {
                    // Some may have gone out (shm and rdma issue op by op): none again. A
                    // closed link's closure comes as a completion of its own.
                    tracing::debug!(
                        "server {}: acknowledgements or answers failed: {e}",
                        self.book.rank
                    );
                    continue;
                }
            }
            for op in &ops {
                if let Err(e) = l.submit(std::slice::from_ref(op)) {
                    tracing::warn!(
                        "server {}: an acknowledgement or answer failed: {e}",
                        self.book.rank
                    );
                }
            }
        }
    }

    /// Reads a push out of its slot (an f32 gradient is applied where it lies; the slot is
    /// free once acknowledged) and hands it to its shard, then the pull riding on it.
    fn take_push(&mut self, link: LinkId, v: u32) {
        let Some(&w) = self.worker_of.get(&link) else {
            return;
        };
        let rank = self.book.rank;
        let imm = match Immediate::unpack(v) {
            Ok(imm) => imm,
            Err(e) => {
                tracing::warn!("server {rank}: worker {w}: {e}; ignored");
                return;
            }
        };
        let i = imm.local as usize;
        let Some(s) = self.shards.get(i) else {
            tracing::warn!("server {rank}: push to unknown local shard {}", imm.local);
            return;
        };
        let slot = s.slots[w as usize].clone();
        let floats = s.spec.len as usize;
        // Initial values travel as f32; gradients in the tensor's wire precision.
        let wire = match imm.kind {
            PushKind::Init => crate::precision::Wire::F32,
            _ => self.book.wire_of(s.spec.tensor),
        };
        // A gradient in f32 is applied where it lies (`Grad::Slot`, acknowledged after the
        // apply): one pass over the slot instead of a copy and a pass over the copy.
        let in_slot = imm.kind == PushKind::Gradient && wire == crate::precision::Wire::F32;
        let (grad, ranges, trailer) = match read_slot(s, &slot, imm.kind, wire, in_slot) {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!("server {rank}: reading worker {w}'s slot: {e}");
                return;
            }
        };
        let SlotTrailer {
            computed_on,
            seq,
            help_for,
            pull,
            src,
            rates,
        } = SlotTrailer::from_bytes(trailer);
        let in_place = SlotGrad {
            slot: &slot,
            floats,
        };
        // A gradient the worker left in its memory (shm): read there, in place of the slot.
        let peer_link = src.and_then(|_| self.links.get(&link).cloned());
        let in_peer = match src {
            None => None,
            Some(src) => {
                let checked = match (&peer_link, in_slot) {
                    (Some(l), true) => PeerGrad::checked(l, &src, floats),
                    (None, _) => Err("its link is gone".to_string()),
                    (_, false) => {
                        Err("only an f32 gradient may be left in the worker's memory".to_string())
                    }
                };
                match checked {
                    Ok(g) => Some(g),
                    Err(e) => {
                        tracing::warn!(
                            "server {rank}: worker {w}: a push to shard {} names its gradient in the worker's memory, which cannot be read: {e}; ignored",
                            s.spec.id
                        );
                        // A pull riding on it is refused, not left waiting.
                        if let (Some(p), Some(l)) = (pull, &peer_link) {
                            refuse_pull(l, p.req, format!("its push was refused: {e}"));
                        }
                        return;
                    }
                }
            }
        };
        let held: Option<&dyn crate::shard::GradSlot> = match (&in_peer, in_slot) {
            (Some(g), _) => Some(g),
            (None, true) => Some(&in_place),
            (None, false) => None,
        };
        let input = push_input(
            imm.kind,
            (link, w),
            (seq, computed_on, help_for),
            (grad, ranges),
            held,
        );
        // A pull riding on a gradient push (push-pull): taken as its request right behind the
        // push would be, its answer sent with the push's acknowledgement. Other kinds of push
        // never carry one; a pull there is ignored.
        let pull = pull.filter(|_| imm.kind == PushKind::Gradient);
        if pull.is_some() {
            self.outbox = Some(Vec::new());
        }
        if imm.kind != PushKind::Init {
            self.shards[i].core.set_rates(rates.unwrap_or_default());
        }
        self.feed(i, input);
        if let Some(p) = pull
            && let Some(l) = self.links.get(&link).cloned()
        {
            let shard = self.shards[i].spec.id;
            self.on_pull_req(&l, shard, seq, p.req, (&p.dst, p.dst_off));
        }
    }

    /// Feeds shard `i` and carries out what it says: acknowledgements at once (as the core
    /// gives them: an async push read from its slot after its apply, one copied out before),
    /// then answers, refusals and offers. Returns the updates a resuming worker lost.
    fn feed(&mut self, i: usize, input: Input<'_>) -> u64 {
        let now = self.start.elapsed().as_nanos() as u64;
        let mut later = Vec::new();
        {
            let (links, s, outbox) = (&self.links, &mut self.shards[i], &mut self.outbox);
            let id = s.spec.id;
            let r = s.core.handle(now, input, &mut s.params, &mut |o| match o {
                Output::Ack {
                    conn,
                    of,
                    staleness,
                    ..
                } => {
                    let msg = Msg::PushAck {
                        shard: id,
                        of,
                        staleness,
                    }
                    .encode();
                    let _ = send_or_hold(outbox.as_mut(), links, conn, msg);
                }
                other => later.push(other),
            });
            if let Err(e) = r {
                tracing::warn!("server {}: shard {id}: {e}; ignored", self.book.rank);
            }
        }
        let mut lost = 0;
        for o in later {
            match o {
                Output::Answer { req, .. } => self.answer(i, req),
                Output::Refuse { req, reason, .. } => {
                    if let Some(p) = self.parked.remove(&req)
                        && let Some(l) = self.links.get(&p.link)
                    {
                        refuse_pull(l, p.req, reason);
                    }
                }
                Output::Offer {
                    helper,
                    straggler,
                    clock,
                } => self.offer(helper, straggler, clock),
                Output::Lost { updates, .. } => lost += updates,
                Output::Ack { .. } => {}
            }
        }
        lost
    }

    /// A released pull gets the latest values, written one-sided into the worker's
    /// destination with the request id as immediate.
    fn answer(&mut self, i: usize, req: u64) {
        let Some(p) = self.parked.remove(&req) else {
            return;
        };
        let Some(l) = self.links.get(&p.link) else {
            return;
        };
        let s = &self.shards[i];
        let len = self.book.wire_of(s.spec.tensor).bytes(s.spec.len);
        let r = match (p.to, self.outbox.as_mut()) {
            (PullTo::Write { dst, dst_off }, Some(ob)) => {
                ob.push(Queued {
                    link: p.link,
                    what: Out::Answer {
                        shard: i,
                        dst,
                        dst_off,
                        len,
                        imm: p.req,
                    },
                });
                Ok(())
            }
            (PullTo::Write { dst, dst_off }, None) => {
                l.write(s.params.pull_region(), 0, &dst, dst_off, len, Some(p.req))
            }
            (PullTo::Rows(ranges), ob) => {
                // Gathered straight into the answer (ranges were checked against the shard).
                let v = zerocopy::IntoBytes::as_bytes(s.params.values());
                let n = ranges.floats() as usize;
                let msg = Msg::encode_rows(p.req, 4 * n, |out| ranges.gather(v, out));
                send_or_hold(ob, &self.links, p.link, msg)
            }
        };
        if let Err(e) = r {
            tracing::warn!("server {}: answering a pull failed: {e}", self.book.rank);
        }
    }

    /// Offers `helper` tasks of `straggler`'s iteration `clock`, once for all shards.
    fn offer(&mut self, helper: u32, straggler: u32, clock: u64) {
        if self.offered.get(&helper) == Some(&(straggler, clock)) {
            return;
        }
        self.offered.insert(helper, (straggler, clock));
        if let Some(c) = self.transfers_offered.get_mut(helper as usize) {
            *c += 1;
        }
        if let Some(l) = self.link_of.get(&helper).and_then(|id| self.links.get(id)) {
            let _ = l.send(&Msg::Offer { straggler, clock }.encode());
        }
    }

    /// Every heartbeat interval: this server's counters to the scheduler's metrics.
    fn metrics_when_due(&mut self) {
        let now = Instant::now();
        if now < self.next_metrics {
            return;
        }
        self.next_metrics = now + self.cfg.heartbeat;
        let _ = self.sched.send(&Msg::Metrics(self.counters()).encode());
    }

    /// This server's totals over its shards (what the metrics and the report share).
    fn counters(&self) -> crate::metrics::NodeMetrics {
        let mut m = crate::metrics::NodeMetrics {
            parked_pulls: self.parked.len() as u64,
            ..Default::default()
        };
        for s in &self.shards {
            let st = s.core.stats();
            let policy = s.core.policy();
            m.pushes += st.gradients;
            m.pulls += st.answered_pulls;
            m.bytes_in += st.bytes_in;
            m.bytes_out += st.bytes_out;
            m.updates += st.updates;
            m.staleness_sum += st.staleness_sum;
            m.staleness_max = m.staleness_max.max(st.staleness_max);
            m.delayed_pulls += policy.delayed_total();
            m.dropped_gradients += policy.dropped();
            m.folded_gradients += st
                .per_worker
                .iter()
                .map(|c| c.folded_gradients)
                .sum::<u64>();
        }
        m
    }

    /// What this incarnation did.
    fn finish(self) -> ServerReport {
        let workers = self.book.workers as usize;
        let totals = self.counters();
        let mut report = ServerReport {
            rank: self.book.rank,
            per_worker: vec![WorkerCounters::default(); workers],
            restored_from: self.restored_from,
            lost_updates: self.lost_updates,
            gradients: totals.pushes,
            updates: totals.updates,
            answered_pulls: totals.pulls,
            staleness_sum: totals.staleness_sum,
            staleness_max: totals.staleness_max,
            delayed_pulls: totals.delayed_pulls,
            dropped_gradients: totals.dropped_gradients,
            workers_dead: self.deaths.clone(),
            workers_rejoined: self.rejoins.clone(),
            workers_lost: {
                let mut lost: Vec<u32> = self.dead.iter().copied().collect();
                lost.sort_unstable();
                lost
            },
            ..Default::default()
        };
        for (w, c) in report.per_worker.iter_mut().enumerate() {
            c.transfers_offered = self.transfers_offered[w];
        }
        for s in &self.shards {
            let st = s.core.stats();
            let policy = s.core.policy();
            report.duplicate_pushes += st.duplicate_pushes;
            report.peak_pending_bytes = report.peak_pending_bytes.max(st.peak_pending_bytes);
            report.held_acks += st.held_acks;
            for (w, c) in report.per_worker.iter_mut().enumerate() {
                let mine = &st.per_worker[w];
                c.parked_pulls += mine.parked_pulls;
                c.dropped_gradients += mine.dropped_gradients;
                c.folded_gradients += mine.folded_gradients;
                report.folded_gradients += mine.folded_gradients;
                c.help_pushes += mine.help_pushes;
                c.grants += policy.grants(w as u32);
                for (d, n) in &mine.staleness {
                    *c.staleness.entry(*d).or_default() += n;
                }
            }
            report.per_shard.push(ShardCounters {
                shard: s.spec.id,
                bytes_in: st.bytes_in,
                bytes_out: st.bytes_out,
                gradients: st.gradients,
                answered_pulls: st.answered_pulls,
            });
            let values = s.params.values();
            report.params.insert(s.spec.id, values.to_vec());
            let (pushes, skipped, helps) = s.core.account();
            report.accounts.push(ShardAccount {
                shard: s.spec.id,
                first: values.first().copied().unwrap_or(0.0),
                pushes,
                skipped,
                helps,
            });
        }
        if let Some((_, writer)) = &self.checkpointer {
            // Written, not merely taken (a write under way now is not counted).
            let (written, failed, last) = writer.counts();
            report.checkpoints = written;
            report.checkpoint_failures = failed;
            report.last_checkpoint_failure = last;
        }
        report
    }
}

/// Writes checkpoints on a thread of its own, so the event loop never waits for the disk. A
/// failed write is reported to the scheduler at once ([`Msg::CheckpointFailed`]) and logged
/// at most once per [`FAILURE_LOG_EVERY`], with the count of failures since the last line.
struct Checkpointer {
    /// `None` once dropped: the writer then finishes and ends.
    tx: Option<crossbeam_channel::Sender<Checkpoint>>,
    /// The writer, joined on drop: an incarnation's last checkpoint is on disk (or failed)
    /// before a successor in this process reads it.
    writer: Option<std::thread::JoinHandle<()>>,
    /// Writes done, writes failed, and the last failure in words.
    counts: Arc<std::sync::Mutex<(u64, u64, Option<String>)>>,
}

/// The least time between two log lines of one server's checkpoint failures.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

impl Checkpointer {
    fn start(
        settings: &crate::config::CheckpointSettings,
        rank: u32,
        sched: Link,
    ) -> Result<Checkpointer> {
        let dir = &settings.dir;
        let path = crate::checkpoint::path(dir, rank);
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::Checkpoint(format!(
                "create the checkpoint directory {}: {e}",
                dir.display()
            ))
        })?;
        let then = match settings.on_failure {
            crate::config::OnCheckpointFailure::Warn => "training goes on without it",
            crate::config::OnCheckpointFailure::Stop => "the scheduler stops the job",
        };
        let counts: Arc<std::sync::Mutex<(u64, u64, Option<String>)>> = Arc::default();
        let shared = Arc::clone(&counts);
        let (tx, rx) = crossbeam_channel::bounded::<Checkpoint>(1);
        let writer = std::thread::Builder::new()
            .name(format!("falcon-ckpt-{rank}"))
            .spawn(move || {
                // Failures since the last log line, and when that line was.
                let (mut unlogged, mut logged) = (0u64, None::<Instant>);
                let mut streak = 0u64;
                for c in rx {
                    let e = match crate::checkpoint::save(&path, &c) {
                        Ok(()) => {
                            shared.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
                            // Back to normal: said once, within the same rate limit.
                            if streak > 0 && logged.is_none_or(|t| t.elapsed() >= FAILURE_LOG_EVERY)
                            {
                                let total = shared.lock().unwrap_or_else(|p| p.into_inner()).1;
                                tracing::warn!(
                                    "server {rank}: checkpoint {} written again ({unlogged} failed since the last line, {total} in all)",
                                    c.number
                                );
                                logged = Some(Instant::now());
                                unlogged = 0;
                            }
                            streak = 0;
                            continue;
                        }
                        Err(e) => e.to_string(),
                    };
                    streak += 1;
                    unlogged += 1;
                    let total = {
                        let mut f = shared.lock().unwrap_or_else(|p| p.into_inner());
                        f.1 += 1;
                        f.2 = Some(e.clone());
                        f.1
                    };
                    let m = Msg::CheckpointFailed {
                        rank,
                        reason: e.clone(),
                        failures: total,
                    };
                    let _ = sched.send(&m.encode());
                    match logged {
                        None => tracing::error!("server {rank}: {e}; {then}"),
                        Some(t) if t.elapsed() >= FAILURE_LOG_EVERY => tracing::error!(
                            "server {rank}: {unlogged} checkpoint writes failed in the last {} s ({total} in all); the last: {e}",
                            t.elapsed().as_secs()
                        ),
                        Some(_) => continue,
                    }
                    logged = Some(Instant::now());
                    unlogged = 0;
                }
            })
            .map_err(|e| Error::os("cannot start the checkpoint writer", e))?;
        Ok(Checkpointer {
            tx: Some(tx),
            writer: Some(writer),
            counts,
        })
    }

    /// Hands a snapshot to the writer; false when it is still busy with the previous one.
    fn offer(&self, c: Checkpoint) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.try_send(c).is_ok())
    }

    /// Writes done so far, writes failed, and the last failure.
    fn counts(&self) -> (u64, u64, Option<String>) {
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Ends an incarnation's heartbeats when dropped: clears their flag and closes the scheduler
/// link (with a goodbye; the heartbeat thread's clone would otherwise keep it open).
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>, Link);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
        self.1.close();
    }
}

/// What a push of `kind` from worker `w` on `link` is to its shard's core: its values (or,
/// `held`, the gradient where it lies), numbered `seq`, computed on `computed_on` (a helper's
/// push: for `help_for`).
fn push_input<'g>(
    kind: PushKind,
    (conn, worker): (LinkId, u32),
    (seq, computed_on, help_for): (u64, Option<u64>, Option<(u32, u64)>),
    (values, ranges): (Vec<f32>, Option<crate::rows::RowIndex>),
    held: Option<&'g dyn crate::shard::GradSlot>,
) -> Input<'g> {
    match kind {
        PushKind::Init => Input::Init {
            conn,
            worker,
            values,
        },
        PushKind::Rows => Input::PushRows {
            conn,
            worker,
            seq,
            computed_on,
            ranges: ranges.unwrap_or_default(),
            values,
        },
        PushKind::Gradient => Input::Push {
            conn,
            worker,
            seq,
            computed_on,
            grad: match held {
                Some(g) => crate::shard::Grad::Slot(g),
                None => values.into(),
            },
        },
        PushKind::Help => Input::Help {
            conn,
            worker,
            seq,
            computed_on,
            grad: values,
            help_for,
        },
    }
}

/// Reads a push of `kind` out of a worker's `slot` of shard `s`: its values (none where an
/// f32 gradient is applied in the slot, `in_slot`; widened from `wire` where it travelled in
/// 16 bits), a row push's index, and the slot's trailer.
fn read_slot(
    s: &Shard,
    slot: &Region,
    kind: PushKind,
    wire: crate::precision::Wire,
    in_slot: bool,
) -> falcon_transport::Result<(
    Vec<f32>,
    Option<crate::rows::RowIndex>,
    [u8; SlotTrailer::BYTES as usize],
)> {
    let mut trailer = [0u8; SlotTrailer::BYTES as usize];
    let mut ranges = None;
    let grad = match (kind, wire) {
        _ if in_slot => Vec::new(),
        (PushKind::Rows, _) => {
            let (r, values) = crate::rows::parse(s.spec.len, s.spec.bytes(), |o, buf| {
                slot.read_at(o, buf).map_err(Error::from)
            })
            .map_err(|e| falcon_transport::Error::Malformed(e.to_string()))?;
            ranges = Some(r);
            values
        }
        (_, crate::precision::Wire::F32) => slot.read_f32_vec(0, s.spec.len as usize)?,
        (_, w) => {
            // Widened in the slot, then read as f32 (the slot holds a gradient's f32 bytes).
            crate::precision::widen_in_place(w, slot, 0, s.spec.len)?;
            slot.read_f32_vec(0, s.spec.len as usize)?
        }
    };
    slot.read_at(s.spec.bytes(), &mut trailer)?;
    Ok((grad, ranges, trailer))
}
