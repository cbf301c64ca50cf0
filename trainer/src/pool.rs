//! The elastic thread pool that runs one worker's iteration, the exactly-once claim point for
//! its tasks, and the over-subscription knee measurement (EPSP — our design: elastic
//! parallelism control and task transfer).
//!
//! # Shape
//!
//! An iteration is `m` tasks (micro-batches) with indices `0..m`. They sit in a [`TaskSource`],
//! one `AtomicU64`, from which the owner's pool threads [`claim`](TaskSource::claim) from the
//! front and a thief (a pioneer doing task transfer) [`steal`](TaskSource::steal)s from the
//! back. [`Pool::run`] runs `f(task, slot)` for every task it claims on up to
//! [`Pool::threads`] threads — the caller's thread is slot 0, persistent workers are slots
//! `1..p` — and returns once every task it claimed is done, with per-task times
//! ([`RunStats`]). [`Pool::resize`] changes `p`; it takes effect at the next `run`, i.e. at an
//! iteration boundary.
//!
//! # Why persistent threads with `'static` jobs (and no `unsafe`)
//!
//! Two safe designs were measured on the 2-core development VM (release build, 2000 runs of
//! 64 empty tasks, caller runs slot 0; the test `print_dispatch_overhead` in
//! `tests/pool.rs`), per run:
//!
//! | p  | scoped threads spawned per run ([`Pool::run_scoped`]) | persistent threads ([`Pool::run`]) |
//! |----|-------------------------------------------------------|------------------------------------|
//! | 1  | 5 µs                                                  | 5 µs                               |
//! | 2  | 69 µs                                                 | 16 µs                              |
//! | 4  | 131 µs                                                | 15 µs                              |
//! | 8  | 303 µs                                                | 29 µs                              |
//! | 16 | 691 µs                                                | 59 µs                              |
//!
//! (With the other core busy, scoped spawning rose to 0.3–1.5 ms per run and persistent
//! dispatch to 30–200 µs.)
//!
//! Spawning threads every iteration costs up to a millisecond — a large share of a
//! few-millisecond iteration, and it grows with exactly the over-subscription we want to
//! measure — so [`Pool::run`] hands work to persistent threads. A persistent thread cannot
//! borrow the caller's stack without erasing a lifetime (`unsafe`), so `run` takes
//! `F: Fn(usize, usize) + Send + Sync + 'static` and an `Arc<TaskSource>`: the job owns what
//! it uses (`Arc`s of the weights, per-slot gradient buffers…). Where borrowing matters more
//! than the overhead above, [`Pool::run_scoped`] runs the same loop on scoped threads spawned
//! for that one call.
//!
//! # Parking
//!
//! Each persistent worker blocks in `recv` on its own crossbeam channel (a futex wait after a
//! few µs of backoff) and is sent a job only when its slot is below the run's thread count, so
//! threads above the target never wake and use no CPU. Growing spawns the missing threads (at
//! `resize` when the pool is idle, else at the next `run`); shrinking only stops sending them
//! jobs. Threads are joined when the pool is dropped.
//!
//! A panic in `f` on any slot is caught, the other slots finish what they claimed, and `run`
//! then resumes the first panic on the caller's thread; the pool stays usable.

use std::any::Any;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
// The task source's word is loom's under `--cfg loom`, so `tests/loom_pool.rs` can model it;
// the pool's own threads and channels are std's either way (loom cannot model them).
#[cfg(loom)]
use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::{Error, Result};

/// The most threads a pool accepts (a guard against typos such as `--threads 10000`).
pub const MAX_THREADS: usize = 4096;

/// The most tasks one iteration of a [`TaskSource`] can hold (2^20 − 1).
pub const MAX_TASKS: usize = (1 << FIELD_BITS) - 1;

/// How many low bits of the iteration number a [`TaskSource`] keeps as its tag.
pub const TAG_BITS: u32 = 24;

const FIELD_BITS: u32 = 20;
const FIELD_MASK: u64 = (1 << FIELD_BITS) - 1;
const END_SHIFT: u32 = FIELD_BITS;
const TAG_SHIFT: u32 = 2 * FIELD_BITS;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

