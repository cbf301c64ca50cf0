//! falcon-trainer drives compute on top of the engine: models on flat f32 buffers, data,
//! the elastic thread pool, heterogeneity injection, the parallelism manager and task
//! transfer. It talks to the parameter server only through `falcon_engine::Worker`, and does
//! not know about media, regions' wire formats or how policies decide.

pub mod data;
pub mod error;
pub mod hetero;
pub mod job;
pub mod model;
pub mod pool;
pub mod sim;
pub mod train;

pub use error::{Error, Result};
