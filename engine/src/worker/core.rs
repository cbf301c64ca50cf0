//! The worker's sans-IO core: everything a worker knows about its requests and its job, as
//! one state machine, like the servers' shard core (`crate::shard`) and the scheduler's
//! membership (`crate::membership`).
//!
//! It owns the request tracker (every push, pull, barrier and steal a caller waits on, with
//! what to send again after a reconnection), each shard's clocks and counters, ElasticBSP's
//! gate, the task-transfer offers, the grants made on each link, the row plans and answers,
//! the dead workers and the counters. It holds no link and reads no clock: the driver
//! (`super::Inner`) feeds it API calls, answers, link changes and the time, and carries out
//! what it returns — [`Action`]s: wake a waiter, widen values that landed, send the
//! superstep report. A waiter is never woken, and nothing is sent, while the core's lock is
//! held (see [`super::Inner::drive`]).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use falcon_transport::{LinkId, Region, RemoteKey};

use super::gate::{Gate, Step};
use super::tracker::{Reply, Request, Signal, Tracker};
use super::{ForgeSource, RowPlan, WorkerStats};
use crate::error::{Error, Result};
use crate::proto::{AckOf, Msg, PushKind};

/// A push as it must be written again (after a reconnection).
#[derive(Clone)]
pub(super) struct PushRecord {
    /// The values (`None`: the slot as it is, a bare repeat).
    pub(super) grad: Option<Region>,
    /// `Some(n)`: `grad` holds this shard's part alone, `n` bytes from its start (a row push,
    /// or its dense fallback); `None`: `grad` is the whole tensor.
    pub(super) own: Option<u64>,
    pub(super) kind: PushKind,
    pub(super) seq: u64,
    /// Transferred tasks: the straggler and iteration they were taken from.
    pub(super) help_for: Option<(u32, u64)>,
    /// The rates asked for when it was made ([`crate::Worker::set_rates`]).
    pub(super) rates: Option<crate::update::Rates>,
}

/// What a tracked request keeps so that it can be sent again on a new link.
#[derive(Clone)]
pub(super) enum Resend {
    /// A push into the slot of shard `shard` (an index into `Inner::shards`).
    Push { shard: usize, rec: PushRecord },
    /// A slow-path pull of shard `shard` (an index into `Inner::shards`) into `out`.
    Pull {
        shard: usize,
        out: Region,
        clock: u64,
    },
    /// A pull of some ranges of shard `shard` (an index into `Inner::shards`): its encoded
    /// message, which is the same on any link.
    PullRows { shard: usize, msg: Arc<Vec<u8>> },
    /// Nothing: the scheduler answers it, and a scheduler link is never replaced.
    Nothing,
}

impl Resend {
    /// The order requests go out again in: pushes before pulls, each by shard.
    pub(super) fn order(&self) -> (u8, usize) {
        match self {
            Resend::Push { shard, .. } => (0, *shard),
            Resend::Pull { shard, .. } | Resend::PullRows { shard, .. } => (1, *shard),
            Resend::Nothing => (2, 0),
        }
    }
}

/// How a worker gives tasks away: called with (iteration, most tasks wanted), returns the
/// range of task indices now the helper's (empty: none).
pub type StealHook = Arc<dyn Fn(u64, u32) -> Range<u32> + Send + Sync>;

/// A task-transfer offer (EPSP, FlexRR): this worker may take unprocessed tasks of
/// `straggler`'s iteration `clock`. The task side (the trainer) asks for the tasks and pushes
/// their gradient credited to the straggler; the offer may find none left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Offer {
    /// The worker behind.
    pub straggler: u32,
    /// Its iteration.
    pub clock: u64,
}

/// The offers received.
#[derive(Default)]
pub(super) struct Offers {
    /// Not yet taken by the embedder, oldest first.
    queue: VecDeque<Offer>,
    /// Every offer received (so the same one from several shards is kept once).
    seen: HashSet<Offer>,
}

impl Offers {
    /// Adds `offer` unless it was received before; whether it is new.
    pub(super) fn add(&mut self, offer: Offer) -> bool {
        let fresh = self.seen.insert(offer);
        if fresh {
            self.queue.push_back(offer);
        }
        fresh
    }

    /// Takes the offers not yet taken, oldest first.
    pub(super) fn take(&mut self) -> Vec<Offer> {
        self.queue.drain(..).collect()
    }
}