/// The tag a [`TaskSource`] stores for `iteration`: its low [`TAG_BITS`] bits.
pub fn iteration_tag(iteration: u64) -> u32 {
    (iteration & TAG_MASK) as u32
}

fn pack(tag: u32, next: u32, end: u32) -> u64 {
    u64::from(next) | (u64::from(end) << END_SHIFT) | (u64::from(tag) << TAG_SHIFT)
}

fn unpack(state: u64) -> (u32, u32, u32) {
    (
        (state >> TAG_SHIFT) as u32,
        (state & FIELD_MASK) as u32,
        ((state >> END_SHIFT) & FIELD_MASK) as u32,
    )
}

/// The exactly-once claim point for one iteration's tasks `0..m`, shared by the owner's pool
/// threads (front, [`claim`](Self::claim)) and thieves doing task transfer (back,
/// [`steal`](Self::steal)).
///
/// # One atomic word
///
/// The state is a single `AtomicU64` packing `(tag: 24 bits, end: 20 bits, next: 20 bits)`:
/// the unclaimed tasks are exactly `next..end`, and `tag` is the low 24 bits of the iteration
/// they belong to. (A plain `(next: u32, end: u32)` pair would leave thieves unable to tell,
/// atomically with the steal, which iteration their tasks belong to; the tag closes that
/// race, and 2^20 − 1 tasks per iteration is far more than any micro-batching needs.)
///
/// # Why every task is handed out exactly once
///
/// Every hand-out is a successful compare-exchange that replaces `next..end` with a strictly
/// smaller interval inside it: `claim` removes `next`, `steal(k)` removes `end−k..end`. All
/// read-modify-writes of one atomic location are totally ordered (its modification order),
/// and a successful CAS read the value written by the one just before it, so the intervals of
/// one iteration form a nested chain `0..m ⊇ I₁ ⊇ I₂ ⊇ …` and each success receives exactly
/// the difference between two consecutive links. Those differences are disjoint, and once the
/// interval is empty their union is `0..m`. A failed CAS hands out nothing and retries on the
/// fresh value. Within an iteration the packed values strictly shrink, so a CAS cannot
/// succeed on a stale value (no ABA); across iterations the tag differs unless 2^24 resets
/// happen between one caller's load and its CAS.
///
/// # Orderings
///
/// Exactly-once needs nothing beyond the atomicity of the CAS on one location, so loads and
/// failed CASes are `Relaxed`. [`reset`](Self::reset) is a `Release` store and successful
/// claims and steals `Acquire`, so whatever the owner wrote before publishing an iteration
/// (its batch, its weights) is visible to whoever takes a task of it; read-modify-writes
/// continue the release sequence, so this holds for every claim after the reset.
///
/// Tested with real threads (claimers and thieves racing over many rounds, `tests/pool.rs`),
/// against a sequential model, and model-checked with loom (`tests/loom_pool.rs`: claimers
/// and a thief racing, and a thief racing the reset to the next iteration).
#[derive(Debug)]
pub struct TaskSource {
    state: AtomicU64,
}

/// Tasks taken from the back of a [`TaskSource`] by a thief.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stolen {
    /// The [`iteration_tag`] of the iteration these tasks belong to.
    pub tag: u32,
    /// The task indices, non-empty.
    pub tasks: Range<usize>,
}

impl Stolen {
    /// Whether these tasks belong to `iteration` (compares [`iteration_tag`]s).
    pub fn is_for(&self, iteration: u64) -> bool {
        self.tag == iteration_tag(iteration)
    }
}

impl TaskSource {
    /// A source for iteration 0 holding tasks `0..m`; `m` above [`MAX_TASKS`] is an
    /// [`Error::Config`].
    pub fn new(m: usize) -> Result<TaskSource> {
        let source = TaskSource {
            state: AtomicU64::new(0),
        };
        source.reset(0, m)?;
        Ok(source)
    }

