//! The deterministic simulator: same spec, same bits; the real policies behave as they must.

use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::sim::{SimSpec, simulate, simulate_all};

fn spec(policy: &str, workers: u32, iters: u64) -> SimSpec {
    let mut hetero = vec![Hetero::None; workers as usize];
    hetero[workers as usize - 1] = Hetero::parse("h=0.25").unwrap();
    SimSpec {
        workers,
        iters,
        policy: policy.parse().unwrap(),
        batch: 8,
        hetero,
        eval_every: 5,
        eval_examples: 200,
        ..SimSpec::default()
    }
}

fn data() -> Dataset {
    Dataset::bundled().expect("the bundled sample ships with the repository")
}

#[test]
fn the_same_spec_gives_the_same_bits() {
    let d = data();
    for policy in [
        "bsp",
        "asp",
        "ssp(2)",
        "dssp(1,4)",
        "epsp",
        "fluentps(2,sigmoid)",
        "syncopt(1)",
        "syncopt(auto,fold)",
        "elasticbsp(4)",
    ] {
        let a = simulate(&spec(policy, 6, 30), &d).unwrap();
        let b = simulate(&spec(policy, 6, 30), &d).unwrap();
        assert_eq!(a.digest, b.digest, "{policy}");
        assert_eq!(
            a.virtual_secs.to_bits(),
            b.virtual_secs.to_bits(),
            "{policy}"
        );
        assert_eq!(a.parked_pulls, b.parked_pulls, "{policy}");
        let curve = |r: &falcon_trainer::sim::SimReport| -> Vec<u64> {
            r.curve.iter().map(|e| e.accuracy.to_bits()).collect()
        };
        assert_eq!(curve(&a), curve(&b), "{policy}");
        let mut other = spec(policy, 6, 30);
        other.seed = 2;
        assert_ne!(
            simulate(&other, &d).unwrap().digest,
            a.digest,
            "{policy}: the seed must matter"
        );
    }
}

#[test]
fn policies_behave_in_virtual_time() {
    let d = data();
    let bsp = simulate(&spec("bsp", 4, 40), &d).unwrap();
    let asp = simulate(&spec("asp", 4, 40), &d).unwrap();
    let syncopt = simulate(&spec("syncopt(1)", 4, 40), &d).unwrap();
    // ASP never waits; BSP's fast workers wait for the straggler at every iteration.
    assert_eq!(asp.parked_pulls, 0);
    assert!(asp.blocked_secs.iter().all(|&b| b == 0.0));
    assert!(
        bsp.blocked_secs[0] > 0.5 * bsp.virtual_secs,
        "{:?}",
        bsp.blocked_secs
    );
    // Sync-opt with one backup: the straggler's late gradients are dropped (nearly all of its
    // 40 while the others run), and the fast workers do not wait for it.
    assert!((30..=80).contains(&syncopt.dropped), "{syncopt:?}");
    assert_eq!(syncopt.updates, 40);
    assert!(syncopt.blocked_secs[0] < bsp.blocked_secs[0]);
    // Every policy applies an update per gradient (async) or per clock (sync).
    assert_eq!(asp.updates, 4 * 40);
    assert_eq!(bsp.updates, 40);
    // The model learns.
    assert!(asp.final_accuracy > 0.5, "{}", asp.final_accuracy);
}

/// Folding keeps what Sync-opt drops: on the same run, `syncopt(1,fold)` drops nothing and
/// folds as many gradients as `syncopt(1)` drops, at the same pace (the same steps, released
/// at the same times), and the straggler's work changes the model.
#[test]
fn folding_keeps_the_gradients_sync_opt_drops_at_its_pace() {
    let d = data();
    let plain = simulate(&spec("syncopt(1)", 4, 40), &d).unwrap();
    let fold = simulate(&spec("syncopt(1,fold)", 4, 40), &d).unwrap();
    assert!(plain.dropped >= 30, "{plain:?}");
    assert_eq!((fold.dropped, fold.folded), (0, plain.dropped));
    assert_eq!(plain.folded, 0);
    assert_eq!(fold.parked_pulls, plain.parked_pulls);
    assert_eq!(fold.virtual_secs.to_bits(), plain.virtual_secs.to_bits());
    // The folded gradients make the step after them: one more at the job's end.
    assert_eq!(fold.updates, plain.updates + 1);
    assert_ne!(
        fold.digest, plain.digest,
        "the folded work reaches the model"
    );
}

