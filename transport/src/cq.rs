//! The completion queue: where immediates, control messages and link closures arrive.
//!
//! One queue per [`crate::Transport`]. Two kinds of source feed it:
//! - shm links: the peer writes records into a ring in our memory and rings our *doorbell*,
//!   a futex word in a memfd page that every shm peer maps. `poll` drains those rings directly,
//!   so a completion costs no thread hop;
//! - tcp (and later rdma) links: a progress thread per link pushes into a local queue and rings
//!   the same doorbell.
//!
//! Waiting spins for a bounded time (`spin`), then parks on the doorbell futex: an idle process
//! burns no CPU, unlike ps-lite's busy-polling van.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::memfd::SharedMap;

/// Identifies a link within one transport.
pub type LinkId = u64;

/// What a completion queue delivers.
#[derive(Debug, Clone)]
pub enum Completion {
    /// A one-sided write with an immediate from `link` landed; its bytes are visible.
    WriteImm {
        /// The link it came on.
        link: LinkId,
        /// The immediate value.
        imm: u32,
    },
    /// A two-sided control message.
    Message {
        /// The link it came on.
        link: LinkId,
        /// Its bytes.
        data: Vec<u8>,
    },
    /// The link ended. `error` is `None` for an orderly close by either side.
    Closed {
        /// The link.
        link: LinkId,
        /// Why, if it failed.
        error: Option<Error>,
    },
}

/// The two words of a doorbell page. `seq` is the futex word: bumped on every ring.
#[repr(C)]
struct DoorbellWords {
    seq: AtomicU32,
    waiters: AtomicU32,
}

/// A futex word in shared memory that wakes a completion queue, from this process or another.
#[derive(Debug)]
pub(crate) struct Doorbell {
    map: SharedMap,
}

impl Doorbell {
    pub(crate) fn create() -> Result<Self> {
        Ok(Doorbell {
            map: SharedMap::create("falcon-doorbell", 4096)?,
        })
    }

    /// Maps a peer's doorbell.
    pub(crate) fn open(fd: std::os::fd::OwnedFd) -> Result<Self> {
        Ok(Doorbell {
            map: SharedMap::open(fd, std::mem::size_of::<DoorbellWords>() as u64)?,
        })
    }

    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.map.fd()
    }

    fn words(&self) -> &DoorbellWords {
        // SAFETY: the mapping is page-aligned and at least 8 bytes long (checked at open);
        // AtomicU32 is valid for every bit pattern, and all access to these words (ours and
        // the peer's) is atomic, so a shared reference is sound.
        unsafe { &*(self.map.ptr() as *const DoorbellWords) }
    }

    /// Wakes whoever waits on this doorbell.
    pub(crate) fn ring(&self) {
        let w = self.words();
        // SeqCst on both sides (here: bump, then read `waiters`; in `park`: register in
        // `waiters`, then read `seq`) forms a Dekker pair: either the waiter sees our bump and
        // does not sleep, or we see it registered and wake it. Never both miss.
        w.seq.fetch_add(1, Ordering::SeqCst);
        if w.waiters.load(Ordering::SeqCst) != 0 {
            // Not FUTEX_PRIVATE: the word is shared between processes.
            let _ = futex::wake(&w.seq, futex::Flags::empty(), u32::MAX);
        }
    }

    /// Sleeps until the doorbell rings or `timeout` passes, unless `ready` sees work after
    /// registering as a waiter.
    fn park(&self, timeout: Option<Duration>, ready: impl FnOnce() -> bool) {
        let w = self.words();
        w.waiters.fetch_add(1, Ordering::SeqCst);
        let seen = w.seq.load(Ordering::SeqCst);
        if !ready() {
            let ts = timeout.map(|t| rustix::time::Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: t.subsec_nanos() as _,
            });
            // EAGAIN (the word moved), EINTR and ETIMEDOUT all just mean "look again".
            let _ = futex::wait(&w.seq, futex::Flags::empty(), seen, ts.as_ref());
        }
        w.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A source the queue drains itself (an shm link's inbound ring).
pub(crate) trait CqSource: Send + Sync {
    /// Moves ready completions into `out`. Returns false once the source is finished (its
    /// `Closed` completion has been delivered) and can be forgotten.
    fn drain(&self, out: &mut VecDeque<Completion>) -> bool;
}

/// A completion queue. Cheap to clone; clones share the queue.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

struct CqInner {
    doorbell: Arc<Doorbell>,
    queue: Mutex<VecDeque<Completion>>,
    sources: Mutex<Vec<Arc<dyn CqSource>>>,
    spin: Duration,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("spin", &self.inner.spin)
            .finish()
    }
}

