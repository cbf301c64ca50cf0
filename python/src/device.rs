//! CUDA tensors through DLPack (feature `cuda`): a torch (or CuPy, or JAX) tensor in device
//! memory is pushed and pulled without the caller copying it to the host.
//!
//! The tensor is exported with `__dlpack__(stream=S)`, S being this worker's copy stream on
//! that device: the producer orders S after the work that made the tensor (PyTorch records
//! an event on its current stream and makes S wait for it), so the copy reads the finished
//! gradient without a device-wide synchronisation. The capsule is read, never consumed: its
//! destructor releases the producer's hold when it goes.
//!
//! A push's one copy is the DMA from the device into one of the tensor's registered regions,
//! page-locked for the device ([`PinnedRegion`]); a pull lands in such a region and goes to
//! the device with one DMA copy when it completes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use falcon_transport::cuda::cudarc::driver::CudaStream;
use falcon_transport::cuda::{CudaError as DeviceError, Gpu, PinnedRegion};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyDict};

use crate::dlpack::{CUDA, CUDA_MANAGED};
use crate::{CudaError, LengthError, TensorError};

/// `kDLFloat`.
const FLOAT: u8 = 2;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// The head of a `DLManagedTensor` (DLPack 0.x, the capsule named "dltensor"): its first
/// member is this `DLTensor`, the only part read here.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

fn device_err(e: DeviceError) -> PyErr {
    CudaError::new_err(format!("CUDA: {e}"))
}

/// A CUDA tensor's memory, exported for the length of a push's copy, or from the start of a
/// pull to its completion.
pub(crate) struct Exported {
    /// Keeps the producer's export alive (released by the capsule's destructor).
    _capsule: Py<PyCapsule>,
    /// The first byte's device address.
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
}

/// Exports `obj` (on CUDA device `device`) with `__dlpack__(stream=stream)` and checks it
/// is `len` contiguous float32 values there.
pub(crate) fn export(
    obj: &Bound<'_, PyAny>,
    stream: &Arc<CudaStream>,
    device: i32,
    tensor: &str,
    len: u64,
) -> PyResult<Exported> {
    let py = obj.py();
    // A tensor that requires grad refuses to be exported; its detached view (the same
    // memory) does not.
    let obj = if obj.hasattr("detach")? {
        obj.call_method0("detach")?
    } else {
        obj.clone()
    };
    let kw = PyDict::new(py);
    kw.set_item("stream", stream.cu_stream() as usize)?;
    // PyTorch orders the consumer's stream after its *current device's* current stream: make
    // the tensor's device the current one for the export (other producers order by the
    // tensor's own device).
    let torch_device = match obj.get_type().module() {
        Ok(m) if m.to_string_lossy().starts_with("torch") => Some(
            py.import("torch.cuda")?
                .getattr("device")?
                .call1((device,))?,
        ),
        _ => None,
    };
    if let Some(d) = &torch_device {
        d.call_method0("__enter__")?;
    }
    let exported = obj.call_method("__dlpack__", (), Some(&kw));
    if let Some(d) = &torch_device {
        d.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
    }
    let capsule = exported?;
    let capsule = capsule.cast_into::<PyCapsule>().map_err(|_| {
        LengthError::new_err(format!(
            "tensor {tensor:?}: __dlpack__ did not return a capsule"
        ))
    })?;
    let head = capsule.pointer_checked(Some(c"dltensor")).map_err(|_| {
        LengthError::new_err(format!(
            "tensor {tensor:?}: __dlpack__ returned a capsule that is not an unused \"dltensor\""
        ))
    })?;
    // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor` (the DLPack protocol),
    // whose first member is the `DLTensor` read here, alive as long as the capsule is alive
    // and not consumed; we hold the capsule and run no Python code while reading.
    let t = unsafe { &*head.as_ptr().cast::<DlTensor>() };
    if t.device.device_type != CUDA && t.device.device_type != CUDA_MANAGED
        || t.device.device_id != device
    {
        return Err(LengthError::new_err(format!(
            "tensor {tensor:?}: exported on DLPack device {}:{}, not CUDA device {device}",
            t.device.device_type, t.device.device_id
        )));
    }
    if t.dtype.code != FLOAT || t.dtype.bits != 32 || t.dtype.lanes != 1 {
        return Err(TensorError::new_err(format!(
            "tensor {tensor:?}: the buffer must hold float32 values (DLPack type code {}, {} \
             bits, {} lanes)",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        )));
    }
    let ndim = usize::try_from(t.ndim).unwrap_or(0);
    let malformed = || {
        LengthError::new_err(format!(
            "tensor {tensor:?}: __dlpack__ described its memory inconsistently"
        ))
    };
    if ndim > 0 && t.shape.is_null() {
        return Err(malformed());
    }
    let (shape, strides): (&[i64], Option<&[i64]>) = if ndim == 0 {
        (&[], None)
    } else {
        // SAFETY: DLPack: `shape` (checked not null above) and `strides` when not null point
        // to `ndim` int64 values, owned by the managed tensor, alive with the capsule.
        unsafe {
            (
                std::slice::from_raw_parts(t.shape, ndim),
                (!t.strides.is_null()).then(|| std::slice::from_raw_parts(t.strides, ndim)),
            )
        }
    };
    let count = shape
        .iter()
        .try_fold(1i64, |c, &n| c.checked_mul(n))
        .ok_or_else(malformed)?;
    if let Some(strides) = strides {
        // Row-major contiguous: each dimension's stride is the product of those after it
        // (a dimension of size 1 may carry any stride).
        let mut want = 1i64;
        for (&n, &s) in shape.iter().zip(strides).rev() {
            if n != 1 && s != want {
                return Err(TensorError::new_err(format!(
                    "tensor {tensor:?}: the buffer must be contiguous (tensor.contiguous())"
                )));
            }
            want = want.saturating_mul(n);
        }
    }
    if count < 0 || count as u64 != len {
        return Err(LengthError::new_err(format!(
            "tensor {tensor:?} has {len} floats; the buffer has {count}"
        )));
    }
    Ok(Exported {
        ptr: (t.data as u64)
            .checked_add(t.byte_offset)
            .ok_or_else(malformed)?,
        bytes: len as usize * 4,
        _capsule: capsule.unbind(),
    })
}

