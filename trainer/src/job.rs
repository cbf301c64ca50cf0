//! A whole training job on an embedded local cluster: a scheduler, servers and one thread
//! per worker in this process, over the real transport (what `falcon train` runs).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use falcon_engine::keys::TensorSpec;
use falcon_engine::local::{LocalCluster, RoleFailure};
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::{Aggregate, Optimizer, ScaleSpec};
use falcon_engine::worker::f32_bytes;
use falcon_engine::{JobConfig, SupervisorSettings};
use falcon_transport::Medium;
use serde::Serialize;

use crate::data::Dataset;
use crate::device::Device;
use crate::hetero::{Hetero, Injector};
use crate::model::{Model, ModelSpec};
use crate::train::{EvalPoint, Snapshot, TENSOR, TrainConfig, Trainer, WorkerSummary, evaluate};
use crate::{Error, Result};

/// Test examples of the progress bar's live accuracy estimate.
const LIVE_EXAMPLES: usize = 200;

/// How often the live estimate is refreshed (it takes CPU from the workers).
const LIVE_EVERY: Duration = Duration::from_millis(500);

/// A local training job.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Workers.
    pub workers: u32,
    /// Servers.
    pub servers: u32,
    /// Synchronization policy.
    pub policy: PolicySpec,
    /// The model.
    pub model: ModelSpec,
    /// Where the workers' models compute (`auto` falls back to the CPU, see
    /// [`crate::device`]).
    pub device: Device,
    /// Per-worker training knobs.
    pub train: TrainConfig,
    /// Server-side SGD learning rate (gradients of a clock are summed under synchronous
    /// policies, applied one by one otherwise: the same step per gradient either way).
    pub lr: f32,
    /// The servers' optimizer (`None`: SGD at [`JobSpec::lr`]).
    pub optimizer: Option<Optimizer>,
    /// How a synchronous step's gradients combine.
    pub aggregate: Aggregate,
    /// Initial pool threads per worker.
    pub threads: usize,
    /// Let the parallelism manager change thread counts.
    pub elastic: bool,
    /// Threads each worker's machine can run at once (the manager's budget and knee; 0: this
    /// host's cores).
    pub budget: usize,
    /// Heterogeneity of each worker (missing: none).
    pub hetero: Vec<Hetero>,
    /// Medium between the nodes.
    pub medium: Medium,
    /// The test accuracy whose first crossing is reported as time to accuracy.
    pub target: f64,
    /// Where per-iteration metrics go (JSON lines), if anywhere.
    pub metrics: Option<PathBuf>,
    /// Staleness scaling of asynchronously applied gradients (DynSGD, ConSGD).
    pub scale: ScaleSpec,
    /// The roles' heartbeat interval and timeouts.
    pub timeouts: Timeouts,
    /// A failure to inject into one worker (tests of how a job ends when a role fails).
    pub fault: Option<Fault>,
    /// Where the scheduler serves the job's metrics for Prometheus (`http://ADDR/metrics`).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The servers checkpoint into this directory (every second); the job is then named
    /// after its configuration, so that a later run of the same configuration may resume.
    pub checkpoint: Option<std::path::PathBuf>,
    /// Start from the checkpoints in `checkpoint` of an earlier run of this configuration.
    pub resume: bool,
}

/// A failure injected into one worker's thread, `after` it starts: an error it returns, or a
/// panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The worker.
    pub rank: u32,
    /// When, after its thread starts.
    pub after: Duration,
    /// Panic (else return an error).
    pub panic: bool,
}

/// The heartbeat interval and timeouts of a job's roles (see [`JobConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// How often every role sends a heartbeat.
    pub heartbeat: Duration,
    /// How long the scheduler waits for a silent role before it declares it dead (`None`:
    /// never). The default here is never: the roles of this job are threads of one process,
    /// so a role cannot die alone (an error or a panic is reported as such, at once), and a
    /// silent one is a hung thread, a bug to see rather than to evict; while a loaded
    /// machine (the workers' compute, injected slowness) could delay heartbeats past any
    /// timeout and evict healthy workers.
    pub suspicion: Option<Duration>,
    /// How long rendezvous may take.
    pub rendezvous: Duration,
    /// The deadline of one transport operation.
    pub op: Duration,
    /// The deadline of one connection handshake.
    pub handshake: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        let d = JobConfig::default();
        Timeouts {
            heartbeat: d.heartbeat,
            suspicion: None,
            rendezvous: d.rendezvous_timeout,
            op: d.transport.op_timeout,
            handshake: d.transport.handshake_timeout,
        }
    }
}

