//! The `falcon` command line.
//!
//! `falcon train` is the main job: real training (Fashion-MNIST) on an embedded local cluster
//! in this process (see `train_cmd.rs`). `falcon local` starts a cluster as separate
//! processes on this host (over shared memory) whose workers run a synthetic workload: each
//! pulls the model, pushes the gradient of ½‖w − target_r‖² with its own target, and the job
//! converges to the targets' mean.

#![forbid(unsafe_code)]
#[macro_use]
mod hygiene;
mod checks;
mod config;
mod experiment;
mod local_cmd;
mod logs;
mod plot;
mod settings;
mod train_cmd;

use std::process::ExitCode;
use std::time::Instant;

use clap::{FromArgMatches, Parser, Subcommand};
use falcon_engine::keys::TensorSpec;
use falcon_engine::launch::Launch;
use falcon_engine::proto::Role;
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::Optimizer;
use falcon_engine::{JobConfig, Scheduler, Server, Worker};
use falcon_transport::{Transport, TransportConfig};

use crate::checks::env_value;

#[derive(Parser)]
#[command(name = "falcon", version, about = "A heterogeneity-aware parameter server", long_about = LONG_ABOUT,
          args_override_self = true, after_long_help = config::help_footer())]
struct Cli {
    /// Read settings from this TOML file, a section per subcommand ([train], [local], [sim],
    /// [experiment]); flags and environment variables override it (see `falcon --help`).
    #[arg(long = "config", global = true, value_name = "PATH", env = config::ENV_VAR)]
    _config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command_,
}

#[derive(Subcommand)]
enum Command_ {
    /// The main job: train a model on Fashion-MNIST with an embedded local cluster (one
    /// worker slowed by default), with any policy; a progress bar, a JSON report and a plot.
    #[command(after_long_help = config::help_footer())]
    Train(train_cmd::TrainArgs),
    /// An embedded local cluster: scheduler, servers and workers as processes on this host.
    #[command(after_long_help = config::help_footer())]
    Local(local_cmd::LocalArgs),
    /// The deterministic simulator: many workers in virtual time, the real policies and
    /// model; every policy on the same workers and seed.
    #[command(after_long_help = config::help_footer())]
    Sim(train_cmd::SimArgs),
    /// Every policy on one heterogeneity profile, and the reproductions of the papers'
    /// claims (stragglers, dssp, fluentps, falcon, zipline): tables, CSV, JSON, PNG and SVG.
    #[command(after_long_help = config::help_footer())]
    Experiment(experiment::ExperimentArgs),
    /// One role of a job, configured from the environment (FALCON_*, or ps-lite's DMLC_*).
    #[command(after_long_help = ROLE_HELP)]
    Role,
    /// Benchmarks, each figure beside its physical reference.
    Bench {
        /// What to benchmark: transport (each medium beside memcpy and a plain socket),
        /// engine (push and pull through the servers), knee (threads against task time) or
        /// policies (each policy's decision cost per push beside an atomic and a cache miss,
        /// and ZipLine beside the ElasticBSP paper; about 15 s on 2 cores, --quick 2 s).
        #[arg(value_parser = ["transport", "engine", "knee", "policies"], default_value = "transport")]
        what: String,
        /// A short smoke run instead of a full measurement.
        #[arg(long)]
        quick: bool,
    },
    /// Explain this machine: host identity, media, RDMA devices, memlock limit.
    Doctor,
}

/// mimalloc keeps freed memory for reuse: the data path allocates and frees buffers of
/// megabytes per iteration (messages, gradients), which the system allocator hands back to
/// the kernel and faults in again every time (two fifths of a row-sparse loop's time).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    logs::init();
    let (cmd, argv, role_vars) = match config::apply(
        <Cli as clap::CommandFactory>::command(),
        std::env::args_os().collect(),
        |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()),
        &role_variables(),
    ) {
        Ok(applied) => applied,
        Err(e) => {
            hygiene::error_line(&e);
            // clap's exit code for usage errors.
            return ExitCode::from(2);
        }
    };
    let cli = match Cli::from_arg_matches(&cmd.get_matches_from(argv)) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let r = match cli.command {
        Command_::Train(a) => train_cmd::train(a),
        Command_::Local(a) => local_cmd::local(a),
        Command_::Sim(a) => train_cmd::sim(a),
        Command_::Experiment(a) => experiment::experiment(a),
        Command_::Role => {
            // The [role] section is the role's alone (`falcon local`'s own roles get the
            // settings it passes them).
            checks::set_file_vars(role_vars);
            role()
        }
        Command_::Bench { what, quick } => bench(&what, quick),
        Command_::Doctor => doctor(),
    };
    let code = match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            hygiene::error_line(&e);
            exit_code(&*e)
        }
    };
    hygiene::flush_stdout();
    code
}

