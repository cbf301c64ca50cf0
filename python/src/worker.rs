//! The worker: push and pull between Python buffers and the job's registered regions.
//!
//! A push copies the caller's buffer into a registered region (the one copy) and sends from
//! there; a pull lands in a registered region and is copied into the caller's buffer when
//! it completes. Regions are kept per tensor and reused, so steady-state pushes and pulls
//! allocate nothing.
//!
//! A CUDA tensor (anything DLPack places on a CUDA device) takes the same path with a DMA
//! for the copy (feature `cuda`, `crate::device`): its regions are kept page-locked for its
//! device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use falcon_engine::keys::TensorSpec;
use falcon_engine::precision::Wire;
use falcon_engine::proto::Role;
use falcon_transport::Region;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dlpack::{CPU, CUDA, CUDA_HOST, CUDA_MANAGED};
use crate::{ConfigError, Error, LengthError, SLICE, TensorError, engine_err, transport_err};

/// Regions kept per tensor for reuse (more in flight at once are made and dropped).
const KEPT_REGIONS: usize = 4;

/// Where a kept region's copies come from and go to: host memory, or a CUDA device.
const HOST: i32 = -1;

/// A registered region of a tensor: filled from host buffers, or page-locked for a CUDA
/// device's DMA.
enum Kept {
    Host(Region),
    #[cfg(feature = "cuda")]
    Device(i32, falcon_transport::cuda::PinnedRegion),
}

impl Kept {
    fn region(&self) -> &Region {
        match self {
            Kept::Host(r) => r,
            #[cfg(feature = "cuda")]
            Kept::Device(_, p) => p.region(),
        }
    }

    fn place(&self) -> i32 {
        match self {
            Kept::Host(_) => HOST,
            #[cfg(feature = "cuda")]
            Kept::Device(d, _) => *d,
        }
    }
}

/// Registered regions waiting for reuse, per tensor and place.
#[derive(Default)]
struct Regions(Mutex<HashMap<(String, i32), Vec<Kept>>>);

impl Regions {
    fn kept(&self, tensor: &str, place: i32) -> Option<Kept> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&(tensor.to_string(), place))
            .and_then(Vec::pop)
    }

    fn take(&self, w: &falcon_engine::Worker, tensor: &str) -> PyResult<Kept> {
        match self.kept(tensor, HOST) {
            Some(k) => Ok(k),
            None => Ok(Kept::Host(w.buffer(tensor).map_err(engine_err)?)),
        }
    }

    #[cfg(feature = "cuda")]
    fn take_device(
        &self,
        w: &falcon_engine::Worker,
        tensor: &str,
        device: i32,
        stream: &Arc<falcon_transport::cuda::cudarc::driver::CudaStream>,
    ) -> PyResult<Kept> {
        match self.kept(tensor, device) {
            Some(k) => Ok(k),
            None => {
                let r = w.buffer(tensor).map_err(engine_err)?;
                Ok(Kept::Device(device, crate::device::pin(stream, r)?))
            }
        }
    }

    fn give(&self, tensor: &str, k: Kept) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let v = m.entry((tensor.to_string(), k.place())).or_default();
        if v.len() < KEPT_REGIONS {
            v.push(k);
        }
    }
}

/// A worker of a falcon job: pushes gradients, pulls parameters. Made by
/// `falcon.init(...)`; every method may be called from any thread.
#[pyclass(frozen, module = "falcon")]
pub struct Worker {
    w: falcon_engine::Worker,
    /// Tensor name → length in floats.
    lens: HashMap<String, u64>,
    /// Names in declaration order.
    names: Vec<String>,
    regions: Arc<Regions>,
    /// Each CUDA device's copy stream, opened on first use.
    #[cfg(feature = "cuda")]
    devices: Arc<crate::device::Devices>,
}

/// The CUDA device of `obj` when it is a DLPack producer whose memory is on one (`None`
/// for host memory, and for objects that are not DLPack producers).
fn cuda_device(obj: &Bound<'_, PyAny>, tensor: &str) -> PyResult<Option<i32>> {
    if !obj.hasattr("__dlpack_device__")? {
        return Ok(None);
    }
    let (ty, id): (i32, i32) = obj
        .call_method0("__dlpack_device__")?
        .extract()
        .map_err(|_| {
            LengthError::new_err(format!(
                "tensor {tensor:?}: __dlpack_device__ did not return (device type, id)"
            ))
        })?;
    match ty {
        CPU | CUDA_HOST => Ok(None),
        CUDA | CUDA_MANAGED if id >= 0 => {
            if cfg!(feature = "cuda") {
                Ok(Some(id))
            } else {
                Err(ConfigError::new_err(format!(
                    "tensor {tensor:?}: the buffer is on CUDA device {id}; this build of falcon \
                     moves host memory (build the package with its `cuda` feature, or .cpu() \
                     first)"
                )))
            }
        }
        _ => Err(ConfigError::new_err(format!(
            "tensor {tensor:?}: the buffer is on DLPack device type {ty} (id {id}); falcon \
             moves host memory and CUDA device memory"
        ))),
    }
}

