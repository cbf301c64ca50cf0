//! FluentPS (Yao, Wu, Wang, IEEE Cluster 2019): SSP with per-shard independent clocks, lazy
//! execution of parked pulls and probabilistic pausing of fast workers. The design is
//! documented on [`FluentPs`] (this module is private; its items are re-exported by `sync`).

use std::collections::BTreeSet;

use super::{Action, Clocks, Event, FastPath, SyncPolicy, Worker};
use crate::meta::within_staleness;

/// When FluentPS pauses a pull that fails the SSP condition (see [`FluentPs`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pause {
    /// Raw SSP: every pull past the bound waits.
    RawSsp,
    /// Only the fastest worker is paused, with a fixed probability `p` (clamped to `[0, 1]`,
    /// NaN counts as 0). `p = 0` is ASP; `p = 1` pauses the fastest every time.
    Fastest {
        /// The pause probability.
        p: f64,
    },
    /// PSSP: any worker past the bound with gap `k > 0`, with probability `1 / (1 + e^(s − k))`.
    Sigmoid,
    /// Only the fastest worker, with probability `1 / (1 + e^(s − k))`.
    FastestSigmoid,
}

/// A parked pull, ordered by the slowest clock it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Parked {
    /// Released once the slowest clock is at least this.
    wait_for: u64,
    clock: u64,
    req: u64,
    worker: Worker,
}

/// FluentPS (Yao, Wu, Wang, IEEE Cluster 2019): SSP with per-shard independent clocks, lazy
/// execution of parked pulls and probabilistic pausing of fast workers.
///
/// Reconstructed from the authors' code (`XinYao1994/FluentPS-paper`, a ps-lite fork) as
/// its published description reads; the paper's full text was not available.
///
/// # State, per shard
///
/// Each shard runs its own instance (that *is* FluentPS's per-server independence):
///
/// - the **slowest** clock ([`FluentPs::slowest`]): the number of iterations every live worker
///   has completed on this shard, i.e. the smallest applied count. It is the authors'
///   `ticks[shard]`, the first iteration not yet completed by everyone;
/// - the **fastest** clock ([`FluentPs::fastest`]): the largest applied count among live
///   workers, the authors' `fast_ticks` (highest pushed iteration) plus one;
/// - the parked pulls, and how many pulls were ever parked ([`SyncPolicy::delayed_total`], the
///   paper's "delayed pull requests").
///
/// # The gap and the SSP condition
///
/// The authors' worker pushes iteration `i` and then pulls with the same `i`; falcon's worker
/// pushes iteration `c − 1` and then pulls with clock `c` (see [`super`]). The authors' gap
/// `k = i − slow` is therefore `k = c − 1 − slowest` here, and their SSP trigger `k ≥ s` is
/// exactly falcon's `!within_staleness(slowest, c, s)`, i.e. `slowest < c − s`. A pull that
/// satisfies the SSP bound is **always** released at once, whatever the variant; only pulls
/// past the bound are candidates for pausing. So [`FastPath::Within`]`(s)` is sound for every
/// variant (and [`FastPath::Always`] for fastest-only with `p = 0`, which never pauses).
///
/// # Pausing variants ([`Pause`])
///
/// For a pull at clock `c` past the bound, with gap `k = c − 1 − slowest ≥ s`:
///
/// - [`Pause::RawSsp`]: always pause;
/// - [`Pause::Fastest`]`{ p }` (the Python wrapper's default): pause only if the puller is the
///   fastest (`c ≥ fastest`, ties included: the authors' `i == fast`), and then with
///   probability `p`;
/// - [`Pause::Sigmoid`] (the authors' PSSP): pause if `k > 0`, with probability
///   `1 / (1 + e^(s − k))`: ½ at `k = s`, rising towards 1 as the gap grows;
/// - [`Pause::FastestSigmoid`] (the authors' "fastest-only, dynamic"): the fastest only, with
///   the sigmoid probability.
///
/// Without membership changes a pull past the bound has `k = s` exactly (its previous pull
/// was released within the bound) and is then at the largest clock any worker can have, so it
/// is the fastest: fastest-only with `p = 1` pauses exactly what raw SSP pauses (tested). The
/// probabilistic rules differ from raw SSP once some pull past the bound is let through.
///
/// "With probability `q`" means: draw `u` uniform in `[0, 1)` from the policy's own seeded
/// splitmix64 generator and pause iff `u < q` (so `q = 0` never pauses and `q = 1` always
/// does). A draw is taken only when a probabilistic test is actually reached, so the sequence of
/// decisions is a function of the seed and the event trace alone.
///
/// # Lazy execution: when parked pulls are released
///
/// The authors park a pull under `callbacks[slow]` and run every callback parked there, in one
/// batch, when iteration `slow` completes on the shard; the reply is built then, from the
/// current store. Here a [`Action::Release`] always means "write the latest values", so the
/// laziness is in the action's meaning; what the policy decides is *when*:
///
/// - probabilistic variants: a pull parked while the slowest clock was `m` is released as soon
///   as the slowest clock exceeds `m` (the authors' semantics: one advance of the slowest
///   worker), even if the gap is still past the bound;
/// - raw SSP: a pull at clock `c` is released once the slowest clock reaches `c − s` (the bound
///   holds again). Without membership changes a parked pull always has `k = s`, so this is the
///   same single advance as the authors'; after a [`Event::Join`] (a worker that rejoins far
///   behind or far ahead) it keeps the SSP bound, which the single-advance rule would not.
///
/// All pulls that become releasable on one event are released together, ordered by
/// `(clock, req, worker)`. With that order raw SSP is action-for-action the same as
/// [`super::Ssp`] (tested).
///
/// # Events
///
/// `Push` raises the pusher's applied count to `clock + 1`; `Leave` stops a worker holding the
/// slowest clock back; `Join` makes it live again with at least `clock` applied; `Tick` does
/// nothing. Any of them may advance the slowest clock and release parked pulls. Events about
/// workers outside `0..workers` are ignored (no action, no panic).
#[derive(Clone, Debug)]
pub struct FluentPs {
    pause: Pause,
    s: u64,
    clocks: Clocks,
    /// Parked pulls in the order their targets are reached.
    parked: BTreeSet<Parked>,
    delayed: u64,
    rng: SplitMix64,
}

