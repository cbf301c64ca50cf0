//! The deterministic simulator (`falcon sim`): discrete events in virtual time, `N` workers
//! with speed profiles, the engine's real synchronization policies, and the real model
//! computing real gradients on real data. No threads, no clock reads: the same spec and seed
//! give the same result, bit for bit.
//!
//! # Model of a job
//!
//! One parameter server shard holds the whole model (every shard of a real job runs the same
//! policy on the same events, so one instance stands for all). It is the servers' own shard
//! state machine ([`ShardCore`]) over a plain vector: exactly-once, the update rule, the
//! optimizer and the aggregate, Sync-opt's judgement and pull parking are the servers' code,
//! not a copy of it. Worker `w`'s iteration `c`:
//!
//! 1. its pull for clock `c` reaches the policy; when released at virtual time `t`, the
//!    servers send the model (see *communication* below) and the worker starts when it has
//!    arrived (or when it is done helping, if later: see below) on the servers' values *at
//!    release* (FluentPS's lazy execution: a released pull gets the latest values) and
//!    computes its gradient then, on a batch of its own share of the data
//!    ([`SimSpec::partition`]);
//! 2. its iteration takes `base × (1 ± jitter)` plus the delay of its heterogeneity profile
//!    ([`Hetero::delay`]: ratio, Gaussian, episodes, trace; contention has no meaning here),
//!    less the tasks helpers take from it;
//! 3. its push leaves when its own and its helpers' tasks are done and reaches the servers as
//!    *communication* below says: applied at once under asynchronous updates (scaled by its version staleness), or
//!    aggregated per step in rank order and applied when the policy's quorum of live workers
//!    is in (BSP, Sync-opt; late gradients Sync-opt drops are counted), with the configured
//!    optimizer ([`SimSpec::optimizer`]) and aggregate ([`SimSpec::aggregate`]); then the
//!    worker's pull for `c + 1` reaches the policy.
//!
//! ElasticBSP runs as its single job-wide state machine ([`ElasticBsp`]).
//!
//! # Elastic parallelism
//!
//! With [`SimSpec::host_cores`] set, each worker runs on a host of that many cores and the
//! job's parallelism manager (the scheduler's own [`Manager`]) plans its thread count, as in a
//! real job: every iteration end reports the iteration's compute time, threads and tasks;
//! each iteration begins with the count the manager advises then. An iteration of `p` threads
//! takes `1/min(p, cores)` of its one-thread time: linear up to the host's cores and no gain
//! past them, the knee `falcon bench knee` measures (on 2 cores: 135 ms at 1 thread, 68 ms at
//! 2, 66–67 ms from 3 on). The manager never plans past the knee, here the host's cores.
//!
//! # Communication
//!
//! Every message pays the one-way latency ([`SimSpec::latency_ns`]); the model's bytes (f32)
//! also pay the bandwidth ([`SimSpec::bandwidth`], bytes per virtual second, the same on every
//! link) twice: once on the worker's link for the whole model, once on the servers' side,
//! where the [`SimSpec::servers`] servers each hold `1/servers` of it and work in parallel,
//! one message after another in arrival order. A push occupies the servers' receiving side for
//! its share of the bytes plus the apply cost ([`SimSpec::apply_ns_per_float`] times the
//! floats of the share); a pull answer occupies their sending side for its share. So a push
//! that leaves at `e` is applied at `max(e + latency + bytes/bandwidth, b + bytes/servers/
//! bandwidth + apply)`, `b` being when the servers get to it (no earlier than `e + latency`),
//! and a pull answered at `t` arrives at `max(t + bytes/bandwidth, b + bytes/servers/
//! bandwidth) + latency`. Many workers pushing at once queue at the servers: the incast a
//! synchronous barrier causes costs time, as it does on a real network.
//!
//! # Tasks and their transfer
//!
//! An iteration is [`SimSpec::tasks`] equal tasks: a worker whose iteration takes `took`
//! (jitter and heterogeneity included) computes them one after another, task `i` (from 0)
//! beginning at `start + ⌊took·i/tasks⌋`; its own tasks are always the first ones, so helpers
//! take from the tail. (An additive heterogeneity such as `gauss` is spread evenly over the
//! tasks too.) With [`SimSpec::transfer`] on, an [`Action::Transfer`]`{ helper, straggler,
//! clock }` of the policy (EPSP, FlexRR), carried out at virtual time `now` (the event that
//! produced it), moves tasks when
//!
//! - the helper is idle: its pull is waiting at the server (parked, or not yet released when
//!   the offer is carried out — FlexRR offers right after a push) and it is not already
//!   helping;
//! - the straggler is computing iteration `clock` and has `r` tasks of its own not yet begun
//!   at `now` (a task beginning exactly at `now` counts as begun). A straggler between
//!   iterations, `clock` being its next one (an offer made right after its push), hands the
//!   tasks over when it begins that iteration, if the helper is still idle then.
//!
//! The helper then takes `k = ⌊r/2⌋` of them (none if `k = 0`) and computes them at its own
//! speed: `k` tasks of the duration its *next* iteration (the clock of its waiting pull) would
//! take, base, jitter and heterogeneity included, i.e. `⌊took_helper·k/tasks⌋`, from `now`
//! (handing the tasks over is instantaneous). It is busy until then: a pull of the helper
//! released earlier starts its iteration only when it is free. When done, the helper pushes
//! what it computed: that push pays the latency, the model's bytes on its link and the servers'
//! receiving side and apply cost, as any push (*communication* above), and counts in
//! [`SimReport::bytes_moved`]. The straggler's push is rescheduled to when both its remaining
//! own tasks and every helper's taken tasks are done (a generation number per worker makes the
//! push event scheduled before stale; it is ignored), and its step is applied once its own push
//! and every helper's push have been. Several helpers may take from the same iteration, each
//! half of what is left.
//!
//! Simplification: the gradient pushed stays the one the straggler computed at its iteration
//! start, on the same examples — the real trainer's helper computes the taken tasks on its own
//! values and pushes them separately, credited to the straggler's clock. Transfer changes the
//! timing here, not the arithmetic. Offers are counted whether or not they move anything
//! ([`SimReport::transfers_offered`]); [`SimReport::tasks_transferred`] counts tasks moved and
//! [`SimReport::tasks_computed`] who computed every task. A worker's `blocked_secs` is the
//! time its pull was parked, whether or not it was helping meanwhile.
//!
//! # Measurement
//!
//! The global model (the servers' parameters) is evaluated at time 0, then every
//! [`SimSpec::eval_every`] full-speed iterations of virtual time (`eval_every × base`) on a
//! fixed subset of [`SimSpec::eval_examples`] test images spread evenly over the test split,
//! and once more when the last push is applied; the time to accuracy is the first crossing of
//! that curve. The final accuracy is on the whole test split. A run whose parameters are not
//! finite, or that ends near chance (below 20 %) with a loss not clearly below the initial
//! model's (above 90 % of it: a dead network that answers one class has a loss near ln 10,
//! about the initial one) or after having been 20 points better, is reported as diverged
//! ([`SimReport::diverged`]).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Instant;

