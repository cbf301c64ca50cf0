//! Synchronization policies: sans-IO state machines.
//!
//! Inputs are [`Event`]s with timestamps; outputs are [`Action`]s. A policy does no I/O, reads
//! no clock and starts no thread: the same code runs in the real server and in the simulator,
//! and is tested deterministically. Each shard runs its own instance (FluentPS's independent
//! shards), so the engine never takes a global lock to synchronize.
//!
//! Clocks: a worker's clock is the iteration it is working on, from 0. It pulls with clock `c`
//! before computing iteration `c` and pushes that iteration's gradient with clock `c`. A
//! shard's *applied* count for a worker is the number of its gradients applied (so `c + 1`
//! once iteration `c`'s gradient is in). The staleness predicate is
//! [`crate::meta::within_staleness`]: `min_applied >= c - s`.
//!
//! The lock-free fast path: when [`SyncPolicy::fast_path`] says so, a worker reads the shard's
//! clocks one-sided and pulls without asking the server; only pulls that fail the check reach
//! the policy as [`Event::Pull`].

mod asp;
mod bsp;
mod dssp;
mod fluentps;
mod ssp;
mod syncopt;
pub mod zipline;

pub use asp::Asp;
pub use bsp::Bsp;
#[allow(unused_imports)]
pub use dssp::*;
#[allow(unused_imports)]
pub use fluentps::*;
pub use ssp::Ssp;
#[allow(unused_imports)]
pub use syncopt::*;

use serde::{Deserialize, Serialize};

/// A worker's rank.
pub type Worker = u32;
/// Nanoseconds on whatever clock the caller uses (wall clock or simulated).
pub type Nanos = u64;

/// What a policy is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `worker`'s gradient for iteration `clock` was applied to the shard.
    Push {
        /// The worker.
        worker: Worker,
        /// The iteration of the gradient.
        clock: u64,
        /// When.
        at: Nanos,
    },
    /// `worker` asks to pull at `clock` (its lock-free check did not allow it, or the policy
    /// has no fast path). `req` names the request in the actions.
    Pull {
        /// The worker.
        worker: Worker,
        /// Its clock.
        clock: u64,
        /// Request id.
        req: u64,
        /// When.
        at: Nanos,
    },
    /// Time passes.
    Tick {
        /// Now.
        at: Nanos,
    },
    /// `worker` left (died or was removed): it no longer holds anyone back.
    Leave {
        /// The worker.
        worker: Worker,
        /// When.
        at: Nanos,
    },
    /// `worker` (re)joined with `clock` updates already counted.
    Join {
        /// The worker.
        worker: Worker,
        /// Its applied count.
        clock: u64,
        /// When.
        at: Nanos,
    },
}

/// What a policy decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Answer pull `req` of `worker` now, with the latest values.
    Release {
        /// The worker.
        worker: Worker,
        /// The request.
        req: u64,
    },
    /// Pull `req` of `worker` waits (counted as a delayed pull).
    Park {
        /// The worker.
        worker: Worker,
        /// The request.
        req: u64,
    },
    /// Discard `worker`'s gradient for `clock` (it arrived too late to count; Sync-opt).
    DropGradient {
        /// The worker.
        worker: Worker,
        /// The gradient's iteration.
        clock: u64,
    },
}

/// Whether a worker may pull without asking the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastPath {
    /// Always (ASP).
    Always,
    /// When every live worker's applied count is within this staleness (`≥` bound).
    Within(u64),
    /// Never: every pull is an event (policies that must see each pull).
    Never,
}

/// A synchronization policy for one shard.
pub trait SyncPolicy: Send + std::fmt::Debug {
    /// A short name (`bsp`, `ssp(3)`…).
    fn name(&self) -> String;
    /// Feeds one event; appends the resulting actions to `out`.
    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>);
    /// The lock-free pull rule workers may apply themselves.
    fn fast_path(&self) -> FastPath;
    /// Pulls parked right now.
    fn parked(&self) -> usize;
    /// Pulls ever parked ("delayed" in FluentPS's terms).
    fn delayed_total(&self) -> u64;
}

/// A policy by name, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicySpec {
    /// Bulk-synchronous parallel.
    Bsp,
    /// Asynchronous parallel.
    Asp,
    /// Stale-synchronous parallel with bound `s`.
    Ssp {
        /// The staleness bound.
        s: u64,
    },
}

impl PolicySpec {
    /// A fresh instance for a shard of a job with `workers` workers.
    pub fn build(&self, workers: u32) -> Box<dyn SyncPolicy> {
        match *self {
            PolicySpec::Bsp => Box::new(Bsp::new(workers)),
            PolicySpec::Asp => Box::new(Asp),
            PolicySpec::Ssp { s } => Box::new(Ssp::new(workers, s)),
        }
    }
}

impl std::str::FromStr for PolicySpec {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, crate::Error> {
        let l = s.trim().to_ascii_lowercase();
        if l == "bsp" {
            return Ok(PolicySpec::Bsp);
        }
        if l == "asp" {
            return Ok(PolicySpec::Asp);
        }
        if let Some(rest) = l.strip_prefix("ssp") {
            let n = rest.trim_matches(|c| c == '(' || c == ')' || c == ':' || c == '=');
            return n.parse().map(|s| PolicySpec::Ssp { s }).map_err(|_| {
                crate::Error::Config(format!("ssp needs a bound, e.g. ssp(3), not {s:?}"))
            });
        }
        Err(crate::Error::Config(format!(
            "unknown policy {s:?} (bsp, asp, ssp(N))"
        )))
    }
}

/// Bookkeeping shared by the staleness-based policies: applied counts and liveness.
#[derive(Clone, Debug)]
pub(crate) struct Clocks {
    applied: Vec<u64>,
    live: Vec<bool>,
}

impl Clocks {
    pub(crate) fn new(workers: u32) -> Clocks {
        Clocks {
            applied: vec![0; workers as usize],
            live: vec![true; workers as usize],
        }
    }

    /// Updates from an event; false for events about unknown workers (ignored).
    pub(crate) fn observe(&mut self, ev: &Event) -> bool {
        let n = self.applied.len();
        match *ev {
            Event::Push { worker, clock, .. } if (worker as usize) < n => {
                let a = &mut self.applied[worker as usize];
                *a = (*a).max(clock + 1);
            }
            Event::Leave { worker, .. } if (worker as usize) < n => {
                self.live[worker as usize] = false
            }
            Event::Join { worker, clock, .. } if (worker as usize) < n => {
                self.live[worker as usize] = true;
                let a = &mut self.applied[worker as usize];
                *a = (*a).max(clock);
            }
            Event::Pull { worker, .. } if (worker as usize) < n => {}
            Event::Tick { .. } => {}
            _ => return false,
        }
        true
    }

    /// The smallest applied count among live workers (u64::MAX when none is live).
    pub(crate) fn min_live(&self) -> u64 {
        self.applied
            .iter()
            .zip(&self.live)
            .filter(|(_, l)| **l)
            .map(|(a, _)| *a)
            .min()
            .unwrap_or(u64::MAX)
    }
}
