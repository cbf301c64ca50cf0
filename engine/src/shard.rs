//! One shard as a state machine: gradients, pulls and membership changes in, acknowledgements,
//! answers and offers out. No sockets, no clocks of its own, no threads: the server's event
//! loop drives one [`ShardCore`] per shard over its shared-memory regions, and the simulator
//! (`falcon sim`) drives the very same code over a plain vector, so what the simulator
//! reports is what the servers do.
//!
//! The core owns, per shard:
//! - exactly-once: a worker's pushes carry sequence numbers; a repeat (a retry) is
//!   acknowledged again and not applied, a gap is refused;
//! - the update rule: asynchronous apply-per-push (scaled by version staleness) or synchronous
//!   aggregate-then-apply in rank order, with the configured optimizer and aggregate;
//! - Sync-opt's judgement of arrivals (a gradient dropped, or counted for the step of the
//!   parameters it was computed on);
//! - the memory cap: acknowledgements held back while the gradients waiting for their step
//!   exceed it, so a pusher faster than the steps slows down instead of growing memory;
//! - pull parking through the shard's [`SyncPolicy`].
//!
//! Parameters sit behind [`ShardParams`]: [`RegionParams`] keeps them in transport regions
//! under the meta block's seqlock (what workers read one-sided), [`VecParams`] in a vector.
//! Every write goes through [`ShardParams::write`], one write section at a time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use crate::checkpoint::ShardState;
use crate::error::{Error, Result};
use crate::proto::AckOf;
use crate::sync::{Action, Event, SyncPolicy};
use crate::update::{Aggregate, GradientScale, ShardOptimizer, UpdateMode, aggregate};

/// What a shard is: its id, size, workers and update rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardConfig {
    /// Global shard id.
    pub id: u32,
    /// Floats.
    pub len: usize,
    /// Workers of the job.
    pub workers: u32,
    /// When updates are applied.
    pub mode: UpdateMode,
    /// How a synchronous step's gradients combine.
    pub aggregate: Aggregate,
    /// Synchronous mode: gradient bytes waiting for their step above which acknowledgements
    /// are held back.
    pub max_pending_bytes: u64,
}

/// Where a dense push's gradient is, for [`Input::Push`].
#[derive(Clone)]
pub enum Grad<'a> {
    /// In a vector.
    Values(Vec<f32>),
    /// Still where the worker wrote it (its slot on a server): read a block at a time while
    /// it is applied, so it is read once, and copied out where it must wait (a synchronous
    /// step). The acknowledgement lets the worker write the slot again, so it comes after
    /// the apply, or after the copy.
    Slot(&'a dyn GradSlot),
}

/// A gradient in place, read by blocks ([`Grad::Slot`]); a large one by several threads at
/// once.
pub trait GradSlot: Sync {
    /// Its floats.
    fn len(&self) -> usize;
    /// Whether it has none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies floats `at .. at + out.len()` (within `len`) into `out`.
    fn read(&self, at: usize, out: &mut [f32]);
}

impl Grad<'_> {
    /// Its floats.
    pub fn len(&self) -> usize {
        match self {
            Grad::Values(v) => v.len(),
            Grad::Slot(s) => s.len(),
        }
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The floats in a vector (a slot's copied out).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Grad::Values(v) => v,
            Grad::Slot(s) => {
                let mut v = vec![0.0; s.len()];
                s.read(0, &mut v);
                v
            }
        }
    }
}

impl From<Vec<f32>> for Grad<'_> {
    fn from(v: Vec<f32>) -> Self {
        Grad::Values(v)
    }
}

impl std::fmt::Debug for Grad<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Grad::Values(v) => f.debug_tuple("Values").field(v).finish(),
            Grad::Slot(s) => write!(f, "Slot({} floats)", s.len()),
        }
    }
}

impl PartialEq for Grad<'_> {
    /// Vectors by their floats; a slot only to itself.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Grad::Values(a), Grad::Values(b)) => a == b,
            (Grad::Slot(a), Grad::Slot(b)) => std::ptr::addr_eq(*a, *b),
            _ => false,
        }
    }
}

/// An event for a shard. `conn` names the connection a push came on (whatever the driver
/// uses); its acknowledgement goes back on it.
#[derive(Clone, Debug, PartialEq)]
pub enum Input<'a> {
    /// Initial values from a worker (the first one wins).
    Init {
        /// The connection.
        conn: u64,
        /// The worker.
        worker: u32,
        /// The values (`len` floats).
        values: Vec<f32>,
    },
    /// A gradient of the worker's own iteration.
    Push {
        /// The connection.
        conn: u64,
        /// The worker.
        worker: u32,
        /// Its sequence number (1 for the first push; a repeat is a retry).
        seq: u64,
        /// The parameter version it was computed on (`None`: the one last sent to the worker).
        computed_on: Option<u64>,
        /// The gradient (`len` floats).
        grad: Grad<'a>,
    },
    /// A gradient of tasks taken from another worker (task transfer): applied at once, no
    /// clock moves.
    Help {
        /// The connection.
        conn: u64,
        /// The worker that computed it.
        worker: u32,
        /// Its own sequence of such pushes (1 first).
        seq: u64,
        /// The version it was computed on, as for [`Input::Push`].
        computed_on: Option<u64>,
        /// The gradient.
        grad: Vec<f32>,
        /// The straggler and iteration the tasks were taken from (under synchronous updates
        /// the gradient joins that step when it has not been applied yet).
        help_for: Option<(u32, u64)>,
    },
    /// A gradient of the worker's own iteration given as some ranges of the shard (a row
    /// push): the rest of the gradient is zero. Applied over those ranges alone in
    /// asynchronous mode, widened to the whole shard for a synchronous step.
    PushRows {
        /// The connection.
        conn: u64,
        /// The worker.
        worker: u32,
        /// Its sequence number, as for [`Input::Push`].
        seq: u64,
        /// The version it was computed on, as for [`Input::Push`].
        computed_on: Option<u64>,
        /// The ranges: (first float, floats), in order; they may repeat (summed).
        ranges: crate::rows::RowIndex,
        /// Their values, one range after another.
        values: Vec<f32>,
    },
    /// A pull the lock-free check did not allow: answered now or when the policy says.
    Pull {
        /// The worker.
        worker: u32,
        /// Its clock.
        clock: u64,
        /// The driver's name for the request (echoed in the answer).
        req: u64,
    },
    /// The worker left (died or was removed): it holds nobody back.
    Leave {
        /// The worker.
        worker: u32,
    },
    /// A worker reattached (or rejoined) and says where it stands.
    Resume {
        /// The worker.
        worker: u32,
        /// Its gradients acknowledged (a rejoin: the clock it starts at).
        pushes: u64,
        /// Its transferred-task gradients acknowledged.
        helps: u64,
        /// A fresh process rejoining at the current clock, not a reconnection.
        rejoin: bool,
    },
    /// The job ended: transferred-task gradients still waiting for a step (late for the
    /// last one) are applied as a step of their own, so nothing acknowledged is lost.
    End,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Acknowledge a push on `conn`: its slot is free.
    Ack {
        /// The connection the push came on.
        conn: u64,
        /// The worker.
        worker: u32,
        /// Which push.
        of: AckOf,
        /// Its version staleness (asynchronous apply; 0 otherwise).
        staleness: u64,
    },
    /// Answer pull `req` with the current values.
    Answer {
        /// The worker.
        worker: u32,
        /// The request, as given.
        req: u64,
    },
    /// Refuse pull `req`.
    Refuse {
        /// The worker.
        worker: u32,
        /// The request.
        req: u64,
        /// Why, in words.
        reason: String,
    },
    /// Offer `helper` tasks of `straggler`'s iteration `clock` (EPSP, FlexRR).
    Offer {
        /// The worker with time to spare.
        helper: u32,
        /// The worker behind.
        straggler: u32,
        /// The straggler's iteration.
        clock: u64,
    },
    /// A reattaching worker had `updates` acknowledged updates this shard no longer has
    /// (taken after the checkpoint it restarted from).
    Lost {
        /// The worker.
        worker: u32,
        /// Updates lost.
        updates: u64,
    },
}

