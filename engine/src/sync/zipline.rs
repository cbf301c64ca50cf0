//! ElasticBSP (Zhao, Cao, Chen, ICDM 2019) and its barrier planner ZipLine.
//!
//! ElasticBSP replaces BSP's barrier after every iteration by barriers after *supersteps* of
//! variable length. At each barrier the server predicts, for each worker, the end times of its
//! next `R` iterations, and picks one predicted end time per worker so that the spread
//! `max − min` (the fastest worker's wait at the next barrier) is as small as possible. Worker
//! `p` then runs `k_p` iterations (the 1-based index of its chosen point) before the next
//! barrier, so the iteration gap between workers is bounded by `R` (the ElasticBSP paper's
//! ZipLine).
//!
//! # ZipLine ([`zipline`])
//!
//! The paper's Algorithm 2, as a pure function:
//!
//! 1. merge the `n·R` candidate points `(time, worker, index)` and sort them (by time, ties by
//!    worker then index);
//! 2. sweep left to right with a window holding, for each worker, its latest point seen (a
//!    newer point of a worker replaces its older one);
//! 3. once the window holds every worker, the current point is its maximum; the window's
//!    minimum is kept in an ordered set, so `d = max − min` is read in `O(log n)`; keep the
//!    first smallest `d`.
//!
//! The paper's step 4 (drop the window's minimum after each evaluation) only skips windows
//! that cannot be better; evaluating at every point after coverage sees a superset of the
//! paper's windows, all of them valid combinations, and the optimum among them: for the best
//! combination with maximum `T` and minimum `m`, the window right after the last point at time
//! `T` holds, for each worker, its latest point `≤ T`, which is `≥` its point in the optimum,
//! so its spread is `≤ T − m`. Ties are broken by the earliest sweep position, i.e. among the
//! combinations of smallest spread the one whose barrier comes first (smallest maximum), and
//! within it each worker's latest point. Cost: `O(n·R·log(n·R))` for the sort plus
//! `O(n·R·log n)` for the sweep, `O(n·R)` memory. The function does not need each worker's
//! candidates sorted. It is proved against brute force (all `R^n` combinations) in
//! `engine/tests/policies_fluentps_zipline.rs`.
//!
//! # The policy ([`ElasticBsp`])
//!
//! Each worker `w` has a barrier clock `b_w`: its pulls at clocks `< b_w` are released at once,
//! a pull at `≥ b_w` is parked. The barrier **falls** when every live worker has pushed
//! every iteration before its barrier (applied count `≥ b_w`). Then, at the time `T` of the
//! event that completed it, the policy plans the next superstep: for each live worker it
//! predicts end times `T + j·I_w`, `j = 1..=R`, where `I_w` is its estimated iteration
//! interval, runs [`zipline`], and sets `b_w = applied_w + k_w` with `k_w ∈ 1..=R`. All parked
//! pulls are then released in one batch, ordered by `(clock, req, worker)`. Between barriers
//! pushes are applied as they arrive (ASP-like; the paper says only that ElasticBSP "allows
//! asynchronous gradient updates to a certain extent", this reading is ours).
//!
//! The first superstep is a single iteration (`b_w = 1`): no interval is known yet.
//!
//! ## Events consumed
//!
//! - `Push { worker, clock, at }` (a gradient not seen before, `clock + 1 >` applied): raises the
//!   applied count and records one **interval sample** `at − start`, where `start` is the start
//!   of that iteration as the policy knows it: the previous push's `at`, or, if the worker's
//!   pull was parked at a barrier since, the `at` of the event that released it (the wait is
//!   not compute time), or, for the first iteration after start or a `Join`, the `at` of its
//!   first pull. `I_w` is the mean of the last `window` samples (default 1: the paper's "most
//!   recent interval"), at least 1 ns. A worker without a sample is given the mean estimate of
//!   those that have one; if nobody has one the next superstep is a single iteration. A
//!   repeated or older push changes nothing. A push may complete the barrier.
//! - `Pull { worker, clock, req, at }`: released if `clock < b_w`, otherwise parked (and counted
//!   in [`SyncPolicy::delayed_total`]). The first pull's `at` starts the interval clock.
//!   Every pull must reach the policy ([`FastPath::Never`]): barriers are per worker.
//! - `Leave { worker }`: the worker no longer holds the barrier back (it may fall now).
//! - `Join { worker, clock }`: the worker is live again with at least `clock` applied and
//!   `b_w = applied`: it waits at the current barrier and is planned for at the next one.
//! - `Tick`: nothing (the barrier falls on pushes and membership changes only).
//!
//! Events about workers outside `0..workers` are ignored (no action, no panic).

use std::collections::{BTreeSet, VecDeque};

