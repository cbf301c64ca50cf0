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
//!
//! Memory is bounded: the queue counts the bytes of the [`Completion::Message`]s it holds, and a
//! tcp progress thread about to exceed the cap (`TransportConfig::max_queued_bytes`) waits for
//! the consumer to drain ([`CompletionQueue::push_bounded`]). While it waits it reads nothing
//! from its socket, so the kernel's buffers fill and the sending peer's `send` blocks, then
//! fails with `Error::Timeout` after its `op_timeout`: backpressure. Immediates and closures
//! carry no payload and are never held back. Sources with their own bound (shm rings, rdma
//! receive buffers) are counted but never wait.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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

/// How long a bounded push sleeps before it re-checks whether to give up waiting.
const ROOM_RECHECK: Duration = Duration::from_millis(100);

/// Payload bytes a completion holds in the queue.
fn payload(c: &Completion) -> u64 {
    match c {
        Completion::Message { data, .. } => data.len() as u64,
        Completion::WriteImm { .. } | Completion::Closed { .. } => 0,
    }
}

/// The queued completions and their byte count.
#[derive(Default)]
struct Queue {
    items: VecDeque<Completion>,
    /// Bytes of queued message payloads.
    bytes: u64,
    /// The most `bytes` ever reached.
    peak: u64,
    /// Bounded pushes waiting for room.
    waiters: u32,
}

impl Queue {
    fn push_back(&mut self, c: Completion) {
        self.bytes += payload(&c);
        self.peak = self.peak.max(self.bytes);
        self.items.push_back(c);
    }

    fn pop_front(&mut self) -> Option<Completion> {
        let c = self.items.pop_front()?;
        self.bytes -= payload(&c);
        Some(c)
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A completion queue. Cheap to clone; clones share the queue.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

struct CqInner {
    doorbell: Arc<Doorbell>,
    queue: Mutex<Queue>,
    /// Signalled when message bytes leave the queue, or when waiting for room should end.
    room: Condvar,
    /// The most message bytes a bounded push may bring the queue to.
    cap: u64,
    /// Set when the transport stops: bounded pushes stop waiting.
    stopped: AtomicBool,
    sources: Mutex<Vec<Arc<dyn CqSource>>>,
    spin: Spin,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("spin", &self.inner.spin.get())
            .field("cap", &self.inner.cap)
            .finish()
    }
}

impl CompletionQueue {
    /// A queue whose bounded pushes hold it to `cap` bytes of messages (see
    /// [`CompletionQueue::push_bounded`]).
    pub(crate) fn new(spin: Duration, cap: u64) -> Result<Self> {
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                doorbell: Arc::new(Doorbell::create()?),
                queue: Mutex::new(Queue::default()),
                room: Condvar::new(),
                cap,
                stopped: AtomicBool::new(false),
                sources: Mutex::new(Vec::new()),
                spin: Spin::new(spin),
            }),
        })
    }

    /// How long waits on this queue, and on the links and device that feed it, spin before
    /// they park.
    pub(crate) fn spin(&self) -> &Spin {
        &self.inner.spin
    }

    pub(crate) fn doorbell(&self) -> &Arc<Doorbell> {
        &self.inner.doorbell
    }

    pub(crate) fn add_source(&self, source: Arc<dyn CqSource>) {
        lock(&self.inner.sources).push(source);
        self.inner.doorbell.ring();
    }

    /// Delivers a completion from a progress thread at once, whatever the queue holds. For
    /// completions without payload, and for sources bounded elsewhere (rdma receive buffers).
    pub(crate) fn push(&self, c: Completion) {
        lock(&self.inner.queue).push_back(c);
        self.inner.doorbell.ring();
    }

    /// Delivers a message from a progress thread that can wait (a tcp reader): while the queued
    /// message bytes plus this one would exceed the cap, waits for the consumer to drain. A
    /// message larger than the cap is delivered once the queue holds no other message, so
    /// nothing deadlocks; queued bytes stay at most `max(cap, largest message)`.
    ///
    /// `give_up` is checked at least every 100 ms (and on [`CompletionQueue::wake_pushers`]):
    /// when it returns true (the link is closing or failed), the message is delivered at once.
    /// Returns false, without delivering, when the transport stopped
    /// ([`CompletionQueue::stop`]): nobody will drain the queue, so the caller should end its
    /// link.
    pub(crate) fn push_bounded(
        &self,
        link: LinkId,
        data: Vec<u8>,
        give_up: impl Fn() -> bool,
    ) -> bool {
        let len = data.len() as u64;
        let mut q = lock(&self.inner.queue);
        while q.bytes != 0 && q.bytes.saturating_add(len) > self.inner.cap {
            if self.inner.stopped.load(Ordering::Acquire) {
                return false;
            }
            if give_up() {
                break;
            }
            q.waiters += 1;
            q = self
                .inner
                .room
                .wait_timeout(q, ROOM_RECHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            q.waiters -= 1;
        }
        q.push_back(Completion::Message { link, data });
        drop(q);
        self.inner.doorbell.ring();
        true
    }

    /// Makes bounded pushes waiting for room re-check their `give_up` now (a link closed).
    pub(crate) fn wake_pushers(&self) {
        let _q = lock(&self.inner.queue);
        self.inner.room.notify_all();
    }

    /// The transport stopped: bounded pushes stop waiting for room (and deliver nothing).
    pub(crate) fn stop(&self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.wake_pushers();
    }

    /// Bytes of message payloads queued now (received, not yet returned by `poll`/`wait`).
    pub fn queued_bytes(&self) -> u64 {
        lock(&self.inner.queue).bytes
    }

    /// The most bytes of message payloads this queue has held at once.
    pub fn peak_queued_bytes(&self) -> u64 {
        lock(&self.inner.queue).peak
    }

    /// The cap on queued message bytes that tcp readers wait for (`max_queued_bytes`).
    pub fn max_queued_bytes(&self) -> u64 {
        self.inner.cap
    }

    /// Pops the next completion, waking a bounded push if it made room.
    fn pop(&self, q: &mut Queue) -> Option<Completion> {
        let c = q.pop_front()?;
        if q.waiters != 0 && payload(&c) != 0 {
            self.inner.room.notify_all();
        }
        Some(c)
    }

    /// Returns a completion if one is ready, without waiting.
    pub fn poll(&self) -> Option<Completion> {
        if let Some(c) = self.pop(&mut lock(&self.inner.queue)) {
            return Some(c);
        }
        let mut sources = match self.inner.sources.try_lock() {
            Ok(s) => s,
            // Another thread is draining the sources; what it finds lands in `queue`.
            Err(_) => return self.pop(&mut lock(&self.inner.queue)),
        };
        let mut found = VecDeque::new();
        sources.retain(|s| s.drain(&mut found));
        drop(sources);
        let mut q = lock(&self.inner.queue);
        found.into_iter().for_each(|c| q.push_back(c));
        self.pop(&mut q)
    }

    /// Waits for a completion: spins for the configured time, then parks. `None` waits forever.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Completion> {
        let start = Instant::now();
        if let Some(c) = spin_for(
            self.inner.spin.get().min(timeout.unwrap_or(Duration::MAX)),
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
        let mut q = lock(&self.inner.queue);
        found.into_iter().for_each(|c| q.push_back(c));
        any
    }
}

