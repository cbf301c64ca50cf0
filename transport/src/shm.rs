//! The shm medium: peers on one host share memory.
//!
//! Setup and grants go over a `SOCK_SEQPACKET` Unix socket that carries memfd descriptors
//! (SCM_RIGHTS): at hello each side passes its inbound ring and its completion queue's
//! doorbell; a grant passes a region's memfd, which the peer maps. From then on a one-sided
//! write or read is a single memcpy between this process's region and the peer's mapping, and
//! an immediate or control message is a record in the peer's ring plus a doorbell ring. The
//! socket stays open as a liveness signal: when the peer dies the kernel closes it, and the
//! link reports `Closed` after every record the peer published has been delivered.

use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use zerocopy::IntoBytes;

use crate::cq::{Backoff, Completion, CompletionQueue, CqSource, Doorbell, LinkId, lock};
use crate::error::{Error, Result, check_bounds};
use crate::memfd::SharedMap;
use crate::region::Region;
use crate::ring::{KIND_BLOB, KIND_IMM, KIND_MSG, Ring};
use crate::state::LinkState;
use crate::wire::{CTL_PACKET, CtlOp, CtlPacket};

/// Settings an shm link needs.
#[derive(Clone, Debug)]
pub(crate) struct ShmSettings {
    pub(crate) job: u64,
    pub(crate) node: u64,
    pub(crate) ring_bytes: u64,
    pub(crate) op_timeout: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_message: u64,
}

/// A new SEQPACKET Unix socket and the address `path`.
fn seqpacket(path: &Path) -> Result<(OwnedFd, SocketAddrUnix)> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Error::errno("create unix socket", e))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| Error::errno("unix socket path", e))?;
    Ok((fd, addr))
}

/// Creates a listening SEQPACKET socket at `path` (owner-only permissions).
pub(crate) fn listen(path: &Path) -> Result<OwnedFd> {
    let _ = std::fs::remove_file(path);
    let (fd, addr) = seqpacket(path)?;
    rustix::net::bind(&fd, &addr).map_err(|e| Error::errno("bind unix socket", e))?;
    rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(0o600))
        .map_err(|e| Error::errno("chmod unix socket", e))?;
    rustix::net::listen(&fd, 128).map_err(|e| Error::errno("listen on unix socket", e))?;
    Ok(fd)
}

/// Connects to a peer's SEQPACKET socket.
pub(crate) fn connect_socket(path: &Path) -> Result<OwnedFd> {
    let (fd, addr) = seqpacket(path)?;
    rustix::net::connect(&fd, &addr).map_err(|e| Error::Unreachable {
        medium: "shm",
        peer: path.display().to_string(),
        why: e.to_string(),
    })?;
    Ok(fd)
}

fn send_ctl(fd: BorrowedFd<'_>, pkt: &CtlPacket, fds: &[BorrowedFd<'_>]) -> Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::Config(
            "too many descriptors for one control packet".into(),
        ));
    }
    let n = rustix::net::sendmsg(
        fd,
        &[IoSlice::new(pkt.as_bytes())],
        &mut cmsg,
        SendFlags::NOSIGNAL,
    )
    .map_err(|e| Error::errno("send shm control packet", e))?;
    if n != CTL_PACKET {
        return Err(Error::Malformed(format!(
            "short control packet send ({n} bytes)"
        )));
    }
    Ok(())
}

/// Receives one control packet. `Ok(None)` on end of stream.
fn recv_ctl(fd: BorrowedFd<'_>) -> Result<Option<(CtlOp, CtlPacket, Vec<OwnedFd>)>> {
    let mut buf = [0u8; CTL_PACKET + 8];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            fd,
            &mut [IoSliceMut::new(&mut buf)],
            &mut cmsg,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) if e == rustix::io::Errno::AGAIN || e == rustix::io::Errno::WOULDBLOCK => {
                return Err(Error::Timeout("shm control receive", Duration::ZERO));
            }
            Err(e) => return Err(Error::errno("receive shm control packet", e)),
        }
    };
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    if msg
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
    {
        return Err(Error::Malformed("truncated shm control packet".into()));
    }
    let (op, pkt) = CtlPacket::decode(&buf[..msg.bytes], fds.len())?;
    Ok(Some((op, pkt, fds)))
}

