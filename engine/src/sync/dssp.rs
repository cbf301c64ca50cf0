//! Dynamic stale-synchronous parallel (DSSP; Zhao, An, Liu, Chen, ICDCS 2019).
//!
//! The user gives a range `[s_L, s_U]` instead of one bound; `r_max = s_U − s_L`. Per worker
//! the server keeps its push count `t[i]` (here the applied count, as for SSP), the extra
//! iterations still granted to it `r[i]`, and the timestamps of its latest two pushes
//! `A[i] = [latest, second latest]` (the `at` of its last two [`Event::Push`]es). On a push of
//! worker `p` (paper, Alg. 1) the server decides whether `p` may start its next iteration:
//!
//! ```text
//! t[p] += 1; A[p] = [now, A[p][0]]
//! if r[p] > 0:                      r[p] -= 1; OK            (spending an earlier grant)
//! elif t[p] - t[slowest] <= s_L:    OK
//! elif p is the fastest worker:     r* = controller(p); if r* > 0 { grant; OK } else hold
//! else:                             hold until t[p] - t[slowest] <= s_L
//! ```
//!
//! The synchronization controller (paper, Alg. 2; [`Dssp::controller`]) predicts `p`'s next
//! pushes `SimP[r] = A[p][0] + r·I_p` and the slowest worker `q`'s `SimQ[k] = A[q][0] + I_q +
//! k·I_q` (`I = A[0] − A[1]`, `r, k = 0..=r_max`) and returns the `r*` whose `SimP[r*]` is
//! nearest to any `SimQ[k]` (smallest predicted wait), found by a two-pointer merge.
//!
//! # Mapping onto falcon's events
//!
//! In falcon the worker asks before iteration `c` by pulling with clock `c`, so the paper's
//! "OK after push `c`" is the release of the pull at clock `c + 1`. The *decision* is taken at
//! push time, exactly as in the paper (the grant counter moves on every push, whatever the
//! pull does later): a grant is recorded as "pulls of `p` up to clock `c + 1` are allowed".
//! A pull at clock `c` is released iff `min_applied >= c − s_L`
//! ([`crate::meta::within_staleness`], the same `≥` bound as [`super::Ssp`]) or a push-time
//! decision granted clock `c`. Otherwise it is parked until one of the two holds. The paper's
//! `t[p] − t[slowest] ≤ s_L` with `t[p] = c` is that same predicate.
//!
//! # Decisions this implementation settles
//!
//! - **Off-by-one: a grant of `r*` is `r*` iterations, the granting push counting as the
//!   first.** The paper's listing OKs the granting push and then decrements `r` on each of the
//!   next `r*` pushes, i.e. `r* + 1` iterations past the blocking point, while its Fig. 2 text
//!   says "run 3 more iterations" for `r* = 3`. We store `r[p] = r* − 1` after the granting
//!   push, so `p` runs `r*` iterations past the point where it would block, and the gap it
//!   reaches is at most `s_L + r* ≤ s_U`. `SimP[r*]` is then exactly the predicted time of the
//!   push after which `p` blocks, which is what the controller minimises the wait from.
//! - **Never past `s_U`.** Read literally, the listing calls the controller again as soon as a
//!   grant is spent if `p` is still the fastest, so grants could stack beyond `s_U`; the
//!   paper's own bound (regret of SSP with `s = s_L + r_max`) assumes they do not. When the
//!   controller is called at gap `g = t[p] − t[slowest]` (for the pull at clock `t[p]`), `r` is
//!   restricted to `0..=min(r_max, s_U + 1 − g)`, so every release satisfies
//!   `min_applied >= c − s_U`. At the usual call point `g = s_L + 1` this is `0..=r_max`, the
//!   paper's range; `SimQ` always has `r_max + 1` entries.
//! - **Before two pushes: no grant.** The controller needs `p`'s and `q`'s latest interval;
//!   while either has fewer than two pushes recorded (since the start or since it (re)joined)
//!   `r* = 0`, so DSSP behaves as SSP(`s_L`).
//! - **Ties.** "Fastest" means `t[p] ≥ t[j]` for every live `j` (ties count as fastest); the
//!   slowest worker `q` is the live worker with the smallest `t`, lowest rank on ties. Among
//!   equally near `r`, the controller returns the smallest (least staleness). Intervals use
//!   saturating subtraction (a clock that runs backwards gives an interval of 0).
//! - **Membership.** A worker that leaves no longer counts as slowest or fastest (as in SSP).
//!   A worker that (re)joins loses its grant and its push history (two fresh pushes are needed
//!   before the controller uses it). A grant given while a worker was gone was sized against a
//!   minimum that worker's return may lower, so a grant is honoured only while the pull stays
//!   within `s_U` of the live minimum at the moment of release; past it the pull waits. Pushes that do not advance a worker's count (duplicates)
//!   change nothing. Events about unknown workers are ignored.
//! - **Fast path: `Within(s_L)`.** A pull within `s_L` is always released by the policy too,
//!   and grants are counted on pushes (which the policy always sees), not on pulls, so a pull
//!   that skips the policy loses no bookkeeping. Nothing looser is safe: grants are per worker
//!   and the one-sided check cannot see them, so pulls past `s_L` must reach the policy.
//!
//! With `s_U = s_L` the controller can only return 0 and DSSP is SSP(`s_L`) action for action
//! (a property test checks it).

