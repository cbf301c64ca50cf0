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
//!
//! # Layout
//!
//! - this file: the public [`Worker`] API (joining, push and pull, barriers, finishing) and
//!   the driver's hub (`Inner::drive`, which feeds the core and carries out its actions);
//! - `core`: the worker's sans-IO state machine — every request a caller waits on (with what
//!   to send again after a reconnection), each shard's clocks and counters, the gate, the
//!   offers, the grants, the row plans and answers, the dead workers and the counters. It
//!   takes calls, answers and the time, and returns actions (wake a waiter, widen values
//!   that landed, send a superstep report); a property test holds it to a shadow model;
//! - `tracker`: the core's table of requests in flight, and the `Signal` a caller waits on;
//! - `gate`: ElasticBSP's gate (part of the core);
//! - `data`: the data path (slot writes, the lock-free pull, pull requests, resends);
//! - `conn`: the server connections (the first attach; with recovery, reconnection,
//!   reattachment) — the link table, which holds the links themselves and the condition
//!   operations wait on while a server is down;
//! - `transfer`: task transfer (offers, steals, [`Worker::push_for`]) and the supervisor's
//!   reports and advice;
//! - `device` (feature `cuda`): push and pull of device memory ([`Worker::push_device`],
//!   `Worker::pull_device`) through a page-locked staging region;
//! - `progress`: the background thread that hands each completion to the core.
//!
//! # Locks
//!
//! The worker's state is the core's, behind one lock (`Inner::core`). The other locks guard
//! I/O resources, not state:
//!
//! | lock | guards |
//! |---|---|
//! | `core` | the [`core`] state machine |
//! | `servers[r].state` (with its condvar `changed`) | server `r`'s link, its reconnection, whether it is gone for good |
//! | `shards[i].keys` (read-write) | shard `i`'s remote keys (replaced on reattachment) |
//! | `shards[i].scratch`, `push_buf`, `rows_buf` | shard `i`'s buffers (meta reads and slot trailers; encoded and row payloads) |
//! | `granting` | nothing but the act of granting a region on a link (held across that transport call) |
//! | `staging` | the staging regions of `push_slice` |
//!
//! and every `Signal` (what a caller waits on) a lock of its own.
//!
//! The order, enforced where the core is taken: **`core` is innermost** — nothing is taken
//! while it is held. The core holds no path to any other lock (it has no link, no buffer,
//! no `Inner`), and `Inner::drive` releases it before carrying out the actions it returned,
//! so a waiter is woken and a report sent with no state lock held. A data-path step may
//! take the core under one shard's buffer lock (a push's trailer reads the shard's last
//! pulled version; a fast pull records it) or under nothing. Of the buffer locks, a push
//! with 16-bit values on the wire takes its shard's `push_buf` under its `scratch`, and a
//! pull that reads every shard at once (`pull_fast_together`) takes its shards' `scratch`
//! in the order of the worker's shard list; every other is taken alone. `servers[r].state`
//! is taken alone (what is needed past it is cloned out), and held across one transport
//! call: closing its links. `granting` is taken under nothing, and only the core under it. Waiting on a signal, or on `changed`, holds no other lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use falcon_transport::{Link, Region, RemoteKey, Transport, TransportConfig};

use crate::config::{FanOut, JobConfig};
use crate::error::{Error, Result};
use crate::keys::{KeyMap, ShardSpec, TensorSpec};
use crate::meta::meta_bytes;
use crate::postoffice::rendezvous;
use crate::proto::{AckOf, Book, Msg, PushKind, Role, ShardKeys};
use crate::sync::{FastPath, PolicySpec};
use crate::update::{Aggregate, Optimizer, UpdateMode};

mod conn;
mod core;
mod data;
#[cfg(feature = "cuda")]
mod device;
mod gate;
mod progress;
mod tracker;
mod transfer;

use conn::ServerSlot;
use core::{Action, Core, Resend};
pub use core::{Offer, StealHook};
use tracker::Signal;

/// Rewrites a gradient's key and offset ([`Worker::forge_in_place_sources`]).
#[doc(hidden)]
pub type ForgeSource = Arc<dyn Fn(&mut RemoteKey, &mut u64) + Send + Sync>;

/// A push or pull in flight. `wait` returns when every shard is done.
#[must_use = "a push or pull is only known done after wait()"]
pub struct Handle {
    signals: Vec<Arc<Signal>>,
    /// Pushes: the operation timeout (the server acknowledges once it has read the gradient
    /// out of the slot, or applied it from there). Pulls: none — a pull
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
                Some(Ok(_)) => {}
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

