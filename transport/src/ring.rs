//! A lock-free single-producer single-consumer byte ring in shared memory.
//!
//! Carries an shm link's immediates and control messages. The consumer creates the ring in a
//! memfd and hands it to the producer (another process). Neither side trusts the other's
//! memory: the producer uses its own capacity and only ever writes inside the data area; the
//! consumer copies every record header out of shared memory before validating it, so a
//! corrupt or malicious ring yields a typed error, never an out-of-bounds access.
//!
//! Layout: one cache line for the producer's `tail`, one for the consumer's `head` (both count
//! bytes since creation, never wrapping in practice: 2^64 bytes), then the data area at 4 KiB.
//! Records are 16-byte aligned: a 16-byte header, then the payload padded to 16. A record that
//! would straddle the end is preceded by a PAD record filling the rest of the area.
//!
//! Orderings: the producer writes a record's bytes, then stores `tail` with Release; the
//! consumer loads `tail` with Acquire before reading them. The consumer copies a record out,
//! then stores `head` with Release; the producer loads `head` with Acquire before reusing
//! that space.
//!
//! The protocol is written once, over [`RingMem`]: where the cursors and the data area live.
//! Production rings live in a memfd mapping ([`Shared`]). Tests also run it on plain heap
//! memory (`Heap`), which Miri can check (it cannot map a memfd: `tools/miri.sh`), and, under
//! `--cfg loom`, on loom's atomics and cells, so the model checker sees every access and
//! explores every interleaving of a producer and a consumer (`ring/loom_model.rs`).

use std::sync::atomic::{AtomicU64, Ordering};

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::{Error, Result};
use crate::memfd::SharedMap;

const DATA_OFFSET: u64 = 4096;
const HEAD_OFFSET: usize = 128;
const RECORD_MAGIC: u16 = 0xFA1C;

/// Record kinds.
pub(crate) const KIND_PAD: u8 = 0;
pub(crate) const KIND_IMM: u8 = 1;
pub(crate) const KIND_MSG: u8 = 2;
/// A message passed out of band as a memfd blob; `imm`/payload name the blob id.
pub(crate) const KIND_BLOB: u8 = 3;

#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub(crate) struct RecordHeader {
    pub(crate) magic: u16,
    pub(crate) kind: u8,
    pub(crate) flags: u8,
    pub(crate) imm: u32,
    pub(crate) len: u64,
}
const HEADER: u64 = std::mem::size_of::<RecordHeader>() as u64;

fn padded(len: u64) -> u64 {
    HEADER + len.div_ceil(16) * 16
}

/// A ring cursor: an atomic `u64` (loom's, under the model checker).
pub(crate) trait Cursor {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
}

impl Cursor for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }

    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order);
    }
}

/// Where a ring lives: its two cursors and a data area of the ring's capacity.
pub(crate) trait RingMem {
    type Cursor: Cursor;

    /// The producer's cursor: bytes published since creation.
    fn tail(&self) -> &Self::Cursor;

    /// The consumer's cursor: bytes consumed since creation.
    fn head(&self) -> &Self::Cursor;

    /// Copies `src` into the data area at byte `pos`.
    ///
    /// # Safety
    ///
    /// `pos + src.len()` must not exceed the capacity the memory was made with.
    unsafe fn put(&self, pos: u64, src: &[u8]);

    /// Copies `dst.len()` bytes of the data area, from byte `pos`, into `dst`.
    ///
    /// # Safety
    ///
    /// `pos + dst.len()` must not exceed the capacity the memory was made with.
    unsafe fn get(&self, pos: u64, dst: &mut [u8]);
}

/// Copies `src` to byte `pos` of the data area at `data`.
///
/// # Safety
///
/// `data` addresses a data area of at least `pos + src.len()` bytes, which `src` (the
/// caller's buffer) does not overlap.
unsafe fn copy_in(data: *mut u8, pos: u64, src: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(pos as usize), src.len()) };
}

