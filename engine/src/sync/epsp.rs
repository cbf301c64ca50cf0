//! EPSP, Falcon's elastic parallel synchronization (Zhou et al., IEEE TC 2021) — **our
//! design**. Falcon's full text is not public; the rules below are built on its published
//! facts (see `docs/architecture.md`, "EPSP").
//!
//! # Rules
//!
//! EPSP has one staleness knob `s` and two schemes:
//!
//! - **enforced** (`s = 0`): a barrier per iteration, exactly BSP: a pull at clock `c` is
//!   released once every live worker has `≥ c` gradients applied;
//! - **slack** (`s > 0`): the SSP bound, released once every live worker has `≥ c − s` applied
//!   ([`crate::meta::within_staleness`], `≥` as everywhere in falcon).
//!
//! **The switch** (mechanism 1, `adaptive`). After every push (every `⌈live/8⌉` pushes
//! beyond 8 workers, to keep the cost per push independent of the job's size) the policy asks its
//! [`Projection`] for a verdict. While it sees only pioneers and *transient* stragglers (or
//! knows too little) EPSP runs enforced: transient episodes on different workers cost one
//! barrier wait each, and bounded staleness would not make them cheaper than a barrier that
//! waits for them once. As soon as it sees a *persistent* straggler, EPSP runs slack with
//! `s = clamp(⌈spread⌉ − 1, 1, s_max)`, `spread` being the slowest predicted iteration time
//! over the fastest: while the straggler does one iteration a pioneer does `spread`, so that
//! bound lets pioneers run through one straggler iteration without blocking on each. When the
//! persistent straggler is gone (it left, or its window shows it caught up), EPSP goes back to
//! enforced. With `adaptive` off, `s` stays `s_max` (`s_max = 0`: always enforced).
//!
//! Lowering `s` never revokes a release already given; it only judges later pulls, and the
//! pulls still parked are judged at the next push with the bound then in force.
//!
//! **Task transfer** (mechanism 2, `transfer`). When a pull is parked, its worker is a pioneer
//! that would block. The policy then offers it tasks of a straggler holding the pull back
//! (live, applied `< c − s`): [`Action::Transfer`]`{ helper, straggler, clock }`, `clock` being
//! the straggler's current iteration (its applied count); a worker that left is offered
//! nothing (its parked pull may outlive it). Pioneers are spread over the
//! stragglers by their remaining work: a straggler's remaining work is what is left of its
//! current iteration (its start plus its predicted iteration time, less now) plus one
//! predicted iteration for every further iteration the pioneer waits for (`c − s − applied −
//! 1`); the offer goes to the straggler with the most remaining work per helper, counting the
//! pioneers already offered its current iteration and still parked (`work / (helpers + 1)`),
//! ties to the lowest rank. A straggler whose iteration time is not known yet counts as having
//! more work than any known one.
//!
//! **Helping goes on while the pull stays parked**: after every push that moves a worker's
//! applied count, each parked pioneer whose last offer is spent (its straggler moved on to
//! another iteration) gets a fresh offer by the same rule. Several stragglers are helped at
//! once, and a pioneer parked across several straggler iterations helps in each. The task side
//! (the trainer, via the scheduler) moves unprocessed tasks of that iteration to the helper,
//! which computes them on its own weights and pushes the gradient credited to the straggler's
//! clock; the straggler skips them, and each task is counted once there.
//!
//! Mechanism 3, elastic parallelism control, lives in the trainer (it changes thread counts,
//! not synchronization); it is switched off there.
//!
//! # Iteration times
//!
//! The projection is fed *compute* times: an iteration of worker `w` starts at its previous
//! push, or, if its pull was parked, at the event that released it; it ends at its push. So a
//! pioneer that waits at every barrier still looks fast (its push intervals alone would equal
//! the straggler's). Only pushes that advance a worker's applied count are samples.
//!
//! # Fast path
//!
//! `Within(0)` when adaptive (a pull within 0 is released under any bound, so the workers'
//! one-sided check never disagrees with the policy; pulls past it reach the policy, which
//! knows the bound in force) and `Within(s_max)` when not.
//!
//! Events about unknown workers are ignored. `Leave` releases what the departed worker held
//! back; `Join` forgets the worker's projection history.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::projection::{Projection, ProjectionConfig, Verdict};
use super::{Action, Clocks, Event, FastPath, Nanos, Parked, SyncPolicy, Worker};