impl FluentPs {
    /// FluentPS with pausing rule `pause` and staleness bound `s` for `workers` workers; `seed`
    /// seeds the generator the probabilistic rules draw from.
    pub fn new(pause: Pause, s: u64, workers: u32, seed: u64) -> FluentPs {
        let pause = match pause {
            Pause::Fastest { p } => Pause::Fastest {
                p: if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) },
            },
            other => other,
        };
        FluentPs {
            pause,
            s,
            clocks: Clocks::new(workers),
            parked: BTreeSet::new(),
            delayed: 0,
            rng: SplitMix64(seed),
        }
    }

    /// The pausing rule.
    pub fn pause(&self) -> Pause {
        self.pause
    }

    /// The staleness bound `s`.
    pub fn staleness(&self) -> u64 {
        self.s
    }

    /// The shard's slowest clock: the smallest applied count among live workers (`u64::MAX`
    /// when none is live).
    pub fn slowest(&self) -> u64 {
        self.clocks.min_live()
    }

    /// The shard's fastest clock: the largest applied count among live workers (0 when none is
    /// live).
    pub fn fastest(&self) -> u64 {
        self.clocks.max_live()
    }

    /// The probability that the rule pauses a pull past the bound with gap `k ≥ s` (the
    /// authors' `i − slow`), from a worker that is (`fastest`) or is not the fastest.
    pub fn pause_probability(&self, k: u64, fastest: bool) -> f64 {
        if k < self.s {
            return 0.0;
        }
        match self.pause {
            Pause::RawSsp => 1.0,
            Pause::Fastest { p } if fastest => p,
            Pause::Sigmoid if k > 0 => sigmoid(self.s, k),
            Pause::FastestSigmoid if fastest => sigmoid(self.s, k),
            _ => 0.0,
        }
    }

    fn known(&self, w: Worker) -> bool {
        (w as usize) < self.clocks.workers()
    }

    fn on_pull(&mut self, worker: Worker, clock: u64, req: u64, out: &mut Vec<Action>) {
        let slow = self.slowest();
        if within_staleness(slow, clock, self.s) {
            out.push(Action::Release { worker, req });
            return;
        }
        // Past the bound: slow + s < clock, so clock ≥ 1 and k ≥ s.
        let k = clock - 1 - slow;
        let fastest = clock >= self.fastest();
        let q = self.pause_probability(k, fastest);
        let pause = match self.pause {
            Pause::RawSsp => true,
            _ if q <= 0.0 => false,
            _ => self.rng.unit() < q,
        };
        if !pause {
            out.push(Action::Release { worker, req });
            return;
        }
        let wait_for = match self.pause {
            Pause::RawSsp => clock - self.s,
            _ => slow + 1,
        };
        self.parked.insert(Parked {
            wait_for,
            clock,
            req,
            worker,
        });
        self.delayed += 1;
        out.push(Action::Park { worker, req });
    }

    /// Releases, in one batch, every parked pull whose slowest-clock target is reached.
    fn release_ready(&mut self, out: &mut Vec<Action>) {
        if self.parked.is_empty() {
            return;
        }
        let slow = self.slowest();
        let mut ready: Vec<Parked> = Vec::new();
        while let Some(&p) = self.parked.first() {
            if p.wait_for > slow {
                break;
            }
            self.parked.pop_first();
            ready.push(p);
        }
        ready.sort_unstable_by_key(|p| (p.clock, p.req, p.worker));
        out.extend(ready.into_iter().map(|p| Action::Release {
            worker: p.worker,
            req: p.req,
        }));
    }
}