use falcon_engine::shard::{Input, Output, ShardConfig, ShardCore, ShardParams, VecParams};
use falcon_engine::supervisor::{Manager, ManagerConfig};
use falcon_engine::sync::{ElasticBsp, PolicySpec, SyncPolicy};
use falcon_engine::update::{
    Aggregate, Constant, Optimizer, ScaleSpec, ShardOptimizer, UpdateMode,
};
use serde::Serialize;

use crate::data::{Dataset, Partition, Split};
use crate::hetero::Hetero;
use crate::model::{ModelSpec, Scratch};
use crate::train::{EvalPoint, evaluate};
use crate::{Error, Result};

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimSpec {
    /// Workers.
    pub workers: u32,
    /// Iterations per worker.
    pub iters: u64,
    /// Synchronization policy.
    pub policy: PolicySpec,
    /// The model (a small one for large runs: `mlp:784-10`).
    pub model: ModelSpec,
    /// Examples per worker per iteration.
    pub batch: usize,
    /// The servers' learning rate (of the optimizer, when [`SimSpec::optimizer`] is none: plain
    /// SGD).
    pub lr: f32,
    /// The servers' optimizer (`None`: SGD at [`SimSpec::lr`]).
    pub optimizer: Option<Optimizer>,
    /// How a synchronous step's gradients combine.
    pub aggregate: Aggregate,
    /// Seed of data order, jitter and Gaussian delays.
    pub seed: u64,
    /// A full-speed iteration, virtual nanoseconds.
    pub base_ns: u64,
    /// Uniform jitter of an iteration, as a fraction of `base_ns` (0..1).
    pub jitter: f64,
    /// One-way network latency, virtual nanoseconds.
    pub latency_ns: u64,
    /// Bandwidth of every link, bytes per virtual second (0: unlimited). See the
    /// [module documentation](self#communication).
    pub bandwidth: f64,
    /// The servers' cost of applying one float of a gradient, virtual ns (`None`: the measured
    /// cost of the optimizer, [`apply_cost`]).
    pub apply_ns_per_float: Option<f64>,
    /// Servers sharing the model (each holds `1/servers` of it; they work in parallel).
    pub servers: u32,
    /// How the training data is divided among the workers.
    pub partition: Partition,
    /// Cores of each worker's host, for the parallelism manager (see the
    /// [module documentation](self#elastic-parallelism); `None`: one thread each, no manager).
    pub host_cores: Option<usize>,
    /// Heterogeneity of each worker (missing: none).
    pub hetero: Vec<Hetero>,
    /// Evaluate the servers' parameters every this many full-speed iterations of virtual time
    /// (`eval_every × base_ns`; 0: only at the end).
    pub eval_every: u64,
    /// Test examples of each evaluation, spread evenly over the test split (0: all of it; the
    /// final accuracy always uses all of it).
    pub eval_examples: usize,
    /// Compute real gradients (off: timing and policy behaviour only).
    pub compute: bool,
    /// Accuracy whose first crossing is the time to accuracy.
    pub target: f64,
    /// Equal tasks per iteration (≥ 1): the unit a transfer moves (see the
    /// [module documentation](self#tasks-and-their-transfer)).
    pub tasks: u32,
    /// Carry out the policy's task-transfer offers (off: only count them).
    pub transfer: bool,
    /// Staleness scaling of asynchronously applied gradients (DynSGD, ConSGD): a gradient
    /// computed on values `d` updates old is scaled as the servers scale it.
    pub scale: ScaleSpec,
}

/// The default link bandwidth: 10 Gbit/s (1.25 GB/s), a commodity cluster's Ethernet. falcon's
/// own tcp path moves 1.5–2 GB/s on one machine's loopback (`falcon bench engine`), so on such a
/// link the wire, not falcon, is the limit.
pub const DEFAULT_BANDWIDTH: f64 = 1.25e9;

