//! `falcon experiment`: every policy on the same heterogeneity profile and seed, and the
//! reproductions of the papers' claims (results under `docs/results/`).
//!
//! Each experiment runs its configurations in one of two modes:
//! * **real**: an embedded cluster in this process (scheduler, servers and one thread per
//!   worker over the real transport), real training on Fashion-MNIST, wall-clock time;
//! * **sim**: the deterministic simulator (virtual time, the same policies, the same model
//!   computing real gradients).
//!
//! and writes, under `--out`: `results.csv` and `results.json` (every figure and every
//! curve), `table.md` (the printed table), `accuracy.png`/`.svg` (test accuracy against time
//! per configuration) and `time_to_target.png`/`.svg`.
//!
//! With `--lr-grid`, every configuration runs at every learning rate of the grid and is
//! reported at its best one: the earliest median time to target over the `--seeds` seeds,
//! then the highest mean final accuracy. Every run of the grid is kept in `results.json`
//! (`grid`), the seeds' spread is in the table, and a run that diverged is marked.
//! `falcon experiment fair` is the comparison of `docs/results/fair-comparison.md`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use falcon_engine::update::Aggregate;
use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::job::{JobReport, JobSpec, run_local};
use falcon_trainer::model::ModelSpec;
use falcon_trainer::sim::{SimReport, SimSpec};
use falcon_trainer::train::TrainConfig;
use falcon_transport::Medium;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::train_cmd::{Entry, top_level_split};

type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Options of `falcon experiment`.
#[derive(clap::Args, Debug)]
pub struct ExperimentArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(clap::Subcommand, Debug)]
enum Which {
    /// Every policy on the same heterogeneity profile and seed: BSP, ASP, SSP s ∈ {3,6,15},
    /// DSSP [3,15], EPSP (enforced, slack, adaptive, and each mechanism off), FluentPS
    /// p ∈ {1,0.5,0.1} and sigmoid, Sync-opt b=1, DynSGD, ConSGD, FlexRR, ElasticBSP.
    Stragglers(Knobs),
    /// DSSP's Table I analogue: 2 workers at a 2:1 speed ratio; BSP, ASP, SSP s ∈ {3,6,15},
    /// DSSP [3,15].
    Dssp(Knobs),
    /// FluentPS: 64 simulated workers, Gaussian delays on every 4th; parked pulls under raw
    /// SSP against fastest-only and sigmoid pausing, and throughput over p.
    Fluentps(Knobs),
    /// Falcon: EPSP against FlexRR, Sync-opt, ConSGD and DynSGD under one and two slowed
    /// workers; then completion time and its variance against thread count.
    Falcon(Knobs),
    /// Every policy at its best momentum and learning rate (Sync-opt at its best backup
    /// count), over two seeds: 16 simulated workers of which 4 at half speed, communication
    /// and task transfer charged, the global model measured.
    Fair(Knobs),
    /// ElasticBSP: ZipLine's decision cost against the paper's Table II.
    Zipline {
        /// Where the results go.
        #[arg(long, default_value = "target/falcon-experiment/zipline")]
        out: PathBuf,
        /// Fewer repetitions.
        #[arg(long)]
        quick: bool,
    },
}

/// The knobs every experiment shares; unset ones take the experiment's defaults.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Knobs {
    /// real (an embedded cluster, wall clock), sim (the simulator, virtual time) or both.
    #[arg(long, value_parser = ["real", "sim", "both"])]
    mode: Option<String>,
    /// Configurations, comma-separated at the top level: POLICY[+static][+dynsgd|+consgd(F)];
    /// syncopt(*) (or syncopt(*,fold)) is Sync-opt tuned over 1 up to as many backups as slowed
    /// workers.
    #[arg(long)]
    policies: Option<String>,
    /// Workers.
    #[arg(long, value_parser = crate::checks::at_least_one_u32)]
    workers: Option<u32>,
    /// Heterogeneity RANKS:SPEC with RANKS a rank N, a range A-B or *, repeatable (h=0.5,
    /// gauss(5,2), episodes(10,3,4), trace(FILE), …); replaces the experiment's profile.
    #[arg(long)]
    hetero: Vec<String>,
    /// Iterations per worker.
    #[arg(long, value_parser = crate::checks::at_least_one_u64)]
    iters: Option<u64>,
    /// Examples per worker per iteration (at least 4, the tasks of an iteration).
    #[arg(long, value_parser = crate::checks::at_least_one_usize)]
    batch: Option<usize>,
    /// Server-side learning rate (finite, > 0).
    #[arg(long, value_parser = crate::checks::learning_rate,
          allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Learning rates to try, comma-separated: each configuration runs at every one and is
    /// reported at its best (the earliest median time to target over the seeds, then the
    /// highest mean final accuracy); every run is in results.json. Replaces --lr.
    #[arg(long, value_delimiter = ',', value_parser = crate::checks::learning_rate)]
    lr_grid: Vec<f32>,
    /// Seeds per configuration and learning rate (--seed, --seed + 1, …): the median time to
    /// target is reported, the spread beside it.
    #[arg(long, value_parser = crate::checks::at_least_one_u32)]
    seeds: Option<u32>,
    /// The servers' optimizer: sgd, momentum(MU), adam, adam(B1,B2,EPS), adamw,
    /// adamw(B1,B2,EPS,WD), adagrad.
    #[arg(long)]
    optimizer: Option<String>,
    /// Momentum values to try where the optimizer is momentum(MU), comma-separated: each
    /// configuration runs at every one (and every learning rate) and is reported at its best.
    #[arg(long, value_delimiter = ',', value_parser = crate::checks::momentum)]
    momenta: Vec<f32>,
    /// Tasks per iteration: the grain of task transfer (every policy gets the same).
    #[arg(long, value_parser = crate::checks::at_least_one_u32)]
    tasks: Option<u32>,
    /// How the training data is divided among the workers in the simulator: iid (a fixed
    /// share each, the default), skewed (a share of label-sorted data) or shuffled (one
    /// shuffled stream cut in shares, as real runs read it).
    #[arg(long)]
    partition: Option<String>,
    /// Evaluate every this many full-speed iterations (default: the experiment's).
    #[arg(long, value_parser = crate::checks::at_least_one_u64)]
    eval_every: Option<u64>,
    /// How a synchronous step's gradients combine: sum or mean.
    #[arg(long, value_parser = ["sum", "mean"])]
    aggregate: Option<String>,
    /// Model: mlp:784-256-10, mlp:784-10, resmlp:784-64x4-10, cnn, …
    #[arg(long)]
    model: Option<String>,
    /// Target test accuracy of the time-to-accuracy column, a fraction in (0, 1].
    #[arg(long, value_parser = crate::checks::accuracy_target,
          allow_negative_numbers = true)]
    target: Option<f64>,
    /// Runs of each real configuration (the median by time to accuracy is reported).
    #[arg(long, value_parser = crate::checks::at_least_one_u32)]
    repeat: Option<u32>,
    /// Dataset directory (default: Debian's Fashion-MNIST, else the bundled sample).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Seed (data order, initial values, delays).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the results go (default: target/falcon-experiment/NAME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A short smoke run: 20 iterations, and a target of at most 60 % unless --target says.
    #[arg(long)]
    quick: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// One experiment's settings, the knobs resolved against its defaults.
