//! The synchronization policies' decision cost per push at 8, 64, 1024 and 4096 workers, and
//! ZipLine's runtime at N ∈ {10, 100, 1000} workers and R ∈ {15, 150} beside the ElasticBSP
//! paper's Table II, each beside the physical references measured in the same run: one
//! uncontended atomic `fetch_add` and one cache-missing random read over 64 MiB. Used by
//! `falcon bench policies` and by the criterion bench `benches/policies.rs`, which times the
//! same traces again under criterion.
//!
//! # The workload
//!
//! A discrete-event simulation of a job: worker `w`'s iteration takes `1 + w % 4` time units
//! (1 ms each) plus up to ¼ unit of deterministic jitter; each worker pulls with clock `c`, waits
//! for its `Action::Release` (a parked pull waits until a later event releases it), computes,
//! pushes clock `c`, and pulls `c + 1`. A `Tick` is fed after every `workers` pushes. Every pull
//! reaches the policy (the lock-free fast path is ignored: the policy's worst case). The events
//! are recorded once per (policy, workers) and replayed into a fresh instance of the policy: the
//! first `warm` pushes' events untimed, then the measured pushes. One measured *push* is the
//! events since the previous push up to and including it, and their releases: so the time per
//! push is the policy's whole decision cost per iteration of one worker, without the simulator's
//! own bookkeeping. Policies are deterministic (FluentPS seeds from the shard), so a replay
//! makes the same decisions as the recording; this is checked once per trace.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use crate::reference;
use crate::stats::median;
use crate::zipline;
use falcon_engine::sync::{Action, ElasticBsp, Event, Nanos, PolicySpec, SyncPolicy, Worker};
use serde::Serialize;

/// The policies, as configured (`PolicySpec` strings).
pub const SPECS: [&str; 13] = [
    "bsp",
    "asp",
    "ssp(3)",
    "dssp(2,8)",
    "fluentps(3)",
    "fluentps(3,p=0.5)",
    "fluentps(3,sigmoid)",
    "syncopt(1)",
    "syncopt(auto)",
    "epsp(4)",
    "epsp(4,no-transfer)",
    "flexrr",
    "elasticbsp(15)",
];
/// ElasticBSP with ZipLine as one state machine (the simulator's), R = 15.
const ELASTIC_SIM: &str = "elasticbsp-sim(15)";
pub const WORKERS: [u32; 4] = [8, 64, 1024, 4096];
/// One simulated time unit.
const UNIT: Nanos = 1_000_000;
/// The random-read reference's buffer.
pub const MISS_BYTES: usize = 64 << 20;

/// A policy under test.
#[derive(Clone, Copy, Debug)]
enum Subject {
    Spec(PolicySpec),
    ElasticSim(usize),
}

#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// Its name as configured.
    pub name: &'static str,
    subject: Subject,
}

impl Policy {
    /// Every policy measured.
    pub fn all() -> Vec<Policy> {
        let mut v: Vec<Policy> = SPECS
            .iter()
            .map(|&name| Policy {
                name,
                subject: Subject::Spec(name.parse().expect("a valid policy spec")),
            })
            .collect();
        v.push(Policy {
            name: ELASTIC_SIM,
            subject: Subject::ElasticSim(15),
        });
        v
    }

    fn build(&self, workers: u32) -> Box<dyn SyncPolicy> {
        match self.subject {
            Subject::Spec(spec) => spec.build_for(workers, 0),
            Subject::ElasticSim(r) => Box::new(ElasticBsp::new(workers, r)),
        }
    }
}

/// xorshift64: deterministic jitter without a dependency.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// How long worker `w`'s next iteration takes.
fn iteration_time(w: Worker, rng: &mut XorShift) -> Nanos {
    (1 + u64::from(w % 4)) * UNIT + rng.next() % (UNIT / 4)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Its pull is due (scheduled).
    PullDue,
    /// Its pull `req` is with the policy (not scheduled until released).
    Waiting(u64),
    /// Computing; its push is scheduled.
    Computing,
}

