//! falcon-transport moves bytes between processes with as few copies as the medium allows.
//!
//! Vocabulary (small on purpose, like ps-lite's van):
//! - [`Region`]: page-aligned memory a peer may address once it is granted on a link; named
//!   to the peer by a [`RemoteKey`].
//! - [`Link`]: a connection to one peer: two-sided [`Link::send`] for control messages,
//!   one-sided [`Link::write`] (optionally with a 32-bit immediate) and [`Link::read`].
//! - [`CompletionQueue`]: where immediates, messages and closures arrive; waiting spins
//!   briefly, then parks, so an idle process burns no CPU. It holds at most
//!   [`TransportConfig::max_queued_bytes`] of messages: past that, tcp readers stop reading
//!   (backpressure) until the process drains it.
//! - [`Transport`]: a process's endpoint; listens, connects, chooses the medium.
//!
//! Media: `shm` (same host: memfd regions mapped by the peer, one memcpy per one-sided op,
//! SPSC rings and futex doorbells), `tcp` (framed, received straight into the target region)
//! and, with feature `rdma`, RDMA verbs.
//!
//! Every decoder validates magic, version, op, lengths and bounds: bad input closes the link
//! it came on with a typed [`Error`]; it never panics and never touches memory outside a
//! granted region.
//!
//! This crate must not know about parameters, tensors, keys or training: it moves bytes.

#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod addr;
mod admit;
mod cq;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
/// Fuzzing seam for the cargo-fuzz targets in `fuzz/`; not API.
#[doc(hidden)]
pub mod fuzzing;
pub mod gdr;
mod handshake;
mod link;
mod memfd;
#[cfg(feature = "rdma")]
mod rdma;
mod region;
mod ring;
mod shm;
pub mod spread;
mod state;
mod tcp;
mod transport;
mod wire;

pub use addr::{Medium, PeerAddr, host_id};
pub use cq::{Completion, CompletionQueue, LinkId};
pub use error::{Error, Result};
pub use link::{Link, Op, PendingReads, ReadOp};
pub use region::{F32Region, Region, RemoteKey};
pub use tcp::split_sends as tcp_split_sends;
pub use transport::{AdmissionCounts, MAX_TCP_STREAMS, TCP_SPLIT_FROM, Transport, TransportConfig};

/// RDMA device discovery, for diagnostics (`falcon doctor`).
#[cfg(feature = "rdma")]
pub use rdma::{
    PortInfo, dmabuf_support as rdma_dmabuf_support, memlock_limit, ports as rdma_ports,
};

/// True when this build includes the rdma medium.
pub const RDMA_BUILT: bool = cfg!(feature = "rdma");

/// True when this build includes CUDA (device memory, kernels, cuBLAS).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");
