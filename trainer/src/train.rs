//! Data-parallel training on top of the engine: each worker pulls the model, computes the
//! gradient of its mini-batch as `m` tasks (micro-batches) on its elastic thread pool,
//! pushes it, and lets the policy decide when it may go on.
//!
//! # One iteration of worker `w` at clock `c`
//!
//! 1. Pull the parameters at clock `c` (asynchronously). While the pull is parked by the
//!    policy (`w` is a pioneer that would block), take task-transfer offers: ask the
//!    straggler for up to half an iteration of its unprocessed tasks, compute them on `w`'s
//!    current values (the previous pull) and push their gradient credited to the straggler
//!    ([`Worker::push_for`]).
//! 2. Run the iteration's `m` tasks on the pool. Tasks are claimed through a [`TaskSource`]
//!    shared with thieves: whatever a helper took is skipped here. Each pool thread sums its
//!    tasks' gradients into its own buffer; the buffers are summed and scaled by 1/batch
//!    into the registered gradient region.
//! 3. Push the gradient at clock `c`, apply the configured heterogeneity (sleep), report
//!    the iteration's time to the scheduler's supervisor and resize the pool as its
//!    parallelism manager advises.
//!
//! The data a task covers depends only on (worker, clock, task) and the job's seed
//! ([`task_examples`]), so any worker can compute any other's task.
//!
//! Every task of every iteration is processed exactly once: by its owner if it claimed it,
//! by the helper its owner's `TaskSource` gave it to otherwise; the per-task ledger counts
//! ([`WorkerSummary::tasks_own`], `tasks_helped`, `tasks_given`) are reported.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use falcon_engine::Worker;
use falcon_engine::worker::{f32_bytes, f32_bytes_mut};
use serde::Serialize;

use crate::data::{Dataset, Split};
use crate::hetero::Injector;
use crate::model::{Model, Scratch};
use crate::pool::{Pool, TaskSource};
use crate::{Error, Result};

/// The name of the model tensor.
pub const TENSOR: &str = "params";

/// The most pool threads one worker uses.
pub const MAX_SLOTS: usize = 64;

/// How a worker trains.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Examples per worker per iteration.
    pub batch: usize,
    /// Tasks (micro-batches) per iteration; `batch` is cut into this many.
    pub tasks: u32,
    /// Iterations per worker.
    pub iters: u64,
    /// Shuffling seed (the same on every worker).
    pub seed: u64,
    /// Snapshot worker 0's values every this many iterations (0: only the end is evaluated).
    pub eval_every: u64,
    /// Test examples each snapshot is evaluated on, after training (the final values are
    /// evaluated on the whole test split).
    pub eval_examples: usize,
    /// Take task-transfer offers.
    pub transfer: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            batch: 64,
            tasks: 4,
            iters: 200,
            seed: 1,
            eval_every: 20,
            eval_examples: 2000,
            transfer: true,
        }
    }
}

/// One evaluation of worker 0's current values.
#[derive(Clone, Debug, Serialize)]
pub struct EvalPoint {
    /// Seconds since training started.
    pub secs: f64,
    /// Worker 0's iteration.
    pub iteration: u64,
    /// Test accuracy in [0, 1].
    pub accuracy: f64,
    /// Mean test loss.
    pub loss: f64,
}

/// Worker 0's values at one moment, to evaluate.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Seconds since training started.
    pub secs: f64,
    /// Worker 0's iteration.
    pub iteration: u64,
    /// The parameters.
    pub params: Vec<f32>,
}

/// What one worker did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkerSummary {
    /// Its rank.
    pub rank: u32,
    /// Iterations done.
    pub iterations: u64,
    /// Seconds from start to its last push.
    pub secs: f64,
    /// Seconds computing its own tasks.
    pub compute_secs: f64,
    /// Seconds waiting for pulls the policy held (including time spent helping).
    pub blocked_secs: f64,
    /// Seconds slept by the heterogeneity injection.
    pub injected_secs: f64,
    /// Seconds computing other workers' tasks.
    pub helping_secs: f64,
    /// Its own tasks it processed.
    pub tasks_own: u64,
    /// Its tasks taken by helpers.
    pub tasks_given: u64,
    /// Other workers' tasks it processed.
    pub tasks_helped: u64,
    /// Tasks of dead workers it computed in their place.
    pub tasks_covered: u64,
    /// Thread count per iteration (the parallelism manager's decisions).
    pub threads: Vec<usize>,
    /// Final training loss of its last iteration (mean per example).
    pub last_loss: f64,
}

