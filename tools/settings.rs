//! Every variable `falcon role` reads, each with its check, run before anything starts: the
//! table is the list of variables (the launch contract's, `falcon_engine::launch::VARIABLES`,
//! and the workloads', [`crate::ROLE_OWN_VARIABLES`]), and a test holds it to both lists, so a
//! new variable cannot go unchecked. Each entry also names a value it must refuse, which the
//! tests feed it.
//!
//! Three kinds of check:
//! - [`Check::Launch`]: read and checked by the launch contract itself
//!   ([`falcon_engine::launch::Launch::from_vars`]), which runs first;
//! - [`Check::Value`]: checked here, whether or not this role's work reads it (a wrong value
//!   is a mistake in the job's settings, wherever it is set);
//! - [`Check::Any`]: any text is a value (a job's name, its token).
//!
//! Some checks need the role: the scheduler bind-tests its metrics address, a server makes
//! sure its checkpoint directory can take a file.

use std::path::Path;

use falcon_engine::launch::Launch;
use falcon_engine::proto::Role;

use crate::checks::{self, Invalid};

/// What a variable's check needs besides its value.
pub(crate) struct Context<'a> {
    /// The launch, as the contract read it.
    pub(crate) launch: &'a Launch,
}

type ValueCheck = fn(&str, &Context<'_>) -> Result<(), String>;

/// How a variable is checked before anything starts. (What the launch's base is, and why any
/// text will do, are read by the tests and written in the table for its readers.)
#[derive(Clone, Copy)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Check {
    /// By the launch contract, where the launch reads it (`Base` says which launches do).
    Launch(Base),
    /// By this function.
    Value(ValueCheck),
    /// Any text is a value: why.
    Any(&'static str),
}

/// The launches in which a variable is read: a role named outright (`FALCON_ROLE`; `Node`:
/// a server or a worker), or a launcher's ranks (torchrun, Slurm, Open MPI) with no role named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Base {
    Role,
    /// A role named outright, but not the scheduler (which listens where the job's address
    /// says, not where these do).
    Node,
    Torchrun,
    Slurm,
}

/// One variable: its name, its check (in every role, or in `only`), and a value the check
/// refuses (for the tests).
pub(crate) struct Setting {
    pub(crate) name: &'static str,
    pub(crate) check: Check,
    pub(crate) only: Option<Role>,
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) garbage: &'static str,
}

const fn launch(name: &'static str, garbage: &'static str) -> Setting {
    under(Base::Role, name, garbage)
}

const fn under(base: Base, name: &'static str, garbage: &'static str) -> Setting {
    Setting {
        name,
        check: Check::Launch(base),
        only: None,
        garbage,
    }
}

const fn value(name: &'static str, check: ValueCheck, garbage: &'static str) -> Setting {
    Setting {
        name,
        check: Check::Value(check),
        only: None,
        garbage,
    }
}

/// A value only `role` uses, checked there alone (a dataset a worker reads may be on the
/// workers' hosts only).
const fn value_in(
    role: Role,
    name: &'static str,
    check: ValueCheck,
    garbage: &'static str,
) -> Setting {
    Setting {
        name,
        check: Check::Value(check),
        only: Some(role),
        garbage,
    }
}

const fn any(name: &'static str, why: &'static str) -> Setting {
    Setting {
        name,
        check: Check::Any(why),
        only: None,
        garbage: "",
    }
}

fn text<T, E: std::fmt::Display>(r: Result<T, E>) -> Result<(), String> {
    r.map(drop).map_err(|e| e.to_string())
}

fn whole(v: &str, _: &Context<'_>) -> Result<(), String> {
    text(checks::whole(v))
}

fn at_least_one(v: &str, _: &Context<'_>) -> Result<(), String> {
    text(checks::at_least_one_u64(v))
}

fn millis(v: &str, _: &Context<'_>) -> Result<(), String> {
    v.trim()
        .parse::<u64>()
        .map(drop)
        .map_err(|_| "not a whole number of milliseconds".into())
}