/// A recorded run of one policy: its events, and where the measured pushes end.
pub struct Trace {
    /// The policy.
    pub policy: Policy,
    /// Its workers.
    pub workers: u32,
    /// Warm-up pushes (fewer than asked when capped).
    warm: u64,
    /// True when the time budget cut the warm-up or the measured pushes short.
    capped: bool,
    /// How long the simulation took (policy and simulator).
    pub recorded_in: Duration,
    events: Vec<Event>,
    /// The first measured event.
    start: usize,
    /// One past each measured push (and the tick after it, if any).
    pub ends: Vec<usize>,
    /// Actions answered over the whole trace (the replay check).
    actions: u64,
    /// Pulls and parks in the measured part.
    pulls: u64,
    parks: u64,
}

/// The discrete-event simulation that records a trace.
struct Sim {
    policy: Box<dyn SyncPolicy>,
    name: &'static str,
    workers: u32,
    state: Vec<State>,
    clock: Vec<u64>,
    /// Scheduled worker steps: (at, sequence number, worker).
    due: BinaryHeap<Reverse<(Nanos, u64, Worker)>>,
    seq: u64,
    rng: XorShift,
    events: Vec<Event>,
    out: Vec<Action>,
    actions: u64,
    parks: u64,
}

impl Sim {
    fn schedule(&mut self, at: Nanos, w: Worker) {
        self.due.push(Reverse((at, self.seq, w)));
        self.seq += 1;
    }

    /// Feeds `ev` at time `at` and carries out the releases it answers.
    fn feed(&mut self, ev: Event, at: Nanos) {
        self.events.push(ev);
        self.out.clear();
        self.policy.on_event(ev, &mut self.out);
        self.actions += self.out.len() as u64;
        for i in 0..self.out.len() {
            match self.out[i] {
                Action::Release { worker, req } => {
                    let w = worker as usize;
                    if self.state.get(w) != Some(&State::Waiting(req)) {
                        panic!(
                            "{} at {} workers released pull {req} of worker {worker}, which is \
                             not waiting for it (after {ev:?})",
                            self.name, self.workers
                        );
                    }
                    self.state[w] = State::Computing;
                    let t = at + iteration_time(worker, &mut self.rng);
                    self.schedule(t, worker);
                }
                Action::Park { .. } => self.parks += 1,
                _ => {}
            }
        }
    }
}