#[derive(Clone, Debug)]
struct Setup {
    modes: Vec<&'static str>,
    /// Each configuration as asked, and the variants it is tuned over (`syncopt(*)`: one to as
    /// many backups as there are slowed workers; otherwise itself).
    entries: Vec<(String, Vec<String>)>,
    workers: u32,
    hetero: Vec<Hetero>,
    iters: u64,
    batch: usize,
    tasks: u32,
    model: ModelSpec,
    target: f64,
    repeat: u32,
    out: PathBuf,
    quiet: bool,
    /// Simulator: a full-speed iteration (virtual ms) and the one-way latency (virtual µs).
    base_ms: f64,
    latency_us: f64,
    eval_every: u64,
    /// The learning rates tried (one: `lr`).
    lrs: Vec<f32>,
    /// The seeds of each configuration and learning rate.
    seeds: Vec<u64>,
    /// The optimizer's text as asked, the optimizers tried (each momentum of `--momenta`;
    /// parsed at each learning rate) and the aggregate.
    optimizer: String,
    optimizers: Vec<String>,
    aggregate: Aggregate,
    /// How the data is divided, when asked (the simulator's default: a fixed IID share each).
    partition: Option<falcon_trainer::data::Partition>,
}

/// An experiment's defaults.
struct Defaults {
    name: &'static str,
    mode: &'static str,
    entries: &'static str,
    workers: u32,
    hetero: &'static [&'static str],
    iters: u64,
    batch: usize,
    lr: f32,
    model: &'static str,
    target: f64,
    /// Runs of each real configuration.
    repeat: u32,
    optimizer: &'static str,
    aggregate: &'static str,
    lr_grid: &'static [f32],
    /// Momenta tried with a momentum optimizer (empty: the optimizer's own).
    momenta: &'static [f32],
    seeds: u32,
    /// Evaluations every this many full-speed iterations (`None`: 40 over the run).
    eval_every: Option<u64>,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            name: "experiment",
            mode: "sim",
            entries: "bsp",
            workers: 4,
            hetero: &[],
            iters: 100,
            batch: 16,
            lr: 0.05,
            model: "mlp:784-10",
            target: 0.7,
            repeat: 1,
            optimizer: "sgd",
            aggregate: "sum",
            lr_grid: &[],
            momenta: &[],
            seeds: 1,
            eval_every: None,
        }
    }
}

