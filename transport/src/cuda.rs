//! CUDA (feature `cuda`): the device, its memory, kernels compiled at run time and cuBLAS.
//!
//! Everything goes through [cudarc](https://docs.rs/cudarc) with dynamic loading: a build
//! needs no CUDA toolkit, and libcuda (the driver), libcublas and libnvrtc are looked for on
//! the dynamic loader's path when first used. cudarc *panics* when a library it needs is
//! missing, so every entry point here checks first and returns a typed [`CudaError`] that
//! names what is missing instead.
//!
//! This is the one place of falcon that holds CUDA's `unsafe` calls (kernel launches, sgemm,
//! the NVRTC calls that produce a cubin, in `pinned.rs` the page-locking of a staging
//! region and the copies between it and device memory a caller owns, and in `staged.rs` a
//! [`DeviceRegion`]'s copies to and from its device memory); the crates above it compute on the device through
//! the checked, safe functions of this module and the safe parts of cudarc re-exported as
//! [`cudarc`]. It knows nothing of models: kernels come in as CUDA C++ source with a
//! declared signature ([`Signature`]) that every launch is checked against.

use std::ffi::{CStr, c_char};
use std::sync::Arc;

pub use cudarc;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PinnedHostSlice, PushKernelArg, sys,
};
use cudarc::nvrtc::{Ptx, result as nvrtc_result, sys as nvrtc_sys};

mod pinned;
mod staged;
pub use pinned::PinnedRegion;
pub use staged::{DeviceRegion, Staged};

/// What can go wrong with CUDA.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library is not on the dynamic loader's path.
    #[error("{library} not found ({what}); looked for {candidates} on the loader's path")]
    Missing {
        /// The library, e.g. `libcuda`.
        library: &'static str,
        /// What it is and where it usually comes from.
        what: &'static str,
        /// The file names looked for.
        candidates: String,
    },
    /// The driver is there but sees no device.
    #[error("the CUDA driver is installed but reports no device ({0})")]
    NoDevice(String),
    /// The ordinal asked for is not one of the devices.
    #[error("no CUDA device {ordinal}: the driver reports {count}")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// NVRTC could not compile a kernel source.
    #[error("NVRTC ({arch}): {why}")]
    Compile {
        /// The target architecture (`sm_90`).
        arch: String,
        /// The compiler's message or log.
        why: String,
    },
    /// A kernel or sgemm call does not match its declaration or its buffers.
    #[error("{0}")]
    Call(String),
}

/// This module's result.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// `CUDA_ERROR_NAME: description` for a driver error (cudarc's own `Display` is `Debug`).
fn driver_message(e: &DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", e.0 as i32));
    match e.error_string() {
        Ok(s) => format!("{name}: {}", s.to_string_lossy()),
        Err(_) => name,
    }
}

fn driver(e: DriverError) -> CudaError {
    if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE {
        CudaError::NoDevice(driver_message(&e))
    } else {
        CudaError::Driver(driver_message(&e))
    }
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        driver(e)
    }
}

fn blas(e: cudarc::cublas::result::CublasError) -> CudaError {
    CudaError::Blas(format!("status {}", e.0 as i32))
}

fn candidates(lib: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    for n in cudarc::get_lib_name_candidates(lib) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names.join(", ")
}

/// Whether libcuda (the NVIDIA driver's user-space library) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: loads (and unloads) the shared library by name; NVIDIA's libraries' initialisers
    // have no preconditions.
    unsafe { sys::is_culib_present() }
}

/// Whether libnvrtc (the run-time CUDA C++ compiler) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Whether libcublas can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: as in `driver_present`.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

fn require_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(CudaError::Missing {
            library: "libcuda",
            what: "the NVIDIA driver's library; install the driver",
            candidates: candidates("cuda"),
        })
    }
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(CudaError::Missing {
            library: "libnvrtc",
            what: "CUDA's run-time compiler: the toolkit, or `pip install nvidia-cuda-nvrtc-cu12` \
                   and its lib folder on LD_LIBRARY_PATH",
            candidates: candidates("nvrtc"),
        })
    }
}

fn require_cublas() -> Result<()> {
    if cublas_present() {
        Ok(())
    } else {
        Err(CudaError::Missing {
            library: "libcublas",
            what: "cuBLAS: the toolkit, or `pip install nvidia-cublas-cu12` and its lib folder on \
                   LD_LIBRARY_PATH",
            candidates: candidates("cublas"),
        })
    }
}

/// One device as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its ordinal.
    pub ordinal: usize,
    /// Its name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability (major, minor): (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub memory_bytes: usize,
    /// Whether the device can export its memory as a dma-buf (for `ibv_reg_dmabuf_mr`).
    pub dma_buf: bool,
    /// Whether the device supports GPUDirect RDMA at all (peer memory or dma-buf).
    pub gpu_direct_rdma: bool,
}

