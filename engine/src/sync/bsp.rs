//! Bulk-synchronous parallel: a pull at clock `c` waits until every live worker has finished
//! iterations `0..c` (all their gradients applied): a barrier per iteration.
//!
//! Written on its own (not as `Ssp::new(w, 0)`) so the equivalence SSP(0) ≡ BSP is a test of
//! two implementations, not one.

use std::collections::BTreeSet;

use super::{Action, Clocks, Event, FastPath, SyncPolicy};

/// BSP.
#[derive(Clone, Debug)]
pub struct Bsp {
    clocks: Clocks,
    /// Parked pulls by the iteration they wait for: (clock, req, worker), in release order.
    waiting: BTreeSet<(u64, u64, u32)>,
    delayed: u64,
}

impl Bsp {
    /// BSP for `workers` workers.
    pub fn new(workers: u32) -> Bsp {
        Bsp {
            clocks: Clocks::new(workers),
            waiting: BTreeSet::new(),
            delayed: 0,
        }
    }
}

impl SyncPolicy for Bsp {
    fn name(&self) -> String {
        "bsp".into()
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        if !self.clocks.observe(&ev) {
            return;
        }
        let done = self.clocks.min_live();
        match ev {
            Event::Pull {
                worker, clock, req, ..
            } if clock <= done => out.push(Action::Release { worker, req }),
            Event::Pull {
                worker, clock, req, ..
            } => {
                self.waiting.insert((clock, req, worker));
                self.delayed += 1;
                out.push(Action::Park { worker, req });
            }
            Event::Push { .. } | Event::Leave { .. } | Event::Join { .. } => {
                // The barrier for every iteration up to `done` has fallen.
                while let Some(&(clock, req, worker)) = self.waiting.first() {
                    if clock > done {
                        break;
                    }
                    self.waiting.pop_first();
                    out.push(Action::Release { worker, req });
                }
            }
            Event::Tick { .. } => {}
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Within(0)
    }

    fn parked(&self) -> usize {
        self.waiting.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }
}
