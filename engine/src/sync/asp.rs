//! Asynchronous parallel: nobody waits; every pull is answered with the latest values.

use super::{Action, Event, FastPath, SyncPolicy};

/// ASP.
#[derive(Clone, Debug, Default)]
pub struct Asp;

impl SyncPolicy for Asp {
    fn name(&self) -> String {
        "asp".into()
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        if let Event::Pull { worker, req, .. } = ev {
            out.push(Action::Release { worker, req });
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Always
    }

    fn parked(&self) -> usize {
        0
    }

    fn delayed_total(&self) -> u64 {
        0
    }
}
