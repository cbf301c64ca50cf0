//! The worker's core against a shadow model, without a cluster: random API calls, answers
//! duplicated and out of order, dropped links with the resends that follow, dead servers and
//! the job's end. Every waiter is woken at most once, and exactly once by the end; every
//! push and pull is sent again exactly once per new link; no request is lost; a shard's
//! slot is busy exactly while its push is unacknowledged; the acknowledged sequence numbers
//! a reattaching worker reports are the model's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::{Action, Core, PushRecord, Resend};
use crate::error::Error;
use crate::proto::{AckOf, PushKind};
use crate::worker::tracker::{Reply, Request, Signal};

const SHARDS: usize = 4;
const SERVERS: usize = 2;

fn server_of(shard: usize) -> usize {
    shard % SERVERS
}

#[derive(Clone, Debug)]
enum Op {
    /// A push to `shard` (when its slot is free, as the driver waits for it).
    Push(usize),
    /// A transferred task's gradient to `shard`.
    Help(usize),
    /// A slow pull of `shard` (`rows`: a row pull).
    Pull {
        shard: usize,
        rows: bool,
    },
    Barrier,
    Steal(u32),
    /// The answer to the `n`-th request ever registered (modulo), whatever its state.
    Answer(usize),
    /// Server `s`'s link is replaced by a new one.
    Drop(usize),
    /// The driver sends again what server `s` must have on its current link.
    Resync(usize),
    /// Server `s` is gone for good.
    Gone(usize),
    /// The job ends.
    FailAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SHARDS).prop_map(Op::Push),
        1 => (0..SHARDS).prop_map(Op::Help),
        3 => (0..SHARDS, any::<bool>()).prop_map(|(shard, rows)| Op::Pull { shard, rows }),
        1 => Just(Op::Barrier),
        1 => (0u32..3).prop_map(Op::Steal),
        8 => any::<usize>().prop_map(Op::Answer),
        2 => (0..SERVERS).prop_map(Op::Drop),
        2 => (0..SERVERS).prop_map(Op::Resync),
        1 => (0..SERVERS).prop_map(Op::Gone),
        1 => Just(Op::FailAll),
    ]
}

/// A request as the model knows it.
struct Known {
    req: Request,
    sig: Arc<Signal>,
    server: Option<usize>,
    /// The push's sequence number and whether it is a help (pushes only).
    seq: Option<(u64, bool)>,
}

/// The model and the core side by side.
struct Bench {
    core: Core,
    now: Instant,
    /// Every request ever registered, in order.
    history: Vec<Known>,
    /// Indices into `history` of those in flight, with the link each last went out on.
    pending: BTreeMap<usize, Option<u64>>,
    /// Wake-ups per signal (by address).
    woken: HashMap<usize, u32>,
    /// Each server's current link.
    link: [u64; SERVERS],
    /// Pushes made per shard (the next push's clock), helps per shard.
    pushes: [u64; SHARDS],
    helps: [u64; SHARDS],
    /// Acknowledged sequence numbers per shard: gradients, helps.
    acked: [[u64; 2]; SHARDS],
    barrier: u64,
    failed: bool,
}

fn key(sig: &Arc<Signal>) -> usize {
    Arc::as_ptr(sig) as usize
}

impl Bench {
    fn new() -> Bench {
        Bench {
            core: Core::new(&[0, 0, 1, 1], 0, false, 0, 16),
            now: Instant::now(),
            history: Vec::new(),
            pending: BTreeMap::new(),
            woken: HashMap::new(),
            link: [100, 200],
            pushes: [0; SHARDS],
            helps: [0; SHARDS],
            acked: [[0; 2]; SHARDS],
            barrier: 0,
            failed: false,
        }
    }

