//! The scheduler's membership ([`Membership`], [`Rendezvous`]): property tests over random
//! sequences of heartbeats, barrier arrivals, supersteps, workers finishing, links closing,
//! rejoins and time passing, checked against a shadow model of the rules; and one unit test
//! per rule.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use falcon_engine::OnCheckpointFailure;
use falcon_engine::membership::{Action, Ending, Event, Membership, Node, Rendezvous, Settings};
use falcon_engine::proto::{Msg, Role};
use falcon_engine::scheduler::{SchedulerReport, plan_superstep};
use proptest::prelude::*;

const S: Role = Role::Server;
const W: Role = Role::Worker;

fn settings(servers: u32, workers: u32) -> Settings {
    Settings {
        servers,
        workers,
        suspicion: None,
        recovery: None,
        elastic: None,
        on_checkpoint_failure: OnCheckpointFailure::Warn,
    }
}

/// Something that happens to the job, by node index (servers first, then workers).
#[derive(Clone, Debug)]
enum Op {
    Beat(u8),
    /// A message that could not be decoded: still a sign of life.
    Garbage(u8),
    Barrier(u8, u64),
    Superstep(u8, u64, u64),
    Done(u8),
    Close(u8),
    /// A join attempt by rank, with a right proof or not.
    Rejoin(u8, bool),
    /// Time passes (ms), then a tick.
    Wait(u64),
    /// A helper asks to steal tasks of a straggler (by rank).
    Steal(u8, u32),
    /// A straggler gives tasks `start..end` to a helper (by rank).
    Tasks(u8, u32, u32, u32),
    /// A node stops the job (a worker interrupted, terminated or failed); `true` one time in
    /// ten, else the op is a heartbeat, so that most runs go on long enough to test the rest.
    Abort(u8, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<u8>().prop_map(Op::Beat),
        1 => any::<u8>().prop_map(Op::Garbage),
        3 => (any::<u8>(), 1u64..4).prop_map(|(n, s)| Op::Barrier(n, s)),
        2 => (any::<u8>(), 0u64..50, prop::sample::select(vec![0u64, 1_000, 3_000_000, 7_000_000]))
            .prop_map(|(n, c, i)| Op::Superstep(n, c, i)),
        1 => any::<u8>().prop_map(Op::Done),
        1 => any::<u8>().prop_map(Op::Close),
        2 => (any::<u8>(), prop::bool::weighted(0.9)).prop_map(|(n, p)| Op::Rejoin(n, p)),
        4 => (0u64..120).prop_map(Op::Wait),
        1 => (any::<u8>(), 0u32..5).prop_map(|(n, s)| Op::Steal(n, s)),
        1 => (any::<u8>(), 0u32..5, 0u32..4, 0u32..9).prop_map(|(n, h, a, b)| Op::Tasks(n, h, a, b)),
        1 => (any::<u8>(), prop::bool::weighted(0.1)).prop_map(|(n, a)| Op::Abort(n, a)),
    ]
}

/// The membership under test with a shadow of the rules, checking every action as it comes.
struct Sim {
    m: Membership,
    s: Settings,
    base: Instant,
    ms: u64,
    live: BTreeSet<Node>,
    heard: BTreeMap<Node, u64>,
    done: BTreeSet<u32>,
    /// Dead servers waiting to restart: rank → deadline (ms).
    down: BTreeMap<u32, u64>,
    arrived: BTreeMap<u64, BTreeSet<u32>>,
    arrivals: BTreeMap<u32, (u64, u64)>,
    ended: Option<Ending>,
    /// The worker whose abort was broadcast, for the end that must follow.
    aborted: Option<u32>,
    closes: usize,
    evictions: usize,
    joins: usize,
    supersteps: u64,
    fallen: u64,
    steals: u64,
    transferred: u64,
}

impl Sim {
    fn new(s: Settings) -> Sim {
        let base = Instant::now();
        let live: BTreeSet<Node> = (0..s.servers)
            .map(|r| (S, r))
            .chain((0..s.workers).map(|r| (W, r)))
            .collect();
        Sim {
            m: Membership::new(s, SchedulerReport::default(), base),
            s,
            base,
            ms: 0,
            heard: live.iter().map(|&n| (n, 0)).collect(),
            live,
            done: BTreeSet::new(),
            down: BTreeMap::new(),
            arrived: BTreeMap::new(),
            arrivals: BTreeMap::new(),
            ended: None,
            aborted: None,
            closes: 0,
            evictions: 0,
            joins: 0,
            supersteps: 0,
            fallen: 0,
            steals: 0,
            transferred: 0,
        }
    }

    fn node(&self, i: u8) -> Node {
        let i = u32::from(i) % (self.s.servers + self.s.workers);
        if i < self.s.servers {
            (S, i)
        } else {
            (W, i - self.s.servers)
        }
    }

    fn now(&self) -> Instant {
        self.base + Duration::from_millis(self.ms)
    }

    fn live_workers(&self) -> Vec<u32> {
        self.live.iter().filter(|n| n.0 == W).map(|n| n.1).collect()
    }