/// The servers' measured apply cost of `opt`, ns per float (`cargo run --release -p
/// falcon-engine --example apply_cost`, 1 M floats, on the project's 2-core build machine):
/// SGD 0.11, momentum 0.29, Adam 0.93; Adagrad, not measured there, is charged as Adam.
pub fn apply_cost(opt: &Optimizer) -> f64 {
    match opt {
        Optimizer::Sgd { .. } => 0.11,
        Optimizer::Momentum { .. } => 0.29,
        _ => 0.93,
    }
}

impl Default for SimSpec {
    fn default() -> Self {
        SimSpec {
            workers: 16,
            iters: 200,
            policy: PolicySpec::Bsp,
            model: ModelSpec::Mlp {
                sizes: vec![784, 10],
            },
            batch: 16,
            lr: 0.05,
            optimizer: None,
            aggregate: Aggregate::Sum,
            seed: 1,
            base_ns: 10_000_000,
            jitter: 0.1,
            latency_ns: 50_000,
            bandwidth: DEFAULT_BANDWIDTH,
            apply_ns_per_float: None,
            servers: 2,
            partition: Partition::Iid,
            host_cores: None,
            hetero: Vec::new(),
            eval_every: 10,
            eval_examples: 500,
            compute: true,
            target: 0.7,
            tasks: 4,
            transfer: true,
            scale: ScaleSpec::Unscaled,
        }
    }
}

/// What a simulation did.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// The policy.
    pub policy: String,
    /// Workers.
    pub workers: u32,
    /// Iterations per worker.
    pub iters: u64,
    /// Virtual seconds until the last push.
    pub virtual_secs: f64,
    /// Wall seconds the simulation took.
    pub wall_secs: f64,
    /// Of which computing gradients (the model alone: the reference for the simulator's own
    /// cost).
    pub gradient_secs: f64,
    /// Iterations per virtual second, all workers together.
    pub iterations_per_sec: f64,
    /// The global model's accuracy over virtual time (`iteration`: pushes applied per worker).
    pub curve: Vec<EvalPoint>,
    /// Final accuracy (whole test split; 0 without computing).
    pub final_accuracy: f64,
    /// Virtual seconds until the target accuracy (None: never).
    pub time_to_target: Option<f64>,
    /// The run diverged (see the [module documentation](self#measurement)).
    pub diverged: bool,
    /// How the data was divided among the workers.
    pub partition: String,
    /// Per worker: virtual seconds its pulls were parked.
    pub blocked_secs: Vec<f64>,
    /// Pulls the policy parked.
    pub parked_pulls: u64,
    /// Gradients the policy dropped (Sync-opt).
    pub dropped: u64,
    /// Late gradients folded into a later step (`syncopt(…,fold)`).
    pub folded: u64,
    /// Task transfers the policy offered (moving tasks only when [`SimSpec::transfer`] is on
    /// and the offer finds an idle helper and unstarted tasks).
    pub transfers_offered: u64,
    /// Offers that moved at least one task.
    pub transfers_taken: u64,
    /// Tasks moved from stragglers to helpers.
    pub tasks_transferred: u64,
    /// Per worker: the tasks it computed, its own and those it took (together, `workers ×
    /// iters × tasks`).
    pub tasks_computed: Vec<u64>,
    /// Updates applied to the parameters.
    pub updates: u64,
    /// Bytes between workers and servers: every iteration pulls the model and pushes a
    /// gradient of its size (f32).
    pub bytes_moved: u64,
    /// Virtual seconds the servers spent receiving and applying pushes and sending pulls
    /// (of their time; `virtual_secs` is the whole).
    pub server_busy_secs: f64,
    /// A digest of the final parameters (bit-for-bit reproducibility).
    pub digest: u64,
    /// Per worker, the threads of its last iteration (1 without elastic parallelism).
    pub threads: Vec<usize>,
    /// How many times the parallelism manager re-planned.
    pub plans: u64,
}

impl SimReport {
    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Worker `w`'s push of clock `c` leaves it (its tasks are done), unless the worker's
    /// generation has moved past `g` (a transfer rescheduled it).
    Sent(u32, u64, u64),
    /// Worker `w`'s push of clock `c` is applied by the servers.
    Push(u32, u64, u64),
    /// Evaluate the servers' parameters.
    Eval,
    /// Worker `w`'s released pull of clock `c` reaches it: it starts iteration `c`.
    Start(u32, u64),
    /// Helper `h`'s push of the tasks it took from worker `w`'s iteration `c` leaves it.
    Helped(u32, u32, u64),
}

/// A worker's iteration in flight, from its start to its push.
#[derive(Clone, Copy, Debug)]
struct Running {
    /// The iteration.
    clock: u64,
    /// When it began computing, virtual ns.
    start: u64,
    /// How long all its tasks would take it, virtual ns.
    took: u64,
    /// Tasks it still computes itself: the first `own` of the iteration.
    own: u32,
    /// When the tasks helpers took are all done (0: none taken).
    helped_until: u64,
    /// When the helpers' pushes of those tasks are all applied (0: none yet).
    helpers_applied: u64,
}

/// `⌊took·i/tasks⌋`: when task `i` of an iteration of `took` begins, relative to its start
/// (`i = tasks`: when it ends).
fn task_offset(took: u64, i: u32, tasks: u32) -> u64 {
    (u128::from(took) * u128::from(i) / u128::from(tasks.max(1))) as u64
}

