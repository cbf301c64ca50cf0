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
//!    worker starts at `t + latency` (or when it is done helping, if later: see below) on the
//!    server's values *at release* (FluentPS's lazy execution: a released pull gets the
//!    latest values) and computes its gradient then;
//! 2. its iteration takes `base × (1 ± jitter)` plus the delay of its heterogeneity profile
//!    ([`Hetero::delay`]: ratio, Gaussian, episodes, trace; contention has no meaning here),
//!    less the tasks helpers take from it;
//! 3. its push reaches the server `latency` after its own and its helpers' tasks are done:
//!    applied at once under asynchronous updates (scaled by its version staleness), or
//!    aggregated per step in rank order and applied when the policy's quorum of live workers
//!    is in (BSP, Sync-opt; late gradients Sync-opt drops are counted), with the configured
//!    optimizer ([`SimSpec::optimizer`]) and aggregate ([`SimSpec::aggregate`]); then the
//!    worker's pull for `c + 1` reaches the policy.
//!
//! ElasticBSP runs as its single job-wide state machine ([`ElasticBsp`]).
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
//!   at `now` (a task beginning exactly at `now` counts as begun).
//!
//! The helper then takes `k = ⌊r/2⌋` of them (none if `k = 0`) and computes them at its own
//! speed: `k` tasks of the duration its *next* iteration (the clock of its waiting pull) would
//! take, base, jitter and heterogeneity included, i.e. `⌊took_helper·k/tasks⌋`, from `now`
//! (handing the tasks over is instantaneous; the latency is charged once, on the push). It is
//! busy until then: a pull of the helper released earlier starts its iteration only when it is
//! free. The straggler's push is rescheduled to when both its remaining own tasks and every
//! helper's taken tasks are done, plus the latency (a generation number per worker makes the
//! push event scheduled before stale; it is ignored). Several helpers may take from the same
//! iteration, each half of what is left.
//!
//! Simplification: the gradient pushed stays the one the straggler computed at its iteration
//! start, on the same examples — the real trainer's helper computes the taken tasks on its own
//! values and pushes them separately, credited to the straggler's clock. Transfer changes the
//! timing here, not the arithmetic. Offers are counted whether or not they move anything
//! ([`SimReport::transfers_offered`]); [`SimReport::tasks_transferred`] counts tasks moved and
//! [`SimReport::tasks_computed`] who computed every task. A worker's `blocked_secs` is the
//! time its pull was parked, whether or not it was helping meanwhile.
//!
//! Time to accuracy: worker 0's values are evaluated every `eval_every` of its iterations on
//! the first `eval_examples` test images.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Instant;

use falcon_engine::shard::{Input, Output, ShardConfig, ShardCore, ShardParams, VecParams};
use falcon_engine::sync::{ElasticBsp, PolicySpec, SyncPolicy};
use falcon_engine::update::{
    Aggregate, Constant, Optimizer, ScaleSpec, ShardOptimizer, UpdateMode,
};
use serde::Serialize;

use crate::data::Dataset;
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
    /// Heterogeneity of each worker (missing: none).
    pub hetero: Vec<Hetero>,
    /// Evaluate worker 0's values every this many of its iterations (0: only at the end).
    pub eval_every: u64,
    /// Test examples of each evaluation (the final one uses the whole test split).
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
    /// Worker 0's accuracy over virtual time.
    pub curve: Vec<EvalPoint>,
    /// Final accuracy (whole test split; 0 without computing).
    pub final_accuracy: f64,
    /// Virtual seconds until the target accuracy (None: never).
    pub time_to_target: Option<f64>,
    /// Per worker: virtual seconds its pulls were parked.
    pub blocked_secs: Vec<f64>,
    /// Pulls the policy parked.
    pub parked_pulls: u64,
    /// Gradients the policy dropped (Sync-opt).
    pub dropped: u64,
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
    /// A digest of the final parameters (bit-for-bit reproducibility).
    pub digest: u64,
}

