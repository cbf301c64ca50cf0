//! Regions: memory a peer may address, and the keys that name them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::{Error, Result, check_bounds};
use crate::memfd::SharedMap;

/// Region ids are unique within a process; `RemoteKey::owner` tells processes apart.
static NEXT_REGION_ID: AtomicU64 = AtomicU64::new(1);

/// Page-aligned host memory that peers can address once it is granted on a link.
///
/// The memory lives in a sealed memfd, so a peer on the same host maps it and reaches it with
/// one memcpy; a tcp peer's writes are read from the socket straight into it. Cloning a
/// `Region` clones a handle to the same memory.
///
/// Remote peers may write a granted region at any time, so safe access goes through copies
/// ([`Region::read_at`], [`Region::write_at`]); the slice accessors are `unsafe` and ask the
/// caller to rule out concurrent remote writes to the bytes they look at.
#[derive(Clone, Debug)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
}

#[derive(Debug)]
pub(crate) struct RegionInner {
    pub(crate) id: u64,
    pub(crate) map: SharedMap,
}

impl Region {
    /// Allocates a zero-filled region of `len` bytes (any length, including 0 and over 4 GiB).
    pub fn new(len: u64) -> Result<Region> {
        let id = NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed);
        let map = SharedMap::create(&format!("falcon-region-{id}"), len)?;
        Ok(Region {
            inner: Arc::new(RegionInner { id, map }),
        })
    }

    /// This region's id, unique within the process.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.map.len()
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Start address (page-aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.map.ptr()
    }

    /// Copies `out.len()` bytes starting at `offset` out of the region.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        check_bounds("region read", offset, out.len() as u64, self.len())?;
        // SAFETY: the range was bounds-checked against the live mapping, which this handle keeps
        // alive; `out` is a distinct Rust allocation, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// Copies `data` into the region starting at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        check_bounds("region write", offset, data.len() as u64, self.len())?;
        // SAFETY: as in `read_at`; the mapping is writable and shared.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_ptr().add(offset as usize),
                data.len(),
            );
        }
        Ok(())
    }

    /// `len` floats starting at byte `offset`, copied out of the region into a new vector (a
    /// gradient a peer wrote into a slot): one pass over the bytes, no zeroing first.
    pub fn read_f32_vec(&self, offset: u64, len: usize) -> Result<Vec<f32>> {
        let bytes = (len as u64).saturating_mul(4);
        check_bounds("region read", offset, bytes, self.len())?;
        let mut out = Vec::<f32>::with_capacity(len);
        // SAFETY: the range was bounds-checked against the live mapping, which this handle keeps
        // alive; `out` has room for `len` floats and is a distinct allocation, so the ranges
        // cannot overlap; a byte copy needs no alignment; every bit pattern is a valid f32, so
        // the `len` floats are initialized once copied.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().add(offset as usize),
                out.as_mut_ptr().cast::<u8>(),
                bytes as usize,
            );
            out.set_len(len);
        }
        Ok(out)
    }

    /// The region as 64-bit atomic words, each on its own cache line: as many whole lines as
    /// fit. Peers read such words with one-sided reads; every access here is atomic, so the
    /// view is safe however the words change.
    pub fn padded_atomics(&self) -> &[CachePadded<AtomicU64>] {
        let line = std::mem::size_of::<CachePadded<AtomicU64>>();
        // SAFETY: the mapping is page-aligned (the alignment of a cache line divides a page)
        // and at least `n * line` bytes long, and lives as long as `self`; every bit pattern is
        // a valid `AtomicU64` (the padding is never read); the words are only accessed
        // atomically through this view, and peers' accesses are outside Rust's memory.
        unsafe {
            std::slice::from_raw_parts(
                self.as_ptr() as *const CachePadded<AtomicU64>,
                self.len() as usize / line,
            )
        }
    }

    /// Fills the whole region with `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole mapping is ours and writable.
        unsafe { std::ptr::write_bytes(self.as_ptr(), byte, self.len() as usize) }
    }

    /// The region's bytes as a slice.
    ///
    /// # Safety
    /// No peer may write the region while the slice lives (no write granted and in flight).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is at least `len` bytes and lives as long as `self`; the caller
        // rules out concurrent writers.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len() as usize) }
    }

    /// The region's bytes as a mutable slice.
    ///
    /// # Safety
    /// No other slice of this region may exist, and no peer may read or write it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as above; the caller guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len() as usize) }
    }

    /// Raw pointer to `[offset, offset+len)` after a bounds check.
    pub(crate) fn span(&self, what: &'static str, offset: u64, len: u64) -> Result<*mut u8> {
        check_bounds(what, offset, len, self.len())?;
        // SAFETY: offset <= len of the mapping, so the result stays inside (or one past) it.
        Ok(unsafe { self.as_ptr().add(offset as usize) })
    }
}

/// Floats in a region with one local writer: the parameters of a shard. Peers read them
/// one-sided (granted through [`F32Region::region`]); locally, [`F32Region::values_mut`] takes
/// `&mut self`, so there is never a second live slice while one writes. Readers on other hosts
/// tell a torn read from a clean one by a seqlock kept beside the values (the engine's meta
/// block).
#[derive(Debug)]
pub struct F32Region {
    region: Region,
    len: usize,
}

impl F32Region {
    /// A zero-filled region of `len` floats.
    pub fn new(len: usize) -> Result<F32Region> {
        let bytes = (len as u64)
            .checked_mul(4)
            .ok_or_else(|| Error::Malformed(format!("a region of {len} floats is too large")))?;
        Ok(F32Region {
            region: Region::new(bytes)?,
            len,
        })
    }

    /// The region, to grant it to peers or to write it one-sided to theirs.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Floats held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values.
    pub fn values(&self) -> &[f32] {
        // SAFETY: the mapping is page-aligned and holds `len` floats (made so by `new`), lives
        // as long as `self`, and every bit pattern is a valid f32; local writes need `&mut
        // self` (`values_mut`), so none happens while this slice lives; peers only read.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr() as *const f32, self.len) }
    }

    /// The values, to change in place: the only live slice (`&mut self`).
    pub fn values_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `values`; `&mut self` rules out any other local slice meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr() as *mut f32, self.len) }
    }
}

/// What a peer needs to address a granted region: owner, id and length (for RDMA also the
/// virtual address and rkey). Plain data; send it to the peer in a control message
/// ([`RemoteKey::to_bytes`] / [`RemoteKey::from_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct RemoteKey {
    /// Node id of the process owning the region.
    pub owner: u64,
    /// Region id within the owner.
    pub region: u64,
    /// Length in bytes.
    pub len: u64,
    /// Virtual address in the owner (RDMA), else 0.
    pub addr: u64,
    /// Remote key (RDMA), else 0.
    pub rkey: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

impl RemoteKey {
    /// Wire size of a key.
    pub const SIZE: usize = std::mem::size_of::<RemoteKey>();

    /// Encodes the key.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        out.copy_from_slice(self.as_bytes());
        out
    }

    /// Decodes a key; fails on a wrong length.
    pub fn from_bytes(bytes: &[u8]) -> Result<RemoteKey> {
        RemoteKey::read_from_bytes(bytes).map_err(|_| {
            Error::Malformed(format!(
                "remote key of {} bytes, expected {}",
                bytes.len(),
                Self::SIZE
            ))
        })
    }
}
