//! The rdma medium (feature `rdma`): RDMA verbs over the system libibverbs, through rdma-sys.
//!
//! One [`Device`] per transport: a context, a protection domain, one completion queue with a
//! completion channel, a registration cache, and a progress thread that polls the queue for a
//! bounded time and then blocks on the channel (no unbounded busy-polling).
//!
//! An RDMA link is a reliable-connected queue pair plus a tcp control link. The tcp link
//! carries the handshake (job, node, queue-pair numbers, GIDs), liveness and the goodbye; the
//! queue pair carries everything else, in order: one-sided writes are RDMA WRITE (WITH_IMM when
//! there is an immediate), reads are RDMA READ, control messages are SENDs into receive buffers
//! posted in advance (a message longer than one buffer is fragmented; RC keeps fragments in
//! order). Immediates and messages consume the same pre-posted receives, reposted as soon as
//! they complete; a burst that outruns them gets receiver-not-ready retries, never loss.
//!
//! All `unsafe` here is FFI into libibverbs; each block says what it relies on.

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use rdma_sys::*;
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

use crate::cq::{Completion, CompletionQueue, LinkId, Spin, lock, spin_for};
use crate::error::{Error, Result};
use crate::region::{Region, RegionInner};

/// Receive buffers per queue pair, and their size. A message fragment carries one flag byte.
const RECV_BUFS: usize = 128;
const BUF: usize = 8192;
const FRAG: usize = BUF - 1;
const FLAG_MORE: u8 = 1;
/// Send-queue depth; fragments are posted in batches that fit.
const SQ_DEPTH: u32 = 256;
const SEND_BATCH: usize = 128;
/// The largest piece one RDMA WRITE/READ work request moves (ports allow up to 2 GiB).
const MAX_CHUNK: u64 = 1 << 30;

fn errno_error(what: &'static str) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

/// Why RDMA cannot be used here, phrased for the user.
fn unavailable(why: impl Into<String>) -> Error {
    Error::MediumUnavailable {
        medium: "rdma",
        why: why.into(),
    }
}

/// The locked-memory limit (`ulimit -l`) in bytes, `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Memlock).current
}

/// One port of one device, as `falcon doctor` shows it.
#[derive(Debug, Clone)]
pub struct PortInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (1-based).
    pub port: u8,
    /// `ACTIVE`, `DOWN`…
    pub state: String,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// GID table entries that are set, as (index, text).
    pub gids: Vec<(i32, String)>,
}

fn mtu_bytes(m: ibv_mtu::Type) -> u32 {
    128 << m.clamp(1, 5)
}

fn port_state(s: ibv_port_state::Type) -> &'static str {
    match s {
        ibv_port_state::IBV_PORT_DOWN => "DOWN",
        ibv_port_state::IBV_PORT_INIT => "INIT",
        ibv_port_state::IBV_PORT_ARMED => "ARMED",
        ibv_port_state::IBV_PORT_ACTIVE => "ACTIVE",
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => "ACTIVE_DEFER",
        _ => "NOP",
    }
}

fn gid_text(g: &ibv_gid) -> String {
    // SAFETY: `raw` is the union's plain 16-byte view; every bit pattern is valid.
    let raw = unsafe { g.raw };
    raw.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// The device list, closed on drop.
struct DeviceList {
    list: *mut *mut ibv_device,
    n: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut n = 0i32;
        // SAFETY: plain FFI call with a valid out-pointer.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            let why = match e.raw_os_error() {
                Some(libc_enosys) if libc_enosys == rustix::io::Errno::NOSYS.raw_os_error() => {
                    "this kernel has no RDMA support (no /dev/infiniband); load an RDMA driver or use tcp".to_string()
                }
                _ => format!("cannot list RDMA devices: {e}"),
            };
            return Err(unavailable(why));
        }
        Ok(DeviceList {
            list,
            n: n.max(0) as usize,
        })
    }

    fn devices(&self) -> impl Iterator<Item = (*mut ibv_device, String)> + '_ {
        (0..self.n).map(|i| {
            // SAFETY: the list holds `n` valid device pointers while `self` lives.
            let dev = unsafe { *self.list.add(i) };
            // SAFETY: a valid device has a NUL-terminated name.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            (dev, name)
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(self.list) }
    }
}

/// Runs `f` on each device of the system, opened (and closed after), with its name.
fn each_device<T>(mut f: impl FnMut(*mut ibv_context, &str) -> Result<T>) -> Result<Vec<T>> {
    let list = DeviceList::get()?;
    let mut out = Vec::new();
    for (dev, name) in list.devices() {
        // SAFETY: `dev` is valid while the list lives.
        let ctx = unsafe { ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(errno_error("open RDMA device"));
        }
        let r = f(ctx, &name);
        // SAFETY: opened above, closed once, after `f` is done with it.
        unsafe { ibv_close_device(ctx) };
        out.push(r?);
    }
    Ok(out)
}