use std::collections::BTreeSet;

use super::{Action, Clocks, Event, FastPath, Nanos, SyncPolicy, Worker};
use crate::meta::within_staleness;

/// DSSP with staleness range `[s_lower, s_upper]`.
#[derive(Clone, Debug)]
pub struct Dssp {
    s_lower: u64,
    s_upper: u64,
    clocks: Clocks,
    /// `r[i]`: granted iterations still to spend after the current one.
    grant: Vec<u64>,
    /// Pulls of worker `i` up to this clock are allowed by a grant.
    ok_through: Vec<u64>,
    /// `A[i]`: latest and second-latest push timestamps.
    stamps: Vec<[Option<Nanos>; 2]>,
    /// Parked pulls no grant covers: (clock, req, worker), answered within `s_L`.
    plain: BTreeSet<(u64, u64, Worker)>,
    /// The same pulls by worker: (worker, clock, req), for a grant to find its worker's.
    plain_of: BTreeSet<(Worker, u64, u64)>,
    /// Parked pulls a grant covers, answered within `s_U`.
    granted_pulls: BTreeSet<(u64, u64, Worker)>,
    delayed: u64,
    controller_calls: u64,
    extra_granted: u64,
    /// Per worker, the sum of the `r*` granted to it.
    granted: Vec<u64>,
}

impl Dssp {
    /// DSSP for `workers` workers with staleness range `[s_lower, s_upper]`
    /// (`r_max = s_upper − s_lower`). The paper's experiments use `[3, 15]`.
    ///
    /// # Panics
    /// If `s_lower > s_upper`.
    pub fn new(workers: u32, s_lower: u64, s_upper: u64) -> Dssp {
        assert!(
            s_lower <= s_upper,
            "DSSP needs s_lower <= s_upper, got [{s_lower}, {s_upper}]"
        );
        let n = workers as usize;
        Dssp {
            s_lower,
            s_upper,
            clocks: Clocks::ranked(workers),
            grant: vec![0; n],
            ok_through: vec![0; n],
            stamps: vec![[None; 2]; n],
            plain: BTreeSet::new(),
            plain_of: BTreeSet::new(),
            granted_pulls: BTreeSet::new(),
            delayed: 0,
            controller_calls: 0,
            extra_granted: 0,
            granted: vec![0; n],
        }
    }

    /// `r_max = s_U − s_L`, the most extra iterations one grant may give.
    pub fn r_max(&self) -> u64 {
        self.s_upper - self.s_lower
    }

