//! Large memory passes shared with helper threads.
//!
//! A copy of megabytes (an shm read or write of a large shard) or a pass over a large
//! shard's values (a server applying a gradient) is cut into chunks that the calling thread
//! and a few parked helper threads claim one at a time. The caller never waits for a helper
//! to start: it claims chunks itself from the first, and once none is left it waits only for
//! the chunks a helper has already claimed. On a host whose cores are all busy the caller
//! does nearly all the work, at the cost of one wake-up; on a host with an idle core (a
//! worker waiting for its server, or the other way round) the pass takes about half as long.
//!
//! The helpers are the process's, shared by every caller; a pass that finds them busy with
//! another caller's runs on its own thread. [`set_helpers`] sets how many there are (none:
//! every pass runs on its caller's thread); by default one fewer than the cores, at most
//! three.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// The most helper threads a process starts.
pub const MAX_HELPERS: usize = 16;

/// Bytes of a copy that [`copy`] hands out at a time.
pub const COPY_CHUNK: usize = 256 << 10;

/// The shortest copy [`copy`] shares with the helpers; shorter ones run on the caller's
/// thread alone (a helper's wake-up would cost more than it saves).
pub const COPY_SHARED_FROM: usize = 2 << 20;

/// Passes a helper took part in so far (see [`shared_passes`]).
static SHARED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many passes of this process a helper thread took part in so far (ran at least one
/// chunk of), for tests and diagnostics.
pub fn shared_passes() -> u64 {
    SHARED.load(Ordering::Relaxed)
}

/// Helpers wanted (`usize::MAX`: not set, the default applies).
static WANTED: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The helpers a pass may use now: as set by [`set_helpers`], else one fewer than the cores
/// (at most three).
pub fn helpers() -> usize {
    match WANTED.load(Ordering::Relaxed) {
        usize::MAX => default_helpers(),
        n => n,
    }
}

fn default_helpers() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        helpers_for_cores(std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

/// The helpers a process with `cores` cores to itself uses by default: one fewer than the
/// cores, at most three.
pub fn helpers_for_cores(cores: usize) -> usize {
    cores.saturating_sub(1).min(3)
}

/// Sets how many helper threads share large passes (at most [`MAX_HELPERS`]; 0: none, every
/// pass runs on its caller's thread). Threads already started stay parked when fewer are
/// wanted.
pub fn set_helpers(n: usize) {
    WANTED.store(n.min(MAX_HELPERS), Ordering::Relaxed);
}

/// One pass: `f(k)` for every chunk `k` in `0..n`, claimed through `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    /// Whether a helper ran a chunk.
    helped: std::sync::atomic::AtomicBool,
    /// What a chunk that panicked on a helper panicked with (the first such).
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs chunks until none is left; whether it ran any.
    fn work(&self) -> bool {
        let mut ran = false;
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= self.n {
                return ran;
            }
            ran = true;
            (self.f)(k);
        }
    }
}

/// A job published to the helpers, its lifetime erased (see [`run`] for why it stays alive).
#[derive(Clone, Copy)]
struct JobPtr(*const Job<'static>);

// SAFETY: a `JobPtr` is only dereferenced by a helper that joined the job (under the pool's
// lock, while it was published), until it leaves it; `run` keeps the job alive, unpublishes
// it under the same lock, then waits until every helper that joined it has left. The job's
// contents are `Sync` (`f` is `Sync`, the rest atomics and a mutex).
unsafe impl Send for JobPtr {}

struct Slot {
    job: Option<JobPtr>,
    /// Bumped at every publication, so a helper joins each job at most once.
    epoch: u64,
    /// Helpers that joined the published job (or the last one) and have not left it.
    inside: usize,
    /// Helpers that joined the published job.
    joined: usize,
    /// Helpers the published job may have (the first to look).
    allowed: usize,
    /// Helper threads started.
    started: usize,
}

struct Pool {
    slot: Mutex<Slot>,
    /// Wakes helpers: a job was published.
    wake: Condvar,
    /// Wakes the caller: the last helper inside left.
    left: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        slot: Mutex::new(Slot {
            job: None,
            epoch: 0,
            inside: 0,
            joined: 0,
            allowed: 0,
            started: 0,
        }),
        wake: Condvar::new(),
        left: Condvar::new(),
    })
}

