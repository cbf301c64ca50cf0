//! The tcp medium: framed messages on one TCP connection per peer pair.
//!
//! A one-sided write is a [`FrameHeader`] and its payload sent with one vectored write from the
//! source region; the receiver's progress thread validates the header, then reads the payload
//! from the socket straight into the target region — no staging buffer. A read is a request
//! answered by the peer's responder thread, whose payload lands straight in the destination.
//! Read responses go out on their own thread so two progress threads can never deadlock
//! writing to each other.
//!
//! A link may have more connections than its first (its *lanes*, `TransportConfig::
//! tcp_streams`): the side that connected opens them after its handshake, each with its own
//! handshake, and binds them to the link by a key announced on the first connection. A write
//! or read answer of [`SPLIT_FROM`] bytes or more is then cut into one piece per connection,
//! sent at once from the calling thread and the process's helper threads
//! ([`crate::spread`]): one TCP stream is bound by the one core that copies into it and runs
//! its protocol, two streams use two. The first piece keeps the first connection's order;
//! the receiver delivers a split write's completion only once its other pieces have landed,
//! and completes a split read when all its pieces have.

use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use zerocopy::{FromBytes, IntoBytes};

use crate::cq::{Completion, CompletionQueue, LinkId, Spin, lock, spin_for};
use crate::error::{Error, Result, check_bounds};
use crate::handshake::{Handshake, Local, Side};
use crate::region::Region;
use crate::state::LinkState;
use crate::wire::{
    FLAG_IMM, FRAME_HEADER, FrameHeader, MAX_LANES, Op, parts_flags, parts_of, piece, piece_index,
};

/// Longest reason text an Error frame may carry.
const MAX_ERROR_TEXT: u64 = 64 * 1024;

/// Writes and read answers of this many bytes or more are split over a link's connections.
/// At 1 MiB over loopback two streams moved a message in 0.10 ms against one stream's 0.25.
pub(crate) const SPLIT_FROM: u64 = 256 << 10;

/// Payloads sent split over several connections so far (see [`split_sends`]).
static SPLIT_SENDS: AtomicU64 = AtomicU64::new(0);

/// How many writes and read answers this process has sent split over a tcp link's
/// connections, for tests and diagnostics.
pub fn split_sends() -> u64 {
    SPLIT_SENDS.load(Ordering::Relaxed)
}

/// Most split writes whose other pieces a link holds count of at once (a peer announcing more
/// is malformed).
const MAX_OPEN_SPLITS: usize = 4096;

/// The links whose other connections may still join, by the connecting peer's node and the
/// key it announced.
#[derive(Clone, Default)]
pub(crate) struct LaneRegistry(Arc<Mutex<LaneKeys>>);

/// (the peer's node id, the key it announced) → the link.
type LaneKeys = HashMap<(u64, u64), Weak<Shared>>;

impl std::fmt::Debug for LaneRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LaneRegistry")
    }
}

impl LaneRegistry {
    fn register(&self, node: u64, key: u64, link: &Arc<Shared>) -> Result<()> {
        let mut m = lock(&self.0);
        m.retain(|_, l| l.strong_count() > 0);
        if m.contains_key(&(node, key)) {
            return Err(Error::Malformed("a lane key announced twice".into()));
        }
        m.insert((node, key), Arc::downgrade(link));
        Ok(())
    }

    fn find(&self, node: u64, key: u64) -> Option<Arc<Shared>> {
        lock(&self.0).get(&(node, key)).and_then(Weak::upgrade)
    }
}

/// Settings a tcp link needs.
#[derive(Clone, Debug)]
pub(crate) struct TcpSettings {
    pub(crate) job: u64,
    pub(crate) node: u64,
    pub(crate) op_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_message: u64,
    /// How long a hand-off between threads spins before it parks.
    pub(crate) spin: Spin,
    /// The job token the handshake proves (empty: none).
    pub(crate) token: Arc<[u8]>,
    /// Links whose peer's other connections may join (shared by the transport's links).
    pub(crate) registry: LaneRegistry,
}

impl TcpSettings {
    /// What this end says of itself in a handshake.
    pub(crate) fn local(&self, ask: u32) -> Local {
        Local {
            job: self.job,
            node: self.node,
            ask,
            token: self.token.clone(),
        }
    }
}

/// Receives from `rx`: a bounded spin (see [`spin_for`]), then a parked wait.
fn recv_spinning<T>(
    rx: &Receiver<T>,
    spin: &Spin,
    timeout: Option<Duration>,
) -> Result<T, crossbeam_channel::RecvTimeoutError> {
    let start = std::time::Instant::now();
    let mut gone = false;
    let got = spin_for(spin.get(), || match rx.try_recv() {
        Ok(v) => Some(v),
        Err(crossbeam_channel::TryRecvError::Disconnected) => {
            gone = true;
            None
        }
        Err(crossbeam_channel::TryRecvError::Empty) => None,
    });
    if let Some(v) = got {
        return Ok(v);
    }
    if gone {
        return Err(crossbeam_channel::RecvTimeoutError::Disconnected);
    }
    match timeout {
        Some(t) => rx.recv_timeout(t.saturating_sub(start.elapsed())),
        None => rx
            .recv()
            .map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
    }
}

/// A raw pointer into a region, for a read in flight.
struct Dst(*mut u8);
// SAFETY: the pointer targets a region kept alive by `PendingRead::_region` (and, for a piece
// of a split answer, by the clone of it the landing thread holds); each byte is written by
// one thread, the one that took the whole answer or claimed the piece.
unsafe impl Send for Dst {}

struct PendingRead {
    dst: Dst,
    len: u64,
    _region: Region,
    done: Sender<Result<()>>,
    /// A split answer: its piece count (0 until the first piece), the pieces claimed by a
    /// receiving thread (a bit each) and those landed.
    parts: u32,
    claimed: u32,
    landed: u32,
}

enum Reply {
    Data {
        req: u64,
        region: Region,
        offset: u64,
        len: u64,
    },
    Refuse {
        req: u64,
        reason: String,
    },
}

struct Shared {
    st: LinkState,
    cq: CompletionQueue,
    grants: RwLock<HashMap<u64, Region>>,
    pending: Mutex<HashMap<u64, PendingRead>>,
    next_req: AtomicU64,
    /// Set by the progress thread when the kernel timed the connection out (TCP_USER_TIMEOUT
    /// on a peer that stopped reading, or failed keepalives). The progress thread usually
    /// takes that error from the socket first, leaving a blocked sender only `EPIPE`.
    timed_out: AtomicBool,
    /// Runs before `Closed` is delivered (an RDMA link drains its queue pair here, so every
    /// completion the peer caused precedes the closure).
    before_close: Option<Box<dyn Fn() + Send + Sync>>,
    /// The peer's node id.
    peer_node: u64,
    op_timeout: Duration,
    /// The link's other connections' writers (lane k is connection k + 1).
    lanes: RwLock<Vec<Arc<Mutex<TcpStream>>>>,
    /// Every connection of the link, to shut them all down.
    streams: Mutex<Vec<TcpStream>>,
    /// Pieces of split writes landed on other connections, by split id, and their waiter.
    parts: Mutex<HashMap<u64, u32>>,
    parts_cv: Condvar,
    next_split: AtomicU64,
    /// Whether the reader of one of the other connections has ended.
    lane_ended: AtomicBool,
    /// Where the peer's lanes find this link (the accepting side, once announced).
    registry: LaneRegistry,
    announced: AtomicBool,
}