/// Waits for `h` in slices, releasing the GIL, checking for Ctrl-C between slices.
fn wait_handle(py: Python<'_>, h: &falcon_engine::Handle) -> PyResult<()> {
    loop {
        match py.detach(|| h.wait_for(SLICE)) {
            Some(r) => return r.map_err(engine_err),
            None => py.check_signals()?,
        }
    }
}

/// A CPU torch tensor's numpy view (which shares its memory); `None` for anything else.
fn numpy_view<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    if obj.hasattr("detach")? && obj.hasattr("numpy")? {
        return Ok(Some(obj.call_method0("detach")?.call_method0("numpy")?));
    }
    Ok(None)
}

/// Row ids from a buffer of unsigned or signed 64-bit integers (a numpy array, a CPU torch
/// tensor) or a sequence of ints.
fn row_ids(py: Python<'_>, tensor: &str, rows: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let view = numpy_view(rows)?;
    let obj = view.as_ref().unwrap_or(rows);
    if let Ok(b) = PyBuffer::<u64>::get(obj) {
        return b.to_vec(py);
    }
    let signed: Vec<i64> = match PyBuffer::<i64>::get(obj) {
        Ok(b) => b.to_vec(py)?,
        Err(_) => obj.extract().map_err(|_| {
            LengthError::new_err(format!(
                "tensor {tensor:?}: row ids must be 64-bit integers (numpy int64 or uint64, \
                 or a list of ints)"
            ))
        })?,
    };
    signed
        .into_iter()
        .map(|r| {
            u64::try_from(r).map_err(|_| {
                ConfigError::new_err(format!("tensor {tensor:?}: row {r} is negative"))
            })
        })
        .collect()
}

/// Float32 values from a buffer (a numpy array, a CPU torch tensor).
fn floats(py: Python<'_>, tensor: &str, values: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    let view = numpy_view(values)?;
    let b = PyBuffer::<f32>::get(view.as_ref().unwrap_or(values)).map_err(|e| {
        TensorError::new_err(format!(
            "tensor {tensor:?}: the rows' gradients must be float32 values ({e})"
        ))
    })?;
    b.to_vec(py)
}

/// The row width: `dim`, or the values per row id.
fn row_width(tensor: &str, dim: Option<u64>, rows: usize, values: usize) -> PyResult<u64> {
    match dim {
        Some(d) => Ok(d),
        None if rows == 0 => Ok(1),
        None if values.is_multiple_of(rows) => Ok((values / rows) as u64),
        None => Err(LengthError::new_err(format!(
            "tensor {tensor:?}: {values} values for {rows} rows: not a whole row each"
        ))),
    }
}

/// Runs `f` (a blocking engine call) on its own thread with the GIL released, checking for
/// Ctrl-C while it runs. On an interrupt the call goes on in the background and its result
/// is dropped.
pub(crate) fn blocking<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> PyResult<T> + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name(format!("falcon-{what}"))
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error::new_err(format!("cannot start a thread for {what}: {e}")))?;
    loop {
        match py.detach(|| rx.recv_timeout(SLICE)) {
            Ok(r) => return r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                return Err(Error::new_err(format!("{what} stopped without an answer")));
            }
        }
    }
}

impl Worker {
    fn len_of(&self, tensor: &str) -> PyResult<u64> {
        self.lens
            .get(tensor)
            .copied()
            .ok_or_else(|| TensorError::new_err(format!("unknown tensor {tensor:?}")))
    }

