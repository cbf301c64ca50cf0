//! `falcon train`: real training on an embedded local cluster (scheduler, servers and one
//! thread per worker in this process, over the real transport), on Fashion-MNIST (the full
//! set when Debian's `dataset-fashion-mnist` is installed, else the bundled sample, or
//! `--data DIR`). Prints a progress bar, writes a JSON report and a PNG plot of accuracy
//! against time. `--compare` runs several configurations one after the other on the same
//! data and prints time-to-accuracy ratios against the first.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use falcon_engine::sync::PolicySpec;
use falcon_engine::update::ScaleSpec;
use falcon_trainer::data::{Dataset, Partition};
use falcon_trainer::device::{Device, Placement};
use falcon_trainer::hetero::Hetero;
use falcon_trainer::job::{Fault, JobReport, JobSpec, Timeouts, run_local};
use falcon_trainer::model::ModelSpec;
use falcon_trainer::train::TrainConfig;
use falcon_transport::Medium;
use indicatif::{ProgressBar, ProgressStyle};

use crate::checks::{self, Invalid, Layout, TimeoutArgs};

/// Options of `falcon train`.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Worker threads (each a falcon worker with its own pool). Defaults differ by
    /// subcommand: 4 here (one straggler among four shows what the policies do), 2 for
    /// `local` (processes on one small host), 16 for `sim` (virtual workers are cheap).
    #[arg(long, default_value_t = 4, env = "FALCON_NUM_WORKER",
          value_parser = checks::at_least_one_u32)]
    workers: u32,
    /// Parameter servers.
    #[arg(long, default_value_t = 2, env = "FALCON_NUM_SERVER",
          value_parser = checks::at_least_one_u32)]
    servers: u32,
    /// Synchronization policy: bsp, asp, ssp(N), dssp(L,U), syncopt(B|auto[,fold]),
    /// fluentps(N[,…]), epsp[(S[,fixed][,no-transfer])], flexrr[(S,…)], elasticbsp[(R)].
    #[arg(long, default_value = "epsp", env = "FALCON_POLICY")]
    policy: String,
    /// Several configurations, comma-separated at the top level, run one after the other:
    /// each a policy, optionally `+static` (parallelism control off) and `+dynsgd` or
    /// `+consgd(F)` (staleness scaling), e.g.
    /// `bsp,ssp(3),epsp,epsp(4,no-transfer),epsp+static,asp+dynsgd`.
    #[arg(long)]
    compare: Option<String>,
    /// Model: mlp:784-256-10, mlp:784-512-256-10, resmlp:784-64x4-10 (residual, CPU), cnn, cnn:C1-C2.
    #[arg(long, default_value = "mlp:784-256-10", env = "FALCON_MODEL")]
    model: String,
    /// Where the models compute: cpu, cuda (fails without a usable device) or auto (the
    /// first CUDA device when the build has feature `cuda` and the machine a device, else
    /// the CPU, saying why).
    #[arg(long, default_value = "auto", env = "FALCON_DEVICE")]
    device: String,
    /// Dataset directory (IDX files); default: Debian's Fashion-MNIST, else the bundled
    /// sample.
    #[arg(long, env = "FALCON_DATA")]
    data: Option<PathBuf>,
    /// Epochs over each worker's share of the training set.
    #[arg(long, default_value_t = 10.0, value_parser = checks::positive)]
    epochs: f64,
    /// Iterations per worker, at least 1 (overrides --epochs).
    #[arg(long, env = "FALCON_ITERS", value_parser = checks::at_least_one_u64)]
    iters: Option<u64>,
    /// Examples per worker per iteration.
    #[arg(long, default_value_t = 64, env = "FALCON_BATCH",
          value_parser = checks::at_least_one_usize)]
    batch: usize,
    /// Tasks (micro-batches) per iteration, 1 to the batch.
    #[arg(long, default_value_t = 4, env = "FALCON_TASKS",
          value_parser = checks::at_least_one_u32)]
    tasks: u32,
    /// Server-side SGD learning rate (finite, > 0). 0.05 for the models here, whose
    /// synchronous steps sum their tasks' gradients; `falcon role`'s default, 0.5, is for
    /// its synthetic workload (a mean of unit-scale gradients).
    #[arg(long, default_value_t = 0.05, env = "FALCON_LR", value_parser = checks::learning_rate,
          allow_negative_numbers = true)]
    lr: f32,
    /// The servers' optimizer: sgd, momentum(MU), adam, adam(B1,B2,EPS), adamw,
    /// adamw(B1,B2,EPS,WD), adagrad or adagrad(EPS), at --lr.
    #[arg(long, default_value = "sgd", env = "FALCON_OPTIMIZER")]
    optimizer: String,
    /// How a synchronous step's gradients combine: sum or mean.
    #[arg(long, default_value = "sum", value_parser = ["sum", "mean"])]
    aggregate: String,
    /// Initial pool threads per worker (at least 1).
    #[arg(long, default_value_t = 1, env = "FALCON_THREADS",
          value_parser = checks::at_least_one_usize)]
    threads: usize,
    /// Heterogeneity of workers, RANKS:SPEC with RANKS a rank N, a range A-B or * (SPEC:
    /// h=0.25, gauss(5,2), episodes(10,3,4), contention(2), trace(PATH), none);
    /// repeatable, or `;`-separated. Default: the last worker at h=0.25.
    #[arg(long, env = "FALCON_HETERO", value_delimiter = ';')]
    hetero: Vec<String>,
    /// No heterogeneity at all.
    #[arg(long)]
    uniform: bool,
    /// Target test accuracy for the time-to-accuracy figure, a fraction in (0, 1].
    #[arg(long, default_value_t = 0.75, value_parser = checks::accuracy_target,
          allow_negative_numbers = true)]
    target: f64,
    /// Snapshot worker 0's values every this many iterations (evaluated after training).
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    /// Test examples each snapshot is evaluated on (the final values use the whole split).
    #[arg(long, default_value_t = 2000)]
    eval_examples: usize,
    /// Medium between the nodes: auto, shm, tcp, rdma.
    #[arg(long, default_value = "auto", env = "FALCON_MEDIUM", value_parser = checks::medium)]
    medium: Medium,
    /// Where the JSON report and the PNG plot go.
    #[arg(long, default_value = "target/falcon-train")]
    out: PathBuf,
    /// Also write each configuration's trained model to DIR/<configuration>.npy: the final
    /// parameters, flat in the model's layout, float32 (NumPy's `numpy.load` reads it), with
    /// the model's spelling beside it in DIR/<configuration>.model. While it trains, the
    /// servers checkpoint every second into DIR/checkpoints/<configuration>/, so that a
    /// stopped run can go on with --resume DIR.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Go on with a run of the same configuration that --save DIR wrote and that stopped
    /// (killed, Ctrl-C): the servers start from its checkpoints and the workers at the
    /// iteration they hold, up to --iters; then the model is saved to DIR. Checkpoints of
    /// another configuration (model, policy, workers, servers, optimizer, seed, batch) are
    /// refused.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Shuffling and initialization seed.
    #[arg(long, default_value_t = 1, env = "FALCON_SEED")]
    seed: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Runs of each configuration (the comparison uses the median time to accuracy).
    #[arg(long, default_value_t = 1, value_parser = checks::at_least_one_u32)]
    repeat: u32,
    /// Write per-iteration metrics of every worker as JSON lines to `OUT/<run>.jsonl`.
    #[arg(long)]
    metrics: bool,
    /// Serve the job's metrics for Prometheus at http://ADDR/metrics while it runs (per
    /// worker and per server counters; e.g. 127.0.0.1:9464).
    #[arg(long, value_name = "IP:PORT", env = "FALCON_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    #[command(flatten)]
    timeouts: TimeoutArgs,
}