impl SimReport {
    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Worker `w`'s push of clock `c` reaches the server, unless the worker's generation has
    /// moved past `g` (a transfer rescheduled it).
    Push(u32, u64, u64),
    /// Worker `w`'s released pull of clock `c` reaches it: it starts iteration `c`.
    Start(u32, u64),
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

/// Runs a simulation on `data`.
pub fn simulate(spec: &SimSpec, data: &Dataset) -> Result<SimReport> {
    let wall = Instant::now();
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
    let model = spec.model.build()?;
    if model.input_len() != data.train.features() {
        return Err(Error::Config(format!(
            "the model takes {} inputs, the data has {} features",
            model.input_len(),
            data.train.features()
        )));
    }
    let policy: Box<dyn SyncPolicy> = match spec.policy.job_barriers() {
        Some(r) => Box::new(ElasticBsp::new(spec.workers, r as usize)),
        None => spec.policy.build_for(spec.workers, 0),
    };
    let mode = match spec.policy {
        PolicySpec::Bsp | PolicySpec::SyncOpt { .. } => UpdateMode::Sync,
        _ => UpdateMode::Async,
    };
    let p = model.num_params();
    // The servers' shard, over a vector (empty when only timing is simulated).
    let len = if spec.compute { p } else { 0 };
    let shard_cfg = ShardConfig {
        id: 0,
        len,
        workers: spec.workers,
        mode,
        aggregate: spec.aggregate,
        max_pending_bytes: u64::MAX,
    };
    let opt = spec.optimizer.unwrap_or(Optimizer::Sgd { lr: spec.lr });
    let opt = ShardOptimizer::new(opt, Arc::new(Constant), len);
    let mut core = ShardCore::new(shard_cfg, policy, opt, spec.scale.build());
    let mut shard = VecParams::new(len, spec.workers);
    let mut out: Vec<Output> = Vec::new();
    if spec.compute {
        let values = model.init_vec(spec.seed);
        let init = Input::Init {
            conn: 0,
            worker: 0,
            values,
        };
        core.handle(0, init, &mut shard, &mut |o| out.push(o))?;
    }
    let mut scratch = Scratch::new();
    let mut x = Vec::new();
    let mut y = Vec::new();
    // Each worker's gradient of the iteration in flight (computed at its start).
    let mut grads: Vec<Vec<f32>> = vec![Vec::new(); n];
    // The parameter version each worker's iteration in flight started from.
    let mut seen = vec![0u64; n];
    let share = data.train.len() / n;
    if share < spec.batch && spec.compute {
        return Err(Error::Config(format!(
            "batch {} is larger than each worker's share ({share})",
            spec.batch
        )));
    }
    let per_epoch = (share / spec.batch).max(1) as u64;
    let mut orders: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    let mut queue: BinaryHeap<Reverse<(u64, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push_ev = |q: &mut BinaryHeap<Reverse<(u64, u64, Ev)>>, t: u64, e: Ev| {
        seq += 1;
        q.push(Reverse((t, seq, e)));
    };
    // Parked pulls: request id → (worker, clock, since).
    let mut waiting: BTreeMap<u64, (u32, u64, u64)> = BTreeMap::new();
    let mut req = 0u64;
    let mut blocked = vec![0u64; n];
    let mut offers = 0u64;
    let mut curve = Vec::new();
    let mut end = 0u64;
    let mut grad_wall = std::time::Duration::ZERO;
    // How long worker `w`'s iteration `c` takes, all its tasks computed by itself (virtual
    // ns): base ± jitter, plus its heterogeneity's delay.
    let duration = |w: u32, c: u64| -> u64 {
        let u = (splitmix(spec.seed ^ (u64::from(w) << 40) ^ c) >> 11) as f64 / (1u64 << 53) as f64;
        let d = spec.base_ns as f64 * (1.0 + spec.jitter * (2.0 * u - 1.0));
        let d = std::time::Duration::from_nanos(d as u64);
        let extra = spec
            .hetero
            .get(w as usize)
            .map_or(std::time::Duration::ZERO, |h| {
                h.delay(spec.seed ^ u64::from(w), c, d)
            });
        u64::try_from(d.saturating_add(extra).as_nanos()).unwrap_or(u64::MAX)
    };
    // Per worker: the clock of its pull waiting at the server, its iteration in flight, the
    // generation of its push event, when it is done helping, the tasks it computed.
    let mut pulling: Vec<Option<u64>> = vec![None; n];
    let mut running: Vec<Option<Running>> = vec![None; n];
    let mut generation = vec![0u64; n];
    let mut busy_until = vec![0u64; n];
    let mut tasks_computed = vec![0u64; n];
    let (mut taken, mut moved) = (0u64, 0u64);

    // Every worker pulls clock 0 at time 0.
    for w in 0..spec.workers {
        req += 1;
        waiting.insert(req, (w, 0, 0));
        pulling[w as usize] = Some(0);
        let pull = Input::Pull {
            worker: w,
            clock: 0,
            req,
        };
        core.handle(0, pull, &mut shard, &mut |o| out.push(o))?;
    }
    loop {
        // Carry out the actions of the last event (at time `end`).
        let now = end;
        for a in std::mem::take(&mut out) {
            match a {
                Output::Answer { req: r, .. } => {
                    if let Some((w, c, since)) = waiting.remove(&r) {
                        let wi = w as usize;
                        let at = since.max(now);
                        blocked[wi] += at - since;
                        pulling[wi] = None;
                        // A helper starts its own iteration once its taken tasks are done.
                        let begin = at.saturating_add(spec.latency_ns).max(busy_until[wi]);
                        push_ev(&mut queue, begin, Ev::Start(w, c));
                    }
                }
                Output::Offer {
                    helper,
                    straggler,
                    clock,
                } => {
                    offers += 1;
                    let (h, st) = (helper as usize, straggler as usize);
                    if !spec.transfer || h == st || h >= n || st >= n || busy_until[h] > now {
                        continue;
                    }
                    let Some(helper_clock) = pulling[h] else {
                        continue;
                    };
                    let Some(run) = running[st].as_mut().filter(|r| r.clock == clock) else {
                        continue;
                    };
                    let begun = tasks_begun(run.start, run.took, run.own, spec.tasks, now);
                    let k = (run.own - begun) / 2;
                    if k == 0 {
                        continue;
                    }
                    let done = now.saturating_add(task_offset(
                        duration(helper, helper_clock),
                        k,
                        spec.tasks,
                    ));
                    busy_until[h] = done;
                    tasks_computed[h] += u64::from(k);
                    run.own -= k;
                    run.helped_until = run.helped_until.max(done);
                    taken += 1;
                    moved += u64::from(k);
                    let own_end = run
                        .start
                        .saturating_add(task_offset(run.took, run.own, spec.tasks));
                    let push_at = own_end
                        .max(run.helped_until)
                        .saturating_add(spec.latency_ns);
                    generation[st] += 1;
                    push_ev(
                        &mut queue,
                        push_at,
                        Ev::Push(straggler, clock, generation[st]),
                    );
                }
                Output::Refuse { reason, .. } => {
                    return Err(Error::Config(format!("the shard refused a pull: {reason}")));
                }
                Output::Ack { .. } | Output::Lost { .. } => {}
            }
        }
        let Some(Reverse((t, _, ev))) = queue.pop() else {
            break;
        };
        if let Ev::Push(w, _, g) = ev
            && g != generation[w as usize]
        {
            // Rescheduled by a transfer: the push happens at its new time.
            continue;
        }
        end = end.max(t);
        match ev {
            Ev::Start(w, c) => {
                let wi = w as usize;
                seen[wi] = shard.version();
                if spec.compute {
                    let epoch = c / per_epoch;
                    let k = (c % per_epoch) as usize;
                    // One shuffle per epoch, cut into the workers' shares exactly as
                    // `Split::batch_indices` does (its order depends on the seed and the
                    // epoch only), instead of one shuffle of the whole split per worker.
                    let order = orders
                        .entry(epoch)
                        .or_insert_with(|| data.train.batch_indices(0, 1, epoch, spec.seed));
                    let len = order.len() as u128;
                    let lo = (len * u128::from(w) / u128::from(spec.workers)) as usize;
                    x.clear();
                    y.clear();
                    for &i in &order[lo + k * spec.batch..lo + (k + 1) * spec.batch] {
                        x.extend_from_slice(data.train.image(i));
                        y.push(data.train.label(i));
                    }
                    if orders.len() > 8 {
                        orders.retain(|&e, _| e + 4 >= epoch);
                    }
                    let g = &mut grads[wi];
                    g.clear();
                    g.resize(p, 0.0);
                    let tg = Instant::now();
                    model.grad(shard.values(), &x, &y, g, &mut scratch)?;
                    grad_wall += tg.elapsed();
                    let inv = 1.0 / spec.batch as f32;
                    g.iter_mut().for_each(|v| *v *= inv);
                }
                let took = duration(w, c);
                running[wi] = Some(Running {
                    clock: c,
                    start: t,
                    took,
                    own: spec.tasks,
                    helped_until: 0,
                });
                let at = t.saturating_add(took).saturating_add(spec.latency_ns);
                push_ev(&mut queue, at, Ev::Push(w, c, generation[wi]));
            }
            Ev::Push(w, c, _) => {
                let wi = w as usize;
                if let Some(run) = running[wi].take() {
                    tasks_computed[wi] += u64::from(run.own);
                }
                let push = Input::Push {
                    conn: 0,
                    worker: w,
                    seq: c + 1,
                    computed_on: Some(seen[wi]),
                    grad: std::mem::take(&mut grads[wi]),
                };
                core.handle(t, push, &mut shard, &mut |o| out.push(o))?;
                if w == 0 && spec.compute && spec.eval_every > 0 && (c + 1) % spec.eval_every == 0 {
                    let (accuracy, loss) =
                        evaluate(&*model, shard.values(), &data.test, spec.eval_examples)?;
                    curve.push(EvalPoint {
                        secs: t as f64 / 1e9,
                        iteration: c + 1,
                        accuracy,
                        loss,
                    });
                }
                if c + 1 < spec.iters {
                    req += 1;
                    waiting.insert(req, (w, c + 1, t));
                    pulling[wi] = Some(c + 1);
                    let pull = Input::Pull {
                        worker: w,
                        clock: c + 1,
                        req,
                    };
                    core.handle(t, pull, &mut shard, &mut |o| out.push(o))?;
                } else if mode == UpdateMode::Async {
                    // Done: it holds nobody back any more (ElasticBSP's barriers leave it out,
                    // as the scheduler does for a finished worker). Under synchronous updates
                    // a finished worker has pushed every clock, and the quorum stays whole.
                    core.handle(t, Input::Leave { worker: w }, &mut shard, &mut |o| {
                        out.push(o)
                    })?;
                }
            }
        }
    }
    if !waiting.is_empty() {
        return Err(Error::Config(format!(
            "the policy left {} pulls parked with nothing left to happen (a policy bug)",
            waiting.len()
        )));
    }
    let final_accuracy = if spec.compute {
        evaluate(&*model, shard.values(), &data.test, 0)?.0
    } else {
        0.0
    };
    let digest = shard
        .values()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        });
    let virtual_secs = end as f64 / 1e9;
    let stats = core.stats();
    let parked = stats.per_worker.iter().map(|c| c.parked_pulls).sum();
    let dropped = stats.per_worker.iter().map(|c| c.dropped_gradients).sum();
    let updates = stats.updates;
    Ok(SimReport {
        policy: core.policy().name(),
        workers: spec.workers,
        iters: spec.iters,
        virtual_secs,
        wall_secs: wall.elapsed().as_secs_f64(),
        gradient_secs: grad_wall.as_secs_f64(),
        iterations_per_sec: (u64::from(spec.workers) * spec.iters) as f64 / virtual_secs.max(1e-12),
        time_to_target: curve
            .iter()
            .find(|e| e.accuracy >= spec.target)
            .map(|e| e.secs),
        curve,
        final_accuracy,
        blocked_secs: blocked.iter().map(|&b| b as f64 / 1e9).collect(),
        parked_pulls: parked,
        dropped,
        transfers_offered: offers,
        transfers_taken: taken,
        tasks_transferred: moved,
        tasks_computed,
        updates,
        bytes_moved: 2 * u64::from(spec.workers) * spec.iters * p as u64 * 4,
        digest,
    })
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
