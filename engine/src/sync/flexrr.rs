//! FlexRR (Harlap et al., SoCC 2016): a small staleness slack plus reassignment of a slow
//! worker's unprocessed work to a faster helper. The full text was not retrieved; the
//! mechanism below follows a secondary description of the paper and is
//! labelled as our reading where it had to be filled in.
//!
//! - **Temporal slack**: the SSP bound `s` (default 1): a pull at clock `c` is released once
//!   every live worker has `≥ c − s` gradients applied, so helpers finish their own iteration
//!   early and can help before the bound stops them.
//! - **Helper groups**: workers are wired into groups of `group` consecutive ranks (0: one
//!   group of everyone); a worker helps only workers of its group (peer to peer in FlexRR, no
//!   central manager).
//! - **Reassignment**: FlexRR workers report progress at checkpoints within an iteration and a
//!   helper offers help to a helpee behind by more than a threshold. The policy sees
//!   iterations (pushes), not checkpoints, so the threshold `theta` is in iterations (our
//!   reading): after each push of worker `h`, and when `h`'s pull is parked, `h` is offered
//!   the work of the group member `j` with the most work left: furthest behind (smallest
//!   applied count); on ties the one whose current iteration started latest (its latest push
//!   is the newest, so the least of its iteration is done; a rejoin starts an iteration), then
//!   the lowest rank) if `applied[h] − applied[j] ≥ theta`: [`Action::Transfer`]`{ helper: h, straggler:
//!   j, clock: applied[j] }`. A helper is offered one helpee iteration once (no repeat offer
//!   for the same `(j, clock)`). The task side hands over the tail of `j`'s unprocessed items,
//!   the helper pushes their gradient credited to `j`'s clock, `j` skips them.
//!
//! The difference from EPSP's transfer ([`super::Epsp`]): FlexRR helps whoever is behind
//! within a group as soon as a helper is `theta` ahead, under a fixed slack; EPSP offers only
//! to a pioneer that would block, takes from the straggler with the most remaining work
//! job-wide, and switches its bound from the straggler projection.
//!
//! Fast path `Within(s)`: offers are decided on pushes and parked pulls, both of which reach
//! the policy. Events about unknown workers are ignored.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use super::{Action, Clocks, Event, FastPath, Nanos, Parked, SyncPolicy, Worker};

/// FlexRR for one shard (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct FlexRr {
    s: u64,
    theta: u64,
    group: u32,
    clocks: Clocks,
    parked: Parked,
    /// Per helper, the last helpee iteration it was offered.
    offered: Vec<Option<(Worker, u64)>>,
    /// Per worker, when its current iteration started: its latest counted push, or its rejoin.
    last_push: Vec<Nanos>,
    /// Per helper group, its live members in helpee order: furthest behind, then the latest
    /// iteration start, then the lowest rank. An offer reads the first two: `O(log workers)`.
    helpees: Vec<BTreeSet<(u64, Reverse<Nanos>, Worker)>>,
    transfers: u64,
}

impl FlexRr {
    /// FlexRR for `workers` workers with slack `s`, help threshold `theta` iterations (≥ 1)
    /// and helper groups of `group` ranks (0: everyone).
    pub fn new(workers: u32, s: u64, theta: u64, group: u32) -> FlexRr {
        let groups = if group == 0 {
            1
        } else {
            workers.div_ceil(group).max(1)
        };
        let mut helpees = vec![BTreeSet::new(); groups as usize];
        for w in 0..workers {
            let g = w.checked_div(group).unwrap_or(0);
            helpees[g as usize].insert((0, Reverse(0), w));
        }
        FlexRr {
            s,
            theta: theta.max(1),
            group,
            clocks: Clocks::new(workers),
            parked: Parked::default(),
            offered: vec![None; workers as usize],
            last_push: vec![0; workers as usize],
            helpees,
            transfers: 0,
        }
    }

    fn group_of(&self, w: Worker) -> usize {
        // Group 0: everyone is in one group.
        w.checked_div(self.group).unwrap_or(0) as usize
    }

    /// `w`'s place in its group's helpee order, while it is live.
    fn key(&self, w: Worker) -> Option<(u64, Reverse<Nanos>, Worker)> {
        let applied = self.clocks.applied(w)?;
        self.clocks
            .is_live(w)
            .then(|| (applied, Reverse(self.last_push[w as usize]), w))
    }

    fn offer(&mut self, helper: Worker, out: &mut Vec<Action>) {
        let h = helper as usize;
        if h >= self.offered.len() || !self.clocks.is_live(helper) {
            return;
        }
        let mine = self.clocks.applied[h];
        let Some(&(theirs, _, j)) = self.helpees[self.group_of(helper)]
            .iter()
            .take(2)
            .find(|&&(_, _, j)| j != helper)
        else {
            return;
        };
        if mine.saturating_sub(theirs) < self.theta || self.offered[h] == Some((j, theirs)) {
            return;
        }
        self.offered[h] = Some((j, theirs));
        self.transfers += 1;
        out.push(Action::Transfer {
            helper,
            straggler: j,
            clock: theirs,
        });
    }

    /// The policy's answer to a known worker's event.
    fn handle(&mut self, ev: Event, out: &mut Vec<Action>) {
        match ev {
            Event::Pull {
                worker, clock, req, ..
            } => {
                let min = self.clocks.min_live();
                if self.parked.judge(min, self.s, (worker, clock, req), out) {
                    self.offer(worker, out);
                }
            }
            Event::Push { worker, at, .. } => {
                if let Some(t) = self.last_push.get_mut(worker as usize) {
                    *t = (*t).max(at);
                }
                self.release_ready(out);
                self.offer(worker, out);
            }
            Event::Join { worker, at, .. } => {
                // A rejoined worker starts a fresh iteration now: its last push before it left
                // says nothing about how much of its current iteration is done.
                if let Some(t) = self.last_push.get_mut(worker as usize) {
                    *t = at;
                }
                self.release_ready(out);
            }
            Event::Leave { .. } => self.release_ready(out),
            Event::Tick { .. } => {}
        }
    }

    fn release_ready(&mut self, out: &mut Vec<Action>) {
        self.parked
            .release_within(self.clocks.min_live(), self.s, |worker, req| {
                out.push(Action::Release { worker, req })
            });
    }
}

impl SyncPolicy for FlexRr {
    fn name(&self) -> String {
        format!(
            "flexrr({},theta={},group={})",
            self.s, self.theta, self.group
        )
    }

    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>) {
        // The event's worker leaves its group's helpee order and comes back with its new place.
        let moved = match ev {
            Event::Push { worker, .. }
            | Event::Leave { worker, .. }
            | Event::Join { worker, .. } => self.key(worker).map(|k| (worker, k)),
            _ => None,
        };
        if let Some((w, k)) = moved {
            let g = self.group_of(w);
            self.helpees[g].remove(&k);
        }
        let known = self.clocks.observe(&ev);
        if known {
            self.handle(ev, out);
        }
        if let Event::Push { worker: w, .. }
        | Event::Leave { worker: w, .. }
        | Event::Join { worker: w, .. } = ev
            && let Some(k) = self.key(w)
        {
            let g = self.group_of(w);
            self.helpees[g].insert(k);
        }
    }

    fn fast_path(&self) -> FastPath {
        FastPath::Within(self.s)
    }

    fn parked(&self) -> usize {
        self.parked.len()
    }

    fn delayed_total(&self) -> u64 {
        self.parked.delayed
    }

    fn transfers(&self) -> u64 {
        self.transfers
    }
}
