//! A link to one peer, whatever the medium.

use std::sync::Arc;

use crate::cq::LinkId;
use crate::error::{Error, Result, check_bounds};
use crate::region::{Region, RemoteKey};
use crate::shm::ShmLink;
use crate::tcp::TcpLink;

pub(crate) enum LinkImpl {
    Shm(ShmLink),
    Tcp(TcpLink),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::RdmaLink),
}

/// One read of a [`Link::read_batch`]: `len` bytes of the peer's region `src` from `src_off`
/// into `dst` from `dst_off`.
#[derive(Clone, Copy)]
pub struct ReadOp<'a> {
    /// The local destination.
    pub dst: &'a Region,
    /// Where in `dst`.
    pub dst_off: u64,
    /// The peer's region.
    pub src: &'a RemoteKey,
    /// Where in `src`.
    pub src_off: u64,
    /// Bytes.
    pub len: u64,
}

/// One operation of a [`Link::submit`] batch.
#[derive(Clone, Copy)]
pub enum Op<'a> {
    /// A one-sided write, as [`Link::write`]: `len` bytes of `src` from `src_off` into the
    /// peer's region `dst` from `dst_off`, with an optional immediate.
    Write {
        /// The local source.
        src: &'a Region,
        /// Where in `src`.
        src_off: u64,
        /// The peer's region.
        dst: &'a RemoteKey,
        /// Where in `dst`.
        dst_off: u64,
        /// Bytes.
        len: u64,
        /// The immediate the peer's completion queue reports once the bytes are visible.
        imm: Option<u32>,
    },
    /// A control message, as [`Link::send`].
    Send(&'a [u8]),
}

/// Reads started by [`Link::post_reads`]; it borrows their destinations until they are
/// done. Dropping it without [`PendingReads::wait`] still waits for the reads under way
/// (their answers may be landing in their destinations).
#[must_use = "the reads are complete only once waited for"]
pub struct PendingReads<'l> {
    link: &'l Link,
    posted: Vec<crossbeam_channel::Receiver<Result<()>>>,
    first: Option<crate::Error>,
    _dsts: std::marker::PhantomData<&'l Region>,
}

impl PendingReads<'_> {
    /// Waits for every read under way: `Ok` once all the batch's bytes are in place, else
    /// the first error.
    pub fn wait(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        if let LinkImpl::Tcp(l) = &self.link.inner.imp {
            for done in std::mem::take(&mut self.posted) {
                if let Err(e) = l.wait_read(&done) {
                    self.first.get_or_insert(e);
                }
            }
        }
        self.first.take().map_or(Ok(()), Err)
    }
}

impl Drop for PendingReads<'_> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// A connection to one peer. Cheap to clone; every clone is the same link, usable from many
/// threads at once. The link closes when its last clone is dropped or on [`Link::close`].
///
/// Ordering: on one link, operations issued by one thread take effect at the peer in issue
/// order. In particular a write's bytes are visible at the target before the target sees any
/// immediate or message issued after it, and a read issued after a write sees that write.
#[derive(Clone)]
pub struct Link {
    inner: Arc<Inner>,
}

struct Inner {
    imp: LinkImpl,
    node: u64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("id", &self.id())
            .field("medium", &self.medium())
            .field("peer", &self.peer())
            .finish()
    }
}

impl Link {
    pub(crate) fn new(imp: LinkImpl, node: u64) -> Link {
        Link {
            inner: Arc::new(Inner { imp, node }),
        }
    }

