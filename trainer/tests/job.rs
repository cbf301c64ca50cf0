//! Whole training jobs on an embedded local cluster (real transport, one thread per worker):
//! they learn, and every task of every iteration is processed exactly once whoever takes it.

use std::sync::Arc;

use falcon_engine::sync::PolicySpec;
use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::job::{JobReport, JobSpec, run_local};
use falcon_trainer::model::ModelSpec;
use falcon_trainer::train::TrainConfig;

fn small(policy: &str, workers: u32, iters: u64, tasks: u32, hetero: Vec<Hetero>) -> JobSpec {
    JobSpec {
        workers,
        servers: 2,
        policy: policy.parse::<PolicySpec>().unwrap(),
        model: ModelSpec::Mlp {
            sizes: vec![784, 32, 10],
        },
        device: falcon_trainer::device::Device::Cpu,
        train: TrainConfig {
            batch: 32,
            tasks,
            iters,
            seed: 3,
            eval_every: 10,
            eval_examples: 300,
            transfer: true,
        },
        lr: 0.1,
        hetero,
        target: 0.5,
        ..JobSpec::default()
    }
}

fn data() -> Arc<Dataset> {
    Arc::new(Dataset::bundled().expect("the bundled sample ships with the repository"))
}

/// Tasks processed = tasks there were; what stragglers gave away is what helpers took and
/// what the scheduler relayed.
fn check_exactly_once(r: &JobReport, spec: &JobSpec) {
    let total = u64::from(spec.workers) * spec.train.iters * u64::from(spec.train.tasks);
    let own: u64 = r.per_worker.iter().map(|w| w.tasks_own).sum();
    let given: u64 = r.per_worker.iter().map(|w| w.tasks_given).sum();
    let helped: u64 = r.per_worker.iter().map(|w| w.tasks_helped).sum();
    assert_eq!(own + helped, total, "every task processed once: {r:#?}");
    assert_eq!(given, helped, "what was given away was taken");
    assert_eq!(helped, r.tasks_transferred, "and relayed by the scheduler");
    assert!(
        r.per_worker
            .iter()
            .all(|w| w.iterations == spec.train.iters)
    );
}

#[test]
fn a_small_job_learns_on_the_bundled_sample() {
    let spec = small("bsp", 2, 40, 2, Vec::new());
    let r = run_local(&spec, &data(), |_| {}).unwrap();
    assert!(
        r.final_accuracy > 0.55,
        "random guessing is 10%; got {:.1}%",
        100.0 * r.final_accuracy
    );
    assert!(!r.curve.is_empty() && r.curve.iter().all(|p| p.accuracy.is_finite()));
    assert!(r.data.contains("bundled"), "{}", r.data);
    check_exactly_once(&r, &spec);
    // BSP never transfers.
    assert_eq!(r.tasks_transferred, 0);
}

#[test]
fn every_task_is_processed_exactly_once_under_random_timings() {
    // A persistent straggler, a noisy worker and episodes: pioneers block and take tasks.
    // Which tasks move depends on timing; that every task is done once must not. The
    // straggler keeps one thread (parallelism control off) so its queue stays long.
    // Whether a pioneer blocks while the straggler still has tasks queued is timing too: on a
    // host loaded to the point that nobody blocks, more rounds run (every one checked) until
    // one moves a task.
    let mut moved = 0;
    // epsp(0) is enforced EPSP: synchronous steps, the helpers' parts joining them.
    let policies = ["epsp(0)", "epsp(3)", "epsp(2,fixed)", "flexrr(1)"];
    for (round, policy) in policies.iter().cycle().enumerate().take(12) {
        if round >= 4 && moved > 0 {
            break;
        }
        let seed = round as u64 + 1;
        let hetero = vec![
            Hetero::None,
            Hetero::parse("gauss(1,1)").unwrap(),
            Hetero::parse("episodes(4,2,3)").unwrap(),
            Hetero::parse("h=0.1").unwrap(),
        ];
        let mut spec = small(policy, 4, 30, 8, hetero);
        spec.train.seed = seed;
        spec.elastic = false;
        let r = run_local(&spec, &data(), |_| {}).unwrap();
        check_exactly_once(&r, &spec);
        moved += r.tasks_transferred;
    }
    assert!(
        moved > 0,
        "blocked pioneers never took a task of the straggler"
    );
}