impl Shared {
    /// Shuts every connection of the link down and wakes whoever waits on it.
    fn shut_all(&self) {
        for s in lock(&self.streams).iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        self.parts_cv.notify_all();
    }

    /// Fails the link from a lane: the first connection's reader then ends the link.
    fn fail_from_lane(&self, e: Error) {
        if !self.closing.load(Ordering::Acquire) {
            tracing::warn!(link = self.id, peer = %self.peer, "tcp link failed on one of its connections: {e}");
            self.record(e);
        }
        self.shut_all();
    }

    /// The other connections a large payload is split over now: one per helper thread at
    /// most, since each piece needs a thread sending it at the same time. With no helper (a
    /// host whose every core has a busy process) nothing is split: pieces sent one after
    /// another only add hand-offs (2 workers × 2 servers on 2 cores ran 10–25 % slower).
    fn sending_lanes(&self) -> Vec<Arc<Mutex<TcpStream>>> {
        let lanes = self.lanes.read().unwrap_or_else(|p| p.into_inner());
        lanes[..lanes.len().min(crate::spread::helpers())].to_vec()
    }

    /// Adds a connection of the link (its handshake done) and starts reading it.
    fn attach_lane(self: &Arc<Self>, stream: TcpStream) -> Result<()> {
        let clone = |s: &TcpStream| s.try_clone().map_err(|e| Error::io("clone tcp socket", e));
        let mut lanes = self.lanes.write().unwrap_or_else(|p| p.into_inner());
        if lanes.len() + 1 >= MAX_LANES as usize {
            return Err(Error::Malformed(format!(
                "more than {MAX_LANES} connections for one link"
            )));
        }
        {
            // Under the lock `shut_all` takes: a link closing or failed gets no more.
            let mut streams = lock(&self.streams);
            self.check_open()?;
            if self.closing.load(Ordering::Acquire) || lock(&self.failure).is_some() {
                return Err(Error::Closed {
                    peer: self.peer.clone(),
                    reason: "closing".into(),
                });
            }
            streams.push(clone(&stream)?);
        }
        let reader = clone(&stream)?;
        let shared = self.clone();
        std::thread::Builder::new()
            .name(format!("falcon-tcp-lane-{}", self.id))
            .spawn(move || lane_loop(reader, shared))
            .map_err(|e| Error::io("spawn tcp lane thread", e))?;
        lanes.push(Arc::new(Mutex::new(stream)));
        Ok(())
    }
}

impl std::ops::Deref for Shared {
    type Target = LinkState;
    fn deref(&self) -> &LinkState {
        &self.st
    }
}

/// A frame about to go out: its header and its payload.
pub(crate) struct Frame<'a> {
    header: FrameHeader,
    payload: &'a [u8],
}

impl<'a> Frame<'a> {
    /// A control message.
    pub(crate) fn send(data: &'a [u8]) -> Self {
        let mut header = FrameHeader::new(Op::Send);
        header.len = (data.len() as u64).into();
        Frame {
            header,
            payload: data,
        }
    }

    /// A one-sided write of `payload` into the peer's region `region` from `offset`.
    pub(crate) fn write(payload: &'a [u8], region: u64, offset: u64, imm: Option<u32>) -> Self {
        let mut header = FrameHeader::new(Op::Write);
        header.region = region.into();
        header.offset = offset.into();
        header.len = (payload.len() as u64).into();
        if let Some(imm) = imm {
            header.imm = imm.into();
            header.flags = FLAG_IMM.into();
        }
        Frame { header, payload }
    }
}