impl Timeouts {
    /// Sets them in a job's configuration.
    pub fn apply(&self, cfg: &mut JobConfig) {
        cfg.heartbeat = self.heartbeat;
        cfg.suspicion = self.suspicion;
        cfg.rendezvous_timeout = self.rendezvous;
        cfg.transport.op_timeout = self.op;
        cfg.transport.handshake_timeout = self.handshake;
    }
}

/// How long a failed job waits for its roles to wind down before it reports the failure.
const WIND_DOWN: Duration = Duration::from_millis(1500);

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            workers: 4,
            servers: 2,
            policy: PolicySpec::Bsp,
            model: ModelSpec::Mlp {
                sizes: vec![784, 256, 10],
            },
            device: Device::Cpu,
            train: TrainConfig::default(),
            lr: 0.05,
            optimizer: None,
            aggregate: Aggregate::Sum,
            threads: 1,
            elastic: true,
            budget: 0,
            hetero: Vec::new(),
            medium: Medium::Auto,
            target: 0.75,
            metrics: None,
            scale: ScaleSpec::Unscaled,
            timeouts: Timeouts::default(),
            fault: None,
            metrics_addr: None,
            checkpoint: None,
            resume: false,
        }
    }
}

/// What a job did.
#[derive(Clone, Debug, Serialize)]
pub struct JobReport {
    /// The policy, as named by the engine.
    pub policy: String,
    /// The model.
    pub model: String,
    /// The servers' optimizer, as the settings spell it (`sgd`, `momentum(0.9)`, …).
    pub optimizer: String,
    /// Its learning rate.
    pub lr: f32,
    /// How a synchronous step's gradients combine.
    pub aggregate: Aggregate,
    /// Where the data came from.
    pub data: String,
    /// Workers and servers.
    pub workers: u32,
    /// Servers.
    pub servers: u32,
    /// Heterogeneity per worker.
    pub hetero: Vec<String>,
    /// Wall seconds of training (rendezvous excluded).
    pub secs: f64,
    /// Worker 0's values over time, each evaluated (after training) on the first
    /// `eval_examples` test examples.
    pub curve: Vec<EvalPoint>,
    /// Test accuracy of the final parameters on the whole test split.
    pub final_accuracy: f64,
    /// Their mean test loss.
    pub final_loss: f64,
    /// The target accuracy.
    pub target: f64,
    /// Seconds until worker 0 first evaluated at or above the target (None: never).
    pub time_to_target: Option<f64>,
    /// Per worker.
    pub per_worker: Vec<WorkerSummary>,
    /// Parked pulls (all servers).
    pub parked_pulls: u64,
    /// Gradients the policy dropped (Sync-opt's late ones; all servers).
    pub dropped_gradients: u64,
    /// Late gradients folded into a later step (`syncopt(…,fold)`; all servers).
    pub folded_gradients: u64,
    /// Bytes moved between workers and servers: gradients pushed, parameters the servers
    /// sent and parameters the workers read one-sided.
    pub bytes_moved: u64,
    /// Mean staleness of the applied gradients, in versions of their shard.
    pub mean_staleness: f64,
    /// Task transfers offered.
    pub transfers_offered: u64,
    /// Tasks moved from stragglers to helpers.
    pub tasks_transferred: u64,
    /// Times the parallelism manager re-planned.
    pub parallelism_plans: u64,
    /// The final parameters, flat in the model's layout (not in the JSON report; `falcon
    /// train --save` writes them).
    #[serde(skip)]
    pub final_values: Vec<f32>,
    /// The supervisor's last class of each worker (pioneer, transient, persistent, unknown).
    pub classes: Vec<String>,
    /// The iteration a resumed job went on from (its servers' checkpoints).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_at: Option<u64>,
}

