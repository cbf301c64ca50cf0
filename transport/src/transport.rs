//! The transport: one per process (or per embedded role). It owns the completion queue,
//! listens for peers and hands out links.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::addr::{Medium, PeerAddr, host_id};
use crate::admit::{self, AdmitLimits, AdmitStats};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::handshake::Peer;
use crate::link::{Link, LinkImpl};
use crate::shm::{self, ShmLink, ShmSettings};
use crate::tcp::{self, TcpLink, TcpSettings};

/// Transport configuration. `Default` is a loopback-only transport for job 0.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Job id: peers of another job are refused at connection time.
    pub job: u64,
    /// Where to listen for tcp peers (`None`: no tcp listener). Port 0 picks a free port.
    pub bind: Option<SocketAddr>,
    /// The address to advertise to peers, when it differs from `bind` (NAT, Kubernetes
    /// services, binding 0.0.0.0). The port is taken from the bound socket when this one is 0.
    pub advertise: Option<SocketAddr>,
    /// Listen for shm peers on a Unix socket in `shm_dir`.
    pub shm: bool,
    /// Directory for Unix sockets (default: `$XDG_RUNTIME_DIR/falcon` or `/tmp/falcon-$UID`).
    pub shm_dir: Option<PathBuf>,
    /// The medium for outgoing links.
    pub medium: Medium,
    /// Deadline of a single operation (a read's response, a full ring, a stuck socket).
    pub op_timeout: Duration,
    /// Deadline of a connection's whole handshake (hellos and proofs), counted from its
    /// acceptance: a peer that has not proved it belongs to the job by then is dropped.
    pub handshake_timeout: Duration,
    /// The job token every tcp connection proves it knows before it becomes a link (an
    /// HMAC over both sides' nonces; the token never crosses the wire). Empty: no token; the
    /// job id alone then keeps other jobs' processes out, and nothing keeps an attacker out.
    pub token: String,
    /// Most tcp connections waiting for admission at once; more are closed at once.
    pub max_handshakes: usize,
    /// Most tcp connections waiting for admission from one source address.
    pub max_handshakes_per_source: usize,
    /// How long a completion-queue wait spins before it parks.
    pub spin: Duration,
    /// Capacity of each shm link's inbound ring.
    pub ring_bytes: u64,
    /// The largest control message accepted from a peer.
    pub max_message: u64,
    /// The largest control message taken from a peer that connected to this process, until
    /// its role raises the cap for that link ([`Link::limit_messages`]), having learnt who
    /// the peer is and what it may send. Never above `max_message`; default `u64::MAX` (the
    /// same as `max_message`). falcon's roles take 4 MiB (`JobConfig`'s default): their
    /// control messages are small, and a server raises the cap for an attached worker.
    pub max_accepted_message: u64,
    /// The most bytes of received control messages held for the process before reading from a
    /// tcp peer pauses (backpressure: the peer's sends then wait, and time out after
    /// `op_timeout`). Counted over the whole completion queue (messages from every medium);
    /// only tcp (and rdma control) readers wait. It may be below `max_message`: a message
    /// larger than the cap is delivered alone, once no other message is queued, so the bytes
    /// held stay at most `max(max_queued_bytes, max_message)`. 0 is refused (`Error::Config`);
    /// `u64::MAX` means no cap. Default 256 MiB.
    pub max_queued_bytes: u64,
    /// RDMA device to use (`None`: `$FALCON_RDMA_DEVICE`, else the first with an active port).
    pub rdma_device: Option<String>,
    /// GID index for RoCE (`None`: `$FALCON_RDMA_GID_INDEX`, else 0, which soft-RoCE needs).
    pub rdma_gid_index: Option<i32>,
    /// TCP connections per tcp link this side opens ([`Transport::connect`]), 1 to
    /// [`MAX_TCP_STREAMS`]: a write or read answer of [`TCP_SPLIT_FROM`] bytes or more is cut
    /// into a piece per connection, sent at once from the caller and the process's helper
    /// threads ([`crate::spread`]), as one TCP stream runs on one core. Default 2. A link a
    /// peer opened uses the connections that peer opened.
    pub tcp_streams: u32,
}