use super::{Action, Event, FastPath, Nanos, SyncPolicy, Worker};

/// A ZipLine answer: one candidate per worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Zip {
    /// For each worker, the 0-based index of its chosen candidate: it runs `picks[w] + 1`
    /// iterations before the next barrier.
    pub picks: Vec<usize>,
    /// The earliest chosen time.
    pub low: Nanos,
    /// The latest chosen time: when the barrier is expected to fall.
    pub high: Nanos,
}

impl Zip {
    /// `high − low`: how long the first worker to arrive is expected to wait.
    pub fn spread(&self) -> Nanos {
        self.high - self.low
    }
}

/// ZipLine: one candidate time per worker minimizing `max − min` (see the [module docs](self)).
/// `candidates[w]` are worker `w`'s predicted iteration end times. `None` when there are no
/// workers or a worker has no candidate. `O(n·R·log(n·R))`.
pub fn zipline<C: AsRef<[Nanos]>>(candidates: &[C]) -> Option<Zip> {
    let n = candidates.len();
    if n == 0 || candidates.iter().any(|c| c.as_ref().is_empty()) {
        return None;
    }
    let mut pts: Vec<(Nanos, usize, usize)> = candidates
        .iter()
        .enumerate()
        .flat_map(|(w, c)| c.as_ref().iter().enumerate().map(move |(i, &t)| (t, w, i)))
        .collect();
    pts.sort_unstable();
    // The window: each worker's latest point, ordered by time to read its minimum.
    let mut latest: Vec<Option<Nanos>> = vec![None; n];
    let mut window: BTreeSet<(Nanos, usize)> = BTreeSet::new();
    let mut best: Option<(Nanos, usize)> = None;
    for (j, &(t, w, _)) in pts.iter().enumerate() {
        if let Some(old) = latest[w].replace(t) {
            window.remove(&(old, w));
        }
        window.insert((t, w));
        if window.len() == n {
            let (lo, _) = *window.first().expect("n > 0");
            let d = t - lo;
            if best.is_none_or(|(b, _)| d < b) {
                best = Some((d, j));
                if d == 0 {
                    break;
                }
            }
        }
    }
    let (_, pos) = best.expect("every worker has a candidate, so the window fills");
    let mut picks = vec![0usize; n];
    for &(_, w, i) in &pts[..=pos] {
        picks[w] = i;
    }
    let high = pts[pos].0;
    let low = picks
        .iter()
        .enumerate()
        .map(|(w, &i)| candidates[w].as_ref()[i])
        .min()
        .expect("n > 0");
    Some(Zip { picks, low, high })
}

/// The next `r` iteration end times of a worker that starts at `now` and takes `interval` per
/// iteration: `now + j·interval` for `j = 1..=r` (saturating).
pub fn predict(now: Nanos, interval: Nanos, r: usize) -> Vec<Nanos> {
    (1..=r as u64)
        .map(|j| now.saturating_add(interval.saturating_mul(j)))
        .collect()
}

/// How many recent interval samples an ElasticBSP estimate averages, in the real job (each
/// worker's gate) and in the simulator (the policy) alike.
pub const INTERVAL_WINDOW: usize = 4;

/// A worker's iteration interval, estimated as the mean of its last `window` samples (at
/// least 1 ns each). The one estimator of ElasticBSP: the worker's gate reports it to the
/// scheduler at a barrier, and [`ElasticBsp`] (the simulator's job-wide policy) keeps one per
/// worker, so the real job and the simulator plan from the same numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntervalEstimate {
    window: usize,
    samples: VecDeque<Nanos>,
}

impl Default for IntervalEstimate {
    fn default() -> Self {
        IntervalEstimate::new(INTERVAL_WINDOW)
    }
}

impl IntervalEstimate {
    /// An estimator over the last `window` samples (`≥ 1`; 0 counts as 1).
    pub fn new(window: usize) -> IntervalEstimate {
        IntervalEstimate {
            window: window.max(1),
            samples: VecDeque::new(),
        }
    }

    /// Records one interval (0 is taken as 1 ns), forgetting the oldest past the window.
    pub fn record(&mut self, interval: Nanos) {
        self.samples.push_back(interval.max(1));
        while self.samples.len() > self.window {
            self.samples.pop_front();
        }
    }

    /// The mean of the recent samples, `None` before the first.
    pub fn estimate(&self) -> Option<Nanos> {
        if self.samples.is_empty() {
            return None;
        }
        let sum: u128 = self.samples.iter().map(|&x| u128::from(x)).sum();
        Some(u64::try_from(sum / self.samples.len() as u128).unwrap_or(u64::MAX))
    }
}

