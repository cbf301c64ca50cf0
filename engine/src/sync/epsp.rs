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
//! the straggler's current iteration (its applied count). Pioneers are spread over the
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

use super::projection::{Projection, ProjectionConfig, Verdict};
use super::{Action, Clocks, Event, FastPath, Nanos, Parked, SyncPolicy, Worker, release_within};

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
    /// The latest event's time.
    now: Nanos,
}

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

    /// The slack bound the verdict asks for.
    fn bound_for(&self, v: &Verdict) -> u64 {
        if !v.any_persistent() {
            return 0;
        }
        let s = (v.spread.ceil() as u64).saturating_sub(1);
        s.clamp(1, self.cfg.s_max.max(1)).min(self.cfg.s_max)
    }

    /// Re-judges the scheme from a fresh verdict. A verdict costs `O(workers × window)`, so
    /// on pushes it is taken once every `⌈live / 8⌉` pushes (every push up to 8 workers):
    /// `O(window)` amortized per push; membership changes always take one.
    fn adapt_on_push(&mut self) {
        self.since_verdict += 1;
        let live = self.clocks.live.iter().filter(|&&l| l).count() as u64;
        if self.since_verdict >= live.div_ceil(8).max(1) {
            self.adapt();
        }
    }

    fn adapt(&mut self) {
        self.since_verdict = 0;
        if !self.cfg.adaptive {
            return;
        }
        let s = self.bound_for(&self.projection.verdict());
        if s != self.s {
            self.s = s;
            self.switches += 1;
        }
    }

    /// The straggler whose tasks a pioneer pulling at `clock` should take at `now`, if any
    /// (the most remaining work per helper; see the [module docs](self)).
    fn straggler_for(&self, helper: Worker, clock: u64, now: Nanos) -> Option<(Worker, u64)> {
        let threshold = clock.saturating_sub(self.s);
        let n = self.clocks.applied.len();
        // Per straggler, the other pioneers offered its current iteration: one pass, so an
        // offer costs O(workers), not O(workers²) (1 ms a push at 1024 workers).
        let mut helpers = vec![0u32; n];
        for (h, o) in self.helping.iter().enumerate() {
            if let Some((s, c)) = *o
                && h != helper as usize
                && self.clocks.applied.get(s as usize) == Some(&c)
            {
                helpers[s as usize] += 1;
            }
        }
        (0..n)
            .filter(|&w| self.clocks.live[w] && w != helper as usize)
            .filter(|&w| self.clocks.applied[w] < threshold)
            .map(|w| {
                let applied = self.clocks.applied[w];
                let work = match (
                    self.projection.started(w as Worker),
                    self.projection.predicted(w as Worker),
                ) {
                    (Some(s), Some(p)) => {
                        let left = s.saturating_add(p).saturating_sub(now);
                        let behind = threshold - applied - 1;
                        u128::from(left) + u128::from(behind) * u128::from(p)
                    }
                    // Unknown: more than any known amount.
                    _ => u128::from(u64::MAX) * u128::from(u64::MAX),
                };
                (w, applied, work / (u128::from(helpers[w]) + 1))
            })
            .max_by(|a, b| a.2.cmp(&b.2).then(b.0.cmp(&a.0)))
            .map(|(w, applied, _)| (w as Worker, applied))
    }

    /// Offers `helper`, parked at `clock`, a straggler's tasks (when one holds it back).
    fn offer(&mut self, helper: Worker, clock: u64, now: Nanos, out: &mut Vec<Action>) {
        let Some((straggler, sclock)) = self.straggler_for(helper, clock, now) else {
            return;
        };
        if let Some(h) = self.helping.get_mut(helper as usize) {
            *h = Some((straggler, sclock));
        }
        self.transfers += 1;
        out.push(Action::Transfer {
            helper,
            straggler,
            clock: sclock,
        });
    }

    /// After a push: every parked pioneer whose offer is spent (its straggler moved on) is
    /// offered again.
    fn offer_again(&mut self, now: Nanos, out: &mut Vec<Action>) {
        if !self.cfg.transfer {
            return;
        }
        let parked: Vec<(u64, Worker)> = self.parked.list.iter().map(|&(c, _, w)| (c, w)).collect();
        for (clock, helper) in parked {
            let spent = match self.helping.get(helper as usize).copied().flatten() {
                Some((s, c)) => self.clocks.applied.get(s as usize) != Some(&c),
                None => true,
            };
            if spent {
                self.offer(helper, clock, now, out);
            }
        }
    }

    fn release_ready(&mut self, at: Nanos, out: &mut Vec<Action>) {
        let projection = &mut self.projection;
        let helping = &mut self.helping;
        release_within(
            &mut self.parked.list,
            self.clocks.min_live(),
            self.s,
            |worker, req| {
                out.push(Action::Release { worker, req });
                projection.start(worker, at);
                if let Some(h) = helping.get_mut(worker as usize) {
                    *h = None;
                }
            },
        );
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
        self.now = self.now.max(match ev {
            Event::Push { at, .. }
            | Event::Pull { at, .. }
            | Event::Leave { at, .. }
            | Event::Join { at, .. }
            | Event::Tick { at } => at,
        });
        let before = match ev {
            Event::Push { worker, .. } => self.clocks.applied.get(worker as usize).copied(),
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
                } else if self.cfg.transfer {
                    self.offer(worker, clock, at, out);
                }
            }
            Event::Push { worker, at, .. } => {
                let moved = before.is_some_and(|b| self.clocks.applied[worker as usize] > b);
                if moved {
                    self.projection.finish(worker, at);
                    self.adapt_on_push();
                }
                self.release_ready(at, out);
                if moved {
                    self.offer_again(at, out);
                }
            }
            Event::Leave { worker, at } => {
                self.projection.leave(worker);
                if let Some(h) = self.helping.get_mut(worker as usize) {
                    *h = None;
                }
                self.adapt();
                self.release_ready(at, out);
            }
            Event::Join { worker, at, .. } => {
                self.projection.join(worker);
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
        self.parked.list.len()
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
        for a in &mut self.clocks.applied {
            *a = (*a).max(steps);
        }
        for (step, workers) in pending {
            for &w in workers {
                if let Some(a) = self.clocks.applied.get_mut(w as usize) {
                    *a = (*a).max(step + 1);
                }
            }
        }
        self.release_ready(self.now, out);
    }
}