/// Copies `dst.len()` bytes from byte `pos` of the data area at `data` into `dst`.
///
/// # Safety
///
/// As for [`copy_in`], in the other direction.
unsafe fn copy_out(data: *mut u8, pos: u64, dst: &mut [u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(data.add(pos as usize), dst.as_mut_ptr(), dst.len()) };
}

/// A ring's memory in a sealed memfd mapping of `DATA_OFFSET + cap` bytes: `tail` at offset
/// 0, `head` at 128, the data area at 4 KiB.
#[derive(Debug)]
pub(crate) struct Shared(SharedMap);

impl Shared {
    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is DATA_OFFSET + cap bytes long.
        unsafe { self.0.ptr().add(DATA_OFFSET as usize) }
    }
}

impl RingMem for Shared {
    type Cursor = AtomicU64;

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: offset 0 of a page-aligned mapping; AtomicU64 accepts any bit pattern and
        // every access from either process is atomic.
        unsafe { &*(self.0.ptr() as *const AtomicU64) }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: as for `tail`, at offset 128 (8-aligned, inside the first page).
        unsafe { &*(self.0.ptr().add(HEAD_OFFSET) as *const AtomicU64) }
    }

    unsafe fn put(&self, pos: u64, src: &[u8]) {
        // SAFETY: the caller's contract is `copy_in`'s.
        unsafe { copy_in(self.data(), pos, src) }
    }

    unsafe fn get(&self, pos: u64, dst: &mut [u8]) {
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe { copy_out(self.data(), pos, dst) }
    }
}

/// A ring's memory on the heap, laid out as in [`Shared`]: the cursors are atomics, the data
/// area is accessed with plain copies, as in a mapping. Tests only: it is what Miri runs on.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Heap(Box<[AtomicU64]>);

#[cfg(test)]
impl Heap {
    fn data(&self) -> *mut u8 {
        // The pointer comes from the whole slice, so it may address all of it; the words are
        // `AtomicU64`, i.e. `UnsafeCell`s, so writing through a pointer derived from a shared
        // reference is allowed.
        let base = self.0.as_ptr().cast::<u8>().cast_mut();
        // SAFETY: the slice is DATA_OFFSET + cap bytes long.
        unsafe { base.add(DATA_OFFSET as usize) }
    }
}

#[cfg(test)]
impl RingMem for Heap {
    type Cursor = AtomicU64;

    fn tail(&self) -> &AtomicU64 {
        &self.0[0]
    }

    fn head(&self) -> &AtomicU64 {
        &self.0[HEAD_OFFSET / 8]
    }

    unsafe fn put(&self, pos: u64, src: &[u8]) {
        // SAFETY: the caller's contract is `copy_in`'s.
        unsafe { copy_in(self.data(), pos, src) }
    }

    unsafe fn get(&self, pos: u64, dst: &mut [u8]) {
        // SAFETY: the caller's contract is `copy_out`'s.
        unsafe { copy_out(self.data(), pos, dst) }
    }
}

/// One side of a ring; `M` is where it lives (a shared mapping, but for tests).
#[derive(Debug)]
pub(crate) struct Ring<M: RingMem = Shared> {
    mem: M,
    cap: u64,
}

/// A record taken off the ring.
pub(crate) struct Record {
    pub(crate) kind: u8,
    pub(crate) imm: u32,
    pub(crate) payload: Vec<u8>,
}

impl Ring<Shared> {
    /// Creates a ring whose data area holds `cap` bytes (rounded up to a power of two ≥ 4 KiB).
    pub(crate) fn create(cap: u64) -> Result<Ring> {
        let cap = cap.max(4096).next_power_of_two();
        let map = SharedMap::create("falcon-ring", DATA_OFFSET + cap)?;
        Ok(Ring {
            mem: Shared(map),
            cap,
        })
    }

