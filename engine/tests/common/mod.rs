//! Helpers shared by the engine's policy tests.
#![allow(dead_code)]

use falcon_engine::meta::within_staleness;
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