    /// Starts `iteration` with tasks `0..m`, dropping whatever the previous iteration had
    /// left. Call it at an iteration boundary, when the owner's pool is not claiming; a thief
    /// racing with it sees the new tag in what it steals. `m` above [`MAX_TASKS`] is an
    /// [`Error::Config`] and leaves the source unchanged.
    pub fn reset(&self, iteration: u64, m: usize) -> Result<()> {
        if m > MAX_TASKS {
            return Err(Error::Config(format!(
                "{m} tasks in one iteration; at most {MAX_TASKS} are supported — use larger \
                 micro-batches"
            )));
        }
        let state = pack(iteration_tag(iteration), 0, m as u32);
        // Release: publishes the owner's writes for this iteration to every later claim/steal.
        // A swap rather than a store: the same effect, and the loom model checks exactly this
        // code (loom 0.7 lets a plain store land inside another thread's compare-exchange,
        // tokio-rs/loom#254, which the memory model forbids, and reports a false failure).
        self.state.swap(state, Ordering::Release);
        Ok(())
    }

    /// Takes the next task from the front, or `None` when none is left.
    pub fn claim(&self) -> Option<usize> {
        // Relaxed: the value is only a guess that the CAS below validates.
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            let (tag, next, end) = unpack(current);
            if next >= end {
                return None;
            }
            // Acquire on success: see reset(); Relaxed on failure: nothing was handed out.
            match self.state.compare_exchange_weak(
                current,
                pack(tag, next + 1, end),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(next as usize),
                Err(actual) => current = actual,
            }
        }
    }

    /// Takes up to `max` tasks from the back — everything not yet claimed if `max` allows —
    /// or `None` when none is left or `max` is 0.
    pub fn steal(&self, max: usize) -> Option<Stolen> {
        self.steal_if(None, max, 0)
    }

    /// Like [`steal`](Self::steal), but only tasks of `iteration`: `None` when the source
    /// holds another iteration (by [`iteration_tag`]). The check and the steal are one atomic
    /// step, so a thief never takes tasks of an iteration it did not ask for, even when the
    /// owner resets concurrently.
    pub fn steal_for(&self, iteration: u64, max: usize) -> Option<Stolen> {
        self.steal_if(Some(iteration_tag(iteration)), max, 0)
    }

    /// Like [`steal_for`](Self::steal_for), but leaving at least `keep` tasks unclaimed for
    /// the owner (checked in the same atomic step): an owner that takes an iteration's tasks
    /// in one go always has some of its own.
    pub fn steal_for_keeping(&self, iteration: u64, max: usize, keep: usize) -> Option<Stolen> {
        self.steal_if(Some(iteration_tag(iteration)), max, keep)
    }

    fn steal_if(&self, want_tag: Option<u32>, max: usize, keep: usize) -> Option<Stolen> {
        let mut current = self.state.load(Ordering::Relaxed);
        loop {
            let (tag, next, end) = unpack(current);
            if want_tag.is_some_and(|t| t != tag) {
                return None;
            }
            let k = max.min((end.saturating_sub(next) as usize).saturating_sub(keep)) as u32;
            if k == 0 {
                return None;
            }
            let new_end = end - k;
            // Orderings as in claim().
            match self.state.compare_exchange_weak(
                current,
                pack(tag, next, new_end),
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(Stolen {
                        tag,
                        tasks: new_end as usize..end as usize,
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// How many tasks are neither claimed nor stolen (a snapshot).
    pub fn remaining(&self) -> usize {
        let (_, next, end) = unpack(self.state.load(Ordering::Relaxed));
        end.saturating_sub(next) as usize
    }

    /// The [`iteration_tag`] of the current iteration.
    pub fn tag(&self) -> u32 {
        unpack(self.state.load(Ordering::Relaxed)).0
    }
}

/// When and how long one task ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskTime {
    /// The task index.
    pub task: usize,
    /// The slot (thread) that ran it: 0 is the caller of [`Pool::run`].
    pub slot: usize,
    /// When it started, from the start of the run.
    pub start: Duration,
    /// How long `f` took on it (its completion time).
    pub time: Duration,
}

/// What one [`Pool::run`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunStats {
    /// How many slots took part (at most [`Pool::threads`], at most the tasks available).
    pub threads: usize,
    /// Wall time of the run, dispatch and collection included.
    pub wall: Duration,
    /// The tasks this run claimed and ran, sorted by task index (stolen tasks are absent).
    pub tasks: Vec<TaskTime>,
}

/// Summary statistics of task completion times.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TaskSummary {
    /// How many tasks.
    pub count: usize,
    /// Mean completion time.
    pub mean: Duration,
    /// Longest.
    pub max: Duration,
    /// Shortest.
    pub min: Duration,
    /// Population variance, in milliseconds squared.
    pub var_ms2: f64,
}

impl TaskSummary {
    /// Summarises `times` (all zero when empty).
    pub fn of(times: impl IntoIterator<Item = Duration>) -> TaskSummary {
        let ms: Vec<f64> = times.into_iter().map(|t| t.as_secs_f64() * 1e3).collect();
        if ms.is_empty() {
            return TaskSummary::default();
        }
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        let var = ms.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let from_ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1e3);
        TaskSummary {
            count: ms.len(),
            mean: from_ms(mean),
            max: from_ms(ms.iter().copied().fold(f64::MIN, f64::max)),
            min: from_ms(ms.iter().copied().fold(f64::MAX, f64::min)),
            var_ms2: var,
        }
    }
}

