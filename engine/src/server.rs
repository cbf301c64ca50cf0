//! A server: owns shards, applies updates, runs one sync-policy instance per shard.
//!
//! Each shard has three kinds of region, all granted to every worker: the parameters (read
//! one-sided by workers whose lock-free check passes), the meta block (version and per-worker
//! clocks under a seqlock, see `meta`), and one gradient slot per worker (written one-sided by
//! that worker, with an immediate naming the shard). The event loop is single-threaded: it
//! owns every shard, so no lock is taken on the data path.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use falcon_transport::{Completion, Link, LinkId, Region, RemoteKey, Transport};

use crate::auth::{self, Purpose};
use crate::checkpoint::{Checkpoint, ShardState};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::ShardSpec;
use crate::meta::{Meta, meta_bytes};
use crate::proto::{Book, Msg, Role, ShardKeys, imm};
use crate::sync::{Action, Event, SyncPolicy};
use crate::update::{
    Aggregate, Constant, GradientScale, LrSchedule, ShardOptimizer, Unscaled, UpdateMode, aggregate,
};

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

/// The clock a server acknowledges a transferred-task push with.
pub const HELP_ACK: u64 = u64::MAX - 1;

/// Bytes after the gradient in a worker's slot: the version it was computed from and the
/// push's sequence number (u64 each, little-endian).
pub const SLOT_TRAILER: u64 = 16;

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
}

/// What a server's policies did to one worker (summed over the server's shards).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerCounters {
    /// Its pulls that were parked ("delayed").
    pub parked_pulls: u64,
    /// Its gradients dropped (Sync-opt: late).
    pub dropped_gradients: u64,
    /// Extra iterations granted to it (DSSP).
    pub grants: u64,
    /// Task transfers offered to it as the helper (EPSP, FlexRR).
    pub transfers_offered: u64,
    /// Gradients of transferred tasks it pushed as the helper (one per shard).
    pub help_pushes: u64,
    /// The version staleness of its asynchronously applied gradients: staleness → count.
    pub staleness: BTreeMap<u64, u64>,
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

struct Shard {
    spec: ShardSpec,
    params: Region,
    meta: Region,
    slots: Vec<Region>,
    opt: ShardOptimizer,
    policy: Box<dyn SyncPolicy>,
    /// Gradients received per worker (the next push's clock).
    pushes: Vec<u64>,
    /// Sync mode: gradients waiting for their clock to complete, by clock, by worker.
    pending: BTreeMap<u64, Vec<Option<Vec<f32>>>>,
    /// Sync mode: the push clock of a gradient the policy counted for a later step (Sync-opt),
    /// by (step, worker): applying the step moves that worker's clock to its own push.
    counted_for: HashMap<(u64, u32), u64>,
    next_apply: u64,
    initialized: bool,
    /// Per worker, the version of the values last sent to it by a released pull.
    sent_version: Vec<u64>,
    /// Per worker, transferred-task gradients applied (the last sequence number seen).
    helps: Vec<u64>,
    /// Per worker, sequence numbers passed over without a gradient: a rejoining worker's
    /// jump to the current clock, and updates lost with a previous incarnation of this
    /// server. Every number up to `pushes[w]` was applied once or passed over once.
    skipped: Vec<u64>,
    /// Sync mode: acknowledgements held back while `pending` is over the memory cap, in
    /// arrival order (link, worker, clock). The pusher's next push waits for its ack: a
    /// worker pushing faster than steps complete slows down instead of growing memory.
    held: VecDeque<(LinkId, u32, u64)>,
}

impl Shard {
    /// Bytes of gradients waiting for their step (sync mode).
    fn pending_bytes(&self) -> u64 {
        self.pending
            .values()
            .flatten()
            .flatten()
            .map(|g| g.len() as u64 * 4)
            .sum()
    }

    fn meta(&self) -> Meta<'_> {
        meta_of(&self.meta)
    }

    fn params_mut(&self) -> &mut [f32] {
        f32s_mut(&self.params, self.spec.len)
    }

    /// The version a worker's pushed gradient was computed from (its slot's trailer).
    /// The sequence number of a worker's pushed gradient (its slot's trailer; 0: unreadable).
    fn seq(&self, w: usize) -> u64 {
        let mut b = [0u8; 8];
        match self.slots[w].read_at(self.spec.bytes() + 8, &mut b) {
            Ok(()) => u64::from_le_bytes(b),
            Err(_) => 0,
        }
    }

    fn pulled_version(&self, w: usize) -> u64 {
        let mut b = [0u8; 8];
        if self.slots[w].read_at(self.spec.bytes(), &mut b).is_err() {
            return self.sent_version[w];
        }
        match u64::from_le_bytes(b) {
            u64::MAX => self.sent_version[w],
            v => v,
        }
    }

    fn slot(&self, w: usize) -> &[f32] {
        // SAFETY: page-aligned region of `len` f32; the worker does not write it again before
        // we acknowledge the push that filled it.
        unsafe {
            std::slice::from_raw_parts(self.slots[w].as_ptr() as *const f32, self.spec.len as usize)
        }
    }
}