    /// Waits for completion. A push's handle returns only once every part has completed or
    /// timed out, failed parts included, so that no server still reads the caller's memory
    /// (a gradient read in place over shm) when it returns with an error; its first error.
    pub fn wait(self) -> Result<()> {
        let mut first = None;
        for s in &self.signals {
            if let Err(e) = s.wait(self.timeout) {
                if self.timeout.is_none() {
                    // A pull waits as long as its policy holds it: the first error ends it.
                    return Err(e);
                }
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Per server, the bytes of one push or pull above which each server's part goes on its
/// own thread (see `Worker::per_server`): below it, a thread costs more than the overlap
/// gains.
const FAN_OUT_BYTES: u64 = 256 << 10;

/// A row request split over its tensor's shards, each shard's index written: what a row
/// push or pull of the same rows needs again.
struct RowPlan {
    dim: u64,
    rows: Vec<u64>,
    /// Per shard of the tensor, in the order of `Worker::shards_of`.
    picks: Vec<crate::rows::Pick>,
    /// Per shard, its index ([`crate::rows::index_into`]).
    index: Vec<Vec<u8>>,
}

/// Called with each shard a pull read on the lock-free path (the device path copies it on).
type ShardHook<'a> = dyn FnMut(&ShardRemote) -> Result<()> + 'a;

/// Fewest cores for the fan-out: on a 2-core host shared with the servers, the extra
/// threads only compete with them (over shm, a 1 × 2 job at 4 MiB ran at half speed).
const FAN_OUT_CORES: usize = 4;

/// This host's cores, asked once.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

struct ShardRemote {
    spec: ShardSpec,
    /// Its index in the worker's shards (and the core's).
    index: usize,
    server: usize,
    local: u32,
    /// The server's keys for this shard (replaced when the worker reattaches; `None` until
    /// a server that was down when this worker joined is reached).
    keys: RwLock<Option<Keys>>,
    /// Scratch for one-sided meta reads (one pull of this shard at a time).
    scratch: Mutex<Region>,
    /// With 16-bit values on the wire: the encoded gradient as it goes out (made at the
    /// first push; one push of a shard is in its slot at a time).
    push_buf: Mutex<Option<Region>>,
    /// A row push's payload for this shard (made at the first row push).
    rows_buf: Mutex<Option<Region>>,
}

impl ShardRemote {
    /// This worker's side of every shard of the job: with the keys the servers sent, none
    /// yet for those of a server not reached.
    fn all(
        book: &Book,
        keys: &HashMap<u32, ShardKeys>,
        reached: &[usize],
    ) -> Result<Vec<ShardRemote>> {
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
                index: shards.len(),
                server: spec.server as usize,
                local,
                keys: RwLock::new(k),
                // The meta block, then its sequence number read again (see `pull_fast`).
                scratch: Mutex::new(Region::new(meta_bytes(book.workers) + 8)?),
                push_buf: Mutex::new(None),
                rows_buf: Mutex::new(None),
            });
        }
        Ok(shards)
    }
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

/// The worker's state, shared with its progress thread. See the [module docs](self) for
/// its locks and their order.
struct Inner {
    t: Transport,
    book: Book,
    sched: Link,
    servers: Vec<ServerSlot>,
    /// The job token (a reattach answers the server's challenge with it).
    token: String,
    /// The servers' cap on control messages (`TransportConfig::max_accepted_message`).
    control_cap: u64,
    /// How long an operation waits for a server that is down to come back (recovery).
    recovery_wait: Duration,
    shards: Vec<ShardRemote>,
    /// The worker's state machine: requests, clocks, gate, offers, grants, row plans,
    /// counters (see [`core`]). Taken through [`Inner::drive`] where it returns actions.
    core: Mutex<Core>,
    /// Held while a region is granted on a link (a transport call), so that a region is
    /// granted once per link however many threads need it at once.
    granting: Mutex<()>,
    /// The staging regions of `push_slice`, per tensor.
    staging: Mutex<HashMap<usize, Region>>,
    timeout: Duration,
    /// [`JobConfig::shm_in_place`].
    shm_in_place: bool,
    stop: AtomicBool,
    /// The rates the next pushes ask for ([`Worker::set_rates`]): the learning rate's and the
    /// weight decay's factor as two f32 bit patterns (high, low); 0 for none.
    rates: AtomicU64,
    /// The policy's lock-free pull rule (fixed for the job).
    fast_path: FastPath,
    /// Per-server parts of large pushes and pulls go out at once (see `Worker::per_server`).
    fan_out: bool,
    /// Bumped whenever the progress thread has handed something on ([`Worker::wait_news`]).
    news: News,
}

/// A count of what the progress thread handed on (answers, acknowledgements, offers), which
/// a caller waiting for any of several things sleeps on instead of polling.
#[derive(Default)]
struct News {
    count: Mutex<u64>,
    cv: std::sync::Condvar,
}

impl News {
    fn bump(&self) {
        *lock(&self.count) += 1;
        self.cv.notify_all();
    }

    fn count(&self) -> u64 {
        *lock(&self.count)
    }

    /// Waits until the count is no longer `seen`, or `timeout` passed; returns the count.
    fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        // No deadline where `timeout` is beyond what a clock can say (then: an hour at a
        // time until something arrives).
        let deadline = Instant::now().checked_add(timeout);
        let mut n = lock(&self.count);
        while *n == seen {
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                break;
            }
            n = self
                .cv
                .wait_timeout(n, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *n
    }
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
    /// Shard pushes whose f32 gradient went over shm without a copy: the server read it in
    /// this worker's memory (shards of at least 64 KiB); a resent push counts again.
    pub pushes_in_place: u64,
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
        let (sched, mut book, _early) = rendezvous(&t, cfg, Role::Worker, rank, tensors)?;
        // A resumed job: every worker goes on at the clock the servers' checkpoints hold, as
        // a worker rejoining a running job does.
        if cfg.checkpoint.as_ref().is_some_and(|c| c.resume) {
            book.rejoin = true;
        }
        let links = conn::connect_servers(&t, &book)?;
        let attached = conn::attach(&t, cfg, &book, links)?;
        let reached: Vec<usize> = attached.links.iter().map(|(r, _)| *r).collect();
        let shards = ShardRemote::all(&book, &attached.keys, &reached)?;
        let tensors: Vec<u32> = shards.iter().map(|s| s.spec.tensor).collect();
        let servers = conn::server_slots(&book, attached.links);
        let recovery_wait = cfg
            .checkpoint
            .as_ref()
            .map_or(Duration::from_secs(60), |c| c.recovery_timeout);
        let first_barrier = if book.rejoin { book.barriers } else { 0 };
        let core = Core::new(
            &tensors,
            attached.start,
            book.policy.job_barriers().is_some(),
            first_barrier,
            data::IN_PLACE_MAX_REGIONS,
        );
        let inner = Arc::new(Inner {
            core: Mutex::new(core),
            fast_path: book.policy.build(book.workers).fast_path(),
            fan_out: match cfg.fan_out {
                FanOut::On => true,
                FanOut::Off => false,
                FanOut::Auto => cores() >= FAN_OUT_CORES,
            },
            t,
            book,
            sched,
            servers,
            token: cfg.token.clone(),
            control_cap: cfg.transport.max_accepted_message,
            recovery_wait,
            shards,
            granting: Mutex::new(()),
            staging: Mutex::new(HashMap::new()),
            timeout: cfg.transport.op_timeout,
            shm_in_place: cfg.shm_in_place,
            stop: AtomicBool::new(false),
            rates: AtomicU64::new(0),
            news: News::default(),
        });
        Inner::start_threads(&inner, cfg.heartbeat)?;
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
        lock(&self.inner.core).dead().iter().copied().collect()
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

    /// The job's precision on the wire (`FALCON_WIRE`; a tensor may have its own).
    pub fn wire(&self) -> crate::precision::Wire {
        self.inner.book.wire
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

    /// How many of the job's workers and servers were on this worker's host at the start,
    /// this one included (a trainer sharing the host's cores among them may size its own
    /// thread pools by it).
    pub fn host_peers(&self) -> u32 {
        self.inner.book.host_peers
    }

    /// How long this worker's waits spin before they park: the configured spin, or none on
    /// a host crowded with the job's processes (see [`JobConfig::spin_auto`]).
    pub fn spin(&self) -> Duration {
        self.inner.t.spin()
    }

    /// The medium of the link to each server, by server rank.
    pub fn server_media(&self) -> Vec<&'static str> {
        (0..self.inner.servers.len())
            .map(|r| self.inner.up_link(r).map_or("down", |l| l.medium()))
            .collect()
    }

    /// Counters so far.
    pub fn stats(&self) -> WorkerStats {
        lock(&self.inner.core).stats().clone()
    }

    /// A zero-filled region sized for `tensor`: push from it and pull into it without copies.
    pub fn buffer(&self, tensor: &str) -> Result<Region> {
        let t = self.tensor(tensor)?;
        Ok(Region::new(self.inner.book.keymap.tensors[t].len * 4)?)
    }

    /// The worker's clock: the iteration it is on, i.e. the fewest gradients pushed to any
    /// tensor it has pushed at all (tensors it never pushes do not hold it back).
    pub fn clock(&self) -> u64 {
        self.inner.clock()
    }

    /// Gradients pushed to `tensor` so far (its next push's clock).
    pub fn clock_of(&self, tensor: &str) -> Result<u64> {
        let t = self.tensor(tensor)?;
        let core = lock(&self.inner.core);
        Ok(self
            .shards_of(t)
            .map(|s| core.shard(s.index).pushes)
            .min()
            .unwrap_or(0))
    }

    /// The plan of a row request of `rows` (`dim` floats each) of tensor `t`, whose shards
    /// are `shards`: the last one's where it named the same rows, else checked
    /// ([`crate::rows::check_rows`]), split over the shards
    /// ([`crate::rows::split`]) and indexed.
    fn row_plan(
        &self,
        t: usize,
        shards: &[&ShardRemote],
        dim: u64,
        rows: &[u64],
    ) -> Result<Arc<RowPlan>> {
        // Compared outside the lock, which every tensor's requests share.
        let last = lock(&self.inner.core).row_plan(t);
        if let Some(p) = last
            && p.dim == dim
            && p.rows == rows
        {
            return Ok(p);
        }
        let spec = &self.inner.book.keymap.tensors[t];
        crate::rows::check_rows(&spec.name, spec.len, dim, rows)?;
        let bounds: Vec<(u64, u64)> = shards.iter().map(|s| (s.spec.offset, s.spec.len)).collect();
        let picks = crate::rows::split(spec.len, &bounds, dim, rows)?;
        // The last plan's buffers are written again where nothing else holds them: fresh
        // ones of this size would be fresh pages of memory every request.
        let old = lock(&self.inner.core).take_row_plan(t);
        let (mut kept_rows, mut index) = match old.and_then(|p| Arc::try_unwrap(p).ok()) {
            Some(p) => (p.rows, p.index),
            None => (Vec::new(), Vec::new()),
        };
        kept_rows.clear();
        kept_rows.extend_from_slice(rows);
        index.resize_with(shards.len(), Vec::new);
        for ((s, pick), out) in shards.iter().zip(&picks).zip(&mut index) {
            crate::rows::index_into(s.spec.offset, s.spec.len, dim, rows, pick, out);
        }
        let plan = Arc::new(RowPlan {
            dim,
            rows: kept_rows,
            picks,
            index,
        });
        lock(&self.inner.core).set_row_plan(t, plan.clone());
        Ok(plan)
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

    /// Pushes `grad` (a region of the tensor's length) as this worker's gradient for `clock`.
    pub fn push(&self, tensor: &str, grad: &Region, clock: u64) -> Result<()> {
        self.push_async(tensor, grad, clock)?.wait()
    }

    /// Starts a push; `grad` may be reused once the handle's `wait` returns, not before: a
    /// push is sent again from it after a reconnection, and over shm a server reads a large
    /// f32 gradient straight out of it (see [`WorkerStats::pushes_in_place`]).
    pub fn push_async(&self, tensor: &str, grad: &Region, clock: u64) -> Result<Handle> {
        let shards = self.push_shards(tensor, grad, clock)?;
        self.sample_interval(clock);
        let signals = self.per_server(&shards, |s| self.push_shard(s, grad, clock))?;
        Ok(self.handle(signals, Some(self.inner.timeout)))
    }

    /// Writes shard `s`'s part of `grad` as the gradient of `clock`, counted; returns the
    /// signal of its acknowledgement.
    fn push_shard(&self, s: &ShardRemote, grad: &Region, clock: u64) -> Result<Arc<Signal>> {
        let sig = self.write_slot(
            s,
            Some(grad),
            AckOf::Push { clock },
            PushKind::Gradient,
            clock + 1,
        )?;
        self.pushed(s);
        Ok(sig)
    }

    /// Pushes `grad` as this worker's gradient for `clock`, then pulls `tensor` into `out` for
    /// `clock + 1`: what [`Worker::push`] then [`Worker::pull`] do (BytePS's `push_pull`,
    /// ps-lite's `ZPushPull`), shard by shard. Each shard's pull request rides in its push (one
    /// write on the link), and its server answers it once the push is applied, in one write
    /// with the push's acknowledgement where both are ready then (when the policy allows, as
    /// for any pull of
    /// `clock + 1`; after a reconnection the pull follows its resent push) while the next
    /// shards' pushes are still on their way: both directions of a link carry data at once,
    /// where `push` then `pull` uses one direction at a time. So each answer holds this push,
    /// unless the policy drops it or counts it for a later step (Sync-opt's backups); after a
    /// `push`, a lock-free `pull` need not see it where the server acknowledges before it
    /// applies (16-bit gradients). `grad` and `out` may be the same region (a shard's answer
    /// lands only after its push has left). Under ElasticBSP the pushes go first, then the
    /// superstep barrier a pull may have to wait for, then every shard's pull through its
    /// server. On an error the pushes that went out stay pushed (the first error is returned
    /// once every shard was pushed), and answers already asked for may still land in `out`.
    pub fn push_pull(&self, tensor: &str, grad: &Region, out: &Region, clock: u64) -> Result<()> {
        let (pushed, pulled) = self.push_pull_async(tensor, grad, out, clock)?;
        // Acknowledgements within the push timeout; answers as long as the policy holds them.
        pushed.wait()?;
        pulled.wait()
    }

    /// Starts a [`Worker::push_pull`]: returns the push's handle (done once every shard
    /// acknowledged, within the operation timeout) and the pull's (done once `out` holds the
    /// values for `clock + 1`; as long as the policy holds them). `grad` may be reused once
    /// the push's handle is done, `out` read once the pull's is. A pull that could not be
    /// asked for is the pull handle's error; the pushes went out anyway.
    pub fn push_pull_async(
        &self,
        tensor: &str,
        grad: &Region,
        out: &Region,
        clock: u64,
    ) -> Result<(Handle, Handle)> {
        let t = self.tensor(tensor)?;
        self.check_len(t, out)?;
        if lock(&self.inner.core).gated() {
            return self.push_pull_gated(tensor, grad, out, clock);
        }
        let shards = self.push_shards(tensor, grad, clock)?;
        self.sample_interval(clock);
        let sent = self.per_server(&shards, |s| {
            let rec = core::PushRecord {
                grad: Some(grad.clone()),
                own: None,
                kind: PushKind::Gradient,
                seq: clock + 1,
                help_for: None,
                rates: self.inner.rates(),
            };
            // The pull rides in the push's trailer: one write, answered with the push's
            // acknowledgement in one write back.
            let (ack, answer) =
                self.write_record_and_pull(s, rec, AckOf::Push { clock }, (out, clock + 1))?;
            self.pushed(s);
            lock(&self.inner.core).stats_mut().slow_pulls += 1;
            // A failed pull request does not stop the other shards' pushes: every shard of
            // the tensor must count this clock.
            Ok((ack, answer))
        })?;
        let mut acks = Vec::with_capacity(sent.len());
        let mut answers = Vec::with_capacity(sent.len());
        for (ack, answer) in sent {
            acks.push(ack);
            answers.push(answer.unwrap_or_else(|e| Signal::with(Err(e))));
        }
        Ok((
            self.handle(acks, Some(self.inner.timeout)),
            self.handle(answers, None),
        ))
    }

    /// [`Worker::push_pull_async`] under ElasticBSP: the pushes go first, then (on a thread
    /// of its own, so the caller goes on) the superstep barrier a pull may have to wait for,
    /// then every shard's pull through its server.
    fn push_pull_gated(
        &self,
        tensor: &str,
        grad: &Region,
        out: &Region,
        clock: u64,
    ) -> Result<(Handle, Handle)> {
        let pushed = self.push_async(tensor, grad, clock)?;
        let acks = self.handle(pushed.signals.clone(), pushed.timeout);
        let done = Arc::new(Signal::default());
        let (w, t, out, sig) = (
            self.clone(),
            self.tensor(tensor)?,
            out.clone(),
            done.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("falcon-push-pull-{}", self.rank()))
            .spawn(move || {
                let pulled = (|| {
                    acks.wait()?;
                    w.pass_gate(clock + 1)?;
                    let shards: Vec<&ShardRemote> = w.shards_of(t).collect();
                    let answers = w.per_server(&shards, |s| {
                        lock(&w.inner.core).stats_mut().slow_pulls += 1;
                        w.pull_slow(s, &out, clock + 1)
                    })?;
                    w.handle(answers, None).wait()
                })();
                sig.set(pulled.map(|()| Default::default()));
                // Set here, not by the progress thread: a caller sleeping in `wait_news`
                // wakes for it too.
                w.inner.news.bump();
            });
        if let Err(e) = spawned {
            done.set(Err(Error::os("cannot start a push-pull's thread", e)));
        }
        Ok((pushed, self.handle(vec![done], None)))
    }

    /// Pushes the gradient of some rows of `tensor`, seen as a table of `len / dim` rows of
    /// `dim` floats, as this worker's gradient for `clock`: `grads` holds `rows.len()` rows
    /// of `dim` floats in the order of `rows`; duplicate rows are summed; rows not named
    /// have a zero gradient. Only the named rows travel, but every shard of the tensor counts
    /// the push, so every policy treats it as it treats a dense push. The servers' optimizer
    /// must leave a row with a zero gradient alone (sgd, adagrad): under momentum or Adam
    /// the push is refused.
    pub fn push_rows(
        &self,
        tensor: &str,
        dim: u64,
        rows: &[u64],
        grads: &[f32],
        clock: u64,
    ) -> Result<()> {
        self.push_rows_async(tensor, dim, rows, grads, clock)?
            .wait()
    }

    /// Starts a row push (see [`Worker::push_rows`]); `rows` and `grads` are copied before
    /// this returns.
    pub fn push_rows_async(
        &self,
        tensor: &str,
        dim: u64,
        rows: &[u64],
        grads: &[f32],
        clock: u64,
    ) -> Result<Handle> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        let spec = &self.inner.book.keymap.tensors[t];
        let opt = self.inner.book.optimizer;
        if !opt.zero_is_identity() {
            return Err(Error::Config(format!(
                "row pushes need servers whose optimizer leaves rows without a gradient alone \
                 (sgd or adagrad); this job's is {}",
                opt.name()
            )));
        }
        let shards: Vec<&ShardRemote> = self.shards_of(t).collect();
        let plan = self.row_plan(t, &shards, dim, rows)?;
        crate::rows::check_values(&spec.name, dim, rows, grads.len())?;
        self.check_push_clock(&shards, tensor, clock)?;
        self.sample_interval(clock);
        let signals = self.per_server(&shards, |s| {
            // The slot's previous push may still be sent again from the buffer: wait for it.
            self.wait_slot(s)?;
            let k = shards.iter().position(|x| std::ptr::eq(*x, s)).unwrap_or(0);
            let region = {
                let mut buf = lock(&s.rows_buf);
                match buf.as_ref() {
                    Some(r) => r.clone(),
                    None => {
                        let r = Region::new(s.spec.bytes())?;
                        *buf = Some(r.clone());
                        r
                    }
                }
            };
            let part = crate::rows::for_shard(
                s.spec.offset,
                s.spec.len,
                dim,
                rows,
                grads,
                &plan.picks[k],
                &plan.index[k],
                |at, bytes| Ok(region.write_at(at, bytes)?),
            )?;
            let (kind, bytes) = match &part {
                crate::rows::ShardRows::Sparse(n) => (PushKind::Rows, *n),
                crate::rows::ShardRows::Dense(d) => {
                    region.write_at(0, f32_bytes(d))?;
                    (PushKind::Gradient, s.spec.bytes())
                }
            };
            let rec = core::PushRecord {
                grad: Some(region),
                own: Some(bytes),
                kind,
                seq: clock + 1,
                help_for: None,
                rates: self.inner.rates(),
            };
            let sig = self.write_record(s, rec, AckOf::Push { clock })?;
            self.pushed(s);
            Ok(sig)
        })?;
        Ok(self.handle(signals, Some(self.inner.timeout)))
    }

    /// Pulls some rows of `tensor` (a table of `len / dim` rows of `dim` floats) for
    /// iteration `clock` into `out` (`rows.len() · dim` floats, in the order of `rows`), with
    /// the values the policy allows this clock to see. Each server holding some of the rows
    /// gathers them into one answer: only the rows travel.
    pub fn pull_rows(
        &self,
        tensor: &str,
        dim: u64,
        rows: &[u64],
        out: &mut [f32],
        clock: u64,
    ) -> Result<()> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        let spec = &self.inner.book.keymap.tensors[t];
        let shards: Vec<&ShardRemote> = self.shards_of(t).collect();
        let plan = self.row_plan(t, &shards, dim, rows)?;
        crate::rows::check_values(&spec.name, dim, rows, out.len())?;
        self.check_pull_clock(t, tensor, clock)?;
        self.pass_gate(clock)?;
        // Every shard's request goes out before any answer is waited for.
        let mut waiting = Vec::with_capacity(shards.len());
        let mut first_err = None;
        for ((s, pick), index) in shards.iter().zip(&plan.picks).zip(&plan.index) {
            if pick.count == 0 {
                continue;
            }
            let link = match self.inner.link(s.server) {
                Ok(l) => l,
                Err(e) => {
                    // The requests already out are still waited for (their answers taken).
                    first_err = Some(e);
                    break;
                }
            };
            let id = lock(&self.inner.core).next_req();
            let req = tracker::Request::Pull(id);
            // Written into the message once: the same bytes go out again on a new link if
            // this one drops.
            let msg = Arc::new(Msg::encode_pull_rows(s.spec.id, clock, id, index));
            let cap = self
                .inner
                .book
                .keymap
                .worker_message_cap(s.spec.server, self.inner.control_cap);
            if msg.len() as u64 > cap {
                first_err = Some(Error::Server {
                    rank: s.spec.server,
                    reason: format!(
                        "a row pull of {} rows is a {}-byte request, over the {cap} bytes a server takes from a worker (16 bytes per float it holds): pull fewer repeated rows at once",
                        pick.count,
                        msg.len()
                    ),
                });
                break;
            }
            let what = Resend::PullRows {
                shard: s.index,
                msg: msg.clone(),
            };
            let sig = self.track(s, &link, req, what);
            lock(&self.inner.core).stats_mut().slow_pulls += 1;
            let sent = link.send(&msg);
            if let Err(e) = self.sent_or_deferred(sent, s.server, req, "pull rows from") {
                first_err = Some(e);
                break;
            }
            waiting.push((id, sig, *s, pick));
        }
        for (id, sig, s, pick) in waiting {
            let got = sig.wait(None).map(drop);
            let values = lock(&self.inner.core).take_row_answer(id);
            if let Err(e) = got {
                first_err.get_or_insert(e);
                continue;
            }
            let Some((answer, at)) = values else { continue };
            let values = &answer[at..];
            if let Err(e) =
                crate::rows::scatter(s.spec.offset, s.spec.len, dim, rows, pick, values, out)
            {
                let e = match e {
                    Error::Malformed(m) => Error::Malformed(format!("row pull {id}: {m}")),
                    other => other,
                };
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Refuses a push at `clock` unless it is the next of every shard in `shards`.
    fn check_push_clock(&self, shards: &[&ShardRemote], tensor: &str, clock: u64) -> Result<()> {
        let core = lock(&self.inner.core);
        for s in shards {
            let made = core.shard(s.index).pushes;
            if clock != made {
                return Err(Error::BadClock {
                    got: clock,
                    why: format!(
                        "tensor {tensor:?} has {made} gradients pushed; the next push is clock {made}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Refuses a pull of tensor `t` at a clock past this worker's pushes.
    fn check_pull_clock(&self, t: usize, tensor: &str, clock: u64) -> Result<()> {
        let core = lock(&self.inner.core);
        for s in self.shards_of(t) {
            let made = core.shard(s.index).pushes;
            if clock > made {
                return Err(Error::BadClock {
                    got: clock,
                    why: format!(
                        "a pull for a clock from the future: {made} gradients pushed to tensor {tensor:?}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Counts a push of shard `s` written.
    fn pushed(&self, s: &ShardRemote) {
        lock(&self.inner.core).pushed(s.index);
    }

    /// Runs `op` on every shard in `shards` and returns the results in their order. Where the
    /// shards live on more than one server and carry at least [`FAN_OUT_BYTES`] per server,
    /// each server's shards go on their own thread, so the one-sided writes or reads to
    /// different servers are in flight at once (a transport operation returns only when its
    /// bytes are out: over tcp the socket took them, over rdma the adapter completed them,
    /// over shm they were copied); otherwise in order on this thread. The first error wins;
    /// the other servers' operations have then been issued or failed on their own.
    fn per_server<'s, T: Send>(
        &self,
        shards: &[&'s ShardRemote],
        op: impl Fn(&'s ShardRemote) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        let mut by_server: Vec<(usize, Vec<usize>, u64)> = Vec::new();
        for (i, s) in shards.iter().enumerate() {
            match by_server.iter_mut().find(|(srv, ..)| *srv == s.server) {
                Some((_, idx, bytes)) => {
                    idx.push(i);
                    *bytes += s.spec.bytes();
                }
                None => by_server.push((s.server, vec![i], s.spec.bytes())),
            }
        }
        let fan_out = by_server.len() > 1
            && by_server.iter().all(|(.., b)| *b >= FAN_OUT_BYTES)
            && self.inner.fan_out;
        if !fan_out {
            return shards.iter().map(|s| op(s)).collect();
        }
        let run = |idx: &[usize]| -> Vec<(usize, Result<T>)> {
            let mut out = Vec::with_capacity(idx.len());
            for &i in idx {
                let r = op(shards[i]);
                let failed = r.is_err();
                out.push((i, r));
                if failed {
                    break;
                }
            }
            out
        };
        let mut results: Vec<(usize, Result<T>)> = std::thread::scope(|scope| {
            let (first, rest) = by_server.split_first().expect("more than one server");
            let others: Vec<_> = rest
                .iter()
                .map(|(_, idx, _)| scope.spawn(|| run(idx)))
                .collect();
            let mut all = run(&first.1);
            for h in others {
                match h.join() {
                    Ok(r) => all.extend(r),
                    Err(p) => std::panic::resume_unwind(p),
                }
            }
            all
        });
        results.sort_by_key(|(i, _)| *i);
        results.into_iter().map(|(_, r)| r).collect()
    }

    /// The shards of `tensor`, once `grad` and `clock` are checked for a push.
    fn push_shards(&self, tensor: &str, grad: &Region, clock: u64) -> Result<Vec<&ShardRemote>> {
        self.check_running()?;
        let t = self.tensor(tensor)?;
        self.check_len(t, grad)?;
        let shards: Vec<&ShardRemote> = self.shards_of(t).collect();
        self.check_push_clock(&shards, tensor, clock)?;
        Ok(shards)
    }

    #[cfg(feature = "cuda")]
    /// Writes `grad` to `shards` as the gradient of `clock`, calling `before(i)` before the
    /// `i`-th shard's part is written.
    fn write_pushes(
        &self,
        shards: Vec<&ShardRemote>,
        grad: &Region,
        clock: u64,
        mut before: impl FnMut(usize) -> Result<()>,
    ) -> Result<Handle> {
        self.sample_interval(clock);
        let mut signals = Vec::new();
        for (i, s) in shards.into_iter().enumerate() {
            before(i)?;
            signals.push(self.write_slot(
                s,
                Some(grad),
                AckOf::Push { clock },
                PushKind::Gradient,
                clock + 1,
            )?);
            lock(&self.inner.core).pushed(s.index);
        }
        Ok(self.handle(signals, Some(self.inner.timeout)))
    }

    /// From now on, rewrites the key and offset that a push read in place names (a worker
    /// lying about its memory), as `forge` says. A fault-injection seam for tests.
    #[doc(hidden)]
    pub fn forge_in_place_sources(&self, forge: ForgeSource) {
        lock(&self.inner.core).set_forge_source(forge);
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
            let pushed = lock(&self.inner.core).shard(s.index).pushes;
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
        let slow = self.pull_shards(tensor, out, clock, None)?;
        Ok(self.handle(slow.into_iter().map(|(_, sig)| sig).collect(), None))
    }

    /// Pulls each shard of `tensor` into `out`: calls `fast_done(s)` after shard `s` was read on
    /// the lock-free path (before the next shard is read), and returns the shards that went to their server with the signal
    /// of each.
    fn pull_shards(
        &self,
        tensor: &str,
        out: &Region,
        clock: u64,
        fast_done: Option<&mut ShardHook<'_>>,
    ) -> Result<Vec<(&ShardRemote, Arc<Signal>)>> {
        self.pull_shards_of(tensor, out, clock, fast_done, None)
    }

    /// [`Worker::pull_shards`], of the shards in `only` (every shard with `None`).
    fn pull_shards_of(
        &self,
        tensor: &str,
        out: &Region,
        clock: u64,
        mut fast_done: Option<&mut ShardHook<'_>>,
        only: Option<&std::collections::HashSet<u32>>,
    ) -> Result<Vec<(&ShardRemote, Arc<Signal>)>> {
        let picked = |s: &&ShardRemote| only.is_none_or(|o| o.contains(&s.spec.id));
        // Without a per-shard hook, shards on different servers are read at once.
        let fan_out = fast_done.is_none();
        self.check_running()?;
        let t = self.tensor(tensor)?;
        self.check_len(t, out)?;
        let fast = match self.inner.fast_path {
            FastPath::Always => Some(u64::MAX),
            FastPath::Within(s) => Some(s),
            FastPath::Never => None,
        };
        self.check_pull_clock(t, tensor, clock)?;
        self.pass_gate(clock)?;
        if let Some(bound) = fast
            && fan_out
        {
            let mut shards: Vec<&ShardRemote> = self.shards_of(t).filter(picked).collect();
            if bound == u64::MAX && shards.len() > 1 {
                shards = self.pull_fast_together(&shards, out)?;
            }
            let done = self.per_server(&shards, |s| {
                if self.pull_fast(s, out, clock, bound)? {
                    return Ok(None);
                }
                lock(&self.inner.core).stats_mut().slow_pulls += 1;
                Ok(Some((s, self.pull_slow(s, out, clock)?)))
            })?;
            return Ok(done.into_iter().flatten().collect());
        }
        let mut slow = Vec::new();
        for s in self.shards_of(t).filter(picked) {
            if let Some(bound) = fast
                && self.pull_fast(s, out, clock, bound)?
            {
                if let Some(f) = fast_done.as_mut() {
                    f(s)?;
                }
                continue;
            }
            lock(&self.inner.core).stats_mut().slow_pulls += 1;
            slow.push((s, self.pull_slow(s, out, clock)?));
        }
        Ok(slow)
    }

    /// Sets what this worker's next pushes ask of the servers' update, as multiples of the
    /// job's: the learning rate (a schedule of the worker's own: the servers multiply their
    /// rate, after their own schedule, by `lr`) and AdamW's decoupled weight decay (`wd`: 0
    /// for parameters that take none). `None`: the job's own. Every push made after this
    /// returns carries them (a push sent again after a reconnection carries what it carried
    /// first); under synchronous updates a step takes the rates of its last push, so every
    /// worker should ask for the same. Worker-wide: set it from the thread that pushes.
    /// Factors that are not finite numbers ≥ 0 are a [`Error::Config`].
    pub fn set_rates(&self, rates: Option<crate::update::Rates>) -> Result<()> {
        let bits = match rates {
            None => 0,
            Some(r) if r.valid() => {
                let nz = |x: f32| {
                    if x.to_bits() == 0 {
                        (-0.0f32).to_bits()
                    } else {
                        x.to_bits()
                    }
                };
                (u64::from(nz(r.lr)) << 32) | u64::from(nz(r.wd))
            }
            Some(r) => {
                return Err(Error::Config(format!(
                    "rates: the learning rate's factor {} and the weight decay's {} must be \
                     finite numbers ≥ 0",
                    r.lr, r.wd
                )));
            }
        };
        self.inner.rates.store(bits, Ordering::Relaxed);
        Ok(())
    }

    /// Waits until every live worker has reached this barrier. Under ElasticBSP a worker
    /// waiting here does not hold the others' superstep barrier (they could never get here).
    pub fn barrier(&self) -> Result<()> {
        let seq = lock(&self.inner.core).next_barrier();
        let req = tracker::Request::Barrier(seq);
        let sig = self
            .inner
            .drive(|c, now, out| c.register(req, None, None, now, Resend::Nothing, out));
        self.inner.sched.send(&Msg::Barrier { seq }.encode())?;
        sig.wait(None).map(drop)
    }

    /// Tells the scheduler this worker is done (the job ends when every worker is) and closes
    /// its links in order. A second call does nothing (a worker may finish itself as soon as
    /// its work is done, which under barrier policies it should: a worker that neither
    /// finishes nor reaches the barrier holds everyone else back; `LocalCluster::finish`
    /// then finishes the rest).
    pub fn finish(&self) -> Result<()> {
        self.leave(Msg::Done, "this worker has finished")
    }

    /// Stops the whole job, saying `why` (this process was interrupted or terminated, or
    /// its script failed): the scheduler tells every worker and server, whose operations
    /// then fail with `PeerGone` naming this worker and `why`, and the job ends failed.
    /// Every operation of this worker fails from now on. A finished worker stops nothing.
    pub fn abort(&self, why: &str) -> Result<()> {
        self.leave(
            Msg::Abort {
                why: why.to_string(),
            },
            "this worker stopped the job",
        )
    }

    /// Leaves the job with `last` (done, or abort).
    fn leave(&self, last: Msg, why: &str) -> Result<()> {
        if self.inner.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        // The last counters for the metrics (the heartbeat ends with the stop below).
        let _ = self
            .inner
            .sched
            .send(&Msg::Metrics(self.inner.metrics()).encode());
        // Stopped before the scheduler hears of it: the servers close their links once every
        // worker is done, and a finished worker's progress thread must not take that for a
        // failure to recover from.
        self.inner.stop.store(true, Ordering::Release);
        let said = self.inner.sched.send(&last.encode());
        // Nobody will route completions any more: fail whatever still waits, whether or not
        // the scheduler heard.
        self.inner.fail_all(Role::Worker, self.rank(), why);
        self.inner.close_servers();
        self.inner.sched.close();
        said?;
        Ok(())
    }
}

impl Inner {
    /// The rates the next push asks for ([`Worker::set_rates`]).
    fn rates(&self) -> Option<crate::update::Rates> {
        let bits = self.rates.load(Ordering::Relaxed);
        (bits != 0).then(|| crate::update::Rates {
            lr: f32::from_bits((bits >> 32) as u32),
            wd: f32::from_bits(bits as u32),
        })
    }
}

impl Inner {
    /// See [`Worker::clock`].
    fn clock(&self) -> u64 {
        lock(&self.core).clock()
    }

    /// Runs `f` on the core with the time, then carries out the actions it returned, with
    /// the core's lock released: the lock order is true by construction — the core holds no
    /// path to another lock, `drive` takes nothing while it holds the core, and whoever
    /// takes the core under another lock (a shard's scratch during a push) takes nothing
    /// under it.
    fn drive<R>(&self, f: impl FnOnce(&mut Core, Instant, &mut Vec<Action>) -> R) -> R {
        let mut out = Vec::new();
        let r = f(&mut lock(&self.core), Instant::now(), &mut out);
        self.perform(out);
        r
    }

    /// Carries out the core's actions.
    fn perform(&self, actions: Vec<Action>) {
        let mut woke = false;
        for a in actions {
            match a {
                Action::Wake(sig, outcome) => {
                    sig.set(outcome);
                    woke = true;
                }
                Action::Widen { shard, out, sig } => {
                    let widened = self.widen(&out, &self.shards[shard]);
                    sig.set(
                        widened
                            .map(|()| Default::default())
                            .map_err(Error::Transport),
                    );
                    woke = true;
                }
                Action::Report(msg) => {
                    if let Err(e) = self.sched.send(&msg.encode()) {
                        let err = Error::PeerGone {
                            role: "scheduler",
                            rank: 0,
                            why: e.to_string(),
                        };
                        self.drive(|c, _, out| c.report_failed(&err, out));
                    }
                }
            }
        }
        // Whatever thread set them (the progress thread, a caller, a failure): a caller
        // sleeping in `wait_news` wakes for them.
        if woke {
            self.news.bump();
        }
    }

    /// The counters the heartbeat sends to the scheduler's metrics.
    fn metrics(&self) -> crate::metrics::NodeMetrics {
        let (st, clock) = {
            let core = lock(&self.core);
            (core.stats().clone(), core.clock())
        };
        crate::metrics::NodeMetrics {
            iterations: clock,
            pushes: st.pushes,
            pulls: st.fast_pulls + st.slow_pulls,
            blocked_nanos: (st.pull_wait + st.barrier_wait).as_nanos() as u64,
            staleness_sum: st.staleness_sum,
            staleness_count: st.staleness_acks,
            staleness_max: st.staleness_max,
            bytes_out: st.fast_pull_bytes,
            ..Default::default()
        }
    }

    /// Starts the progress thread and the heartbeat to the scheduler; both end once the
    /// worker is dropped or finished.
    fn start_threads(inner: &Arc<Inner>, heartbeat: Duration) -> Result<()> {
        let weak = Arc::downgrade(inner);
        std::thread::Builder::new()
            .name(format!("falcon-worker-{}", inner.book.rank))
            .spawn(move || progress::progress(weak, heartbeat))
            .map_err(|e| Error::os("cannot start the worker's progress thread", e))?;
        let (weak, counters) = (Arc::downgrade(inner), Arc::downgrade(inner));
        crate::heartbeat::start(
            &format!("falcon-worker-{}-heartbeat", inner.book.rank),
            inner.sched.clone(),
            heartbeat,
            move || {
                weak.upgrade()
                    .is_some_and(|w| !w.stop.load(Ordering::Acquire))
            },
            move || counters.upgrade().map(|w| Msg::Metrics(w.metrics())),
        )
    }

    /// Fails every waiting caller: a peer is gone, nothing they wait for will come.
    fn fail_all(&self, role: Role, rank: u32, why: &str) {
        self.fail_with(Error::PeerGone {
            role: role.name(),
            rank,
            why: why.to_string(),
        });
    }

    /// Fails every waiter, and every later operation, with `err`.
    fn fail_with(&self, err: Error) {
        self.servers_gone(&err);
        self.drive(|c, _, out| c.fail_all(&err, out));
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

#[cfg(test)]
mod news_tests {
    use super::News;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_bump_wakes_the_sleeper_and_a_quiet_wait_ends_at_its_timeout() {
        let news = Arc::new(News::default());
        assert_eq!(news.count(), 0);
        // Nothing arrives: the wait ends at its timeout with the count unchanged.
        assert_eq!(news.wait(0, Duration::from_millis(20)), 0);
        // A bump before the wait: it returns at once with the new count.
        news.bump();
        assert_eq!(news.wait(0, Duration::from_secs(3600)), 1);
        // A bump from another thread wakes a sleeper with no deadline to speak of.
        let other = news.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            other.bump();
        });
        assert_eq!(news.wait(1, Duration::MAX), 2);
        t.join().unwrap();
    }
}