impl Knobs {
    fn resolve(&self, d: Defaults) -> Res<Setup> {
        let workers = self.workers.unwrap_or(d.workers).max(1);
        let specs: Vec<String> = if self.hetero.is_empty() {
            d.hetero.iter().map(|s| s.to_string()).collect()
        } else {
            self.hetero.clone()
        };
        let hetero = crate::checks::setting(falcon_trainer::hetero::assign(workers, &specs))?;
        let mode = self.mode.as_deref().unwrap_or(d.mode);
        let modes = match mode {
            "both" => vec!["real", "sim"],
            "real" => vec!["real"],
            _ => vec!["sim"],
        };
        if modes.contains(&"real") {
            // The real runs are embedded clusters in this process (2 servers).
            crate::checks::check_limits(
                crate::checks::Layout::OneProcess,
                &format!("a real run with {workers} worker(s) and 2 servers"),
                2,
                workers,
                1,
                falcon_transport::Medium::Auto,
            )?;
        }
        let asked = top_level_split(self.policies.as_deref().unwrap_or(d.entries));
        if asked.is_empty() {
            return Err("--policies: no configuration".into());
        }
        let slowed = hetero.iter().filter(|h| **h != Hetero::None).count() as u32;
        let mut entries = Vec::new();
        for e in asked {
            let variants = tuned_variants(&e, slowed, workers);
            for v in &variants {
                let parsed: Entry = crate::checks::setting(v.parse())?;
                crate::checks::policy_fits(&parsed.policy, v, workers)?;
            }
            entries.push((e, variants));
        }
        let batch = self.batch.unwrap_or(d.batch).max(1);
        crate::checks::tasks_fit(u64::from(self.tasks.unwrap_or(4)), batch as u64)?;
        let iters = self.iters.unwrap_or(d.iters);
        let iters = if self.quick { iters.min(20) } else { iters }.max(1);
        let lr = self.lr.unwrap_or(d.lr);
        let lrs = if !self.lr_grid.is_empty() {
            self.lr_grid.clone()
        } else if self.lr.is_some() || d.lr_grid.is_empty() {
            vec![lr]
        } else {
            d.lr_grid.to_vec()
        };
        let optimizer = self.optimizer.as_deref().unwrap_or(d.optimizer).to_string();
        let momenta = if self.momenta.is_empty() {
            d.momenta
        } else {
            &self.momenta[..]
        };
        let optimizers: Vec<String> = if optimizer.starts_with("momentum") && !momenta.is_empty() {
            momenta.iter().map(|m| format!("momentum({m})")).collect()
        } else {
            vec![optimizer.clone()]
        };
        for o in &optimizers {
            for &lr in &lrs {
                falcon_engine::update::Optimizer::parse(o, lr)?;
            }
        }
        let partition: Option<falcon_trainer::data::Partition> = match &self.partition {
            Some(p) => Some(crate::checks::setting(p.parse())?),
            None => None,
        };
        if let Some(partition) = partition
            .filter(|p| modes.contains(&"real") && *p != falcon_trainer::data::Partition::Shuffled)
        {
            return Err(format!(
                "--partition {partition}: real runs read one shuffled stream; other partitions \
                 are the simulator's (--mode sim)"
            )
            .into());
        }
        let aggregate = match self.aggregate.as_deref().unwrap_or(d.aggregate) {
            "mean" => Aggregate::Mean,
            _ => Aggregate::Sum,
        };
        let seeds = (0..u64::from(self.seeds.unwrap_or(d.seeds).max(1)))
            .map(|i| self.seed + i)
            .collect();
        Ok(Setup {
            modes,
            entries,
            workers,
            hetero,
            iters,
            batch,
            tasks: self.tasks.unwrap_or(4),
            model: crate::checks::setting(self.model.as_deref().unwrap_or(d.model).parse())?,
            // A quick run's 20 iterations reach no paper's target: at most 60 %.
            target: self.target.unwrap_or(if self.quick {
                d.target.min(0.6)
            } else {
                d.target
            }),
            repeat: self.repeat.unwrap_or(d.repeat).max(1),
            out: self
                .out
                .clone()
                .unwrap_or_else(|| Path::new("target/falcon-experiment").join(d.name)),
            quiet: self.quiet,
            base_ms: 10.0,
            latency_us: 50.0,
            eval_every: self
                .eval_every
                .or(d.eval_every)
                .unwrap_or((iters / 40).max(1)),
            lrs,
            seeds,
            optimizer,
            optimizers,
            aggregate,
            partition,
        })
    }
}

/// One configuration's result (the median run by time to accuracy when repeated).
#[derive(Clone, Debug, Serialize)]
struct Row {
    config: String,
    mode: &'static str,
    /// Seconds (wall in real mode, virtual in sim mode) to the target accuracy.
    time_to_target: Option<f64>,
    /// Times to the target of every run.
    times: Vec<Option<f64>>,
    final_accuracy: f64,
    /// Iterations per second, all workers together.
    iterations_per_sec: f64,
    /// Seconds the workers' pulls waited for the policy, all workers together.
    blocked_secs: f64,
    parked_pulls: u64,
    dropped_gradients: u64,
    /// Late gradients folded into a later step (`syncopt(…,fold)`), in results.json.
    folded_gradients: u64,
    bytes_moved: u64,
    tasks_transferred: u64,
    /// Seconds until the last worker finished.
    secs: f64,
    /// (seconds, test accuracy): worker 0's snapshots in real mode, the servers' parameters
    /// in the simulator.
    curve: Vec<(f64, f64)>,
    /// The learning rate reported (the best of the grid), and the optimizer (the best of
    /// `--momenta`).
    lr: f32,
    optimizer: String,
    /// The lowest accuracy of the curve after it first reached the target: a run that
    /// collapses after getting there shows it here.
    low_after_target: Option<f64>,
    /// The run diverged (the servers' parameters not finite, or near chance with a loss not
    /// clearly below the initial model's).
    diverged: bool,
    /// Every run of the grid: learning rate, seed, time to target, final accuracy, diverged.
    grid: Vec<GridRun>,
}

/// One run of a configuration's learning-rate grid.
#[derive(Clone, Debug, Serialize)]
struct GridRun {
    config: String,
    optimizer: String,
    lr: f32,
    seed: u64,
    time_to_target: Option<f64>,
    final_accuracy: f64,
    diverged: bool,
}

/// A real run diverged: its last evaluation near chance with a loss not clearly below the
/// first (the simulator's rule, [`SimReport::diverged`]).
fn diverged_curve(r: &JobReport) -> bool {
    let (Some(first), Some(last)) = (r.curve.first(), r.curve.last()) else {
        return false;
    };
    !r.final_accuracy.is_finite()
        || !last.loss.is_finite()
        || (r.final_accuracy < 0.2 && last.loss >= 0.9 * first.loss)
}

