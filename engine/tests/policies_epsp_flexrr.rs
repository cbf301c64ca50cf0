//! EPSP (our design) and FlexRR: equivalences and invariants over random event traces,
//! the projection-driven switch and task-transfer offers in time-driven runs.

mod common;

use common::{compute_time, run, timed_run, timed_run_times, timed_run_with};

use falcon_engine::sync::projection::{Class, ProjectionConfig};
use falcon_engine::sync::{
    Action, Bsp, Epsp, EpspConfig, Event, FlexRr, PolicySpec, Ssp, SyncPolicy,
};
use proptest::prelude::*;

fn epsp(workers: u32, s_max: u64, adaptive: bool, transfer: bool) -> Epsp {
    Epsp::new(
        workers,
        EpspConfig {
            s_max,
            adaptive,
            transfer,
            ..EpspConfig::default()
        },
    )
}

fn without_transfers(a: &[Action]) -> Vec<Action> {
    a.iter()
        .filter(|x| !matches!(x, Action::Transfer { .. }))
        .copied()
        .collect()
}

/// Applied counts as the trace's pushes and departures leave them.
struct Applied {
    applied: Vec<u64>,
    live: Vec<bool>,
}

impl Applied {
    fn new(workers: u32) -> Applied {
        Applied {
            applied: vec![0; workers as usize],
            live: vec![true; workers as usize],
        }
    }