    /// A float32, C-contiguous buffer of `tensor`'s length (writable for pulls).
    fn buffer_of(
        &self,
        obj: &Bound<'_, PyAny>,
        tensor: &str,
        writable: bool,
    ) -> PyResult<PyBuffer<f32>> {
        let len = self.len_of(tensor)?;
        // A CPU torch tensor has no buffer of its own: its numpy view shares its memory (no
        // copy), and the buffer keeps the view alive.
        let view;
        let obj = if obj.hasattr("detach")? && obj.hasattr("numpy")? {
            if let Ok(device) = obj.getattr("device").and_then(|d| d.getattr("type"))
                && device.extract::<String>().is_ok_and(|t| t != "cpu")
            {
                return Err(ConfigError::new_err(format!(
                    "tensor {tensor:?}: the buffer is on {device}; this build moves CPU memory \
                     (.cpu() first)"
                )));
            }
            view = obj.call_method0("detach")?.call_method0("numpy")?;
            &view
        } else {
            obj
        };
        let buf = PyBuffer::<f32>::get(obj).map_err(|e| {
            TensorError::new_err(format!(
                "tensor {tensor:?}: the buffer must hold float32 values ({e})"
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(TensorError::new_err(format!(
                "tensor {tensor:?}: the buffer must be contiguous (numpy.ascontiguousarray, \
                 tensor.contiguous())"
            )));
        }
        if writable && buf.readonly() {
            return Err(LengthError::new_err(format!(
                "tensor {tensor:?}: a pull needs a writable buffer"
            )));
        }
        if buf.item_count() as u64 != len {
            return Err(LengthError::new_err(format!(
                "tensor {tensor:?} has {len} floats; the buffer has {}",
                buf.item_count()
            )));
        }
        Ok(buf)
    }

    /// Copies `buf` into `region` (the push's one copy).
    fn fill(region: &Region, buf: &PyBuffer<f32>) -> PyResult<()> {
        // SAFETY: `buf` is a C-contiguous buffer of `item_count` f32 values (checked in
        // `buffer_of`), held (so its memory stays valid) for the life of this borrow, and we
        // hold the GIL, so no Python code can resize or free it meanwhile.
        let bytes =
            unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.item_count() * 4) };
        region.write_at(0, bytes).map_err(transport_err)
    }

    /// Copies `region` into `buf` (the pull's one copy).
    fn drain(region: &Region, buf: &PyBuffer<f32>) -> PyResult<()> {
        // SAFETY: as in `fill`, and the buffer is writable (checked in `buffer_of`); the
        // slice lives only for this copy, while the GIL is held.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(buf.buf_ptr() as *mut u8, buf.item_count() * 4)
        };
        region.read_at(0, bytes).map_err(transport_err)
    }

    /// A registered region of `tensor` holding a copy of `values` (checked as its buffer):
    /// host memory copied, CUDA memory copied by DMA into a page-locked region.
    fn staged(&self, tensor: &str, values: &Bound<'_, PyAny>) -> PyResult<Kept> {
        if let Some(device) = cuda_device(values, tensor)? {
            return self.staged_device(tensor, values, device);
        }
        let buf = self.buffer_of(values, tensor, false)?;
        let kept = self.regions.take(&self.w, tensor)?;
        if let Err(e) = Self::fill(kept.region(), &buf) {
            self.regions.give(tensor, kept);
            return Err(e);
        }
        Ok(kept)
    }

    #[cfg(feature = "cuda")]
    fn staged_device(
        &self,
        tensor: &str,
        values: &Bound<'_, PyAny>,
        device: i32,
    ) -> PyResult<Kept> {
        let len = self.len_of(tensor)?;
        let stream = self.devices.stream(device)?;
        let exported = crate::device::export(values, &stream, device, tensor, len)?;
        let kept = self.regions.take_device(&self.w, tensor, device, &stream)?;
        let copied = match &kept {
            // The DMA waits for the producer's work: without the GIL, so other threads go on.
            Kept::Device(_, p) => values.py().detach(|| crate::device::copy_in(p, &exported)),
            Kept::Host(_) => Ok(()),
        };
        if let Err(e) = copied {
            self.regions.give(tensor, kept);
            return Err(e);
        }
        Ok(kept)
    }

    #[cfg(not(feature = "cuda"))]
    fn staged_device(&self, tensor: &str, _: &Bound<'_, PyAny>, device: i32) -> PyResult<Kept> {
        // Not reached: `cuda_device` refuses device memory in a build without the feature.
        Err(ConfigError::new_err(format!(
            "tensor {tensor:?}: the buffer is on CUDA device {device}; this build of falcon \
             moves host memory"
        )))
    }

    /// A kept region for a pull into `out`, and what completing it does.
    fn pull_target(&self, tensor: &str, out: &Bound<'_, PyAny>) -> PyResult<(Kept, Done)> {
        #[cfg(feature = "cuda")]
        if let Some(device) = cuda_device(out, tensor)? {
            let len = self.len_of(tensor)?;
            let stream = self.devices.stream(device)?;
            // Checked now (type, length, layout) and held, as a host buffer is, until the
            // pull completes and writes it.
            let exported = crate::device::export(out, &stream, device, tensor, len)?;
            let kept = self.regions.take_device(&self.w, tensor, device, &stream)?;
            return Ok((kept, Done::PullDevice(exported)));
        }
        #[cfg(not(feature = "cuda"))]
        cuda_device(out, tensor)?;
        let buf = self.buffer_of(out, tensor, true)?;
        let kept = self.regions.take(&self.w, tensor)?;
        Ok((kept, Done::Pull(buf)))
    }

    /// Sends a copy of `values` with `send` (a blocking engine call, run without the GIL),
    /// then keeps the region for reuse.
    fn send_staged(
        &self,
        py: Python<'_>,
        what: &str,
        tensor: &str,
        values: &Bound<'_, PyAny>,
        send: impl FnOnce(&falcon_engine::Worker, &str, &Region) -> falcon_engine::Result<()>
        + Send
        + 'static,
    ) -> PyResult<()> {
        let kept = self.staged(tensor, values)?;
        let (w, t, r) = (self.w.clone(), tensor.to_string(), kept.region().clone());
        let out = blocking(py, what, move || send(&w, &t, &r).map_err(engine_err));
        self.regions.give(tensor, kept);
        out
    }