    /// Carries out `out` as the driver would, counting each wake-up.
    fn perform(&mut self, out: Vec<Action>) -> Vec<(Arc<Signal>, bool)> {
        let mut woke = Vec::new();
        for a in out {
            let (sig, ok) = match a {
                Action::Wake(sig, r) => {
                    let ok = r.is_ok();
                    sig.set(r);
                    (sig, ok)
                }
                Action::Widen { sig, .. } => {
                    sig.set(Ok(Reply::Done));
                    (sig, true)
                }
                Action::Report(_) => panic!("no gate here"),
            };
            let n = self.woken.entry(key(&sig)).or_default();
            *n += 1;
            assert_eq!(*n, 1, "a waiter woken twice");
            woke.push((sig, ok));
        }
        woke
    }

    fn register(
        &mut self,
        req: Request,
        server: Option<usize>,
        what: Resend,
        seq: Option<(u64, bool)>,
    ) {
        let sent_on = server.map(|s| self.link[s]);
        let mut out = Vec::new();
        self.now += Duration::from_millis(1);
        let sig = self
            .core
            .register(req, server, sent_on, self.now, what, &mut out);
        let woke = self.perform(out);
        let i = self.history.len();
        self.history.push(Known {
            req,
            sig: sig.clone(),
            server,
            seq,
        });
        if self.failed {
            // After the job's end a request fails at once.
            assert!(matches!(woke.as_slice(), [(s, false)] if Arc::ptr_eq(s, &sig)));
        } else {
            assert!(woke.is_empty());
            self.pending.insert(i, sent_on);
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Push(shard) | Op::Help(shard) => {
                let help = matches!(op, Op::Help(_));
                let busy = self
                    .pending
                    .keys()
                    .any(|&i| matches!(self.history[i].req, Request::Ack { shard: s, .. } if s == shard as u32));
                assert_eq!(
                    self.core.slot(shard as u32).is_some(),
                    busy,
                    "the slot is busy exactly while its push is unacknowledged"
                );
                if busy {
                    return;
                }
                let (of, kind, seq) = if help {
                    let seq = self.core.next_help(shard);
                    self.helps[shard] += 1;
                    assert_eq!(seq, self.helps[shard]);
                    (AckOf::Help, PushKind::Help, seq)
                } else {
                    let clock = self.pushes[shard];
                    assert_eq!(self.core.shard(shard).pushes, clock);
                    (AckOf::Push { clock }, PushKind::Gradient, clock + 1)
                };
                let rec = PushRecord {
                    grad: None,
                    own: None,
                    kind,
                    seq,
                    help_for: help.then_some((0, 0)),
                    rates: None,
                };
                let req = Request::Ack {
                    shard: shard as u32,
                    of,
                };
                self.register(
                    req,
                    Some(server_of(shard)),
                    Resend::Push { shard, rec },
                    Some((seq, help)),
                );
                if !help {
                    self.core.pushed(shard);
                    self.pushes[shard] += 1;
                }
            }
            Op::Pull { shard, rows } => {
                let id = self.core.next_req();
                let what = if rows {
                    Resend::PullRows {
                        shard,
                        msg: Arc::new(vec![1, 2, 3]),
                    }
                } else {
                    Resend::Pull {
                        shard,
                        out: falcon_transport::Region::new(4).expect("a region"),
                        clock: 0,
                    }
                };
                self.register(Request::Pull(id), Some(server_of(shard)), what, None);
            }
            Op::Barrier => {
                let seq = self.core.next_barrier();
                self.barrier += 1;
                assert_eq!(seq, self.barrier);
                self.register(Request::Barrier(seq), None, Resend::Nothing, None);
            }
            Op::Steal(straggler) => {
                let req = Request::Steal {
                    straggler,
                    clock: self.history.len() as u64,
                };
                self.register(req, None, Resend::Nothing, None);
            }
            Op::Answer(n) => self.answer(n),
            Op::Drop(s) => self.link[s] += 1,
            Op::Resync(s) => self.resync(s),
            Op::Gone(s) => {
                let mut out = Vec::new();
                self.core.fail(Some(s), &gone(), &mut out);
                let woke = self.perform(out);
                let doomed: Vec<usize> = self
                    .pending
                    .keys()
                    .copied()
                    .filter(|&i| self.history[i].server == Some(s))
                    .collect();
                assert_eq!(woke.len(), doomed.len());
                for i in doomed {
                    self.pending.remove(&i);
                    assert!(
                        woke.iter()
                            .any(|(w, ok)| !ok && Arc::ptr_eq(w, &self.history[i].sig))
                    );
                }
            }
            Op::FailAll => {
                let mut out = Vec::new();
                self.core.fail_all(&gone(), &mut out);
                let woke = self.perform(out);
                assert_eq!(woke.len(), self.pending.len(), "every waiter failed");
                assert!(woke.iter().all(|(_, ok)| !ok));
                self.pending.clear();
                self.failed = true;
            }
        }
        assert_eq!(self.core.in_flight(), self.pending.len(), "no request lost");
        for (shard, acked) in self.acked.iter().enumerate() {
            assert_eq!(&self.core.shard(shard).acked, acked);
        }
    }

