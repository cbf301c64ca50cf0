//! The worker's progress thread: routes acknowledgements, pull answers and scheduler news to
//! the pieces that wait for them. (Heartbeats have a thread of their own, which nothing here
//! can block.)

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use falcon_transport::{Completion, LinkId};

use super::core::Offer;
use super::{Inner, lock};
use crate::error::Error;
use crate::postoffice::closed_why;
use crate::proto::{Msg, Role};

/// How often requests recorded against a replaced link are looked for (with recovery).
const RESYNC_EVERY: Duration = Duration::from_millis(250);

/// How long a server's orderly close waits for the scheduler's word before it is taken for
/// the server's end: a job the scheduler ended (a worker stopped it, a server failed) closes
/// the servers' links too, and their closes may come in before the scheduler's message that
/// says why.
pub(super) const VERDICT_WAIT: Duration = Duration::from_millis(500);

/// The progress loop; it ends when the worker is dropped or finished.
pub(super) fn progress(inner: Weak<Inner>, heartbeat: Duration) {
    let mut last_resync = Instant::now();
    // A server whose link closed in order, and when: failed at `VERDICT_WAIT` unless the
    // scheduler said meanwhile why the job ended.
    let mut closed: Option<(usize, Instant)> = None;
    loop {
        let Some(w) = inner.upgrade() else { return };
        if w.stop.load(Ordering::Acquire) {
            return;
        }
        if w.book.recovery {
            w.reconnect();
            // Anything recorded against a link that has since been replaced goes out again
            // (a request that raced with a reconnection).
            if last_resync.elapsed() >= RESYNC_EVERY {
                for r in 0..w.servers.len() {
                    w.resync(r);
                }
                last_resync = Instant::now();
            }
        }
        let mut wait = heartbeat.min(Duration::from_millis(200));
        if let Some((r, at)) = closed {
            let left = VERDICT_WAIT.saturating_sub(at.elapsed());
            if left.is_zero() {
                closed = None;
                w.server_closed(r, &None);
                w.news.bump();
                continue;
            }
            wait = wait.min(left);
        }
        if let Ok(c) = w.t.cq().wait(Some(wait)) {
            if let Some(r) = w.route(c) {
                closed = closed.or(Some((r, Instant::now())));
            }
            w.news.bump();
        }
    }
}

impl Inner {
    /// Hands one completion to what waits for it; a server whose link closed in order, to
    /// fail after the scheduler has had its say ([`VERDICT_WAIT`]).
    fn route(&self, c: Completion) -> Option<usize> {
        match c {
            Completion::WriteImm { imm, .. } => {
                self.drive(|c, now, out| c.on_pulled(imm, now, out))
            }
            // A completion on a reattachment under way (looked up once; none in steady state).
            Completion::Message { link, data } => match self.joining_server(link) {
                Some(r) => self.reattach_step(r, &data),
                // A row answer's values are read where they arrived, not copied out.
                None => match Msg::rows_in(&data) {
                    Some((req, at)) => self.drive(|c, now, out| c.on_rows(req, data, at, now, out)),
                    None => match Msg::decode(&data) {
                        Ok(m) => self.on_message(m),
                        Err(e) => tracing::warn!("worker: {e}"),
                    },
                },
            },
            Completion::Closed { link, error } => match self.joining_server(link) {
                Some(r) => self.reattach_failed(r, &error),
                None => return self.on_closed(link, &error),
            },
        }
        None
    }

    /// A message from a server or the scheduler.
    fn on_message(&self, m: Msg) {
        let servers = self.servers.len();
        match m {
            Msg::PushAck {
                shard,
                of,
                staleness,
            } => self.drive(|c, _, out| c.on_ack(shard, of, staleness, out)),
            Msg::PullFailed { req, reason } => {
                self.drive(|c, _, out| c.on_pull_failed(req, reason, out))
            }
            Msg::Rows { req, values } => {
                self.drive(|c, now, out| c.on_rows(req, values, 0, now, out))
            }
            Msg::BarrierDone { seq } => self.drive(|c, _, out| c.on_barrier_done(seq, out)),
            Msg::Plan { until } => self.drive(|c, now, out| c.on_plan(until, now, out)),
            Msg::Steal {
                helper,
                clock,
                want,
                ..
            } => self.give_tasks(helper, clock, want),
            Msg::Tasks {
                straggler,
                clock,
                start,
                end,
                ..
            } => self.drive(|c, _, out| c.on_tasks(straggler, clock, start..end, out)),
            Msg::Threads { threads } => lock(&self.core).advise(threads),
            Msg::Offer { straggler, clock } => {
                lock(&self.core).on_offer(Offer { straggler, clock })
            }
            Msg::Dead {
                role: Role::Worker,
                rank,
            } => self.worker_dead(rank, true),
            Msg::Rejoined { rank } => self.worker_dead(rank, false),
            Msg::Dead {
                role: Role::Server,
                rank,
            } if self.book.recovery && (rank as usize) < servers => {
                self.on_server_dead(rank as usize)
            }
            Msg::Evicted { reason } => {
                tracing::error!(
                    "worker {}: evicted by the scheduler: {reason}",
                    self.book.rank
                );
                self.fail_with(Error::Evicted {
                    rank: self.book.rank,
                    reason,
                });
            }
            Msg::ServerBack { rank, addr } if (rank as usize) < servers => {
                self.on_server_back(rank as usize, addr)
            }
            Msg::Dead { role, rank } => self.fail_all(role, rank, "declared dead by the scheduler"),
            Msg::Aborted { rank, why } => {
                self.fail_all(Role::Worker, rank, &format!("it stopped the job: {why}"))
            }
            Msg::Shutdown => self.fail_all(Role::Scheduler, 0, "the job was shut down"),
            _ => {}
        }
    }

