//! Synchronous SGD with backup workers ("Sync-opt"; Chen, Pan, Monga, Bengio, Jozefowicz,
//! 2016, "Revisiting distributed synchronous SGD").
//!
//! `N + b` workers run; for each iteration (clock) the first `N` gradients to arrive count and
//! the `b` that arrive later are dropped, so a step costs the `N`-th fastest worker's time, not
//! the slowest's. In TensorFlow this is `SyncReplicasOptimizer(replicas_to_aggregate = N,
//! total_num_replicas = N + b)`.
//!
//! # Event semantics this policy expects
//!
//! - [`Event::Push`]`{worker, clock}` means *`worker`'s gradient for iteration `clock` arrived
//!   at the server and has not been applied yet*, unlike the other policies, which are told
//!   after the fact. The policy answers [`Action::DropGradient`]`{worker, clock}` for a gradient
//!   that does not count, and the server must then discard it; a push answered without
//!   `DropGradient` counts and the server applies it. A gradient counts iff fewer than `N`
//!   gradients for `clock` have counted so far (and this worker has not already pushed
//!   `clock`, or a later clock: repeats are dropped too). Gradients for a clock whose step is
//!   already complete are therefore always dropped ("stale": computed for an old version).
//! - The *version* `v` ([`SyncOpt::version`]) is the number of steps complete: clocks
//!   `0..v` each have their `N` counted gradients. [`Event::Pull`]`{clock: c}` is released iff
//!   `c <= v`, i.e. once clock `c − 1` (and every clock before it) has its `N` gradients;
//!   otherwise it is parked and released, in clock order, by the push that completes the step.
//!   A worker that lags (a backup) is never held: its pulls are for old clocks and are
//!   answered at once with the latest values.
//! - **A gradient belongs to the version it was computed on**, as in the paper and in
//!   TensorFlow's `SyncReplicasOptimizer` (a worker's local step is reset to the global step
//!   when it fetches the variables). A released pull gives the worker the parameters of the
//!   version `v` at release, so its next gradient counts for step `max(c, v)` (`c` its own
//!   clock), answered with [`Action::CountFor`] when that is not `c`: a backup released with
//!   newer parameters than its clock contributes to the current step instead of being dropped
//!   as stale. Its gradient is stale, and dropped, only if that step completed meanwhile. A
//!   worker counts at most once per step: a second gradient for a step it already counted in
//!   (it pulled again before the step completed, so its parameters were the same) is dropped.
//!   The pulls themselves are not held for this (a worker that waited for its own step could
//!   wait forever once the others have finished), so every pull must reach the policy: the
//!   fast path is off when there are backups.
//! - [`Event::Leave`]: a departed worker no longer counts toward the quorum. While fewer than
//!   `N` workers are live a step completes with as many gradients as there are live workers
//!   (gradients a worker pushed before it left still count), so training does not deadlock.
//!   [`Event::Join`]`{clock}` marks the worker live again; its pushes for clocks below `clock`
//!   are treated as repeats. [`Event::Tick`] does nothing. Events about unknown workers are
//!   ignored (no action at all: the server must not feed gradients from ranks it does not
//!   know).
//! - Each shard runs its own instance, so on different shards different workers may be among
//!   the first `N` of a step, as with TensorFlow's one accumulator per variable.
//!
//! Fast path: without backups `Within(0)` (a one-sided pull at `c` needs every live worker to
//! have pushed clock `c − 1`, so the step is complete and the policy would have released it
//! too; the version at release is then `c`, so no gradient is ever re-assigned). With backups
//! `Never`: the policy must see each pull to know the version a worker's gradient is computed
//! on.
//!
//! With `b = 0` this is BSP action for action (a property test checks it against
//! [`super::Bsp`]).
//!
//! # Backups from the straggler projection
//!
//! `syncopt(auto)` (ours) needs no `b`: it times each worker's iterations as EPSP does (from
//! the release of its pull to the arrival of its push, so waiting is not compute) with EPSP's
//! straggler projection, and takes as backups the workers the projection classes as
//! *persistent* stragglers (most of a window's iterations more than 30 % slower than the
//! lower quartile of the live workers' medians — the fast group's typical time; the fastest
//! worker's own median, EPSP's reference, is an outlier among many or noisy workers),
//! re-judged every `⌈live / 8⌉` pushes. Without persistent
//! stragglers it is BSP; transient episodes do not make backups. Tuning `b` by hand needs a
//! run per value; the projection finds it while training.
//!
//! # Folding late gradients
//!
//! `syncopt(B,fold)` and `syncopt(auto,fold)` (ours) keep the backups' work. A gradient
//! Sync-opt would drop because its step was made without it (or because the worker already
//! counted in that step) is answered with [`Action::Fold`]: the server adds it to the next
//! step it applies, as one more gradient in that step's mean, not toward its quorum. Steps
//! still close at the pace of the `N`-th fastest worker, and every example a worker computed
//! reaches the model, one or more steps stale (a backup at half speed: about two). Sync-opt
//! instead loses the backups' data, which costs accuracy when the slow workers hold data the
//! others do not (a skewed partition). Repeats are dropped as before. Everything else
//! (quorum, version, releases, `CountFor`) is Sync-opt's.