impl RunStats {
    /// Mean, max, min and variance of this run's task completion times.
    pub fn summary(&self) -> TaskSummary {
        TaskSummary::of(self.tasks.iter().map(|t| t.time))
    }
}

type DynTask = dyn Fn(usize, usize) + Send + Sync;
type SlotReport = thread::Result<Vec<TaskTime>>;

struct Job {
    f: Arc<DynTask>,
    tasks: Arc<TaskSource>,
    start: Instant,
    done: Sender<SlotReport>,
}

struct Worker {
    mailbox: Sender<Job>,
    handle: JoinHandle<()>,
}

/// An elastic pool of persistent threads; see the [module documentation](self).
pub struct Pool {
    /// The thread count the next run uses. Relaxed everywhere: a lone value that publishes
    /// nothing else.
    target: AtomicUsize,
    /// Persistent workers for slots `1..=len`; the lock also makes runs one at a time, so a
    /// slot is never used by two runs at once.
    workers: Mutex<Vec<Worker>>,
    /// How many persistent threads exist (parked or not), readable without the lock.
    spawned: AtomicUsize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads())
            .field("spawned", &self.spawned())
            .finish()
    }
}

fn check_threads(threads: usize) -> Result<()> {
    if threads == 0 || threads > MAX_THREADS {
        return Err(Error::Config(format!(
            "a pool of {threads} threads; use 1 to {MAX_THREADS}"
        )));
    }
    Ok(())
}

/// Runs tasks claimed from `tasks` on `slot` until none is left.
fn work<F: Fn(usize, usize) + ?Sized>(
    f: &F,
    tasks: &TaskSource,
    slot: usize,
    start: Instant,
) -> Vec<TaskTime> {
    let mut done = Vec::new();
    while let Some(task) = tasks.claim() {
        let began = Instant::now();
        f(task, slot);
        done.push(TaskTime {
            task,
            slot,
            start: began - start,
            time: began.elapsed(),
        });
    }
    done
}

fn worker_loop(slot: usize, mailbox: Receiver<Job>) {
    // Blocks (parks) here between jobs; ends when the pool drops the sender.
    for job in mailbox {
        let Job {
            f,
            tasks,
            start,
            done,
        } = job;
        let report = catch_unwind(AssertUnwindSafe(|| work(&*f, &tasks, slot, start)));
        // Drop our references before reporting, so that when run() returns no clone of the
        // caller's closure is left on a worker.
        drop(f);
        drop(tasks);
        let _ = done.send(report);
    }
}