/// Of the first `own` tasks of an iteration that began at `start` and takes `took`, how
/// many have begun at `now` (task `i` begins at `start + task_offset(took, i, tasks)`).
fn tasks_begun(start: u64, took: u64, own: u32, tasks: u32, now: u64) -> u32 {
    if now < start || own == 0 {
        return 0;
    }
    if took == 0 {
        return own;
    }
    // ⌊took·i/tasks⌋ ≤ e ⇔ took·i ≤ (e + 1)·tasks − 1.
    let e = u128::from(now - start);
    let last = ((e + 1) * u128::from(tasks) - 1) / u128::from(took);
    u32::try_from(last + 1).map_or(own, |b| b.min(own))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Checks a spec against itself and the data.
fn check(spec: &SimSpec, data: &Dataset, model: &dyn crate::model::Model) -> Result<()> {
    let n = spec.workers as usize;
    if n == 0 || spec.iters == 0 || spec.batch == 0 {
        return Err(Error::Config(
            "a simulation needs workers, iterations and a batch".into(),
        ));
    }
    if spec.tasks == 0 {
        return Err(Error::Config(
            "a simulation needs at least 1 task per iteration".into(),
        ));
    }
    if !(0.0..1.0).contains(&spec.jitter) {
        return Err(Error::Config(format!(
            "jitter {} must be in [0, 1)",
            spec.jitter
        )));
    }
    if model.input_len() != data.train.features() {
        return Err(Error::Config(format!(
            "the model takes {} inputs, the data has {} features",
            model.input_len(),
            data.train.features()
        )));
    }
    let share = data.train.len() / n;
    if share < spec.batch && spec.compute {
        return Err(Error::Config(format!(
            "batch {} is larger than each worker's share ({share})",
            spec.batch
        )));
    }
    Ok(())
}

/// Runs a simulation on `data`.
pub fn simulate(spec: &SimSpec, data: &Dataset) -> Result<SimReport> {
    let wall = Instant::now();
    let model = spec.model.build()?;
    check(spec, data, &*model)?;
    let mut sim = Sim::new(spec, data, model)?;
    // Every worker pulls clock 0 at time 0.
    for w in 0..spec.workers {
        sim.pull(w, 0, 0)?;
    }
    if spec.compute {
        sim.record(0)?;
    }
    if let Some(every) = sim.eval_interval() {
        sim.schedule(every, Ev::Eval);
    }
    loop {
        // Carry out what the shard said at the last event (at time `end`).
        sim.carry_out()?;
        let Some(Reverse((t, _, ev))) = sim.queue.pop() else {
            break;
        };
        if let Ev::Sent(w, _, g) = ev
            && g != sim.workers[w as usize].generation
        {
            // Rescheduled by a transfer: the push leaves at its new time.
            continue;
        }
        if ev == Ev::Eval {
            sim.eval(t)?;
            continue;
        }
        sim.end = sim.end.max(t);
        match ev {
            Ev::Start(w, c) => sim.start(w, c, t)?,
            Ev::Sent(w, c, g) => sim.sent(w, c, g, t),
            Ev::Helped(_, w, c) => sim.helped(w, c, t),
            Ev::Push(w, c, _) => sim.push(w, c, t)?,
            Ev::Eval => {}
        }
    }
    sim.report(wall)
}

/// Runs `specs` on `data`, up to `threads` simulations at once (each on its own thread: a
/// simulation is one sequential event loop, and a sweep of policies, rates and seeds is many
/// independent ones), handing each report to `done` in the order of `specs` as soon as it and
/// every one before it have finished. Each report is what [`simulate`] gives for its spec alone.
pub fn simulate_all(
    specs: &[SimSpec],
    data: &Dataset,
    threads: usize,
    mut done: impl FnMut(usize, Result<SimReport>),
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let threads = threads.clamp(1, specs.len().max(1));
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..threads {
            let (tx, next) = (tx.clone(), &next);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(spec) = specs.get(i) else {
                        break;
                    };
                    if tx.send((i, simulate(spec, data))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut waiting = BTreeMap::new();
        let mut due = 0;
        for (i, r) in rx {
            waiting.insert(i, r);
            while let Some(r) = waiting.remove(&due) {
                done(due, r);
                due += 1;
            }
        }
    });
}

/// One simulated worker.
#[derive(Clone, Default)]
struct SimWorker {
    /// The gradient of its iteration in flight (computed at its start).
    grad: Vec<f32>,
    /// The parameter version its iteration in flight started from.
    seen: u64,
    /// The clock of its pull waiting at the server.
    pulling: Option<u64>,
    /// Its iteration in flight.
    running: Option<Running>,
    /// The generation of its push event (a transfer reschedules it).
    generation: u64,
    /// When it is done helping.
    busy_until: u64,
    /// Tasks it computed.
    tasks_computed: u64,
    /// Virtual ns its pulls were parked.
    blocked: u64,
    /// The iteration it computes next (its running one's successor while running).
    next: u64,
    /// Helpers offered its next iteration before it began.
    pending: Vec<u32>,
}

/// A simulation in progress: the event queue, the workers, and the servers' shard core
/// driven over a vector.
struct Sim<'a> {
    spec: &'a SimSpec,
    data: &'a Dataset,
    model: Box<dyn crate::model::Model>,
    mode: UpdateMode,
    core: ShardCore,
    shard: VecParams,
    /// What the shard said, not carried out yet.
    out: Vec<Output>,
    queue: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    /// Events queued so far (the tie-break of equal times).
    seq: u64,
    workers: Vec<SimWorker>,
    /// Parked pulls: request id → (worker, clock, since).
    waiting: BTreeMap<u64, (u32, u64, u64)>,
    req: u64,
    /// Iterations per epoch of a worker's share.
    per_epoch: u64,
    /// Each epoch's order of the training examples ([`Partition::Shuffled`]).
    orders: BTreeMap<u64, Vec<usize>>,
    /// Per worker, its fixed share of the training examples (other partitions), and its
    /// order of the epoch it is in.
    shares: Vec<Vec<usize>>,
    epoch_orders: Vec<(u64, Vec<usize>)>,
    /// The evaluation subset of the test split.
    eval_set: Split,
    /// Model bytes (f32), and the servers' apply cost of one push's share, virtual ns.
    bytes: u64,
    apply_ns: u64,
    /// When the servers' receiving and sending sides are free, and their busy time.
    in_free: u64,
    out_free: u64,
    busy: u64,
    /// Pushes applied, and workers done.
    pushes: u64,
    finished: u32,
    /// The parallelism manager, and each worker's threads now.
    manager: Option<Manager>,
    threads: Vec<usize>,
    scratch: Scratch,
    x: Vec<f32>,
    y: Vec<u8>,
    curve: Vec<EvalPoint>,
    /// The latest event's virtual time.
    end: u64,
    grad_wall: std::time::Duration,
    offers: u64,
    taken: u64,
    moved: u64,
    /// Bytes of every pull answer and push, helpers' included.
    moved_bytes: u64,
}