/// The I/O slices of `frames`, headers and payloads in order, for one vectored write.
fn slices<'a>(frames: &'a [Frame<'a>]) -> Vec<IoSlice<'a>> {
    frames
        .iter()
        .flat_map(|f| [IoSlice::new(f.header.as_bytes()), IoSlice::new(f.payload)])
        .collect()
}

/// `payload` cut into `parts` pieces (see [`piece`]): (index, offset, bytes) each.
fn pieces(payload: &[u8], parts: u32) -> impl Iterator<Item = (u32, u64, &[u8])> {
    (0..parts).map(move |i| {
        let (at, n) = piece(payload.len() as u64, parts, i);
        (i, at, &payload[at as usize..(at + n) as usize])
    })
}

/// Runs `f(0)` … `f(n - 1)` at once, on this thread and the process's helper threads
/// ([`crate::spread`]), and returns the first error, once every call has returned.
fn at_once<E: Send>(
    n: usize,
    f: impl Fn(usize) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    let failed: Mutex<Option<E>> = Mutex::new(None);
    crate::spread::run(n, &|i| {
        if let Err(e) = f(i) {
            lock(&failed).get_or_insert(e);
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

pub(crate) struct TcpLink {
    shared: Arc<Shared>,
    writer: Arc<Mutex<TcpStream>>,
    stream: TcpStream,
    op_timeout: Duration,
    spin: Spin,
    pub(crate) peer_node: u64,
}

/// Reads exactly `buf.len()` bytes; distinguishes a clean EOF before the first byte.
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes every byte of `bufs` with vectored writes.
fn write_all_vectored(s: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        match s.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn tune(stream: &TcpStream, op_timeout: Duration) -> Result<()> {
    let sock = socket2::SockRef::from(stream);
    sock.set_tcp_nodelay(true)
        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
    // Detect a dead host (no FIN, no RST) within seconds: keepalive probes plus a bound on
    // unacknowledged data.
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(2))
        .with_interval(Duration::from_secs(1))
        .with_retries(3);
    sock.set_tcp_keepalive(&ka)
        .map_err(|e| Error::io("set TCP keepalive", e))?;
    sock.set_tcp_user_timeout(Some(op_timeout))
        .map_err(|e| Error::io("set TCP_USER_TIMEOUT", e))?;
    stream
        .set_write_timeout(Some(op_timeout))
        .map_err(|e| Error::io("set send timeout", e))?;
    Ok(())
}

/// `MSG_DONTWAIT`: a send that fails rather than waits for room.
fn dontwait() -> std::ffi::c_int {
    rustix::net::SendFlags::DONTWAIT.bits() as std::ffi::c_int
}

pub(crate) use crate::handshake::{HELLO_LANE, HELLO_RDMA, HELLO_TCP};

/// The accepting side of a lane (its handshake done): reads its [`Op::Bind`] frame under the
/// handshake deadline and joins it to the link the peer announced. The announcement may
/// still be on its way on the link's first connection: wait for it until the deadline.
pub(crate) fn bind_lane(mut stream: TcpStream, peer_node: u64, cfg: &TcpSettings) -> Result<()> {
    let deadline = Instant::now() + cfg.handshake_timeout;
    stream
        .set_read_timeout(Some(cfg.handshake_timeout))
        .map_err(|e| Error::io("set handshake timeout", e))?;
    let mut raw = [0u8; FRAME_HEADER];
    stream
        .read_exact(&mut raw)
        .map_err(|e| Error::io("read tcp lane binding", e))?;
    let (op, h) = FrameHeader::decode(&raw)?;
    if op != Op::Bind {
        return Err(Error::Malformed(format!(
            "a {} frame where a lane's binding belongs",
            op.name()
        )));
    }
    let key = h.req.get();
    loop {
        if let Some(link) = cfg.registry.find(peer_node, key) {
            established(&stream)?;
            return link.attach_lane(stream);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout(
                "tcp lane binding (no link announced its key)",
                cfg.handshake_timeout,
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The connecting side's handshake (see [`crate::handshake`]), under one deadline for the
/// whole exchange; returns the peer's node id and what it asked for (`HELLO_*`).
pub(crate) fn handshake(stream: &mut TcpStream, cfg: &TcpSettings, ask: u32) -> Result<(u64, u32)> {
    tune(stream, cfg.op_timeout)?;
    let deadline = std::time::Instant::now() + cfg.handshake_timeout;
    let timed_out = || Error::Timeout("tcp handshake", cfg.handshake_timeout);
    let left = || {
        let d = deadline.saturating_duration_since(std::time::Instant::now());
        if d.is_zero() { Err(timed_out()) } else { Ok(d) }
    };
    let mut hs = Handshake::new(Side::Connect, cfg.local(ask), crate::handshake::nonce()?);
    let mut heard: Vec<u8> = Vec::new();
    loop {
        while !hs.outgoing().is_empty() {
            stream
                .set_write_timeout(Some(left()?))
                .map_err(|e| Error::io("set handshake timeout", e))?;
            match stream.write(hs.outgoing()) {
                Ok(0) => {
                    return Err(Error::io(
                        "send tcp hello",
                        std::io::ErrorKind::WriteZero.into(),
                    ));
                }
                Ok(n) => hs.sent(n),
                Err(e) if is_reset(&e) => return Err(reset_busy(stream, &e)),
                Err(e) => handshake_io(e, "send tcp hello", &timed_out)?,
            }
        }
        if let Some(peer) = hs.finished() {
            stream
                .set_write_timeout(Some(cfg.op_timeout))
                .map_err(|e| Error::io("set send timeout", e))?;
            // An rdma link's queue-pair exchange follows on this stream under its own timeout.
            stream
                .set_read_timeout(Some(cfg.handshake_timeout))
                .map_err(|e| Error::io("set handshake timeout", e))?;
            return Ok((peer.node, peer.ask));
        }
        let want = hs.wants();
        let mut buf = [0u8; crate::handshake::MAX_RECORD];
        stream
            .set_read_timeout(Some(left()?))
            .map_err(|e| Error::io("set handshake timeout", e))?;
        match stream.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(Error::Closed {
                    peer: peer_name(stream),
                    reason: "closed during the handshake without a word (a falcon node that \
                             is stopping, or not a falcon node)"
                        .into(),
                });
            }
            Ok(n) => {
                if heard.len() < SEEN {
                    let k = n.min(SEEN - heard.len());
                    heard.extend_from_slice(&buf[..k]);
                }
                // Four bytes tell falcon from another program: no need to wait for more.
                if heard.len() >= 4 && heard[..4] != crate::wire::MAGIC.to_le_bytes() {
                    return Err(Error::NotFalcon {
                        peer: peer_name(stream),
                        seen: printable(&heard),
                    });
                }
                if let Err(e) = hs.receive(&buf[..n]) {
                    return Err(named(e, stream, &heard));
                }
            }
            Err(e) if is_reset(&e) => return Err(reset_busy(stream, &e)),
            Err(e) => handshake_io(e, "receive tcp hello", &timed_out)?,
        }
    }
}

fn is_reset(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
}

/// A reset during the handshake, before or after the peer's hello (a peer that refuses says
/// why; a foreign one is known by its first bytes): a wall that had to let us go, or a process
/// that died; the caller retries it as it retries a busy peer, until its deadline.
fn reset_busy(stream: &TcpStream, e: &std::io::Error) -> Error {
    Error::Busy {
        peer: peer_name(stream),
        why: format!("it reset the connection during the handshake ({e})"),
    }
}

/// How many of the peer's first bytes a handshake keeps, to say what a foreign peer sent.
const SEEN: usize = 48;

/// A handshake error with the peer named: a busy wall's answer gets its address, and bytes
/// that do not begin with falcon's magic mean the port is another program's.
fn named(e: Error, stream: &TcpStream, heard: &[u8]) -> Error {
    match e {
        Error::Busy { why, .. } => Error::Busy {
            peer: peer_name(stream),
            why,
        },
        Error::Malformed(_) | Error::Version { .. }
            if heard.len() >= 4 && heard[..4] != crate::wire::MAGIC.to_le_bytes() =>
        {
            Error::NotFalcon {
                peer: peer_name(stream),
                seen: printable(heard),
            }
        }
        other => other,
    }
}

/// Bytes as a quoted, printable excerpt: `"HTTP/1.1 400 Bad…"`.
fn printable(bytes: &[u8]) -> String {
    let text: String = bytes
        .iter()
        .map(|&b| match b {
            b' '..=b'~' => b as char,
            b'\r' | b'\n' | b'\t' => ' ',
            _ => '.',
        })
        .collect();
    format!("\"{}\"", text.trim_end())
}

/// An I/O error of the blocking handshake: an interruption is retried (Ok), a socket timeout
/// is the handshake's deadline, anything else is what it says.
fn handshake_io(
    e: std::io::Error,
    what: &'static str,
    timed_out: &dyn Fn() -> Error,
) -> Result<()> {
    match e.kind() {
        std::io::ErrorKind::Interrupted => Ok(()),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Err(timed_out()),
        _ => Err(Error::io(what, e)),
    }
}

/// Clears the handshake's read timeout once the connection is established.
pub(crate) fn established(stream: &TcpStream) -> Result<()> {
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::io("clear handshake timeout", e))
}

fn peer_name(s: &TcpStream) -> String {
    s.peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown tcp peer".into())
}

impl TcpLink {
    /// Wraps a connection whose handshake succeeded and starts its progress threads.
    pub(crate) fn start(
        id: LinkId,
        stream: TcpStream,
        peer_node: u64,
        cfg: &TcpSettings,
        cq: CompletionQueue,
    ) -> Result<TcpLink> {
        Self::start_with(id, stream, peer_node, cfg, cq, None, None)
    }

    /// As `start`, with a hook run before `Closed` is delivered, and a gate: when given, the
    /// link reads nothing (so delivers no completion) until the gate opens or its sender is
    /// dropped — an acceptor hands the link out first, so its first completion can never
    /// overtake it.
    pub(crate) fn start_with(
        id: LinkId,
        stream: TcpStream,
        peer_node: u64,
        cfg: &TcpSettings,
        cq: CompletionQueue,
        before_close: Option<Box<dyn Fn() + Send + Sync>>,
        gate: Option<Receiver<()>>,
    ) -> Result<TcpLink> {
        established(&stream)?;
        let peer = format!("tcp:{}", peer_name(&stream));
        let shared = Arc::new(Shared {
            st: LinkState::new(id, peer, cfg.max_message),
            cq,
            grants: RwLock::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            timed_out: AtomicBool::new(false),
            before_close,
            peer_node,
            op_timeout: cfg.op_timeout,
            lanes: RwLock::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
            parts: Mutex::new(HashMap::new()),
            parts_cv: Condvar::new(),
            next_split: AtomicU64::new(1),
            lane_ended: AtomicBool::new(false),
            registry: cfg.registry.clone(),
            announced: AtomicBool::new(false),
        });
        let clone = |s: &TcpStream| s.try_clone().map_err(|e| Error::io("clone tcp socket", e));
        lock(&shared.streams).push(clone(&stream)?);
        let writer = Arc::new(Mutex::new(clone(&stream)?));
        let (tx, rx) = crossbeam_channel::unbounded();
        {
            let (shared, writer, spin) = (shared.clone(), writer.clone(), cfg.spin.clone());
            std::thread::Builder::new()
                .name(format!("falcon-tcp-resp-{id}"))
                .spawn(move || respond_loop(rx, writer, shared, spin))
                .map_err(|e| Error::io("spawn tcp responder", e))?;
        }
        {
            let (shared, reader) = (shared.clone(), clone(&stream)?);
            std::thread::Builder::new()
                .name(format!("falcon-tcp-recv-{id}"))
                .spawn(move || {
                    if let Some(g) = gate {
                        let _ = g.recv();
                    }
                    recv_loop(reader, tx, shared)
                })
                .map_err(|e| Error::io("spawn tcp progress thread", e))?;
        }
        Ok(TcpLink {
            shared,
            writer,
            stream,
            op_timeout: cfg.op_timeout,
            spin: cfg.spin.clone(),
            peer_node,
        })
    }

    pub(crate) fn peer(&self) -> &str {
        &self.shared.peer
    }

    pub(crate) fn state(&self) -> &crate::state::LinkState {
        &self.shared.st
    }

    pub(crate) fn id(&self) -> LinkId {
        self.shared.id
    }

    pub(crate) fn is_open(&self) -> bool {
        self.shared.is_open()
    }

    fn check_open(&self) -> Result<()> {
        self.shared.check_open()
    }

    fn send_frame(&self, header: &FrameHeader, payload: &[u8]) -> Result<()> {
        self.send_frames(&mut [IoSlice::new(header.as_bytes()), IoSlice::new(payload)])
    }

    /// Sends whole frames (headers and payloads in order) in as few writes as the socket
    /// takes.
    fn send_frames(&self, bufs: &mut [IoSlice<'_>]) -> Result<()> {
        self.send_on(&self.writer, bufs)
    }

    /// Sends whole frames on one of the link's connections. A failure shuts that connection
    /// (a frame may be half-sent); on another connection than the first, the whole link.
    fn send_on(&self, writer: &Mutex<TcpStream>, bufs: &mut [IoSlice<'_>]) -> Result<()> {
        self.check_open()?;
        let mut w = lock(writer);
        write_all_vectored(&mut w, bufs).map_err(|e| {
            use std::io::ErrorKind as K;
            let err = if matches!(e.kind(), K::WouldBlock | K::TimedOut) {
                Error::Timeout("tcp send (peer not reading)", self.op_timeout)
            } else if matches!(
                e.kind(),
                K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted
            ) && self.kernel_timed_out()
            {
                Error::Timeout("tcp send (connection timed out)", self.op_timeout)
            } else {
                Error::Closed {
                    peer: self.shared.peer.clone(),
                    reason: format!("send failed: {e}"),
                }
            };
            // A frame may be half-sent: the stream is unusable now.
            let _ = w.shutdown(Shutdown::Both);
            if !std::ptr::eq(writer, &*self.writer) {
                self.shared.shut_all();
            }
            err
        })
    }

    /// Sends `frames` in order. Where the link has other connections, a write payload of
    /// [`SPLIT_FROM`] bytes or more is cut into a piece per connection: the first piece goes
    /// in its place on the first connection (flagged [`crate::wire::FLAG_PARTS`]), the others
    /// as [`Op::Part`] frames on the others, all sent at once (the calling thread and the
    /// process's helper threads, [`crate::spread`]). The frames before a split one are sent
    /// before its pieces, and those after it once every piece is sent, so every frame's bytes
    /// are read from memory after the one before, as separate calls would read them. Returns
    /// once every byte is sent.
    fn send_split(&self, frames: &[Frame<'_>]) -> Result<()> {
        let lanes = self.shared.sending_lanes();
        let big = |f: &Frame<'_>| {
            !lanes.is_empty()
                && f.header.op.get() == Op::Write as u16
                && f.payload.len() as u64 >= SPLIT_FROM
        };
        let whole = |frames: &[Frame<'_>]| self.send_frames(&mut slices(frames));
        let mut from = 0;
        for (k, f) in frames.iter().enumerate() {
            if !big(f) {
                continue;
            }
            if from < k {
                whole(&frames[from..k])?;
            }
            from = k + 1;
            self.send_pieces(f, &lanes)?;
        }
        if from < frames.len() {
            whole(&frames[from..])?;
        }
        Ok(())
    }

    /// Sends one write cut into a piece per connection (see [`TcpLink::send_split`]).
    fn send_pieces(&self, f: &Frame<'_>, lanes: &[Arc<Mutex<TcpStream>>]) -> Result<()> {
        let parts = lanes.len() as u32 + 1;
        let id = self.shared.next_split.fetch_add(1, Ordering::Relaxed);
        SPLIT_SENDS.fetch_add(1, Ordering::Relaxed);
        let frames: Vec<Frame<'_>> = pieces(f.payload, parts)
            .map(|(i, at, payload)| {
                let mut header = if i == 0 {
                    let mut h = f.header;
                    h.flags = parts_flags(f.header.flags.get() & FLAG_IMM != 0, parts).into();
                    h
                } else {
                    let mut h = FrameHeader::new(Op::Part);
                    h.region = f.header.region;
                    h.offset = (f.header.offset.get() + at).into();
                    h
                };
                header.len = (payload.len() as u64).into();
                header.req = id.into();
                Frame { header, payload }
            })
            .collect();
        at_once(frames.len(), |i| {
            let w = if i == 0 {
                &*self.writer
            } else {
                &*lanes[i - 1]
            };
            self.send_on(w, &mut slices(&frames[i..=i]))
        })
        .inspect_err(|_| self.shared.shut_all())
    }

    /// After a send found the connection gone: did the kernel time it out? The progress
    /// thread, woken by the same event, says so; give it a moment to.
    fn kernel_timed_out(&self) -> bool {
        let deadline = std::time::Instant::now() + self.op_timeout.min(Duration::from_secs(1));
        while self.shared.is_open()
            && !self.shared.timed_out.load(Ordering::Acquire)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.shared.timed_out.load(Ordering::Acquire)
    }

    pub(crate) fn send(&self, data: &[u8]) -> Result<()> {
        let f = Frame::send(data);
        self.send_frame(&f.header, f.payload)
    }

    /// Sends `frames` in order, in as few writes as the socket takes (one, mostly; large
    /// writes split over the link's connections, see [`TcpLink::send_split`]).
    pub(crate) fn send_all(&self, frames: &[Frame<'_>]) -> Result<()> {
        self.send_split(frames)
    }

    pub(crate) fn grant(&self, region: &Region) {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(region.id(), region.clone());
    }

    pub(crate) fn revoke(&self, region: &Region) {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&region.id());
    }

    pub(crate) fn write(
        &self,
        src: *const u8,
        len: u64,
        region: u64,
        offset: u64,
        imm: Option<u32>,
    ) -> Result<()> {
        // SAFETY: the caller bounds-checked [src, src+len) inside a live source region.
        let payload = unsafe { std::slice::from_raw_parts(src, len as usize) };
        self.send_split(&[Frame::write(payload, region, offset, imm)])
    }

    pub(crate) fn read(
        &self,
        dst: &Region,
        dst_ptr: *mut u8,
        len: u64,
        region: u64,
        offset: u64,
    ) -> Result<()> {
        let done = self.post_reads(&[(dst, dst_ptr, len, region, offset)])?;
        done.iter().try_for_each(|d| self.wait_read(d))
    }

    /// Sends read requests `(destination, where in it, bytes, peer region, offset)` in one
    /// write and returns what each completion arrives on, in order; the peer answers them in
    /// that order.
    pub(crate) fn post_reads(
        &self,
        reads: &[(&Region, *mut u8, u64, u64, u64)],
    ) -> Result<Vec<Receiver<Result<()>>>> {
        self.check_open()?;
        let mut done = Vec::with_capacity(reads.len());
        let mut headers = Vec::with_capacity(reads.len());
        let mut reqs = Vec::with_capacity(reads.len());
        {
            let mut pending = lock(&self.shared.pending);
            for &(dst, dst_ptr, len, region, offset) in reads {
                let req = self.shared.next_req.fetch_add(1, Ordering::Relaxed);
                let (done_tx, done_rx) = crossbeam_channel::bounded(1);
                pending.insert(
                    req,
                    PendingRead {
                        dst: Dst(dst_ptr),
                        len,
                        _region: dst.clone(),
                        done: done_tx,
                        parts: 0,
                        claimed: 0,
                        landed: 0,
                    },
                );
                let mut h = FrameHeader::new(Op::ReadReq);
                h.region = region.into();
                h.offset = offset.into();
                h.len = len.into();
                h.req = req.into();
                headers.push(h);
                reqs.push(req);
                done.push(done_rx);
            }
        }
        let mut bufs: Vec<IoSlice<'_>> =
            headers.iter().map(|h| IoSlice::new(h.as_bytes())).collect();
        if let Err(e) = self.send_frames(&mut bufs) {
            // Part of the batch may have gone out and been answered: a read the receiving
            // thread already took may be landing in its destination right now. Wait for
            // those (the failed send shut the socket, so they end soon); drop the rest.
            let taken: Vec<usize> = {
                let mut pending = lock(&self.shared.pending);
                reqs.iter()
                    .enumerate()
                    .filter(|&(_, req)| pending.remove(req).is_none())
                    .map(|(k, _)| k)
                    .collect()
            };
            for k in taken {
                let _ = self.wait_read(&done[k]);
            }
            return Err(e);
        }
        Ok(done)
    }

    /// Waits for a posted read: `Ok` once its bytes are in the destination.
    pub(crate) fn wait_read(&self, done: &Receiver<Result<()>>) -> Result<()> {
        match recv_spinning(done, &self.spin, Some(self.op_timeout)) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                // The progress thread may be writing into the destination right now, so the
                // link cannot be trusted any more: fail it, which also drops the entry.
                let err = Error::Timeout("tcp read", self.op_timeout);
                self.fail(err.clone());
                Err(err)
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                self.check_open().and(Err(Error::Closed {
                    peer: self.shared.peer.clone(),
                    reason: "closed during read".into(),
                }))
            }
        }
    }

    fn fail(&self, err: Error) {
        self.shared.record(err);
        self.shared.shut_all();
        self.shared.cq.wake_pushers();
    }

    /// A handle that fails this link from elsewhere (an RDMA queue pair in error).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn failer(&self) -> Result<impl Fn(Error) + Send + Sync + 'static> {
        let shared = self.shared.clone();
        let stream = self
            .stream
            .try_clone()
            .map_err(|e| Error::io("clone tcp socket", e))?;
        Ok(move |err: Error| {
            shared.record(err);
            shared.open.store(false, Ordering::Release);
            let _ = stream.shutdown(Shutdown::Both);
            shared.shut_all();
            shared.cq.wake_pushers();
        })
    }

    /// The connecting side: opens the link's other connections to `addr` (`lanes` in all,
    /// this one included), each with its own handshake, and binds them to the link. A
    /// connection that cannot be opened is logged and left out: the link works with fewer.
    pub(crate) fn open_lanes(&self, addr: SocketAddr, cfg: &TcpSettings, lanes: u32) {
        let lanes = lanes.min(MAX_LANES);
        if lanes < 2 {
            return;
        }
        let key = match crate::handshake::nonce() {
            Ok(n) => u64::from_le_bytes(n[..8].try_into().expect("a nonce has 8 bytes")),
            Err(e) => {
                tracing::debug!("no lanes for tcp link {}: {e}", self.id());
                return;
            }
        };
        let mut h = FrameHeader::new(Op::Lanes);
        h.req = key.into();
        h.imm = (lanes - 1).into();
        if self.send_frame(&h, &[]).is_err() {
            return;
        }
        for k in 1..lanes {
            let joined = (|| {
                let mut s =
                    TcpStream::connect_timeout(&addr, cfg.handshake_timeout).map_err(|e| {
                        Error::Unreachable {
                            medium: "tcp",
                            peer: addr.to_string(),
                            why: e.to_string(),
                        }
                    })?;
                let (node, _) = handshake(&mut s, cfg, HELLO_LANE)?;
                if node != self.peer_node {
                    return Err(Error::Malformed(format!(
                        "a lane reached node {node:#x}, not the link's peer {:#x}",
                        self.peer_node
                    )));
                }
                let mut b = FrameHeader::new(Op::Bind);
                b.req = key.into();
                b.imm = k.into();
                s.write_all(b.as_bytes())
                    .map_err(|e| Error::io("send tcp lane binding", e))?;
                established(&s)?;
                self.shared.attach_lane(s)
            })();
            if let Err(e) = joined {
                tracing::debug!(
                    "tcp link {} goes on with {k} connection(s): another could not join: {e}",
                    self.id()
                );
                return;
            }
        }
    }

    /// How many connections the link sends on (1: no lanes).
    pub(crate) fn connections(&self) -> usize {
        1 + self
            .shared
            .lanes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    pub(crate) fn close(&self) {
        if self.shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        // The goodbye goes out only if it can at once: a peer that stopped reading (paused,
        // cut off) must not hold a closing link for the send timeout. Another thread's send
        // blocked on such a peer holds the writer; the shutdown below ends that send.
        if self.is_open()
            && let Ok(w) = self.writer.try_lock()
        {
            let bye = FrameHeader::new(Op::Bye);
            let _ = socket2::SockRef::from(&*w).send_with_flags(bye.as_bytes(), dontwait());
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        self.shared.shut_all();
        // A reader waiting for room in the completion queue delivers what it holds and ends.
        self.shared.cq.wake_pushers();
    }

    /// Test hook: raw bytes onto the wire, as a broken peer would send them.
    pub(crate) fn send_raw(&self, bytes: &[u8]) -> Result<()> {
        let mut w = lock(&self.writer);
        w.write_all(bytes)
            .map_err(|e| Error::io("send raw bytes", e))
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        self.close();
    }
}

/// Most read answers gathered into one write.
const REPLY_BATCH: usize = 16;

fn respond_loop(
    rx: Receiver<Reply>,
    writer: Arc<Mutex<TcpStream>>,
    shared: Arc<Shared>,
    spin: Spin,
) {
    let mut batch: Vec<Reply> = Vec::with_capacity(REPLY_BATCH);
    while let Ok(reply) = recv_spinning(&rx, &spin, None) {
        // Answers already queued behind this one (a batch of reads) go out in the same
        // write, in order.
        batch.push(reply);
        while batch.len() < REPLY_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let lanes = shared.sending_lanes();
        let parts = lanes.len() as u32 + 1;
        // Per connection, the frames to write. An answer split over the connections is sent
        // after everything before it and before anything behind it, so the answers' bytes are
        // still read from memory in order.
        let mut plan: Vec<Vec<Frame<'_>>> = (0..parts).map(|_| Vec::new()).collect();
        let mut r = Ok(());
        for reply in &batch {
            match reply {
                Reply::Data {
                    req,
                    region,
                    offset,
                    len,
                } => {
                    // Bounds were checked by the progress thread against this same region.
                    let ptr = region
                        .span("read response", *offset, *len)
                        .expect("checked");
                    // SAFETY: [ptr, ptr+len) lies inside `region`, which `batch` keeps alive
                    // until after the writes below.
                    let payload = unsafe { std::slice::from_raw_parts(ptr, *len as usize) };
                    let split = parts > 1 && *len >= SPLIT_FROM;
                    if split && !plan[0].is_empty() {
                        // The answers before this one go out first, whole: a helper writing
                        // a piece must not read the values before the first connection's
                        // writer has read what comes before them (a seqlock reader's first
                        // sequence, say).
                        r = write_plan(&writer, &lanes, &plan);
                        plan[0].clear();
                        if r.is_err() {
                            break;
                        }
                    }
                    for (i, at, payload) in pieces(payload, if split { parts } else { 1 }) {
                        let mut header = FrameHeader::new(Op::ReadResp);
                        header.req = (*req).into();
                        header.len = (payload.len() as u64).into();
                        if split {
                            header.offset = at.into();
                            header.imm = parts.into();
                        }
                        plan[i as usize].push(Frame { header, payload });
                    }
                    if split {
                        SPLIT_SENDS.fetch_add(1, Ordering::Relaxed);
                        r = write_plan(&writer, &lanes, &plan);
                        plan.iter_mut().for_each(Vec::clear);
                    }
                }
                Reply::Refuse { req, reason } => {
                    let mut h = FrameHeader::new(Op::Error);
                    h.req = (*req).into();
                    h.len = (reason.len() as u64).into();
                    plan[0].push(Frame {
                        header: h,
                        payload: reason.as_bytes(),
                    });
                }
            }
            if r.is_err() {
                break;
            }
        }
        if r.is_ok() && !plan[0].is_empty() {
            r = write_plan(&writer, &lanes, &plan);
        }
        drop(plan);
        batch.clear();
        if r.is_err() {
            let _ = lock(&writer).shutdown(Shutdown::Both);
            shared.shut_all();
            break;
        }
    }
    drop(shared);
}

/// Writes each connection's frames: the first connection's on this thread, the others' at
/// the same time on the process's helper threads; returns once all are written.
fn write_plan(
    writer: &Mutex<TcpStream>,
    lanes: &[Arc<Mutex<TcpStream>>],
    plan: &[Vec<Frame<'_>>],
) -> std::io::Result<()> {
    let write = |w: &Mutex<TcpStream>, frames: &[Frame<'_>]| {
        let mut bufs = slices(frames);
        if cfg!(any(target_arch = "x86", target_arch = "x86_64")) {
            write_all_vectored(&mut lock(w), &mut bufs)
        } else {
            // A seqlock reader's batch (meta, values, sequence again) relies on each answer's
            // bytes being read after the one before: the loads of one write have no such
            // order where the CPU may reorder loads, so each answer is its own write, behind
            // an acquire fence.
            let mut w = lock(w);
            bufs.chunks_mut(2).try_for_each(|frame| {
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                write_all_vectored(&mut w, frame)
            })
        }
    };
    if plan.iter().filter(|f| !f.is_empty()).count() <= 1 {
        return write(writer, &plan[0]);
    }
    at_once(plan.len(), |i| {
        let w = if i == 0 { writer } else { &*lanes[i - 1] };
        if plan[i].is_empty() {
            Ok(())
        } else {
            write(w, &plan[i])
        }
    })
}

fn recv_loop(mut s: TcpStream, replies: Sender<Reply>, shared: Arc<Shared>) {
    let result = recv_frames(&mut s, &replies, &shared);
    drop(replies);
    shared.open.store(false, Ordering::Release);
    let error = match result {
        Ok(()) => None,
        Err(e) => {
            tracing::warn!(link = shared.id, peer = %shared.peer, "tcp link failed: {e}");
            Some(e)
        }
    };
    let error = lock(&shared.failure).clone().or(error);
    if let Some(e) = &error {
        shared.record(e.clone());
    }
    let _ = s.shutdown(Shutdown::Both);
    shared.shut_all();
    let fail = error.clone().unwrap_or_else(|| Error::Closed {
        peer: shared.peer.clone(),
        reason: "closed".into(),
    });
    for (_, p) in lock(&shared.pending).drain() {
        let _ = p.done.send(Err(fail.clone()));
    }
    if let Some(hook) = &shared.before_close {
        hook();
    }
    let error = lock(&shared.failure).clone().or(error);
    shared.cq.push(Completion::Closed {
        link: shared.id,
        error,
    });
}

/// Processes frames until an orderly close (Ok) or a failure (Err).
fn recv_frames(s: &mut TcpStream, replies: &Sender<Reply>, shared: &Arc<Shared>) -> Result<()> {
    let mut said_bye = false;
    loop {
        let mut raw = [0u8; FRAME_HEADER];
        let got = read_full(s, &mut raw);
        match got {
            Ok(true) => {}
            Ok(false) if said_bye || shared.closing.load(Ordering::Acquire) => return Ok(()),
            Ok(false) => {
                return Err(Error::Closed {
                    peer: shared.peer.clone(),
                    reason: "connection closed without goodbye (peer died?)".into(),
                });
            }
            // After a goodbye (ours or theirs) a reset is the peer closing with unread data.
            Err(_) if said_bye || shared.closing.load(Ordering::Acquire) => return Ok(()),
            Err(e) => return Err(lost(shared, e)),
        }
        let (op, h) = FrameHeader::decode(&raw)?;
        let len = h.len.get();
        match op {
            Op::Write => {
                let region = granted(shared, h.region.get())?;
                let ptr = region.span("incoming write", h.offset.get(), len)?;
                // SAFETY: [ptr, ptr+len) was bounds-checked inside a region granted to this peer
                // for remote writes; `region` keeps the mapping alive while we fill it.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
                s.read_exact(dst).map_err(|e| lost(shared, e))?;
                let parts = parts_of(h.flags.get());
                if parts > 1 && !wait_parts(shared, h.req.get(), parts - 1)? {
                    return Ok(());
                }
                if h.flags.get() & FLAG_IMM != 0 {
                    shared.cq.push(Completion::WriteImm {
                        link: shared.id,
                        imm: h.imm.get(),
                    });
                }
            }
            Op::Send => {
                shared.st.cap.check(len)?;
                let data = read_message(s, len).map_err(|e| match e {
                    Grown::Alloc => {
                        Error::Malformed(format!("cannot allocate a {len}-byte message"))
                    }
                    Grown::Io(e) => lost(shared, e),
                })?;
                // Backpressure: past the queue's cap, wait for the consumer without reading the
                // socket, so the peer's sends block and then time out.
                let give_up = || {
                    !shared.is_open()
                        || shared.closing.load(Ordering::Acquire)
                        || lock(&shared.failure).is_some()
                };
                if !shared.cq.push_bounded(shared.id, data, give_up) {
                    return Err(Error::Closed {
                        peer: shared.peer.clone(),
                        reason: "the transport stopped while messages waited to be read".into(),
                    });
                }
            }
            Op::ReadReq => {
                let req = h.req.get();
                let checked = granted(shared, h.region.get()).and_then(|r| {
                    check_bounds("remote read", h.offset.get(), len, r.len()).map(|_| r)
                });
                match checked {
                    Ok(region) => {
                        let _ = replies.send(Reply::Data {
                            req,
                            region,
                            offset: h.offset.get(),
                            len,
                        });
                    }
                    Err(e) => {
                        let _ = replies.send(Reply::Refuse {
                            req,
                            reason: e.to_string(),
                        });
                        return Err(e);
                    }
                }
            }
            Op::ReadResp => read_answer(s, shared, &h)?,
            Op::Part => write_part(s, shared, &h)?,
            Op::Lanes => {
                if shared.announced.swap(true, Ordering::AcqRel) {
                    return Err(Error::Malformed("lanes announced twice on one link".into()));
                }
                shared
                    .registry
                    .register(shared.peer_node, h.req.get(), shared)?;
            }
            Op::Error => {
                if len > MAX_ERROR_TEXT {
                    return Err(Error::Malformed(format!("error text of {len} bytes")));
                }
                let mut text = vec![0u8; len as usize];
                s.read_exact(&mut text).map_err(|e| lost(shared, e))?;
                let e = Error::Remote(String::from_utf8_lossy(&text).into_owned());
                if let Some(p) = lock(&shared.pending).remove(&h.req.get()) {
                    let _ = p.done.send(Err(e.clone()));
                }
                return Err(e);
            }
            Op::Bye => said_bye = true,
            Op::Hello | Op::Proof | Op::Bind => {
                return Err(Error::Malformed(format!(
                    "a {} frame after the handshake",
                    op.name()
                )));
            }
        }
    }
}

/// Why a message could not be read.
enum Grown {
    Alloc,
    Io(std::io::Error),
}

/// Bytes of a message read at a time: its buffer grows with the bytes that came, never with
/// the bytes announced, so a header announcing gigabytes costs nothing until they arrive.
const MESSAGE_STEP: usize = 1 << 20;

/// Reads a message of `len` bytes into a buffer that grows as its bytes come.
fn read_message(s: &mut TcpStream, len: u64) -> std::result::Result<Vec<u8>, Grown> {
    let len = usize::try_from(len).map_err(|_| Grown::Alloc)?;
    let mut data: Vec<u8> = Vec::new();
    while data.len() < len {
        let have = data.len();
        let step = (len - have).min(MESSAGE_STEP.max(have));
        data.try_reserve_exact(step).map_err(|_| Grown::Alloc)?;
        data.resize(have + step, 0);
        s.read_exact(&mut data[have..]).map_err(Grown::Io)?;
    }
    Ok(data)
}

/// A read answer, whole or one piece of a split one, read into the read's destination.
fn read_answer(s: &mut TcpStream, shared: &Shared, h: &FrameHeader) -> Result<()> {
    let (req, len, at, parts) = (h.req.get(), h.len.get(), h.offset.get(), h.imm.get());
    if parts <= 1 {
        let p = lock(&shared.pending)
            .remove(&req)
            .ok_or_else(|| Error::Malformed(format!("read response for unknown request {req}")))?;
        // A whole answer to a read whose pieces are landing would write under them (each
        // landing piece holds the destination itself).
        if p.len != len || at != 0 || p.claimed != 0 {
            let e = Error::Malformed(format!(
                "read response of {len} bytes at {at} for a {}-byte read{}",
                p.len,
                if p.claimed != 0 {
                    " answered in pieces"
                } else {
                    ""
                }
            ));
            let _ = p.done.send(Err(e.clone()));
            return Err(e);
        }
        // SAFETY: p.dst was bounds-checked for p.len == len bytes inside p._region, kept
        // alive by the entry; the requester is blocked until we signal `done`.
        let dst = unsafe { std::slice::from_raw_parts_mut(p.dst.0, len as usize) };
        if let Err(e) = s.read_exact(dst) {
            let e = lost(shared, e);
            let _ = p.done.send(Err(e.clone()));
            return Err(e);
        }
        let _ = p.done.send(Ok(()));
        return Ok(());
    }
    // One piece of a split answer: claim it (each piece once, and only a piece of the plan
    // both ends cut by), land it, then count it; the last one landed completes the read.
    let refuse = |why: String| {
        let e = Error::Malformed(why);
        if let Some(p) = lock(&shared.pending).remove(&req) {
            let _ = p.done.send(Err(e.clone()));
        }
        Err(e)
    };
    let (dst, _kept) = {
        let mut pending = lock(&shared.pending);
        let Some(p) = pending.get_mut(&req) else {
            drop(pending);
            return refuse(format!("read response for unknown request {req}"));
        };
        let index = (parts <= MAX_LANES && (p.parts == 0 || p.parts == parts))
            .then(|| piece_index(p.len, parts, at, len))
            .flatten()
            .filter(|&i| p.claimed & (1 << i) == 0);
        let Some(i) = index else {
            let total = p.len;
            drop(pending);
            return refuse(format!(
                "read response piece of {len} bytes at {at} in {parts} for a {total}-byte read"
            ));
        };
        p.parts = parts;
        p.claimed |= 1 << i;
        // SAFETY: the piece [at, at+len) lies inside the read's p.len bytes (it is one of the
        // plan's pieces), which were bounds-checked inside p._region.
        let dst = Dst(unsafe { p.dst.0.add(at as usize) });
        // This thread's own hold on the destination: the entry may go (a failure elsewhere
        // ends the read) while the piece is still landing.
        (dst, p._region.clone())
    };
    // SAFETY: `dst` is this piece's own range of the destination (claimed above, so no other
    // thread writes it, and a whole answer to the same read is refused); `_kept` keeps the
    // region mapped until the piece has landed, and the requester waits until the last piece
    // has. Should the read fail meanwhile, the requester is told so and the bytes land in its
    // region as a late remote write would.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.0, len as usize) };
    if let Err(e) = s.read_exact(out) {
        let e = lost(shared, e);
        if let Some(p) = lock(&shared.pending).remove(&req) {
            let _ = p.done.send(Err(e.clone()));
        }
        return Err(e);
    }
    let mut pending = lock(&shared.pending);
    if let Some(p) = pending.get_mut(&req) {
        p.landed += 1;
        if p.landed == p.parts
            && let Some(p) = pending.remove(&req)
        {
            let _ = p.done.send(Ok(()));
        }
    }
    Ok(())
}

/// A piece of a split write: landed like a write, then counted for the first piece's reader.
fn write_part(s: &mut TcpStream, shared: &Shared, h: &FrameHeader) -> Result<()> {
    let len = h.len.get();
    let region = granted(shared, h.region.get())?;
    let ptr = region.span("incoming write", h.offset.get(), len)?;
    // SAFETY: [ptr, ptr+len) was bounds-checked inside a region granted to this peer for
    // remote writes; `region` keeps the mapping alive while we fill it.
    let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
    s.read_exact(dst).map_err(|e| lost(shared, e))?;
    let mut parts = lock(&shared.parts);
    let id = h.req.get();
    if !parts.contains_key(&id) && parts.len() >= MAX_OPEN_SPLITS {
        return Err(Error::Malformed(format!(
            "more than {MAX_OPEN_SPLITS} split writes unfinished"
        )));
    }
    *parts.entry(id).or_default() += 1;
    shared.parts_cv.notify_all();
    Ok(())
}

/// The first piece of split write `id` has landed: wait until its `want` other pieces have
/// (the link's other connections), so its completion follows every byte of it. `Ok(true)`:
/// they have; `Ok(false)`: this side is closing the link (the reader stops, as at a clean
/// end); an error if one of the other connections ended or the link failed first, or the
/// pieces are later than the operation deadline.
fn wait_parts(shared: &Shared, id: u64, want: u32) -> Result<bool> {
    let deadline = Instant::now() + shared.op_timeout;
    let mut parts = lock(&shared.parts);
    loop {
        if parts.get(&id).is_some_and(|&n| n >= want) {
            parts.remove(&id);
            return Ok(true);
        }
        if shared.closing.load(Ordering::Acquire) {
            return Ok(false);
        }
        if shared.lane_ended.load(Ordering::Acquire) {
            return Err(Error::Closed {
                peer: shared.peer.clone(),
                reason: "one of the link's connections ended while a split write was landing"
                    .into(),
            });
        }
        if !shared.is_open() || lock(&shared.failure).is_some() {
            return Err(lock(&shared.failure)
                .clone()
                .unwrap_or_else(|| Error::Closed {
                    peer: shared.peer.clone(),
                    reason: "closed while a split write was landing".into(),
                }));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout(
                "tcp split write (its pieces on the link's other connections)",
                shared.op_timeout,
            ));
        }
        // Bounded, so a close whose wake-up came between the checks above and the wait is
        // seen soon.
        parts = shared
            .parts_cv
            .wait_timeout(parts, left.min(Duration::from_millis(100)))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Reads one of a link's other connections: split-write pieces and read answers. A clean
/// end between frames is the peer closing the link (its first connection says why); a
/// failure fails the link.
fn lane_loop(mut s: TcpStream, shared: Arc<Shared>) {
    let r = (|| -> Result<()> {
        loop {
            let mut raw = [0u8; FRAME_HEADER];
            match read_full(&mut s, &mut raw) {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(_) if shared.closing.load(Ordering::Acquire) || !shared.is_open() => {
                    return Ok(());
                }
                Err(e) => return Err(lost(&shared, e)),
            }
            let (op, h) = FrameHeader::decode(&raw)?;
            match op {
                Op::Part => write_part(&mut s, &shared, &h)?,
                Op::ReadResp => read_answer(&mut s, &shared, &h)?,
                Op::Bye => return Ok(()),
                _ => {
                    return Err(Error::Malformed(format!(
                        "a {} frame on a link's other connection",
                        op.name()
                    )));
                }
            }
        }
    })();
    // A reader waiting for this connection's pieces learns that none will come.
    shared.lane_ended.store(true, Ordering::Release);
    drop(lock(&shared.parts));
    shared.parts_cv.notify_all();
    if let Err(e) = r {
        shared.fail_from_lane(e);
    }
}

fn granted(shared: &Shared, region: u64) -> Result<Region> {
    shared
        .grants
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&region)
        .cloned()
        .ok_or(Error::UnknownRegion(region))
}

fn lost(shared: &Shared, e: std::io::Error) -> Error {
    // No read timeout is set once established: a timeout here is the kernel's.
    if matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    ) {
        shared.timed_out.store(true, Ordering::Release);
    }
    Error::Closed {
        peer: shared.peer.clone(),
        reason: format!("connection lost mid-frame: {e}"),
    }
}

// Keep the header type's size part of the protocol: a change is a version bump.
const _: () = assert!(FRAME_HEADER == 48);
const _: fn() = || {
    let _ = FrameHeader::read_from_bytes(&[0u8; FRAME_HEADER]);
};
