//! Request tracking: every request a worker waits on, in one place.
//!
//! A caller that sends a request registers it first ([`Tracker::register`]) and waits on the
//! [`Signal`] it gets back; when the answer comes the worker's core takes it out
//! ([`Tracker::take`]) and has its signal set, takes out what a dead peer will never answer
//! ([`Tracker::take_answered_by`]), and after a reconnection lists what was sent on an
//! older link ([`Tracker::stale`]).
//!
//! The tracker is sans-IO: it holds no link (a request names the server that answers it and
//! the id of the link it went out on) and reads no clock (the caller passes the time).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use falcon_transport::LinkId;

use crate::error::{Error, Result};
use crate::proto::AckOf;

/// What a completed request brings back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Done; nothing to bring (an acknowledgement, a pull's values written, a barrier).
    #[default]
    Done,
    /// A steal's answer: the task range given away (empty: none).
    Tasks(Range<u32>),
}

/// Something a caller waits for: set once, by whoever completes it.
#[derive(Default)]
pub(crate) struct Signal {
    state: Mutex<Option<Result<Reply>>>,
    cv: Condvar,
}

impl Signal {
    /// True once it is set.
    pub(crate) fn done(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// A signal set already, to `r` (an operation that ended before it went out).
    pub(crate) fn with(r: Result<Reply>) -> Arc<Signal> {
        let s = Arc::new(Signal::default());
        s.set(r);
        s
    }

    /// Sets the outcome; a second call does nothing (the first outcome stands).
    pub(crate) fn set(&self, r: Result<Reply>) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.is_none() {
            *s = Some(r);
            self.cv.notify_all();
        }
    }

