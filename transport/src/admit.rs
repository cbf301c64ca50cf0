//! The admission wall of a tcp listener: one thread accepts every connection and drives all
//! their handshakes ([`Handshake`]) with non-blocking sockets and `poll`.
//!
//! Until a peer has proved that it knows the job token it owns no thread, at most
//! [`MAX_RECORD`] bytes of buffer and one descriptor, and it lives at most the handshake
//! deadline, counted from its connection (not per read: a peer trickling bytes is dropped on
//! time). Connections waiting for admission are capped per source address and in total;
//! one over a cap is closed at once — except that when the total is reached, a newcomer from a
//! less represented source takes the place of the most represented source's oldest, so a few
//! flooding addresses cannot lock everyone else out. Refused, failed and timed-out connections release their
//! descriptor at once. Only an admitted connection becomes a link with threads of its own.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use crate::error::{Error, Result};
use crate::handshake::{Handshake, Local, NONCE, Peer, Side};

/// The wall's limits.
#[derive(Clone, Debug)]
pub(crate) struct AdmitLimits {
    /// One deadline for the whole handshake, from the connection's acceptance.
    pub(crate) deadline: Duration,
    /// Connections waiting for admission, in total.
    pub(crate) max_pending: usize,
    /// Connections waiting for admission from one source address.
    pub(crate) max_per_source: usize,
}

/// Counts of what the wall did, for tests and diagnostics.
#[derive(Debug, Default)]
pub(crate) struct AdmitStats {
    pub(crate) admitted: std::sync::atomic::AtomicU64,
    pub(crate) refused: std::sync::atomic::AtomicU64,
    pub(crate) timed_out: std::sync::atomic::AtomicU64,
    pub(crate) over_cap: std::sync::atomic::AtomicU64,
    pub(crate) pending: std::sync::atomic::AtomicU64,
}

struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    deadline: Instant,
    hs: Handshake,
}

/// Why a pending connection ended without admission.
enum End {
    Refused(Error),
    TimedOut,
}

/// Longest a poll sleeps, so a stopping transport is noticed even if nothing wakes it.
const MAX_SLEEP: Duration = Duration::from_millis(500);

/// A fresh nonce from the kernel.
pub(crate) fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    let mut filled = 0;
    while filled < NONCE {
        match rustix::rand::getrandom(&mut n[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(k) => filled += k,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("random handshake nonce", e.into())),
        }
    }
    Ok(n)
}

fn timespec(d: Duration) -> Timespec {
    Timespec {
        tv_sec: d.as_secs() as _,
        tv_nsec: d.subsec_nanos() as _,
    }
}