/// EPSP's knobs (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpspConfig {
    /// The largest slack bound (with `adaptive` off: the bound).
    pub s_max: u64,
    /// Switch between enforced and slack from the projection's verdict.
    pub adaptive: bool,
    /// Offer parked pioneers the tasks of the straggler with the most remaining work.
    pub transfer: bool,
    /// The straggler projection's knobs.
    pub projection: ProjectionConfig,
}

impl Default for EpspConfig {
    fn default() -> Self {
        EpspConfig {
            s_max: 0,
            adaptive: true,
            transfer: true,
            projection: ProjectionConfig::default(),
        }
    }
}

/// EPSP for one shard (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Epsp {
    cfg: EpspConfig,
    s: u64,
    clocks: Clocks,
    projection: Projection,
    /// Parked pulls.
    parked: Parked,
    transfers: u64,
    switches: u64,
    /// Pushes since the last verdict.
    since_verdict: u64,
    /// Per worker: the straggler iteration it was last offered while its pull is parked
    /// (cleared when the pull is released).
    helping: Vec<Option<(Worker, u64)>>,
    /// Per helper with a current offer, the parked pull it was made for: (clock, req).
    helping_pull: Vec<Option<(u64, u64)>>,
    /// Per straggler, the parked pioneers offered its current iteration.
    helpers_of: Vec<u32>,
    /// Per straggler, the pioneers offered its tasks since its applied count last moved (some
    /// may have been released or offered another since: checked against `helping`).
    helped_by: Vec<Vec<Worker>>,
    /// The live workers as offers weigh them: (applied, when its iteration is expected to end —
    /// `u64::MAX` when unknown — latest first, rank).
    candidates: BTreeSet<(u64, Reverse<Nanos>, Worker)>,
    /// Each live worker's key in `candidates`.
    keys: Vec<Option<(u64, Reverse<Nanos>, Worker)>>,
    /// Every parked pioneer is offered again at the next push that moves a worker (after a
    /// change of bound, a rejoin or a restore, which can make stragglers of workers that were
    /// not).
    reoffer_all: bool,
    /// The latest event's time.
    now: Nanos,
}

/// The most stragglers an offer weighs: those furthest behind, the latest expected to end
/// first. Exact whenever fewer hold the pioneer back; keeps an offer `O(log workers)` at any
/// size.
pub const OFFER_CANDIDATES: usize = 16;

impl Epsp {
    /// EPSP for `workers` workers.
    pub fn new(workers: u32, cfg: EpspConfig) -> Epsp {
        Epsp {
            cfg,
            s: if cfg.adaptive { 0 } else { cfg.s_max },
            clocks: Clocks::new(workers),
            projection: Projection::new(workers, cfg.projection),
            parked: Parked::default(),
            transfers: 0,
            switches: 0,
            since_verdict: 0,
            helping: vec![None; workers as usize],
            helping_pull: vec![None; workers as usize],
            helpers_of: vec![0; workers as usize],
            helped_by: vec![Vec::new(); workers as usize],
            candidates: (0..workers).map(|w| (0, Reverse(u64::MAX), w)).collect(),
            keys: (0..workers)
                .map(|w| Some((0, Reverse(u64::MAX), w)))
                .collect(),
            reoffer_all: false,
            now: 0,
        }
    }

    /// The bound in force (0: enforced).
    pub fn staleness(&self) -> u64 {
        self.s
    }

    /// True while enforced.
    pub fn enforced(&self) -> bool {
        self.s == 0
    }

    /// How many times the scheme switched (enforced ↔ slack or slack bound changed).
    pub fn switches(&self) -> u64 {
        self.switches
    }

    /// The projection's current verdict.
    pub fn verdict(&self) -> Verdict {
        self.projection.verdict()
    }