    /// A message from `node` if it is alive (a dead node's link is closed).
    fn message(&mut self, node: Node, msg: Option<Msg>) {
        if !self.live.contains(&node) {
            return;
        }
        self.heard.insert(node, self.ms);
        if node.0 == W {
            match msg {
                Some(Msg::Barrier { seq }) => {
                    self.arrived.entry(seq).or_default().insert(node.1);
                }
                Some(Msg::Superstep { clock, interval_ns }) if self.s.elastic.is_some() => {
                    self.arrivals.insert(node.1, (clock, interval_ns));
                }
                Some(Msg::Done) => {
                    self.done.insert(node.1);
                }
                _ => {}
            }
        }
        self.feed(Event::Message { node, msg }, None);
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Beat(i) => self.message(self.node(i), Some(Msg::Heartbeat)),
            Op::Garbage(i) => self.message(self.node(i), None),
            Op::Barrier(i, seq) => self.message(self.node(i), Some(Msg::Barrier { seq })),
            Op::Superstep(i, clock, interval_ns) => {
                self.message(self.node(i), Some(Msg::Superstep { clock, interval_ns }))
            }
            Op::Done(i) => self.message(self.node(i), Some(Msg::Done)),
            Op::Steal(i, straggler) => {
                let helper = self.node(i);
                if helper.0 == W && self.live.contains(&helper) && self.ended.is_none() {
                    self.steals += 1;
                }
                let msg = Msg::Steal {
                    straggler,
                    helper: 99,
                    clock: 3,
                    want: 2,
                };
                self.message(helper, Some(msg))
            }
            Op::Tasks(i, helper, start, end) => {
                let from = self.node(i);
                let to = (W, helper);
                if from.0 == W
                    && self.live.contains(&from)
                    && self.live.contains(&to)
                    && self.ended.is_none()
                {
                    self.transferred += u64::from(end.saturating_sub(start));
                }
                let msg = Msg::Tasks {
                    straggler: 99,
                    helper,
                    clock: 3,
                    start,
                    end,
                };
                self.message(from, Some(msg))
            }
            Op::Close(i) => {
                let node = self.node(i);
                self.feed(Event::Closed { node }, Some(node));
            }
            Op::Rejoin(i, proof_ok) => self.rejoin(self.node(i), proof_ok),
            Op::Wait(ms) => {
                self.ms += ms;
                self.feed(Event::Tick, None);
            }
            Op::Abort(i, true) => {
                let why = "interrupted (SIGINT)".to_string();
                self.message(self.node(i), Some(Msg::Abort { why }))
            }
            Op::Abort(i, false) => self.message(self.node(i), Some(Msg::Heartbeat)),
        }
    }

    fn rejoin(&mut self, node: Node, proof_ok: bool) {
        let (role, rank) = node;
        let may = proof_ok
            && self.ended.is_none()
            && match role {
                S => self.down.contains_key(&rank),
                _ => !self.live.contains(&node) && !self.done.contains(&rank),
            };
        let got = self.m.admit(role, Some(rank), proof_ok);
        if self.ended.is_some() {
            return;
        }
        assert_eq!(got.is_ok(), may, "{node:?} admitted: {got:?}");
        assert!(self.m.admit(role, None, proof_ok).is_err());
        if got != Ok(rank) {
            return;
        }
        self.live.insert(node);
        self.heard.insert(node, self.ms);
        if role == S {
            self.down.remove(&rank);
        }
        self.joins += 1;
        let addr = format!("server-{rank}-again");
        self.feed(Event::Joined { node, addr }, None);
    }

    /// Hands `ev` in and checks each action; `closed`: the node whose link closed.
    fn feed(&mut self, ev: Event, closed: Option<Node>) {
        let before: BTreeSet<Node> = self.live.clone();
        let was_down = self.down.clone();
        let mut out = Vec::new();
        self.m.on_event(ev.clone(), self.now(), &mut out);
        if self.ended.is_some() {
            assert!(out.is_empty(), "actions after the end: {out:?}");
            return;
        }
        let mut evicted = BTreeSet::new();
        let mut planned = Vec::new();
        for (i, a) in out.iter().enumerate() {
            assert!(self.ended.is_none(), "an action after the end: {out:?}");
            match a {
                Action::Send {
                    to,
                    msg: Msg::Evicted { .. },
                } => self.evicted(*to, &before, &mut evicted),
                Action::Send {
                    to,
                    msg: Msg::Plan { until },
                } => planned.push((to.1, *until)),
                Action::Send { to, msg } => self.sent(*to, msg, &ev),
                Action::Close { node } => {
                    assert!(
                        closed == Some(*node) || evicted.contains(node),
                        "{node:?} closed without a cause"
                    );
                    assert!(self.live.remove(node), "{node:?} declared dead twice");
                    self.closes += 1;
                    if node.0 == S
                        && let Some(r) = self.s.recovery
                    {
                        self.down.insert(node.1, self.ms + r.as_millis() as u64);
                    }
                }
                Action::Broadcast { to, msg } => self.broadcast(to, msg, &ev, &out[..i]),
                Action::End(how) => {
                    assert_eq!(i + 1, out.len(), "the end is the last action");
                    self.end(how, &was_down);
                }
            }
        }
        if !planned.is_empty() {
            self.planned(&planned);
        }
        self.check_state();
    }

    fn evicted(&mut self, node: Node, before: &BTreeSet<Node>, evicted: &mut BTreeSet<Node>) {
        let limit = self
            .s
            .suspicion
            .expect("eviction without a suspicion timeout");
        let quiet = self.ms - self.heard[&node];
        assert!(
            u128::from(quiet) > limit.as_millis(),
            "{node:?} evicted after {quiet} ms of silence"
        );
        assert!(before.contains(&node) && self.live.contains(&node));
        assert!(!(node.0 == W && self.done.contains(&node.1)));
        assert!(evicted.insert(node), "{node:?} evicted twice");
        self.evictions += 1;
    }

    fn sent(&mut self, to: Node, msg: &Msg, ev: &Event) {
        match (msg, ev) {
            // A restarted server is told which workers are dead.
            (
                Msg::Dead {
                    role: W,
                    rank: worker,
                },
                Event::Joined { node, .. },
            ) => {
                assert_eq!(to, *node);
                assert_eq!(node.0, S);
                assert!(!self.live.contains(&(W, *worker)));
            }
            // A straggler that died cannot answer the steals relayed to it: "none" on its
            // behalf, to a live helper.
            (
                Msg::Tasks {
                    straggler,
                    helper,
                    start: 0,
                    end: 0,
                    ..
                },
                _,
            ) if !self.live.contains(&(W, *straggler)) => {
                assert_eq!(to, (W, *helper));
                assert!(self.live.contains(&to));
            }
            // A steal goes to a straggler that can give tasks, else is answered "none".
            (
                Msg::Steal {
                    straggler, helper, ..
                },
                Event::Message { node, .. },
            ) => {
                assert_eq!((*helper, to), (node.1, (W, *straggler)));
                assert!(*straggler != node.1 && !self.done.contains(straggler));
                assert!(self.live.contains(&to));
            }
            (
                Msg::Tasks {
                    straggler,
                    helper,
                    start,
                    end,
                    ..
                },
                Event::Message {
                    node,
                    msg: Some(sent),
                },
            ) => match sent {
                Msg::Steal { .. } => {
                    assert_eq!((to, *straggler, *helper), (*node, *straggler, node.1));
                    assert_eq!((*start, *end), (0, 0));
                    let s = (W, *straggler);
                    assert!(
                        *straggler == node.1
                            || !self.live.contains(&s)
                            || self.done.contains(straggler)
                    );
                }
                _ => {
                    assert_eq!((to, *straggler), ((W, *helper), node.1));
                    assert!(self.live.contains(&to));
                }
            },
            _ => panic!("unexpected send to {to:?}: {msg:?} on {ev:?}"),
        }
    }

    fn broadcast(&mut self, to: &[Node], msg: &Msg, ev: &Event, earlier: &[Action]) {
        let everyone: Vec<Node> = self.live.iter().copied().collect();
        match msg {
            Msg::BarrierDone { seq } => {
                let workers: Vec<Node> = self.live_workers().into_iter().map(|w| (W, w)).collect();
                assert_eq!(to, &workers[..]);
                let arrived = self
                    .arrived
                    .remove(seq)
                    .expect("a barrier nobody reached fell");
                self.fallen = self.fallen.max(*seq);
                for w in self.live_workers() {
                    assert!(
                        arrived.contains(&w) || self.done.contains(&w),
                        "barrier {seq} fell before worker {w} arrived"
                    );
                }
            }
            Msg::Dead { role, rank } => {
                assert!(
                    earlier.last()
                        == Some(&Action::Close {
                            node: (*role, *rank)
                        })
                );
                assert_eq!(to, &everyone[..]);
            }
            Msg::Rejoined { rank } => {
                assert!(matches!(ev, Event::Joined { node, .. } if *node == (W, *rank)));
                assert_eq!(to, &everyone[..]);
            }
            Msg::ServerBack { rank, .. } => {
                assert!(matches!(ev, Event::Joined { node, .. } if *node == (S, *rank)));
                assert_eq!(to, &everyone[..]);
            }
            Msg::Shutdown => assert_eq!(to, &everyone[..]),
            // A worker stopped the job: everyone alive is told who and why, and the end follows.
            Msg::Aborted { rank, why } => {
                assert!(
                    matches!(ev, Event::Message { node, msg: Some(Msg::Abort { why: w }) }
                        if *node == (W, *rank) && w == why),
                    "an abort nobody asked for: {msg:?} on {ev:?}"
                );
                assert_eq!(to, &everyone[..]);
                self.aborted = Some(*rank);
            }
            other => panic!("unexpected broadcast {other:?}"),
        }
    }

    fn planned(&mut self, planned: &[(u32, u64)]) {
        let r = u64::from(self.s.elastic.expect("a plan without ElasticBSP"));
        let live = self.live_workers();
        self.arrivals
            .retain(|w, _| live.contains(w) && !self.done.contains(w));
        let workers: Vec<u32> = planned.iter().map(|p| p.0).collect();
        assert_eq!(workers, self.arrivals.keys().copied().collect::<Vec<_>>());
        for w in live {
            assert!(
                self.arrivals.contains_key(&w) || self.done.contains(&w) || self.at_barrier(w),
                "superstep planned before worker {w} reported"
            );
        }
        for &(w, until) in planned {
            let clock = self.arrivals[&w].0;
            assert!(
                (1..=r).contains(&(until - clock)),
                "worker {w}: {clock} → {until}"
            );
        }
        self.arrivals.clear();
        self.supersteps += 1;
    }

    fn at_barrier(&self, w: u32) -> bool {
        self.arrived.values().any(|a| a.contains(&w))
    }

    fn end(&mut self, how: &Ending, was_down: &BTreeMap<u32, u64>) {
        let all_done_or_dead =
            (0..self.s.workers).all(|w| self.done.contains(&w) || !self.live.contains(&(W, w)));
        match how {
            Ending::Finished => {
                assert!(
                    all_done_or_dead,
                    "the job ended with a worker still at work"
                );
                assert!(!self.done.is_empty());
            }
            Ending::EveryWorkerLeft => {
                assert!(all_done_or_dead);
                assert!(self.done.is_empty());
            }
            Ending::ServerDied { rank } => {
                assert!(self.s.recovery.is_none());
                assert!(!self.live.contains(&(S, *rank)));
            }
            Ending::ServerNotBack { rank } => {
                let deadline = was_down
                    .get(rank)
                    .or(self.down.get(rank))
                    .expect("a server down");
                assert!(
                    self.ms > *deadline,
                    "server {rank} given up before its deadline"
                );
            }
            Ending::Aborted { rank, .. } => {
                assert_eq!(
                    self.aborted,
                    Some(*rank),
                    "the job aborted without telling anyone"
                );
            }
            Ending::CheckpointFailed { .. } => panic!("no checkpoint failed"),
        }
        if self.aborted.is_some() {
            assert!(
                matches!(how, Ending::Aborted { .. }),
                "an abort ended as {how:?}"
            );
        }
        self.ended = Some(how.clone());
    }

    /// The machine agrees with the shadow, and no rule is left pending.
    fn check_state(&mut self) {
        assert_eq!(self.m.live().collect::<BTreeSet<_>>(), self.live);
        let report = self.m.report();
        assert_eq!(report.dead.len(), self.closes, "one death each");
        assert_eq!(report.evicted.len(), self.evictions);
        assert_eq!(report.rejoined.len(), self.joins);
        assert_eq!(report.supersteps, self.supersteps);
        assert_eq!(report.steals, self.steals);
        assert_eq!(report.tasks_transferred, self.transferred);
        assert_eq!(self.m.ended(), self.ended.is_some());
        if self.ended.is_some() {
            return;
        }
        let live = self.live_workers();
        // Every node alive has been heard from within the suspicion timeout.
        if let Some(limit) = self.s.suspicion {
            for n in &self.live {
                if !(n.0 == W && self.done.contains(&n.1)) {
                    assert!(
                        u128::from(self.ms - self.heard[n]) <= limit.as_millis(),
                        "{n:?} silent and alive"
                    );
                }
            }
        }
        // No barrier every live worker reached is left standing.
        for (seq, arrived) in &self.arrived {
            assert!(
                !live
                    .iter()
                    .all(|w| arrived.contains(w) || self.done.contains(w)),
                "barrier {seq} should have fallen"
            );
        }
        // No superstep every live worker reported at is left unplanned.
        if self.s.elastic.is_some() {
            self.arrivals
                .retain(|w, _| live.contains(w) && !self.done.contains(w));
            assert!(
                self.arrivals.is_empty()
                    || !live.iter().all(|w| self.arrivals.contains_key(w)
                        || self.done.contains(w)
                        || self.at_barrier(*w)),
                "a superstep should have been planned"
            );
        }
        // The job goes on only while a live worker has not finished, and no server is past
        // its recovery deadline.
        assert!(
            live.iter().any(|w| !self.done.contains(w)),
            "the job should have ended"
        );
        assert!(self.down.values().all(|&d| self.ms <= d));
        assert_eq!(self.m.barriers_fallen(), self.fallen);
    }
}