/// One barrier's plan, as [`ElasticBsp`] made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// When the barrier fell (the `at` of the event that completed it).
    pub at: Nanos,
    /// The workers planned for (the live ones), in rank order.
    pub workers: Vec<Worker>,
    /// Their predicted end times, `candidates[i]` for `workers[i]`; empty when no worker had
    /// an interval estimate (then every worker got one iteration).
    pub candidates: Vec<Vec<Nanos>>,
    /// ZipLine's answer over `candidates` (`None` when they are empty).
    pub zip: Option<Zip>,
}

/// ElasticBSP with ZipLine barriers for one shard (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct ElasticBsp {
    r: usize,
    applied: Vec<u64>,
    live: Vec<bool>,
    barrier: Vec<u64>,
    /// When the worker's current iteration started, as far as the policy knows.
    started: Vec<Option<Nanos>>,
    intervals: Vec<IntervalEstimate>,
    /// Parked pulls: (clock, req, worker).
    parked: Vec<(u64, u64, Worker)>,
    delayed: u64,
    supersteps: u64,
    plan: Option<Plan>,
}

impl ElasticBsp {
    /// ElasticBSP for `workers` workers, each predicted `r` iterations ahead (`r ≥ 1`; 0 counts
    /// as 1), from the mean of its last [`INTERVAL_WINDOW`] intervals, as the real job's
    /// workers estimate theirs.
    pub fn new(workers: u32, r: usize) -> ElasticBsp {
        let n = workers as usize;
        ElasticBsp {
            r: r.max(1),
            applied: vec![0; n],
            live: vec![true; n],
            barrier: vec![1; n],
            started: vec![None; n],
            intervals: vec![IntervalEstimate::default(); n],
            parked: Vec::new(),
            delayed: 0,
            supersteps: 0,
            plan: None,
        }
    }

    /// Estimates each interval as the mean of the last `window` samples (`≥ 1`) instead of the
    /// last [`INTERVAL_WINDOW`].
    pub fn with_window(mut self, window: usize) -> ElasticBsp {
        for iv in &mut self.intervals {
            *iv = IntervalEstimate::new(window);
        }
        self
    }

    /// How far ahead each worker is predicted (`R`).
    pub fn lookahead(&self) -> usize {
        self.r
    }

    /// `worker`'s barrier: its pulls at this clock or later are parked until the barrier falls.
    /// `None` for an unknown worker.
    pub fn barrier(&self, worker: Worker) -> Option<u64> {
        self.barrier.get(worker as usize).copied()
    }

    /// `worker`'s estimated iteration interval, if it has one.
    pub fn estimate(&self, worker: Worker) -> Option<Nanos> {
        self.intervals.get(worker as usize)?.estimate()
    }

    /// How many barriers have fallen.
    pub fn supersteps(&self) -> u64 {
        self.supersteps
    }

    /// The plan made at the last barrier.
    pub fn last_plan(&self) -> Option<&Plan> {
        self.plan.as_ref()
    }

    fn known(&self, w: Worker) -> bool {
        (w as usize) < self.applied.len()
    }

    fn barrier_complete(&self) -> bool {
        (0..self.applied.len()).all(|w| !self.live[w] || self.applied[w] >= self.barrier[w])
    }

    /// The barrier fell at `at`: plan the next superstep and release every parked pull.
    fn fall(&mut self, at: Nanos, out: &mut Vec<Action>) {
        self.supersteps += 1;
        let n = self.applied.len();
        let workers: Vec<Worker> = (0..n)
            .filter(|&w| self.live[w])
            .map(|w| w as Worker)
            .collect();
        let est: Vec<Option<Nanos>> = workers.iter().map(|&w| self.estimate(w)).collect();
        let known: Vec<Nanos> = est.iter().flatten().copied().collect();
        let mut plan = Plan {
            at,
            workers: workers.clone(),
            candidates: Vec::new(),
            zip: None,
        };
        if known.is_empty() {
            for &w in &workers {
                self.barrier[w as usize] = self.applied[w as usize] + 1;
            }
        } else {
            let fill = (known.iter().map(|&x| x as u128).sum::<u128>() / known.len() as u128).max(1)
                as Nanos;
            plan.candidates = est
                .iter()
                .map(|e| predict(at, e.unwrap_or(fill), self.r))
                .collect();
            let zip = zipline(&plan.candidates).expect("live workers, R ≥ 1");
            for (i, &w) in workers.iter().enumerate() {
                self.barrier[w as usize] = self.applied[w as usize] + zip.picks[i] as u64 + 1;
            }
            plan.zip = Some(zip);
        }
        for w in 0..n {
            if !self.live[w] {
                // Holds nobody back; its own stray pulls may go.
                self.barrier[w] = self.applied[w] + 1;
            }
        }
        self.plan = Some(plan);
        self.parked.sort_unstable();
        let barrier = &self.barrier;
        let started = &mut self.started;
        self.parked.retain(|&(clock, req, worker)| {
            if clock < barrier[worker as usize] {
                out.push(Action::Release { worker, req });
                started[worker as usize] = Some(at);
                false
            } else {
                true
            }
        });
    }
}