/// The exit status for an error (see [`hygiene`] for the list): 2 for a value refused before
/// anything started, 128 + N for `falcon local` stopped by signal N, else 1.
fn exit_code(e: &(dyn std::error::Error + 'static)) -> ExitCode {
    if let Some(l) = e.downcast_ref::<local_cmd::LocalError>() {
        return ExitCode::from(l.exit_code());
    }
    if e.is::<checks::Invalid>()
        || e.is::<checks::BadValue>()
        || e.is::<falcon_engine::launch::LaunchError>()
    {
        return ExitCode::from(2);
    }
    ExitCode::FAILURE
}

/// What `falcon --help` says before the commands: the exit statuses.
const LONG_ABOUT: &str = "\
A heterogeneity-aware parameter server.

Exit status: 0 done; 1 an error, said on stderr; 2 a usage error or a value refused before
anything started; 130, 143, 129 `falcon local` stopped by SIGINT, SIGTERM or SIGHUP (after its
role processes are gone); 141 standard output closed under it (e.g. `falcon train | head -1`):
it ends at once and quietly, as a program killed by SIGPIPE would.";

pub(crate) type Res = Result<(), Box<dyn std::error::Error>>;

/// What `falcon role --help` shows after the usage: every variable `falcon role` reads
/// (the launch contract's, `falcon_engine::launch::VARIABLES`, then its own).
const ROLE_HELP: &str = "\
Environment: the launch contract, the same for a worker process of one's own
(falcon_engine::launch::Launch::from_env()); ps-lite's DMLC_* names work too:
  FALCON_ROLE (DMLC_ROLE)       scheduler, server or worker. Unset: a launcher's ranks are
                                the workers (torchrun's RANK and WORLD_SIZE, Slurm's
                                SLURM_PROCID and SLURM_NTASKS, Open MPI's OMPI_COMM_WORLD_RANK
                                and OMPI_COMM_WORLD_SIZE), rank 0 hosting the scheduler and
                                each node's first rank a server, on threads; the ranks on a
                                node from LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or
                                SLURM_NNODES (none named: one node)
  FALCON_HOST_ROLES             0: a launcher's ranks host no scheduler or servers (they
                                run apart, as falcon role processes); default 1
  FALCON_RANK                   rank within the role (default: the scheduler assigns one)
  FALCON_NUM_SERVER (DMLC_NUM_SERVER)  servers (default 1; under a launcher, one per node)
  FALCON_NUM_WORKER (DMLC_NUM_WORKER)  workers (default 1; under a launcher, the world size)
  FALCON_SCHEDULER              the scheduler's address: HOST:PORT, IP:PORT, or
                                host=ID;tcp=IP:PORT; a scheduler given HOST:PORT listens there
  FALCON_SCHEDULER_URI          or the scheduler's host (DMLC_PS_ROOT_URI; torchrun's
                                MASTER_ADDR; the first node of Slurm's SLURM_NODELIST or
                                SLURM_JOB_NODELIST)...
  FALCON_SCHEDULER_PORT         ...and port, where it listens (DMLC_PS_ROOT_PORT, MASTER_PORT;
                                under Slurm or mpirun, default 9091); MASTER_PORT + 1 when
                                torchrun's TORCHELASTIC_USE_AGENT_STORE=True says its agent
                                holds MASTER_PORT
  FALCON_NODE_HOST (DMLC_NODE_HOST)  this node's interface (default: the scheduler's host)
  FALCON_BIND                   this node's listening address, HOST:PORT (default: any port
                                of its interface)
  FALCON_ADVERTISE              the address it advertises, IP:PORT (behind NAT)
  FALCON_JOB, FALCON_TOKEN      job id (default falcon) and its secret token
  FALCON_POLICY                 synchronization policy (default bsp)
  FALCON_LR                     learning rate, finite and > 0 (default 0.5, for the synthetic
                                workload's mean of unit gradients; train's models: 0.05);
                                asynchronous policies apply each gradient with lr / workers
  FALCON_OPTIMIZER              the servers' optimizer: sgd (default), momentum(MU), adam,
                                adam(B1,B2,EPS), adamw, adamw(B1,B2,EPS,WD), adagrad,
                                adagrad(EPS), or local (each worker applies its own)
  FALCON_AGGREGATE              a clock's gradients combined: mean (default) or sum
  FALCON_SCALE                  staleness scaling of asynchronous gradients: none (default),
                                dynsgd, consgd(F)
  FALCON_MAX_SHARD_BYTES        largest shard, at least 4 (default 4194304)
  FALCON_FAN_OUT                a worker's parts of one push or pull for different servers go
                                out at once, one thread per server: auto (default: when
                                each part is at least 256 KiB and the host has 4 cores or
                                more), on (whatever the cores) or off
  FALCON_WIRE                   gradients and pulled values on the wire: f32 (default, exact),
                                bf16 or f16 (half the bytes; the servers keep f32 weights;
                                the scheduler's setting holds for the job)
  FALCON_METRICS_ADDR           the scheduler serves the job's metrics for Prometheus at
                                http://IP:PORT/metrics (per worker and per server counters,
                                sent with the heartbeats; default: not served)
  FALCON_MEDIUM                 auto, shm, tcp, rdma (default auto)
  FALCON_HEARTBEAT_MS           heartbeat interval, at least 10 (default 1000)
  FALCON_SUSPICION_MS           a role silent this long is declared dead; 0: never
                                (default 15000; longer than the heartbeat interval)
  FALCON_RENDEZVOUS_TIMEOUT_MS  how long the roles may take to meet (default 60000)
  FALCON_OP_TIMEOUT_MS          deadline of one transport operation (default 30000)
  FALCON_HANDSHAKE_TIMEOUT_MS   deadline of one connection's whole handshake and admission
                                (default 5000)
  FALCON_SPIN_US                how long a hand-off between threads spins before it parks,
                                0 to 10000 (default 50, or 0 where the job's workers and
                                servers on a host outnumber its cores; set, it holds there too)
  FALCON_SHM_IN_PLACE           over shm, servers read a large gradient in the worker's
                                memory instead of a copy in the slot: 1 (default) or 0
  FALCON_HELPER_THREADS         threads that share large copies and applies, 0 to 16
                                (default one fewer than the cores, at most 3; 0 where the
                                job's workers and servers on a host outnumber its cores)
  FALCON_TCP_STREAMS            tcp connections per worker-server link, 1 to 8 (default 2):
                                a payload of 256 KiB or more is split over them
  FALCON_MAX_HANDSHAKES         connections waiting for admission at once (default 128);
  FALCON_MAX_HANDSHAKES_PER_SOURCE  from one address (default 32); past the caps a newcomer
                                is told the node is busy (and retries), or takes the place of
                                an older unproven connection
  FALCON_MAX_CONTROL_BYTES      the largest message a role takes from a peer that connected
                                to it, before it knows what the peer may send (default
                                4194304; at least 65536); a server takes from an attached
                                worker up to 16 bytes per float it holds
  FALCON_CHECKPOINT_DIR         server checkpoints there (default: none)
  FALCON_CHECKPOINT_MS          how often, at least 10 (default 1000)
  FALCON_RECOVERY_TIMEOUT_MS    how long the job waits for a dead server to restart from its
                                checkpoint (default 60000)
  FALCON_CHECKPOINT_ON_FAILURE  a failed checkpoint write: warn (default) or stop the job
  FALCON_RESUME                 1: a job stopped and started again goes on from the
                                checkpoints in FALCON_CHECKPOINT_DIR (every role set alike;
                                a checkpoint of another FALCON_JOB is refused)

Read by falcon role itself:
  FALCON_WORKLOAD               a worker's work: synthetic (default), count (every gradient
                                -1, exactly-once checks), rows (row-sparse: a table of
                                FALCON_FLOATS rows of one float, each iteration pulls and
                                pushes FALCON_ROWS random rows, default 1000; with
                                FALCON_ROWS_SETS=N, N sets of them drawn before the loop,
                                used in turn) or train (with FALCON_MODEL, FALCON_DATA,
                                FALCON_BATCH, FALCON_TASKS, FALCON_THREADS,
                                FALCON_SEED, FALCON_DEVICE: cpu, cuda or auto, the
                                default; cuda needs a build with feature cuda)
  FALCON_HETERO                 workers' heterogeneity, RANKS:SPEC;... (checked by every role)
  FALCON_LR_DECAY               a server's step decay of the learning rate, EVERY:GAMMA: × GAMMA
                                (0 < GAMMA ≤ 1) every EVERY updates of a shard, as PyTorch's
                                StepLR (default: none; the count survives a restart)
  FALCON_ITERS, FALCON_FLOATS   iterations (default 100) and model size (default 1048576)
  FALCON_LOOP                   the synthetic worker's loop: pull-push (default: pull, then
                                push) or push-pull (one push_pull per iteration, each
                                shard's pull right behind its push)
  FALCON_FAULT_DROP_MS, FALCON_FAULT_DROP_EVERY  fault injection: a worker drops one of its
                                server links every N ms, or every N iterations
  FALCON_RDMA_DEVICE, FALCON_RDMA_GID_INDEX  the RDMA device and GID index (rdma builds)
  FALCON_ANNOUNCE               the scheduler prints its address on stdout
  FALCON_PARENT_PID             die with that process (set by `falcon local`)
  RUST_LOG                      log filter (default warn)

Configuration file: `falcon --config FILE role` (or FALCON_CONFIG=FILE) reads the [role]
section, whose keys are these variables, by their name or their name after FALCON_ in any
case (`policy = \"ssp(3)\"` is FALCON_POLICY, `DMLC_NUM_WORKER = 4` itself); the
environment wins over the file. Not from the file: the role itself, RUST_LOG and the RDMA
device (read below falcon's own code).
";

fn bench(what: &str, quick: bool) -> Res {
    if let Some(warning) = busy_warning(std::fs::read_to_string("/proc/loadavg").ok(), cores()) {
        eprintln!("{warning}");
    }
    if what == "knee" {
        return knee(quick);
    }
    if what == "policies" {
        use falcon_bench::policies;
        let effort = if quick {
            policies::QUICK
        } else {
            policies::FULL
        };
        let (summary, _) = policies::measure(effort);
        outln!("{}", policies::markdown(&summary));
        let dir = std::path::Path::new("target/falcon-bench");
        policies::write(&summary, dir)?;
        outln!(
            "written: {} and {}",
            dir.join("policies.md").display(),
            dir.join("policies.json").display()
        );
        return Ok(());
    }
    if what == "engine" {
        let rows = falcon_bench::engine::summary(quick)?;
        outln!("{}", falcon_bench::engine::markdown(&rows));
        return Ok(());
    }
    let effort = if quick {
        falcon_bench::transport::Effort::QUICK
    } else {
        falcon_bench::transport::Effort::FULL
    };
    let rows =
        falcon_bench::transport::summary(&falcon_bench::transport::available_media(), effort);
    outln!("{}", falcon_bench::transport::markdown(&rows));
    Ok(())
}

/// This host's cores.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A warning when the machine is busy (its one-minute load average above a quarter of its
/// cores): benchmark figures taken then say more about the other load than about falcon.
fn busy_warning(loadavg: Option<String>, cores: usize) -> Option<String> {
    let load: f64 = loadavg?.split_whitespace().next()?.parse().ok()?;
    let limit = (cores as f64 / 4.0).max(0.5);
    (load > limit).then(|| {
        format!(
            "falcon bench: warning: this machine is busy (load average {load:.2} on {cores} \
             cores, above {limit:.2}); the figures will reflect that load. Measure on a quiet \
             machine, or compare only ratios taken in the same run."
        )
    })
}

/// Falcon's over-subscription figure on this machine: one iteration of 64 CPU-bound tasks
/// (about 2 ms each, the MLP's step) on 1..=16 pool threads; task completion time (mean, max)
/// and its variance against the thread count, and the knee the parallelism manager uses.
fn knee(quick: bool) -> Res {
    knee_run(quick, std::path::Path::new("target/falcon-bench"))
}

/// Measures task completion time and its variance against thread count; table and plot
/// (`knee.png`, `knee.svg`) under `dir`.
pub(crate) fn knee_run(quick: bool, dir: &std::path::Path) -> Res {
    use falcon_trainer::pool::{knee, measure_knee};
    // A fixed amount of arithmetic: ~2 ms on one core of this machine.
    let work = || {
        let mut x = 1.0f64;
        for i in 0..280_000u32 {
            x = (x * 1.000_000_1 + f64::from(i & 7)).sqrt();
        }
        std::hint::black_box(x);
    };
    let (max, tasks) = if quick { (4, 8) } else { (16, 64) };
    let points = measure_knee(max, tasks, work);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    use std::fmt::Write as _;
    let mut table = String::from(
        "| threads | iteration ms | task mean ms | task max ms | task variance ms² | cv² |\n|---|---|---|---|---|---|\n",
    );
    for p in &points {
        let _ = writeln!(
            table,
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.3} |",
            p.threads,
            p.iteration_time.as_secs_f64() * 1e3,
            p.mean_task.as_secs_f64() * 1e3,
            p.max_task.as_secs_f64() * 1e3,
            p.var_task,
            p.cv2()
        );
    }
    let _ = writeln!(
        table,
        "\nknee: {} thread(s) on this {cores}-core machine",
        knee(&points)
    );
    outln!("{table}");
    std::fs::create_dir_all(dir)?;
    let xs = |f: &dyn Fn(&falcon_trainer::pool::KneePoint) -> f64| -> Vec<(f64, f64)> {
        points.iter().map(|p| (p.threads as f64, f(p))).collect()
    };
    let series = [
        (
            "max task ms".to_string(),
            xs(&|p| p.max_task.as_secs_f64() * 1e3),
        ),
        (
            "mean task ms".into(),
            xs(&|p| p.mean_task.as_secs_f64() * 1e3),
        ),
        ("variance ms^2".into(), xs(&|p| p.var_task)),
        (
            "iteration ms".into(),
            xs(&|p| p.iteration_time.as_secs_f64() * 1e3),
        ),
    ];
    for ext in ["png", "svg"] {
        crate::plot::line_chart(
            &dir.join(format!("knee.{ext}")),
            &crate::plot::Lines {
                title: "task completion time and its variance against threads",
                x_label: "threads",
                y_label: "ms (variance: ms^2)",
                series: &series,
                target: None,
            },
        )?;
    }
    std::fs::write(dir.join("knee.md"), table)?;
    outln!("plot: {}", dir.join("knee.png").display());
    Ok(())
}

/// The variables `falcon role` reads besides the launch contract's (all in [`ROLE_HELP`]).
pub(crate) const ROLE_OWN_VARIABLES: &[&str] = &[
    "FALCON_WORKLOAD",
    "FALCON_ROWS",
    "FALCON_ROWS_SETS",
    "FALCON_HETERO",
    "FALCON_LR_DECAY",
    "FALCON_ITERS",
    "FALCON_FLOATS",
    "FALCON_LOOP",
    "FALCON_MODEL",
    "FALCON_DEVICE",
    "FALCON_DATA",
    "FALCON_BATCH",
    "FALCON_TASKS",
    "FALCON_THREADS",
    "FALCON_SEED",
    "FALCON_FAULT_DROP_MS",
    "FALCON_FAULT_DROP_EVERY",
    "FALCON_RDMA_DEVICE",
    "FALCON_RDMA_GID_INDEX",
    "FALCON_ANNOUNCE",
    "FALCON_PARENT_PID",
    "RUST_LOG",
];

/// The variables a `[role]` section of the configuration file may set: the launch contract's
/// and the workloads', but those read below falcon's own code (`RUST_LOG`, the transport's
/// RDMA device) and `falcon local`'s internal ones.
fn role_variables() -> Vec<&'static str> {
    falcon_engine::launch::VARIABLES
        .iter()
        .chain(ROLE_OWN_VARIABLES)
        .copied()
        .filter(|v| {
            !matches!(
                *v,
                "RUST_LOG"
                    | "FALCON_RDMA_DEVICE"
                    | "FALCON_RDMA_GID_INDEX"
                    | "FALCON_ANNOUNCE"
                    | "FALCON_PARENT_PID"
                    | "FALCON_ROLE"
                    | "DMLC_ROLE"
            )
        })
        .collect()
}

