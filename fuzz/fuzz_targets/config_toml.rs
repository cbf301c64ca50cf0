//! The CLI's TOML configuration (`tools/config.rs` `apply`): the file's settings turned into
//! clap defaults (and a `[role]` section into variables). `tools/config.rs` is a module of the `falcon` binary, not of a library, so
//! it is included here by path and applied to a command with the kinds of arguments of the
//! real one (values with defaults and environment variables, switches, counts, negated
//! switches, repeatable values, positionals, a subcommand with subcommands).
//!
//! The first byte picks the command line, the rest is the file (any bytes: not UTF-8 is an
//! error too). Whatever `apply` returns must then parse with clap without panicking.
#![no_main]

use std::ffi::OsString;

use clap::{ArgAction, CommandFactory, Parser, Subcommand};
use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../tools/config.rs"]
mod config;

#[derive(Parser, Debug)]
#[command(name = "falcon", args_override_self = true)]
struct Cli {
    #[arg(long = "config", global = true, value_name = "PATH", env = config::ENV_VAR)]
    _config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Subcommand, Debug)]
enum Sub {
    Train(TrainArgs),
    Sim {
        #[arg(long, default_value_t = 16)]
        workers: u32,
        #[arg(long, default_value = "bsp,epsp")]
        policies: String,
    },
    Experiment {
        #[command(subcommand)]
        which: Which,
    },
    Bench {
        #[arg(default_value = "transport")]
        what: String,
        #[arg(long)]
        quick: bool,
    },
    Doctor,
    /// Configured by variables alone: its section is a list of them.
    Role,
}

#[derive(Subcommand, Debug)]
enum Which {
    Dssp(Knobs),
    Fluentps(Knobs),
    Zipline {
        #[arg(long)]
        out: Option<String>,
        #[arg(long)]
        quick: bool,
    },
}

#[derive(clap::Args, Debug)]
struct Knobs {
    #[arg(long, value_parser = ["real", "sim", "both"])]
    mode: Option<String>,
    #[arg(long)]
    workers: Option<u32>,
    #[arg(long)]
    hetero: Vec<String>,
    #[arg(long)]
    quick: bool,
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    #[arg(long, default_value_t = 4)]
    workers: u32,
    #[arg(long, default_value = "epsp")]
    policy: String,
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long, env = "FALCON_SEED", default_value_t = 1)]
    seed: u64,
    #[arg(long, default_value_t = 10)]
    eval_every: u64,
    #[arg(long)]
    quiet: bool,
    #[arg(short = 'v', long, action = ArgAction::Count)]
    verbose: u8,
    #[arg(long = "no-elastic", action = ArgAction::SetFalse)]
    elastic: bool,
    #[arg(short = 'm', long)]
    metrics: bool,
    #[arg(long)]
    hetero: Vec<String>,
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
}

thread_local! {
    /// Built once: building it is most of the work of an input otherwise.
    static COMMAND: clap::Command = Cli::command();
}

/// Where the file is written for `expand` to read: memory when there is a tmpfs.
fn scratch_dir() -> std::path::PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

const LINES: &[&[&str]] = &[
    &["train"],
    &["train", "--workers", "3", "--hetero", "h=0.5"],
    &["sim"],
    &["experiment", "dssp"],
    &["experiment", "fluentps", "--quick"],
    &["experiment", "zipline"],
    &["bench", "rdma"],
    &["doctor"],
    &["role"],
    &[],
    &["train", "--", "--config", "x"],
];

fuzz_target!(|data: &[u8]| {
    let Some((&line, file)) = data.split_first() else {
        return;
    };
    let path = scratch_dir().join(format!("falcon-fuzz-config-{}.toml", std::process::id()));
    std::fs::write(&path, file).expect("write the configuration file");
    let mut argv: Vec<OsString> = vec!["falcon".into(), "--config".into(), path.clone().into()];
    argv.extend(
        LINES[usize::from(line) % LINES.len()]
            .iter()
            .map(OsString::from),
    );
    let cmd = COMMAND.with(Clone::clone);
    let env = |_: &str| None;
    let Ok((cmd, argv, vars)) =
        config::apply(cmd, argv, env, &["FALCON_POLICY", "DMLC_NUM_WORKER"])
    else {
        return;
    };
    assert!(
        !argv
            .iter()
            .take_while(|a| *a != "--")
            .any(|a| a == "--config"),
        "--config is consumed: {argv:?}"
    );
    assert!(
        vars.iter()
            .all(|(k, _)| k == "FALCON_POLICY" || k == "DMLC_NUM_WORKER"),
        "only the role's variables: {vars:?}"
    );
    let _ = cmd.try_get_matches_from(argv);
});
