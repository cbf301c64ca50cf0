//! falcon's Python extension module, `falcon._falcon`: the engine's worker, a local cluster,
//! the serving roles, the task source of task transfer, heterogeneity injection and the
//! bundled dataset. The Python package `falcon` (in `python/falcon/`) is the public face;
//! this module is its engine room and is not imported directly.
//!
//! Every call that waits (a push, a pull, a barrier, a join, a role serving a job) releases
//! the GIL and waits in slices of at most [`SLICE`], checking for signals between them, so a
//! Ctrl-C interrupts it and other Python threads run meanwhile.
//!
//! The only `unsafe` here is at the boundary with Python's memory: the byte view of a
//! Python buffer (two blocks in [`worker`]) and, with feature `cuda`, the reading of a
//! DLPack capsule and the two copies between its device memory and a page-locked region
//! (`device`), each with its `// SAFETY:` reasoning.

use std::collections::HashMap;
use std::time::Duration;

use falcon_engine::launch::{Launch, LaunchError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

#[cfg(feature = "cuda")]
mod device;
mod dlpack;
mod quota;
mod roles;
mod tasks;
mod worker;

/// The longest a waiting call goes without checking for Ctrl-C.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

create_exception!(
    falcon,
    Error,
    PyException,
    "The base of every error falcon raises; its message is the engine's."
);
create_exception!(
    falcon,
    ConfigError,
    Error,
    "A configuration refused: a variable of the launch contract, an argument, a job that cannot start."
);
create_exception!(
    falcon,
    NotInitializedError,
    Error,
    "A call that needs a worker before falcon.init() (or before the tensors were declared)."
);
create_exception!(
    falcon,
    TensorError,
    Error,
    "A tensor name the job does not know."
);
create_exception!(
    falcon,
    LengthError,
    Error,
    "A buffer whose length (or type, or layout) does not fit the tensor."
);
create_exception!(
    falcon,
    ClockError,
    Error,
    "A push or pull at a clock that is not valid at that moment."
);
create_exception!(
    falcon,
    PeerError,
    Error,
    "A peer gone: a dead server or scheduler, an eviction, a refused or failed rendezvous."
);
create_exception!(
    falcon,
    TimeoutError,
    Error,
    "An operation past its deadline."
);
create_exception!(
    falcon,
    CudaError,
    Error,
    "CUDA unusable for a device tensor: no driver library, no device, a failed driver call."
);
create_exception!(
    falcon,
    TransportError,
    Error,
    "A transport failure: a link, a socket, a malformed message."
);

/// The engine's error as the matching Python exception, its message the engine's.
pub(crate) fn engine_err(e: falcon_engine::Error) -> PyErr {
    use falcon_engine::Error as E;
    let msg = e.to_string();
    match e {
        E::Config(_) => ConfigError::new_err(msg),
        E::UnknownTensor(_) => TensorError::new_err(msg),
        E::WrongLength { .. } => LengthError::new_err(msg),
        E::BadClock { .. } => ClockError::new_err(msg),
        E::PeerGone { .. }
        | E::Evicted { .. }
        | E::SchedulerLost { .. }
        | E::Fenced { .. }
        | E::Refused(_)
        | E::Server { .. }
        | E::Rendezvous { .. } => PeerError::new_err(msg),
        E::Timeout(..) => TimeoutError::new_err(msg),
        E::Transport(_) | E::Malformed(_) => TransportError::new_err(msg),
        _ => Error::new_err(msg),
    }
}

/// A transport error (a region that cannot be made, say).
pub(crate) fn transport_err(e: falcon_transport::Error) -> PyErr {
    TransportError::new_err(e.to_string())
}

/// The trainer's error (a heterogeneity spec, the dataset, the task source).
pub(crate) fn trainer_err(e: falcon_trainer::Error) -> PyErr {
    match e {
        falcon_trainer::Error::Engine(e) => engine_err(e),
        e => ConfigError::new_err(e.to_string()),
    }
}

/// A launch refused (a variable, its value, what is allowed).
pub(crate) fn launch_err(e: LaunchError) -> PyErr {
    ConfigError::new_err(e.to_string())
}

/// The launch contract over the environment, `overrides` first (the arguments of
/// `falcon.init(...)` as FALCON_* variables).
pub(crate) fn launch(overrides: &HashMap<String, String>) -> PyResult<Launch> {
    Launch::from_vars(|name| {
        overrides
            .get(name)
            .cloned()
            .or_else(|| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    })
    .map_err(launch_err)
}

/// Every variable the launch contract reads, aliases included.
#[pyfunction]
fn launch_variables() -> Vec<&'static str> {
    falcon_engine::launch::VARIABLES.to_vec()
}

/// This process's part in the job its environment (with `overrides` first) describes:
/// `(role, rank, workers)`, role one of "scheduler", "server", "worker"; rank None when the
/// scheduler will assign one; workers the job's.
#[pyfunction]
fn launch_role(overrides: HashMap<String, String>) -> PyResult<(String, Option<u32>, u32)> {
    let l = launch(&overrides)?;
    Ok((l.role.name().to_string(), l.rank, l.config.workers))
}

#[pymodule]
fn _falcon(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("NotInitializedError", py.get_type::<NotInitializedError>())?;
    m.add("TensorError", py.get_type::<TensorError>())?;
    m.add("LengthError", py.get_type::<LengthError>())?;
    m.add("ClockError", py.get_type::<ClockError>())?;
    m.add("PeerError", py.get_type::<PeerError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add_function(wrap_pyfunction!(launch_variables, m)?)?;
    m.add_function(wrap_pyfunction!(launch_role, m)?)?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<worker::Handle>()?;
    m.add_class::<roles::Cluster>()?;
    m.add_class::<roles::HostedRoles>()?;
    m.add_function(wrap_pyfunction!(roles::serve, m)?)?;
    m.add_class::<tasks::Tasks>()?;
    m.add_class::<quota::CpuQuota>()?;
    m.add_function(wrap_pyfunction!(quota::cpu_quota_of, m)?)?;
    m.add_function(wrap_pyfunction!(quota::own_cpus, m)?)?;
    m.add_class::<tasks::Hetero>()?;
    m.add_function(wrap_pyfunction!(tasks::hetero_of, m)?)?;
    m.add_function(wrap_pyfunction!(tasks::load_fashion_mnist, m)?)?;
    Ok(())
}
