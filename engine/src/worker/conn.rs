//! The connections to the servers: the first attach when the worker joins, and with recovery
//! the reconnection to a server whose link dropped or that restarted from its checkpoint
//! (connect, answer the challenge, install the new keys, resume, send again what was in
//! flight).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use falcon_transport::{Completion, Link, LinkId, Transport};

use super::{Inner, Keys, lock};
use crate::auth::{self, Purpose};
use crate::config::JobConfig;
use crate::error::{Error, Result};
use crate::postoffice::{closed_why, time_left};
use crate::proto::{Book, Msg, ResumeShard, Role, ShardKeys};

/// Pause between attempts to reach a server that is down.
const RETRY: Duration = Duration::from_millis(200);

/// The connection to one server.
pub(super) struct ServerSlot {
    pub(super) state: Mutex<ServerConn>,
    /// Signalled when the link comes back or the server is gone for good.
    pub(super) changed: Condvar,
}

pub(super) struct ServerConn {
    /// The link in use; `None` while the server is unreachable.
    pub(super) link: Option<Link>,
    /// Where it listens: the book's address, or the one the scheduler announced last.
    addr: String,
    /// A reconnection under way: the new link, attached but not yet resumed.
    pub(super) joining: Option<Link>,
    /// No reconnection attempt before this.
    next_try: Instant,
    /// Set once it is gone for good (the job failed or ended).
    pub(super) gone: Option<Error>,
    /// This process rejoined the job and has not resumed on this server yet.
    rejoin: bool,
    /// Failed reconnection attempts in a row (every 15th is logged).
    attempts: u32,
    /// A reconnection attempt is under way on its own thread.
    connecting: bool,
}

/// Connects to every server in the book and knocks: the links, with the rank each reaches.
/// With recovery, a server that cannot be reached now (restarting from its checkpoint) is
/// reached later: the progress thread reattaches when the scheduler announces it.
pub(super) fn connect_servers(t: &Transport, book: &Book) -> Result<Vec<(usize, Link)>> {
    let mut links = Vec::new();
    for (r, addr) in book.servers.iter().enumerate() {
        let peer = addr
            .parse()
            .map_err(|e| Error::Config(format!("server {r} address {addr:?}: {e}")))?;
        tracing::debug!("worker {}: connecting to server {r} at {addr}", book.rank);
        match t.connect(&peer).and_then(|link| {
            link.send(&Msg::Knock.encode())?;
            Ok(link)
        }) {
            Ok(link) => links.push((r, link)),
            Err(e) if book.recovery => {
                tracing::warn!("worker {}: server {r} unreachable for now: {e}", book.rank);
            }
            Err(e) => {
                return Err(Error::PeerGone {
                    role: "server",
                    rank: r as u32,
                    why: e.to_string(),
                });
            }
        }
    }
    Ok(links)
}

/// What the servers reached sent while this worker attached.
pub(super) struct Attached {
    /// Their shards' keys, by shard id.
    pub(super) keys: HashMap<u32, ShardKeys>,
    /// The clock this worker starts at (a rejoining worker's is the job's current one).
    pub(super) start: u64,
    /// The links attached, with the rank each reaches (with recovery, a server that died while
    /// this worker attached is left out: it is reached again when the scheduler announces it).
    pub(super) links: Vec<(usize, Link)>,
}

/// The first attach to the servers reached, in progress.
struct Attaching<'a> {
    book: &'a Book,
    token: &'a str,
    links: Vec<(usize, Link)>,
    /// Per link: it answered its server's challenge; its server sent its keys; (rejoining)
    /// its server agreed to resume; the link failed (with recovery: left out).
    attached: Vec<bool>,
    got: Vec<bool>,
    resumed: Vec<bool>,
    down: Vec<bool>,
    keys: HashMap<u32, ShardKeys>,
    /// Where a rejoining worker starts, once known.
    start: Option<u64>,
}

