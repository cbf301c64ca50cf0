//! The data path: writing a push into this worker's slot on a shard's server, and pulling a
//! shard — the lock-free one-sided path, or a request the server's policy answers.

use std::collections::HashSet;
use std::sync::Arc;

use falcon_transport::{Link, LinkId, Op, ReadOp, Region, RemoteKey};

use super::core::{PushRecord, Resend, SourceGrant};
use super::tracker::{Request, Signal};
use super::{Inner, ShardRemote, Worker, lock};
use crate::error::{Error, Result};
use crate::meta::{Snapshot, meta_bytes, within_staleness};
use crate::precision::Wire;
use crate::proto::{AckOf, Immediate, Msg, PushKind, SlotTrailer, TrailerPull, TrailerSrc};

/// The smallest shard whose f32 gradient a push over shm leaves in the worker's memory for
/// the server to read there. Below it the copy into the slot costs about what the server's
/// reads out of another process's memory cost, and the slot keeps the worker's region free
/// of a peer's reads.
pub(super) const IN_PLACE_MIN_BYTES: u64 = 64 << 10;

/// The most gradient regions a worker grants one server link for pushes read in place; a
/// push from a further region goes into the slot.
pub(super) const IN_PLACE_MAX_REGIONS: usize = 16;

impl Worker {
    /// Waits until shard `s`'s slot is free: the previous push to it was acknowledged.
    pub(super) fn wait_slot(&self, s: &ShardRemote) -> Result<()> {
        let prev = lock(&self.inner.core).slot(s.spec.id);
        match prev {
            Some(p) => p.wait(Some(self.inner.timeout)).map(drop),
            None => Ok(()),
        }
    }

    /// Writes `grad`'s part for shard `s` into this worker's slot with immediate `kind` and
    /// sequence number `seq` (the server applies each sequence number once), once the
    /// previous push left the slot; returns the signal of the ack (keyed `ack`). With
    /// recovery, a push whose link fails is kept and written again after the reconnection.
    pub(super) fn write_slot(
        &self,
        s: &ShardRemote,
        grad: Option<&Region>,
        ack: AckOf,
        kind: PushKind,
        seq: u64,
    ) -> Result<Arc<Signal>> {
        let rec = PushRecord {
            grad: grad.cloned(),
            own: None,
            kind,
            seq,
            help_for: None,
            rates: self.inner.rates(),
        };
        self.write_record(s, rec, ack)
    }

    /// [`Worker::write_slot`] with the record made by the caller.
    pub(super) fn write_record(
        &self,
        s: &ShardRemote,
        rec: PushRecord,
        ack: AckOf,
    ) -> Result<Arc<Signal>> {
        let (link, req, sig) = self.track_push(s, &rec, ack)?;
        let sent = self.inner.write_push(&link, s, &rec, None);
        self.sent_or_deferred(sent, s.server, req, "push to")?;
        Ok(sig)
    }

    /// As [`Worker::write_record`], asking in the same write for the shard's values for
    /// `clock` into `out`: the pull rides in the push's trailer, so its server takes it right
    /// behind the push. Returns the push's signal and the answer's (or why the pull could not
    /// be asked for: the push went out anyway). Sent again after a reconnection, the push goes
    /// first and the pull as a request of its own.
    pub(super) fn write_record_and_pull(
        &self,
        s: &ShardRemote,
        rec: PushRecord,
        ack: AckOf,
        (out, clock): (&Region, u64),
    ) -> Result<(Arc<Signal>, Result<Arc<Signal>>)> {
        // The trailer's pull is for the clock its push's sequence number names.
        debug_assert_eq!(
            clock, rec.seq,
            "a riding pull is for the clock after its push"
        );
        let (link, req, sig) = self.track_push(s, &rec, ack)?;
        let (id, answer) = self.track_pull(s, &link, out, clock);
        let pull = Request::Pull(id);
        let (rides, refused) = match self.inner.granted(&link, out) {
            Ok(dst) => {
                let rides = TrailerPull {
                    req: id,
                    dst: dst.to_bytes(),
                    dst_off: s.spec.offset * 4,
                };
                (Some(rides), None)
            }
            // The link failed: the pull waits for the reconnection with the push, and goes
            // as a request of its own behind it.
            Err(e) if self.deferred(&e) => (None, None),
            Err(e) => (None, Some(self.inner.server_error(s.server, e))),
        };
        let sent = self.inner.write_push(&link, s, &rec, rides);
        if refused.is_some() || sent.as_ref().is_err_and(|e| !self.deferred(e)) {
            // The pull goes nowhere: its request is withdrawn.
            lock(&self.inner.core).withdraw(pull);
        }
        self.sent_or_deferred(sent, s.server, req, "push to")?;
        Ok((sig, refused.map_or(Ok(answer), Err)))
    }

