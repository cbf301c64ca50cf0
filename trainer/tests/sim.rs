//! The deterministic simulator: same spec, same bits; the real policies behave as they must.

use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::sim::{SimSpec, simulate};

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