/// One write section over a shard's parameters: readers see all of its changes or none.
pub trait WriteSection {
    /// The values, to change in place.
    fn values(&mut self) -> &mut [f32];
    /// Worker `w`'s clock (its applied count).
    fn clock(&self, w: usize) -> u64;
    /// Sets worker `w`'s clock.
    fn set_clock(&mut self, w: usize, clock: u64);
    /// Adds one to the version.
    fn bump_version(&mut self);
    /// Sets the version (a restore).
    fn set_version(&mut self, version: u64);
}

/// Raises worker `w`'s clock to at least `clock`.
fn raise_clock(s: &mut dyn WriteSection, w: usize, clock: u64) {
    let c = s.clock(w).max(clock);
    s.set_clock(w, c);
}

/// Where a shard's parameters, version and clocks live.
pub trait ShardParams {
    /// The values.
    fn values(&self) -> &[f32];
    /// Updates applied.
    fn version(&self) -> u64;
    /// Worker `w`'s clock.
    fn clock(&self, w: usize) -> u64;
    /// Runs `f` as one write section.
    fn write(&mut self, f: &mut dyn FnMut(&mut dyn WriteSection));
}

/// Parameters in a vector (the simulator, tests).
#[derive(Clone, Debug, PartialEq)]
pub struct VecParams {
    values: Vec<f32>,
    version: u64,
    clocks: Vec<u64>,
}

impl VecParams {
    /// `len` zeros, version 0, `workers` clocks at 0.
    pub fn new(len: usize, workers: u32) -> VecParams {
        VecParams {
            values: vec![0.0; len],
            version: 0,
            clocks: vec![0; workers as usize],
        }
    }

    /// Every worker's clock.
    pub fn clocks(&self) -> &[u64] {
        &self.clocks
    }
}

impl WriteSection for VecParams {
    fn values(&mut self) -> &mut [f32] {
        &mut self.values
    }
    fn clock(&self, w: usize) -> u64 {
        self.clocks[w]
    }
    fn set_clock(&mut self, w: usize, clock: u64) {
        self.clocks[w] = clock;
    }
    fn bump_version(&mut self) {
        self.version += 1;
    }
    fn set_version(&mut self, version: u64) {
        self.version = version;
    }
}

impl ShardParams for VecParams {
    fn values(&self) -> &[f32] {
        &self.values
    }
    fn version(&self) -> u64 {
        self.version
    }
    fn clock(&self, w: usize) -> u64 {
        self.clocks[w]
    }
    fn write(&mut self, f: &mut dyn FnMut(&mut dyn WriteSection)) {
        f(self)
    }
}

/// Parameters in transport regions, as workers read them one-sided: the values, and the
/// meta block (version and clocks) whose seqlock brackets every write.
#[cfg(not(loom))]
pub struct RegionParams {
    values: falcon_transport::F32Region,
    meta: falcon_transport::Region,
    /// With 16-bit values on the wire: the values as pulls read them, refreshed inside every
    /// write section (so the seqlock covers them), and the encoding buffer.
    mirror: Option<(crate::precision::Wire, falcon_transport::Region, Vec<u8>)>,
}

#[cfg(not(loom))]
impl RegionParams {
    /// Zeroed regions for `len` floats and `workers` clocks.
    pub fn new(len: usize, workers: u32) -> Result<RegionParams> {
        Self::with_wire(len, workers, crate::precision::Wire::F32)
    }

    /// As [`RegionParams::new`], with pulls reading the values in `wire`'s precision.
    pub fn with_wire(
        len: usize,
        workers: u32,
        wire: crate::precision::Wire,
    ) -> Result<RegionParams> {
        let mirror = match wire {
            crate::precision::Wire::F32 => None,
            w => {
                let bytes = w.bytes(len as u64);
                Some((
                    w,
                    falcon_transport::Region::new(bytes)?,
                    vec![0u8; bytes as usize],
                ))
            }
        };
        Ok(RegionParams {
            values: falcon_transport::F32Region::new(len)?,
            meta: falcon_transport::Region::new(crate::meta::meta_bytes(workers))?,
            mirror,
        })
    }

    /// The values' region.
    pub fn values_region(&self) -> &falcon_transport::Region {
        self.values.region()
    }

    /// What pulls read (granted to workers; the source of answered pulls): the values, or
    /// their 16-bit mirror.
    pub fn pull_region(&self) -> &falcon_transport::Region {
        match &self.mirror {
            Some((_, r, _)) => r,
            None => self.values.region(),
        }
    }

    /// The meta block's region (granted to workers).
    pub fn meta_region(&self) -> &falcon_transport::Region {
        &self.meta
    }

    fn meta(&self) -> crate::meta::Meta<'_> {
        crate::meta::Meta::new(self.meta.padded_atomics())
    }
}

#[cfg(not(loom))]
struct RegionSection<'a, 'm> {
    meta: &'a crate::meta::Meta<'m>,
    values: &'a mut [f32],
}

