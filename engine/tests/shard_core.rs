//! The shard state machine that servers and the simulator share: one random stream of inputs
//! through the core over the servers' seqlocked regions and through the core over the
//! simulator's vector gives the same outputs and the same bits; and the rules the core owns
//! (exactly-once, rank-ordered aggregation, the memory cap, refusals) hold on their own.

use std::sync::Arc;

use falcon_engine::proto::AckOf;
use falcon_engine::shard::{
    Grad, GradSlot, Input, Output, RegionParams, ShardConfig, ShardCore, ShardParams, VecParams,
};
use falcon_engine::sync::PolicySpec;
use falcon_engine::update::{
    Aggregate, Constant, Optimizer, ScaleSpec, ShardOptimizer, UpdateMode, aggregate,
};
use proptest::prelude::*;

const LEN: usize = 37;

fn core(policy: &str, workers: u32, opt: Optimizer, agg: Aggregate, cap: u64) -> ShardCore {
    let spec: PolicySpec = policy.parse().expect("a policy");
    let mode = spec.update_mode();
    let cfg = ShardConfig {
        id: 3,
        len: LEN,
        workers,
        mode,
        aggregate: agg,
        max_pending_bytes: cap,
    };
    let scale = if policy.starts_with("asp") {
        ScaleSpec::DynSgd.build()
    } else {
        ScaleSpec::Unscaled.build()
    };
    ShardCore::new(
        cfg,
        spec.build_for(workers, 3),
        ShardOptimizer::new(opt, Arc::new(Constant), LEN),
        scale,
    )
}

/// One step of a random stream, resolved against the stream's own bookkeeping into an
/// [`Input`] (mostly valid pushes, with repeats, gaps, pulls from the future, deaths, rejoins
/// and reattachments mixed in).
#[derive(Clone, Debug)]
enum Op {
    Push { w: u32, how: u8, on: u8, seed: u64 },
    Help { w: u32, seed: u64 },
    Pull { w: u32, ahead: bool },
    Leave { w: u32 },
    Rejoin { w: u32 },
    Reattach { w: u32, extra: u8 },
    Init { w: u32, seed: u64 },
}

fn op(workers: u32) -> impl Strategy<Value = Op> {
    let w = 0..workers;
    prop_oneof![
        20 => steady(workers),
        1 => w.clone().prop_map(|w| Op::Leave { w }),
        1 => w.prop_map(|w| Op::Rejoin { w }),
    ]
}

/// Steps of a stream without deaths and rejoins.
fn steady(workers: u32) -> impl Strategy<Value = Op> {
    let w = 0..workers;
    prop_oneof![
        8 => (w.clone(), 0u8..10, 0u8..4, any::<u64>()).prop_map(|(w, how, on, seed)| Op::Push { w, how, on, seed }),
        1 => (w.clone(), any::<u64>()).prop_map(|(w, seed)| Op::Help { w, seed }),
        4 => (w.clone(), prop::bool::weighted(0.1)).prop_map(|(w, ahead)| Op::Pull { w, ahead }),
        1 => (w.clone(), 0u8..3).prop_map(|(w, extra)| Op::Reattach { w, extra }),
        1 => (w, any::<u64>()).prop_map(|(w, seed)| Op::Init { w, seed }),
    ]
}

fn floats(seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..LEN).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// A gradient left where it arrived ([`Grad::Slot`]), counting the floats read from it.
struct CountedSlot {
    values: Vec<f32>,
    read: std::sync::atomic::AtomicUsize,
}

impl GradSlot for CountedSlot {
    fn len(&self) -> usize {
        self.values.len()
    }