fn one_of(v: &str, allowed: &[&str]) -> Result<(), String> {
    if allowed.contains(&v.trim()) {
        Ok(())
    } else {
        Err(format!("not one of {}", allowed.join(", ")))
    }
}

fn workload(v: &str, _: &Context<'_>) -> Result<(), String> {
    one_of(v, crate::WORKLOADS)
        .map_err(|_| format!("not a workload: {}", crate::WORKLOADS.join(", ")))
}

fn worker_loop(v: &str, _: &Context<'_>) -> Result<(), String> {
    one_of(v, &["pull-push", "push-pull"])
        .map_err(|_| "the loop is pull-push (the default) or push-pull".into())
}

fn hetero(v: &str, c: &Context<'_>) -> Result<(), String> {
    text(falcon_trainer::hetero::assign(
        c.launch.config.workers,
        &falcon_trainer::hetero::split_entries(v),
    ))
}

fn lr_decay(v: &str, _: &Context<'_>) -> Result<(), String> {
    text(crate::parse_lr_decay(v))
}

fn model(v: &str, _: &Context<'_>) -> Result<(), String> {
    text(v.parse::<falcon_trainer::model::ModelSpec>())
}

fn device(v: &str, _: &Context<'_>) -> Result<(), String> {
    text(v.parse::<falcon_trainer::device::Device>())
}

/// The dataset's directory, said as the dataset itself says it when it reads it.
fn data(v: &str, _: &Context<'_>) -> Result<(), String> {
    let dir = Path::new(v);
    if !dir.exists() {
        Err(format!("dataset {v}: does not exist"))
    } else if !dir.is_dir() {
        Err(format!(
            "dataset {v}: not a directory (of the dataset's IDX files)"
        ))
    } else {
        Ok(())
    }
}

fn true_or_false(v: &str, _: &Context<'_>) -> Result<(), String> {
    if v.trim().eq_ignore_ascii_case("true") || v.trim().eq_ignore_ascii_case("false") {
        Ok(())
    } else {
        Err("not true or false (torchrun sets it)".into())
    }
}

fn gid_index(v: &str, _: &Context<'_>) -> Result<(), String> {
    v.trim()
        .parse::<i32>()
        .map(drop)
        .map_err(|_| "not a GID index (a whole number)".into())
}

fn parent_pid(v: &str, _: &Context<'_>) -> Result<(), String> {
    match v.trim().parse::<i32>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err("not a process id (a whole number > 0)".into()),
    }
}

/// The scheduler serves its metrics there: it must be able to listen on it now (another
/// role only checks its form, done by the launch contract).
fn metrics_addr(v: &str, c: &Context<'_>) -> Result<(), String> {
    if c.launch.role != Role::Scheduler {
        return Ok(());
    }
    let Some(addr) = c.launch.config.metrics_addr else {
        return Ok(());
    };
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|e| format!("the scheduler cannot serve its metrics on {v}: {e}"))
}

/// A checkpoint directory must be a directory (or not exist yet); a server's must take a
/// file now, not after rendezvous.
fn checkpoint_dir(v: &str, c: &Context<'_>) -> Result<(), String> {
    let dir = Path::new(v);
    if dir.exists() && !dir.is_dir() {
        return Err("not a directory: a file is in its place".into());
    }
    if c.launch.role != Role::Server {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create it: {e}"))?;
    let probe = dir.join(format!(".falcon-probe-{}", std::process::id()));
    let written = std::fs::write(&probe, b"probe");
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| format!("cannot write a checkpoint in it: {e}"))
}

