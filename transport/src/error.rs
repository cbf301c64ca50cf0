//! The transport's typed errors.
//!
//! Every error a peer can provoke is one of these: it names the problem and, where there is
//! one, the fix. Errors are `Clone` so one link failure can be reported to every operation that
//! was waiting on it.

use std::sync::Arc;

/// A transport error.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What falcon was doing.
        context: &'static str,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A frame or ring record failed validation; the link it came on is closed.
    #[error("malformed input from peer: {0}")]
    Malformed(String),
    /// The peer speaks another protocol version.
    #[error("peer speaks transport protocol version {theirs}, this build speaks {ours}")]
    Version {
        /// The peer's version.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// The peer belongs to another job (a stale process from an earlier run, say).
    #[error("peer belongs to job {theirs:#x}, this process to job {ours:#x}; refusing it")]
    WrongJob {
        /// The peer's job id.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
    /// The peer refused this connection (at the handshake: a wrong job token).
    #[error("refused by the peer: {0}")]
    Refused(String),
    /// The peer's admission wall is full (too many connections wait to prove the job token):
    /// try again shortly. [`crate::Transport::connect`] does, until the handshake deadline.
    #[error("{peer} is busy: {why}")]
    Busy {
        /// The peer.
        peer: String,
        /// What it said.
        why: String,
    },
    /// A listener could not be opened on an address.
    #[error("cannot listen on {addr}: {why}")]
    Bind {
        /// The address.
        addr: String,
        /// Why not.
        why: String,
    },
    /// The peer sent a message larger than the link's cap; the link is closed.
    #[error("a message of {len} bytes is over {what}: {cap} bytes; the link is closed")]
    TooLarge {
        /// The message's announced length.
        len: u64,
        /// The cap.
        cap: u64,
        /// Which cap, by name.
        what: String,
    },
    /// The peer does not speak falcon's protocol (another program holds its port).
    #[error("{peer} is not a falcon node: it answered with {seen}")]
    NotFalcon {
        /// The peer.
        peer: String,
        /// What it sent first, as printable text.
        seen: String,
    },
    /// An access fell outside a region's bounds.
    #[error(
        "out of bounds: {what} [{offset}, {offset}+{len}) outside a region of {region_len} bytes"
    )]
    OutOfBounds {
        /// Which side of the operation.
        what: &'static str,
        /// Start of the access.
        offset: u64,
        /// Length of the access.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// A remote key names a region the peer never granted on this link.
    #[error("region {0} is not granted on this link")]
    UnknownRegion(u64),
    /// The two sides of a copy differ in length.
    #[error("length mismatch: source {src} bytes, destination {dst} bytes")]
    LengthMismatch {
        /// Source length.
        src: u64,
        /// Destination length.
        dst: u64,
    },
    /// The link is closed: by us, by the peer, or because the peer died.
    #[error("link to {peer} closed: {reason}")]
    Closed {
        /// The peer, as we know it.
        peer: String,
        /// Why.
        reason: String,
    },
    /// An operation did not complete within its deadline.
    #[error("{what} timed out after {secs:.1} s", what = .0, secs = .1.as_secs_f64())]
    Timeout(&'static str, std::time::Duration),
    /// The requested medium cannot reach this peer.
    #[error("medium {medium} cannot reach {peer}: {why}")]
    Unreachable {
        /// The medium that was asked for.
        medium: &'static str,
        /// The peer address.
        peer: String,
        /// Why not.
        why: String,
    },
    /// The medium is not available on this machine (feature off, no device).
    #[error("medium {medium} is unavailable: {why}")]
    MediumUnavailable {
        /// The medium.
        medium: &'static str,
        /// Why, with the fix where there is one.
        why: String,
    },
    /// Memory registration for RDMA hit the locked-memory limit.
    #[error(
        "registering {needed} bytes for RDMA needs locked memory, but `ulimit -l` allows only {limit} bytes: \
         raise the memlock limit (shell: `ulimit -l unlimited`; systemd: LimitMEMLOCK=infinity; \
         docker: --ulimit memlock=-1; /etc/security/limits.conf: `* - memlock unlimited`)"
    )]
    Memlock {
        /// Bytes the registration needed.
        needed: u64,
        /// The current limit in bytes.
        limit: u64,
    },
    /// A configuration value is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The remote side reported an error for our request.
    #[error("peer rejected the operation: {0}")]
    Remote(String),
}

impl Error {
    pub(crate) fn io(context: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            context,
            source: Arc::new(source),
        }
    }

    pub(crate) fn errno(context: &'static str, errno: rustix::io::Errno) -> Self {
        Error::io(context, std::io::Error::from(errno))
    }

    /// True when the error means the link can no longer be used.
    pub fn is_fatal_for_link(&self) -> bool {
        matches!(
            self,
            Error::Closed { .. }
                | Error::Malformed(_)
                | Error::Io { .. }
                | Error::Version { .. }
                | Error::WrongJob { .. }
                | Error::TooLarge { .. }
        )
    }
}

/// The transport's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Checks `[offset, offset + len)` against a region of `region_len` bytes without overflow.
pub(crate) fn check_bounds(
    what: &'static str,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            what,
            offset,
            len,
            region_len,
        }),
    }
}