impl Attaching<'_> {
    fn up(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.links.len()).filter(|&i| !self.down[i])
    }

    fn done(&self) -> bool {
        self.up()
            .all(|i| self.got[i] && (!self.book.rejoin || self.resumed[i]))
    }

    fn all_keys(&self) -> bool {
        self.up().all(|i| self.got[i])
    }

    /// Link `i` failed: with recovery its server is left for the reattachment (as if it had
    /// been unreachable), unless no server is left; else the join fails.
    fn failed(&mut self, i: usize, why: String) -> Result<()> {
        let r = self.links[i].0;
        let gone = Error::PeerGone {
            role: "server",
            rank: r as u32,
            why: format!("failed while attaching to the servers: {why}"),
        };
        self.down[i] = true;
        if !self.book.recovery || self.up().next().is_none() {
            return Err(gone);
        }
        tracing::warn!(
            "worker {}: server {r} failed while attaching ({why}); reattaching when it is back",
            self.book.rank
        );
        Ok(())
    }

    /// A rejoining worker with every server's keys: it starts at the current clock, the
    /// furthest any server reports (so no shard sees it go back), and tells every server so.
    fn resume_all(&mut self) -> Result<()> {
        let reached: Vec<usize> = self.up().map(|i| self.links[i].0).collect();
        let c = self
            .keys
            .values()
            .filter(|k| {
                self.book
                    .keymap
                    .shards
                    .iter()
                    .any(|sp| sp.id == k.shard && reached.contains(&(sp.server as usize)))
            })
            .map(|k| k.clock)
            .max()
            .unwrap_or(0);
        self.start = Some(c);
        for i in self.up().collect::<Vec<_>>() {
            let (r, l) = &self.links[i];
            let shards = self
                .book
                .keymap
                .shards
                .iter()
                .filter(|sp| sp.server as usize == *r)
                .map(|sp| ResumeShard {
                    shard: sp.id,
                    pushes: c,
                    helps: 0,
                })
                .collect();
            let sent = l.send(
                &Msg::Resume {
                    rejoin: true,
                    shards,
                }
                .encode(),
            );
            if let Err(e) = sent {
                self.failed(i, e.to_string())?;
            }
        }
        tracing::info!("worker {}: rejoining the job at clock {c}", self.book.rank);
        Ok(())
    }

    /// A message from the server behind `self.links[i]`.
    fn on_message(&mut self, i: usize, data: &[u8]) -> Result<()> {
        let r = self.links[i].0;
        match Msg::decode(data)? {
            Msg::Challenge { nonce } if !self.attached[i] => {
                let sent = self.links[i].1.send(
                    &Msg::Attach {
                        rank: self.book.rank,
                        proof: auth::answer(self.token, Purpose::Attach, &nonce),
                    }
                    .encode(),
                );
                if let Err(e) = sent {
                    return self.failed(i, e.to_string());
                }
                self.attached[i] = true;
                tracing::debug!(
                    "worker {}: attached to server {r} over {}",
                    self.book.rank,
                    self.links[i].1.medium()
                );
            }
            Msg::Keys { shards } => {
                for k in shards {
                    self.keys.insert(k.shard, k);
                }
                self.got[i] = true;
            }
            Msg::Resumed { .. } => self.resumed[i] = true,
            Msg::Failed { reason, .. } => {
                return Err(Error::Server {
                    rank: r as u32,
                    reason,
                });
            }
            other => tracing::debug!("worker: ignoring {other:?} from server {r}"),
        }
        Ok(())
    }
}