#[cfg(not(loom))]
impl WriteSection for RegionSection<'_, '_> {
    fn values(&mut self) -> &mut [f32] {
        self.values
    }
    fn clock(&self, w: usize) -> u64 {
        self.meta.clock(w)
    }
    fn set_clock(&mut self, w: usize, clock: u64) {
        self.meta.set_clock(w, clock);
    }
    fn bump_version(&mut self) {
        self.meta.bump_version();
    }
    fn set_version(&mut self, version: u64) {
        self.meta.set_version(version);
    }
}

#[cfg(not(loom))]
impl ShardParams for RegionParams {
    fn values(&self) -> &[f32] {
        self.values.values()
    }
    fn version(&self) -> u64 {
        self.meta().version()
    }
    fn clock(&self, w: usize) -> u64 {
        self.meta().clock(w)
    }
    fn write(&mut self, f: &mut dyn FnMut(&mut dyn WriteSection)) {
        let meta = crate::meta::Meta::new(self.meta.padded_atomics());
        let values = self.values.values_mut();
        let mirror = &mut self.mirror;
        meta.write(|m| {
            f(&mut RegionSection { meta: m, values });
            if let Some((wire, region, buf)) = mirror.as_mut() {
                wire.encode(values, buf);
                // In bounds: the mirror was made for these values.
                let _ = region.write_at(0, buf);
            }
        });
    }
}

/// What the policies of a server did to one worker (summed over shards by the server).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerCounters {
    /// Its pulls that were parked ("delayed").
    pub parked_pulls: u64,
    /// Its gradients dropped (Sync-opt: late).
    pub dropped_gradients: u64,
    /// Its late gradients added to a later step (`syncopt(…,fold)`).
    pub folded_gradients: u64,
    /// Extra iterations granted to it (DSSP).
    pub grants: u64,
    /// Task transfers offered to it as the helper (EPSP, FlexRR).
    pub transfers_offered: u64,
    /// Gradients of transferred tasks it pushed as the helper (one per shard).
    pub help_pushes: u64,
    /// The version staleness of its asynchronously applied gradients: staleness → count.
    pub staleness: BTreeMap<u64, u64>,
}

/// What one shard did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShardStats {
    /// Gradients received of the workers' own iterations (repeats not counted).
    pub gradients: u64,
    /// Updates applied to the parameters.
    pub updates: u64,
    /// Pushes received again (retries) and not applied again.
    pub duplicate_pushes: u64,
    /// Gradient bytes received.
    pub bytes_in: u64,
    /// Parameter bytes sent in answer to pulls.
    pub bytes_out: u64,
    /// Pulls answered by the shard.
    pub answered_pulls: u64,
    /// Synchronous mode: the most gradient bytes held waiting for their step.
    pub peak_pending_bytes: u64,
    /// Synchronous mode: acknowledgements held back over the memory cap.
    pub held_acks: u64,
    /// Sum of the version staleness of asynchronously applied gradients.
    pub staleness_sum: u64,
    /// The largest such staleness.
    pub staleness_max: u64,
    /// Synchronous mode: transferred-task gradients that arrived after their step was
    /// applied, and joined the next one.
    pub late_helps: u64,
    /// Per worker.
    pub per_worker: Vec<WorkerCounters>,
}

/// A gradient as it arrived: the connection, the worker, its sequence number, the version it
/// was computed on, and the values.
struct Arrival<'a> {
    conn: u64,
    worker: u32,
    seq: u64,
    computed_on: Option<u64>,
    /// The whole gradient, or with `ranges` the values of those ranges alone.
    grad: Grad<'a>,
    ranges: Option<crate::rows::RowIndex>,
}

impl<'a> Arrival<'a> {
    /// A whole-shard gradient.
    fn whole(conn: u64, worker: u32, seq: u64, computed_on: Option<u64>, grad: Grad<'a>) -> Self {
        Arrival {
            conn,
            worker,
            seq,
            computed_on,
            grad,
            ranges: None,
        }
    }

    /// The whole gradient of a shard of `len` floats (repeated ranges summed in order).
    fn dense(self, len: usize) -> Vec<f32> {
        let Some(ranges) = self.ranges else {
            return self.grad.into_vec();
        };
        crate::rows::widen(len, &ranges, &self.grad.into_vec())
    }
}

/// A worker's late gradients folded for the next step applied.
#[derive(Clone, Debug, PartialEq)]
struct Folded {
    /// `Σ weight · gradient`.
    sum: Vec<f32>,
    /// How many.
    count: u32,
    /// `Σ weight`.
    weight: f32,
}

/// One shard's state machine (see the [module documentation](self)).
pub struct ShardCore {
    cfg: ShardConfig,
    opt: ShardOptimizer,
    scale: Arc<dyn GradientScale>,
    policy: Box<dyn SyncPolicy>,
    /// Per worker, gradients received (the last applied sequence number; the next push's
    /// clock).
    pushes: Vec<u64>,
    /// Synchronous mode: gradients waiting for their step, by step, by worker. An empty one
    /// holds a place lost (a restarted server's, or a rejoining worker's): it counts toward
    /// the quorum and adds nothing.
    pending: BTreeMap<u64, Vec<Option<Vec<f32>>>>,
    /// Synchronous mode: per step waiting, how many of its places are held (the quorum check
    /// without a pass over the workers at every push).
    held_places: BTreeMap<u64, usize>,
    /// Synchronous mode: transferred tasks' gradients waiting for their step, summed.
    help_pending: BTreeMap<u64, Vec<f32>>,
    /// Synchronous mode: gradients that arrived after their step was applied, for the next
    /// step applied (policies that fold: `syncopt(…,fold)`), per worker: their weighed sum,
    /// how many, and the sum of their weights. A worker's folded gradients are at most one
    /// contributor of that step (their mean), so a backup that runs on while no step is made
    /// (the others finished) holds one buffer, not one per gradient, and its work does not
    /// outweigh a step's.
    folded: BTreeMap<u32, Folded>,
    /// Bytes of the buffers in `folded`: at most one shard per worker, so they are left out
    /// of the cap on `pending_bytes` (a backup folding while no step is made, the others
    /// finished, must not have its acknowledgements held for ever).
    folded_bytes: u64,
    /// Bytes of the gradients in `pending`.
    pending_bytes: u64,
    /// The push clock of a gradient the policy counted for a later step (Sync-opt), by
    /// (step, worker): applying the step moves that worker's clock to its own push.
    counted_for: HashMap<(u64, u32), u64>,
    next_apply: u64,
    initialized: bool,
    /// Per worker, the version of the values last sent to it by an answered pull.
    sent_version: Vec<u64>,
    /// Per worker, transferred-task gradients applied (the last sequence number).
    helps: Vec<u64>,
    /// Per worker, sequence numbers passed over without a gradient: a rejoining worker's jump
    /// to the current clock, and updates lost with a previous incarnation of the server.
    /// Every number up to `pushes[w]` was applied once or passed over once.
    skipped: Vec<u64>,
    /// Acknowledgements not sent yet, in arrival order, each with whether it was held back
    /// past the event that made it (`pending` over the cap).
    held: VecDeque<(u64, u32, AckOf, bool)>,
    /// Per worker: left the job (and not rejoined).
    left: Vec<bool>,
    /// Workers that have not left.
    live: u32,
    /// The policy's actions not yet carried out.
    actions: Vec<Action>,
    stats: ShardStats,
}