type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Splits on commas outside parentheses.
pub(crate) fn top_level_split(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    for ch in s.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// One configuration of a comparison: `POLICY[+static][+dynsgd|+consgd(F)]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Entry {
    pub policy: PolicySpec,
    /// Parallelism control on (off with `+static`).
    pub elastic: bool,
    /// Staleness scaling of asynchronously applied gradients.
    pub scale: ScaleSpec,
}

impl std::str::FromStr for Entry {
    type Err = Box<dyn std::error::Error>;
    fn from_str(entry: &str) -> Res<Entry> {
        let mut parts = entry.split('+');
        let policy: PolicySpec = parts.next().unwrap_or_default().parse()?;
        let mut e = Entry {
            policy,
            elastic: true,
            scale: ScaleSpec::Unscaled,
        };
        for extra in parts {
            match extra.trim() {
                "static" => e.elastic = false,
                other => {
                    e.scale = other.parse().map_err(|err| {
                        format!(
                            "configuration {entry}: after '+', static, dynsgd or consgd(F): {err}"
                        )
                    })?
                }
            }
        }
        if e.scale != ScaleSpec::Unscaled
            && e.policy.update_mode() == falcon_engine::update::UpdateMode::Sync
        {
            return Err(format!(
                "configuration {entry}: gradient scaling applies to asynchronously applied gradients, \
                 not to the summed clocks of a synchronous policy (BSP, Sync-opt, epsp(0))"
            )
            .into());
        }
        Ok(e)
    }
}

/// What `falcon train` runs, checked before anything starts (data included).
struct Plan {
    /// Each configuration: its text and its parse.
    entries: Vec<(String, Entry)>,
    model: ModelSpec,
    /// The device resolved once (`auto` becomes cpu or cuda) and where that put the model.
    device: Device,
    placement: Placement,
    hetero: Vec<Hetero>,
    timeouts: Timeouts,
    fault: Option<Fault>,
    optimizer: falcon_engine::update::Optimizer,
    aggregate: falcon_engine::update::Aggregate,
}