    fn start_push(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<Handle> {
        let kept = self.staged(tensor, grad)?;
        // Starting may wait (a previous push of the shard still in flight, the servers'
        // memory cap): without the GIL, so other Python threads go on.
        let started = py.detach(|| self.w.push_async(tensor, kept.region(), clock));
        match started {
            Ok(h) => Ok(Handle::new(
                h,
                Done::Push,
                tensor,
                kept,
                self.regions.clone(),
            )),
            Err(e) => {
                self.regions.give(tensor, kept);
                Err(engine_err(e))
            }
        }
    }

    fn start_push_pull(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<(Handle, Handle)> {
        let staged = self.staged(tensor, grad)?;
        let (kept, done) = match self.pull_target(tensor, out) {
            Ok(k) => k,
            Err(e) => {
                self.regions.give(tensor, staged);
                return Err(e);
            }
        };
        // Starting may wait (a previous push of the shard still in flight): without the GIL.
        let started = py.detach(|| {
            self.w
                .push_pull_async(tensor, staged.region(), kept.region(), clock)
        });
        match started {
            Ok((pushed, pulled)) => Ok((
                Handle::new(pushed, Done::Push, tensor, staged, self.regions.clone()),
                Handle::new(pulled, done, tensor, kept, self.regions.clone()),
            )),
            Err(e) => {
                self.regions.give(tensor, staged);
                self.regions.give(tensor, kept);
                Err(engine_err(e))
            }
        }
    }

    fn start_pull(
        &self,
        py: Python<'_>,
        tensor: &str,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<Handle> {
        let (kept, done) = self.pull_target(tensor, out)?;
        // Starting may wait (ElasticBSP's barrier waits for the scheduler's plan): without
        // the GIL, so the other workers' threads in this process reach theirs.
        let started = py.detach(|| self.w.pull_async(tensor, kept.region(), clock));
        match started {
            Ok(h) => Ok(Handle::new(h, done, tensor, kept, self.regions.clone())),
            Err(e) => {
                self.regions.give(tensor, kept);
                Err(engine_err(e))
            }
        }
    }
}

#[pymethods]
impl Worker {
    /// Joins the job the environment describes (the launch contract; `overrides` first, as
    /// FALCON_* variables) as a worker training `tensors`, a list of (name, length in
    /// floats). Every worker of a job declares the same tensors. Blocks (the GIL released)
    /// until the job's rendezvous completes.
    ///
    /// `dtypes` names the tensors whose values are 16-bit numbers (tensor name →
    /// "bfloat16" or "float16"; the rest are float32): they travel as 16 bits, exactly.
    #[staticmethod]
    #[pyo3(signature = (tensors, overrides, dtypes = None))]
    fn join(
        py: Python<'_>,
        tensors: Vec<(String, u64)>,
        overrides: HashMap<String, String>,
        dtypes: Option<HashMap<String, String>>,
    ) -> PyResult<Worker> {
        let launch = crate::launch(&overrides)?;
        if launch.role != Role::Worker {
            return Err(ConfigError::new_err(format!(
                "this process is the job's {} by its environment, not a worker",
                launch.role.name()
            )));
        }
        if tensors.is_empty() {
            return Err(ConfigError::new_err(
                "a worker must declare at least one tensor",
            ));
        }
        let mut lens = HashMap::new();
        let mut names = Vec::new();
        for (name, len) in &tensors {
            if name.is_empty() || *len == 0 {
                return Err(ConfigError::new_err(format!(
                    "tensor {name:?} of {len} floats: a tensor needs a name and at least one float"
                )));
            }
            if lens.insert(name.clone(), *len).is_some() {
                return Err(ConfigError::new_err(format!(
                    "tensor {name:?} is declared twice"
                )));
            }
            names.push(name.clone());
        }
        let dtypes = dtypes.unwrap_or_default();
        if let Some(n) = dtypes.keys().find(|n| !lens.contains_key(*n)) {
            return Err(ConfigError::new_err(format!(
                "a dtype is given for {n:?}, which is not a declared tensor"
            )));
        }
        let mut specs = Vec::with_capacity(tensors.len());
        for (name, len) in tensors {
            let wire = match dtypes.get(&name).map(|d| d.trim()) {
                None | Some("float32" | "torch.float32") => None,
                Some("bfloat16" | "torch.bfloat16") => Some(Wire::Bf16),
                Some("float16" | "torch.float16") => Some(Wire::F16Native),
                Some(other) => {
                    return Err(ConfigError::new_err(format!(
                        "tensor {name:?} is {other}: falcon's tensors hold float32, bfloat16 \
                         or float16 values"
                    )));
                }
            };
            specs.push(TensorSpec {
                wire,
                ..TensorSpec::new(name, len)
            });
        }
        let (cfg, rank) = (launch.config, launch.rank);
        let w = crate::worker::blocking(py, "join", move || {
            falcon_engine::Worker::join(&cfg, specs, rank).map_err(engine_err)
        })?;
        Ok(Worker {
            w,
            lens,
            names,
            regions: Arc::default(),
            #[cfg(feature = "cuda")]
            devices: Arc::default(),
        })
    }

    /// This worker's rank, 0 ≤ rank < workers.
    #[getter]
    fn rank(&self) -> u32 {
        self.w.rank()
    }

    /// The job's workers.
    #[getter]
    fn workers(&self) -> u32 {
        self.w.workers()
    }

    /// The declared tensors: a list of (name, length in floats) in declaration order.
    #[getter]
    fn tensors(&self) -> Vec<(String, u64)> {
        self.names
            .iter()
            .map(|n| (n.clone(), self.lens[n]))
            .collect()
    }

    /// The job's rules as the scheduler gave them: a dict with `policy` (its text, as
    /// `policy=` takes it), `optimizer` ("sgd", "momentum", "adam" or "adagrad"), `lr` (the rate the job
    /// was given, FALCON_LR), `lr_per_push` (the rate each gradient is applied with: `lr`, or
    /// `lr` / workers under an asynchronous policy),
    /// `momentum`, `betas` and `eps` where the optimizer has them, `aggregate` ("mean" or
    /// "sum") and `mode` ("sync": a clock's gradients are combined, then applied; "async":
    /// each is applied as it arrives, with lr / workers), `wire` ("f32", "bf16" or "f16":
    /// FALCON_WIRE).
    #[getter]
    fn job<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use falcon_engine::update::{Aggregate, Optimizer, UpdateMode};
        let d = PyDict::new(py);
        d.set_item("policy", self.w.policy().to_string())?;
        d.set_item("wire", self.w.wire().name())?;
        let (aggregate, mode) = self.w.update_rule();
        // The servers of an asynchronous policy apply each gradient at the job's rate divided
        // by the workers: `lr` is the rate as the job was given it, `lr_per_push` as applied.
        let per_push = self.w.optimizer().lr();
        let given = match mode {
            UpdateMode::Async => per_push * self.w.workers().max(1) as f32,
            UpdateMode::Sync => per_push,
        };
        d.set_item("lr_per_push", per_push)?;
        match self.w.optimizer().with_lr(given) {
            Optimizer::Sgd { lr } => {
                d.set_item("optimizer", "sgd")?;
                d.set_item("lr", lr)?;
            }
            Optimizer::Momentum { lr, mu } => {
                d.set_item("optimizer", "momentum")?;
                d.set_item("lr", lr)?;
                d.set_item("momentum", mu)?;
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                wd,
            } => {
                d.set_item("optimizer", if wd > 0.0 { "adamw" } else { "adam" })?;
                d.set_item("lr", lr)?;
                d.set_item("weight_decay", wd)?;
                d.set_item("betas", (beta1, beta2))?;
                d.set_item("eps", eps)?;
            }
            Optimizer::Adagrad { lr, eps } => {
                d.set_item("optimizer", "adagrad")?;
                d.set_item("lr", lr)?;
                d.set_item("eps", eps)?;
            }
            Optimizer::Local { lr } => {
                d.set_item("optimizer", "local")?;
                d.set_item("lr", lr)?;
            }
        }
        d.set_item(
            "aggregate",
            match aggregate {
                Aggregate::Mean => "mean",
                Aggregate::Sum => "sum",
            },
        )?;
        d.set_item(
            "mode",
            match mode {
                UpdateMode::Sync => "sync",
                UpdateMode::Async => "async",
            },
        )?;
        Ok(d)
    }

    /// True when `policy` (a policy's text) names the job's policy; a text that names no
    /// policy raises ConfigError saying why.
    fn runs_policy(&self, policy: &str) -> PyResult<bool> {
        let spec: falcon_engine::sync::PolicySpec = policy.parse().map_err(engine_err)?;
        Ok(spec == self.w.policy())
    }

    /// True when this worker rejoined a running job (after an eviction) rather than starting.
    #[getter]
    fn rejoined(&self) -> bool {
        self.w.rejoined()
    }

    /// The worker's clock: the fewest gradients pushed to any tensor it has pushed.
    fn clock(&self) -> u64 {
        self.w.clock()
    }

    /// Gradients pushed to `tensor` so far: its next push's clock.
    fn clock_of(&self, tensor: &str) -> PyResult<u64> {
        self.len_of(tensor)?;
        self.w.clock_of(tensor).map_err(engine_err)
    }

    /// Sets `tensor`'s initial values on the servers (the first initialization of each shard
    /// wins); `values` is any float32 buffer of the tensor's length.
    fn init_tensor(&self, py: Python<'_>, tensor: &str, values: &Bound<'_, PyAny>) -> PyResult<()> {
        self.send_staged(py, "init", tensor, values, |w, t, r| w.init(t, r))
    }

    /// Pushes `grad` (a float32 buffer of the tensor's length) as this worker's gradient for
    /// `clock`, which must be the tensor's next clock. Returns once the servers have it.
    fn push(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<()> {
        self.start_push(py, tensor, grad, clock)?.finish(py)
    }

    /// Starts a push and returns its handle; `grad` is copied before this returns, so it may
    /// be reused at once.
    fn push_async(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<Handle> {
        self.start_push(py, tensor, grad, clock)
    }

    /// Pulls `tensor` into `out` (a writable float32 buffer of its length) for `clock`:
    /// returns when `out` holds values the job's policy lets this clock see.
    fn pull(
        &self,
        py: Python<'_>,
        tensor: &str,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<()> {
        self.start_pull(py, tensor, out, clock)?.finish(py)
    }

    /// Starts a pull and returns its handle; `out` is written when the handle's `wait`
    /// returns, and must stay alive until then.
    fn pull_async(
        &self,
        py: Python<'_>,
        tensor: &str,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<Handle> {
        self.start_pull(py, tensor, out, clock)
    }

    /// Pushes `grad` as this worker's gradient for `clock`, then pulls into `out` the values
    /// for `clock + 1`, shard by shard: each shard's pull rides in its push (one exchange),
    /// so the two directions of a link work at once, and each answer comes after this push
    /// was applied (unless the policy drops it or counts it for a later step: Sync-opt's
    /// backups). Blocks (the GIL released) until `out` is written; `grad` is copied first.
    fn push_pull(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<()> {
        let (mut pushed, mut pulled) = self.start_push_pull(py, tensor, grad, out, clock)?;
        pushed.finish(py)?;
        pulled.finish(py)
    }

    /// Starts a `push_pull`: returns the push's handle (done once the servers have the
    /// gradient) and the pull's (done once `out` holds the values for `clock + 1`). `grad` is
    /// copied before this returns; `out` is written when the pull's `wait` returns, and must
    /// stay alive until then.
    fn push_pull_async(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        clock: u64,
    ) -> PyResult<(Handle, Handle)> {
        self.start_push_pull(py, tensor, grad, out, clock)
    }

    /// Pushes the gradient of some rows of `tensor`, seen as a table of rows of `dim` floats
    /// (`dim` defaults to `len(grads) / len(rows)`), as this worker's gradient for `clock`:
    /// `rows` holds integer row ids (duplicates are summed), `grads` their gradients, row
    /// after row (float32; a 2-D array of `len(rows)` × `dim` is fine). Only these rows
    /// travel; every other row's gradient is zero. The job's optimizer must be sgd or
    /// adagrad.
    #[pyo3(signature = (tensor, rows, grads, clock, dim=None))]
    fn push_rows(
        &self,
        py: Python<'_>,
        tensor: &str,
        rows: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        clock: u64,
        dim: Option<u64>,
    ) -> PyResult<()> {
        let ids = row_ids(py, tensor, rows)?;
        let values = floats(py, tensor, grads)?;
        let dim = row_width(tensor, dim, ids.len(), values.len())?;
        let (w, t) = (self.w.clone(), tensor.to_string());
        blocking(py, "push_rows", move || {
            w.push_rows(&t, dim, &ids, &values, clock)
                .map_err(engine_err)
        })
    }

    /// Pulls some rows of `tensor` (a table of rows of `dim` floats; `dim` defaults to
    /// `len(out) / len(rows)`) for `clock` into `out`, a writable float32 buffer of
    /// `len(rows)` × `dim` values, row after row, with the values the job's policy lets this
    /// clock see.
    #[pyo3(signature = (tensor, rows, out, clock, dim=None))]
    fn pull_rows(
        &self,
        py: Python<'_>,
        tensor: &str,
        rows: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        clock: u64,
        dim: Option<u64>,
    ) -> PyResult<()> {
        let ids = row_ids(py, tensor, rows)?;
        let obj = numpy_view(out)?;
        let buf = PyBuffer::<f32>::get(obj.as_ref().unwrap_or(out)).map_err(|e| {
            TensorError::new_err(format!(
                "tensor {tensor:?}: the rows' buffer must hold float32 values ({e})"
            ))
        })?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(LengthError::new_err(format!(
                "tensor {tensor:?}: a row pull needs a writable, contiguous buffer"
            )));
        }
        let dim = row_width(tensor, dim, ids.len(), buf.item_count())?;
        let (w, t, n) = (self.w.clone(), tensor.to_string(), buf.item_count());
        let got = blocking(py, "pull_rows", move || {
            let mut v = vec![0f32; n];
            w.pull_rows(&t, dim, &ids, &mut v, clock)
                .map_err(engine_err)?;
            Ok(v)
        })?;
        buf.copy_from_slice(py, &got)
    }

    /// Sets what this worker's next pushes ask of the servers' update, as multiples of the
    /// job's: `lr` × the servers' learning rate (a schedule of your own) and `weight_decay`
    /// × AdamW's decoupled decay (0 for parameters that take none); each defaults to 1.
    /// With neither, the job's own. Worker-wide; every push made afterwards carries them.
    #[pyo3(signature = (lr=None, weight_decay=None))]
    fn set_rates(&self, lr: Option<f32>, weight_decay: Option<f32>) -> PyResult<()> {
        let rates =
            (lr.is_some() || weight_decay.is_some()).then(|| falcon_engine::update::Rates {
                lr: lr.unwrap_or(1.0),
                wd: weight_decay.unwrap_or(1.0),
            });
        self.w.set_rates(rates).map_err(engine_err)
    }

    /// Waits until every live worker has reached this barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.w.clone();
        blocking(py, "barrier", move || w.barrier().map_err(engine_err))
    }

    /// Tells the scheduler this worker is done and closes its links (the job ends when every
    /// worker is). A second call does nothing.
    fn finish(&self) -> PyResult<()> {
        self.w.finish().map_err(engine_err)
    }

    /// Stops the whole job, saying `why` (this process was interrupted, or its script
    /// failed): every other worker's next operation fails with a PeerError naming this
    /// worker and `why`, and the job ends failed. A finished worker stops nothing.
    fn abort(&self, why: &str) -> PyResult<()> {
        self.w.abort(why).map_err(engine_err)
    }

    /// Workers the scheduler has declared dead.
    fn dead_workers(&self) -> Vec<u32> {
        self.w.dead_workers()
    }

    /// Counters of this worker, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.w.stats();
        let d = PyDict::new(py);
        d.set_item("fast_pulls", s.fast_pulls)?;
        d.set_item("slow_pulls", s.slow_pulls)?;
        d.set_item("pushes", s.pushes)?;
        d.set_item("pull_wait_s", s.pull_wait.as_secs_f64())?;
        d.set_item("barrier_wait_s", s.barrier_wait.as_secs_f64())?;
        d.set_item("offers", s.offers)?;
        d.set_item("help_pushes", s.help_pushes)?;
        d.set_item("staleness_sum", s.staleness_sum)?;
        d.set_item("staleness_acks", s.staleness_acks)?;
        d.set_item("staleness_max", s.staleness_max)?;
        d.set_item("reconnects", s.reconnects)?;
        Ok(d)
    }

    // --- task transfer and elastic parallelism (the task-driven trainer) ---

    /// Gives helpers this worker's unprocessed tasks from `tasks` (a `Tasks`): a helper's
    /// request for iteration `clock` takes the tail of what is left, only if that iteration
    /// is the one in the source, and leaves at least `keep` tasks for this worker.
    #[pyo3(signature = (tasks, keep=0))]
    fn serve_steals(&self, tasks: &crate::tasks::Tasks, keep: usize) {
        let source = tasks.source();
        self.w.on_steal(move |clock, want| {
            match source.steal_for_keeping(clock, want as usize, keep) {
                Some(s) => s.tasks.start as u32..s.tasks.end as u32,
                None => 0..0,
            }
        });
    }

    /// Task-transfer offers the servers made while this worker's pull was parked: a list of
    /// (straggler, clock).
    fn offers(&self) -> Vec<(u32, u64)> {
        self.w
            .offers()
            .into_iter()
            .map(|o| (o.straggler, o.clock))
            .collect()
    }

    /// How many completions (answers, acknowledgements, offers) this worker has received so
    /// far: read it, check what you wait for, then `wait_news(count, timeout)`.
    fn news(&self) -> u64 {
        self.w.news()
    }

    /// Sleeps until something arrives after `seen` (a count from `news()`) — an answer, an
    /// acknowledgement, an offer — or `timeout` seconds pass; returns the count then. Waits
    /// without the GIL; Ctrl-C interrupts it.
    fn wait_news(&self, py: Python<'_>, seen: &Bound<'_, PyAny>, timeout: f64) -> PyResult<u64> {
        let seen: u64 = seen.extract().map_err(|_| {
            ConfigError::new_err("wait_news: seen must be a count from news() (an int ≥ 0)")
        })?;
        if !timeout.is_finite() || timeout < 0.0 {
            return Err(ConfigError::new_err(format!(
                "wait_news: timeout must be a finite number of seconds ≥ 0, not {timeout}"
            )));
        }
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_secs_f64(timeout.min(1e6));
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let w = &self.w;
            let n = py.detach(|| w.wait_news(seen, left.min(SLICE)));
            if n != seen || left <= SLICE {
                return Ok(n);
            }
            py.check_signals()?;
        }
    }

    /// Asks `straggler` for up to `want` unprocessed tasks of its iteration `clock`: returns
    /// (start, end), the task range now this worker's to compute and push with `push_for`
    /// (empty when none is left).
    fn steal(&self, py: Python<'_>, straggler: u32, clock: u64, want: u32) -> PyResult<(u32, u32)> {
        let w = self.w.clone();
        let r = blocking(py, "steal", move || {
            w.steal(straggler, clock, want).map_err(engine_err)
        })?;
        Ok((r.start, r.end))
    }

    /// Pushes the gradient of tasks taken from `straggler` for its iteration `clock`,
    /// credited to it (exactly once).
    fn push_for(
        &self,
        py: Python<'_>,
        tensor: &str,
        grad: &Bound<'_, PyAny>,
        straggler: u32,
        clock: u64,
    ) -> PyResult<()> {
        self.send_staged(py, "push_for", tensor, grad, move |w, t, r| {
            w.push_for(t, r, straggler, clock)
        })
    }

    /// Reports an iteration to the scheduler's parallelism manager: threads used, tasks
    /// processed, and its duration in seconds.
    fn report_iteration(&self, threads: usize, tasks: u32, seconds: f64) -> PyResult<()> {
        let d = Duration::try_from_secs_f64(seconds.max(0.0))
            .map_err(|_| ConfigError::new_err(format!("{seconds} is not a duration")))?;
        self.w
            .report_iteration(threads, tasks, d)
            .map_err(engine_err)
    }

    /// The thread count the parallelism manager advises for the next iteration, if any.
    fn advised_threads(&self) -> Option<usize> {
        self.w.advised_threads()
    }

    fn __repr__(&self) -> String {
        format!(
            "<falcon.Worker rank {} of {}, {} tensors>",
            self.w.rank(),
            self.w.workers(),
            self.names.len()
        )
    }
}

/// What completing an operation does.
enum Done {
    Push,
    /// Copy the region into this buffer.
    Pull(PyBuffer<f32>),
    /// Copy the (page-locked) region into this exported CUDA tensor.
    #[cfg(feature = "cuda")]
    PullDevice(crate::device::Exported),
}

/// A push or pull in flight: `wait()` returns when it is done (raising its error, if any);
/// `ready()` says whether `wait()` would return at once.
#[pyclass(module = "falcon")]
pub struct Handle {
    /// `None` once waited for.
    op: Option<(falcon_engine::Handle, Done)>,
    tensor: String,
    region: Option<Kept>,
    regions: Arc<Regions>,
    started: Instant,
}

impl Handle {
    fn new(
        h: falcon_engine::Handle,
        done: Done,
        tensor: &str,
        region: Kept,
        regions: Arc<Regions>,
    ) -> Handle {
        Handle {
            op: Some((h, done)),
            tensor: tensor.to_string(),
            region: Some(region),
            regions,
            started: Instant::now(),
        }
    }

    /// Waits (the GIL released, Ctrl-C checked), then completes the operation.
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some((h, done)) = self.op.take() else {
            return Err(Error::new_err("this handle was already waited for"));
        };
        let outcome = wait_handle(py, &h);
        if let Err(e) = outcome {
            if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
                // Interrupted, not failed: the operation goes on; wait again later.
                self.op = Some((h, done));
            } else if let Done::Pull(buf) = done {
                drop(buf);
            }
            return Err(e);
        }
        let region = self.region.take();
        let copied = match (&done, &region) {
            (Done::Pull(buf), Some(k)) => Worker::drain(k.region(), buf),
            #[cfg(feature = "cuda")]
            (Done::PullDevice(e), Some(Kept::Device(_, p))) => {
                py.detach(|| crate::device::copy_out(p, e))
            }
            _ => Ok(()),
        };
        if let Done::Pull(buf) = done {
            drop(buf);
        }
        if let Some(r) = region {
            self.regions.give(&self.tensor, r);
        }
        copied
    }
}

#[pymethods]
impl Handle {
    /// Waits for the operation; raises its error if it failed. A pull's buffer holds the
    /// values when this returns.
    fn wait(&mut self, py: Python<'_>) -> PyResult<()> {
        self.finish(py)
    }

    /// True when `wait()` would return at once.
    fn ready(&self) -> bool {
        self.op.as_ref().is_none_or(|(h, _)| h.ready())
    }

    /// Seconds since the operation started.
    #[getter]
    fn age(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn __repr__(&self) -> String {
        format!(
            "<falcon.Handle on {:?}, {}>",
            self.tensor,
            if self.op.is_none() {
                "done"
            } else if self.ready() {
                "ready"
            } else {
                "in flight"
            }
        )
    }
}
