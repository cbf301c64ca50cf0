//! What every link tracks about itself, whatever the medium: who it is, whether it is open,
//! and why it failed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::cq::{LinkId, lock};
use crate::error::{Error, Result};

/// The name of the process-wide cap on a message.
pub(crate) const MAX_MESSAGE: &str =
    "the largest message this process takes (TransportConfig::max_message)";
/// The name of the cap on a message from a peer that connected to this process, until its
/// role knows what the peer may send.
pub(crate) const MAX_ACCEPTED: &str = "the cap on a message from a peer that connected, before its role admitted it (TransportConfig::max_accepted_message; a falcon role's FALCON_MAX_CONTROL_BYTES)";

pub(crate) struct LinkState {
    pub(crate) id: LinkId,
    pub(crate) peer: String,
    /// False once the link has closed or failed.
    pub(crate) open: AtomicBool,
    /// Set when this side started an orderly close.
    pub(crate) closing: AtomicBool,
    /// The first failure, if any.
    pub(crate) failure: Mutex<Option<Error>>,
    /// The largest message the peer may send on this link.
    pub(crate) cap: MessageCap,
}

/// The largest message a link takes from its peer, and the name of that cap for the error a
/// peer breaking it gets. A link starts at [`crate::TransportConfig::max_message`] (one this
/// side accepted: at [`crate::TransportConfig::max_accepted_message`]); the role moves it with
/// [`crate::Link::limit_messages`] once it knows what the peer may send.
pub(crate) struct MessageCap {
    bytes: AtomicU64,
    what: Mutex<String>,
    /// The process-wide cap, which no link's cap exceeds.
    ceiling: u64,
}

impl MessageCap {
    pub(crate) fn new(bytes: u64, what: &str) -> MessageCap {
        MessageCap {
            bytes: AtomicU64::new(bytes),
            what: Mutex::new(what.into()),
            ceiling: bytes,
        }
    }

    pub(crate) fn ceiling(&self) -> u64 {
        self.ceiling
    }

    pub(crate) fn set(&self, bytes: u64, what: &str) {
        let mut w = lock(&self.what);
        *w = what.into();
        self.bytes.store(bytes, Ordering::Release);
    }

    /// Ok for a message of `len` bytes within the cap; else the error that ends the link.
    pub(crate) fn check(&self, len: u64) -> Result<()> {
        let cap = self.bytes.load(Ordering::Acquire);
        if len <= cap {
            return Ok(());
        }
        Err(Error::TooLarge {
            len,
            cap,
            what: lock(&self.what).clone(),
        })
    }
}

impl LinkState {
    pub(crate) fn new(id: LinkId, peer: String, max_message: u64) -> LinkState {
        LinkState {
            id,
            peer,
            open: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
            cap: MessageCap::new(max_message, MAX_MESSAGE),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Ok while open; else the failure, or `Closed` for an orderly close.
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.is_open() {
            return Ok(());
        }
        Err(lock(&self.failure)
            .clone()
            .unwrap_or_else(|| Error::Closed {
                peer: self.peer.clone(),
                reason: "closed".into(),
            }))
    }

    /// Records a failure (the first one wins).
    pub(crate) fn record(&self, e: Error) {
        lock(&self.failure).get_or_insert(e);
    }
}
