//! Property tests of the staleness policies over random per-worker delays.

mod common;

use common::run;

use falcon_engine::sync::{Action, Asp, Bsp, Event, Ssp, SyncPolicy};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn ssp_never_violates_its_bound(workers in 1u32..6, s in 0u64..4, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut p = Ssp::new(workers, s);
        run(&mut p, workers, Some(s), 12, &picks, false);
        // With the workers' lock-free check in front: the policy must agree with it.
        let mut q = Ssp::new(workers, s);
        run(&mut q, workers, Some(s), 12, &picks, true);
        prop_assert_eq!(p.parked(), 0);
    }

    #[test]
    fn ssp_zero_is_bsp_action_for_action(workers in 1u32..6, picks in prop::collection::vec(0u32..1000, 1..200)) {
        let mut ssp = Ssp::new(workers, 0);
        let trace = run(&mut ssp, workers, Some(0), 10, &picks, false);
        let mut bsp = Bsp::new(workers);
        for (ev, expected) in trace {
            let mut out = Vec::new();
            bsp.on_event(ev, &mut out);
            prop_assert_eq!(out, expected, "event {:?}", ev);
        }
    }

    #[test]
    fn asp_never_parks(workers in 1u32..6, picks in prop::collection::vec(0u32..1000, 1..100)) {
        let mut p = Asp;
        let trace = run(&mut p, workers, None, 8, &picks, false);
        let all_released = trace.iter().all(|(_, a)| a.iter().all(|x| matches!(x, Action::Release { .. })));
        prop_assert!(all_released);
        prop_assert_eq!(p.delayed_total(), 0);
    }
}

#[test]
fn ssp_bound_is_inclusive() {
    // Worker 1 at clock 2 with s = 1: allowed when worker 0 has applied 1 gradient, parked at 0.
    let mut p = Ssp::new(2, 1);
    let mut out = Vec::new();
    p.on_event(
        Event::Push {
            worker: 1,
            clock: 0,
            at: 0,
        },
        &mut out,
    );
    p.on_event(
        Event::Push {
            worker: 1,
            clock: 1,
            at: 1,
        },
        &mut out,
    );
    p.on_event(
        Event::Pull {
            worker: 1,
            clock: 2,
            req: 7,
            at: 2,
        },
        &mut out,
    );
    assert_eq!(
        out,
        vec![Action::Park { worker: 1, req: 7 }],
        "min applied 0 < 2 - 1"
    );
    out.clear();
    p.on_event(
        Event::Push {
            worker: 0,
            clock: 0,
            at: 3,
        },
        &mut out,
    );
    assert_eq!(
        out,
        vec![Action::Release { worker: 1, req: 7 }],
        "min applied 1 ≥ 2 - 1"
    );
    assert_eq!(p.delayed_total(), 1);
}

#[test]
fn a_departed_worker_no_longer_holds_the_others() {
    let mut p = Bsp::new(3);
    let mut out = Vec::new();
    for w in 0..2 {
        p.on_event(
            Event::Push {
                worker: w,
                clock: 0,
                at: 0,
            },
            &mut out,
        );
    }
    p.on_event(
        Event::Pull {
            worker: 0,
            clock: 1,
            req: 1,
            at: 1,
        },
        &mut out,
    );
    assert_eq!(out, vec![Action::Park { worker: 0, req: 1 }]);
    out.clear();
    p.on_event(Event::Leave { worker: 2, at: 2 }, &mut out);
    assert_eq!(out, vec![Action::Release { worker: 0, req: 1 }]);
    // Unknown workers are ignored, not a panic.
    p.on_event(
        Event::Push {
            worker: 99,
            clock: 0,
            at: 3,
        },
        &mut out,
    );
}

#[test]
fn policy_specs_parse_and_build() {
    use falcon_engine::sync::{PauseSpec, PolicySpec};
    let cases = [
        ("bsp", PolicySpec::Bsp),
        ("ASP", PolicySpec::Asp),
        ("ssp(3)", PolicySpec::Ssp { s: 3 }),
        (
            "dssp(3, 15)",
            PolicySpec::Dssp {
                s_lower: 3,
                s_upper: 15,
            },
        ),
        (
            "fluentps(3)",
            PolicySpec::FluentPs {
                s: 3,
                pause: PauseSpec::RawSsp,
            },
        ),
        (
            "fluentps(3,p=0.5)",
            PolicySpec::FluentPs {
                s: 3,
                pause: PauseSpec::Fastest { permille: 500 },
            },
        ),
        (
            "fluentps(3,sigmoid)",
            PolicySpec::FluentPs {
                s: 3,
                pause: PauseSpec::Sigmoid,
            },
        ),
    ];
    for (text, spec) in cases {
        assert_eq!(text.parse::<PolicySpec>().unwrap(), spec, "{text}");
        assert!(!spec.build_for(4, 7).name().is_empty());
    }
    for bad in [
        "ssp",
        "ssp(x)",
        "dssp(5,3)",
        "fluentps(3,p=2)",
        "zz",
        "elastic()",
    ] {
        assert!(bad.parse::<PolicySpec>().is_err(), "{bad} must be refused");
    }
}
