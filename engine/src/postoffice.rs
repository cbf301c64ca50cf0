//! The node-level part of every role (ps-lite's Postoffice): joining the job at the scheduler
//! (rendezvous), and the bookkeeping of accepted links before they are admitted. Servers,
//! workers and the scheduler all use it; it uses none of them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Transport};

use crate::auth::{self, Purpose};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::keys::TensorSpec;
use crate::proto::{Book, Msg, Role};

/// Joins a job at the scheduler: hello, then wait for the book (or a refusal). Completions
/// from other peers that arrive meanwhile (a fast worker attaching to a server that has not
/// read its own book yet) are returned, not dropped.
pub fn rendezvous(
    t: &Transport,
    cfg: &JobConfig,
    role: Role,
    rank: Option<u32>,
    tensors: Vec<TensorSpec>,
) -> Result<(Link, Book, Vec<Completion>)> {
    let mut early = Vec::new();
    let sched = reach_scheduler(t, cfg, role)?;
    sched.send(&Msg::Knock.encode())?;
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    // The scheduler answers with a challenge our hello must answer.
    let nonce = from_scheduler(
        t,
        &sched,
        (deadline, cfg.rendezvous_timeout),
        "waiting for the scheduler's challenge",
        &mut early,
        |m| match m {
            Msg::Challenge { nonce } => Ok(nonce),
            other => Err(Box::new(other)),
        },
    )?;
    sched.send(
        &Msg::Hello {
            role,
            rank,
            proof: auth::answer(&cfg.token, Purpose::Hello, &nonce),
            addr: t.address().to_string(),
            tensors,
        }
        .encode(),
    )?;
    let book = from_scheduler(
        t,
        &sched,
        (deadline, cfg.rendezvous_timeout),
        "waiting for the scheduler's address book",
        &mut early,
        |m| match m {
            Msg::Book(b) => Ok(b),
            other => Err(Box::new(other)),
        },
    )?;
    book.keymap.validate(book.servers.len())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let spin = crate::config::host_spin(cfg.transport.spin, cfg.spin_auto, book.host_peers, cores);
    if spin != t.spin() {
        tracing::debug!(
            "{} {}: {} of the job's workers and servers share this host's {cores} core(s): waits park at once instead of spinning (FALCON_SPIN_US sets a spin)",
            role.name(),
            book.rank,
            book.host_peers
        );
        t.set_spin(spin);
    }
    let helpers = crate::config::host_helpers(cfg.helper_threads, book.host_peers, cores);
    falcon_transport::spread::set_helpers(helpers);
    Ok((sched, book, early))
}