use std::collections::{BTreeSet, VecDeque};

use super::projection::{Projection, ProjectionConfig};
use super::{Action, Event, FastPath, Nanos, SyncPolicy, Worker};

/// Where among the live workers' typical iteration times `syncopt(auto)` takes the reference a
/// backup is slower than: the lower quartile.
const BACKUP_REFERENCE: f64 = 0.25;

/// `syncopt(auto)` (ours): the backups are the workers EPSP's straggler projection classes as
/// persistent stragglers, re-judged as iterations are timed.
#[derive(Clone, Debug)]
struct Auto {
    projection: Projection,
    /// Pushes timed since the last verdict.
    since: u64,
}

/// Sync-opt: `N` counted gradients per step out of `N + b` workers.
#[derive(Clone, Debug)]
pub struct SyncOpt {
    /// `N`: gradients that count per step.
    quorum: u32,
    backups: u32,
    /// Per worker: one past the highest clock it pushed (or joined with).
    next: Vec<u64>,
    /// Per worker: the version of the parameters its last released pull gave it.
    base: Vec<u64>,
    /// Per worker: one past the last step it counted in (0: none).
    counted_in: Vec<u64>,
    live: Vec<bool>,
    /// Live workers.
    live_count: u32,
    /// Completed steps (the version).
    version: u64,
    /// Counted gradients for clocks `version, version + 1, …`.
    counted: VecDeque<u32>,
    /// Parked pulls in release order: (clock, req, worker).
    waiting: BTreeSet<(u64, u64, Worker)>,
    delayed: u64,
    dropped: u64,
    /// Backups from the straggler projection (`None`: fixed).
    auto: Option<Box<Auto>>,
    /// Late gradients are folded into the next step instead of dropped.
    fold: bool,
    folded: u64,
    /// The latest event's time.
    now: Nanos,
}

impl SyncOpt {
    /// Sync-opt for `workers_total = N + b` workers of which `backups = b` are backups: each
    /// step aggregates the first `N = workers_total − backups` gradients.
    ///
    /// # Panics
    /// If `backups >= workers_total` (a step needs at least one gradient).
    pub fn new(workers_total: u32, backups: u32) -> SyncOpt {
        assert!(
            backups < workers_total,
            "Sync-opt needs fewer backups ({backups}) than workers ({workers_total})"
        );
        SyncOpt {
            quorum: workers_total - backups,
            backups,
            next: vec![0; workers_total as usize],
            base: vec![0; workers_total as usize],
            counted_in: vec![0; workers_total as usize],
            live: vec![true; workers_total as usize],
            live_count: workers_total,
            version: 0,
            counted: VecDeque::new(),
            waiting: BTreeSet::new(),
            delayed: 0,
            dropped: 0,
            auto: None,
            fold: false,
            folded: 0,
            now: 0,
        }
    }