    /// Maps a peer's ring of capacity `cap` (as announced in its hello).
    pub(crate) fn open(fd: std::os::fd::OwnedFd, cap: u64) -> Result<Ring> {
        if !cap.is_power_of_two() || cap < 4096 {
            return Err(Error::Malformed(format!(
                "ring capacity {cap} is not a power of two ≥ 4096"
            )));
        }
        let map = SharedMap::open(fd, DATA_OFFSET + cap)?;
        Ok(Ring {
            mem: Shared(map),
            cap,
        })
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.mem.0.fd()
    }
}

#[cfg(test)]
impl Ring<Heap> {
    /// A ring on the heap whose data area holds `cap` bytes (a power of two ≥ 64, so that a
    /// record may carry a payload).
    pub(crate) fn heap(cap: u64) -> Ring<Heap> {
        assert!(cap.is_power_of_two() && cap >= 64);
        let words = ((DATA_OFFSET + cap) / 8) as usize;
        Ring {
            mem: Heap((0..words).map(|_| AtomicU64::new(0)).collect()),
            cap,
        }
    }
}

impl<M: RingMem> Ring<M> {
    pub(crate) fn capacity(&self) -> u64 {
        self.cap
    }

    /// The largest payload one record may carry; longer messages go out of band.
    pub(crate) fn max_record_payload(&self) -> u64 {
        self.cap / 4 - HEADER
    }

    fn tail(&self) -> &M::Cursor {
        self.mem.tail()
    }

    fn head(&self) -> &M::Cursor {
        self.mem.head()
    }

    /// Producer: tries to append one record. Returns Ok(false) if there is no room yet.
    /// The caller serializes producers (one lock per link).
    pub(crate) fn try_push(&self, kind: u8, flags: u8, imm: u32, payload: &[u8]) -> Result<bool> {
        let len = payload.len() as u64;
        if len > self.max_record_payload() {
            return Err(Error::Config(format!(
                "ring record of {len} bytes exceeds {}",
                self.max_record_payload()
            )));
        }
        let need = padded(len);
        // Relaxed: only this (locked) producer writes `tail`.
        let mut tail = self.tail().load(Ordering::Relaxed);
        // The cursors live in the consumer's memory: a tail we did not write (not 16-aligned)
        // would put a PAD header across the end of the data area.
        if !tail.is_multiple_of(16) {
            return Err(Error::Malformed(format!(
                "shm ring tail {tail} is not 16-aligned"
            )));
        }
        // Acquire: pairs with the consumer's Release store of `head`, so it has finished
        // reading the bytes we are about to overwrite.
        let head = self.head().load(Ordering::Acquire);
        let pos = tail % self.cap;
        let to_end = self.cap - pos;
        let total = if need > to_end { to_end + need } else { need };
        let used = tail.wrapping_sub(head);
        if used > self.cap || self.cap - used < total {
            return Ok(false);
        }
        if need > to_end {
            self.put_header(pos, KIND_PAD, 0, 0, to_end - HEADER);
            tail = tail.wrapping_add(to_end);
        }
        let pos = tail % self.cap;
        self.put_header(pos, kind, flags, imm, len);
        // SAFETY: pos + need <= cap (checked above: the record fits before the end), and
        // HEADER + payload.len() <= need.
        unsafe { self.mem.put(pos + HEADER, payload) };
        // Release: the record's bytes become visible before the consumer can see the new tail.
        self.tail()
            .store(tail.wrapping_add(need), Ordering::Release);
        Ok(true)
    }

    fn put_header(&self, pos: u64, kind: u8, flags: u8, imm: u32, len: u64) {
        let h = RecordHeader {
            magic: RECORD_MAGIC,
            kind,
            flags,
            imm,
            len,
        };
        // SAFETY: pos is 16-aligned and pos + HEADER <= cap because every record, PAD included,
        // is at least HEADER long and ends at or before cap.
        unsafe { self.mem.put(pos, h.as_bytes()) };
    }

