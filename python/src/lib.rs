//! falcon's Python extension module (work in progress).
use pyo3::prelude::*;

#[pymodule]
fn _falcon(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
