//! ElasticBSP's gate on this worker (see the [module docs](super)): pulls below the barrier
//! pass; the first at or past it reports to the scheduler and waits for the plan that moves
//! the barrier.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tracker::Signal;
use super::{Inner, Worker, lock};
use crate::error::{Error, Result};
use crate::proto::Msg;
use crate::sync::zipline::IntervalEstimate;

/// ElasticBSP's gate on this worker.
pub(super) struct Gate {
    /// Pulls at clocks below this pass; one at or above it waits for the next plan.
    barrier: u64,
    /// When the current iteration started (None until the first pull or push).
    mark: Option<Instant>,
    /// The next clock whose first push records an interval sample.
    next_sample: u64,
    /// The interval estimate (the mean of the last few samples, as the simulator's).
    interval: IntervalEstimate,
    /// The superstep report in flight: what its waiters wait on, and when it was sent.
    pending: Option<(Arc<Signal>, Instant)>,
    /// Set once no plan can come (a peer is gone, the job is over, this worker finished).
    broken: Option<Error>,
}

impl Gate {
    pub(super) fn new() -> Gate {
        Gate {
            barrier: 1,
            mark: None,
            next_sample: 0,
            interval: IntervalEstimate::default(),
            pending: None,
            broken: None,
        }
    }

    /// The mean of the recent samples in nanoseconds, 0 if there is none.
    fn interval_ns(&self) -> u64 {
        self.interval.estimate().unwrap_or(0)
    }
}

impl Worker {
    /// Under ElasticBSP, the clock of this worker's next barrier: pulls at clocks below it
    /// pass, the first at or above it waits for the scheduler's next plan. None under other
    /// policies.
    pub fn superstep_until(&self) -> Option<u64> {
        self.inner.gate.as_ref().map(|g| lock(g).barrier)
    }

    /// Under ElasticBSP, the iteration interval this worker would report at a barrier now (the
    /// mean of its last few samples). None under other policies or before the first sample.
    pub fn interval_estimate(&self) -> Option<Duration> {
        let ns = lock(self.inner.gate.as_ref()?).interval_ns();
        (ns > 0).then(|| Duration::from_nanos(ns))
    }

    /// ElasticBSP: returns at once below the barrier; at or past it, reports to the scheduler
    /// (once, however many threads pull at this clock) and waits for the plan. No timeout:
    /// the plan comes when every other live worker has reached its barrier or finished, and
    /// a dead peer or the job's end fails the wait (through [`Inner::fail_with`]). Without
    /// ElasticBSP it does nothing.
    pub(super) fn pass_gate(&self, clock: u64) -> Result<()> {
        let Some(gate) = &self.inner.gate else {
            return Ok(());
        };
        loop {
            let sig = {
                let mut g = lock(gate);
                if let Some(e) = &g.broken {
                    return Err(e.clone());
                }
                if g.mark.is_none() {
                    g.mark = Some(Instant::now());
                }
                if clock < g.barrier {
                    return Ok(());
                }
                match &g.pending {
                    Some((sig, _)) => sig.clone(),
                    None => {
                        let interval_ns = g.interval_ns();
                        // Sent under the gate's lock: the plan's handler takes it too, so it
                        // finds `pending` set.
                        self.inner
                            .sched
                            .send(&Msg::Superstep { clock, interval_ns }.encode())
                            .map_err(|e| Error::PeerGone {
                                role: "scheduler",
                                rank: 0,
                                why: e.to_string(),
                            })?;
                        let sig = Arc::new(Signal::default());
                        g.pending = Some((sig.clone(), Instant::now()));
                        sig
                    }
                }
            };
            sig.wait(None)?;
        }
    }

    /// ElasticBSP: the first push of a new clock closes an iteration: one interval sample.
    pub(super) fn sample_interval(&self, clock: u64) {
        let Some(gate) = &self.inner.gate else {
            return;
        };
        let now = Instant::now();
        let mut g = lock(gate);
        if clock < g.next_sample {
            return;
        }
        if let Some(mark) = g.mark {
            let ns = u64::try_from(now.duration_since(mark).as_nanos()).unwrap_or(u64::MAX);
            g.interval.record(ns);
        }
        g.mark = Some(now);
        g.next_sample = clock + 1;
    }
}

impl Inner {
    /// The scheduler's plan arrived: the barrier moves to `until`. Only an answer to a report
    /// moves it (a stray plan does not).
    pub(super) fn on_plan(&self, until: u64) {
        let Some(gate) = &self.gate else { return };
        let now = Instant::now();
        let answered = {
            let mut g = lock(gate);
            let pending = g.pending.take();
            if pending.is_some() {
                g.barrier = g.barrier.max(until);
                // The next iteration starts now: the wait is not compute.
                g.mark = Some(now);
            }
            pending
        };
        if let Some((sig, sent)) = answered {
            let mut stats = lock(&self.stats);
            stats.supersteps += 1;
            stats.barrier_wait += now.saturating_duration_since(sent);
            drop(stats);
            sig.set(Ok(Default::default()));
        }
    }

    /// No plan can come any more: the gate fails its waiters, and every later pull past the
    /// barrier, with `err`.
    pub(super) fn break_gate(&self, err: &Error) {
        let Some(gate) = &self.gate else { return };
        let mut g = lock(gate);
        if g.broken.is_none() {
            g.broken = Some(err.clone());
        }
        if let Some((s, _)) = g.pending.take() {
            s.set(Err(err.clone()));
        }
    }
}