    /// Another worker was declared dead (`dead`), or rejoined: said once, as the others
    /// train on.
    fn worker_dead(&self, rank: u32, dead: bool) {
        let changed = lock(&self.core).worker_dead(rank, dead);
        match (changed, dead) {
            (true, true) => tracing::warn!(
                "worker {}: worker {rank} died; the job goes on without it (it may rejoin under its rank)",
                self.book.rank
            ),
            (true, false) => {
                tracing::warn!("worker {}: worker {rank} rejoined the job", self.book.rank)
            }
            _ => {}
        }
    }

    /// A link closed: a server's (reconnect, or without recovery fail everything; closed in
    /// order, returned, to fail once the scheduler has had its say), one already replaced,
    /// or the scheduler's.
    fn on_closed(&self, link: LinkId, error: &Option<falcon_transport::Error>) -> Option<usize> {
        if self.stop.load(Ordering::Acquire) {
            // Finished: the job's end closes the links.
            return None;
        }
        match self.server_of(link) {
            Some(r) if self.book.recovery => {
                tracing::warn!(
                    "worker: link to server {r} closed ({}); reconnecting",
                    closed_why(error)
                );
                self.server_down(r);
            }
            Some(r) if error.is_none() && self.sched.is_open() => return Some(r),
            Some(r) => self.server_closed(r, error),
            // A link already replaced: nothing to do.
            None if link != self.sched.id() => {}
            // Lost without a goodbye (a partition the scheduler may have evicted this worker
            // over, its eviction notice lost with the link): the worker may join again under
            // its rank.
            // Unless nothing listens where the scheduler was: then it is gone, and the job
            // with it (nothing is left to rejoin).
            None if error.is_some() => match scheduler_gone(self.sched.peer()) {
                Some(gone) => self.fail_all(
                    Role::Scheduler,
                    0,
                    &format!(
                        "its link closed ({}) and {gone}: the scheduler is gone, and the job with it",
                        closed_why(error)
                    ),
                ),
                None => self.fail_with(Error::SchedulerLost {
                    rank: self.book.rank,
                    why: closed_why(error),
                }),
            },
            None => self.fail_all(
                Role::Scheduler,
                0,
                &format!("link closed: {}", closed_why(error)),
            ),
        }
        None
    }
}

impl Inner {
    /// Server `r`'s link closed (`error`: how; none for an orderly close, looked at once the
    /// scheduler has had its say): the job's end if it is over, else the server's.
    pub(super) fn server_closed(&self, r: usize, error: &Option<falcon_transport::Error>) {
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        match self.job_over() {
            Some(over) => self.fail_with(over),
            // A server whose scheduler died ends at once, closing its links in order, and
            // its link may close here before the scheduler's does: if nothing listens
            // where the scheduler was, that is why. A server that died (no goodbye) is
            // named itself, though its death may end the scheduler too.
            None => match error
                .is_none()
                .then(|| scheduler_gone(self.sched.peer()))
                .flatten()
            {
                Some(gone) => self.fail_all(
                    Role::Scheduler,
                    0,
                    &format!(
                        "server {r}'s link closed and {gone}: the scheduler is gone, and the job with it"
                    ),
                ),
                None => self.fail_all(
                    Role::Server,
                    r as u32,
                    &format!("link closed: {}", closed_why(error)),
                ),
            },
        }
    }

    /// Why the job is over for this worker, if it is: what already failed every request, or
    /// a scheduler whose link is closed and where nothing listens any more (a server link
    /// that closes then closed because of it).
    pub(super) fn job_over(&self) -> Option<Error> {
        if let Some(e) = lock(&self.core).broken() {
            return Some(e.clone());
        }
        if self.sched.is_open() || self.stop.load(Ordering::Acquire) {
            return None;
        }
        let gone = scheduler_gone(self.sched.peer())?;
        Some(Error::PeerGone {
            role: Role::Scheduler.name(),
            rank: 0,
            why: format!("its link closed and {gone}: the scheduler is gone, and the job with it"),
        })
    }
}

/// Whether nothing listens any more where the scheduler's link went (`tcp:IP:PORT` or
/// `shm:PATH`, as the link names its peer): a connection refused at once means the process
/// is gone from a host that is up. A host that does not answer (a partition) is not taken
/// for gone: the worker may rejoin once it heals.
fn scheduler_gone(peer: &str) -> Option<String> {
    // A process being killed closes its connections before its listener: asked at once, a
    // dying scheduler may still accept. Five tries a tenth of a second apart.
    (0..5).find_map(|_| {
        std::thread::sleep(Duration::from_millis(100));
        nothing_listens(peer)
    })
}

/// One try of [`scheduler_gone`].
fn nothing_listens(peer: &str) -> Option<String> {
    use std::io::ErrorKind;
    let refused =
        |e: &std::io::Error| matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound);
    if let Some(addr) = peer.strip_prefix("tcp:") {
        let addr: std::net::SocketAddr = addr.parse().ok()?;
        return match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Err(e) if refused(&e) => Some(format!("nothing listens at {addr} any more")),
            _ => None,
        };
    }
    if let Some(path) = peer.strip_prefix("shm:") {
        return match std::os::unix::net::UnixStream::connect(path) {
            Err(e) if refused(&e) => Some(format!("nothing listens at {path} any more")),
            _ => None,
        };
    }
    None
}
