//! A shard's meta block: a sequence word, a version counter and one clock per worker, each on
//! its own cache line (`CachePadded<AtomicU64>`), published with a seqlock.
//!
//! The block lives in a transport region beside the shard's parameters, so a worker reads it
//! with a one-sided read: the clocks give the staleness predicate without asking the server;
//! the sequence word, read before and after the parameters, tells a consistent snapshot from a
//! torn one.
//!
//! Layout (each entry one 128-byte line): `[seq] [version] [clock of worker 0] … [clock W-1]`.
//!
//! Orderings (the classic seqlock, Boehm 2012, checked with loom in `tests/loom_meta.rs`):
//! - writer: `seq := s+1` (Relaxed; only the server thread writes), `fence(Release)`, then the
//!   data (plain), then the clocks (Release: they are also read on their own, see
//!   `set_clock`), then `seq := s+2` with Release;
//! - reader: `s1 = seq` with Acquire, the data and clocks, `fence(Acquire)`, `s2 = seq` (Relaxed);
//!   the snapshot is good iff `s1 == s2` and even. The Release fence keeps the odd store ahead of
//!   the data stores; the Acquire fence keeps the data loads ahead of the second read, so a
//!   reader that saw any byte of a write also sees `seq` move.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering, fence};

use crossbeam_utils::CachePadded;

use crate::error::{Error, Result};

/// Bytes per entry (one `CachePadded<AtomicU64>`).
pub const LINE: usize = std::mem::size_of::<CachePadded<u64>>();

/// Bytes of a meta block for `workers` workers.
pub fn meta_bytes(workers: u32) -> u64 {
    ((2 + workers as usize) * LINE) as u64
}

/// The staleness predicate, the one place it is written: a worker at clock `clock` may read a
/// shard whose slowest live worker has `min_clock` updates applied iff
/// `min_clock >= clock - s` — i.e. the bound is **`≥`**: at most `s` iterations of the slowest
/// worker may be missing. With `s = 0` this is BSP.
pub fn within_staleness(min_clock: u64, clock: u64, s: u64) -> bool {
    min_clock.saturating_add(s) >= clock
}

/// A meta block in shared memory, as its owner (the server) sees it.
pub struct Meta<'a> {
    words: &'a [CachePadded<AtomicU64>],
}

impl<'a> Meta<'a> {
    /// Views `words` (2 + workers entries) as a meta block.
    pub fn new(words: &'a [CachePadded<AtomicU64>]) -> Meta<'a> {
        assert!(
            words.len() >= 2,
            "a meta block has a sequence and a version word"
        );
        Meta { words }
    }

    /// Number of worker clocks.
    pub fn workers(&self) -> usize {
        self.words.len() - 2
    }

    /// Runs `f` as one write section: readers either see all of its effects or retry.
    /// Only one thread (the shard's server) may write.
    pub fn write<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
        let seq = &self.words[0];
        // Relaxed: the server thread is the only writer of `seq`.
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        // Release fence: the odd value above is ordered before every store `f` makes.
        fence(Ordering::Release);
        let r = f(self);
        // Release: all of `f`'s stores happen-before a reader's Acquire load of the even value.
        seq.store(s.wrapping_add(2), Ordering::Release);
        r
    }

    /// Sets worker `w`'s clock. Inside `write`, after the data it counts: Release, because the
    /// lock-free staleness check reads clocks on their own, outside the seqlock, and a worker
    /// that sees the new clock (Acquire, in `clock`) must see the data with it. (Loom found the
    /// Relaxed version of this wanting: `tests/loom_meta.rs`.)
    pub fn set_clock(&self, w: usize, clock: u64) {
        self.words[2 + w].store(clock, Ordering::Release);
    }