    /// The projection.
    pub fn projection(&self) -> &Projection {
        &self.projection
    }

    /// The slack bound the verdict asks for: 0 without a persistent straggler.
    fn bound_from(&self, persistent: bool, spread: f64) -> u64 {
        if !persistent {
            return 0;
        }
        let s = (spread.ceil() as u64).saturating_sub(1);
        s.clamp(1, self.cfg.s_max.max(1)).min(self.cfg.s_max)
    }

    /// Re-judges the scheme from a fresh verdict. A verdict costs `O(workers × window)`, so
    /// on pushes it is taken once every `⌈live / 8⌉` pushes (every push up to 8 workers):
    /// `O(window)` amortized per push; membership changes always take one.
    fn adapt_on_push(&mut self) {
        self.since_verdict += 1;
        let live = self.clocks.live_count() as u64;
        if self.since_verdict >= live.div_ceil(8).max(1) {
            self.adapt();
        }
    }

    fn adapt(&mut self) {
        self.since_verdict = 0;
        if !self.cfg.adaptive {
            return;
        }
        let (persistent, spread) = self.projection.outlook();
        let s = self.bound_from(persistent, spread);
        if s != self.s {
            self.s = s;
            self.switches += 1;
            self.reoffer_all = true;
        }
    }

    /// `w`'s key among the candidates, while it is live.
    fn key(&self, w: Worker) -> Option<(u64, Reverse<Nanos>, Worker)> {
        if !self.clocks.is_live(w) {
            return None;
        }
        let end = match (self.projection.started(w), self.projection.predicted(w)) {
            (Some(s), Some(p)) => s.saturating_add(p),
            _ => u64::MAX,
        };
        Some((self.clocks.applied(w)?, Reverse(end), w))
    }

    /// Puts `w` back in its place among the candidates after its count, its iteration's start
    /// or prediction or its liveness changed.
    fn rekey(&mut self, w: Worker) {
        let Some(slot) = self.keys.get(w as usize).copied() else {
            return;
        };
        let key = self.key(w);
        if slot != key {
            if let Some(old) = slot {
                self.candidates.remove(&old);
            }
            if let Some(k) = key {
                self.candidates.insert(k);
            }
            self.keys[w as usize] = key;
        }
    }

    /// True when `o` is an offer of a straggler's current iteration.
    fn current(&self, o: Option<(Worker, u64)>) -> bool {
        o.is_some_and(|(s, c)| self.clocks.applied(s) == Some(c))
    }

    /// Sets `helper`'s offer (or clears it), keeping the per-straggler helper counts.
    fn set_helping(
        &mut self,
        helper: Worker,
        offer: Option<(Worker, u64)>,
        pull: Option<(u64, u64)>,
    ) {
        let h = helper as usize;
        let Some(&old) = self.helping.get(h) else {
            return;
        };
        if self.current(old)
            && let Some((s, _)) = old
        {
            self.helpers_of[s as usize] -= 1;
        }
        if let Some((s, _)) = offer {
            self.helpers_of[s as usize] += 1;
            self.helped_by[s as usize].push(helper);
        }
        self.helping[h] = offer;
        self.helping_pull[h] = pull;
    }

    /// `w`'s applied count moved: every offer of its tasks is spent. Returns the pioneers that
    /// held one, to be offered again.
    fn spend_offers_of(&mut self, w: Worker, was: u64) -> Vec<Worker> {
        let Some(list) = self.helped_by.get_mut(w as usize) else {
            return Vec::new();
        };
        let list = std::mem::take(list);
        self.helpers_of[w as usize] = 0;
        list.into_iter()
            .filter(|&h| self.helping[h as usize] == Some((w, was)))
            .collect()
    }