impl Row {
    fn from_job(config: &str, r: &JobReport) -> Row {
        let iterations: u64 = r.per_worker.iter().map(|w| w.iterations).sum();
        Row {
            config: config.into(),
            mode: "real",
            time_to_target: r.time_to_target,
            times: vec![r.time_to_target],
            final_accuracy: r.final_accuracy,
            iterations_per_sec: iterations as f64 / r.secs.max(1e-9),
            blocked_secs: r.per_worker.iter().map(|w| w.blocked_secs).sum(),
            parked_pulls: r.parked_pulls,
            dropped_gradients: r.dropped_gradients,
            folded_gradients: r.folded_gradients,
            bytes_moved: r.bytes_moved,
            tasks_transferred: r.tasks_transferred,
            secs: r.secs,
            curve: r.curve.iter().map(|p| (p.secs, p.accuracy)).collect(),
            lr: 0.0,
            optimizer: String::new(),
            low_after_target: None,
            diverged: diverged_curve(r),
            grid: Vec::new(),
        }
    }

    fn from_sim(config: &str, r: &SimReport) -> Row {
        Row {
            config: config.into(),
            mode: "sim",
            time_to_target: r.time_to_target,
            times: vec![r.time_to_target],
            final_accuracy: r.final_accuracy,
            iterations_per_sec: r.iterations_per_sec,
            blocked_secs: r.blocked_secs.iter().sum(),
            parked_pulls: r.parked_pulls,
            dropped_gradients: r.dropped,
            folded_gradients: r.folded,
            bytes_moved: r.bytes_moved,
            tasks_transferred: r.tasks_transferred,
            secs: r.virtual_secs,
            curve: r.curve.iter().map(|p| (p.secs, p.accuracy)).collect(),
            lr: 0.0,
            optimizer: String::new(),
            low_after_target: None,
            diverged: r.diverged,
            grid: Vec::new(),
        }
    }
}

/// Seconds to target, never reached last.
fn time_key(t: Option<f64>) -> f64 {
    t.unwrap_or(f64::INFINITY)
}

/// The median of `times` (never reached counts as the latest).
fn median_time(times: &[Option<f64>]) -> Option<f64> {
    let mut t: Vec<Option<f64>> = times.to_vec();
    t.sort_by(|a, b| time_key(*a).total_cmp(&time_key(*b)));
    t.get(t.len() / 2).copied().flatten()
}

fn bar(quiet: bool, len: u64, prefix: String) -> ProgressBar {
    // Hidden when stderr is not a terminal (indicatif's default target).
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(len)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>30} [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar
}

/// The variants configuration `e` is tuned over: `syncopt(*)` is Sync-opt with 1 to `slowed`
/// backups (at least one, fewer than the workers); any other is itself.
fn tuned_variants(e: &str, slowed: u32, workers: u32) -> Vec<String> {
    // `syncopt(*)` and `syncopt(*,fold)`, with what follows (`+consgd`…).
    let starred = e
        .strip_prefix("syncopt(*)")
        .map(|rest| ("", rest))
        .or_else(|| {
            e.strip_prefix("syncopt(*,fold)")
                .map(|rest| (",fold", rest))
        });
    match starred {
        Some((fold, rest)) => {
            let most = slowed.clamp(1, workers.saturating_sub(1).max(1));
            (1..=most)
                .map(|b| format!("syncopt({b}{fold}){rest}"))
                .collect()
        }
        None => vec![e.to_string()],
    }
}

/// One run of a tuning grid: the configuration's variant, the optimizer, rate and seed.
struct Cell {
    variant: String,
    optimizer: String,
    lr: f32,
    seed: u64,
}

/// Runs every configuration of `s` in `mode` (on `data`): every variant, optimizer (momentum),
/// learning rate and seed (and, in real mode, `repeat` times each), reported at its best
/// variant, optimizer and rate. In the simulator the runs of a configuration go side by side,
/// one per core.
fn run_all(s: &Setup, mode: &'static str, data: &Arc<Dataset>) -> Res<Vec<Row>> {
    let mut rows = Vec::new();
    for (entry, variants) in &s.entries {
        let repeat = if mode == "sim" { 1 } else { s.repeat };
        let mut cells = Vec::new();
        for variant in variants {
            for optimizer in &s.optimizers {
                for &lr in &s.lrs {
                    for &seed in &s.seeds {
                        for round in 0..repeat {
                            cells.push(Cell {
                                variant: variant.clone(),
                                optimizer: optimizer.clone(),
                                lr,
                                seed: seed + u64::from(round) * 1000,
                            });
                        }
                    }
                }
            }
        }
        let mut runs = run_cells(s, mode, data, &cells)?;
        for (row, c) in runs.iter_mut().zip(&cells) {
            row.lr = c.lr;
            row.optimizer.clone_from(&c.optimizer);
            row.low_after_target = low_after(&row.curve, s.target);
            row.grid = vec![GridRun {
                config: c.variant.clone(),
                optimizer: c.optimizer.clone(),
                lr: c.lr,
                seed: c.seed,
                time_to_target: row.time_to_target,
                final_accuracy: row.final_accuracy,
                diverged: row.diverged,
            }];
        }
        let grid: Vec<GridRun> = runs.iter().flat_map(|r| r.grid.clone()).collect();
        // Per (variant, optimizer, rate): its runs.
        let mut groups: Vec<Vec<Row>> = Vec::new();
        for (row, c) in runs.into_iter().zip(&cells) {
            match groups.last_mut() {
                Some(g)
                    if g[0].config == c.variant
                        && g[0].optimizer == c.optimizer
                        && g[0].lr == c.lr =>
                {
                    g.push(row)
                }
                _ => groups.push(vec![row]),
            }
        }
        // The best: earliest median time, then highest mean final accuracy.
        let score = |runs: &[Row]| {
            let times: Vec<Option<f64>> = runs.iter().map(|r| r.time_to_target).collect();
            let mean = runs.iter().map(|r| r.final_accuracy).sum::<f64>() / runs.len() as f64;
            (time_key(median_time(&times)), -mean)
        };
        let Some(mut runs) = groups.into_iter().min_by(|a, b| {
            let (x, y) = (score(a), score(b));
            x.0.total_cmp(&y.0).then(x.1.total_cmp(&y.1))
        }) else {
            continue;
        };
        runs.sort_by(|a, b| time_key(a.time_to_target).total_cmp(&time_key(b.time_to_target)));
        let times = runs.iter().map(|r| r.time_to_target).collect();
        let n = runs.len();
        let mut median = runs.swap_remove(n / 2);
        median.times = times;
        median.grid = grid;
        if variants.len() > 1 {
            median.config = format!("{} of {entry}", median.config);
        }
        if rows.is_empty() {
            outln!("{}", table_header(s.target));
        }
        // Each row as it finishes, its ratio to the first row's time (the table once).
        let base = rows
            .first()
            .map_or(median.time_to_target, |r: &Row| r.time_to_target);
        outln!("{}", table_row(&median, base));
        rows.push(median);
    }
    Ok(rows)
}