/// Lists every device and port (for `falcon doctor`).
pub fn ports() -> Result<Vec<PortInfo>> {
    let per_device = each_device(|ctx, name| {
        let mut out = Vec::new();
        // SAFETY: `ibv_device_attr` is plain C data: all zeroes is a valid value.
        let mut da: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        let nports = if unsafe { ibv_query_device(ctx, &mut da) } == 0 {
            da.phys_port_cnt
        } else {
            1
        };
        for port in 1..=nports {
            // SAFETY: `ibv_port_attr` is plain C data: all zeroes is a valid value.
            let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
            // SAFETY: valid context and out-pointer.
            if unsafe { ___ibv_query_port(ctx, port, &mut pa) } != 0 {
                continue;
            }
            let mut gids = Vec::new();
            for idx in 0..pa.gid_tbl_len.min(16) {
                // SAFETY: `ibv_gid` is a union of plain bytes: all zeroes is a valid value.
                let mut g: ibv_gid = unsafe { std::mem::zeroed() };
                // SAFETY: valid context, index within the table, out-pointer.
                let found = unsafe { ibv_query_gid(ctx, port, idx, &mut g) } == 0;
                // SAFETY: reading the union's raw bytes is valid whatever the library wrote
                // (every field is bytes).
                if found && unsafe { g.raw } != [0u8; 16] {
                    gids.push((idx, gid_text(&g)));
                }
            }
            out.push(PortInfo {
                device: name.to_string(),
                port,
                state: port_state(pa.state).into(),
                link_layer: if pa.link_layer == LINK_LAYER_ETHERNET {
                    "Ethernet (RoCE)".into()
                } else {
                    "InfiniBand".into()
                },
                mtu: mtu_bytes(pa.active_mtu),
                lid: pa.lid,
                gids,
            });
        }
        Ok(out)
    })?;
    Ok(per_device.into_iter().flatten().collect())
}

// libibverbs exports `ibv_reg_dmabuf_mr` since rdma-core 34 (symbol version IBVERBS_1.12);
// rdma-sys 0.3 does not bind it.
unsafe extern "C" {
    fn ibv_reg_dmabuf_mr(
        pd: *mut ibv_pd,
        offset: u64,
        length: usize,
        iova: u64,
        fd: i32,
        access: i32,
    ) -> *mut ibv_mr;
}

/// Whether a device's verbs stack registers dma-bufs, asked as NCCL asks: register fd -1
/// with no length. `EOPNOTSUPP` or `EPROTONOSUPPORT` mean the provider or the kernel has no
/// dma-buf registration; any other failure (`EBADF` for the bad fd) means the call reached a
/// provider that has it.
fn probe_dmabuf(pd: *mut ibv_pd) -> bool {
    // SAFETY: a valid protection domain; fd -1 and length 0 make the call fail before it
    // touches memory (the provider checks the fd); a registration that somehow succeeded is
    // released at once.
    let mr = unsafe { ibv_reg_dmabuf_mr(pd, 0, 0, 0, -1, 0) };
    if !mr.is_null() {
        // SAFETY: registered just above, deregistered once.
        unsafe { ibv_dereg_mr(mr) };
        return true;
    }
    let errno = std::io::Error::last_os_error().raw_os_error();
    !(errno == Some(rustix::io::Errno::OPNOTSUPP.raw_os_error())
        || errno == Some(rustix::io::Errno::PROTONOSUPPORT.raw_os_error()))
}

/// Whether each RDMA device registers dma-bufs (the first step of GPUDirect RDMA without the
/// peer-memory module), by NCCL's probe: `(device, supported)` for every device; an error
/// when there is no RDMA at all.
pub fn dmabuf_support() -> Result<Vec<(String, bool)>> {
    each_device(|ctx, name| {
        // SAFETY: a valid context; the result is checked.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(errno_error("allocate an RDMA protection domain"));
        }
        let supported = probe_dmabuf(pd);
        // SAFETY: allocated above, released once.
        unsafe { ibv_dealloc_pd(pd) };
        Ok((name.to_string(), supported))
    })
}

/// A registered memory region, deregistered on drop.
struct Mr(*mut ibv_mr);
// SAFETY: an MR handle may be used and deregistered from any thread.
unsafe impl Send for Mr {}
// SAFETY: shared use only reads its keys; libibverbs needs no lock for that.
unsafe impl Sync for Mr {}
impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; no work request uses it any more
        // (its region is gone, or its queue pair was destroyed first).
        unsafe { ibv_dereg_mr(self.0) };
    }
}
impl Mr {
    fn lkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.0).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: valid MR.
        unsafe { (*self.0).rkey }
    }
}

/// What is exchanged over the tcp control link to connect two queue pairs.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub(crate) struct QpInfo {
    /// 1 if this side has a usable device, else 0 (then `reason` explains).
    ok: u32,
    qpn: u32,
    psn: u32,
    lid: u16,
    mtu: u8,
    global: u8,
    gid: [u8; 16],
}

/// A cached registration: the region it belongs to (weakly) and its MR.
type Registration = (Weak<RegionInner>, Arc<Mr>);

