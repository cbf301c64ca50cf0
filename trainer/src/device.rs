//! Where a model computes: `--device cpu|cuda|auto`.
//!
//! `cuda` needs a build with feature `cuda`, libcuda, a device, libnvrtc and libcublas; when
//! one is missing it fails with [`Error::Cuda`] naming it. `auto` takes the first device when
//! all of that is there and the CPU otherwise, and says why ([`Placement::Cpu`]'s reason).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::model::{Model, ModelSpec};
use crate::{Error, Result};

/// The device asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// The CPU (ndarray and matrixmultiply).
    #[default]
    Cpu,
    /// CUDA device 0; an error when there is none.
    Cuda,
    /// CUDA device 0 when it can be used, else the CPU.
    Auto,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Auto => "auto",
        })
    }
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda),
            "auto" => Ok(Device::Auto),
            _ => Err(Error::Config(format!(
                "device `{s}`: expected cpu, cuda or auto"
            ))),
        }
    }
}

/// Where a model was placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// On the CPU; with `auto`, the reason CUDA was not used.
    Cpu(Option<String>),
    /// On this CUDA device (its name and architecture).
    Cuda(String),
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Cpu(None) => f.write_str("cpu"),
            Placement::Cpu(Some(why)) => write!(f, "cpu (cuda unavailable: {why})"),
            Placement::Cuda(name) => write!(f, "cuda ({name})"),
        }
    }
}

/// Whether this build includes the CUDA path.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Builds `spec` on `device`.
pub fn build(spec: &ModelSpec, device: Device) -> Result<(Box<dyn Model>, Placement)> {
    match device {
        Device::Cpu => Ok((spec.build()?, Placement::Cpu(None))),
        // A bad model configuration is a configuration error first, on every device.
        Device::Cuda => spec.build().and_then(|_| build_cuda(spec)),
        // A build without CUDA has nothing to try: the CPU, as asked for.
        Device::Auto if !CUDA_BUILT => Ok((spec.build()?, Placement::Cpu(None))),
        Device::Auto => {
            let cpu = spec.build()?;
            match build_cuda(spec) {
                Ok(built) => Ok(built),
                Err(Error::Cuda(why)) => Ok((cpu, Placement::Cpu(Some(why)))),
                Err(e) => Err(e),
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn build_cuda(spec: &ModelSpec) -> Result<(Box<dyn Model>, Placement)> {
    use crate::model::gpu::{Device as Gpu, GpuModel};
    let gpu = Gpu::open(0)?;
    let info = gpu.info();
    let placement = Placement::Cuda(format!("{}, {}", info.name, info.arch()));
    Ok((Box::new(GpuModel::build(spec, gpu)?), placement))
}

#[cfg(not(feature = "cuda"))]
fn build_cuda(_spec: &ModelSpec) -> Result<(Box<dyn Model>, Placement)> {
    Err(Error::Cuda(
        "this build has no CUDA support (rebuild with --features cuda)".to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for d in [Device::Cpu, Device::Cuda, Device::Auto] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert_eq!("GPU".parse::<Device>().unwrap(), Device::Cuda);
        let e = "tpu".parse::<Device>().unwrap_err().to_string();
        assert!(e.contains("cpu, cuda or auto"), "{e}");
    }

    #[test]
    fn cpu_builds_on_the_cpu_and_bad_models_fail_everywhere() {
        let spec: ModelSpec = "mlp:4-3-2".parse().unwrap();
        let (m, p) = build(&spec, Device::Cpu).unwrap();
        assert_eq!(p, Placement::Cpu(None));
        assert_eq!(m.num_params(), 4 * 3 + 3 + 3 * 2 + 2);
        let bad = ModelSpec::Mlp { sizes: vec![4, 0] };
        for d in [Device::Cpu, Device::Cuda, Device::Auto] {
            assert!(matches!(build(&bad, d), Err(Error::Config(_))), "{d}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_cuda_is_an_error_and_auto_is_the_cpu() {
        let spec: ModelSpec = "mlp:4-3-2".parse().unwrap();
        let e = build(&spec, Device::Cuda).err().unwrap().to_string();
        assert!(e.contains("--features cuda"), "{e}");
        let (_, p) = build(&spec, Device::Auto).unwrap();
        assert_eq!(p, Placement::Cpu(None));
    }
}