/// Connects to the scheduler for control messages, retrying until the rendezvous deadline
/// while it is not listening yet, is busy admitting others, or times out (roles start in any
/// order, as in ps-lite); a peer that is not a falcon scheduler, or any other error, ends the
/// wait at once.
fn reach_scheduler(t: &Transport, cfg: &JobConfig, role: Role) -> Result<Link> {
    // HOST:PORT, IP:PORT (a remote tcp endpoint) or the transport's text form.
    let addr = crate::launch::scheduler_address(&cfg.scheduler)
        .map_err(|e| Error::Config(format!("scheduler address {}: {e}", cfg.scheduler)))?;
    // The configured medium is for the data path; the control link to the scheduler takes
    // whatever reaches it (its address may be a bare tcp endpoint from the environment).
    // Roles start in any order: retry until the rendezvous deadline, like ps-lite.
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut pause = Duration::from_millis(20);
    let mut attempt = 0u32;
    let mut last_said = Instant::now();
    loop {
        attempt += 1;
        match t.connect_control(&addr) {
            Ok(l) => return Ok(l),
            // Not listening yet, or at its admission limit: retry until the deadline.
            Err(
                e @ (falcon_transport::Error::Unreachable { .. }
                | falcon_transport::Error::Closed { .. }
                | falcon_transport::Error::Busy { .. }
                | falcon_transport::Error::Timeout(..)),
            ) => {
                if Instant::now() + pause > deadline {
                    return Err(Error::PeerGone {
                        role: "scheduler",
                        rank: 0,
                        why: format!(
                            "unreachable at {} after {attempt} attempts in {:.1} s: {e}",
                            cfg.scheduler,
                            cfg.rendezvous_timeout.as_secs_f64()
                        ),
                    });
                }
                if last_said.elapsed() >= Duration::from_secs(3) {
                    tracing::warn!(
                        "{}: waiting for the scheduler at {} (attempt {attempt}, {:.0} s left): {e}",
                        role.name(),
                        cfg.scheduler,
                        deadline
                            .saturating_duration_since(Instant::now())
                            .as_secs_f64()
                    );
                    last_said = Instant::now();
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            // Another program holds the scheduler's port: no use waiting for it.
            Err(falcon_transport::Error::NotFalcon { seen, .. }) => {
                return Err(Error::Config(format!(
                    "{} is not a falcon scheduler: it answered with {seen}; another program \
                     holds that port (check FALCON_SCHEDULER, or DMLC_PS_ROOT_URI and \
                     DMLC_PS_ROOT_PORT, or MASTER_ADDR and MASTER_PORT)",
                    cfg.scheduler
                )));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Waits for the scheduler's message that `want` takes (it hands others back), by `deadline`
/// (of a `timeout`-long wait); a refusal or the link's end is an error, other completions go
/// to `early`.
fn from_scheduler<T>(
    t: &Transport,
    sched: &Link,
    (deadline, timeout): (Instant, Duration),
    what: &'static str,
    early: &mut Vec<Completion>,
    want: impl Fn(Msg) -> std::result::Result<T, Box<Msg>>,
) -> Result<T> {
    loop {
        let left = time_left(deadline, what, timeout)?;
        match t.cq().wait(Some(left)) {
            Ok(Completion::Message { link, data }) if link == sched.id() => {
                match Msg::decode(&data)? {
                    Msg::Refused { reason } => return Err(Error::Refused(reason)),
                    m => match want(m) {
                        Ok(v) => return Ok(v),
                        Err(other) => tracing::debug!("rendezvous: ignoring {other:?}"),
                    },
                }
            }
            Ok(Completion::Closed { link, error }) if link == sched.id() => {
                return Err(Error::PeerGone {
                    role: "scheduler",
                    rank: 0,
                    why: format!("closed during rendezvous: {}", closed_why(&error)),
                });
            }
            Ok(other) => early.push(other),
            Err(_) => {}
        }
    }
}

/// Hands every link the transport has accepted so far to `take`, without waiting.
pub(crate) fn each_accepted(t: &Transport, mut take: impl FnMut(Link)) {
    while let Ok(l) = t.accept(Some(Duration::ZERO)) {
        take(l);
    }
}

/// Moves every link the transport has accepted into `links`, stamped with when it came.
pub(crate) fn drain_accepted(t: &Transport, links: &mut HashMap<LinkId, (Link, Instant)>) {
    each_accepted(t, |l| {
        links.insert(l.id(), (l, Instant::now()));
    });
}

/// The accepted link a completion came on, if this role knows it. The transport hands a link
/// to the accept queue before it delivers any completion of it, so draining the queue first
/// finds every link there is: a completion of a link still unknown is of one this role has
/// already refused or forgotten, and is dropped — never waited for.
pub(crate) fn known_link(
    t: &Transport,
    links: &mut HashMap<LinkId, (Link, Instant)>,
    id: LinkId,
) -> Option<Link> {
    if !links.contains_key(&id) {
        drain_accepted(t, links);
    }
    links.get(&id).map(|(l, _)| l.clone())
}

/// Closes and forgets the links accepted more than `deadline` ago that `admitted` does not
/// know: a peer that has not finished the role's admission by then is dropped.
pub(crate) fn expire_unadmitted(
    links: &mut HashMap<LinkId, (Link, Instant)>,
    deadline: Duration,
    admitted: impl Fn(LinkId) -> bool,
    who: &str,
) {
    links.retain(|id, (l, at)| admitted(*id) || !overdue(Some(l), *at, deadline, who));
}

/// Whether a link accepted at `at` is past the admission `deadline`: if so, it is closed
/// (where the caller still holds it), saying so. Every role expires its unadmitted links
/// through this.
pub(crate) fn overdue(
    link: Option<&Link>,
    at: Instant,
    deadline: Duration,
    who: impl std::fmt::Display,
) -> bool {
    if at.elapsed() < deadline {
        return false;
    }
    if let Some(l) = link {
        tracing::warn!(
            "{who}: dropped {}: it did not finish admission within {} ms",
            l.peer(),
            deadline.as_millis()
        );
        l.close();
    }
    true
}

/// Time left before `deadline`, or the timeout error for `what`.
pub(crate) fn time_left(
    deadline: Instant,
    what: &'static str,
    timeout: Duration,
) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::Timeout(what, timeout));
    }
    Ok(left)
}

/// Why a link closed, in words: its error, or an orderly close.
pub(crate) fn closed_why(error: &Option<falcon_transport::Error>) -> String {
    match error {
        Some(e) => e.to_string(),
        None => "closed by the peer".into(),
    }
}