    fn read(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self.values[at..at + out.len()]);
        self.read
            .fetch_add(out.len(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// Feeds `ops` to `core` over `params`; returns every output in order.
fn drive(ops: &[Op], core: &mut ShardCore, params: &mut dyn ShardParams) -> Vec<Output> {
    drive_with(ops, core, params, false)
}

/// [`drive`], with the gradients of pushes left in slots when `slots`: then every
/// acknowledgement given while a new push is handled comes after that push's gradient was
/// read whole (an acknowledgement lets the worker write its slot again).
fn drive_with(
    ops: &[Op],
    core: &mut ShardCore,
    params: &mut dyn ShardParams,
    slots: bool,
) -> Vec<Output> {
    let workers = core.config().workers as usize;
    let (mut helps, mut req) = (vec![0u64; workers], 0u64);
    let mut out = Vec::new();
    for (t, o) in ops.iter().enumerate() {
        let mut slot: Option<CountedSlot> = None;
        let mut new_push = false;
        let now = t as u64 * 1000;
        let input = match *o {
            Op::Push { w, how, on, seed } => {
                let next = core.pushes(w) + 1;
                let seq = match how {
                    0 => next.saturating_sub(1), // a retry
                    1 => next + 1,               // a gap
                    _ => next,
                };
                let version = params.version();
                let computed_on = match on {
                    0 => None,
                    1 => Some(version),
                    _ => Some(version.saturating_sub(u64::from(on))),
                };
                new_push = seq == next;
                let grad = if slots {
                    slot = Some(CountedSlot {
                        values: floats(seed),
                        read: std::sync::atomic::AtomicUsize::new(0),
                    });
                    Grad::Slot(slot.as_ref().expect("just made"))
                } else {
                    floats(seed).into()
                };
                Input::Push {
                    conn: u64::from(w) + 100,
                    worker: w,
                    seq,
                    computed_on,
                    grad,
                }
            }
            Op::Help { w, seed } => {
                helps[w as usize] += 1;
                // Tasks of the next worker's current iteration (or, every other time, of one
                // long applied).
                let s = (w + 1) % workers as u32;
                let clock = if seed % 2 == 0 { core.pushes(s) } else { 0 };
                Input::Help {
                    conn: u64::from(w) + 100,
                    worker: w,
                    seq: helps[w as usize],
                    computed_on: None,
                    grad: floats(seed),
                    help_for: Some((s, clock)),
                }
            }
            Op::Pull { w, ahead } => {
                req += 1;
                Input::Pull {
                    worker: w,
                    clock: core.pushes(w) + u64::from(ahead),
                    req,
                }
            }
            Op::Leave { w } => Input::Leave { worker: w },
            Op::Rejoin { w } => {
                helps[w as usize] = 0;
                Input::Resume {
                    worker: w,
                    pushes: core.start_clock(w),
                    helps: 0,
                    rejoin: true,
                }
            }
            Op::Reattach { w, extra } => Input::Resume {
                worker: w,
                pushes: core.pushes(w) + u64::from(extra),
                helps: helps[w as usize],
                rejoin: false,
            },
            Op::Init { w, seed } => Input::Init {
                conn: u64::from(w) + 100,
                worker: w,
                values: floats(seed),
            },
        };
        let watched = slot.as_ref().filter(|_| new_push);
        core.handle(now, input, params, &mut |o| {
            if let (Some(s), Output::Ack { .. }) = (watched, &o) {
                assert_eq!(
                    s.read.load(std::sync::atomic::Ordering::Relaxed),
                    LEN,
                    "acknowledged before its gradient was read whole"
                );
            }
            out.push(o)
        })
        .expect("valid workers and lengths");
    }
    out
}

fn bits(p: &dyn ShardParams, workers: usize) -> (Vec<u32>, u64, Vec<u64>) {
    (
        p.values().iter().map(|v| v.to_bits()).collect(),
        p.version(),
        (0..workers).map(|w| p.clock(w)).collect(),
    )
}

const POLICIES: [&str; 10] = [
    "bsp",
    "epsp(0)",
    "asp",
    "ssp(2)",
    "dssp(1,3)",
    "syncopt(1)",
    "syncopt(1,fold)",
    "epsp(2)",
    "fluentps(2,sigmoid)",
    "flexrr(1)",
];

fn optimizer(i: u8) -> Optimizer {
    match i {
        0 => Optimizer::Sgd { lr: 0.1 },
        1 => Optimizer::Momentum { lr: 0.05, mu: 0.9 },
        _ => Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            wd: 0.0,
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The servers' core (regions under the seqlock) and the simulator's (a vector) agree on
    /// every output and every bit, for every policy, optimizer and aggregate; and so does the
    /// servers' core reading each push's gradient from its slot (a block at a time while it
    /// is applied, acknowledged after; see `drive_with`).
    #[test]
    fn region_and_vector_cores_agree_bit_for_bit(
        p in 0..POLICIES.len(),
        o in 0u8..3,
        mean in any::<bool>(),
        capped in any::<bool>(),
        ops in prop::collection::vec(op(3), 1..120),
    ) {
        let agg = if mean { Aggregate::Mean } else { Aggregate::Sum };
        let cap = if capped { 2 * LEN as u64 * 4 } else { u64::MAX };
        let mut a = core(POLICIES[p], 3, optimizer(o), agg, cap);
        let mut b = core(POLICIES[p], 3, optimizer(o), agg, cap);
        let mut c = core(POLICIES[p], 3, optimizer(o), agg, cap);
        let mut region = RegionParams::new(LEN, 3).unwrap();
        let mut vector = VecParams::new(LEN, 3);
        let mut slots = RegionParams::new(LEN, 3).unwrap();
        let out_a = drive(&ops, &mut a, &mut region);
        let out_b = drive(&ops, &mut b, &mut vector);
        let out_c = drive_with(&ops, &mut c, &mut slots, true);
        prop_assert_eq!(&out_a, &out_b);
        prop_assert_eq!(&out_a, &out_c);
        prop_assert_eq!(bits(&region, 3), bits(&vector, 3));
        prop_assert_eq!(bits(&region, 3), bits(&slots, 3));
        prop_assert_eq!(a.state(&region), b.state(&vector));
        prop_assert_eq!(a.state(&region), c.state(&slots));
        prop_assert_eq!(a.stats(), b.stats());
        prop_assert_eq!(a.stats(), c.stats());
    }

    /// A checkpointed core restored into a fresh one goes on exactly as the original. (A
    /// checkpoint keeps no policy state: the policy is rebuilt from the workers' clocks, which
    /// is exact while membership does not change, who left being the scheduler's word; Sync-opt
    /// is left out: a restored Sync-opt takes every worker to have the current parameters, as a
    /// worker reattaching to a restarted server pulls them, so a worker that never pulled has
    /// its first late gradient counted rather than dropped.)
    #[test]
    fn a_restored_core_goes_on_as_the_original(
        p in (0..POLICIES.len()).prop_filter("not sync-opt", |&p| !POLICIES[p].starts_with("syncopt")),
        ops in prop::collection::vec(steady(3), 1..80),
        more in prop::collection::vec(steady(3), 1..40),
    ) {
        let mut a = core(POLICIES[p], 3, optimizer(1), Aggregate::Mean, u64::MAX);
        let mut pa = VecParams::new(LEN, 3);
        drive(&ops, &mut a, &mut pa);
        let saved = a.state(&pa);
        let mut b = core(POLICIES[p], 3, optimizer(1), Aggregate::Mean, u64::MAX);
        let mut pb = RegionParams::new(LEN, 3).unwrap();
        b.restore(&saved, &mut pb).unwrap();
        prop_assert_eq!(b.state(&pb), saved);
        drive(&more, &mut a, &mut pa);
        drive(&more, &mut b, &mut pb);
        prop_assert_eq!(bits(&pa, 3), bits(&pb, 3));
    }
}

fn push(core: &mut ShardCore, p: &mut VecParams, w: u32, seq: u64, g: Vec<f32>) -> Vec<Output> {
    let mut out = Vec::new();
    let input = Input::Push {
        conn: 7,
        worker: w,
        seq,
        computed_on: None,
        grad: g.into(),
    };
    core.handle(0, input, p, &mut |o| out.push(o)).unwrap();
    out
}

#[test]
fn a_synchronous_step_sums_in_rank_order_whatever_the_arrival_order() {
    let grads: Vec<Vec<f32>> = (0..4).map(|w| floats(w + 11)).collect();
    let mut expected = vec![0f32; LEN];
    aggregate(
        &mut expected,
        grads.iter().map(Vec::as_slice),
        Aggregate::Mean,
    );
    let expected: Vec<u32> = expected.iter().map(|g| (-0.1 * g).to_bits()).collect();
    for order in [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]] {
        let mut c = core("bsp", 4, optimizer(0), Aggregate::Mean, u64::MAX);
        let mut p = VecParams::new(LEN, 4);
        for w in order {
            push(&mut c, &mut p, w, 1, grads[w as usize].clone());
        }
        let got: Vec<u32> = p.values().iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, expected, "arrival order {order:?}");
        assert_eq!(p.version(), 1);
        assert_eq!(p.clocks(), &[1, 1, 1, 1]);
    }
}

#[test]
fn a_repeated_push_is_acknowledged_again_and_not_applied() {
    let mut c = core("asp", 2, optimizer(0), Aggregate::Sum, u64::MAX);
    let mut p = VecParams::new(LEN, 2);
    let out = push(&mut c, &mut p, 0, 1, vec![1.0; LEN]);
    assert!(matches!(
        out[0],
        Output::Ack {
            conn: 7,
            worker: 0,
            of: AckOf::Push { clock: 0 },
            ..
        }
    ));
    let after_one = p.clone();
    let again = push(&mut c, &mut p, 0, 1, vec![1.0; LEN]);
    assert_eq!(
        again,
        vec![Output::Ack {
            conn: 7,
            worker: 0,
            of: AckOf::Push { clock: 0 },
            staleness: 0
        }]
    );
    assert_eq!(p, after_one, "a retry changes nothing");
    // A gap is neither applied nor acknowledged.
    assert!(push(&mut c, &mut p, 0, 5, vec![1.0; LEN]).is_empty());
    assert_eq!(p, after_one);
    assert_eq!(c.stats().duplicate_pushes, 1);
    assert_eq!(c.account(), (1, 0, 0));
}

#[test]
fn acknowledgements_wait_while_the_waiting_gradients_exceed_the_cap() {
    // Room for one waiting gradient: worker 0 runs two steps ahead of worker 1.
    let mut c = core("bsp", 2, optimizer(0), Aggregate::Sum, LEN as u64 * 4);
    let mut p = VecParams::new(LEN, 2);
    let acks = |out: &[Output]| {
        out.iter()
            .filter(|o| matches!(o, Output::Ack { .. }))
            .count()
    };
    assert_eq!(acks(&push(&mut c, &mut p, 0, 1, vec![1.0; LEN])), 1);
    assert_eq!(
        acks(&push(&mut c, &mut p, 0, 2, vec![1.0; LEN])),
        0,
        "over the cap"
    );
    // Worker 1's push completes step 0: the waiting bytes drop under the cap, and both held
    // acknowledgements go out in arrival order.
    let out = push(&mut c, &mut p, 1, 1, vec![1.0; LEN]);
    let of: Vec<(u32, AckOf)> = out
        .iter()
        .filter_map(|o| match o {
            Output::Ack { worker, of, .. } => Some((*worker, *of)),
            _ => None,
        })
        .collect();
    assert_eq!(
        of,
        vec![(0, AckOf::Push { clock: 1 }), (1, AckOf::Push { clock: 0 })]
    );
    assert_eq!(c.stats().held_acks, 1);
}

#[test]
fn a_pull_from_the_future_is_refused_and_bad_inputs_are_errors() {
    let mut c = core("ssp(1)", 2, optimizer(0), Aggregate::Sum, u64::MAX);
    let mut p = VecParams::new(LEN, 2);
    let mut out = Vec::new();
    let pull = Input::Pull {
        worker: 1,
        clock: 3,
        req: 9,
    };
    c.handle(0, pull, &mut p, &mut |o| out.push(o)).unwrap();
    assert!(
        matches!(&out[..], [Output::Refuse { worker: 1, req: 9, reason }] if reason.contains("from the future"))
    );
    let stranger = Input::Leave { worker: 2 };
    let e = c.handle(0, stranger, &mut p, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("worker 2"), "{e}");
    let short = Input::Push {
        conn: 0,
        worker: 0,
        seq: 1,
        computed_on: None,
        grad: vec![0.0; 3].into(),
    };
    let e = c.handle(0, short, &mut p, &mut |_| {}).unwrap_err();
    assert!(
        matches!(e, falcon_engine::Error::WrongLength { expected, got: 3, .. } if expected == LEN as u64)
    );
    assert_eq!(c.account(), (0, 0, 0), "nothing changed");
}

#[test]
fn a_parked_pull_is_answered_when_the_policy_releases_it() {
    let mut c = core("bsp", 2, optimizer(0), Aggregate::Sum, u64::MAX);
    let mut p = VecParams::new(LEN, 2);
    push(&mut c, &mut p, 0, 1, vec![1.0; LEN]);
    let mut out = Vec::new();
    let pull = Input::Pull {
        worker: 0,
        clock: 1,
        req: 4,
    };
    c.handle(0, pull, &mut p, &mut |o| out.push(o)).unwrap();
    assert!(out.is_empty(), "parked until worker 1's gradient is in");
    let out = push(&mut c, &mut p, 1, 1, vec![1.0; LEN]);
    assert!(out.contains(&Output::Answer { worker: 0, req: 4 }));
    assert_eq!(c.stats().per_worker[0].parked_pulls, 1);
    assert_eq!(c.stats().answered_pulls, 1);
}

#[test]
fn sync_opt_counts_the_places_a_reattaching_worker_holds() {
    // Sync-opt, 2 of 3 per step. Worker 1 reattaches having had one push acknowledged that
    // this shard lost: its place in step 0 is held, empty. Worker 2's gradient then completes
    // step 0, for the policy as for the shard.
    let mut c = core("syncopt(1)", 3, optimizer(0), Aggregate::Sum, u64::MAX);
    let mut p = VecParams::new(LEN, 3);
    let mut out = Vec::new();
    let resume = Input::Resume {
        worker: 1,
        pushes: 1,
        helps: 0,
        rejoin: false,
    };
    c.handle(0, resume, &mut p, &mut |o| out.push(o)).unwrap();
    assert_eq!(
        out,
        vec![Output::Lost {
            worker: 1,
            updates: 1
        }]
    );
    push(&mut c, &mut p, 2, 1, vec![1.0; LEN]);
    assert_eq!(p.version(), 1, "step 0: worker 2 and worker 1's place");
    // Worker 0 pulls at clock 0 and is given version 1 at once: its gradient counts for
    // step 1, not dropped as late.
    let mut out = Vec::new();
    let pull = Input::Pull {
        worker: 0,
        clock: 0,
        req: 1,
    };
    c.handle(0, pull, &mut p, &mut |o| out.push(o)).unwrap();
    assert_eq!(out, vec![Output::Answer { worker: 0, req: 1 }]);
    push(&mut c, &mut p, 0, 1, vec![1.0; LEN]);
    assert_eq!(c.stats().per_worker[0].dropped_gradients, 0);
    let st = c.state(&p);
    assert_eq!(st.pending.len(), 1);
    assert_eq!(st.pending[0].0, 1, "waiting in step 1");
    assert!(st.pending[0].1[0].is_some());
}

#[test]
fn a_rejoining_worker_whose_step_fell_without_it_goes_on() {
    // BSP, 2 workers. Worker 1 leaves; worker 0's gradient alone completes step 0. Worker 1
    // rejoins at clock 0 (the others' count when it attached, before step 0 fell): its
    // gradient of clock 0 comes too late and is dropped, and its pull of clock 1 is answered
    // instead of waiting for a step that already fell.
    let mut c = core("bsp", 2, optimizer(0), Aggregate::Sum, u64::MAX);
    let mut p = VecParams::new(LEN, 2);
    c.handle(0, Input::Leave { worker: 1 }, &mut p, &mut |_| {})
        .unwrap();
    push(&mut c, &mut p, 0, 1, vec![1.0; LEN]);
    assert_eq!(p.version(), 1);
    let rejoin = Input::Resume {
        worker: 1,
        pushes: 0,
        helps: 0,
        rejoin: true,
    };
    c.handle(0, rejoin, &mut p, &mut |_| {}).unwrap();
    push(&mut c, &mut p, 1, 1, vec![1.0; LEN]);
    assert_eq!(p.version(), 1, "dropped, not applied");
    assert_eq!(p.clocks(), &[1, 1]);
    let mut out = Vec::new();
    let pull = Input::Pull {
        worker: 1,
        clock: 1,
        req: 8,
    };
    c.handle(0, pull, &mut p, &mut |o| out.push(o)).unwrap();
    assert_eq!(out, vec![Output::Answer { worker: 1, req: 8 }]);
}

fn help(
    core: &mut ShardCore,
    p: &mut VecParams,
    w: u32,
    seq: u64,
    help_for: (u32, u64),
    g: Vec<f32>,
) -> Vec<Output> {
    let mut out = Vec::new();
    let input = Input::Help {
        conn: 9,
        worker: w,
        seq,
        computed_on: None,
        grad: g,
        help_for: Some(help_for),
    };
    core.handle(0, input, p, &mut |o| out.push(o)).unwrap();
    out
}

/// Enforced EPSP (`epsp(0)`) aggregates its steps as BSP does, and transferred tasks join
/// their straggler's step: the step applied is the mean of the workers' gradients with the
/// helper's part summed into the straggler's. A transferred part whose step was already
/// applied joins the next step; one late for the last step is applied when the job ends.
#[test]
fn under_enforced_epsp_transferred_tasks_join_their_straggler_s_step() {
    assert_eq!(
        "epsp(0)".parse::<PolicySpec>().unwrap().update_mode(),
        UpdateMode::Sync
    );
    assert_eq!(
        "epsp(2)".parse::<PolicySpec>().unwrap().update_mode(),
        UpdateMode::Async
    );
    let (g0, g1, h) = (floats(1), floats(2), floats(3));
    let mut c = core("epsp(0)", 2, optimizer(0), Aggregate::Mean, u64::MAX);
    let mut p = VecParams::new(LEN, 2);
    push(&mut c, &mut p, 0, 1, g0.clone());
    // Worker 0 helps worker 1 with its iteration 0 before worker 1's own push.
    let out = help(&mut c, &mut p, 0, 1, (1, 0), h.clone());
    assert!(
        out.iter().any(|o| matches!(
            o,
            Output::Ack {
                of: AckOf::Help,
                ..
            }
        )),
        "{out:?}"
    );
    assert_eq!(p.version(), 0, "held for the step");
    push(&mut c, &mut p, 1, 1, g1.clone());
    assert_eq!(p.version(), 1, "one step");
    let want: Vec<u32> = (0..LEN)
        .map(|i| (-0.1 * ((g0[i] + g1[i]) * 0.5 + 0.5 * h[i])).to_bits())
        .collect();
    let got: Vec<u32> = p.values().iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want);
    // Late: worker 1's iteration 0 is applied already; the part joins the next step (never
    // an optimizer step of its own).
    help(&mut c, &mut p, 0, 2, (1, 0), h.clone());
    assert_eq!(p.version(), 1, "no step of its own");
    assert_eq!(c.stats().late_helps, 1);
    assert_eq!(c.state(&p).help_pending, vec![(1, h.clone())]);
    // A checkpoint keeps a part waiting for its step (here, the late part and one more for
    // step 1, summed).
    help(&mut c, &mut p, 0, 3, (1, 1), h.clone());
    let saved = c.state(&p);
    let twice: Vec<f32> = h.iter().map(|x| x + x).collect();
    assert_eq!(saved.help_pending, vec![(1, twice.clone())]);
    let mut d = core("epsp(0)", 2, optimizer(0), Aggregate::Mean, u64::MAX);
    let mut q = VecParams::new(LEN, 2);
    d.restore(&saved, &mut q).unwrap();
    assert_eq!(d.state(&q), saved);
    // Step 1: both workers' own gradients, the parts summed into it.
    let before = p.values().to_vec();
    push(&mut c, &mut p, 0, 2, g0.clone());
    push(&mut c, &mut p, 1, 2, g1.clone());
    assert_eq!(p.version(), 2);
    for i in 0..LEN {
        let step = (g0[i] + g1[i]) * 0.5 + 0.5 * twice[i];
        assert_eq!(p.values()[i].to_bits(), (before[i] - 0.1 * step).to_bits());
    }
    // Late for the last step: held until the job ends, then applied (nothing lost).
    help(&mut c, &mut p, 0, 4, (1, 1), h.clone());
    assert_eq!(p.version(), 2);
    let before = p.values().to_vec();
    c.handle(0, Input::End, &mut p, &mut |_| {}).unwrap();
    assert_eq!(p.version(), 3);
    for i in 0..LEN {
        assert_eq!(
            p.values()[i].to_bits(),
            (before[i] - 0.1 * (0.5 * h[i])).to_bits()
        );
    }
    assert!(c.state(&p).help_pending.is_empty());
    // Nothing waiting: the end changes nothing.
    c.handle(0, Input::End, &mut p, &mut |_| {}).unwrap();
    assert_eq!(p.version(), 3);
}

/// `syncopt(1,fold)`, 2 of 3 per step: a gradient whose step was made without it is not
/// dropped but added to the next step applied, weighed 1 / (1 + its staleness) in that step's
/// weighted mean; a worker's several late gradients are one contributor (their mean); a
/// checkpoint keeps them; the job's end applies what is left. Plain Sync-opt drops the same
/// gradient.
#[test]
fn a_folded_gradient_joins_the_next_step_weighed_by_its_staleness() {
    let (g0, g1, g2, g3, g4) = (floats(1), floats(2), floats(3), floats(4), floats(5));
    let close = |got: &[f32], want: &[f32]| {
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "[{i}] {a} against {b}"
            );
        }
    };
    for fold in [false, true] {
        let policy = if fold {
            "syncopt(1,fold)"
        } else {
            "syncopt(1)"
        };
        let mut c = core(policy, 3, optimizer(0), Aggregate::Mean, u64::MAX);
        let mut p = VecParams::new(LEN, 3);
        push(&mut c, &mut p, 0, 1, g0.clone());
        push(&mut c, &mut p, 1, 1, g1.clone());
        assert_eq!(p.version(), 1, "{policy}: step 0 is workers 0 and 1");
        let v1 = p.values().to_vec();
        // Worker 2's gradient of clock 0 (computed on version 0) comes after step 0.
        let out = push(&mut c, &mut p, 2, 1, g2.clone());
        assert!(
            out.iter()
                .any(|o| matches!(o, Output::Ack { worker: 2, .. })),
            "{out:?}"
        );
        assert_eq!(p.version(), 1, "{policy}: no step of its own");
        assert_eq!(p.clocks()[2], 1, "{policy}: its clock moves past it");
        let st = c.stats().per_worker[2].clone();
        let half: Vec<f32> = g2.iter().map(|x| x * 0.5).collect();
        if fold {
            assert_eq!((st.dropped_gradients, st.folded_gradients), (0, 1));
            assert_eq!(c.state(&p).folded, vec![(2, half.clone(), 1, 0.5)]);
            // A checkpoint restores it.
            let saved = c.state(&p);
            let mut d = core(policy, 3, optimizer(0), Aggregate::Mean, u64::MAX);
            let mut q = VecParams::new(LEN, 3);
            d.restore(&saved, &mut q).unwrap();
            assert_eq!(d.state(&q), saved);
            // A saved buffer that cannot be is refused, nothing changed: no weight, no
            // count, a weight above its count, a worker twice, a worker not of the job.
            for bad in [
                vec![(2, half.clone(), 1, 0.0)],
                vec![(2, half.clone(), 0, 0.5)],
                vec![(2, half.clone(), 1, 1.5)],
                vec![(2, half.clone(), 1, f32::NAN)],
                vec![(2, half.clone(), 1, 0.5), (2, half.clone(), 1, 0.5)],
                vec![(3, half.clone(), 1, 0.5)],
            ] {
                let mut broken = saved.clone();
                broken.folded = bad;
                let mut e = core(policy, 3, optimizer(0), Aggregate::Mean, u64::MAX);
                let mut r = VecParams::new(LEN, 3);
                let err = e.restore(&broken, &mut r).unwrap_err();
                assert!(err.contains("not of 3 workers"), "{err}");
            }
        } else {
            assert_eq!((st.dropped_gradients, st.folded_gradients), (1, 0));
            assert!(c.state(&p).folded.is_empty());
        }
        push(&mut c, &mut p, 0, 2, g3.clone());
        push(&mut c, &mut p, 1, 2, g4.clone());
        assert_eq!(p.version(), 2, "{policy}: step 1");
        let want: Vec<f32> = (0..LEN)
            .map(|i| {
                let mean = if fold {
                    (g3[i] + g4[i] + half[i]) / 2.5
                } else {
                    (g3[i] + g4[i]) / 2.0
                };
                v1[i] - 0.1 * mean
            })
            .collect();
        close(p.values(), &want);
        assert!(c.state(&p).folded.is_empty(), "{policy}: applied once");
        if !fold {
            continue;
        }
        // Step 2 is made by workers 0 and 1; worker 2 (never given newer values) then pushes
        // two more late gradients, 3 steps stale each: one buffer (each weighed 1/4), and the
        // job's end applies them as a step of their own, keeping their weights (a step of
        // stale gradients alone is not made fresh by its divisor).
        push(&mut c, &mut p, 0, 3, g3.clone());
        push(&mut c, &mut p, 1, 3, g4.clone());
        push(&mut c, &mut p, 2, 2, g0.clone());
        push(&mut c, &mut p, 2, 3, g1.clone());
        assert_eq!(p.version(), 3);
        let st = c.state(&p);
        assert_eq!(st.folded.len(), 1);
        assert_eq!((st.folded[0].2, st.folded[0].3), (2, 0.5));
        let before = p.values().to_vec();
        c.handle(0, Input::End, &mut p, &mut |_| {}).unwrap();
        assert_eq!(p.version(), 4);
        let want: Vec<f32> = (0..LEN)
            .map(|i| before[i] - 0.1 * ((g0[i] + g1[i]) / 4.0 / 2.0))
            .collect();
        close(p.values(), &want);
        assert_eq!(c.stats().per_worker[2].folded_gradients, 3);
    }
}