/// The most TCP connections one tcp link uses.
pub const MAX_TCP_STREAMS: u32 = crate::wire::MAX_LANES;
/// Writes and read answers of this many bytes or more are split over a tcp link's
/// connections.
pub const TCP_SPLIT_FROM: u64 = tcp::SPLIT_FROM;

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            job: 0,
            bind: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            advertise: None,
            shm: true,
            shm_dir: None,
            medium: Medium::Auto,
            op_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            token: String::new(),
            max_handshakes: 128,
            max_handshakes_per_source: 32,
            spin: Duration::from_micros(50),
            ring_bytes: 1 << 20,
            max_message: 8 << 30,
            max_accepted_message: u64::MAX,
            max_queued_bytes: 256 << 20,
            rdma_device: None,
            rdma_gid_index: None,
            tcp_streams: 2,
        }
    }
}

fn default_shm_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("falcon"),
        _ => std::env::temp_dir().join(format!("falcon-{}", rustix::process::getuid().as_raw())),
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(b)
}

/// What a transport's tcp admission wall has done (see [`TransportConfig::token`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmissionCounts {
    /// Connections that proved the job token and became links.
    pub admitted: u64,
    /// Connections refused: wrong token or job, malformed or closed handshakes.
    pub refused: u64,
    /// Connections dropped at the handshake deadline.
    pub timed_out: u64,
    /// Connections closed at once because too many waited for admission.
    pub over_cap: u64,
    /// Connections waiting for admission now.
    pub pending: u64,
}

/// Shared between the transport and its acceptor threads (which must not keep it alive).
struct Common {
    cq: CompletionQueue,
    next_link: AtomicU64,
    stopping: AtomicBool,
    tcp: TcpSettings,
    shm: ShmSettings,
    local: String,
    /// The RDMA device, or why there is none.
    rdma: std::result::Result<RdmaDevice, Error>,
    /// What the tcp admission wall did.
    admit: Arc<AdmitStats>,
    /// shm handshakes in flight.
    shm_pending: std::sync::atomic::AtomicUsize,
    /// The cap on shm handshakes in flight, and apart on extra tcp connections waiting to
    /// bind (`max_handshakes`).
    max_pending: usize,
    /// Extra tcp connections of links waiting for their binding (capped as handshakes are).
    binds_pending: std::sync::atomic::AtomicUsize,
    /// The message cap of a link this side accepted (`max_accepted_message`).
    max_accepted: u64,
}

/// Counts a pending handshake or binding out when its thread ends, however it ends.
struct PendingGuard<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(feature = "rdma")]
type RdmaDevice = Arc<crate::rdma::Device>;
#[cfg(not(feature = "rdma"))]
type RdmaDevice = std::convert::Infallible;

#[cfg(feature = "rdma")]
fn open_rdma(
    cfg: &TransportConfig,
    cq: &CompletionQueue,
) -> std::result::Result<RdmaDevice, Error> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let device = cfg
        .rdma_device
        .clone()
        .or_else(|| env("FALCON_RDMA_DEVICE"));
    let gid = match cfg.rdma_gid_index {
        Some(g) => g,
        None => match env("FALCON_RDMA_GID_INDEX") {
            Some(v) => v.parse().map_err(|_| {
                Error::Config(format!("FALCON_RDMA_GID_INDEX={v:?} is not a number"))
            })?,
            None => 0,
        },
    };
    crate::rdma::Device::open(device.as_deref(), gid, cq.clone())
}

#[cfg(not(feature = "rdma"))]
fn open_rdma(_: &TransportConfig, _: &CompletionQueue) -> std::result::Result<RdmaDevice, Error> {
    Err(Error::MediumUnavailable {
        medium: "rdma",
        why: "this build has no RDMA support; rebuild with `--features rdma`".into(),
    })
}

/// What the accepting side gives [`rdma_link`]: the control link's gate, and the hand-off of
/// the link to the accept queue.
type Accepted<'a> = (Receiver<()>, &'a dyn Fn(&Link));

