//! FluentPS and ElasticBSP/ZipLine: property tests over random event traces (as in
//! `policies.rs`), ZipLine against brute force, and a persistent-straggler scenario.

mod common;

use std::collections::HashMap;

use common::timed_run;

use falcon_engine::meta::within_staleness;
use falcon_engine::sync::zipline::{ElasticBsp, Zip, predict, zipline};
use falcon_engine::sync::{Action, Asp, Bsp, Event, FastPath, FluentPs, Pause, Ssp, SyncPolicy};
use proptest::prelude::*;

#[derive(Clone, Copy, PartialEq, Debug)]
enum St {
    WantPull,
    Parked(u64),
    WantPush,
    /// Finished its iterations; will send `Leave`.
    Leaving,
    Done,
}

/// Simulates `workers` workers doing `iters` iterations (pull, then push) against `policy`,
/// the next worker to act chosen by `picks` (random delays); time advances by 1 per event.
/// With `leave`, a worker sends `Leave` once done (a barrier policy needs it). Checks that
/// every release answers a waiting pull and, with `bound`, that it keeps the SSP bound.
/// `hook` sees the policy after each event. Returns the trace: each event and its actions.
fn run<P: SyncPolicy>(
    policy: &mut P,
    workers: u32,
    iters: u64,
    picks: &[u32],
    leave: bool,
    bound: Option<u64>,
    mut hook: impl FnMut(&P, &Event, &[Action]),
) -> Vec<(Event, Vec<Action>)> {
    let n = workers as usize;
    let mut st = vec![St::WantPull; n];
    let mut clock = vec![0u64; n];
    let mut applied = vec![0u64; n];
    let mut trace = Vec::new();
    let mut req = 0u64;
    let mut i = 0usize;
    let mut t = 0u64;
    while st.iter().any(|s| *s != St::Done) {
        let ready: Vec<usize> = (0..n)
            .filter(|&w| matches!(st[w], St::WantPull | St::WantPush | St::Leaving))
            .collect();
        assert!(
            !ready.is_empty(),
            "deadlock: every unfinished worker is parked"
        );
        let w = ready[picks[i % picks.len()] as usize % ready.len()];
        i += 1;
        t += 1;
        let ev = match st[w] {
            St::WantPull => {
                req += 1;
                Event::Pull {
                    worker: w as u32,
                    clock: clock[w],
                    req,
                    at: t,
                }
            }
            St::WantPush => Event::Push {
                worker: w as u32,
                clock: clock[w],
                at: t,
            },
            St::Leaving => Event::Leave {
                worker: w as u32,
                at: t,
            },
            _ => unreachable!(),
        };
        match ev {
            Event::Push { .. } => {
                applied[w] = clock[w] + 1;
                clock[w] += 1;
                st[w] = match (clock[w] == iters, leave) {
                    (false, _) => St::WantPull,
                    (true, true) => St::Leaving,
                    (true, false) => St::Done,
                };
            }
            Event::Leave { .. } => st[w] = St::Done,
            _ => {}
        }
        let mut out = Vec::new();
        policy.on_event(ev, &mut out);
        if let Event::Pull { req: r, .. } = ev {
            st[w] = St::Parked(r);
        }
        for a in &out {
            if let Action::Release { worker, req: r } = *a {
                let wk = worker as usize;
                assert_eq!(
                    st[wk],
                    St::Parked(r),
                    "release of a pull that is not waiting"
                );
                if let Some(s) = bound {
                    let min = *applied.iter().min().unwrap();
                    assert!(
                        within_staleness(min, clock[wk], s),
                        "worker {wk} at clock {} released with min applied {min}, bound {s}",
                        clock[wk]
                    );
                }
                st[wk] = St::WantPush;
            }
        }
        hook(policy, &ev, &out);
        trace.push((ev, out));
    }
    trace
}

fn no_hook<P>(_: &P, _: &Event, _: &[Action]) {}

/// Applied counts and liveness, replayed from a trace.
struct Book {
    applied: Vec<u64>,
    live: Vec<bool>,
}

impl Book {
    fn new(workers: u32) -> Book {
        Book {
            applied: vec![0; workers as usize],
            live: vec![true; workers as usize],
        }
    }
    fn apply(&mut self, ev: &Event) {
        match *ev {
            Event::Push { worker, clock, .. } => {
                let a = &mut self.applied[worker as usize];
                *a = (*a).max(clock + 1);
            }
            Event::Leave { worker, .. } => self.live[worker as usize] = false,
            _ => {}
        }
    }
    fn min_live(&self) -> u64 {
        (0..self.applied.len())
            .filter(|&w| self.live[w])
            .map(|w| self.applied[w])
            .min()
            .unwrap_or(u64::MAX)
    }
}

