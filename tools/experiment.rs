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

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::job::{JobReport, JobSpec, run_local};
use falcon_trainer::model::ModelSpec;
use falcon_trainer::sim::{SimReport, SimSpec, simulate};
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
    /// Configurations, comma-separated at the top level: POLICY[+static][+dynsgd|+consgd(F)].
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
    /// Server-side SGD learning rate (finite, > 0).
    #[arg(long, value_parser = crate::checks::learning_rate,
          allow_negative_numbers = true)]
    lr: Option<f32>,
    /// Model: mlp:784-256-10, mlp:784-10, cnn, …
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
    /// A short smoke run (few iterations).
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
    entries: Vec<String>,
    workers: u32,
    hetero: Vec<Hetero>,
    iters: u64,
    batch: usize,
    tasks: u32,
    lr: f32,
    model: ModelSpec,
    target: f64,
    repeat: u32,
    seed: u64,
    out: PathBuf,
    quiet: bool,
    /// Simulator: a full-speed iteration (virtual ms) and the one-way latency (virtual µs).
    base_ms: f64,
    latency_us: f64,
    eval_every: u64,
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
        let entries = top_level_split(self.policies.as_deref().unwrap_or(d.entries));
        if entries.is_empty() {
            return Err("--policies: no configuration".into());
        }
        for e in &entries {
            let parsed: Entry = crate::checks::setting(e.parse())?;
            crate::checks::policy_fits(&parsed.policy, e, workers)?;
        }
        let batch = self.batch.unwrap_or(d.batch).max(1);
        crate::checks::tasks_fit(4, batch as u64)?;
        let iters = self.iters.unwrap_or(d.iters);
        let iters = if self.quick { iters.min(20) } else { iters }.max(1);
        Ok(Setup {
            modes,
            entries,
            workers,
            hetero,
            iters,
            batch,
            tasks: 4,
            lr: self.lr.unwrap_or(d.lr),
            model: crate::checks::setting(self.model.as_deref().unwrap_or(d.model).parse())?,
            target: self.target.unwrap_or(d.target),
            repeat: self.repeat.unwrap_or(d.repeat).max(1),
            seed: self.seed,
            out: self
                .out
                .clone()
                .unwrap_or_else(|| Path::new("target/falcon-experiment").join(d.name)),
            quiet: self.quiet,
            base_ms: 10.0,
            latency_us: 50.0,
            eval_every: (iters / 40).max(1),
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
    bytes_moved: u64,
    tasks_transferred: u64,
    /// Seconds until the last worker finished.
    secs: f64,
    /// (seconds, test accuracy) of worker 0's snapshots.
    curve: Vec<(f64, f64)>,
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
            bytes_moved: r.bytes_moved,
            tasks_transferred: r.tasks_transferred,
            secs: r.secs,
            curve: r.curve.iter().map(|p| (p.secs, p.accuracy)).collect(),
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
            bytes_moved: r.bytes_moved,
            tasks_transferred: r.tasks_transferred,
            secs: r.virtual_secs,
            curve: r.curve.iter().map(|p| (p.secs, p.accuracy)).collect(),
        }
    }
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

/// Runs every configuration of `s` in `mode` (on `data`).
fn run_all(s: &Setup, mode: &'static str, data: &Arc<Dataset>) -> Res<Vec<Row>> {
    let mut rows = Vec::new();
    for entry in &s.entries {
        let e: Entry = entry.parse()?;
        let mut runs = Vec::new();
        let repeat = if mode == "sim" { 1 } else { s.repeat };
        for round in 0..repeat {
            let row = match mode {
                "sim" => {
                    let spec = SimSpec {
                        workers: s.workers,
                        iters: s.iters,
                        policy: e.policy,
                        scale: e.scale,
                        model: s.model.clone(),
                        batch: s.batch,
                        lr: s.lr,
                        seed: s.seed,
                        base_ns: (s.base_ms * 1e6) as u64,
                        latency_ns: (s.latency_us * 1e3) as u64,
                        hetero: s.hetero.clone(),
                        eval_every: s.eval_every,
                        eval_examples: 1000,
                        compute: true,
                        target: s.target,
                        tasks: s.tasks,
                        ..SimSpec::default()
                    };
                    Row::from_sim(entry, &simulate(&spec, data)?)
                }
                _ => {
                    let spec = JobSpec {
                        workers: s.workers,
                        servers: 2,
                        policy: e.policy,
                        model: s.model.clone(),
                        train: TrainConfig {
                            batch: s.batch,
                            tasks: s.tasks,
                            iters: s.iters,
                            seed: s.seed + u64::from(round),
                            eval_every: s.eval_every,
                            eval_examples: 1000,
                            transfer: true,
                        },
                        lr: s.lr,
                        elastic: e.elastic,
                        hetero: s.hetero.clone(),
                        medium: Medium::Auto,
                        target: s.target,
                        scale: e.scale,
                        ..JobSpec::default()
                    };
                    let total = u64::from(s.workers) * s.iters;
                    let pb = bar(s.quiet, total, format!("{entry} ({mode})"));
                    let r = run_local(&spec, data, |p| {
                        pb.set_position(p.iterations);
                        pb.set_message(format!("blocked {:.1} s", p.blocked_secs));
                    })?;
                    pb.finish_and_clear();
                    // Let the previous job's threads wind down before the next starts.
                    std::thread::sleep(Duration::from_millis(100));
                    Row::from_job(entry, &r)
                }
            };
            runs.push(row);
        }
        let key = |r: &Row| r.time_to_target.unwrap_or(f64::INFINITY);
        runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
        let times = runs.iter().map(|r| r.time_to_target).collect();
        let n = runs.len();
        let mut median = runs.swap_remove(n / 2);
        median.times = times;
        if rows.is_empty() {
            outln!("{}", table_header(s.target));
        }
        outln!("{}", table_row(&median, None));
        rows.push(median);
    }
    Ok(rows)
}