    /// With `fold`, a gradient that does not count for its step (late, or a second one for a
    /// step the worker already counted in) is answered with [`Action::Fold`] instead of
    /// [`Action::DropGradient`]: the server adds it to the next step it applies (see the
    /// [module docs](self#folding-late-gradients)). Repeats are still dropped.
    pub fn folding(mut self, fold: bool) -> SyncOpt {
        self.fold = fold;
        self
    }

    /// Gradients folded into a later step so far (answered with [`Action::Fold`]).
    pub fn folded_total(&self) -> u64 {
        self.folded
    }

    /// `syncopt(auto)` for `workers_total` workers: no backups until the straggler projection
    /// (EPSP's, default settings) classes workers as persistent stragglers; then as many
    /// backups as it classes so, at most `workers_total − 1` (see the
    /// [module docs](self#backups-from-the-straggler-projection)).
    pub fn auto(workers_total: u32) -> SyncOpt {
        SyncOpt {
            auto: Some(Box::new(Auto {
                projection: Projection::new(workers_total, ProjectionConfig::default()),
                since: 0,
            })),
            ..SyncOpt::new(workers_total.max(1), 0)
        }
    }

    /// Re-judges the backups from the projection (every `⌈live / 8⌉` timed pushes: a verdict
    /// passes over every worker's window, so this keeps it `O(window)` per push).
    fn rejudge(&mut self, out: &mut Vec<Action>) {
        let Some(auto) = self.auto.as_mut() else {
            return;
        };
        auto.since += 1;
        if auto.since < u64::from(self.live_count.div_ceil(8).max(1)) {
            return;
        }
        auto.since = 0;
        let total = self.next.len() as u32;
        // Against the lower quartile of the workers' typical times, not the fastest's: with
        // many workers, or noisy ones, the fastest median is an outlier and a third of a
        // healthy cluster sat more than 30 % above it (256 simulated workers, 64 slowed:
        // 16 105 gradients dropped, where 64 backups drop 6 400).
        let persistent = auto.projection.persistent_count_from(BACKUP_REFERENCE) as u32;
        let backups = persistent.min(total.saturating_sub(1));
        if backups != self.backups {
            self.backups = backups;
            self.quorum = total - backups;
            if self.advance() {
                self.release_ready(out);
            }
        }
    }

    /// `N`: the gradients that count per step.
    pub fn quorum(&self) -> u32 {
        self.quorum
    }

    /// `b`: the backup workers.
    pub fn backups(&self) -> u32 {
        self.backups
    }

    /// Steps complete: every clock below this has its `N` counted gradients.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Gradients dropped so far (answered with [`Action::DropGradient`]).
    pub fn dropped_total(&self) -> u64 {
        self.dropped
    }

    /// Gradients a step needs now: `N`, or the live workers when fewer are live.
    fn needed(&self) -> u32 {
        self.quorum.min(self.live_count)
    }

    /// Advances the version over every complete step; true if it moved.
    fn advance(&mut self) -> bool {
        let needed = self.needed();
        let mut moved = false;
        while needed > 0 && self.counted.front().is_some_and(|&n| n >= needed) {
            self.counted.pop_front();
            self.version += 1;
            moved = true;
        }
        moved
    }

    fn release_ready(&mut self, out: &mut Vec<Action>) {
        let (v, now) = (self.version, self.now);
        while let Some(&(clock, req, worker)) = self.waiting.first() {
            if clock > v {
                break;
            }
            self.waiting.pop_first();
            self.base[worker as usize] = v;
            if let Some(a) = self.auto.as_mut() {
                a.projection.start(worker, now);
            }
            out.push(Action::Release { worker, req });
        }
    }

