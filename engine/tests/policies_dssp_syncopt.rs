//! DSSP and Sync-opt: property tests over random event traces (DSSP with `s_U = s_L` ≡ SSP,
//! Sync-opt without backups ≡ BSP, action for action) and hand-computed cases.

mod common;

use common::run;

use std::collections::HashMap;

use falcon_engine::sync::{Action, Bsp, Dssp, Event, FastPath, Ssp, SyncOpt, SyncPolicy};
use proptest::prelude::*;

/// The controller by brute force: the smallest `r` whose predicted push is nearest to any of
/// the slowest worker's predicted pushes.
fn controller_brute(p: [u64; 2], q: [u64; 2], r_max: u64) -> u64 {
    let ip = u128::from(p[0].saturating_sub(p[1]));
    let iq = u128::from(q[0].saturating_sub(q[1]));
    let mut best = (u128::MAX, 0);
    for r in 0..=r_max {
        let x = u128::from(p[0]) + u128::from(r) * ip;
        for k in 0..=r_max {
            let y = u128::from(q[0]) + (u128::from(k) + 1) * iq;
            if x.abs_diff(y) < best.0 {
                best = (x.abs_diff(y), r);
            }
        }
    }
    best.1
}

fn push(p: &mut dyn SyncPolicy, worker: u32, clock: u64, at: u64) -> Vec<Action> {
    let mut out = Vec::new();
    p.on_event(Event::Push { worker, clock, at }, &mut out);
    out
}

fn pull(p: &mut dyn SyncPolicy, worker: u32, clock: u64, req: u64, at: u64) -> Vec<Action> {
    let mut out = Vec::new();
    p.on_event(
        Event::Pull {
            worker,
            clock,
            req,
            at,
        },
        &mut out,
    );
    out
}

fn released(worker: u32, req: u64) -> Vec<Action> {
    vec![Action::Release { worker, req }]
}