/// Simulates `warm + measured` pushes of `policy` with `workers` workers, within about
/// `budget` of wall-clock time: a policy too slow for that gets a shorter warm-up (cut at half
/// the budget) and fewer measured pushes (at least 16), and its trace is marked capped.
fn record(policy: Policy, workers: u32, warm: u64, measured: u64, budget: Duration) -> Trace {
    let began = Instant::now();
    let n = workers as usize;
    let mut sim = Sim {
        policy: policy.build(workers),
        name: policy.name,
        workers,
        state: vec![State::PullDue; n],
        clock: vec![0; n],
        due: BinaryHeap::with_capacity(n),
        seq: 0,
        rng: XorShift(0x2545_F491_4F6C_DD1D ^ u64::from(workers)),
        events: Vec::with_capacity(((warm + measured) * 2 + (warm + measured) / n as u64) as usize),
        out: Vec::new(),
        actions: 0,
        parks: 0,
    };
    for w in 0..workers {
        sim.schedule(0, w);
    }
    let (mut warm, mut capped) = (warm.max(1), false);
    let (mut pushes, mut req, mut now) = (0u64, 0u64, 0);
    let (mut start, mut ends, mut pulls, mut parks_before) = (0, Vec::new(), 0u64, 0u64);
    while (ends.len() as u64) < measured {
        let Some(Reverse((at, _, w))) = sim.due.pop() else {
            // Nobody can run: let time pass once (a policy may release on a tick), then give up.
            now += 1;
            sim.feed(Event::Tick { at: now }, now);
            if sim.due.is_empty() {
                let waiting = sim.state.iter().filter(|s| **s != State::Computing).count();
                panic!(
                    "{} at {workers} workers deadlocked after {pushes} pushes: {waiting} workers \
                     wait on pulls the policy never releases (it reports {} parked)",
                    policy.name,
                    sim.policy.parked()
                );
            }
            continue;
        };
        now = at;
        let wi = w as usize;
        match sim.state[wi] {
            State::PullDue => {
                req += 1;
                sim.state[wi] = State::Waiting(req);
                if pushes >= warm {
                    pulls += 1;
                }
                let ev = Event::Pull {
                    worker: w,
                    clock: sim.clock[wi],
                    req,
                    at,
                };
                sim.feed(ev, at);
            }
            State::Computing => {
                let clock = sim.clock[wi];
                sim.clock[wi] += 1;
                sim.state[wi] = State::PullDue;
                sim.schedule(at, w);
                sim.feed(
                    Event::Push {
                        worker: w,
                        clock,
                        at,
                    },
                    at,
                );
                pushes += 1;
                if pushes % u64::from(workers) == 0 {
                    sim.feed(Event::Tick { at }, at);
                }
                let check = pushes % 8 == 0;
                if pushes <= warm {
                    if pushes < warm && check && began.elapsed() > budget / 2 {
                        (warm, capped) = (pushes, true);
                    }
                    if pushes == warm {
                        start = sim.events.len();
                        parks_before = sim.parks;
                    }
                } else {
                    ends.push(sim.events.len());
                    if check && ends.len() >= 16 && began.elapsed() > budget {
                        capped = true;
                        break;
                    }
                }
            }
            State::Waiting(_) => unreachable!("a waiting worker is not scheduled"),
        }
    }
    Trace {
        policy,
        workers,
        warm,
        capped,
        recorded_in: began.elapsed(),
        start,
        ends,
        actions: sim.actions,
        pulls,
        parks: sim.parks - parks_before,
        events: sim.events,
    }
}

/// Replays a trace into a fresh policy, measured push by push.
pub struct Replay<'a> {
    trace: &'a Trace,
    policy: Box<dyn SyncPolicy>,
    /// The next measured push.
    next: usize,
    out: Vec<Action>,
    /// Actions answered since the last rewind (checked against the recording).
    actions: u64,
}

impl<'a> Replay<'a> {
    /// A replay of `trace`, warmed up.
    pub fn new(trace: &'a Trace) -> Replay<'a> {
        let mut r = Replay {
            trace,
            policy: trace.policy.build(trace.workers),
            next: 0,
            out: Vec::new(),
            actions: 0,
        };
        r.rewind();
        r
    }

    /// A fresh policy, warmed up with the unmeasured events.
    fn rewind(&mut self) {
        self.policy = self.trace.policy.build(self.trace.workers);
        self.actions = 0;
        for &ev in &self.trace.events[..self.trace.start] {
            self.out.clear();
            self.policy.on_event(ev, &mut self.out);
            self.actions += self.out.len() as u64;
        }
        self.next = 0;
    }

    /// Feeds the events of the next `pushes` measured pushes (rewinding, untimed, when the
    /// trace runs out); returns the time spent in the policy.
    pub fn run(&mut self, mut pushes: u64) -> Duration {
        let trace = self.trace;
        let mut spent = Duration::ZERO;
        while pushes > 0 {
            if self.next == trace.ends.len() {
                self.rewind();
            }
            let k = pushes.min((trace.ends.len() - self.next) as u64) as usize;
            let lo = match self.next {
                0 => trace.start,
                i => trace.ends[i - 1],
            };
            let hi = trace.ends[self.next + k - 1];
            let events = &trace.events[lo..hi];
            let t = Instant::now();
            for &ev in events {
                self.out.clear();
                self.policy.on_event(ev, &mut self.out);
                self.actions += self.out.len() as u64;
            }
            spent += t.elapsed();
            self.next += k;
            pushes -= k as u64;
        }
        spent
    }
}

/// How much work the run does.
#[derive(Clone, Copy)]
pub struct Effort {
    warm: fn(u32) -> u64,
    measured: fn(u32) -> u64,
    reps: usize,
    /// Wall-clock budget of one policy's simulation at one worker count.
    budget: Duration,
    atomic_ops: usize,
    misses: usize,
}

/// A full measurement.
pub const FULL: Effort = Effort {
    warm: |n| (16 * u64::from(n)).max(4096),
    measured: |n| (64 * u64::from(n)).max(16384),
    reps: 5,
    budget: Duration::from_secs(4),
    atomic_ops: 1 << 20,
    misses: 1 << 20,
};
/// A short smoke run.
pub const QUICK: Effort = Effort {
    warm: |n| (4 * u64::from(n)).max(512),
    measured: |n| (8 * u64::from(n)).max(1024),
    reps: 1,
    budget: Duration::from_millis(250),
    atomic_ops: 1 << 16,
    misses: 1 << 16,
};

/// One policy at one worker count.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyRow {
    policy: String,
    workers: u32,
    /// Median over the repetitions of the measured pushes' time / pushes.
    ns_per_push: f64,
    /// ns_per_push / one atomic fetch_add.
    x_atomic: f64,
    /// ns_per_push / one cache-missing read.
    x_miss: f64,
    /// Warm-up pushes, measured pushes, and whether the time budget cut them short.
    warm_pushes: u64,
    pushes: u64,
    capped: bool,
    /// The share of the measured pulls the policy parked.
    parked_share: f64,
}