/// The lowest accuracy of `curve` from its first point at `target` on (`None`: never there).
fn low_after(curve: &[(f64, f64)], target: f64) -> Option<f64> {
    let first = curve.iter().position(|&(_, a)| a >= target)?;
    curve[first..].iter().map(|&(_, a)| a).reduce(f64::min)
}

/// Runs `cells` of one configuration in `mode`: the simulator's side by side (one per core),
/// real runs one after another. The rows come back in the order of `cells`.
fn run_cells(s: &Setup, mode: &'static str, data: &Arc<Dataset>, cells: &[Cell]) -> Res<Vec<Row>> {
    if mode != "sim" {
        return cells
            .iter()
            .map(|c| {
                let e: Entry = c.variant.parse()?;
                let optimizer = falcon_engine::update::Optimizer::parse(&c.optimizer, c.lr)?;
                run_real(s, mode, data, &c.variant, &e, c.lr, optimizer, c.seed)
            })
            .collect();
    }
    let mut specs = Vec::new();
    for c in cells {
        let e: Entry = c.variant.parse()?;
        let optimizer = falcon_engine::update::Optimizer::parse(&c.optimizer, c.lr)?;
        specs.push(sim_spec(s, &e, c.lr, optimizer, c.seed));
    }
    let pb = bar(
        s.quiet,
        cells.len() as u64,
        format!("{} (sim)", cells.first().map_or("", |c| c.variant.as_str())),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    let mut failed = None;
    falcon_trainer::sim::simulate_all(&specs, data, cores, |i, r| match r {
        Ok(r) => {
            rows.push(Row::from_sim(&cells[i].variant, &r));
            pb.inc(1);
        }
        Err(e) => {
            failed.get_or_insert(e);
        }
    });
    pb.finish_and_clear();
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(rows),
    }
}

/// The simulator's spec of one run.
fn sim_spec(
    s: &Setup,
    e: &Entry,
    lr: f32,
    optimizer: falcon_engine::update::Optimizer,
    seed: u64,
) -> SimSpec {
    SimSpec {
        workers: s.workers,
        iters: s.iters,
        policy: e.policy,
        scale: e.scale,
        model: s.model.clone(),
        batch: s.batch,
        lr,
        optimizer: Some(optimizer),
        aggregate: s.aggregate,
        seed,
        base_ns: (s.base_ms * 1e6) as u64,
        latency_ns: (s.latency_us * 1e3) as u64,
        hetero: s.hetero.clone(),
        eval_every: s.eval_every,
        eval_examples: 2000,
        compute: true,
        target: s.target,
        tasks: s.tasks,
        partition: s.partition.unwrap_or(SimSpec::default().partition),
        ..SimSpec::default()
    }
}

/// One real run (an embedded cluster) of configuration `entry` (parsed: `e`) at learning rate
/// `lr` and `seed`; the simulator's runs go through [`run_cells`].
#[allow(clippy::too_many_arguments)]
fn run_real(
    s: &Setup,
    mode: &'static str,
    data: &Arc<Dataset>,
    entry: &str,
    e: &Entry,
    lr: f32,
    optimizer: falcon_engine::update::Optimizer,
    seed: u64,
) -> Res<Row> {
    let spec = JobSpec {
        workers: s.workers,
        servers: 2,
        policy: e.policy,
        model: s.model.clone(),
        train: TrainConfig {
            batch: s.batch,
            tasks: s.tasks,
            iters: s.iters,
            seed,
            eval_every: s.eval_every,
            eval_examples: 1000,
            transfer: true,
        },
        lr,
        optimizer: Some(optimizer),
        aggregate: s.aggregate,
        elastic: e.elastic,
        hetero: s.hetero.clone(),
        medium: Medium::Auto,
        target: s.target,
        scale: e.scale,
        ..JobSpec::default()
    };
    let total = u64::from(s.workers) * s.iters;
    let pb = bar(s.quiet, total, format!("{entry} ({mode}, lr {lr})"));
    let r = run_local(&spec, data, |p| {
        pb.set_position(p.iterations);
        pb.set_message(format!("blocked {:.1} s", p.blocked_secs));
    })?;
    pb.finish_and_clear();
    // Let the previous job's threads wind down before the next starts.
    std::thread::sleep(Duration::from_millis(100));
    Ok(Row::from_job(entry, &r))
}

fn secs(t: Option<f64>) -> String {
    t.map_or("not reached".into(), |t| format!("{t:.2}"))
}

/// The Markdown table's header for `target`.
fn table_header(target: f64) -> String {
    format!(
        "| configuration | mode | optimizer | lr | time to {:.0}% (s) | runs' spread (s) | × first | final acc | lowest after target | it/s | blocked s | parked pulls | dropped | MB moved | tasks moved |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        100.0 * target
    )
}