fn parked(worker: u32, req: u64) -> Vec<Action> {
    vec![Action::Park { worker, req }]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn dssp_without_range_is_ssp_action_for_action(workers in 1u32..6, s in 0u64..4, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut ssp = Ssp::new(workers, s);
        let trace = run(&mut ssp, workers, Some(s), 12, &picks, false);
        let mut dssp = Dssp::new(workers, s, s);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            dssp.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
        prop_assert_eq!(dssp.parked(), 0);
        prop_assert_eq!(dssp.delayed_total(), ssp.delayed_total());
        prop_assert_eq!(dssp.extra_granted_total(), 0);
        prop_assert_eq!(dssp.fast_path(), ssp.fast_path());
    }

    #[test]
    fn dssp_never_exceeds_its_upper_bound(workers in 1u32..6, s_lower in 0u64..3, r_max in 0u64..6, fast: bool, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut p = Dssp::new(workers, s_lower, s_lower + r_max);
        run(&mut p, workers, Some(s_lower + r_max), 16, &picks, fast);
        prop_assert_eq!(p.parked(), 0);
        // Per-worker grants add up to the controller's total.
        prop_assert_eq!((0..workers).map(|w| p.grants(w)).sum::<u64>(), p.extra_granted_total());
    }

    #[test]
    fn dssp_controller_is_the_nearest_pair(p1 in 0u64..200, ip in 0u64..50, q1 in 0u64..200, iq in 0u64..80, r_max in 0u64..16) {
        let p = [p1 + ip, p1];
        let q = [q1 + iq, q1];
        let r = Dssp::controller(p, q, r_max);
        prop_assert!(r <= r_max);
        prop_assert_eq!(r, controller_brute(p, q, r_max));
    }

    #[test]
    fn syncopt_without_backups_is_bsp_action_for_action(workers in 1u32..6, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut bsp = Bsp::new(workers);
        let trace = run(&mut bsp, workers, Some(0), 10, &picks, false);
        let mut so = SyncOpt::new(workers, 0);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            so.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
        prop_assert_eq!(so.parked(), 0);
        prop_assert_eq!(so.dropped_total(), 0);
        prop_assert_eq!(so.delayed_total(), bsp.delayed_total());
        prop_assert_eq!(so.fast_path(), bsp.fast_path());
    }

    /// Folding changes what becomes of a late gradient, nothing else: on the same random run,
    /// `syncopt(B,fold)` answers exactly as `syncopt(B)` except that a gradient Sync-opt drops
    /// for coming too late (or for a step its worker already counted in) is folded instead;
    /// none is dropped but repeats.
    #[test]
    fn syncopt_with_folding_is_syncopt_with_late_gradients_folded(quorum in 1u32..5, backups in 1u32..3, fast: bool, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let total = quorum + backups;
        let mut plain = SyncOpt::new(total, backups);
        let mut folding = SyncOpt::new(total, backups).folding(true);
        let trace = run(&mut plain, total, None, 10, &picks, fast);
        let mut folds = 0u64;
        for (ev, expected) in trace {
            let mut out = Vec::new();
            folding.on_event(ev, &mut out);
            let want: Vec<Action> = expected
                .iter()
                .map(|a| match *a {
                    Action::DropGradient { worker, clock } => {
                        folds += 1;
                        Action::Fold { worker, clock }
                    }
                    other => other,
                })
                .collect();
            prop_assert_eq!(out, want, "event {:?}", ev);
        }
        prop_assert_eq!(folding.dropped_total(), 0);
        prop_assert_eq!(folding.folded_total(), folds);
        prop_assert_eq!(folds, plain.dropped_total());
        prop_assert_eq!(folding.version(), plain.version());
        prop_assert!(folding.name().ends_with(",fold)"), "{}", folding.name());
    }

    /// A repeat (a clock the worker pushed already) is still dropped, not folded: it is the
    /// same gradient again.
    #[test]
    fn syncopt_with_folding_drops_repeats(clock in 0u64..5) {
        let mut so = SyncOpt::new(3, 1).folding(true);
        for c in 0..=clock {
            push(&mut so, 0, c, 1);
        }
        prop_assert_eq!(push(&mut so, 0, clock, 2), vec![Action::DropGradient { worker: 0, clock }]);
        prop_assert_eq!(so.dropped_total(), 1);
    }

    #[test]
    fn syncopt_counts_each_gradient_for_the_version_it_was_computed_on(quorum in 1u32..5, backups in 0u32..3, fast: bool, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let total = quorum + backups;
        let iters = 10;
        let mut so = SyncOpt::new(total, backups);
        let trace = run(&mut so, total, None, iters, &picks, fast);
        // Model (the paper's rule): a released pull gives the worker the current version; its
        // next gradient belongs to step max(its clock, that version); a step takes the first
        // `quorum` gradients, at most one per worker; pulls at c wait for c steps.
        let n = total as usize;
        let mut version = 0u64;
        let mut counted: HashMap<u64, u32> = HashMap::new();
        let mut base = vec![0u64; n];
        let mut counted_in = vec![0u64; n];
        let mut pull_of: HashMap<u64, (usize, u64)> = HashMap::new();
        let (mut drops, mut counts) = (0u64, 0u64);
        for (ev, out) in &trace {
            match *ev {
                Event::Push { worker, clock, .. } => {
                    let w = worker as usize;
                    let step = clock.max(base[w]);
                    let open = counted.get(&step).copied().unwrap_or(0) < quorum && step >= version;
                    if open && step >= counted_in[w] {
                        counts += 1;
                        *counted.entry(step).or_default() += 1;
                        counted_in[w] = step + 1;
                        if step != clock {
                            prop_assert!(out.contains(&Action::CountFor { worker, clock, step }), "{:?}", out);
                        }
                        let dropped = out.iter().any(|a| matches!(a, Action::DropGradient { .. }));
                        prop_assert!(!dropped, "a counting gradient dropped: {:?}", out);
                        while counted.get(&version).copied().unwrap_or(0) >= quorum {
                            version += 1;
                        }
                    } else {
                        drops += 1;
                        prop_assert_eq!(out, &vec![Action::DropGradient { worker, clock }]);
                    }
                }
                Event::Pull { worker, clock, req, .. } => {
                    pull_of.insert(req, (worker as usize, clock));
                }
                _ => {}
            }
            for a in out {
                if let Action::Release { req, .. } = *a {
                    let (w, c) = pull_of[&req];
                    prop_assert!(c <= version, "pull at {} released at version {}", c, version);
                    base[w] = version;
                }
            }
        }
        prop_assert_eq!(so.dropped_total(), drops);
        prop_assert_eq!(so.version(), version);
        prop_assert_eq!(drops + counts, u64::from(total) * iters);
        prop_assert!(version >= iters, "every clock of the fastest got its step");
        prop_assert_eq!(so.parked(), 0);
        if backups > 0 {
            prop_assert_eq!(so.fast_path(), FastPath::Never);
        }
    }
}