/// The examples of task `task` of `worker`'s iteration `clock` (empty past the iteration):
/// its share of the training split in this epoch's order, cut into batches, each cut into
/// `tasks` micro-batches. Depends only on its arguments, so a helper computes exactly what
/// the owner would have.
pub fn task_examples(
    order: &dyn Fn(u32, u64) -> Arc<Vec<usize>>,
    worker: u32,
    clock: u64,
    task: u32,
    cfg: &TrainConfig,
) -> Vec<usize> {
    let share = order(worker, 0).len();
    let per_epoch = (share / cfg.batch.max(1)).max(1) as u64;
    let epoch = clock / per_epoch;
    let k = (clock % per_epoch) as usize;
    let idx = order(worker, epoch);
    let batch = &idx[(k * cfg.batch).min(idx.len())..((k + 1) * cfg.batch).min(idx.len())];
    let tasks = cfg.tasks.max(1) as usize;
    let (t, n) = (task as usize, batch.len());
    batch[(t * n / tasks).min(n)..((t + 1) * n / tasks).min(n)].to_vec()
}

/// One worker's visiting order of the training split in one epoch.
type Order = Arc<Vec<usize>>;

/// Per-(worker, epoch) shuffled orders, computed once.
#[derive(Default)]
struct Orders {
    cache: Mutex<HashMap<(u32, u64), Order>>,
}

impl Orders {
    fn get(
        &self,
        split: &Split,
        worker: u32,
        workers: u32,
        epoch: u64,
        seed: u64,
    ) -> Arc<Vec<usize>> {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if c.len() > 64 {
            c.clear();
        }
        c.entry((worker, epoch))
            .or_insert_with(|| Arc::new(split.batch_indices(worker, workers, epoch, seed)))
            .clone()
    }
}

/// Per-thread working memory of the pool.
struct Slot {
    grad: Vec<f32>,
    x: Vec<f32>,
    y: Vec<u8>,
    scratch: Scratch,
    loss: f64,
    tasks: u64,
}

/// What the pool's threads share with the worker's loop.
struct Shared {
    model: Arc<dyn Model>,
    data: Arc<Dataset>,
    cfg: TrainConfig,
    workers: u32,
    orders: Orders,
    slots: Vec<Mutex<Slot>>,
    /// The values of the latest pull: what this worker's tasks are computed on.
    params: RwLock<Vec<f32>>,
    /// The first error a pool thread met.
    failure: Mutex<Option<Error>>,
    /// The heterogeneity injection.
    injector: Injector,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn order(&self, w: u32, e: u64) -> Arc<Vec<usize>> {
        self.orders
            .get(&self.data.train, w, self.workers, e, self.cfg.seed)
    }

    /// Adds the gradient of `tasks` of `owner`'s iteration `clock` on `params` into the
    /// slot's buffer.
    fn compute_tasks(
        &self,
        params: &[f32],
        owner: u32,
        clock: u64,
        tasks: Range<usize>,
        slot: &mut Slot,
    ) -> Result<()> {
        let order = |w, e| self.order(w, e);
        for t in tasks {
            let ex = task_examples(&order, owner, clock, t as u32, &self.cfg);
            if ex.is_empty() {
                continue;
            }
            slot.x.clear();
            slot.y.clear();
            for &i in &ex {
                slot.x.extend_from_slice(self.data.train.image(i));
                slot.y.push(self.data.train.label(i));
            }
            if slot.grad.len() != params.len() {
                slot.grad = vec![0.0; params.len()];
            }
            let (loss, _) =
                self.model
                    .grad(params, &slot.x, &slot.y, &mut slot.grad, &mut slot.scratch)?;
            slot.loss += f64::from(loss);
            slot.tasks += 1;
        }
        Ok(())
    }
}

/// One worker's trainer.
pub struct Trainer {
    worker: Worker,
    shared: Arc<Shared>,
    pool: Pool,
    source: Arc<TaskSource>,
    metrics: Option<Metrics>,
}

/// Where per-iteration metrics go: one JSON object per line, shared by a job's workers.
pub type Metrics = Arc<Mutex<dyn std::io::Write + Send>>;

