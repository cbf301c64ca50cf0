//! Heterogeneity injection: delay formulas, parsing, serde, contention threads.
//!
//! Tests take `SERIAL` so the CPU-usage test measures this process alone.

use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use falcon_trainer::Error;
use falcon_trainer::hetero::{Contention, Hetero, Injector};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's user + system CPU time, from `/proc/self/stat` (clock ticks at the Linux
/// USER_HZ of 100).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// How many of this process's threads are named `falcon-burn-*`.
fn contention_threads_alive() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("falcon-burn-"))
        .count()
}

/// Waits (up to 2 s) until `n` contention threads have named themselves: a new thread sets
/// its own name as it starts.
fn await_contention_threads(n: usize) -> usize {
    let t = Instant::now();
    while contention_threads_alive() != n && t.elapsed() < Duration::from_secs(2) {
        thread::sleep(MS);
    }
    contention_threads_alive()
}

const MS: Duration = Duration::from_millis(1);

// ---- delay formulas -------------------------------------------------------------------------

#[test]
fn ratio_sleeps_one_over_h_minus_one_times_compute() {
    let _s = serial();
    let h = Hetero::Ratio { h: 0.25 };
    assert_eq!(h.delay(1, 0, 100 * MS), 300 * MS);
    assert_eq!(h.delay(1, 99, 10 * MS), 30 * MS);
    assert_eq!(Hetero::Ratio { h: 0.5 }.delay(0, 0, 40 * MS), 40 * MS);
    assert_eq!(
        Hetero::Ratio { h: 1.0 }.delay(0, 0, 40 * MS),
        Duration::ZERO
    );
}

#[test]
fn episodes_slow_the_first_length_iterations_of_every_period() {
    let _s = serial();
    let h = Hetero::Episodes {
        every: 10,
        length: 3,
        slowdown: 4.0,
    };
    let d = 20 * MS;
    for k in 0..40u64 {
        let want = if k % 10 < 3 { 60 * MS } else { Duration::ZERO };
        assert_eq!(h.delay(7, k, d), want, "iteration {k}");
    }
    let always = Hetero::Episodes {
        every: 2,
        length: 2,
        slowdown: 1.5,
    };
    assert_eq!(always.delay(0, 5, d), 10 * MS);
}

#[test]
fn gaussian_is_seeded_clamped_and_has_its_moments() {
    let _s = serial();
    let g = Hetero::Gaussian {
        mean_ms: 5.0,
        std_ms: 2.0,
    };
    // Pure in (seed, iteration), whatever is asked in between.
    let first: Vec<Duration> = (0..50).map(|k| g.delay(42, k, MS)).collect();
    let again: Vec<Duration> = (0..50).rev().map(|k| g.delay(42, k, MS)).collect();
    assert_eq!(first, again.into_iter().rev().collect::<Vec<_>>());
    let other: Vec<Duration> = (0..50).map(|k| g.delay(43, k, MS)).collect();
    assert_ne!(first, other, "another seed, another sequence");
    assert!(
        first.windows(2).any(|w| w[0] != w[1]),
        "it varies by iteration"
    );
    // Independent of the compute time.
    assert_eq!(g.delay(42, 3, MS), g.delay(42, 3, 500 * MS));

    let n = 20_000;
    let xs: Vec<f64> = (0..n)
        .map(|k| g.delay(9, k, MS).as_secs_f64() * 1e3)
        .collect();
    let mean = xs.iter().sum::<f64>() / n as f64;
    let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    assert!((mean - 5.0).abs() < 0.1, "mean {mean}");
    assert!((sd - 2.0).abs() < 0.1, "sd {sd}");
    assert!(xs.iter().all(|&x| x >= 0.0));

    // σ = 0 gives exactly μ, and a negative μ clamps at 0.
    let fixed = Hetero::Gaussian {
        mean_ms: 5.0,
        std_ms: 0.0,
    };
    assert_eq!(fixed.delay(1, 1, MS), 5 * MS);
    let negative = Hetero::Gaussian {
        mean_ms: -10.0,
        std_ms: 1.0,
    };
    assert!((0..100).all(|k| negative.delay(1, k, MS) == Duration::ZERO));
}