/// Every variable `falcon role` reads, in the order of `falcon role --help`.
pub(crate) const SETTINGS: &[Setting] = &[
    launch("FALCON_ROLE", "chef"),
    launch("DMLC_ROLE", "chef"),
    launch("FALCON_RANK", "first"),
    launch("FALCON_NUM_SERVER", "two"),
    launch("DMLC_NUM_SERVER", "-1"),
    launch("FALCON_NUM_WORKER", "many"),
    launch("DMLC_NUM_WORKER", "1.5"),
    launch("FALCON_SCHEDULER", "nowhere"),
    launch("FALCON_SCHEDULER_URI", "no such host!"),
    launch("DMLC_PS_ROOT_URI", "no such host!"),
    launch("FALCON_SCHEDULER_PORT", "70000"),
    launch("DMLC_PS_ROOT_PORT", "port"),
    value("RANK", whole, "one"),
    value("WORLD_SIZE", whole, "all"),
    under(Base::Torchrun, "MASTER_ADDR", "no such host!"),
    value("MASTER_PORT", whole, "p"),
    value("TORCHELASTIC_USE_AGENT_STORE", true_or_false, "maybe"),
    value("SLURM_PROCID", whole, "x"),
    value("SLURM_NTASKS", whole, "x"),
    under(Base::Slurm, "SLURM_NODELIST", "node[3-1]"),
    under(Base::Slurm, "SLURM_JOB_NODELIST", "node[3-1]"),
    value("OMPI_COMM_WORLD_RANK", whole, "x"),
    value("OMPI_COMM_WORLD_SIZE", whole, "x"),
    under(Base::Torchrun, "LOCAL_WORLD_SIZE", "x"),
    under(Base::Slurm, "SLURM_NNODES", "x"),
    value("OMPI_COMM_WORLD_LOCAL_SIZE", whole, "x"),
    under(Base::Torchrun, "FALCON_HOST_ROLES", "maybe"),
    under(Base::Node, "FALCON_NODE_HOST", "no such host!"),
    under(Base::Node, "DMLC_NODE_HOST", "no such host!"),
    under(Base::Node, "FALCON_BIND", "nowhere"),
    under(Base::Node, "FALCON_ADVERTISE", "nowhere"),
    any("FALCON_JOB", "a job's name: any text (it is hashed)"),
    any("FALCON_TOKEN", "a secret: any text"),
    launch("FALCON_POLICY", "fastest"),
    launch("FALCON_LR", "fast"),
    launch("FALCON_OPTIMIZER", "lamb"),
    launch("FALCON_AGGREGATE", "median"),
    launch("FALCON_SCALE", "twice"),
    launch("FALCON_MAX_SHARD_BYTES", "big"),
    launch("FALCON_FAN_OUT", "maybe"),
    launch("FALCON_WIRE", "f8"),
    value("FALCON_METRICS_ADDR", metrics_addr, "localhost"),
    launch("FALCON_MEDIUM", "pigeon"),
    launch("FALCON_HEARTBEAT_MS", "1s"),
    launch("FALCON_SUSPICION_MS", "-5"),
    launch("FALCON_RENDEZVOUS_TIMEOUT_MS", "soon"),
    launch("FALCON_OP_TIMEOUT_MS", "soon"),
    launch("FALCON_HANDSHAKE_TIMEOUT_MS", "soon"),
    launch("FALCON_SPIN_US", "spin"),
    launch("FALCON_SHM_IN_PLACE", "maybe"),
    launch("FALCON_HELPER_THREADS", "all"),
    launch("FALCON_TCP_STREAMS", "9"),
    launch("FALCON_MAX_HANDSHAKES", "lots"),
    launch("FALCON_MAX_HANDSHAKES_PER_SOURCE", "lots"),
    launch("FALCON_MAX_CONTROL_BYTES", "4M"),
    value("FALCON_CHECKPOINT_DIR", checkpoint_dir, "/dev/null"),
    value("FALCON_CHECKPOINT_MS", millis, "often"),
    value("FALCON_RECOVERY_TIMEOUT_MS", millis, "a while"),
    launch("FALCON_CHECKPOINT_ON_FAILURE", "panic"),
    launch("FALCON_RESUME", "maybe"),
    // The workloads' own.
    value("FALCON_WORKLOAD", workload, "bogus"),
    value("FALCON_ROWS", at_least_one, "0"),
    value("FALCON_ROWS_SETS", whole, "some"),
    value("FALCON_HETERO", hetero, "9:h=0.5"),
    value("FALCON_LR_DECAY", lr_decay, "1000:2"),
    value("FALCON_ITERS", at_least_one, "0"),
    value("FALCON_FLOATS", at_least_one, "many"),
    value("FALCON_LOOP", worker_loop, "push-push"),
    value("FALCON_MODEL", model, "transformer"),
    value("FALCON_DEVICE", device, "tpu"),
    value_in(Role::Worker, "FALCON_DATA", data, "/no/such/dataset"),
    value("FALCON_BATCH", at_least_one, "0"),
    value("FALCON_TASKS", at_least_one, "0"),
    value("FALCON_THREADS", at_least_one, "0"),
    value("FALCON_SEED", whole, "random"),
    value("FALCON_FAULT_DROP_MS", whole, "abc"),
    value("FALCON_FAULT_DROP_EVERY", whole, "abc"),
    any(
        "FALCON_RDMA_DEVICE",
        "a device's name: one that is not there is said when the medium opens",
    ),
    value("FALCON_RDMA_GID_INDEX", gid_index, "first"),
    any(
        "FALCON_ANNOUNCE",
        "set (to anything): the scheduler prints its address",
    ),
    value("FALCON_PARENT_PID", parent_pid, "parent"),
    any(
        "RUST_LOG",
        "read by the logger, which skips a directive it cannot read",
    ),
];