    /// The answer to the `n`-th request: it wakes the waiter of the request of that name in
    /// flight, once, and nobody if none is (a duplicate, or an answer to a failed request).
    fn answer(&mut self, n: usize) {
        if self.history.is_empty() {
            return;
        }
        let i = n % self.history.len();
        let req = self.history[i].req;
        let mut out = Vec::new();
        self.now += Duration::from_millis(1);
        match req {
            Request::Ack { shard, of } => self.core.on_ack(shard, of, 1, &mut out),
            Request::Pull(id) if n.is_multiple_of(3) => {
                self.core.on_rows(id, vec![9; 8], 4, self.now, &mut out)
            }
            Request::Pull(id) if n % 3 == 1 => {
                self.core.on_pull_failed(id, "refused".into(), &mut out)
            }
            Request::Pull(id) => self.core.on_pulled(id, self.now, &mut out),
            Request::Barrier(seq) => self.core.on_barrier_done(seq, &mut out),
            Request::Steal { straggler, clock } => {
                self.core.on_tasks(straggler, clock, 3..5, &mut out)
            }
        }
        let woke = self.perform(out);
        // An answer names its request, not the call: a transferred task's acknowledgement
        // answers whichever help holds the slot now.
        let live = self
            .pending
            .keys()
            .copied()
            .find(|&j| self.history[j].req == req);
        if let Some(i) = live {
            self.pending.remove(&i);
            assert_eq!(woke.len(), 1, "an answer wakes its waiter");
            assert!(Arc::ptr_eq(&woke[0].0, &self.history[i].sig));
            if let Some((seq, help)) = self.history[i].seq {
                let Request::Ack { shard, .. } = req else {
                    unreachable!()
                };
                let a = &mut self.acked[shard as usize][usize::from(help)];
                *a = (*a).max(seq);
            }
            if let Request::Steal { .. } = req {
                assert!(matches!(
                    self.history[i].sig.wait(Some(Duration::ZERO)),
                    Ok(Reply::Tasks(r)) if r == (3..5)
                ));
            }
            if let Request::Pull(id) = req {
                // A row answer is kept for its caller, once.
                let kept = self.core.take_row_answer(id);
                assert_eq!(kept.is_some(), n.is_multiple_of(3));
                assert!(self.core.take_row_answer(id).is_none());
            }
        } else {
            assert!(
                woke.is_empty(),
                "an answer to nothing in flight wakes nobody"
            );
        }
    }