impl CompletionQueue {
    pub(crate) fn new(spin: Duration) -> Result<Self> {
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                doorbell: Arc::new(Doorbell::create()?),
                queue: Mutex::new(VecDeque::new()),
                sources: Mutex::new(Vec::new()),
                spin,
            }),
        })
    }

    pub(crate) fn doorbell(&self) -> &Arc<Doorbell> {
        &self.inner.doorbell
    }

    pub(crate) fn add_source(&self, source: Arc<dyn CqSource>) {
        lock(&self.inner.sources).push(source);
        self.inner.doorbell.ring();
    }

    /// Delivers a completion from a progress thread.
    pub(crate) fn push(&self, c: Completion) {
        lock(&self.inner.queue).push_back(c);
        self.inner.doorbell.ring();
    }

    /// Returns a completion if one is ready, without waiting.
    pub fn poll(&self) -> Option<Completion> {
        if let Some(c) = lock(&self.inner.queue).pop_front() {
            return Some(c);
        }
        let mut sources = match self.inner.sources.try_lock() {
            Ok(s) => s,
            // Another thread is draining the sources; what it finds lands in `queue`.
            Err(_) => return lock(&self.inner.queue).pop_front(),
        };
        let mut found = VecDeque::new();
        sources.retain(|s| s.drain(&mut found));
        drop(sources);
        let mut q = lock(&self.inner.queue);
        q.extend(found);
        q.pop_front()
    }

    /// Waits for a completion: spins for the configured time, then parks. `None` waits forever.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Completion> {
        let start = Instant::now();
        if let Some(c) = spin_for(
            self.inner.spin.min(timeout.unwrap_or(Duration::MAX)),
            || self.poll(),
        ) {
            return Ok(c);
        }
        loop {
            if let Some(c) = self.poll() {
                return Ok(c);
            }
            let elapsed = start.elapsed();
            if let Some(t) = timeout
                && elapsed >= t
            {
                return Err(Error::Timeout("completion queue wait", t));
            }
            let left = timeout.map(|t| t.saturating_sub(elapsed));
            // Sleep at most 100 ms at a time so a missed wake-up (e.g. a peer that died between
            // publishing and ringing) costs latency, never liveness.
            let nap = Some(left.map_or(Duration::from_millis(100), |l| {
                l.min(Duration::from_millis(100))
            }));
            self.inner.doorbell.park(nap, || self.has_work());
        }
    }

    fn has_work(&self) -> bool {
        if !lock(&self.inner.queue).is_empty() {
            return true;
        }
        let mut found = VecDeque::new();
        if let Ok(mut sources) = self.inner.sources.try_lock() {
            sources.retain(|s| s.drain(&mut found));
        } else {
            return true;
        }
        let any = !found.is_empty();
        lock(&self.inner.queue).extend(found);
        any
    }
}

/// Polls `poll` for up to `spin`, yielding the core now and then; `None` if nothing came.
/// The bounded spin before any park: a parked hand-off costs a futex wake-up (tens of µs on a
/// loaded machine), a spin costs at most `spin` of CPU.
pub(crate) fn spin_for<T>(spin: Duration, mut poll: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    let mut round = 0u32;
    loop {
        if let Some(v) = poll() {
            return Some(v);
        }
        if start.elapsed() >= spin {
            return None;
        }
        round = round.wrapping_add(1);
        if round.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Locks a mutex, ignoring poisoning: every critical section here leaves its data consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spin briefly, then back off by sleeping (1 µs doubling to 1 ms). For rare waits on a peer
/// (a full ring) where a futex would cost more machinery than it saves.
pub(crate) struct Backoff {
    round: u32,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff { round: 0 }
    }

    pub(crate) fn snooze(&mut self) {
        if self.round < 64 {
            std::hint::spin_loop();
        } else if self.round < 80 {
            std::thread::yield_now();
        } else {
            let us = 1u64 << (self.round - 80).min(10);
            std::thread::sleep(Duration::from_micros(us));
        }
        self.round = self.round.saturating_add(1);
    }
}