/// The paper's minimal case: N = 1 gradient per step, 2 backups (3 workers). Worker 2 pushes
/// clocks 0 and 1: the version reaches 2. Worker 1's clock-0 gradient is stale (dropped).
/// Worker 1 pulls at clock 1 and is released at once with the version-2 parameters, so its
/// next gradient (its clock 1) is a fresh gradient for step 2: it counts, and makes step 2.
#[test]
fn syncopt_counts_a_released_backups_gradient_for_the_current_step() {
    let mut so = SyncOpt::new(3, 2);
    for w in 0..3 {
        assert_eq!(
            pull(&mut so, w, 0, 10 + u64::from(w), 0),
            released(w, 10 + u64::from(w))
        );
    }
    assert!(push(&mut so, 2, 0, 1).is_empty());
    assert_eq!(pull(&mut so, 2, 1, 20, 1), released(2, 20));
    assert!(push(&mut so, 2, 1, 2).is_empty());
    assert_eq!(so.version(), 2);
    assert_eq!(
        push(&mut so, 1, 0, 3),
        vec![Action::DropGradient {
            worker: 1,
            clock: 0
        }]
    );
    assert_eq!(
        pull(&mut so, 1, 1, 21, 3),
        released(1, 21),
        "a backup is never held"
    );
    assert_eq!(
        push(&mut so, 1, 1, 4),
        vec![Action::CountFor {
            worker: 1,
            clock: 1,
            step: 2
        }],
        "computed on version 2: it counts for step 2"
    );
    assert_eq!(so.version(), 3);
    assert_eq!(so.dropped_total(), 1);
    // Worker 2's pull at its clock 2 is released at version 3: its gradient is for step 3.
    assert_eq!(pull(&mut so, 2, 2, 22, 4), released(2, 22));
    assert_eq!(
        push(&mut so, 2, 2, 5),
        vec![Action::CountFor {
            worker: 2,
            clock: 2,
            step: 3
        }]
    );
    assert_eq!(so.version(), 4);
}

/// A backup that pulls again before its step completes has the same parameters: its second
/// gradient for that step is dropped (a worker counts once per step), and its pulls are never
/// held.
#[test]
fn syncopt_counts_a_worker_once_per_step() {
    let mut so = SyncOpt::new(3, 1); // N = 2
    for w in 0..3 {
        assert_eq!(
            pull(&mut so, w, 0, 10 + u64::from(w), 0),
            released(w, 10 + u64::from(w))
        );
    }
    // Workers 0 and 2 make steps 0 and 1; worker 1 lags.
    for c in 0..2 {
        push(&mut so, 0, c, 1 + c);
        push(&mut so, 2, c, 1 + c);
        assert_eq!(pull(&mut so, 0, c + 1, 30 + c, 1 + c), released(0, 30 + c));
        assert_eq!(pull(&mut so, 2, c + 1, 40 + c, 1 + c), released(2, 40 + c));
    }
    assert_eq!(so.version(), 2);
    assert_eq!(
        push(&mut so, 1, 0, 5),
        vec![Action::DropGradient {
            worker: 1,
            clock: 0
        }]
    );
    assert_eq!(pull(&mut so, 1, 1, 50, 5), released(1, 50));
    assert_eq!(
        push(&mut so, 1, 1, 6),
        vec![Action::CountFor {
            worker: 1,
            clock: 1,
            step: 2
        }]
    );
    // Step 2 still open (1 of 2): worker 1's next pull is released with version 2 again.
    assert_eq!(pull(&mut so, 1, 2, 51, 6), released(1, 51));
    assert_eq!(
        push(&mut so, 1, 2, 7),
        vec![Action::DropGradient {
            worker: 1,
            clock: 2
        }]
    );
    // Worker 0 completes step 2 with worker 1's gradient.
    assert!(push(&mut so, 0, 2, 8).is_empty());
    assert_eq!(so.version(), 3);
}

#[test]
fn dssp_controller_hand_computed() {
    // p every 10 (last at 100), q every 19 (last at 93), r_max = 4:
    // SimP = 100 110 120 130 140, SimQ = 112 131 150 169 188; |130 − 131| = 1 is the nearest.
    assert_eq!(Dssp::controller([100, 90], [93, 74], 4), 3);
    // A 2:1 speed ratio (10 vs 20): SimP = 60 70 80 90 100, SimQ = 67 87 107 127 147;
    // r = 1 and r = 3 are both 3 away, the smaller wins.
    assert_eq!(Dssp::controller([60, 50], [47, 27], 4), 1);
    // One step later: SimP = 70 80 90 100 110, SimQ = 87 107 127 147 167; r = 2 (and 4) 3 away.
    assert_eq!(Dssp::controller([70, 60], [67, 47], 4), 2);
    // q's next push is due right now: wait.
    assert_eq!(Dssp::controller([100, 90], [80, 60], 4), 0);
    // No range, or p's interval is 0 (every r predicts the same time): 0.
    assert_eq!(Dssp::controller([100, 90], [93, 74], 0), 0);
    assert_eq!(Dssp::controller([100, 100], [93, 74], 4), 0);
}

