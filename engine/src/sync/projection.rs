//! Straggler projection: Falcon's supervisor view of who straggles and how (**our design**;
//! Falcon's full text is not public; see `docs/architecture.md`, "EPSP").
//!
//! Falcon's preview figure projects each worker's straggling episodes onto the iteration axis:
//! stragglers on different workers in different iterations slow every iteration, overlapping
//! ones cost only the largest delay. This module keeps what that needs, sans-IO:
//!
//! - per worker, the **compute time** of its recent iterations (a sliding window of `window`
//!   samples). The caller marks when an iteration starts ([`Projection::start`]: the release of
//!   its pull, or its previous push if it did not wait) and when it ends
//!   ([`Projection::finish`]: the push); waiting at a barrier is not compute time, so under a
//!   barrier a pioneer still looks fast;
//! - the **reference**: the fastest live worker's typical iteration time, the smallest median
//!   over live workers' windows;
//! - per sample, its **delay over the fastest**, `sample − reference`. A sample *straggles* when
//!   it exceeds `(1 + theta) × reference`.
//!
//! The **verdict** classes each live worker:
//!
//! - [`Class::Persistent`]: at least `persistent` (a fraction) of its window straggles and the
//!   window holds at least `min_samples` samples: a slow machine (Falcon's "ratio" straggler);
//! - [`Class::Transient`]: some samples of its window straggle, fewer than that: episodes;
//! - [`Class::Pioneer`]: none straggles;
//! - [`Class::Unknown`]: fewer than `min_samples` samples yet.
//!
//! It also predicts each worker's next iteration time (the median of its window: episodes do
//! not move a median much, a persistent slow-down does) and the **spread**, the slowest
//! prediction over the fastest, which EPSP turns into its slack bound.
//!
//! Deterministic: no clock reads; `Nanos` come from the caller (wall clock or simulated).
//! Cost: a sample is `O(window log window)` (its median is kept up to date); a verdict is
//! `O(workers × window)`.

use std::collections::{BTreeSet, VecDeque};

use super::{Nanos, Worker};

/// How a worker is classed by the projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Not enough samples yet.
    Unknown,
    /// None of its recent iterations straggled.
    Pioneer,
    /// Some of its recent iterations straggled (episodes).
    Transient,
    /// Most of its recent iterations straggled (a slow machine).
    Persistent,
}

/// Knobs of the projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProjectionConfig {
    /// Samples kept per worker.
    pub window: usize,
    /// A sample straggles when it exceeds `(1 + theta) ×` the reference.
    pub theta: f64,
    /// The fraction of a window that must straggle for a persistent straggler.
    pub persistent: f64,
    /// Samples needed before a worker is classed.
    pub min_samples: usize,
}

impl Default for ProjectionConfig {
    fn default() -> Self {
        ProjectionConfig {
            window: 8,
            theta: 0.3,
            persistent: 0.5,
            min_samples: 3,
        }
    }
}

/// The projection's verdict on the live workers.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Per worker (by rank), its class; departed workers are `Unknown`.
    pub classes: Vec<Class>,
    /// The slowest predicted iteration time over the fastest (`1.0` when unknown).
    pub spread: f64,
}

impl Verdict {
    /// True if some live worker is a persistent straggler.
    pub fn any_persistent(&self) -> bool {
        self.classes.contains(&Class::Persistent)
    }

    /// The workers of a class.
    pub fn of(&self, class: Class) -> Vec<Worker> {
        self.classes
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == class)
            .map(|(w, _)| w as Worker)
            .collect()
    }
}

/// The straggler projection over `workers` workers (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Projection {
    cfg: ProjectionConfig,
    samples: Vec<VecDeque<Nanos>>,
    /// The median of each window, kept up to date on every sample.
    medians: Vec<Option<Nanos>>,
    started: Vec<Option<Nanos>>,
    live: Vec<bool>,
    /// Straggling samples seen, per worker, ever.
    episodes: Vec<u64>,
    /// The live workers with a median, by (median, rank): the reference and the spread
    /// without a pass over the job.
    by_median: BTreeSet<(Nanos, Worker)>,
}

fn median(v: &VecDeque<Nanos>) -> Option<Nanos> {
    if v.is_empty() {
        return None;
    }
    // On the stack for the usual windows: a median per push allocates nothing.
    let mut small = [0 as Nanos; 32];
    let mut big = Vec::new();
    let s: &mut [Nanos] = if v.len() <= small.len() {
        for (d, x) in small.iter_mut().zip(v) {
            *d = *x;
        }
        &mut small[..v.len()]
    } else {
        big.extend(v.iter().copied());
        &mut big
    };
    let mid = s.len() / 2;
    Some(*s.select_nth_unstable(mid).1)
}