/// Follows an [`ElasticBsp`] event by event and checks its barrier rules.
struct BarrierWatch {
    r: u64,
    book: Book,
    /// Each worker's barrier before the event.
    prev: Vec<u64>,
    /// Barriers seen falling.
    steps: u64,
    /// Pull clocks by request.
    pulls: HashMap<u64, u64>,
}

impl BarrierWatch {
    fn new(workers: u32, r: usize) -> BarrierWatch {
        BarrierWatch {
            r: r as u64,
            book: Book::new(workers),
            prev: vec![1; workers as usize],
            steps: 0,
            pulls: HashMap::new(),
        }
    }

    fn after(&mut self, p: &ElasticBsp, ev: &Event, acts: &[Action]) -> Result<(), String> {
        let n = self.prev.len();
        let book = &mut self.book;
        let prev = &self.prev;
        book.apply(ev);
        if let Event::Pull { clock, req, .. } = *ev {
            self.pulls.insert(req, clock);
        }
        let live: Vec<usize> = (0..n).filter(|&w| book.live[w]).collect();
        // The barrier falls exactly when every live worker has reached its own.
        let fell = !matches!(ev, Event::Pull { .. })
            && !live.is_empty()
            && live.iter().all(|&w| book.applied[w] >= prev[w]);
        if fell {
            self.steps += 1;
        }
        if p.supersteps() != self.steps {
            let got = p.supersteps();
            return Err(format!(
                "{got} supersteps, expected {} after {ev:?}",
                self.steps
            ));
        }
        let now: Vec<u64> = (0..n).map(|w| p.barrier(w as u32).unwrap()).collect();
        for (w, (&a, &b)) in book.applied.iter().zip(prev).enumerate() {
            if a > b {
                return Err(format!("worker {w} pushed past its barrier {b}"));
            }
        }
        for a in acts {
            match *a {
                Action::Release { worker, req } => {
                    let (w, c) = (worker as usize, self.pulls[&req]);
                    if !(c < prev[w] || (fell && c < now[w])) {
                        let b = prev[w];
                        return Err(format!("{w}'s pull at {c} released early (barrier {b})"));
                    }
                }
                Action::Park { worker, req } => {
                    let (w, c) = (worker as usize, self.pulls[&req]);
                    if c < prev[w] {
                        let b = prev[w];
                        return Err(format!("{w}'s pull at {c} parked before its barrier {b}"));
                    }
                }
                other => return Err(format!("unexpected {other:?}")),
            }
        }
        if fell {
            if p.parked() != 0 {
                return Err(format!(
                    "{} pulls parked after the barrier fell",
                    p.parked()
                ));
            }
            let plan = p.last_plan().ok_or("no plan")?;
            let ws: Vec<u32> = live.iter().map(|&w| w as u32).collect();
            if plan.workers != ws {
                return Err(format!("planned for {:?}, live {ws:?}", plan.workers));
            }
            for (i, &w) in live.iter().enumerate() {
                let k = now[w] - book.applied[w];
                let planned = plan.zip.as_ref().map_or(1, |z| z.picks[i] as u64 + 1);
                if !(1..=self.r).contains(&k) || k != planned {
                    return Err(format!("{w} given {k} iterations, plan says {planned}"));
                }
            }
            if let Some(z) = &plan.zip {
                if Some(z) != zipline(&plan.candidates).as_ref() {
                    return Err("plan is not ZipLine's".into());
                }
                if z.spread() != brute_force(&plan.candidates) {
                    return Err("plan's spread is not minimal".into());
                }
            }
        } else if let Some(w) = live.iter().find(|&&w| now[w] != prev[w]) {
            return Err(format!("barrier of {w} moved without falling"));
        }
        self.prev = now;
        Ok(())
    }
}

fn any_pause() -> impl Strategy<Value = Pause> {
    prop_oneof![
        Just(Pause::RawSsp),
        (0.0f64..=1.0).prop_map(|p| Pause::Fastest { p }),
        Just(Pause::Fastest { p: 1.0 }),
        Just(Pause::Sigmoid),
        Just(Pause::FastestSigmoid),
    ]
}