fn secs(t: Option<f64>) -> String {
    t.map_or("not reached".into(), |t| format!("{t:.2}"))
}

/// The Markdown table's header for `target`.
fn table_header(target: f64) -> String {
    format!(
        "| configuration | mode | time to {:.0}% (s) | × first | final acc | it/s | blocked s | parked pulls | dropped | MB moved | tasks moved |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        100.0 * target
    )
}

/// `r`'s row of the Markdown table, its time also as a ratio to `base`'s.
fn table_row(r: &Row, base: Option<f64>) -> String {
    let ratio = match (r.time_to_target, base) {
        (Some(x), Some(b)) if b > 0.0 => format!("{:.2}", x / b),
        _ => "–".into(),
    };
    format!(
        "| {} | {} | {} | {ratio} | {:.2}% | {:.1} | {:.2} | {} | {} | {:.1} | {} |",
        r.config,
        r.mode,
        secs(r.time_to_target),
        100.0 * r.final_accuracy,
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
        "configuration,mode,time_to_target_s,final_accuracy,iterations_per_s,blocked_s,parked_pulls,dropped_gradients,bytes_moved,tasks_transferred,secs\n",
    );
    for r in rows {
        let _ = writeln!(
            csv,
            "\"{}\",{},{},{:.5},{:.3},{:.4},{},{},{},{},{:.4}",
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
            r.secs
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
        falcon_bench::plot::line_chart(
            &dir.join(format!("{prefix}accuracy.{ext}")),
            &format!("{title}: test accuracy (%) against time ({unit})"),
            &series,
        )?;
        falcon_bench::plot::bar_chart(
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
            "\n{title} — {mode}: {} workers × {} iterations, {}, batch {}, lr {}, on {}; profile {}",
            s.workers,
            s.iters,
            s.model,
            s.batch,
            s.lr,
            data.source,
            profile(&s.hetero)
        );
        let rows = run_all(s, mode, data)?;
        let prefix = if s.modes.len() > 1 {
            format!("{mode}-")
        } else {
            String::new()
        };
        let t = write_outputs(
            &s.out,
            &prefix,
            &format!("{title} ({mode})"),
            &rows,
            s.target,
        )?;
        outln!("\n{t}");
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
        Which::Zipline { out, quick } => zipline(&out, quick),
    }
}

const ALL_POLICIES: &str = "bsp,asp,ssp(3),ssp(6),ssp(15),dssp(3,15),epsp(0,fixed),epsp(4,fixed),\
     epsp(4),epsp(4,no-transfer),epsp(4)+static,fluentps(3,p=1),fluentps(3,p=0.5),\
     fluentps(3,p=0.1),fluentps(3,sigmoid),syncopt(1),asp+dynsgd,asp+consgd(0.5),flexrr(1),\
     elasticbsp(15)";

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
        for c in s.entries.iter().filter(|c| c.starts_with("fluentps")) {
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
    use falcon_bench::reference::RandomReads;
    use falcon_bench::stats::median;
    // The physical reference: one dependent random read in 64 MiB (a cache miss).
    let mut misses = RandomReads::new(64 << 20);
    let n = if quick { 100_000 } else { 1_000_000 };
    misses.run(n);
    let mut miss: Vec<f64> = (0..5)
        .map(|_| misses.run(n).as_nanos() as f64 / n as f64)
        .collect();
    let miss_ns = median(&mut miss);
    let rows = falcon_bench::zipline::measure(
        if quick { 3 } else { 11 },
        Duration::from_millis(if quick { 2 } else { 20 }),
    );
    let mut t = String::from(
        "| N | R | ours µs | ns per point | × cache miss per point | paper µs (24-core Xeon) | paper / ours |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for z in &rows {
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0}× |",
            z.n,
            z.r,
            z.us,
            z.ns_per_point,
            z.ns_per_point / miss_ns,
            z.paper_us,
            z.speedup
        );
    }
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
        falcon_bench::plot::bar_chart(
            &out.join(format!("cost.{ext}")),
            "ZipLine decision cost, log10(us): ours against the paper's Table II",
            &bars,
        )?;
    }
    outln!("results: {}", out.display());
    Ok(())
}