    /// The outcome if it comes by `deadline`.
    pub(crate) fn outcome_by(&self, deadline: Instant) -> Option<Result<Reply>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = s.as_ref() {
                return Some(r.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits for the outcome; `None` waits as long as the peers live (a dead peer fails every
    /// waiter through the progress thread, so this never hangs on one).
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Result<Reply> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = s.as_ref() {
                return r.clone();
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return Err(Error::Timeout(
                    "push acknowledgement",
                    timeout.unwrap_or_default(),
                ));
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A request a worker waits on, as its answer names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Request {
    /// A write into this worker's slot of shard `shard`, answered by a `PushAck`.
    Ack {
        /// The shard's id.
        shard: u32,
        /// Which push.
        of: AckOf,
    },
    /// A slow-path pull, by request id (the answer's immediate, or a `PullFailed`).
    Pull(u32),
    /// A job barrier, by sequence number (answered by the scheduler's `BarrierDone`).
    Barrier(u64),
    /// A steal of `straggler`'s tasks of iteration `clock` (answered by the scheduler's
    /// `Tasks`).
    Steal {
        /// The worker asked for tasks.
        straggler: u32,
        /// Its iteration.
        clock: u64,
    },
}

/// A registered request.
pub(crate) struct Tracked<T> {
    /// What its caller waits on.
    pub(crate) sig: Arc<Signal>,
    /// The server that answers it (`None`: the scheduler).
    pub(crate) server: Option<usize>,
    /// The link it last went out on (`None`: not sent yet).
    pub(crate) sent_on: Option<LinkId>,
    /// When it was registered.
    pub(crate) since: Instant,
    /// What the caller keeps with it (what to send again after a reconnection).
    pub(crate) what: T,
}

/// The requests in flight, each with the signal its caller waits on.
pub(crate) struct Tracker<T> {
    waiting: HashMap<Request, Tracked<T>>,
    /// The acknowledgement each shard's slot waits for (a slot holds one push at a time).
    slots: HashMap<u32, AckOf>,
}

impl<T> Default for Tracker<T> {
    fn default() -> Self {
        Tracker {
            waiting: HashMap::new(),
            slots: HashMap::new(),
        }
    }
}

impl<T> Tracker<T> {
    /// Registers `req`, answered by `server` (`None`: the scheduler) and going out on
    /// `sent_on`, at `now`; returns the signal its caller waits on. A request registered
    /// again under the same name replaces the first (whose caller is no longer answered).
    pub(crate) fn register(
        &mut self,
        req: Request,
        server: Option<usize>,
        sent_on: Option<LinkId>,
        now: Instant,
        what: T,
    ) -> Arc<Signal> {
        let sig = Arc::new(Signal::default());
        if let Request::Ack { shard, of } = req {
            self.slots.insert(shard, of);
        }
        let tracked = Tracked {
            sig: sig.clone(),
            server,
            sent_on,
            since: now,
            what,
        };
        self.waiting.insert(req, tracked);
        sig
    }

    /// Takes `req` out without setting its signal: its caller gave up on it or never sent it,
    /// or the caller sets the signal itself once its own bookkeeping is done.
    pub(crate) fn take(&mut self, req: Request) -> Option<Tracked<T>> {
        let t = self.waiting.remove(&req)?;
        if let Request::Ack { shard, of } = req
            && self.slots.get(&shard) == Some(&of)
        {
            self.slots.remove(&shard);
        }
        Some(t)
    }

    /// Takes out every request answered by server `server`, or every request at all with
    /// `None` (a peer is gone: what it would have answered never comes), for their waiters
    /// to be told.
    pub(crate) fn take_answered_by(&mut self, server: Option<usize>) -> Vec<Tracked<T>> {
        let doomed: Vec<Request> = self
            .waiting
            .iter()
            .filter(|(_, t)| server.is_none() || t.server == server)
            .map(|(&r, _)| r)
            .collect();
        doomed.into_iter().filter_map(|r| self.take(r)).collect()
    }

    /// The signal of the push that shard `shard`'s slot holds, while unacknowledged.
    pub(crate) fn slot(&self, shard: u32) -> Option<Arc<Signal>> {
        let of = *self.slots.get(&shard)?;
        self.waiting
            .get(&Request::Ack { shard, of })
            .map(|t| t.sig.clone())
    }

    /// What server `server` must be sent again on its link `link`: every request it answers
    /// that last went out on another link (or on none), with its signal and what the caller
    /// kept.
    pub(crate) fn stale(&self, server: usize, link: LinkId) -> Vec<(Request, Arc<Signal>, T)>
    where
        T: Clone,
    {
        self.waiting
            .iter()
            .filter(|(_, t)| t.server == Some(server) && t.sent_on != Some(link))
            .map(|(&r, t)| (r, t.sig.clone(), t.what.clone()))
            .collect()
    }

    /// Records that `req` (still the request behind `sig`) went out again on `link`.
    pub(crate) fn resent(&mut self, req: Request, sig: &Arc<Signal>, link: LinkId) {
        if let Some(t) = self.waiting.get_mut(&req)
            && Arc::ptr_eq(&t.sig, sig)
        {
            t.sent_on = Some(link);
        }
    }

    /// Requests in flight.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gone() -> Error {
        Error::PeerGone {
            role: "server",
            rank: 1,
            why: "test".into(),
        }
    }

    #[test]
    fn a_completed_request_sets_its_signal_once() {
        let mut t: Tracker<u8> = Tracker::default();
        let now = Instant::now();
        let sig = t.register(Request::Pull(7), Some(0), Some(1), now, 42);
        assert!(!sig.done());
        let done = t.take(Request::Pull(7)).expect("tracked");
        assert_eq!(done.what, 42);
        assert_eq!(done.since, now);
        assert!(Arc::ptr_eq(&done.sig, &sig));
        done.sig.set(Ok(Reply::Done));
        assert!(matches!(sig.wait(Some(Duration::ZERO)), Ok(Reply::Done)));
        // A second answer finds nothing; a second outcome does not replace the first.
        assert!(t.take(Request::Pull(7)).is_none());
        sig.set(Err(gone()));
        assert!(matches!(sig.wait(None), Ok(Reply::Done)));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_steal_brings_back_its_tasks() {
        let mut t: Tracker<()> = Tracker::default();
        let req = Request::Steal {
            straggler: 2,
            clock: 5,
        };
        let sig = t.register(req, None, None, Instant::now(), ());
        t.take(req)
            .expect("tracked")
            .sig
            .set(Ok(Reply::Tasks(3..9)));
        assert!(matches!(sig.wait(None), Ok(Reply::Tasks(r)) if r == (3..9)));
    }

    #[test]
    fn an_unanswered_request_times_out_and_can_be_taken_out() {
        let mut t: Tracker<()> = Tracker::default();
        let sig = t.register(Request::Barrier(1), None, None, Instant::now(), ());
        assert!(matches!(
            sig.wait(Some(Duration::from_millis(1))),
            Err(Error::Timeout(..))
        ));
        assert!(sig.outcome_by(Instant::now()).is_none());
        assert!(t.take(Request::Barrier(1)).is_some());
        assert!(!sig.done());
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_dead_server_fails_what_it_answers_and_only_that() {
        let mut t: Tracker<()> = Tracker::default();
        let now = Instant::now();
        let a = t.register(Request::Pull(1), Some(0), Some(10), now, ());
        let b = t.register(Request::Pull(2), Some(1), Some(11), now, ());
        let c = t.register(Request::Barrier(1), None, None, now, ());
        let fail = |t: &mut Tracker<()>, server| {
            let taken = t.take_answered_by(server);
            for d in &taken {
                d.sig.set(Err(gone()));
            }
            taken.len()
        };
        assert_eq!(fail(&mut t, Some(1)), 1);
        assert!(!a.done() && !c.done());
        assert!(matches!(b.wait(None), Err(Error::PeerGone { .. })));
        assert_eq!(fail(&mut t, None), 2);
        assert!(matches!(a.wait(None), Err(Error::PeerGone { .. })));
        assert!(matches!(c.wait(None), Err(Error::PeerGone { .. })));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_slot_waits_for_its_acknowledgement() {
        let mut t: Tracker<()> = Tracker::default();
        let now = Instant::now();
        assert!(t.slot(3).is_none());
        let ack = Request::Ack {
            shard: 3,
            of: AckOf::Push { clock: 0 },
        };
        let sig = t.register(ack, Some(0), Some(1), now, ());
        assert!(Arc::ptr_eq(&t.slot(3).expect("held"), &sig));
        assert!(t.slot(4).is_none());
        // An acknowledgement of another push leaves it held.
        let other = Request::Ack {
            shard: 3,
            of: AckOf::Help,
        };
        assert!(t.take(other).is_none());
        assert!(t.slot(3).is_some());
        t.take(ack).expect("tracked");
        assert!(t.slot(3).is_none());
    }

    #[test]
    fn after_a_reconnection_what_went_out_on_an_older_link_is_sent_again() {
        let mut t: Tracker<u32> = Tracker::default();
        let now = Instant::now();
        t.register(Request::Pull(1), Some(0), Some(10), now, 1);
        t.register(Request::Pull(2), Some(0), None, now, 2);
        t.register(Request::Pull(3), Some(1), Some(10), now, 3);
        t.register(Request::Barrier(1), None, None, now, 4);
        let mut stale = t.stale(0, 20);
        stale.sort_by_key(|(_, _, w)| *w);
        let got: Vec<u32> = stale.iter().map(|(_, _, w)| *w).collect();
        assert_eq!(got, vec![1, 2]);
        for (req, sig, _) in &stale {
            t.resent(*req, sig, 20);
        }
        assert!(t.stale(0, 20).is_empty());
        // A request replaced since it was listed keeps its own link.
        let fresh = t.register(Request::Pull(1), Some(0), None, now, 5);
        t.resent(Request::Pull(1), &stale[0].1, 20);
        assert_eq!(t.stale(0, 20).len(), 1);
        t.resent(Request::Pull(1), &fresh, 20);
        assert!(t.stale(0, 20).is_empty());
        assert_eq!(t.stale(1, 20).len(), 1);
    }
}