/// Merges the slots' reports; returns the first panic payload, if any.
fn merge(
    reports: impl IntoIterator<Item = SlotReport>,
    stats: &mut RunStats,
) -> Option<Box<dyn Any + Send>> {
    let mut panic = None;
    for report in reports {
        match report {
            Ok(times) => stats.tasks.extend(times),
            Err(payload) => {
                panic.get_or_insert(payload);
            }
        }
    }
    stats.tasks.sort_unstable_by_key(|t| t.task);
    panic
}

impl Pool {
    /// A pool running `threads` slots (the caller plus `threads − 1` persistent threads,
    /// spawned now). 0 or more than [`MAX_THREADS`] is an [`Error::Config`]; failing to spawn
    /// is an [`Error::Io`].
    pub fn new(threads: usize) -> Result<Pool> {
        check_threads(threads)?;
        let pool = Pool {
            target: AtomicUsize::new(threads),
            workers: Mutex::new(Vec::new()),
            spawned: AtomicUsize::new(0),
        };
        pool.grow(&mut pool.lock(), threads - 1)?;
        Ok(pool)
    }

    /// The thread count the next [`run`](Self::run) uses.
    pub fn threads(&self) -> usize {
        self.target.load(Ordering::Relaxed)
    }

    /// How many persistent threads exist, parked or busy (the caller's slot 0 not counted).
    /// Shrinking parks threads rather than ending them, so this only grows.
    pub fn spawned(&self) -> usize {
        self.spawned.load(Ordering::Relaxed)
    }

