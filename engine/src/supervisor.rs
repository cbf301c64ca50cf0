//! Falcon's supervisor and parallelism manager — **our design** (Falcon's full text is not
//! public; the rules are built on its published facts: straggler projection, elastic
//! parallelism, task transfer). The scheduler runs one for
//! its job: workers report each iteration ([`crate::Worker::report_iteration`], a
//! `Msg::IterationDone`) and hear their thread count back (`Msg::Threads`,
//! [`crate::Worker::advised_threads`]); the trainer applies it at its next iteration boundary.
//!
//! # Supervisor
//!
//! Workers report, at each iteration boundary, the time of the iteration they just finished
//! and the thread count it ran with ([`Manager::report`]). The supervisor feeds the
//! engine's straggler [`Projection`] (the same code EPSP's policy runs on the servers), so it
//! classes each worker as pioneer, transient or persistent straggler and predicts its next
//! iteration time.
//!
//! # Parallelism manager
//!
//! An online model of each worker's speed against its thread count: `speed_i(p)`, tasks per
//! second, the mean of the observed iterations at `p` (exponentially weighted, so it follows a
//! machine that slows down). Unobserved counts are estimated from the nearest observed one,
//! assuming linear scaling below it and no gain above it, and never past the knee.
//!
//! The **knee** is the over-subscription point where completion time and its variance blow
//! up (Falcon's figure, measured by `falcon_trainer::pool::measure_knee`): no worker gets more
//! threads than the knee of its host. The **budget** is the threads a host can run at once
//! (its cores, or the knee's total); workers sharing a host share it.
//!
//! Every `every` reports the manager re-plans (applied by each worker at its next iteration
//! boundary): every worker starts at one thread; then one more goes to the worker whose
//! projected iteration time `m / speed_i(p_i)` is the longest, as long as its host has a
//! thread left in its budget, it is below its knee and the extra thread is predicted to
//! shorten its iteration, and it is a persistent straggler (or already holds extra threads);
//! when the slowest cannot be helped the plan stops (more threads for a faster worker would
//! not shorten a synchronous iteration). Persistent stragglers thus get threads; pioneers
//! keep one, which leaves the cores to the stragglers. The projection sees each iteration's
//! one-thread equivalent (compute time × threads), so it classes machines: a straggler
//! given threads stays classed a straggler and keeps them. With `enabled` off the thread
//! counts never change (the mechanism is switched off alone, so its share of a gain is
//! measurable).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::sync::projection::{Class, Projection, ProjectionConfig, Verdict};

/// The manager's knobs.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// Workers.
    pub workers: u32,
    /// Host of each worker (workers with the same value share a budget).
    pub hosts: Vec<u32>,
    /// Threads each host can run at once.
    pub budget: usize,
    /// The over-subscription knee: the most threads one worker may get.
    pub knee: usize,
    /// Tasks per iteration.
    pub tasks: u32,
    /// Re-plan after this many reports.
    pub every: u64,
    /// Change thread counts at all.
    pub enabled: bool,
    /// Initial threads per worker.
    pub initial: usize,
}

impl ManagerConfig {
    /// Every worker on one host of `budget` threads.
    pub fn one_host(workers: u32, budget: usize, knee: usize, tasks: u32) -> ManagerConfig {
        ManagerConfig {
            workers,
            hosts: vec![0; workers as usize],
            budget: budget.max(1),
            knee: knee.max(1),
            tasks: tasks.max(1),
            every: 4,
            enabled: true,
            initial: 1,
        }
    }
}

/// The state behind the lock.
#[derive(Debug)]
struct State {
    projection: Projection,
    /// Per worker, per thread count: EWMA of tasks per second.
    speed: Vec<BTreeMap<usize, f64>>,
    threads: Vec<usize>,
    reports: u64,
    plans: u64,
    clock: u64,
}

/// The supervisor and parallelism manager, shared by the workers of a job (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct Manager {
    cfg: ManagerConfig,
    state: Mutex<State>,
}

const EWMA: f64 = 0.5;

