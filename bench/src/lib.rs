//! falcon-bench: criterion micro-benchmarks and experiment runners.
//!
//! Every figure is measured beside its physical reference in the same run (memcpy of the same
//! size, a plain blocking socket on loopback, an atomic ping-pong between two cores) and
//! reported as a ratio, so a number means the same thing on any machine.
//!
//! This crate knows how to measure; it must not contain the behaviour it measures.

#![forbid(unsafe_code)]
pub mod engine;
pub mod policies;
pub mod reference;
pub mod stats;
pub mod transport;
pub mod zipline;
