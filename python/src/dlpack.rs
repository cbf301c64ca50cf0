//! DLPack's device types (`DLDeviceType`), shared by the worker (which tells host memory
//! from device memory) and the CUDA path (which checks what a tensor exported).

/// `kDLCPU`.
pub(crate) const CPU: i32 = 1;
/// `kDLCUDA`.
pub(crate) const CUDA: i32 = 2;
/// `kDLCUDAHost`: page-locked host memory.
pub(crate) const CUDA_HOST: i32 = 3;
/// `kDLCUDAManaged`.
pub(crate) const CUDA_MANAGED: i32 = 13;