    fn on_push(&mut self, worker: Worker, clock: u64, out: &mut Vec<Action>) {
        let w = worker as usize;
        let repeat = clock < self.next[w];
        if !repeat && let Some(a) = self.auto.as_mut() {
            a.projection.finish(worker, self.now);
            self.rejudge(out);
        }
        self.next[w] = self.next[w].max(clock.saturating_add(1));
        // The step of the parameters it was computed on.
        let step = clock.max(self.base[w]);
        let slot = step
            .checked_sub(self.version)
            .and_then(|i| usize::try_from(i).ok());
        let counts = !repeat
            && step >= self.counted_in[w]
            && slot.is_some_and(|i| self.counted.get(i).is_none_or(|&n| n < self.quorum));
        if !counts {
            if self.fold && !repeat {
                self.folded += 1;
                out.push(Action::Fold { worker, clock });
            } else {
                self.dropped += 1;
                out.push(Action::DropGradient { worker, clock });
            }
            return;
        }
        let i = slot.expect("counted gradients have a slot");
        if self.counted.len() <= i {
            self.counted.resize(i + 1, 0);
        }
        self.counted[i] += 1;
        self.counted_in[w] = step + 1;
        if step != clock {
            out.push(Action::CountFor {
                worker,
                clock,
                step,
            });
        }
        if self.advance() {
            self.release_ready(out);
        }
    }
}

impl SyncPolicy for SyncOpt {
    fn judges_arrivals(&self) -> bool {
        true
    }

    fn step_quorum(&self, live: u32) -> u32 {
        self.quorum().min(live)
    }

    fn restored(&mut self, steps: u64, pending: &[(u64, Vec<Worker>)], out: &mut Vec<Action>) {
        self.version = self.version.max(steps);
        self.counted.clear();
        for (step, workers) in pending {
            let Some(i) = step
                .checked_sub(self.version)
                .and_then(|i| usize::try_from(i).ok())
            else {
                continue;
            };
            if self.counted.len() <= i {
                self.counted.resize(i + 1, 0);
            }
            for &w in workers {
                if let Some(c) = self.counted_in.get_mut(w as usize) {
                    self.counted[i] += 1;
                    *c = (*c).max(step + 1);
                }
            }
        }
        for b in &mut self.base {
            *b = (*b).max(self.version);
        }
        self.release_ready(out);
    }

    fn dropped(&self) -> u64 {
        self.dropped
    }

    fn name(&self) -> String {
        let fold = if self.fold { ",fold" } else { "" };
        if self.auto.is_some() {
            return format!("syncopt(auto{fold})");
        }
        format!("syncopt({}+{}{fold})", self.quorum, self.backups)
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        let known = |w: Worker| (w as usize) < self.next.len();
        self.now = self.now.max(ev.at());
        match ev {
            Event::Push { worker, clock, .. } if known(worker) => self.on_push(worker, clock, out),
            Event::Pull {
                worker, clock, req, ..
            } if known(worker) => {
                if clock <= self.version {
                    self.base[worker as usize] = self.version;
                    if let Some(a) = self.auto.as_mut() {
                        a.projection.start(worker, self.now);
                    }
                    out.push(Action::Release { worker, req });
                } else {
                    self.waiting.insert((clock, req, worker));
                    self.delayed += 1;
                    out.push(Action::Park { worker, req });
                }
            }
            Event::Leave { worker, .. } if known(worker) => {
                if std::mem::replace(&mut self.live[worker as usize], false) {
                    self.live_count -= 1;
                }
                if let Some(a) = self.auto.as_mut() {
                    a.projection.leave(worker);
                }
                if self.advance() {
                    self.release_ready(out);
                }
            }
            Event::Join { worker, clock, .. } if known(worker) => {
                let w = worker as usize;
                if !std::mem::replace(&mut self.live[w], true) {
                    self.live_count += 1;
                }
                if let Some(a) = self.auto.as_mut() {
                    a.projection.join(worker);
                }
                self.next[w] = self.next[w].max(clock);
            }
            _ => {}
        }
    }

    fn fast_path(&self) -> FastPath {
        // With backups, or backups that may come (auto), the policy sees every pull.
        if self.backups == 0 && self.auto.is_none() {
            FastPath::Within(0)
        } else {
            FastPath::Never
        }
    }

    fn parked(&self) -> usize {
        self.waiting.len()
    }

    fn delayed_total(&self) -> u64 {
        self.delayed
    }
}