/// Checks everything that can be checked before the data is read and a cluster started.
fn plan(a: &TrainArgs) -> Res<Plan> {
    let texts = match &a.compare {
        Some(c) => top_level_split(c),
        None => vec![a.policy.clone()],
    };
    if texts.is_empty() {
        return Err(Invalid::NoConfiguration {
            flag: if a.compare.is_some() {
                "--compare"
            } else {
                "--policy"
            },
            example: "bsp,epsp",
        }
        .into());
    }
    let mut entries = Vec::new();
    for text in texts {
        let e: Entry = checks::setting(text.parse())?;
        checks::policy_fits(&e.policy, &text, a.workers)?;
        entries.push((text, e));
    }
    let model: ModelSpec = checks::setting(a.model.parse())?;
    // Its shape too (cheap: no parameters are allocated).
    checks::setting(model.build())?;
    let device: Device = checks::setting(a.device.parse())?;
    let (_, placement) = checks::setting(falcon_trainer::device::build(&model, device))?;
    let device = match placement {
        Placement::Cuda(_) => Device::Cuda,
        Placement::Cpu(_) => Device::Cpu,
    };
    checks::tasks_fit(u64::from(a.tasks), a.batch as u64)?;
    let hetero = if a.uniform {
        vec![Hetero::None; a.workers as usize]
    } else if a.hetero.is_empty() {
        let mut h = vec![Hetero::None; a.workers as usize];
        if a.workers > 1 {
            h[a.workers as usize - 1] = Hetero::parse("h=0.25")?;
        }
        h
    } else {
        checks::setting(falcon_trainer::hetero::assign(a.workers, &a.hetero))?
    };
    let timeouts = a.timeouts.resolve(None)?;
    checks::check_limits(
        Layout::OneProcess,
        &format!(
            "falcon train with {} worker(s) and {} server(s) ({} thread(s) each)",
            a.workers, a.servers, a.threads
        ),
        a.servers,
        a.workers,
        a.threads as u64,
        a.medium,
    )?;
    let fault = fault_from_env(a.workers)?;
    let optimizer = checks::setting(falcon_engine::update::Optimizer::parse(&a.optimizer, a.lr))?;
    let aggregate = aggregate_of(&a.aggregate);
    Ok(Plan {
        entries,
        model,
        device,
        placement,
        hetero,
        timeouts,
        fault,
        optimizer,
        aggregate,
    })
}

/// `--aggregate`'s value (clap admits only `sum` and `mean`).
fn aggregate_of(text: &str) -> falcon_engine::update::Aggregate {
    match text {
        "mean" => falcon_engine::update::Aggregate::Mean,
        _ => falcon_engine::update::Aggregate::Sum,
    }
}

/// The variable of the fault injection of tests: `RANK:error@MS` or `RANK:panic@MS` makes
/// worker RANK's thread fail, or panic, MS milliseconds after it starts.
const FAULT_VAR: &str = "FALCON_FAULT_WORKER";

fn fault_from_env(workers: u32) -> Result<Option<Fault>, Invalid> {
    let Some(v) = crate::env(&[FAULT_VAR]) else {
        return Ok(None);
    };
    let bad = || Invalid::Env {
        var: FAULT_VAR,
        value: v.clone(),
        why: format!(
            "expected RANK:error@MS or RANK:panic@MS with RANK a worker (0 to {})",
            workers.saturating_sub(1)
        ),
    };
    let (rank, rest) = v.split_once(':').ok_or_else(bad)?;
    let (kind, ms) = rest.split_once('@').unwrap_or((rest, "0"));
    let rank: u32 = rank.trim().parse().map_err(|_| bad())?;
    let ms: u64 = ms.trim().parse().map_err(|_| bad())?;
    if rank >= workers {
        return Err(bad());
    }
    let panic = match kind.trim() {
        "panic" => true,
        "error" => false,
        _ => return Err(bad()),
    };
    Ok(Some(Fault {
        rank,
        after: Duration::from_millis(ms),
        panic,
    }))
}

/// Where `--save` or `--resume` keeps the checkpoints of the run named `base`.
fn checkpoints(a: &TrainArgs, base: &str) -> Option<PathBuf> {
    a.resume
        .as_ref()
        .or(a.save.as_ref())
        .map(|d| d.join("checkpoints").join(base))
}

fn spec_for(
    a: &TrainArgs,
    plan: &Plan,
    (entry, base): (&str, &str),
    e: &Entry,
    data: &Dataset,
) -> JobSpec {
    let share = data.train.len() / a.workers as usize;
    let per_epoch = (share / a.batch.max(1)).max(1) as f64;
    let iters = a
        .iters
        .unwrap_or_else(|| (a.epochs * per_epoch).ceil().max(1.0) as u64);
    JobSpec {
        workers: a.workers,
        servers: a.servers,
        policy: e.policy,
        model: plan.model.clone(),
        device: plan.device,
        train: TrainConfig {
            batch: a.batch,
            tasks: a.tasks,
            iters,
            seed: a.seed,
            eval_every: a.eval_every,
            eval_examples: a.eval_examples,
            transfer: true,
        },
        lr: a.lr,
        optimizer: Some(plan.optimizer),
        aggregate: plan.aggregate,
        threads: a.threads,
        elastic: e.elastic,
        budget: 0,
        hetero: plan.hetero.clone(),
        medium: a.medium,
        target: a.target,
        metrics: a
            .metrics
            .then(|| a.out.join(format!("{}.jsonl", file_name(entry)))),
        scale: e.scale,
        timeouts: plan.timeouts,
        fault: plan.fault,
        metrics_addr: a.metrics_addr,
        checkpoint: checkpoints(a, base),
        // A configuration of a --compare that never started has nothing to resume: it
        // starts afresh (and says so).
        resume: a.resume.is_some() && checkpoints(a, base).is_some_and(|d| d.is_dir()),
    }
}