impl Trainer {
    /// A trainer for `worker`, starting with `threads` pool threads.
    pub fn new(
        worker: Worker,
        model: Arc<dyn Model>,
        data: Arc<Dataset>,
        cfg: TrainConfig,
        threads: usize,
        injector: Injector,
    ) -> Result<Trainer> {
        if cfg.batch == 0 || cfg.tasks == 0 || cfg.tasks as usize > cfg.batch {
            return Err(Error::Config(format!(
                "batch {} cut into {} tasks: need 1 ≤ tasks ≤ batch",
                cfg.batch, cfg.tasks
            )));
        }
        let share = data.train.len() / worker.workers().max(1) as usize;
        if cfg.batch > share {
            return Err(Error::Config(format!(
                "batch {} is larger than each worker's share of the training set ({share} of {} \
                 examples over {} workers)",
                cfg.batch,
                data.train.len(),
                worker.workers()
            )));
        }
        if data.train.features() != model.input_len() {
            return Err(Error::Config(format!(
                "the model takes {} inputs, the data has {} features",
                model.input_len(),
                data.train.features()
            )));
        }
        let source = Arc::new(TaskSource::new(0)?);
        // A helper asks for tasks of our iteration `clock`: give the tail of what is left,
        // only if that iteration is the one in the source (checked in the same atomic step).
        {
            let source = source.clone();
            worker.on_steal(
                move |clock, want| match source.steal_for(clock, want as usize) {
                    Some(s) => s.tasks.start as u32..s.tasks.end as u32,
                    None => 0..0,
                },
            );
        }
        let micro = cfg.batch.div_ceil(cfg.tasks as usize);
        let slots = (0..MAX_SLOTS)
            .map(|_| {
                Mutex::new(Slot {
                    grad: Vec::new(),
                    x: Vec::with_capacity(micro * model.input_len()),
                    y: Vec::with_capacity(micro),
                    scratch: model.scratch(micro),
                    loss: 0.0,
                    tasks: 0,
                })
            })
            .collect();
        let workers = worker.workers();
        Ok(Trainer {
            shared: Arc::new(Shared {
                params: RwLock::new(vec![0.0; model.num_params()]),
                model,
                data,
                cfg,
                workers,
                orders: Orders::default(),
                slots,
                failure: Mutex::new(None),
                injector,
            }),
            worker,
            pool: Pool::new(threads.clamp(1, MAX_SLOTS))?,
            source,
            metrics: None,
        })
    }

    /// Writes a JSON line per iteration to `sink`: time, worker, iteration, compute,
    /// blocked, injected and helping time, threads, tasks, bytes moved.
    pub fn with_metrics(mut self, sink: Metrics) -> Trainer {
        self.metrics = Some(sink);
        self
    }

