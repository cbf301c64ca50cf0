//! Sealed memfd mappings: the one place shared memory is created and mapped.
//!
//! A memfd lives in no file system, so only processes we hand its descriptor to (over a Unix
//! socket, SCM_RIGHTS) can map it. The creator seals its size: a peer can then never shrink it
//! under our feet, which would turn our next access into SIGBUS. A mapping received from a peer
//! is accepted only if it carries those seals and is at least as long as claimed.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::error::{Error, Result};

/// A shared mapping of a sealed memfd.
#[derive(Debug)]
pub(crate) struct SharedMap {
    file: File,
    map: MmapRaw,
    len: u64,
}

const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

impl SharedMap {
    /// Creates a zero-filled memfd of `len` bytes (at least one page is mapped), seals its size
    /// and maps it shared.
    pub(crate) fn create(name: &str, len: u64) -> Result<Self> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| Error::errno("memfd_create", e))?;
        let file_len = len.max(1);
        rustix::fs::ftruncate(&fd, file_len).map_err(|e| Error::errno("ftruncate memfd", e))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| Error::errno("seal memfd", e))?;
        Self::map(File::from(fd), len, file_len)
    }

    /// Maps a memfd received from a peer, checking its seals and its size.
    pub(crate) fn open(fd: OwnedFd, claimed_len: u64) -> Result<Self> {
        let seals =
            rustix::fs::fcntl_get_seals(&fd).map_err(|e| Error::errno("read memfd seals", e))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(Error::Malformed(
                "peer passed a shared-memory file whose size is not sealed".into(),
            ));
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| Error::errno("fstat memfd", e))?;
        let file_len = u64::try_from(stat.st_size).unwrap_or(0);
        if file_len < claimed_len.max(1) {
            return Err(Error::Malformed(format!(
                "peer claims a {claimed_len}-byte region backed by a {file_len}-byte file"
            )));
        }
        Self::map(File::from(fd), claimed_len, file_len)
    }

    fn map(file: File, len: u64, file_len: u64) -> Result<Self> {
        let map_len = usize::try_from(file_len).map_err(|_| {
            Error::Config(format!("{file_len} bytes do not fit this address space"))
        })?;
        let map = MmapOptions::new()
            .len(map_len)
            .map_raw(&file)
            .map_err(|e| Error::io("mmap shared memory", e))?;
        Ok(SharedMap { file, map, len })
    }

    /// The usable length (the mapping may be longer by up to a page).
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Start of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The descriptor, to pass to a peer.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }
}