/// A device opened for one transport.
pub(crate) struct Device {
    name: String,
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    channel: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    port: u8,
    gid_index: i32,
    gid: ibv_gid,
    lid: u16,
    mtu: ibv_mtu::Type,
    global: bool,
    max_chunk: u64,
    spin: Spin,
    /// Registration cache: region id → (the region, its MR).
    mrs: Mutex<HashMap<u64, Registration>>,
    /// Queue pairs by number, for dispatching completions.
    qps: RwLock<HashMap<u32, Arc<QpState>>>,
    /// The generation given to the next queue pair (see [`GEN_SHIFT`]).
    next_gen: AtomicU64,
    /// Serializes polling (progress thread and close hooks) so completions keep their order.
    poll_lock: Mutex<()>,
    out: CompletionQueue,
    stop: AtomicBool,
}

// SAFETY: libibverbs objects are thread-safe (the library locks internally); the raw pointers
// are owned by this struct and freed once in Drop, after the progress thread has stopped.
unsafe impl Send for Device {}
// SAFETY: as for `Send`: every use through `&Device` is a thread-safe verbs call.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rdma device {} port {}", self.name, self.port)
    }
}

impl Device {
    /// Opens `want` (or the first device with an active port) for a transport.
    pub(crate) fn open(
        want: Option<&str>,
        gid_index: i32,
        out: CompletionQueue,
    ) -> Result<Arc<Device>> {
        let list = DeviceList::get()?;
        let names: Vec<String> = list.devices().map(|(_, n)| n).collect();
        if names.is_empty() {
            return Err(unavailable("no RDMA device found (ibv_devices lists none)"));
        }
        let mut last_err = None;
        for (dev, name) in list.devices() {
            if want.is_some_and(|w| w != name) {
                continue;
            }
            match Self::open_one(dev, &name, gid_index, out.clone()) {
                Ok(d) => return Ok(d),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| {
            unavailable(format!(
                "RDMA device {:?} not found; devices: {}",
                want.unwrap_or(""),
                names.join(", ")
            ))
        }))
    }