    /// Waits for shard `s`'s slot, then registers a push of `rec` on the server's current
    /// link; returns the link, the request and its signal.
    fn track_push(
        &self,
        s: &ShardRemote,
        rec: &PushRecord,
        ack: AckOf,
    ) -> Result<(Link, Request, Arc<Signal>)> {
        self.wait_slot(s)?;
        let link = self.inner.link(s.server)?;
        let req = Request::Ack {
            shard: s.spec.id,
            of: ack,
        };
        let what = Resend::Push {
            shard: s.index,
            rec: rec.clone(),
        };
        let sig = self.track(s, &link, req, what);
        Ok((link, req, sig))
    }

    /// Registers `req`, answered by shard `s`'s server and about to go out on `link`.
    pub(super) fn track(
        &self,
        s: &ShardRemote,
        link: &Link,
        req: Request,
        what: Resend,
    ) -> Arc<Signal> {
        self.inner
            .drive(|c, now, out| c.register(req, Some(s.server), Some(link.id()), now, what, out))
    }

    /// What a request's first send came to: with recovery, a send the link's failure stopped
    /// is deferred (the request goes out again after the reconnection); any other failure
    /// withdraws the request and is the caller's error.
    pub(super) fn sent_or_deferred(
        &self,
        sent: std::result::Result<(), falcon_transport::Error>,
        server: usize,
        req: Request,
        what: &str,
    ) -> Result<()> {
        let Err(e) = sent else {
            return Ok(());
        };
        if self.deferred(&e) {
            tracing::debug!("worker: {what} server {server} deferred: {e}");
            return Ok(());
        }
        lock(&self.inner.core).withdraw(req);
        Err(self.inner.server_error(server, e))
    }

    /// Whether a send that failed with `e` is deferred to the reconnection (with recovery, a
    /// failure of the link itself) rather than the caller's error.
    fn deferred(&self, e: &falcon_transport::Error) -> bool {
        self.inner.book.recovery && e.is_fatal_for_link()
    }