    /// What server `s` must be sent again: exactly its requests in flight that last went
    /// out on another link, pushes first; once sent again, nothing more.
    fn resync(&mut self, s: usize) {
        let link = self.link[s];
        let stale = self.core.stale(s, link);
        let mut want: Vec<usize> = self
            .pending
            .iter()
            .filter(|(i, on)| self.history[**i].server == Some(s) && **on != Some(link))
            .map(|(i, _)| *i)
            .collect();
        want.sort_unstable();
        let mut got: Vec<usize> = stale
            .iter()
            .map(|(req, sig, _)| {
                self.history
                    .iter()
                    .position(|k| k.req == *req && Arc::ptr_eq(&k.sig, sig))
                    .expect("a request the model knows")
            })
            .collect();
        let first_pull = stale
            .iter()
            .position(|(_, _, w)| !matches!(w, Resend::Push { .. }))
            .unwrap_or(stale.len());
        assert!(
            stale[first_pull..]
                .iter()
                .all(|(_, _, w)| !matches!(w, Resend::Push { .. })),
            "pushes go out again before pulls"
        );
        got.sort_unstable();
        assert_eq!(
            got, want,
            "sent again: exactly what went out on an older link"
        );
        for (req, sig, _) in &stale {
            self.core.resent(*req, sig, link);
        }
        for i in want {
            self.pending.insert(i, Some(link));
        }
        assert!(self.core.stale(s, link).is_empty(), "sent again once");
    }
}

fn gone() -> Error {
    Error::PeerGone {
        role: "server",
        rank: 0,
        why: "test".into(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_core_keeps_every_request_and_wakes_each_waiter_once(
        ops in proptest::collection::vec(op(), 1..120)
    ) {
        let mut b = Bench::new();
        for op in ops {
            b.step(op);
        }
        // The job ends: whatever was still in flight is woken now, and every waiter ever
        // registered has been woken exactly once.
        b.step(Op::FailAll);
        for k in &b.history {
            prop_assert_eq!(b.woken.get(&key(&k.sig)).copied(), Some(1));
            prop_assert!(k.sig.done());
        }
    }

    #[test]
    fn the_gate_reports_once_and_only_a_plan_moves_the_barrier(
        steps in proptest::collection::vec((0u8..4, 0u64..8), 1..60)
    ) {
        let mut core = Core::new(&[0], 0, true, 0, 16);
        let mut now = Instant::now();
        let mut pending: Option<Arc<Signal>> = None;
        // Every waiter kept alive, so that none's address is reused by another.
        let mut kept: Vec<Arc<Signal>> = Vec::new();
        let mut woken: HashMap<usize, u32> = HashMap::new();
        let mut broken = false;
        let mut barrier = 1;
        for (kind, clock) in steps {
            now += Duration::from_millis(5);
            let mut out = Vec::new();
            match kind {
                0 => match core.gate_enter(clock, now, &mut out) {
                    Err(_) => prop_assert!(broken),
                    Ok(None) => prop_assert!(!broken && clock < barrier),
                    Ok(Some(sig)) => {
                        prop_assert!(!broken && clock >= barrier);
                        let reports = out.iter().filter(|a| matches!(a, Action::Report(_))).count();
                        match &pending {
                            // One report however many pulls wait: they share its waiter.
                            Some(p) => {
                                prop_assert!(Arc::ptr_eq(p, &sig));
                                prop_assert_eq!(reports, 0);
                            }
                            None => {
                                prop_assert_eq!(reports, 1);
                                kept.push(sig.clone());
                                pending = Some(sig);
                            }
                        }
                        out.clear();
                    }
                },
                1 => {
                    core.on_plan(clock, now, &mut out);
                    if pending.take().is_some() {
                        barrier = barrier.max(clock);
                    }
                }
                2 => {
                    core.report_failed(&gone(), &mut out);
                    pending = None;
                }
                _ => {
                    core.gate_sample(clock, now);
                }
            }
            for a in out {
                if let Action::Wake(sig, _) = a {
                    *woken.entry(key(&sig)).or_default() += 1;
                }
            }
            prop_assert!(woken.values().all(|&n| n == 1), "a waiter woken twice");
            prop_assert_eq!(core.barrier(), Some(barrier));
            if kind == 3 && clock == 7 {
                let mut out = Vec::new();
                core.fail_all(&gone(), &mut out);
                broken = true;
                pending = None;
                for a in out {
                    if let Action::Wake(sig, r) = a {
                        prop_assert!(r.is_err());
                        *woken.entry(key(&sig)).or_default() += 1;
                    }
                }
            }
        }
    }
}
