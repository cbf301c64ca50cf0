//! falcon: a heterogeneity-aware parameter server. This facade re-exports the workspace's
//! crates so an embedding program depends on one crate:
//!
//! - [`transport`]: regions, links and completion queues over shm, tcp and rdma;
//! - [`engine`]: the parameter server (scheduler, servers, the worker client, policies);
//! - [`trainer`]: compute on top (models, data, elastic parallelism).
//!
//! ```no_run
//! use falcon::engine::{JobConfig, local::LocalCluster, keys::TensorSpec};
//! let cluster = LocalCluster::start(JobConfig::default(), vec![TensorSpec::new("w", 10)])?;
//! let w = &cluster.workers[0];
//! let mut values = vec![0f32; 10];
//! w.pull_slice("w", &mut values, 0)?;
//! w.push_slice("w", &values, 0)?;
//! cluster.finish()?;
//! # Ok::<(), falcon::engine::Error>(())
//! ```

#![forbid(unsafe_code)]
pub use falcon_engine as engine;
pub use falcon_trainer as trainer;
pub use falcon_transport as transport;