/// `r`'s row of the Markdown table, its time also as a ratio to `base`'s.
fn table_row(r: &Row, base: Option<f64>) -> String {
    let ratio = match (r.time_to_target, base) {
        (Some(x), Some(b)) if b > 0.0 => format!("{:.2}", x / b),
        _ => "–".into(),
    };
    let reached: Vec<f64> = r.times.iter().flatten().copied().collect();
    let spread = match (
        reached.iter().copied().reduce(f64::min),
        reached.iter().copied().reduce(f64::max),
    ) {
        _ if r.times.len() < 2 => "–".to_string(),
        (Some(lo), Some(hi)) if reached.len() == r.times.len() => format!("{lo:.2}–{hi:.2}"),
        (Some(lo), Some(hi)) => format!(
            "{lo:.2}–{hi:.2}, {} of {} not reached",
            r.times.len() - reached.len(),
            r.times.len()
        ),
        _ => "none reached".to_string(),
    };
    format!(
        "| {} | {} | {} | {} | {} | {spread} | {ratio} | {:.2}%{} | {} | {:.1} | {:.2} | {} | {} | {:.1} | {} |",
        r.config,
        r.mode,
        if r.optimizer.is_empty() {
            "–"
        } else {
            &r.optimizer
        },
        r.lr,
        secs(r.time_to_target),
        100.0 * r.final_accuracy,
        if r.diverged { " (diverged)" } else { "" },
        r.low_after_target
            .map_or("–".into(), |a| format!("{:.2}%", 100.0 * a)),
        r.iterations_per_sec,
        r.blocked_secs,
        r.parked_pulls,
        r.dropped_gradients,
        r.bytes_moved as f64 / 1e6,
        r.tasks_transferred
    )
}

/// The Markdown table of `rows`, times also as a ratio to the first row's.
fn table(rows: &[Row], target: f64) -> String {
    let base = rows.first().and_then(|r| r.time_to_target);
    let mut t = table_header(target);
    for r in rows {
        t.push('\n');
        t.push_str(&table_row(r, base));
    }
    t.push('\n');
    t
}

/// Writes `rows` as CSV, JSON, a Markdown table and the plots under `dir`, with `prefix` on
/// every file name; returns the table.
fn write_outputs(dir: &Path, prefix: &str, title: &str, rows: &[Row], target: f64) -> Res<String> {
    std::fs::create_dir_all(dir)?;
    let mut csv = String::from(
        "configuration,mode,time_to_target_s,final_accuracy,iterations_per_s,blocked_s,parked_pulls,dropped_gradients,bytes_moved,tasks_transferred,secs,lr,diverged,optimizer,lowest_after_target\n",
    );
    for r in rows {
        let _ = writeln!(
            csv,
            "\"{}\",{},{},{:.5},{:.3},{:.4},{},{},{},{},{:.4},{},{},\"{}\",{}",
            r.config.replace('"', "\"\""),
            r.mode,
            r.time_to_target
                .map_or(String::new(), |t| format!("{t:.4}")),
            r.final_accuracy,
            r.iterations_per_sec,
            r.blocked_secs,
            r.parked_pulls,
            r.dropped_gradients,
            r.bytes_moved,
            r.tasks_transferred,
            r.secs,
            r.lr,
            r.diverged,
            r.optimizer,
            r.low_after_target
                .map_or(String::new(), |a| format!("{a:.5}"))
        );
    }
    std::fs::write(dir.join(format!("{prefix}results.csv")), csv)?;
    std::fs::write(
        dir.join(format!("{prefix}results.json")),
        serde_json::to_string_pretty(rows)?,
    )?;
    let t = table(rows, target);
    std::fs::write(
        dir.join(format!("{prefix}table.md")),
        format!("{title}\n\n{t}"),
    )?;
    let unit = if rows.iter().all(|r| r.mode == "sim") {
        "virtual s"
    } else {
        "s"
    };
    let series: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .map(|r| {
            (
                r.config.clone(),
                r.curve.iter().map(|&(x, a)| (x, 100.0 * a)).collect(),
            )
        })
        .collect();
    let bars: Vec<(String, f64)> = rows
        .iter()
        .map(|r| (r.config.clone(), r.time_to_target.unwrap_or(f64::NAN)))
        .collect();
    for ext in ["png", "svg"] {
        crate::plot::line_chart(
            &dir.join(format!("{prefix}accuracy.{ext}")),
            &crate::plot::Lines::accuracy(
                &format!("{title}: test accuracy against time"),
                &format!("time ({unit})"),
                &series,
                target,
            ),
        )?;
        crate::plot::bar_chart(
            &dir.join(format!("{prefix}time_to_target.{ext}")),
            &format!("{title}: time to {:.0}% ({unit})", 100.0 * target),
            &bars,
        )?;
    }
    Ok(t)
}

/// Runs `s` in each of its modes; prints and writes the results.
fn run_setup(s: &Setup, title: &str, data: &Arc<Dataset>) -> Res<Vec<Row>> {
    let mut all = Vec::new();
    for &mode in &s.modes {
        outln!(
            "\n{title} — {mode}: {} workers × {} iterations, {}, batch {}, {} at lr {}, {} seed(s), on {}; profile {}",
            s.workers,
            s.iters,
            s.model,
            s.batch,
            s.optimizers.join(" or "),
            s.lrs
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            s.seeds.len(),
            data.source,
            profile(&s.hetero)
        );
        let rows = run_all(s, mode, data)?;
        let prefix = if s.modes.len() > 1 {
            format!("{mode}-")
        } else {
            String::new()
        };
        // The table was printed row by row; the files get it whole.
        write_outputs(
            &s.out,
            &prefix,
            &format!("{title} ({mode})"),
            &rows,
            s.target,
        )?;
        all.extend(rows);
    }
    outln!("results: {}", s.out.display());
    Ok(all)
}

