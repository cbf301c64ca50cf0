//! Task transfer in the simulator: EPSP's offers move a straggler's unstarted tasks to idle
//! pioneers, the job finishes sooner, every task is computed once, and runs stay
//! reproducible.

use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::Hetero;
use falcon_trainer::sim::{SimReport, SimSpec, simulate};

/// `workers` workers, the last a persistent straggler at a quarter speed; timing only.
fn spec(policy: &str, workers: u32, iters: u64) -> SimSpec {
    let mut hetero = vec![Hetero::None; workers as usize];
    hetero[workers as usize - 1] = Hetero::parse("h=0.25").unwrap();
    SimSpec {
        workers,
        iters,
        policy: policy.parse().unwrap(),
        batch: 8,
        hetero,
        eval_every: 0,
        compute: false,
        ..SimSpec::default()
    }
}

fn data() -> Dataset {
    Dataset::bundled().expect("the bundled sample ships with the repository")
}

fn total_tasks(s: &SimSpec) -> u64 {
    u64::from(s.workers) * s.iters * u64::from(s.tasks)
}

#[test]
fn transfer_moves_tasks_and_finishes_sooner() {
    let d = data();
    let on = spec("epsp(3)", 4, 40);
    assert!(on.transfer && on.tasks == 4, "the defaults");
    let mut off = on.clone();
    off.transfer = false;
    let with = simulate(&on, &d).unwrap();
    let without = simulate(&off, &d).unwrap();

    assert!(with.transfers_offered > 0, "{with:?}");
    assert!(with.tasks_transferred > 0, "{with:?}");
    assert!(with.transfers_taken > 0 && with.transfers_taken <= with.transfers_offered);
    assert!(with.tasks_transferred >= with.transfers_taken);
    // Off: the offers are still made, nothing moves.
    assert!(without.transfers_offered > 0, "{without:?}");
    assert_eq!(without.tasks_transferred, 0);
    assert_eq!(without.transfers_taken, 0);
    eprintln!(
        "epsp(3): {} s with transfer ({} of {} offers moved {} tasks; per worker {:?}), {} s \
         without",
        with.virtual_secs,
        with.transfers_taken,
        with.transfers_offered,
        with.tasks_transferred,
        with.tasks_computed,
        without.virtual_secs
    );
    assert!(
        with.virtual_secs < without.virtual_secs,
        "transfer on: {} s, off: {} s",
        with.virtual_secs,
        without.virtual_secs
    );
    // The straggler computed fewer than its own tasks; the pioneers did its share.
    let own = on.iters * u64::from(on.tasks);
    assert!(with.tasks_computed[3] < own, "{:?}", with.tasks_computed);
    assert_eq!(
        with.tasks_computed[..3].iter().sum::<u64>(),
        3 * own + with.tasks_transferred
    );
    assert_eq!(without.tasks_computed, vec![own; 4]);
}

#[test]
fn policies_without_transfer_move_nothing() {
    let d = data();
    for policy in ["epsp(3,no-transfer)", "bsp", "asp", "ssp(2)"] {
        let s = spec(policy, 4, 30);
        let r = simulate(&s, &d).unwrap();
        assert_eq!(r.transfers_offered, 0, "{policy}");
        assert_eq!(r.tasks_transferred, 0, "{policy}");
        assert_eq!(r.tasks_computed, vec![s.iters * 4; 4], "{policy}");
    }
}

#[test]
fn every_task_is_computed_once() {
    let d = data();
    for (policy, tasks, workers) in [
        ("epsp(3)", 4, 4),
        ("epsp(3)", 1, 4),
        ("epsp(2)", 7, 5),
        ("epsp(0,fixed)", 16, 3),
        ("flexrr(1)", 8, 4),
        ("flexrr(0,theta=1,group=2)", 5, 6),
    ] {
        let mut s = spec(policy, workers, 25);
        s.tasks = tasks;
        let r = simulate(&s, &d).unwrap();
        assert_eq!(
            r.tasks_computed.iter().sum::<u64>(),
            total_tasks(&s),
            "{policy} with {tasks} tasks: {:?}",
            r.tasks_computed
        );
        if tasks == 1 {
            // Nothing unstarted once an iteration begins.
            assert_eq!(r.tasks_transferred, 0, "{policy}");
        }
        // A worker computes at most its own tasks plus those it took.
        assert!(r.tasks_transferred <= total_tasks(&s), "{policy}");
    }
}