    fn open_one(
        dev: *mut ibv_device,
        name: &str,
        gid_index: i32,
        out: CompletionQueue,
    ) -> Result<Arc<Device>> {
        let spin = out.spin().clone();
        // SAFETY: `dev` is valid while the caller's list lives.
        let ctx = unsafe { ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(unavailable(format!(
                "cannot open {name}: {}",
                std::io::Error::last_os_error()
            )));
        }
        let port = 1u8;
        // SAFETY: `ibv_port_attr` is plain C data: all zeroes is a valid value.
        let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        if unsafe { ___ibv_query_port(ctx, port, &mut pa) } != 0 {
            // SAFETY: opened above, closed once on this path.
            unsafe { ibv_close_device(ctx) };
            return Err(errno_error("query RDMA port"));
        }
        if pa.state != ibv_port_state::IBV_PORT_ACTIVE {
            // SAFETY: opened above.
            unsafe { ibv_close_device(ctx) };
            return Err(unavailable(format!(
                "port {port} of {name} is {}: bring the link up (`ip link set <netdev> up`, check the cable or the subnet manager)",
                port_state(pa.state)
            )));
        }
        let global = pa.link_layer == LINK_LAYER_ETHERNET || pa.lid == 0;
        // SAFETY: `ibv_gid` is a union of plain bytes: all zeroes is a valid value.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        if unsafe { ibv_query_gid(ctx, port, gid_index, &mut gid) } != 0 && global {
            // SAFETY: opened above, closed once on this path.
            unsafe { ibv_close_device(ctx) };
            return Err(unavailable(format!(
                "{name} has no GID at index {gid_index} (set FALCON_RDMA_GID_INDEX)"
            )));
        }
        // SAFETY: FFI constructors on a valid context; each result is checked.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        // SAFETY: as above.
        let channel = unsafe { ibv_create_comp_channel(ctx) };
        let cq = if channel.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: as above, on a channel just created and checked non-null.
            unsafe { ibv_create_cq(ctx, 4096, std::ptr::null_mut(), channel, 0) }
        };
        if pd.is_null() || channel.is_null() || cq.is_null() {
            let e = errno_error("create RDMA protection domain / completion queue");
            // SAFETY: free what was created, in reverse order.
            unsafe {
                if !cq.is_null() {
                    ibv_destroy_cq(cq);
                }
                if !channel.is_null() {
                    ibv_destroy_comp_channel(channel);
                }
                if !pd.is_null() {
                    ibv_dealloc_pd(pd);
                }
                ibv_close_device(ctx);
            }
            return Err(e);
        }
        let max_chunk = u64::from(pa.max_msg_sz).clamp(4096, MAX_CHUNK);
        let d = Arc::new(Device {
            name: name.to_string(),
            ctx,
            pd,
            channel,
            cq,
            port,
            gid_index,
            gid,
            lid: pa.lid,
            mtu: pa.active_mtu,
            global,
            max_chunk,
            spin,
            mrs: Mutex::new(HashMap::new()),
            qps: RwLock::new(HashMap::new()),
            next_gen: AtomicU64::new(1),
            poll_lock: Mutex::new(()),
            out,
            stop: AtomicBool::new(false),
        });
        let d2 = d.clone();
        std::thread::Builder::new()
            .name(format!("falcon-rdma-{name}"))
            .spawn(move || d2.progress())
            .map_err(|e| Error::io("spawn rdma progress thread", e))?;
        tracing::info!(
            "rdma: using {name} port {port}, MTU {}, {}",
            mtu_bytes(pa.active_mtu),
            if global { "GID" } else { "LID" }
        );
        Ok(d)
    }

    /// Stops the progress thread (which holds a reference to the device).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Registers `region` (cached; never per message).
    fn register(&self, region: &Region) -> Result<Arc<Mr>> {
        let mut mrs = lock(&self.mrs);
        if let Some((weak, mr)) = mrs.get(&region.id())
            && weak
                .upgrade()
                .is_some_and(|r| Arc::ptr_eq(&r, &region.inner))
        {
            return Ok(mr.clone());
        }
        // Forget registrations of regions that are gone.
        mrs.retain(|_, (w, _)| w.strong_count() > 0);
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0 as i32;
        let len = region.len().max(1) as usize;
        // SAFETY: the region's mapping is at least max(len, 1) bytes and outlives the MR (the
        // cache drops the MR once the region is gone; links keep their own regions alive).
        let mr = unsafe { ibv_reg_mr(self.pd, region.as_ptr().cast(), len, access) };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            let limit = memlock_limit();
            if let Some(limit) = limit
                && (e.raw_os_error() == Some(rustix::io::Errno::NOMEM.raw_os_error())
                    || e.raw_os_error() == Some(rustix::io::Errno::PERM.raw_os_error())
                    || e.raw_os_error() == Some(rustix::io::Errno::FAULT.raw_os_error()))
            {
                return Err(Error::Memlock {
                    needed: len as u64,
                    limit,
                });
            }
            return Err(Error::io("register memory for RDMA (ibv_reg_mr)", e));
        }
        let mr = Arc::new(Mr(mr));
        mrs.insert(region.id(), (Arc::downgrade(&region.inner), mr.clone()));
        Ok(mr)
    }

    /// Grants remote access to `region`: (address, rkey) for its remote key.
    pub(crate) fn grant(&self, region: &Region) -> Result<(u64, u32)> {
        let mr = self.register(region)?;
        Ok((region.as_ptr() as u64, mr.rkey()))
    }

    fn progress(self: Arc<Self>) {
        let mut idle_since = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            if self.poll() > 0 {
                idle_since = Instant::now();
                continue;
            }
            if idle_since.elapsed() < self.spin.get() {
                std::hint::spin_loop();
                continue;
            }
            // Arm the queue, then poll once more: a completion that slipped in between is seen
            // now, and any later one triggers an event.
            // SAFETY: valid CQ.
            unsafe { ibv_req_notify_cq(self.cq, 0) };
            if self.poll() > 0 {
                idle_since = Instant::now();
                continue;
            }
            // SAFETY: the channel's fd is valid while the device lives.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*self.channel).fd) };
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            let timeout = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            if matches!(rustix::event::poll(&mut fds, Some(&timeout)), Ok(n) if n > 0) {
                let mut ev_cq: *mut ibv_cq = std::ptr::null_mut();
                let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
                // SAFETY: the fd is readable, so this does not block; out-pointers are valid.
                if unsafe { ibv_get_cq_event(self.channel, &mut ev_cq, &mut ev_ctx) } == 0 {
                    // SAFETY: acknowledges the one event just taken.
                    unsafe { ibv_ack_cq_events(ev_cq, 1) };
                }
            }
            idle_since = Instant::now();
        }
    }

    /// Polls the completion queue dry; returns how many completions were handled.
    pub(crate) fn poll(&self) -> usize {
        let _g = lock(&self.poll_lock);
        let mut total = 0;
        loop {
            // SAFETY: ibv_wc is plain data; zeroed is a valid initial value.
            let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
            // SAFETY: valid CQ, buffer of 16 entries.
            let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
            if n <= 0 {
                return total;
            }
            for wc in &wcs[..n as usize] {
                self.dispatch(wc);
            }
            total += n as usize;
        }
    }

    fn dispatch(&self, wc: &ibv_wc) {
        let qp = self
            .qps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&wc.qp_num)
            .cloned();
        let Some(qp) = qp else { return };
        if (wc.wr_id >> GEN_SHIFT) & GEN_MASK != qp.generation {
            // An earlier queue pair with the same number: not this one's business.
            return;
        }
        let id = wc.wr_id & ID_MASK;
        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
        // `opcode` is undefined in an error completion: our receive ids carry RECV_TAG.
        let is_recv = wc.wr_id & RECV_TAG != 0;
        if !ok {
            let err = wc_error(wc.status, &self.name);
            // Flushes after the first error add nothing.
            qp.fail(err.clone());
            if !is_recv {
                qp.complete(id, Some(err));
            }
            return;
        }
        if !is_recv {
            qp.complete(id, None);
            return;
        }
        let buf = id as usize;
        match wc.opcode {
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => {
                // SAFETY: the union holds the immediate for this opcode.
                let imm = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
                self.out.push(Completion::WriteImm { link: qp.link, imm });
            }
            _ => {
                let len = (wc.byte_len as usize).min(BUF);
                if len == 0 || buf >= RECV_BUFS {
                    qp.fail(Error::Malformed(format!(
                        "RDMA message fragment of {len} bytes in buffer {buf}"
                    )));
                    return;
                }
                let mut frag = vec![0u8; len];
                qp.recv
                    .read_at((buf * BUF) as u64, &mut frag)
                    .expect("in bounds");
                let mut partial = lock(&qp.partial);
                if partial.len() as u64 + len as u64 > qp.max_message {
                    drop(partial);
                    qp.fail(Error::Malformed(format!(
                        "message exceeds the {}-byte limit",
                        qp.max_message
                    )));
                    return;
                }
                partial.extend_from_slice(&frag[1..]);
                if frag[0] & FLAG_MORE == 0 {
                    let data = std::mem::take(&mut *partial);
                    self.out.push(Completion::Message {
                        link: qp.link,
                        data,
                    });
                }
            }
        }
        if let Err(e) = qp.post_recv(buf) {
            qp.fail(e);
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        lock(&self.mrs).clear();
        // SAFETY: every queue pair was destroyed by its link (which holds the device alive);
        // the progress thread has exited (it held a reference). Free in reverse order.
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

/// `IBV_LINK_LAYER_ETHERNET` from verbs.h (not in rdma-sys's bindings): RoCE.
const LINK_LAYER_ETHERNET: u8 = 2;

/// How a flushed work request's error begins.
const FLUSHED: &str = "queue pair flushed";

/// Tag on receive work-request ids.
const RECV_TAG: u64 = 1 << 63;

/// Work-request ids carry their queue pair's generation in bits 48..63: a device reuses a
/// destroyed queue pair's number at once (soft-RoCE does), and completions of the old queue
/// pair still in the shared completion queue must not reach the new one (a stale send
/// completion would mark the new one's requests done; a flushed receive would fail it).
const GEN_SHIFT: u32 = 48;
/// The generation bits (15: bit 63 is [`RECV_TAG`]).
const GEN_MASK: u64 = 0x7FFF;
/// The id or buffer bits.
const ID_MASK: u64 = (1 << GEN_SHIFT) - 1;

fn wc_error(status: ibv_wc_status::Type, dev: &str) -> Error {
    match status {
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_LOC_PROT_ERR => {
            Error::Remote(format!(
                "RDMA access refused ({}): the region is not granted or the range is out of its bounds",
                wc_status_name(status)
            ))
        }
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => {
            Error::Closed {
                peer: dev.to_string(),
                reason: format!(
                    "peer unreachable ({}): it died or the fabric is down",
                    wc_status_name(status)
                ),
            }
        }
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => Error::Closed {
            peer: dev.to_string(),
            reason: format!("{FLUSHED} after an error"),
        },
        s => Error::Remote(format!("RDMA work request failed: {}", wc_status_name(s))),
    }
}

fn wc_status_name(status: ibv_wc_status::Type) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    unsafe { CStr::from_ptr(ibv_wc_status_str(status)) }
        .to_string_lossy()
        .into_owned()
}