impl<'a> Sim<'a> {
    fn new(
        spec: &'a SimSpec,
        data: &'a Dataset,
        model: Box<dyn crate::model::Model>,
    ) -> Result<Sim<'a>> {
        let policy: Box<dyn SyncPolicy> = match spec.policy.job_barriers() {
            Some(r) => Box::new(ElasticBsp::new(spec.workers, r as usize)),
            None => spec.policy.build_for(spec.workers, 0),
        };
        let mode = spec.policy.update_mode();
        // The servers' shard, over a vector (empty when only timing is simulated).
        let len = if spec.compute { model.num_params() } else { 0 };
        let shard_cfg = ShardConfig {
            id: 0,
            len,
            workers: spec.workers,
            mode,
            aggregate: spec.aggregate,
            max_pending_bytes: u64::MAX,
        };
        let opt_spec = spec.optimizer.unwrap_or(Optimizer::Sgd { lr: spec.lr });
        let opt = ShardOptimizer::new(opt_spec, Arc::new(Constant), len);
        let n = spec.workers as usize;
        let share = data.train.len() / n;
        let shares = if spec.partition == Partition::Shuffled || !spec.compute {
            Vec::new()
        } else {
            (0..spec.workers)
                .map(|w| {
                    data.train
                        .partition(spec.partition, w, spec.workers, spec.seed)
                })
                .collect()
        };
        let floats = model.num_params() as u64;
        let mut sim = Sim {
            spec,
            data,
            mode,
            core: ShardCore::new(shard_cfg, policy, opt, spec.scale.build()),
            shard: VecParams::new(len, spec.workers),
            out: Vec::new(),
            queue: BinaryHeap::new(),
            seq: 0,
            workers: vec![SimWorker::default(); n],
            waiting: BTreeMap::new(),
            req: 0,
            per_epoch: (share / spec.batch).max(1) as u64,
            orders: BTreeMap::new(),
            shares,
            epoch_orders: vec![(u64::MAX, Vec::new()); n],
            eval_set: if spec.compute {
                data.test.spread_subset(spec.eval_examples)
            } else {
                data.test.spread_subset(1)
            },
            bytes: floats * 4,
            apply_ns: {
                let per_float = spec
                    .apply_ns_per_float
                    .unwrap_or_else(|| apply_cost(&opt_spec));
                (per_float * floats.div_ceil(u64::from(spec.servers.max(1))) as f64) as u64
            },
            in_free: 0,
            out_free: 0,
            busy: 0,
            pushes: 0,
            finished: 0,
            manager: spec.host_cores.map(|cores| {
                let mut cfg = ManagerConfig::one_host(spec.workers, cores, cores, spec.tasks);
                // Each worker on its own host.
                cfg.hosts = (0..spec.workers).collect();
                Manager::new(cfg)
            }),
            threads: vec![1; n],
            scratch: Scratch::new(),
            x: Vec::new(),
            y: Vec::new(),
            curve: Vec::new(),
            end: 0,
            grad_wall: std::time::Duration::ZERO,
            offers: 0,
            taken: 0,
            moved: 0,
            moved_bytes: 0,
            model,
        };
        if spec.compute {
            let values = sim.model.init_vec(spec.seed);
            sim.feed(
                0,
                Input::Init {
                    conn: 0,
                    worker: 0,
                    values,
                },
            )?;
        }
        Ok(sim)
    }

    fn feed(&mut self, t: u64, input: Input) -> Result<()> {
        let out = &mut self.out;
        self.core
            .handle(t, input, &mut self.shard, &mut |o| out.push(o))?;
        Ok(())
    }

    fn schedule(&mut self, t: u64, e: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, e)));
    }

    /// How long worker `w`'s iteration `c` takes, all its tasks computed by itself (virtual
    /// ns): base ± jitter, plus its heterogeneity's delay.
    fn duration(&self, w: u32, c: u64) -> u64 {
        let spec = self.spec;
        let u = (splitmix(spec.seed ^ (u64::from(w) << 40) ^ c) >> 11) as f64 / (1u64 << 53) as f64;
        let d = spec.base_ns as f64 * (1.0 + spec.jitter * (2.0 * u - 1.0));
        let d = std::time::Duration::from_nanos(d as u64);
        let extra = spec
            .hetero
            .get(w as usize)
            .map_or(std::time::Duration::ZERO, |h| {
                h.delay(spec.seed ^ u64::from(w), c, d)
            });
        let one = u64::try_from(d.saturating_add(extra).as_nanos()).unwrap_or(u64::MAX);
        match spec.host_cores {
            Some(cores) => one / self.threads[w as usize].clamp(1, cores.max(1)) as u64,
            None => one,
        }
    }

    /// Worker `w`'s pull for clock `c` reaches the shard at `t`.
    fn pull(&mut self, w: u32, c: u64, t: u64) -> Result<()> {
        self.req += 1;
        self.waiting.insert(self.req, (w, c, t));
        self.workers[w as usize].pulling = Some(c);
        let req = self.req;
        self.feed(
            t,
            Input::Pull {
                worker: w,
                clock: c,
                req,
            },
        )
    }

    /// Carries out what the shard said at the last event.
    fn carry_out(&mut self) -> Result<()> {
        let now = self.end;
        for o in std::mem::take(&mut self.out) {
            match o {
                Output::Answer { req, .. } => {
                    if let Some((w, c, since)) = self.waiting.remove(&req) {
                        let me = &mut self.workers[w as usize];
                        let at = since.max(now);
                        me.blocked += at - since;
                        me.pulling = None;
                        let busy_until = me.busy_until;
                        // A helper starts its own iteration once its taken tasks are done.
                        let begin = self.answer_arrives(at).max(busy_until);
                        self.schedule(begin, Ev::Start(w, c));
                    }
                }
                Output::Offer {
                    helper,
                    straggler,
                    clock,
                } => self.transfer(helper, straggler, clock, now),
                Output::Refuse { reason, .. } => {
                    return Err(Error::Config(format!("the shard refused a pull: {reason}")));
                }
                Output::Ack { .. } | Output::Lost { .. } => {}
            }
        }
        Ok(())
    }

    /// An offer to `helper` of `straggler`'s iteration `clock`, carried out at `now` (see the
    /// [module documentation](self#tasks-and-their-transfer)).
    fn transfer(&mut self, helper: u32, straggler: u32, clock: u64, now: u64) {
        self.offers += 1;
        let (h, st, n) = (helper as usize, straggler as usize, self.workers.len());
        if !self.spec.transfer || h == st || h >= n || st >= n {
            return;
        }
        match self.workers[st].running {
            Some(r) if r.clock == clock => self.take_tasks(helper, straggler, clock, now),
            // Between iterations (its push applied, its next iteration not begun): the helper
            // takes its tasks of that iteration when it begins.
            None if self.workers[st].next == clock => self.workers[st].pending.push(helper),
            _ => {}
        }
    }

    /// `helper` takes tasks of `straggler`'s running iteration `clock` at `now`, if it is
    /// idle and any are left.
    fn take_tasks(&mut self, helper: u32, straggler: u32, clock: u64, now: u64) {
        let (h, st) = (helper as usize, straggler as usize);
        let tasks = self.spec.tasks;
        if self.workers[h].busy_until > now {
            return;
        }
        let Some(helper_clock) = self.workers[h].pulling else {
            return;
        };
        let Some(run) = self.workers[st].running.filter(|r| r.clock == clock) else {
            return;
        };
        let begun = tasks_begun(run.start, run.took, run.own, tasks, now);
        let k = (run.own - begun) / 2;
        if k == 0 {
            return;
        }
        let done = now.saturating_add(task_offset(self.duration(helper, helper_clock), k, tasks));
        self.workers[h].busy_until = done;
        self.workers[h].tasks_computed += u64::from(k);
        let mut run = run;
        run.own -= k;
        run.helped_until = run.helped_until.max(done);
        self.taken += 1;
        self.moved += u64::from(k);
        let own_end = run
            .start
            .saturating_add(task_offset(run.took, run.own, tasks));
        let push_at = own_end.max(run.helped_until);
        let me = &mut self.workers[st];
        me.running = Some(run);
        me.generation += 1;
        let g = me.generation;
        // The helper pushes what it computed as soon as it is done (before the straggler's
        // own push, which waits for it: scheduled first, it comes first at equal times).
        self.schedule(done, Ev::Helped(helper, straggler, clock));
        self.schedule(push_at, Ev::Sent(straggler, clock, g));
    }

    /// A helper's push of tasks of `w`'s iteration `c` leaves it at `t`: it pays the network
    /// and the servers as any push, and `w`'s step waits for it.
    fn helped(&mut self, w: u32, c: u64, t: u64) {
        let done = self.receive(t);
        if let Some(run) = self.workers[w as usize]
            .running
            .as_mut()
            .filter(|r| r.clock == c)
        {
            run.helpers_applied = run.helpers_applied.max(done);
        }
    }

    /// A push that leaves its worker at `t`: when the servers have received and applied it
    /// (see the [module documentation](self#communication)).
    fn receive(&mut self, t: u64) -> u64 {
        let spec = self.spec;
        let servers = u64::from(spec.servers.max(1));
        let arrive = t.saturating_add(spec.latency_ns);
        let begin = arrive.max(self.in_free);
        let side = self.wire(self.bytes.div_ceil(servers)) + self.apply_ns;
        self.in_free = begin + side;
        self.busy += side;
        self.moved_bytes += self.bytes;
        (begin + side).max(arrive.saturating_add(self.wire(self.bytes)))
    }

    /// Virtual ns to move `bytes` over one link.
    fn wire(&self, bytes: u64) -> u64 {
        if self.spec.bandwidth > 0.0 {
            (bytes as f64 * 1e9 / self.spec.bandwidth) as u64
        } else {
            0
        }
    }

    /// A pull answered at `t`: when the model has reached the worker.
    fn answer_arrives(&mut self, t: u64) -> u64 {
        let servers = u64::from(self.spec.servers.max(1));
        let begin = t.max(self.out_free);
        let side = self.wire(self.bytes.div_ceil(servers));
        self.out_free = begin + side;
        self.busy += side;
        self.moved_bytes += self.bytes;
        (begin + side)
            .max(t.saturating_add(self.wire(self.bytes)))
            .saturating_add(self.spec.latency_ns)
    }

    /// Worker `w`'s push of clock `c` leaves it at `t`: it is applied once it has crossed the
    /// network and the servers have received and applied it (see the
    /// [module documentation](self#communication)).
    fn sent(&mut self, w: u32, c: u64, g: u64, t: u64) {
        let spec = self.spec;
        if let (Some(m), Some(run)) = (&self.manager, self.workers[w as usize].running)
            && run.own > 0
        {
            // Its own tasks' compute time, as a worker reports its iteration.
            let own = task_offset(run.took, run.own, spec.tasks);
            m.report(
                w,
                self.threads[w as usize],
                run.own,
                std::time::Duration::from_nanos(own),
            );
        }
        let helpers = self.workers[w as usize]
            .running
            .map_or(0, |r| r.helpers_applied);
        let done = self.receive(t).max(helpers);
        self.schedule(done, Ev::Push(w, c, g));
    }

    /// The evaluation interval, virtual ns (`None`: only at the end).
    fn eval_interval(&self) -> Option<u64> {
        (self.spec.compute && self.spec.eval_every > 0).then(|| {
            self.spec
                .eval_every
                .saturating_mul(self.spec.base_ns)
                .max(1)
        })
    }

    /// Evaluates the servers' parameters at `t` (while any worker is still at work), and
    /// schedules the next evaluation.
    fn eval(&mut self, t: u64) -> Result<()> {
        if self.finished >= self.spec.workers {
            return Ok(());
        }
        self.record(t)?;
        // Only while something else is to happen (a policy that left pulls parked for ever
        // is reported as such, not evaluated for ever).
        if let Some(every) = self.eval_interval().filter(|_| !self.queue.is_empty()) {
            self.schedule(t.saturating_add(every), Ev::Eval);
        }
        Ok(())
    }

    /// One point of the curve: the servers' parameters at `t` on the evaluation subset.
    fn record(&mut self, t: u64) -> Result<()> {
        let (accuracy, loss) = evaluate(&*self.model, self.shard.values(), &self.eval_set, 0)?;
        self.curve.push(EvalPoint {
            secs: t as f64 / 1e9,
            iteration: self.pushes / u64::from(self.spec.workers.max(1)),
            accuracy,
            loss,
        });
        Ok(())
    }

    /// Worker `w` starts iteration `c` at `t` on the shard's values as they are.
    fn start(&mut self, w: u32, c: u64, t: u64) -> Result<()> {
        let wi = w as usize;
        self.workers[wi].seen = self.shard.version();
        if self.spec.compute {
            self.gradient(w, c)?;
        }
        if let Some(m) = &self.manager {
            self.threads[wi] = m.threads(w);
        }
        let took = self.duration(w, c);
        let me = &mut self.workers[wi];
        me.running = Some(Running {
            clock: c,
            start: t,
            took,
            own: self.spec.tasks,
            helped_until: 0,
            helpers_applied: 0,
        });
        me.next = c + 1;
        let g = me.generation;
        let pending = std::mem::take(&mut me.pending);
        self.schedule(t.saturating_add(took), Ev::Sent(w, c, g));
        for helper in pending {
            self.take_tasks(helper, w, c, t);
        }
        Ok(())
    }

    /// Worker `w`'s gradient of iteration `c`, on its share of the epoch's order.
    fn gradient(&mut self, w: u32, c: u64) -> Result<()> {
        let (spec, train) = (self.spec, &self.data.train);
        let epoch = c / self.per_epoch;
        let k = (c % self.per_epoch) as usize;
        self.x.clear();
        self.y.clear();
        if let Some(share) = self.shares.get(w as usize) {
            // Its own share, reshuffled every epoch.
            let mine = &mut self.epoch_orders[w as usize];
            if mine.0 != epoch {
                let mut order = share.clone();
                fastrand::Rng::with_seed(splitmix(spec.seed ^ (u64::from(w) << 40) ^ epoch))
                    .shuffle(&mut order);
                *mine = (epoch, order);
            }
            for &i in &mine.1[k * spec.batch..(k + 1) * spec.batch] {
                self.x.extend_from_slice(train.image(i));
                self.y.push(train.label(i));
            }
        } else {
            // One shuffle per epoch, cut into the workers' shares exactly as
            // `Split::batch_indices` does (its order depends on the seed and the epoch only),
            // instead of one shuffle of the whole split per worker.
            let order = self
                .orders
                .entry(epoch)
                .or_insert_with(|| train.batch_indices(0, 1, epoch, spec.seed));
            let len = order.len() as u128;
            let lo = (len * u128::from(w) / u128::from(spec.workers)) as usize;
            for &i in &order[lo + k * spec.batch..lo + (k + 1) * spec.batch] {
                self.x.extend_from_slice(train.image(i));
                self.y.push(train.label(i));
            }
            if self.orders.len() > 8 {
                self.orders.retain(|&e, _| e + 4 >= epoch);
            }
        }
        let g = &mut self.workers[w as usize].grad;
        g.clear();
        g.resize(self.model.num_params(), 0.0);
        let tg = Instant::now();
        self.model
            .grad(self.shard.values(), &self.x, &self.y, g, &mut self.scratch)?;
        self.grad_wall += tg.elapsed();
        let inv = 1.0 / spec.batch as f32;
        g.iter_mut().for_each(|v| *v *= inv);
        Ok(())
    }

    /// Worker `w`'s push of iteration `c` reaches the shard at `t`; then its next pull.
    fn push(&mut self, w: u32, c: u64, t: u64) -> Result<()> {
        let spec = self.spec;
        let me = &mut self.workers[w as usize];
        if let Some(run) = me.running.take() {
            me.tasks_computed += u64::from(run.own);
        }
        let push = Input::Push {
            conn: 0,
            worker: w,
            seq: c + 1,
            computed_on: Some(me.seen),
            grad: std::mem::take(&mut me.grad).into(),
        };
        self.feed(t, push)?;
        self.pushes += 1;
        if c + 1 < spec.iters {
            self.pull(w, c + 1, t)?;
        } else {
            self.finished += 1;
            if self.mode == UpdateMode::Async {
                // Done: it holds nobody back any more (ElasticBSP's barriers leave it out, as
                // the scheduler does for a finished worker). Under synchronous updates a
                // finished worker has pushed every clock, and the quorum stays whole.
                self.feed(t, Input::Leave { worker: w })?;
            }
        }
        Ok(())
    }

    fn report(mut self, wall: Instant) -> Result<SimReport> {
        let spec = self.spec;
        if !self.waiting.is_empty() {
            return Err(Error::Config(format!(
                "the policy left {} pulls parked with nothing left to happen (a policy bug)",
                self.waiting.len()
            )));
        }
        // The job ends, as the servers' does: transferred tasks late for the last step are
        // applied.
        self.feed(self.end, Input::End)?;
        if spec.compute {
            self.record(self.end)?;
        }
        let values = self.shard.values();
        let (final_accuracy, final_loss) = if spec.compute {
            evaluate(&*self.model, values, &self.data.test, 0)?
        } else {
            (0.0, 0.0)
        };
        let first_loss = self.curve.first().map_or(f64::INFINITY, |e| e.loss);
        let best = self.curve.iter().map(|e| e.accuracy).fold(0.0, f64::max);
        let diverged = spec.compute
            && (values.iter().any(|v| !v.is_finite())
                || !final_loss.is_finite()
                || (final_accuracy < 0.2
                    && (final_loss >= 0.9 * first_loss || best >= final_accuracy + 0.2)));
        let digest = values.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        });
        let virtual_secs = self.end as f64 / 1e9;
        let stats = self.core.stats();
        Ok(SimReport {
            policy: format!("{}{}", self.core.policy().name(), spec.scale.suffix()),
            workers: spec.workers,
            iters: spec.iters,
            virtual_secs,
            wall_secs: wall.elapsed().as_secs_f64(),
            gradient_secs: self.grad_wall.as_secs_f64(),
            iterations_per_sec: (u64::from(spec.workers) * spec.iters) as f64
                / virtual_secs.max(1e-12),
            time_to_target: self
                .curve
                .iter()
                .find(|e| e.accuracy >= spec.target)
                .map(|e| e.secs),
            curve: self.curve,
            final_accuracy,
            diverged,
            partition: spec.partition.to_string(),
            blocked_secs: self
                .workers
                .iter()
                .map(|w| w.blocked as f64 / 1e9)
                .collect(),
            parked_pulls: stats.per_worker.iter().map(|c| c.parked_pulls).sum(),
            dropped: stats.per_worker.iter().map(|c| c.dropped_gradients).sum(),
            folded: stats.per_worker.iter().map(|c| c.folded_gradients).sum(),
            transfers_offered: self.offers,
            transfers_taken: self.taken,
            tasks_transferred: self.moved,
            tasks_computed: self.workers.iter().map(|w| w.tasks_computed).collect(),
            updates: stats.updates,
            bytes_moved: self.moved_bytes,
            server_busy_secs: self.busy as f64 / 1e9,
            threads: self.threads.clone(),
            plans: self.manager.as_ref().map_or(0, Manager::plans),
            digest,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_begin_one_after_another() {
        // 4 tasks of 10 ns: they begin at 100, 110, 120, 130.
        let begun = |own, now| tasks_begun(100, 40, own, 4, now);
        assert_eq!(begun(4, 99), 0);
        assert_eq!(begun(4, 100), 1, "a task beginning now has begun");
        assert_eq!(begun(4, 109), 1);
        assert_eq!(begun(4, 110), 2);
        assert_eq!(begun(4, 129), 3);
        assert_eq!(begun(4, 130), 4);
        assert_eq!(begun(4, 1_000), 4);
        // Fewer own tasks (helpers took the tail): never more than those.
        assert_eq!(begun(2, 125), 2);
        assert_eq!(begun(0, 125), 0);
        // Uneven division: ⌊took·i/tasks⌋ = 0, 3, 6 for 10 ns in 3 tasks.
        for (now, want) in [(0, 1), (2, 1), (3, 2), (5, 2), (6, 3), (50, 3)] {
            assert_eq!(tasks_begun(0, 10, 3, 3, now), want, "at {now}");
        }
        assert_eq!(tasks_begun(5, 0, 3, 3, 5), 3, "an instant iteration");
        for i in 0..=3 {
            assert_eq!(task_offset(10, i, 3), [0, 3, 6, 10][i as usize]);
        }
        assert_eq!(task_offset(u64::MAX, 3, 4), u64::MAX / 4 * 3 + 2);
    }
}