#[test]
fn flexrr_offers_are_carried_out_too() {
    let d = data();
    let mut s = spec("flexrr(1)", 4, 40);
    s.tasks = 8;
    let with = simulate(&s, &d).unwrap();
    assert!(with.tasks_transferred > 0, "{with:?}");
    s.transfer = false;
    let without = simulate(&s, &d).unwrap();
    assert_eq!(without.tasks_transferred, 0);
    assert!(with.virtual_secs < without.virtual_secs);
    eprintln!(
        "flexrr(1), 8 tasks: {} s with transfer ({} tasks moved), {} s without",
        with.virtual_secs, with.tasks_transferred, without.virtual_secs
    );
}

#[test]
fn the_same_spec_gives_the_same_report() {
    let d = data();
    let same = |a: &SimReport, b: &SimReport| {
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.virtual_secs.to_bits(), b.virtual_secs.to_bits());
        assert_eq!(a.tasks_transferred, b.tasks_transferred);
        assert_eq!(a.tasks_computed, b.tasks_computed);
        assert_eq!(a.transfers_offered, b.transfers_offered);
        assert_eq!(a.parked_pulls, b.parked_pulls);
        let curve = |r: &SimReport| -> Vec<(u64, u64)> {
            r.curve
                .iter()
                .map(|e| (e.secs.to_bits(), e.accuracy.to_bits()))
                .collect()
        };
        assert_eq!(curve(a), curve(b));
    };
    let timing = spec("epsp(3)", 4, 40);
    let a = simulate(&timing, &d).unwrap();
    let b = simulate(&timing, &d).unwrap();
    assert!(a.tasks_transferred > 0);
    same(&a, &b);

    let mut learning = spec("epsp(3)", 4, 20);
    learning.compute = true;
    learning.eval_every = 5;
    learning.eval_examples = 100;
    let a = simulate(&learning, &d).unwrap();
    let b = simulate(&learning, &d).unwrap();
    assert!(a.tasks_transferred > 0);
    same(&a, &b);
}

#[test]
fn with_transfer_a_small_run_still_learns() {
    let d = data();
    let mut s = spec("epsp(3)", 4, 60);
    s.compute = true;
    s.eval_every = 20;
    s.eval_examples = 200;
    let r = simulate(&s, &d).unwrap();
    assert!(r.tasks_transferred > 0, "{r:?}");
    assert_eq!(r.updates, 4 * 60);
    // Ten classes: chance is 10 %.
    assert!(r.final_accuracy > 0.3, "{}", r.final_accuracy);
}

#[test]
fn zero_tasks_is_a_config_error() {
    let d = data();
    let mut s = spec("epsp(3)", 4, 5);
    s.tasks = 0;
    let err = simulate(&s, &d).unwrap_err();
    assert!(
        matches!(err, falcon_trainer::Error::Config(ref m) if m.contains("task")),
        "{err}"
    );
}

#[test]
fn a_measured_trace_drives_the_simulator_like_its_ratio() {
    // A constant factor 4 is h = 0.25, to the bit; a varying trace is a different run.
    let d = data();
    let dir = std::env::temp_dir();
    let constant = dir.join(format!("falcon-sim-trace-{}-4.txt", std::process::id()));
    let varying = dir.join(format!("falcon-sim-trace-{}-var.txt", std::process::id()));
    std::fs::write(&constant, "# a quarter speed\n4\n").unwrap();
    std::fs::write(&varying, "1\n4\n8\n").unwrap();
    let ratio = spec("epsp(3)", 4, 30);
    let mut traced = ratio.clone();
    traced.hetero[3] = Hetero::parse(&format!("trace({})", constant.display())).unwrap();
    let mut other = ratio.clone();
    other.hetero[3] = Hetero::parse(&format!("trace({})", varying.display())).unwrap();
    let (a, b, c) = (
        simulate(&ratio, &d).unwrap(),
        simulate(&traced, &d).unwrap(),
        simulate(&other, &d).unwrap(),
    );
    let _ = std::fs::remove_file(&constant);
    let _ = std::fs::remove_file(&varying);
    assert_eq!(a.virtual_secs.to_bits(), b.virtual_secs.to_bits());
    assert_eq!(a.tasks_computed, b.tasks_computed);
    assert_ne!(a.virtual_secs.to_bits(), c.virtual_secs.to_bits());
    assert_eq!(c.tasks_computed.iter().sum::<u64>(), total_tasks(&other));
}

