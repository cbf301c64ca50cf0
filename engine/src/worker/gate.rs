//! ElasticBSP's gate on this worker (see the [module docs](super)): pulls below the barrier
//! pass; the first at or past it reports to the scheduler and waits for the plan that moves
//! the barrier. The gate is part of the worker's core: it takes the time, and returns what to
//! send and whom to wake.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::tracker::Signal;
use super::{Worker, lock};
use crate::error::{Error, Result};
use crate::proto::Msg;
use crate::sync::zipline::IntervalEstimate;

/// What a pull at the gate comes to.
pub(super) enum Step {
    /// It passes.
    Pass,
    /// It waits on this (a report is in flight).
    Wait(Arc<Signal>),
    /// It sends this superstep report, then waits on this.
    Report(Msg, Arc<Signal>),
}

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

    /// Pulls at clocks below this pass.
    pub(super) fn barrier(&self) -> u64 {
        self.barrier
    }

    /// The mean of the recent samples, if there is one.
    pub(super) fn interval(&self) -> Option<Duration> {
        self.interval
            .estimate()
            .filter(|&ns| ns > 0)
            .map(Duration::from_nanos)
    }

    /// A pull at `clock` at `now`. The first at or past the barrier sends the superstep
    /// report (one report however many threads pull at this clock); it is pending before it
    /// goes, so the plan that answers it always finds it.
    pub(super) fn enter(&mut self, clock: u64, now: Instant) -> Result<Step> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        self.mark.get_or_insert(now);
        if clock < self.barrier {
            return Ok(Step::Pass);
        }
        if let Some((sig, _)) = &self.pending {
            return Ok(Step::Wait(sig.clone()));
        }
        let interval_ns = self.interval.estimate().unwrap_or(0);
        let sig = Arc::new(Signal::default());
        self.pending = Some((sig.clone(), now));
        Ok(Step::Report(Msg::Superstep { clock, interval_ns }, sig))
    }

    /// The first push of a new clock closes an iteration: one interval sample.
    pub(super) fn sample(&mut self, clock: u64, now: Instant) {
        if clock < self.next_sample {
            return;
        }
        if let Some(mark) = self.mark {
            let ns = u64::try_from(now.duration_since(mark).as_nanos()).unwrap_or(u64::MAX);
            self.interval.record(ns);
        }
        self.mark = Some(now);
        self.next_sample = clock + 1;
    }

    /// The scheduler's plan arrived: the barrier moves to `until`. Only an answer to a report
    /// moves it (a stray plan does not); returns the report's waiter, to wake, and how long
    /// it waited.
    pub(super) fn on_plan(&mut self, until: u64, now: Instant) -> Option<(Arc<Signal>, Duration)> {
        let (sig, sent) = self.pending.take()?;
        self.barrier = self.barrier.max(until);
        // The next iteration starts now: the wait is not compute.
        self.mark = Some(now);
        Some((sig, now.saturating_duration_since(sent)))
    }

    /// The report could not go out: returns its waiter, to fail (a later pull reports again).
    pub(super) fn report_failed(&mut self) -> Option<Arc<Signal>> {
        self.pending.take().map(|(s, _)| s)
    }

    /// No plan can come any more: every later pull past the barrier fails with `err`;
    /// returns the report's waiter, to fail with it too.
    pub(super) fn break_with(&mut self, err: &Error) -> Option<Arc<Signal>> {
        self.broken.get_or_insert_with(|| err.clone());
        self.report_failed()
    }
}

impl Worker {
    /// Under ElasticBSP, the clock of this worker's next barrier: pulls at clocks below it
    /// pass, the first at or above it waits for the scheduler's next plan. None under other
    /// policies.
    pub fn superstep_until(&self) -> Option<u64> {
        lock(&self.inner.core).barrier()
    }

    /// Under ElasticBSP, the iteration interval this worker would report at a barrier now (the
    /// mean of its last few samples). None under other policies or before the first sample.
    pub fn interval_estimate(&self) -> Option<Duration> {
        lock(&self.inner.core).interval()
    }

    /// ElasticBSP: returns at once below the barrier; at or past it, reports to the scheduler
    /// (once, however many threads pull at this clock) and waits for the plan. No timeout:
    /// the plan comes when every other live worker has reached its barrier or finished, and
    /// a dead peer or the job's end fails the wait. Without ElasticBSP it does nothing.
    pub(super) fn pass_gate(&self, clock: u64) -> Result<()> {
        loop {
            let step = self
                .inner
                .drive(|c, now, out| c.gate_enter(clock, now, out))?;
            match step {
                None => return Ok(()),
                Some(sig) => {
                    sig.wait(None)?;
                }
            }
        }
    }

    /// ElasticBSP: the first push of a new clock closes an iteration: one interval sample.
    pub(super) fn sample_interval(&self, clock: u64) {
        lock(&self.inner.core).gate_sample(clock, Instant::now());
    }
}
