//! Stale-synchronous parallel (Ho et al., 2013): a pull at clock `c` is answered once every
//! live worker has `≥ c − s` gradients applied; the fastest worker runs at most `s` iterations
//! ahead of the slowest.

use super::{Action, Clocks, Event, FastPath, SyncPolicy, release_within};
use crate::meta::within_staleness;

/// SSP with bound `s`.
#[derive(Clone, Debug)]
pub struct Ssp {
    s: u64,
    clocks: Clocks,
    /// Parked pulls: (clock, req, worker), answered in clock order.
    parked: Vec<(u64, u64, u32)>,
    delayed: u64,
}

impl Ssp {
    /// SSP for `workers` workers with staleness bound `s`.
    pub fn new(workers: u32, s: u64) -> Ssp {
        Ssp {
            s,
            clocks: Clocks::new(workers),
            parked: Vec::new(),
            delayed: 0,
        }
    }

    fn release_ready(&mut self, out: &mut Vec<Action>) {
        release_within(
            &mut self.parked,
            self.clocks.min_live(),
            self.s,
            |worker, req| out.push(Action::Release { worker, req }),
        );
    }
}

impl SyncPolicy for Ssp {
    fn name(&self) -> String {
        format!("ssp({})", self.s)
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        if !self.clocks.observe(&ev) {
            return;
        }
        match ev {
            Event::Pull {
                worker, clock, req, ..
            } => {
                if within_staleness(self.clocks.min_live(), clock, self.s) {
                    out.push(Action::Release { worker, req });
                } else {
                    self.parked.push((clock, req, worker));
                    self.delayed += 1;
                    out.push(Action::Park { worker, req });
                }
            }
            Event::Push { .. } | Event::Leave { .. } | Event::Join { .. } => {
                self.release_ready(out)
            }
            Event::Tick { .. } => {}
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Within(self.s)
    }

    fn parked(&self) -> usize {
        self.parked.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }
}
