//! The elastic pool, the exactly-once task source and the knee rule.
//!
//! Tests take `SERIAL` so the CPU-usage test measures this process alone.

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use falcon_trainer::Error;
use falcon_trainer::pool::{
    KneePoint, KneeRule, MAX_TASKS, MAX_THREADS, Pool, Stolen, TaskSource, iteration_tag, knee,
    knee_with, measure_knee,
};
use proptest::prelude::*;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// This process's user + system CPU time, from `/proc/self/stat` (clock ticks at the Linux
/// USER_HZ of 100).
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state), so utime (14) and stime (15) are at 11 and 12.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

fn source(iteration: u64, m: usize) -> Arc<TaskSource> {
    let s = TaskSource::new(m).unwrap();
    s.reset(iteration, m).unwrap();
    Arc::new(s)
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

// ---- Pool -----------------------------------------------------------------------------------

#[test]
fn bad_thread_counts_are_config_errors() {
    let _s = serial();
    assert!(matches!(Pool::new(0), Err(Error::Config(_))));
    assert!(matches!(Pool::new(MAX_THREADS + 1), Err(Error::Config(_))));
    let pool = Pool::new(2).unwrap();
    assert!(matches!(pool.resize(0), Err(Error::Config(_))));
    assert_eq!(pool.threads(), 2, "a rejected resize changes nothing");
}

#[test]
fn run_does_every_task_once_and_reports_it() {
    let _s = serial();
    let pool = Pool::new(4).unwrap();
    let hits: Arc<Vec<AtomicUsize>> = Arc::new((0..500).map(|_| AtomicUsize::new(0)).collect());
    let tasks = source(7, 500);
    let h = Arc::clone(&hits);
    let stats = pool.run(&tasks, move |t, slot| {
        assert!(slot < 4);
        h[t].fetch_add(1, Ordering::Relaxed);
    });
    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    assert_eq!(stats.threads, 4);
    assert_eq!(
        stats.tasks.iter().map(|t| t.task).collect::<Vec<_>>(),
        (0..500).collect::<Vec<_>>()
    );
    assert!(stats.tasks.iter().all(|t| t.slot < 4));
    assert_eq!(tasks.remaining(), 0);
    let s = stats.summary();
    assert_eq!(s.count, 500);
    assert!(s.min <= s.mean && s.mean <= s.max);
}

/// `p` tasks that wait on a `Barrier(p)` finish only if `p` slots really run at once.
fn run_with_barrier(pool: &Pool, p: usize) -> BTreeSet<usize> {
    let barrier = Arc::new(Barrier::new(p));
    let tasks = source(0, p);
    let b = Arc::clone(&barrier);
    let stats = pool.run(&tasks, move |_, _| {
        b.wait();
    });
    assert_eq!(stats.threads, p);
    stats.tasks.iter().map(|t| t.slot).collect()
}

#[test]
fn resize_takes_effect_at_the_next_run() {
    let _s = serial();
    let pool = Pool::new(3).unwrap();
    assert_eq!(pool.spawned(), 2);
    assert_eq!(run_with_barrier(&pool, 3), (0..3).collect());

    pool.resize(6).unwrap();
    assert_eq!(pool.threads(), 6);
    assert_eq!(pool.spawned(), 5, "growing an idle pool spawns at once");
    assert_eq!(run_with_barrier(&pool, 6), (0..6).collect());

    pool.resize(2).unwrap();
    assert_eq!(
        pool.spawned(),
        5,
        "shrinking parks, it does not end threads"
    );
    assert_eq!(run_with_barrier(&pool, 2), (0..2).collect());
    let stats = pool.run(&source(1, 100), |_, _| {});
    assert_eq!(stats.threads, 2);
    assert!(stats.tasks.iter().all(|t| t.slot < 2));

    pool.resize(1).unwrap();
    let stats = pool.run(&source(2, 10), |_, _| {});
    assert_eq!(stats.threads, 1);
    assert!(stats.tasks.iter().all(|t| t.slot == 0));
}

#[test]
fn resize_during_a_run_applies_to_the_next() {
    let _s = serial();
    let pool = Arc::new(Pool::new(2).unwrap());
    let started = Arc::new(Barrier::new(2));
    let (p, st) = (Arc::clone(&pool), Arc::clone(&started));
    let resizer = thread::spawn(move || {
        st.wait();
        p.resize(4).unwrap();
    });
    let st = Arc::clone(&started);
    let stats = pool.run(&source(0, 2), move |t, _| {
        if t == 0 {
            st.wait();
            thread::sleep(Duration::from_millis(20));
        }
    });
    resizer.join().unwrap();
    assert_eq!(stats.threads, 2);
    assert_eq!(pool.threads(), 4);
    assert_eq!(run_with_barrier(&pool, 4), (0..4).collect());
    assert_eq!(pool.spawned(), 3);
}

#[test]
fn fewer_tasks_than_threads_wake_fewer_threads() {
    let _s = serial();
    let pool = Pool::new(8).unwrap();
    assert_eq!(pool.run(&source(0, 3), |_, _| {}).threads, 3);
    assert_eq!(pool.run(&source(0, 0), |_, _| {}).threads, 1);
}

#[test]
fn a_panicking_task_is_resumed_and_the_pool_survives() {
    let _s = serial();
    let pool = Pool::new(4).unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let d = Arc::clone(&done);
    let result = catch_unwind(AssertUnwindSafe(|| {
        pool.run(&source(0, 64), move |t, _| {
            if t == 5 {
                panic!("task five fails");
            }
            d.fetch_add(1, Ordering::Relaxed);
        })
    }));
    let payload = result.expect_err("the panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"task five fails"));
    assert_eq!(
        done.load(Ordering::Relaxed),
        63,
        "the other slots finish the rest"
    );
    assert_eq!(run_with_barrier(&pool, 4), (0..4).collect());
}

#[test]
fn run_scoped_borrows_from_the_caller() {
    let _s = serial();
    let pool = Pool::new(3).unwrap();
    let counts: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
    let tasks = TaskSource::new(100).unwrap();
    let stats = pool.run_scoped(&tasks, |t, slot| {
        assert!(slot < 3);
        counts[t].fetch_add(1, Ordering::Relaxed);
    });
    assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    assert_eq!(stats.threads, 3);
    assert_eq!(stats.tasks.len(), 100);
    let barrier = Barrier::new(3);
    tasks.reset(1, 3).unwrap();
    let stats = pool.run_scoped(&tasks, |_, _| {
        barrier.wait();
    });
    let slots: BTreeSet<usize> = stats.tasks.iter().map(|t| t.slot).collect();
    assert_eq!(slots, (0..3).collect());
}

#[test]
fn parked_threads_use_no_cpu() {
    let _s = serial();
    let pool = Pool::new(8).unwrap();
    // Every thread has worked, then the pool shrinks to 1 and runs once at that size.
    assert_eq!(run_with_barrier(&pool, 8), (0..8).collect());
    pool.resize(1).unwrap();
    pool.run(&source(1, 16), |_, _| spin(Duration::from_micros(100)));
    assert_eq!(pool.spawned(), 7);

    let before = process_cpu();
    thread::sleep(Duration::from_millis(300));
    let used = process_cpu() - before;
    assert!(
        used < Duration::from_millis(50),
        "7 parked threads used {used:?} of CPU in 300 ms"
    );
}

#[test]
fn threads_and_thieves_share_a_source_exactly_once() {
    let _s = serial();
    let pool = Pool::new(3).unwrap();
    for (iteration, m) in [(0u64, 1000usize), (1, 1), (2, 57), (3, 4000)] {
        let tasks = source(iteration, m);
        let stolen: Vec<Stolen> = thread::scope(|scope| {
            let thieves: Vec<_> = (0..2)
                .map(|i| {
                    let tasks = Arc::clone(&tasks);
                    scope.spawn(move || {
                        let mut got = Vec::new();
                        while let Some(s) = tasks.steal(3 + i) {
                            got.push(s);
                            thread::yield_now();
                        }
                        got
                    })
                })
                .collect();
            let stats = pool.run(&tasks, |_, _| spin(Duration::from_micros(5)));
            let mut all: Vec<usize> = stats.tasks.iter().map(|t| t.task).collect();
            let stolen: Vec<Stolen> = thieves
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect();
            for s in &stolen {
                assert!(s.is_for(iteration));
                all.extend(s.tasks.clone());
            }
            all.sort_unstable();
            assert_eq!(all, (0..m).collect::<Vec<_>>());
            stolen
        });
        assert!(stolen.iter().all(|s| !s.tasks.is_empty()));
    }
}

// ---- TaskSource -----------------------------------------------------------------------------

#[test]
fn task_source_basics() {
    let _s = serial();
    assert!(matches!(
        TaskSource::new(MAX_TASKS + 1),
        Err(Error::Config(_))
    ));
    let s = TaskSource::new(10).unwrap();
    assert_eq!(s.tag(), 0);
    assert_eq!(s.claim(), Some(0));
    assert_eq!(s.claim(), Some(1));
    assert_eq!(
        s.steal(3),
        Some(Stolen {
            tag: 0,
            tasks: 7..10
        })
    );
    assert_eq!(s.remaining(), 5);
    assert_eq!(s.steal(0), None);
    assert_eq!(
        s.steal(100),
        Some(Stolen {
            tag: 0,
            tasks: 2..7
        })
    );
    assert_eq!(s.claim(), None);
    assert_eq!(s.steal(1), None);
    assert_eq!(s.remaining(), 0);

    let iteration = (1u64 << 24) + 5;
    s.reset(iteration, MAX_TASKS).unwrap();
    assert_eq!(s.tag(), iteration_tag(iteration));
    assert_eq!(s.tag(), 5);
    assert_eq!(s.remaining(), MAX_TASKS);
    let stolen = s.steal(1).unwrap();
    assert_eq!(stolen.tasks, MAX_TASKS - 1..MAX_TASKS);
    assert!(stolen.is_for(iteration) && stolen.is_for(5) && !stolen.is_for(6));
    assert_eq!(s.steal_for(6, 1), None, "another iteration");
    assert_eq!(s.remaining(), MAX_TASKS - 1);
    assert_eq!(
        s.steal_for(iteration, 2),
        Some(Stolen {
            tag: 5,
            tasks: MAX_TASKS - 3..MAX_TASKS - 1
        })
    );
    assert!(s.reset(9, MAX_TASKS + 1).is_err());
    assert_eq!(s.tag(), 5, "a rejected reset changes nothing");
}

#[test]
fn a_thief_leaves_the_owner_what_it_keeps() {
    let s = TaskSource::new(0).unwrap();
    s.reset(3, 5).unwrap();
    assert_eq!(s.steal_for_keeping(2, 4, 1), None, "another iteration");
    assert_eq!(s.steal_for_keeping(3, 9, 1).unwrap().tasks, 1..5);
    assert_eq!(
        s.steal_for_keeping(3, 9, 1),
        None,
        "the last task is the owner's"
    );
    assert_eq!(s.remaining(), 1);
    assert_eq!(s.claim(), Some(0));
    assert_eq!(s.steal_for_keeping(3, 1, 0), None, "nothing left");
    s.reset(4, 3).unwrap();
    assert_eq!(s.steal_for_keeping(4, 1, 1).unwrap().tasks, 2..3);
    assert_eq!(s.steal_for_keeping(4, 5, 2), None);
    assert_eq!(s.claim(), Some(0));
    assert_eq!(s.claim(), Some(1));
}

#[derive(Clone, Debug)]
enum Op {
    Claim,
    Steal(usize),
    StealFor(u64, usize),
    Reset(u64, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Claim),
        3 => (0usize..20).prop_map(Op::Steal),
        2 => (0u64..4, 0usize..20).prop_map(|(i, k)| Op::StealFor(i, k)),
        1 => (0u64..4, 0usize..200).prop_map(|(i, m)| Op::Reset(i, m)),
        1 => (0u64..1 << 30, 0usize..200).prop_map(|(i, m)| Op::Reset(i, m)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Sequentially, the source behaves like the interval `next..end` it stands for.
    #[test]
    fn task_source_matches_its_model(m in 0usize..200, ops in prop::collection::vec(op(), 0..200)) {
        let _s = serial();
        let s = TaskSource::new(m).unwrap();
        let (mut tag, mut next, mut end) = (0u32, 0usize, m);
        for op in ops {
            match op {
                Op::Claim => {
                    let want = (next < end).then(|| { next += 1; next - 1 });
                    prop_assert_eq!(s.claim(), want);
                }
                Op::Steal(k) => {
                    let take = k.min(end - next);
                    let want = (take > 0).then(|| {
                        end -= take;
                        Stolen { tag, tasks: end..end + take }
                    });
                    prop_assert_eq!(s.steal(k), want);
                }
                Op::StealFor(i, k) => {
                    let take = if iteration_tag(i) == tag { k.min(end - next) } else { 0 };
                    let want = (take > 0).then(|| {
                        end -= take;
                        Stolen { tag, tasks: end..end + take }
                    });
                    prop_assert_eq!(s.steal_for(i, k), want);
                }
                Op::Reset(i, n) => {
                    s.reset(i, n).unwrap();
                    (tag, next, end) = (iteration_tag(i), 0, n);
                }
            }
            prop_assert_eq!(s.remaining(), end - next);
            prop_assert_eq!(s.tag(), tag);
        }
    }

    /// Concurrently, claimers and thieves on real threads together take every task of every
    /// round exactly once.
    #[test]
    fn claims_and_steals_cover_each_round_exactly_once(
        rounds in prop::collection::vec((0usize..3000, 1usize..5, 0usize..4, 1usize..64), 1..6),
    ) {
        let _s = serial();
        let source = TaskSource::new(0).unwrap();
        for (round, &(m, claimers, thieves, max)) in rounds.iter().enumerate() {
            source.reset(round as u64, m).unwrap();
            let go = Barrier::new(claimers + thieves);
            let mut all: Vec<usize> = thread::scope(|scope| {
                let mut handles = Vec::new();
                for _ in 0..claimers {
                    handles.push(scope.spawn(|| {
                        go.wait();
                        let mut got = Vec::new();
                        while let Some(t) = source.claim() {
                            got.push(t);
                        }
                        got
                    }));
                }
                for i in 0..thieves {
                    let (go, source) = (&go, &source);
                    handles.push(scope.spawn(move || {
                        go.wait();
                        let mut got = Vec::new();
                        while let Some(s) = source.steal(max + i) {
                            assert_eq!(s.tag, iteration_tag(round as u64));
                            assert!(!s.tasks.is_empty() && s.tasks.len() <= max + i);
                            got.extend(s.tasks);
                        }
                        got
                    }));
                }
                handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
            });
            all.sort_unstable();
            prop_assert_eq!(all, (0..m).collect::<Vec<_>>());
            prop_assert_eq!(source.remaining(), 0);
        }
    }
}

#[test]
fn steal_for_never_crosses_iterations() {
    let _s = serial();
    use std::sync::atomic::AtomicBool;
    let (rounds, m) = (300u64, 64usize);
    let source = TaskSource::new(0).unwrap();
    let done = AtomicBool::new(false);
    let mut taken: Vec<Vec<usize>> = vec![Vec::new(); rounds as usize];
    thread::scope(|scope| {
        let thieves: Vec<_> = (0..3)
            .map(|k| {
                let (source, done) = (&source, &done);
                scope.spawn(move || {
                    let mut got = Vec::new();
                    while !done.load(Ordering::Relaxed) {
                        // The iteration the thief believes in may be stale by the time it
                        // steals: steal_for must then give nothing.
                        let believed = u64::from(source.tag());
                        thread::yield_now();
                        if let Some(s) = source.steal_for(believed, 1 + k) {
                            assert!(s.is_for(believed));
                            got.push((believed, s.tasks));
                        }
                    }
                    got
                })
            })
            .collect();
        for round in 0..rounds {
            source.reset(round, m).unwrap();
            while let Some(t) = source.claim() {
                taken[round as usize].push(t);
                if t % 8 == 0 {
                    thread::yield_now();
                }
            }
        }
        done.store(true, Ordering::Relaxed);
        for thief in thieves {
            for (round, tasks) in thief.join().unwrap() {
                taken[round as usize].extend(tasks);
            }
        }
    });
    for (round, mut tasks) in taken.into_iter().enumerate() {
        tasks.sort_unstable();
        assert_eq!(tasks, (0..m).collect::<Vec<_>>(), "round {round}");
    }
}

// ---- knee -----------------------------------------------------------------------------------

fn point(threads: usize, iteration_ms: f64, mean_ms: f64, var_ms2: f64) -> KneePoint {
    let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
    KneePoint {
        threads,
        mean_task: ms(mean_ms),
        max_task: ms(mean_ms * 2.0),
        min_task: ms(mean_ms / 2.0),
        var_task: var_ms2,
        iteration_time: ms(iteration_ms),
    }
}

#[test]
fn knee_of_synthetic_curves() {
    let _s = serial();
    // Linear scaling to 4 cores, flat beyond, variance exploding from 6.
    let curve: Vec<KneePoint> = (1..=8)
        .map(|p| {
            let t = 128.0 / p.min(4) as f64;
            let var = if p >= 6 { 4.0 * p as f64 } else { 0.01 };
            point(p, t, 2.0, var)
        })
        .collect();
    assert_eq!(knee(&curve), 4);

    // Order does not matter.
    let mut shuffled = curve.clone();
    shuffled.reverse();
    assert_eq!(knee(&shuffled), 4);

    // Time keeps improving, but the variance jumps at 5: stop at 4.
    let jumpy: Vec<KneePoint> = (1..=6)
        .map(|p| point(p, 120.0 / p as f64, 2.0, if p >= 5 { 1.0 } else { 0.01 }))
        .collect();
    assert_eq!(knee(&jumpy), 4);

    // One noisy point (3 is slower than 2) does not end the walk.
    let noisy = vec![
        point(1, 100.0, 2.0, 0.0),
        point(2, 50.0, 2.0, 0.0),
        point(3, 52.0, 2.0, 0.0),
        point(4, 25.5, 2.0, 0.0),
        point(5, 25.0, 2.0, 0.0),
    ];
    assert_eq!(
        knee(&noisy),
        4,
        "5 saves 2 % where linear scaling would save 20 %"
    );
    let lax = KneeRule {
        min_gain: 0.05,
        ..KneeRule::default()
    };
    assert_eq!(knee_with(&noisy, lax), 5);

    // Variance is judged relative to the mean: large but proportional variance is fine.
    let slow_tasks = vec![point(1, 1000.0, 100.0, 50.0), point(2, 500.0, 100.0, 60.0)];
    assert_eq!(knee(&slow_tasks), 2);

    assert_eq!(knee(&[]), 1);
    assert_eq!(knee(&[point(3, 10.0, 1.0, 0.0)]), 3);
    assert_eq!(point(1, 1.0, 0.0, 5.0).cv2(), 0.0);
}

#[test]
fn measure_knee_reports_each_thread_count() {
    let _s = serial();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let points = measure_knee(3, 6, move || {
        c.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(
        points.iter().map(|p| p.threads).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    // 6 measured tasks plus a warm-up of one per thread, at each count.
    assert_eq!(calls.load(Ordering::Relaxed), 3 * 6 + (1 + 2 + 3));
    for p in &points {
        assert!(p.min_task <= p.mean_task && p.mean_task <= p.max_task);
        assert!(p.var_task >= 0.0);
    }
    assert!(measure_knee(0, 6, || {}).is_empty());
    let empty = measure_knee(2, 0, || {});
    assert_eq!(empty.iter().map(|p| p.threads).collect::<Vec<_>>(), [1, 2]);
    assert!(empty.iter().all(|p| p.mean_task == Duration::ZERO));
}

// ---- measurements (not asserted; run with --ignored --nocapture, preferably --release) -------

/// Busy work of about `ms` milliseconds, calibrated once.
fn cpu_job(ms: f64) -> impl Fn() + Send + Sync + 'static {
    fn burn(n: u64) -> u64 {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        std::hint::black_box(x)
    }
    let n = 4_000_000;
    let t = Instant::now();
    burn(n);
    let per_ms = n as f64 / (t.elapsed().as_secs_f64() * 1e3);
    let iters = (per_ms * ms) as u64;
    move || {
        burn(iters);
    }
}

#[test]
#[ignore = "a measurement: prints the knee table"]
fn print_knee_measurement() {
    let _s = serial();
    let points = measure_knee(16, 64, cpu_job(2.0));
    println!("threads  iteration_ms  mean_ms  min_ms  max_ms  var_ms2   cv2");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for p in &points {
        println!(
            "{:7}  {:12.1}  {:7.2}  {:6.2}  {:6.2}  {:7.2}  {:5.3}",
            p.threads,
            ms(p.iteration_time),
            ms(p.mean_task),
            ms(p.min_task),
            ms(p.max_task),
            p.var_task,
            p.cv2()
        );
    }
    println!("knee = {}", knee(&points));
}

#[test]
#[ignore = "a measurement: prints per-run overhead of run vs run_scoped"]
fn print_dispatch_overhead() {
    let _s = serial();
    let runs = 2000;
    for p in [1usize, 2, 4, 8, 16] {
        let pool = Pool::new(p).unwrap();
        let tasks = Arc::new(TaskSource::new(64).unwrap());
        let t = Instant::now();
        for i in 0..runs {
            tasks.reset(i, 64).unwrap();
            pool.run(&tasks, |_, _| {});
        }
        let persistent = t.elapsed().as_secs_f64() * 1e6 / runs as f64;
        let t = Instant::now();
        for i in 0..runs {
            tasks.reset(i, 64).unwrap();
            pool.run_scoped(&tasks, |_, _| {});
        }
        let scoped = t.elapsed().as_secs_f64() * 1e6 / runs as f64;
        println!("p={p:2}  run (persistent) {persistent:7.1} µs   run_scoped {scoped:7.1} µs");
    }
}
