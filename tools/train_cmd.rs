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
use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::job::{JobReport, JobSpec, run_local};
use falcon_trainer::model::ModelSpec;
use falcon_trainer::train::TrainConfig;
use falcon_transport::Medium;
use indicatif::{ProgressBar, ProgressStyle};

/// Options of `falcon train`.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Worker threads (each a falcon worker with its own pool).
    #[arg(long, default_value_t = 4, env = "FALCON_NUM_WORKER")]
    workers: u32,
    /// Parameter servers.
    #[arg(long, default_value_t = 2, env = "FALCON_NUM_SERVER")]
    servers: u32,
    /// Synchronization policy: bsp, asp, ssp(N), dssp(L,U), syncopt(B),
    /// fluentps(N[,…]), epsp[(S[,fixed][,no-transfer])], flexrr[(S,…)], elasticbsp[(R)].
    #[arg(long, default_value = "epsp", env = "FALCON_POLICY")]
    policy: String,
    /// Several configurations, comma-separated at the top level, run one after the other:
    /// each a policy, optionally `+static` (parallelism control off) and `+dynsgd` or
    /// `+consgd(F)` (staleness scaling), e.g.
    /// `bsp,ssp(3),epsp,epsp(4,no-transfer),epsp+static,asp+dynsgd`.
    #[arg(long)]
    compare: Option<String>,
    /// Model: mlp:784-256-10, mlp:784-512-256-10, cnn, cnn:C1-C2.
    #[arg(long, default_value = "mlp:784-256-10", env = "FALCON_MODEL")]
    model: String,
    /// Dataset directory (IDX files); default: Debian's Fashion-MNIST, else the bundled
    /// sample.
    #[arg(long, env = "FALCON_DATA")]
    data: Option<PathBuf>,
    /// Epochs over each worker's share of the training set.
    #[arg(long, default_value_t = 10.0)]
    epochs: f64,
    /// Iterations per worker (overrides --epochs).
    #[arg(long, env = "FALCON_ITERS")]
    iters: Option<u64>,
    /// Examples per worker per iteration.
    #[arg(long, default_value_t = 64, env = "FALCON_BATCH")]
    batch: usize,
    /// Tasks (micro-batches) per iteration.
    #[arg(long, default_value_t = 4, env = "FALCON_TASKS")]
    tasks: u32,
    /// Server-side SGD learning rate.
    #[arg(long, default_value_t = 0.05, env = "FALCON_LR")]
    lr: f32,
    /// Initial pool threads per worker.
    #[arg(long, default_value_t = 1, env = "FALCON_THREADS")]
    threads: usize,
    /// Heterogeneity of a worker, RANK:SPEC (h=0.25, gauss(5,2), episodes(10,3,4),
    /// contention(2), none); repeatable. Default: the last worker at h=0.25.
    #[arg(long)]
    hetero: Vec<String>,
    /// No heterogeneity at all.
    #[arg(long)]
    uniform: bool,
    /// Target test accuracy for the time-to-accuracy figure.
    #[arg(long, default_value_t = 0.75)]
    target: f64,
    /// Snapshot worker 0's values every this many iterations (evaluated after training).
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    /// Test examples each snapshot is evaluated on (the final values use the whole split).
    #[arg(long, default_value_t = 2000)]
    eval_examples: usize,
    /// Medium between the nodes: auto, shm, tcp, rdma.
    #[arg(long, default_value = "auto", env = "FALCON_MEDIUM")]
    medium: String,
    /// Where the JSON report and the PNG plot go.
    #[arg(long, default_value = "target/falcon-train")]
    out: PathBuf,
    /// Shuffling and initialization seed.
    #[arg(long, default_value_t = 1, env = "FALCON_SEED")]
    seed: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Runs of each configuration (the comparison uses the median time to accuracy).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Write per-iteration metrics of every worker as JSON lines to `OUT/<run>.jsonl`.
    #[arg(long)]
    metrics: bool,
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
                        format!("{entry:?}: after '+', static, dynsgd or consgd(F): {err}")
                    })?
                }
            }
        }
        if e.scale != ScaleSpec::Unscaled && is_sync(&e) {
            return Err(format!(
                "{entry:?}: gradient scaling applies to asynchronously applied gradients, \
                 not to the summed clocks of BSP or Sync-opt"
            )
            .into());
        }
        Ok(e)
    }
}

fn is_sync(e: &Entry) -> bool {
    matches!(e.policy, PolicySpec::Bsp | PolicySpec::SyncOpt { .. })
}