/// Reads a variable by its falcon name or one of its aliases (ps-lite's DMLC_* names).
pub(crate) fn env(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| checks::var(n))
}

/// The job configuration from the environment: the engine's launch contract
/// ([`Launch::from_env`], the same for a worker process of one's own), then what the
/// workloads of `falcon role` add to it.
fn job_from_env() -> Result<Launch, Box<dyn std::error::Error>> {
    let mut launch = Launch::from_vars(checks::var)?;
    // Every variable set is checked now, before anything starts (`settings::SETTINGS`).
    settings::check(&checks::var, &launch)?;
    let workload = env(&["FALCON_WORKLOAD"]);
    // The scheduler and the servers a launched rank hosts run the same job.
    for cfg in std::iter::once(&mut launch.config).chain(launch.hosted.scheduler.as_mut()) {
        match workload.as_deref() {
            // Every gradient is −1: each one applied adds exactly 1/8 to every parameter, so
            // the values count the gradients applied (exactly-once checks).
            Some("count") => cfg.optimizer = Optimizer::Sgd { lr: 0.125 },
            // The trainer's convention: the gradients of a clock are summed (each is already
            // a mean over its batch), each asynchronous one applied with the same step.
            Some("train") => {
                cfg.aggregate = falcon_engine::update::Aggregate::Sum;
                cfg.optimizer = Optimizer::Sgd {
                    lr: env_value(&["FALCON_LR"], 0.05, checks::learning_rate)?,
                };
            }
            // The synthetic workload (and rows): the launch contract's learning rate (lr /
            // workers under asynchronous policies). Other names were refused by the checks.
            _ => {}
        }
    }
    Ok(launch)
}