/// Runs the wall until `stopping` is set; each admitted connection (blocking again, its
/// handshake done) goes to `admitted` with the peer and its address.
pub(crate) fn run(
    listener: TcpListener,
    local: Local,
    limits: AdmitLimits,
    stats: std::sync::Arc<AdmitStats>,
    stopping: &AtomicBool,
    log_name: &str,
    mut admitted: impl FnMut(TcpStream, Peer, SocketAddr),
) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("{log_name}: tcp listener cannot be made non-blocking: {e}");
        return;
    }
    let mut pending: Vec<Pending> = Vec::new();
    let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
    let mut last_cap_warning: Option<Instant> = None;
    let mut quiet = Quiet::default();
    loop {
        if stopping.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let sleep = pending
            .iter()
            .map(|p| p.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(MAX_SLEEP)
            .min(MAX_SLEEP);
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(pending.len() + 1);
        fds.push(PollFd::new(&listener, PollFlags::IN));
        for p in &pending {
            let mut ev = PollFlags::IN;
            if !p.hs.outgoing().is_empty() {
                ev |= PollFlags::OUT;
            }
            fds.push(PollFd::from_borrowed_fd(p.stream.as_fd(), ev));
        }
        let ready = match rustix::event::poll(&mut fds, Some(&timespec(sleep))) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!("{log_name}: poll failed on the tcp listener: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let listener_ready = !fds[0].revents().is_empty();
        let active: Vec<bool> = fds[1..].iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        if stopping.load(Ordering::Acquire) {
            return;
        }

        // Drive the handshakes that have something to do, and end those past their deadline.
        let now = Instant::now();
        let mut kept = Vec::with_capacity(pending.len());
        for (mut p, is_active) in pending.drain(..).zip(active) {
            let outcome = if ready > 0 && is_active {
                step(&mut p)
            } else {
                Ok(false)
            };
            let outcome = match outcome {
                Ok(false) if now >= p.deadline => Err(End::TimedOut),
                other => other,
            };
            match outcome {
                Ok(false) => kept.push(p),
                Ok(true) => {
                    release(&mut per_source, p.from.ip());
                    let peer = p.hs.finished().expect("step reported it done");
                    match p.stream.set_nonblocking(false) {
                        Ok(()) => {
                            stats.admitted.fetch_add(1, Ordering::Relaxed);
                            admitted(p.stream, peer, p.from);
                        }
                        Err(e) => tracing::warn!("{log_name}: tcp peer {}: {e}", p.from),
                    }
                }
                Err(end) => {
                    release(&mut per_source, p.from.ip());
                    match end {
                        End::Refused(e) => {
                            stats.refused.fetch_add(1, Ordering::Relaxed);
                            // Tell it why, if the socket takes it now; never wait for it.
                            let _ = p.stream.write(p.hs.outgoing());
                            quiet.warn(|more| {
                                tracing::warn!("{log_name}: refused tcp peer {}: {e}{more}", p.from)
                            });
                        }
                        End::TimedOut => {
                            stats.timed_out.fetch_add(1, Ordering::Relaxed);
                            quiet.warn(|more| {
                                tracing::warn!(
                                    "{log_name}: dropped tcp peer {}: no complete handshake within {} ms{more}",
                                    p.from,
                                    limits.deadline.as_millis()
                                )
                            });
                        }
                    }
                }
            }
        }
        pending = kept;

        // New connections.
        if listener_ready {
            loop {
                let (stream, from) = match listener.accept() {
                    Ok(s) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) if stopping.load(Ordering::Acquire) => return,
                    Err(e) => {
                        // Out of descriptors, say: back off rather than spin.
                        tracing::warn!("{log_name}: tcp accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                        break;
                    }
                };
                let from_here = per_source.get(&from.ip()).copied().unwrap_or(0);
                // Fairness when the wall is full: a newcomer from a source with fewer
                // connections waiting than the most represented one takes the place of that
                // source's oldest, so a few addresses flooding the wall cannot lock others out.
                if pending.len() >= limits.max_pending
                    && from_here < limits.max_per_source
                    && let Some((&crowded, _)) = per_source
                        .iter()
                        .filter(|&(_, &n)| n > from_here + 1)
                        .max_by_key(|&(_, &n)| n)
                    && let Some(oldest) = pending
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.from.ip() == crowded)
                        .min_by_key(|(_, p)| p.deadline)
                        .map(|(i, _)| i)
                {
                    let p = pending.swap_remove(oldest);
                    release(&mut per_source, p.from.ip());
                    stats.over_cap.fetch_add(1, Ordering::Relaxed);
                    drop(p);
                }
                if pending.len() >= limits.max_pending || from_here >= limits.max_per_source {
                    stats.over_cap.fetch_add(1, Ordering::Relaxed);
                    if last_cap_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                        tracing::warn!(
                            "{log_name}: closed tcp peer {from} at once: {} connections wait for admission ({} from its address; caps {} and {})",
                            pending.len(),
                            from_here,
                            limits.max_pending,
                            limits.max_per_source
                        );
                        last_cap_warning = Some(Instant::now());
                    }
                    drop(stream);
                    continue;
                }
                let Ok(n) = nonce() else {
                    drop(stream);
                    continue;
                };
                if stream.set_nonblocking(true).is_err() {
                    continue;
                }
                let mut p = Pending {
                    stream,
                    from,
                    deadline: Instant::now() + limits.deadline,
                    hs: Handshake::new(Side::Accept, local.clone(), n),
                };
                // Our hello fits any fresh socket buffer; what does not goes out on POLLOUT.
                let _ = flush(&mut p);
                *per_source.entry(from.ip()).or_default() += 1;
                pending.push(p);
            }
        }
        stats.pending.store(pending.len() as u64, Ordering::Relaxed);
    }
}

/// Rate-limits the wall's warnings: one a second, with a count of those left unsaid.
#[derive(Default)]
struct Quiet {
    last: Option<Instant>,
    unsaid: u64,
}

impl Quiet {
    fn warn(&mut self, say: impl FnOnce(String)) {
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            self.unsaid += 1;
            return;
        }
        let more = match self.unsaid {
            0 => String::new(),
            n => format!(" ({n} more refused or dropped since the last warning)"),
        };
        say(more);
        self.unsaid = 0;
        self.last = Some(Instant::now());
    }
}

fn release(per_source: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = per_source.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            per_source.remove(&ip);
        }
    }
}

/// Writes what the handshake has to send, as far as the socket takes it.
fn flush(p: &mut Pending) -> std::io::Result<()> {
    while !p.hs.outgoing().is_empty() {
        match p.stream.write(p.hs.outgoing()) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => p.hs.sent(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Moves bytes for one handshake: `Ok(true)` when it is done, `Ok(false)` when it waits.
fn step(p: &mut Pending) -> std::result::Result<bool, End> {
    let io = |e: std::io::Error| End::Refused(Error::io("tcp handshake", e));
    flush(p).map_err(io)?;
    loop {
        let want = p.hs.wants();
        if want == 0 {
            break;
        }
        let mut buf = [0u8; crate::handshake::MAX_RECORD];
        match p.stream.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(End::Refused(Error::Closed {
                    peer: p.from.to_string(),
                    reason: "closed during the handshake".into(),
                }));
            }
            Ok(n) => {
                p.hs.receive(&buf[..n]).map_err(End::Refused)?;
                flush(p).map_err(io)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    Ok(p.hs.finished().is_some())
}