fn spec_for(a: &TrainArgs, entry: &str, data: &Dataset) -> Res<JobSpec> {
    let Entry {
        policy,
        elastic,
        scale,
    } = entry.parse()?;
    let model: ModelSpec = a.model.parse()?;
    if a.workers == 0 || a.servers == 0 {
        return Err("--workers and --servers must be at least 1".into());
    }
    let share = data.train.len() / a.workers as usize;
    let per_epoch = (share / a.batch.max(1)).max(1) as f64;
    let iters = a
        .iters
        .unwrap_or_else(|| (a.epochs * per_epoch).ceil().max(1.0) as u64);
    let mut hetero = vec![Hetero::None; a.workers as usize];
    if !a.uniform {
        if a.hetero.is_empty() {
            if a.workers > 1 {
                hetero[a.workers as usize - 1] = Hetero::parse("h=0.25")?;
            }
        } else {
            for h in &a.hetero {
                let (rank, spec) = h
                    .split_once(':')
                    .ok_or_else(|| format!("--hetero {h:?}: expected RANK:SPEC"))?;
                let rank: usize = rank
                    .parse()
                    .map_err(|_| format!("--hetero {h:?}: bad rank"))?;
                let slot = hetero
                    .get_mut(rank)
                    .ok_or_else(|| format!("--hetero {h:?}: no worker {rank}"))?;
                *slot = Hetero::parse(spec)?;
            }
        }
    }
    Ok(JobSpec {
        workers: a.workers,
        servers: a.servers,
        policy,
        model,
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
        threads: a.threads,
        elastic,
        budget: 0,
        hetero,
        medium: a.medium.parse::<Medium>()?,
        target: a.target,
        metrics: a
            .metrics
            .then(|| a.out.join(format!("{}.jsonl", file_name(entry)))),
        scale,
    })
}

