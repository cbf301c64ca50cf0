//! The worker client: the API other trainers embed.
//!
//! `push(tensor, &grad, clock)` writes each shard's slice of `grad` one-sided into this
//! worker's slot on the shard's server, with an immediate naming the shard; the server
//! acknowledges once the slot is consumed. `pull(tensor, &out, clock)` first tries the
//! lock-free path — read the shard's meta block one-sided, check the staleness predicate
//! against its clocks, read the parameters one-sided, re-read the sequence word — and only if
//! the policy does not allow it sends a request, which the server's policy may park; on
//! release the server writes the *latest* values straight into `out`. Both have non-blocking
//! variants returning a [`Handle`]. Buffers are [`Region`]s: push and pull are zero-copy.
//!
//! Under ElasticBSP (`PolicySpec::job_barriers`) the worker also holds a *gate*: a pull at a
//! clock at or past its barrier first reports to the scheduler ([`Msg::Superstep`], with the
//! mean of its last few iteration intervals) and waits for the scheduler's plan
//! ([`Msg::Plan`]), which moves the barrier. The first barrier is at clock 1 (the first
//! superstep is one iteration: no interval is known yet). An interval sample is the time from
//! the start of an iteration (the previous iteration's first push, or the plan's arrival, so
//! the wait at a barrier is not counted as compute, or the very first pull) to the iteration's
//! first push. Other policies have no gate and pay nothing for it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Region, RemoteKey, Transport, TransportConfig};

use crate::auth::{self, Purpose};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::{KeyMap, ShardSpec, TensorSpec};
use crate::meta::{Snapshot, meta_bytes, within_staleness};
use crate::postoffice::{closed_why, rendezvous, time_left};
use crate::proto::{
    AckOf, Book, Immediate, Msg, PushKind, ResumeShard, Role, ShardKeys, SlotTrailer,
};
use crate::sync::zipline::IntervalEstimate;
use crate::sync::{FastPath, PolicySpec};
use crate::update::{Aggregate, Optimizer, UpdateMode};