    /// Trains `cfg.iters` iterations; worker 0 hands a copy of its values to `on_snapshot`
    /// every `eval_every` iterations.
    pub fn run(&mut self, mut on_snapshot: impl FnMut(Snapshot)) -> Result<WorkerSummary> {
        let w = self.worker.clone();
        refuse_local(w.optimizer())?;
        let sh = self.shared.clone();
        let cfg = sh.cfg.clone();
        let n = sh.model.num_params();
        let pulled = w.buffer(TENSOR)?;
        let grad_region = w.buffer(TENSOR)?;
        let mut grad = vec![0f32; n];
        let help_region = w.buffer(TENSOR)?;
        let mut help = Slot {
            grad: vec![0f32; n],
            x: Vec::new(),
            y: Vec::new(),
            scratch: Scratch::new(),
            loss: 0.0,
            tasks: 0,
        };
        let mut sum = WorkerSummary {
            rank: w.rank(),
            ..Default::default()
        };
        let rank = w.rank();
        let start = Instant::now();
        // (sum, count) of push staleness already reported in the metrics.
        let mut acked = (0u64, 0u64);
        let scale = 1.0 / cfg.batch as f32;
        // A worker rejoining a running job starts at the current clock. Its first pull is a
        // pull of its own; every later one rides in the previous iteration's push.
        let first = w.clock();
        let mut next = None;
        for c in first..cfg.iters {
            // 1. Pull; help while the policy holds us.
            let t0 = Instant::now();
            let (helping_before, helped_before) = (sum.helping_secs, sum.tasks_helped);
            let h = match next.take() {
                Some(h) => h,
                None => w.pull_async(TENSOR, &pulled, c)?,
            };
            while !h.ready() {
                let mut helped = false;
                if cfg.transfer && c > 0 {
                    for offer in w.offers() {
                        let r = w.steal(offer.straggler, offer.clock, cfg.tasks.div_ceil(2))?;
                        if r.is_empty() {
                            continue;
                        }
                        let th = Instant::now();
                        help.grad.iter_mut().for_each(|g| *g = 0.0);
                        {
                            let params = sh.params.read().unwrap_or_else(|p| p.into_inner());
                            sh.compute_tasks(
                                &params,
                                offer.straggler,
                                offer.clock,
                                r.start as usize..r.end as usize,
                                &mut help,
                            )?;
                        }
                        help.grad.iter_mut().for_each(|g| *g *= scale);
                        help_region.write_at(0, f32_bytes(&help.grad))?;
                        w.push_for(TENSOR, &help_region, offer.straggler, offer.clock)?;
                        sum.tasks_helped += u64::from(r.end - r.start);
                        sum.helping_secs += th.elapsed().as_secs_f64();
                        helped = true;
                    }
                }
                if !helped {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            h.wait()?;
            let t0_blocked = t0.elapsed();
            sum.blocked_secs += t0_blocked.as_secs_f64();
            {
                let mut params = sh.params.write().unwrap_or_else(|p| p.into_inner());
                pulled.read_at(0, f32_bytes_mut(&mut params))?;
            }

            // 2. This iteration's tasks on the pool.
            let tc = Instant::now();
            for s in &sh.slots {
                let mut s = lock(s);
                s.grad.iter_mut().for_each(|g| *g = 0.0);
                s.loss = 0.0;
                s.tasks = 0;
            }
            self.source.reset(c, cfg.tasks as usize)?;
            let job = sh.clone();
            let per_task = sh.injector.spec().per_task();
            self.pool.run(&self.source, move |task, slot| {
                let t = Instant::now();
                {
                    let params = job.params.read().unwrap_or_else(|p| p.into_inner());
                    let mut s = lock(&job.slots[slot % job.slots.len()]);
                    if let Err(e) = job.compute_tasks(&params, rank, c, task..task + 1, &mut s) {
                        lock(&job.failure).get_or_insert(e);
                    }
                }
                if per_task {
                    job.injector.after_iteration(c, t.elapsed());
                }
            });
            if let Some(e) = lock(&sh.failure).take() {
                return Err(e);
            }
            grad.iter_mut().for_each(|g| *g = 0.0);
            let (mut loss, mut done) = (0.0, 0u64);
            for s in &sh.slots {
                let s = lock(s);
                if s.tasks > 0 {
                    for (g, x) in grad.iter_mut().zip(&s.grad) {
                        *g += x;
                    }
                    loss += s.loss;
                    done += s.tasks;
                }
            }
            grad.iter_mut().for_each(|g| *g *= scale);
            let compute = tc.elapsed();
            sum.compute_secs += compute.as_secs_f64();
            sum.tasks_own += done;
            sum.tasks_given += u64::from(cfg.tasks).saturating_sub(done);
            let examples_per_task = cfg.batch as f64 / f64::from(cfg.tasks);
            sum.last_loss = loss / (done.max(1) as f64 * examples_per_task);

            // A dead worker's tasks go to the survivors: each of its iterations to one of
            // them in turn, added to that one's gradient (the step still sees every batch).
            let dead = w.dead_workers();
            if !dead.is_empty() {
                let live: Vec<u32> = (0..w.workers()).filter(|r| !dead.contains(r)).collect();
                for &d in &dead {
                    if live.is_empty() || live[(c as usize + d as usize) % live.len()] != rank {
                        continue;
                    }
                    let th = Instant::now();
                    help.grad.iter_mut().for_each(|g| *g = 0.0);
                    let params = sh.params.read().unwrap_or_else(|p| p.into_inner());
                    sh.compute_tasks(&params, d, c, 0..cfg.tasks as usize, &mut help)?;
                    drop(params);
                    for (g, h) in grad.iter_mut().zip(&help.grad) {
                        *g += h * scale;
                    }
                    sum.tasks_covered += u64::from(cfg.tasks);
                    sum.helping_secs += th.elapsed().as_secs_f64();
                }
            }

            // 3. Push, heterogeneity, parallelism.
            grad_region.write_at(0, f32_bytes(&grad))?;
            if c + 1 < cfg.iters {
                // The next iteration's values asked for in the push: one exchange.
                let (pushed, pulled_next) = w.push_pull_async(TENSOR, &grad_region, &pulled, c)?;
                pushed.wait()?;
                next = Some(pulled_next);
            } else {
                w.push(TENSOR, &grad_region, c)?;
            }
            sum.iterations = c + 1;
            let injected = if per_task {
                // Slept inside the tasks: the share of the task phase that was not compute.
                let d = sh.injector.delay(c, Duration::from_secs(1)).as_secs_f64();
                compute.mul_f64(d / (1.0 + d))
            } else {
                sh.injector.after_iteration(c, compute)
            };
            sum.injected_secs += injected.as_secs_f64();
            let threads = self.pool.threads();
            sum.threads.push(threads);
            // To the scheduler's supervisor: the iteration as the job sees it, compute and
            // injected slowness; its advice applies from the next iteration.
            let iteration = if per_task {
                compute
            } else {
                compute + injected
            };
            w.report_iteration(threads, done as u32, iteration)?;
            if let Some(m) = &self.metrics {
                // Staleness of the pushes acknowledged since the last line.
                let st = w.stats();
                let (stale, acks) = (st.staleness_sum - acked.0, st.staleness_acks - acked.1);
                acked = (st.staleness_sum, st.staleness_acks);
                let line = serde_json::json!({
                    "t": start.elapsed().as_secs_f64(),
                    "worker": rank,
                    "iteration": c,
                    "compute_s": compute.as_secs_f64(),
                    "blocked_s": t0_blocked.as_secs_f64(),
                    "injected_s": injected.as_secs_f64(),
                    "iteration_s": iteration.as_secs_f64(),
                    "helping_s": sum.helping_secs - helping_before,
                    "threads": threads,
                    "tasks_own": done,
                    "tasks_helped": sum.tasks_helped - helped_before,
                    "loss": sum.last_loss,
                    // The iteration's push and pull of the whole model, in bytes.
                    "bytes": 2 * n as u64 * 4,
                    "staleness": (acks > 0).then(|| stale as f64 / acks as f64),
                });
                let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                let _ = writeln!(m, "{line}");
            }
            if let Some(next) = w.advised_threads().map(|n| n.clamp(1, MAX_SLOTS))
                && next != threads
            {
                self.pool.resize(next)?;
            }
            if rank == 0 && cfg.eval_every > 0 && (c + 1) % cfg.eval_every == 0 {
                // A copy, evaluated elsewhere: evaluating here would slow worker 0, and with
                // it every policy that waits for worker 0.
                let params = sh.params.read().unwrap_or_else(|p| p.into_inner());
                on_snapshot(Snapshot {
                    secs: start.elapsed().as_secs_f64(),
                    iteration: c + 1,
                    params: params.clone(),
                });
            }
        }
        sum.secs = start.elapsed().as_secs_f64();
        Ok(sum)
    }
}

/// Test accuracy and mean loss of `params` on the first `limit` examples of `split` (all
/// when `limit` is 0 or larger).
pub fn evaluate(
    model: &dyn Model,
    params: &[f32],
    split: &Split,
    limit: usize,
) -> Result<(f64, f64)> {
    let n = if limit == 0 {
        split.len()
    } else {
        limit.min(split.len())
    };
    if n == 0 {
        return Err(Error::Config("no test examples to evaluate on".into()));
    }
    let chunk = model.chunk().max(1);
    let mut scratch = model.scratch(chunk);
    let (mut loss, mut correct) = (0f64, 0usize);
    let f = split.features();
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let x = &split.images[start * f..end * f];
        let y = &split.labels[start..end];
        let (l, c) = model.evaluate(params, x, y, &mut scratch)?;
        loss += f64::from(l);
        correct += c;
        start = end;
    }
    Ok((correct as f64 / n as f64, loss / n as f64))
}

/// The Rust trainer pushes gradients for the servers' optimizer to apply: a job whose
/// workers apply their own (`local`) is not one it can train.
pub fn refuse_local(opt: falcon_engine::update::Optimizer) -> Result<()> {
    if let falcon_engine::update::Optimizer::Local { .. } = opt {
        return Err(Error::Config(
            "this job's servers apply no optimizer (FALCON_OPTIMIZER=local: each worker applies \
             its own, as falcon.torch's DistributedOptimizer does); the Rust trainer and the \
             synthetic workloads push gradients for the servers to apply: start the job with \
             sgd, momentum(MU), adam or adagrad"
                .into(),
        ));
    }
    Ok(())
}