/// Runs every check of the variables that are set (`lookup`), for the launch the contract
/// read: the first refusal, naming its variable.
pub(crate) fn check(
    lookup: &dyn Fn(&str) -> Option<String>,
    launch: &Launch,
) -> Result<(), Invalid> {
    let c = Context { launch };
    for s in SETTINGS {
        let Check::Value(f) = s.check else { continue };
        if s.only.is_some_and(|r| r != launch.role) {
            continue;
        }
        let Some(v) = lookup(s.name) else { continue };
        f(&v, &c).map_err(|why| Invalid::Env {
            var: s.name,
            value: v.clone(),
            why,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn every_variable_role_reads_has_exactly_one_check() {
        let listed: BTreeSet<&str> = falcon_engine::launch::VARIABLES
            .iter()
            .chain(crate::ROLE_OWN_VARIABLES)
            .copied()
            .collect();
        for s in SETTINGS {
            match s.check {
                Check::Any(why) => assert!(!why.is_empty(), "{}: say why any text will do", s.name),
                _ => assert!(!s.garbage.is_empty(), "{}: a value it refuses", s.name),
            }
        }
        let checked: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        let set: BTreeSet<&str> = checked.iter().copied().collect();
        assert_eq!(set.len(), checked.len(), "a variable is listed twice");
        let missing: Vec<_> = listed.difference(&set).collect();
        let extra: Vec<_> = set.difference(&listed).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "unchecked: {missing:?}; checked but not read: {extra:?}"
        );
    }

    /// The environment of a launch of kind `base`, for a role whose scheduler does not run.
    fn base(kind: Base, role: &str) -> Vec<(&'static str, String)> {
        let v = |k: &'static str, s: &str| (k, s.to_string());
        match kind {
            // ps-lite's names: each falcon name, and each alias set again, overrides them.
            Base::Role | Base::Node => vec![
                v("DMLC_ROLE", role),
                v("DMLC_PS_ROOT_URI", "127.0.0.1"),
                v("DMLC_PS_ROOT_PORT", "1"),
                v("DMLC_NUM_SERVER", "1"),
                v("DMLC_NUM_WORKER", "2"),
            ],
            Base::Torchrun => vec![
                v("RANK", "2"),
                v("WORLD_SIZE", "3"),
                v("MASTER_ADDR", "127.0.0.1"),
                v("MASTER_PORT", "1"),
            ],
            Base::Slurm => vec![
                v("SLURM_PROCID", "2"),
                v("SLURM_NTASKS", "3"),
                v("SLURM_JOB_NODELIST", "localhost"),
                v("FALCON_SCHEDULER_PORT", "1"),
            ],
        }
    }

    /// What `falcon role` runs before anything starts, on an environment of its own.
    fn before_start(vars: &[(&'static str, String)]) -> Result<(), String> {
        let lookup = |k: &str| {
            vars.iter()
                .rev()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.clone())
        };
        let launch = Launch::from_vars(lookup).map_err(|e| e.to_string())?;
        check(&lookup, &launch).map_err(|e| e.to_string())
    }

    #[test]
    fn garbage_in_any_variable_is_refused_before_anything_starts_naming_it() {
        for role in ["worker", "server", "scheduler"] {
            // The bases themselves start.
            for kind in [Base::Role, Base::Torchrun, Base::Slurm] {
                if kind == Base::Role || role == "worker" {
                    before_start(&base(kind, role)).unwrap();
                }
            }
            for s in SETTINGS {
                let kind = match s.check {
                    Check::Any(_) => continue,
                    Check::Launch(Base::Node) if role == "scheduler" => continue,
                    Check::Launch(Base::Node) => Base::Role,
                    Check::Launch(kind) => kind,
                    Check::Value(_) => Base::Role,
                };
                if kind != Base::Role && role != "worker" {
                    continue;
                }
                if s.only.is_some_and(|r| r.name() != role) {
                    continue;
                }
                let mut vars = base(kind, role);
                vars.push((s.name, s.garbage.to_string()));
                match before_start(&vars) {
                    Err(e) => assert!(
                        e.contains(s.name),
                        "{role}: {}={} refused without naming it: {e}",
                        s.name,
                        s.garbage
                    ),
                    Ok(()) => panic!("{role}: {}={} was taken", s.name, s.garbage),
                }
            }
        }
    }

    #[test]
    fn the_role_that_uses_an_address_or_a_directory_tries_it() {
        // A port held by another program: refused by the scheduler, which would serve there.
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap().to_string();
        let mut vars = base(Base::Role, "scheduler");
        vars.push(("FALCON_METRICS_ADDR", addr.clone()));
        let e = before_start(&vars).unwrap_err();
        assert!(
            e.contains("FALCON_METRICS_ADDR") && e.contains(&addr),
            "{e}"
        );
        // An address of another host: refused too.
        vars.push(("FALCON_METRICS_ADDR", "192.0.2.1:9464".into()));
        let e = before_start(&vars).unwrap_err();
        assert!(e.contains("FALCON_METRICS_ADDR"), "{e}");
        // A worker does not serve metrics.
        let mut vars = base(Base::Role, "worker");
        vars.push(("FALCON_METRICS_ADDR", addr));
        before_start(&vars).unwrap();
        // A checkpoint directory that a server cannot write in.
        let dir = std::env::temp_dir().join(format!("falcon-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        let mut vars = base(Base::Role, "server");
        vars.push(("FALCON_CHECKPOINT_DIR", file.display().to_string()));
        let e = before_start(&vars).unwrap_err();
        assert!(
            e.contains("FALCON_CHECKPOINT_DIR") && e.contains("not a directory"),
            "{e}"
        );
        vars.push((
            "FALCON_CHECKPOINT_DIR",
            file.join("below").display().to_string(),
        ));
        let e = before_start(&vars).unwrap_err();
        assert!(e.contains("FALCON_CHECKPOINT_DIR"), "{e}");
        vars.push((
            "FALCON_CHECKPOINT_DIR",
            dir.join("ok").display().to_string(),
        ));
        before_start(&vars).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