/// What the driver must do for the core.
pub(super) enum Action {
    /// Give a waiter its outcome.
    Wake(Arc<Signal>, Result<Reply>),
    /// Shard `shard`'s values landed in `out` as the server wrote them: widen them where the
    /// wire is narrower than f32, then wake the waiter (with the widening's error, if any).
    Widen {
        /// An index into the worker's shards.
        shard: usize,
        /// Where they landed.
        out: Region,
        /// The pull's waiter.
        sig: Arc<Signal>,
    },
    /// Send this to the scheduler (ElasticBSP's superstep report); if it cannot go, tell the
    /// core ([`Core::report_failed`]).
    Report(Msg),
}

/// One shard's clocks and counters, as this worker keeps them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ShardClock {
    /// Gradients pushed so far (the next push's clock).
    pub(super) pushes: u64,
    /// The highest sequence numbers the server acknowledged: gradients (and row pushes),
    /// then transferred-task gradients. A reattaching worker reports them.
    pub(super) acked: [u64; 2],
    /// The version of the values last pulled (u64::MAX: pulled through the server, which
    /// remembers what it sent); sent with each push so the server knows its staleness.
    pub(super) pulled_version: u64,
    /// Transferred tasks' gradients pushed (the next one's sequence number is this plus one).
    pub(super) helps: u64,
    /// The tensor the shard is part of.
    tensor: u32,
}

/// Where a gradient region read in place stands on a link.
pub(super) enum SourceGrant {
    /// Granted already: its key there.
    Granted(RemoteKey),
    /// Not yet, and there is room for one more on the link.
    Room,
    /// The link holds as many as it may: the push goes into the slot.
    Full,
}

/// The worker's state machine (see the [module docs](self)).
pub(super) struct Core {
    requests: Tracker<Resend>,
    shards: Vec<ShardClock>,
    dead: BTreeSet<u32>,
    /// Row pulls answered and not yet taken by their caller: request id → the answer's
    /// message and where its values start in it.
    row_answers: HashMap<u32, (Vec<u8>, usize)>,
    /// Per tensor, the last row request's plan.
    row_plans: HashMap<usize, Arc<RowPlan>>,
    /// The keys of regions granted on each link, by (link, region).
    grants: HashMap<(LinkId, u64), RemoteKey>,
    /// Of those, the gradient regions granted for pushes read in place, per link.
    source_grants: HashMap<LinkId, usize>,
    /// The most of those per link.
    source_cap: usize,
    /// ElasticBSP's gate; None under every other policy.
    gate: Option<Gate>,
    offers: Offers,
    stats: WorkerStats,
    next_req: u32,
    /// The sequence number of the last barrier this worker entered.
    next_barrier: u64,
    /// The parallelism manager's latest advice (0: none yet).
    advised: u32,
    steal_hook: Option<StealHook>,
    forge_source: Option<ForgeSource>,
    /// Set once every request fails (a peer gone, the job over, this worker finished).
    broken: Option<Error>,
}

impl Core {
    /// A core for shards of the tensors `tensors` (one entry per shard, in the worker's
    /// order), at clock `start` (a rejoining worker's is the job's), with ElasticBSP's gate
    /// where `gate`, the first barrier's sequence number `first_barrier`, and at most
    /// `source_cap` gradient regions read in place per link.
    pub(super) fn new(
        tensors: &[u32],
        start: u64,
        gate: bool,
        first_barrier: u64,
        source_cap: usize,
    ) -> Core {
        Core {
            requests: Tracker::default(),
            shards: tensors
                .iter()
                .map(|&tensor| ShardClock {
                    pushes: start,
                    acked: [start, 0],
                    pulled_version: 0,
                    helps: 0,
                    tensor,
                })
                .collect(),
            dead: BTreeSet::new(),
            row_answers: HashMap::new(),
            row_plans: HashMap::new(),
            grants: HashMap::new(),
            source_grants: HashMap::new(),
            source_cap,
            gate: gate.then(Gate::new),
            offers: Offers::default(),
            stats: WorkerStats::default(),
            next_req: 1,
            next_barrier: first_barrier,
            advised: 0,
            steal_hook: None,
            forge_source: None,
            broken: None,
        }
    }

    // ----- requests -----

    /// Registers `req`, answered by `server` (`None`: the scheduler), going out on `sent_on`,
    /// at `now`; its waiter. Once every request fails (see [`Core::fail_all`]) the waiter is
    /// woken at once with that error.
    pub(super) fn register(
        &mut self,
        req: Request,
        server: Option<usize>,
        sent_on: Option<LinkId>,
        now: Instant,
        what: Resend,
        out: &mut Vec<Action>,
    ) -> Arc<Signal> {
        let sig = self.requests.register(req, server, sent_on, now, what);
        if let Some(e) = &self.broken {
            self.requests.take(req);
            out.push(Action::Wake(sig.clone(), Err(e.clone())));
        }
        sig
    }