#[test]
fn none_and_contention_add_no_sleep() {
    let _s = serial();
    assert_eq!(Hetero::None.delay(1, 1, 50 * MS), Duration::ZERO);
    assert_eq!(
        Hetero::Contention { threads: 2 }.delay(1, 1, 50 * MS),
        Duration::ZERO
    );
    assert_eq!(Hetero::default(), Hetero::None);
}

#[test]
fn injector_delays_match_the_spec_and_after_iteration_sleeps_them() {
    let _s = serial();
    let spec = Hetero::Gaussian {
        mean_ms: 3.0,
        std_ms: 1.0,
    };
    let inj = Injector::new(spec.clone(), 11).unwrap();
    assert_eq!(inj.spec(), &spec);
    assert_eq!(inj.contention_threads(), 0);
    for k in 0..5 {
        assert_eq!(inj.delay(k, MS), spec.delay(11, k, MS));
    }
    let inj = Injector::new(Hetero::Ratio { h: 0.5 }, 0).unwrap();
    let t = Instant::now();
    let slept = inj.after_iteration(3, 15 * MS);
    assert_eq!(slept, 15 * MS);
    assert!(t.elapsed() >= slept, "sleep lasts at least the delay");
    assert_eq!(
        Injector::new(Hetero::None, 0)
            .unwrap()
            .after_iteration(0, MS),
        Duration::ZERO
    );
}

// ---- parsing and serde ----------------------------------------------------------------------

#[test]
fn parse_accepts_the_documented_forms() {
    let _s = serial();
    let cases = [
        ("none", Hetero::None),
        ("h=0.25", Hetero::Ratio { h: 0.25 }),
        ("H = 1", Hetero::Ratio { h: 1.0 }),
        ("ratio(0.5)", Hetero::Ratio { h: 0.5 }),
        (
            "gauss(5,2)",
            Hetero::Gaussian {
                mean_ms: 5.0,
                std_ms: 2.0,
            },
        ),
        (
            "Gaussian( 5.5 , 0 )",
            Hetero::Gaussian {
                mean_ms: 5.5,
                std_ms: 0.0,
            },
        ),
        (
            "episodes(10,3,4)",
            Hetero::Episodes {
                every: 10,
                length: 3,
                slowdown: 4.0,
            },
        ),
        ("contention(2)", Hetero::Contention { threads: 2 }),
    ];
    for (text, want) in cases {
        assert_eq!(Hetero::parse(text).unwrap(), want, "{text}");
        assert_eq!(text.parse::<Hetero>().unwrap(), want, "{text}");
    }
}

#[test]
fn display_round_trips_through_parse() {
    let _s = serial();
    let specs = [
        Hetero::None,
        Hetero::Ratio { h: 0.25 },
        Hetero::Ratio { h: 1.0 / 3.0 },
        Hetero::Gaussian {
            mean_ms: 5.0,
            std_ms: 2.0,
        },
        Hetero::Gaussian {
            mean_ms: -0.1,
            std_ms: 1e-9,
        },
        Hetero::Episodes {
            every: 10,
            length: 3,
            slowdown: 4.0,
        },
        Hetero::Episodes {
            every: 7,
            length: 0,
            slowdown: 1.25,
        },
        Hetero::Contention { threads: 2 },
    ];
    for spec in specs {
        let text = spec.to_string();
        assert_eq!(Hetero::parse(&text).unwrap(), spec, "{text}");
    }
    assert_eq!(Hetero::Ratio { h: 0.25 }.to_string(), "h=0.25");
    assert_eq!(
        Hetero::Gaussian {
            mean_ms: 5.0,
            std_ms: 2.0
        }
        .to_string(),
        "gauss(5,2)"
    );
    assert_eq!(
        Hetero::Episodes {
            every: 10,
            length: 3,
            slowdown: 4.0
        }
        .to_string(),
        "episodes(10,3,4)"
    );
    assert_eq!(
        Hetero::Contention { threads: 2 }.to_string(),
        "contention(2)"
    );
}