impl DeviceInfo {
    /// The NVRTC architecture name for this device, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// The driver and its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, (major, minor), e.g. (13, 0).
    pub cuda_version: (i32, i32),
    /// The devices (may be empty only if the driver reports none without an error).
    pub devices: Vec<DeviceInfo>,
}

/// Looks at the driver and its devices without keeping anything open.
///
/// Fails with [`CudaError::Missing`] without libcuda and [`CudaError::NoDevice`] when the
/// driver sees no device.
pub fn probe() -> Result<DriverInfo> {
    require_driver()?;
    cudarc::driver::result::init().map_err(driver)?;
    let mut version = 0;
    // SAFETY: cuDriverGetVersion writes one int through the valid pointer it is given.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver)?;
    let count = cudarc::driver::result::device::get_count().map_err(driver)?;
    let mut devices = Vec::new();
    for ordinal in 0..count {
        devices.push(device_info(ordinal)?);
    }
    if devices.is_empty() {
        return Err(CudaError::NoDevice(
            "the driver counts 0 devices".to_string(),
        ));
    }
    Ok(DriverInfo {
        cuda_version: (version / 1000, (version % 1000) / 10),
        devices,
    })
}

fn device_info(ordinal: i32) -> Result<DeviceInfo> {
    use cudarc::driver::result::device;
    let dev = device::get(ordinal).map_err(driver)?;
    let name = device::get_name(dev).map_err(driver)?;
    let attr = |a| {
        // SAFETY: `dev` was returned by cuDeviceGet just above.
        unsafe { device::get_attribute(dev, a) }.map_err(driver)
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: as above.
    let memory_bytes = unsafe { device::total_mem(dev) }.map_err(driver)?;
    // Older drivers do not know these attributes: unknown is "no".
    let flag = |a| attr(a).map(|v| v != 0).unwrap_or(false);
    Ok(DeviceInfo {
        ordinal: ordinal as usize,
        name,
        compute_capability: (major, minor),
        memory_bytes,
        dma_buf: flag(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
        gpu_direct_rdma: flag(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
        ),
    })
}

/// Whether the kernel module for peer-memory GPUDirect RDMA (`nvidia_peermem`, or the older
/// `nv_peer_mem`) is loaded.
pub fn peer_memory_loaded() -> bool {
    ["nvidia_peermem", "nv_peer_mem"]
        .iter()
        .any(|m| std::path::Path::new("/sys/module").join(m).exists())
}

/// Compiles CUDA C++ `src` with NVRTC to a cubin for `arch` (`sm_80`, `sm_90`…): the machine
/// code a device of that architecture loads as is. Needs libnvrtc only, no device.
pub fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>> {
    let prog = Program::compile(src, arch)?;
    let mut size = 0usize;
    // SAFETY: `prog` is a live, compiled program; the call writes one usize.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| prog.error(arch, e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes NVRTC just said the cubin needs.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| prog.error(arch, e))?;
    if cubin.is_empty() {
        return Err(CudaError::Compile {
            arch: arch.to_string(),
            why: "NVRTC produced an empty cubin".to_string(),
        });
    }
    Ok(cubin)
}

/// The version of the NVRTC that is loaded, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the call writes two ints through valid pointers.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Compile {
            arch: String::new(),
            why: nvrtc_message(e),
        })?;
    Ok((major, minor))
}