    /// Starts a dormant accepted link delivering (shm links are accepted dormant).
    pub(crate) fn activate(&self) -> Result<()> {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.activate(),
            _ => Ok(()),
        }
    }

    /// The link's id in this transport's completion queue.
    pub fn id(&self) -> LinkId {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.id(),
            LinkImpl::Tcp(l) => l.id(),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.id(),
        }
    }

    /// The medium's name: `shm`, `tcp` or `rdma`.
    pub fn medium(&self) -> &'static str {
        match &self.inner.imp {
            LinkImpl::Shm(_) => "shm",
            LinkImpl::Tcp(_) => "tcp",
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(_) => "rdma",
        }
    }

    /// How many TCP connections a tcp link sends on (its first and the others that joined it,
    /// see [`crate::TransportConfig::tcp_streams`]); 0 for other media. The peer's others
    /// join the accepting side a moment after the link is accepted.
    pub fn tcp_connections(&self) -> usize {
        match &self.inner.imp {
            LinkImpl::Tcp(l) => l.connections(),
            _ => 0,
        }
    }

    /// A human-readable name of the peer.
    pub fn peer(&self) -> &str {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.peer(),
            LinkImpl::Tcp(l) => l.peer(),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.peer(),
        }
    }

    /// The peer's node id.
    pub fn peer_node(&self) -> u64 {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.peer_node,
            LinkImpl::Tcp(l) => l.peer_node,
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.peer_node,
        }
    }

    /// Caps the messages the peer may send on this link from now on at `bytes` (never above
    /// [`crate::TransportConfig::max_message`]); `what` names the cap in the error that ends
    /// the link of a peer that breaks it. A link this side accepted starts at
    /// [`crate::TransportConfig::max_accepted_message`]: its role raises the cap once it knows
    /// what the peer may send (a server, for an attached worker's row requests).
    pub fn limit_messages(&self, bytes: u64, what: &str) {
        let st = match &self.inner.imp {
            LinkImpl::Shm(l) => l.state(),
            LinkImpl::Tcp(l) => l.state(),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.state(),
        };
        st.cap.set(bytes.min(st.cap.ceiling()), what);
    }

    /// False once the link has closed or failed.
    pub fn is_open(&self) -> bool {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.is_open(),
            LinkImpl::Tcp(l) => l.is_open(),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.is_open() && l.qp.is_ok(),
        }
    }

    /// Sends a control message; it arrives as [`crate::Completion::Message`]. Any length.
    pub fn send(&self, data: &[u8]) -> Result<()> {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.send(data),
            LinkImpl::Tcp(l) => l.send(data),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => {
                self.check_open()?;
                l.qp.send(data)
            }
        }
    }

    /// Lets the peer read and write `region`; returns the key to send it.
    pub fn grant(&self, region: &Region) -> Result<RemoteKey> {
        let (addr, rkey) = match &self.inner.imp {
            LinkImpl::Shm(l) => {
                l.grant(region)?;
                (0, 0)
            }
            LinkImpl::Tcp(l) => {
                l.grant(region);
                (0, 0)
            }
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.grant(region)?,
        };
        Ok(RemoteKey {
            owner: self.inner.node,
            region: region.id(),
            len: region.len(),
            addr,
            rkey,
            reserved: 0,
        })
    }

    /// Withdraws a grant; later accesses by the peer fail. On rdma the registration (and so
    /// the rkey) is per device: revoking withdraws the region from every peer.
    pub fn revoke(&self, region: &Region) -> Result<()> {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.revoke(region),
            LinkImpl::Tcp(l) => {
                l.revoke(region);
                Ok(())
            }
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => {
                l.revoke(region);
                Ok(())
            }
        }
    }

    #[cfg(feature = "rdma")]
    fn check_open(&self) -> Result<()> {
        if self.is_open() {
            return Ok(());
        }
        Err(Error::Closed {
            peer: self.peer().to_string(),
            reason: "closed".into(),
        })
    }

    fn check_key(&self, key: &RemoteKey) -> Result<()> {
        if key.owner != self.peer_node() {
            return Err(Error::Config(format!(
                "remote key of node {:#x} used on a link to node {:#x}",
                key.owner,
                self.peer_node()
            )));
        }
        Ok(())
    }

    /// One-sided write of `len` bytes from `src[src_off..]` into the peer's region `dst` at
    /// `dst_off`. With `imm`, the peer's completion queue reports
    /// [`crate::Completion::WriteImm`] once the bytes are visible there. Returns when `src`
    /// may be reused.
    pub fn write(
        &self,
        src: &Region,
        src_off: u64,
        dst: &RemoteKey,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<()> {
        let ptr = self.check_write(src, src_off, dst, dst_off, len)?;
        self.issue_write(src, ptr, dst, dst_off, len, imm)
    }

    /// Checks a write (the key is for this peer, both ranges in bounds); returns where its
    /// bytes start in `src`.
    fn check_write(
        &self,
        src: &Region,
        src_off: u64,
        dst: &RemoteKey,
        dst_off: u64,
        len: u64,
    ) -> Result<*mut u8> {
        self.check_key(dst)?;
        let ptr = src.span("local write source", src_off, len)?;
        check_bounds("remote write destination", dst_off, len, dst.len)?;
        Ok(ptr)
    }

    /// Issues a write [`Link::check_write`] passed: `len` bytes at `ptr`, inside `src`.
    fn issue_write(
        &self,
        src: &Region,
        ptr: *mut u8,
        dst: &RemoteKey,
        dst_off: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<()> {
        #[cfg(not(feature = "rdma"))]
        let _ = src;
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.write(ptr, len, dst.region, dst_off, imm),
            LinkImpl::Tcp(l) => l.write(ptr, len, dst.region, dst_off, imm),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => {
                self.check_open()?;
                l.qp.write(src, ptr, len, dst.addr.wrapping_add(dst_off), dst.rkey, imm)
            }
        }
    }

    /// Carries out `ops` in order, as the same [`Link::write`] and [`Link::send`] calls one
    /// after another would, and returns when every source may be reused. Over tcp they go out
    /// in one write (one system call, and the peer's reader finds them together), so a push
    /// and the request right behind it, or an acknowledgement and an answer, cost one. Every
    /// write is checked before anything is issued: a bad one fails the batch with nothing
    /// sent. Over shm and rdma the ops are issued one by one; an error stops the batch there.
    pub fn submit(&self, ops: &[Op<'_>]) -> Result<()> {
        // Each write's source, checked (null for a message).
        let sources = ops
            .iter()
            .map(|op| match *op {
                Op::Write {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    len,
                    ..
                } => self.check_write(src, src_off, dst, dst_off, len),
                Op::Send(_) => Ok(std::ptr::null_mut()),
            })
            .collect::<Result<Vec<_>>>()?;
        let checked = ops.iter().zip(sources);
        if let LinkImpl::Tcp(l) = &self.inner.imp {
            let frames: Vec<crate::tcp::Frame<'_>> = checked
                .map(|(op, ptr)| match *op {
                    Op::Write {
                        dst,
                        dst_off,
                        len,
                        imm,
                        ..
                    } => {
                        // SAFETY: `ptr..ptr + len` was checked above to lie inside `src`,
                        // which `ops` borrows for as long as the frames live.
                        let payload = unsafe { std::slice::from_raw_parts(ptr, len as usize) };
                        crate::tcp::Frame::write(payload, dst.region, dst_off, imm)
                    }
                    Op::Send(data) => crate::tcp::Frame::send(data),
                })
                .collect();
            return l.send_all(&frames);
        }
        for (op, ptr) in checked {
            match *op {
                Op::Write {
                    src,
                    dst,
                    dst_off,
                    len,
                    imm,
                    ..
                } => self.issue_write(src, ptr, dst, dst_off, len, imm)?,
                Op::Send(data) => self.send(data)?,
            }
        }
        Ok(())
    }

    /// One-sided read of `len` bytes from the peer's region `src` at `src_off` into
    /// `dst[dst_off..]`. Returns when the bytes are in `dst`.
    pub fn read(
        &self,
        dst: &Region,
        dst_off: u64,
        src: &RemoteKey,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        self.check_key(src)?;
        let ptr = dst.span("local read destination", dst_off, len)?;
        check_bounds("remote read source", src_off, len, src.len)?;
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.read(ptr, len, src.region, src_off),
            LinkImpl::Tcp(l) => l.read(dst, ptr, len, src.region, src_off),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => {
                self.check_open()?;
                l.qp.read(dst, ptr, len, src.addr.wrapping_add(src_off), src.rkey)
            }
        }
    }

    /// Whether the peer's granted regions are mapped into this process (shm), so that
    /// [`Link::read_mapped`] reads them with a plain copy, without the peer.
    pub fn maps_peer_memory(&self) -> bool {
        matches!(self.inner.imp, LinkImpl::Shm(_))
    }

    /// Copies `out.len()` bytes of the peer's region `src`, from `src_off`, into `out`, here
    /// and now: where [`Link::maps_peer_memory`] (shm), a copy out of the peer's mapping.
    /// Unlike [`Link::read`] it needs no registered destination, and it still reads after
    /// the link closed, while the mapping lasts (the peer's memory stays mapped until the
    /// link is dropped or the region revoked). Other media refuse it with
    /// [`Error::Config`]; a key of another node, a region never granted on this link or a
    /// range outside it are refused with nothing read.
    pub fn read_mapped(&self, src: &RemoteKey, src_off: u64, out: &mut [u8]) -> Result<()> {
        self.check_key(src)?;
        let len = out.len() as u64;
        check_bounds("remote read source", src_off, len, src.len)?;
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.read_mapped(out, src.region, src_off),
            _ => Err(Error::Config(format!(
                "reading a peer's memory in place needs shm, not {}",
                self.medium()
            ))),
        }
    }

    /// One-sided reads (each as [`Link::read`]), carried out by the peer in the order given;
    /// returns when all their bytes are in place, or with the first error once none is still
    /// under way. Over tcp the requests go out back to back and their answers are awaited
    /// together: the batch costs one round trip, not one per read.
    pub fn read_batch(&self, reads: &[ReadOp<'_>]) -> Result<()> {
        self.post_reads(reads).wait()
    }

    /// Starts the reads of a [`Link::read_batch`] and returns at once where the medium allows
    /// (tcp); [`PendingReads::wait`] finishes them. Reads posted on several links before
    /// any is waited for are under way together. Every read is checked before any is
    /// issued: a bad one fails the whole batch, with nothing sent.
    pub fn post_reads<'l>(&'l self, reads: &[ReadOp<'l>]) -> PendingReads<'l> {
        let mut pending = PendingReads {
            link: self,
            posted: Vec::new(),
            first: None,
            _dsts: std::marker::PhantomData,
        };
        let mut spans = Vec::with_capacity(reads.len());
        for r in reads {
            let checked = self.check_key(r.src).and_then(|()| {
                let ptr = r.dst.span("local read destination", r.dst_off, r.len)?;
                check_bounds("remote read source", r.src_off, r.len, r.src.len)?;
                Ok(ptr)
            });
            match checked {
                Ok(ptr) => spans.push(ptr),
                Err(e) => {
                    pending.first = Some(e);
                    return pending;
                }
            }
        }
        match &self.inner.imp {
            LinkImpl::Tcp(l) => {
                let items: Vec<_> = reads
                    .iter()
                    .zip(&spans)
                    .map(|(r, &ptr)| (r.dst, ptr, r.len, r.src.region, r.src_off))
                    .collect();
                match l.post_reads(&items) {
                    Ok(done) => pending.posted = done,
                    Err(e) => pending.first = Some(e),
                }
            }
            _ => {
                for r in reads {
                    if let Err(e) = self.read(r.dst, r.dst_off, r.src, r.src_off, r.len) {
                        pending.first = Some(e);
                        break;
                    }
                }
            }
        }
        pending
    }

    /// Closes the link (both sides get [`crate::Completion::Closed`]).
    pub fn close(&self) {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.close(),
            LinkImpl::Tcp(l) => l.close(),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.close(),
        }
    }

    /// Test hook: puts raw bytes on the medium (tcp stream, shm ring) as a broken peer would.
    #[doc(hidden)]
    pub fn inject_raw(&self, bytes: &[u8]) -> Result<()> {
        match &self.inner.imp {
            LinkImpl::Shm(l) => l.send_raw(bytes),
            LinkImpl::Tcp(l) => l.send_raw(bytes),
            #[cfg(feature = "rdma")]
            LinkImpl::Rdma(l) => l.ctl.send_raw(bytes),
        }
    }
}