#[test]
fn bad_strings_are_config_errors_naming_the_accepted_forms() {
    let _s = serial();
    for bad in [
        "",
        "fast",
        "h=",
        "h=0",
        "h=-0.5",
        "h=1.5",
        "h=abc",
        "h=nan",
        "h=inf",
        "gauss(5)",
        "gauss(5,2,1)",
        "gauss(5,-1)",
        "gauss(inf,1)",
        "episodes(0,1,2)",
        "episodes(3,4,2)",
        "episodes(10,3,0.5)",
        "episodes(10,-3,2)",
        "episodes(10,3)",
        "contention(0)",
        "contention(-1)",
        "contention(1.5)",
        "contention(100000)",
        "contention(2",
        "slow(2)",
    ] {
        match Hetero::parse(bad) {
            Err(Error::Config(msg)) => {
                assert!(msg.contains("accepted forms"), "{bad:?}: {msg}");
                assert!(msg.contains("episodes(EVERY,LENGTH,SLOWDOWN)"), "{msg}");
            }
            other => panic!("{bad:?} gave {other:?}"),
        }
    }
}

#[test]
fn serde_uses_the_string_form_and_accepts_tables() {
    let _s = serial();
    let spec = Hetero::Episodes {
        every: 10,
        length: 3,
        slowdown: 4.0,
    };
    let json = serde_json::to_string(&spec).unwrap();
    assert_eq!(json, r#""episodes(10,3,4)""#);
    assert_eq!(serde_json::from_str::<Hetero>(&json).unwrap(), spec);

    let tables = [
        (r#"{"kind":"none"}"#, Hetero::None),
        (r#"{"kind":"ratio","h":0.5}"#, Hetero::Ratio { h: 0.5 }),
        (
            r#"{"kind":"gaussian","mean_ms":5,"std_ms":2}"#,
            Hetero::Gaussian {
                mean_ms: 5.0,
                std_ms: 2.0,
            },
        ),
        (
            r#"{"kind":"episodes","every":10,"length":3,"slowdown":4}"#,
            spec.clone(),
        ),
        (
            r#"{"kind":"contention","threads":2}"#,
            Hetero::Contention { threads: 2 },
        ),
    ];
    for (text, want) in tables {
        assert_eq!(
            serde_json::from_str::<Hetero>(text).unwrap(),
            want,
            "{text}"
        );
    }
    for bad in [
        r#""h=2""#,
        r#"{"kind":"ratio","h":2}"#,
        r#"{"kind":"ratio","h":0.5,"extra":1}"#,
        r#"{"kind":"warp","h":0.5}"#,
        "3",
    ] {
        assert!(serde_json::from_str::<Hetero>(bad).is_err(), "{bad}");
    }
}

// ---- contention -----------------------------------------------------------------------------

#[test]
fn contention_burns_cpu_and_stops_on_drop() {
    let _s = serial();
    assert_eq!(contention_threads_alive(), 0);
    let inj = Injector::new(Hetero::Contention { threads: 1 }, 0).unwrap();
    assert_eq!(inj.contention_threads(), 1);
    assert_eq!(await_contention_threads(1), 1);
    assert_eq!(inj.after_iteration(0, 10 * MS), Duration::ZERO);

    // One burning thread accumulates 100 ms of CPU in about 100–200 ms; allow up to 3 s on
    // a loaded machine.
    let before = process_cpu();
    let t = Instant::now();
    while process_cpu() - before < 100 * MS && t.elapsed() < Duration::from_secs(3) {
        thread::sleep(20 * MS);
    }
    let burned = process_cpu() - before;
    assert!(
        burned >= 100 * MS,
        "1 contention thread used {burned:?} of CPU in {:?}",
        t.elapsed()
    );

    drop(inj);
    assert_eq!(contention_threads_alive(), 0, "dropped threads are joined");
    let before = process_cpu();
    thread::sleep(200 * MS);
    let after = process_cpu() - before;
    assert!(after < 50 * MS, "{after:?} of CPU after the drop");

    let c = Contention::start(3).unwrap();
    assert_eq!(c.threads(), 3);
    assert_eq!(await_contention_threads(3), 3);
    drop(c);
    assert_eq!(contention_threads_alive(), 0);
}