/// How long a hand-off between threads spins before it parks: one value shared by a
/// transport's completion queue, its links' threads and its RDMA device, which may change
/// while they run (a node that learns its host is crowded stops spinning).
#[derive(Clone, Debug)]
pub(crate) struct Spin(Arc<AtomicU64>);

impl Spin {
    pub(crate) fn new(d: Duration) -> Self {
        Spin(Arc::new(AtomicU64::new(nanos(d))))
    }

    pub(crate) fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, d: Duration) {
        self.0.store(nanos(d), Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    fn msg(len: usize) -> Completion {
        Completion::Message {
            link: 1,
            data: vec![0; len],
        }
    }

    #[test]
    fn counts_message_bytes_only() {
        let cq = CompletionQueue::new(Duration::ZERO, 100).unwrap();
        assert_eq!(cq.max_queued_bytes(), 100);
        cq.push(msg(30));
        cq.push(Completion::WriteImm { link: 1, imm: 9 });
        assert!(cq.push_bounded(1, vec![1; 50], || false));
        cq.push(Completion::Closed {
            link: 1,
            error: None,
        });
        assert_eq!(cq.queued_bytes(), 80);
        assert!(matches!(cq.poll(), Some(Completion::Message { .. })));
        assert_eq!(cq.queued_bytes(), 50);
        assert!(matches!(
            cq.poll(),
            Some(Completion::WriteImm { imm: 9, .. })
        ));
        assert_eq!(cq.queued_bytes(), 50);
        assert!(matches!(cq.poll(), Some(Completion::Message { data, .. }) if data == [1; 50]));
        assert!(matches!(cq.poll(), Some(Completion::Closed { .. })));
        assert!(cq.poll().is_none());
        assert_eq!(cq.queued_bytes(), 0);
        assert_eq!(cq.peak_queued_bytes(), 80);
    }

    #[test]
    fn bounded_push_waits_for_room() {
        let cq = CompletionQueue::new(Duration::ZERO, 100).unwrap();
        assert!(cq.push_bounded(1, vec![0; 60], || false));
        let done = Arc::new(AtomicBool::new(false));
        let t = std::thread::spawn({
            let (cq, done) = (cq.clone(), done.clone());
            move || {
                let r = cq.push_bounded(1, vec![0; 60], || false);
                done.store(true, Ordering::Release);
                r
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        // Whatever the timing, the second message cannot be queued before the first leaves.
        assert!(!done.load(Ordering::Acquire));
        assert_eq!(cq.queued_bytes(), 60);
        // Payload-free completions still pass.
        cq.push(Completion::WriteImm { link: 1, imm: 0 });
        assert!(matches!(cq.poll(), Some(Completion::Message { .. })));
        assert!(t.join().unwrap());
        assert_eq!(cq.peak_queued_bytes(), 60);
        assert!(matches!(cq.poll(), Some(Completion::WriteImm { .. })));
        assert!(matches!(
            cq.wait(Some(Duration::from_secs(10))),
            Ok(Completion::Message { .. })
        ));
        assert_eq!(cq.queued_bytes(), 0);
    }

    #[test]
    fn oversized_message_passes_alone() {
        let cq = CompletionQueue::new(Duration::ZERO, 100).unwrap();
        assert!(cq.push_bounded(1, vec![0; 500], || false));
        assert_eq!(cq.queued_bytes(), 500);
        // Not on top of another message, unless the pusher gives up waiting.
        assert!(cq.push_bounded(1, vec![0; 1], || true));
        assert_eq!(cq.queued_bytes(), 501);
    }

    #[test]
    fn stop_releases_waiting_pushes() {
        let cq = CompletionQueue::new(Duration::ZERO, 10).unwrap();
        assert!(cq.push_bounded(1, vec![0; 10], || false));
        let t = std::thread::spawn({
            let cq = cq.clone();
            move || cq.push_bounded(1, vec![0; 10], || false)
        });
        cq.stop();
        assert!(
            !t.join().unwrap(),
            "a stopped queue takes no more waiting messages"
        );
        assert_eq!(cq.queued_bytes(), 10);
    }
}