/// `3:h=0.5, 5:h=0.5` (slow workers only).
fn profile(h: &[Hetero]) -> String {
    let slow: Vec<String> = h
        .iter()
        .enumerate()
        .filter(|(_, h)| **h != Hetero::None)
        .map(|(i, h)| format!("{i}:{h}"))
        .collect();
    if slow.is_empty() {
        "uniform".into()
    } else if slow.len() > 6 {
        format!("{} slowed workers ({} …)", slow.len(), slow[..3].join(", "))
    } else {
        slow.join(", ")
    }
}

fn time_of(rows: &[Row], config: &str, mode: &str) -> Option<f64> {
    rows.iter()
        .find(|r| r.config == config && r.mode == mode)
        .and_then(|r| r.time_to_target)
}

/// Runs `falcon experiment …`.
pub fn experiment(a: ExperimentArgs) -> Res {
    match a.which {
        Which::Stragglers(k) => stragglers(&k),
        Which::Dssp(k) => dssp(&k),
        Which::Fluentps(k) => fluentps(&k),
        Which::Falcon(k) => falcon(&k),
        Which::Fair(k) => fair(&k),
        Which::Zipline { out, quick } => zipline(&out, quick),
    }
}

const ALL_POLICIES: &str = "bsp,asp,ssp(3),ssp(6),ssp(15),dssp(3,15),epsp(0,fixed),epsp(4,fixed),\
     epsp(4),epsp(4,no-transfer),epsp(4)+static,fluentps(3,p=1),fluentps(3,p=0.5),\
     fluentps(3,p=0.1),fluentps(3,sigmoid),syncopt(1),asp+dynsgd,asp+consgd(0.5),flexrr(1),\
     elasticbsp(15)";