#[test]
fn bad_specs_are_typed_errors() {
    let d = data();
    let mut s = spec("bsp", 2, 5);
    s.batch = 100_000;
    assert!(simulate(&s, &d).unwrap_err().to_string().contains("batch"));
    let mut s = spec("bsp", 2, 5);
    s.jitter = 1.5;
    assert!(simulate(&s, &d).unwrap_err().to_string().contains("jitter"));
    let mut s = spec("bsp", 2, 5);
    s.model = "mlp:100-10".parse().unwrap();
    assert!(simulate(&s, &d).unwrap_err().to_string().contains("inputs"));
}

#[test]
fn one_shuffle_per_epoch_cut_into_shares_is_every_worker_s_order() {
    // The simulator shuffles once per epoch and cuts the workers' shares itself.
    let d = data();
    for (workers, epoch) in [(3u32, 0u64), (7, 5), (1024, 2)] {
        let full = d.train.batch_indices(0, 1, epoch, 9);
        for w in [0, workers / 2, workers - 1] {
            let n = full.len() as u128;
            let lo = (n * u128::from(w) / u128::from(workers)) as usize;
            let hi = (n * u128::from(w + 1) / u128::from(workers)) as usize;
            assert_eq!(d.train.batch_indices(w, workers, epoch, 9), full[lo..hi]);
        }
    }
}

/// The model's bytes pay the bandwidth on the worker's link and, one message after another,
/// at the servers. BSP, 4 workers, no jitter, no latency, a link that moves the whole model in
/// 1 ms, one server, no apply cost: the answers of a round reach the workers 1, 2, 3, 4 ms
/// after the release, each computes 10 ms, and the pushes are applied one after another, the
/// last 15 ms after the round's release. Unlimited, a round is the 10 ms of compute.
#[test]
fn bandwidth_and_the_servers_queue_cost_time_exactly() {
    let d = data();
    let mut s = SimSpec {
        workers: 4,
        iters: 6,
        policy: "bsp".parse().unwrap(),
        jitter: 0.0,
        latency_ns: 0,
        servers: 1,
        apply_ns_per_float: Some(0.0),
        compute: false,
        base_ns: 10_000_000,
        ..SimSpec::default()
    };
    let bytes = 4.0 * 7850.0; // mlp:784-10
    s.bandwidth = bytes / 1e-3;
    let r = simulate(&s, &d).unwrap();
    assert!(
        (r.virtual_secs - 6.0 * 0.015).abs() < 1e-6,
        "{} virtual s",
        r.virtual_secs
    );
    // Each round the servers receive 4 models and send 4: 8 ms busy.
    assert!(
        (r.server_busy_secs - 6.0 * 0.008).abs() < 1e-6,
        "{}",
        r.server_busy_secs
    );
    s.bandwidth = 0.0;
    let free = simulate(&s, &d).unwrap();
    assert!(
        (free.virtual_secs - 0.06).abs() < 1e-6,
        "{}",
        free.virtual_secs
    );
    // Two servers halve the servers' side: a push or an answer costs 0.5 ms there, but the
    // worker's link still takes 1 ms for the whole model.
    s.bandwidth = bytes / 1e-3;
    s.servers = 2;
    let two = simulate(&s, &d).unwrap();
    assert!(two.virtual_secs < r.virtual_secs, "{}", two.virtual_secs);
    // The apply cost counts on the servers' side: 1 µs per float = 7.85 ms per push.
    s.servers = 1;
    s.apply_ns_per_float = Some(1000.0);
    let slow = simulate(&s, &d).unwrap();
    assert!(
        slow.virtual_secs > r.virtual_secs + 6.0 * 0.025,
        "{}",
        slow.virtual_secs
    );
}

