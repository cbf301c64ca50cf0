//! What every link tracks about itself, whatever the medium: who it is, whether it is open,
//! and why it failed.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::cq::{LinkId, lock};
use crate::error::{Error, Result};

pub(crate) struct LinkState {
    pub(crate) id: LinkId,
    pub(crate) peer: String,
    /// False once the link has closed or failed.
    pub(crate) open: AtomicBool,
    /// Set when this side started an orderly close.
    pub(crate) closing: AtomicBool,
    /// The first failure, if any.
    pub(crate) failure: Mutex<Option<Error>>,
}

impl LinkState {
    pub(crate) fn new(id: LinkId, peer: String) -> LinkState {
        LinkState {
            id,
            peer,
            open: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
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
