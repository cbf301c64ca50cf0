//! falcon-engine is the parameter server: roles (scheduler, servers, workers), keys and their
//! placement, shards with versions and per-worker clocks, update rules, and the
//! synchronization policies as sans-IO state machines.
//!
//! It moves bytes only through falcon-transport, and must not know about models, datasets or
//! compute: a tensor is a name and a length of f32.

#![warn(missing_docs)]

mod error;
pub mod keys;
pub mod meta;
pub mod sync;
pub mod update;

pub use error::{Error, Result};
pub mod config;
pub mod local;
pub mod proto;
pub mod scheduler;
pub mod server;
pub mod worker;

pub use config::JobConfig;
pub use scheduler::{Scheduler, SchedulerReport};
pub use server::{Server, ServerHooks, ServerReport};
pub use worker::{Handle, Worker, WorkerStats};
