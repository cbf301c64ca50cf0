//! Helpers shared by the engine's policy tests.
#![allow(dead_code)]

use falcon_engine::meta::within_staleness;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use falcon_engine::sync::{Action, Event, FastPath, SyncPolicy};

/// Simulates `workers` workers doing `iters` iterations (pull, then push) against `policy`,
/// the next worker to act chosen by `picks` (random delays; the gap between two events is also
/// taken from `picks`, so push intervals vary). With `fast`, a pull that the policy's fast path
/// allows (checked against the pushes so far) skips the policy, as in the real worker. Checks
/// that no release answers a pull that is not waiting, that every release respects `bound`
/// (if any), and that the policy releases at once every pull its fast path would allow.
/// Returns the event trace and the actions each event produced.
pub fn run(
    policy: &mut dyn SyncPolicy,
    workers: u32,
    bound: Option<u64>,
    iters: u64,
    picks: &[u32],
    fast: bool,
) -> Vec<(Event, Vec<Action>)> {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum St {
        WantPull,
        Parked(u64),
        WantPush,
        Done,
    }
    let n = workers as usize;
    let mut st = vec![St::WantPull; n];
    let mut clock = vec![0u64; n];
    let mut pushed = vec![0u64; n];
    let mut trace = Vec::new();
    let mut req = 0u64;
    let mut i = 0usize;
    let mut t = 0u64;
    let fast_ok = |p: &dyn SyncPolicy, pushed: &[u64], c: u64| match p.fast_path() {
        FastPath::Always => true,
        FastPath::Within(s) => within_staleness(*pushed.iter().min().unwrap(), c, s),
        FastPath::Never => false,
    };
    while st.iter().any(|s| *s != St::Done) {
        let ready: Vec<usize> = (0..n)
            .filter(|&w| matches!(st[w], St::WantPull | St::WantPush))
            .collect();
        assert!(
            !ready.is_empty(),
            "deadlock: every unfinished worker is parked"
        );
        let pick = picks[i % picks.len()];
        let w = ready[pick as usize % ready.len()];
        i += 1;
        t += 1 + u64::from(pick % 7);
        let ev = match st[w] {
            St::WantPull => {
                if fast && fast_ok(policy, &pushed, clock[w]) {
                    st[w] = St::WantPush;
                    continue;
                }
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
            _ => unreachable!(),
        };
        if let Event::Push { .. } = ev {
            pushed[w] = clock[w] + 1;
            clock[w] += 1;
            st[w] = if clock[w] == iters {
                St::Done
            } else {
                St::WantPull
            };
        }
        let allowed = fast_ok(policy, &pushed, clock[w]);
        let mut out = Vec::new();
        policy.on_event(ev, &mut out);
        if let Event::Pull { req: r, .. } = ev {
            st[w] = St::Parked(r);
            if allowed {
                assert!(
                    out.contains(&Action::Release {
                        worker: w as u32,
                        req: r
                    }),
                    "the fast path allows worker {w}'s pull at {} but the policy did not release it",
                    clock[w]
                );
            }
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
                    let min = *pushed.iter().min().unwrap();
                    assert!(
                        within_staleness(min, clock[wk], s),
                        "worker {wk} at clock {} released with min pushed {min}, bound {s}",
                        clock[wk]
                    );
                }
                st[wk] = St::WantPush;
            }
        }
        trace.push((ev, out));
    }
    trace
}

/// What a time-driven run calls after every event: `hook(policy, event, actions)`.
pub type Hook<'a> = dyn FnMut(&dyn SyncPolicy, &Event, &[Action]) + 'a;

/// A deterministic per-(worker, iteration) compute time: `base[w]` plus up to 20% jitter.
pub fn compute_time(base: &[u64], w: usize, c: u64, seed: u64) -> u64 {
    let mut z = seed ^ ((w as u64) << 32) ^ c;
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    base[w] + z % (base[w] / 5 + 1)
}

/// A time-driven run: worker `w`'s iteration `c` takes `compute_time(base, w, c, seed)`; it
/// pushes, then pulls the next clock at once; a released pull starts the next iteration; a
/// worker leaves after `iters` iterations. Returns the finish time.
pub fn timed_run(policy: &mut dyn SyncPolicy, base: &[u64], iters: u64, seed: u64) -> u64 {
    timed_run_with(policy, base, iters, seed, &mut |_, _, _| {})
}

/// [`timed_run_with`] with `base.len()` workers whose iteration times come from `base` and
/// `seed` (as [`compute_time`]).
pub fn timed_run_with(
    policy: &mut dyn SyncPolicy,
    base: &[u64],
    iters: u64,
    seed: u64,
    hook: &mut Hook<'_>,
) -> u64 {
    timed_run_times(
        policy,
        base.len(),
        &|w, c| compute_time(base, w, c, seed),
        iters,
        hook,
    )
}

/// A time-driven run of `workers` workers, iteration `c` of worker `w` taking `time(w, c)`,
/// calling `hook(policy, event, actions)` after every event.
pub fn timed_run_times(
    policy: &mut dyn SyncPolicy,
    workers: usize,
    time: &dyn Fn(usize, u64) -> u64,
    iters: u64,
    hook: &mut Hook<'_>,
) -> u64 {
    struct Sim<'a> {
        time: &'a dyn Fn(usize, u64) -> u64,
        queue: BinaryHeap<Reverse<(u64, usize, u64)>>, // (push time, worker, clock)
        waiting: HashMap<u64, (usize, u64)>,           // req → (worker, clock)
        req: u64,
        out: Vec<Action>,
        hook: &'a mut Hook<'a>,
    }
    impl Sim<'_> {
        /// Feeds `ev` at time `t`; each released pull starts its iteration at `t`.
        fn feed(&mut self, policy: &mut dyn SyncPolicy, ev: Event, t: u64) {
            policy.on_event(ev, &mut self.out);
            (self.hook)(&*policy, &ev, &self.out);
            for a in std::mem::take(&mut self.out) {
                if let Action::Release { req, .. } = a {
                    let (w, c) = self.waiting.remove(&req).expect("a waiting pull");
                    let done = t + (self.time)(w, c);
                    self.queue.push(Reverse((done, w, c)));
                }
            }
        }
        fn pull(&mut self, policy: &mut dyn SyncPolicy, w: usize, c: u64, t: u64) {
            self.req += 1;
            self.waiting.insert(self.req, (w, c));
            let ev = Event::Pull {
                worker: w as u32,
                clock: c,
                req: self.req,
                at: t,
            };
            self.feed(policy, ev, t);
        }
    }
    let mut sim = Sim {
        time,
        queue: BinaryHeap::new(),
        waiting: HashMap::new(),
        req: 0,
        out: Vec::new(),
        hook,
    };
    for w in 0..workers {
        sim.pull(policy, w, 0, 0);
    }
    let mut end = 0;
    while let Some(Reverse((t, w, c))) = sim.queue.pop() {
        end = t;
        let worker = w as u32;
        sim.feed(
            policy,
            Event::Push {
                worker,
                clock: c,
                at: t,
            },
            t,
        );
        if c + 1 == iters {
            sim.feed(policy, Event::Leave { worker, at: t }, t);
        } else {
            sim.pull(policy, w, c + 1, t);
        }
    }
    assert!(
        sim.waiting.is_empty(),
        "pulls left parked: {:?}",
        sim.waiting
    );
    end
}