    /// Consumer: takes the next record, skipping padding. `Ok(None)` when empty.
    pub(crate) fn pop(&self) -> Result<Option<Record>> {
        loop {
            // Relaxed: only this consumer writes `head`.
            let head = self.head().load(Ordering::Relaxed);
            // Acquire: pairs with the producer's Release store; the record bytes are visible.
            let tail = self.tail().load(Ordering::Acquire);
            if head == tail {
                return Ok(None);
            }
            let avail = tail.wrapping_sub(head);
            if avail > self.cap || !head.is_multiple_of(16) || avail < HEADER {
                return Err(Error::Malformed(format!(
                    "shm ring cursors head={head} tail={tail} are inconsistent"
                )));
            }
            let pos = head % self.cap;
            let mut raw = [0u8; HEADER as usize];
            // SAFETY: pos is 16-aligned and < cap, so pos + HEADER <= cap; copying out first
            // means a producer scribbling meanwhile cannot change what we validate.
            unsafe { self.mem.get(pos, &mut raw) };
            let h = RecordHeader::read_from_bytes(&raw).expect("16 bytes");
            if h.magic != RECORD_MAGIC {
                return Err(Error::Malformed(format!(
                    "shm ring record magic {:#x}",
                    h.magic
                )));
            }
            let size = padded(h.len.min(self.cap));
            if h.len > self.cap || size > avail || pos + size > self.cap {
                return Err(Error::Malformed(format!(
                    "shm ring record of {} bytes at {pos} overruns the ring ({avail} bytes published)",
                    h.len
                )));
            }
            let rec = match h.kind {
                KIND_PAD => None,
                KIND_IMM | KIND_MSG | KIND_BLOB => {
                    let mut payload = vec![0u8; h.len as usize];
                    // SAFETY: pos + size <= cap was checked, and HEADER + h.len <= size.
                    unsafe { self.mem.get(pos + HEADER, &mut payload) };
                    Some(Record {
                        kind: h.kind,
                        imm: h.imm,
                        payload,
                    })
                }
                k => return Err(Error::Malformed(format!("shm ring record kind {k}"))),
            };
            // Release: we have copied the record out before the producer may reuse its space.
            self.head()
                .store(head.wrapping_add(size), Ordering::Release);
            if let Some(r) = rec {
                return Ok(Some(r));
            }
        }
    }

    /// Fuzzing hook: overwrites both cursors and the start of the data area, as a hostile
    /// peer sharing the mapping could (see [`crate::fuzzing::ring_records`]).
    pub(crate) fn scribble(&self, head: u64, tail: u64, data: &[u8]) {
        let n = data.len().min(self.cap as usize);
        // SAFETY: n <= cap keeps the copy inside the data area.
        unsafe { self.mem.put(0, &data[..n]) };
        self.head().store(head, Ordering::Relaxed);
        self.tail().store(tail, Ordering::Release);
    }

    /// Test hook: writes raw bytes at the producer position and publishes them, as a broken
    /// or hostile producer would.
    pub(crate) fn push_raw(&self, bytes: &[u8]) {
        let tail = self.tail().load(Ordering::Relaxed);
        let pos = tail % self.cap;
        let n = (bytes.len() as u64).min(self.cap - pos) as usize;
        // SAFETY: n <= cap - pos keeps the copy inside the data area.
        unsafe { self.mem.put(pos, &bytes[..n]) };
        self.tail()
            .store(tail.wrapping_add(n as u64), Ordering::Release);
    }
}

