//! falcon-engine is the parameter server: roles (scheduler, servers, workers), keys and their
//! placement, shards with versions and per-worker clocks, update rules, and the
//! synchronization policies as sans-IO state machines.
//!
//! It moves bytes only through falcon-transport, and must not know about models, datasets or
//! compute: a tensor is a name and a length of f32.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

// Values travel as their little-endian bytes, written and read as the host's own.
#[cfg(not(target_endian = "little"))]
compile_error!("falcon's wire format is little-endian; this target is big-endian");

mod error;
pub mod keys;
pub mod meta;
pub mod sync;
pub mod update;

pub use error::{Error, Result};
pub mod auth;
pub mod checkpoint;
pub mod checks;
pub mod config;
mod heartbeat;
pub mod launch;
#[cfg(not(loom))]
pub mod postoffice;
pub mod precision;
pub mod proto;
pub mod quota;
pub mod rows;
pub mod shard;
// The roles map real shared memory with std atomics; the loom build (`--cfg loom`) models
// the meta block alone, so they are left out of it.
#[cfg(not(loom))]
pub mod local;
#[cfg(not(loom))]
pub mod membership;
pub mod metrics;
#[cfg(not(loom))]
pub mod scheduler;
#[cfg(not(loom))]
pub mod server;
pub mod supervisor;
#[cfg(not(loom))]
pub mod worker;

pub use config::{CheckpointSettings, JobConfig, OnCheckpointFailure, SupervisorSettings};
#[cfg(not(loom))]
pub use scheduler::{Scheduler, SchedulerReport};
#[cfg(not(loom))]
pub use server::{Server, ServerHooks, ServerReport, ShardAccount, ShardCounters, WorkerCounters};
#[cfg(not(loom))]
pub use worker::{Handle, Offer, Worker, WorkerStats};