fn any_settings() -> impl Strategy<Value = Settings> {
    (
        1u32..3,
        1u32..5,
        prop::option::of(50u64..200),
        prop::option::of(100u64..400),
        prop::option::of(1u32..4),
    )
        .prop_map(
            |(servers, workers, suspicion, recovery, elastic)| Settings {
                suspicion: suspicion.map(Duration::from_millis),
                recovery: recovery.map(Duration::from_millis),
                elastic,
                ..settings(servers, workers)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn membership_follows_its_rules(
        s in any_settings(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut sim = Sim::new(s);
        for op in &ops {
            sim.step(op);
        }
    }

    #[test]
    fn nodes_that_keep_beating_never_die(
        workers in 1u32..5,
        gaps in prop::collection::vec(0u64..100, 1..80),
    ) {
        // Every node beats at least every 100 ms; the suspicion timeout is 100 ms.
        let s = Settings { suspicion: Some(Duration::from_millis(100)), ..settings(2, workers) };
        let base = Instant::now();
        let mut m = Membership::new(s, SchedulerReport::default(), base);
        let mut out = Vec::new();
        let mut ms = 0;
        for gap in gaps {
            ms += gap;
            let now = base + Duration::from_millis(ms);
            let nodes: Vec<Node> = m.live().collect();
            for node in nodes {
                m.on_event(Event::Message { node, msg: Some(Msg::Heartbeat) }, now, &mut out);
            }
            m.on_event(Event::Tick, now, &mut out);
        }
        prop_assert!(out.is_empty(), "{:?}", out);
        prop_assert!(m.report().dead.is_empty());
    }

    #[test]
    fn rendezvous_assigns_every_rank_once(
        servers in 1u32..4,
        workers in 1u32..5,
        hellos in prop::collection::vec(
            (
                any::<bool>(),
                prop::option::of(0u32..6),
                prop::bool::weighted(0.9),
                prop::bool::weighted(0.1),
            ),
            1..40,
        ),
    ) {
        let mut r = Rendezvous::new(servers, workers);
        let mut peers = Vec::new();
        for (i, &(server, rank, proof_ok, leave)) in hellos.iter().enumerate() {
            let peer = i as u64;
            let role = if server { S } else { W };
            let want = if server { servers } else { workers };
            let had = r.ranks().iter().filter(|(n, _)| n.0 == role).count() as u32;
            // Taken: asked for by an admitted peer of the role.
            let taken = r
                .ranks()
                .iter()
                .any(|(n, p)| n.0 == role && Some(n.1) == rank && hellos[*p as usize].1 == rank);
            let got = r.hello(peer, role, rank, proof_ok);
            let may = proof_ok && had < want && rank.is_none_or(|k| k < want && !taken);
            prop_assert_eq!(got.is_ok(), may, "{:?}", got);
            prop_assert_eq!(r.admitted(peer), may);
            if may {
                peers.push(peer);
            }
            if leave && let Some(p) = peers.pop() {
                r.left(p);
                prop_assert!(!r.admitted(p));
            }
            let ranks = r.ranks();
            for role in [S, W] {
                let count = ranks.iter().filter(|(n, _)| n.0 == role).count();
                let mine: BTreeSet<u32> =
                    ranks.iter().filter(|(n, _)| n.0 == role).map(|(n, _)| n.1).collect();
                prop_assert_eq!(mine.len(), count, "a rank given twice");
                let want = if role == S { servers } else { workers };
                prop_assert!(mine.iter().all(|&k| k < want));
            }
            // A peer that asked for a rank has it.
            for (n, p) in &ranks {
                if let Some(k) = hellos[*p as usize].1 {
                    prop_assert_eq!(n.1, k);
                }
            }
            prop_assert_eq!(r.complete(), ranks.len() as u32 == servers + workers);
            prop_assert_eq!(r.missing() == "none", r.complete());
        }
    }
}

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

fn msg(node: Node, m: Msg) -> Event {
    Event::Message { node, msg: Some(m) }
}

fn run(m: &mut Membership, ev: Event, now: Instant) -> Vec<Action> {
    let mut out = Vec::new();
    m.on_event(ev, now, &mut out);
    out
}

fn started(s: Settings) -> (Membership, Instant) {
    let base = Instant::now();
    (Membership::new(s, SchedulerReport::default(), base), base)
}

#[test]
fn a_barrier_falls_when_every_live_worker_arrived() {
    let (mut m, t) = started(settings(1, 3));
    assert!(run(&mut m, msg((W, 0), Msg::Barrier { seq: 1 }), t).is_empty());
    assert!(run(&mut m, msg((W, 2), Msg::Barrier { seq: 1 }), t).is_empty());
    assert_eq!(m.arrived(1).map(|a| a.len()), Some(2));
    let out = run(&mut m, msg((W, 1), Msg::Barrier { seq: 1 }), t);
    assert_eq!(
        out,
        vec![Action::Broadcast {
            to: vec![(W, 0), (W, 1), (W, 2)],
            msg: Msg::BarrierDone { seq: 1 }
        }]
    );
    assert_eq!(m.barriers_fallen(), 1);
    assert!(m.arrived(1).is_none());
}

#[test]
fn a_dead_or_finished_worker_no_longer_holds_a_barrier() {
    let (mut m, t) = started(settings(1, 3));
    run(&mut m, msg((W, 0), Msg::Barrier { seq: 4 }), t);
    run(&mut m, msg((W, 1), Msg::Done), t);
    assert!(m.arrived(4).is_some(), "worker 2 has not arrived");
    let out = run(&mut m, Event::Closed { node: (W, 2) }, t);
    assert_eq!(out[0], Action::Close { node: (W, 2) });
    assert!(out.contains(&Action::Broadcast {
        to: vec![(W, 0), (W, 1)],
        msg: Msg::BarrierDone { seq: 4 }
    }));
    assert_eq!(m.barriers_fallen(), 4);
}

#[test]
fn barriers_fall_in_order_and_the_book_has_the_highest() {
    let (mut m, t) = started(settings(1, 2));
    for seq in [3, 1, 2] {
        run(&mut m, msg((W, 0), Msg::Barrier { seq }), t);
    }
    run(&mut m, msg((W, 1), Msg::Barrier { seq: 3 }), t);
    assert_eq!(m.barriers_fallen(), 3);
    let out = run(&mut m, msg((W, 1), Msg::Barrier { seq: 1 }), t);
    assert_eq!(out.len(), 1);
    assert_eq!(m.barriers_fallen(), 3, "the highest fallen, not the last");
}

#[test]
fn a_barrier_from_a_server_is_unexpected() {
    let (mut m, t) = started(settings(1, 1));
    assert!(run(&mut m, msg((S, 0), Msg::Barrier { seq: 1 }), t).is_empty());
    assert!(m.arrived(1).is_none());
}

#[test]
fn a_silent_node_is_evicted_after_the_suspicion_timeout_once() {
    let s = Settings {
        suspicion: Some(Duration::from_millis(100)),
        ..settings(1, 2)
    };
    let (mut m, t) = started(s);
    run(&mut m, msg((W, 0), Msg::Heartbeat), at(t, 60));
    run(&mut m, msg((S, 0), Msg::Heartbeat), at(t, 60));
    // Exactly at the timeout: not yet.
    assert!(run(&mut m, Event::Tick, at(t, 100)).is_empty());
    let out = run(&mut m, Event::Tick, at(t, 101));
    assert!(matches!(
        &out[0],
        Action::Send { to: (W, 1), msg: Msg::Evicted { reason } }
            if reason.contains("silent for 0.1 s")
    ));
    assert_eq!(out[1], Action::Close { node: (W, 1) });
    assert_eq!(
        out[2],
        Action::Broadcast {
            to: vec![(S, 0), (W, 0)],
            msg: Msg::Dead { role: W, rank: 1 }
        }
    );
    assert_eq!(out.len(), 3);
    assert!(!m.is_live((W, 1)));
    assert_eq!(m.report().dead, vec![(W, 1)]);
    assert_eq!(m.report().evicted.len(), 1);
    // Declared once: neither more silence nor its link closing kills it again.
    assert!(run(&mut m, Event::Tick, at(t, 150)).is_empty());
    assert!(run(&mut m, Event::Closed { node: (W, 1) }, at(t, 150)).is_empty());
    assert_eq!(m.report().dead.len(), 1);
}

#[test]
fn without_a_suspicion_timeout_silence_kills_nobody() {
    let (mut m, t) = started(settings(1, 1));
    assert!(run(&mut m, Event::Tick, at(t, 3_600_000)).is_empty());
}

#[test]
fn a_finished_worker_may_be_silent_and_leave() {
    let s = Settings {
        suspicion: Some(Duration::from_millis(100)),
        ..settings(1, 2)
    };
    let (mut m, t) = started(s);
    run(&mut m, msg((W, 0), Msg::Done), t);
    assert!(run(&mut m, Event::Closed { node: (W, 0) }, t).is_empty());
    for n in [(S, 0), (W, 1)] {
        run(&mut m, msg(n, Msg::Heartbeat), at(t, 90));
    }
    assert!(run(&mut m, Event::Tick, at(t, 150)).is_empty());
    assert!(m.is_live((W, 0)) && m.finished((W, 0)));
}

#[test]
fn the_job_ends_when_every_live_worker_is_done() {
    let (mut m, t) = started(settings(1, 2));
    assert!(run(&mut m, msg((W, 0), Msg::Done), t).is_empty());
    let out = run(&mut m, msg((W, 1), Msg::Done), t);
    assert_eq!(
        out,
        vec![
            Action::Broadcast {
                to: vec![(S, 0), (W, 0), (W, 1)],
                msg: Msg::Shutdown
            },
            Action::End(Ending::Finished)
        ]
    );
    assert!(m.ended());
    assert!(Ending::Finished.error().is_none() && Ending::Finished.lingers());
    // Nothing more after the end.
    assert!(run(&mut m, Event::Closed { node: (S, 0) }, t).is_empty());
}

#[test]
fn a_worker_that_died_is_tolerated_while_others_finish() {
    let (mut m, t) = started(settings(1, 2));
    run(&mut m, Event::Closed { node: (W, 1) }, t);
    let out = run(&mut m, msg((W, 0), Msg::Done), t);
    assert_eq!(out.last(), Some(&Action::End(Ending::Finished)));
}

#[test]
fn a_job_whose_every_worker_left_has_failed() {
    let (mut m, t) = started(settings(1, 2));
    run(&mut m, Event::Closed { node: (W, 0) }, t);
    let out = run(&mut m, Event::Closed { node: (W, 1) }, t);
    assert_eq!(out.last(), Some(&Action::End(Ending::EveryWorkerLeft)));
    let e = Ending::EveryWorkerLeft.error().expect("an error");
    assert!(
        e.to_string().contains("every worker left before finishing"),
        "{e}"
    );
}

#[test]
fn a_dead_server_without_checkpoints_ends_the_job() {
    let (mut m, t) = started(settings(2, 1));
    let out = run(&mut m, Event::Closed { node: (S, 1) }, t);
    assert_eq!(
        out,
        vec![
            Action::Close { node: (S, 1) },
            Action::Broadcast {
                to: vec![(S, 0), (W, 0)],
                msg: Msg::Dead { role: S, rank: 1 }
            },
            Action::Broadcast {
                to: vec![(S, 0), (W, 0)],
                msg: Msg::Shutdown
            },
            Action::End(Ending::ServerDied { rank: 1 }),
        ]
    );
    assert!(!Ending::ServerDied { rank: 1 }.lingers());
}

#[test]
fn a_dead_server_with_checkpoints_is_waited_for_and_comes_back() {
    let s = Settings {
        recovery: Some(Duration::from_millis(500)),
        ..settings(2, 3)
    };
    let (mut m, t) = started(s);
    run(&mut m, Event::Closed { node: (W, 2) }, t);
    run(&mut m, Event::Closed { node: (S, 1) }, at(t, 10));
    assert_eq!(m.down().collect::<Vec<_>>(), vec![(1, at(t, 510))]);
    assert!(run(&mut m, Event::Tick, at(t, 510)).is_empty());
    assert_eq!(m.admit(S, Some(1), true), Ok(1));
    assert!(m.admit(S, Some(0), true).is_err(), "server 0 is alive");
    let addr = "10.0.0.9:7000".to_string();
    let out = run(
        &mut m,
        Event::Joined {
            node: (S, 1),
            addr: addr.clone(),
        },
        at(t, 510),
    );
    assert_eq!(
        out,
        vec![
            // It restarts knowing nobody's death.
            Action::Send {
                to: (S, 1),
                msg: Msg::Dead { role: W, rank: 2 }
            },
            Action::Broadcast {
                to: vec![(S, 0), (S, 1), (W, 0), (W, 1)],
                msg: Msg::ServerBack { rank: 1, addr }
            },
        ]
    );
    assert_eq!(m.down().count(), 0);
    assert_eq!(m.report().rejoined, vec![(S, 1)]);
}

#[test]
fn a_server_not_back_in_time_ends_the_job() {
    let s = Settings {
        recovery: Some(Duration::from_millis(500)),
        ..settings(1, 1)
    };
    let (mut m, t) = started(s);
    run(&mut m, Event::Closed { node: (S, 0) }, t);
    let out = run(&mut m, Event::Tick, at(t, 501));
    assert_eq!(
        out.last(),
        Some(&Action::End(Ending::ServerNotBack { rank: 0 }))
    );
    let e = Ending::ServerNotBack { rank: 0 }.error().expect("an error");
    assert!(e.to_string().contains("did not restart"), "{e}");
}

#[test]
fn a_dead_worker_rejoins_by_its_rank() {
    let (mut m, t) = started(settings(1, 3));
    assert!(m.admit(W, Some(1), true).is_err(), "worker 1 is alive");
    run(&mut m, Event::Closed { node: (W, 1) }, t);
    assert_eq!(m.admit(W, Some(1), true), Ok(1));
    assert!(
        m.admit(W, Some(1), false)
            .unwrap_err()
            .contains("wrong job token")
    );
    assert!(
        m.admit(W, None, true)
            .unwrap_err()
            .contains("without a rank")
    );
    assert!(m.admit(W, Some(3), true).is_err(), "out of range");
    assert!(m.admit(Role::Scheduler, Some(0), true).is_err());
    let out = run(
        &mut m,
        Event::Joined {
            node: (W, 1),
            addr: String::new(),
        },
        t,
    );
    assert_eq!(
        out,
        vec![Action::Broadcast {
            to: vec![(S, 0), (W, 0), (W, 1), (W, 2)],
            msg: Msg::Rejoined { rank: 1 }
        }]
    );
    assert!(m.is_live((W, 1)));
    assert_eq!(m.last_heard((W, 1)), Some(t));
}

#[test]
fn a_finished_worker_cannot_rejoin() {
    let (mut m, t) = started(settings(1, 2));
    run(&mut m, msg((W, 0), Msg::Done), t);
    run(&mut m, Event::Closed { node: (W, 0) }, t);
    assert!(m.admit(W, Some(0), true).is_err());
}

#[test]
fn a_superstep_is_planned_when_every_live_worker_reported() {
    let s = Settings {
        elastic: Some(4),
        ..settings(1, 3)
    };
    let (mut m, t) = started(s);
    let ms = 1_000_000;
    run(
        &mut m,
        msg(
            (W, 0),
            Msg::Superstep {
                clock: 10,
                interval_ns: ms,
            },
        ),
        t,
    );
    run(
        &mut m,
        msg(
            (W, 1),
            Msg::Superstep {
                clock: 7,
                interval_ns: 2 * ms,
            },
        ),
        t,
    );
    // Worker 2 waits at a job barrier: it does not hold the superstep.
    let out = run(&mut m, msg((W, 2), Msg::Barrier { seq: 1 }), t);
    let plan = plan_superstep(&[(0, 10, ms), (1, 7, 2 * ms)], 4);
    let sends: Vec<Action> = plan
        .iter()
        .map(|p| Action::Send {
            to: (W, p.worker),
            msg: Msg::Plan { until: p.until },
        })
        .collect();
    assert_eq!(out, sends);
    assert_eq!(m.report().supersteps, 1);
    assert_eq!(m.report().last_plan, plan);
}

#[test]
fn without_elastic_bsp_a_superstep_is_unexpected() {
    let (mut m, t) = started(settings(1, 1));
    assert!(
        run(
            &mut m,
            msg(
                (W, 0),
                Msg::Superstep {
                    clock: 1,
                    interval_ns: 1
                }
            ),
            t
        )
        .is_empty()
    );
    assert_eq!(m.report().supersteps, 0);
}

#[test]
fn a_dead_workers_superstep_report_is_dropped() {
    let s = Settings {
        elastic: Some(2),
        ..settings(1, 2)
    };
    let (mut m, t) = started(s);
    run(
        &mut m,
        msg(
            (W, 0),
            Msg::Superstep {
                clock: 3,
                interval_ns: 0,
            },
        ),
        t,
    );
    let out = run(&mut m, Event::Closed { node: (W, 0) }, t);
    assert!(!out.iter().any(|a| matches!(
        a,
        Action::Send {
            msg: Msg::Plan { .. },
            ..
        }
    )));
    // Worker 1 alone now: its report is planned at once.
    let out = run(
        &mut m,
        msg(
            (W, 1),
            Msg::Superstep {
                clock: 5,
                interval_ns: 0,
            },
        ),
        t,
    );
    assert_eq!(
        out,
        vec![Action::Send {
            to: (W, 1),
            msg: Msg::Plan { until: 6 }
        }]
    );
}

#[test]
fn steals_are_relayed_or_answered_with_none() {
    let (mut m, t) = started(settings(1, 3));
    let steal = |straggler| Msg::Steal {
        straggler,
        helper: 99,
        clock: 5,
        want: 2,
    };
    assert_eq!(
        run(&mut m, msg((W, 0), steal(1)), t),
        vec![Action::Send {
            to: (W, 1),
            msg: Msg::Steal {
                straggler: 1,
                helper: 0,
                clock: 5,
                want: 2
            }
        }]
    );
    let none = |straggler| {
        vec![Action::Send {
            to: (W, 0),
            msg: Msg::Tasks {
                straggler,
                helper: 0,
                clock: 5,
                start: 0,
                end: 0,
            },
        }]
    };
    // From itself, from a finished worker, from a dead one: none.
    assert_eq!(run(&mut m, msg((W, 0), steal(0)), t), none(0));
    run(&mut m, msg((W, 2), Msg::Done), t);
    assert_eq!(run(&mut m, msg((W, 0), steal(2)), t), none(2));
    run(&mut m, Event::Closed { node: (W, 1) }, t);
    let out = run(&mut m, msg((W, 0), steal(1)), t);
    assert_eq!(out, none(1));
    assert_eq!(m.report().steals, 4);
}

/// A steal relayed to a worker that then finishes or dies is answered "none" on its behalf
/// (it will not answer, and the helper would wait for it until its timeout); one it answered
/// is not answered again.
#[test]
fn steals_a_straggler_cannot_answer_any_more_are_answered_none() {
    let (mut m, t) = started(settings(1, 4));
    let steal = |straggler, clock| Msg::Steal {
        straggler,
        helper: 99,
        clock,
        want: 2,
    };
    let none = |straggler, helper, clock| Action::Send {
        to: (W, helper),
        msg: Msg::Tasks {
            straggler,
            helper,
            clock,
            start: 0,
            end: 0,
        },
    };
    // Worker 0 asks worker 1 twice; worker 1 answers the first, then finishes.
    run(&mut m, msg((W, 0), steal(1, 5)), t);
    run(&mut m, msg((W, 0), steal(1, 6)), t);
    let answer = Msg::Tasks {
        straggler: 99,
        helper: 0,
        clock: 5,
        start: 2,
        end: 4,
    };
    assert_eq!(run(&mut m, msg((W, 1), answer), t).len(), 1);
    assert_eq!(run(&mut m, msg((W, 1), Msg::Done), t), vec![none(1, 0, 6)]);
    // Worker 3 asks worker 2, which dies: "none" comes with the news.
    run(&mut m, msg((W, 3), steal(2, 7)), t);
    let out = run(&mut m, Event::Closed { node: (W, 2) }, t);
    assert!(out.contains(&none(2, 3, 7)), "{out:?}");
    // Nothing is left to answer.
    assert!(
        !run(&mut m, msg((W, 1), Msg::Done), t)
            .iter()
            .any(|a| matches!(
                a,
                Action::Send {
                    msg: Msg::Tasks { .. },
                    ..
                }
            ))
    );
}

#[test]
fn tasks_go_to_a_live_helper() {
    let (mut m, t) = started(settings(1, 3));
    let tasks = Msg::Tasks {
        straggler: 99,
        helper: 2,
        clock: 4,
        start: 3,
        end: 8,
    };
    assert_eq!(
        run(&mut m, msg((W, 1), tasks.clone()), t),
        vec![Action::Send {
            to: (W, 2),
            msg: Msg::Tasks {
                straggler: 1,
                helper: 2,
                clock: 4,
                start: 3,
                end: 8
            }
        }]
    );
    assert_eq!(m.report().tasks_transferred, 5);
    run(&mut m, Event::Closed { node: (W, 2) }, t);
    assert!(run(&mut m, msg((W, 1), tasks), t).is_empty());
    assert_eq!(m.report().tasks_transferred, 5);
}

#[test]
fn a_checkpoint_failure_warns_or_stops_the_job() {
    let failed = |failures| Msg::CheckpointFailed {
        rank: 0,
        reason: "disk full".into(),
        failures,
    };
    let (mut m, t) = started(settings(1, 1));
    assert!(run(&mut m, msg((S, 0), failed(1)), t).is_empty());
    assert!(run(&mut m, msg((S, 0), failed(2)), t).is_empty());
    assert_eq!(
        m.report().checkpoint_failures,
        vec![(0, 2, "disk full".to_string())]
    );
    let s = Settings {
        on_checkpoint_failure: OnCheckpointFailure::Stop,
        ..settings(1, 1)
    };
    let (mut m, t) = started(s);
    let out = run(&mut m, msg((S, 0), failed(1)), t);
    let how = Ending::CheckpointFailed {
        rank: 0,
        failures: 1,
        reason: "disk full".into(),
    };
    assert_eq!(out.last(), Some(&Action::End(how.clone())));
    assert!(how.lingers());
    assert!(
        how.error()
            .expect("an error")
            .to_string()
            .contains("disk full")
    );
    // From a worker, it is unexpected.
    let (mut m, t) = started(settings(1, 1));
    assert!(run(&mut m, msg((W, 0), failed(1)), t).is_empty());
    assert!(m.report().checkpoint_failures.is_empty());
}

#[test]
fn any_message_is_a_sign_of_life() {
    let s = Settings {
        suspicion: Some(Duration::from_millis(100)),
        ..settings(1, 1)
    };
    let (mut m, t) = started(s);
    run(
        &mut m,
        Event::Message {
            node: (W, 0),
            msg: None,
        },
        at(t, 90),
    );
    run(
        &mut m,
        msg(
            (S, 0),
            Msg::IterationDone {
                threads: 1,
                tasks: 1,
                nanos: 1,
            },
        ),
        at(t, 90),
    );
    assert!(run(&mut m, Event::Tick, at(t, 150)).is_empty());
    assert_eq!(m.last_heard((W, 0)), Some(at(t, 90)));
}

#[test]
fn the_tick_notices_silence_within_a_quarter_of_the_timeout() {
    let s = Settings {
        suspicion: Some(Duration::from_millis(400)),
        ..settings(1, 1)
    };
    let (m, _) = started(s);
    assert_eq!(
        m.tick_every(Duration::from_secs(1)),
        Duration::from_millis(100)
    );
    assert_eq!(
        m.tick_every(Duration::from_millis(50)),
        Duration::from_millis(50)
    );
    assert_eq!(
        m.tick_every(Duration::from_millis(1)),
        Duration::from_millis(10)
    );
    let (m, _) = started(settings(1, 1));
    assert_eq!(m.tick_every(Duration::from_secs(1)), Duration::from_secs(1));
}

#[test]
fn rendezvous_refuses_what_the_job_has_no_place_for() {
    let mut r = Rendezvous::new(1, 2);
    assert!(
        r.hello(1, S, None, false)
            .unwrap_err()
            .contains("wrong job token")
    );
    assert!(
        r.hello(1, Role::Scheduler, None, true)
            .unwrap_err()
            .contains("one scheduler")
    );
    assert_eq!(r.missing(), "server 0; workers 0, 1");
    r.hello(1, W, Some(1), true).expect("admitted");
    assert!(
        r.hello(2, W, Some(1), true)
            .unwrap_err()
            .contains("duplicate rank")
    );
    assert!(
        r.hello(2, W, Some(2), true)
            .unwrap_err()
            .contains("out of range 0..2")
    );
    assert_eq!(r.missing(), "server 0; worker 0");
    r.hello(2, W, None, true).expect("admitted");
    assert!(
        r.hello(3, W, None, true)
            .unwrap_err()
            .contains("already has its 2 workers")
    );
    assert!(!r.complete());
    r.hello(3, S, None, true).expect("admitted");
    assert!(r.complete());
    assert_eq!(r.missing(), "none");
    assert_eq!(r.ranks(), vec![((S, 0), 3), ((W, 1), 1), ((W, 0), 2)]);
    // A node that leaves frees its place.
    r.left(1);
    assert!(!r.complete() && !r.admitted(1));
    assert_eq!(r.missing(), "worker 1");
}
