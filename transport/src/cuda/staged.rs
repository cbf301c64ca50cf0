//! Device memory that push and pull reach through a page-locked staging [`Region`].
//!
//! The transports (shm, tcp, and rdma without GPUDirect) move host memory. A
//! [`DeviceRegion`] pairs `len` floats of device memory with a [`Region`] of the same length
//! whose own mapping is page-locked with `cuMemHostRegister`: the transport reads a push from
//! it and writes a pull into it exactly as it does any region, and the one extra copy is the
//! DMA between the device and that mapping (`cuMemcpyDtoHAsync` before a push,
//! `cuMemcpyHtoDAsync` after a pull), queued on the region's stream — never a second copy
//! through a bounce buffer inside the driver.
//!
//! Copies go by ranges ([`DeviceRegion::stage_out`], [`DeviceRegion::stage_in`]) so a caller
//! can overlap them with the transport: queue every shard's copy, then write shard `i` while
//! shard `i + 1` is still on its way.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};

use super::{CudaError, Gpu, Result, driver};
use crate::Region;

/// `len` floats on a device with a page-locked staging [`Region`] of `4 · len` bytes.
///
/// The device side is a cudarc [`CudaSlice`] ([`DeviceRegion::device`],
/// [`DeviceRegion::device_mut`]) for kernels and copies; work queued on it from another
/// stream is ordered before this region's copies by cudarc's event tracking. The staging
/// side is an ordinary region ([`DeviceRegion::staging`]) that push and pull take; it holds
/// what the last [`DeviceRegion::stage_out`] copied out or what the last pull wrote, not
/// necessarily what the device holds.
#[derive(Debug)]
pub struct DeviceRegion {
    dev: CudaSlice<f32>,
    staging: Region,
    stream: Arc<CudaStream>,
    len: usize,
    /// Whether `cuMemHostRegister` page-locked the staging mapping (else: why not).
    pinned: std::result::Result<(), String>,
}

/// A copy queued by [`DeviceRegion::stage_out`]; [`Staged::wait`] returns once it landed.
#[derive(Debug)]
#[must_use = "the staging bytes are only known complete after wait()"]
pub struct Staged(Option<CudaEvent>);

impl Staged {
    /// Blocks until the copy is in the staging region.
    pub fn wait(self) -> Result<()> {
        match self.0 {
            Some(e) => e.synchronize().map_err(driver),
            None => Ok(()),
        }
    }
}

impl Gpu {
    /// `len` zeroed floats on this device, with a page-locked staging region and a stream of
    /// their own ([`DeviceRegion::stream`]).
    pub fn device_region(&self, len: usize) -> Result<DeviceRegion> {
        let stream = self.ctx.new_stream().map_err(driver)?;
        DeviceRegion::on_stream(&stream, len)
    }
}

