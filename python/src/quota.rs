//! CPU quotas for worker processes from Python (`falcon.CpuQuota`): the engine's
//! [`falcon_engine::quota::CpuQuota`], a slow machine the kernel enforces.

use pyo3::prelude::*;

use crate::engine_err;

/// A control group holding its processes to `cpus` CPUs (cgroup v1 `cpu` or v2 `cpu.max`),
/// removed by `close()` or at the end of a `with` block, once its processes have ended.
/// Making one where cgroups are not writable (no root) is an `Error` (or a `ConfigError`
/// where the host mounts no CPU controller) that says so.
#[pyclass(module = "falcon._falcon")]
pub struct CpuQuota {
    q: Option<falcon_engine::quota::CpuQuota>,
}

#[pymethods]
impl CpuQuota {
    #[new]
    fn new(name: &str, cpus: f64) -> PyResult<Self> {
        let q = falcon_engine::quota::CpuQuota::new(name, cpus).map_err(engine_err)?;
        Ok(CpuQuota { q: Some(q) })
    }

    /// Moves process `pid` (with its threads) into the group.
    fn add(&self, pid: u32) -> PyResult<()> {
        match &self.q {
            Some(q) => q.add(pid).map_err(engine_err),
            None => Err(crate::ConfigError::new_err("this CPU quota was closed")),
        }
    }

    /// Moves process `pid` out of the group (back where new groups are made).
    fn release(&self, pid: u32) -> PyResult<()> {
        match &self.q {
            Some(q) => q.release(pid).map_err(engine_err),
            None => Err(crate::ConfigError::new_err("this CPU quota was closed")),
        }
    }

    /// The group's directory.
    #[getter]
    fn path(&self) -> Option<String> {
        self.q.as_ref().map(|q| q.dir().display().to_string())
    }

    /// Its CPUs.
    #[getter]
    fn cpus(&self) -> Option<f64> {
        self.q.as_ref().map(|q| q.cpus())
    }

    /// Removes the group (waiting up to a second for its processes to have left it).
    fn close(&mut self, py: Python<'_>) {
        let q = self.q.take();
        py.detach(move || drop(q));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &mut self,
        py: Python<'_>,
        _t: &Bound<'_, PyAny>,
        _v: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        match &self.q {
            Some(q) => format!("CpuQuota({} CPUs at {})", q.cpus(), q.dir().display()),
            None => "CpuQuota(closed)".into(),
        }
    }
}

/// Worker `rank`'s CPUs in `quotas` (`RANKS:CPUS[,RANKS:CPUS...]`, as FALCON_CPU_QUOTA and
/// `falcon local --cpu-quota`) for a job of `workers` workers; None when it has no quota.
#[pyfunction]
pub fn cpu_quota_of(quotas: &str, workers: u32, rank: u32) -> PyResult<Option<f64>> {
    let all = falcon_engine::quota::parse_quotas(quotas, workers).map_err(engine_err)?;
    Ok(all.get(rank as usize).copied().flatten())
}

/// The CPUs this process may use at once under its control group's CPU quota (a fraction
/// for a group held below one CPU); None where it has no quota.
#[pyfunction]
pub fn own_cpus() -> Option<f64> {
    falcon_engine::quota::own_cpus()
}
