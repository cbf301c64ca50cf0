//! falcon-trainer drives compute on top of the engine: models on flat f32 buffers, data,
//! the elastic thread pool, heterogeneity injection, task transfer, local jobs and the
//! simulator. A training worker talks to the running parameter server only through
//! `falcon_engine::Worker` (a local job starts its scheduler and servers with
//! `falcon_engine::local::LocalCluster`, and follows the scheduler's parallelism manager);
//! the simulator drives the engine's shard core and sync policies directly, in one process,
//! without the transport. Nothing here knows media or regions' wire formats.

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