/// Attaches to the servers reached: each challenges its new link, the attach answers it, and
/// the server sends its shards' keys (servers answer in any order). A worker rejoining a
/// running job then tells every server where it starts, and waits for each to agree. With
/// recovery, a server that dies meanwhile is left out (see [`Attached::links`]).
pub(super) fn attach(
    t: &Transport,
    cfg: &JobConfig,
    book: &Book,
    links: Vec<(usize, Link)>,
) -> Result<Attached> {
    let n = links.len();
    let mut a = Attaching {
        book,
        token: &cfg.token,
        links,
        attached: vec![false; n],
        got: vec![false; n],
        resumed: vec![false; n],
        down: vec![false; n],
        keys: HashMap::new(),
        start: None,
    };
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    while !a.done() {
        if book.rejoin && a.start.is_none() && a.all_keys() {
            a.resume_all()?;
            continue;
        }
        let left = time_left(deadline, "attaching to the servers", cfg.rendezvous_timeout)?;
        match t.cq().wait(Some(left)) {
            Ok(Completion::Message { link, data }) => {
                if let Some(i) = a.links.iter().position(|(_, l)| l.id() == link)
                    && !a.down[i]
                {
                    a.on_message(i, &data)?;
                }
            }
            Ok(Completion::Closed { link, error }) => {
                match a.links.iter().position(|(_, l)| l.id() == link) {
                    Some(i) if !a.down[i] => a.failed(i, closed_why(&error))?,
                    Some(_) => {}
                    None => {
                        return Err(Error::PeerGone {
                            role: "scheduler",
                            rank: 0,
                            why: format!(
                                "closed while attaching to the servers: {}",
                                closed_why(&error)
                            ),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    let mut links = Vec::new();
    for (i, (r, l)) in a.links.into_iter().enumerate() {
        if a.down[i] {
            l.close();
        } else {
            links.push((r, l));
        }
    }
    Ok(Attached {
        keys: a.keys,
        start: a.start.unwrap_or(0),
        links,
    })
}

/// The connection slot of every server in the book: the links reached, the others down (a
/// rejoining worker not yet resumed on one tells it so when it is).
pub(super) fn server_slots(book: &Book, links: Vec<(usize, Link)>) -> Vec<ServerSlot> {
    let mut links: HashMap<usize, Link> = links.into_iter().collect();
    book.servers
        .iter()
        .enumerate()
        .map(|(r, addr)| {
            let link = links.remove(&r);
            ServerSlot {
                state: Mutex::new(ServerConn {
                    rejoin: book.rejoin && link.is_none(),
                    link,
                    addr: addr.clone(),
                    joining: None,
                    next_try: Instant::now(),
                    gone: None,
                    attempts: 0,
                    connecting: false,
                }),
                changed: Condvar::new(),
            }
        })
        .collect()
}

impl Inner {
    /// The link to server `r` if it is up.
    pub(super) fn up_link(&self, r: usize) -> Option<Link> {
        lock(&self.servers[r].state).link.clone()
    }

    /// The link to server `r`; with recovery, waits (up to the recovery timeout) while the
    /// server is down.
    pub(super) fn link(&self, r: usize) -> Result<Link> {
        let slot = &self.servers[r];
        let deadline = Instant::now() + self.recovery_wait;
        let mut st = lock(&slot.state);
        loop {
            if let Some(e) = &st.gone {
                return Err(e.clone());
            }
            if let Some(l) = &st.link {
                return Ok(l.clone());
            }
            if !self.book.recovery {
                return Err(Error::PeerGone {
                    role: "server",
                    rank: r as u32,
                    why: "its link is closed".into(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(
                    "waiting for a server to come back",
                    self.recovery_wait,
                ));
            }
            st = slot
                .changed
                .wait_timeout(st, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Every server is gone for good: operations waiting for a link fail with `err`, and so
    /// does every later one.
    pub(super) fn servers_gone(&self, err: &Error) {
        for slot in &self.servers {
            let mut st = lock(&slot.state);
            if st.gone.is_none() {
                st.gone = Some(err.clone());
            }
            slot.changed.notify_all();
        }
    }

    /// Closes every server link, those in use and those reattaching.
    pub(super) fn close_servers(&self) {
        for slot in &self.servers {
            let st = lock(&slot.state);
            for l in st.link.iter().chain(st.joining.iter()) {
                l.close();
            }
        }
    }

    /// Server `r` is unreachable: operations wait, and the progress thread reconnects.
    pub(super) fn server_down(&self, r: usize) {
        let mut st = lock(&self.servers[r].state);
        if let Some(l) = st.link.take() {
            l.close();
        }
        st.next_try = Instant::now();
    }

    /// The scheduler declared server `r` dead (with recovery): it may only be paused, so
    /// this worker never reattaches to that incarnation; the scheduler announces its
    /// successor ([`Inner::on_server_back`]).
    pub(super) fn on_server_dead(&self, r: usize) {
        tracing::warn!("worker: server {r} died; waiting for its restart");
        self.server_down(r);
        lock(&self.servers[r].state).next_try =
            Instant::now() + Duration::from_secs(365 * 24 * 3600);
    }

    /// Server `r` restarted at `addr`: reattach there (dropping any attempt on the old one).
    pub(super) fn on_server_back(&self, r: usize, addr: String) {
        tracing::info!("worker: server {r} restarted at {addr}; reattaching");
        let mut st = lock(&self.servers[r].state);
        st.addr = addr;
        st.next_try = Instant::now();
        if let Some(j) = st.joining.take() {
            j.close();
        }
    }

    /// The server whose link in use is `link`, if any.
    pub(super) fn server_of(&self, link: LinkId) -> Option<usize> {
        (0..self.servers.len()).find(|&r| self.up_link(r).is_some_and(|l| l.id() == link))
    }

    /// The server whose reconnection `link` is, if any.
    pub(super) fn joining_server(&self, link: LinkId) -> Option<usize> {
        (0..self.servers.len()).find(|&r| {
            lock(&self.servers[r].state)
                .joining
                .as_ref()
                .is_some_and(|l| l.id() == link)
        })
    }

    /// Starts a reconnection to every server that is down and due for an attempt: connect and
    /// knock on a thread of its own (a host that drops packets would hold a connect for the
    /// handshake deadline, and the progress thread must never wait on one peer);
    /// [`Inner::reattach_step`] carries it on.
    pub(super) fn reconnect(self: &Arc<Self>) {
        for (r, slot) in self.servers.iter().enumerate() {
            let addr = {
                let mut st = lock(&slot.state);
                if st.link.is_some()
                    || st.joining.is_some()
                    || st.connecting
                    || st.gone.is_some()
                    || Instant::now() < st.next_try
                {
                    continue;
                }
                st.connecting = true;
                st.addr.clone()
            };
            let w = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name(format!("falcon-reconnect-{r}"))
                .spawn(move || {
                    if let Some(w) = w.upgrade() {
                        w.connect_to(r, &addr);
                    }
                });
            if let Err(e) = spawned {
                let mut st = lock(&slot.state);
                st.connecting = false;
                st.next_try = Instant::now() + RETRY;
                tracing::warn!(
                    "worker {}: cannot start a reconnection: {e}",
                    self.book.rank
                );
            }
        }
    }

    /// One reconnection attempt to server `r` at `addr` (on its own thread).
    fn connect_to(&self, r: usize, addr: &str) {
        let attempt = addr
            .parse()
            .map_err(|e| format!("address {addr:?}: {e}"))
            .and_then(|peer| self.t.connect(&peer).map_err(|e| e.to_string()));
        let slot = &self.servers[r];
        let mut st = lock(&slot.state);
        st.connecting = false;
        match attempt {
            // Still wanted, and still the address the scheduler gave last (a successor
            // announced meanwhile must not be shadowed by its predecessor).
            Ok(l)
                if st.link.is_none()
                    && st.joining.is_none()
                    && st.gone.is_none()
                    && st.addr == addr =>
            {
                st.attempts = 0;
                // Known as this server's reconnection before the server can answer it.
                st.joining = Some(l.clone());
                drop(st);
                if let Err(e) = l.send(&Msg::Knock.encode()) {
                    let mut st = lock(&slot.state);
                    if st.joining.as_ref().is_some_and(|j| j.id() == l.id()) {
                        st.joining = None;
                        st.next_try = Instant::now() + RETRY;
                    }
                    drop(st);
                    tracing::debug!("worker: knocking on server {r} failed: {e}");
                    l.close();
                }
            }
            Ok(l) => {
                st.next_try = Instant::now();
                drop(st);
                l.close();
            }
            Err(e) => {
                st.attempts += 1;
                if st.attempts % 15 == 1 {
                    tracing::warn!(
                        "worker {}: server {r} at {addr} not reachable yet (attempt {}): {e}",
                        self.book.rank,
                        st.attempts
                    );
                }
                st.next_try = Instant::now() + RETRY;
            }
        }
    }

    /// The reconnection to server `r` closed before it resumed: try again later.
    pub(super) fn reattach_failed(&self, r: usize, error: &Option<falcon_transport::Error>) {
        tracing::debug!(
            "worker: reattaching to server {r} failed: {}",
            closed_why(error)
        );
        let mut st = lock(&self.servers[r].state);
        st.joining = None;
        st.next_try = Instant::now() + RETRY;
    }

    /// One step of a reattachment to server `r`: answer its challenge, install its keys and
    /// tell it what was acknowledged, then (resumed) put the link in use and resend.
    pub(super) fn reattach_step(&self, r: usize, data: &[u8]) {
        let Some(link) = lock(&self.servers[r].state).joining.clone() else {
            return;
        };
        match Msg::decode(data) {
            Ok(Msg::Challenge { nonce }) => {
                let _ = link.send(
                    &Msg::Attach {
                        rank: self.book.rank,
                        proof: auth::answer(&self.token, Purpose::Attach, &nonce),
                    }
                    .encode(),
                );
            }
            Ok(Msg::Keys { shards }) => self.reattach_keys(r, &link, &shards),
            Ok(Msg::Resumed { lost }) => self.reattached(r, link, lost),
            Ok(Msg::Failed { what, reason }) => {
                self.fail_all(
                    Role::Server,
                    r as u32,
                    &format!("refused the reattachment ({what}): {reason}"),
                );
            }
            Ok(other) => tracing::debug!("worker: ignoring {other:?} while reattaching to {r}"),
            Err(e) => tracing::warn!("worker: reattaching to server {r}: {e}"),
        }
    }

    /// Server `r`'s keys on the reattaching `link`: install them, and tell the server what
    /// it acknowledged (what it must still have).
    fn reattach_keys(&self, r: usize, link: &Link, shards: &[ShardKeys]) {
        for k in shards {
            let Some(s) = self.shards.iter().find(|s| s.spec.id == k.shard) else {
                continue;
            };
            match Keys::from_wire(k) {
                Ok(keys) => *s.keys.write().unwrap_or_else(|p| p.into_inner()) = Some(keys),
                Err(e) => tracing::warn!("worker: server {r} sent a bad key: {e}"),
            }
        }
        let core = lock(&self.core);
        let resume = self
            .shards
            .iter()
            .filter(|s| s.server == r)
            .map(|s| ResumeShard {
                shard: s.spec.id,
                pushes: core.shard(s.index).acked[0],
                helps: core.shard(s.index).acked[1],
            })
            .collect();
        drop(core);
        let rejoin = lock(&self.servers[r].state).rejoin;
        let _ = link.send(
            &Msg::Resume {
                rejoin,
                shards: resume,
            }
            .encode(),
        );
    }

    /// Server `r` resumed on `link` (`lost`: acknowledged updates it no longer has): the link
    /// goes in use, and what was in flight goes out again.
    fn reattached(&self, r: usize, link: Link, lost: u64) {
        {
            let slot = &self.servers[r];
            let mut st = lock(&slot.state);
            st.joining = None;
            st.rejoin = false;
            st.link = Some(link);
            slot.changed.notify_all();
        }
        {
            let mut core = lock(&self.core);
            let stats = core.stats_mut();
            stats.reconnects += 1;
            stats.lost_updates += lost;
        }
        tracing::info!(
            "worker {}: reattached to server {r} ({lost} acknowledged updates lost)",
            self.book.rank
        );
        self.forget_old_grants();
        self.resync(r);
    }
}