/// The workloads of `falcon role` (`FALCON_WORKLOAD`).
pub(crate) const WORKLOADS: &[&str] = &["synthetic", "count", "rows", "train"];

/// `EVERY:GAMMA`, EVERY a whole number of updates ≥ 1 and 0 < GAMMA ≤ 1.
pub(crate) fn parse_lr_decay(v: &str) -> Result<falcon_engine::update::StepDecay, &'static str> {
    let bad = "expected EVERY:GAMMA, EVERY a whole number of updates ≥ 1 and 0 < GAMMA ≤ 1, e.g. 1000:0.1";
    let (every, gamma) = v.split_once(':').ok_or(bad)?;
    let every: u64 = every.trim().parse().map_err(|_| bad)?;
    let gamma: f32 = gamma.trim().parse().map_err(|_| bad)?;
    if every == 0 || !(gamma > 0.0 && gamma <= 1.0) {
        return Err(bad);
    }
    Ok(falcon_engine::update::StepDecay { every, gamma })
}

/// `FALCON_LR_DECAY=EVERY:GAMMA`: the servers' learning rate × GAMMA every EVERY updates of
/// a shard (unset: constant).
fn lr_decay_from_env()
-> Result<std::sync::Arc<dyn falcon_engine::update::LrSchedule>, checks::Invalid> {
    use falcon_engine::update::Constant;
    checks::env_value(&["FALCON_LR_DECAY"], None, |v| parse_lr_decay(v).map(Some)).map(
        |d| match d {
            Some(d) => {
                std::sync::Arc::new(d) as std::sync::Arc<dyn falcon_engine::update::LrSchedule>
            }
            None => std::sync::Arc::new(Constant),
        },
    )
}