#[test]
fn without_transfer_nobody_takes_tasks() {
    let mut spec = small(
        "epsp(3)",
        3,
        12,
        4,
        vec![Hetero::None, Hetero::None, Hetero::parse("h=0.3").unwrap()],
    );
    spec.train.transfer = false;
    let r = run_local(&spec, &data(), |_| {}).unwrap();
    check_exactly_once(&r, &spec);
    assert_eq!(r.tasks_transferred, 0);
}

#[test]
fn bad_job_configurations_are_typed_errors() {
    let mut spec = small("bsp", 1, 2, 4, Vec::new());
    spec.train.batch = 2; // fewer examples than tasks
    let e = run_local(&spec, &data(), |_| {}).unwrap_err();
    assert!(e.to_string().contains("tasks"), "{e}");
    let mut spec = small("bsp", 1, 2, 1, Vec::new());
    spec.model = ModelSpec::Mlp {
        sizes: vec![100, 10],
    };
    let e = run_local(&spec, &data(), |_| {}).unwrap_err();
    assert!(e.to_string().contains("inputs"), "{e}");
}

#[test]
fn the_supervisor_gives_the_persistent_straggler_threads_and_only_it() {
    let hetero = vec![Hetero::None, Hetero::None, Hetero::parse("h=0.25").unwrap()];
    let mut spec = small("epsp(3)", 3, 30, 4, hetero.clone());
    spec.budget = 2;
    let r = run_local(&spec, &data(), |_| {}).unwrap();
    check_exactly_once(&r, &spec);
    assert!(r.parallelism_plans > 0);
    assert!(
        r.per_worker[2].threads.contains(&2),
        "the straggler never got a second thread: {:?}",
        r.per_worker[2].threads
    );
    assert!(
        r.per_worker[..2]
            .iter()
            .all(|w| w.threads.iter().all(|&t| t == 1)),
        "pioneers keep one thread"
    );
    assert_eq!(
        r.classes.get(2).map(String::as_str),
        Some("persistent"),
        "{:?}",
        r.classes
    );
    // Switched off: nobody's count changes.
    let mut off = small("epsp(3)", 3, 12, 4, hetero);
    off.budget = 2;
    off.elastic = false;
    let r = run_local(&off, &data(), |_| {}).unwrap();
    assert_eq!(r.parallelism_plans, 0);
    assert!(
        r.per_worker
            .iter()
            .all(|w| w.threads.iter().all(|&t| t == 1))
    );
}

#[test]
fn per_iteration_metrics_are_json_lines() {
    let path = std::env::temp_dir().join(format!("falcon-metrics-{}.jsonl", std::process::id()));
    let mut spec = small("ssp(1)", 2, 8, 2, Vec::new());
    spec.metrics = Some(path.clone());
    run_local(&spec, &data(), |_| {}).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 2 * 8, "{text}");
    for l in &lines {
        for key in [
            "t",
            "worker",
            "iteration",
            "compute_s",
            "blocked_s",
            "threads",
            "tasks_own",
            "bytes",
            "staleness",
        ] {
            assert!(l.get(key).is_some(), "{key} missing in {l}");
        }
    }
    // Each line's bytes are one push and one pull of the whole model (not a count of acks).
    let model = spec.model.build().unwrap().num_params() as u64;
    for l in &lines {
        assert_eq!(l["bytes"].as_u64(), Some(2 * 4 * model), "{l}");
    }
    // Acknowledged pushes report their staleness (SSP applies gradients asynchronously).
    assert!(
        lines.iter().any(|l| l["staleness"].as_f64().is_some()),
        "{text}"
    );
    for w in 0..2u64 {
        let iters: Vec<u64> = lines
            .iter()
            .filter(|l| l["worker"] == w)
            .map(|l| l["iteration"].as_u64().unwrap())
            .collect();
        assert_eq!(iters, (0..8).collect::<Vec<_>>());
    }
}