fn run_one(a: &TrainArgs, entry: &str, data: &Arc<Dataset>) -> Res<JobReport> {
    let spec = spec_for(a, entry, data)?;
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
    println!(
        "{entry}: {} on {} — {} workers, {} servers, {:.2} s, final accuracy {:.2}% (loss {:.3}), time to {:.0}%: {}",
        r.model,
        r.data,
        r.workers,
        r.servers,
        r.secs,
        100.0 * r.final_accuracy,
        r.final_loss,
        100.0 * r.target,
        r.time_to_target
            .map_or("not reached".into(), |t| format!("{t:.2} s"))
    );
    for w in &r.per_worker {
        println!(
            "  worker {} [{}]: {} it in {:.2} s, compute {:.2} s, blocked {:.2} s, injected {:.2} s, tasks own {} / given {} / helped {}, threads {:?}",
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
    println!(
        "  parked pulls {}, transfer offers {}, tasks transferred {}, parallelism plans {}, supervisor's classes {:?}",
        r.parked_pulls, r.transfers_offered, r.tasks_transferred, r.parallelism_plans, r.classes
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

fn file_name(entry: &str) -> String {
    entry
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Runs `falcon train`.
pub fn train(a: TrainArgs) -> Res {
    let data = Arc::new(Dataset::find(a.data.as_deref())?);
    let entries = match &a.compare {
        Some(c) => top_level_split(c),
        None => vec![a.policy.clone()],
    };
    if entries.is_empty() {
        return Err("--compare: no configuration".into());
    }
    std::fs::create_dir_all(&a.out)?;
    let mut reports = Vec::new();
    let mut runs: Vec<(String, Vec<JobReport>)> =
        entries.iter().map(|e| (e.clone(), Vec::new())).collect();
    // Rounds: every configuration once per round, so a slow period of the machine hits all.
    for round in 0..a.repeat.max(1) {
        for (entry, done) in runs.iter_mut() {
            let r = run_one(&a, entry, &data)?;
            print_report(&r, entry);
            let name = if a.repeat > 1 {
                format!("{}-run{}.json", file_name(entry), round + 1)
            } else {
                format!("{}.json", file_name(entry))
            };
            std::fs::write(a.out.join(name), r.json())?;
            done.push(r);
            // Let the previous job's threads wind down before the next starts.
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for (entry, mut done) in runs {
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
            println!(
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
    falcon_bench::plot::line_chart(&png, "test accuracy (%) against time (s)", &series)?;
    println!(
        "report: {} (JSON per run), plot: {}",
        a.out.display(),
        png.display()
    );
    if reports.len() > 1 {
        let (base_name, base) = &reports[0];
        println!(
            "\ntime to {:.0}% test accuracy, against {base_name}:",
            100.0 * a.target
        );
        for (e, r) in &reports {
            let ratio = match (r.time_to_target, base.time_to_target) {
                (Some(t), Some(b)) if b > 0.0 => format!("{:.2}×", t / b),
                _ => "–".into(),
            };
            println!(
                "  {e:<28} {:>10}  {ratio:>7}  final {:.2}%",
                r.time_to_target
                    .map_or("not reached".into(), |t| format!("{t:.2} s")),
                100.0 * r.final_accuracy
            );
        }
    }
    Ok(())
}

/// A worker process of a multi-process job (`falcon role` with `FALCON_WORKLOAD=train`):
/// trains its share with the trainer, then worker 0 reports the test accuracy of the final
/// values. Configured from the environment: `FALCON_MODEL`, `FALCON_DATA`, `FALCON_ITERS`,
/// `FALCON_BATCH`, `FALCON_TASKS`, `FALCON_THREADS`, `FALCON_SEED`, and `FALCON_HETERO`
/// (`RANK:SPEC;RANK:SPEC…`, the entry of this worker's rank applies).
pub fn role_worker(cfg: &falcon_engine::JobConfig, rank: Option<u32>) -> Res {
    use crate::{env, env_parse};
    use falcon_engine::keys::TensorSpec;
    use falcon_trainer::hetero::Injector;
    use falcon_trainer::train::{TENSOR, Trainer, evaluate};

    let data = Arc::new(Dataset::find(
        env(&["FALCON_DATA"]).as_deref().map(std::path::Path::new),
    )?);
    let model: Arc<dyn falcon_trainer::model::Model> = env(&["FALCON_MODEL"])
        .unwrap_or_else(|| "mlp:784-256-10".into())
        .parse::<ModelSpec>()?
        .build()?
        .into();
    let train = TrainConfig {
        batch: env_parse(&["FALCON_BATCH"], 64)?,
        tasks: env_parse(&["FALCON_TASKS"], 4)?,
        iters: env_parse(&["FALCON_ITERS"], 100)?,
        seed: env_parse(&["FALCON_SEED"], 1)?,
        eval_every: 0,
        eval_examples: 0,
        transfer: true,
    };
    let threads: usize = env_parse(&["FALCON_THREADS"], 1)?;
    let tensors = vec![TensorSpec {
        name: TENSOR.into(),
        len: model.num_params() as u64,
    }];
    let w = falcon_engine::Worker::join(cfg, tensors, rank)?;
    crate::spawn_link_dropper(&w)?;
    let me = w.rank();
    let mut hetero = Hetero::None;
    for entry in env(&["FALCON_HETERO"]).unwrap_or_default().split(';') {
        if let Some((r, spec)) = entry.split_once(':')
            && r.trim().parse::<u32>().ok() == Some(me)
        {
            hetero = Hetero::parse(spec)?;
        }
    }
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
    println!(
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
    /// Simulated workers.
    #[arg(long, default_value_t = 16, env = "FALCON_NUM_WORKER")]
    workers: u32,
    /// Iterations per worker.
    #[arg(long, default_value_t = 200, env = "FALCON_ITERS")]
    iters: u64,
    /// Policies to compare, comma-separated at the top level (each as for `train`).
    #[arg(long, default_value = "bsp,ssp(3),dssp(3,15),epsp,asp")]
    policies: String,
    /// Model: small ones keep large runs fast (mlp:784-10 is logistic regression).
    #[arg(long, default_value = "mlp:784-10", env = "FALCON_MODEL")]
    model: String,
    /// Examples per worker per iteration.
    #[arg(long, default_value_t = 16, env = "FALCON_BATCH")]
    batch: usize,
    /// Server-side SGD learning rate.
    #[arg(long, default_value_t = 0.05, env = "FALCON_LR")]
    lr: f32,
    /// A full-speed iteration, in virtual milliseconds.
    #[arg(long, default_value_t = 10.0)]
    base_ms: f64,
    /// Uniform jitter of an iteration, as a fraction.
    #[arg(long, default_value_t = 0.1)]
    jitter: f64,
    /// One-way network latency, virtual microseconds.
    #[arg(long, default_value_t = 50.0)]
    latency_us: f64,
    /// Heterogeneity RANK:SPEC (repeatable); default: the last worker at h=0.25.
    #[arg(long)]
    hetero: Vec<String>,
    /// Also slow every worker of this fraction of ranks (from the top) with --slow-spec.
    #[arg(long, default_value_t = 0.0)]
    slow_fraction: f64,
    /// The profile of --slow-fraction's workers.
    #[arg(long, default_value = "h=0.5")]
    slow_spec: String,
    /// Evaluate worker 0's values every this many of its iterations.
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    /// Test examples per evaluation.
    #[arg(long, default_value_t = 500)]
    eval_examples: usize,
    /// Timing and policies only, no gradients.
    #[arg(long)]
    no_compute: bool,
    /// Equal tasks per iteration: the unit EPSP's and FlexRR's task transfer moves.
    #[arg(long, default_value_t = 4, env = "FALCON_TASKS")]
    tasks: u32,
    /// Count the policies' task-transfer offers without carrying them out.
    #[arg(long)]
    no_transfer: bool,
    /// Target accuracy for time to accuracy.
    #[arg(long, default_value_t = 0.7)]
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
    use falcon_trainer::sim::{SimSpec, simulate};
    let data = Dataset::find(a.data.as_deref())?;
    let n = a.workers.max(1) as usize;
    let mut hetero = vec![Hetero::None; n];
    let slow = (a.slow_fraction.clamp(0.0, 1.0) * n as f64).round() as usize;
    for h in hetero.iter_mut().skip(n - slow) {
        *h = Hetero::parse(&a.slow_spec)?;
    }
    if a.hetero.is_empty() && slow == 0 && n > 1 {
        hetero[n - 1] = Hetero::parse("h=0.25")?;
    }
    for h in &a.hetero {
        let (rank, spec) = h
            .split_once(':')
            .ok_or_else(|| format!("--hetero {h:?}: expected RANK:SPEC"))?;
        let rank: usize = rank
            .parse()
            .map_err(|_| format!("--hetero {h:?}: bad rank"))?;
        *hetero
            .get_mut(rank)
            .ok_or_else(|| format!("--hetero {h:?}: no worker {rank}"))? = Hetero::parse(spec)?;
    }
    std::fs::create_dir_all(&a.out)?;
    println!(
        "falcon sim: {} workers × {} iterations, model {}, batch {}, on {}",
        a.workers, a.iters, a.model, a.batch, data.source
    );
    println!(
        "\n| policy | virtual s | it/s (virtual) | time to {:.0}% | final acc | blocked s (mean) | parked | dropped | offers / tasks moved | wall s | of which gradients s |\n|---|---|---|---|---|---|---|---|---|---|---|",
        100.0 * a.target
    );
    let mut series = Vec::new();
    for p in top_level_split(&a.policies) {
        let entry: Entry = p.parse()?;
        let spec = SimSpec {
            workers: a.workers,
            iters: a.iters,
            policy: entry.policy,
            model: a.model.parse()?,
            batch: a.batch,
            lr: a.lr,
            seed: a.seed,
            base_ns: (a.base_ms * 1e6) as u64,
            jitter: a.jitter,
            latency_ns: (a.latency_us * 1e3) as u64,
            hetero: hetero.clone(),
            eval_every: a.eval_every,
            eval_examples: a.eval_examples,
            compute: !a.no_compute,
            target: a.target,
            tasks: a.tasks,
            transfer: !a.no_transfer,
            scale: entry.scale,
        };
        let r = simulate(&spec, &data)?;
        let mean_blocked = r.blocked_secs.iter().sum::<f64>() / r.blocked_secs.len().max(1) as f64;
        println!(
            "| {} | {:.2} | {:.0} | {} | {:.2}% | {:.2} | {} | {} | {} / {} | {:.2} | {:.2} |",
            p,
            r.virtual_secs,
            r.iterations_per_sec,
            r.time_to_target.map_or("–".into(), |t| format!("{t:.2} s")),
            100.0 * r.final_accuracy,
            mean_blocked,
            r.parked_pulls,
            r.dropped,
            r.transfers_offered,
            r.tasks_transferred,
            r.wall_secs,
            r.gradient_secs
        );
        std::fs::write(a.out.join(format!("{}.json", file_name(&p))), r.json())?;
        series.push((
            p.clone(),
            r.curve
                .iter()
                .map(|e| (e.secs, 100.0 * e.accuracy))
                .collect(),
        ));
    }
    let png = a.out.join("accuracy.png");
    falcon_bench::plot::line_chart(&png, "test accuracy (%) against virtual time (s)", &series)?;
    println!(
        "\nreports: {} (JSON per policy), plot: {}",
        a.out.display(),
        png.display()
    );
    Ok(())
}