/// A folded gradient is acknowledged at once, whatever the cap on waiting gradients: the
/// buffers are one per worker at most, and a backup that folds while no step is made (the
/// others finished) must not wait for an acknowledgement that no step would release.
#[test]
fn a_folded_gradient_is_acknowledged_at_once_under_the_cap() {
    let mut c = core("syncopt(1,fold)", 3, optimizer(0), Aggregate::Mean, 0);
    let mut p = VecParams::new(LEN, 3);
    for seq in 1..=3 {
        let held = push(&mut c, &mut p, 0, seq, floats(seq));
        assert!(held.is_empty(), "over the cap: held, {held:?}");
        let both = push(&mut c, &mut p, 1, seq, floats(seq + 10));
        assert_eq!(both.len(), 2, "the step frees both: {both:?}");
    }
    // Workers 0 and 1 are done; worker 2's gradients of clocks 0 and 1 come late.
    for seq in 1..=2 {
        let out = push(&mut c, &mut p, 2, seq, floats(seq + 20));
        assert!(
            matches!(out.as_slice(), [Output::Ack { worker: 2, .. }]),
            "late gradient {seq}: {out:?}"
        );
    }
    assert_eq!(c.stats().per_worker[2].folded_gradients, 2);
    assert_eq!(c.stats().peak_pending_bytes, 2 * LEN as u64 * 4);
}