/// Something a caller waits for.
#[derive(Default)]
struct Signal {
    state: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Signal {
    fn done(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn set(&self, r: Result<()>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.is_none() {
            *s = Some(r);
            self.cv.notify_all();
        }
    }

    /// The outcome if it comes by `deadline`.
    fn outcome_by(&self, deadline: Instant) -> Option<Result<()>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = s.as_ref() {
                return Some(r.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits for the outcome; `None` waits as long as the peers live (a dead peer fails every
    /// waiter through the progress thread, so this never hangs on one).
    fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = s.as_ref() {
                return r.clone();
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return Err(Error::Timeout(
                    "push acknowledgement",
                    timeout.unwrap_or_default(),
                ));
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A push or pull in flight. `wait` returns when every shard is done.
#[must_use = "a push or pull is only known done after wait()"]
pub struct Handle {
    signals: Vec<Arc<Signal>>,
    /// Pushes: the operation timeout (the server acknowledges on receipt). Pulls: none — a pull
    /// may rightly wait as long as the policy holds it (a straggler under BSP); peer death,
    /// not a clock, ends it.
    timeout: Option<Duration>,
    /// When the operation started (a push's timeout counts from here in `wait_for`).
    started: Instant,
}

impl Handle {
    /// Waits at most `within` for completion: `Some` outcome when done (a push unacknowledged
    /// past the operation timeout, counted from its start, is a [`Error::Timeout`]), `None`
    /// when still in flight. An embedding that must stay responsive (Python's Ctrl-C) waits
    /// in such slices.
    pub fn wait_for(&self, within: Duration) -> Option<Result<()>> {
        let deadline = Instant::now() + within;
        for s in &self.signals {
            match s.outcome_by(deadline) {
                Some(Ok(())) => {}
                Some(Err(e)) => return Some(Err(e)),
                None => {
                    return match self.timeout {
                        Some(t) if self.started.elapsed() >= t => {
                            Some(Err(Error::Timeout("push acknowledgement", t)))
                        }
                        _ => None,
                    };
                }
            }
        }
        Some(Ok(()))
    }

    /// True once every part has completed (successfully or not): `wait` will not block.
    pub fn ready(&self) -> bool {
        self.signals.iter().all(|s| s.done())
    }

    /// Waits for completion.
    pub fn wait(self) -> Result<()> {
        for s in &self.signals {
            s.wait(self.timeout)?;
        }
        Ok(())
    }
}

struct ShardRemote {
    spec: ShardSpec,
    server: usize,
    local: u32,
    /// The server's keys for this shard (replaced when the worker reattaches; `None` until
    /// a server that was down when this worker joined is reached).
    keys: RwLock<Option<Keys>>,
    /// Scratch for one-sided meta reads (one pull of this shard at a time).
    scratch: Mutex<Region>,
    /// Gradients pushed so far (the next push's clock).
    pushes: AtomicU32,
    /// The previous push: its slot must be free (acknowledged) before the next write, and
    /// until then it is written again on a new link after a reconnection.
    inflight: Mutex<Option<PushRecord>>,
    /// The highest sequence numbers the server acknowledged: gradients
    /// ([`PushKind::Gradient`]) and transferred-task gradients ([`PushKind::Help`]). A
    /// reattaching worker reports them.
    acked: [AtomicU64; 2],
    /// The version of the values last pulled (u64::MAX: pulled through the server, which
    /// remembers what it sent); sent with each push so the server knows its staleness.
    pulled_version: std::sync::atomic::AtomicU64,
    /// Gradients of transferred tasks pushed to this shard (the next one's sequence number
    /// is this plus one).
    helps: std::sync::atomic::AtomicU64,
}

/// A shard's keys on its server.
#[derive(Clone, Copy)]
struct Keys {
    params: RemoteKey,
    meta: RemoteKey,
    slot: RemoteKey,
}

impl Keys {
    fn from_wire(k: &ShardKeys) -> Result<Keys> {
        Ok(Keys {
            params: RemoteKey::from_bytes(&k.params)?,
            meta: RemoteKey::from_bytes(&k.meta)?,
            slot: RemoteKey::from_bytes(&k.slot)?,
        })
    }
}

/// A push not yet acknowledged, as it must be written again.
#[derive(Clone)]
struct PushRecord {
    /// The values (`None`: the slot as it is, a bare repeat).
    grad: Option<Region>,
    kind: PushKind,
    seq: u64,
    sig: Arc<Signal>,
    /// The link it was last written on.
    sent_on: Option<LinkId>,
}

/// A slow-path pull waiting for the server's answer, as it must be sent again.
struct PullWait {
    sig: Arc<Signal>,
    sent: Instant,
    /// Index of the shard in `Inner::shards`.
    shard: usize,
    out: Region,
    clock: u64,
    /// The link it was last sent on.
    sent_on: Option<LinkId>,
}

/// The connection to one server.
struct ServerSlot {
    state: Mutex<ServerConn>,
    changed: Condvar,
}

struct ServerConn {
    /// The link in use; `None` while the server is unreachable.
    link: Option<Link>,
    /// Where it listens: the book's address, or the one the scheduler announced last.
    addr: String,
    /// A reconnection under way: the new link, attached but not yet resumed.
    joining: Option<Link>,
    /// No reconnection attempt before this.
    next_try: Instant,
    /// Set once it is gone for good (the job failed or ended).
    gone: Option<Error>,
    /// This process rejoined the job and has not resumed on this server yet.
    rejoin: bool,
    /// Failed reconnection attempts in a row (every 15th is logged).
    attempts: u32,
    /// A reconnection attempt is under way on its own thread.
    connecting: bool,
}

/// ElasticBSP's gate on this worker (see the [module docs](self)).
struct Gate {
    /// Pulls at clocks below this pass; one at or above it waits for the next plan.
    barrier: u64,
    /// When the current iteration started (None until the first pull or push).
    mark: Option<Instant>,
    /// The next clock whose first push records an interval sample.
    next_sample: u64,
    /// The interval estimate (the mean of the last few samples, as the simulator's).
    interval: IntervalEstimate,
    /// The superstep report in flight: what its waiters wait on, and when it was sent.
    pending: Option<(Arc<Signal>, Instant)>,
    /// Set once no plan can come (a peer is gone, the job is over, this worker finished).
    broken: Option<Error>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            barrier: 1,
            mark: None,
            next_sample: 0,
            interval: IntervalEstimate::default(),
            pending: None,
            broken: None,
        }
    }

    /// The mean of the recent samples in nanoseconds, 0 if there is none.
    fn interval_ns(&self) -> u64 {
        self.interval.estimate().unwrap_or(0)
    }
}

#[derive(Default)]
struct Waits {
    acks: HashMap<(u32, AckOf), Arc<Signal>>,
    /// Pulls sent to a server, by request id (the answer's immediate).
    pulls: HashMap<u32, PullWait>,
    barriers: HashMap<u64, Arc<Signal>>,
}

struct Inner {
    t: Transport,
    book: Book,
    sched: Link,
    servers: Vec<ServerSlot>,
    /// The job token (a reattach answers the server's challenge with it).
    token: String,
    /// How long an operation waits for a server that is down to come back (recovery).
    recovery_wait: Duration,
    shards: Vec<ShardRemote>,
    waits: Mutex<Waits>,
    dead: Mutex<HashSet<u32>>,
    grants: Mutex<HashMap<(LinkId, u64), RemoteKey>>,
    next_req: AtomicU32,
    next_barrier: Mutex<u64>,
    staging: Mutex<HashMap<usize, Region>>,
    timeout: Duration,
    stop: AtomicBool,
    stats: Mutex<WorkerStats>,
    /// ElasticBSP's gate; None under every other policy.
    gate: Option<Mutex<Gate>>,
    /// The policy's lock-free pull rule (fixed for the job).
    fast_path: FastPath,
    /// Task-transfer offers not yet taken by the embedder.
    offers: Mutex<VecDeque<Offer>>,
    /// The parallelism manager's latest advice (0: none yet).
    advised: AtomicU32,
    /// Answers a helper's steal: (iteration, most tasks) → the task range given away.
    steal_hook: Mutex<Option<StealHook>>,
    /// Steals in flight: (straggler, clock) → the answer, once it came.
    steals: Mutex<HashMap<(u32, u64), PendingSteal>>,
    /// Every offer received (so the same one from several shards is kept once).
    taken: Mutex<HashSet<Offer>>,
}

/// A steal in flight: its signal, and the answer once it came.
type PendingSteal = (Arc<Signal>, Option<Range<u32>>);

/// How a worker gives tasks away: called with (iteration, most tasks wanted), returns the
/// range of task indices now the helper's (empty: none).
pub type StealHook = Arc<dyn Fn(u64, u32) -> Range<u32> + Send + Sync>;

/// A task-transfer offer (EPSP, FlexRR): this worker may take unprocessed tasks of
/// `straggler`'s iteration `clock`. The task side (the trainer) asks for the tasks and pushes
/// their gradient credited to the straggler; the offer may find none left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Offer {
    /// The worker behind.
    pub straggler: u32,
    /// Its iteration.
    pub clock: u64,
}

/// Counters of one worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerStats {
    /// Shard pulls served by one-sided reads after the lock-free check passed.
    pub fast_pulls: u64,
    /// Shard pulls that went to the server's policy.
    pub slow_pulls: u64,
    /// Shard pushes.
    pub pushes: u64,
    /// Time spent waiting at ElasticBSP barriers (from the report to the plan's arrival).
    pub barrier_wait: Duration,
    /// ElasticBSP supersteps this worker took part in (plans received).
    pub supersteps: u64,
    /// Time its slow-path pulls spent between request and answer (parked by the policy,
    /// then written): the time the policy blocked it, plus one transfer each.
    pub pull_wait: Duration,
    /// Parameter bytes read one-sided by fast-path pulls.
    pub fast_pull_bytes: u64,
    /// Task-transfer offers received (each distinct offer once).
    pub offers: u64,
    /// Shard pushes of transferred tasks' gradients ([`Worker::push_for`]).
    pub help_pushes: u64,
    /// Staleness of its acknowledged shard pushes (updates applied between the values a
    /// gradient was computed on and the gradient; 0 under synchronous clocks): sum, count
    /// and maximum.
    pub staleness_sum: u64,
    /// Acknowledged shard pushes counted in `staleness_sum`.
    pub staleness_acks: u64,
    /// The largest.
    pub staleness_max: u64,
    /// Reattachments to a server (a dropped link, or a server restarted from its checkpoint).
    pub reconnects: u64,
    /// Acknowledged updates a restarted server no longer had (applied after its last
    /// checkpoint), as the servers counted them when this worker reattached.
    pub lost_updates: u64,
}

/// A worker of a job.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<Inner>,
}

impl Worker {
    /// Joins the job as a worker that trains `tensors` (every worker declares the same).
    pub fn join(cfg: &JobConfig, tensors: Vec<TensorSpec>, rank: Option<u32>) -> Result<Worker> {
        let t = Transport::new(TransportConfig {
            bind: None,
            shm: false,
            ..cfg.transport_config()
        })?;
        let (sched, book, _early) = rendezvous(&t, cfg, Role::Worker, rank, tensors)?;
        // With recovery, a server that cannot be reached now (restarting from its checkpoint)
        // is reached later: the progress thread reattaches when the scheduler announces it.
        let mut servers: Vec<Link> = Vec::new();
        let mut reached: Vec<usize> = Vec::new();
        for (r, addr) in book.servers.iter().enumerate() {
            let peer = addr
                .parse()
                .map_err(|e| Error::Config(format!("server {r} address {addr:?}: {e}")))?;
            tracing::debug!("worker {}: connecting to server {r} at {addr}", book.rank);
            match t.connect(&peer) {
                Ok(link) => {
                    link.send(&Msg::Knock.encode())?;
                    servers.push(link);
                    reached.push(r);
                }
                Err(e) if book.recovery => {
                    tracing::warn!("worker {}: server {r} unreachable for now: {e}", book.rank);
                }
                Err(e) => {
                    return Err(Error::PeerGone {
                        role: "server",
                        rank: r as u32,
                        why: e.to_string(),
                    });
                }
            }
        }
        // Each server challenges its new link; the attach answers it, and the server sends
        // its shards' keys (servers answer in any order). A worker rejoining a running job
        // then tells every server where it starts, and waits for each to agree.
        let mut attached = vec![false; servers.len()];
        let mut keys: HashMap<u32, ShardKeys> = HashMap::new();
        let mut got = 0;
        let mut resumed = 0;
        let mut start_clock = None;
        let deadline = Instant::now() + cfg.rendezvous_timeout;
        while got < servers.len() || (book.rejoin && resumed < servers.len()) {
            if book.rejoin && got == servers.len() && start_clock.is_none() {
                // Where a rejoining worker starts: the current clock, the furthest any
                // server reports (so no shard sees it go back).
                let c = keys.values().map(|k| k.clock).max().unwrap_or(0);
                start_clock = Some(c);
                for (l, &r) in servers.iter().zip(&reached) {
                    let shards = book
                        .keymap
                        .shards
                        .iter()
                        .filter(|sp| sp.server as usize == r)
                        .map(|sp| ResumeShard {
                            shard: sp.id,
                            pushes: c,
                            helps: 0,
                        })
                        .collect();
                    l.send(
                        &Msg::Resume {
                            rejoin: true,
                            shards,
                        }
                        .encode(),
                    )?;
                }
                tracing::info!("worker {}: rejoining the job at clock {c}", book.rank);
            }
            let left = time_left(deadline, "attaching to the servers", cfg.rendezvous_timeout)?;
            match t.cq().wait(Some(left)) {
                Ok(Completion::Message { link, data }) => {
                    let Some(r) = servers.iter().position(|l| l.id() == link) else {
                        continue;
                    };
                    match Msg::decode(&data)? {
                        Msg::Challenge { nonce } if !attached[r] => {
                            servers[r].send(
                                &Msg::Attach {
                                    rank: book.rank,
                                    proof: auth::answer(&cfg.token, Purpose::Attach, &nonce),
                                }
                                .encode(),
                            )?;
                            attached[r] = true;
                            tracing::debug!(
                                "worker {}: attached to server {r} over {}",
                                book.rank,
                                servers[r].medium()
                            );
                        }
                        Msg::Keys { shards } => {
                            for k in shards {
                                keys.insert(k.shard, k);
                            }
                            got += 1;
                        }
                        Msg::Resumed { .. } => resumed += 1,
                        Msg::Failed { reason, .. } => {
                            return Err(Error::Server {
                                rank: r as u32,
                                reason,
                            });
                        }
                        other => tracing::debug!("worker: ignoring {other:?} from server {r}"),
                    }
                }
                Ok(Completion::Closed { link, error }) => {
                    let (role, rank) = match servers.iter().position(|l| l.id() == link) {
                        Some(r) => ("server", r as u32),
                        None => ("scheduler", 0),
                    };
                    return Err(Error::PeerGone {
                        role,
                        rank,
                        why: format!(
                            "closed while attaching to the servers: {}",
                            closed_why(&error)
                        ),
                    });
                }
                _ => {}
            }
        }
        let start = start_clock.unwrap_or(0);
        let mut shards = Vec::new();
        let mut local_index = vec![0u32; book.servers.len()];
        for spec in &book.keymap.shards {
            let k = match keys.get(&spec.id) {
                Some(k) => Some(Keys::from_wire(k)?),
                None if !reached.contains(&(spec.server as usize)) => None,
                None => {
                    return Err(Error::PeerGone {
                        role: "server",
                        rank: spec.server,
                        why: format!("sent no keys for shard {}", spec.id),
                    });
                }
            };
            let local = local_index[spec.server as usize];
            local_index[spec.server as usize] += 1;
            shards.push(ShardRemote {
                spec: *spec,
                server: spec.server as usize,
                local,
                keys: RwLock::new(k),
                scratch: Mutex::new(Region::new(meta_bytes(book.workers))?),
                pushes: AtomicU32::new(u32::try_from(start).unwrap_or(u32::MAX)),
                inflight: Mutex::new(None),
                acked: [AtomicU64::new(start), AtomicU64::new(0)],
                pulled_version: std::sync::atomic::AtomicU64::new(0),
                helps: std::sync::atomic::AtomicU64::new(0),
            });
        }
        let timeout = cfg.transport.op_timeout;
        let gate = book.policy.job_barriers().map(|_| Mutex::new(Gate::new()));
        let fast_path = book.policy.build(book.workers).fast_path();
        let mut links = servers.into_iter();
        let servers = book
            .servers
            .iter()
            .enumerate()
            .map(|(r, addr)| {
                let link = if reached.contains(&r) {
                    links.next()
                } else {
                    None
                };
                ServerSlot {
                    state: Mutex::new(ServerConn {
                        // A rejoining worker not yet resumed on it tells it so when it is.
                        rejoin: book.rejoin && link.is_none(),
                        link,
                        addr: addr.clone(),
                        joining: None,
                        next_try: Instant::now(),
                        gone: None,
                        attempts: 0,
                        connecting: false,
                    }),
                    changed: Condvar::new(),
                }
            })
            .collect();
        let recovery_wait = cfg
            .checkpoint
            .as_ref()
            .map_or(Duration::from_secs(60), |c| c.recovery_timeout);
        let first_barrier = if book.rejoin { book.barriers } else { 0 };
        let inner = Arc::new(Inner {
            t,
            book,
            sched,
            servers,
            token: cfg.token.clone(),
            recovery_wait,
            shards,
            waits: Mutex::new(Waits::default()),
            dead: Mutex::new(HashSet::new()),
            grants: Mutex::new(HashMap::new()),
            next_req: AtomicU32::new(1),
            next_barrier: Mutex::new(first_barrier),
            staging: Mutex::new(HashMap::new()),
            timeout,
            stop: AtomicBool::new(false),
            stats: Mutex::new(WorkerStats::default()),
            gate,
            fast_path,
            offers: Mutex::new(VecDeque::new()),
            advised: AtomicU32::new(0),
            steal_hook: Mutex::new(None),
            steals: Mutex::new(HashMap::new()),
            taken: Mutex::new(HashSet::new()),
        });
        let weak = Arc::downgrade(&inner);
        let heartbeat = cfg.heartbeat;
        std::thread::Builder::new()
            .name(format!("falcon-worker-{}", inner.book.rank))
            .spawn(move || progress(weak, heartbeat))
            .map_err(|e| Error::Config(format!("spawn worker progress thread: {e}")))?;
        let weak = Arc::downgrade(&inner);
        let sched = inner.sched.clone();
        crate::heartbeat::start(
            &format!("falcon-worker-{}-heartbeat", inner.book.rank),
            sched,
            heartbeat,
            move || {
                weak.upgrade()
                    .is_some_and(|w| !w.stop.load(Ordering::Acquire))
            },
        )?;
        Ok(Worker { inner })
    }

    /// True when this process rejoined a running job (its rank had died): it starts at the
    /// current clock ([`Worker::clock`]) and must not wait at the job's first barrier, which
    /// has fallen.
    pub fn rejoined(&self) -> bool {
        self.inner.book.rejoin
    }

    /// The workers the scheduler declared dead (and that have not rejoined), by rank.
    pub fn dead_workers(&self) -> Vec<u32> {
        let mut d: Vec<u32> = lock(&self.inner.dead).iter().copied().collect();
        d.sort_unstable();
        d
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.inner.book.rank
    }

    /// Number of workers in the job.
    pub fn workers(&self) -> u32 {
        self.inner.book.workers
    }

    /// The job's synchronization policy, as the scheduler gave it.
    pub fn policy(&self) -> PolicySpec {
        self.inner.book.policy
    }

    /// The servers' optimizer, as they apply it: under an asynchronous policy its rate is
    /// already the job's rate divided by the workers (each gradient is applied on its own).
    pub fn optimizer(&self) -> Optimizer {
        self.inner.book.optimizer
    }

    /// How a clock's gradients combine, and when updates are applied.
    pub fn update_rule(&self) -> (Aggregate, UpdateMode) {
        (self.inner.book.aggregate, self.inner.book.mode)
    }

    /// The job's tensors and shards.
    pub fn keymap(&self) -> &KeyMap {
        &self.inner.book.keymap
    }

    /// The medium of the link to each server, by server rank.
    pub fn server_media(&self) -> Vec<&'static str> {
        (0..self.inner.servers.len())
            .map(|r| self.inner.up_link(r).map_or("down", |l| l.medium()))
            .collect()
    }

    /// Counters so far.
    pub fn stats(&self) -> WorkerStats {
        lock(&self.inner.stats).clone()
    }

    /// Sets how this worker gives tasks away when a helper asks (task transfer): `hook(clock,
    /// want)` takes up to `want` unprocessed tasks of its iteration `clock` off its own queue
    /// and returns their range (the trainer's exactly-once claim point). Without a hook this
    /// worker gives nothing away.
    pub fn on_steal(&self, hook: impl Fn(u64, u32) -> Range<u32> + Send + Sync + 'static) {
        *lock(&self.inner.steal_hook) = Some(Arc::new(hook));
    }

    /// Asks `straggler` (through the scheduler) for up to `want` unprocessed tasks of its
    /// iteration `clock`. Returns the range now this worker's to compute and push with
    /// [`Worker::push_for`]; empty when none is left, the straggler is gone or does not answer
    /// within the operation timeout.
    pub fn steal(&self, straggler: u32, clock: u64, want: u32) -> Result<Range<u32>> {
        self.check_running()?;
        if straggler >= self.workers() || straggler == self.rank() {
            return Err(Error::Config(format!(
                "worker {} cannot take tasks from worker {straggler}",
                self.rank()
            )));
        }
        let sig = Arc::new(Signal::default());
        lock(&self.inner.steals).insert((straggler, clock), (sig.clone(), None));
        let msg = Msg::Steal {
            straggler,
            helper: self.rank(),
            clock,
            want,
        };
        let sent = self.inner.sched.send(&msg.encode());
        let waited = sent
            .map_err(|e| Error::PeerGone {
                role: "scheduler",
                rank: 0,
                why: e.to_string(),
            })
            .and_then(|_| sig.wait(Some(self.inner.timeout)));
        let got = lock(&self.inner.steals).remove(&(straggler, clock));
        match waited {
            Ok(()) => Ok(got.and_then(|(_, r)| r).unwrap_or(0..0)),
            Err(Error::Timeout(..)) => Ok(0..0),
            Err(e) => Err(e),
        }
    }

    /// Pushes the gradient of tasks taken from `straggler`'s iteration `clock` (task
    /// transfer): applied by the servers like an asynchronous gradient, without moving this
    /// worker's clock. Needs asynchronous updates (EPSP, FlexRR, SSP…): under a policy that
    /// aggregates per clock (BSP, Sync-opt) it is refused.
    pub fn push_for(&self, tensor: &str, grad: &Region, straggler: u32, clock: u64) -> Result<()> {
        self.check_running()?;
        if self.inner.book.mode == UpdateMode::Sync {
            return Err(Error::Config(
                "transferred tasks need asynchronous updates; this job's policy (BSP or Sync-opt) aggregates per clock".into(),
            ));
        }
        if straggler >= self.workers() {
            return Err(Error::Config(format!("no worker {straggler}")));
        }
        let _ = clock;
        let t = self.tensor(tensor)?;
        self.check_len(t, grad)?;
        let mut signals = Vec::new();
        for s in self.shards_of(t) {
            let seq = s.helps.fetch_add(1, Ordering::AcqRel) + 1;
            signals.push(self.write_slot(s, Some(grad), AckOf::Help, PushKind::Help, seq)?);
        }
        lock(&self.inner.stats).help_pushes += signals.len() as u64;
        self.handle(signals, Some(self.inner.timeout)).wait()
    }

    /// Tells the scheduler's supervisor that an iteration took `time` (compute and injected
    /// slowness, not waiting for the policy) with `threads` threads and `tasks` own tasks.
    pub fn report_iteration(&self, threads: usize, tasks: u32, time: Duration) -> Result<()> {
        self.check_running()?;
        let m = Msg::IterationDone {
            threads: threads.min(u32::MAX as usize) as u32,
            tasks,
            nanos: time.as_nanos().min(u128::from(u64::MAX)) as u64,
        };
        self.inner
            .sched
            .send(&m.encode())
            .map_err(|e| Error::PeerGone {
                role: "scheduler",
                rank: 0,
                why: e.to_string(),
            })
    }

    /// The thread count the scheduler's parallelism manager last advised for this worker,
    /// if it advised any.
    pub fn advised_threads(&self) -> Option<usize> {
        match self.inner.advised.load(Ordering::Acquire) {
            0 => None,
            n => Some(n as usize),
        }
    }

    /// Takes the task-transfer offers received since the last call (EPSP, FlexRR), oldest
    /// first. Each distinct offer is returned once however many shards made it.
    pub fn offers(&self) -> Vec<Offer> {
        lock(&self.inner.offers).drain(..).collect()
    }

    /// Under ElasticBSP, the clock of this worker's next barrier: pulls at clocks below it
    /// pass, the first at or above it waits for the scheduler's next plan. None under other
    /// policies.
    pub fn superstep_until(&self) -> Option<u64> {
        self.inner.gate.as_ref().map(|g| lock(g).barrier)
    }

    /// Under ElasticBSP, the iteration interval this worker would report at a barrier now (the
    /// mean of its last few samples). None under other policies or before the first sample.
    pub fn interval_estimate(&self) -> Option<Duration> {
        let ns = lock(self.inner.gate.as_ref()?).interval_ns();
        (ns > 0).then(|| Duration::from_nanos(ns))
    }

    /// A zero-filled region sized for `tensor`: push from it and pull into it without copies.
    pub fn buffer(&self, tensor: &str) -> Result<Region> {
        let t = self.tensor(tensor)?;
        Ok(Region::new(self.inner.book.keymap.tensors[t].len * 4)?)
    }

    /// The worker's clock: the iteration it is on, i.e. the fewest gradients pushed to any
    /// tensor it has pushed at all (tensors it never pushes do not hold it back).
    pub fn clock(&self) -> u64 {
        let mut per_tensor: HashMap<u32, u64> = HashMap::new();
        for s in &self.inner.shards {
            let n = u64::from(s.pushes.load(Ordering::Acquire));
            per_tensor
                .entry(s.spec.tensor)
                .and_modify(|m| *m = (*m).min(n))
                .or_insert(n);
        }
        per_tensor
            .values()
            .copied()
            .filter(|&n| n > 0)
            .min()
            .unwrap_or(0)
    }

    /// Gradients pushed to `tensor` so far (its next push's clock).
    pub fn clock_of(&self, tensor: &str) -> Result<u64> {
        let t = self.tensor(tensor)? as u32;
        Ok(self
            .inner
            .shards
            .iter()
            .filter(|s| s.spec.tensor == t)
            .map(|s| u64::from(s.pushes.load(Ordering::Acquire)))
            .min()
            .unwrap_or(0))
    }

    /// The shards of tensor `t`.
    fn shards_of(&self, t: usize) -> impl Iterator<Item = &ShardRemote> {
        self.inner
            .shards
            .iter()
            .filter(move |s| s.spec.tensor as usize == t)
    }

    fn check_running(&self) -> Result<()> {
        if self.inner.stop.load(Ordering::Acquire) {
            return Err(Error::Config(
                "this worker has finished; it can no longer push or pull".into(),
            ));
        }
        Ok(())
    }

    fn tensor(&self, name: &str) -> Result<usize> {
        self.inner.book.keymap.tensor(name)
    }

    fn check_len(&self, t: usize, region: &Region) -> Result<()> {
        let spec = &self.inner.book.keymap.tensors[t];
        if region.len() != spec.len * 4 {
            return Err(Error::WrongLength {
                tensor: spec.name.clone(),
                expected: spec.len,
                got: region.len() / 4,
            });
        }
        Ok(())
    }

    fn handle(&self, signals: Vec<Arc<Signal>>, timeout: Option<Duration>) -> Handle {
        Handle {
            signals,
            timeout,
            started: Instant::now(),
        }
    }

    /// Sets `tensor`'s initial values (the first initialization of each shard wins). Call it
    /// from one worker before training.
    pub fn init(&self, tensor: &str, values: &Region) -> Result<()> {
        let t = self.tensor(tensor)?;
        self.check_len(t, values)?;
        let mut signals = Vec::new();
        for s in self.shards_of(t) {
            signals.push(self.write_slot(s, Some(values), AckOf::Init, PushKind::Init, 0)?);
        }
        self.handle(signals, Some(self.inner.timeout)).wait()
    }

    fn wait_slot(&self, s: &ShardRemote) -> Result<()> {
        let prev = lock(&s.inflight).as_ref().map(|r| r.sig.clone());
        match prev {
            Some(p) => p.wait(Some(self.inner.timeout)),
            None => Ok(()),
        }
    }

    /// Pushes `grad` (a region of the tensor's length) as this worker's gradient for `clock`.
    pub fn push(&self, tensor: &str, grad: &Region, clock: u64) -> Result<()> {
        self.push_async(tensor, grad, clock)?.wait()
    }

    /// Starts a push; `grad` may be reused once the handle's `wait` returns.
    pub fn push_async(&self, tensor: &str, grad: &Region, clock: u64) -> Result<Handle> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        self.check_len(t, grad)?;
        let shards: Vec<&ShardRemote> = self.shards_of(t).collect();
        for s in &shards {
            let made = u64::from(s.pushes.load(Ordering::Acquire));
            if clock != made {
                return Err(Error::BadClock {
                    got: clock,
                    why: format!(
                        "tensor {tensor:?} has {made} gradients pushed; the next push is clock {made}"
                    ),
                });
            }
        }
        self.sample_interval(clock);
        let mut signals = Vec::new();
        for s in shards {
            signals.push(self.write_slot(
                s,
                Some(grad),
                AckOf::Push { clock },
                PushKind::Gradient,
                clock + 1,
            )?);
            s.pushes.fetch_add(1, Ordering::AcqRel);
            lock(&self.inner.stats).pushes += 1;
        }
        Ok(self.handle(signals, Some(self.inner.timeout)))
    }