fn set_recv_timeout(fd: BorrowedFd<'_>, t: Option<Duration>) -> Result<()> {
    rustix::net::sockopt::set_socket_timeout(fd, rustix::net::sockopt::Timeout::Recv, t)
        .map_err(|e| Error::errno("set unix socket timeout", e))
}

/// A handoff waiting for its acknowledgement: its number, and where to say it came.
type AckWaiter = (u64, crossbeam_channel::Sender<()>);

/// State shared by the link handle, its control thread and the completion queue.
struct Shared {
    st: LinkState,
    sock: OwnedFd,
    inbound: Ring,
    /// Regions the peer granted us, mapped.
    remote: RwLock<HashMap<u64, Arc<SharedMap>>>,
    /// Our regions granted to the peer, kept alive while granted.
    granted: Mutex<HashMap<u64, Region>>,
    acks: Mutex<HashMap<u64, VecDeque<AckWaiter>>>,
    /// Large messages received out of band, waiting for their place in the ring.
    blobs: Mutex<HashMap<u64, Vec<u8>>>,
    peer_gone: AtomicBool,
    own_bell: Arc<Doorbell>,
}

impl std::ops::Deref for Shared {
    type Target = LinkState;
    fn deref(&self) -> &LinkState {
        &self.st
    }
}

impl Shared {
    fn fail(&self, e: Error) {
        self.record(e);
        self.open.store(false, Ordering::Release);
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
    }
}