/// Builds the RDMA half of a link on a tcp connection whose hellos asked for it.
#[cfg(feature = "rdma")]
/// The accepting side passes `accepted`: the ctl link's gate and the hand-off to the accept
/// queue. Control messages of an rdma link travel as SENDs on the queue pair, which delivers
/// them as soon as it is connected; so the acceptor hands the link out first and only then
/// sends its half of the final `ready` exchange, before which the connecting side says
/// nothing.
fn rdma_link(
    common: &Common,
    mut stream: TcpStream,
    peer_node: u64,
    accepted: Option<Accepted<'_>>,
) -> Result<Link> {
    use crate::rdma::{self, RdmaLink, RdmaQp};
    let id = common.link_id();
    let qp = match &common.rdma {
        Ok(dev) => Some(RdmaQp::create(
            dev,
            id,
            common.tcp.max_message,
            common.tcp.op_timeout,
        )?),
        Err(_) => None,
    };
    let ours = qp.as_ref().map_or_else(RdmaQp::refusal, |q| q.info());
    let theirs = rdma::exchange(&mut stream, &ours)?;
    let Some(qp) = qp else {
        return Err(common
            .rdma
            .as_ref()
            .err()
            .cloned()
            .expect("no qp means no device"));
    };
    qp.connect(&theirs)?;
    let (gate, announce) = match accepted {
        Some((gate, announce)) => (Some(gate), Some(announce)),
        None => {
            // The connecting side: ready before the control link reads the stream.
            rdma::ready(&mut stream)?;
            (None, None)
        }
    };
    let mut sync = stream
        .try_clone()
        .map_err(|e| Error::io("clone tcp socket", e))?;
    let ctl = TcpLink::start_with(
        id,
        stream,
        peer_node,
        &common.tcp,
        common.cq.clone(),
        Some(qp.drainer()),
        gate,
    )?;
    qp.on_fail(Box::new(ctl.failer()?));
    let link = Link::new(
        LinkImpl::Rdma(RdmaLink {
            ctl,
            qp,
            granted: Default::default(),
        }),
        common.tcp.node,
    );
    if let Some(announce) = announce {
        announce(&link);
        // The gate is still shut: the ready byte is ours to read, under the handshake
        // deadline (the control link cleared the socket's read timeout).
        let synced = sync
            .set_read_timeout(Some(common.tcp.handshake_timeout))
            .map_err(|e| Error::io("set handshake timeout", e))
            .and_then(|()| rdma::ready(&mut sync))
            .and_then(|()| tcp::established(&sync));
        if let Err(e) = synced {
            link.close();
            return Err(e);
        }
    }
    Ok(link)
}

#[cfg(not(feature = "rdma"))]
fn rdma_link(common: &Common, _: TcpStream, _: u64, _: Option<Accepted<'_>>) -> Result<Link> {
    Err(common.rdma.clone().expect_err("no rdma in this build"))
}

/// An admitted tcp connection becomes a link: plain tcp, or the control link of an RDMA
/// link. It is handed to the accept queue before it reads anything, so its first completion
/// can never overtake it.
fn admitted_tcp(common: &Arc<Common>, stream: TcpStream, peer: Peer, tx: &Sender<Result<Link>>) {
    // The socket options every link needs (no Nagle delay, keepalive, send timeout), and the
    // handshake's read timeout for an rdma link's queue-pair exchange.
    let tuned = tcp::tune(&stream, common.tcp.op_timeout).and_then(|()| {
        stream
            .set_read_timeout(Some(common.tcp.handshake_timeout))
            .map_err(|e| Error::io("set handshake timeout", e))
    });
    if let Err(e) = tuned {
        tracing::warn!("{}: tcp link setup failed: {e}", common.local);
        return;
    }
    if peer.ask == tcp::HELLO_LANE {
        // Its binding may wait for the link's announcement: off the wall's thread, and no
        // more of them at once than handshakes may be in flight.
        if common.binds_pending.fetch_add(1, Ordering::AcqRel) >= common.max_pending {
            common.binds_pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                "{}: closed a tcp link's extra connection at once: too many waiting to bind",
                common.local
            );
            return;
        }
        let common = common.clone();
        let _ = spawn("falcon-tcp-bind", move || {
            let _done = PendingGuard(&common.binds_pending);
            if let Err(e) = tcp::bind_lane(stream, peer.node, &common.tcp) {
                tracing::warn!(
                    "{}: a tcp link's extra connection was refused: {e}",
                    common.local
                );
            }
        });
        return;
    }
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    if peer.ask == tcp::HELLO_RDMA {
        // The queue-pair exchange blocks on an admitted peer: off the wall's thread.
        let (common, tx) = (common.clone(), tx.clone());
        let _ = spawn("falcon-rdma-setup", move || {
            let announce = |link: &Link| {
                let _ = tx.send(Ok(link.clone()));
            };
            if let Err(e) = rdma_link(&common, stream, peer.node, Some((gate, &announce))) {
                tracing::warn!("{}: rdma link setup failed: {e}", common.local);
            }
            drop(open);
        });
        return;
    }
    match TcpLink::start_with(
        common.link_id(),
        stream,
        peer.node,
        &common.tcp,
        common.cq.clone(),
        None,
        Some(gate),
    ) {
        Ok(link) => {
            let link = Link::new(LinkImpl::Tcp(link), common.tcp.node);
            link.limit_messages(common.max_accepted, crate::state::MAX_ACCEPTED);
            let _ = tx.send(Ok(link));
        }
        Err(e) => tracing::warn!("{}: tcp link setup failed: {e}", common.local),
    }
    drop(open);
}