/// Under enforced EPSP the policy sees gradients as they arrive: a pioneer whose pull is
/// parked is offered the tasks of the worker that has not pushed, not of one waiting in the
/// same step.
#[test]
fn enforced_epsp_offers_the_worker_that_has_not_pushed() {
    let mut c = core("epsp(0)", 3, optimizer(0), Aggregate::Mean, u64::MAX);
    let mut p = VecParams::new(LEN, 3);
    push(&mut c, &mut p, 0, 1, floats(1));
    push(&mut c, &mut p, 1, 1, floats(2));
    let mut out = Vec::new();
    let pull = Input::Pull {
        worker: 0,
        clock: 1,
        req: 5,
    };
    c.handle(10, pull, &mut p, &mut |o| out.push(o)).unwrap();
    let offers: Vec<(u32, u32, u64)> = out
        .iter()
        .filter_map(|o| match *o {
            Output::Offer {
                helper,
                straggler,
                clock,
            } => Some((helper, straggler, clock)),
            _ => None,
        })
        .collect();
    assert_eq!(offers, vec![(0, 2, 0)], "{out:?}");
    // Worker 2's push completes the step and releases the pull.
    let out = push(&mut c, &mut p, 2, 1, floats(3));
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::Answer { req: 5, .. })),
        "{out:?}"
    );
    assert_eq!(p.version(), 1);
}
