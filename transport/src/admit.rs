//! The admission wall of a tcp listener: one thread accepts every connection and drives all
//! their handshakes ([`Handshake`]) with non-blocking sockets and `poll`.
//!
//! Until a peer has proved that it knows the job token it owns no thread, at most
//! [`MAX_RECORD`] bytes of buffer and one descriptor, and it lives at most the handshake
//! deadline, counted from its connection (not per read: a peer trickling bytes is dropped on
//! time). Connections waiting for admission are capped per source address and in total. When
//! the wall is full, a newcomer takes the place of a waiting connection (see [`make_room`]):
//! the oldest of a source more represented than its own; else the oldest from an address that
//! never proved the token here, once it has waited [`grace`]; a newcomer from an address that
//! did (a worker coming back) takes the oldest from an unknown address at once. One flooding
//! address or many, each holding connections it never proves, cannot lock a node out. A
//! connection turned away, or made to give way, is told so (a refusal marked *busy*, which the
//! connecting side retries) and closed without a reset: its unread input is drained for a
//! moment first ([`LINGER`]). Refused, failed and timed-out connections release their
//! descriptor at once, or after that moment. Only an admitted connection becomes a link with
//! threads of its own.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use crate::error::Error;
use crate::handshake::{Handshake, Local, Peer, Side, busy_record, nonce};

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
    accepted: Instant,
    deadline: Instant,
    hs: Handshake,
}

/// A connection turned away, drained until its peer closes or [`LINGER`] passes, so the
/// kernel closes it with a FIN after our last words, not a reset that could overtake them.
struct Closing {
    stream: TcpStream,
    until: Instant,
}

/// How long a connection turned away is drained before it is closed.
const LINGER: Duration = Duration::from_millis(250);

/// Addresses that proved the job token on this listener, remembered up to [`KNOWN_CAP`] (the
/// oldest forgotten first).
#[derive(Default)]
struct Known {
    set: HashSet<IpAddr>,
    order: VecDeque<IpAddr>,
}

const KNOWN_CAP: usize = 4096;

impl Known {
    fn contains(&self, ip: &IpAddr) -> bool {
        self.set.contains(ip)
    }

    fn add(&mut self, ip: IpAddr) {
        if self.set.insert(ip) {
            self.order.push_back(ip);
            if self.order.len() > KNOWN_CAP
                && let Some(old) = self.order.pop_front()
            {
                self.set.remove(&old);
            }
        }
    }
}

/// What a full (or not full) wall does with a newcomer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// There is room: it waits for admission.
    Free,
    /// It takes the place of waiting connection `i`, which is told the wall is busy.
    Take(usize),
    /// It is told the wall is busy.
    Busy,
}

/// One connection waiting for admission, as [`make_room`] sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Waiting {
    pub(crate) ip: IpAddr,
    pub(crate) accepted: Instant,
    pub(crate) known: bool,
}

/// How long a connection from an unknown address is safe from newcomers from other unknown
/// addresses: a legitimate handshake takes a round trip or two, so a flood must outpace it
/// everywhere at once to push it out.
pub(crate) fn grace(limits: &AdmitLimits) -> Duration {
    (limits.deadline / 4).min(Duration::from_millis(100))
}

/// The wall's fairness rule, without sockets: where a newcomer from `ip` goes, given the
/// connections `waiting` (their per-source counts in `per_source`).
///
/// 1. A source at its own cap is turned away.
/// 2. With room, it waits.
/// 3. A full wall makes room for it by dropping the oldest connection of the most
///    represented source, if that source has at least two more waiting than the newcomer's.
/// 4. Else the oldest connection from an address that never proved the token here gives
///    way: at once for a newcomer from an address that did, after [`grace`] for another.
/// 5. Else it is turned away.
pub(crate) fn make_room(
    waiting: &[Waiting],
    per_source: &HashMap<IpAddr, usize>,
    ip: IpAddr,
    known: bool,
    limits: &AdmitLimits,
    now: Instant,
) -> Room {
    let from_here = per_source.get(&ip).copied().unwrap_or(0);
    if from_here >= limits.max_per_source {
        return Room::Busy;
    }
    if waiting.len() < limits.max_pending {
        return Room::Free;
    }
    let oldest = |pick: &dyn Fn(&Waiting) -> bool| {
        waiting
            .iter()
            .enumerate()
            .filter(|(_, w)| pick(w))
            .min_by_key(|(_, w)| w.accepted)
            .map(|(i, _)| i)
    };
    if let Some((&crowded, _)) = per_source
        .iter()
        .filter(|&(_, &n)| n > from_here + 1)
        .max_by_key(|&(_, &n)| n)
        && let Some(i) = oldest(&|w| w.ip == crowded)
    {
        return Room::Take(i);
    }
    let grace = if known { Duration::ZERO } else { grace(limits) };
    match oldest(&|w| !w.known && now.saturating_duration_since(w.accepted) >= grace) {
        Some(i) => Room::Take(i),
        None => Room::Busy,
    }
}

