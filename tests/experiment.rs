//! `falcon experiment` as a user runs it: a real process, real files out.

use std::path::Path;
use std::process::Command;

fn falcon(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_falcon"))
        .args(args)
        .output()
        .expect("falcon runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "falcon {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("falcon-exp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn stragglers_writes_every_output_for_both_modes() {
    let out = tmp("stragglers");
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist-sample");
    let printed = falcon(&[
        "experiment",
        "stragglers",
        "--quick",
        "--quiet",
        "--mode",
        "both",
        "--policies",
        "bsp,epsp(0,fixed),asp+dynsgd",
        "--data",
        sample.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(printed.contains("| configuration |"), "{printed}");
    for mode in ["real", "sim"] {
        let csv = std::fs::read_to_string(out.join(format!("{mode}-results.csv"))).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines.len(),
            4,
            "a header and one row per configuration: {csv}"
        );
        for (line, config) in lines[1..]
            .iter()
            .zip(["bsp", "epsp(0,fixed)", "asp+dynsgd"])
        {
            assert!(line.starts_with(&format!("\"{config}\",{mode},")), "{line}");
        }
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(format!("{mode}-results.json"))).unwrap(),
        )
        .unwrap();
        let rows = json.as_array().unwrap();
        assert_eq!(rows.len(), 3);
        for r in rows {
            // Every configuration trained: worker 0's curve exists and beats chance.
            assert!(r["final_accuracy"].as_f64().unwrap() > 0.2, "{r}");
            assert!(!r["curve"].as_array().unwrap().is_empty());
            assert!(r["bytes_moved"].as_u64().unwrap() > 0);
        }
        // BSP under a straggler parks pulls; EPSP enforced with transfer moves tasks.
        assert!(rows[0]["parked_pulls"].as_u64().unwrap() > 0);
        if mode == "sim" {
            // Deterministic: the simulator carries out EPSP's transfers.
            assert!(
                rows[1]["tasks_transferred"].as_u64().unwrap() > 0,
                "{}",
                rows[1]
            );
        }
        for plot in ["accuracy", "time_to_target"] {
            let png = std::fs::read(out.join(format!("{mode}-{plot}.png"))).unwrap();
            assert!(png.starts_with(b"\x89PNG"));
            let svg = std::fs::read_to_string(out.join(format!("{mode}-{plot}.svg"))).unwrap();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        }
        assert!(out.join(format!("{mode}-table.md")).exists());
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The fair comparison: every configuration at every momentum, learning rate and seed of the
/// grid (Sync-opt at every backup count up to the slowed workers), reported at its best, every
/// run kept; the grain of tasks, the partition and the evaluation interval as asked.
#[test]
fn fair_runs_the_grid_and_reports_each_policy_at_its_best_settings() {
    let out = tmp("fair");
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fashion-mnist-sample");
    let printed = falcon(&[
        "experiment",
        "fair",
        "--quick",
        "--quiet",
        "--workers",
        "4",
        "--hetero",
        "2-3:h=0.5",
        "--policies",
        "bsp,epsp(0),asp,syncopt(*)",
        "--lr-grid",
        "0.001,0.1",
        "--momenta",
        "0.5,0.9",
        "--seeds",
        "2",
        "--tasks",
        "8",
        "--eval-every",
        "1",
        "--data",
        sample.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        printed.contains("| configuration | mode | optimizer | lr |"),
        "{printed}"
    );
    assert!(
        printed.contains("momentum(0.5) or momentum(0.9) at lr 0.001, 0.1, 2 seed(s)"),
        "{printed}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for (i, r) in rows.iter().enumerate() {
        let grid = r["grid"].as_array().unwrap();
        let variants = if i == 3 { 2 } else { 1 };
        assert_eq!(
            grid.len(),
            variants * 8,
            "variants × 2 momenta × 2 learning rates × 2 seeds: {r}"
        );
        assert_eq!(r["times"].as_array().unwrap().len(), 2, "one per seed");
        // The reported settings are the best group's: the earliest median time to target,
        // then the highest mean final accuracy.
        let key = |g: &serde_json::Value| {
            (
                g["config"].as_str().unwrap().to_string(),
                g["optimizer"].as_str().unwrap().to_string(),
                g["lr"].as_f64().unwrap().to_bits(),
            )
        };
        type Settings = (String, String, u64);
        let mut groups: Vec<(Settings, Vec<&serde_json::Value>)> = Vec::new();
        for g in grid {
            match groups.iter_mut().find(|(k, _)| *k == key(g)) {
                Some((_, v)) => v.push(g),
                None => groups.push((key(g), vec![g])),
            }
        }
        let score = |runs: &[&serde_json::Value]| {
            let mut t: Vec<f64> = runs
                .iter()
                .map(|g| g["time_to_target"].as_f64().unwrap_or(f64::INFINITY))
                .collect();
            t.sort_by(f64::total_cmp);
            let mean = runs
                .iter()
                .map(|g| g["final_accuracy"].as_f64().unwrap())
                .sum::<f64>()
                / runs.len() as f64;
            (t[t.len() / 2], -mean)
        };
        let best = groups
            .iter()
            .map(|(k, v)| (score(v), k))
            .min_by(|a, b| a.0.0.total_cmp(&b.0.0).then(a.0.1.total_cmp(&b.0.1)))
            .unwrap();
        let chosen = (
            r["config"]
                .as_str()
                .unwrap()
                .split(" of ")
                .next()
                .unwrap()
                .to_string(),
            r["optimizer"].as_str().unwrap().to_string(),
            r["lr"].as_f64().unwrap().to_bits(),
        );
        assert_eq!(
            score(&groups.iter().find(|(k, _)| *k == chosen).unwrap().1),
            best.0,
            "{r}"
        );
        if i == 3 {
            assert!(
                r["config"].as_str().unwrap().ends_with(" of syncopt(*)"),
                "{r}"
            );
        }
    }
    // Enforced EPSP takes BSP's steps: the same final model at the same settings.
    assert_eq!(rows[0]["lr"], rows[1]["lr"]);
    assert_eq!(rows[0]["optimizer"], rows[1]["optimizer"]);
    assert_eq!(rows[0]["final_accuracy"], rows[1]["final_accuracy"]);
    // Evaluated at every iteration of a 20-iteration run: 20 points and the final one or so.
    assert!(rows[0]["curve"].as_array().unwrap().len() >= 20);
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert!(
        csv.lines()
            .next()
            .unwrap()
            .ends_with(",lr,diverged,optimizer,lowest_after_target"),
        "{csv}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn zipline_reports_beside_the_paper() {
    let out = tmp("zipline");
    let printed = falcon(&[
        "experiment",
        "zipline",
        "--quick",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(printed.contains("| 1000 | 150 |"), "{printed}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(json["points"].as_array().unwrap().len(), 6);
    assert!(json["miss_ns"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_bad_configuration_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_falcon"))
        .args([
            "experiment",
            "stragglers",
            "--policies",
            "bsp+dynsgd",
            "--quick",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gradient scaling"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_falcon"))
        .args(["experiment", "dssp", "--hetero", "5:h=0.5", "--quick"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ranks"));
}

#[test]
fn a_config_file_is_overridden_by_environment_and_flags() {
    let dir = tmp("config");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.toml");
    std::fs::write(
        &file,
        format!(
            "[sim]\nworkers = 3\niters = 5\nmodel = \"mlp:784-10\"\npolicies = \"bsp\"\n\
             no-compute = true\nout = {:?}\n",
            dir.join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    let sim = |env: &[(&str, &str)], args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_falcon"));
        c.env_remove("FALCON_NUM_WORKER")
            .env_remove("FALCON_ITERS")
            .env_remove("FALCON_MODEL")
            .env_remove("FALCON_CONFIG");
        for (k, v) in env {
            c.env(k, v);
        }
        c.args(args).output().unwrap()
    };
    let f = file.to_str().unwrap();
    // The file alone.
    let out = sim(&[], &["--config", f, "sim"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("3 workers × 5 iterations, model mlp:784-10"),
        "{text}"
    );
    assert!(dir.join("out/accuracy.png").exists());
    // The environment beats the file; a flag beats both.
    let out = sim(
        &[
            ("FALCON_CONFIG", f),
            ("FALCON_ITERS", "6"),
            ("FALCON_MODEL", "mlp:784-8-10"),
        ],
        &["sim", "--workers", "2"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("2 workers × 6 iterations, model mlp:784-8-10"),
        "{text}"
    );
    // A misspelt key is a clear error naming it, the file and the line.
    std::fs::write(&file, "[sim]\nwokers = 3\n").unwrap();
    let out = sim(&[], &["--config", f, "sim"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("wokers") && err.contains("job.toml:2"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn falcon_bench_policies_measures_every_policy_beside_its_references() {
    let dir = tmp("bench-policies");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_falcon"))
        .args(["bench", "policies", "--quick"])
        .current_dir(&dir)
        .output()
        .expect("falcon runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every policy has a row of four worker counts, priced against an atomic.
    for policy in [
        "bsp",
        "asp",
        "ssp(3)",
        "dssp(2,8)",
        "syncopt(1)",
        "syncopt(auto)",
        "epsp(4)",
        "flexrr",
        "elasticbsp(15)",
        "elasticbsp-sim(15)",
    ] {
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("| {policy} |")))
            .unwrap_or_else(|| panic!("no row for {policy}:\n{text}"));
        assert_eq!(row.matches('|').count(), 12, "{row}");
    }
    assert!(
        text.contains("×atomic") && text.contains("ZipLine"),
        "{text}"
    );
    // ZipLine beside the paper's six configurations.
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("| 10 |")
                || l.starts_with("| 100 |")
                || l.starts_with("| 1000 |"))
            .count(),
        6,
        "{text}"
    );
    let md = std::fs::read_to_string(dir.join("target/falcon-bench/policies.md")).unwrap();
    assert!(
        text.contains(md.trim()),
        "the file holds the printed tables"
    );
    let json = std::fs::read_to_string(dir.join("target/falcon-bench/policies.json")).unwrap();
    assert_eq!(json.matches("\"ns_per_push\"").count(), 14 * 4, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}