    /// Writes `grad`'s part for shard `s` into this worker's slot with immediate `kind` and
    /// sequence number `seq` (the server applies each sequence number once), once the
    /// previous push left the slot; returns the signal of the ack (keyed `ack`). With
    /// recovery, a push whose link fails is kept and written again after the reconnection.
    fn write_slot(
        &self,
        s: &ShardRemote,
        grad: Option<&Region>,
        ack: AckOf,
        kind: PushKind,
        seq: u64,
    ) -> Result<Arc<Signal>> {
        self.wait_slot(s)?;
        let link = self.inner.link(s.server)?;
        let sig = Arc::new(Signal::default());
        lock(&self.inner.waits)
            .acks
            .insert((s.spec.id, ack), sig.clone());
        let record = PushRecord {
            grad: grad.cloned(),
            kind,
            seq,
            sig: sig.clone(),
            sent_on: Some(link.id()),
        };
        *lock(&s.inflight) = Some(record.clone());
        if let Err(e) = self.inner.write_push(&link, s, &record) {
            if self.inner.book.recovery && e.is_fatal_for_link() {
                tracing::debug!("worker: push to server {} deferred: {e}", s.server);
            } else {
                lock(&self.inner.waits).acks.remove(&(s.spec.id, ack));
                *lock(&s.inflight) = None;
                return Err(self.server_error(s.server, e));
            }
        }
        Ok(sig)
    }