impl Projection {
    /// A projection over `workers` workers.
    pub fn new(workers: u32, cfg: ProjectionConfig) -> Projection {
        let n = workers as usize;
        let cfg = ProjectionConfig {
            window: cfg.window.max(1),
            min_samples: cfg.min_samples.clamp(1, cfg.window.max(1)),
            ..cfg
        };
        Projection {
            cfg,
            samples: vec![VecDeque::new(); n],
            medians: vec![None; n],
            started: vec![None; n],
            live: vec![true; n],
            episodes: vec![0; n],
            by_median: BTreeSet::new(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &ProjectionConfig {
        &self.cfg
    }

    /// `worker` starts an iteration at `at` (unknown workers are ignored).
    pub fn start(&mut self, worker: Worker, at: Nanos) {
        if let Some(s) = self.started.get_mut(worker as usize) {
            *s = Some(at);
        }
    }

    /// `worker` finished an iteration at `at`: one sample if its start is known. The next
    /// iteration starts at `at` unless [`Projection::start`] says later.
    pub fn finish(&mut self, worker: Worker, at: Nanos) {
        let w = worker as usize;
        let Some(start) = self.started.get(w).copied() else {
            return;
        };
        if let Some(start) = start {
            let sample = at.saturating_sub(start);
            let reference = self.reference();
            if reference.is_some_and(|r| self.straggles(sample, r)) {
                self.episodes[w] += 1;
            }
            let v = &mut self.samples[w];
            v.push_back(sample);
            while v.len() > self.cfg.window {
                v.pop_front();
            }
            let m = median(v);
            self.set_median(w, m);
        }
        self.started[w] = Some(at);
    }

    /// Sets `w`'s median, keeping the order of the live medians.
    fn set_median(&mut self, w: usize, m: Option<Nanos>) {
        if let Some(old) = self.medians[w] {
            self.by_median.remove(&(old, w as Worker));
        }
        self.medians[w] = m;
        if let (Some(m), true) = (m, self.live[w]) {
            self.by_median.insert((m, w as Worker));
        }
    }

    /// `worker` left: it is no longer classed nor the reference.
    pub fn leave(&mut self, worker: Worker) {
        let w = worker as usize;
        if w < self.live.len() {
            if let Some(m) = self.medians[w] {
                self.by_median.remove(&(m, worker));
            }
            self.live[w] = false;
        }
    }

    /// `worker` (re)joined: its history is forgotten.
    pub fn join(&mut self, worker: Worker) {
        let w = worker as usize;
        if w < self.live.len() {
            self.live[w] = true;
            self.samples[w].clear();
            self.set_median(w, None);
            self.started[w] = None;
        }
    }

    fn straggles(&self, sample: Nanos, reference: Nanos) -> bool {
        sample as f64 > (1.0 + self.cfg.theta) * reference as f64
    }

    /// The fastest live worker's typical iteration time (smallest median), if any is known.
    pub fn reference(&self) -> Option<Nanos> {
        self.by_median.first().map(|&(m, _)| m)
    }

    /// `worker`'s predicted next iteration time (the median of its window).
    pub fn predicted(&self, worker: Worker) -> Option<Nanos> {
        self.medians.get(worker as usize).copied().flatten()
    }

    /// When `worker`'s current iteration started, as far as the projection knows.
    pub fn started(&self, worker: Worker) -> Option<Nanos> {
        self.started.get(worker as usize).copied().flatten()
    }

    /// Straggling samples `worker` ever had (its episodes, projected on the iteration axis).
    pub fn episodes(&self, worker: Worker) -> u64 {
        self.episodes.get(worker as usize).copied().unwrap_or(0)
    }

    /// `worker`'s class now.
    pub fn class(&self, worker: Worker) -> Class {
        match self.reference() {
            Some(r) => self.class_against(worker, r),
            None => Class::Unknown,
        }
    }

    /// `worker`'s class against a given reference (one reference per verdict: `O(window)`).
    fn class_against(&self, worker: Worker, reference: Nanos) -> Class {
        let w = worker as usize;
        if w >= self.samples.len() || !self.live[w] {
            return Class::Unknown;
        }
        let v = &self.samples[w];
        if v.len() < self.cfg.min_samples {
            return Class::Unknown;
        }
        let slow = v.iter().filter(|&&x| self.straggles(x, reference)).count();
        if slow == 0 {
            Class::Pioneer
        } else if slow as f64 >= self.cfg.persistent * v.len() as f64 {
            Class::Persistent
        } else {
            Class::Transient
        }
    }

    /// What EPSP's switch reads of a verdict, without classing every worker: whether any live
    /// worker is a persistent straggler (the pass stops at the first), and the spread.
    pub fn outlook(&self) -> (bool, f64) {
        let spread = self.spread();
        let Some(reference) = self.reference() else {
            return (false, spread);
        };
        // A sample straggles when sample > (1 + theta) × reference: for whole nanoseconds,
        // when it is above that bound's floor.
        let limit = ((1.0 + self.cfg.theta) * reference as f64).floor();
        let limit = if limit >= u64::MAX as f64 {
            u64::MAX
        } else {
            limit.max(0.0) as u64
        };
        let any = (0..self.samples.len()).any(|w| {
            let v = &self.samples[w];
            self.live[w] && v.len() >= self.cfg.min_samples && {
                let slow = v.iter().filter(|&&x| x > limit).count();
                slow > 0 && slow as f64 >= self.cfg.persistent * v.len() as f64
            }
        });
        (any, spread)
    }

    /// How many live workers are persistent stragglers now (one pass over the windows).
    pub fn persistent_count(&self) -> usize {
        self.persistent_count_from(0.0)
    }

    /// How many live workers are persistent stragglers against the median at `quantile` of the
    /// live workers' medians instead of the smallest (`0.0`: [`Projection::persistent_count`];
    /// `0.25`: the fast group's typical time, which one unusually fast worker does not move,
    /// as long as fewer than three quarters of the workers are slow). One pass over the
    /// windows.
    pub fn persistent_count_from(&self, quantile: f64) -> usize {
        let known = self.by_median.len();
        let k = (quantile.clamp(0.0, 1.0) * known.saturating_sub(1) as f64) as usize;
        let Some(&(reference, _)) = self.by_median.iter().nth(k) else {
            return 0;
        };
        (0..self.samples.len())
            .filter(|&w| self.class_against(w as Worker, reference) == Class::Persistent)
            .count()
    }

    fn spread(&self) -> f64 {
        match (self.by_median.first(), self.by_median.last()) {
            (Some(&(lo, _)), Some(&(hi, _))) if lo > 0 => hi as f64 / lo as f64,
            _ => 1.0,
        }
    }

    /// The verdict on every worker.
    pub fn verdict(&self) -> Verdict {
        let n = self.samples.len();
        let classes = match self.reference() {
            Some(r) => (0..n).map(|w| self.class_against(w as Worker, r)).collect(),
            None => vec![Class::Unknown; n],
        };
        Verdict {
            classes,
            spread: self.spread(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(p: &mut Projection, w: Worker, durations: &[Nanos]) {
        let mut t = p.started(w).unwrap_or(0);
        p.start(w, t);
        for d in durations {
            t += d;
            p.finish(w, t);
        }
    }

    #[test]
    fn classes_pioneers_transient_and_persistent_stragglers() {
        let mut p = Projection::new(3, ProjectionConfig::default());
        feed(&mut p, 0, &[100; 8]);
        // One episode in eight: transient.
        feed(&mut p, 1, &[100, 100, 500, 100, 100, 100, 100, 100]);
        // Every iteration 2.5× slower: persistent.
        feed(&mut p, 2, &[250; 8]);
        let v = p.verdict();
        assert_eq!(
            v.classes,
            vec![Class::Pioneer, Class::Transient, Class::Persistent]
        );
        assert!(v.any_persistent());
        assert!((v.spread - 2.5).abs() < 1e-9);
        assert_eq!(p.outlook(), (true, v.spread));
        assert_eq!(p.predicted(1), Some(100));
        assert_eq!(v.of(Class::Pioneer), vec![0]);
    }

    /// One unusually fast worker makes the whole fast group look slow against the fastest
    /// median; against the lower quartile only the slow machines are persistent stragglers.
    #[test]
    fn the_lower_quartile_is_not_moved_by_one_fast_outlier() {
        let mut p = Projection::new(8, ProjectionConfig::default());
        feed(&mut p, 0, &[70; 8]);
        for w in 1..6 {
            feed(&mut p, w, &[100; 8]);
        }
        feed(&mut p, 6, &[250; 8]);
        feed(&mut p, 7, &[250; 8]);
        assert_eq!(p.persistent_count(), 7, "against 70: everyone but worker 0");
        assert_eq!(p.persistent_count_from(0.0), 7);
        assert_eq!(
            p.persistent_count_from(0.25),
            2,
            "against 100: workers 6 and 7"
        );
        // Nothing known yet: none.
        assert_eq!(
            Projection::new(4, ProjectionConfig::default()).persistent_count_from(0.25),
            0
        );
    }

    #[test]
    fn unknown_until_enough_samples_and_departed_workers_do_not_count() {
        let mut p = Projection::new(2, ProjectionConfig::default());
        feed(&mut p, 0, &[100, 100]);
        feed(&mut p, 1, &[400, 400]);
        assert_eq!(p.class(0), Class::Unknown);
        feed(&mut p, 0, &[100]);
        feed(&mut p, 1, &[400]);
        assert_eq!(p.class(1), Class::Persistent);
        // The fast worker leaves: the slow one is now the reference, not a straggler.
        p.leave(0);
        assert_eq!(p.class(1), Class::Pioneer);
        assert_eq!(p.class(0), Class::Unknown);
        p.join(0);
        assert_eq!(p.predicted(0), None);
        // Unknown workers are ignored.
        p.finish(9, 5);
        p.start(9, 5);
        assert_eq!(p.class(9), Class::Unknown);
    }

    #[test]
    fn waiting_is_not_compute_time() {
        let mut p = Projection::new(1, ProjectionConfig::default());
        p.start(0, 0);
        p.finish(0, 100);
        // Waited at a barrier from 100 to 1000, then computed for 100.
        p.start(0, 1000);
        p.finish(0, 1100);
        assert_eq!(p.predicted(0), Some(100));
    }
}