/// Per-queue-pair state the progress thread needs.
struct QpState {
    link: LinkId,
    qp: *mut ibv_qp,
    /// Receive buffers (RECV_BUFS × BUF) and their registration.
    recv: Region,
    recv_mr: Arc<Mr>,
    partial: Mutex<Vec<u8>>,
    max_message: u64,
    /// Highest send work-request id completed (completions on an RC send queue are in order).
    done: AtomicU64,
    error: Mutex<Option<Error>>,
    waiter: Mutex<Option<std::thread::Thread>>,
    failed: AtomicBool,
    on_fail: OnceLock<Box<dyn Fn(Error) + Send + Sync>>,
    /// Tags this queue pair's work-request ids (see [`GEN_SHIFT`]).
    generation: u64,
    /// False once the queue pair is being destroyed. The progress thread reposts receive
    /// buffers on a queue pair it found in the device's map; it does so under the read lock,
    /// and the destroyer flips this under the write lock first, so no verb ever reaches a
    /// destroyed queue pair (that raced: a segfault with two links closing at once).
    alive: RwLock<bool>,
}

// SAFETY: the QP pointer is used only through thread-safe verbs calls.
unsafe impl Send for QpState {}
// SAFETY: as for `Send`; destruction is fenced by `alive` under its write lock.
unsafe impl Sync for QpState {}

impl QpState {
    fn post_recv(&self, buf: usize) -> Result<()> {
        let mut sge = ibv_sge {
            addr: self.recv.as_ptr() as u64 + (buf * BUF) as u64,
            length: BUF as u32,
            lkey: self.recv_mr.lkey(),
        };
        // SAFETY: zeroed is a valid empty work request; fields set below.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = RECV_TAG | (self.generation << GEN_SHIFT) | buf as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        let alive = self.alive.read().unwrap_or_else(|p| p.into_inner());
        if !*alive {
            // Being destroyed: nothing more to receive.
            return Ok(());
        }
        // SAFETY: a live QP (the destroyer waits for this read lock to go); the buffer lies
        // in a registered region kept alive by `self`.
        if unsafe { ibv_post_recv(self.qp, &mut wr, &mut bad) } != 0 {
            return Err(errno_error("post RDMA receive"));
        }
        drop(alive);
        Ok(())
    }

