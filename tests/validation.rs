//! Values refused before anything starts, with the real binary: each bad value (as a flag,
//! as its environment variable, in the configuration file) ends `falcon` at once with a
//! message saying what is wrong and what is allowed, and starts nothing (no banner, no
//! report, no role process, no output directory). Such a refusal is a usage error: status 2.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const FALCON: &str = env!("CARGO_BIN_EXE_falcon");
const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/fashion-mnist-sample");

/// A fresh directory name under the temporary directory (not created).
fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("falcon-validation-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs `falcon ARGS` with `env` set; it must fail at once, saying `says` on stderr, having
/// printed nothing on stdout and created no `out` directory.
fn refused(args: &[&str], env: &[(&str, &str)], says: &str) -> String {
    let out = out_dir("run");
    let mut c = Command::new(FALCON);
    c.args(args);
    let sub = args[0];
    if matches!(sub, "train" | "sim") {
        c.arg("--out").arg(&out).args(["--data", SAMPLE]);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let start = Instant::now();
    let o: Output = c.output().unwrap();
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "{args:?} {env:?} was accepted:\n{stdout}\n{stderr}"
    );
    assert_eq!(
        o.status.code(),
        Some(2),
        "a value refused before anything started is a usage error: {stderr}"
    );
    assert!(
        stderr.contains(says),
        "{args:?} {env:?}: the message does not say {says:?}:\n{stderr}"
    );
    assert!(
        stdout.is_empty(),
        "{args:?} {env:?} started something:\n{stdout}"
    );
    assert!(
        !out.exists(),
        "{args:?} {env:?} created its output directory"
    );
    assert!(
        !stderr.contains("Some(") && !stderr.contains("None"),
        "{stderr}"
    );
    assert!(took < Duration::from_secs(10), "{args:?}: {took:?}");
    stderr
}

const LR: &str = "the learning rate must be a finite number greater than 0";

#[test]
fn a_learning_rate_must_be_finite_and_positive() {
    for lr in ["nan", "inf", "0", "-0.5"] {
        let e = refused(&["train", "--lr", lr], &[], LR);
        assert!(e.contains(&format!("{lr} is not")), "{e}");
        refused(&["local", "--lr", lr], &[], LR);
        refused(&["sim", "--lr", lr], &[], LR);
        // The environment variable's form.
        refused(&["train"], &[("FALCON_LR", lr)], LR);
        refused(&["local"], &[("FALCON_LR", lr)], LR);
    }
    // `falcon role` reads FALCON_LR itself.
    let e = refused(
        &["role"],
        &[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
            ("FALCON_LR", "nan"),
        ],
        LR,
    );
    assert!(e.contains("FALCON_LR=nan"), "{e}");
    assert_eq!(
        Command::new(FALCON)
            .args(["train", "--lr", "nan"])
            .output()
            .unwrap()
            .status
            .code(),
        Some(2),
        "a usage error"
    );
}

#[test]
fn an_optimizer_must_be_one_the_servers_have() {
    const SAYS: &str = "the optimizers: sgd, momentum(MU), adam";
    for sub in ["train", "sim"] {
        let e = refused(&[sub, "--optimizer", "nesterov"], &[], SAYS);
        assert!(e.contains("optimizer nesterov: unknown optimizer"), "{e}");
        let e = refused(&[sub, "--optimizer", "momentum(2)"], &[], SAYS);
        assert!(e.contains("0 ≤ MU < 1"), "{e}");
    }
    refused(&["train"], &[("FALCON_OPTIMIZER", "adam(1)")], SAYS);
    refused(
        &["train", "--aggregate", "median"],
        &[],
        "possible values: sum, mean",
    );
}

#[test]
fn a_configuration_files_values_are_checked_too() {
    let dir = out_dir("config");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("run.toml");
    std::fs::write(
        &file,
        "[train]\nlr = -1.0\n\n[local]\niters = 0\n\n[sim]\ntarget = 2.0\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    refused(&["train", "--config", f], &[], LR);
    refused(
        &["local", "--config", f],
        &[],
        "the count must be at least 1",
    );
    refused(&["sim", "--config", f], &[], "a fraction in (0, 1]");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn heterogeneity_must_name_workers_of_the_job() {
    let says = "worker 7 is out of range: this job has 2 worker(s), ranks 0 to 1";
    refused(
        &["local", "--workload", "train", "--workers", "2"],
        &[("FALCON_HETERO", "7:h=0.25")],
        says,
    );
    refused(
        &["local", "--workers", "2", "--hetero", "7:h=0.25"],
        &[],
        says,
    );
    refused(
        &["train", "--workers", "2", "--hetero", "7:h=0.25"],
        &[],
        says,
    );
    refused(
        &["train", "--workers", "2"],
        &[("FALCON_HETERO", "0:h=0.5;7:h=0.25")],
        says,
    );
    refused(
        &["sim", "--workers", "2", "--hetero", "7:h=0.25"],
        &[],
        says,
    );
    let e = refused(
        &["role"],
        &[
            ("FALCON_ROLE", "worker"),
            ("FALCON_NUM_WORKER", "2"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
            ("FALCON_HETERO", "7:h=0.25"),
        ],
        says,
    );
    assert!(e.contains("FALCON_HETERO=7:h=0.25"), "{e}");
    refused(
        &["train", "--workers", "2", "--hetero", "1:h=2"],
        &[],
        "h = 2 is outside (0, 1]",
    );
}

#[test]
fn syncopt_needs_fewer_backups_than_workers() {
    let says = "the backups must be fewer than the workers (0 to 3)";
    refused(
        &["train", "--workers", "4", "--policy", "syncopt(10)"],
        &[],
        says,
    );
    refused(
        &["local", "--workers", "4", "--policy", "syncopt(10)"],
        &[],
        says,
    );
    refused(
        &["sim", "--workers", "4", "--policies", "bsp,syncopt(4)"],
        &[],
        says,
    );
    refused(
        &["train", "--workers", "4", "--compare", "bsp,syncopt(4)"],
        &[],
        says,
    );
}

#[test]
fn targets_counts_and_threads_are_checked() {
    refused(
        &["train", "--target", "2"],
        &[],
        "a fraction in (0, 1], e.g. 0.75 for 75 %",
    );
    refused(&["sim", "--target", "0"], &[], "a fraction in (0, 1]");
    let one = "the count must be at least 1";
    refused(&["train", "--threads", "0"], &[], one);
    refused(&["train"], &[("FALCON_THREADS", "0")], one);
    refused(&["train", "--iters", "0"], &[], one);
    refused(&["local", "--iters", "0"], &[], one);
    refused(&["sim", "--iters", "0"], &[], one);
    refused(&["train", "--workers", "0"], &[], one);
    refused(&["local", "--servers", "0"], &[], one);
    refused(
        &["train", "--batch", "8", "--tasks", "9"],
        &[],
        "tasks must be between 1 and the batch",
    );
    // What worker processes of `local --workload train` will read is checked by `local`.
    let e = refused(
        &["local", "--workload", "train"],
        &[("FALCON_THREADS", "0")],
        one,
    );
    assert!(e.contains("FALCON_THREADS=0"), "{e}");
}

#[test]
fn policies_say_what_is_wrong_with_them() {
    let e = refused(
        &["local", "--policy", "dssp(8,2)"],
        &[],
        "s_L must be ≤ s_U",
    );
    assert!(!e.contains("fluentps(N"), "not the whole grammar: {e}");
    refused(
        &["train", "--policy", "fluentps(3,p=2)"],
        &[],
        "p must be in [0, 1]",
    );
    refused(
        &["local", "--scale", "consgd(0)"],
        &[],
        "must be a finite number > 0",
    );
}

#[test]
fn too_many_workers_for_this_machines_limits_is_refused_up_front() {
    for sub in ["train", "local"] {
        let e = refused(
            &[sub, "--workers", "100000"],
            &[],
            "the limit of open files (ulimit -n) is",
        );
        assert!(e.contains("raise it (`ulimit -n "), "{e}");
        assert!(e.contains("100000 worker(s)"), "{e}");
    }
}

#[test]
fn heartbeat_and_timeouts_are_checked() {
    for sub in ["train", "local"] {
        refused(&[sub, "--heartbeat-ms", "5"], &[], "at least 10 ms");
        refused(&[sub, "--rendezvous-timeout-ms", "0"], &[], "at least 1 ms");
        refused(&[sub, "--op-timeout-ms", "0"], &[], "at least 1 ms");
        refused(
            &[sub],
            &[("FALCON_HANDSHAKE_TIMEOUT_MS", "0")],
            "at least 1 ms",
        );
        refused(
            &[sub, "--heartbeat-ms", "1000", "--suspicion-ms", "500"],
            &[],
            "must be longer than the heartbeat interval",
        );
    }
    let e = refused(
        &["role"],
        &[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
            ("FALCON_HEARTBEAT_MS", "5"),
        ],
        "at least 10 ms",
    );
    assert!(e.contains("FALCON_HEARTBEAT_MS=5"), "{e}");
    refused(
        &["role"],
        &[
            ("FALCON_ROLE", "worker"),
            ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
            ("FALCON_OP_TIMEOUT_MS", "0"),
        ],
        "FALCON_OP_TIMEOUT_MS=0: a timeout must be at least 1 ms",
    );
}

#[test]
fn the_timeouts_are_documented_with_their_defaults() {
    for sub in ["train", "local"] {
        let out = Command::new(FALCON).args([sub, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        for (flag, var, default) in [
            ("--heartbeat-ms", "FALCON_HEARTBEAT_MS", Some("1000")),
            ("--suspicion-ms", "FALCON_SUSPICION_MS", None),
            (
                "--rendezvous-timeout-ms",
                "FALCON_RENDEZVOUS_TIMEOUT_MS",
                Some("60000"),
            ),
            ("--op-timeout-ms", "FALCON_OP_TIMEOUT_MS", Some("30000")),
            (
                "--handshake-timeout-ms",
                "FALCON_HANDSHAKE_TIMEOUT_MS",
                Some("5000"),
            ),
        ] {
            let at = help
                .find(flag)
                .unwrap_or_else(|| panic!("{sub}: no {flag}:\n{help}"));
            let entry = &help[at..];
            let entry = &entry[..entry[2..].find("\n  -").map_or(entry.len(), |e| e + 2)];
            assert!(
                entry.contains(&format!("[env: {var}=")),
                "{sub} {flag}: {entry}"
            );
            if let Some(d) = default {
                assert!(
                    entry.contains(&format!("[default: {d}]")),
                    "{sub} {flag}: {entry}"
                );
            }
        }
    }
    let out = Command::new(FALCON)
        .args(["local", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--recovery-timeout-ms"), "{help}");
    let out = Command::new(FALCON)
        .args(["role", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for var in [
        "FALCON_HEARTBEAT_MS",
        "FALCON_SUSPICION_MS",
        "FALCON_RENDEZVOUS_TIMEOUT_MS",
        "FALCON_OP_TIMEOUT_MS",
        "FALCON_HANDSHAKE_TIMEOUT_MS",
        "FALCON_RECOVERY_TIMEOUT_MS",
    ] {
        assert!(help.contains(var), "role --help: {var}:\n{help}");
    }
}

#[test]
fn a_roles_handshake_timeout_is_the_one_set() {
    // A "scheduler" that accepts connections and never answers: each of the worker's
    // handshakes times out after FALCON_HANDSHAKE_TIMEOUT_MS, not the default 5 s; it retries
    // (saying so) until its rendezvous deadline.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let start = Instant::now();
    let out = Command::new(FALCON)
        .arg("role")
        .env("FALCON_ROLE", "worker")
        .env("FALCON_NODE_HOST", "127.0.0.1")
        .env("FALCON_SCHEDULER", format!("host=remote;tcp={addr}"))
        .env("FALCON_HANDSHAKE_TIMEOUT_MS", "300")
        .env("FALCON_RENDEZVOUS_TIMEOUT_MS", "1500")
        .output()
        .unwrap();
    let took = start.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("tcp handshake timed out after 0.3 s"), "{err}");
    assert!(
        err.contains("unreachable at"),
        "it says where it tried: {err}"
    );
    assert!(took < Duration::from_secs(4), "{took:?}: {err}");
    drop(silent);
}

#[test]
fn role_help_lists_every_variable_of_the_launch_contract() {
    let out = Command::new(FALCON)
        .args(["role", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let part = |c: char| c.is_ascii_alphanumeric() || c == '_';
    for var in falcon_engine::launch::VARIABLES {
        // As a whole name: RANK, not inside FALCON_RANK.
        let named = help
            .match_indices(var)
            .any(|(i, _)| !help[..i].ends_with(part) && !help[i + var.len()..].starts_with(part));
        assert!(named, "role --help misses {var}:\n{help}");
    }
}

#[test]
fn role_refuses_a_launch_it_cannot_use_naming_the_variable() {
    // Nothing of this process's own environment decides the role.
    let role = |env: &[(&str, &str)]| -> String {
        let mut c = Command::new(FALCON);
        c.arg("role");
        for var in falcon_engine::launch::VARIABLES {
            c.env_remove(var);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "a usage error: {stderr}");
        assert!(o.stdout.is_empty(), "{stderr}");
        assert!(
            !stderr.contains("Some(") && !stderr.contains('"'),
            "{stderr}"
        );
        stderr
    };
    let e = role(&[]);
    assert!(e.contains("no role: set FALCON_ROLE (or DMLC_ROLE)"), "{e}");
    let e = role(&[("FALCON_ROLE", "worker")]);
    assert!(
        e.contains("no scheduler: set FALCON_SCHEDULER (HOST:PORT)"),
        "{e}"
    );
    let e = role(&[("FALCON_ROLE", "worker"), ("FALCON_SCHEDULER", "node01")]);
    assert!(
        e.contains("FALCON_SCHEDULER=node01: no port: expected HOST:PORT"),
        "{e}"
    );
    let e = role(&[("RANK", "5"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "9")]);
    assert!(
        e.contains("RANK=5 with WORLD_SIZE=4: the rank must be below the world size"),
        "{e}"
    );
    let e = role(&[
        ("DMLC_ROLE", "server"),
        ("DMLC_PS_ROOT_URI", "127.0.0.1"),
        ("DMLC_PS_ROOT_PORT", "70000"),
    ]);
    assert!(
        e.contains("DMLC_PS_ROOT_PORT=70000: not a port (a whole number from 0 to 65535)"),
        "{e}"
    );
}

#[test]
fn a_learning_rate_decay_is_checked() {
    for bad in ["10", "0:0.5", "10:0", "10:1.5", "x:0.5", "10:nan"] {
        let e = refused(
            &["role"],
            &[
                ("FALCON_ROLE", "server"),
                ("FALCON_SCHEDULER", "host=remote;tcp=127.0.0.1:9"),
                ("FALCON_LR_DECAY", bad),
            ],
            "expected EVERY:GAMMA",
        );
        assert!(e.contains(&format!("FALCON_LR_DECAY={bad}")), "{e}");
    }
}

/// `falcon role` as `role` of a job of one server and one worker whose scheduler is at
/// 127.0.0.1:`port`, in ps-lite's variables (none of this process's own launch variables).
fn ps_lite_role(role: &str, port: &str) -> Command {
    let mut c = Command::new(FALCON);
    c.arg("role");
    for v in falcon_engine::launch::VARIABLES {
        c.env_remove(v);
    }
    c.envs([
        ("DMLC_ROLE", role),
        ("DMLC_PS_ROOT_URI", "127.0.0.1"),
        ("DMLC_PS_ROOT_PORT", port),
        ("DMLC_NUM_SERVER", "1"),
        ("DMLC_NUM_WORKER", "1"),
    ]);
    c
}

/// The settings found too late before (2026-11-27): each refused by `falcon role` before it
/// joins anything, naming the variable, as a usage error, with no scheduler running (a
/// setting taken would wait for rendezvous, and the test would see it time out instead).
#[test]
fn role_refuses_every_setting_before_rendezvous_naming_it() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let held_addr = held.local_addr().unwrap().to_string();
    let file = out_dir("ckpt-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let file_s = file.display().to_string();
    let cases: Vec<(&str, &str, &str, &str)> = vec![
        ("worker", "FALCON_WORKLOAD", "bogus", "not a workload"),
        (
            "worker",
            "FALCON_FAULT_DROP_MS",
            "abc",
            "not a whole number",
        ),
        (
            "scheduler",
            "FALCON_METRICS_ADDR",
            &held_addr,
            "cannot serve its metrics on",
        ),
        (
            "scheduler",
            "FALCON_METRICS_ADDR",
            "192.0.2.7:9464",
            "cannot serve its metrics on",
        ),
        (
            "server",
            "FALCON_CHECKPOINT_DIR",
            &file_s,
            "not a directory",
        ),
        ("worker", "FALCON_LOOP", "push-push", "pull-push"),
        ("worker", "FALCON_LR_DECAY", "10:2", "EVERY:GAMMA"),
        (
            "server",
            "FALCON_CHECKPOINT_MS",
            "often",
            "whole number of milliseconds",
        ),
        ("worker", "RANK", "one", "not a whole number"),
        (
            "worker",
            "FALCON_MAX_CONTROL_BYTES",
            "4M",
            "not a whole number",
        ),
    ];
    for (role, var, value, says) in cases {
        let mut c = ps_lite_role(role, "1");
        c.envs([("FALCON_RENDEZVOUS_TIMEOUT_MS", "30000"), (var, value)]);
        let start = Instant::now();
        let o = c.output().unwrap();
        let took = start.elapsed();
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(
            o.status.code(),
            Some(2),
            "{role} with {var}={value}: a usage error before rendezvous ({took:?}): {stderr}"
        );
        assert!(
            stderr.contains(var) && stderr.contains(says),
            "{role} with {var}={value}: {stderr}"
        );
        assert!(took < Duration::from_secs(10), "{var}: {took:?}");
    }
    let _ = std::fs::remove_file(&file);
    drop(held);
}

/// A port another program holds: the scheduler names the address and the variables to
/// change; a worker whose scheduler address reaches that program says it is not a falcon
/// scheduler, at once, instead of failing later on its bytes.
#[test]
fn a_port_held_by_another_program_is_named_as_such() {
    use std::io::{Read, Write};
    let foreign = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = foreign.local_addr().unwrap().port().to_string();
    // The other program: a web server answering every connection with a page.
    std::thread::spawn(move || {
        for conn in foreign.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let _ = conn.write_all(b"<!DOCTYPE html>\n<html>");
                let mut buf = [0u8; 256];
                let _ = conn.read(&mut buf);
                std::thread::sleep(Duration::from_secs(20));
            });
        }
    });
    let role = |role: &str| {
        let mut c = ps_lite_role(role, &port);
        let start = Instant::now();
        let o = c.output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            start.elapsed(),
        )
    };
    let (code, err, _) = role("scheduler");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("the scheduler cannot listen on 127.0.0.1:{port}"))
            && err.contains("Address already in use")
            && err.contains("DMLC_PS_ROOT_PORT"),
        "{err}"
    );
    for r in ["worker", "server"] {
        let (code, err, took) = role(r);
        assert_eq!(code, Some(1), "{err}");
        assert!(
            err.contains(&format!("127.0.0.1:{port} is not a falcon scheduler"))
                && err.contains("<!DOCTYPE html>"),
            "{r}: {err}"
        );
        // At once: not after the handshake deadline nor the rendezvous timeout.
        assert!(took < Duration::from_secs(4), "{r}: {took:?}");
    }
}