    /// Adds one to the version. Inside `write`.
    pub fn bump_version(&self) {
        let v = &self.words[1];
        v.store(v.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Sets the version (a server restoring its checkpoint). Inside `write`.
    pub fn set_version(&self, version: u64) {
        self.words[1].store(version, Ordering::Relaxed);
    }

    /// Worker `w`'s clock. Acquire: pairs with the Release that closed the write section that
    /// set it, so the update it counts is visible to whoever acts on the value.
    pub fn clock(&self, w: usize) -> u64 {
        self.words[2 + w].load(Ordering::Acquire)
    }

    /// The version (updates applied).
    pub fn version(&self) -> u64 {
        self.words[1].load(Ordering::Acquire)
    }

    /// The smallest clock among the workers `live` accepts: a lock-free read of each clock.
    pub fn min_clock(&self, live: impl Fn(usize) -> bool) -> u64 {
        (0..self.workers())
            .filter(|&w| live(w))
            .map(|w| self.clock(w))
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Reads consistently: runs `f` until no write section overlapped it.
    pub fn read<T>(&self, mut f: impl FnMut(&Self) -> T) -> T {
        let seq = &self.words[0];
        loop {
            // Acquire: pairs with the writer's closing Release.
            let s1 = seq.load(Ordering::Acquire);
            if !s1.is_multiple_of(2) {
                spin();
                continue;
            }
            let v = f(self);
            // Acquire fence: `f`'s loads are ordered before the re-read below.
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return v;
            }
            spin();
        }
    }
}

#[cfg(loom)]
fn spin() {
    loom::thread::yield_now();
}
#[cfg(not(loom))]
fn spin() {
    std::hint::spin_loop();
}

/// A meta block copied out of a peer's memory (one-sided read), parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The sequence word: odd while a write is in progress.
    pub seq: u64,
    /// Updates applied.
    pub version: u64,
    /// Per-worker clocks.
    pub clocks: Vec<u64>,
}

impl Snapshot {
    /// Parses the bytes of a meta block for `workers` workers.
    pub fn parse(bytes: &[u8], workers: u32) -> Result<Snapshot> {
        if bytes.len() as u64 != meta_bytes(workers) {
            return Err(Error::Malformed(format!(
                "meta block of {} bytes for {workers} workers (expected {})",
                bytes.len(),
                meta_bytes(workers)
            )));
        }
        let word = |i: usize| {
            u64::from_ne_bytes(bytes[i * LINE..i * LINE + 8].try_into().expect("8 bytes"))
        };
        Ok(Snapshot {
            seq: word(0),
            version: word(1),
            clocks: (0..workers as usize).map(|w| word(2 + w)).collect(),
        })
    }

    /// The sequence word alone, from the first 8 bytes of a block.
    pub fn seq_of(bytes: &[u8]) -> u64 {
        u64::from_ne_bytes(bytes[..8].try_into().expect("8 bytes"))
    }

    /// True unless a write was in progress.
    pub fn stable(&self) -> bool {
        self.seq.is_multiple_of(2)
    }

    /// The smallest clock among live workers.
    pub fn min_clock(&self, live: impl Fn(usize) -> bool) -> u64 {
        self.clocks
            .iter()
            .enumerate()
            .filter(|(w, _)| live(*w))
            .map(|(_, &c)| c)
            .min()
            .unwrap_or(u64::MAX)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn staleness_bound_is_greater_or_equal() {
        // s = 2: a worker at clock 5 may read when the slowest has applied 3, not 2.
        assert!(within_staleness(3, 5, 2));
        assert!(!within_staleness(2, 5, 2));
        // s = 0 is BSP: every worker must have finished the previous iterations.
        assert!(within_staleness(5, 5, 0));
        assert!(!within_staleness(4, 5, 0));
        assert!(within_staleness(0, 0, 0), "the first pull never waits");
        assert!(within_staleness(u64::MAX, 3, u64::MAX), "no overflow");
    }

    #[test]
    fn snapshot_round_trips_the_layout() {
        let words: Vec<CachePadded<AtomicU64>> = (0..5)
            .map(|_| CachePadded::new(AtomicU64::new(0)))
            .collect();
        let meta = Meta::new(&words);
        meta.write(|m| {
            m.set_clock(0, 4);
            m.set_clock(1, 2);
            m.set_clock(2, 9);
            m.bump_version();
        });
        assert_eq!(meta.min_clock(|_| true), 2);
        assert_eq!(
            meta.min_clock(|w| w != 1),
            4,
            "departed workers do not hold the minimum"
        );
        // The block as a peer's one-sided read copies it: each word at the start of its line.
        let mut bytes = vec![0u8; words.len() * LINE];
        for (i, w) in words.iter().enumerate() {
            bytes[i * LINE..i * LINE + 8].copy_from_slice(&w.load(Ordering::Acquire).to_ne_bytes());
        }
        let bytes = &bytes[..];
        let snap = Snapshot::parse(bytes, 3).unwrap();
        assert_eq!(snap.seq, 2);
        assert!(snap.stable());
        assert_eq!(snap.version, 1);
        assert_eq!(snap.clocks, vec![4, 2, 9]);
        assert!(Snapshot::parse(&bytes[..LINE], 3).is_err());
    }
}