impl JobReport {
    /// The report as pretty JSON.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Progress a job reports while it runs.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Iterations done by all workers together.
    pub iterations: u64,
    /// Of how many.
    pub total: u64,
    /// Seconds since training started.
    pub secs: f64,
    /// Seconds the workers' pulls spent waiting for the policy (all workers together).
    pub blocked_secs: f64,
    /// A rough live estimate (a few test examples) of worker 0's latest snapshot, if any.
    pub last: Option<EvalPoint>,
}

/// Runs `spec` on `data`; `progress` is called now and then (from the calling thread).
pub fn run_local(
    spec: &JobSpec,
    data: &Arc<Dataset>,
    mut progress: impl FnMut(&Progress),
) -> Result<JobReport> {
    let (model, _) = crate::device::build(&spec.model, spec.device)?;
    let model: Arc<dyn Model> = model.into();
    // Refuse a bad configuration before starting anything.
    check_spec(spec, &*model, data)?;
    let cfg = job_config(spec, &*model)?;
    let optimizer = cfg.optimizer;
    let metrics: Option<crate::train::Metrics> = match &spec.metrics {
        Some(path) => Some(Arc::new(Mutex::new(std::io::BufWriter::new(
            std::fs::File::create(path)?,
        )))),
        None => None,
    };
    check_resume(&cfg)?;
    let tensors = vec![TensorSpec::new(TENSOR, model.num_params() as u64)];
    let cluster = LocalCluster::start(cfg, tensors)?;
    // Initial values from worker 0, before anyone pulls (a resumed job's servers keep the
    // values they restored: the first initialization of a shard wins).
    let w0 = &cluster.workers[0];
    let resumed_at = spec.resume.then(|| w0.clock());
    let init = w0.buffer(TENSOR)?;
    init.write_at(0, f32_bytes(&model.init_vec(spec.train.seed)))?;
    w0.init(TENSOR, &init)?;
    let run = Running {
        done: Arc::new(AtomicU64::new(0)),
        snapshots: Arc::default(),
        failures: cluster.failures().clone(),
        start: Instant::now(),
    };
    let handles = spawn_workers(spec, &cluster, &model, data, metrics, &run);
    if let Some(f) = watch(
        spec,
        &cluster,
        &*model,
        data,
        &run,
        handles.len(),
        &mut progress,
    ) {
        return Err(stop(cluster, handles, &run.done, f));
    }
    let results: Vec<Result<WorkerSummary>> = handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| {
            h.join().unwrap_or_else(|payload| {
                Err(Error::Role(RoleFailure::panicked(
                    "worker", r as u32, &*payload,
                )))
            })
        })
        .collect();
    let secs = run.start.elapsed().as_secs_f64();
    let fast_pull_bytes: u64 = cluster
        .workers
        .iter()
        .map(|w| w.stats().fast_pull_bytes)
        .sum();
    let keymap = cluster.workers[0].keymap().clone();
    let report = cluster.finish()?;
    let per_worker = results.into_iter().collect::<Result<Vec<_>>>()?;
    let params = report.tensor(&keymap, TENSOR)?;
    let (final_accuracy, final_loss) = evaluate(&*model, &params, &data.test, 0)?;
    // The curve, after the fact: every snapshot on the same test examples.
    let snapshots = std::mem::take(&mut *run.snapshots.lock().unwrap_or_else(|e| e.into_inner()));
    let mut curve = Vec::with_capacity(snapshots.len());
    for s in snapshots {
        let (accuracy, loss) = evaluate(&*model, &s.params, &data.test, spec.train.eval_examples)?;
        curve.push(EvalPoint {
            secs: s.secs,
            iteration: s.iteration,
            accuracy,
            loss,
        });
    }
    Ok(job_report(
        spec,
        &*model,
        data,
        (optimizer, secs, resumed_at),
        (curve, final_accuracy, final_loss),
        (per_worker, params, fast_pull_bytes),
        &report,
    ))
}

/// What the threads of a running local job share with its driver.
struct Running {
    /// Workers finished, well or not.
    done: Arc<AtomicU64>,
    /// The parameters as workers saw them along the way, for the curve.
    snapshots: Arc<Mutex<Vec<Snapshot>>>,
    /// The first role that failed.
    failures: falcon_engine::local::FirstFailure,
    start: Instant,
}

