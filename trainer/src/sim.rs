//! The deterministic simulator (`falcon sim`): discrete events in virtual time, `N` workers
//! with speed profiles, the engine's real synchronization policies, and the real model
//! computing real gradients on real data. No threads, no clock reads: the same spec and seed
//! give the same result, bit for bit.
//!
//! # Model of a job
//!
//! One parameter server shard holds the whole model (every shard of a real job runs the same
//! policy on the same events, so one instance stands for all). Worker `w`'s iteration `c`:
//!
//! 1. its pull for clock `c` reaches the policy; when released at virtual time `t`, the
//!    worker starts at `t + latency` on the server's values *at release* (FluentPS's lazy
//!    execution: a released pull gets the latest values) and computes its gradient then;
//! 2. its iteration takes `base × (1 ± jitter)` plus the delay of its heterogeneity profile
//!    ([`Hetero::delay`]: ratio, Gaussian, episodes; contention has no meaning here);
//! 3. its push reaches the server `latency` later: applied at once under asynchronous
//!    updates (SGD, `lr`), or summed per clock and applied when the policy's quorum of live
//!    workers is in (BSP, Sync-opt; late gradients Sync-opt drops are counted), then the
//!    worker's pull for `c + 1` reaches the policy.
//!
//! ElasticBSP runs as its single job-wide state machine ([`ElasticBsp`]). Task-transfer offers
//! (EPSP, FlexRR) are counted, not carried out: the simulator has no task model; the real
//! trainer and `falcon train` do transfer tasks.
//!
//! Time to accuracy: worker 0's values are evaluated every `eval_every` of its iterations on
//! the first `eval_examples` test images.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Instant;

use falcon_engine::sync::{Action, ElasticBsp, Event, PolicySpec, SyncPolicy};
use falcon_engine::update::UpdateMode;
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
    /// Server-side SGD learning rate (per gradient; synchronous clocks apply the sum).
    pub lr: f32,
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
            seed: 1,
            base_ns: 10_000_000,
            jitter: 0.1,
            latency_ns: 50_000,
            hetero: Vec::new(),
            eval_every: 10,
            eval_examples: 500,
            compute: true,
            target: 0.7,
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
    /// Task transfers the policy offered (not carried out here).
    pub transfers_offered: u64,
    /// Updates applied to the parameters.
    pub updates: u64,
    /// A digest of the final parameters (bit-for-bit reproducibility).
    pub digest: u64,
}

/// Synchronous updates: applies, in clock order, every clock that has its quorum of counted
/// gradients among `live` workers (`apply(sum)`), then tells the policy who pushed (unless it
/// judged the arrivals itself).
fn apply_ready(
    pending: &mut BTreeMap<u64, (Vec<f32>, Vec<u32>)>,
    next_apply: &mut u64,
    policy: &mut dyn SyncPolicy,
    live: u32,
    t: u64,
    out: &mut Vec<Action>,
    apply: &mut dyn FnMut(&[f32]),
) {
    let quorum = policy.step_quorum(live).max(1) as usize;
    while pending
        .get(next_apply)
        .is_some_and(|(_, who)| who.len() >= quorum)
    {
        let (sum, who) = pending.remove(next_apply).expect("present");
        apply(&sum);
        if !policy.judges_arrivals() {
            for worker in who {
                policy.on_event(
                    Event::Push {
                        worker,
                        clock: *next_apply,
                        at: t,
                    },
                    out,
                );
            }
        }
        *next_apply += 1;
    }
}

impl SimReport {
    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Worker `w`'s push of clock `c` reaches the server.
    Push(u32, u64),
    /// Worker `w`'s released pull of clock `c` reaches it: it starts iteration `c`.
    Start(u32, u64),
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
    let mut policy: Box<dyn SyncPolicy> = match spec.policy.job_barriers() {
        Some(r) => Box::new(ElasticBsp::new(spec.workers, r as usize)),
        None => spec.policy.build_for(spec.workers, 0),
    };
    let mode = match spec.policy {
        PolicySpec::Bsp | PolicySpec::SyncOpt { .. } => UpdateMode::Sync,
        _ => UpdateMode::Async,
    };
    let p = model.num_params();
    let mut params = model.init_vec(spec.seed);
    let mut scratch = Scratch::new();
    let mut x = Vec::new();
    let mut y = Vec::new();
    // Each worker's gradient of the iteration in flight (computed at its start).
    let mut grads: Vec<Vec<f32>> = vec![Vec::new(); n];
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
    let (mut parked, mut dropped, mut offers, mut updates) = (0u64, 0u64, 0u64, 0u64);
    // Synchronous clocks: the sum of their counted gradients and who pushed them.
    let mut pending: BTreeMap<u64, (Vec<f32>, Vec<u32>)> = BTreeMap::new();
    let mut next_apply = 0u64;
    let mut curve = Vec::new();
    let mut end = 0u64;
    let mut grad_wall = std::time::Duration::ZERO;
    let mut out: Vec<Action> = Vec::new();
    let live = spec.workers;