    /// Withdraws `req` without waking its waiter (never sent, or given up on).
    pub(super) fn withdraw(&mut self, req: Request) {
        self.requests.take(req);
    }

    /// The waiter of the push that shard `shard`'s slot holds, while unacknowledged.
    pub(super) fn slot(&self, shard: u32) -> Option<Arc<Signal>> {
        self.requests.slot(shard)
    }

    /// What server `server` must be sent again on its link `link`: every request it answers
    /// that last went out on another link, pushes first, each kind by shard.
    pub(super) fn stale(&self, server: usize, link: LinkId) -> Vec<(Request, Arc<Signal>, Resend)> {
        let mut stale = self.requests.stale(server, link);
        stale.sort_by_key(|(_, _, what)| what.order());
        stale
    }

    /// `req` (still the request behind `sig`) went out again on `link`.
    pub(super) fn resent(&mut self, req: Request, sig: &Arc<Signal>, link: LinkId) {
        self.requests.resent(req, sig, link);
    }

    /// A fresh request id.
    pub(super) fn next_req(&mut self) -> u32 {
        let id = self.next_req;
        self.next_req = self.next_req.wrapping_add(1).max(1);
        id
    }

    /// The next barrier's sequence number.
    pub(super) fn next_barrier(&mut self) -> u64 {
        self.next_barrier += 1;
        self.next_barrier
    }

    // ----- answers -----

    /// Shard `shard` acknowledged a push (`staleness`: updates applied between the values the
    /// gradient was computed on and the gradient).
    pub(super) fn on_ack(&mut self, shard: u32, of: AckOf, staleness: u64, out: &mut Vec<Action>) {
        if let Some(t) = self.requests.take(Request::Ack { shard, of }) {
            // Counted before the caller goes on: a reattachment reports what was acknowledged.
            if let Resend::Push { shard, rec } = &t.what {
                let i = match rec.kind {
                    PushKind::Gradient | PushKind::Rows => Some(0),
                    PushKind::Help => Some(1),
                    PushKind::Init => None,
                };
                if let (Some(i), Some(c)) = (i, self.shards.get_mut(*shard)) {
                    c.acked[i] = c.acked[i].max(rec.seq);
                }
            }
            out.push(Action::Wake(t.sig, Ok(Reply::Done)));
        }
        if of != AckOf::Init {
            let st = &mut self.stats;
            st.staleness_sum += staleness;
            st.staleness_acks += 1;
            st.staleness_max = st.staleness_max.max(staleness);
        }
    }

    /// Pull `id`'s values landed (the server's write with the id as immediate).
    pub(super) fn on_pulled(&mut self, id: u32, now: Instant, out: &mut Vec<Action>) {
        let Some(p) = self.requests.take(Request::Pull(id)) else {
            return;
        };
        self.stats.pull_wait += now.saturating_duration_since(p.since);
        out.push(match p.what {
            Resend::Pull { shard, out, .. } => Action::Widen {
                shard,
                out,
                sig: p.sig,
            },
            _ => Action::Wake(p.sig, Ok(Reply::Done)),
        });
    }

    /// Row pull `id` was answered: its values are `answer`'s from byte `at` on, kept for the
    /// caller ([`Core::take_row_answer`]).
    pub(super) fn on_rows(
        &mut self,
        id: u32,
        answer: Vec<u8>,
        at: usize,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.requests.take(Request::Pull(id)) else {
            return;
        };
        self.stats.pull_wait += now.saturating_duration_since(p.since);
        self.row_answers.insert(id, (answer, at));
        out.push(Action::Wake(p.sig, Ok(Reply::Done)));
    }

    /// The values of row pull `id`, once answered (taken: asked twice, `None`).
    pub(super) fn take_row_answer(&mut self, id: u32) -> Option<(Vec<u8>, usize)> {
        self.row_answers.remove(&id)
    }

    /// The server could not serve pull `id`.
    pub(super) fn on_pull_failed(&mut self, id: u32, reason: String, out: &mut Vec<Action>) {
        if let Some(p) = self.requests.take(Request::Pull(id)) {
            let rank = p.server.map_or(0, |s| s as u32);
            out.push(Action::Wake(p.sig, Err(Error::Server { rank, reason })));
        }
    }

    /// The scheduler says barrier `seq` fell.
    pub(super) fn on_barrier_done(&mut self, seq: u64, out: &mut Vec<Action>) {
        if let Some(t) = self.requests.take(Request::Barrier(seq)) {
            out.push(Action::Wake(t.sig, Ok(Reply::Done)));
        }
    }

