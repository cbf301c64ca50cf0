//! A [`Region`] page-locked for a device's DMA, and copies between it and device memory that
//! somebody else owns (a PyTorch or CuPy tensor exported through DLPack, say).
//!
//! [`DeviceRegion`](super::DeviceRegion) owns its device memory. A framework's tensor is
//! different: falcon gets a device address and a length, and the memory stays the
//! framework's. [`PinnedRegion`] is the staging side alone: any region (one of the engine's
//! registered buffers) whose own mapping is page-locked with `cuMemHostRegister`, so that a
//! push reads what one DMA copy put there and a pull's bytes go to the device with one DMA
//! copy — never a second copy through a bounce buffer inside the driver.
//!
//! The copies take a device address, so they are `unsafe`: the caller promises the memory
//! is live and that writing it races with nothing. What can be checked is checked: the
//! address must lie, with all its bytes, inside one allocation of the stream's context
//! (`cuMemGetAddressRange`), and the range of the region must exist.

use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};

use super::{CudaError, Result, driver, driver_message};
use crate::Region;

/// Page-locks `region`'s mapping for the device of `stream`'s context; `Err` carries the
/// driver's reason (the region still works, copies then go through the driver's bounce
/// buffer, synchronously).
pub(super) fn pin(
    stream: &Arc<CudaStream>,
    region: &Region,
) -> Result<std::result::Result<(), String>> {
    let bytes = region.len() as usize;
    if bytes == 0 {
        return Ok(Ok(()));
    }
    stream.context().bind_to_thread().map_err(driver)?;
    // SAFETY: the pointer and length are the region's own mapping, live for as long as the
    // caller holds the region (it unregisters with `unpin` before letting it go); registering
    // only page-locks the pages and maps them for the device.
    let r = unsafe {
        sys::cuMemHostRegister_v2(
            region.as_ptr().cast(),
            bytes,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }
    .result()
    .map_err(|e| driver_message(&e));
    if let Err(why) = &r {
        tracing::warn!(
            "cuda: a staging region is not page-locked ({why}); copies go through the driver's bounce buffer"
        );
    }
    Ok(r)
}

/// Undoes a successful [`pin`] once no copy uses the region any more.
pub(super) fn unpin(stream: &Arc<CudaStream>, region: &Region) {
    if !region.is_empty() && stream.context().bind_to_thread().is_ok() {
        // SAFETY: the pointer is the one registered by `pin`, still mapped (the caller holds
        // the region), and the caller drained every copy that used it.
        let _ = unsafe { sys::cuMemHostUnregister(region.as_ptr().cast()) };
    }
}

/// The device allocation (base, size) holding `ptr` in the current context.
fn range_of(ptr: u64) -> Result<(u64, usize)> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: the call only reads the driver's allocation table and writes the two out
    // parameters, which are live locals.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| {
            CudaError::Call(format!(
                "address {ptr:#x} is not device memory of this context ({})",
                driver_message(&e)
            ))
        })?;
    Ok((base, size))
}

/// A region whose mapping is page-locked for the device of a stream, for copies to and from
/// device memory the caller owns. Unregistered when dropped.
#[derive(Debug)]
pub struct PinnedRegion {
    region: Region,
    stream: Arc<CudaStream>,
    pinned: std::result::Result<(), String>,
}

impl PinnedRegion {
    /// Page-locks `region` for `stream`'s device; copies are queued on `stream`. If the
    /// driver refuses, the region still works ([`PinnedRegion::pinned`] says why).
    pub fn new(stream: &Arc<CudaStream>, region: Region) -> Result<Self> {
        let pinned = pin(stream, &region)?;
        Ok(Self {
            region,
            stream: stream.clone(),
            pinned,
        })
    }

    /// The region (push from it, pull into it).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The stream the copies are queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `Ok` when the mapping is page-locked; otherwise the driver's reason.
    pub fn pinned(&self) -> std::result::Result<(), &str> {
        self.pinned.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Checks that bytes `[offset, offset + bytes)` are in the region and that
    /// `[ptr, ptr + bytes)` is inside one device allocation of the stream's context.
    fn check(&self, ptr: u64, offset: usize, bytes: usize) -> Result<()> {
        match offset.checked_add(bytes) {
            Some(end) if end as u64 <= self.region.len() => {}
            _ => {
                return Err(CudaError::Call(format!(
                    "bytes [{offset}, {offset}+{bytes}) outside a region of {}",
                    self.region.len()
                )));
            }
        }
        self.stream.context().bind_to_thread().map_err(driver)?;
        let (base, size) = range_of(ptr)?;
        let end = ptr.checked_add(bytes as u64).ok_or_else(|| {
            CudaError::Call(format!(
                "{bytes} bytes at {ptr:#x} overflow the address space"
            ))
        })?;
        // Within one allocation; or, where an allocator maps one virtual range in pieces
        // (PyTorch's expandable segments), its last byte inside device memory too.
        if end > base.saturating_add(size as u64) && range_of(end - 1).is_err() {
            return Err(CudaError::Call(format!(
                "{bytes} bytes at {ptr:#x} run past the end of their device memory ({size} \
                 bytes at {base:#x})"
            )));
        }
        Ok(())
    }

    /// Copies `bytes` bytes of device memory at `src` into the region at `offset` with one
    /// DMA copy on the stream, and waits until they are there.
    ///
    /// # Safety
    /// `src..src + bytes` must be device memory that stays allocated until this returns and
    /// that nothing writes meanwhile except work already ordered before the stream's queue
    /// (the caller orders the producer's stream before this one, as DLPack's `stream`
    /// argument does).
    pub unsafe fn copy_from_device(&self, src: u64, offset: usize, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.check(src, offset, bytes)?;
        // SAFETY: the destination is `bytes` bytes of the region's own mapping (checked just
        // above), kept mapped by `self`; the region is memory that peers may write at any time
        // and is only accessed through raw copies, so the DMA landing in it is like a peer's
        // write. The source is live device memory of this context (checked, and promised by
        // the caller). The stream is drained before this returns.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.region.as_ptr().add(offset).cast(),
                src,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver)?;
        self.stream.synchronize().map_err(driver)
    }

    /// Copies `bytes` bytes of the region at `offset` to device memory at `dst` with one DMA
    /// copy on the stream, and waits until they are there.
    ///
    /// # Safety
    /// `dst..dst + bytes` must be device memory that stays allocated until this returns and
    /// that nothing reads or writes meanwhile (work that reads it after this returns is
    /// ordered after the copy, which has completed).
    pub unsafe fn copy_to_device(&self, dst: u64, offset: usize, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.check(dst, offset, bytes)?;
        // SAFETY: the source is `bytes` bytes of the region's mapping (checked), kept mapped
        // by `self`; a peer writing them meanwhile only changes which values arrive. The
        // destination is live device memory of this context that nothing else touches until
        // this returns (checked, and promised by the caller). The stream is drained before
        // this returns.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                self.region.as_ptr().add(offset).cast_const().cast(),
                bytes,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver)?;
        self.stream.synchronize().map_err(driver)
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        if self.pinned.is_ok() {
            unpin(&self.stream, &self.region);
        }
    }
}