/// Enforced EPSP (`epsp(0)`) applies the same steps as BSP — aggregated, same values, same
/// bits — and task transfer makes them come sooner.
#[test]
fn enforced_epsp_is_bsp_arithmetic_in_less_time() {
    let d = data();
    let with_model = |policy: &str| SimSpec {
        compute: true,
        eval_every: 5,
        eval_examples: 200,
        ..spec(policy, 4, 30)
    };
    let bsp = simulate(&with_model("bsp"), &d).unwrap();
    let epsp = simulate(&with_model("epsp(0)"), &d).unwrap();
    assert_eq!(epsp.digest, bsp.digest, "the same steps");
    assert_eq!(epsp.updates, bsp.updates);
    assert!(epsp.tasks_transferred > 0);
    assert!(
        epsp.virtual_secs < 0.8 * bsp.virtual_secs,
        "transfer shortens the straggler's iterations: {} against {} virtual s",
        epsp.virtual_secs,
        bsp.virtual_secs
    );
}

/// The parallelism manager acts in virtual time: the persistent straggler, on a host of 4
/// cores, is given threads and its iterations shorten; the pioneers keep one thread; the job
/// ends sooner; the run stays reproducible.
#[test]
fn the_parallelism_manager_gives_the_straggler_threads_in_virtual_time() {
    let d = data();
    let off = spec("bsp", 4, 60);
    let on = SimSpec {
        host_cores: Some(4),
        ..off.clone()
    };
    let (a, b) = (simulate(&off, &d).unwrap(), simulate(&on, &d).unwrap());
    assert_eq!(a.threads, vec![1; 4]);
    assert_eq!(a.plans, 0);
    assert!(b.plans > 0);
    assert!(b.threads[3] > 1, "the straggler's threads: {:?}", b.threads);
    assert!(b.threads[..3].iter().all(|&t| t == 1), "{:?}", b.threads);
    assert!(
        b.virtual_secs < 0.7 * a.virtual_secs,
        "{} against {} virtual s",
        b.virtual_secs,
        a.virtual_secs
    );
    let again = simulate(&on, &d).unwrap();
    assert_eq!(again.virtual_secs.to_bits(), b.virtual_secs.to_bits());
    assert_eq!(again.threads, b.threads);
}

/// A helper's push pays as any push: its bytes count, and on a slow network the time it
/// takes shrinks what transfer gains.
#[test]
fn a_helpers_push_pays_the_network_and_the_servers() {
    let d = data();
    let on = spec("epsp(0)", 4, 30);
    let bsp = simulate(&spec("bsp", 4, 30), &d).unwrap();
    let epsp = simulate(&on, &d).unwrap();
    assert!(epsp.transfers_taken > 0, "{epsp:?}");
    // Every pull answer and push is the model's bytes; each taken offer is one more push.
    assert_eq!(
        epsp.bytes_moved,
        bsp.bytes_moved + epsp.transfers_taken * bsp.bytes_moved / (2 * 4 * 30)
    );
    // On a network where one push takes a tenth of an iteration, the helpers' pushes cost
    // time: transfer still helps, less than on a free network.
    let floats = bsp.bytes_moved / (2 * 4 * 30) / 4;
    let slow = |policy: &str| {
        let mut s = spec(policy, 4, 30);
        s.bandwidth = (floats * 4) as f64 * 1e9 / (s.base_ns as f64 / 10.0);
        simulate(&s, &d).unwrap()
    };
    let (bsp_slow, epsp_slow) = (slow("bsp"), slow("epsp(0)"));
    let gain_free = bsp.virtual_secs - epsp.virtual_secs;
    let gain_slow = bsp_slow.virtual_secs - epsp_slow.virtual_secs;
    assert!(epsp_slow.transfers_taken > 0);
    assert!(
        gain_slow < gain_free,
        "helpers' pushes cost time on a slow network: gain {gain_slow} s there against \
         {gain_free} s on a free one"
    );
    assert!(epsp_slow.server_busy_secs > bsp_slow.server_busy_secs);
}
