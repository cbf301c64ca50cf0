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

/// One side of a ring mapping.
#[derive(Debug)]
pub(crate) struct Ring {
    map: SharedMap,
    cap: u64,
}

/// A record taken off the ring.
pub(crate) struct Record {
    pub(crate) kind: u8,
    pub(crate) imm: u32,
    pub(crate) payload: Vec<u8>,
}

impl Ring {
    /// Creates a ring whose data area holds `cap` bytes (rounded up to a power of two ≥ 4 KiB).
    pub(crate) fn create(cap: u64) -> Result<Ring> {
        let cap = cap.max(4096).next_power_of_two();
        let map = SharedMap::create("falcon-ring", DATA_OFFSET + cap)?;
        Ok(Ring { map, cap })
    }

    /// Maps a peer's ring of capacity `cap` (as announced in its hello).
    pub(crate) fn open(fd: std::os::fd::OwnedFd, cap: u64) -> Result<Ring> {
        if !cap.is_power_of_two() || cap < 4096 {
            return Err(Error::Malformed(format!(
                "ring capacity {cap} is not a power of two ≥ 4096"
            )));
        }
        let map = SharedMap::open(fd, DATA_OFFSET + cap)?;
        Ok(Ring { map, cap })
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd()
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.cap
    }

    /// The largest payload one record may carry; longer messages go out of band.
    pub(crate) fn max_record_payload(&self) -> u64 {
        self.cap / 4 - HEADER
    }

    fn tail(&self) -> &AtomicU64 {
        // SAFETY: offset 0 of a page-aligned mapping; AtomicU64 accepts any bit pattern and
        // every access from either process is atomic.
        unsafe { &*(self.map.ptr() as *const AtomicU64) }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: as for `tail`, at offset 128 (8-aligned, inside the first page).
        unsafe { &*(self.map.ptr().add(HEAD_OFFSET) as *const AtomicU64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is DATA_OFFSET + cap bytes long.
        unsafe { self.map.ptr().add(DATA_OFFSET as usize) }
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
            tail += to_end;
        }
        let pos = tail % self.cap;
        self.put_header(pos, kind, flags, imm, len);
        // SAFETY: pos + need <= cap (checked above: the record fits before the end), and the
        // payload is a distinct local buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                payload.as_ptr(),
                self.data().add((pos + HEADER) as usize),
                payload.len(),
            );
        }
        // Release: the record's bytes become visible before the consumer can see the new tail.
        self.tail().store(tail + need, Ordering::Release);
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
        unsafe {
            std::ptr::copy_nonoverlapping(
                h.as_bytes().as_ptr(),
                self.data().add(pos as usize),
                HEADER as usize,
            );
        }
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
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.data().add(pos as usize),
                    raw.as_mut_ptr(),
                    raw.len(),
                );
            }
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
                    // SAFETY: pos + size <= cap was checked; payload is a fresh buffer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.data().add((pos + HEADER) as usize),
                            payload.as_mut_ptr(),
                            payload.len(),
                        );
                    }
                    Some(Record {
                        kind: h.kind,
                        imm: h.imm,
                        payload,
                    })
                }
                k => return Err(Error::Malformed(format!("shm ring record kind {k}"))),
            };
            // Release: we have copied the record out before the producer may reuse its space.
            self.head().store(head + size, Ordering::Release);
            if let Some(r) = rec {
                return Ok(Some(r));
            }
        }
    }

    /// Test hook: writes raw bytes at the producer position and publishes them, as a broken
    /// or hostile producer would.
    pub(crate) fn push_raw(&self, bytes: &[u8]) {
        let tail = self.tail().load(Ordering::Relaxed);
        let pos = tail % self.cap;
        let n = (bytes.len() as u64).min(self.cap - pos) as usize;
        // SAFETY: n <= cap - pos keeps the copy inside the data area.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().add(pos as usize), n) };
        self.tail().store(tail + n as u64, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_wrap_around_in_order() {
        let ring = Ring::create(4096).unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        let (mut pushed, mut popped) = (0u32, 0u32);
        for _ in 0..20_000 {
            if rng.bool() {
                let len = rng.usize(0..=ring.max_record_payload() as usize);
                let payload = vec![(pushed % 251) as u8; len];
                if ring.try_push(KIND_MSG, 0, pushed, &payload).unwrap() {
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
        assert!(pushed > 1000);
    }

    #[test]
    fn full_ring_refuses_instead_of_overwriting() {
        let ring = Ring::create(4096).unwrap();
        let mut n = 0;
        while ring.try_push(KIND_IMM, 0, n, &[]).unwrap() {
            n += 1;
        }
        assert_eq!(n as u64, 4096 / HEADER, "every slot used, none overwritten");
        assert!(
            ring.try_push(KIND_MSG, 0, 0, &vec![0; 5000]).is_err(),
            "oversized record is an error"
        );
        for i in 0..n {
            assert_eq!(ring.pop().unwrap().unwrap().imm, i);
        }
        assert!(ring.pop().unwrap().is_none());
    }

    #[test]
    fn hostile_bytes_give_typed_errors_never_panics() {
        let mut rng = fastrand::Rng::with_seed(11);
        for round in 0..2000 {
            let ring = Ring::create(4096).unwrap();
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
        }
    }
}