    /// Sets the thread count for the next run (an iteration boundary; a run in progress keeps
    /// its count). Threads above it park; growing spawns missing threads now if the pool is
    /// idle, else at the next run. 0 or more than [`MAX_THREADS`] is an [`Error::Config`];
    /// failing to spawn is an [`Error::Io`] (the target is still set, and the next run uses
    /// the threads it can get).
    pub fn resize(&self, threads: usize) -> Result<()> {
        check_threads(threads)?;
        self.target.store(threads, Ordering::Relaxed);
        if let Ok(mut workers) = self.workers.try_lock() {
            self.grow(&mut workers, threads - 1)?;
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Worker>> {
        // A panic resumed by run() poisons the lock after every slot has reported; the worker
        // list is consistent then, so poisoning carries no information here.
        self.workers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns persistent workers until there are `n`.
    fn grow(&self, workers: &mut Vec<Worker>, n: usize) -> Result<()> {
        while workers.len() < n {
            let slot = workers.len() + 1;
            let (mailbox, inbox) = crossbeam_channel::unbounded();
            let handle = thread::Builder::new()
                .name(format!("falcon-pool-{slot}"))
                .spawn(move || worker_loop(slot, inbox))?;
            workers.push(Worker { mailbox, handle });
            self.spawned.store(workers.len(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// How many slots a run with `tasks` uses, spawning what is missing.
    fn slots_for(&self, workers: &mut Vec<Worker>, tasks: &TaskSource) -> usize {
        let want = self.threads().min(tasks.remaining()).max(1);
        if let Err(e) = self.grow(workers, want - 1) {
            tracing::warn!(
                wanted = want,
                have = workers.len() + 1,
                "could not spawn pool threads, running with fewer: {e}"
            );
        }
        want.min(workers.len() + 1)
    }

    /// Runs every task it can claim from `tasks` as `f(task, slot)` on up to
    /// [`threads`](Self::threads) slots (the calling thread is slot 0), and returns once all
    /// the tasks it claimed are done. Tasks a thief steals meanwhile are not run here. Runs
    /// are one at a time; a concurrent call waits. A panic in `f` is resumed here after every
    /// slot has finished.
    pub fn run<F>(&self, tasks: &Arc<TaskSource>, f: F) -> RunStats
    where
        F: Fn(usize, usize) + Send + Sync + 'static,
    {
        let mut workers = self.lock();
        let start = Instant::now();
        let slots = self.slots_for(&mut workers, tasks);
        let f: Arc<DynTask> = Arc::new(f);
        let (done, reports) = crossbeam_channel::bounded(slots);
        for worker in &workers[..slots - 1] {
            let job = Job {
                f: Arc::clone(&f),
                tasks: Arc::clone(tasks),
                start,
                done: done.clone(),
            };
            // A worker only ends when its sender is dropped, so this cannot fail; if it did,
            // the job (and its `done`) is dropped and the collection below still ends.
            let _ = worker.mailbox.send(job);
        }
        drop(done);
        let mine = catch_unwind(AssertUnwindSafe(|| work(&*f, tasks, 0, start)));
        // Ends when every dispatched job has reported and dropped its sender.
        let theirs: Vec<SlotReport> = reports.iter().collect();
        let mut stats = RunStats {
            threads: slots,
            ..RunStats::default()
        };
        let panic = merge(std::iter::once(mine).chain(theirs), &mut stats);
        stats.wall = start.elapsed();
        drop(workers);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
        stats
    }

    /// Like [`run`](Self::run), but `f` may borrow from the caller: the slots above 0 are
    /// scoped threads spawned for this call (the persistent threads stay parked). Spawning
    /// costs roughly 0.07–0.7 ms per call on a 2-core host (see the module documentation), so
    /// prefer `run` in the training loop.
    pub fn run_scoped<F>(&self, tasks: &TaskSource, f: F) -> RunStats
    where
        F: Fn(usize, usize) + Sync,
    {
        let workers = self.lock();
        let start = Instant::now();
        let want = self.threads().min(tasks.remaining()).max(1);
        let f = &f;
        let reports = thread::scope(|scope| {
            let handles: Vec<_> = (1..want)
                .map_while(|slot| {
                    thread::Builder::new()
                        .name(format!("falcon-scoped-{slot}"))
                        .spawn_scoped(scope, move || {
                            catch_unwind(AssertUnwindSafe(|| work(f, tasks, slot, start)))
                        })
                        .inspect_err(|e| {
                            tracing::warn!(wanted = want, "could not spawn a scoped thread: {e}")
                        })
                        .ok()
                })
                .collect();
            let slots = handles.len() + 1;
            let mut reports = vec![catch_unwind(AssertUnwindSafe(|| work(f, tasks, 0, start)))];
            // The closures catch panics, so join only fails if catching itself failed.
            reports.extend(handles.into_iter().map(|h| h.join().and_then(|r| r)));
            (slots, reports)
        });
        let mut stats = RunStats {
            threads: reports.0,
            ..RunStats::default()
        };
        let panic = merge(reports.1, &mut stats);
        stats.wall = start.elapsed();
        drop(workers);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
        stats
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let workers = std::mem::take(&mut *self.lock());
        // Close every mailbox first so all threads wind down together, then join them.
        let (mailboxes, handles): (Vec<_>, Vec<_>) =
            workers.into_iter().map(|w| (w.mailbox, w.handle)).unzip();
        drop(mailboxes);
        for handle in handles {
            let _ = handle.join();
        }
    }
}

/// One thread count's measurement from [`measure_knee`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KneePoint {
    /// Thread count (parallelism p) asked for; a run uses fewer only when there are fewer
    /// tasks than threads.
    pub threads: usize,
    /// Mean task completion time.
    pub mean_task: Duration,
    /// Longest task completion time.
    pub max_task: Duration,
    /// Shortest task completion time.
    pub min_task: Duration,
    /// Variance of task completion times, in milliseconds squared.
    pub var_task: f64,
    /// Wall time of the whole iteration.
    pub iteration_time: Duration,
}

impl KneePoint {
    /// Squared coefficient of variation of task times (variance / mean²), dimensionless; 0
    /// when the mean is 0.
    pub fn cv2(&self) -> f64 {
        let mean_ms = self.mean_task.as_secs_f64() * 1e3;
        if mean_ms > 0.0 {
            self.var_task / (mean_ms * mean_ms)
        } else {
            0.0
        }
    }
}

/// Runs one iteration of `tasks` calls of `work` at each thread count `1..=max_threads` (after
/// an untimed warm-up of one task per thread) and reports task completion times and the
/// iteration time: the over-subscription curve of Falcon's ICDCS figure. `max_threads` above
/// [`MAX_THREADS`] is capped; 0 gives no points; `tasks` is capped at [`MAX_TASKS`].
pub fn measure_knee<W>(max_threads: usize, tasks: usize, work: W) -> Vec<KneePoint>
where
    W: Fn() + Send + Sync + 'static,
{
    let max_threads = max_threads.min(MAX_THREADS);
    let tasks = tasks.min(MAX_TASKS);
    if max_threads == 0 {
        return Vec::new();
    }
    let Ok(pool) = Pool::new(1) else {
        return Vec::new();
    };
    let work = Arc::new(work);
    // Empty until reset; every reset below has at most MAX_TASKS tasks.
    let source = Arc::new(TaskSource {
        state: AtomicU64::new(0),
    });
    let mut points = Vec::with_capacity(max_threads);
    for threads in 1..=max_threads {
        if let Err(e) = pool.resize(threads) {
            tracing::warn!("knee measurement stops at {threads} threads: {e}");
            break;
        }
        let iteration = 2 * threads as u64;
        let _ = source.reset(iteration, threads);
        let w = Arc::clone(&work);
        pool.run(&source, move |_, _| w());
        let _ = source.reset(iteration + 1, tasks);
        let w = Arc::clone(&work);
        let stats = pool.run(&source, move |_, _| w());
        let s = stats.summary();
        points.push(KneePoint {
            threads,
            mean_task: s.mean,
            max_task: s.max,
            min_task: s.min,
            var_task: s.var_ms2,
            iteration_time: stats.wall,
        });
    }
    points
}

/// The thresholds [`knee_with`] uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KneeRule {
    /// Going from the current knee k to q > k threads must save at least this fraction of
    /// the ideal saving `t(k)·(1 − k/q)` (linear scaling). Default 0.25.
    pub min_gain: f64,
    /// … and must not raise the squared coefficient of variation of task times above this
    /// many times the knee's. Default 4.
    pub var_jump: f64,
    /// … where a squared coefficient of variation up to this floor never counts as a jump
    /// (uniform tasks have cv² ≈ 0, and 4 × 0 would reject any noise). Default 0.01, i.e. a
    /// 10 % standard deviation.
    pub cv2_floor: f64,
}

impl Default for KneeRule {
    fn default() -> Self {
        KneeRule {
            min_gain: 0.25,
            var_jump: 4.0,
            cv2_floor: 0.01,
        }
    }
}

/// The over-subscription knee of `points` under the default [`KneeRule`]; see [`knee_with`].
pub fn knee(points: &[KneePoint]) -> usize {
    knee_with(points, KneeRule::default())
}

/// The largest thread count worth using: walking the points by increasing thread count, the
/// knee starts at the first point and moves to a point q when q still pays off against the
/// current knee k —
///
/// - iteration time improves by at least `min_gain` of linear scaling:
///   `t(k) − t(q) ≥ min_gain · t(k) · (1 − k/q)`, and
/// - task-time variance does not jump: `cv²(q) ≤ max(var_jump · cv²(k), cv2_floor)`, with
///   `cv² = var / mean²`.
///
/// Points that fail are skipped, not fatal: comparing to the knee rather than the neighbour
/// keeps one noisy point from ending the walk early, while past the knee of an
/// over-subscribed machine no later point beats it. No points gives 1.
pub fn knee_with(points: &[KneePoint], rule: KneeRule) -> usize {
    let mut sorted: Vec<&KneePoint> = points.iter().filter(|p| p.threads > 0).collect();
    sorted.sort_by_key(|p| p.threads);
    let Some((&first, rest)) = sorted.split_first() else {
        return 1;
    };
    let mut best = first;
    for &q in rest {
        let tk = best.iteration_time.as_secs_f64();
        let tq = q.iteration_time.as_secs_f64();
        let ideal = tk * (1.0 - best.threads as f64 / q.threads as f64);
        let faster = tk - tq > 0.0 && tk - tq >= rule.min_gain * ideal;
        let steady = q.cv2() <= (rule.var_jump * best.cv2()).max(rule.cv2_floor);
        if faster && steady {
            best = q;
        }
    }
    best.threads
}