fn role() -> Res {
    // Started by `falcon local`: die with it.
    hygiene::die_with_parent()?;
    let launch = job_from_env()?;
    let (role, rank) = (launch.role, launch.rank);
    logs::label(match rank {
        Some(r) => format!("{} {r}", role.name()),
        None => role.name().to_string(),
    });
    let mode = launch.config.update_mode();
    match role {
        Role::Scheduler => scheduler_role(launch.config),
        Role::Server => server_role(launch.config, rank),
        Role::Worker => {
            // A launched rank: the scheduler and servers it hosts run on threads beside its
            // worker, and serve the job to its end.
            let hooks = falcon_engine::ServerHooks {
                schedule: lr_decay_from_env()?,
                ..Default::default()
            };
            let hosted = falcon_engine::local::HostedRoles::start_with(&launch, hooks)?;
            let worked = worker_role(launch.config, rank);
            if hosted.is_empty() {
                return worked;
            }
            if worked.is_err() && hosted.failure().is_none() {
                // The job goes on without this worker only where its policy allows; the
                // hosted roles still serve the others.
                tracing::warn!("this rank's worker failed; its scheduler and servers serve on");
            }
            let report = hosted.finish()?;
            if let Some(r) = &report.scheduler {
                scheduler_report(r, mode)?;
            }
            for (_, r) in &report.servers {
                server_report(r);
            }
            worked
        }
    }
}

/// The scheduler's part: serves the job, then says how it ended (and fails it where a
/// worker was lost for good under a synchronous policy).
fn scheduler_role(cfg: JobConfig) -> Res {
    let mode = cfg.update_mode();
    let sched = Scheduler::bind(cfg)?;
    if env(&["FALCON_ANNOUNCE"]).is_some() {
        use std::io::Write;
        outln!("{}{}", local_cmd::ANNOUNCE, sched.address());
        std::io::stdout().flush()?;
    }
    let report = sched.run()?;
    scheduler_report(&report, mode)
}

/// What the scheduler says at the job's end (an error where a lost worker fails the job).
fn scheduler_report(
    report: &falcon_engine::SchedulerReport,
    mode: falcon_engine::update::UpdateMode,
) -> Res {
    outln!(
        "scheduler: {}; bytes per server [{}]",
        report.ending(),
        report.bytes_per_server_list()
    );
    for (rank, n, reason) in &report.checkpoint_failures {
        outln!("scheduler: server {rank}: {n} checkpoint writes failed; the last: {reason}");
    }
    if let Some(why) = report.loss_fails_job(mode) {
        return Err(why.into());
    }
    Ok(())
}

/// A server's part: serves its shards, then reports what it did.
fn server_role(cfg: JobConfig, rank: Option<u32>) -> Res {
    let hooks = falcon_engine::ServerHooks {
        schedule: lr_decay_from_env()?,
        ..Default::default()
    };
    let server = Server::join(cfg, rank, hooks)?;
    logs::label(format!("server {}", server.rank()));
    let report = server.run()?;
    server_report(&report);
    Ok(())
}

/// What a server says at the job's end.
fn server_report(report: &falcon_engine::ServerReport) {
    outln!(
        "server {}: {} gradients, {} updates, {} delayed pulls, {} answered pulls, {} dropped gradients, {} duplicate pushes, {} folded gradients",
        report.rank,
        report.gradients,
        report.updates,
        report.delayed_pulls,
        report.answered_pulls,
        report.dropped_gradients,
        report.duplicate_pushes,
        report.folded_gradients
    );
    outln!("{}", report.ending());
    for a in &report.accounts {
        outln!(
            "server {}: shard {} first parameter {:.6}, sequence numbers {} = applied + {} skipped, {} transferred-task gradients",
            report.rank,
            a.shard,
            a.first,
            a.pushes,
            a.skipped,
            a.helps
        );
    }
    if report.checkpoints > 0 || report.restored_from.is_some() {
        outln!(
            "server {}: {} checkpoints written; restarted from checkpoint {}; {} acknowledged updates lost",
            report.rank,
            report.checkpoints,
            report
                .restored_from
                .map_or("none".into(), |n| n.to_string()),
            report.lost_updates
        );
    }
    if let Some(last) = &report.last_checkpoint_failure {
        println!(
            "server {}: {} checkpoint writes failed; the last: {last}",
            report.rank, report.checkpoint_failures
        );
    }
    for (w, c) in report.per_worker.iter().enumerate() {
        let n: u64 = c.staleness.values().sum();
        let sum: u64 = c.staleness.iter().map(|(d, k)| d * k).sum();
        let max = c.staleness.keys().next_back().copied().unwrap_or(0);
        outln!(
            "server {}:   worker {w}: {} parked pulls, staleness mean {:.2} max {max}, {} grants, {} transfer offers, {} dropped, {} folded",
            report.rank,
            c.parked_pulls,
            if n == 0 { 0.0 } else { sum as f64 / n as f64 },
            c.grants,
            c.transfers_offered,
            c.dropped_gradients,
            c.folded_gradients
        );
    }
    let (bytes_in, bytes_out) = report
        .per_shard
        .iter()
        .fold((0, 0), |(i, o), c| (i + c.bytes_in, o + c.bytes_out));
    outln!(
        "server {}:   {} shards, {bytes_in} bytes in, {bytes_out} bytes out (answered pulls)",
        report.rank,
        report.per_shard.len()
    );
}

/// A worker's part: its workload. An evicted worker (silent past the suspicion timeout:
/// paused, cut off) is told why; it joins again under its rank and goes on at the job's
/// current clock.
fn worker_role(cfg: JobConfig, rank: Option<u32>) -> Res {
    let train = env(&["FALCON_WORKLOAD"]).as_deref() == Some("train");
    let mut rank = rank;
    let mut cfg = cfg;
    for rejoins in 0.. {
        let r = if train {
            train_cmd::role_worker(&cfg, rank)
        } else {
            worker_workload(&cfg, rank)
        };
        let Err(e) = r else { break };
        let (r, why) = match e.downcast_ref::<falcon_engine::Error>() {
            Some(falcon_engine::Error::Evicted { rank: r, reason }) => (*r, reason),
            Some(falcon_engine::Error::SchedulerLost { rank: r, why }) => (*r, why),
            _ => return Err(e),
        };
        if rejoins >= 10 {
            return Err(e);
        }
        tracing::warn!(
            "worker {r}: evicted by the scheduler or cut off from it ({why}); rejoining under rank {r} at the current clock"
        );
        rank = Some(r);
        // A scheduler that is really gone is given up on soon.
        cfg.rendezvous_timeout = cfg
            .rendezvous_timeout
            .min(falcon_engine::config::REJOIN_TIMEOUT);
    }
    Ok(())
}