/// Why a pending connection ended without admission.
enum End {
    Refused(Error),
    TimedOut,
}

/// Longest a poll sleeps, so a stopping transport is noticed even if nothing wakes it.
const MAX_SLEEP: Duration = Duration::from_millis(500);

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
    let mut wall = Wall {
        local,
        limits,
        stats,
        log_name,
        pending: Vec::new(),
        closing: Vec::new(),
        known: Known::default(),
        per_source: HashMap::new(),
        last_cap_warning: None,
        quiet: Quiet::default(),
    };
    while !stopping.load(Ordering::Acquire) {
        let Some(ready) = wall.wait(&listener) else {
            continue;
        };
        wall.linger(&ready.draining);
        if stopping.load(Ordering::Acquire) {
            return;
        }
        wall.drive(&ready.active, &mut admitted);
        if ready.listener && !wall.accept(&listener, stopping) {
            return;
        }
        wall.stats
            .pending
            .store(wall.pending.len() as u64, Ordering::Relaxed);
    }
}

/// One listener's wall: the connections waiting for admission and those being turned away.
struct Wall<'a> {
    local: Local,
    limits: AdmitLimits,
    stats: std::sync::Arc<AdmitStats>,
    log_name: &'a str,
    pending: Vec<Pending>,
    closing: Vec<Closing>,
    known: Known,
    per_source: HashMap<IpAddr, usize>,
    last_cap_warning: Option<Instant>,
    quiet: Quiet,
}

/// What a poll found ready: the listener, each pending connection, each one lingering.
struct Ready {
    listener: bool,
    active: Vec<bool>,
    draining: Vec<bool>,
}