fn nvrtc_message(e: nvrtc_result::NvrtcError) -> String {
    // SAFETY: nvrtcGetErrorString returns a static, NUL-terminated string for any code.
    let s = unsafe { CStr::from_ptr(nvrtc_sys::nvrtcGetErrorString(e.0)) };
    s.to_string_lossy().into_owned()
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Program {
    fn compile(src: &str, arch: &str) -> Result<Self> {
        require_nvrtc()?;
        let bad = |why: String| CudaError::Compile {
            arch: arch.to_string(),
            why,
        };
        let valid_arch = arch.len() > 3
            && arch.starts_with("sm_")
            && arch[3..].bytes().all(|b| b.is_ascii_alphanumeric());
        if !valid_arch {
            return Err(bad(format!("`{arch}` is not an architecture like sm_90")));
        }
        let csrc = std::ffi::CString::new(src)
            .map_err(|_| bad("the source holds a NUL byte".to_string()))?;
        let prog =
            Program(nvrtc_result::create_program(&csrc, None).map_err(|e| bad(nvrtc_message(e)))?);
        let options = [
            format!("--gpu-architecture={arch}"),
            "--std=c++14".to_string(),
        ];
        // SAFETY: `prog` was created just above and is destroyed only on drop.
        if let Err(e) = unsafe { nvrtc_result::compile_program(prog.0, &options) } {
            return Err(prog.error(arch, e));
        }
        Ok(prog)
    }

    /// The error `e` with the program's log.
    fn error(&self, arch: &str, e: nvrtc_result::NvrtcError) -> CudaError {
        // SAFETY: `self.0` is a live program.
        let log = unsafe { nvrtc_result::get_program_log(self.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).trim().to_string()
            })
            .unwrap_or_default();
        CudaError::Compile {
            arch: arch.to_string(),
            why: if log.is_empty() {
                nvrtc_message(e)
            } else {
                format!("{}: {log}", nvrtc_message(e))
            },
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program is live and dropped once.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

/// The type of one kernel parameter, as declared in a [`Signature`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    /// `const float*`
    F32s,
    /// `float*`
    F32sMut,
    /// `const unsigned int*`
    U32s,
    /// `unsigned int*`
    U32sMut,
    /// `const unsigned char*`
    U8s,
    /// `unsigned int`
    U32,
    /// `float`
    F32,
}

/// A kernel's name and parameter types, exactly as its CUDA C++ source declares them.
///
/// Convention every kernel of a [`Kernels`] set follows: its **first** parameter is an
/// `unsigned int` count `n`, it runs on (at least) `n` threads, and a thread whose global
/// index is `n` or more returns at once; a launch passes that count with [`Lane::launch`].
#[derive(Debug, Clone, Copy)]
pub struct Signature {
    /// The `extern "C"` name.
    pub name: &'static str,
    /// The parameters after the count, in order.
    pub params: &'static [Ty],
}

/// One argument of a launch.
pub enum Arg<'v, 'a> {
    /// A `const float*`.
    F32s(&'v CudaView<'a, f32>),
    /// A `float*`.
    F32sMut(&'v mut CudaViewMut<'a, f32>),
    /// A `const unsigned int*`.
    U32s(&'v CudaView<'a, u32>),
    /// An `unsigned int*`.
    U32sMut(&'v mut CudaViewMut<'a, u32>),
    /// A `const unsigned char*`.
    U8s(&'v CudaView<'a, u8>),
    /// An `unsigned int`.
    U32(u32),
    /// A `float`.
    F32(f32),
}

impl Arg<'_, '_> {
    fn ty(&self) -> Ty {
        match self {
            Arg::F32s(_) => Ty::F32s,
            Arg::F32sMut(_) => Ty::F32sMut,
            Arg::U32s(_) => Ty::U32s,
            Arg::U32sMut(_) => Ty::U32sMut,
            Arg::U8s(_) => Ty::U8s,
            Arg::U32(_) => Ty::U32,
            Arg::F32(_) => Ty::F32,
        }
    }
}

/// A CUDA device with its primary context.
#[derive(Debug, Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    info: DeviceInfo,
}

impl Gpu {
    /// Opens device `ordinal`. Fails with a typed error, never a panic: [`CudaError::Missing`]
    /// without libcuda, [`CudaError::NoDevice`] when the driver sees none.
    pub fn open(ordinal: usize) -> Result<Self> {
        require_driver()?;
        cudarc::driver::result::init().map_err(driver)?;
        let count = cudarc::driver::result::device::get_count().map_err(driver)?;
        let count = usize::try_from(count).unwrap_or(0);
        if count == 0 {
            return Err(CudaError::NoDevice(
                "the driver counts 0 devices".to_string(),
            ));
        }
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let info = device_info(ordinal as i32)?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        Ok(Self { ctx, info })
    }

    /// The device's description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The context (for cudarc's safe allocation and copy functions).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `len` zeroed floats of page-locked host memory: copies between it and the device are
    /// asynchronous DMA, with no staging copy inside the driver (cudarc's `memcpy_htod` and
    /// `memcpy_dtoh` take it; its `as_slice` waits for the copies queued on it).
    pub fn pinned(&self, len: usize) -> Result<PinnedHostSlice<f32>> {
        let len = len.max(1);
        if len > isize::MAX as usize / size_of::<f32>() {
            return Err(CudaError::Call(format!("{len} pinned floats is too many")));
        }
        // SAFETY: the allocation is uninitialised; it is zeroed just below, through a raw
        // pointer, before any reference to it exists. Flags 0: cached (not write-combined)
        // memory, so the host reads it back at full speed.
        let mut p = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len, 0) }?;
        let ptr = p.as_mut_ptr()?;
        // SAFETY: `ptr` points to `len` floats just allocated and not shared with anything.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(p)
    }

    /// A new stream with its own cuBLAS handle: work on different lanes may overlap.
    pub fn lane(&self) -> Result<Lane> {
        require_cublas()?;
        let stream = self.ctx.new_stream().map_err(driver)?;
        let blas = CudaBlas::new(stream.clone()).map_err(blas)?;
        Ok(Lane { stream, blas })
    }

    /// Compiles `src` for this device with NVRTC, loads it, and looks up every kernel of
    /// `signatures`.
    pub fn load(&self, src: &str, signatures: &[Signature]) -> Result<Kernels> {
        let cubin = compile_cubin(src, &self.info.arch())?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .map_err(driver)?;
        let mut functions = Vec::with_capacity(signatures.len());
        for sig in signatures {
            let f = module.load_function(sig.name).map_err(|e| {
                CudaError::Call(format!(
                    "kernel {} is not in the module: {}",
                    sig.name,
                    driver_message(&e)
                ))
            })?;
            functions.push(Kernel { sig: *sig, f });
        }
        Ok(Kernels {
            _module: module,
            functions,
        })
    }
}