/// Two workers at a 2:1 speed ratio, `[s_L, s_U] = [3, 7]`: worker 0 pushes iteration `c` at
/// `10(c + 1)`, worker 1 pushes iteration `k` at `27 + 20k`; each pulls its next clock at
/// once. Under SSP(3) worker 0 would block at clock 6 (gap 4); DSSP lets it run, with the
/// grants computed by hand in the comments, until the gap would pass `s_U`.
#[test]
fn dssp_two_workers_at_two_to_one() {
    let mut p = Dssp::new(2, 3, 7);
    let mut req = 0;
    assert_eq!(pull(&mut p, 0, 0, 100, 0), released(0, 100));
    assert_eq!(pull(&mut p, 1, 0, 200, 0), released(1, 200));
    let mut slow = 0u64; // worker 1's next iteration
    // (worker 0's clock, expected controller calls, extra iterations granted, grant left,
    // released?) after each of worker 0's pushes.
    let expect = [
        (0, 0, 0, 0, true),
        (1, 0, 0, 0, true),
        (2, 0, 0, 0, true),
        (3, 0, 0, 0, true),
        (4, 0, 0, 0, true),
        // t = 60: gap 4 > s_L, A_p = [60, 50], A_q = [47, 27]: r* = 1, spent on this pull.
        (5, 1, 1, 0, true),
        // t = 70: gap 4, A_p = [70, 60], A_q = [67, 47]: r* = 2, one left.
        (6, 2, 3, 1, true),
        // t = 80: the grant's second iteration (gap 5).
        (7, 2, 3, 0, true),
        // t = 90: gap 5, r limited to 0..=3 (s_U + 1 − 5): SimP 90 100 110 120 vs SimQ 107
        // 127…: r* = 2.
        (8, 3, 5, 1, true),
        (9, 3, 5, 0, true),
        // t = 110: gap 6, r ≤ 2: SimP 110 120 130 vs 127 147: r* = 2.
        (10, 4, 7, 1, true),
        // t = 120: pull 12 at gap 7 = s_U.
        (11, 4, 7, 0, true),
        // t = 130: gap 7, r ≤ 1: SimP 130 140 vs 147: r* = 1.
        (12, 5, 8, 0, true),
        // t = 140: gap 8, r ≤ 0: hold.
        (13, 6, 8, 0, false),
    ];
    for (c, calls, extra, left, ok) in expect {
        let at = 10 * (c + 1);
        while 27 + 20 * slow < at {
            let t = 27 + 20 * slow;
            assert!(push(&mut p, 1, slow, t).is_empty());
            slow += 1;
            req += 1;
            assert_eq!(pull(&mut p, 1, slow, req, t), released(1, req));
        }
        assert!(push(&mut p, 0, c, at).is_empty());
        req += 1;
        let out = pull(&mut p, 0, c + 1, req, at);
        assert_eq!(
            out,
            if ok { released(0, req) } else { parked(0, req) },
            "worker 0's pull at {} (t = {at})",
            c + 1
        );
        assert_eq!(p.controller_calls(), calls, "calls after push {c}");
        assert_eq!(p.extra_granted_total(), extra, "extra after push {c}");
        assert_eq!(p.grant(0), left, "grant left after push {c}");
    }
    // Worker 0 waits at clock 14 until worker 1 has 11 gradients in (gap back to s_L): its
    // pushes at 147, 167, 187 and 207 do not release it; the one at 227 does.
    let held = req;
    for k in 6..=10 {
        let t = 27 + 20 * k;
        let out = push(&mut p, 1, k, t);
        if k < 10 {
            assert!(out.is_empty(), "released too early at {t}");
        } else {
            assert_eq!(out, released(0, held));
        }
    }
    assert_eq!(p.delayed_total(), 1);
    // SSP(3) would have held worker 0 at clock 6 already.
    let mut ssp = Ssp::new(2, 3);
    push(&mut ssp, 1, 0, 27);
    push(&mut ssp, 1, 1, 47);
    for c in 0..6 {
        push(&mut ssp, 0, c, 10 * (c + 1));
    }
    assert_eq!(pull(&mut ssp, 0, 6, 1, 60), parked(0, 1));
}