    /// Records why the queue pair failed. The first specific cause wins; a flush (the echo of
    /// an earlier error on every outstanding request) never hides the error that caused it.
    fn record(&self, err: Error) {
        let is_flush =
            |e: &Error| matches!(e, Error::Closed { reason, .. } if reason.starts_with(FLUSHED));
        let mut slot = lock(&self.error);
        match slot.as_ref() {
            None => *slot = Some(err),
            Some(old) if is_flush(old) && !is_flush(&err) => *slot = Some(err),
            Some(_) => {}
        }
    }

    fn complete(&self, id: u64, err: Option<Error>) {
        if let Some(e) = err {
            self.record(e);
        }
        self.done.fetch_max(id, Ordering::AcqRel);
        if let Some(t) = lock(&self.waiter).as_ref() {
            t.unpark();
        }
    }

    fn fail(&self, err: Error) {
        // The cause is recorded before the flag is raised: a waiter that sees `failed` reads
        // the error next, and must find it (raising the flag first let a refused write
        // return Ok to a waiter that looked in between).
        self.record(err.clone());
        if self.failed.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(link = self.link, "rdma link failed: {err}");
        if let Some(t) = lock(&self.waiter).as_ref() {
            t.unpark();
        }
        if let Some(f) = self.on_fail.get() {
            f(err);
        }
    }
}

/// The queue-pair half of an RDMA link.
pub(crate) struct RdmaQp {
    dev: Arc<Device>,
    state: Arc<QpState>,
    /// Serializes posting, so one operation's work requests are contiguous and waited for.
    post: Mutex<u64>,
    send_buf: Region,
    send_mr: Arc<Mr>,
    op_timeout: Duration,
}

impl RdmaQp {
    /// Creates a queue pair (state INIT) with its receives posted.
    pub(crate) fn create(
        dev: &Arc<Device>,
        link: LinkId,
        max_message: u64,
        op_timeout: Duration,
    ) -> Result<RdmaQp> {
        // SAFETY: zeroed init attributes are valid; the fields that matter are set.
        let mut ia: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        ia.send_cq = dev.cq;
        ia.recv_cq = dev.cq;
        ia.qp_type = ibv_qp_type::IBV_QPT_RC;
        ia.cap.max_send_wr = SQ_DEPTH;
        ia.cap.max_recv_wr = RECV_BUFS as u32;
        ia.cap.max_send_sge = 1;
        ia.cap.max_recv_sge = 1;
        // SAFETY: valid PD and attributes.
        let qp = unsafe { ibv_create_qp(dev.pd, &mut ia) };
        if qp.is_null() {
            return Err(errno_error("create RDMA queue pair"));
        }
        let destroy = |e: Error| {
            // SAFETY: created above, destroyed once on this error path.
            unsafe { ibv_destroy_qp(qp) };
            e
        };
        let recv = Region::new((RECV_BUFS * BUF) as u64).map_err(destroy)?;
        let recv_mr = dev.register(&recv).map_err(destroy)?;
        let send_buf = Region::new((SEND_BATCH * BUF) as u64).map_err(destroy)?;
        let send_mr = dev.register(&send_buf).map_err(destroy)?;
        // SAFETY: zeroed attributes, then the INIT fields.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = dev.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        // SAFETY: valid QP and attributes.
        if unsafe { ibv_modify_qp(qp, &mut a, mask.0 as i32) } != 0 {
            return Err(destroy(errno_error("RDMA queue pair to INIT")));
        }
        let state = Arc::new(QpState {
            link,
            qp,
            recv,
            recv_mr,
            partial: Mutex::new(Vec::new()),
            max_message,
            done: AtomicU64::new(0),
            error: Mutex::new(None),
            waiter: Mutex::new(None),
            failed: AtomicBool::new(false),
            on_fail: OnceLock::new(),
            generation: dev.next_gen.fetch_add(1, Ordering::Relaxed) & GEN_MASK,
            alive: RwLock::new(true),
        });
        for buf in 0..RECV_BUFS {
            state.post_recv(buf).map_err(destroy)?;
        }
        // SAFETY: valid QP.
        let qpn = unsafe { (*qp).qp_num };
        dev.qps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(qpn, state.clone());
        Ok(RdmaQp {
            dev: dev.clone(),
            state,
            post: Mutex::new(0),
            send_buf,
            send_mr,
            op_timeout,
        })
    }

    /// What the peer needs to connect to this queue pair.
    pub(crate) fn info(&self) -> QpInfo {
        QpInfo {
            ok: 1,
            // SAFETY: valid QP.
            qpn: unsafe { (*self.state.qp).qp_num },
            psn: 0,
            lid: self.dev.lid,
            mtu: self.dev.mtu as u8,
            global: self.dev.global as u8,
            // SAFETY: plain 16-byte view of the GID.
            gid: unsafe { self.dev.gid.raw },
        }
    }

    /// The info a side without a usable device sends.
    pub(crate) fn refusal() -> QpInfo {
        QpInfo::new_zeroed()
    }