fn run_one(
    a: &TrainArgs,
    plan: &Plan,
    (entry, base, e): (&str, &str, &Entry),
    data: &Arc<Dataset>,
) -> Res<JobReport> {
    let spec = spec_for(a, plan, (entry, base), e, data);
    let total = u64::from(spec.workers) * spec.train.iters;
    let bar = if a.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} it {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(entry.to_string());
    let report = run_local(&spec, data, |p| {
        bar.set_position(p.iterations);
        let acc = p.last.as_ref().map_or(String::from("–"), |e| {
            format!("{:.1}%", 100.0 * e.accuracy)
        });
        bar.set_message(format!(
            "acc {acc}, {:.0} it/s, blocked {:.1} s",
            p.iterations as f64 / p.secs.max(1e-9),
            p.blocked_secs
        ));
    })?;
    bar.finish_and_clear();
    Ok(report)
}

fn print_report(r: &JobReport, entry: &str) {
    if let Some(at) = r.resumed_at {
        outln!("{entry}: resumed from the servers' checkpoints at iteration {at}");
    }
    outln!(
        "{entry}: {} on {} — {} workers, {} servers, {} at lr {} ({} of a step), {:.2} s, final accuracy {:.2}% (loss {:.3}), time to {:.0}%: {}",
        r.model,
        r.data,
        r.workers,
        r.servers,
        r.optimizer,
        r.lr,
        match r.aggregate {
            falcon_engine::update::Aggregate::Mean => "mean",
            falcon_engine::update::Aggregate::Sum => "sum",
        },
        r.secs,
        100.0 * r.final_accuracy,
        r.final_loss,
        100.0 * r.target,
        r.time_to_target
            .map_or("not reached".into(), |t| format!("{t:.2} s"))
    );
    for w in &r.per_worker {
        outln!(
            "  worker {} [{}]: {} it in {:.2} s, compute {:.2} s, blocked {:.2} s, injected {:.2} s, tasks own {} / given {} / helped {}, threads {}",
            w.rank,
            r.hetero.get(w.rank as usize).map_or("none", |s| s.as_str()),
            w.iterations,
            w.secs,
            w.compute_secs,
            w.blocked_secs,
            w.injected_secs,
            w.tasks_own,
            w.tasks_given,
            w.tasks_helped,
            compress(&w.threads)
        );
    }
    outln!(
        "  parked pulls {}, transfer offers {}, tasks transferred {}, parallelism plans {}, supervisor's classes: {}",
        r.parked_pulls,
        r.transfers_offered,
        r.tasks_transferred,
        r.parallelism_plans,
        r.classes.join(", ")
    );
}

/// `[1, 1, 1, 2, 2]` → `1×3 2×2`.
fn compress(v: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let j = v[i..].iter().take_while(|&&x| x == v[i]).count();
        out.push(format!("{}×{j}", v[i]));
        i += j;
    }
    out.join(" ")
}

/// Writes `r`'s final parameters to `dir/base.npy` (NumPy format 1.0: a little-endian
/// float32 vector) and the model's spelling to `dir/base.model`.
fn save_model(dir: &std::path::Path, base: &str, r: &JobReport) -> Res {
    std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", dir.display()))?;
    let npy = dir.join(format!("{base}.npy"));
    std::fs::write(&npy, npy_f32(&r.final_values))
        .map_err(|e| format!("--save: writing {}: {e}", npy.display()))?;
    let spec = dir.join(format!("{base}.model"));
    std::fs::write(&spec, format!("{}\n", r.model))
        .map_err(|e| format!("--save: writing {}: {e}", spec.display()))?;
    outln!(
        "model saved: {} ({} floats, {})",
        npy.display(),
        r.final_values.len(),
        r.model
    );
    Ok(())
}