/// The curve is the global model's at regular intervals of virtual time, plus one point when
/// the last push is applied; the time to target is its first crossing.
#[test]
fn the_global_model_is_evaluated_at_regular_virtual_times() {
    let d = data();
    let s = SimSpec {
        eval_every: 4,
        target: 0.3,
        ..spec("asp", 4, 40)
    };
    let r = simulate(&s, &d).unwrap();
    let every = 4.0 * s.base_ns as f64 / 1e9;
    let (last, regular) = r.curve.split_last().unwrap();
    assert!(regular.len() > 1);
    assert_eq!(regular[0].iteration, 0, "the initial model first");
    for (k, e) in regular.iter().enumerate() {
        assert!(
            (e.secs - every * k as f64).abs() < 1e-9,
            "point {k} at {} s",
            e.secs
        );
    }
    assert!((last.secs - r.virtual_secs).abs() < 1e-9);
    assert_eq!(last.iteration, 40, "pushes applied per worker at the end");
    let first = r.curve.iter().find(|e| e.accuracy >= 0.3).map(|e| e.secs);
    assert_eq!(r.time_to_target, first);
    assert!(!r.diverged);
}

/// A learning rate far too large diverges, and the report says so.
#[test]
fn a_diverging_run_is_reported_as_diverged() {
    let d = data();
    let model: falcon_trainer::model::ModelSpec = "mlp:784-32-10".parse().unwrap();
    let s = SimSpec {
        lr: 50.0,
        model: model.clone(),
        ..spec("asp", 4, 30)
    };
    let r = simulate(&s, &d).unwrap();
    assert!(
        r.diverged,
        "accuracy {} at lr 50, curve {:?}",
        r.final_accuracy, r.curve
    );
    let calm = SimSpec {
        model,
        ..spec("asp", 4, 30)
    };
    assert!(!simulate(&calm, &d).unwrap().diverged);
}

/// Fixed partitions: IID shares are disjoint and cover the split; label-skewed shares hold few
/// classes each; the partition changes what is learned, deterministically.
#[test]
fn partitions_are_fixed_disjoint_and_skewed_as_asked() {
    use falcon_trainer::data::Partition;
    let d = data();
    let train = &d.train;
    for p in [Partition::Iid, Partition::Skewed] {
        let mut all: Vec<usize> = (0..5).flat_map(|w| train.partition(p, w, 5, 1)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..train.len()).collect::<Vec<_>>(), "{p}");
    }
    let classes = |w| {
        let mut c: Vec<u8> = train
            .partition(Partition::Skewed, w, 10, 1)
            .iter()
            .map(|&i| train.label(i))
            .collect();
        c.sort_unstable();
        c.dedup();
        c.len()
    };
    for w in 0..10 {
        assert!(classes(w) <= 3, "worker {w} sees {} classes", classes(w));
    }
    let iid: std::collections::HashSet<u8> = train
        .partition(Partition::Iid, 0, 10, 1)
        .iter()
        .map(|&i| train.label(i))
        .collect();
    assert!(iid.len() >= 8, "an IID share sees most classes");
    let run = |p| {
        simulate(
            &SimSpec {
                partition: p,
                ..spec("asp", 4, 20)
            },
            &d,
        )
        .unwrap()
    };
    let (a, b) = (run(Partition::Iid), run(Partition::Skewed));
    assert_ne!(a.digest, b.digest);
    assert_eq!(a.digest, run(Partition::Iid).digest);
    assert_eq!(
        (a.partition.as_str(), b.partition.as_str()),
        ("iid", "skewed")
    );
}

/// Simulations run side by side on threads give each spec's own report, handed back in the
/// order of the specs, and an error in one is that spec's.
#[test]
fn simulations_side_by_side_give_each_specs_own_report_in_order() {
    let d = data();
    let mut specs: Vec<SimSpec> = ["bsp", "epsp", "asp", "ssp(2)", "syncopt(1)"]
        .iter()
        .map(|p| spec(p, 6, 20))
        .collect();
    specs[3].tasks = 0;
    let mut got = Vec::new();
    simulate_all(&specs, &d, 3, |i, r| got.push((i, r)));
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    for (i, r) in got {
        match simulate(&specs[i], &d) {
            Ok(alone) => assert_eq!(r.unwrap().digest, alone.digest, "spec {i}"),
            Err(e) => assert_eq!(r.unwrap_err().to_string(), e.to_string(), "spec {i}"),
        }
    }
}