impl Manager {
    /// A manager for `cfg.workers` workers, each starting at `cfg.initial` threads.
    pub fn new(cfg: ManagerConfig) -> Manager {
        let n = cfg.workers as usize;
        let initial = cfg.initial.clamp(1, cfg.knee.max(1));
        Manager {
            state: Mutex::new(State {
                projection: Projection::new(cfg.workers, ProjectionConfig::default()),
                speed: vec![BTreeMap::new(); n],
                threads: vec![initial; n],
                reports: 0,
                plans: 0,
                clock: 0,
            }),
            cfg,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The thread count `worker` should use for its next iteration.
    pub fn threads(&self, worker: u32) -> usize {
        self.lock()
            .threads
            .get(worker as usize)
            .copied()
            .unwrap_or(1)
    }

    /// Every worker's thread count now.
    pub fn all_threads(&self) -> Vec<usize> {
        self.lock().threads.clone()
    }

    /// How many times the manager re-planned.
    pub fn plans(&self) -> u64 {
        self.lock().plans
    }

    /// `worker` computed `tasks` tasks in `compute` with `threads` threads (its iteration
    /// just ended). Unknown workers are ignored.
    pub fn report(&self, worker: u32, threads: usize, tasks: u32, compute: Duration) {
        let w = worker as usize;
        let mut s = self.lock();
        if w >= s.threads.len() || tasks == 0 {
            return;
        }
        // The projection wants start and end times: compute time on a private clock.
        let start = s.clock;
        s.clock = s.clock.saturating_add(1_000_000_000_000);
        // The projection classes machines, not thread counts: it sees the one-thread
        // equivalent of the iteration (a straggler given a second thread stays a straggler).
        let nanos = compute
            .as_nanos()
            .saturating_mul(threads.max(1) as u128)
            .min(u128::from(u64::MAX / 4)) as u64;
        s.projection.start(worker, start);
        s.projection.finish(worker, start.saturating_add(nanos));
        let rate = f64::from(tasks) / compute.as_secs_f64().max(1e-9);
        let e = s.speed[w].entry(threads.max(1)).or_insert(rate);
        *e = EWMA * rate + (1.0 - EWMA) * *e;
        s.reports += 1;
        if self.cfg.enabled && s.reports.is_multiple_of(self.cfg.every.max(1)) {
            let plan = self.plan(&s);
            s.threads = plan;
            s.plans += 1;
        }
    }

    /// The supervisor's verdict (straggler projection).
    pub fn verdict(&self) -> Verdict {
        self.lock().projection.verdict()
    }

    /// `worker`'s class.
    pub fn class(&self, worker: u32) -> Class {
        self.lock().projection.class(worker)
    }

    /// `speed_i(p)` in tasks per second, estimated (None before any observation).
    pub fn speed(&self, worker: u32, threads: usize) -> Option<f64> {
        let s = self.lock();
        Self::estimate(s.speed.get(worker as usize)?, threads, self.cfg.knee)
    }

    fn estimate(obs: &BTreeMap<usize, f64>, p: usize, knee: usize) -> Option<f64> {
        let p = p.clamp(1, knee.max(1));
        if let Some(v) = obs.get(&p) {
            return Some(*v);
        }
        // The nearest observation below scales linearly up to p; above, no gain.
        if let Some((&q, &v)) = obs.range(..p).next_back() {
            return Some(v * p as f64 / q as f64);
        }
        obs.range(p..).next().map(|(_, &v)| v)
    }

    /// A new thread plan (see the [module docs](self)).
    fn plan(&self, s: &State) -> Vec<usize> {
        let n = s.threads.len();
        let mut threads = vec![1usize; n];
        let mut used: BTreeMap<u32, usize> = BTreeMap::new();
        for w in 0..n {
            *used
                .entry(self.cfg.hosts.get(w).copied().unwrap_or(0))
                .or_default() += 1;
        }
        let m = f64::from(self.cfg.tasks);
        let time = |w: usize, p: usize| {
            Self::estimate(&s.speed[w], p, self.cfg.knee).map(|v| m / v.max(1e-12))
        };
        loop {
            // The slowest projected worker sets the pace: it gets the next thread if its host
            // has one left, it is below its knee and the thread is predicted to help. If not,
            // nobody does (a thread for a faster worker would not shorten the iteration).
            let slowest = (0..n)
                .filter_map(|w| Some((time(w, threads[w])?, w)))
                .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((now, w)) = slowest else { break };
            // Only a persistent straggler (or a worker already holding extra threads) is
            // helped: a pioneer that looks slowest for a moment (a noisy host) is not.
            let eligible = s.threads[w] > 1 || s.projection.class(w as u32) == Class::Persistent;
            let host = self.cfg.hosts.get(w).copied().unwrap_or(0);
            let room = used.get(&host).copied().unwrap_or(0) < self.cfg.budget;
            let helps = time(w, threads[w] + 1).is_some_and(|next| next < now * 0.98);
            if !(eligible && room && threads[w] < self.cfg.knee && helps) {
                break;
            }
            threads[w] += 1;
            *used
                .entry(self.cfg.hosts.get(w).copied().unwrap_or(0))
                .or_default() += 1;
        }
        // Workers never observed keep what they have.
        for ((t, obs), &old) in threads.iter_mut().zip(&s.speed).zip(&s.threads) {
            if obs.is_empty() {
                *t = old;
            }
        }
        threads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn the_slow_worker_gets_the_spare_threads_up_to_the_knee() {
        // Two workers on one 6-thread host; worker 1 is 3× slower per thread.
        let m = Manager::new(ManagerConfig {
            every: 1,
            ..ManagerConfig::one_host(2, 6, 4, 8)
        });
        for _ in 0..4 {
            m.report(0, 1, 8, ms(80));
            m.report(1, 1, 8, ms(240));
        }
        let t = m.all_threads();
        assert!(t[1] > t[0], "{t:?}");
        assert!(
            t.iter().all(|&p| p <= 4) && t.iter().sum::<usize>() <= 6,
            "{t:?}"
        );
        assert!(m.plans() > 0);
        assert_eq!(m.class(1), Class::Persistent);
    }

    #[test]
    fn a_pioneer_slow_for_a_moment_gets_no_thread() {
        // Three machines of two threads each; worker 0 has one slow iteration (a noisy host)
        // while it is the slowest known.
        let m = Manager::new(ManagerConfig {
            every: 1,
            hosts: vec![0, 1, 2],
            ..ManagerConfig::one_host(3, 2, 2, 8)
        });
        for _ in 0..4 {
            m.report(0, 1, 8, ms(100));
            m.report(1, 1, 8, ms(100));
        }
        m.report(0, 1, 8, ms(1000));
        m.report(1, 1, 8, ms(100));
        assert_eq!(m.all_threads(), vec![1, 1, 1]);
        // A persistent straggler gets a thread and keeps it, though it then computes faster.
        for _ in 0..6 {
            m.report(0, 1, 8, ms(100));
            m.report(1, 1, 8, ms(100));
            let p = m.threads(2);
            m.report(2, p, 8, ms(400 / p as u64));
        }
        assert_eq!(m.all_threads(), vec![1, 1, 2]);
        assert_eq!(m.class(2), Class::Persistent);
    }

    #[test]
    fn no_threads_past_the_budget_or_without_gain() {
        let m = Manager::new(ManagerConfig {
            every: 1,
            ..ManagerConfig::one_host(3, 3, 8, 8)
        });
        for w in 0..3 {
            m.report(w, 1, 8, ms(100));
        }
        // Budget 3 for 3 workers: one each.
        assert_eq!(m.all_threads(), vec![1, 1, 1]);
        // A worker observed not to speed up with 2 threads gets no third.
        let m = Manager::new(ManagerConfig {
            every: 1,
            ..ManagerConfig::one_host(1, 8, 8, 8)
        });
        m.report(0, 1, 8, ms(100));
        m.report(0, 2, 8, ms(100));
        assert!(m.threads(0) <= 2, "{:?}", m.all_threads());
    }

    #[test]
    fn switched_off_it_never_changes_anything() {
        let m = Manager::new(ManagerConfig {
            enabled: false,
            every: 1,
            initial: 2,
            ..ManagerConfig::one_host(2, 8, 4, 8)
        });
        for _ in 0..8 {
            m.report(0, 2, 8, ms(10));
            m.report(1, 2, 8, ms(90));
        }
        assert_eq!(m.all_threads(), vec![2, 2]);
        assert_eq!(m.plans(), 0);
        // Unknown workers are ignored.
        m.report(7, 1, 8, ms(1));
        assert_eq!(m.threads(7), 1);
    }

    #[test]
    fn speed_estimates_scale_below_and_stay_flat_above() {
        let m = Manager::new(ManagerConfig::one_host(1, 8, 4, 8));
        assert_eq!(m.speed(0, 1), None);
        m.report(0, 2, 8, ms(100)); // 80 tasks/s at 2 threads
        assert!((m.speed(0, 2).unwrap() - 80.0).abs() < 1e-6);
        assert!((m.speed(0, 4).unwrap() - 160.0).abs() < 1e-6);
        assert!((m.speed(0, 1).unwrap() - 80.0).abs() < 1e-6);
        // Past the knee: as at the knee.
        assert_eq!(m.speed(0, 9), m.speed(0, 4));
    }
}