impl SyncPolicy for FluentPs {
    fn name(&self) -> String {
        let s = self.s;
        match self.pause {
            Pause::RawSsp => format!("fluentps(ssp, s={s})"),
            Pause::Fastest { p } => format!("fluentps(fastest p={p}, s={s})"),
            Pause::Sigmoid => format!("fluentps(sigmoid, s={s})"),
            Pause::FastestSigmoid => format!("fluentps(fastest-sigmoid, s={s})"),
        }
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        match ev {
            Event::Pull {
                worker, clock, req, ..
            } => {
                if self.known(worker) {
                    self.on_pull(worker, clock, req, out);
                }
                return;
            }
            Event::Push { worker, .. }
            | Event::Leave { worker, .. }
            | Event::Join { worker, .. }
                if self.known(worker) =>
            {
                self.clocks.observe(&ev);
            }
            Event::Tick { .. } => {}
            _ => return,
        }
        self.release_ready(out);
    }

    fn fast_path(&self) -> FastPath {
        match self.pause {
            Pause::Fastest { p } if p <= 0.0 => FastPath::Always,
            _ => FastPath::Within(self.s),
        }
    }

    fn parked(&self) -> usize {
        self.parked.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }
}

/// `1 / (1 + e^(s − k))`.
fn sigmoid(s: u64, k: u64) -> f64 {
    1.0 / (1.0 + (s as f64 - k as f64).exp())
}

/// splitmix64 (Steele, Lea, Flood 2014): a tiny seeded generator, so the policy stays
/// deterministic and dependency-free.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_uniformish_and_seeded() {
        let mut a = SplitMix64(7);
        let mut b = SplitMix64(7);
        let xs: Vec<f64> = (0..10_000).map(|_| a.unit()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(xs.iter().zip((0..).map(|_| b.unit())).all(|(x, y)| *x == y));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn sigmoid_is_half_at_the_bound_and_rises() {
        assert_eq!(sigmoid(3, 3), 0.5);
        assert!(sigmoid(3, 4) > 0.7 && sigmoid(3, 10) > 0.999);
        let p = FluentPs::new(Pause::Sigmoid, 0, 2, 1);
        assert_eq!(p.pause_probability(0, true), 0.0, "PSSP needs k > 0");
        let f = FluentPs::new(Pause::FastestSigmoid, 2, 2, 1);
        assert_eq!(f.pause_probability(2, false), 0.0);
        assert_eq!(f.pause_probability(2, true), 0.5);
        assert_eq!(f.pause_probability(1, true), 0.0, "within the bound");
    }
}