/// The smallest spread over all `R^n` combinations.
fn brute_force(c: &[Vec<u64>]) -> u64 {
    fn go(c: &[Vec<u64>], lo: u64, hi: u64) -> u64 {
        match c.split_first() {
            None => hi - lo,
            Some((first, rest)) => first
                .iter()
                .map(|&t| go(rest, lo.min(t), hi.max(t)))
                .min()
                .unwrap(),
        }
    }
    go(c, u64::MAX, 0)
}

/// A ZipLine answer is a valid combination with the spread it claims.
fn check_zip(c: &[Vec<u64>], z: &Zip) -> Result<(), TestCaseError> {
    prop_assert_eq!(z.picks.len(), c.len());
    let chosen: Vec<u64> = z.picks.iter().zip(c).map(|(&i, cands)| cands[i]).collect();
    prop_assert_eq!(*chosen.iter().min().unwrap(), z.low);
    prop_assert_eq!(*chosen.iter().max().unwrap(), z.high);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn fluentps_p0_is_asp_action_for_action(
        workers in 1u32..6, s in 0u64..4, seed: u64, leave: bool,
        picks in prop::collection::vec(0u32..1000, 1..200),
    ) {
        let mut f = FluentPs::new(Pause::Fastest { p: 0.0 }, s, workers, seed);
        prop_assert_eq!(f.fast_path(), FastPath::Always);
        let trace = run(&mut f, workers, 10, &picks, leave, None, no_hook);
        prop_assert_eq!(f.delayed_total(), 0);
        let mut asp = Asp;
        for (ev, expected) in trace {
            let mut out = Vec::new();
            asp.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
    }

    #[test]
    fn fluentps_raw_ssp_never_violates_the_bound(
        workers in 1u32..6, s in 0u64..4, seed: u64, leave: bool,
        picks in prop::collection::vec(0u32..1000, 1..200),
    ) {
        let mut f = FluentPs::new(Pause::RawSsp, s, workers, seed);
        prop_assert_eq!(f.fast_path(), FastPath::Within(s));
        run(&mut f, workers, 12, &picks, leave, Some(s), no_hook);
        prop_assert_eq!(f.parked(), 0);
    }

    #[test]
    fn fluentps_raw_ssp_is_ssp_action_for_action(
        workers in 1u32..6, s in 0u64..4, seed: u64, leave: bool,
        picks in prop::collection::vec(0u32..1000, 1..200),
    ) {
        let mut f = FluentPs::new(Pause::RawSsp, s, workers, seed);
        let trace = run(&mut f, workers, 10, &picks, leave, Some(s), no_hook);
        let mut ssp = Ssp::new(workers, s);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            ssp.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
        prop_assert_eq!(f.delayed_total(), ssp.delayed_total());
    }

    /// Without membership changes the gap of a pull past the bound is exactly `s`, so the
    /// puller is the fastest: fastest-only with `p = 1` pauses exactly what raw SSP pauses.
    #[test]
    fn fluentps_fastest_p1_is_raw_ssp_action_for_action(
        workers in 1u32..6, s in 0u64..4, seed: u64, leave: bool,
        picks in prop::collection::vec(0u32..1000, 1..200),
    ) {
        let mut f = FluentPs::new(Pause::Fastest { p: 1.0 }, s, workers, seed);
        let trace = run(&mut f, workers, 10, &picks, leave, Some(s), no_hook);
        let mut raw = FluentPs::new(Pause::RawSsp, s, workers, seed ^ 1);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            raw.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
    }

    /// Every variant: only pulls past the SSP bound are parked (so `FastPath::Within(s)` is
    /// sound), and a parked pull is released exactly on the event that first moves the
    /// slowest clock to its target (one advance for the probabilistic rules, the bound for
    /// raw SSP), all such pulls together.
    #[test]
    fn fluentps_parks_only_past_the_bound_and_releases_lazily(
        workers in 1u32..6, s in 0u64..4, seed: u64, leave: bool, pause in any_pause(),
        picks in prop::collection::vec(0u32..1000, 1..200),
    ) {
        let mut f = FluentPs::new(pause, s, workers, seed);
        let trace = run(&mut f, workers, 12, &picks, leave, None, no_hook);
        prop_assert_eq!(f.parked(), 0);
        let mut book = Book::new(workers);
        let mut waiting: HashMap<u64, (u32, u64)> = HashMap::new(); // req → (worker, target)
        let mut parks = 0u64;
        for (ev, acts) in &trace {
            book.apply(ev);
            let min = book.min_live();
            if let Event::Pull { worker, clock, req, .. } = *ev {
                prop_assert_eq!(acts.len(), 1);
                match acts[0] {
                    Action::Release { worker: w, req: r } => {
                        prop_assert_eq!((w, r), (worker, req));
                    }
                    Action::Park { worker: w, req: r } => {
                        prop_assert_eq!((w, r), (worker, req));
                        prop_assert!(!within_staleness(min, clock, s), "parked within the bound");
                        let target = if pause == Pause::RawSsp { clock - s } else { min + 1 };
                        waiting.insert(req, (worker, target));
                        parks += 1;
                    }
                    other => prop_assert!(false, "unexpected {:?}", other),
                }
                continue;
            }
            let mut due: Vec<(u32, u64)> = waiting
                .iter()
                .filter(|(_, (_, target))| *target <= min)
                .map(|(r, (w, _))| (*w, *r))
                .collect();
            due.sort_unstable();
            let mut got: Vec<(u32, u64)> = acts
                .iter()
                .map(|a| match *a {
                    Action::Release { worker, req } => (worker, req),
                    other => panic!("unexpected {other:?}"),
                })
                .collect();
            got.sort_unstable();
            prop_assert_eq!(&got, &due, "event {:?}", ev);
            for (_, r) in due {
                waiting.remove(&r);
            }
        }
        prop_assert_eq!(parks, f.delayed_total());
    }

    #[test]
    fn zipline_equals_brute_force(
        c in prop::collection::vec(prop::collection::vec(0u64..30, 1..6), 1..6),
    ) {
        let z = zipline(&c).unwrap();
        check_zip(&c, &z)?;
        prop_assert_eq!(z.spread(), brute_force(&c));
    }

    #[test]
    fn zipline_equals_brute_force_on_predictions(
        now in 0u64..1_000,
        intervals in prop::collection::vec(1u64..50, 1..6),
        r in 1usize..6,
    ) {
        let c: Vec<Vec<u64>> = intervals.iter().map(|&i| predict(now, i, r)).collect();
        let z = zipline(&c).unwrap();
        check_zip(&c, &z)?;
        prop_assert_eq!(z.spread(), brute_force(&c));
    }

    /// ElasticBSP on random traces: a worker never pushes past its barrier nor has a pull
    /// released at or beyond it before the barrier falls; when every live worker reaches its
    /// barrier, the barrier falls on that very event, every parked pull is released, and the
    /// next barriers are ZipLine's plan (`1..=R` iterations ahead, minimal predicted spread).
    #[test]
    fn elastic_bsp_releases_everyone_at_the_barrier_and_nobody_early(
        workers in 1u32..6, r in 1usize..6, window in 1usize..4,
        picks in prop::collection::vec(0u32..1000, 1..300),
    ) {
        let mut e = ElasticBsp::new(workers, r).with_window(window);
        prop_assert_eq!(e.fast_path(), FastPath::Never);
        let mut watch = BarrierWatch::new(workers, r);
        let mut failure: Option<String> = None;
        run(&mut e, workers, 15, &picks, true, None, |p: &ElasticBsp, ev, acts| {
            if failure.is_none() {
                failure = watch.after(p, ev, acts).err();
            }
        });
        if let Some(f) = failure {
            prop_assert!(false, "{}", f);
        }
        prop_assert_eq!(e.parked(), 0);
        prop_assert!(watch.steps >= 1);
    }

    /// Events about workers the policy does not know are ignored: no action, no panic, and the
    /// policy then behaves exactly like a fresh one.
    #[test]
    fn unknown_workers_are_ignored(
        workers in 1u32..5, s in 0u64..3, seed: u64, pause in any_pause(), r in 1usize..5,
        stray in prop::collection::vec((0u8..4, 0u32..8, 0u64..20), 0..20),
        picks in prop::collection::vec(0u32..1000, 1..100),
    ) {
        let events: Vec<Event> = stray
            .iter()
            .enumerate()
            .map(|(i, &(kind, dw, clock))| {
                let worker = workers + dw; // never a known rank
                let at = i as u64;
                match kind {
                    0 => Event::Push { worker, clock, at },
                    1 => Event::Pull { worker, clock, req: 1_000_000 + i as u64, at },
                    2 => Event::Leave { worker, at },
                    _ => Event::Join { worker, clock, at },
                }
            })
            .collect();
        let mut f = FluentPs::new(pause, s, workers, seed);
        let mut e = ElasticBsp::new(workers, r);
        let mut out = Vec::new();
        for ev in &events {
            f.on_event(*ev, &mut out);
            e.on_event(*ev, &mut out);
        }
        prop_assert!(out.is_empty(), "{:?}", out);
        prop_assert_eq!((f.parked(), f.delayed_total()), (0, 0));
        prop_assert_eq!((e.parked(), e.delayed_total()), (0, 0));
        // Same behaviour afterwards as fresh instances (times shifted past the strays).
        let mut fresh_f = FluentPs::new(pause, s, workers, seed);
        let mut fresh_e = ElasticBsp::new(workers, r);
        let t1 = run(&mut f, workers, 8, &picks, true, None, no_hook);
        let t2 = run(&mut fresh_f, workers, 8, &picks, true, None, no_hook);
        prop_assert_eq!(t1, t2);
        let t1 = run(&mut e, workers, 8, &picks, true, None, no_hook);
        let t2 = run(&mut fresh_e, workers, 8, &picks, true, None, no_hook);
        prop_assert_eq!(t1, t2);
    }
}

#[test]
fn raw_ssp_parks_the_most_under_a_persistent_straggler() {
    // Four fast workers of distinct speeds and one persistent straggler, 4× slower.
    let base = [100, 110, 120, 130, 450];
    let (s, iters, seed) = (2, 80, 42);
    let variants = [
        ("raw SSP", Pause::RawSsp),
        ("fastest p=0.5", Pause::Fastest { p: 0.5 }),
        ("fastest p=1", Pause::Fastest { p: 1.0 }),
        ("sigmoid", Pause::Sigmoid),
        ("fastest-sigmoid", Pause::FastestSigmoid),
    ];
    let mut counts = Vec::new();
    for (name, pause) in variants {
        let mut p = FluentPs::new(pause, s, base.len() as u32, seed);
        let end = timed_run(&mut p, &base, iters, seed);
        eprintln!(
            "{name:>16}: {:>4} delayed pulls, finished at {end}",
            p.delayed_total()
        );
        counts.push(p.delayed_total());
    }
    let raw = counts[0];
    for i in [1, 3, 4] {
        assert!(
            raw > counts[i],
            "raw SSP parked {raw}, {} parked {}",
            variants[i].0,
            counts[i]
        );
    }
    // Pausing only the fastest, always, is raw SSP: whoever is past the bound is the fastest.
    assert_eq!(counts[2], raw);
    // Pausing only the fastest, half the time, delays far fewer pulls.
    assert!(raw >= 2 * counts[1], "{raw} vs {}", counts[1]);
}

#[test]
fn fluentps_fastest_only_pauses_only_the_fastest() {
    // s = 0; worker 0 has pushed iterations 0 and 1, worker 1 iteration 0, worker 2 nothing.
    let mut p = FluentPs::new(Pause::Fastest { p: 1.0 }, 0, 3, 9);
    let mut out = Vec::new();
    for (worker, clock) in [(0, 0), (0, 1), (1, 0)] {
        p.on_event(
            Event::Push {
                worker,
                clock,
                at: 0,
            },
            &mut out,
        );
    }
    assert_eq!((p.slowest(), p.fastest()), (0, 2));
    let pull = |worker, clock, req| Event::Pull {
        worker,
        clock,
        req,
        at: 1,
    };
    // Worker 1 at clock 1 is past the bound but not the fastest: released.
    p.on_event(pull(1, 1, 1), &mut out);
    // Worker 0 at clock 2 is the fastest: paused (p = 1).
    p.on_event(pull(0, 2, 2), &mut out);
    assert_eq!(
        out,
        vec![
            Action::Release { worker: 1, req: 1 },
            Action::Park { worker: 0, req: 2 }
        ]
    );
    out.clear();
    // One advance of the slowest clock releases it, lazily, though the gap is still 1 > s.
    p.on_event(
        Event::Push {
            worker: 2,
            clock: 0,
            at: 2,
        },
        &mut out,
    );
    assert_eq!(out, vec![Action::Release { worker: 0, req: 2 }]);
    assert_eq!((p.parked(), p.delayed_total()), (0, 1));
}

#[test]
fn elastic_bsp_plans_the_aligned_barrier() {
    // Worker 0 takes 2 ns per iteration, worker 1 takes 3 ns; R = 6.
    let mut e = ElasticBsp::new(2, 6);
    let mut out = Vec::new();
    let ev = |e: &mut ElasticBsp, out: &mut Vec<Action>, x: Event| {
        out.clear();
        e.on_event(x, out);
        out.clone()
    };
    let pull = |worker, clock, req, at| Event::Pull {
        worker,
        clock,
        req,
        at,
    };
    let push = |worker, clock, at| Event::Push { worker, clock, at };
    assert_eq!((e.barrier(0), e.barrier(1)), (Some(1), Some(1)));
    assert_eq!(
        ev(&mut e, &mut out, pull(0, 0, 1, 0)),
        [Action::Release { worker: 0, req: 1 }]
    );
    assert_eq!(
        ev(&mut e, &mut out, pull(1, 0, 2, 0)),
        [Action::Release { worker: 1, req: 2 }]
    );
    assert_eq!(ev(&mut e, &mut out, push(0, 0, 2)), []);
    assert_eq!(
        ev(&mut e, &mut out, pull(0, 1, 3, 2)),
        [Action::Park { worker: 0, req: 3 }]
    );
    // Worker 1's push at t = 3 completes the first barrier: from T = 3 the predictions are
    // 5, 7, 9, … and 6, 9, 12, …; they meet at 9: 3 more iterations for worker 0, 2 for 1.
    assert_eq!(
        ev(&mut e, &mut out, push(1, 0, 3)),
        [Action::Release { worker: 0, req: 3 }]
    );
    assert_eq!((e.estimate(0), e.estimate(1)), (Some(2), Some(3)));
    let plan = e.last_plan().unwrap();
    assert_eq!(plan.at, 3);
    assert_eq!(plan.zip.as_ref().unwrap().picks, vec![2, 1]);
    assert_eq!(plan.zip.as_ref().unwrap().high, 9);
    assert_eq!((e.barrier(0), e.barrier(1)), (Some(4), Some(3)));
    // Worker 0 runs iterations 1..3 freely, then waits at clock 4.
    assert_eq!(ev(&mut e, &mut out, push(0, 1, 5)), []);
    assert_eq!(
        ev(&mut e, &mut out, pull(1, 1, 4, 3)),
        [Action::Release { worker: 1, req: 4 }]
    );
    assert_eq!(
        ev(&mut e, &mut out, pull(0, 2, 5, 5)),
        [Action::Release { worker: 0, req: 5 }]
    );
    assert_eq!(ev(&mut e, &mut out, push(1, 1, 6)), []);
    assert_eq!(
        ev(&mut e, &mut out, pull(1, 2, 6, 6)),
        [Action::Release { worker: 1, req: 6 }]
    );
    assert_eq!(ev(&mut e, &mut out, push(0, 2, 7)), []);
    assert_eq!(
        ev(&mut e, &mut out, pull(0, 3, 7, 7)),
        [Action::Release { worker: 0, req: 7 }]
    );
    assert_eq!(ev(&mut e, &mut out, push(0, 3, 9)), []);
    assert_eq!(
        ev(&mut e, &mut out, pull(0, 4, 8, 9)),
        [Action::Park { worker: 0, req: 8 }]
    );
    // Worker 1 finishes iteration 2 at 9: the barrier falls with nobody having waited long.
    assert_eq!(
        ev(&mut e, &mut out, push(1, 2, 9)),
        [Action::Release { worker: 0, req: 8 }]
    );
    assert_eq!(e.supersteps(), 2);
    assert_eq!(e.last_plan().unwrap().zip.as_ref().unwrap().spread(), 0);
    assert_eq!(e.delayed_total(), 2);
}

#[test]
fn elastic_bsp_waits_less_than_bsp_on_steady_heterogeneous_speeds() {
    let base = [200, 300, 500];
    let (iters, seed) = (60, 7);
    let mut bsp = Bsp::new(3);
    let bsp_end = timed_run(&mut bsp, &base, iters, seed);
    let mut e = ElasticBsp::new(3, 15);
    let e_end = timed_run(&mut e, &base, iters, seed);
    eprintln!(
        "bsp: {} delayed, end {bsp_end}; elastic-bsp(R=15): {} delayed, end {e_end}, {} supersteps",
        bsp.delayed_total(),
        e.delayed_total(),
        e.supersteps()
    );
    assert!(e.delayed_total() < bsp.delayed_total());
    assert!(e.supersteps() < iters);
}

#[test]
fn zipline_scales_to_many_workers() {
    // 1000 workers × R = 150 (the paper's largest case) stays well within a test's budget.
    let c: Vec<Vec<u64>> = (0..1000u64)
        .map(|w| predict(0, 1_000 + (w * 7919) % 5_000, 150))
        .collect();
    let z = zipline(&c).unwrap();
    assert!(z.picks.iter().all(|&i| i < 150));
    assert!(z.spread() <= z.high);
}