impl Wall<'_> {
    /// Sleeps until a socket is ready or the next deadline; `None` when interrupted.
    fn wait(&mut self, listener: &TcpListener) -> Option<Ready> {
        let now = Instant::now();
        let sleep = self
            .pending
            .iter()
            .map(|p| p.deadline)
            .chain(self.closing.iter().map(|c| c.until))
            .map(|t| t.saturating_duration_since(now))
            .min()
            .unwrap_or(MAX_SLEEP)
            .min(MAX_SLEEP);
        let mut fds: Vec<PollFd<'_>> =
            Vec::with_capacity(self.pending.len() + self.closing.len() + 1);
        fds.push(PollFd::new(listener, PollFlags::IN));
        for p in &self.pending {
            let mut ev = PollFlags::IN;
            if !p.hs.outgoing().is_empty() {
                ev |= PollFlags::OUT;
            }
            fds.push(PollFd::from_borrowed_fd(p.stream.as_fd(), ev));
        }
        for c in &self.closing {
            fds.push(PollFd::from_borrowed_fd(c.stream.as_fd(), PollFlags::IN));
        }
        match rustix::event::poll(&mut fds, Some(&timespec(sleep))) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return None,
            Err(e) => {
                tracing::error!("{}: poll failed on the tcp listener: {e}", self.log_name);
                std::thread::sleep(Duration::from_millis(10));
                return None;
            }
        }
        let ready = |f: &PollFd<'_>| !f.revents().is_empty();
        let split = 1 + self.pending.len();
        Some(Ready {
            listener: ready(&fds[0]),
            active: fds[1..split].iter().map(ready).collect(),
            draining: fds[split..].iter().map(ready).collect(),
        })
    }

    /// Connections turned away: drained until their peer closes, or for [`LINGER`].
    fn linger(&mut self, draining: &[bool]) {
        let now = Instant::now();
        let mut lingering = Vec::with_capacity(self.closing.len());
        for (mut c, &ready) in self.closing.drain(..).zip(draining) {
            if (ready && !drain(&mut c.stream)) || now >= c.until {
                continue;
            }
            lingering.push(c);
        }
        self.closing = lingering;
    }

    /// Drives the handshakes that have something to do, and ends those past their deadline.
    fn drive(&mut self, active: &[bool], admitted: &mut impl FnMut(TcpStream, Peer, SocketAddr)) {
        let now = Instant::now();
        let mut kept = Vec::with_capacity(self.pending.len());
        let pending = std::mem::take(&mut self.pending);
        for (mut p, &is_active) in pending.into_iter().zip(active) {
            let outcome = if is_active { step(&mut p) } else { Ok(false) };
            let outcome = match outcome {
                Ok(false) if now >= p.deadline => Err(End::TimedOut),
                other => other,
            };
            match outcome {
                Ok(false) => kept.push(p),
                Ok(true) => {
                    release(&mut self.per_source, p.from.ip());
                    self.known.add(p.from.ip());
                    let peer = p.hs.finished().expect("step reported it done");
                    match p.stream.set_nonblocking(false) {
                        Ok(()) => {
                            self.stats.admitted.fetch_add(1, Ordering::Relaxed);
                            admitted(p.stream, peer, p.from);
                        }
                        Err(e) => tracing::warn!("{}: tcp peer {}: {e}", self.log_name, p.from),
                    }
                }
                Err(end) => {
                    release(&mut self.per_source, p.from.ip());
                    self.ended(p, end);
                }
            }
        }
        self.pending = kept;
    }

    /// A pending connection ended without admission: refused (told why) or timed out.
    fn ended(&mut self, p: Pending, end: End) {
        let name = self.log_name;
        match end {
            End::Refused(e) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                // Tell it why, if the socket takes it now; never wait for it.
                let why = p.hs.outgoing().to_vec();
                let room = self.linger_room();
                turn_away(p.stream, &why, &mut self.closing, room);
                self.quiet
                    .warn(|more| tracing::warn!("{name}: refused tcp peer {}: {e}{more}", p.from));
            }
            End::TimedOut => {
                self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                let ms = self.limits.deadline.as_millis();
                self.quiet.warn(|more| {
                    tracing::warn!(
                        "{name}: dropped tcp peer {}: no complete handshake within {ms} ms{more}",
                        p.from
                    )
                });
            }
        }
    }

    /// How many connections may linger: what the cap on waiting connections leaves, so the
    /// descriptors the wall holds stay within that one cap (past it, one turned away is
    /// closed at once: its peer may see a reset, which it takes for "busy" too).
    fn linger_room(&self) -> usize {
        self.limits.max_pending.saturating_sub(self.pending.len())
    }

    /// Takes in every connection the listener has; false when the transport is stopping.
    fn accept(&mut self, listener: &TcpListener, stopping: &AtomicBool) -> bool {
        loop {
            let (stream, from) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) if stopping.load(Ordering::Acquire) => return false,
                Err(e) => {
                    // Out of descriptors, say: back off rather than spin.
                    tracing::warn!("{}: tcp accept failed: {e}", self.log_name);
                    std::thread::sleep(Duration::from_millis(10));
                    return true;
                }
            };
            self.newcomer(stream, from);
        }
    }

    /// A new connection: it waits for admission, taking another's place or turned away if
    /// the wall is full ([`make_room`]).
    fn newcomer(&mut self, stream: TcpStream, from: SocketAddr) {
        let ip = from.ip();
        let known = &self.known;
        let waiting: Vec<Waiting> = self
            .pending
            .iter()
            .map(|p| Waiting {
                ip: p.from.ip(),
                accepted: p.accepted,
                known: known.contains(&p.from.ip()),
            })
            .collect();
        let room = make_room(
            &waiting,
            &self.per_source,
            ip,
            known.contains(&ip),
            &self.limits,
            Instant::now(),
        );
        match room {
            Room::Free => {}
            Room::Take(i) => {
                let p = self.pending.swap_remove(i);
                release(&mut self.per_source, p.from.ip());
                self.stats.over_cap.fetch_add(1, Ordering::Relaxed);
                let room = self.linger_room();
                turn_away(p.stream, &busy_record(), &mut self.closing, room);
            }
            Room::Busy => {
                self.stats.over_cap.fetch_add(1, Ordering::Relaxed);
                if self
                    .last_cap_warning
                    .is_none_or(|t| t.elapsed() > Duration::from_secs(5))
                {
                    tracing::warn!(
                        "{}: turned tcp peer {from} away: {} connections wait for admission ({} from its address; caps {} and {}); it may try again",
                        self.log_name,
                        self.pending.len(),
                        self.per_source.get(&ip).copied().unwrap_or(0),
                        self.limits.max_pending,
                        self.limits.max_per_source
                    );
                    self.last_cap_warning = Some(Instant::now());
                }
                let room = self.linger_room();
                turn_away(stream, &busy_record(), &mut self.closing, room);
                return;
            }
        }
        let Ok(n) = nonce() else {
            return;
        };
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let now = Instant::now();
        let mut p = Pending {
            stream,
            from,
            accepted: now,
            deadline: now + self.limits.deadline,
            hs: Handshake::new(Side::Accept, self.local.clone(), n),
        };
        // Our hello fits any fresh socket buffer; what does not goes out on POLLOUT.
        let _ = flush(&mut p);
        *self.per_source.entry(ip).or_default() += 1;
        self.pending.push(p);
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

/// Says `words` to a connection turned away (as far as its socket takes them at once), ends
/// our side of it, and keeps it draining for [`LINGER`] (while fewer than `cap` linger;
/// past that it is closed at once).
fn turn_away(stream: TcpStream, words: &[u8], closing: &mut Vec<Closing>, cap: usize) {
    let _ = stream.set_nonblocking(true);
    let _ = (&stream).write(words);
    let _ = stream.shutdown(Shutdown::Write);
    let mut stream = stream;
    if closing.len() < cap && drain(&mut stream) {
        closing.push(Closing {
            stream,
            until: Instant::now() + LINGER,
        });
    }
}

/// Reads and discards what a connection turned away has sent; false once it has closed (or
/// failed, or sent more than a handshake's worth: it is not listening).
fn drain(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    let mut total = 0;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                total += n;
                if total > 64 * 1024 {
                    return false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn limits() -> AdmitLimits {
        AdmitLimits {
            deadline: Duration::from_secs(5),
            max_pending: 4,
            max_per_source: 3,
        }
    }

    fn ip(i: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, i))
    }

    /// Connections from `sources` (ip, known), accepted a millisecond apart, `age` before `now`.
    fn wall(
        sources: &[(u8, bool)],
        now: Instant,
        age: Duration,
    ) -> (Vec<Waiting>, HashMap<IpAddr, usize>) {
        let mut per = HashMap::new();
        let w = sources
            .iter()
            .enumerate()
            .map(|(k, &(i, known))| {
                *per.entry(ip(i)).or_default() += 1;
                Waiting {
                    ip: ip(i),
                    accepted: now - age + Duration::from_millis(k as u64),
                    known,
                }
            })
            .collect();
        (w, per)
    }

    #[test]
    fn one_connection_from_each_of_many_addresses_gives_way_to_a_newcomer() {
        let now = Instant::now();
        let (w, per) = wall(
            &[(2, false), (3, false), (4, false), (5, false)],
            now,
            Duration::from_secs(1),
        );
        // An unknown newcomer takes the oldest unknown one's place once it has waited its grace.
        assert_eq!(
            make_room(&w, &per, ip(9), false, &limits(), now),
            Room::Take(0)
        );
        // A known one, too.
        assert_eq!(
            make_room(&w, &per, ip(1), true, &limits(), now),
            Room::Take(0)
        );
        // Within the grace, only a known newcomer gets in.
        let (w, per) = wall(
            &[(2, false), (3, false), (4, false), (5, false)],
            now,
            Duration::from_millis(10),
        );
        assert_eq!(
            make_room(&w, &per, ip(9), false, &limits(), now),
            Room::Busy
        );
        assert_eq!(
            make_room(&w, &per, ip(1), true, &limits(), now),
            Room::Take(0)
        );
    }

    #[test]
    fn known_addresses_keep_their_places_and_crowded_sources_give_way_first() {
        let now = Instant::now();
        let old = Duration::from_secs(1);
        // All waiting connections come from addresses that proved the token: an unknown
        // newcomer is turned away, a known one takes the oldest place.
        let (w, per) = wall(&[(2, true), (3, true), (4, true), (5, true)], now, old);
        assert_eq!(
            make_room(&w, &per, ip(9), false, &limits(), now),
            Room::Busy
        );
        assert_eq!(make_room(&w, &per, ip(9), true, &limits(), now), Room::Busy);
        // The unknown one among known ones is the one to go.
        let (w, per) = wall(&[(2, true), (3, false), (4, true), (5, true)], now, old);
        assert_eq!(
            make_room(&w, &per, ip(9), false, &limits(), now),
            Room::Take(1)
        );
        // A source with three waiting against the newcomer's none: its oldest goes, known or not.
        let (w, per) = wall(&[(5, true), (2, true), (2, true), (2, true)], now, old);
        assert_eq!(
            make_room(&w, &per, ip(9), false, &limits(), now),
            Room::Take(1)
        );
        // At its own cap a source is turned away, even with room.
        let (w, per) = wall(&[(2, false), (2, false), (2, false)], now, old);
        assert_eq!(make_room(&w, &per, ip(2), true, &limits(), now), Room::Busy);
        assert_eq!(
            make_room(&w, &per, ip(3), false, &limits(), now),
            Room::Free
        );
    }
}