impl Common {
    fn link_id(&self) -> u64 {
        self.next_link.fetch_add(1, Ordering::Relaxed)
    }
}

/// A process's endpoint: completion queue, listeners and links. Cheap to clone.
#[derive(Clone)]
pub struct Transport {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: TransportConfig,
    node: u64,
    common: Arc<Common>,
    addr: PeerAddr,
    accepted: Receiver<Result<Link>>,
    tcp_listener: Option<TcpListener>,
    unix: Option<(Arc<OwnedFd>, PathBuf)>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.common.stopping.store(true, Ordering::Release);
        self.common.cq.stop();
        #[cfg(feature = "rdma")]
        if let Ok(dev) = &self.common.rdma {
            dev.stop();
        }
        if let Some(l) = &self.tcp_listener {
            let _ = rustix::net::shutdown(l, rustix::net::Shutdown::Both);
        }
        if let Some((fd, path)) = &self.unix {
            let _ = rustix::net::shutdown(fd.as_fd(), rustix::net::Shutdown::Both);
            let _ = std::fs::remove_file(path);
        }
    }
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("node", &format_args!("{:#x}", self.inner.node))
            .field("addr", &self.inner.addr.to_string())
            .finish()
    }
}

impl Transport {
    /// Creates a transport and starts its listeners.
    pub fn new(cfg: TransportConfig) -> Result<Transport> {
        if !(1..=MAX_TCP_STREAMS).contains(&cfg.tcp_streams) {
            return Err(Error::Config(format!(
                "tcp_streams is {}: it must be 1 to {MAX_TCP_STREAMS}",
                cfg.tcp_streams
            )));
        }
        if cfg.max_queued_bytes == 0 {
            return Err(Error::Config(
                "max_queued_bytes must be at least 1 (u64::MAX: no cap)".into(),
            ));
        }
        let node = random_u64();
        let cq = CompletionQueue::new(cfg.spin, cfg.max_queued_bytes)?;
        let spin = cq.spin().clone();
        let rdma = open_rdma(&cfg, &cq);
        if let Err(e) = &rdma
            && crate::RDMA_BUILT
        {
            tracing::info!("rdma unavailable, peers on other hosts use tcp: {e}");
        }
        let common = Arc::new(Common {
            cq,
            next_link: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            tcp: TcpSettings {
                job: cfg.job,
                node,
                op_timeout: cfg.op_timeout,
                handshake_timeout: cfg.handshake_timeout,
                max_message: cfg.max_message,
                spin,
                token: cfg.token.as_bytes().into(),
                registry: Default::default(),
            },
            shm: ShmSettings {
                job: cfg.job,
                node,
                ring_bytes: cfg.ring_bytes,
                op_timeout: cfg.op_timeout,
                handshake_timeout: cfg.handshake_timeout,
                max_message: cfg.max_message,
            },
            local: format!("node {node:#x}"),
            rdma,
            admit: Arc::default(),
            shm_pending: Default::default(),
            binds_pending: Default::default(),
            max_pending: cfg.max_handshakes.max(1),
            max_accepted: cfg.max_accepted_message.min(cfg.max_message),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut addr = PeerAddr {
            host: host_id(),
            tcp: None,
            shm: None,
        };

        let tcp_listener = match cfg.bind {
            Some(bind) => {
                let l = TcpListener::bind(bind).map_err(|e| Error::Bind {
                    addr: bind.to_string(),
                    why: match e.kind() {
                        std::io::ErrorKind::AddrInUse => {
                            format!("{e} (another program, or another job, holds that port)")
                        }
                        std::io::ErrorKind::AddrNotAvailable => {
                            format!("{e} (no interface of this host has that address)")
                        }
                        _ => e.to_string(),
                    },
                })?;
                let bound = l
                    .local_addr()
                    .map_err(|e| Error::io("tcp listener address", e))?;
                let mut adv = cfg.advertise.unwrap_or(bound);
                if adv.port() == 0 {
                    adv.set_port(bound.port());
                }
                if adv.ip().is_unspecified() {
                    return Err(Error::Config(format!(
                        "bound to {bound}: set an advertise address peers can reach (e.g. FALCON_ADVERTISE)"
                    )));
                }
                addr.tcp = Some(adv);
                let l2 = l
                    .try_clone()
                    .map_err(|e| Error::io("clone tcp listener", e))?;
                spawn("falcon-tcp-admit", {
                    let (common, tx) = (common.clone(), tx.clone());
                    let limits = AdmitLimits {
                        deadline: cfg.handshake_timeout,
                        max_pending: cfg.max_handshakes.max(1),
                        max_per_source: cfg.max_handshakes_per_source.max(1),
                    };
                    move || {
                        let local = common.tcp.local(tcp::HELLO_TCP);
                        let stats = common.admit.clone();
                        admit::run(
                            l2,
                            local,
                            limits,
                            stats,
                            &common.stopping,
                            &common.local,
                            |stream, peer, _from| admitted_tcp(&common, stream, peer, &tx),
                        )
                    }
                })?;
                Some(l)
            }
            None => None,
        };

        let unix = if cfg.shm {
            let dir = cfg.shm_dir.clone().unwrap_or_else(default_shm_dir);
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io("create shm socket directory", e))?;
            let _ = rustix::fs::chmod(&dir, rustix::fs::Mode::from_raw_mode(0o700));
            let path = dir.join(format!("{node:016x}.sock"));
            let fd = Arc::new(shm::listen(&path)?);
            addr.shm = Some(path.clone());
            spawn("falcon-shm-accept", {
                let (common, tx, fd) = (common.clone(), tx.clone(), fd.clone());
                move || unix_accept_loop(fd, common, tx)
            })?;
            Some((fd, path))
        } else {
            None
        };

        Ok(Transport {
            inner: Arc::new(Inner {
                cfg,
                node,
                common,
                addr,
                accepted: rx,
                tcp_listener,
                unix,
            }),
        })
    }

    /// This transport's node id (random, unique per process with overwhelming probability).
    pub fn node_id(&self) -> u64 {
        self.inner.node
    }

    /// The address peers connect to.
    pub fn address(&self) -> &PeerAddr {
        &self.inner.addr
    }

    /// The completion queue every link of this transport delivers to.
    pub fn cq(&self) -> &CompletionQueue {
        &self.inner.common.cq
    }

    /// The configuration.
    pub fn config(&self) -> &TransportConfig {
        &self.inner.cfg
    }

    /// Waits for the next incoming link (`None`: forever). A peer of another job or a broken
    /// handshake is refused and logged; it never reaches the caller as a link.
    pub fn accept(&self, timeout: Option<Duration>) -> Result<Link> {
        let r = match timeout {
            Some(t) => self
                .inner
                .accepted
                .recv_timeout(t)
                .map_err(|_| Error::Timeout("accept", t)),
            None => self.inner.accepted.recv().map_err(|_| Error::Closed {
                peer: "listener".into(),
                reason: "transport stopped".into(),
            }),
        };
        r?
    }

    /// Connects to a peer with the configured medium.
    pub fn connect(&self, peer: &PeerAddr) -> Result<Link> {
        self.connect_with(peer, self.inner.cfg.medium)
    }

    /// Connects to a peer for control messages only: as [`Transport::connect_with`] with
    /// `Auto`, but a tcp link keeps to one connection ([`TransportConfig::tcp_streams`] is
    /// for links that move tensors).
    pub fn connect_control(&self, peer: &PeerAddr) -> Result<Link> {
        self.connect_via(peer, Medium::Auto, 1)
    }

    /// How long a hand-off between this transport's threads (a completion-queue wait, a tcp
    /// read's answer, the RDMA progress thread) spins before it parks; starts at
    /// [`TransportConfig::spin`].
    pub fn spin(&self) -> Duration {
        self.inner.common.cq.spin().get()
    }

    /// Changes [`Transport::spin`] for every wait from now on, on links open already too:
    /// zero parks at once, for a process that shares its cores with busier ones.
    pub fn set_spin(&self, spin: Duration) {
        self.inner.common.cq.spin().set(spin);
    }

    /// Connects to a peer over a given medium (`Auto`: same host → shm, else rdma when a
    /// device is available, else tcp).
    pub fn connect_with(&self, peer: &PeerAddr, medium: Medium) -> Result<Link> {
        self.connect_via(peer, medium, self.inner.cfg.tcp_streams)
    }

    /// As [`Transport::connect_with`], a tcp link opening `lanes` connections.
    fn connect_via(&self, peer: &PeerAddr, medium: Medium, lanes: u32) -> Result<Link> {
        let same_host = peer.host == self.inner.addr.host;
        match medium {
            Medium::Shm => self.connect_shm(peer),
            Medium::Tcp => self.connect_tcp(peer, tcp::HELLO_TCP, lanes),
            Medium::Rdma => {
                if let Err(e) = &self.inner.common.rdma {
                    return Err(e.clone());
                }
                self.connect_tcp(peer, tcp::HELLO_RDMA, lanes)
            }
            Medium::Auto if same_host && peer.shm.is_some() => match self.connect_shm(peer) {
                Ok(l) => Ok(l),
                Err(e @ Error::WrongJob { .. }) => Err(e),
                Err(e) if peer.tcp.is_some() => {
                    tracing::warn!("shm connection to {peer} failed ({e}); falling back to tcp");
                    self.connect_tcp(peer, tcp::HELLO_TCP, lanes)
                }
                Err(e) => Err(e),
            },
            Medium::Auto if self.inner.common.rdma.is_ok() => {
                match self.connect_tcp(peer, tcp::HELLO_RDMA, lanes) {
                    Ok(l) => Ok(l),
                    Err(e @ Error::WrongJob { .. }) => Err(e),
                    Err(e) => {
                        tracing::warn!(
                            "rdma connection to {peer} failed ({e}); falling back to tcp"
                        );
                        self.connect_tcp(peer, tcp::HELLO_TCP, lanes)
                    }
                }
            }
            Medium::Auto => self.connect_tcp(peer, tcp::HELLO_TCP, lanes),
        }
    }

    /// What the tcp admission wall has done so far.
    pub fn admission(&self) -> AdmissionCounts {
        let a = &self.inner.common.admit;
        AdmissionCounts {
            admitted: a.admitted.load(Ordering::Relaxed),
            refused: a.refused.load(Ordering::Relaxed),
            timed_out: a.timed_out.load(Ordering::Relaxed),
            over_cap: a.over_cap.load(Ordering::Relaxed),
            pending: a.pending.load(Ordering::Relaxed),
        }
    }

    /// True when this transport can use the rdma medium.
    pub fn rdma_available(&self) -> bool {
        self.inner.common.rdma.is_ok()
    }

    /// Why the rdma medium is unavailable, if it is.
    pub fn rdma_error(&self) -> Option<&Error> {
        self.inner.common.rdma.as_ref().err()
    }

    fn connect_shm(&self, peer: &PeerAddr) -> Result<Link> {
        let unreachable = |why: &str| Error::Unreachable {
            medium: "shm",
            peer: peer.to_string(),
            why: why.into(),
        };
        if peer.host != self.inner.addr.host {
            return Err(unreachable("the peer is on another host"));
        }
        let path = peer
            .shm
            .as_ref()
            .ok_or_else(|| unreachable("the peer does not listen for shm"))?;
        let c = &self.inner.common;
        let sock = shm::connect_socket(path)?;
        let link = ShmLink::connect(
            c.link_id(),
            sock,
            format!("shm:{}", path.display()),
            &c.shm,
            &c.cq,
        )?;
        Ok(Link::new(LinkImpl::Shm(link), self.inner.node))
    }

    fn connect_tcp(&self, peer: &PeerAddr, ask: u32, lanes: u32) -> Result<Link> {
        let addr = peer.tcp.ok_or_else(|| Error::Unreachable {
            medium: if ask == tcp::HELLO_RDMA {
                "rdma"
            } else {
                "tcp"
            },
            peer: peer.to_string(),
            why: "the peer does not listen on tcp (its control link)".into(),
        })?;
        let c = &self.inner.common;
        let (stream, peer_node) = admitted(addr, &c.tcp, ask)?;
        if ask == tcp::HELLO_RDMA {
            return rdma_link(c, stream, peer_node, None);
        }
        let link = TcpLink::start(c.link_id(), stream, peer_node, &c.tcp, c.cq.clone())?;
        link.open_lanes(addr, &c.tcp, lanes);
        Ok(Link::new(LinkImpl::Tcp(link), self.inner.node))
    }
}

/// Connects to `addr` and runs the handshake; a peer whose admission wall is full (it says
/// it is busy, or resets the connection before a word) is tried again, backing off from 10 ms
/// to 250 ms with jitter, until the handshake deadline has passed since the first attempt.
fn admitted(addr: SocketAddr, cfg: &tcp::TcpSettings, ask: u32) -> Result<(TcpStream, u64)> {
    let give_up = Instant::now() + cfg.handshake_timeout;
    let mut pause = Duration::from_millis(10);
    let mut tries = 0u32;
    loop {
        tries += 1;
        let mut stream = TcpStream::connect_timeout(&addr, cfg.handshake_timeout).map_err(|e| {
            Error::Unreachable {
                medium: "tcp",
                peer: addr.to_string(),
                why: e.to_string(),
            }
        })?;
        match tcp::handshake(&mut stream, cfg, ask) {
            Ok((node, _)) => return Ok((stream, node)),
            Err(Error::Busy { peer, why }) if Instant::now() + pause < give_up => {
                tracing::debug!("{peer} is busy ({why}); trying again (attempt {tries})");
                drop(stream);
                // Up to half the pause again, so newcomers turned away together spread out.
                let r = crate::handshake::nonce().map_or(0, |n| u32::from(n[0]));
                let jitter = pause * r / 512;
                std::thread::sleep(pause + jitter);
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            Err(Error::Busy { peer, why }) => {
                return Err(Error::Busy {
                    peer,
                    why: format!(
                        "{why} ({tries} attempts in {:.1} s)",
                        cfg.handshake_timeout.as_secs_f64()
                    ),
                });
            }
            Err(e) => return Err(e),
        }
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|_| ())
        .map_err(|e| Error::io("spawn thread", e))
}

fn unix_accept_loop(listener: Arc<OwnedFd>, common: Arc<Common>, tx: Sender<Result<Link>>) {
    loop {
        let sock =
            match rustix::net::accept_with(listener.as_fd(), rustix::net::SocketFlags::CLOEXEC) {
                Ok(s) => s,
                Err(_) if common.stopping.load(Ordering::Acquire) => return,
                Err(e) => {
                    tracing::warn!("unix accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
        // Local peers of this user only (the socket's directory is 0700); still, handshakes
        // in flight are capped like tcp's.
        if common.shm_pending.fetch_add(1, Ordering::AcqRel) >= common.max_pending {
            common.shm_pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(
                "{}: closed an shm peer at once: too many handshakes in flight",
                common.local
            );
            drop(sock);
            continue;
        }
        let (common, tx) = (common.clone(), tx.clone());
        let _ = spawn("falcon-shm-handshake", move || {
            let _done = PendingGuard(&common.shm_pending);
            let id = common.link_id();
            match ShmLink::accept(id, sock, format!("shm-peer#{id}"), &common.shm, &common.cq) {
                Ok(link) => {
                    let link = Link::new(LinkImpl::Shm(link), common.shm.node);
                    link.limit_messages(common.max_accepted, crate::state::MAX_ACCEPTED);
                    let _ = tx.send(Ok(link.clone()));
                    if let Err(e) = link.activate() {
                        tracing::warn!("{}: shm link could not start: {e}", common.local);
                        link.close();
                    }
                }
                Err(e) => tracing::warn!("{}: refused shm peer: {e}", common.local),
            }
        });
    }
}