    /// Sends the last push of `tensor` again, as a retry after a lost acknowledgement would
    /// (its immediate and sequence number again, on the slot as it is), and waits for the
    /// server's answer. The server must not apply it twice. A fault-injection seam for
    /// tests; no error if nothing was pushed yet.
    #[doc(hidden)]
    pub fn repeat_last_push(&self, tensor: &str) -> Result<()> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        let mut signals = Vec::new();
        for s in self.shards_of(t) {
            let pushed = u64::from(s.pushes.load(Ordering::Acquire));
            if pushed == 0 {
                continue;
            }
            signals.push(self.write_slot(
                s,
                None,
                AckOf::Push { clock: pushed - 1 },
                PushKind::Gradient,
                pushed,
            )?);
        }
        self.handle(signals, Some(self.inner.timeout)).wait()
    }

    /// Closes the link to server `server` as a dropped connection would (a fault-injection
    /// seam for tests and the chaos run): with recovery the worker reconnects and resends
    /// what was in flight; without, its operations fail.
    #[doc(hidden)]
    pub fn drop_server_link(&self, server: u32) {
        if let Some(l) = self.inner.up_link(server as usize) {
            l.close();
        }
    }

    /// Pushes from a slice (copied into a staging region first).
    pub fn push_slice(&self, tensor: &str, grad: &[f32], clock: u64) -> Result<()> {
        let region = self.stage(tensor, grad)?;
        self.push(tensor, &region, clock)
    }

    fn stage(&self, tensor: &str, data: &[f32]) -> Result<Region> {
        let t = self.tensor(tensor)?;
        let spec = &self.inner.book.keymap.tensors[t];
        if data.len() as u64 != spec.len {
            return Err(Error::WrongLength {
                tensor: spec.name.clone(),
                expected: spec.len,
                got: data.len() as u64,
            });
        }
        let mut staging = lock(&self.inner.staging);
        let region = match staging.get(&t) {
            Some(r) => r.clone(),
            None => {
                let r = Region::new(spec.len * 4)?;
                staging.insert(t, r.clone());
                r
            }
        };
        region.write_at(0, f32_bytes(data))?;
        Ok(region)
    }

    /// Pulls `tensor` into `out` for iteration `clock`: returns when `out` holds values the
    /// policy allows this clock to see.
    pub fn pull(&self, tensor: &str, out: &Region, clock: u64) -> Result<()> {
        self.pull_async(tensor, out, clock)?.wait()
    }

    /// Pulls into a slice (through a staging region).
    pub fn pull_slice(&self, tensor: &str, out: &mut [f32], clock: u64) -> Result<()> {
        let t = self.tensor(tensor)?;
        let region = self.buffer(&self.inner.book.keymap.tensors[t].name)?;
        if out.len() as u64 != self.inner.book.keymap.tensors[t].len {
            return Err(Error::WrongLength {
                tensor: tensor.to_string(),
                expected: self.inner.book.keymap.tensors[t].len,
                got: out.len() as u64,
            });
        }
        self.pull(tensor, &region, clock)?;
        region.read_at(0, f32_bytes_mut(out))?;
        Ok(())
    }

    /// Starts a pull; `out` is complete once the handle's `wait` returns.
    pub fn pull_async(&self, tensor: &str, out: &Region, clock: u64) -> Result<Handle> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        self.check_len(t, out)?;
        let fast = match self.inner.fast_path {
            FastPath::Always => Some(u64::MAX),
            FastPath::Within(s) => Some(s),
            FastPath::Never => None,
        };
        for s in self.shards_of(t) {
            let made = u64::from(s.pushes.load(Ordering::Acquire));
            if clock > made {
                return Err(Error::BadClock {
                    got: clock,
                    why: format!(
                        "a pull for a clock from the future: {made} gradients pushed to tensor {tensor:?}"
                    ),
                });
            }
        }
        self.pass_gate(clock)?;
        let mut signals = Vec::new();
        for s in self.shards_of(t) {
            if let Some(bound) = fast
                && self.pull_fast(s, out, clock, bound)?
            {
                let mut stats = lock(&self.inner.stats);
                stats.fast_pulls += 1;
                stats.fast_pull_bytes += s.spec.bytes();
                continue;
            }
            lock(&self.inner.stats).slow_pulls += 1;
            signals.push(self.pull_slow(s, out, clock)?);
        }
        Ok(self.handle(signals, None))
    }

    /// ElasticBSP: returns at once below the barrier; at or past it, reports to the scheduler
    /// (once, however many threads pull at this clock) and waits for the plan. No timeout:
    /// the plan comes when every other live worker has reached its barrier or finished, and
    /// a dead peer or the job's end fails the wait (through [`fail_all`]). Without ElasticBSP
    /// it does nothing.
    fn pass_gate(&self, clock: u64) -> Result<()> {
        let Some(gate) = &self.inner.gate else {
            return Ok(());
        };
        loop {
            let sig = {
                let mut g = lock(gate);
                if let Some(e) = &g.broken {
                    return Err(e.clone());
                }
                if g.mark.is_none() {
                    g.mark = Some(Instant::now());
                }
                if clock < g.barrier {
                    return Ok(());
                }
                match &g.pending {
                    Some((sig, _)) => sig.clone(),
                    None => {
                        let interval_ns = g.interval_ns();
                        // Sent under the gate's lock: the plan's handler takes it too, so it
                        // finds `pending` set.
                        self.inner
                            .sched
                            .send(&Msg::Superstep { clock, interval_ns }.encode())
                            .map_err(|e| Error::PeerGone {
                                role: "scheduler",
                                rank: 0,
                                why: e.to_string(),
                            })?;
                        let sig = Arc::new(Signal::default());
                        g.pending = Some((sig.clone(), Instant::now()));
                        sig
                    }
                }
            };
            sig.wait(None)?;
        }
    }

    /// ElasticBSP: the first push of a new clock closes an iteration: one interval sample.
    fn sample_interval(&self, clock: u64) {
        let Some(gate) = &self.inner.gate else {
            return;
        };
        let now = Instant::now();
        let mut g = lock(gate);
        if clock < g.next_sample {
            return;
        }
        if let Some(mark) = g.mark {
            let ns = u64::try_from(now.duration_since(mark).as_nanos()).unwrap_or(u64::MAX);
            g.interval.record(ns);
        }
        g.mark = Some(now);
        g.next_sample = clock + 1;
    }

    /// The lock-free path: meta, check, parameters, sequence again. Ok(false) if the policy
    /// does not allow it (or the shard kept changing under us).
    fn pull_fast(&self, s: &ShardRemote, out: &Region, clock: u64, bound: u64) -> Result<bool> {
        // A server that is down: the slow path queues the request until it is back.
        let Some(link) = self.inner.up_link(s.server) else {
            return Ok(false);
        };
        let Some(keys) = *s.keys.read().unwrap_or_else(|p| p.into_inner()) else {
            return Ok(false);
        };
        let scratch = lock(&s.scratch);
        let workers = self.inner.book.workers;
        let dead = lock(&self.inner.dead).clone();
        let recovery = self.inner.book.recovery;
        let read = |dst: &Region, off: u64, src: &RemoteKey, len: u64| -> Result<bool> {
            match link.read(dst, off, src, 0, len) {
                Ok(()) => Ok(true),
                Err(e) if recovery && e.is_fatal_for_link() => Ok(false),
                Err(e) => Err(self.server_error(s.server, e)),
            }
        };
        for _attempt in 0..4 {
            if !read(&scratch, 0, &keys.meta, meta_bytes(workers))? {
                return Ok(false);
            }
            let mut raw = vec![0u8; meta_bytes(workers) as usize];
            scratch.read_at(0, &mut raw)?;
            let snap = Snapshot::parse(&raw, workers)?;
            if !snap.stable() {
                continue;
            }
            let min = snap.min_clock(|w| !dead.contains(&(w as u32)));
            if bound != u64::MAX && !within_staleness(min, clock, bound) {
                return Ok(false);
            }
            if !read(out, s.spec.offset * 4, &keys.params, s.spec.bytes())?
                || !read(&scratch, 0, &keys.meta, 8)?
            {
                return Ok(false);
            }
            let mut seq = [0u8; 8];
            scratch.read_at(0, &mut seq)?;
            if Snapshot::seq_of(&seq) == snap.seq {
                s.pulled_version.store(snap.version, Ordering::Release);
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn pull_slow(&self, s: &ShardRemote, out: &Region, clock: u64) -> Result<Arc<Signal>> {
        let link = self.inner.link(s.server)?;
        let req = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        let sig = Arc::new(Signal::default());
        s.pulled_version.store(u64::MAX, Ordering::Release);
        let shard = self
            .inner
            .shards
            .iter()
            .position(|x| x.spec.id == s.spec.id)
            .expect("a shard of this worker");
        lock(&self.inner.waits).pulls.insert(
            req,
            PullWait {
                sig: sig.clone(),
                sent: Instant::now(),
                shard,
                out: out.clone(),
                clock,
                sent_on: Some(link.id()),
            },
        );
        if let Err(e) = self.inner.send_pull(&link, s, req, out, clock) {
            if self.inner.book.recovery && e.is_fatal_for_link() {
                tracing::debug!("worker: pull from server {} deferred: {e}", s.server);
            } else {
                lock(&self.inner.waits).pulls.remove(&req);
                return Err(self.server_error(s.server, e));
            }
        }
        Ok(sig)
    }

    fn server_error(&self, server: usize, e: falcon_transport::Error) -> Error {
        if e.is_fatal_for_link() {
            Error::PeerGone {
                role: "server",
                rank: server as u32,
                why: e.to_string(),
            }
        } else {
            Error::Transport(e)
        }
    }

    /// Waits until every live worker has reached this barrier. Under ElasticBSP a worker
    /// waiting here does not hold the others' superstep barrier (they could never get here).
    pub fn barrier(&self) -> Result<()> {
        let seq = {
            let mut n = lock(&self.inner.next_barrier);
            *n += 1;
            *n
        };
        let sig = Arc::new(Signal::default());
        lock(&self.inner.waits).barriers.insert(seq, sig.clone());
        self.inner.sched.send(&Msg::Barrier { seq }.encode())?;
        sig.wait(None)
    }

    /// Tells the scheduler this worker is done (the job ends when every worker is) and closes
    /// its links in order. A second call does nothing (a worker may finish itself as soon as
    /// its work is done, which under barrier policies it should: a worker that neither
    /// finishes nor reaches the barrier holds everyone else back; `LocalCluster::finish`
    /// then finishes the rest).
    pub fn finish(&self) -> Result<()> {
        if self.inner.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        self.inner.sched.send(&Msg::Done.encode())?;
        self.inner.stop.store(true, Ordering::Release);
        // Nobody will route completions any more: fail whatever still waits.
        fail_all(
            &self.inner,
            Role::Worker,
            self.rank(),
            "this worker has finished",
        );
        for slot in &self.inner.servers {
            let st = lock(&slot.state);
            for l in st.link.iter().chain(st.joining.iter()) {
                l.close();
            }
        }
        self.inner.sched.close();
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The heartbeat thread holds a clone of the scheduler link: close it here, with a
        // goodbye, rather than when that thread notices.
        self.stop.store(true, Ordering::Release);
        self.sched.close();
    }
}

/// The worker's progress thread: routes acknowledgements, pull answers and scheduler news to
/// waiting callers. (Heartbeats have a thread of their own, which nothing here can block.)
fn progress(inner: std::sync::Weak<Inner>, heartbeat: Duration) {
    let mut last_resync = Instant::now();
    loop {
        let Some(w) = inner.upgrade() else { return };
        if w.stop.load(Ordering::Acquire) {
            return;
        }
        if w.book.recovery {
            w.reconnect();
            // Anything recorded against a link that has since been replaced goes out again
            // (a request that raced with a reconnection).
            if last_resync.elapsed() >= Duration::from_millis(250) {
                for r in 0..w.servers.len() {
                    w.resync(r);
                }
                last_resync = Instant::now();
            }
        }
        let c = match w
            .t
            .cq()
            .wait(Some(heartbeat.min(Duration::from_millis(200))))
        {
            Ok(c) => c,
            Err(_) => continue,
        };
        // A completion on a reattachment under way (looked up once; none in steady state).
        let joining = match &c {
            Completion::Message { link, .. } | Completion::Closed { link, .. } => {
                w.joining_server(*link)
            }
            Completion::WriteImm { .. } => None,
        };
        match c {
            Completion::Message { data, .. } if joining.is_some() => {
                let r = joining.expect("checked");
                w.reattach_step(r, &data);
            }
            Completion::Closed { error, .. } if joining.is_some() => {
                let r = joining.expect("checked");
                tracing::debug!("worker: reattaching to server {r} failed: {error:?}");
                let mut st = lock(&w.servers[r].state);
                st.joining = None;
                st.next_try = Instant::now() + RETRY;
            }
            Completion::WriteImm { imm, .. } => {
                if let Some(p) = lock(&w.waits).pulls.remove(&imm) {
                    lock(&w.stats).pull_wait += p.sent.elapsed();
                    p.sig.set(Ok(()));
                }
            }
            Completion::Message { data, .. } => match Msg::decode(&data) {
                Ok(Msg::PushAck {
                    shard,
                    of,
                    staleness,
                }) => {
                    if let Some(sig) = lock(&w.waits).acks.remove(&(shard, of)) {
                        w.count_ack(shard, &sig);
                        sig.set(Ok(()));
                    }
                    if of != AckOf::Init {
                        let mut stats = lock(&w.stats);
                        stats.staleness_sum += staleness;
                        stats.staleness_acks += 1;
                        stats.staleness_max = stats.staleness_max.max(staleness);
                    }
                }
                Ok(Msg::PullFailed { req, reason }) => {
                    let waiting = lock(&w.waits).pulls.remove(&req);
                    if let Some(p) = waiting {
                        let rank = w.shards.get(p.shard).map_or(0, |s| s.server as u32);
                        p.sig.set(Err(Error::Server { rank, reason }));
                    }
                }
                Ok(Msg::BarrierDone { seq }) => {
                    if let Some(sig) = lock(&w.waits).barriers.remove(&seq) {
                        sig.set(Ok(()));
                    }
                }
                Ok(Msg::Plan { until }) => {
                    if let Some(gate) = &w.gate {
                        let now = Instant::now();
                        let mut g = lock(gate);
                        // Only an answer to a report moves the barrier (a stray plan does not).
                        if let Some((sig, sent)) = g.pending.take() {
                            g.barrier = g.barrier.max(until);
                            // The next iteration starts now: the wait is not compute.
                            g.mark = Some(now);
                            let mut stats = lock(&w.stats);
                            stats.supersteps += 1;
                            stats.barrier_wait += now.saturating_duration_since(sent);
                            drop(stats);
                            sig.set(Ok(()));
                        }
                    }
                }
                Ok(Msg::Steal {
                    helper,
                    clock,
                    want,
                    ..
                }) => {
                    let hook = lock(&w.steal_hook).clone();
                    let r = match hook {
                        Some(h) => h(clock, want),
                        None => 0..0,
                    };
                    let reply = Msg::Tasks {
                        straggler: w.book.rank,
                        helper,
                        clock,
                        start: r.start,
                        end: r.end.max(r.start),
                    };
                    let _ = w.sched.send(&reply.encode());
                }
                Ok(Msg::Tasks {
                    straggler,
                    clock,
                    start,
                    end,
                    ..
                }) => {
                    if let Some((sig, got)) = lock(&w.steals).get_mut(&(straggler, clock)) {
                        *got = Some(start..end.max(start));
                        sig.set(Ok(()));
                    }
                }
                Ok(Msg::Threads { threads }) => {
                    w.advised.store(threads, Ordering::Release);
                }
                Ok(Msg::Offer { straggler, clock }) => {
                    // Every shard's policy may make the same offer: keep one.
                    let offer = Offer { straggler, clock };
                    let mut offers = lock(&w.offers);
                    if !offers.contains(&offer) && lock(&w.taken).insert(offer) {
                        offers.push_back(offer);
                        lock(&w.stats).offers += 1;
                    }
                }
                Ok(Msg::Dead {
                    role: Role::Worker,
                    rank,
                }) => {
                    lock(&w.dead).insert(rank);
                }
                Ok(Msg::Rejoined { rank }) => {
                    lock(&w.dead).remove(&rank);
                }
                Ok(Msg::Dead {
                    role: Role::Server,
                    rank,
                }) if w.book.recovery && (rank as usize) < w.servers.len() => {
                    tracing::warn!("worker: server {rank} died; waiting for its restart");
                    w.server_down(rank as usize);
                    // Declared dead, it may only be paused: never reattach to that incarnation.
                    // The scheduler announces its successor (`ServerBack`).
                    lock(&w.servers[rank as usize].state).next_try =
                        Instant::now() + Duration::from_secs(365 * 24 * 3600);
                }
                Ok(Msg::Evicted { reason }) => {
                    tracing::error!("worker {}: evicted by the scheduler: {reason}", w.book.rank);
                    fail_with(
                        &w,
                        Error::Evicted {
                            rank: w.book.rank,
                            reason,
                        },
                    );
                }
                Ok(Msg::ServerBack { rank, addr }) if (rank as usize) < w.servers.len() => {
                    tracing::info!("worker: server {rank} restarted at {addr}; reattaching");
                    let mut st = lock(&w.servers[rank as usize].state);
                    st.addr = addr;
                    st.next_try = Instant::now();
                    if let Some(j) = st.joining.take() {
                        j.close();
                    }
                }
                Ok(Msg::Dead { role, rank }) => {
                    fail_all(&w, role, rank, "declared dead by the scheduler")
                }
                Ok(Msg::Shutdown) => fail_all(&w, Role::Scheduler, 0, "the job was shut down"),
                Ok(_) => {}
                Err(e) => tracing::warn!("worker: {e}"),
            },
            Completion::Closed { link, error } => {
                let server =
                    (0..w.servers.len()).find(|&r| w.up_link(r).is_some_and(|l| l.id() == link));
                match server {
                    Some(r) if w.book.recovery => {
                        tracing::warn!(
                            "worker: link to server {r} closed ({}); reconnecting",
                            closed_why(&error)
                        );
                        w.server_down(r);
                    }
                    Some(r) => fail_all(
                        &w,
                        Role::Server,
                        r as u32,
                        &format!("link closed: {}", closed_why(&error)),
                    ),
                    // A link already replaced: nothing to do.
                    None if link != w.sched.id() => {}
                    // Lost without a goodbye (a partition the scheduler may have evicted
                    // this worker over, its eviction notice lost with the link): the worker
                    // may join again under its rank.
                    None if error.is_some() => fail_with(
                        &w,
                        Error::SchedulerLost {
                            rank: w.book.rank,
                            why: closed_why(&error),
                        },
                    ),
                    None => fail_all(
                        &w,
                        Role::Scheduler,
                        0,
                        &format!("link closed: {}", closed_why(&error)),
                    ),
                }
            }
        }
    }
}

/// Fails every waiting caller: a peer is gone, nothing they wait for will come.
fn fail_all(w: &Inner, role: Role, rank: u32, why: &str) {
    fail_with(
        w,
        Error::PeerGone {
            role: role.name(),
            rank,
            why: why.to_string(),
        },
    );
}

/// Fails every waiter, and every later operation, with `err`.
fn fail_with(w: &Inner, err: Error) {
    for slot in &w.servers {
        let mut st = lock(&slot.state);
        if st.gone.is_none() {
            st.gone = Some(err.clone());
        }
        slot.changed.notify_all();
    }
    let mut waits = lock(&w.waits);
    for (_, s) in waits.acks.drain() {
        s.set(Err(err.clone()));
    }
    for (_, p) in waits.pulls.drain() {
        p.sig.set(Err(err.clone()));
    }
    for (_, s) in waits.barriers.drain() {
        s.set(Err(err.clone()));
    }
    drop(waits);
    if let Some(gate) = &w.gate {
        let mut g = lock(gate);
        if g.broken.is_none() {
            g.broken = Some(err.clone());
        }
        if let Some((s, _)) = g.pending.take() {
            s.set(Err(err));
        }
    }
}

/// Pause between attempts to reach a server that is down.
const RETRY: Duration = Duration::from_millis(200);

impl Inner {
    /// The link to server `r` if it is up.
    fn up_link(&self, r: usize) -> Option<Link> {
        lock(&self.servers[r].state).link.clone()
    }

    /// The link to server `r`; with recovery, waits (up to the recovery timeout) while the
    /// server is down.
    fn link(&self, r: usize) -> Result<Link> {
        let slot = &self.servers[r];
        let deadline = Instant::now() + self.recovery_wait;
        let mut st = lock(&slot.state);
        loop {
            if let Some(e) = &st.gone {
                return Err(e.clone());
            }
            if let Some(l) = &st.link {
                return Ok(l.clone());
            }
            if !self.book.recovery {
                return Err(Error::PeerGone {
                    role: "server",
                    rank: r as u32,
                    why: "its link is closed".into(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(
                    "waiting for a server to come back",
                    self.recovery_wait,
                ));
            }
            st = slot
                .changed
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Server `r` is unreachable: operations wait, and the progress thread reconnects.
    fn server_down(&self, r: usize) {
        let mut st = lock(&self.servers[r].state);
        if let Some(l) = st.link.take() {
            l.close();
        }
        st.next_try = Instant::now();
    }

    /// The server whose reconnection `link` is, if any.
    fn joining_server(&self, link: LinkId) -> Option<usize> {
        (0..self.servers.len()).find(|&r| {
            lock(&self.servers[r].state)
                .joining
                .as_ref()
                .is_some_and(|l| l.id() == link)
        })
    }

    /// Starts a reconnection to every server that is down and due for an attempt: connect and
    /// knock on a thread of its own (a host that drops packets would hold a connect for the
    /// handshake deadline, and the progress thread must never wait on one peer);
    /// [`Inner::reattach_step`] carries it on.
    fn reconnect(self: &Arc<Self>) {
        for (r, slot) in self.servers.iter().enumerate() {
            let addr = {
                let mut st = lock(&slot.state);
                if st.link.is_some()
                    || st.joining.is_some()
                    || st.connecting
                    || st.gone.is_some()
                    || Instant::now() < st.next_try
                {
                    continue;
                }
                st.connecting = true;
                st.addr.clone()
            };
            let w = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name(format!("falcon-reconnect-{r}"))
                .spawn(move || {
                    if let Some(w) = w.upgrade() {
                        w.connect_to(r, &addr);
                    }
                });
            if let Err(e) = spawned {
                let mut st = lock(&slot.state);
                st.connecting = false;
                st.next_try = Instant::now() + RETRY;
                tracing::warn!(
                    "worker {}: cannot start a reconnection: {e}",
                    self.book.rank
                );
            }
        }
    }

    /// One reconnection attempt to server `r` at `addr` (on its own thread).
    fn connect_to(&self, r: usize, addr: &str) {
        let attempt = addr
            .parse()
            .map_err(|e| format!("address {addr:?}: {e}"))
            .and_then(|peer| self.t.connect(&peer).map_err(|e| e.to_string()));
        let slot = &self.servers[r];
        let mut st = lock(&slot.state);
        st.connecting = false;
        match attempt {
            // Still wanted, and still the address the scheduler gave last (a successor
            // announced meanwhile must not be shadowed by its predecessor).
            Ok(l)
                if st.link.is_none()
                    && st.joining.is_none()
                    && st.gone.is_none()
                    && st.addr == addr =>
            {
                st.attempts = 0;
                // Known as this server's reconnection before the server can answer it.
                st.joining = Some(l.clone());
                drop(st);
                if let Err(e) = l.send(&Msg::Knock.encode()) {
                    let mut st = lock(&slot.state);
                    if st.joining.as_ref().is_some_and(|j| j.id() == l.id()) {
                        st.joining = None;
                        st.next_try = Instant::now() + RETRY;
                    }
                    drop(st);
                    tracing::debug!("worker: knocking on server {r} failed: {e}");
                    l.close();
                }
            }
            Ok(l) => {
                st.next_try = Instant::now();
                drop(st);
                l.close();
            }
            Err(e) => {
                st.attempts += 1;
                if st.attempts % 15 == 1 {
                    tracing::warn!(
                        "worker {}: server {r} at {addr} not reachable yet (attempt {}): {e}",
                        self.book.rank,
                        st.attempts
                    );
                }
                st.next_try = Instant::now() + RETRY;
            }
        }
    }

    /// One step of a reattachment to server `r`: answer its challenge, install its keys and
    /// tell it what was acknowledged, then (resumed) put the link in use and resend.
    fn reattach_step(&self, r: usize, data: &[u8]) {
        let Some(link) = lock(&self.servers[r].state).joining.clone() else {
            return;
        };
        match Msg::decode(data) {
            Ok(Msg::Challenge { nonce }) => {
                let _ = link.send(
                    &Msg::Attach {
                        rank: self.book.rank,
                        proof: auth::answer(&self.token, Purpose::Attach, &nonce),
                    }
                    .encode(),
                );
            }
            Ok(Msg::Keys { shards }) => {
                for k in &shards {
                    let Some(s) = self.shards.iter().find(|s| s.spec.id == k.shard) else {
                        continue;
                    };
                    match Keys::from_wire(k) {
                        Ok(keys) => *s.keys.write().unwrap_or_else(|p| p.into_inner()) = Some(keys),
                        Err(e) => tracing::warn!("worker: server {r} sent a bad key: {e}"),
                    }
                }
                let resume = self
                    .shards
                    .iter()
                    .filter(|s| s.server == r)
                    .map(|s| ResumeShard {
                        shard: s.spec.id,
                        pushes: s.acked[0].load(Ordering::Acquire),
                        helps: s.acked[1].load(Ordering::Acquire),
                    })
                    .collect();
                let rejoin = lock(&self.servers[r].state).rejoin;
                let _ = link.send(
                    &Msg::Resume {
                        rejoin,
                        shards: resume,
                    }
                    .encode(),
                );
            }
            Ok(Msg::Resumed { lost }) => {
                {
                    let slot = &self.servers[r];
                    let mut st = lock(&slot.state);
                    st.joining = None;
                    st.rejoin = false;
                    st.link = Some(link.clone());
                    slot.changed.notify_all();
                }
                let mut stats = lock(&self.stats);
                stats.reconnects += 1;
                stats.lost_updates += lost;
                drop(stats);
                tracing::info!(
                    "worker {}: reattached to server {r} ({lost} acknowledged updates lost)",
                    self.book.rank
                );
                self.resync(r);
            }
            Ok(Msg::Failed { what, reason }) => {
                fail_all(
                    self,
                    Role::Server,
                    r as u32,
                    &format!("refused the reattachment ({what}): {reason}"),
                );
            }
            Ok(other) => tracing::debug!("worker: ignoring {other:?} while reattaching to {r}"),
            Err(e) => tracing::warn!("worker: reattaching to server {r}: {e}"),
        }
    }

    /// Writes again, on server `r`'s current link, the push and the pulls recorded against
    /// an older link (the server applies a push's sequence number once).
    fn resync(&self, r: usize) {
        let Some(link) = self.up_link(r) else { return };
        for s in self.shards.iter().filter(|s| s.server == r) {
            let record = lock(&s.inflight).clone();
            let Some(rec) = record else { continue };
            if rec.sig.done() || rec.sent_on == Some(link.id()) {
                continue;
            }
            if self.write_push(&link, s, &rec).is_ok() {
                let mut cur = lock(&s.inflight);
                if let Some(c) = cur.as_mut()
                    && Arc::ptr_eq(&c.sig, &rec.sig)
                {
                    c.sent_on = Some(link.id());
                }
            }
        }
        let todo: Vec<(u32, usize, Region, u64)> = lock(&self.waits)
            .pulls
            .iter()
            .filter(|(_, p)| self.shards[p.shard].server == r && p.sent_on != Some(link.id()))
            .map(|(&req, p)| (req, p.shard, p.out.clone(), p.clock))
            .collect();
        for (req, i, out, clock) in todo {
            if self
                .send_pull(&link, &self.shards[i], req, &out, clock)
                .is_ok()
                && let Some(p) = lock(&self.waits).pulls.get_mut(&req)
            {
                p.sent_on = Some(link.id());
            }
        }
    }

    /// Writes a push on `link`: the slot's trailer (the version the gradient was computed
    /// from, the sequence number), then the gradient with its immediate (same link, so the
    /// trailer lands first).
    fn write_push(
        &self,
        link: &Link,
        s: &ShardRemote,
        rec: &PushRecord,
    ) -> std::result::Result<(), falcon_transport::Error> {
        let Some(keys) = *s.keys.read().unwrap_or_else(|p| p.into_inner()) else {
            return Err(falcon_transport::Error::Closed {
                peer: format!("server {}", s.server),
                reason: "not reached yet".into(),
            });
        };
        let scratch = lock(&s.scratch);
        let v = s.pulled_version.load(Ordering::Acquire);
        let trailer = SlotTrailer {
            computed_on: Some(v).filter(|&v| v != u64::MAX),
            seq: rec.seq,
        };
        scratch.write_at(0, &trailer.to_bytes())?;
        link.write(
            &scratch,
            0,
            &keys.slot,
            s.spec.bytes(),
            SlotTrailer::BYTES,
            None,
        )?;
        let kind = rec.kind;
        let imm = Some(
            Immediate {
                kind,
                local: s.local,
            }
            .pack(),
        );
        match &rec.grad {
            Some(g) => link.write(g, s.spec.offset * 4, &keys.slot, 0, s.spec.bytes(), imm),
            None => link.write(&scratch, 0, &keys.slot, 0, 0, imm),
        }
    }

    /// Sends a pull request on `link`, granting the destination on it first (cached).
    fn send_pull(
        &self,
        link: &Link,
        s: &ShardRemote,
        req: u32,
        out: &Region,
        clock: u64,
    ) -> std::result::Result<(), falcon_transport::Error> {
        let dst = {
            let mut grants = lock(&self.grants);
            match grants.get(&(link.id(), out.id())) {
                Some(k) => *k,
                None => {
                    let k = link.grant(out)?;
                    grants.insert((link.id(), out.id()), k);
                    k
                }
            }
        };
        let msg = Msg::PullReq {
            shard: s.spec.id,
            clock,
            req,
            dst: dst.to_bytes().to_vec(),
            dst_off: s.spec.offset * 4,
        };
        link.send(&msg.encode())
    }

    /// An acknowledgement arrived with `sig`: counts it as acknowledged for the push it ends.
    fn count_ack(&self, shard: u32, sig: &Arc<Signal>) {
        let Some(s) = self.shards.iter().find(|s| s.spec.id == shard) else {
            return;
        };
        if let Some(rec) = lock(&s.inflight).as_ref()
            && Arc::ptr_eq(&rec.sig, sig)
        {
            let i = match rec.kind {
                PushKind::Gradient => 0,
                PushKind::Help => 1,
                PushKind::Init => return,
            };
            s.acked[i].fetch_max(rec.seq, Ordering::AcqRel);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The bytes of an f32 slice.
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    zerocopy::IntoBytes::as_bytes(v)
}

/// The bytes of an f32 slice, mutably (every byte pattern is a valid f32).
pub fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    zerocopy::IntoBytes::as_mut_bytes(v)
}