/// The fair comparison (`docs/results/fair-comparison.md`): every policy at its best
/// learning rate, momentum, the mean of a synchronous step, two seeds.
fn fair(k: &Knobs) -> Res {
    let s = k.resolve(Defaults {
        name: "fair",
        mode: "sim",
        entries: "bsp,ssp(3),dssp(3,15),epsp(0),epsp(4),flexrr(1),asp,syncopt(*)",
        workers: 16,
        hetero: &["12-15:h=0.5"],
        iters: 300,
        batch: 16,
        model: "mlp:784-64-10",
        target: 0.8,
        optimizer: "momentum(0.9)",
        aggregate: "mean",
        lr_grid: &[0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
        momenta: &[0.5, 0.9],
        seeds: 2,
        eval_every: Some(2),
        ..Defaults::default()
    })?;
    let data = Arc::new(Dataset::find(k.data.as_deref())?);
    run_setup(
        &s,
        &format!("fair comparison ({}, {} seeds)", s.optimizer, s.seeds.len()),
        &data,
    )?;
    Ok(())
}

fn stragglers(k: &Knobs) -> Res {
    let s = k.resolve(Defaults {
        name: "stragglers",
        mode: "both",
        entries: ALL_POLICIES,
        workers: 4,
        hetero: &["3:h=0.25"],
        iters: 600,
        batch: 64,
        lr: 0.05,
        model: "mlp:784-256-10",
        target: 0.83,
        repeat: 3,
        ..Defaults::default()
    })?;
    let data = Arc::new(Dataset::find(k.data.as_deref())?);
    run_setup(&s, "stragglers", &data)?;
    Ok(())
}

fn dssp(k: &Knobs) -> Res {
    let s = k.resolve(Defaults {
        name: "dssp",
        mode: "both",
        entries: "bsp,asp,ssp(3),ssp(6),ssp(15),dssp(3,15)",
        workers: 2,
        hetero: &["1:h=0.5"],
        iters: 1000,
        batch: 64,
        lr: 0.05,
        model: "mlp:784-256-10",
        target: 0.83,
        repeat: 3,
        ..Defaults::default()
    })?;
    let data = Arc::new(Dataset::find(k.data.as_deref())?);
    let rows = run_setup(&s, "DSSP Table I analogue (2 workers, 2:1)", &data)?;
    outln!(
        "\nDSSP's time to target against the others (paper, Table I to 0.67: ASP 1.01×, BSP 0.49×, SSP 0.53–0.54×):"
    );
    for &mode in &s.modes {
        let Some(d) = time_of(&rows, "dssp(3,15)", mode) else {
            outln!("  [{mode}] DSSP did not reach the target");
            continue;
        };
        let others: Vec<String> = ["asp", "bsp", "ssp(3)", "ssp(6)", "ssp(15)"]
            .iter()
            .map(|c| {
                time_of(&rows, c, mode).map_or(format!("{c} –"), |t| format!("{c} {:.2}×", d / t))
            })
            .collect();
        outln!("  [{mode}] DSSP / {}", others.join(", "));
    }
    Ok(())
}

fn fluentps(k: &Knobs) -> Res {
    let s = k.resolve(Defaults {
        name: "fluentps",
        mode: "sim",
        entries: "ssp(3),fluentps(3,p=1),fluentps(3,p=0.8),fluentps(3,p=0.5),fluentps(3,p=0.3),\
                  fluentps(3,p=0.1),fluentps(3,p=0.01),fluentps(3,p=0),fluentps(3,sigmoid),\
                  fluentps(3,fastest-sigmoid),bsp,asp",
        workers: 64,
        // FluentPS's injection: workers with rank % 4 == 0 sleep N(mean, sd) ms per iteration.
        hetero: &[],
        iters: 200,
        batch: 16,
        lr: 0.02,
        model: "mlp:784-10",
        target: 0.7,
        repeat: 1,
        ..Defaults::default()
    })?;
    let mut s = s;
    if k.hetero.is_empty() {
        for (w, h) in s.hetero.iter_mut().enumerate() {
            if w % 4 == 0 {
                *h = Hetero::parse("gauss(10,5)")?;
            }
        }
    }
    let data = Arc::new(Dataset::find(k.data.as_deref())?);
    let rows = run_setup(&s, "FluentPS parked pulls (64 workers)", &data)?;
    let parked = |c: &str| rows.iter().find(|r| r.config == c).map(|r| r.parked_pulls);
    if let Some(raw) = parked("ssp(3)") {
        outln!(
            "\nparked pulls, raw SSP(3) against FluentPS (paper: up to 131× more under raw SSP):"
        );
        for (c, _) in s.entries.iter().filter(|c| c.0.starts_with("fluentps")) {
            if let Some(p) = parked(c) {
                outln!(
                    "  {c}: {p} parked; raw SSP parks {}",
                    if p == 0 {
                        format!("{raw} (none here)")
                    } else {
                        format!("{:.1}× more", raw as f64 / p as f64)
                    }
                );
            }
        }
    }
    Ok(())
}

fn falcon(k: &Knobs) -> Res {
    let data = Arc::new(Dataset::find(k.data.as_deref())?);
    let entries = "epsp(4),flexrr(1),syncopt(1),asp+consgd(0.5),asp+dynsgd,bsp";
    let mut summary = Vec::new();
    for (label, profile) in [
        ("one", &["3:h=0.2"][..]),
        ("two", &["2:h=0.5", "3:h=0.2"][..]),
    ] {
        let mut s = k.resolve(Defaults {
            name: "falcon",
            mode: "both",
            entries,
            workers: 4,
            hetero: profile,
            iters: 600,
            batch: 64,
            lr: 0.05,
            model: "mlp:784-256-10",
            target: 0.83,
            repeat: 3,
            ..Defaults::default()
        })?;
        s.out = s.out.join(format!("{label}-slowed"));
        let rows = run_setup(
            &s,
            &format!("Falcon: EPSP against the baselines, {label} slowed worker(s)"),
            &data,
        )?;
        for &mode in &s.modes {
            let Some(e) = time_of(&rows, "epsp(4)", mode) else {
                summary.push(format!(
                    "  [{label} slowed, {mode}] EPSP did not reach the target"
                ));
                continue;
            };
            let cuts: Vec<String> = ["flexrr(1)", "syncopt(1)", "asp+consgd(0.5)", "asp+dynsgd"]
                .iter()
                .map(|c| {
                    time_of(&rows, c, mode).map_or(format!("{c} never reached"), |t| {
                        format!("{c} {:+.1}%", 100.0 * (1.0 - e / t))
                    })
                })
                .collect();
            summary.push(format!(
                "  [{label} slowed, {mode}] EPSP's convergence time shorter than {}",
                cuts.join(", ")
            ));
        }
    }
    outln!(
        "\nEPSP's time to target, shorter by (paper: up to 61.83% vs FlexRR, 55.19% vs Sync-opt, \
         38.92% vs ConSGD, 23.68% vs DynSGD):"
    );
    for l in &summary {
        outln!("{l}");
    }
    let out = k
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/falcon-experiment/falcon"));
    outln!("\ncompletion time and its variance against thread count:");
    crate::knee_run(k.quick, &out)?;
    Ok(())
}

fn zipline(out: &Path, quick: bool) -> Res {
    // The physical reference: one dependent random read in 64 MiB (a cache miss).
    let n = if quick { 100_000 } else { 1_000_000 };
    let miss_ns = falcon_bench::reference::miss_ns(64 << 20, n, 5);
    let rows = falcon_bench::zipline::measure(
        if quick { 3 } else { 11 },
        Duration::from_millis(if quick { 2 } else { 20 }),
    );
    let t = falcon_bench::zipline::table(&rows, miss_ns);
    outln!("ZipLine decision cost (one thread; a cache miss costs {miss_ns:.1} ns here)\n\n{t}");
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "miss_ns": miss_ns,
            "points": rows,
        }))?,
    )?;
    std::fs::write(out.join("table.md"), &t)?;
    let bars: Vec<(String, f64)> = rows
        .iter()
        .flat_map(|z| {
            [
                (format!("N={} R={} ours", z.n, z.r), z.us.log10()),
                (format!("N={} R={} paper", z.n, z.r), z.paper_us.log10()),
            ]
        })
        .collect();
    for ext in ["png", "svg"] {
        crate::plot::bar_chart(
            &out.join(format!("cost.{ext}")),
            "ZipLine decision cost, log10(us): ours against the paper's Table II",
            &bars,
        )?;
    }
    outln!("results: {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::tuned_variants;

    #[test]
    fn a_starred_syncopt_expands_to_one_variant_per_backup_count_folding_or_not() {
        assert_eq!(
            tuned_variants("syncopt(*)", 3, 16),
            ["syncopt(1)", "syncopt(2)", "syncopt(3)"]
        );
        assert_eq!(
            tuned_variants("syncopt(*,fold)+dynsgd", 2, 16),
            ["syncopt(1,fold)+dynsgd", "syncopt(2,fold)+dynsgd"]
        );
        // At least one backup, fewer than the workers.
        assert_eq!(tuned_variants("syncopt(*)", 0, 4), ["syncopt(1)"]);
        assert_eq!(tuned_variants("syncopt(*)", 9, 3).len(), 2);
        assert_eq!(tuned_variants("epsp(0)", 3, 16), ["epsp(0)"]);
    }
}