impl CqSource for Shared {
    fn drain(&self, out: &mut VecDeque<Completion>) -> bool {
        // Read `peer_gone` before draining: everything the peer published before it went is
        // then already visible to the pops below (Acquire pairs with the control thread's
        // Release store, which follows the kernel's report of the closed socket).
        let gone = self.peer_gone.load(Ordering::Acquire);
        loop {
            match self.inbound.pop() {
                Ok(None) => break,
                Ok(Some(rec)) if rec.kind == KIND_IMM => out.push_back(Completion::WriteImm {
                    link: self.id,
                    imm: rec.imm,
                }),
                Ok(Some(rec)) if rec.kind == KIND_MSG => out.push_back(Completion::Message {
                    link: self.id,
                    data: rec.payload,
                }),
                Ok(Some(rec)) => {
                    let id = u64::from_le_bytes(
                        rec.payload
                            .get(..8)
                            .and_then(|b| b.try_into().ok())
                            .unwrap_or([0; 8]),
                    );
                    match lock(&self.blobs).remove(&id) {
                        Some(data) => out.push_back(Completion::Message {
                            link: self.id,
                            data,
                        }),
                        None => {
                            self.fail(Error::Malformed(format!(
                                "ring names blob {id}, which never arrived"
                            )));
                            break;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(link = self.id, peer = %self.peer, "shm link failed: {e}");
                    self.fail(e);
                    break;
                }
            }
        }
        let failed = lock(&self.failure).clone();
        let finished = gone || matches!(failed, Some(Error::Malformed(_)));
        if finished {
            self.open.store(false, Ordering::Release);
            out.push_back(Completion::Closed {
                link: self.id,
                error: failed,
            });
        }
        !finished
    }
}

pub(crate) struct ShmLink {
    shared: Arc<Shared>,
    out: Mutex<Ring>,
    peer_bell: Doorbell,
    op_timeout: Duration,
    pub(crate) peer_node: u64,
    /// Until [`ShmLink::activate`]: the completion queue and the control socket the link's
    /// control thread will read. A dormant link delivers nothing.
    dormant: Mutex<Option<(CompletionQueue, OwnedFd)>>,
}

impl ShmLink {
    /// Client side of the handshake on a connected socket.
    pub(crate) fn connect(
        id: LinkId,
        sock: OwnedFd,
        peer: String,
        cfg: &ShmSettings,
        cq: &CompletionQueue,
    ) -> Result<ShmLink> {
        set_recv_timeout(sock.as_fd(), Some(cfg.handshake_timeout))?;
        let ring = Ring::create(cfg.ring_bytes)?;
        send_ctl(
            sock.as_fd(),
            &CtlPacket::new(CtlOp::Hello, cfg.job, cfg.node, ring.capacity()),
            &[ring.fd(), cq.doorbell().fd()],
        )?;
        let (op, pkt, fds) = recv_hello(sock.as_fd(), &peer, cfg)?;
        if op == CtlOp::Refuse {
            return Err(Error::WrongJob {
                theirs: pkt.a.get(),
                ours: cfg.job,
            });
        }
        let link = Self::finish(id, sock, peer, cfg, cq, ring, pkt, fds)?;
        link.activate()?;
        Ok(link)
    }

    /// Server side of the handshake on an accepted socket. The link is dormant until
    /// [`ShmLink::activate`]: the acceptor hands it out first, so its first completion can
    /// never overtake it.
    pub(crate) fn accept(
        id: LinkId,
        sock: OwnedFd,
        peer: String,
        cfg: &ShmSettings,
        cq: &CompletionQueue,
    ) -> Result<ShmLink> {
        set_recv_timeout(sock.as_fd(), Some(cfg.handshake_timeout))?;
        let (op, pkt, fds) = recv_hello(sock.as_fd(), &peer, cfg)?;
        if op != CtlOp::Hello {
            return Err(Error::Malformed(format!("expected a hello, got {op:?}")));
        }
        if pkt.a.get() != cfg.job {
            let _ = send_ctl(
                sock.as_fd(),
                &CtlPacket::new(CtlOp::Refuse, cfg.job, 0, 0),
                &[],
            );
            return Err(Error::WrongJob {
                theirs: pkt.a.get(),
                ours: cfg.job,
            });
        }
        let ring = Ring::create(cfg.ring_bytes)?;
        send_ctl(
            sock.as_fd(),
            &CtlPacket::new(CtlOp::Hello, cfg.job, cfg.node, ring.capacity()),
            &[ring.fd(), cq.doorbell().fd()],
        )?;
        Self::finish(id, sock, peer, cfg, cq, ring, pkt, fds)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        id: LinkId,
        sock: OwnedFd,
        peer: String,
        cfg: &ShmSettings,
        cq: &CompletionQueue,
        inbound: Ring,
        hello: CtlPacket,
        fds: Vec<OwnedFd>,
    ) -> Result<ShmLink> {
        if hello.a.get() != cfg.job {
            return Err(Error::WrongJob {
                theirs: hello.a.get(),
                ours: cfg.job,
            });
        }
        let mut fds = fds.into_iter();
        let (ring_fd, bell_fd) = (
            fds.next().expect("2 fds checked"),
            fds.next().expect("2 fds checked"),
        );
        let out = Ring::open(ring_fd, hello.c.get())?;
        let peer_bell = Doorbell::open(bell_fd)?;
        set_recv_timeout(sock.as_fd(), None)?;
        let ctl_sock = sock
            .try_clone()
            .map_err(|e| Error::io("dup unix socket", e))?;
        let shared = Arc::new(Shared {
            st: LinkState::new(id, peer, cfg.max_message),
            sock,
            inbound,
            remote: RwLock::new(HashMap::new()),
            granted: Mutex::new(HashMap::new()),
            acks: Mutex::new(HashMap::new()),
            blobs: Mutex::new(HashMap::new()),
            peer_gone: AtomicBool::new(false),
            own_bell: cq.doorbell().clone(),
        });
        Ok(ShmLink {
            shared,
            out: Mutex::new(out),
            peer_bell,
            op_timeout: cfg.op_timeout,
            peer_node: hello.b.get(),
            dormant: Mutex::new(Some((cq.clone(), ctl_sock))),
        })
    }

    /// Starts delivering: the completion queue polls the link's ring and its control thread
    /// runs. Idempotent.
    pub(crate) fn activate(&self) -> Result<()> {
        let Some((cq, ctl_sock)) = lock(&self.dormant).take() else {
            return Ok(());
        };
        cq.add_source(self.shared.clone());
        let s2 = self.shared.clone();
        std::thread::Builder::new()
            .name(format!("falcon-shm-ctl-{}", self.shared.id))
            .spawn(move || ctl_loop(ctl_sock, s2))
            .map_err(|e| Error::io("spawn shm control thread", e))?;
        Ok(())
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

    /// Appends one record to the peer's ring, waiting (bounded) for room.
    fn push(&self, ring: &Ring, kind: u8, flags: u8, imm: u32, payload: &[u8]) -> Result<()> {
        let start = Instant::now();
        let mut backoff = Backoff::new();
        while !ring.try_push(kind, flags, imm, payload)? {
            self.check_open()?;
            if start.elapsed() > self.op_timeout {
                return Err(Error::Timeout(
                    "shm ring full (peer not polling its queue)",
                    self.op_timeout,
                ));
            }
            self.peer_bell.ring();
            backoff.snooze();
        }
        self.peer_bell.ring();
        Ok(())
    }

    pub(crate) fn send(&self, data: &[u8]) -> Result<()> {
        self.check_open()?;
        let inline = (data.len() as u64) <= lock(&self.out).max_record_payload();
        if inline {
            let ring = lock(&self.out);
            return self.push(&ring, KIND_MSG, 0, 0, data);
        }
        // Too large for the ring: hand the peer's control thread a memfd holding the message
        // (it copies it out and acknowledges without the peer's application polling), then put
        // a placeholder in the ring so the message keeps its place in the order.
        let blob = Region::new(data.len() as u64)?;
        blob.write_at(0, data)?;
        self.handoff(CtlOp::Blob, &blob)?;
        let ring = lock(&self.out);
        self.push(&ring, KIND_BLOB, 0, 0, &blob.id().to_le_bytes())
    }

    /// Sends `region`'s memfd to the peer under `op` and waits for its acknowledgement.
    fn handoff(&self, op: CtlOp, region: &Region) -> Result<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        // Handoffs of one region may overlap (two threads granting it at once): the peer
        // acknowledges each, in order, and each waiter takes one. The waiter keeps no sender
        // of its own, so the link's end (which drops every sender) wakes it at once.
        static HANDOFFS: AtomicU64 = AtomicU64::new(0);
        let me = HANDOFFS.fetch_add(1, Ordering::Relaxed);
        lock(&self.shared.acks)
            .entry(region.id())
            .or_default()
            .push_back((me, tx));
        send_ctl(
            self.shared.sock.as_fd(),
            &CtlPacket::new(op, region.id(), region.len(), 0),
            &[region.inner.map.fd()],
        )?;
        match rx.recv_timeout(self.op_timeout) {
            Ok(()) => Ok(()),
            Err(_) => {
                let mut acks = lock(&self.shared.acks);
                if let Some(waiting) = acks.get_mut(&region.id()) {
                    waiting.retain(|(w, _)| *w != me);
                    if waiting.is_empty() {
                        acks.remove(&region.id());
                    }
                }
                drop(acks);
                self.check_open()?;
                Err(Error::Timeout("shm peer acknowledgement", self.op_timeout))
            }
        }
    }

    pub(crate) fn grant(&self, region: &Region) -> Result<()> {
        self.check_open()?;
        lock(&self.shared.granted).insert(region.id(), region.clone());
        self.handoff(CtlOp::Grant, region)
    }

    pub(crate) fn revoke(&self, region: &Region) -> Result<()> {
        lock(&self.shared.granted).remove(&region.id());
        self.check_open()?;
        send_ctl(
            self.shared.sock.as_fd(),
            &CtlPacket::new(CtlOp::Revoke, region.id(), 0, 0),
            &[],
        )
    }

    /// Runs `f` on the peer's mapping of `region` (held under a read lock: a concurrent
    /// revoke waits for the copy to finish, and no reference count is touched per operation).
    fn with_mapping<R>(&self, region: u64, f: impl FnOnce(&SharedMap) -> Result<R>) -> Result<R> {
        let maps = self.shared.remote.read().unwrap_or_else(|p| p.into_inner());
        f(maps.get(&region).ok_or(Error::UnknownRegion(region))?)
    }

    pub(crate) fn write(
        &self,
        src: *const u8,
        len: u64,
        region: u64,
        offset: u64,
        imm: Option<u32>,
    ) -> Result<()> {
        self.check_open()?;
        self.with_mapping(region, |map| {
            check_bounds("remote write", offset, len, map.len())?;
            // SAFETY: the destination [offset, offset+len) is inside the peer's mapping
            // (checked against the size verified when mapping it), alive under the read lock,
            // which is held until the copy returns, helpers' chunks included; the source was
            // bounds-checked by the caller and lives for the call. The peer's mapping is an
            // mmap of its own, so its addresses never overlap a range of ours (a region a
            // process granted to itself aliases physically, not virtually), as
            // `spread::copy` requires.
            unsafe { crate::spread::copy(src, map.ptr().add(offset as usize), len as usize) };
            Ok(())
        })?;
        if let Some(imm) = imm {
            let ring = lock(&self.out);
            self.push(&ring, KIND_IMM, 0, imm, &[])?;
        }
        Ok(())
    }

    pub(crate) fn read(&self, dst: *mut u8, len: u64, region: u64, offset: u64) -> Result<()> {
        self.check_open()?;
        self.with_mapping(region, |map| {
            check_bounds("remote read", offset, len, map.len())?;
            // SAFETY: as in `write`, with source and destination swapped.
            unsafe { crate::spread::copy(map.ptr().add(offset as usize), dst, len as usize) };
            Ok(())
        })
    }

    /// [`crate::Link::read_mapped`]: a copy out of the peer's mapping, open link or not.
    pub(crate) fn read_mapped(&self, out: &mut [u8], region: u64, offset: u64) -> Result<()> {
        self.with_mapping(region, |map| {
            check_bounds("remote read", offset, out.len() as u64, map.len())?;
            // SAFETY: the source [offset, offset+len) is inside the peer's mapping (checked
            // against the size verified when mapping it; the memfd is sealed against
            // shrinking, so every page of it is there), alive under the read lock; `out` is a
            // live exclusive slice of `len` bytes. The peer may write its memory meanwhile:
            // as for `read`, that race is accepted by design, the copy goes through raw
            // pointers, never references, and the bytes are plain data, whatever they hold.
            // A mapping never overlaps a slice of ours unless a process grants a region to
            // itself, hence `copy`.
            unsafe { std::ptr::copy(map.ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
            Ok(())
        })
    }

    pub(crate) fn close(&self) {
        if self.shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let _ = send_ctl(
            self.shared.sock.as_fd(),
            &CtlPacket::new(CtlOp::Bye, 0, 0, 0),
            &[],
        );
        self.shared.open.store(false, Ordering::Release);
        let _ = rustix::net::shutdown(&self.shared.sock, rustix::net::Shutdown::Both);
    }

    /// Test hook: raw bytes into the peer's ring, as a broken peer would write them.
    pub(crate) fn send_raw(&self, bytes: &[u8]) -> Result<()> {
        lock(&self.out).push_raw(bytes);
        self.peer_bell.ring();
        Ok(())
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.close();
    }
}

fn recv_hello(
    sock: BorrowedFd<'_>,
    peer: &str,
    _cfg: &ShmSettings,
) -> Result<(CtlOp, CtlPacket, Vec<OwnedFd>)> {
    match recv_ctl(sock) {
        Ok(Some(x)) if matches!(x.0, CtlOp::Hello | CtlOp::Refuse) => Ok(x),
        Ok(Some((op, ..))) => Err(Error::Malformed(format!("expected a hello, got {op:?}"))),
        Ok(None) => Err(Error::Closed {
            peer: peer.to_string(),
            reason: "closed during handshake".into(),
        }),
        Err(Error::Timeout(what, _)) => Err(Error::Timeout(what, _cfg.handshake_timeout)),
        Err(e) => Err(e),
    }
}

fn ctl_loop(sock: OwnedFd, shared: Arc<Shared>) {
    let result = ctl_packets(&sock, &shared);
    if let Err(e) = result
        && !shared.closing.load(Ordering::Acquire)
    {
        tracing::warn!(link = shared.id, peer = %shared.peer, "shm link failed: {e}");
        shared.record(e);
    }
    shared.open.store(false, Ordering::Release);
    lock(&shared.acks).clear();
    // Release: pairs with the Acquire in `drain`; see there.
    shared.peer_gone.store(true, Ordering::Release);
    shared.own_bell.ring();
}

fn ctl_packets(sock: &OwnedFd, shared: &Shared) -> Result<()> {
    let mut said_bye = false;
    loop {
        let Some((op, pkt, fds)) = recv_ctl(sock.as_fd())? else {
            if said_bye || shared.closing.load(Ordering::Acquire) {
                return Ok(());
            }
            return Err(Error::Closed {
                peer: shared.peer.clone(),
                reason: "connection closed without goodbye (peer died?)".into(),
            });
        };
        match op {
            CtlOp::Grant => {
                let fd = fds.into_iter().next().expect("1 fd checked");
                let map = SharedMap::open(fd, pkt.b.get())?;
                shared
                    .remote
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(pkt.a.get(), Arc::new(map));
                send_ctl(
                    sock.as_fd(),
                    &CtlPacket::new(CtlOp::GrantAck, pkt.a.get(), 0, 0),
                    &[],
                )?;
            }
            CtlOp::Blob => {
                let len = pkt.b.get();
                shared.st.cap.check(len)?;
                let fd = fds.into_iter().next().expect("1 fd checked");
                let map = SharedMap::open(fd, len)?;
                let mut data = Vec::new();
                data.try_reserve_exact(len as usize).map_err(|_| {
                    Error::Malformed(format!("cannot allocate a {len}-byte message"))
                })?;
                // SAFETY: the mapping holds at least `len` bytes (checked by `open`).
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(map.ptr(), len as usize)
                });
                lock(&shared.blobs).insert(pkt.a.get(), data);
                send_ctl(
                    sock.as_fd(),
                    &CtlPacket::new(CtlOp::GrantAck, pkt.a.get(), 0, 0),
                    &[],
                )?;
            }
            CtlOp::GrantAck => {
                let mut acks = lock(&shared.acks);
                if let Some(waiting) = acks.get_mut(&pkt.a.get()) {
                    if let Some((_, tx)) = waiting.pop_front() {
                        let _ = tx.send(());
                    }
                    if waiting.is_empty() {
                        acks.remove(&pkt.a.get());
                    }
                }
            }
            CtlOp::Revoke => {
                shared
                    .remote
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&pkt.a.get());
            }
            CtlOp::Bye => said_bye = true,
            CtlOp::Hello | CtlOp::Refuse => {
                return Err(Error::Malformed(format!("{op:?} after the handshake")));
            }
        }
    }
}
