//! Stale-synchronous parallel (Ho et al., 2013): a pull at clock `c` is answered once every
//! live worker has `≥ c − s` gradients applied; the fastest worker runs at most `s` iterations
//! ahead of the slowest.

use super::{Action, Clocks, Event, FastPath, Parked, SyncPolicy};

/// SSP with bound `s`.
#[derive(Clone, Debug)]
pub struct Ssp {
    s: u64,
    clocks: Clocks,
    /// Parked pulls, answered in clock order.
    parked: Parked,
}

impl Ssp {
    /// SSP for `workers` workers with staleness bound `s`.
    pub fn new(workers: u32, s: u64) -> Ssp {
        Ssp {
            s,
            clocks: Clocks::new(workers),
            parked: Parked::default(),
        }
    }

    fn release_ready(&mut self, out: &mut Vec<Action>) {
        self.parked
            .release_within(self.clocks.min_live(), self.s, |worker, req| {
                out.push(Action::Release { worker, req })
            });
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
                let min = self.clocks.min_live();
                self.parked.judge(min, self.s, (worker, clock, req), out);
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
        self.parked.delayed
    }
}