/// The checks a job's settings must pass before anything starts.
fn check_spec(spec: &JobSpec, model: &dyn Model, data: &Dataset) -> Result<()> {
    let t = &spec.train;
    if t.batch == 0 || t.tasks == 0 || t.tasks as usize > t.batch {
        return Err(Error::Config(format!(
            "batch {} cut into {} tasks: need 1 ≤ tasks ≤ batch",
            t.batch, t.tasks
        )));
    }
    if let Some(opt) = spec.optimizer {
        crate::train::refuse_local(opt)?;
    }
    let conflict = |e: falcon_engine::checks::Conflict| Error::Config(e.to_string());
    falcon_engine::checks::roles_fit(spec.servers, spec.workers).map_err(conflict)?;
    falcon_engine::checks::policy_fits(&spec.policy, &spec.policy.to_string(), spec.workers)
        .map_err(conflict)?;
    if spec.hetero.len() > spec.workers as usize {
        return Err(Error::Config(format!(
            "heterogeneity given for {} workers; the job has {}",
            spec.hetero.len(),
            spec.workers
        )));
    }
    if data.train.features() != model.input_len() {
        return Err(Error::Config(format!(
            "the model takes {} inputs, the data has {} features",
            model.input_len(),
            data.train.features()
        )));
    }
    Ok(())
}

/// The embedded cluster's configuration: its name (a checkpointed job is named after what
/// its checkpoints hold and how it trains, so that only a run of the same configuration
/// resumes from them), policy, optimizer, timeouts, checkpoints and supervisor.
fn job_config(spec: &JobSpec, model: &dyn Model) -> Result<JobConfig> {
    let job = match &spec.checkpoint {
        Some(_) => format!(
            "train:{}:{}:{}w{}s:{}:{}:seed{}:batch{}x{}",
            model.name(),
            spec.policy,
            spec.workers,
            spec.servers,
            spec.optimizer.unwrap_or(Optimizer::Sgd { lr: spec.lr }),
            match spec.aggregate {
                Aggregate::Mean => "mean",
                Aggregate::Sum => "sum",
            },
            spec.train.seed,
            spec.train.tasks,
            spec.train.batch,
        ),
        None => format!("train-{}", fastrand::u64(..)),
    };
    let mut cfg = JobConfig {
        job,
        token: format!("{:016x}", fastrand::u64(..)),
        servers: spec.servers.max(1),
        workers: spec.workers.max(1),
        policy: spec.policy,
        optimizer: spec.optimizer.unwrap_or(Optimizer::Sgd { lr: spec.lr }),
        aggregate: spec.aggregate,
        scale: spec.scale,
        metrics_addr: spec.metrics_addr,
        ..JobConfig::default()
    };
    spec.timeouts.apply(&mut cfg);
    cfg.transport.medium = spec.medium;
    if let Some(dir) = &spec.checkpoint {
        std::fs::create_dir_all(dir)?;
        cfg.checkpoint = Some(falcon_engine::config::CheckpointSettings {
            resume: spec.resume,
            ..falcon_engine::config::CheckpointSettings::new(dir)
        });
    }
    // The scheduler's supervisor: each worker of the embedded cluster stands for one machine
    // of `budget` threads (on a real cluster each worker has its own host).
    cfg.supervisor = SupervisorSettings {
        elastic: spec.elastic,
        budget: spec.budget,
        knee: spec.budget,
        initial: spec.threads.max(1),
    };
    Ok(cfg)
}

/// A resumed job's checkpoints, refused before anything starts: missing, of another
/// configuration, or damaged (each server checks again when it restores).
fn check_resume(cfg: &JobConfig) -> Result<()> {
    if let Some(c) = cfg.checkpoint.as_ref().filter(|c| c.resume) {
        for rank in 0..cfg.servers {
            falcon_engine::checkpoint::load_to_resume(
                &c.dir,
                rank,
                falcon_engine::config::job_hash(&cfg.job),
                cfg.workers,
            )?;
        }
    }
    Ok(())
}