    /// The straggler whose tasks a pioneer pulling at `clock` should take at `now`, if any
    /// (the most remaining work per helper; see the [module docs](self)). It weighs at most
    /// [`OFFER_CANDIDATES`] stragglers, furthest behind and latest to end first, and stops at
    /// the first one of the last level that no one helps (none after it has more work).
    fn straggler_for(&self, helper: Worker, clock: u64, now: Nanos) -> Option<(Worker, u64)> {
        let threshold = clock.saturating_sub(self.s);
        let own = self.helping.get(helper as usize).copied().flatten();
        let own = self.current(own).then_some(own).flatten();
        let mut best: Option<(u128, Worker, u64)> = None;
        let below = self.candidates.range(..(threshold, Reverse(u64::MAX), 0));
        for &(applied, Reverse(end), w) in below.filter(|k| k.2 != helper).take(OFFER_CANDIDATES) {
            let known = end != u64::MAX;
            let behind = threshold - applied - 1;
            let work = match self.projection.predicted(w) {
                Some(p) if known => {
                    u128::from(end.saturating_sub(now)) + u128::from(behind) * u128::from(p)
                }
                // Unknown: more than any known amount.
                _ => u128::from(u64::MAX) * u128::from(u64::MAX),
            };
            let mut helpers = self.helpers_of[w as usize];
            if own.is_some_and(|(s, _)| s == w) {
                helpers -= 1;
            }
            let value = match u64::try_from(work) {
                _ if helpers == 0 => work,
                // A machine division where the work fits in 64 bits (it does unless unknown).
                Ok(w) => u128::from(w / (u64::from(helpers) + 1)),
                Err(_) => work / (u128::from(helpers) + 1),
            };
            if best.is_none_or(|(v, b, _)| value > v || (value == v && w < b)) {
                best = Some((value, w, applied));
            }
            // In the last level the work is what is left of the iteration, which the order
            // already sorts: no straggler after this one has more work than it, so none can
            // beat a best already above that (an equal one might win its tie by rank).
            if behind == 0 && best.is_some_and(|(v, _, _)| v > work) {
                break;
            }
        }
        best.map(|(_, w, applied)| (w, applied))
    }

    /// Offers `helper`, parked at `clock` with `req`, a straggler's tasks (when one holds it
    /// back).
    fn offer(
        &mut self,
        helper: Worker,
        (clock, req): (u64, u64),
        now: Nanos,
        out: &mut Vec<Action>,
    ) {
        // A worker that left takes no tasks: they would wait on it.
        if !self.clocks.is_live(helper) {
            return;
        }
        let Some((straggler, sclock)) = self.straggler_for(helper, clock, now) else {
            return;
        };
        self.set_helping(helper, Some((straggler, sclock)), Some((clock, req)));
        self.transfers += 1;
        out.push(Action::Transfer {
            helper,
            straggler,
            clock: sclock,
        });
    }

    /// After a push that moved `mover`'s count from `was`: the parked pioneers whose offer that
    /// spent are offered again, in the order of their pulls (every parked pioneer without a
    /// current offer, after a change that can make new stragglers).
    fn offer_again(&mut self, mover: Worker, was: u64, now: Nanos, out: &mut Vec<Action>) {
        let spent = self.spend_offers_of(mover, was);
        if !self.cfg.transfer {
            return;
        }
        let mut again: Vec<(u64, u64, Worker)> = if std::mem::take(&mut self.reoffer_all) {
            self.parked
                .iter()
                .copied()
                .filter(|&(_, _, h)| !self.current(self.helping.get(h as usize).copied().flatten()))
                .collect()
        } else {
            spent
                .into_iter()
                .filter_map(|h| self.helping_pull[h as usize].map(|(c, r)| (c, r, h)))
                .collect()
        };
        // One offer per pioneer, for its first parked pull, as the parked pulls are ordered.
        again.sort_unstable();
        let mut seen = std::collections::HashSet::new();
        again.retain(|&(_, _, h)| seen.insert(h));
        for (clock, req, helper) in again {
            self.offer(helper, (clock, req), now, out);
        }
    }

    fn release_ready(&mut self, at: Nanos, out: &mut Vec<Action>) {
        let mut released = Vec::new();
        self.parked
            .release_within(self.clocks.min_live(), self.s, |worker, req| {
                out.push(Action::Release { worker, req });
                released.push(worker);
            });
        for worker in released {
            self.projection.start(worker, at);
            self.set_helping(worker, None, None);
            self.rekey(worker);
        }
    }