// The loom model of the protocol: `RUSTFLAGS="--cfg loom" cargo test -p falcon-transport --lib
// --release ring::loom_model`.
#[cfg(all(test, loom))]
#[path = "ring/loom_model.rs"]
mod loom_model;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Scales a test's work down under Miri, which interprets every instruction.
    fn scaled(n: usize, under_miri: usize) -> usize {
        if cfg!(miri) { under_miri } else { n }
    }

    /// Random pushes and pops on one thread: FIFO order and intact bytes across wrap-arounds.
    fn records_survive_wrap_around<M: RingMem>(ring: &Ring<M>, steps: usize) {
        let mut rng = fastrand::Rng::with_seed(3);
        let (mut pushed, mut popped, mut pads) = (0u32, 0u32, 0u32);
        for _ in 0..steps {
            if rng.bool() {
                let len = rng.usize(0..=ring.max_record_payload() as usize);
                let payload = vec![(pushed % 251) as u8; len];
                let before = ring.tail().load(Ordering::Relaxed);
                if ring.try_push(KIND_MSG, 0, pushed, &payload).unwrap() {
                    let grew = ring.tail().load(Ordering::Relaxed) - before;
                    pads += u32::from(grew > padded(len as u64));
                    pushed += 1;
                }
            } else if let Some(r) = ring.pop().unwrap() {
                assert_eq!(r.imm, popped, "FIFO order");
                assert!(r.payload.iter().all(|&b| b == (popped % 251) as u8));
                popped += 1;
            }
        }
        while let Some(r) = ring.pop().unwrap() {
            assert_eq!(r.imm, popped);
            popped += 1;
        }
        assert_eq!(pushed, popped);
        assert!(
            pushed as usize > steps / 20,
            "{pushed} pushed in {steps} steps"
        );
        assert!(pads > 0, "some records wrapped behind a PAD record");
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps a memfd")]
    fn records_survive_wrap_around_in_order() {
        records_survive_wrap_around(&Ring::create(4096).unwrap(), 20_000);
    }

    #[test]
    fn records_survive_wrap_around_in_order_on_the_heap() {
        let ring = Ring::heap(scaled(4096, 256) as u64);
        records_survive_wrap_around(&ring, scaled(20_000, 400));
    }

    fn full_ring_refuses_instead_of_overwriting<M: RingMem>(ring: &Ring<M>) {
        let mut n = 0;
        while ring.try_push(KIND_IMM, 0, n, &[]).unwrap() {
            n += 1;
        }
        assert_eq!(
            n as u64,
            ring.capacity() / HEADER,
            "every slot used, none overwritten"
        );
        assert!(
            ring.try_push(KIND_MSG, 0, 0, &vec![0; ring.capacity() as usize + 1])
                .is_err(),
            "oversized record is an error"
        );
        for i in 0..n {
            assert_eq!(ring.pop().unwrap().unwrap().imm, i);
        }
        assert!(ring.pop().unwrap().is_none());
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps a memfd")]
    fn full_ring_refuses_instead_of_overwriting_shared() {
        full_ring_refuses_instead_of_overwriting(&Ring::create(4096).unwrap());
    }

    #[test]
    fn full_ring_refuses_instead_of_overwriting_on_the_heap() {
        full_ring_refuses_instead_of_overwriting(&Ring::heap(scaled(4096, 256) as u64));
    }

    fn hostile_bytes<M: RingMem>(new: impl Fn() -> Ring<M>, rounds: usize) {
        let mut rng = fastrand::Rng::with_seed(11);
        for round in 0..rounds {
            let ring = new();
            let mut junk = vec![0u8; rng.usize(1..200)];
            rng.fill(&mut junk);
            if round % 3 == 0 && junk.len() >= 2 {
                junk[..2].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
            }
            ring.push_raw(&junk);
            for _ in 0..4 {
                match ring.pop() {
                    Ok(Some(_)) => {}
                    Ok(None) | Err(Error::Malformed(_)) => break,
                    Err(e) => panic!("unexpected error kind {e}"),
                }
            }
            // Cursors corrupted outright.
            ring.tail().store(rng.u64(..), Ordering::Relaxed);
            assert!(matches!(
                ring.pop(),
                Ok(None) | Ok(Some(_)) | Err(Error::Malformed(_))
            ));
            // Both cursors and the whole data area, as the fuzzing hook writes them; the
            // producer must then refuse or stay inside the area.
            let mut area = vec![0u8; ring.capacity() as usize];
            rng.fill(&mut area);
            for h in area.chunks_exact_mut(16) {
                if rng.bool() {
                    continue;
                }
                h[..2].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
                h[2] = rng.u8(0..4);
                h[8..].copy_from_slice(&rng.u64(0..2 * ring.capacity()).to_le_bytes());
            }
            let head = rng.u64(0..4 * ring.capacity()) & !15;
            let tail = head.wrapping_add(rng.u64(0..2 * ring.capacity()));
            ring.scribble(head, tail, &area);
            for _ in 0..=ring.capacity() / 16 {
                match ring.pop() {
                    Ok(Some(r)) => assert!(r.payload.len() as u64 <= ring.capacity()),
                    Ok(None) | Err(Error::Malformed(_)) => break,
                    Err(e) => panic!("unexpected error kind {e}"),
                }
            }
            let _ = ring.try_push(KIND_MSG, 0, 7, &vec![0xAB; rng.usize(0..64)]);
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "maps a memfd")]
    fn hostile_bytes_give_typed_errors_never_panics() {
        hostile_bytes(|| Ring::create(4096).unwrap(), 2000);
    }

    #[test]
    fn hostile_bytes_give_typed_errors_never_panics_on_the_heap() {
        hostile_bytes(|| Ring::heap(scaled(4096, 256) as u64), scaled(2000, 40));
    }

    /// The producer's cursor lives in the consumer's memory: a hostile consumer that sets it
    /// 8 bytes before the end once made the producer write a PAD header across the end of the
    /// data area (`to_end - HEADER` underflowed). It is refused now.
    #[test]
    fn a_misaligned_tail_is_refused_not_overrun() {
        let ring = Ring::heap(256);
        for tail in [256 - 8, 8, 3, u64::MAX] {
            ring.scribble(tail, tail, &[]);
            assert!(
                matches!(
                    ring.try_push(KIND_MSG, 0, 0, &[1; 16]),
                    Err(Error::Malformed(_))
                ),
                "tail {tail}"
            );
        }
        // A tail at the very end of the counter space wraps instead of overflowing.
        let tail = u64::MAX - 15;
        ring.scribble(tail, tail, &[]);
        assert!(ring.try_push(KIND_MSG, 0, 9, &[2; 16]).unwrap());
        assert_eq!(ring.pop().unwrap().unwrap().payload, [2; 16]);
    }

    /// A producer and a consumer on two threads, as across processes: every record arrives
    /// once, in order, intact. Under Miri this also checks that no plain access of the data
    /// area races (the Release/Acquire pairs on the cursors order them).
    #[test]
    fn producer_and_consumer_threads_agree_on_the_heap() {
        let ring = Arc::new(Ring::heap(scaled(4096, 128) as u64));
        let n = scaled(20_000, 40) as u32;
        let payload = |i: u32, max: u64| {
            let len = (i as u64 * 7) % (max + 1);
            (0..len).map(|b| (i as u64 + b) as u8).collect::<Vec<u8>>()
        };
        let producer = {
            let ring = Arc::clone(&ring);
            std::thread::spawn(move || {
                for i in 0..n {
                    let bytes = payload(i, ring.max_record_payload());
                    while !ring.try_push(KIND_MSG, 0, i, &bytes).unwrap() {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0u32;
        while next < n {
            match ring.pop().unwrap() {
                Some(r) => {
                    assert_eq!(r.imm, next, "FIFO order");
                    assert_eq!(r.payload, payload(next, ring.max_record_payload()));
                    next += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert!(ring.pop().unwrap().is_none());
    }
}