/// One thread per worker, each training its share and recording its failure, if any. Not
/// scoped: a job that fails reports its failure at once, without waiting for every worker
/// thread to notice.
fn spawn_workers(
    spec: &JobSpec,
    cluster: &LocalCluster,
    model: &Arc<dyn Model>,
    data: &Arc<Dataset>,
    metrics: Option<crate::train::Metrics>,
    run: &Running,
) -> Vec<std::thread::JoinHandle<Result<WorkerSummary>>> {
    let mut handles = Vec::with_capacity(cluster.workers.len());
    let failures = &run.failures;
    for worker in &cluster.workers {
        let (worker, model, data, done, snapshots, metrics, fail) = (
            worker.clone(),
            model.clone(),
            data.clone(),
            run.done.clone(),
            run.snapshots.clone(),
            metrics.clone(),
            failures.clone(),
        );
        let hetero = spec
            .hetero
            .get(worker.rank() as usize)
            .cloned()
            .unwrap_or(Hetero::None);
        let (train, threads) = (spec.train.clone(), spec.threads);
        let rank = worker.rank();
        let fault = spec.fault.filter(|f| f.rank == rank);
        let body = move || -> Result<WorkerSummary> {
            let run = || {
                if let Some(f) = fault {
                    std::thread::sleep(f.after);
                    if f.panic {
                        panic!("injected fault: worker {rank} panics");
                    }
                    return Err(Error::Config(format!(
                        "injected fault: worker {rank} fails"
                    )));
                }
                let injector = Injector::new(hetero, u64::from(worker.rank()) + 17)?;
                let mut t = Trainer::new(worker.clone(), model, data, train, threads, injector)?;
                if let Some(m) = metrics {
                    t = t.with_metrics(m);
                }
                t.run(|p| {
                    snapshots.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                })
            };
            let out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
                Ok(Ok(summary)) => Ok(summary),
                Ok(Err(e)) => {
                    let e = Arc::new(e);
                    fail.record(RoleFailure::Failed {
                        role: "worker",
                        rank,
                        error: e.clone(),
                    });
                    Err(Error::Config(format!("worker {rank} failed: {e}")))
                }
                Err(payload) => {
                    let f = RoleFailure::panicked("worker", rank, &*payload);
                    fail.record(f.clone());
                    Err(Error::Role(f))
                }
            };
            // Done, well or not. Leave at once: under barrier policies the others must not
            // wait for us (a failed worker's peers see it leave).
            done.fetch_add(1, Ordering::Relaxed);
            let _ = worker.finish();
            out
        };
        let h = std::thread::Builder::new()
            .name(format!("falcon-train-{rank}"))
            .spawn(body);
        match h {
            Ok(h) => handles.push(h),
            Err(e) => {
                let f = RoleFailure::failed("worker", rank, e);
                failures.record(f);
                break;
            }
        }
    }
    handles
}

/// Watches the workers' threads until they are done, telling `progress` now and then (with
/// a rough live estimate of the model on a few test examples); a failed role (a worker's
/// error or panic, the scheduler's, a server's) ends the watch at once with its failure.
fn watch(
    spec: &JobSpec,
    cluster: &LocalCluster,
    model: &dyn Model,
    data: &Dataset,
    run: &Running,
    workers: usize,
    progress: &mut impl FnMut(&Progress),
) -> Option<RoleFailure> {
    let total = u64::from(spec.workers) * spec.train.iters;
    let mut last: Option<EvalPoint> = None;
    let mut last_eval = Instant::now();
    let mut last_progress = Instant::now();
    let mut scratch = model.scratch(LIVE_EXAMPLES);
    while run.done.load(Ordering::Relaxed) < workers as u64 {
        std::thread::sleep(Duration::from_millis(20));
        // A failed role (a worker's error or panic, the scheduler's, a server's) ends the
        // whole job at once, with its failure as the job's error.
        if let Some(f) = run.failures.get() {
            return Some(f);
        }
        if last_progress.elapsed() < Duration::from_millis(100) {
            continue;
        }
        last_progress = Instant::now();
        let iterations = cluster
            .workers
            .iter()
            .map(|w| w.clock_of(TENSOR).unwrap_or(0))
            .sum();
        // A rough live estimate for the progress bar, on a few test examples.
        let latest = run
            .snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last()
            .map(|s| (s.secs, s.iteration, s.params.clone()));
        if let Some((secs, iteration, params)) = latest
            && last.as_ref().is_none_or(|l| l.iteration != iteration)
            && last_eval.elapsed() >= LIVE_EVERY
        {
            last_eval = Instant::now();
            let n = LIVE_EXAMPLES.min(data.test.len());
            let f = data.test.features();
            if let Ok((loss, correct)) = model.evaluate(
                &params,
                &data.test.images[..n * f],
                &data.test.labels[..n],
                &mut scratch,
            ) {
                last = Some(EvalPoint {
                    secs,
                    iteration,
                    accuracy: correct as f64 / n.max(1) as f64,
                    loss: f64::from(loss) / n.max(1) as f64,
                });
            }
        }
        let last = last.clone();
        let blocked_secs = cluster
            .workers
            .iter()
            .map(|w| w.stats().pull_wait.as_secs_f64())
            .sum();
        progress(&Progress {
            iterations,
            total,
            blocked_secs,
            secs: run.start.elapsed().as_secs_f64(),
            last,
        });
    }
    run.failures.get()
}