impl std::fmt::Debug for ShardCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardCore")
            .field("cfg", &self.cfg)
            .field("policy", &self.policy)
            .field("pushes", &self.pushes)
            .field("next_apply", &self.next_apply)
            .finish_non_exhaustive()
    }
}

impl ShardCore {
    /// A shard with `policy` and optimizer `opt`; asynchronous gradients are scaled by
    /// `scale` of their staleness.
    pub fn new(
        cfg: ShardConfig,
        policy: Box<dyn SyncPolicy>,
        opt: ShardOptimizer,
        scale: Arc<dyn GradientScale>,
    ) -> ShardCore {
        let n = cfg.workers as usize;
        let opt = opt.for_mode(cfg.mode);
        ShardCore {
            cfg,
            opt,
            scale,
            policy,
            pushes: vec![0; n],
            pending: BTreeMap::new(),
            held_places: BTreeMap::new(),
            help_pending: BTreeMap::new(),
            folded: BTreeMap::new(),
            folded_bytes: 0,
            pending_bytes: 0,
            counted_for: HashMap::new(),
            next_apply: 0,
            initialized: false,
            sent_version: vec![0; n],
            helps: vec![0; n],
            skipped: vec![0; n],
            held: VecDeque::new(),
            left: vec![false; n],
            live: n as u32,
            actions: Vec::new(),
            stats: ShardStats {
                per_worker: vec![WorkerCounters::default(); n],
                ..ShardStats::default()
            },
        }
    }

    /// The shard's configuration.
    pub fn config(&self) -> &ShardConfig {
        &self.cfg
    }

    /// The shard's policy.
    pub fn policy(&self) -> &dyn SyncPolicy {
        &*self.policy
    }

    /// What the shard did so far.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// Worker `w`'s gradients received (its next push's clock).
    pub fn pushes(&self, w: u32) -> u64 {
        self.pushes.get(w as usize).copied().unwrap_or(0)
    }

    /// Sums over workers of gradients received, sequence numbers passed over, and
    /// transferred-task gradients applied: what an outside check of exactly-once needs.
    pub fn account(&self) -> (u64, u64, u64) {
        (
            self.pushes.iter().sum(),
            self.skipped.iter().sum(),
            self.helps.iter().sum(),
        )
    }

    /// Where a (re)attaching worker `w` starts: the slowest other live worker's count, or its
    /// own if that is further.
    pub fn start_clock(&self, w: u32) -> u64 {
        (0..self.pushes.len())
            .filter(|&x| x != w as usize && !self.left[x])
            .map(|x| self.pushes[x])
            .min()
            .unwrap_or(0)
            .max(self.pushes(w))
    }

    /// The rates the updates that follow take (a push's, given with it: the driver sets them
    /// right before feeding the push; under synchronous updates a step takes those of the
    /// push that completes it).
    pub fn set_rates(&mut self, rates: crate::update::Rates) {
        self.opt.set_rates(rates);
    }

    /// Feeds one input at time `now` (nanoseconds on the driver's clock); what the driver
    /// must do comes out through `out`, in order. Refused (with nothing changed) when the
    /// worker is not one of the shard's or a buffer has the wrong length.
    pub fn handle<P: ShardParams + ?Sized>(
        &mut self,
        now: u64,
        input: Input<'_>,
        params: &mut P,
        out: &mut dyn FnMut(Output),
    ) -> Result<()> {
        self.check(&input)?;
        match input {
            Input::Init {
                conn,
                worker,
                values,
            } => {
                if !self.initialized {
                    params.write(&mut |s| s.values().copy_from_slice(&values));
                    self.initialized = true;
                }
                out(Output::Ack {
                    conn,
                    worker,
                    of: AckOf::Init,
                    staleness: 0,
                });
            }
            Input::Push {
                conn,
                worker,
                seq,
                computed_on,
                grad,
            } => {
                let a = Arrival::whole(conn, worker, seq, computed_on, grad);
                self.push(now, a, params, out)
            }
            Input::Help {
                conn,
                worker,
                seq,
                computed_on,
                grad,
                help_for,
            } => {
                let a = Arrival::whole(conn, worker, seq, computed_on, grad.into());
                self.help(a, help_for, params, out)
            }
            Input::PushRows {
                conn,
                worker,
                seq,
                computed_on,
                ranges,
                values,
            } => {
                let a = Arrival {
                    conn,
                    worker,
                    seq,
                    computed_on,
                    grad: values.into(),
                    ranges: Some(ranges),
                };
                self.push(now, a, params, out)
            }
            Input::Pull { worker, clock, req } => {
                let pushed = self.pushes[worker as usize];
                if clock > pushed {
                    out(Output::Refuse {
                        worker,
                        req,
                        reason: format!(
                            "clock {clock} is from the future: worker {worker} has pushed {pushed} gradients to shard {}",
                            self.cfg.id
                        ),
                    });
                } else {
                    let ev = Event::Pull {
                        worker,
                        clock,
                        req,
                        at: now,
                    };
                    self.policy.on_event(ev, &mut self.actions);
                }
            }
            Input::Leave { worker } => {
                if !self.left[worker as usize] {
                    self.left[worker as usize] = true;
                    self.live -= 1;
                    let ev = Event::Leave { worker, at: now };
                    self.policy.on_event(ev, &mut self.actions);
                    // Its missing gradients no longer hold a synchronous step back.
                    if self.cfg.mode == UpdateMode::Sync {
                        self.apply_ready(now, params);
                    }
                }
            }
            Input::End => self.end(params),
            Input::Resume {
                worker,
                pushes,
                helps,
                rejoin,
            } => {
                let lost = self.resume(now, worker, pushes, helps, rejoin, params);
                if lost > 0 {
                    out(Output::Lost {
                        worker,
                        updates: lost,
                    });
                }
            }
        }
        self.carry_out(params, out);
        self.release_held(out);
        Ok(())
    }