    /// A known worker's count was raised outside a push (a rejoin, a restore): the offers of
    /// its tasks are spent, and every parked pioneer is offered again at the next push.
    fn raised(&mut self, w: Worker, was: u64) {
        if self.clocks.applied(w) != Some(was) {
            let _ = self.spend_offers_of(w, was);
            self.reoffer_all = true;
        }
        self.rekey(w);
    }
}

impl SyncPolicy for Epsp {
    fn name(&self) -> String {
        let mut n = format!("epsp({}", self.cfg.s_max);
        if !self.cfg.adaptive {
            n.push_str(",fixed");
        }
        if !self.cfg.transfer {
            n.push_str(",no-transfer");
        }
        n.push(')');
        n
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        self.now = self.now.max(ev.at());
        let before = match ev {
            Event::Push { worker, .. } | Event::Join { worker, .. } => self.clocks.applied(worker),
            _ => None,
        };
        if !self.clocks.observe(&ev) {
            return;
        }
        match ev {
            Event::Pull {
                worker,
                clock,
                req,
                at,
            } => {
                let min = self.clocks.min_live();
                if !self.parked.judge(min, self.s, (worker, clock, req), out) {
                    self.projection.start(worker, at);
                    self.rekey(worker);
                } else if self.cfg.transfer {
                    self.offer(worker, (clock, req), at, out);
                }
            }
            Event::Push { worker, at, .. } => {
                let was = before.unwrap_or(0);
                let moved = self.clocks.applied(worker).is_some_and(|a| a > was);
                if moved {
                    self.projection.finish(worker, at);
                    self.rekey(worker);
                    self.adapt_on_push();
                }
                self.release_ready(at, out);
                if moved {
                    self.offer_again(worker, was, at, out);
                }
            }
            Event::Leave { worker, at } => {
                self.projection.leave(worker);
                self.set_helping(worker, None, None);
                self.rekey(worker);
                self.adapt();
                self.release_ready(at, out);
            }
            Event::Join { worker, at, .. } => {
                self.projection.join(worker);
                self.raised(worker, before.unwrap_or(0));
                self.reoffer_all = true;
                self.adapt();
                self.release_ready(at, out);
            }
            Event::Tick { .. } => {}
        }
    }

    fn fast_path(&self) -> FastPath {
        if self.cfg.adaptive {
            FastPath::Within(0)
        } else {
            FastPath::Within(self.cfg.s_max)
        }
    }

    fn parked(&self) -> usize {
        self.parked.len()
    }

    fn delayed_total(&self) -> u64 {
        self.parked.delayed
    }

    fn transfers(&self) -> u64 {
        self.transfers
    }

    /// Under synchronous updates (`epsp(0)`) EPSP sees each gradient when it arrives, not when
    /// its step is applied: the projection times real iterations and the offers know who has
    /// not pushed yet. Every gradient counts for its own clock (nothing is dropped or moved).
    /// Asynchronous updates feed every push on arrival anyway.
    fn judges_arrivals(&self) -> bool {
        true
    }