impl SyncPolicy for ElasticBsp {
    fn name(&self) -> String {
        format!("elastic-bsp(R={})", self.r)
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        let at = match ev {
            Event::Pull {
                worker,
                clock,
                req,
                at,
            } if self.known(worker) => {
                let w = worker as usize;
                if self.started[w].is_none() {
                    self.started[w] = Some(at);
                }
                if clock < self.barrier[w] {
                    out.push(Action::Release { worker, req });
                } else {
                    self.parked.push((clock, req, worker));
                    self.delayed += 1;
                    out.push(Action::Park { worker, req });
                }
                return;
            }
            Event::Push { worker, clock, at } if self.known(worker) => {
                let w = worker as usize;
                if clock.saturating_add(1) > self.applied[w] {
                    self.applied[w] = clock.saturating_add(1);
                    if let Some(start) = self.started[w] {
                        self.intervals[w].record(at.saturating_sub(start));
                    }
                    self.started[w] = Some(at);
                }
                at
            }
            Event::Leave { worker, at } if self.known(worker) => {
                self.live[worker as usize] = false;
                at
            }
            Event::Join { worker, clock, at } if self.known(worker) => {
                let w = worker as usize;
                self.live[w] = true;
                self.applied[w] = self.applied[w].max(clock);
                self.barrier[w] = self.applied[w];
                self.started[w] = None;
                at
            }
            _ => return,
        };
        if self.live.iter().any(|&l| l) && self.barrier_complete() {
            self.fall(at, out);
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Never
    }

    fn parked(&self) -> usize {
        self.parked.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }
}

/// ElasticBSP's shard side in a real job: pushes are applied as they arrive and pulls are
/// answered at once (the worker only pulls once the job-wide barrier let it through). The
/// barriers themselves are planned by the scheduler, which runs ZipLine over every worker's
/// estimated interval, so all shards agree on them ([`ElasticBsp`] is the same algorithm as one
/// state machine, for the simulator).
#[derive(Clone, Debug)]
pub struct ElasticBspShard {
    r: u32,
}

impl ElasticBspShard {
    /// The shard side of ElasticBSP with look-ahead `r`.
    pub fn new(r: u32) -> ElasticBspShard {
        ElasticBspShard { r: r.max(1) }
    }
}

impl SyncPolicy for ElasticBspShard {
    fn name(&self) -> String {
        format!("elasticbsp({})", self.r)
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        super::Asp.on_event(ev, out)
    }

    fn fast_path(&self) -> FastPath {
        super::Asp.fast_path()
    }

    fn parked(&self) -> usize {
        0
    }

    fn delayed_total(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_estimate_is_the_mean_of_the_last_four_samples_in_the_job_and_the_policy() {
        let mut est = IntervalEstimate::default();
        assert_eq!(est.estimate(), None);
        for (sample, mean) in [(10, 10), (20, 15), (30, 20), (40, 25), (100, 47), (0, 42)] {
            est.record(sample);
            assert_eq!(est.estimate(), Some(mean), "after {sample}");
        }
        // The simulator's policy: pushes every 10, 20, 30, 40, 100 ns give the same estimate.
        let mut e = ElasticBsp::new(1, 3);
        let mut out = Vec::new();
        e.on_event(
            Event::Pull {
                worker: 0,
                clock: 0,
                req: 1,
                at: 0,
            },
            &mut out,
        );
        let mut at = 0;
        for (clock, step) in [10u64, 20, 30, 40, 100].into_iter().enumerate() {
            at += step;
            e.on_event(
                Event::Push {
                    worker: 0,
                    clock: clock as u64,
                    at,
                },
                &mut out,
            );
        }
        assert_eq!(e.estimate(0), Some((20 + 30 + 40 + 100) / 4));
    }
    use super::*;

    #[test]
    fn zipline_picks_the_aligned_points() {
        // Intervals 2 and 3 from t = 0: 2,4,6,8 and 3,6,9,12 meet at 6.
        let z = zipline(&[predict(0, 2, 4), predict(0, 3, 4)]).unwrap();
        assert_eq!(z.picks, vec![2, 1]);
        assert_eq!((z.low, z.high, z.spread()), (6, 6, 0));
        assert!(zipline::<Vec<Nanos>>(&[]).is_none());
        assert!(zipline(&[vec![1], vec![]]).is_none());
    }
}