    /// The lock-free path: meta, check, parameters, sequence again. Ok(false) if the policy
    /// does not allow it (or the shard kept changing under us).
    pub(super) fn pull_fast(
        &self,
        s: &ShardRemote,
        out: &Region,
        clock: u64,
        bound: u64,
    ) -> Result<bool> {
        // A server that is down: the slow path queues the request until it is back.
        let Some(link) = self.inner.up_link(s.server) else {
            return Ok(false);
        };
        let Some(keys) = *s.keys.read().unwrap_or_else(|p| p.into_inner()) else {
            return Ok(false);
        };
        let dead = lock(&self.inner.core).dead().clone();
        let scratch = lock(&s.scratch);
        let [meta, values, seq_again] = self.seqlock_reads(s, &scratch, out, &keys);
        // The peer carries the reads out in order, so they travel together: one round trip
        // where no staleness bound must be checked first, else two.
        let unbounded = bound == u64::MAX;
        for _attempt in 0..4 {
            let first: &[ReadOp<'_>] = if unbounded {
                &[meta, values, seq_again]
            } else {
                &[meta]
            };
            if !self.read_outcome(s, link.read_batch(first))? {
                return Ok(false);
            }
            let Some(snap) = self.stable_meta(&scratch)? else {
                continue;
            };
            if !unbounded {
                let min = snap.min_clock(|w| !dead.contains(&(w as u32)));
                if !within_staleness(min, clock, bound) {
                    return Ok(false);
                }
                if !self.read_outcome(s, link.read_batch(&[values, seq_again]))? {
                    return Ok(false);
                }
            }
            if self.seq_held(&scratch, &snap)? {
                self.fast_pulled(out, s, &snap)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The lock-free path for several shards at once, where no staleness bound applies:
    /// every shard's reads are posted, on every server, before any is awaited, so the
    /// whole pull costs one round trip. Returns the shards it could not read this way (the
    /// caller takes them through [`Worker::pull_fast`] or the slow path).
    pub(super) fn pull_fast_together<'s>(
        &self,
        shards: &[&'s ShardRemote],
        out: &Region,
    ) -> Result<Vec<&'s ShardRemote>> {
        let links: Vec<Option<Link>> = shards
            .iter()
            .map(|s| self.inner.up_link(s.server))
            .collect();
        let keys: Vec<Option<super::Keys>> = shards
            .iter()
            .map(|s| *s.keys.read().unwrap_or_else(|p| p.into_inner()))
            .collect();
        let scratch: Vec<_> = shards.iter().map(|s| lock(&s.scratch)).collect();
        let mut posted = Vec::with_capacity(shards.len());
        for (k, s) in shards.iter().enumerate() {
            posted.push(match (&links[k], &keys[k]) {
                (Some(link), Some(key)) => {
                    Some(link.post_reads(&self.seqlock_reads(s, &scratch[k], out, key)))
                }
                _ => None,
            });
        }
        let mut left = Vec::new();
        let mut first_err = None;
        for (k, p) in posted.into_iter().enumerate() {
            let s = shards[k];
            // Read whole and unchanged meanwhile: done; else the caller tries again.
            let done = p.map_or(Ok(false), |p| {
                if !self.read_outcome(s, p.wait())? {
                    return Ok(false);
                }
                let Some(snap) = self.stable_meta(&scratch[k])? else {
                    return Ok(false);
                };
                if !self.seq_held(&scratch[k], &snap)? {
                    return Ok(false);
                }
                self.fast_pulled(out, s, &snap).map(|()| true)
            });
            match done {
                Ok(true) => {}
                Ok(false) => left.push(s),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(left),
        }
    }

    /// A shard's seqlock read: the meta block, the values, then the meta's sequence number
    /// again (into the scratch after the meta); equal and even sequence numbers mean no
    /// write overlapped the values.
    fn seqlock_reads<'a>(
        &self,
        s: &ShardRemote,
        scratch: &'a Region,
        out: &'a Region,
        keys: &'a super::Keys,
    ) -> [ReadOp<'a>; 3] {
        let mb = meta_bytes(self.inner.book.workers);
        [
            ReadOp {
                dst: scratch,
                dst_off: 0,
                src: &keys.meta,
                src_off: 0,
                len: mb,
            },
            ReadOp {
                dst: out,
                dst_off: s.spec.offset * 4,
                src: &keys.params,
                src_off: 0,
                len: self.inner.book.wire_of(s.spec.tensor).bytes(s.spec.len),
            },
            ReadOp {
                dst: scratch,
                dst_off: mb,
                src: &keys.meta,
                src_off: 0,
                len: 8,
            },
        ]
    }

    /// A read's outcome: `Ok(false)` sends the pull the slow way (a failed read on a link
    /// that recovery will replace).
    fn read_outcome(&self, s: &ShardRemote, r: falcon_transport::Result<()>) -> Result<bool> {
        match r {
            Ok(()) => Ok(true),
            Err(e) if self.inner.book.recovery && e.is_fatal_for_link() => Ok(false),
            Err(e) => Err(self.inner.server_error(s.server, e)),
        }
    }

    /// The meta block read into `scratch`, if no write was under way.
    fn stable_meta(&self, scratch: &Region) -> Result<Option<Snapshot>> {
        let workers = self.inner.book.workers;
        let mut raw = vec![0u8; meta_bytes(workers) as usize];
        scratch.read_at(0, &mut raw)?;
        let snap = Snapshot::parse(&raw, workers)?;
        Ok(snap.stable().then_some(snap))
    }

    /// Whether the sequence number read after the values is the meta block's.
    fn seq_held(&self, scratch: &Region, snap: &Snapshot) -> Result<bool> {
        let mut seq = [0u8; 8];
        scratch.read_at(meta_bytes(self.inner.book.workers), &mut seq)?;
        Ok(Snapshot::seq_of(&seq) == snap.seq)
    }

    /// A shard read whole on the lock-free path: widened where the wire is narrower, its
    /// version noted, counted.
    fn fast_pulled(&self, out: &Region, s: &ShardRemote, snap: &Snapshot) -> Result<()> {
        self.inner.widen(out, s)?;
        let mut core = lock(&self.inner.core);
        core.pulled(s.index, snap.version);
        let stats = core.stats_mut();
        stats.fast_pulls += 1;
        stats.fast_pull_bytes += s.spec.bytes();
        Ok(())
    }

    /// Asks shard `s`'s server for the shard at `clock`, written into `out` when the policy
    /// allows; returns the signal of the answer.
    pub(super) fn pull_slow(
        &self,
        s: &ShardRemote,
        out: &Region,
        clock: u64,
    ) -> Result<Arc<Signal>> {
        let link = self.inner.link(s.server)?;
        let (id, sig) = self.track_pull(s, &link, out, clock);
        let req = Request::Pull(id);
        let sent = self.inner.send_pull(&link, s, id, out, clock);
        self.sent_or_deferred(sent, s.server, req, "pull from")?;
        Ok(sig)
    }

    /// Registers a slow-path pull of shard `s` into `out` for `clock`, about to go out on
    /// `link` (the values this worker last read are no longer what it holds); returns the
    /// request id and its signal.
    fn track_pull(
        &self,
        s: &ShardRemote,
        link: &Link,
        out: &Region,
        clock: u64,
    ) -> (u32, Arc<Signal>) {
        let id = {
            let mut core = lock(&self.inner.core);
            core.pulled(s.index, u64::MAX);
            core.next_req()
        };
        let what = Resend::Pull {
            shard: s.index,
            out: out.clone(),
            clock,
        };
        (id, self.track(s, link, Request::Pull(id), what))
    }
}

impl Inner {
    /// A transport error on server `server`'s link, as the caller sees it.
    pub(super) fn server_error(&self, server: usize, e: falcon_transport::Error) -> Error {
        if !e.is_fatal_for_link() {
            return Error::Transport(e);
        }
        // A server that went because the job is over (its scheduler died, and the servers
        // with it; the scheduler ended the job, and its word that says why may still be on
        // the way) is not the cause: the caller is told the cause.
        if self.sched.is_open() {
            let until = std::time::Instant::now() + super::progress::VERDICT_WAIT;
            while std::time::Instant::now() < until {
                if let Some(e) = lock(&self.core).broken() {
                    return e.clone();
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        if let Some(over) = self.job_over() {
            return over;
        }
        Error::PeerGone {
            role: "server",
            rank: server as u32,
            why: e.to_string(),
        }
    }

    /// Writes a push on `link`: the slot's trailer (the version the gradient was computed
    /// from, the sequence number, a pull riding on the push), then the gradient with its
    /// immediate, in one batch (so the trailer lands first, and over tcp both go in one
    /// write). Over shm a dense f32 gradient of at least [`IN_PLACE_MIN_BYTES`] is not
    /// copied: the trailer names where it lies in `grad` (granted on the link), and goes
    /// with the immediate alone.
    pub(super) fn write_push(
        &self,
        link: &Link,
        s: &ShardRemote,
        rec: &PushRecord,
        pull: Option<TrailerPull>,
    ) -> std::result::Result<(), falcon_transport::Error> {
        let Some(keys) = *s.keys.read().unwrap_or_else(|p| p.into_inner()) else {
            return Err(falcon_transport::Error::Closed {
                peer: format!("server {}", s.server),
                reason: "not reached yet".into(),
            });
        };
        let wire = self.book.wire_of(s.spec.tensor);
        // Where this shard's values start in `grad`.
        let src_off = if rec.own.is_some() {
            0
        } else {
            s.spec.offset * 4
        };
        let in_place = self.in_place_source(link, s, rec, src_off)?;
        let scratch = lock(&s.scratch);
        let v = lock(&self.core).shard(s.index).pulled_version;
        let trailer = SlotTrailer {
            computed_on: Some(v).filter(|&v| v != u64::MAX),
            seq: rec.seq,
            help_for: rec.help_for,
            pull,
            src: in_place,
            rates: rec.rates,
        };
        scratch.write_at(0, &trailer.to_bytes())?;
        let imm = Some(
            Immediate {
                kind: rec.kind,
                local: s.local,
            }
            .pack(),
        );
        let trailer_op = |imm| Op::Write {
            src: &scratch,
            src_off: 0,
            dst: &keys.slot,
            dst_off: s.spec.bytes(),
            len: SlotTrailer::BYTES,
            imm,
        };
        if in_place.is_some() {
            link.submit(&[trailer_op(imm)])?;
            lock(&self.core).stats_mut().pushes_in_place += 1;
            return Ok(());
        }
        let into_slot = |src, src_off, len| Op::Write {
            src,
            src_off,
            dst: &keys.slot,
            dst_off: 0,
            len,
            imm,
        };
        let encoded;
        let values = match &rec.grad {
            Some(g) if rec.kind == PushKind::Rows => into_slot(g, 0, rec.own.unwrap_or(0)),
            Some(g) if wire != Wire::F32 && rec.kind != PushKind::Init => {
                encoded = encode_push(s, wire, g, src_off)?;
                into_slot(&encoded, 0, wire.bytes(s.spec.len))
            }
            Some(g) => into_slot(g, src_off, s.spec.bytes()),
            None => into_slot(&scratch, 0, 0),
        };
        link.submit(&[trailer_op(None), values])
    }

    /// Over shm a large f32 gradient stays where it is: the server maps this worker's memory
    /// and applies it from there (acknowledging after the apply, or after copying it out), so
    /// the push moves the trailer alone, not the values. Where it goes that way, the source
    /// the trailer names (the grant of `rec`'s gradient on `link`, its values at `src_off`).
    fn in_place_source(
        &self,
        link: &Link,
        s: &ShardRemote,
        rec: &PushRecord,
        src_off: u64,
    ) -> std::result::Result<Option<TrailerSrc>, falcon_transport::Error> {
        let Some(g) = &rec.grad else {
            return Ok(None);
        };
        if !(self.shm_in_place
            && link.maps_peer_memory()
            && rec.kind == PushKind::Gradient
            && rec.own.is_none()
            && self.book.wire_of(s.spec.tensor) == Wire::F32
            && s.spec.bytes() >= IN_PLACE_MIN_BYTES)
        {
            return Ok(None);
        }
        Ok(self.granted_source(link, g)?.map(|mut key| {
            let mut off = src_off;
            if let Some(forge) = lock(&self.core).forge_source() {
                forge(&mut key, &mut off);
            }
            TrailerSrc {
                key: key.to_bytes(),
                off,
            }
        }))
    }

    /// With 16-bit values on the wire, a pull put the shard's values encoded at the start of
    /// its range in `out`: widens them to f32 in place.
    pub(super) fn widen(
        &self,
        out: &Region,
        s: &ShardRemote,
    ) -> std::result::Result<(), falcon_transport::Error> {
        crate::precision::widen_in_place(
            self.book.wire_of(s.spec.tensor),
            out,
            s.spec.offset * 4,
            s.spec.len,
        )
    }

    /// The key of `out` on `link` (a pull's destination, a gradient left in place), granted
    /// there the first time (cached in the core).
    pub(super) fn granted(
        &self,
        link: &Link,
        out: &Region,
    ) -> std::result::Result<RemoteKey, falcon_transport::Error> {
        if let Some(k) = lock(&self.core).grant(link.id(), out.id()) {
            return Ok(k);
        }
        // Granted with the core released (a transport call), one caller at a time: the
        // first grants, the others find its key.
        let _granting = lock(&self.granting);
        if let Some(k) = lock(&self.core).grant(link.id(), out.id()) {
            return Ok(k);
        }
        let k = link.grant(out)?;
        Ok(lock(&self.core).granted(link.id(), out.id(), k, false))
    }

    /// The key of `grad` on `link` for a push that leaves it in place, granted there the
    /// first time (cached); `None` once [`IN_PLACE_MAX_REGIONS`] gradient regions are granted
    /// on the link and `grad` is not among them, or when the grant fails other than by the
    /// link closing (the push then goes into the slot). A grant keeps its region mapped by
    /// the server until the link ends, so a caller pushing from a fresh region every step
    /// must not pile them up.
    pub(super) fn granted_source(
        &self,
        link: &Link,
        grad: &Region,
    ) -> std::result::Result<Option<RemoteKey>, falcon_transport::Error> {
        let _granting = lock(&self.granting);
        match lock(&self.core).source_grant(link.id(), grad.id()) {
            SourceGrant::Granted(k) => return Ok(Some(k)),
            SourceGrant::Full => return Ok(None),
            SourceGrant::Room => {}
        }
        match link.grant(grad) {
            Ok(k) => Ok(Some(lock(&self.core).granted(
                link.id(),
                grad.id(),
                k,
                true,
            ))),
            Err(e @ falcon_transport::Error::Closed { .. }) => Err(e),
            Err(e) => {
                tracing::debug!(
                    "worker: granting a gradient region failed ({e}); the push is copied"
                );
                Ok(None)
            }
        }
    }

    /// Forgets the grants made on links no longer in use (after a reattachment).
    pub(super) fn forget_old_grants(&self) {
        let live: HashSet<LinkId> = (0..self.servers.len())
            .filter_map(|r| self.up_link(r).map(|l| l.id()))
            .collect();
        lock(&self.core).forget_grants(&live);
    }

    /// Sends a pull request on `link`, granting the destination on it first (cached).
    pub(super) fn send_pull(
        &self,
        link: &Link,
        s: &ShardRemote,
        req: u32,
        out: &Region,
        clock: u64,
    ) -> std::result::Result<(), falcon_transport::Error> {
        let dst = self.granted(link, out)?;
        let msg = Msg::PullReq {
            shard: s.spec.id,
            clock,
            req,
            dst: dst.to_bytes().to_vec(),
            dst_off: s.spec.offset * 4,
        };
        link.send(&msg.encode())
    }

    /// Sends again, on server `r`'s current link, the pushes and pulls that went out on an
    /// older link (the server applies a push's sequence number once).
    pub(super) fn resync(&self, r: usize) {
        let Some(link) = self.up_link(r) else { return };
        let stale = lock(&self.core).stale(r, link.id());
        for (req, sig, what) in stale {
            let sent = match (&what, req) {
                (Resend::Push { shard, rec }, _) => {
                    self.write_push(&link, &self.shards[*shard], rec, None)
                }
                (Resend::Pull { shard, out, clock }, Request::Pull(id)) => {
                    self.send_pull(&link, &self.shards[*shard], id, out, *clock)
                }
                (Resend::PullRows { msg, .. }, Request::Pull(_)) => link.send(msg),
                _ => continue,
            };
            if sent.is_ok() {
                lock(&self.core).resent(req, &sig, link.id());
            }
        }
    }
}

/// Shard `s`'s part of gradient `g` (from `src_off`) encoded in the wire's 16 bits, in the
/// shard's push buffer (made at its first push; one push of a shard is in flight at a time).
fn encode_push(
    s: &ShardRemote,
    wire: Wire,
    g: &Region,
    src_off: u64,
) -> std::result::Result<Region, falcon_transport::Error> {
    let mut buf = lock(&s.push_buf);
    let encoded = match buf.as_ref() {
        Some(r) => r.clone(),
        None => {
            let r = Region::new(wire.bytes(s.spec.len))?;
            *buf = Some(r.clone());
            r
        }
    };
    crate::precision::encode_region(wire, g, src_off, s.spec.len, &encoded)?;
    Ok(encoded)
}
