//! falcon-trainer drives compute on top of the engine: models on flat f32 buffers, data,
//! the elastic thread pool, heterogeneity injection, the parallelism manager and task
//! transfer. It talks to the parameter server only through `falcon_engine::Worker`, and does
//! not know about media, regions' wire formats or how policies decide.

#![forbid(unsafe_code)]
pub mod data;
pub mod device;
pub mod error;
pub mod hetero;
// The loom build (`--cfg loom`) models the pool's task source alone (`tests/loom_pool.rs`);
// the engine leaves its roles out of that build, so what runs on them is left out too.
#[cfg(not(loom))]
pub mod job;
pub mod model;
pub mod pool;
#[cfg(not(loom))]
pub mod sim;
#[cfg(not(loom))]
pub mod train;

pub use error::{Error, Result};