    fn check(&self, input: &Input<'_>) -> Result<()> {
        let (worker, len) = match input {
            Input::Init { worker, values, .. } => (*worker, Some(values.len())),
            Input::Push { worker, grad, .. } => (*worker, Some(grad.len())),
            Input::Help { worker, grad, .. } => (*worker, Some(grad.len())),
            Input::PushRows {
                worker,
                ranges,
                values,
                ..
            } => {
                if ranges.reach() > self.cfg.len as u64 {
                    return Err(Error::Malformed(format!(
                        "rows up to float {} outside shard {} of {} floats",
                        ranges.reach(),
                        self.cfg.id,
                        self.cfg.len
                    )));
                }
                let total = ranges.floats();
                if total != values.len() as u64 {
                    return Err(Error::WrongLength {
                        tensor: format!("shard {} rows", self.cfg.id),
                        expected: total,
                        got: values.len() as u64,
                    });
                }
                (*worker, None)
            }
            Input::Pull { worker, .. } | Input::Leave { worker } | Input::Resume { worker, .. } => {
                (*worker, None)
            }
            Input::End => return Ok(()),
        };
        if worker >= self.cfg.workers {
            return Err(Error::Malformed(format!(
                "worker {worker} on shard {} of a job of {} workers",
                self.cfg.id, self.cfg.workers
            )));
        }
        match len {
            Some(got) if got != self.cfg.len => Err(Error::WrongLength {
                tensor: format!("shard {}", self.cfg.id),
                expected: self.cfg.len as u64,
                got: got as u64,
            }),
            _ => Ok(()),
        }
    }

    /// Exactly once: true when `seq` is the next after `done`; a repeat is acknowledged
    /// again (with `of`), a gap ignored.
    fn fresh(
        &mut self,
        (conn, worker): (u64, u32),
        seq: u64,
        done: u64,
        of: AckOf,
        out: &mut dyn FnMut(Output),
    ) -> bool {
        if seq == done + 1 {
            return true;
        }
        if seq <= done && seq > 0 {
            self.stats.duplicate_pushes += 1;
            out(Output::Ack {
                conn,
                worker,
                of,
                staleness: 0,
            });
        } else {
            tracing::warn!(
                "worker {worker} pushed sequence {seq} to shard {} after {done}; ignored",
                self.cfg.id
            );
        }
        false
    }

    fn push<P: ShardParams + ?Sized>(
        &mut self,
        now: u64,
        a: Arrival<'_>,
        params: &mut P,
        out: &mut dyn FnMut(Output),
    ) {
        let (conn, w, seq) = (a.conn, a.worker, a.seq);
        let wi = w as usize;
        self.stats.bytes_in += a.grad.len() as u64 * 4;
        let clock = self.pushes[wi];
        if !self.fresh(
            (conn, w),
            seq,
            clock,
            AckOf::Push {
                clock: seq.wrapping_sub(1),
            },
            out,
        ) {
            return;
        }
        self.pushes[wi] += 1;
        self.stats.gradients += 1;
        match self.cfg.mode {
            UpdateMode::Async => {
                let of = AckOf::Push { clock };
                let d = self.apply_async(a, of, Some(clock), params, out);
                self.stats.staleness_sum += d;
                self.stats.staleness_max = self.stats.staleness_max.max(d);
                *self.stats.per_worker[wi].staleness.entry(d).or_default() += 1;
                let ev = Event::Push {
                    worker: w,
                    clock,
                    at: now,
                };
                self.policy.on_event(ev, &mut self.actions);
            }
            UpdateMode::Sync => {
                let base = a.computed_on.unwrap_or(self.sent_version[wi]);
                let grad = a.dense(self.cfg.len);
                self.push_sync(now, conn, w, clock, (grad, base), params)
            }
        }
    }

    /// Synchronous mode: the gradient waits for its step; its acknowledgement is held until
    /// the waiting gradients are within the cap.
    fn push_sync<P: ShardParams + ?Sized>(
        &mut self,
        now: u64,
        conn: u64,
        w: u32,
        clock: u64,
        (grad, base): (Vec<f32>, u64),
        params: &mut P,
    ) {
        let wi = w as usize;
        let (mut counts, step, fold) = self.judge(now, w, clock);
        if counts && step < self.next_apply {
            // A step already applied (the policy and the shard disagree after a
            // placeholder): never applied, so never held.
            tracing::warn!(
                "shard {}: worker {w}'s gradient of clock {clock} counted for step {step}, already applied; dropped",
                self.cfg.id
            );
            counts = false;
            self.stats.per_worker[wi].dropped_gradients += 1;
        }
        if counts {
            if step != clock {
                self.counted_for.insert((step, w), clock);
            }
            self.hold_gradient(step, wi, grad);
        } else if fold {
            // Late: part of the next step applied (not toward its quorum).
            let stale = params.version().saturating_sub(base);
            self.fold(w, grad, stale);
        }
        self.held.push_back((conn, w, AckOf::Push { clock }, false));
        if !counts {
            // Dropped or folded: the shard is done with this worker's gradient as a part of
            // its own step, and so is the policy
            // (one that judged the arrival saw it already): the worker's clock moves past it
            // in both, or a worker whose step fell without it (a rejoin racing the others'
            // pushes) would wait for a step that never comes.
            params.write(&mut |s| raise_clock(s, wi, clock + 1));
            if !self.policy.judges_arrivals() {
                let ev = Event::Push {
                    worker: w,
                    clock,
                    at: now,
                };
                self.policy.on_event(ev, &mut self.actions);
            }
        }
        self.apply_ready(now, params);
    }

    /// A policy that judges arrivals (Sync-opt) says whether worker `w`'s gradient of `clock`
    /// counts, for which step, and, when it does not, whether it is folded into the next step
    /// applied.
    fn judge(&mut self, now: u64, w: u32, clock: u64) -> (bool, u64, bool) {
        if !self.policy.judges_arrivals() {
            return (true, clock, false);
        }
        let (mut counts, mut step, mut fold) = (true, clock, false);
        let mut judged = Vec::new();
        let ev = Event::Push {
            worker: w,
            clock,
            at: now,
        };
        self.policy.on_event(ev, &mut judged);
        for a in judged {
            match a {
                Action::DropGradient { worker, clock: c } if worker == w && c == clock => {
                    counts = false;
                    self.stats.per_worker[w as usize].dropped_gradients += 1;
                }
                Action::Fold { worker, clock: c } if worker == w && c == clock => {
                    counts = false;
                    fold = true;
                }
                Action::CountFor {
                    worker,
                    clock: c,
                    step: s,
                } if worker == w && c == clock => step = s,
                other => self.actions.push(other),
            }
        }
        (counts, step, fold)
    }