/// Per device: its copy stream.
#[derive(Default)]
pub(crate) struct Devices(Mutex<HashMap<i32, Arc<CudaStream>>>);

impl Devices {
    /// The copy stream of `device`, opening the device the first time (a typed error when
    /// there is no driver or no such device).
    pub(crate) fn stream(&self, device: i32) -> PyResult<Arc<CudaStream>> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(&device) {
            return Ok(s.clone());
        }
        let gpu = Gpu::open(device as usize).map_err(device_err)?;
        let stream = gpu
            .context()
            .new_stream()
            .map_err(|e| device_err(e.into()))?;
        m.insert(device, stream.clone());
        Ok(stream)
    }
}

/// Page-locks a fresh registered region of a tensor for `stream`'s device.
pub(crate) fn pin(
    stream: &Arc<CudaStream>,
    region: falcon_transport::Region,
) -> PyResult<PinnedRegion> {
    PinnedRegion::new(stream, region).map_err(device_err)
}

/// The push's one copy: the exported device memory into the region.
pub(crate) fn copy_in(r: &PinnedRegion, e: &Exported) -> PyResult<()> {
    // SAFETY: `e` holds the export (the capsule) for the length of the copy, so the memory
    // stays allocated; the export ordered the copy stream after the work that wrote it; the
    // copy only reads it; and the region's length was checked against the tensor's.
    unsafe { r.copy_from_device(e.ptr, 0, e.bytes) }.map_err(device_err)
}

/// The pull's one copy: the region into the exported device memory.
pub(crate) fn copy_out(r: &PinnedRegion, e: &Exported) -> PyResult<()> {
    // SAFETY: as in `copy_in` (the export is held from the pull's start to here, so the
    // memory stays allocated); the copy completes before this returns, so the caller's later
    // work on the tensor comes after it. The caller handed the tensor to a pull, whose
    // contract is that falcon writes it when the pull completes.
    unsafe { r.copy_to_device(e.ptr, 0, e.bytes) }.map_err(device_err)
}