/// Fault injection for tests and the chaos run: with `FALCON_FAULT_DROP_MS`, a thread drops
/// one of the worker's server links (in turn) that often, as a failing network would.
pub(crate) fn spawn_link_dropper(w: &Worker) -> Res {
    let ms: u64 = env_value(&["FALCON_FAULT_DROP_MS"], 0, checks::whole)?;
    if ms == 0 {
        return Ok(());
    }
    let w = w.clone();
    std::thread::Builder::new()
        .name("falcon-fault-drop".into())
        .spawn(move || {
            let servers = w.server_media().len().max(1) as u32;
            for i in 0u32.. {
                std::thread::sleep(std::time::Duration::from_millis(ms));
                w.drop_server_link(i % servers);
            }
        })?;
    Ok(())
}

/// The row-sparse workload (the key-value loop of ps-lite's users): a table of `rows` rows of
/// one float; each iteration pulls `FALCON_ROWS` distinct random rows, and pushes a gradient
/// for them (the value minus the worker's target, as the synthetic workload). The rows are
/// drawn in the iteration, or with `FALCON_ROWS_SETS=N` as N sets before the loop, used in
/// turn (a key-value benchmark's loop then times the pushes and pulls alone, as ps-lite's
/// own benchmark does with its keys).
fn rows_workload(cfg: &JobConfig, rank: Option<u32>, iters: u64, rows: u64) -> Res {
    let per: u64 = env_value(&["FALCON_ROWS"], 1000, checks::at_least_one_u64)?;
    if per > rows {
        return Err(format!("FALCON_ROWS={per} is more than the table's {rows} rows").into());
    }
    let sets: u64 = env_value(&["FALCON_ROWS_SETS"], 0, checks::whole)?;
    if sets.saturating_mul(per) > 1 << 27 {
        return Err(format!(
            "FALCON_ROWS_SETS={sets} sets of FALCON_ROWS={per} rows: at most 2^27 rows \
             (1 GiB of row ids) are drawn ahead"
        )
        .into());
    }
    let tensors = vec![TensorSpec::new("table", rows)];
    let w = Worker::join(cfg, tensors, rank)?;
    falcon_trainer::train::refuse_local(w.optimizer())?;
    crate::logs::label(format!("worker {}", w.rank()));
    let target = (w.rank() + 1) as f32;
    let mut rng = fastrand::Rng::with_seed(u64::from(w.rank()) + 1);
    let mut seen = vec![0u64; rows.div_ceil(64) as usize];
    // Distinct sorted ids, as a key-value request carries them: `per` draws marked in a
    // bitmap of the table, read back in order (as the ps-lite loop beside it does).
    let mut draw = |ids: &mut Vec<u64>| {
        seen.iter_mut().for_each(|b| *b = 0);
        for _ in 0..per {
            let r = rng.u64(0..rows);
            seen[(r / 64) as usize] |= 1 << (r % 64);
        }
        ids.clear();
        for (i, &word) in seen.iter().enumerate() {
            let mut b = word;
            while b != 0 {
                ids.push(i as u64 * 64 + u64::from(b.trailing_zeros()));
                b &= b - 1;
            }
        }
    };
    let pool: Vec<Vec<u64>> = (0..sets)
        .map(|_| {
            let mut ids = Vec::with_capacity(per as usize);
            draw(&mut ids);
            ids
        })
        .collect();
    let mut fresh = Vec::with_capacity(per as usize);
    if !w.rejoined() {
        w.barrier()?;
    }
    let start = Instant::now();
    let first = w.clock();
    let mut vals = vec![0f32; per as usize];
    let mut grads = vec![0f32; per as usize];
    for t in first..iters {
        let ids = if pool.is_empty() {
            draw(&mut fresh);
            &fresh
        } else {
            &pool[(t % sets) as usize]
        };
        let n = ids.len();
        w.pull_rows("table", 1, ids, &mut vals[..n], t)?;
        for (g, v) in grads.iter_mut().zip(&vals[..n]) {
            *g = v - target;
        }
        w.push_rows("table", 1, ids, &grads[..n], t)?;
    }
    let secs = start.elapsed().as_secs_f64();
    w.barrier()?;
    outln!(
        "worker {}: {} iterations in {secs:.2} s ({:.1} it/s, {per} rows pulled and pushed each)",
        w.rank(),
        iters - first,
        (iters - first) as f64 / secs,
    );
    w.finish()?;
    Ok(())
}