    /// `straggler` answered this worker's steal of its iteration `clock`.
    pub(super) fn on_tasks(
        &mut self,
        straggler: u32,
        clock: u64,
        tasks: Range<u32>,
        out: &mut Vec<Action>,
    ) {
        let tasks = tasks.start..tasks.end.max(tasks.start);
        if let Some(t) = self.requests.take(Request::Steal { straggler, clock }) {
            out.push(Action::Wake(t.sig, Ok(Reply::Tasks(tasks))));
        }
    }

    /// Fails with `err` every request answered by server `server` (`None`: every request):
    /// what a peer that is gone would have answered never comes.
    pub(super) fn fail(&mut self, server: Option<usize>, err: &Error, out: &mut Vec<Action>) {
        for t in self.requests.take_answered_by(server) {
            out.push(Action::Wake(t.sig, Err(err.clone())));
        }
    }

    /// Fails every waiter, and every later request and pull past the barrier, with `err`.
    pub(super) fn fail_all(&mut self, err: &Error, out: &mut Vec<Action>) {
        if self.broken.is_none() {
            self.broken = Some(err.clone());
        }
        self.fail(None, err, out);
        if let Some(sig) = self.gate.as_mut().and_then(|g| g.break_with(err)) {
            out.push(Action::Wake(sig, Err(err.clone())));
        }
    }

    // ----- the gate (ElasticBSP) -----

    /// Whether this worker has a gate (ElasticBSP).
    pub(super) fn gated(&self) -> bool {
        self.gate.is_some()
    }