/// A loaded module's kernels, looked up by name at load time.
#[derive(Debug)]
pub struct Kernels {
    _module: Arc<CudaModule>,
    functions: Vec<Kernel>,
}

impl Kernels {
    /// The kernel called `name`, if it was declared at load time.
    pub fn get(&self, name: &str) -> Result<&Kernel> {
        self.functions
            .iter()
            .find(|k| k.sig.name == name)
            .ok_or_else(|| CudaError::Call(format!("kernel {name} was not loaded")))
    }
}

/// One loaded kernel and its declared signature.
#[derive(Debug)]
pub struct Kernel {
    sig: Signature,
    f: CudaFunction,
}

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// A stream and the cuBLAS handle bound to it.
#[derive(Debug)]
pub struct Lane {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
}

impl Lane {
    /// The stream (for cudarc's safe copies: `memcpy_htod`, `memcpy_dtoh`, `alloc_zeros`…).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on this lane.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver)
    }

    /// Launches `kernel` on `n` threads with `args` (the parameters after the count).
    ///
    /// Checked: the arguments' types must be the kernel's declared ones. The declared
    /// signature must match the source, and the kernel must keep its accesses within the
    /// buffers it is given for that count (every kernel of falcon's sources bounds-checks
    /// its index against `n`; their callers check the buffers' lengths).
    pub fn launch(&self, kernel: &Kernel, n: u32, args: &mut [Arg<'_, '_>]) -> Result<()> {
        let types: Vec<Ty> = args.iter().map(Arg::ty).collect();
        if types != kernel.sig.params {
            return Err(CudaError::Call(format!(
                "kernel {}: {} argument(s) of the wrong types for its declaration",
                kernel.sig.name,
                args.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(&n);
        for a in args.iter_mut() {
            match a {
                Arg::F32s(v) => b.arg(*v),
                Arg::F32sMut(v) => b.arg(&mut **v),
                Arg::U32s(v) => b.arg(*v),
                Arg::U32sMut(v) => b.arg(&mut **v),
                Arg::U8s(v) => b.arg(*v),
                Arg::U32(x) => b.arg(&*x),
                Arg::F32(x) => b.arg(&*x),
            };
        }
        // SAFETY: the arguments' types were checked against the kernel's declaration, which
        // matches its source; device buffers outlive the launch (cudarc records their use on
        // this stream); the kernel bounds its accesses by the count `n` as documented above.
        unsafe { b.launch(cfg) }.map_err(driver)?;
        Ok(())
    }

    /// Row-major `c = alpha · op(a) · op(b) + beta · c` with cuBLAS, where `c` is `m × n`,
    /// `op(a)` is `m × k` (`a` is stored `k × m` when `ta`) and `op(b)` is `k × n` (`b` is
    /// stored `n × k` when `tb`). Checks every length before calling cuBLAS.
    #[allow(clippy::too_many_arguments)]
    pub fn sgemm(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        beta: f32,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let need = |what: &str, rows: usize, cols: usize, got: usize| -> Result<()> {
            match rows.checked_mul(cols) {
                Some(len) if len <= got => Ok(()),
                _ => Err(CudaError::Call(format!(
                    "sgemm: {what} holds {got} floats, needs {rows}×{cols}"
                ))),
            }
        };
        need("a", m, k, a.len())?;
        need("b", k, n, b.len())?;
        need("c", m, n, c.len())?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| CudaError::Call(format!("sgemm: dimension {v} too large")))
        };
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands.
        let cfg = GemmConfig {
            transa: op(tb),
            transb: op(ta),
            m: ni,
            n: mi,
            k: ki,
            alpha,
            lda: if tb { ki.max(1) } else { ni },
            ldb: if ta { mi } else { ki.max(1) },
            beta,
            ldc: ni,
        };
        // SAFETY: with these leading dimensions cuBLAS reads k·n floats of `b`, m·k of `a`
        // and writes m·n of `c`; the three lengths were checked above.
        unsafe { self.blas.gemm(cfg, b, a, c) }.map_err(blas)
    }
}