    // Every worker pulls clock 0 at time 0.
    for w in 0..spec.workers {
        req += 1;
        waiting.insert(req, (w, 0, 0));
        policy.on_event(
            Event::Pull {
                worker: w,
                clock: 0,
                req,
                at: 0,
            },
            &mut out,
        );
    }
    loop {
        // Carry out the actions of the last event (at time `end`).
        let now = end;
        for a in std::mem::take(&mut out) {
            match a {
                Action::Release { req: r, .. } => {
                    if let Some((w, c, since)) = waiting.remove(&r) {
                        let at = since.max(now);
                        blocked[w as usize] += at - since;
                        push_ev(&mut queue, at + spec.latency_ns, Ev::Start(w, c));
                    }
                }
                Action::Park { .. } => parked += 1,
                Action::DropGradient { .. } => dropped += 1,
                Action::Transfer { .. } => offers += 1,
                _ => {}
            }
        }
        let Some(Reverse((t, _, ev))) = queue.pop() else {
            break;
        };
        end = end.max(t);
        match ev {
            Ev::Start(w, c) => {
                let wi = w as usize;
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
                    model.grad(&params, &x, &y, g, &mut scratch)?;
                    grad_wall += tg.elapsed();
                    let inv = 1.0 / spec.batch as f32;
                    g.iter_mut().for_each(|v| *v *= inv);
                }
                let u = (splitmix(spec.seed ^ (u64::from(w) << 40) ^ c) >> 11) as f64
                    / (1u64 << 53) as f64;
                let d = spec.base_ns as f64 * (1.0 + spec.jitter * (2.0 * u - 1.0));
                let d = std::time::Duration::from_nanos(d as u64);
                let extra = spec.hetero.get(wi).map_or(std::time::Duration::ZERO, |h| {
                    h.delay(spec.seed ^ u64::from(w), c, d)
                });
                let took = (d + extra).as_nanos() as u64;
                push_ev(&mut queue, t + took + spec.latency_ns, Ev::Push(w, c));
            }
            Ev::Push(w, c) => {
                let wi = w as usize;
                let g = std::mem::take(&mut grads[wi]);
                match mode {
                    UpdateMode::Async => {
                        if spec.compute {
                            for (pv, gv) in params.iter_mut().zip(&g) {
                                *pv -= spec.lr * gv;
                            }
                        }
                        updates += 1;
                        policy.on_event(
                            Event::Push {
                                worker: w,
                                clock: c,
                                at: t,
                            },
                            &mut out,
                        );
                    }
                    UpdateMode::Sync => {
                        let mut counts = true;
                        if policy.judges_arrivals() {
                            let mut judged = Vec::new();
                            policy.on_event(
                                Event::Push {
                                    worker: w,
                                    clock: c,
                                    at: t,
                                },
                                &mut judged,
                            );
                            for a in judged {
                                if a == (Action::DropGradient {
                                    worker: w,
                                    clock: c,
                                }) {
                                    counts = false;
                                    dropped += 1;
                                } else {
                                    out.push(a);
                                }
                            }
                        }
                        if counts {
                            let e = pending
                                .entry(c)
                                .or_insert_with(|| (vec![0.0; p], Vec::new()));
                            if spec.compute {
                                for (s, gv) in e.0.iter_mut().zip(&g) {
                                    *s += gv;
                                }
                            }
                            e.1.push(w);
                        }
                        apply_ready(
                            &mut pending,
                            &mut next_apply,
                            &mut *policy,
                            live,
                            t,
                            &mut out,
                            &mut |sum| {
                                updates += 1;
                                if spec.compute {
                                    for (pv, s) in params.iter_mut().zip(sum) {
                                        *pv -= spec.lr * s;
                                    }
                                }
                            },
                        );
                    }
                }
                grads[wi] = g;
                if w == 0 && spec.compute && spec.eval_every > 0 && (c + 1) % spec.eval_every == 0 {
                    let (accuracy, loss) =
                        evaluate(&*model, &params, &data.test, spec.eval_examples)?;
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
                    policy.on_event(
                        Event::Pull {
                            worker: w,
                            clock: c + 1,
                            req,
                            at: t,
                        },
                        &mut out,
                    );
                } else if mode == UpdateMode::Async {
                    // Done: it holds nobody back any more (ElasticBSP's barriers leave it out,
                    // as the scheduler does for a finished worker). Under synchronous updates
                    // a finished worker has pushed every clock, and the quorum stays whole.
                    policy.on_event(Event::Leave { worker: w, at: t }, &mut out);
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
        evaluate(&*model, &params, &data.test, 0)?.0
    } else {
        0.0
    };
    let digest = params.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
    });
    let virtual_secs = end as f64 / 1e9;
    Ok(SimReport {
        policy: policy.name(),
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
        updates,
        digest,
    })
}