    /// Moves the queue pair to RTR then RTS, connected to `peer`.
    pub(crate) fn connect(&self, peer: &QpInfo) -> Result<()> {
        if peer.ok != 1 {
            return Err(unavailable("the peer has no usable RDMA device"));
        }
        let qp = self.state.qp;
        // SAFETY: zeroed attributes, then the RTR fields.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        // Path MTU: the smaller of ours and theirs (soft-RoCE defaults to 1024).
        a.path_mtu = (self.dev.mtu).min(peer.mtu as ibv_mtu::Type).max(1);
        a.dest_qp_num = peer.qpn;
        a.rq_psn = peer.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = self.dev.port;
        a.ah_attr.dlid = peer.lid;
        if self.dev.global || peer.global == 1 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: peer.gid };
            a.ah_attr.grh.sgid_index = self.dev.gid_index as u8;
            a.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        // SAFETY: valid QP and attributes.
        if unsafe { ibv_modify_qp(qp, &mut a, mask.0 as i32) } != 0 {
            return Err(errno_error(
                "RDMA queue pair to RTR (check GID index and MTU)",
            ));
        }
        // SAFETY: zeroed attributes, then the RTS fields.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14; // 4.096 µs × 2^14 ≈ 67 ms per try
        a.retry_cnt = 7;
        a.rnr_retry = 7; // receiver-not-ready: retry forever (flow control, not failure)
        a.sq_psn = 0;
        a.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        // SAFETY: valid QP and attributes.
        if unsafe { ibv_modify_qp(qp, &mut a, mask.0 as i32) } != 0 {
            return Err(errno_error("RDMA queue pair to RTS"));
        }
        Ok(())
    }

    /// Sets what to do when the queue pair fails (fail the control link).
    pub(crate) fn on_fail(&self, f: Box<dyn Fn(Error) + Send + Sync>) {
        let _ = self.state.on_fail.set(f);
    }

    /// A hook that drains the device's completions (run before `Closed` is delivered).
    pub(crate) fn drainer(&self) -> Box<dyn Fn() + Send + Sync> {
        let dev = self.dev.clone();
        Box::new(move || {
            dev.poll();
        })
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    fn check(&self) -> Result<()> {
        match lock(&self.state.error).clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Posts one work request; the caller holds the post lock and passes the next id.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        id: u64,
        opcode: ibv_wr_opcode::Type,
        addr: u64,
        len: u64,
        lkey: u32,
        remote: Option<(u64, u32)>,
        imm: Option<u32>,
    ) -> Result<()> {
        let mut sge = ibv_sge {
            addr,
            length: len as u32,
            lkey,
        };
        // SAFETY: zeroed is a valid empty work request; fields set below.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = (self.state.generation << GEN_SHIFT) | (id & ID_MASK);
        wr.sg_list = &mut sge;
        wr.num_sge = if len == 0 { 0 } else { 1 };
        wr.opcode = opcode;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Some(imm) = imm {
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        }
        if let Some((raddr, rkey)) = remote {
            wr.wr.rdma.remote_addr = raddr;
            wr.wr.rdma.rkey = rkey;
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: valid QP; the local range lies in a registered region the caller keeps alive
        // until the completion has been waited for.
        if unsafe { ibv_post_send(self.state.qp, &mut wr, &mut bad) } != 0 {
            return Err(errno_error("post RDMA work request"));
        }
        Ok(())
    }

    /// Waits until work request `id` has completed (and with it every earlier one).
    fn wait(&self, id: u64) -> Result<()> {
        let done = || {
            self.state.done.load(Ordering::Acquire) >= id
                || self.state.failed.load(Ordering::Acquire)
        };
        if spin_for(self.dev.spin.get(), || done().then_some(())).is_none() {
            *lock(&self.state.waiter) = Some(std::thread::current());
            let start = Instant::now();
            while !done() {
                if start.elapsed() > self.op_timeout {
                    *lock(&self.state.waiter) = None;
                    let e = Error::Timeout("RDMA completion", self.op_timeout);
                    self.state.fail(e.clone());
                    return Err(e);
                }
                std::thread::park_timeout(Duration::from_millis(10));
            }
            *lock(&self.state.waiter) = None;
        }
        self.check()?;
        if self.state.done.load(Ordering::Acquire) < id {
            // Failed without a recorded cause (cannot happen: `fail` records first); never
            // report an unfinished request as done.
            return Err(Error::Closed {
                peer: self.dev.name.clone(),
                reason: "queue pair failed".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn write(
        &self,
        src: &Region,
        src_ptr: *mut u8,
        len: u64,
        raddr: u64,
        rkey: u32,
        imm: Option<u32>,
    ) -> Result<()> {
        self.check()?;
        let mr = self.dev.register(src)?;
        let mut next = lock(&self.post);
        let mut off = 0;
        loop {
            let n = (len - off).min(self.dev.max_chunk);
            let last = off + n == len;
            *next += 1;
            let (op, imm) = match (last, imm) {
                (true, Some(i)) => (ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, Some(i)),
                _ => (ibv_wr_opcode::IBV_WR_RDMA_WRITE, None),
            };
            self.post(
                *next,
                op,
                src_ptr as u64 + off,
                n,
                mr.lkey(),
                Some((raddr + off, rkey)),
                imm,
            )?;
            off += n;
            if last {
                break;
            }
        }
        self.wait(*next)
    }

    pub(crate) fn read(
        &self,
        dst: &Region,
        dst_ptr: *mut u8,
        len: u64,
        raddr: u64,
        rkey: u32,
    ) -> Result<()> {
        self.check()?;
        if len == 0 {
            return Ok(());
        }
        let mr = self.dev.register(dst)?;
        let mut next = lock(&self.post);
        let mut off = 0;
        while off < len {
            let n = (len - off).min(self.dev.max_chunk);
            *next += 1;
            self.post(
                *next,
                ibv_wr_opcode::IBV_WR_RDMA_READ,
                dst_ptr as u64 + off,
                n,
                mr.lkey(),
                Some((raddr + off, rkey)),
                None,
            )?;
            off += n;
        }
        self.wait(*next)
    }

    pub(crate) fn send(&self, data: &[u8]) -> Result<()> {
        self.check()?;
        let mut next = lock(&self.post);
        let frags: Vec<&[u8]> = if data.is_empty() {
            vec![&[]]
        } else {
            data.chunks(FRAG).collect()
        };
        let total = frags.len();
        for (batch_no, batch) in frags.chunks(SEND_BATCH).enumerate() {
            for (i, frag) in batch.iter().enumerate() {
                let more = batch_no * SEND_BATCH + i + 1 < total;
                let slot = (i * BUF) as u64;
                self.send_buf
                    .write_at(slot, &[if more { FLAG_MORE } else { 0 }])?;
                self.send_buf.write_at(slot + 1, frag)?;
                *next += 1;
                let addr = self.send_buf.as_ptr() as u64 + slot;
                self.post(
                    *next,
                    ibv_wr_opcode::IBV_WR_SEND,
                    addr,
                    frag.len() as u64 + 1,
                    self.send_mr.lkey(),
                    None,
                    None,
                )?;
            }
            // The staging buffer is reused by the next batch: wait for this one.
            self.wait(*next)?;
        }
        Ok(())
    }

    pub(crate) fn is_ok(&self) -> bool {
        !self.state.failed.load(Ordering::Acquire)
    }
}

impl Drop for RdmaQp {
    fn drop(&mut self) {
        // SAFETY: valid QP.
        let qpn = unsafe { (*self.state.qp).qp_num };
        self.dev
            .qps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&qpn);
        // The progress thread may still hold this state (found in the map just before):
        // wait for any verb it is posting, and make it post no more.
        *self.state.alive.write().unwrap_or_else(|p| p.into_inner()) = false;
        // SAFETY: no longer dispatched to and no verb can reach it any more; destroyed once.
        // Outstanding receives are flushed by the device and their completions ignored (the
        // number is no longer mapped).
        unsafe { ibv_destroy_qp(self.state.qp) };
    }
}

/// Writes our queue-pair info and reads the peer's over the control stream.
pub(crate) fn exchange(stream: &mut TcpStream, ours: &QpInfo) -> Result<QpInfo> {
    use std::io::{Read, Write};
    stream
        .write_all(ours.as_bytes())
        .map_err(|e| Error::io("send RDMA queue-pair info", e))?;
    let mut raw = [0u8; std::mem::size_of::<QpInfo>()];
    stream
        .read_exact(&mut raw)
        .map_err(|e| Error::io("receive RDMA queue-pair info", e))?;
    Ok(QpInfo::read_from_bytes(&raw).expect("exact size"))
}

/// After both sides reached RTS: one byte each way, so neither writes before the other is ready.
pub(crate) fn ready(stream: &mut TcpStream) -> Result<()> {
    use std::io::{Read, Write};
    stream
        .write_all(&[1])
        .map_err(|e| Error::io("send RDMA ready", e))?;
    let mut b = [0u8; 1];
    stream
        .read_exact(&mut b)
        .map_err(|e| Error::io("receive RDMA ready", e))?;
    if b[0] != 1 {
        return Err(Error::Malformed("bad RDMA ready byte".into()));
    }
    Ok(())
}

/// An RDMA link: the tcp control link and the queue pair. The control link is dropped first,
/// so the peer hears the goodbye before the queue pair goes.
pub(crate) struct RdmaLink {
    pub(crate) ctl: crate::tcp::TcpLink,
    pub(crate) qp: RdmaQp,
    /// Regions granted on this link, kept alive (and so registered) until revoked, as on
    /// every medium.
    pub(crate) granted: Mutex<HashMap<u64, Region>>,
}

impl RdmaLink {
    pub(crate) fn grant(&self, region: &Region) -> Result<(u64, u32)> {
        let key = self.qp.device().grant(region)?;
        lock(&self.granted).insert(region.id(), region.clone());
        Ok(key)
    }

    pub(crate) fn revoke(&self, region: &Region) {
        lock(&self.granted).remove(&region.id());
        self.qp.device().revoke(region);
    }
}

impl Device {
    /// Withdraws remote access to `region` on this device (all links: the registration, and
    /// with it the rkey, is per device). A later local use registers it afresh.
    pub(crate) fn revoke(&self, region: &Region) {
        lock(&self.mrs).remove(&region.id());
    }
}