    /// The gradients waiting in their steps arrived: they count (see
    /// [`SyncPolicy::judges_arrivals`]).
    fn restored(&mut self, steps: u64, pending: &[(u64, Vec<Worker>)], out: &mut Vec<Action>) {
        let n = self.clocks.workers() as Worker;
        for w in 0..n {
            let was = self.clocks.applied(w).unwrap_or(0);
            self.clocks.raise(w, steps);
            self.raised(w, was);
        }
        for (step, workers) in pending {
            for &w in workers {
                if let Some(was) = self.clocks.applied(w) {
                    self.clocks.raise(w, step + 1);
                    self.raised(w, was);
                }
            }
        }
        self.release_ready(self.now, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The offer rule as a pass over every worker: the definition the indexed
    /// `straggler_for` must agree with while fewer than [`OFFER_CANDIDATES`] stragglers hold the
    /// pioneer back.
    fn exact(e: &Epsp, helper: Worker, clock: u64, now: Nanos) -> Option<(Worker, u64)> {
        let threshold = clock.saturating_sub(e.s);
        let n = e.clocks.workers() as Worker;
        (0..n)
            .filter(|&w| e.clocks.is_live(w) && w != helper)
            .filter(|&w| e.clocks.applied(w).unwrap() < threshold)
            .map(|w| {
                let applied = e.clocks.applied(w).unwrap();
                let helpers = (0..n)
                    .filter(|&h| h != helper)
                    .filter(|&h| {
                        e.helping[h as usize].is_some_and(|o| o.0 == w && e.current(Some(o)))
                    })
                    .count() as u128;
                let work = match (e.projection.started(w), e.projection.predicted(w)) {
                    (Some(s), Some(p)) => {
                        let left = s.saturating_add(p).saturating_sub(now);
                        let behind = threshold - applied - 1;
                        u128::from(left) + u128::from(behind) * u128::from(p)
                    }
                    _ => u128::from(u64::MAX) * u128::from(u64::MAX),
                };
                (w, applied, work / (helpers + 1))
            })
            .max_by(|a, b| a.2.cmp(&b.2).then(b.0.cmp(&a.0)))
            .map(|(w, applied, _)| (w, applied))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Over random traces (pushes, pulls, departures, rejoins; slack or enforced), every
        /// parked pioneer would be offered what the pass over every worker gives, and the
        /// per-straggler helper counts match the offers held.
        #[test]
        fn indexed_offers_agree_with_the_pass_over_every_worker(
            workers in 2u32..8,
            s_max in 0u64..3,
            steps in prop::collection::vec((0u32..8, 0u8..12, 1u64..400), 1..250),
        ) {
            let cfg = EpspConfig { s_max, ..EpspConfig::default() };
            let mut e = Epsp::new(workers, cfg);
            let n = workers as usize;
            let mut clock = vec![0u64; n];
            let mut waiting = vec![false; n];
            let mut live = vec![true; n];
            let (mut at, mut req) = (0u64, 0u64);
            let mut out = Vec::new();
            for &(w, kind, dt) in &steps {
                let w = w % workers;
                let wi = w as usize;
                at += dt;
                let ev = match kind {
                    0 if live[wi] && live.iter().filter(|l| **l).count() > 1 => {
                        live[wi] = false;
                        Event::Leave { worker: w, at }
                    }
                    1 if !live[wi] => {
                        live[wi] = true;
                        waiting[wi] = false;
                        Event::Join { worker: w, clock: clock[wi], at }
                    }
                    2..=6 if live[wi] && !waiting[wi] => {
                        req += 1;
                        waiting[wi] = true;
                        Event::Pull { worker: w, clock: clock[wi], req, at }
                    }
                    _ if live[wi] && !waiting[wi] => {
                        clock[wi] += 1;
                        Event::Push { worker: w, clock: clock[wi] - 1, at }
                    }
                    _ => Event::Tick { at },
                };
                out.clear();
                e.on_event(ev, &mut out);
                let mut offered = std::collections::HashSet::new();
                for a in &out {
                    if let Action::Release { worker, .. } = *a {
                        waiting[worker as usize] = false;
                    }
                    if let Action::Transfer { helper, .. } = *a {
                        prop_assert!(live[helper as usize], "an offer to a departed worker: {:?}", out);
                        prop_assert!(offered.insert(helper), "two offers to one worker: {:?}", out);
                    }
                }
                let v = e.projection.verdict();
                prop_assert_eq!(e.projection.outlook(), (v.any_persistent(), v.spread));
                for &(c, _, h) in e.parked.iter() {
                    prop_assert_eq!(e.straggler_for(h, c, at), exact(&e, h, c, at));
                }
                for st in 0..workers {
                    let held = (0..workers)
                        .filter(|&h| e.helping[h as usize].is_some_and(|o| o.0 == st && e.current(Some(o))))
                        .count() as u32;
                    prop_assert_eq!(e.helpers_of[st as usize], held, "straggler {}", st);
                }
            }
        }
    }
}