    /// Adds worker `w`'s late gradient to what it folded for the next step applied.
    ///
    /// It is weighed `1 / (1 + stale)`, `stale` being the steps applied since the values it was
    /// computed on, as DynSGD weighs a stale gradient; under a mean the weight counts in the
    /// divisor too, so a step's size does not shrink for what it folds in (a weighted mean).
    fn fold(&mut self, w: u32, grad: Vec<f32>, stale: u64) {
        let mut grad = grad;
        let weight = 1.0 / (1 + stale.min(1 << 20)) as f32;
        if stale > 0 {
            crate::update::scale_in_place(&mut grad, weight);
        }
        match self.folded.get_mut(&w) {
            Some(f) => {
                for (s, g) in f.sum.iter_mut().zip(&grad) {
                    *s += g;
                }
                f.count += 1;
                f.weight += weight;
            }
            None => {
                self.folded_bytes += self.cfg.len as u64 * 4;
                let f = Folded {
                    sum: grad,
                    count: 1,
                    weight,
                };
                self.folded.insert(w, f);
            }
        }
        self.stats.per_worker[w as usize].folded_gradients += 1;
        self.stats.peak_pending_bytes = self
            .stats
            .peak_pending_bytes
            .max(self.pending_bytes + self.folded_bytes);
    }