fn lock(p: &Pool) -> MutexGuard<'_, Slot> {
    // Nothing runs user code under this lock; a poisoned one still holds consistent counts.
    p.slot.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f(k)` for every `k` in `0..n`, each exactly once, on this thread and on idle helper
/// threads; returns once every call has returned. With no helper, fewer than two chunks, or
/// the helpers busy with another pass, every call runs here, in order.
///
/// # Panics
/// If `f` panics, here or on a helper (after every claimed chunk ended).
pub fn run(n: usize, f: &(dyn Fn(usize) + Sync)) {
    let want = helpers().min(n.saturating_sub(1));
    if want == 0 {
        return (0..n).for_each(f);
    }
    let p = pool();
    let job = Job {
        f,
        n,
        next: AtomicUsize::new(0),
        helped: std::sync::atomic::AtomicBool::new(false),
        panicked: Mutex::new(None),
    };
    let epoch = {
        let mut s = lock(p);
        // Published only while no helper is inside a pass: those that joined an earlier one
        // have all left it, so whoever is inside below is inside this one.
        if s.job.is_some() || s.inside > 0 {
            // Another pass has the helpers: this one runs here.
            drop(s);
            return (0..n).for_each(f);
        }
        while s.started < want {
            if start_helper().is_err() {
                break;
            }
            s.started += 1;
        }
        if s.started == 0 {
            drop(s);
            return (0..n).for_each(f);
        }
        // The erased lifetime: `job` outlives every use a helper makes of it (below).
        let erased: *const Job<'_> = &job;
        s.job = Some(JobPtr(erased.cast()));
        s.epoch = s.epoch.wrapping_add(1);
        s.joined = 0;
        s.allowed = want;
        s.epoch
    };
    p.wake.notify_all();
    let mine = catch_unwind(AssertUnwindSafe(|| {
        job.work();
    }));
    {
        let mut s = lock(p);
        // No helper joins from here on; wait for those inside to leave. Once they have, a
        // later pass may be published (and helpers join it): that one is not waited for.
        s.job = None;
        while s.inside > 0 && s.epoch == epoch {
            s = p
                .left
                .wait_timeout(s, Duration::from_millis(10))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    if job.helped.load(Ordering::Relaxed) {
        SHARED.fetch_add(1, Ordering::Relaxed);
    }
    if let Err(e) = mine {
        std::panic::resume_unwind(e);
    }
    let theirs = job
        .panicked
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(e) = theirs {
        std::panic::resume_unwind(e);
    }
}

fn start_helper() -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("falcon-helper".into())
        .spawn(helper)
        .map(|_| ())
}

fn helper() {
    let p = pool();
    let mut seen = 0u64;
    loop {
        let job = {
            let mut s = lock(p);
            loop {
                if let Some(j) = s.job
                    && s.epoch != seen
                {
                    seen = s.epoch;
                    if s.joined < s.allowed {
                        s.joined += 1;
                        s.inside += 1;
                        break j;
                    }
                }
                s = p.wake.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Leaves the job however the work ends.
        let _leave = Leave(p);
        // SAFETY: this helper joined the job under the lock while it was published and counts
        // in `inside` until `_leave` drops; `run` keeps the job alive until then.
        let j = unsafe { &*job.0 };
        let ran = catch_unwind(AssertUnwindSafe(|| j.work()));
        if !matches!(ran, Ok(false)) {
            j.helped.store(true, Ordering::Relaxed);
        }
        if let Err(e) = ran {
            // The caller panics with it (the first one kept).
            j.panicked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    }
}

/// A helper's leaving of the job it joined: `inside` counted down, the caller woken.
struct Leave(&'static Pool);

impl Drop for Leave {
    fn drop(&mut self) {
        let mut s = lock(self.0);
        s.inside -= 1;
        if s.inside == 0 {
            self.0.left.notify_all();
        }
    }
}

/// Runs `f(k, &mut items[k])` for every item, each exactly once, shared with the helpers as
/// [`run`] does.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    struct Items<T>(*mut T);
    // SAFETY: only used to hand out `&mut items[k]` for distinct `k` (below); `T: Send`.
    unsafe impl<T: Send> Sync for Items<T> {}
    let n = items.len();
    let base = Items(items.as_mut_ptr());
    let base = &base;
    run(n, &move |k| {
        // SAFETY: `run` calls this once for each `k` in `0..n`, so no two calls alias one
        // item, and `items` is borrowed mutably for the whole of `run`.
        let item = unsafe { &mut *base.0.add(k) };
        f(k, item)
    });
}

/// Copies `len` bytes from `src` to `dst` (as `std::ptr::copy`), in chunks of
/// [`COPY_CHUNK`] shared with the helpers when it is long enough.
///
/// # Safety
/// As for `std::ptr::copy`: `src` valid for reads and `dst` for writes of `len` bytes for the
/// whole call, from any thread. The ranges must not overlap unless they are equal (a chunk of
/// one may then be copied while another thread copies another chunk).
pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    if len < COPY_SHARED_FROM || helpers() == 0 {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src, dst, len) };
        return;
    }
    struct Span(*const u8, *mut u8);
    // SAFETY: the caller's contract makes both ranges usable from any thread for the call.
    unsafe impl Sync for Span {}
    let span = Span(src, dst);
    let span = &span;
    run(len.div_ceil(COPY_CHUNK), &move |k| {
        let at = k * COPY_CHUNK;
        let n = COPY_CHUNK.min(len - at);
        // SAFETY: [at, at + n) lies in both ranges (the caller's contract); each chunk is
        // copied once, by one thread, and chunks of distinct ranges do not overlap.
        unsafe { std::ptr::copy(span.0.add(at), span.1.add(at), n) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helpers are the process's: tests that count on them take turns.
    static TURN: Mutex<()> = Mutex::new(());

    fn turn() -> MutexGuard<'static, ()> {
        TURN.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[test]
    fn every_chunk_runs_once() {
        let _turn = turn();
        set_helpers(2);
        for n in [0, 1, 2, 3, 64, if cfg!(miri) { 100 } else { 1000 }] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            run(n, &|k| {
                hits[k].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn passes_from_several_threads_at_once_each_run_whole() {
        let _turn = turn();
        set_helpers(2);
        let rounds = if cfg!(miri) { 3 } else { 50 };
        std::thread::scope(|s| {
            for t in 0..3u32 {
                s.spawn(move || {
                    for round in 0..rounds {
                        let mut v = vec![0u32; 97];
                        for_each_mut(&mut v, |k, x| *x = k as u32 * t + round);
                        for (k, x) in v.iter().enumerate() {
                            assert_eq!(*x, k as u32 * t + round);
                        }
                    }
                });
            }
        });
    }

    fn on_a_helper() -> bool {
        std::thread::current().name() == Some("falcon-helper")
    }

    /// Waits (yielding) until `done`, for at most a few seconds (Miri: a bounded number of
    /// turns); whether it came.
    fn wait_for(done: impl Fn() -> bool) -> bool {
        let start = std::time::Instant::now();
        let mut turns = 0u64;
        while !done() {
            turns += 1;
            if (cfg!(miri) && turns > 100_000) || start.elapsed() > Duration::from_secs(10) {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// A pass whose caller holds its first chunk until a helper has run one: how many
    /// chunks helpers ran.
    fn pass_with_a_helper() -> usize {
        let helped = AtomicUsize::new(0);
        run(8, &|k| {
            if on_a_helper() {
                helped.fetch_add(1, Ordering::Relaxed);
            } else if k == 0 {
                assert!(
                    wait_for(|| helped.load(Ordering::Relaxed) > 0),
                    "no helper came"
                );
            }
        });
        helped.into_inner()
    }

    #[test]
    fn a_helper_takes_chunks_while_the_caller_is_busy() {
        let _turn = turn();
        set_helpers(1);
        let before = shared_passes();
        assert!(pass_with_a_helper() > 0);
        assert_eq!(shared_passes(), before + 1);
    }

    #[test]
    fn a_panic_on_a_helper_reaches_the_caller_with_its_message() {
        let _turn = turn();
        set_helpers(1);
        let panicked = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            run(8, &|k| {
                if on_a_helper() {
                    panicked.fetch_add(1, Ordering::Relaxed);
                    panic!("chunk {k} on a helper");
                } else if k == 0 {
                    assert!(
                        wait_for(|| panicked.load(Ordering::Relaxed) > 0),
                        "no helper came"
                    );
                }
            })
        }));
        let e = r.expect_err("the helper's panic reaches the caller");
        let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.ends_with("on a helper"), "{msg}");
        // The helper lives on and takes part in the next pass.
        assert!(pass_with_a_helper() > 0);
    }

    #[test]
    fn a_long_copy_is_the_plain_copy() {
        let _turn = turn();
        set_helpers(3);
        let mut src = vec![7u8; COPY_SHARED_FROM + COPY_CHUNK + 123];
        // Marks at every chunk's ends, so a chunk copied to the wrong place shows.
        for k in 0..src.len().div_ceil(COPY_CHUNK) {
            for at in [
                k * COPY_CHUNK,
                (k * COPY_CHUNK + COPY_CHUNK - 1).min(src.len() - 1),
            ] {
                src[at] = k as u8 + 1;
            }
        }
        let mut dst = vec![0u8; src.len()];
        // SAFETY: both vectors hold `src.len()` bytes and do not overlap.
        unsafe { copy(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
        assert_eq!(src, dst);
    }

    #[test]
    fn a_panic_in_a_chunk_reaches_the_caller_and_the_helpers_go_on() {
        let _turn = turn();
        set_helpers(2);
        let r = catch_unwind(|| {
            run(64, &|k| {
                if k == 40 {
                    panic!("chunk {k}");
                }
            })
        });
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        run(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
