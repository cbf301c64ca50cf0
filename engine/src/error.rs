//! The engine's typed errors.

use falcon_transport::Error as TransportError;

/// An engine error. Transport errors keep their full context.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The data plane failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The scheduler refused this process (wrong token, duplicate rank, job full…).
    #[error("refused by the scheduler: {0}")]
    Refused(String),
    /// A server refused a request of this worker (an attach, a pull).
    #[error("server {rank} refused: {reason}")]
    Server {
        /// The server's rank.
        rank: u32,
        /// Why, as the server said.
        reason: String,
    },
    /// No tensor of that name is registered.
    #[error("unknown tensor {0:?}")]
    UnknownTensor(String),
    /// A buffer does not match the tensor it is used for.
    #[error("tensor {tensor:?} has {expected} floats; the buffer has {got}")]
    WrongLength {
        /// The tensor.
        tensor: String,
        /// Its length in floats.
        expected: u64,
        /// The buffer's length in floats.
        got: u64,
    },
    /// A clock that this worker cannot use now.
    #[error("clock {got} is not valid here: {why}")]
    BadClock {
        /// The clock given.
        got: u64,
        /// Why not.
        why: String,
    },
    /// A peer (scheduler, server, worker) failed or left.
    #[error("{role} {rank} is gone: {why}")]
    PeerGone {
        /// `scheduler`, `server` or `worker`.
        role: &'static str,
        /// Its rank.
        rank: u32,
        /// What was observed.
        why: String,
    },
    /// A control message could not be decoded.
    #[error("malformed control message: {0}")]
    Malformed(String),
    /// Invalid configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An operating-system call failed (a thread that cannot start, an address that cannot
    /// be listened on): what falcon was doing, and the OS error.
    #[error("{what}: {source}")]
    Os {
        /// What falcon was doing.
        what: String,
        /// The OS error.
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// A server checkpoint could not be written, or one found is unusable.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The scheduler evicted this worker (silent past the suspicion timeout, say); it may
    /// rejoin under its rank at the current clock.
    #[error("worker {rank} was evicted by the scheduler: {reason}; it can rejoin under its rank")]
    Evicted {
        /// The worker's rank.
        rank: u32,
        /// Why, as the scheduler said.
        reason: String,
    },
    /// This worker's link to the scheduler was lost mid-job (not closed in order): a
    /// partition, after which the scheduler may have evicted it without being heard. It may
    /// join again under its rank; a scheduler that is really gone refuses that quickly.
    #[error("worker {rank} lost its link to the scheduler ({why}); it can rejoin under its rank")]
    SchedulerLost {
        /// The worker's rank.
        rank: u32,
        /// What the link said.
        why: String,
    },
    /// The scheduler declared this server dead (it was paused or cut off past the suspicion
    /// timeout): it must not serve on, and restarts from its checkpoint.
    #[error("server {rank} was fenced by the scheduler: {reason}")]
    Fenced {
        /// The server's rank.
        rank: u32,
        /// Why, as the scheduler said.
        reason: String,
    },
    /// A server could not write its checkpoint, and the job is set to stop on that
    /// ([`crate::config::OnCheckpointFailure::Stop`]).
    #[error(
        "server {rank} could not write its checkpoint ({failures} failed): {reason}; the job was stopped (checkpoint failures are set to stop it)"
    )]
    CheckpointFailed {
        /// The server's rank.
        rank: u32,
        /// Its failed checkpoint writes so far.
        failures: u64,
        /// The last failure, in words.
        reason: String,
    },
    /// Rendezvous did not complete: some nodes never joined.
    #[error(
        "rendezvous timed out after {} s: never joined: {missing} (are those processes started, and do they reach the scheduler's address?)",
        after.as_secs_f64()
    )]
    Rendezvous {
        /// The rendezvous timeout.
        after: std::time::Duration,
        /// The ranks that never joined, in words.
        missing: String,
    },
    /// A CUDA call of a device push or pull failed (only with feature `cuda`; the variant is
    /// there without it, so that matches on this enum do not depend on the feature).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// Something did not happen in time.
    #[error("{what} timed out after {secs:.1} s", what = .0, secs = .1.as_secs_f64())]
    Timeout(&'static str, std::time::Duration),
}

#[cfg(feature = "cuda")]
impl From<falcon_transport::cuda::CudaError> for Error {
    fn from(e: falcon_transport::cuda::CudaError) -> Self {
        Error::Cuda(e.to_string())
    }
}

impl Error {
    /// An OS error while doing `what`.
    pub fn os(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Os {
            what: what.into(),
            source: std::sync::Arc::new(source),
        }
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