    /// The granted iterations `worker` still has to spend after its current one (`r[i]`);
    /// 0 for unknown workers.
    pub fn grant(&self, worker: Worker) -> u64 {
        self.grant.get(worker as usize).copied().unwrap_or(0)
    }

    /// How many times the synchronization controller ran.
    pub fn controller_calls(&self) -> u64 {
        self.controller_calls
    }

    /// The sum of the `r*` the controller returned: extra iterations granted beyond `s_L`.
    pub fn extra_granted_total(&self) -> u64 {
        self.extra_granted
    }

    /// The synchronization controller (paper, Alg. 2) for the fastest worker `p` and the
    /// slowest worker `q`, each given as `[latest, second-latest]` push timestamps: the number
    /// of extra iterations `r* ∈ 0..=r_max` after which `p`'s predicted push
    /// `SimP[r] = p[0] + r·I_p` is nearest to one of `q`'s predicted pushes
    /// `SimQ[k] = q[0] + (k + 1)·I_q`, `k ∈ 0..=r_max`. Ties go to the smallest `r`. Runs in
    /// `O(r_max)`.
    pub fn controller(p: [Nanos; 2], q: [Nanos; 2], r_max: u64) -> u64 {
        Self::choose(p, q, r_max, r_max)
    }

    /// [`Dssp::controller`] with `r` limited to `0..=r_limit` (`SimQ` keeps `r_max + 1`
    /// entries).
    fn choose(p: [Nanos; 2], q: [Nanos; 2], r_max: u64, r_limit: u64) -> u64 {
        let ip = u128::from(p[0].saturating_sub(p[1]));
        let iq = u128::from(q[0].saturating_sub(q[1]));
        let sim_p = |r: u64| u128::from(p[0]) + u128::from(r) * ip;
        let sim_q = |k: u64| u128::from(q[0]) + (u128::from(k) + 1) * iq;
        let (mut best_d, mut best_r) = (u128::MAX, 0);
        // `k`: the last SimQ entry <= SimP[r] (or 0); both arrays are sorted, so it only moves
        // forward. The nearest SimQ entry to SimP[r] is SimQ[k] or SimQ[k + 1].
        let mut k = 0;
        for r in 0..=r_limit.min(r_max) {
            let x = sim_p(r);
            while k < r_max && sim_q(k + 1) <= x {
                k += 1;
            }
            let mut d = sim_q(k).abs_diff(x);
            if k < r_max {
                d = d.min(sim_q(k + 1).abs_diff(x));
            }
            if d < best_d {
                (best_d, best_r) = (d, r);
            }
        }
        best_r
    }

    fn may_pull(&self, worker: Worker, clock: u64) -> bool {
        self.may_pull_at(self.clocks.min_live(), worker, clock)
    }

    /// As `may_pull`, with the live minimum already known (one scan per release pass).
    /// A grant is honoured only within `s_U` of the live minimum *now*: a worker that comes
    /// back (or joins) below the minimum the grant was given against lowers it.
    fn may_pull_at(&self, min: u64, worker: Worker, clock: u64) -> bool {
        within_staleness(min, clock, self.s_lower)
            || (clock <= self.ok_through[worker as usize]
                && within_staleness(min, clock, self.s_upper))
    }

    /// The paper's push handler: decides whether `p` may run iteration `next` (= `t[p]`).
    fn decide(&mut self, p: usize, next: u64) {
        if self.grant[p] > 0 {
            self.grant[p] -= 1;
            self.ok_through[p] = self.ok_through[p].max(next);
            return;
        }
        let min = self.clocks.min_live();
        if within_staleness(min, next, self.s_lower) {
            return;
        }
        let fastest = self.clocks.max_live() <= self.clocks.applied[p];
        if !fastest {
            return; // held until within s_L
        }
        self.controller_calls += 1;
        // The slowest live worker, lowest rank on ties.
        let q = self.clocks.slowest();
        let r = match (q, self.stamps[p]) {
            (Some(q), [Some(p0), Some(p1)]) => match self.stamps[q as usize] {
                [Some(q0), Some(q1)] => {
                    let gap = next - min;
                    let limit = (self.s_upper + 1).saturating_sub(gap);
                    Self::choose([p0, p1], [q0, q1], self.r_max(), limit)
                }
                _ => 0,
            },
            _ => 0,
        };
        if r > 0 {
            self.extra_granted += r;
            self.granted[p] += r;
            self.grant[p] = r - 1;
            self.ok_through[p] = self.ok_through[p].max(next);
        }
    }