    fn see(&mut self, ev: &Event) {
        match *ev {
            Event::Push { worker, clock, .. } => {
                let a = &mut self.applied[worker as usize];
                *a = (*a).max(clock + 1);
            }
            Event::Leave { worker, .. } => self.live[worker as usize] = false,
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Enforced EPSP with no mechanism (no switch, no transfer) is BSP, action for action.
    #[test]
    fn epsp_enforced_without_mechanisms_is_bsp(workers in 1u32..6, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut e = epsp(workers, 0, false, false);
        let trace = run(&mut e, workers, Some(0), 10, &picks, false);
        let mut bsp = Bsp::new(workers);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            bsp.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
    }

    /// Adaptive EPSP with transfer on: as long as the switch has not fired, its releases and
    /// parks are BSP's, and every transfer offer goes to a worker whose pull is parked — made
    /// either with the park itself or after a push that moved a worker's applied count — and
    /// names a live worker holding that pull back, at that worker's current iteration.
    #[test]
    fn epsp_is_bsp_until_a_mechanism_fires(workers in 1u32..6, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut e = epsp(workers, 4, true, true);
        let trace = run(&mut e, workers, Some(4), 10, &picks, true);
        let mut replay = epsp(workers, 4, true, true);
        let mut bsp = Bsp::new(workers);
        let mut book = Applied::new(workers);
        // Parked pulls: worker → clock.
        let mut parked = std::collections::HashMap::new();
        for (ev, _) in trace {
            let before = book.applied.clone();
            book.see(&ev);
            let mut out = Vec::new();
            replay.on_event(ev, &mut out);
            if let Event::Pull { worker, clock, req, .. } = ev
                && out.contains(&Action::Park { worker, req })
            {
                parked.insert(worker, clock);
            }
            for a in &out {
                if let Action::Release { worker, .. } = *a {
                    parked.remove(&worker);
                }
            }
            for (i, a) in out.iter().enumerate() {
                if let Action::Transfer { helper, straggler, clock } = *a {
                    match ev {
                        Event::Pull { worker, req, .. } => {
                            prop_assert_eq!(helper, worker);
                            let park = Action::Park { worker, req };
                            prop_assert!(i > 0 && out[i - 1] == park, "offer without a park");
                        }
                        Event::Push { worker, .. } => prop_assert!(
                            book.applied[worker as usize] > before[worker as usize],
                            "an offer on a push that moved nothing"
                        ),
                        _ => return Err(TestCaseError::fail(format!("transfer on {ev:?}"))),
                    }
                    let Some(&c) = parked.get(&helper) else {
                        return Err(TestCaseError::fail(format!("offer to {helper}, not parked")));
                    };
                    prop_assert!(straggler != helper && book.live[straggler as usize]);
                    prop_assert_eq!(clock, book.applied[straggler as usize]);
                    prop_assert!(clock + replay.staleness() < c, "the straggler holds the pull back");
                }
            }
            if replay.switches() > 0 {
                break;
            }
            let mut expected = Vec::new();
            bsp.on_event(ev, &mut expected);
            prop_assert_eq!(without_transfers(&out), expected, "event {:?}", ev);
        }
    }

    /// No bound is ever exceeded, whatever the switch does; every parked pull is released
    /// (the simulator fails on a deadlock or a pull left waiting); no offer without transfer.
    #[test]
    fn epsp_never_exceeds_s_max(workers in 1u32..6, s_max in 0u64..4, adaptive: bool, transfer: bool, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut e = epsp(workers, s_max, adaptive, transfer);
        let trace = run(&mut e, workers, Some(s_max), 12, &picks, true);
        prop_assert_eq!(e.parked(), 0);
        prop_assert!(e.staleness() <= s_max);
        let offers = trace.iter().flat_map(|(_, a)| a).filter(|a| matches!(a, Action::Transfer { .. })).count() as u64;
        prop_assert_eq!(offers, e.transfers());
        if !transfer {
            prop_assert_eq!(offers, 0);
        }
    }

    /// FlexRR never exceeds its slack, releases everything, and without helpers (θ beyond
    /// reach) is SSP action for action.
    #[test]
    fn flexrr_keeps_its_slack_and_is_ssp_without_offers(workers in 1u32..6, s in 0u64..3, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut f = FlexRr::new(workers, s, 1, 0);
        let trace = run(&mut f, workers, Some(s), 12, &picks, true);
        prop_assert_eq!(f.parked(), 0);
        let mut ssp = Ssp::new(workers, s);
        for (ev, actions) in &trace {
            let mut expected = Vec::new();
            ssp.on_event(*ev, &mut expected);
            prop_assert_eq!(without_transfers(actions), expected, "event {:?}", ev);
        }
        // θ = 1000 iterations: never reached in 12, so no offer at all.
        let mut quiet = FlexRr::new(workers, s, 1000, 0);
        run(&mut quiet, workers, Some(s), 12, &picks, true);
        prop_assert_eq!(quiet.transfers(), 0);
    }

    /// Every FlexRR offer: the helper is ahead of the helpee by at least θ, both in one
    /// group, the helpee furthest behind in it, and no offer repeats.
    #[test]
    fn flexrr_offers_follow_the_rule(workers in 2u32..7, theta in 1u64..3, group in 0u32..4, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut f = FlexRr::new(workers, 2, theta, group);
        let trace = run(&mut f, workers, Some(2), 12, &picks, true);
        let mut book = Applied::new(workers);
        let mut seen = std::collections::HashSet::new();
        let same = |a: u32, b: u32| group == 0 || a / group == b / group;
        for (ev, actions) in &trace {
            book.see(ev);
            for a in actions {
                if let Action::Transfer { helper, straggler, clock } = *a {
                    prop_assert!(same(helper, straggler) && helper != straggler);
                    prop_assert_eq!(clock, book.applied[straggler as usize]);
                    prop_assert!(book.applied[helper as usize] >= clock + theta);
                    let min = (0..workers).filter(|&w| w != helper && same(helper, w)).map(|w| book.applied[w as usize]).min().unwrap();
                    prop_assert_eq!(clock, min);
                    prop_assert!(seen.insert((helper, straggler, clock)), "repeated offer");
                }
            }
        }
    }
}

#[test]
fn epsp_stays_enforced_under_transient_stragglers() {
    // Five workers of about equal speed (≤ 20% jitter); each has a 4× slow episode once in a
    // while, on different workers in different iterations: transient, never persistent.
    let base = [100, 100, 100, 100, 100];
    let time = |w: usize, c: u64| {
        let t = compute_time(&base, w, c, 7);
        if c % 10 == 2 * w as u64 { 4 * t } else { t }
    };
    let mut e = epsp(5, 4, true, false);
    let mut events = Vec::new();
    let e_end = timed_run_times(&mut e, 5, &time, 60, &mut |_, ev, _| events.push(*ev));
    let mut bsp = Bsp::new(5);
    let bsp_end = timed_run_times(&mut bsp, 5, &time, 60, &mut |_, _, _| {});
    // Replay into a twin to read the verdict after every event.
    let mut twin = epsp(5, 4, true, false);
    let mut transient_seen = false;
    let mut out = Vec::new();
    for ev in events {
        twin.on_event(ev, &mut out);
        transient_seen |= twin.verdict().classes.contains(&Class::Transient);
    }
    assert!(transient_seen, "the episodes must be seen as transient");
    assert_eq!(e.switches(), 0, "switched without a persistent straggler");
    assert_eq!(e_end, bsp_end, "enforced EPSP must time like BSP");
}

#[test]
fn epsp_switches_to_slack_for_a_persistent_straggler_and_back_when_it_leaves() {
    // Worker 3 is 3× slower: persistent. Spread ≈ 3 → s = ⌈3⌉ − 1 = 2 (≤ s_max = 4).
    let base = [100, 105, 110, 300];
    let mut e = epsp(4, 4, true, false);
    let mut events = Vec::new();
    timed_run_with(&mut e, &base, 40, 3, &mut |_, ev, _| events.push(*ev));
    // Replay into a twin to watch the bound after every event.
    let mut e2 = epsp(4, 4, true, false);
    let mut slack_seen = Vec::new();
    let mut out = Vec::new();
    for ev in &events {
        e2.on_event(*ev, &mut out);
        slack_seen.push(e2.staleness());
        if e2.staleness() > 0 {
            assert_eq!(
                e2.verdict().classes[3],
                Class::Persistent,
                "slack only for a persistent straggler"
            );
        }
    }
    assert_eq!(e2.switches(), e.switches());
    let most = *slack_seen.iter().max().unwrap();
    assert!((2..=3).contains(&most), "slack bound {most}, spread ≈ 3");
    assert!(e2.switches() >= 1);
    // The straggler leaves: back to enforced.
    e2.on_event(
        Event::Leave {
            worker: 3,
            at: u64::MAX / 2,
        },
        &mut out,
    );
    assert_eq!(e2.staleness(), 0);
}

#[test]
fn epsp_fixed_slack_never_switches() {
    let base = [100, 100, 400];
    let mut e = epsp(3, 2, false, false);
    timed_run(&mut e, &base, 30, 1);
    assert_eq!((e.switches(), e.staleness()), (0, 2));
}

#[test]
fn epsp_offers_a_blocked_pioneer_the_straggler_with_the_most_remaining_work() {
    let base = [100, 100, 450];
    let mut e = epsp(3, 4, true, true);
    let mut offers = Vec::new();
    timed_run_with(&mut e, &base, 30, 5, &mut |_, _, acts| {
        for a in acts {
            if let Action::Transfer {
                helper, straggler, ..
            } = *a
            {
                offers.push((helper, straggler));
            }
        }
    });
    assert!(
        !offers.is_empty(),
        "pioneers blocked but were offered nothing"
    );
    // In the first round nobody's iteration time is known and ties go to the lowest rank;
    // from then on the offers take from the persistent straggler.
    assert!(
        offers.iter().skip(2).all(|&(h, s)| s == 2 && h != 2),
        "offers must take from the persistent straggler: {offers:?}"
    );
    assert_eq!(e.transfers(), offers.len() as u64);
    let mut off = epsp(3, 4, true, false);
    timed_run(&mut off, &base, 30, 5);
    assert_eq!(off.transfers(), 0);
}

/// Two stragglers, six pioneers: the pioneers are spread over both stragglers, not piled onto
/// the one furthest behind, and a pioneer parked across a straggler's iterations is offered
/// each of them.
#[test]
fn epsp_spreads_pioneers_over_every_straggler_and_keeps_them_helping() {
    let base = [100, 100, 100, 100, 100, 100, 400, 400];
    let mut e = epsp(8, 4, false, true);
    let mut offers = Vec::new();
    let mut on_push = 0;
    timed_run_with(&mut e, &base, 40, 3, &mut |_, ev, acts| {
        for a in acts {
            if let Action::Transfer {
                helper,
                straggler,
                clock,
            } = *a
            {
                offers.push((helper, straggler, clock));
                if matches!(ev, Event::Push { .. }) {
                    on_push += 1;
                }
            }
        }
    });
    let to = |s: u32| offers.iter().filter(|o| o.1 == s).count();
    assert!(
        to(6) > 0 && to(7) > 0,
        "both stragglers helped: {} offers for 6, {} for 7",
        to(6),
        to(7)
    );
    let (a, b) = (to(6) as f64, to(7) as f64);
    assert!(
        a.min(b) / a.max(b) > 0.5,
        "about evenly spread: {a} offers for 6, {b} for 7"
    );
    assert!(
        offers.iter().all(|&(h, s, _)| h < 6 && s >= 6),
        "pioneers help stragglers: {offers:?}"
    );
    assert!(on_push > 0, "helping goes on after the first offer");
    // Within one parked pull, a helper never gets the same straggler iteration twice.
    let mut seen = std::collections::HashSet::new();
    for o in &offers {
        assert!(seen.insert(*o), "repeated offer {o:?}");
    }
}

/// `worker`'s push of `clock` at `at`.
fn push(worker: u32, clock: u64, at: u64) -> Event {
    Event::Push { worker, clock, at }
}

/// The (helper, straggler) of each transfer offer in `out`.
fn helper_straggler(out: &[Action]) -> Vec<(u32, u32)> {
    out.iter()
        .filter_map(|a| match *a {
            Action::Transfer {
                helper, straggler, ..
            } => Some((helper, straggler)),
            _ => None,
        })
        .collect()
}

/// FlexRR's helpee among those equally far behind is the one with the most work left: the
/// one whose current iteration started latest.
#[test]
fn flexrr_helps_the_helpee_with_the_most_work_left() {
    let mut f = FlexRr::new(3, 1, 1, 0);
    let mut out = Vec::new();
    // Worker 1 finishes iteration 0 at 10, worker 2 at 20: both have 1 applied, so worker 2
    // (its iteration 1 started later) has more left. Worker 0 pushes twice.
    f.on_event(push(0, 0, 5), &mut out);
    f.on_event(push(1, 0, 10), &mut out);
    f.on_event(push(2, 0, 20), &mut out);
    out.clear();
    f.on_event(push(0, 1, 30), &mut out);
    let offers = helper_straggler(&out);
    assert_eq!(offers, vec![(0, 2)], "{out:?}");
}

/// A rejoin starts the worker's iteration: among helpees equally far behind, one that rejoined
/// after the other's last push has the more work left, whatever it pushed before it left.
#[test]
fn flexrr_counts_a_rejoin_as_the_start_of_an_iteration() {
    let mut f = FlexRr::new(3, 1, 1, 0);
    let mut out = Vec::new();
    // Worker 1 pushes iteration 0 at 10 and leaves; worker 2 pushes it at 20; worker 1
    // rejoins at 50 with its one gradient counted. Both have 1 applied; worker 1's iteration
    // started at 50, worker 2's at 20: worker 1 has the more work left.
    f.on_event(push(0, 0, 5), &mut out);
    f.on_event(push(1, 0, 10), &mut out);
    f.on_event(Event::Leave { worker: 1, at: 15 }, &mut out);
    f.on_event(push(2, 0, 20), &mut out);
    f.on_event(
        Event::Join {
            worker: 1,
            clock: 1,
            at: 50,
        },
        &mut out,
    );
    out.clear();
    f.on_event(push(0, 1, 60), &mut out);
    let offers = helper_straggler(&out);
    assert_eq!(offers, vec![(0, 1)], "{out:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Over random traces with departures and rejoins, each FlexRR offer goes to the group
    /// member furthest behind and, among those, to the one whose iteration started latest — a
    /// rejoin being a start — then the lowest rank.
    #[test]
    fn flexrr_picks_by_iteration_start_across_rejoins(
        workers in 2u32..6,
        steps in prop::collection::vec((0u32..6, 0u8..10), 1..150),
    ) {
        let n = workers as usize;
        let mut f = FlexRr::new(workers, 1, 1, 0);
        let mut applied = vec![0u64; n];
        let mut live = vec![true; n];
        let mut start = vec![0u64; n];
        let mut out = Vec::new();
        for (i, &(w, kind)) in steps.iter().enumerate() {
            let w = w % workers;
            let wi = w as usize;
            let at = 10 * (i as u64 + 1);
            let ev = match kind {
                0 if live[wi] && live.iter().filter(|l| **l).count() > 1 => {
                    live[wi] = false;
                    Event::Leave { worker: w, at }
                }
                1 if !live[wi] => {
                    live[wi] = true;
                    start[wi] = at;
                    Event::Join { worker: w, clock: applied[wi], at }
                }
                _ if live[wi] => {
                    let clock = applied[wi];
                    applied[wi] += 1;
                    start[wi] = at;
                    Event::Push { worker: w, clock, at }
                }
                _ => continue,
            };
            out.clear();
            f.on_event(ev, &mut out);
            for a in &out {
                if let Action::Transfer { helper, straggler, clock } = *a {
                    let expected = (0..n)
                        .filter(|&j| j != helper as usize && live[j])
                        .min_by_key(|&j| (applied[j], std::cmp::Reverse(start[j]), j))
                        .unwrap();
                    prop_assert_eq!(straggler as usize, expected, "{:?}", out);
                    prop_assert_eq!(clock, applied[expected]);
                }
            }
        }
    }
}

#[test]
fn flexrr_helps_the_slow_worker_of_its_group_only() {
    // Two groups of two; worker 1 and worker 3 are slow. Helpers only help their own group.
    let base = [100, 400, 100, 400];
    let mut f = FlexRr::new(4, 1, 1, 2);
    let mut offers = Vec::new();
    timed_run_with(&mut f, &base, 20, 9, &mut |_, _, acts| {
        for a in acts {
            if let Action::Transfer {
                helper, straggler, ..
            } = *a
            {
                offers.push((helper, straggler));
            }
        }
    });
    assert!(
        offers.contains(&(0, 1)) && offers.contains(&(2, 3)),
        "{offers:?}"
    );
    assert!(offers.iter().all(|&(h, s)| h / 2 == s / 2), "{offers:?}");
}

#[test]
fn specs_parse_build_and_name_themselves() {
    let cases = [
        ("epsp", "epsp(0)"),
        ("epsp(2)", "epsp(2)"),
        ("epsp(0,fixed)", "epsp(0,fixed)"),
        ("epsp(3, no-transfer)", "epsp(3,no-transfer)"),
        ("epsp(3,fixed,no-transfer)", "epsp(3,fixed,no-transfer)"),
        ("flexrr", "flexrr(1,theta=1,group=0)"),
        ("flexrr(2,theta=3,group=4)", "flexrr(2,theta=3,group=4)"),
        ("elasticbsp", "elasticbsp(15)"),
        ("elasticbsp(30)", "elasticbsp(30)"),
    ];
    for (text, name) in cases {
        let spec: PolicySpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(spec.build(4).name(), name, "{text}");
    }
    for bad in [
        "epsp(x)",
        "epsp(1,2)",
        "epsp(1,sideways)",
        "flexrr(1,theta=x)",
        "flexrr(1,2)",
        "elasticbsp(0)",
        "elasticbsp(1,2)",
    ] {
        let err = bad.parse::<PolicySpec>().unwrap_err().to_string();
        // The spec is named, and what is wrong with it said (not the grammar of every policy).
        assert!(err.contains(&format!("policy {bad}: ")), "{bad}: {err}");
        assert!(!err.contains("the policies:"), "{bad}: {err}");
    }
    assert_eq!(
        "elasticbsp(7)"
            .parse::<PolicySpec>()
            .unwrap()
            .job_barriers(),
        Some(7)
    );
    assert_eq!("ssp(2)".parse::<PolicySpec>().unwrap().job_barriers(), None);
}

#[test]
fn projection_config_defaults_are_sane() {
    let c = ProjectionConfig::default();
    assert!(c.min_samples <= c.window && c.theta > 0.0 && c.persistent > 0.0);
}

#[test]
fn unknown_workers_are_ignored() {
    for mut p in [
        Box::new(epsp(2, 2, true, true)) as Box<dyn SyncPolicy>,
        Box::new(FlexRr::new(2, 1, 1, 0)),
    ] {
        let mut out = Vec::new();
        for ev in [
            Event::Push {
                worker: 9,
                clock: 0,
                at: 1,
            },
            Event::Pull {
                worker: 9,
                clock: 5,
                req: 1,
                at: 2,
            },
            Event::Leave { worker: 9, at: 3 },
            Event::Join {
                worker: 9,
                clock: 4,
                at: 4,
            },
        ] {
            p.on_event(ev, &mut out);
        }
        assert!(out.is_empty(), "{}: {out:?}", p.name());
        assert_eq!(p.parked(), 0);
    }
}