#[derive(Clone, Debug, Serialize)]
/// The whole measurement.
pub struct Summary {
    /// `quick` or `full`.
    pub mode: &'static str,
    atomic_ns: f64,
    miss_ns: f64,
    policies: Vec<PolicyRow>,
    zipline: Vec<zipline::Row>,
}

/// Nanoseconds per item.
pub fn ns_per(d: Duration, n: usize) -> f64 {
    d.as_nanos() as f64 / n as f64
}

/// The summary as markdown tables.
pub fn markdown(s: &Summary) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Physical references (same run): atomic fetch_add {:.2} ns, cache-missing random read \
         over 64 MiB {:.1} ns.\n",
        s.atomic_ns, s.miss_ns
    );
    let _ = writeln!(
        t,
        "Decision cost per push: a steady-state round-robin trace (iteration of worker w: \
         1 + w % 4 units + jitter), every pull reaching the policy; one push = the events since \
         the previous push and this push, with their releases. Median of the repetitions.\n"
    );
    let _ = write!(t, "| policy |");
    for n in WORKERS {
        let _ = write!(t, " {n} w ns/push | ×atomic |");
    }
    let counts: Vec<String> = WORKERS.iter().map(|n| n.to_string()).collect();
    let _ = writeln!(
        t,
        " {} w / {} w | parked pulls {} w |",
        WORKERS[WORKERS.len() - 1],
        WORKERS[0],
        counts.join(" / ")
    );
    let _ = writeln!(t, "|---|{}---:|---|", "---:|---:|".repeat(WORKERS.len()));
    let mut names: Vec<&str> = Vec::new();
    for r in &s.policies {
        if !names.contains(&r.policy.as_str()) {
            names.push(&r.policy);
        }
    }
    for name in names {
        let rows: Vec<&PolicyRow> = s.policies.iter().filter(|r| r.policy == name).collect();
        let _ = write!(t, "| {name} |");
        for r in &rows {
            let mark = if r.capped { "*" } else { "" };
            let _ = write!(t, " {:.1}{mark} | {:.1} |", r.ns_per_push, r.x_atomic);
        }
        let growth = match (rows.first(), rows.last()) {
            (Some(a), Some(b)) if rows.len() == WORKERS.len() => {
                format!("{:.1}×", b.ns_per_push / a.ns_per_push)
            }
            _ => "–".into(),
        };
        let parked: Vec<String> = rows
            .iter()
            .map(|r| format!("{:.0}%", 100.0 * r.parked_share))
            .collect();
        let _ = writeln!(t, " {growth} | {} |", parked.join(" / "));
    }
    let capped: Vec<String> = s
        .policies
        .iter()
        .filter(|r| r.capped)
        .map(|r| {
            format!(
                "{} at {} w: {} warm-up + {} measured pushes",
                r.policy, r.workers, r.warm_pushes, r.pushes
            )
        })
        .collect();
    if !capped.is_empty() {
        let _ = writeln!(
            t,
            "\n\\* Too slow for the time budget, so cut short (not steady state: a lower bound \
             where the cost grows with history): {}.",
            capped.join("; ")
        );
    }
    let _ = writeln!(
        t,
        "\nZipLine (`falcon_engine::sync::zipline::zipline`, one thread) against the ElasticBSP \
         paper's Table II (24-core Xeon); goal: ≥ 10× faster.\n"
    );
    t.push_str(&zipline::table(&s.zipline, s.miss_ns));
    t
}