/// The synthetic workload: minimise ½‖w − (rank+1)‖² together; under BSP with the mean the
/// model converges to the mean of the targets.
fn worker_workload(cfg: &JobConfig, rank: Option<u32>) -> Res {
    let iters: u64 = env_value(&["FALCON_ITERS"], 100, checks::at_least_one_u64)?;
    let floats: u64 = env_value(&["FALCON_FLOATS"], 1 << 20, checks::at_least_one_u64)?;
    // Fault injection (tests, the chaos run): drop a server link every N iterations.
    let drop_every: u64 = env_value(&["FALCON_FAULT_DROP_EVERY"], 0, checks::whole)?;
    let push_pull = match env(&["FALCON_LOOP"]).as_deref() {
        None | Some("pull-push") => false,
        Some("push-pull") => true,
        Some(other) => {
            return Err(format!(
                "FALCON_LOOP={other}: the loop is pull-push (the default) or push-pull"
            )
            .into());
        }
    };
    if env(&["FALCON_WORKLOAD"]).as_deref() == Some("rows") {
        if push_pull {
            return Err(
                "FALCON_LOOP=push-pull is a loop of dense pushes; the rows workload \
                        pulls and pushes rows"
                    .into(),
            );
        }
        return rows_workload(cfg, rank, iters, floats);
    }
    // FALCON_WORKLOAD=count: constant gradients (see `job_from_env`).
    let count = env(&["FALCON_WORKLOAD"]).as_deref() == Some("count");
    let tensors = vec![TensorSpec::new("model", floats)];
    let w = Worker::join(cfg, tensors, rank)?;
    falcon_trainer::train::refuse_local(w.optimizer())?;
    crate::logs::label(format!("worker {}", w.rank()));
    spawn_link_dropper(&w)?;
    let buf = w.buffer("model")?;
    let grad = w.buffer("model")?;
    let target = (w.rank() + 1) as f32;
    let mut p = vec![0f32; floats as usize];
    // The gradient is computed a piece at a time, from the pulled buffer straight into the
    // pushed one: one pass over the model, as a trainer's backward pass writes its gradient
    // once. A 4 KiB piece stays in the first-level cache and its copies use the C library's
    // vector loop: at 16 MiB the pass took 1.6–1.9 ms against 2.5–2.9 ms with 64 KiB pieces
    // (and 1.5 ms computing in place, which the safe region API does not allow).
    const PIECE: usize = 1 << 10;
    let mut piece = vec![0f32; PIECE.min(floats as usize)];
    if !w.rejoined() {
        w.barrier()?;
    }
    let start = Instant::now();
    let first = w.clock();
    // With push_pull, each iteration's push brings the next iteration's values.
    if push_pull && first < iters {
        w.pull("model", &buf, first)?;
    }
    for t in first..iters {
        if !push_pull {
            w.pull("model", &buf, t)?;
        }
        for at in (0..floats as usize).step_by(PIECE) {
            let part = &mut piece[..PIECE.min(floats as usize - at)];
            buf.read_at(4 * at as u64, falcon_engine::worker::f32_bytes_mut(part))?;
            if at == 0 {
                p[0] = part[0];
            }
            for x in part.iter_mut() {
                *x = if count { -1.0 } else { *x - target };
            }
            grad.write_at(4 * at as u64, falcon_engine::worker::f32_bytes(part))?;
        }
        if push_pull {
            w.push_pull("model", &grad, &buf, t)?;
        } else {
            w.push("model", &grad, t)?;
        }
        if drop_every > 0 && t > 0 && t % drop_every == 0 {
            w.drop_server_link((t / drop_every % w.server_media().len() as u64) as u32);
        }
        if w.rank() == 0 && (t % 25 == 0 || t + 1 == iters) {
            outln!("  worker 0 iteration {t:>4}: w[0] = {:.5}", p[0]);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    w.barrier()?;
    w.pull("model", &buf, iters)?;
    buf.read_at(0, falcon_engine::worker::f32_bytes_mut(&mut p))?;
    let mean = (1..=w.workers()).map(|r| r as f32).sum::<f32>() / w.workers() as f32;
    let stats = w.stats();
    let bytes = 2.0 * iters as f64 * floats as f64 * 4.0;
    outln!(
        "worker {}: {} iterations in {secs:.2} s ({:.1} it/s, {:.2} GB/s pushed+pulled), w[0] = {:.4} (targets' mean {mean}), pulls {} lock-free / {} via the server, shard pushes {} (pushed in place {}), blocked {:.1} ms in pulls, {:.1} ms at superstep barriers, {} task offers, reconnects {}, lost updates {}",
        w.rank(),
        iters - first,
        iters as f64 / secs,
        bytes / secs / 1e9,
        p[0],
        stats.fast_pulls,
        stats.slow_pulls,
        stats.pushes,
        stats.pushes_in_place,
        stats.pull_wait.as_secs_f64() * 1e3,
        stats.barrier_wait.as_secs_f64() * 1e3,
        stats.offers,
        stats.reconnects,
        stats.lost_updates
    );
    // Asynchronous policies apply stale gradients, which may overshoot the targets; only BSP
    // has an exact answer. Every policy must keep the model finite and near the targets.
    let bound = 4.0 * w.workers() as f32;
    if !count && !p.iter().all(|x| x.is_finite() && x.abs() <= bound) {
        return Err(format!("worker {}: the model diverged (|w| > {bound})", w.rank()).into());
    }
    if !count && cfg.policy == PolicySpec::Bsp && iters >= 30 && (p[0] - mean).abs() > 1e-3 {
        return Err(format!(
            "worker {}: BSP did not converge to the mean target",
            w.rank()
        )
        .into());
    }
    w.finish()?;
    Ok(())
}

fn doctor() -> Res {
    outln!("falcon doctor");
    outln!("  host id            {}", falcon_transport::host_id());
    let t = Transport::new(TransportConfig::default())?;
    outln!(
        "  shm                available (memfd + unix socket at {})",
        t.address()
            .shm
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    outln!(
        "  tcp                available (loopback test listener {})",
        t.address().tcp.map(|a| a.to_string()).unwrap_or_default()
    );
    let (soft, hard) = memlock();
    outln!("  memlock (ulimit -l) soft {soft}, hard {hard}");
    rdma_report();
    cuda_report();
    Ok(())
}

/// The driver, its devices and their compute capability, and the libraries the CUDA path
/// loads at run time, as they are (nothing is assumed from the build).
#[cfg(feature = "cuda")]
fn cuda_report() {
    use falcon_transport::{cuda, gdr};
    match cuda::probe() {
        Ok(info) => {
            outln!(
                "  cuda               built in; driver for CUDA {}.{}, {} device(s):",
                info.cuda_version.0,
                info.cuda_version.1,
                info.devices.len()
            );
            let yes = |b: bool| if b { "yes" } else { "no" };
            for d in &info.devices {
                outln!(
                    "    {}: {} · compute capability {}.{} ({}) · {:.1} GiB · GPUDirect RDMA {} · dma-buf {}",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.arch(),
                    d.memory_bytes as f64 / (1u64 << 30) as f64,
                    yes(d.gpu_direct_rdma),
                    yes(d.dma_buf)
                );
            }
            let peer = cuda::peer_memory_loaded();
            outln!(
                "    peer memory (nvidia_peermem) {}; push/pull of device memory go through page-locked staging on every medium",
                if peer { "loaded" } else { "not loaded" }
            );
            let enabled = gdr::gdr_enabled(std::env::var("FALCON_GDR").ok().as_deref());
            for d in &info.devices {
                let plan = gdr::gdr_plan(&gdr::GdrProbe {
                    enabled,
                    cuda_version: info.cuda_version,
                    device_gpu_direct_rdma: d.gpu_direct_rdma,
                    device_dma_buf: d.dma_buf,
                    // Any RDMA device that registers dma-bufs will do; not probed (tried)
                    // without RDMA in the build or on the machine.
                    verbs_dma_buf: rdma_dmabuf().map(|v| v.iter().any(|(_, yes)| *yes)),
                    peer_memory: peer,
                });
                let tries: Vec<&str> = plan.tries.iter().map(|p| p.name()).collect();
                let skipped: Vec<String> = plan
                    .skipped
                    .iter()
                    .map(|(p, why)| format!("{}: {why}", p.name()))
                    .collect();
                outln!(
                    "    {}: GPUDirect RDMA registration, as NCCL would try it: {}{} (not wired: the rdma medium registers host memory)",
                    d.ordinal,
                    tries.join(", then "),
                    if skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" (left out: {})", skipped.join("; "))
                    }
                );
            }
        }
        Err(e) => {
            outln!("  cuda               built in; unavailable: {e} (--device auto uses the CPU)")
        }
    }
    match cuda::nvrtc_version() {
        Ok((major, minor)) => {
            let arch = cuda::probe()
                .ok()
                .and_then(|i| i.devices.first().map(cuda::DeviceInfo::arch))
                .unwrap_or_else(|| "sm_90".to_string());
            match falcon_trainer::model::gpu::compile_kernels(&arch) {
                Ok(_) => {
                    outln!("    nvrtc {major}.{minor}: the trainer's kernels compile for {arch}")
                }
                Err(e) => {
                    outln!("    nvrtc {major}.{minor}: the kernels do not compile for {arch}: {e}")
                }
            }
        }
        Err(e) => outln!("    {e}"),
    }
    if cuda::cublas_present() {
        outln!("    cublas found");
    } else {
        outln!(
            "    libcublas not found (the toolkit, or pip's nvidia-cublas-cu12 on LD_LIBRARY_PATH)"
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_report() {
    outln!("  cuda               not built in (rebuild with --features cuda)");
}

#[cfg(feature = "rdma")]
fn rdma_report() {
    match falcon_transport::rdma_ports() {
        Ok(ports) if ports.is_empty() => outln!(
            "  rdma               built in; no RDMA device found (tcp will be used between hosts)"
        ),
        Ok(ports) => {
            outln!("  rdma               built in; {} port(s):", ports.len());
            for p in ports {
                outln!(
                    "    {} port {}: {} · {} · MTU {} · LID {}",
                    p.device,
                    p.port,
                    p.state,
                    p.link_layer,
                    p.mtu,
                    p.lid
                );
                for (i, g) in p.gids {
                    outln!("      GID[{i}] {g}");
                }
            }
        }
        Err(e) => outln!("  rdma               built in; unavailable: {e}"),
    }
    if let Some(found) = rdma_dmabuf() {
        for (dev, yes) in found {
            outln!(
                "    {dev}: dma-buf registration (ibv_reg_dmabuf_mr, probed as NCCL probes it) {}",
                if yes { "supported" } else { "not supported" }
            );
        }
    }
    if let Some(limit) = falcon_transport::memlock_limit() {
        outln!(
            "    memlock limit {} KiB: RDMA registers every region it moves; raise it if regions are larger (`ulimit -l unlimited`)",
            limit / 1024
        );
    }
}

/// Each RDMA device's answer to the dma-buf probe; `None` without RDMA.
#[cfg(feature = "rdma")]
fn rdma_dmabuf() -> Option<Vec<(String, bool)>> {
    falcon_transport::rdma_dmabuf_support()
        .ok()
        .filter(|v| !v.is_empty())
}

#[cfg(all(not(feature = "rdma"), feature = "cuda"))]
fn rdma_dmabuf() -> Option<Vec<(String, bool)>> {
    None
}

#[cfg(not(feature = "rdma"))]
fn rdma_report() {
    outln!("  rdma               not built in (rebuild with --features rdma)");
}

fn memlock() -> (String, String) {
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |b| format!("{} KiB", b / 1024));
    let l = rustix_limit();
    (show(l.0), show(l.1))
}

fn rustix_limit() -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    for line in text.lines() {
        if line.starts_with("Max locked memory") {
            let f: Vec<&str> = line.split_whitespace().collect();
            let parse = |s: &str| s.parse::<u64>().ok();
            if f.len() >= 6 {
                return (parse(f[3]), parse(f[4]));
            }
        }
    }
    (None, None)
}

#[cfg(test)]
mod tests {
    use super::ROLE_HELP;

    #[test]
    fn a_busy_machine_is_named_before_its_figures() {
        let w = super::busy_warning(Some("3.10 2.00 1.00 3/200 123".into()), 2).unwrap();
        assert!(w.contains("load average 3.10 on 2 cores"), "{w}");
        assert_eq!(
            super::busy_warning(Some("0.20 0.1 0.1 1/1 1".into()), 2),
            None
        );
        assert_eq!(super::busy_warning(Some("9.0 1 1 1/1 1".into()), 64), None);
        assert_eq!(super::busy_warning(None, 2), None);
        assert_eq!(super::busy_warning(Some("garbage".into()), 2), None);
    }

    /// Whether `name` appears in `text` as a whole name (`RANK`, not inside `FALCON_RANK`).
    fn names(text: &str, name: &str) -> bool {
        let part = |c: char| c.is_ascii_alphanumeric() || c == '_';
        text.match_indices(name)
            .any(|(i, _)| !text[..i].ends_with(part) && !text[i + name.len()..].starts_with(part))
    }

    #[test]
    fn role_help_lists_every_variable_role_reads() {
        for var in falcon_engine::launch::VARIABLES
            .iter()
            .chain(super::ROLE_OWN_VARIABLES)
        {
            assert!(names(ROLE_HELP, var), "falcon role --help misses {var}");
        }
        assert!(!names("FALCON_RANK", "RANK"));
        assert!(names("RANK and", "RANK"));
    }
}