/// Worker 0 (every 10) and worker 1 (every 19), `[s_L, s_U] = [1, 5]`.
fn dssp_until_first_grant(workers: u32) -> (Dssp, Vec<Action>) {
    let mut p = Dssp::new(workers, 1, 5);
    for w in 0..workers {
        assert_eq!(
            pull(&mut p, w, 0, 100 + u64::from(w), 0),
            released(w, 100 + u64::from(w))
        );
    }
    assert!(push(&mut p, 0, 0, 60).is_empty());
    assert_eq!(pull(&mut p, 0, 1, 1, 60), released(0, 1));
    for w in 1..workers {
        assert!(push(&mut p, w, 0, 74).is_empty());
        assert_eq!(
            pull(&mut p, w, 1, 10 + u64::from(w), 74),
            released(w, 10 + u64::from(w))
        );
    }
    assert!(push(&mut p, 0, 1, 80).is_empty());
    assert_eq!(pull(&mut p, 0, 2, 2, 80), released(0, 2), "gap 1 = s_L");
    // Gap 2: the controller runs, but worker 1 has one push only: no grant (SSP(1)).
    assert!(push(&mut p, 0, 2, 90).is_empty());
    assert_eq!(p.controller_calls(), 1);
    assert_eq!(pull(&mut p, 0, 3, 3, 90), parked(0, 3));
    let mut out = Vec::new();
    for w in 1..workers {
        out = push(&mut p, w, 1, 93);
    }
    assert_eq!(out, released(0, 3), "gap back to s_L");
    // Gap 2 again, now with two pushes each: A_p = [100, 90], A_q = [93, 74]: r* = 3.
    assert!(push(&mut p, 0, 3, 100).is_empty());
    assert_eq!(p.controller_calls(), 2);
    assert_eq!(p.extra_granted_total(), 3);
    assert_eq!(p.grant(0), 2, "the granting push is the first of the 3");
    let out = pull(&mut p, 0, 4, 4, 100);
    (p, out)
}

#[test]
fn dssp_grants_nothing_before_two_pushes_then_grants_r_star_iterations() {
    let (mut p, out) = dssp_until_first_grant(2);
    assert_eq!(out, released(0, 4), "gap 2 > s_L, granted");
    // The grant's other two iterations (gaps 3 and 4), then worker 0 is held again.
    assert!(push(&mut p, 0, 4, 110).is_empty());
    assert_eq!(pull(&mut p, 0, 5, 5, 110), released(0, 5));
    assert!(push(&mut p, 0, 5, 120).is_empty());
    assert_eq!(pull(&mut p, 0, 6, 6, 120), released(0, 6));
    assert_eq!(p.grant(0), 0);
    // t = 130, gap 5: r ≤ 1; SimP 130 140 vs SimQ 112 131 150…: r* = 0.
    assert!(push(&mut p, 0, 6, 130).is_empty());
    assert_eq!(p.controller_calls(), 3);
    assert_eq!(pull(&mut p, 0, 7, 7, 130), parked(0, 7));
    assert_eq!(p.extra_granted_total(), 3);
}

#[test]
fn dssp_a_worker_first_blocked_at_its_first_push_gets_no_grant() {
    // s_L = 0: worker 0 is past the bound after one push, with one timestamp only.
    let mut p = Dssp::new(2, 0, 10);
    assert_eq!(pull(&mut p, 0, 0, 1, 0), released(0, 1));
    assert!(push(&mut p, 0, 0, 10).is_empty());
    assert_eq!(p.controller_calls(), 1);
    assert_eq!(pull(&mut p, 0, 1, 2, 10), parked(0, 2));
    assert_eq!(push(&mut p, 1, 0, 50), released(0, 2));
    assert_eq!(p.extra_granted_total(), 0);
}

#[test]
fn dssp_grant_counts_down_on_every_push_even_inside_s_lower() {
    let (mut p, out) = dssp_until_first_grant(2);
    assert_eq!(out, released(0, 4));
    // Worker 1 catches up (applied 4): worker 0's next push is inside s_L, yet, as in the
    // paper, it spends a granted iteration.
    push(&mut p, 1, 2, 101);
    push(&mut p, 1, 3, 102);
    assert!(push(&mut p, 0, 4, 110).is_empty());
    assert_eq!(p.grant(0), 1);
    assert_eq!(pull(&mut p, 0, 5, 5, 110), released(0, 5));
}

#[test]
fn dssp_grant_is_kept_when_no_longer_the_fastest() {
    let (mut p, out) = dssp_until_first_grant(3);
    assert_eq!(out, released(0, 4));
    // Worker 2 comes back far ahead: worker 0 is no longer the fastest, but spends its grant.
    let mut none = Vec::new();
    p.on_event(
        Event::Join {
            worker: 2,
            clock: 10,
            at: 105,
        },
        &mut none,
    );
    assert!(none.is_empty());
    assert!(push(&mut p, 0, 4, 110).is_empty());
    assert_eq!(pull(&mut p, 0, 5, 5, 110), released(0, 5), "gap 3, granted");
    assert!(push(&mut p, 0, 5, 120).is_empty());
    assert_eq!(pull(&mut p, 0, 6, 6, 120), released(0, 6), "gap 4, granted");
    // Grant spent; not the fastest, so no controller: held.
    assert!(push(&mut p, 0, 6, 130).is_empty());
    assert_eq!(p.controller_calls(), 2);
    assert_eq!(pull(&mut p, 0, 7, 7, 130), parked(0, 7));
}

#[test]
fn dssp_fast_path_is_the_lower_bound() {
    assert_eq!(Dssp::new(4, 3, 15).fast_path(), FastPath::Within(3));
    assert_eq!(Dssp::new(4, 3, 15).name(), "dssp(3,15)");
    assert_eq!(Dssp::new(4, 3, 15).r_max(), 12);
}