/// `values` as a NumPy `.npy` file (format 1.0): magic, version, a header dict padded with
/// spaces to a multiple of 64 bytes ending in a newline, then the data.
pub(crate) fn npy_f32(values: &[f32]) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        values.len()
    );
    let unpadded = 6 + 2 + 2 + dict.len() + 1;
    let pad = (64 - unpadded % 64) % 64;
    let header = format!("{dict}{}\n", " ".repeat(pad));
    let mut out = Vec::with_capacity(10 + header.len() + 4 * values.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn file_name(entry: &str) -> String {
    entry
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Runs `falcon train`.
pub fn train(a: TrainArgs) -> Res {
    let plan = plan(&a)?;
    if plan.placement != Placement::Cpu(None) {
        outln!("compute: {}", plan.placement);
    }
    let data = Arc::new(Dataset::find(a.data.as_deref())?);
    let entries: Vec<String> = plan.entries.iter().map(|(t, _)| t.clone()).collect();
    std::fs::create_dir_all(&a.out)?;
    if let (Some(s), Some(r)) = (&a.save, &a.resume)
        && s != r
    {
        return Err(checks::Invalid::Setting(format!(
            "--save {} and --resume {}: a resumed run saves where it resumes from; give one",
            s.display(),
            r.display()
        ))
        .into());
    }
    if let Some(dir) = &a.resume
        && !dir.join("checkpoints").is_dir()
    {
        return Err(checks::Invalid::Setting(format!(
            "--resume {}: no checkpoints there (a run with --save {} writes them)",
            dir.display(),
            dir.display()
        ))
        .into());
    }
    let save = a.resume.as_ref().or(a.save.as_ref());
    if let Some(dir) = save {
        // Before training: a directory that cannot be made fails now, not after the run.
        std::fs::create_dir_all(dir).map_err(|e| format!("--save {}: {e}", dir.display()))?;
    }
    let mut reports = Vec::new();
    let mut runs: Vec<(String, Entry, Vec<JobReport>)> = plan
        .entries
        .iter()
        .map(|(t, e)| (t.clone(), *e, Vec::new()))
        .collect();
    // Rounds: every configuration once per round, so a slow period of the machine hits all.
    for round in 0..a.repeat.max(1) {
        for (entry, e, done) in runs.iter_mut() {
            // Each run's files share one base name (per round when repeated).
            let base = if a.repeat > 1 {
                format!("{}-run{}", file_name(entry), round + 1)
            } else {
                file_name(entry)
            };
            if a.resume.is_some() && checkpoints(&a, &base).is_some_and(|d| !d.is_dir()) {
                outln!(
                    "{entry}: no checkpoints of this configuration to resume; starting it afresh"
                );
            }
            let r = run_one(&a, &plan, (entry, &base, e), &data)?;
            print_report(&r, entry);
            std::fs::write(a.out.join(format!("{base}.json")), r.json())?;
            if let Some(dir) = save {
                save_model(dir, &base, &r)?;
            }
            done.push(r);
            // Let the previous job's threads wind down before the next starts.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for (entry, _, mut done) in runs {
        // The run of median time to accuracy represents the configuration.
        done.sort_by(|x, y| {
            let t = |r: &JobReport| r.time_to_target.unwrap_or(f64::INFINITY);
            t(x).total_cmp(&t(y))
        });
        let n = done.len();
        let times: Vec<String> = done
            .iter()
            .map(|r| r.time_to_target.map_or("–".into(), |t| format!("{t:.2}")))
            .collect();
        if n > 1 {
            outln!(
                "{entry}: times to target over {n} runs: {}",
                times.join(", ")
            );
        }
        reports.push((entry, done.swap_remove(n / 2)));
    }
    let series: Vec<(String, Vec<(f64, f64)>)> = reports
        .iter()
        .map(|(e, r)| {
            (
                e.clone(),
                r.curve
                    .iter()
                    .map(|p| (p.secs, 100.0 * p.accuracy))
                    .collect(),
            )
        })
        .collect();
    let png = a.out.join(if entries.len() == 1 {
        format!("{}.png", file_name(&entries[0]))
    } else {
        "compare.png".into()
    });
    crate::plot::line_chart(
        &png,
        &crate::plot::Lines::accuracy(
            "falcon train: test accuracy against time",
            "time (s)",
            &series,
            a.target,
        ),
    )?;
    outln!(
        "report: {} (JSON per run), plot: {}",
        a.out.display(),
        png.display()
    );
    if reports.len() > 1 {
        let (base_name, base) = &reports[0];
        outln!(
            "\ntime to {:.0}% test accuracy, against {base_name}:",
            100.0 * a.target
        );
        for (e, r) in &reports {
            let ratio = match (r.time_to_target, base.time_to_target) {
                (Some(t), Some(b)) if b > 0.0 => format!("{:.2}×", t / b),
                _ => "–".into(),
            };
            outln!(
                "  {e:<28} {:>10}  {ratio:>7}  final {:.2}%",
                r.time_to_target
                    .map_or("not reached".into(), |t| format!("{t:.2} s")),
                100.0 * r.final_accuracy
            );
        }
    }
    Ok(())
}

/// What a worker process of `--workload train` reads from the environment, checked.
pub(crate) struct TrainerEnv {
    /// Its training knobs.
    pub train: TrainConfig,
    /// Its initial pool threads.
    pub threads: usize,
    /// Every worker's heterogeneity (`FALCON_HETERO`).
    pub hetero: Vec<Hetero>,
}

/// Reads and checks `FALCON_BATCH`, `FALCON_TASKS`, `FALCON_ITERS`, `FALCON_SEED`,
/// `FALCON_THREADS` and `FALCON_HETERO` (whose ranks must be workers of a job of `workers`).
pub(crate) fn trainer_env(workers: u32) -> Res<TrainerEnv> {
    use checks::env_value;
    let batch = env_value(&["FALCON_BATCH"], 64, checks::at_least_one_usize)?;
    let tasks = env_value(&["FALCON_TASKS"], 4, checks::at_least_one_u32)?;
    checks::tasks_fit(u64::from(tasks), batch as u64)?;
    let train = TrainConfig {
        batch,
        tasks,
        iters: env_value(&["FALCON_ITERS"], 100, checks::at_least_one_u64)?,
        seed: env_value(&["FALCON_SEED"], 1, checks::whole)?,
        eval_every: 0,
        eval_examples: 0,
        transfer: true,
    };
    let threads = env_value(&["FALCON_THREADS"], 1, checks::at_least_one_usize)?;
    let list = crate::env(&["FALCON_HETERO"]).unwrap_or_default();
    let hetero =
        falcon_trainer::hetero::assign(workers, &falcon_trainer::hetero::split_entries(&list))
            .map_err(|e| checks::Invalid::Env {
                var: "FALCON_HETERO",
                value: list.clone(),
                why: e.to_string(),
            })?;
    Ok(TrainerEnv {
        train,
        threads,
        hetero,
    })
}

/// A worker process of a multi-process job (`falcon role` with `FALCON_WORKLOAD=train`):
/// trains its share with the trainer, then worker 0 reports the test accuracy of the final
/// values. Configured from the environment: `FALCON_MODEL`, `FALCON_DEVICE`, `FALCON_DATA`,
/// `FALCON_ITERS`,
/// `FALCON_BATCH`, `FALCON_TASKS`, `FALCON_THREADS`, `FALCON_SEED`, and `FALCON_HETERO`
/// (`RANK:SPEC;RANK:SPEC…`, the entry of this worker's rank applies).
pub fn role_worker(cfg: &falcon_engine::JobConfig, rank: Option<u32>) -> Res {
    use crate::env;
    use falcon_engine::keys::TensorSpec;
    use falcon_trainer::hetero::Injector;
    use falcon_trainer::train::{TENSOR, Trainer, evaluate};

    // Checked before the data is read or the job joined.
    let TrainerEnv {
        train,
        threads,
        hetero: all_hetero,
    } = trainer_env(cfg.workers)?;
    let spec = env(&["FALCON_MODEL"])
        .unwrap_or_else(|| "mlp:784-256-10".into())
        .parse::<ModelSpec>()?;
    let device = env(&["FALCON_DEVICE"])
        .unwrap_or_else(|| "auto".into())
        .parse::<Device>()?;
    let (model, placement) = falcon_trainer::device::build(&spec, device)?;
    if placement != Placement::Cpu(None) {
        tracing::info!("compute: {placement}");
    }
    let model: Arc<dyn falcon_trainer::model::Model> = model.into();
    let data = Arc::new(Dataset::find(
        env(&["FALCON_DATA"]).as_deref().map(std::path::Path::new),
    )?);
    let tensors = vec![TensorSpec::new(TENSOR, model.num_params() as u64)];
    let w = falcon_engine::Worker::join(cfg, tensors, rank)?;
    crate::logs::label(format!("worker {}", w.rank()));
    crate::spawn_link_dropper(&w)?;
    let me = w.rank();
    let hetero = all_hetero.get(me as usize).cloned().unwrap_or(Hetero::None);
    if me == 0 && !w.rejoined() {
        let init = w.buffer(TENSOR)?;
        init.write_at(
            0,
            falcon_engine::worker::f32_bytes(&model.init_vec(train.seed)),
        )?;
        w.init(TENSOR, &init)?;
    }
    // Nobody pulls before the initial values are in (a rejoining worker finds them there).
    if !w.rejoined() {
        w.barrier()?;
    }
    let iters = train.iters;
    let injector = Injector::new(hetero.clone(), u64::from(me) + 17)?;
    let summary = Trainer::new(
        w.clone(),
        model.clone(),
        data.clone(),
        train,
        threads,
        injector,
    )?
    .run(|_| {})?;
    w.barrier()?;
    let out = w.buffer(TENSOR)?;
    w.pull(TENSOR, &out, iters)?;
    let mut params = vec![0f32; model.num_params()];
    out.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut params))?;
    let (acc, loss) = evaluate(&*model, &params, &data.test, 0)?;
    outln!(
        "worker {me} [{hetero}]: {iters} iterations in {:.2} s, compute {:.2} s, blocked {:.2} s, tasks own {} / given {} / helped {} / covered for dead workers {}, reconnects {}, lost updates {}; test accuracy {:.2}% (loss {loss:.3}) on {}",
        summary.secs,
        summary.compute_secs,
        summary.blocked_secs,
        summary.tasks_own,
        summary.tasks_given,
        summary.tasks_helped,
        summary.tasks_covered,
        w.stats().reconnects,
        w.stats().lost_updates,
        100.0 * acc,
        data.source
    );
    w.finish()?;
    Ok(())
}

/// Options of `falcon sim`.
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// Simulated workers (16 by default: virtual workers are cheap; `train` runs 4 real ones).
    #[arg(long, default_value_t = 16, env = "FALCON_NUM_WORKER",
          value_parser = checks::at_least_one_u32)]
    workers: u32,
    /// Iterations per worker.
    #[arg(long, default_value_t = 200, env = "FALCON_ITERS",
          value_parser = checks::at_least_one_u64)]
    iters: u64,
    /// Policies to compare, comma-separated at the top level (each as for `train`).
    #[arg(long, default_value = "bsp,ssp(3),dssp(3,15),epsp,asp")]
    policies: String,
    /// Model: small ones keep large runs fast (mlp:784-10 is logistic regression; resmlp:784-64x4-10 is a deeper residual one).
    #[arg(long, default_value = "mlp:784-10", env = "FALCON_MODEL")]
    model: String,
    /// Examples per worker per iteration.
    #[arg(long, default_value_t = 16, env = "FALCON_BATCH",
          value_parser = checks::at_least_one_usize)]
    batch: usize,
    /// Server-side SGD learning rate (finite, > 0). 0.05 for the models here, whose
    /// synchronous steps sum their tasks' gradients; `falcon role`'s default, 0.5, is for
    /// its synthetic workload (a mean of unit-scale gradients).
    #[arg(long, default_value_t = 0.05, env = "FALCON_LR", value_parser = checks::learning_rate,
          allow_negative_numbers = true)]
    lr: f32,
    /// The servers' optimizer: sgd, momentum(MU), adam, adam(B1,B2,EPS), adamw,
    /// adamw(B1,B2,EPS,WD), adagrad or adagrad(EPS), at --lr.
    #[arg(long, default_value = "sgd")]
    optimizer: String,
    /// How a synchronous step's gradients combine: sum or mean.
    #[arg(long, default_value = "sum", value_parser = ["sum", "mean"])]
    aggregate: String,
    /// A full-speed iteration, in virtual milliseconds (> 0).
    #[arg(long, default_value_t = 10.0, value_parser = checks::positive)]
    base_ms: f64,
    /// Uniform jitter of an iteration, as a fraction in [0, 1).
    #[arg(long, default_value_t = 0.1, value_parser = checks::jitter)]
    jitter: f64,
    /// One-way network latency, virtual microseconds (≥ 0).
    #[arg(long, default_value_t = 50.0, value_parser = checks::non_negative)]
    latency_us: f64,
    /// Bandwidth of every link, Gbit/s (0: unlimited); the model's bytes pay it on the
    /// worker's link and, shared, at the servers.
    #[arg(long, default_value_t = 10.0, value_parser = checks::non_negative)]
    bandwidth_gbps: f64,
    /// The servers' apply cost, virtual ns per float (default: the measured cost of the
    /// optimizer: SGD 0.11, momentum 0.29, Adam and Adagrad 0.93).
    #[arg(long, value_parser = checks::non_negative)]
    apply_ns: Option<f64>,
    /// Servers sharing the model (each holds 1/servers of it; they work in parallel).
    #[arg(long, default_value_t = 2, value_parser = checks::at_least_one_u32)]
    servers: u32,
    /// How the training data is divided among the workers: iid (a fixed random share each),
    /// skewed (a fixed share of label-sorted data: few classes each) or shuffled (every epoch
    /// reshuffled across all workers).
    #[arg(long, default_value = "iid", value_parser = ["iid", "skewed", "shuffled"])]
    partition: String,
    /// Cores of each worker's host: the parallelism manager plans each worker's threads, an
    /// iteration of p threads taking 1/min(p, cores) of its one-thread time (0: one thread
    /// each, no manager).
    #[arg(long, default_value_t = 0)]
    host_cores: usize,
    /// Heterogeneity RANKS:SPEC (RANKS: N, A-B or *; repeatable, or `;`-separated); default:
    /// the last worker at h=0.25.
    #[arg(long, env = "FALCON_HETERO", value_delimiter = ';')]
    hetero: Vec<String>,
    /// Also slow every worker of this fraction of ranks (from the top) with --slow-spec, in
    /// [0, 1].
    #[arg(long, default_value_t = 0.0, value_parser = checks::fraction)]
    slow_fraction: f64,
    /// The profile of --slow-fraction's workers.
    #[arg(long, default_value = "h=0.5")]
    slow_spec: String,
    /// Evaluate the servers' parameters every this many full-speed iterations of virtual
    /// time (0: only at the end).
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    /// Test examples per evaluation, spread evenly over the test split (0: all; the final
    /// accuracy always uses all).
    #[arg(long, default_value_t = 2000)]
    eval_examples: usize,
    /// Timing and policies only, no gradients.
    #[arg(long)]
    no_compute: bool,
    /// Equal tasks per iteration: the unit EPSP's and FlexRR's task transfer moves (1 to the
    /// batch).
    #[arg(long, default_value_t = 4, env = "FALCON_TASKS",
          value_parser = checks::at_least_one_u32)]
    tasks: u32,
    /// Count the policies' task-transfer offers without carrying them out.
    #[arg(long)]
    no_transfer: bool,
    /// Target accuracy for time to accuracy, a fraction in (0, 1].
    #[arg(long, default_value_t = 0.7, value_parser = checks::accuracy_target,
          allow_negative_numbers = true)]
    target: f64,
    /// Dataset directory (default: Debian's Fashion-MNIST, else the bundled sample).
    #[arg(long, env = "FALCON_DATA")]
    data: Option<PathBuf>,
    /// Seed.
    #[arg(long, default_value_t = 1, env = "FALCON_SEED")]
    seed: u64,
    /// Where the JSON reports go.
    #[arg(long, default_value = "target/falcon-sim")]
    out: PathBuf,
}

