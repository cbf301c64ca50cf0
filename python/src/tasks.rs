//! What the task-driven trainer (`falcon.torch.fit`) needs from Rust: the task source a
//! worker claims its tasks from and helpers steal from (one atomic word, so a task is
//! processed exactly once), heterogeneity injection with the Rust trainer's specs, and the
//! Fashion-MNIST loader.

use std::sync::Arc;
use std::time::Duration;

use falcon_trainer::data::Dataset;
use falcon_trainer::hetero::{self, Hetero as Spec};
use falcon_trainer::pool::TaskSource;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::trainer_err;

/// The tasks of one iteration of this worker: `claim()` takes the next one; helpers that
/// `Worker.serve_steals(tasks)` admitted take from the tail. Each task goes to exactly one.
#[pyclass(frozen, module = "falcon")]
pub struct Tasks {
    source: Arc<TaskSource>,
}

impl Tasks {
    pub(crate) fn source(&self) -> Arc<TaskSource> {
        self.source.clone()
    }
}

#[pymethods]
impl Tasks {
    #[new]
    fn new() -> PyResult<Tasks> {
        Ok(Tasks {
            source: Arc::new(TaskSource::new(0).map_err(trainer_err)?),
        })
    }

    /// Starts iteration `clock` with `m` tasks, numbered 0 … m−1.
    fn reset(&self, clock: u64, m: usize) -> PyResult<()> {
        self.source.reset(clock, m).map_err(trainer_err)
    }

    /// The next task of the iteration, or None when every task is claimed or taken.
    fn claim(&self) -> Option<usize> {
        self.source.claim()
    }

    /// Tasks neither claimed nor taken.
    fn remaining(&self) -> usize {
        self.source.remaining()
    }
}

/// How one worker is made slow: the Rust trainer's specs (`none`, `h=H`,
/// `gauss(MEAN_MS,STD_MS)`, `episodes(EVERY,LENGTH,SLOWDOWN)`, `trace(PATH[,WORKER])`).
#[pyclass(frozen, module = "falcon")]
pub struct Hetero {
    spec: Spec,
    seed: u64,
}

#[pymethods]
impl Hetero {
    /// Parses `spec`; `seed` draws the random delays (gauss).
    #[new]
    #[pyo3(signature = (spec, seed=1))]
    fn new(spec: &str, seed: u64) -> PyResult<Hetero> {
        let spec = Spec::parse(spec).map_err(trainer_err)?;
        if matches!(spec, Spec::Contention { .. }) {
            return Err(crate::ConfigError::new_err(
                "contention(THREADS) burns CPU in the Rust trainer's process; from Python, \
                 start the contention yourself",
            ));
        }
        Ok(Hetero { spec, seed })
    }

    /// The sleep, in seconds, after iteration `iteration` whose compute took `compute`
    /// seconds. Pure: the same arguments give the same delay.
    fn delay(&self, iteration: u64, compute: f64) -> f64 {
        let c = Duration::try_from_secs_f64(compute.max(0.0)).unwrap_or_default();
        self.spec.delay(self.seed, iteration, c).as_secs_f64()
    }

    /// True for specs proportional to compute (h=…, episodes, trace), applied after each
    /// task so that unprocessed tasks wait where helpers can take them.
    #[getter]
    fn per_task(&self) -> bool {
        self.spec.per_task()
    }

    /// True when this worker runs at full speed.
    #[getter]
    fn is_none(&self) -> bool {
        matches!(self.spec, Spec::None)
    }

    fn __str__(&self) -> String {
        self.spec.to_string()
    }

    fn __repr__(&self) -> String {
        format!("falcon.Hetero({:?})", self.spec.to_string())
    }
}

/// The heterogeneity of worker `rank` of `workers` from a list of `RANKS:SPEC` entries
/// separated by `;` (as `--hetero` and FALCON_HETERO: `1:h=0.25`, `2-3:gauss(5,1)`, `*:…`).
#[pyfunction]
#[pyo3(signature = (entries, workers, rank, seed=1))]
pub fn hetero_of(entries: &str, workers: u32, rank: u32, seed: u64) -> PyResult<Hetero> {
    let all = hetero::assign(workers, &hetero::split_entries(entries)).map_err(trainer_err)?;
    let spec = all.get(rank as usize).cloned().ok_or_else(|| {
        crate::ConfigError::new_err(format!("rank {rank} is not a worker of a job of {workers}"))
    })?;
    Hetero::new(&spec.to_string(), seed.wrapping_add(u64::from(rank)))
}

/// Fashion-MNIST: `path` when given, else the full set where Debian's package puts it, else
/// the sample bundled with falcon's sources. Returns a dict: train_images and test_images
/// (float32 bytes, pixels in [0, 1], row-major N×rows×cols), train_labels and test_labels
/// (uint8 bytes), rows, cols, source.
#[pyfunction]
#[pyo3(signature = (path=None))]
pub fn load_fashion_mnist<'py>(
    py: Python<'py>,
    path: Option<std::path::PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = py
        .detach(|| Dataset::find(path.as_deref()))
        .map_err(trainer_err)?;
    let out = PyDict::new(py);
    let floats = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    out.set_item("train_images", PyBytes::new(py, &floats(&d.train.images)))?;
    out.set_item("train_labels", PyBytes::new(py, &d.train.labels))?;
    out.set_item("test_images", PyBytes::new(py, &floats(&d.test.images)))?;
    out.set_item("test_labels", PyBytes::new(py, &d.test.labels))?;
    out.set_item("rows", d.train.rows)?;
    out.set_item("cols", d.train.cols)?;
    out.set_item("source", d.source)?;
    Ok(out)
}