    /// Aggregates a step's own gradients `own` into `out` with what was folded for it (taken):
    /// the own ones in rank order, then each folding worker's, in a weighted mean under a mean
    /// (divided by at least one contributor, so folded gradients alone keep their weights).
    /// Returns the step's contributors, by weight. Without folded gradients it is exactly
    /// [`aggregate`].
    fn aggregate_with_folded<'a>(
        &mut self,
        out: &mut [f32],
        own: impl Iterator<Item = &'a [f32]> + Clone,
    ) -> f32 {
        let n = own.clone().count();
        if self.folded.is_empty() {
            aggregate(out, own, self.cfg.aggregate);
            return n.max(1) as f32;
        }
        let (folded, weight) = self.take_folded();
        // The own gradients' borrow shortened to the folded ones'.
        let own = own.map(|g| -> &[f32] { g });
        aggregate(
            out,
            own.chain(folded.iter().map(Vec::as_slice)),
            Aggregate::Sum,
        );
        let contributors = (n as f32 + weight).max(1.0);
        if self.cfg.aggregate == Aggregate::Mean && contributors != 1.0 {
            crate::update::scale_in_place(out, 1.0 / contributors);
        }
        contributors
    }

    /// What was folded for this step, taken: each worker's weighed mean, in rank order, and
    /// the sum of their weights (each worker's mean weight: at most 1).
    fn take_folded(&mut self) -> (Vec<Vec<f32>>, f32) {
        let folded = std::mem::take(&mut self.folded);
        self.folded_bytes = 0;
        let mut weight = 0.0;
        let means = folded
            .into_values()
            .map(|mut f| {
                let n = f.count.max(1) as f32;
                if f.count > 1 {
                    crate::update::scale_in_place(&mut f.sum, 1.0 / n);
                }
                weight += f.weight / n;
                f.sum
            })
            .collect();
        (means, weight)
    }

    fn hold_gradient(&mut self, step: u64, w: usize, grad: Vec<f32>) {
        let workers = self.cfg.workers as usize;
        self.pending_bytes += grad.len() as u64 * 4;
        let slot = &mut self
            .pending
            .entry(step)
            .or_insert_with(|| vec![None; workers])[w];
        if let Some(old) = slot.replace(grad) {
            self.pending_bytes -= old.len() as u64 * 4;
        } else {
            *self.held_places.entry(step).or_insert(0) += 1;
        }
        self.stats.peak_pending_bytes = self.stats.peak_pending_bytes.max(self.pending_bytes);
    }

    fn help<P: ShardParams + ?Sized>(
        &mut self,
        a: Arrival<'_>,
        help_for: Option<(u32, u64)>,
        params: &mut P,
        out: &mut dyn FnMut(Output),
    ) {
        let (conn, w, seq) = (a.conn, a.worker, a.seq);
        let wi = w as usize;
        self.stats.bytes_in += self.cfg.len as u64 * 4;
        if !self.fresh((conn, w), seq, self.helps[wi], AckOf::Help, out) {
            return;
        }
        self.helps[wi] = seq;
        if self.cfg.mode == UpdateMode::Sync
            && let Some((_, step)) = help_for
        {
            // Part of the straggler's iteration: it joins that step (summed with the
            // straggler's own gradient when the step is applied). Late — the straggler's own
            // push completed the step first — it joins the next step to be applied: one
            // step stale, but never an optimizer step of its own. Applied alone, it would be
            // one more step than BSP makes, which under momentum moves the values by the
            // whole velocity again (enforced EPSP over the transport ended 2.4 points below
            // BSP that way, with 16 workers).
            if step < self.next_apply {
                self.stats.late_helps += 1;
            }
            let step = step.max(self.next_apply);
            let sum = self.help_pending.entry(step).or_insert_with(|| {
                self.pending_bytes += self.cfg.len as u64 * 4;
                vec![0.0; self.cfg.len]
            });
            for (s, g) in sum.iter_mut().zip(a.grad.into_vec()) {
                *s += g;
            }
            self.stats.peak_pending_bytes = self.stats.peak_pending_bytes.max(self.pending_bytes);
            self.stats.per_worker[wi].help_pushes += 1;
            out(Output::Ack {
                conn,
                worker: w,
                of: AckOf::Help,
                staleness: 0,
            });
            return;
        }
        // Tasks taken from another worker, computed on this worker's values: applied like an
        // asynchronous gradient; the pusher's clock does not move and the policy sees no push
        // (the straggler's own push completes its iteration).
        self.apply_async(a, AckOf::Help, None, params, out);
        self.stats.per_worker[wi].help_pushes += 1;
    }

    /// Applies worker `w`'s gradient at once, scaled by its version staleness, and
    /// acknowledges it: first, or after the apply for a gradient read from its slot (the
    /// acknowledgement frees the slot); with `clock`, the worker's applied count becomes
    /// `clock + 1`. Returns the staleness.
    fn apply_async<P: ShardParams + ?Sized>(
        &mut self,
        a: Arrival<'_>,
        of: AckOf,
        clock: Option<u64>,
        params: &mut P,
        out: &mut dyn FnMut(Output),
    ) -> u64 {
        let Arrival {
            conn,
            worker: w,
            computed_on,
            grad,
            ranges,
            ..
        } = a;
        let base = computed_on.unwrap_or(self.sent_version[w as usize]);
        let d = params.version().saturating_sub(base);
        let factor = self.scale.scale(d);
        let ack = Output::Ack {
            conn,
            worker: w,
            of,
            staleness: d,
        };
        let opt = &mut self.opt;
        let mut apply = |apply: &mut dyn FnMut(&mut ShardOptimizer, &mut [f32])| {
            params.write(&mut |s| {
                apply(opt, s.values());
                if let Some(c) = clock {
                    s.set_clock(w as usize, c + 1);
                }
                s.bump_version();
            });
        };
        match (grad, &ranges) {
            // Read where it lies while it is applied; the slot is free once acknowledged.
            (Grad::Slot(slot), None) => {
                apply(&mut |opt, v| opt.apply_blocks(v, factor, |at, b| slot.read(at, b)));
                out(ack);
            }
            (grad, ranges) => {
                let mut g = grad.into_vec();
                if factor != 1.0 {
                    crate::update::scale_in_place(&mut g, factor);
                }
                out(ack);
                apply(&mut |opt, v| match ranges {
                    Some(r) => opt.apply_ranges(v, r, &g),
                    None => opt.apply(v, &g),
                });
            }
        }
        self.stats.updates += 1;
        d
    }

    /// Adds a step's transferred-task sum `help`, taken out of `help_pending`, into `sum`:
    /// divided by the step's `contributors` under a mean, as their own gradients are.
    fn add_help(&mut self, sum: &mut [f32], help: &[f32], contributors: f32) {
        self.pending_bytes -= help.len() as u64 * 4;
        let k = match self.cfg.aggregate {
            Aggregate::Mean => 1.0 / contributors,
            _ => 1.0,
        };
        for (s, h) in sum.iter_mut().zip(help) {
            *s += k * h;
        }
    }

    /// The job ended: what waits in `help_pending` is applied as one step (a mean over the
    /// live workers, as a step's own gradients would be).
    fn end<P: ShardParams + ?Sized>(&mut self, params: &mut P) {
        if self.help_pending.is_empty() && self.folded.is_empty() {
            return;
        }
        let live = self.live.max(1) as f32;
        let mut sum = vec![0f32; self.cfg.len];
        for (_, help) in std::mem::take(&mut self.help_pending) {
            self.add_help(&mut sum, &help, live);
        }
        // Folded gradients: a step of their own, keeping their weights.
        if !self.folded.is_empty() {
            let mut mean = vec![0f32; self.cfg.len];
            self.aggregate_with_folded(&mut mean, std::iter::empty());
            for (s, m) in sum.iter_mut().zip(mean) {
                *s += m;
            }
        }
        let opt = &mut self.opt;
        params.write(&mut |s| {
            opt.apply(s.values(), &sum);
            s.bump_version();
        });
        self.stats.updates += 1;
    }

    /// Synchronous mode: applies every step that has its quorum of gradients (every live
    /// worker's, or what the policy asks for), in order, summing the present ones in rank
    /// order.
    fn apply_ready<P: ShardParams + ?Sized>(&mut self, now: u64, params: &mut P) {
        let quorum = self.policy.step_quorum(self.live).max(1) as usize;
        while let Some(&held) = self.held_places.get(&self.next_apply) {
            if held < quorum {
                break;
            }
            let step = self.next_apply;
            self.held_places.remove(&step);
            let grads = self.pending.remove(&step).unwrap_or_default();
            let bytes: u64 = grads.iter().flatten().map(|g| g.len() as u64 * 4).sum();
            self.pending_bytes -= bytes;
            let mut sum = vec![0f32; self.cfg.len];
            let own = grads.iter().flatten().filter(|g| !g.is_empty());
            let contributors = self.aggregate_with_folded(&mut sum, own.map(Vec::as_slice));
            // Transferred tasks are part of their straggler's gradient: summed into it (a mean
            // divides them by the contributors, as the straggler's own).
            if let Some(help) = self.help_pending.remove(&step) {
                self.add_help(&mut sum, &help, contributors);
            }
            // Each contributor's clock moves past its own push (the step, unless the policy
            // counted the gradient for a later step than its push).
            let pushed: Vec<Option<u64>> = (0..grads.len())
                .map(|w| {
                    let own = self.counted_for.remove(&(step, w as u32));
                    grads[w].as_ref().map(|_| own.unwrap_or(step))
                })
                .collect();
            let opt = &mut self.opt;
            params.write(&mut |s| {
                opt.apply(s.values(), &sum);
                for (w, p) in pushed.iter().enumerate() {
                    if let Some(p) = p {
                        raise_clock(s, w, p + 1);
                    }
                }
                s.bump_version();
            });
            self.stats.updates += 1;
            self.next_apply += 1;
            if !self.policy.judges_arrivals() {
                for (w, p) in pushed.iter().enumerate() {
                    if p.is_some() {
                        let ev = Event::Push {
                            worker: w as u32,
                            clock: step,
                            at: now,
                        };
                        self.policy.on_event(ev, &mut self.actions);
                    }
                }
            }
        }
    }

    /// Carries out the policy's actions.
    fn carry_out<P: ShardParams + ?Sized>(&mut self, params: &P, out: &mut dyn FnMut(Output)) {
        for a in std::mem::take(&mut self.actions) {
            match a {
                Action::Transfer {
                    helper,
                    straggler,
                    clock,
                } => out(Output::Offer {
                    helper,
                    straggler,
                    clock,
                }),
                Action::Park { worker, .. } => {
                    if let Some(c) = self.stats.per_worker.get_mut(worker as usize) {
                        c.parked_pulls += 1;
                    }
                }
                Action::Release { worker, req } => {
                    self.stats.answered_pulls += 1;
                    self.stats.bytes_out += self.cfg.len as u64 * 4;
                    if let Some(v) = self.sent_version.get_mut(worker as usize) {
                        *v = params.version();
                    }
                    out(Output::Answer { worker, req });
                }
                _ => {}
            }
        }
    }

    /// Sends the held acknowledgements once the waiting gradients are within the cap.
    fn release_held(&mut self, out: &mut dyn FnMut(Output)) {
        if self.pending_bytes > self.cfg.max_pending_bytes {
            for (_, _, _, waited) in self.held.iter_mut().filter(|h| !h.3) {
                *waited = true;
                self.stats.held_acks += 1;
            }
            return;
        }
        while let Some((conn, worker, of, _)) = self.held.pop_front() {
            out(Output::Ack {
                conn,
                worker,
                of,
                staleness: 0,
            });
        }
    }

    /// A worker reattached (or rejoined): counts it had acknowledged beyond the shard's are
    /// taken as applied and lost (a reattach), or skipped (a rejoin). Returns the updates lost.
    fn resume<P: ShardParams + ?Sized>(
        &mut self,
        now: u64,
        w: u32,
        pushes: u64,
        helps: u64,
        rejoin: bool,
        params: &mut P,
    ) -> u64 {
        let wi = w as usize;
        if rejoin && std::mem::replace(&mut self.left[wi], false) {
            self.live += 1;
        }
        let mut lost = 0;
        let from = self.pushes[wi];
        if pushes > from {
            if !rejoin {
                lost += pushes - from;
            }
            self.skipped[wi] += pushes - from;
            self.pushes[wi] = pushes;
            if self.cfg.mode == UpdateMode::Sync {
                // Its places in the steps still to apply are held, empty.
                for c in from.max(self.next_apply)..pushes {
                    self.hold_gradient(c, wi, Vec::new());
                }
            }
        }
        if rejoin {
            // A fresh process numbers its transferred-task pushes from 1 again.
            self.helps[wi] = helps;
        } else if helps > self.helps[wi] {
            lost += helps - self.helps[wi];
            self.helps[wi] = helps;
        }
        if !rejoin && pushes <= from {
            // A reconnection the shard lost nothing of: its standing is unchanged.
            return lost;
        }
        let clock = match self.cfg.mode {
            UpdateMode::Async => self.pushes[wi],
            UpdateMode::Sync => self.pushes[wi].min(self.next_apply),
        };
        params.write(&mut |s| raise_clock(s, wi, clock));
        let ev = Event::Join {
            worker: w,
            clock,
            at: now,
        };
        self.policy.on_event(ev, &mut self.actions);
        if self.cfg.mode == UpdateMode::Sync {
            self.apply_ready(now, params);
            // A policy that counts each step's gradients itself (Sync-opt) counts the places
            // too, or it would wait for gradients that were lost, and the pulls it parked with
            // it.
            if pushes > from && self.policy.judges_arrivals() {
                let waiting = self.waiting();
                self.policy
                    .restored(self.next_apply, &waiting, &mut self.actions);
            }
        }
        lost
    }

    /// The shard's state for a checkpoint.
    pub fn state<P: ShardParams + ?Sized>(&self, params: &P) -> ShardState {
        let (m, v, step) = self.opt.state();
        ShardState {
            id: self.cfg.id,
            params: params.values().to_vec(),
            version: params.version(),
            clocks: (0..self.cfg.workers as usize)
                .map(|w| params.clock(w))
                .collect(),
            pushes: self.pushes.clone(),
            helps: self.helps.clone(),
            skipped: self.skipped.clone(),
            sent_version: self.sent_version.clone(),
            next_apply: self.next_apply,
            pending: self.pending.iter().map(|(c, g)| (*c, g.clone())).collect(),
            help_pending: self
                .help_pending
                .iter()
                .map(|(c, g)| (*c, g.clone()))
                .collect(),
            folded: self
                .folded
                .iter()
                .map(|(&w, f)| (w, f.sum.clone(), f.count, f.weight))
                .collect(),
            initialized: self.initialized,
            opt_m: m.to_vec(),
            opt_v: v.to_vec(),
            opt_step: step,
        }
    }

    /// Puts a checkpointed state back into a fresh shard: values, version, clocks, counters
    /// and optimizer state; the policy learns every worker's applied count. Refused, with
    /// nothing changed, when the state is not of this shard.
    pub fn restore<P: ShardParams + ?Sized>(
        &mut self,
        st: &ShardState,
        params: &mut P,
    ) -> std::result::Result<(), String> {
        let n = self.cfg.workers as usize;
        if st.id != self.cfg.id || st.params.len() != self.cfg.len {
            return Err(format!(
                "shard {} of {} floats saved where shard {} of {} is",
                st.id,
                st.params.len(),
                self.cfg.id,
                self.cfg.len
            ));
        }
        let per_worker = [
            &st.clocks,
            &st.pushes,
            &st.helps,
            &st.skipped,
            &st.sent_version,
        ];
        if per_worker.iter().any(|v| v.len() != n)
            || st.pending.iter().any(|(_, g)| g.len() != n)
            || st
                .pending
                .iter()
                .flat_map(|(_, g)| g.iter().flatten())
                .any(|g| !g.is_empty() && g.len() != self.cfg.len)
            || st.help_pending.iter().any(|(_, g)| g.len() != self.cfg.len)
            || st.folded.iter().any(|(w, g, count, k)| {
                *w as usize >= n
                    || g.len() != self.cfg.len
                    || *count == 0
                    || !(k.is_finite() && *k > 0.0 && *k <= *count as f32)
            })
            || st.folded.windows(2).any(|p| p[0].0 >= p[1].0)
        {
            return Err(format!(
                "shard {}: the saved state is not of {n} workers and {} floats",
                st.id, self.cfg.len
            ));
        }
        self.opt.restore(&st.opt_m, &st.opt_v, st.opt_step)?;
        params.write(&mut |s| {
            s.values().copy_from_slice(&st.params);
            for (w, &clock) in st.clocks.iter().enumerate() {
                s.set_clock(w, clock);
            }
            s.set_version(st.version);
        });
        self.pushes.clone_from(&st.pushes);
        self.helps.clone_from(&st.helps);
        self.skipped.clone_from(&st.skipped);
        self.sent_version.clone_from(&st.sent_version);
        self.next_apply = st.next_apply;
        self.pending = st.pending.iter().cloned().collect();
        self.held_places = self
            .pending
            .iter()
            .map(|(&step, g)| (step, g.iter().filter(|x| x.is_some()).count()))
            .collect();
        self.help_pending = st.help_pending.iter().cloned().collect();
        self.folded = st
            .folded
            .iter()
            .map(|(w, g, n, k)| {
                let f = Folded {
                    sum: g.clone(),
                    count: *n,
                    weight: *k,
                };
                (*w, f)
            })
            .collect();
        self.pending_bytes = self
            .pending
            .values()
            .flatten()
            .flatten()
            .map(|g| g.len() as u64 * 4)
            .sum::<u64>()
            + self.help_pending.len() as u64 * self.cfg.len as u64 * 4;
        self.folded_bytes = self.folded.len() as u64 * self.cfg.len as u64 * 4;
        self.initialized = st.initialized;
        let mut ignored = Vec::new();
        for (w, &clock) in st.clocks.iter().enumerate() {
            let ev = Event::Join {
                worker: w as u32,
                clock,
                at: 0,
            };
            self.policy.on_event(ev, &mut ignored);
        }
        let waiting = self.waiting();
        // Nothing is parked yet in a fresh shard: no action can come of it.
        self.policy
            .restored(self.next_apply, &waiting, &mut ignored);
        Ok(())
    }

    /// The steps waiting, each with the workers whose gradients (or places) it holds.
    fn waiting(&self) -> Vec<(u64, Vec<u32>)> {
        self.pending
            .iter()
            .map(|(&step, g)| {
                let who = (0..g.len() as u32)
                    .filter(|&w| g[w as usize].is_some())
                    .collect();
                (step, who)
            })
            .collect()
    }
}