    /// Parks a pull where the grants of its worker put it.
    fn park(&mut self, (worker, clock, req): (Worker, u64, u64)) {
        if clock <= self.ok_through[worker as usize] {
            self.granted_pulls.insert((clock, req, worker));
        } else {
            self.plain.insert((clock, req, worker));
            self.plain_of.insert((worker, clock, req));
        }
    }

    /// A grant to `p` covers its parked pulls up to `ok_through[p]`: they move to the granted.
    fn regrant(&mut self, p: usize) {
        let worker = p as Worker;
        let through = self.ok_through[p];
        let covered: Vec<(Worker, u64, u64)> = self
            .plain_of
            .range((worker, 0, 0)..=(worker, through, u64::MAX))
            .copied()
            .collect();
        for (w, clock, req) in covered {
            self.plain_of.remove(&(w, clock, req));
            self.plain.remove(&(clock, req, w));
            self.granted_pulls.insert((clock, req, w));
        }
    }

    /// Releases the parked pulls `may_pull` now allows, in `(clock, req, worker)` order: the
    /// uncovered ones within `s_L` of the live minimum, the granted ones within `s_U` (only
    /// the fronts of the two sets are read).
    fn release_ready(&mut self, out: &mut Vec<Action>) {
        let min = self.clocks.min_live();
        let mut ready = Vec::new();
        while let Some(&(clock, req, worker)) = self.plain.first() {
            if !within_staleness(min, clock, self.s_lower) {
                break;
            }
            self.plain.pop_first();
            self.plain_of.remove(&(worker, clock, req));
            ready.push((clock, req, worker));
        }
        while let Some(&(clock, req, worker)) = self.granted_pulls.first() {
            if !within_staleness(min, clock, self.s_upper) {
                break;
            }
            self.granted_pulls.pop_first();
            ready.push((clock, req, worker));
        }
        ready.sort_unstable();
        out.extend(
            ready
                .into_iter()
                .map(|(_, req, worker)| Action::Release { worker, req }),
        );
    }
}

impl SyncPolicy for Dssp {
    fn name(&self) -> String {
        format!("dssp({},{})", self.s_lower, self.s_upper)
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        let before = match ev {
            Event::Push { worker, .. } => self.clocks.applied.get(worker as usize).copied(),
            _ => None,
        };
        if !self.clocks.observe(&ev) {
            return;
        }
        match ev {
            Event::Pull {
                worker, clock, req, ..
            } => {
                if self.may_pull(worker, clock) {
                    out.push(Action::Release { worker, req });
                } else {
                    self.park((worker, clock, req));
                    self.delayed += 1;
                    out.push(Action::Park { worker, req });
                }
            }
            Event::Push { worker, at, .. } => {
                let p = worker as usize;
                let next = self.clocks.applied[p];
                if before.is_some_and(|b| next > b) {
                    self.stamps[p] = [Some(at), self.stamps[p][0]];
                    self.decide(p, next);
                    self.regrant(p);
                }
                self.release_ready(out);
            }
            Event::Join { worker, .. } => {
                let p = worker as usize;
                self.grant[p] = 0;
                self.stamps[p] = [None; 2];
                self.release_ready(out);
            }
            Event::Leave { .. } => self.release_ready(out),
            Event::Tick { .. } => {}
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Within(self.s_lower)
    }

    fn parked(&self) -> usize {
        self.plain.len() + self.granted_pulls.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }

    fn grants(&self, worker: Worker) -> u64 {
        self.granted.get(worker as usize).copied().unwrap_or(0)
    }
}