impl DeviceRegion {
    /// `len` zeroed floats on `stream`'s device, with a page-locked staging region; copies
    /// are queued on `stream`.
    ///
    /// If the driver refuses to page-lock the staging mapping, the region still works (the
    /// driver then copies through its own bounce buffer, synchronously);
    /// [`DeviceRegion::pinned`] says so.
    pub fn on_stream(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<f32>())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| CudaError::Call(format!("{len} floats is too many")))?;
        let staging = Region::new(bytes as u64)
            .map_err(|e| CudaError::Call(format!("the staging region: {e}")))?;
        // Device allocations of 0 bytes are refused: an empty region keeps one float.
        let dev = stream.alloc_zeros::<f32>(len.max(1)).map_err(driver)?;
        let pinned = super::pinned::pin(stream, &staging)?;
        Ok(Self {
            dev,
            staging,
            stream: stream.clone(),
            len,
            pinned,
        })
    }

    /// Its length in floats.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a region of no floats.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The staging region (push from it, pull into it).
    pub fn staging(&self) -> &Region {
        &self.staging
    }

    /// The stream this region's copies are queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `Ok` when the staging mapping is page-locked; otherwise the driver's reason.
    pub fn pinned(&self) -> std::result::Result<(), &str> {
        self.pinned.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// The device memory (its first [`DeviceRegion::len`] floats are the region's).
    pub fn device(&self) -> &CudaSlice<f32> {
        &self.dev
    }

    /// The device memory, for kernels and copies that write it.
    pub fn device_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.dev
    }

    /// Copies `values` (exactly [`DeviceRegion::len`] floats) to the device and waits.
    pub fn upload(&mut self, values: &[f32]) -> Result<()> {
        self.check_len(values.len())?;
        if values.is_empty() {
            return Ok(());
        }
        let mut view = self.dev.slice_mut(..self.len);
        self.stream.memcpy_htod(values, &mut view).map_err(driver)?;
        self.synchronize()
    }

    /// The device's floats, copied to the host (waits).
    pub fn to_host(&self) -> Result<Vec<f32>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let v = self
            .stream
            .clone_dtoh(&self.dev.slice(..self.len))
            .map_err(driver)?;
        self.synchronize()?;
        Ok(v)
    }

    fn check_len(&self, got: usize) -> Result<()> {
        if got == self.len {
            Ok(())
        } else {
            Err(CudaError::Call(format!(
                "the device region holds {} floats, not {got}",
                self.len
            )))
        }
    }

    fn check_range(&self, start: usize, len: usize) -> Result<()> {
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::Call(format!(
                "floats [{start}, {start}+{len}) outside a device region of {}",
                self.len
            ))),
        }
    }

    /// Queues the copy of floats `[start, start + len)` from the device into the same floats
    /// of the staging region, after the work already queued on the device memory; returns
    /// what to wait on before the transport reads them.
    pub fn stage_out(&self, start: usize, len: usize) -> Result<Staged> {
        self.check_range(start, len)?;
        if len == 0 {
            return Ok(Staged(None));
        }
        {
            let (ptr, _record) = self.dev.device_ptr(&self.stream);
            let bytes = len * size_of::<f32>();
            let off = start * size_of::<f32>();
            // SAFETY: the source is `len` floats inside the device allocation (checked above)
            // that `self` keeps alive until the stream is drained (`Drop` synchronizes); the
            // destination is the same range of the staging mapping, which `self` keeps mapped.
            // The staging region is memory that peers may write at any time, read and written
            // only through raw copies, so the DMA landing in it later is like a peer's write.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    self.staging.as_ptr().add(off).cast(),
                    ptr + off as u64,
                    bytes,
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(driver)?;
        }
        let event = self.stream.record_event(None).map_err(driver)?;
        Ok(Staged(Some(event)))
    }

    /// Queues the copy of floats `[start, start + len)` of the staging region to the same
    /// floats on the device, ordered before later work on the device memory. The staging
    /// bytes must stay as they are until it ran: [`DeviceRegion::synchronize`] (a pull into
    /// the staging region takes `&mut`, and so waits for it).
    pub fn stage_in(&mut self, start: usize, len: usize) -> Result<()> {
        self.check_range(start, len)?;
        if len == 0 {
            return Ok(());
        }
        let (ptr, _record) = self.dev.device_ptr_mut(&self.stream);
        let bytes = len * size_of::<f32>();
        let off = start * size_of::<f32>();
        // SAFETY: the destination is `len` floats inside the device allocation (checked
        // above), kept alive until the stream is drained; the source is the same range of the
        // staging mapping, kept mapped by `self`. A peer writing those bytes meanwhile only
        // changes which values arrive (the region is only ever accessed through raw copies).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                ptr + off as u64,
                self.staging.as_ptr().add(off).cast_const().cast(),
                bytes,
                self.stream.cu_stream(),
            )
        }
        .result()
        .map_err(driver)
    }

    /// Waits for every copy queued on this region's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver)
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        // Copies in flight read or write both sides: let them land first.
        let _ = self.stream.synchronize();
        if self.pinned.is_ok() {
            super::pinned::unpin(&self.stream, &self.staging);
        }
    }
}
