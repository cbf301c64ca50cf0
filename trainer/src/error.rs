//! The trainer's errors.

/// What can go wrong in the trainer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A dataset file is missing, truncated or corrupt.
    #[error("dataset {path}: {why}")]
    Data {
        /// The file.
        path: String,
        /// What is wrong with it.
        why: String,
    },
    /// Bad configuration (model shape, thread counts, heterogeneity spec…).
    #[error("configuration: {0}")]
    Config(String),
    /// Buffers of the wrong length.
    #[error("{what}: expected {expected} floats, got {got}")]
    WrongLength {
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// CUDA is absent or failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// A role of a job (a worker, the scheduler, a server) failed or panicked: the cause of
    /// the job's failure. (Not in the loom build, which leaves the engine's roles out.)
    #[cfg(not(loom))]
    #[error(transparent)]
    Role(#[from] falcon_engine::local::RoleFailure),
    /// The parameter server said no.
    #[error(transparent)]
    Engine(#[from] falcon_engine::Error),
    /// The transport said no.
    #[error(transparent)]
    Transport(#[from] falcon_transport::Error),
    /// I/O.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The trainer's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