#[test]
fn syncopt_drops_the_late_gradients_and_counts_them() {
    // N = 2 of 3 workers.
    let mut p = SyncOpt::new(3, 1);
    assert_eq!(p.quorum(), 2);
    assert_eq!(p.backups(), 1);
    for w in 0..3 {
        assert_eq!(
            pull(&mut p, w, 0, u64::from(w), 0),
            released(w, u64::from(w))
        );
    }
    assert!(push(&mut p, 0, 0, 1).is_empty());
    assert_eq!(
        pull(&mut p, 0, 1, 10, 1),
        parked(0, 10),
        "step 0 has 1 of 2"
    );
    assert_eq!(push(&mut p, 1, 0, 2), released(0, 10), "step 0 complete");
    assert_eq!(p.version(), 1);
    assert_eq!(
        push(&mut p, 2, 0, 3),
        vec![Action::DropGradient {
            worker: 2,
            clock: 0
        }],
        "the third gradient of step 0 is late"
    );
    assert_eq!(p.dropped_total(), 1);
    // The straggler is not held: its pull at 1 is answered, and its gradient for 1 is early
    // enough this time.
    assert_eq!(pull(&mut p, 2, 1, 11, 3), released(2, 11));
    assert!(push(&mut p, 2, 1, 4).is_empty());
    assert_eq!(pull(&mut p, 2, 2, 12, 4), parked(2, 12));
    assert_eq!(push(&mut p, 0, 1, 5), released(2, 12));
    assert_eq!(p.version(), 2);
    assert_eq!(
        push(&mut p, 1, 1, 6),
        vec![Action::DropGradient {
            worker: 1,
            clock: 1
        }]
    );
    // A repeated gradient is dropped too, even for a step still open.
    assert_eq!(pull(&mut p, 0, 2, 13, 7), released(0, 13));
    assert!(push(&mut p, 0, 2, 8).is_empty());
    assert_eq!(
        push(&mut p, 0, 2, 9),
        vec![Action::DropGradient {
            worker: 0,
            clock: 2
        }]
    );
    assert_eq!(p.version(), 2);
    assert_eq!(p.dropped_total(), 3);
    assert_eq!(p.delayed_total(), 2);
    assert_eq!(p.parked(), 0);
    assert_eq!(p.name(), "syncopt(2+1)");
    // Every pull must reach the policy: it tells each worker's gradient its version.
    assert_eq!(p.fast_path(), FastPath::Never);
    assert_eq!(SyncOpt::new(3, 0).fast_path(), FastPath::Within(0));
}

#[test]
fn syncopt_counts_at_most_n_gradients_for_a_step_not_yet_open() {
    // Gradients for a clock ahead of the version (e.g. from workers that joined ahead) count
    // toward that step, but only the first N of them.
    let mut p = SyncOpt::new(3, 1);
    for w in 0..2 {
        assert!(push(&mut p, w, 5, 1).is_empty());
    }
    assert_eq!(
        push(&mut p, 2, 5, 2),
        vec![Action::DropGradient {
            worker: 2,
            clock: 5
        }]
    );
    assert_eq!(p.version(), 0, "steps 0..5 are still open");
    assert_eq!(p.dropped_total(), 1);
}

#[test]
fn syncopt_with_fewer_live_workers_than_the_quorum_still_progresses() {
    let mut p = SyncOpt::new(3, 1);
    assert!(push(&mut p, 0, 0, 1).is_empty());
    assert_eq!(pull(&mut p, 0, 1, 1, 1), parked(0, 1));
    let mut out = Vec::new();
    p.on_event(Event::Leave { worker: 1, at: 2 }, &mut out);
    assert!(out.is_empty(), "2 live workers still make a quorum of 2");
    p.on_event(Event::Leave { worker: 2, at: 3 }, &mut out);
    assert_eq!(
        out,
        released(0, 1),
        "one live worker: its gradient is enough"
    );
    assert_eq!(p.version(), 1);
}

#[test]
fn unknown_workers_are_ignored() {
    let evs = [
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
        Event::Tick { at: 5 },
    ];
    let mut dssp = Dssp::new(2, 1, 4);
    let mut so = SyncOpt::new(2, 1);
    for ev in evs {
        let mut out = Vec::new();
        dssp.on_event(ev, &mut out);
        so.on_event(ev, &mut out);
        assert!(out.is_empty(), "{ev:?} gave {out:?}");
    }
    assert_eq!(dssp.grant(9), 0);
    assert_eq!((dssp.parked(), so.parked(), so.dropped_total()), (0, 0, 0));
    assert_eq!(so.version(), 0);
}