/// The job's report, from what the run measured and the cluster's report.
fn job_report(
    spec: &JobSpec,
    model: &dyn Model,
    data: &Dataset,
    (optimizer, secs, resumed_at): (Optimizer, f64, Option<u64>),
    (curve, final_accuracy, final_loss): (Vec<EvalPoint>, f64, f64),
    (per_worker, params, fast_pull_bytes): (Vec<WorkerSummary>, Vec<f32>, u64),
    report: &falcon_engine::local::LocalReport,
) -> JobReport {
    let time_to_target = curve
        .iter()
        .find(|p| p.accuracy >= spec.target)
        .map(|p| p.secs);
    let sum = |f: &dyn Fn(&falcon_engine::WorkerCounters) -> u64| -> u64 {
        report
            .servers
            .iter()
            .flat_map(|s| &s.per_worker)
            .map(f)
            .sum()
    };
    JobReport {
        policy: spec.policy.build(spec.workers).name(),
        model: model.name(),
        optimizer: optimizer.to_string(),
        lr: optimizer.lr(),
        aggregate: spec.aggregate,
        data: data.source.clone(),
        workers: spec.workers,
        servers: spec.servers,
        hetero: (0..spec.workers as usize)
            .map(|w| spec.hetero.get(w).map_or("none".into(), |h| h.to_string()))
            .collect(),
        secs,
        curve,
        final_accuracy,
        final_loss,
        target: spec.target,
        time_to_target,
        per_worker,
        parked_pulls: sum(&|c| c.parked_pulls),
        dropped_gradients: report.servers.iter().map(|s| s.dropped_gradients).sum(),
        folded_gradients: report.servers.iter().map(|s| s.folded_gradients).sum(),
        bytes_moved: fast_pull_bytes
            + report
                .servers
                .iter()
                .flat_map(|s| &s.per_shard)
                .map(|c| c.bytes_in + c.bytes_out)
                .sum::<u64>(),
        mean_staleness: {
            let (n, d) = report.servers.iter().fold((0u64, 0u64), |(n, d), s| {
                (n + s.gradients, d + s.staleness_sum)
            });
            d as f64 / n.max(1) as f64
        },
        transfers_offered: sum(&|c| c.transfers_offered),
        tasks_transferred: report.scheduler.tasks_transferred,
        parallelism_plans: report.scheduler.parallelism_plans,
        classes: report.scheduler.classes.clone(),
        resumed_at,
        final_values: params,
    }
}

/// Ends a job whose role failed: every worker leaves (their pending operations fail at
/// once), their threads and the cluster's get a moment to wind down, and the failure is the
/// job's error. Threads still running after that are left to end on their own.
fn stop(
    cluster: LocalCluster,
    handles: Vec<std::thread::JoinHandle<Result<WorkerSummary>>>,
    done: &AtomicU64,
    failure: RoleFailure,
) -> Error {
    tracing::debug!("the job stops: {failure}");
    for w in &cluster.workers {
        let _ = w.finish();
    }
    let start = Instant::now();
    while done.load(Ordering::Relaxed) < handles.len() as u64 && start.elapsed() < WIND_DOWN {
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = cluster.finish_within(WIND_DOWN.saturating_sub(start.elapsed()));
    Error::Role(failure)
}

/// Where reports go by default.
pub fn default_out_dir() -> PathBuf {
    PathBuf::from("target/falcon-train")
}