/// Runs `falcon sim`: every policy on the same simulated workers and seed.
pub fn sim(a: SimArgs) -> Res {
    use falcon_trainer::sim::SimSpec;
    // Everything checked before the data is read.
    let mut entries = Vec::new();
    for p in top_level_split(&a.policies) {
        let entry: Entry = checks::setting(p.parse())?;
        checks::policy_fits(&entry.policy, &p, a.workers)?;
        entries.push((p, entry));
    }
    if entries.is_empty() {
        return Err(Invalid::NoConfiguration {
            flag: "--policies",
            example: "bsp,epsp",
        }
        .into());
    }
    let model: ModelSpec = checks::setting(a.model.parse())?;
    // Its shape too (cheap: no parameters are allocated).
    checks::setting(model.build())?;
    checks::tasks_fit(u64::from(a.tasks), a.batch as u64)?;
    let n = a.workers as usize;
    let mut hetero = vec![Hetero::None; n];
    let slow = (a.slow_fraction * n as f64).round() as usize;
    for h in hetero.iter_mut().skip(n - slow) {
        *h = checks::setting(Hetero::parse(&a.slow_spec))?;
    }
    if a.hetero.is_empty() && slow == 0 && n > 1 {
        hetero[n - 1] = Hetero::parse("h=0.25")?;
    }
    checks::setting(falcon_trainer::hetero::assign_onto(&mut hetero, &a.hetero))?;
    let optimizer = checks::setting(falcon_engine::update::Optimizer::parse(&a.optimizer, a.lr))?;
    let aggregate = aggregate_of(&a.aggregate);
    let data = Dataset::find(a.data.as_deref())?;
    std::fs::create_dir_all(&a.out)?;
    outln!(
        "falcon sim: {} workers × {} iterations, model {}, batch {}, on {}",
        a.workers,
        a.iters,
        a.model,
        a.batch,
        data.source
    );
    outln!(
        "\n| policy | virtual s | it/s (virtual) | time to {:.0}% | final acc | blocked s (mean) | parked | dropped | offers / tasks moved | wall s | of which gradients s |\n|---|---|---|---|---|---|---|---|---|---|---|",
        100.0 * a.target
    );
    let mut specs = Vec::new();
    for (_, entry) in &entries {
        specs.push(SimSpec {
            workers: a.workers,
            iters: a.iters,
            policy: entry.policy,
            model: model.clone(),
            batch: a.batch,
            lr: a.lr,
            optimizer: Some(optimizer),
            aggregate,
            seed: a.seed,
            base_ns: (a.base_ms * 1e6) as u64,
            jitter: a.jitter,
            latency_ns: (a.latency_us * 1e3) as u64,
            bandwidth: a.bandwidth_gbps * 1e9 / 8.0,
            apply_ns_per_float: a.apply_ns,
            servers: a.servers,
            partition: checks::setting(a.partition.parse::<Partition>())?,
            host_cores: (a.host_cores > 0).then_some(a.host_cores),
            hetero: hetero.clone(),
            eval_every: a.eval_every,
            eval_examples: a.eval_examples,
            compute: !a.no_compute,
            target: a.target,
            tasks: a.tasks,
            transfer: !a.no_transfer,
            scale: entry.scale,
        });
    }
    // Each policy's simulation on a core of its own; the rows in the order asked.
    let mut series = Vec::new();
    let mut failed = None;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    falcon_trainer::sim::simulate_all(&specs, &data, cores, |i, r| {
        if failed.is_some() {
            return;
        }
        let p = &entries[i].0;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                failed = Some(e);
                return;
            }
        };
        let mean_blocked = r.blocked_secs.iter().sum::<f64>() / r.blocked_secs.len().max(1) as f64;
        outln!(
            "| {} | {:.2} | {:.0} | {} | {:.2}%{} | {:.2} | {} | {} | {} / {} | {:.2} | {:.2} |",
            p,
            r.virtual_secs,
            r.iterations_per_sec,
            r.time_to_target.map_or("–".into(), |t| format!("{t:.2} s")),
            100.0 * r.final_accuracy,
            if r.diverged { " (diverged)" } else { "" },
            mean_blocked,
            r.parked_pulls,
            r.dropped,
            r.transfers_offered,
            r.tasks_transferred,
            r.wall_secs,
            r.gradient_secs
        );
        if let Err(e) = std::fs::write(a.out.join(format!("{}.json", file_name(p))), r.json()) {
            failed = Some(e.into());
            return;
        }
        series.push((
            p.clone(),
            r.curve
                .iter()
                .map(|e| (e.secs, 100.0 * e.accuracy))
                .collect(),
        ));
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    let png = a.out.join("accuracy.png");
    crate::plot::line_chart(
        &png,
        &crate::plot::Lines::accuracy(
            "falcon sim: test accuracy against virtual time",
            "virtual time (s)",
            &series,
            a.target,
        ),
    )?;
    outln!(
        "\nreports: {} (JSON per policy), plot: {}",
        a.out.display(),
        png.display()
    );
    Ok(())
}