/// Measures everything once (references, every policy at every worker count, ZipLine) with
/// `effort`; returns the summary and the recorded traces (for a harness that times them
/// again).
pub fn measure(effort: Effort) -> (Summary, Vec<Trace>) {
    let quick = effort.reps == QUICK.reps;
    // The physical references.
    let mut atomic: Vec<f64> = (0..11)
        .map(|_| {
            ns_per(
                reference::atomic_fetch_add(effort.atomic_ops),
                effort.atomic_ops,
            )
        })
        .collect();
    let atomic_ns = median(&mut atomic);
    let miss_ns = reference::miss_ns(MISS_BYTES, effort.misses, effort.reps.max(3));

    // Decision cost per push.
    let mut policies = Vec::new();
    let mut all = Vec::new();
    for policy in Policy::all() {
        let traces: Vec<Trace> = WORKERS
            .iter()
            .map(|&n| {
                let (warm, measured) = ((effort.warm)(n), (effort.measured)(n));
                record(policy, n, warm, measured, effort.budget)
            })
            .collect();
        for t in &traces {
            let pushes = t.ends.len();
            let reps = if t.slow(effort) { 1 } else { effort.reps };
            let mut per_push: Vec<f64> = (0..reps)
                .map(|_| {
                    let mut r = Replay::new(t);
                    let spent = r.run(pushes as u64);
                    assert_eq!(
                        r.actions, t.actions,
                        "{} at {} workers is not deterministic: its replay answers differently",
                        policy.name, t.workers
                    );
                    ns_per(spent, pushes)
                })
                .collect();
            let ns = median(&mut per_push);
            policies.push(PolicyRow {
                policy: policy.name.into(),
                workers: t.workers,
                ns_per_push: ns,
                x_atomic: ns / atomic_ns,
                x_miss: ns / miss_ns,
                warm_pushes: t.warm,
                pushes: pushes as u64,
                capped: t.capped,
                parked_share: t.parks as f64 / t.pulls.max(1) as f64,
            });
        }
        all.extend(traces);
    }

    // ZipLine.
    let zips = zipline::measure(
        effort.reps,
        Duration::from_millis(if quick { 2 } else { 20 }),
    );
    let summary = Summary {
        mode: if quick { "quick" } else { "full" },
        atomic_ns,
        miss_ns,
        policies,
        zipline: zips,
    };
    (summary, all)
}

/// Writes `policies.md` and `policies.json` under `dir`.
pub fn write(summary: &Summary, dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("policies.md"), markdown(summary))?;
    std::fs::write(
        dir.join("policies.json"),
        serde_json::to_string_pretty(summary).unwrap_or_default(),
    )
}

impl Trace {
    /// A trace that took a good part of its budget is slow to replay too: fewer samples.
    pub fn slow(&self, effort: Effort) -> bool {
        self.recorded_in > effort.budget / 4
    }
}
