//! Task transfer (EPSP, FlexRR): offers of a straggler's tasks, steals through the scheduler,
//! the gradients of taken tasks ([`Worker::push_for`]), and what the scheduler's supervisor
//! learns and advises.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use super::core::{Offer, PushRecord, Resend};
use super::tracker::{Reply, Request};
use super::{Inner, Worker, lock};
use crate::error::{Error, Result};
use crate::proto::{AckOf, Msg, PushKind};

/// The scheduler's link failed.
fn scheduler_gone(e: falcon_transport::Error) -> Error {
    Error::PeerGone {
        role: "scheduler",
        rank: 0,
        why: e.to_string(),
    }
}

impl Worker {
    /// Sets how this worker gives tasks away when a helper asks (task transfer): `hook(clock,
    /// want)` takes up to `want` unprocessed tasks of its iteration `clock` off its own queue
    /// and returns their range (the trainer's exactly-once claim point). Without a hook this
    /// worker gives nothing away.
    pub fn on_steal(&self, hook: impl Fn(u64, u32) -> Range<u32> + Send + Sync + 'static) {
        lock(&self.inner.core).set_steal_hook(Arc::new(hook));
    }

    /// Asks `straggler` (through the scheduler) for up to `want` unprocessed tasks of its
    /// iteration `clock`. Returns the range now this worker's to compute and push with
    /// [`Worker::push_for`]; empty when none is left, the straggler is gone or does not answer
    /// within the operation timeout.
    pub fn steal(&self, straggler: u32, clock: u64, want: u32) -> Result<Range<u32>> {
        self.check_running()?;
        if straggler >= self.workers() || straggler == self.rank() {
            return Err(Error::Config(format!(
                "worker {} cannot take tasks from worker {straggler}",
                self.rank()
            )));
        }
        let req = Request::Steal { straggler, clock };
        let sig = self
            .inner
            .drive(|c, now, out| c.register(req, None, None, now, Resend::Nothing, out));
        let msg = Msg::Steal {
            straggler,
            helper: self.rank(),
            clock,
            want,
        };
        let sent = self.inner.sched.send(&msg.encode());
        if let Err(e) = sent {
            lock(&self.inner.core).withdraw(req);
            return Err(scheduler_gone(e));
        }
        let waited = sig.wait(Some(self.inner.timeout));
        lock(&self.inner.core).withdraw(req);
        // No answer in time, or none coming (a peer gone): nothing taken.
        match waited {
            Ok(Reply::Tasks(r)) => Ok(r),
            Ok(Reply::Done) | Err(_) => Ok(0..0),
        }
    }

    /// Pushes the gradient of tasks taken from `straggler`'s iteration `clock` (task
    /// transfer), without moving this worker's clock. Under asynchronous updates the servers
    /// apply it at once; under synchronous ones (enforced EPSP) it joins the straggler's step
    /// `clock` when that step has not been applied yet, and the next step otherwise (one
    /// late for the last step is applied when the job ends).
    pub fn push_for(
        &self,
        tensor: &str,
        grad: &falcon_transport::Region,
        straggler: u32,
        clock: u64,
    ) -> Result<()> {
        self.check_running()?;
        if straggler >= self.workers() {
            return Err(Error::Config(format!("no worker {straggler}")));
        }
        let t = self.tensor(tensor)?;
        self.check_len(t, grad)?;
        let mut signals = Vec::new();
        for s in self.shards_of(t) {
            let seq = lock(&self.inner.core).next_help(s.index);
            let rec = PushRecord {
                grad: Some(grad.clone()),
                own: None,
                kind: PushKind::Help,
                seq,
                help_for: Some((straggler, clock)),
                rates: self.inner.rates(),
            };
            signals.push(self.write_record(s, rec, AckOf::Help)?);
        }
        lock(&self.inner.core).stats_mut().help_pushes += signals.len() as u64;
        self.handle(signals, Some(self.inner.timeout)).wait()
    }

    /// Tells the scheduler's supervisor that an iteration took `time` (compute and injected
    /// slowness, not waiting for the policy) with `threads` threads and `tasks` own tasks.
    pub fn report_iteration(&self, threads: usize, tasks: u32, time: Duration) -> Result<()> {
        self.check_running()?;
        let m = Msg::IterationDone {
            threads: threads.min(u32::MAX as usize) as u32,
            tasks,
            nanos: time.as_nanos().min(u128::from(u64::MAX)) as u64,
        };
        self.inner.sched.send(&m.encode()).map_err(scheduler_gone)
    }

    /// The thread count the scheduler's parallelism manager last advised for this worker,
    /// if it advised any.
    pub fn advised_threads(&self) -> Option<usize> {
        match lock(&self.inner.core).advised() {
            0 => None,
            n => Some(n as usize),
        }
    }

    /// Takes the task-transfer offers received since the last call (EPSP, FlexRR), oldest
    /// first. Each distinct offer is returned once however many shards made it.
    pub fn offers(&self) -> Vec<Offer> {
        lock(&self.inner.core).take_offers()
    }

    /// How many completions (answers, acknowledgements, offers, scheduler news) this
    /// worker's progress thread has handed on so far.
    pub fn news(&self) -> u64 {
        self.inner.news.count()
    }

    /// Waits until the progress thread hands on something after `seen` (a count from
    /// [`Worker::news`]) or `timeout` passes; returns the count then. A caller that waits
    /// for a pull *or* a task-transfer offer reads `news()`, checks both, and sleeps here
    /// instead of polling: whatever arrives after its check wakes it.
    pub fn wait_news(&self, seen: u64, timeout: Duration) -> u64 {
        self.inner.news.wait(seen, timeout)
    }
}

impl Inner {
    /// A helper asks (through the scheduler) for up to `want` of this worker's tasks of
    /// iteration `clock`: the steal hook gives them, and the answer goes back.
    pub(super) fn give_tasks(&self, helper: u32, clock: u64, want: u32) {
        let hook = lock(&self.core).steal_hook();
        let r = match hook {
            Some(h) => h(clock, want),
            None => 0..0,
        };
        let reply = Msg::Tasks {
            straggler: self.book.rank,
            helper,
            clock,
            start: r.start,
            end: r.end.max(r.start),
        };
        let _ = self.sched.send(&reply.encode());
    }
}