/// A grant given while a worker was gone is re-checked when it comes back: under DSSP(1,5)
/// worker 2 leaves at the start, worker 0 earns a grant of 3 against worker 1 (the sequence
/// of `dssp_until_first_grant`), then worker 2 rejoins at clock 0. The grant still covers
/// clocks 4 to 6, but clock 6 is 6 past worker 2: that pull waits until worker 2 pushes.
#[test]
fn dssp_a_grant_is_rechecked_when_a_worker_rejoins() {
    let mut p = Dssp::new(3, 1, 5);
    for w in 0..3 {
        assert_eq!(
            pull(&mut p, w, 0, 100 + u64::from(w), 0),
            released(w, 100 + u64::from(w))
        );
    }
    let mut none = Vec::new();
    p.on_event(Event::Leave { worker: 2, at: 1 }, &mut none);
    assert!(push(&mut p, 0, 0, 60).is_empty());
    assert_eq!(pull(&mut p, 0, 1, 1, 60), released(0, 1));
    assert!(push(&mut p, 1, 0, 74).is_empty());
    assert_eq!(pull(&mut p, 1, 1, 11, 74), released(1, 11));
    assert!(push(&mut p, 0, 1, 80).is_empty());
    assert_eq!(pull(&mut p, 0, 2, 2, 80), released(0, 2));
    assert!(push(&mut p, 0, 2, 90).is_empty());
    assert_eq!(pull(&mut p, 0, 3, 3, 90), parked(0, 3));
    assert_eq!(push(&mut p, 1, 1, 93), released(0, 3));
    assert!(push(&mut p, 0, 3, 100).is_empty());
    assert_eq!(
        p.extra_granted_total(),
        3,
        "a grant of 3 while worker 2 is gone"
    );
    // Worker 2 comes back at clock 0: the live minimum falls from 2 to 0.
    p.on_event(
        Event::Join {
            worker: 2,
            clock: 0,
            at: 101,
        },
        &mut none,
    );
    assert_eq!(pull(&mut p, 0, 4, 4, 101), released(0, 4), "gap 4 ≤ s_U");
    assert!(push(&mut p, 0, 4, 110).is_empty());
    assert_eq!(pull(&mut p, 0, 5, 5, 110), released(0, 5), "gap 5 = s_U");
    assert!(push(&mut p, 0, 5, 120).is_empty());
    assert_eq!(
        pull(&mut p, 0, 6, 6, 120),
        parked(0, 6),
        "granted, but 6 past worker 2: beyond s_U = 5"
    );
    assert_eq!(
        push(&mut p, 2, 0, 125),
        released(0, 6),
        "worker 2 at 1: gap 5"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random traces in which workers leave and come back (at the clock they had, or at 0):
    /// no pull of a live worker is ever released more than `s_U` past the live minimum.
    #[test]
    fn dssp_never_exceeds_its_upper_bound_across_leaves_and_rejoins(
        workers in 2u32..5,
        s_lower in 0u64..3,
        r_max in 0u64..5,
        picks in prop::collection::vec(0u32..1000, 50..400),
    ) {
        #[derive(Clone, Copy, PartialEq)]
        enum St { Pull, Parked(u64), Push, Gone }
        let n = workers as usize;
        let s_upper = s_lower + r_max;
        let mut p = Dssp::new(workers, s_lower, s_upper);
        let mut st = vec![St::Pull; n];
        let mut clock = vec![0u64; n];
        let mut applied = vec![0u64; n];
        let mut pulls: HashMap<u64, (usize, u64)> = HashMap::new();
        let (mut req, mut t) = (0u64, 0u64);
        for (i, &pick) in picks.iter().enumerate() {
            t += 1 + u64::from(pick % 7);
            let w = pick as usize % n;
            let mut out = Vec::new();
            match st[w] {
                St::Pull => {
                    req += 1;
                    pulls.insert(req, (w, clock[w]));
                    p.on_event(Event::Pull { worker: w as u32, clock: clock[w], req, at: t }, &mut out);
                    st[w] = St::Parked(req);
                }
                St::Push if i % 13 == 5 => {
                    p.on_event(Event::Leave { worker: w as u32, at: t }, &mut out);
                    st[w] = St::Gone;
                }
                St::Push => {
                    p.on_event(Event::Push { worker: w as u32, clock: clock[w], at: t }, &mut out);
                    clock[w] += 1;
                    applied[w] = applied[w].max(clock[w]);
                    st[w] = St::Pull;
                }
                St::Gone => {
                    let at = if pick % 2 == 0 { 0 } else { clock[w] };
                    p.on_event(Event::Join { worker: w as u32, clock: at, at: t }, &mut out);
                    applied[w] = applied[w].max(at);
                    st[w] = St::Pull;
                }
                St::Parked(_) => {}
            }
            let min = (0..n).filter(|&j| st[j] != St::Gone).map(|j| applied[j]).min().unwrap_or(u64::MAX);
            for a in out {
                if let Action::Release { req: r, .. } = a {
                    let (wk, c) = pulls[&r];
                    if st[wk] == St::Parked(r) {
                        prop_assert!(c <= min.saturating_add(s_upper),
                            "worker {} released at clock {} with live minimum {}, s_U {}", wk, c, min, s_upper);
                        st[wk] = St::Push;
                    }
                }
            }
        }
    }
}

/// A server restarted from its checkpoint tells its Sync-opt instance the steps it had
/// applied and the gradients it still holds: pulls of the next clocks are answered as before
/// the restart instead of waiting for a step 0 nobody pushes again.
#[test]
fn syncopt_resumes_from_a_checkpoints_steps() {
    let mut so = SyncOpt::new(3, 1); // N = 2
    let mut none = Vec::new();
    for w in 0..3 {
        so.on_event(
            Event::Join {
                worker: w,
                clock: 5,
                at: 0,
            },
            &mut none,
        );
    }
    so.restored(5, &[(5, vec![0])], &mut Vec::new());
    assert_eq!(so.version(), 5);
    assert_eq!(pull(&mut so, 1, 5, 1, 1), released(1, 1));
    assert_eq!(pull(&mut so, 0, 6, 2, 1), parked(0, 2));
    // Worker 1's gradient joins worker 0's held one: step 5 is complete.
    assert_eq!(push(&mut so, 1, 5, 2), released(0, 2));
    assert_eq!(so.version(), 6);
    // Worker 0's next push (its clock 6) counts for step 6, and worker 2's completes it.
    assert!(push(&mut so, 0, 6, 3).is_empty());
    assert_eq!(so.version(), 6);
    assert!(push(&mut so, 2, 6, 4).is_empty());
    assert_eq!(so.version(), 7);
}

/// `syncopt(auto)`: the persistent stragglers the projection finds become the backups — their
/// late gradients dropped, steps at the others' pace, as a hand-tuned `syncopt(2)`.
#[test]
fn syncopt_auto_takes_the_persistent_stragglers_as_backups() {
    let base = [100, 100, 100, 100, 100, 100, 250, 250];
    // When worker 0 pushes its last (60th) iteration: the pace of the steps.
    let paced = |p: &mut dyn SyncPolicy, drops: &mut Vec<u64>| {
        let mut done = 0;
        common::timed_run_with(p, &base, 60, 3, &mut |_, ev, acts| {
            if let Event::Push {
                worker: 0,
                clock: 59,
                at,
            } = *ev
            {
                done = at;
            }
            for a in acts {
                if let Action::DropGradient { worker, .. } = *a {
                    drops[worker as usize] += 1;
                }
            }
        });
        done
    };
    let mut drops = vec![0u64; base.len()];
    let mut auto = SyncOpt::auto(8);
    let auto_done = paced(&mut auto, &mut drops);
    // The stragglers' late gradients are dropped; a pioneer's only at the run's end, where the
    // harness's workers leave one by one after their last push (plain Sync-opt does the same).
    assert!(drops[..6].iter().all(|&d| d <= 1), "{drops:?}");
    assert!(drops[6] >= 30 && drops[7] >= 30, "{drops:?}");
    assert_eq!(auto.name(), "syncopt(auto)");
    let bsp_done = paced(&mut Bsp::new(8), &mut vec![0; 8]);
    let tuned_done = paced(&mut SyncOpt::new(8, 2), &mut vec![0; 8]);
    assert!(
        (auto_done as f64) < 0.6 * bsp_done as f64,
        "auto {auto_done}, bsp {bsp_done}"
    );
    assert!(
        (auto_done as f64) < 1.15 * tuned_done as f64,
        "auto {auto_done}, syncopt(2) {tuned_done}"
    );
}

/// Without persistent stragglers (iterations within 20 % of each other) `syncopt(auto)` has
/// no backups: Sync-opt without backups — BSP's steps — action for action.
#[test]
fn syncopt_auto_without_stragglers_is_bsp() {
    let base = [100; 6];
    let trace = |p: &mut SyncOpt| {
        let mut all = Vec::new();
        let end = common::timed_run_with(p, &base, 40, 9, &mut |_, ev, acts| {
            all.push((*ev, acts.to_vec()));
        });
        (end, all)
    };
    let mut auto = SyncOpt::auto(6);
    let (end_auto, auto_trace) = trace(&mut auto);
    let (end_plain, plain_trace) = trace(&mut SyncOpt::new(6, 0));
    assert_eq!(auto.backups(), 0);
    assert_eq!(auto_trace, plain_trace);
    assert_eq!(end_auto, end_plain);
    assert_eq!(end_auto, common::timed_run(&mut Bsp::new(6), &base, 40, 9));
}