/// The meta block in `region`.
fn meta_of(region: &Region) -> Meta<'_> {
    // SAFETY: the meta region is page-aligned, holds 2 + W lines of CachePadded<AtomicU64>
    // (sized by `meta_bytes`) and lives as long as the borrow; atomics accept any bit pattern,
    // and every access to these words, here or by peers, is atomic or a racy copy that the
    // seqlock validates.
    let words = unsafe {
        std::slice::from_raw_parts(
            region.as_ptr() as *const CachePadded<AtomicU64>,
            region.len() as usize / std::mem::size_of::<CachePadded<AtomicU64>>(),
        )
    };
    Meta::new(words)
}

/// The parameters in `region`, `len` floats.
#[allow(clippy::mut_from_ref)]
fn f32s_mut(region: &Region, len: u64) -> &mut [f32] {
    // SAFETY: page-aligned region of at least `len` f32 owned by one shard; only the server
    // thread writes it, inside a meta write section, through one such slice at a time; peers
    // only read it (one-sided pulls), validated by the seqlock.
    unsafe { std::slice::from_raw_parts_mut(region.as_ptr() as *mut f32, len as usize) }
}

struct ParkedPull {
    link: LinkId,
    shard: usize,
    dst: RemoteKey,
    dst_off: u64,
    req: u32,
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
            crate::worker::rendezvous(&t, &cfg, Role::Server, rank, Vec::new())?;
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
        let mut early = early.into_iter();
        // The job's rule (from the book) unless it is none and the embedder set one.
        let scale = match book.scale {
            crate::update::ScaleSpec::Unscaled => hooks.scale.clone(),
            spec => spec.build(),
        };
        let workers = book.workers as usize;
        let mut shards = Vec::new();
        let mut local_of: HashMap<u32, usize> = HashMap::new();
        for spec in book.keymap.shards_on(book.rank) {
            let bytes = spec.bytes();
            local_of.insert(spec.id, shards.len());
            shards.push(Shard {
                spec: *spec,
                params: Region::new(bytes)?,
                meta: Region::new(meta_bytes(book.workers))?,
                // Each slot holds the gradient and a trailer: the version of the parameters
                // it was computed from (u64::MAX: the one this server last sent) and the
                // push's sequence number (a retried push is not applied twice).
                slots: (0..workers)
                    .map(|_| Region::new(bytes + SLOT_TRAILER))
                    .collect::<Result<_, _>>()?,
                opt: ShardOptimizer::new(book.optimizer, hooks.schedule.clone(), spec.len as usize),
                policy: book.policy.build_for(book.workers, spec.id),
                pushes: vec![0; workers],
                pending: BTreeMap::new(),
                counted_for: HashMap::new(),
                next_apply: 0,
                initialized: false,
                sent_version: vec![0; workers],
                helps: vec![0; workers],
                skipped: vec![0; workers],
                held: VecDeque::new(),
            });
        }
        let token = cfg.token.clone();
        let mut report = ServerReport {
            rank: book.rank,
            per_worker: vec![WorkerCounters::default(); workers],
            per_shard: shards
                .iter()
                .map(|s| ShardCounters {
                    shard: s.spec.id,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let mut links: HashMap<LinkId, Link> = HashMap::new();
        // Accepted links not attached yet, with when they came.
        let mut unattached: HashMap<LinkId, Instant> = HashMap::new();
        let admission = crate::config::admission_deadline(&cfg);
        // The challenge sent to each accepted link, used once by its attach.
        let mut nonces: HashMap<LinkId, Vec<u8>> = HashMap::new();
        let mut worker_of: HashMap<LinkId, u32> = HashMap::new();
        let mut link_of: HashMap<u32, LinkId> = HashMap::new();
        let mut parked: HashMap<u64, ParkedPull> = HashMap::new();
        // Per helper, the last task-transfer offer sent to it.
        let mut offered: HashMap<u32, (u32, u64)> = HashMap::new();
        let mut dead: std::collections::HashSet<u32> = std::collections::HashSet::new();
        let mut actions = Vec::new();
        let start = Instant::now();
        let job = crate::config::job_hash(&cfg.job);
        let checkpoints = match (&cfg.checkpoint, book.recovery) {
            (Some(c), true) => Some((c, Checkpointer::start(c, book.rank, sched.clone())?)),
            _ => None,
        };
        if book.rejoin {
            let Some((c, _)) = &checkpoints else {
                return Err(Error::Config(
                    "admitted into a running job as a restarted server, but no checkpoint directory is configured".into(),
                ));
            };
            let saved = crate::checkpoint::load(&c.dir, book.rank, job, book.workers)?
                .filter(|k| k.instance == book.instance)
                .ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "server {} restarted into a running job, but {} holds no checkpoint of this run",
                        book.rank,
                        c.dir.display()
                    ))
                })?;
            restore(&mut shards, &saved)?;
            report.restored_from = Some(saved.number);
            tracing::warn!(
                "server {}: restarted from checkpoint {} ({} shards)",
                book.rank,
                saved.number,
                saved.shards.len()
            );
        }
        let mut last_ckpt = Instant::now();
        // Heartbeats from their own thread, which ends with this incarnation.
        let serving = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let _stop_beats = StopOnDrop(serving.clone(), sched.clone());
        crate::heartbeat::start(
            &format!("falcon-server-{}-heartbeat", book.rank),
            sched.clone(),
            cfg.heartbeat,
            move || serving.load(std::sync::atomic::Ordering::Acquire),
        )?;
        loop {
            if let Some((c, writer)) = &checkpoints
                && last_ckpt.elapsed() >= c.every
            {
                report.checkpoints += 1;
                // Numbered on from the checkpoint this server restarted from.
                let number = report.restored_from.unwrap_or(0) + report.checkpoints;
                let snapshot = snapshot(&shards, job, &book, number);
                if writer.offer(snapshot) {
                    last_ckpt = Instant::now();
                } else {
                    report.checkpoints -= 1;
                }
            }
            drain_accepted(&t, &mut links, &mut unattached);
            // A link that has not attached within the handshake deadline is dropped.
            unattached.retain(|id, at| {
                if at.elapsed() < admission {
                    return true;
                }
                if let Some(l) = links.remove(id) {
                    tracing::warn!(
                        "server {}: dropped {}: it did not attach within {} ms",
                        book.rank,
                        l.peer(),
                        admission.as_millis()
                    );
                    l.close();
                }
                nonces.remove(id);
                false
            });
            let c = match early.next() {
                Some(c) => c,
                None => match t.cq().wait(Some(cfg.heartbeat)) {
                    Ok(c) => c,
                    Err(_) => continue,
                },
            };
            let now = start.elapsed().as_nanos() as u64;
            match c {
                Completion::Message { link, data } if link == sched.id() => {
                    match Msg::decode(&data) {
                        Ok(Msg::Shutdown) => break,
                        Ok(Msg::Evicted { reason }) => {
                            return Err(Error::Fenced {
                                rank: book.rank,
                                reason,
                            });
                        }
                        Ok(Msg::Dead {
                            role: Role::Worker,
                            rank,
                        }) => {
                            dead.insert(rank);
                            let live = book.workers - dead.len() as u32;
                            for s in &mut shards {
                                s.policy.on_event(
                                    Event::Leave {
                                        worker: rank,
                                        at: now,
                                    },
                                    &mut actions,
                                );
                                // Its missing gradients no longer hold a synchronous step back.
                                apply_ready(
                                    s,
                                    book.aggregate,
                                    live,
                                    now,
                                    &mut actions,
                                    &mut report,
                                );
                            }
                        }
                        Ok(_) => {}
                        Err(e) => tracing::warn!(
                            "server {}: bad message from the scheduler: {e}",
                            book.rank
                        ),
                    }
                }
                Completion::Message { link, data } => {
                    if !links.contains_key(&link) {
                        // The transport hands a link over before its first completion: one
                        // still unknown was refused or forgotten here already.
                        drain_accepted(&t, &mut links, &mut unattached);
                    }
                    let Some(l) = links.get(&link).cloned() else {
                        continue;
                    };
                    let reply = |m: Msg| {
                        let _ = l.send(&m.encode());
                    };
                    match Msg::decode(&data) {
                        Ok(Msg::Knock) => auth::challenge(&l, &mut nonces)?,
                        Ok(Msg::Attach { rank, proof }) => {
                            let proof_ok = nonces
                                .remove(&link)
                                .is_some_and(|n| auth::check(&token, Purpose::Attach, &n, &proof));
                            tracing::debug!("server {}: worker {rank} attaches", book.rank);
                            if !proof_ok || rank as usize >= workers {
                                reply(Msg::Failed {
                                    what: "attach".into(),
                                    reason: format!(
                                        "worker {rank} refused (wrong answer to the challenge: wrong job token; or a bad or duplicate rank)"
                                    ),
                                });
                                l.close();
                                links.remove(&link);
                                unattached.remove(&link);
                                continue;
                            }
                            // A worker reconnecting (its old link dropped, perhaps not yet
                            // noticed here): the new link replaces the old one.
                            if let Some(old) = link_of.get(&rank).copied()
                                && old != link
                            {
                                if let Some(o) = links.remove(&old) {
                                    o.close();
                                }
                                worker_of.remove(&old);
                                parked.retain(|_, p| p.link != old);
                            }
                            let mut keys = Vec::new();
                            for s in &shards {
                                // Where a rejoining worker starts: the slowest other live
                                // worker's count.
                                let clock = (0..workers)
                                    .filter(|&x| x != rank as usize && !dead.contains(&(x as u32)))
                                    .map(|x| s.pushes[x])
                                    .min()
                                    .unwrap_or(0)
                                    .max(s.pushes[rank as usize]);
                                keys.push(ShardKeys {
                                    shard: s.spec.id,
                                    params: l.grant(&s.params)?.to_bytes().to_vec(),
                                    meta: l.grant(&s.meta)?.to_bytes().to_vec(),
                                    clock,
                                    slot: l.grant(&s.slots[rank as usize])?.to_bytes().to_vec(),
                                });
                            }
                            worker_of.insert(link, rank);
                            link_of.insert(rank, link);
                            unattached.remove(&link);
                            reply(Msg::Keys { shards: keys });
                        }
                        Ok(Msg::PullReq {
                            shard,
                            clock,
                            req,
                            dst,
                            dst_off,
                        }) => {
                            let Some(&w) = worker_of.get(&link) else {
                                continue;
                            };
                            let fail = |reason: String| Msg::Failed {
                                what: format!("pull:{req}"),
                                reason,
                            };
                            let Some(&i) = local_of.get(&shard) else {
                                reply(fail(format!(
                                    "shard {shard} is not on server {}",
                                    book.rank
                                )));
                                continue;
                            };
                            let dst = match RemoteKey::from_bytes(&dst) {
                                Ok(k)
                                    if dst_off
                                        .checked_add(shards[i].spec.bytes())
                                        .is_some_and(|e| e <= k.len) =>
                                {
                                    k
                                }
                                _ => {
                                    reply(fail(
                                        "pull destination key is malformed or too short".into(),
                                    ));
                                    continue;
                                }
                            };
                            if clock > shards[i].pushes[w as usize] {
                                reply(fail(format!(
                                    "clock {clock} is from the future: worker {w} has pushed {} gradients to shard {shard}",
                                    shards[i].pushes[w as usize]
                                )));
                                continue;
                            }
                            let id = (u64::from(w) << 32) | u64::from(req);
                            parked.insert(
                                id,
                                ParkedPull {
                                    link,
                                    shard: i,
                                    dst,
                                    dst_off,
                                    req,
                                },
                            );
                            shards[i].policy.on_event(
                                Event::Pull {
                                    worker: w,
                                    clock,
                                    req: id,
                                    at: now,
                                },
                                &mut actions,
                            );
                            dispatch(
                                &mut actions,
                                &mut parked,
                                &mut shards,
                                (&links, &link_of),
                                &mut offered,
                                &mut report,
                            );
                        }
                        Ok(Msg::Resume {
                            rejoin,
                            shards: resume,
                        }) => {
                            let Some(&w) = worker_of.get(&link) else {
                                continue;
                            };
                            if rejoin && dead.remove(&w) {
                                tracing::info!("server {}: worker {w} rejoined", book.rank);
                            }
                            let live = book.workers - dead.len() as u32;
                            let mut lost = 0;
                            for r in resume {
                                let Some(&i) = local_of.get(&r.shard) else {
                                    continue;
                                };
                                lost += resume_shard(
                                    &mut shards[i],
                                    w,
                                    r,
                                    rejoin,
                                    (book.mode, book.aggregate, live, now),
                                    &mut actions,
                                    &mut report,
                                );
                            }
                            report.lost_updates += lost;
                            if lost > 0 {
                                tracing::warn!(
                                    "server {}: worker {w} had {lost} acknowledged updates this server lost (taken after its last checkpoint)",
                                    book.rank
                                );
                            }
                            // Its releases go out with the loop's (below).
                            reply(Msg::Resumed { lost });
                        }
                        Ok(other) => tracing::warn!(
                            "server {}: unexpected {} message",
                            book.rank,
                            other.name()
                        ),
                        Err(e) => {
                            tracing::warn!("server {}: {e}; closing that link", book.rank);
                            l.close();
                        }
                    }
                }
                Completion::WriteImm { link, imm: v } => {
                    let Some(&w) = worker_of.get(&link) else {
                        continue;
                    };
                    let (kind, local) = imm::unpack(v);
                    let Some(s) = shards.get_mut(local as usize) else {
                        tracing::warn!("server {}: push to unknown local shard {local}", book.rank);
                        continue;
                    };
                    let Some(l) = links.get(&link) else { continue };
                    if kind == imm::INIT {
                        if !s.initialized {
                            let src = s.slot(w as usize).to_vec();
                            let dst = s.params_mut();
                            s.meta().write(|_| dst.copy_from_slice(&src));
                            s.initialized = true;
                        }
                        let _ = l.send(
                            &Msg::PushAck {
                                shard: s.spec.id,
                                clock: u64::MAX,
                                staleness: 0,
                            }
                            .encode(),
                        );
                        continue;
                    }
                    let traffic = &mut report.per_shard[local as usize];
                    traffic.bytes_in += s.spec.bytes();
                    // Exactly once: a sequence number at or below what was applied is a
                    // repeated push (a retry): acknowledged again, not applied.
                    let seq = s.seq(w as usize);
                    let done = if kind == imm::HELP {
                        s.helps[w as usize]
                    } else {
                        s.pushes[w as usize]
                    };
                    if seq <= done || seq > done + 1 {
                        if seq <= done && seq > 0 {
                            report.duplicate_pushes += 1;
                            let _ = l.send(
                                &Msg::PushAck {
                                    shard: s.spec.id,
                                    clock: if kind == imm::HELP { HELP_ACK } else { seq - 1 },
                                    staleness: 0,
                                }
                                .encode(),
                            );
                        } else {
                            tracing::warn!(
                                "server {}: worker {w} pushed sequence {seq} to shard {} after {done}; ignored",
                                book.rank,
                                s.spec.id
                            );
                        }
                        continue;
                    }
                    if kind == imm::HELP {
                        s.helps[w as usize] = seq;
                        // Task transfer: tasks taken from another worker, computed on this
                        // worker's values. Applied like an asynchronous gradient; the pusher's
                        // clock does not move and the policy sees no push (the straggler's own
                        // push completes its iteration).
                        if book.mode == UpdateMode::Sync {
                            let ack = Msg::PushAck {
                                shard: s.spec.id,
                                clock: HELP_ACK,
                                staleness: 0,
                            };
                            tracing::warn!(
                                "server {}: worker {w} pushed transferred tasks under synchronous updates; ignored",
                                book.rank
                            );
                            let _ = l.send(&ack.encode());
                            continue;
                        }
                        apply_async(s, w, &*scale, l, HELP_ACK, None);
                        report.updates += 1;
                        report.per_worker[w as usize].help_pushes += 1;
                        continue;
                    }
                    let clock = s.pushes[w as usize];
                    s.pushes[w as usize] += 1;
                    report.gradients += 1;
                    report.per_shard[local as usize].gradients += 1;
                    match book.mode {
                        UpdateMode::Async => {
                            let d = apply_async(s, w, &*scale, l, clock, Some(clock));
                            report.staleness_sum += d;
                            report.staleness_max = report.staleness_max.max(d);
                            *report.per_worker[w as usize]
                                .staleness
                                .entry(d)
                                .or_default() += 1;
                            report.updates += 1;
                            s.policy.on_event(
                                Event::Push {
                                    worker: w,
                                    clock,
                                    at: now,
                                },
                                &mut actions,
                            );
                        }
                        UpdateMode::Sync => {
                            let g = s.slot(w as usize).to_vec();
                            // A policy that judges arrivals (Sync-opt) says now whether it counts.
                            let mut counts = true;
                            // The step it counts for: its clock, unless the policy says the
                            // parameters it was computed on were newer (Sync-opt).
                            let mut step = clock;
                            if s.policy.judges_arrivals() {
                                let mut judged = Vec::new();
                                s.policy.on_event(
                                    Event::Push {
                                        worker: w,
                                        clock,
                                        at: now,
                                    },
                                    &mut judged,
                                );
                                for a in judged {
                                    match a {
                                        Action::DropGradient { worker, clock: c }
                                            if worker == w && c == clock =>
                                        {
                                            counts = false;
                                            report.per_worker[w as usize].dropped_gradients += 1;
                                        }
                                        Action::CountFor {
                                            worker,
                                            clock: c,
                                            step: counted_for,
                                        } if worker == w && c == clock => step = counted_for,
                                        other => actions.push(other),
                                    }
                                }
                            }
                            if counts && step < s.next_apply {
                                // A step already applied (the policy and the shard disagree
                                // after a placeholder): never applied, so never held.
                                tracing::warn!(
                                    "shard {}: worker {w}'s gradient of clock {clock} counted for \
                                     step {step}, already applied; dropped",
                                    s.spec.id
                                );
                                counts = false;
                                report.per_worker[w as usize].dropped_gradients += 1;
                            }
                            if counts && step != clock {
                                s.counted_for.insert((step, w), clock);
                            }
                            if counts {
                                s.pending.entry(step).or_insert_with(|| vec![None; workers])
                                    [w as usize] = Some(g);
                                let bytes = s.pending_bytes();
                                report.peak_pending_bytes = report.peak_pending_bytes.max(bytes);
                            }
                            // The slot is free once copied; the ack waits while the
                            // gradients waiting for their step are over the cap.
                            s.held.push_back((link, w, clock));
                            if s.pending_bytes() > cfg.max_pending_bytes {
                                report.held_acks += 1;
                            }
                            if !counts {
                                // Dropped: the shard is done with this worker's gradient.
                                meta_of(&s.meta).write(|m| {
                                    m.set_clock(w as usize, m.clock(w as usize).max(clock + 1))
                                });
                            }
                            let live = book.workers - dead.len() as u32;
                            apply_ready(s, book.aggregate, live, now, &mut actions, &mut report);
                        }
                    }
                    dispatch(
                        &mut actions,
                        &mut parked,
                        &mut shards,
                        (&links, &link_of),
                        &mut offered,
                        &mut report,
                    );
                }
                Completion::Closed { link, error } if link == sched.id() => {
                    let why = crate::worker::closed_why(&error);
                    if book.recovery {
                        // Cut off, or declared dead while paused: this incarnation must stop.
                        return Err(Error::Fenced {
                            rank: book.rank,
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
                    drain_accepted(&t, &mut links, &mut unattached);
                    links.remove(&link);
                    unattached.remove(&link);
                    nonces.remove(&link);
                    if let Some(w) = worker_of.remove(&link) {
                        link_of.remove(&w);
                    }
                    parked.retain(|_, p| p.link != link);
                }
            }
            if !actions.is_empty() {
                dispatch(
                    &mut actions,
                    &mut parked,
                    &mut shards,
                    (&links, &link_of),
                    &mut offered,
                    &mut report,
                );
            }
            for s in &mut shards {
                release_held(s, &links, cfg.max_pending_bytes);
            }
        }
        for s in &shards {
            for (w, c) in report.per_worker.iter_mut().enumerate() {
                c.grants += s.policy.grants(w as u32);
            }
            report.delayed_pulls += s.policy.delayed_total();
            report.dropped_gradients += s.policy.dropped();
            report.params.insert(s.spec.id, s.params_mut().to_vec());
            report.accounts.push(ShardAccount {
                shard: s.spec.id,
                first: s.params_mut().first().copied().unwrap_or(0.0),
                pushes: s.pushes.iter().sum(),
                skipped: s.skipped.iter().sum(),
                helps: s.helps.iter().sum(),
            });
        }
        if let Some((_, writer)) = &checkpoints {
            // Written, not merely taken (a write under way now is not counted).
            let (written, failed, last) = writer.counts();
            report.checkpoints = written;
            report.checkpoint_failures = failed;
            report.last_checkpoint_failure = last;
        }
        Ok(report)
    }
}

/// Async mode: applies worker `w`'s gradient in its slot at once, scaled by its version
/// staleness, acknowledging with `ack` as soon as the slot is copied; with `clock`, the
/// worker's applied count becomes `clock + 1` (a credited push of transferred tasks moves
/// no clock). Returns the staleness.
fn apply_async(
    s: &mut Shard,
    w: u32,
    scale: &dyn GradientScale,
    l: &Link,
    ack_clock: u64,
    clock: Option<u64>,
) -> u64 {
    let version = meta_of(&s.meta).version();
    let d = version.saturating_sub(s.pulled_version(w as usize));
    let factor = scale.scale(d);
    let mut g = s.slot(w as usize).to_vec();
    if factor != 1.0 {
        g.iter_mut().for_each(|x| *x *= factor);
    }
    // Acknowledge first: the slot is free once copied.
    let ack = Msg::PushAck {
        shard: s.spec.id,
        clock: ack_clock,
        staleness: d,
    };
    let _ = l.send(&ack.encode());
    let params = f32s_mut(&s.params, s.spec.len);
    let opt = &mut s.opt;
    meta_of(&s.meta).write(|m| {
        opt.apply(params, &g);
        if let Some(c) = clock {
            m.set_clock(w as usize, c + 1);
        }
        m.bump_version();
    });
    d
}

/// Sync mode: applies every clock that has its quorum of gradients (every live worker's, or
/// what the policy asks for), in clock order, summing the present ones in rank order.
fn apply_ready(
    s: &mut Shard,
    agg: Aggregate,
    live: u32,
    now: u64,
    actions: &mut Vec<Action>,
    report: &mut ServerReport,
) {
    let quorum = s.policy.step_quorum(live).max(1) as usize;
    while let Some(grads) = s.pending.get(&s.next_apply) {
        if grads.iter().filter(|g| g.is_some()).count() < quorum {
            break;
        }
        let grads = s.pending.remove(&s.next_apply).expect("present");
        let clock = s.next_apply;
        let mut sum = vec![0f32; s.spec.len as usize];
        // An empty gradient holds a place it lost (a restarted server's, or a rejoining
        // worker's): it counts toward the quorum and adds nothing.
        aggregate(
            &mut sum,
            grads
                .iter()
                .flatten()
                .filter(|g| !g.is_empty())
                .map(Vec::as_slice),
            agg,
        );
        // Each contributor's clock moves past its own push (the step's clock, unless the
        // policy counted the gradient for a later step than its push).
        let pushed: Vec<u64> = (0..grads.len())
            .map(|w| s.counted_for.remove(&(clock, w as u32)).unwrap_or(clock))
            .collect();
        let params = f32s_mut(&s.params, s.spec.len);
        let opt = &mut s.opt;
        meta_of(&s.meta).write(|m| {
            opt.apply(params, &sum);
            for (w, g) in grads.iter().enumerate() {
                if g.is_some() {
                    m.set_clock(w, m.clock(w).max(pushed[w] + 1));
                }
            }
            m.bump_version();
        });
        report.updates += 1;
        s.next_apply += 1;
        if !s.policy.judges_arrivals() {
            for (w, g) in grads.iter().enumerate() {
                if g.is_some() {
                    s.policy.on_event(
                        Event::Push {
                            worker: w as u32,
                            clock,
                            at: now,
                        },
                        actions,
                    );
                }
            }
        }
    }
}

/// Carries out the policy's actions: released pulls get the latest values, written one-sided
/// into the worker's destination with the request id as immediate.
fn dispatch(
    actions: &mut Vec<Action>,
    parked: &mut HashMap<u64, ParkedPull>,
    shards: &mut [Shard],
    (links, link_of): (&HashMap<LinkId, Link>, &HashMap<u32, LinkId>),
    offered: &mut HashMap<u32, (u32, u64)>,
    report: &mut ServerReport,
) {
    for a in actions.drain(..) {
        if let Action::Transfer {
            helper,
            straggler,
            clock,
        } = a
            && offered.get(&helper) != Some(&(straggler, clock))
        {
            // Each shard's policy may make the same offer: the worker hears it once.
            offered.insert(helper, (straggler, clock));
            if let Some(c) = report.per_worker.get_mut(helper as usize) {
                c.transfers_offered += 1;
            }
            if let Some(l) = link_of.get(&helper).and_then(|id| links.get(id)) {
                let _ = l.send(&Msg::Offer { straggler, clock }.encode());
            }
        }
        if let Action::Park { worker, .. } = a
            && let Some(c) = report.per_worker.get_mut(worker as usize)
        {
            c.parked_pulls += 1;
        }
        if let Action::Release { req, .. } = a
            && let Some(p) = parked.remove(&req)
            && let Some(l) = links.get(&p.link)
        {
            let s = &mut shards[p.shard];
            report.answered_pulls += 1;
            let traffic = &mut report.per_shard[p.shard];
            traffic.answered_pulls += 1;
            traffic.bytes_out += s.spec.bytes();
            if let Some(w) = s.sent_version.get_mut((req >> 32) as usize) {
                *w = meta_of(&s.meta).version();
            }
            if let Err(e) = l.write(&s.params, 0, &p.dst, p.dst_off, s.spec.bytes(), Some(p.req)) {
                tracing::warn!("server: answering a pull failed: {e}");
            }
        }
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
            .map_err(|e| Error::Config(format!("spawn the checkpoint writer: {e}")))?;
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

/// A consistent snapshot of every shard (taken on the event loop, between events).
fn snapshot(shards: &[Shard], job: u64, book: &Book, number: u64) -> Checkpoint {
    let taken_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    Checkpoint {
        job,
        instance: book.instance,
        rank: book.rank,
        workers: book.workers,
        number,
        taken_ms,
        shards: shards
            .iter()
            .map(|s| {
                let meta = s.meta();
                let (m, v, step) = s.opt.state();
                ShardState {
                    id: s.spec.id,
                    params: s.params_mut().to_vec(),
                    version: meta.version(),
                    clocks: (0..book.workers as usize).map(|w| meta.clock(w)).collect(),
                    pushes: s.pushes.clone(),
                    helps: s.helps.clone(),
                    skipped: s.skipped.clone(),
                    sent_version: s.sent_version.clone(),
                    next_apply: s.next_apply,
                    pending: s.pending.iter().map(|(c, g)| (*c, g.clone())).collect(),
                    initialized: s.initialized,
                    opt_m: m.to_vec(),
                    opt_v: v.to_vec(),
                    opt_step: step,
                }
            })
            .collect(),
    }
}

/// Puts a checkpoint back into freshly built shards: values, versions, clocks, counters and
/// optimizer state; each policy learns every worker's applied count.
fn restore(shards: &mut [Shard], c: &Checkpoint) -> Result<()> {
    let bad = |why: String| Error::Checkpoint(format!("does not fit this server: {why}"));
    if c.shards.len() != shards.len() {
        return Err(bad(format!(
            "{} shards saved, {} here",
            c.shards.len(),
            shards.len()
        )));
    }
    let mut ignored = Vec::new();
    for (s, st) in shards.iter_mut().zip(&c.shards) {
        if st.id != s.spec.id || st.params.len() as u64 != s.spec.len {
            return Err(bad(format!(
                "shard {} of {} floats saved where shard {} of {} is",
                st.id,
                st.params.len(),
                s.spec.id,
                s.spec.len
            )));
        }
        s.opt
            .restore(&st.opt_m, &st.opt_v, st.opt_step)
            .map_err(bad)?;
        let params = f32s_mut(&s.params, s.spec.len);
        meta_of(&s.meta).write(|m| {
            params.copy_from_slice(&st.params);
            for (w, &clock) in st.clocks.iter().enumerate() {
                m.set_clock(w, clock);
            }
            m.set_version(st.version);
        });
        s.pushes.clone_from(&st.pushes);
        s.helps.clone_from(&st.helps);
        s.skipped.clone_from(&st.skipped);
        s.sent_version.clone_from(&st.sent_version);
        s.next_apply = st.next_apply;
        s.pending = st.pending.iter().cloned().collect();
        s.initialized = st.initialized;
        for (w, &clock) in st.clocks.iter().enumerate() {
            s.policy.on_event(
                Event::Join {
                    worker: w as u32,
                    clock,
                    at: 0,
                },
                &mut ignored,
            );
        }
        let waiting: Vec<(u64, Vec<u32>)> = s
            .pending
            .iter()
            .map(|(&step, g)| {
                let who = (0..g.len() as u32)
                    .filter(|&w| g[w as usize].is_some())
                    .collect();
                (step, who)
            })
            .collect();
        s.policy.restored(s.next_apply, &waiting);
        ignored.clear();
    }
    Ok(())
}

/// A worker reattached (or rejoined) with `r`: what it had acknowledged on this shard (a
/// rejoin: where it starts). Counts it had acknowledged beyond the shard's are taken as
/// applied and lost (a reattach), or skipped (a rejoin). Returns the updates lost.
fn resume_shard(
    s: &mut Shard,
    w: u32,
    r: crate::proto::ResumeShard,
    rejoin: bool,
    (mode, agg, live, now): (UpdateMode, Aggregate, u32, u64),
    actions: &mut Vec<Action>,
    report: &mut ServerReport,
) -> u64 {
    let wi = w as usize;
    let mut lost = 0;
    let from = s.pushes[wi];
    if r.pushes > from {
        if !rejoin {
            lost += r.pushes - from;
        }
        s.skipped[wi] += r.pushes - from;
        s.pushes[wi] = r.pushes;
        if mode == UpdateMode::Sync {
            // Its places in the steps still to apply are held, empty.
            let workers = s.pushes.len();
            for c in from.max(s.next_apply)..r.pushes {
                s.pending.entry(c).or_insert_with(|| vec![None; workers])[wi] = Some(Vec::new());
            }
        }
    }
    if rejoin {
        // A fresh process numbers its transferred-task pushes from 1 again.
        s.helps[wi] = r.helps;
    } else if r.helps > s.helps[wi] {
        lost += r.helps - s.helps[wi];
        s.helps[wi] = r.helps;
    }
    if !rejoin && r.pushes <= from {
        // A reconnection the server lost nothing of: its standing is unchanged.
        return lost;
    }
    let clock = match mode {
        UpdateMode::Async => s.pushes[wi],
        UpdateMode::Sync => s.pushes[wi].min(s.next_apply),
    };
    meta_of(&s.meta).write(|m| m.set_clock(wi, m.clock(wi).max(clock)));
    s.policy.on_event(
        Event::Join {
            worker: w,
            clock,
            at: now,
        },
        actions,
    );
    if mode == UpdateMode::Sync {
        apply_ready(s, agg, live, now, actions, report);
    }
    lost
}

/// Sends the held acknowledgements of `s` (sync mode) once its waiting gradients are within
/// `cap` bytes.
fn release_held(s: &mut Shard, links: &HashMap<LinkId, Link>, cap: u64) {
    if s.held.is_empty() {
        return;
    }
    if s.pending_bytes() > cap {
        return;
    }
    while let Some((link, _w, clock)) = s.held.pop_front() {
        if let Some(l) = links.get(&link) {
            let _ = l.send(
                &Msg::PushAck {
                    shard: s.spec.id,
                    clock,
                    staleness: 0,
                }
                .encode(),
            );
        }
    }
}

/// Moves every link the transport has accepted into `links`, noting it as not yet attached.
fn drain_accepted(
    t: &Transport,
    links: &mut HashMap<LinkId, Link>,
    unattached: &mut HashMap<LinkId, Instant>,
) {
    crate::worker::each_accepted(t, |l| {
        unattached.insert(l.id(), Instant::now());
        links.insert(l.id(), l);
    });
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