    /// A pull at `clock`: `None` when it may go on, else the waiter to wait on before asking
    /// again (a superstep report goes out with the first).
    pub(super) fn gate_enter(
        &mut self,
        clock: u64,
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<Option<Arc<Signal>>> {
        let Some(g) = &mut self.gate else {
            return Ok(None);
        };
        Ok(match g.enter(clock, now)? {
            Step::Pass => None,
            Step::Wait(sig) => Some(sig),
            Step::Report(msg, sig) => {
                out.push(Action::Report(msg));
                Some(sig)
            }
        })
    }

    /// The first push of `clock` at `now` (an interval sample).
    pub(super) fn gate_sample(&mut self, clock: u64, now: Instant) {
        if let Some(g) = &mut self.gate {
            g.sample(clock, now);
        }
    }

    /// The scheduler's plan: the barrier moves to `until`.
    pub(super) fn on_plan(&mut self, until: u64, now: Instant, out: &mut Vec<Action>) {
        if let Some(g) = &mut self.gate
            && let Some((sig, waited)) = g.on_plan(until, now)
        {
            self.stats.supersteps += 1;
            self.stats.barrier_wait += waited;
            out.push(Action::Wake(sig, Ok(Reply::Done)));
        }
    }

    /// The superstep report could not go out: its waiters fail with `err`.
    pub(super) fn report_failed(&mut self, err: &Error, out: &mut Vec<Action>) {
        if let Some(sig) = self.gate.as_mut().and_then(Gate::report_failed) {
            out.push(Action::Wake(sig, Err(err.clone())));
        }
    }

    /// The gate's barrier (None without a gate).
    pub(super) fn barrier(&self) -> Option<u64> {
        self.gate.as_ref().map(Gate::barrier)
    }

    /// The interval a superstep report would carry now (None without a gate or a sample).
    pub(super) fn interval(&self) -> Option<Duration> {
        self.gate.as_ref()?.interval()
    }

    // ----- shards -----

    /// Shard `i`'s clocks and counters.
    pub(super) fn shard(&self, i: usize) -> &ShardClock {
        &self.shards[i]
    }

    /// Shard `i`'s gradient went out: one more pushed.
    pub(super) fn pushed(&mut self, i: usize) {
        self.shards[i].pushes += 1;
        self.stats.pushes += 1;
    }

    /// The next transferred-task gradient's sequence number of shard `i`.
    pub(super) fn next_help(&mut self, i: usize) -> u64 {
        self.shards[i].helps += 1;
        self.shards[i].helps
    }

    /// Shard `i`'s values were read at `version` (u64::MAX: through its server).
    pub(super) fn pulled(&mut self, i: usize, version: u64) {
        self.shards[i].pulled_version = version;
    }

    /// The worker's clock: the fewest gradients pushed to any tensor pushed at all.
    pub(super) fn clock(&self) -> u64 {
        let mut per_tensor: HashMap<u32, u64> = HashMap::new();
        for s in &self.shards {
            per_tensor
                .entry(s.tensor)
                .and_modify(|m| *m = (*m).min(s.pushes))
                .or_insert(s.pushes);
        }
        per_tensor
            .values()
            .copied()
            .filter(|&n| n > 0)
            .min()
            .unwrap_or(0)
    }

    // ----- grants -----

    /// The key of region `region` on `link`, if granted there.
    pub(super) fn grant(&self, link: LinkId, region: u64) -> Option<RemoteKey> {
        self.grants.get(&(link, region)).copied()
    }

    /// Where gradient region `region` read in place stands on `link`.
    pub(super) fn source_grant(&self, link: LinkId, region: u64) -> SourceGrant {
        match self.grant(link, region) {
            Some(k) => SourceGrant::Granted(k),
            None if self.source_grants.get(&link).copied().unwrap_or(0) < self.source_cap => {
                SourceGrant::Room
            }
            None => SourceGrant::Full,
        }
    }

    /// `region` was granted on `link` as `key` (`source`: a gradient read in place). Where
    /// another caller recorded a grant of it meanwhile, that one stands and is returned.
    pub(super) fn granted(
        &mut self,
        link: LinkId,
        region: u64,
        key: RemoteKey,
        source: bool,
    ) -> RemoteKey {
        if let Some(k) = self.grant(link, region) {
            return k;
        }
        self.grants.insert((link, region), key);
        if source {
            *self.source_grants.entry(link).or_default() += 1;
        }
        key
    }

    /// Forgets the grants on links not in `live` (after a reattachment).
    pub(super) fn forget_grants(&mut self, live: &HashSet<LinkId>) {
        self.grants.retain(|(l, _), _| live.contains(l));
        self.source_grants.retain(|l, _| live.contains(l));
    }

    // ----- rows, peers, offers, hooks, counters -----

    /// Tensor `t`'s last row plan.
    pub(super) fn row_plan(&self, t: usize) -> Option<Arc<RowPlan>> {
        self.row_plans.get(&t).cloned()
    }

    /// Takes tensor `t`'s last row plan out (its buffers may be reused).
    pub(super) fn take_row_plan(&mut self, t: usize) -> Option<Arc<RowPlan>> {
        self.row_plans.remove(&t)
    }

    /// Tensor `t`'s row plan is now `plan`.
    pub(super) fn set_row_plan(&mut self, t: usize, plan: Arc<RowPlan>) {
        self.row_plans.insert(t, plan);
    }

    /// Worker `rank` was declared dead (`dead`) or rejoined; whether that is news.
    pub(super) fn worker_dead(&mut self, rank: u32, dead: bool) -> bool {
        if dead {
            self.dead.insert(rank)
        } else {
            self.dead.remove(&rank)
        }
    }

    /// The workers declared dead, by rank.
    pub(super) fn dead(&self) -> &BTreeSet<u32> {
        &self.dead
    }

    /// A shard's policy offers `offer` (every shard's may make the same one: kept once).
    pub(super) fn on_offer(&mut self, offer: Offer) {
        if self.offers.add(offer) {
            self.stats.offers += 1;
        }
    }

    /// Takes the offers not yet taken, oldest first.
    pub(super) fn take_offers(&mut self) -> Vec<Offer> {
        self.offers.take()
    }

    /// The parallelism manager advised `threads`.
    pub(super) fn advise(&mut self, threads: u32) {
        self.advised = threads;
    }

    /// Its latest advice (0: none).
    pub(super) fn advised(&self) -> u32 {
        self.advised
    }

    /// How this worker gives tasks away.
    pub(super) fn steal_hook(&self) -> Option<StealHook> {
        self.steal_hook.clone()
    }

    /// Sets it.
    pub(super) fn set_steal_hook(&mut self, hook: StealHook) {
        self.steal_hook = Some(hook);
    }

    /// The fault-injection seam rewriting in-place sources.
    pub(super) fn forge_source(&self) -> Option<ForgeSource> {
        self.forge_source.clone()
    }

    /// Sets it.
    pub(super) fn set_forge_source(&mut self, forge: ForgeSource) {
        self.forge_source = Some(forge);
    }

    /// Why every request fails, once the job is over for this worker.
    pub(super) fn broken(&self) -> Option<&Error> {
        self.broken.as_ref()
    }

    /// The counters.
    pub(super) fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// The counters, to count in.
    pub(super) fn stats_mut(&mut self) -> &mut WorkerStats {
        &mut self.stats
    }

    /// Requests in flight.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests;
