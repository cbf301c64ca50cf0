//! Synchronization policies: sans-IO state machines.
//!
//! Inputs are [`Event`]s with timestamps; outputs are [`Action`]s. A policy does no I/O, reads
//! no clock and starts no thread: the same code runs in the real server and in the simulator,
//! and is tested deterministically. Each shard runs its own instance (FluentPS's independent
//! shards), so the engine never takes a global lock to synchronize.
//!
//! Clocks: a worker's clock is the iteration it is working on, from 0. It pulls with clock `c`
//! before computing iteration `c` and pushes that iteration's gradient with clock `c`. A
//! shard's *applied* count for a worker is the number of its gradients applied (so `c + 1`
//! once iteration `c`'s gradient is in). The staleness predicate is
//! [`crate::meta::within_staleness`]: `min_applied >= c - s`.
//!
//! The lock-free fast path: when [`SyncPolicy::fast_path`] says so, a worker reads the shard's
//! clocks one-sided and pulls without asking the server; only pulls that fail the check reach
//! the policy as [`Event::Pull`].

mod asp;
mod bsp;
mod dssp;
pub mod epsp;
pub mod flexrr;
mod fluentps;
pub mod projection;
mod ssp;
mod syncopt;
pub mod zipline;

pub use asp::Asp;
pub use bsp::Bsp;
pub use dssp::*;
pub use epsp::*;
pub use flexrr::*;
pub use fluentps::*;
pub use ssp::Ssp;
pub use syncopt::*;
pub use zipline::{ElasticBsp, ElasticBspShard};

use serde::{Deserialize, Serialize};

/// A worker's rank.
pub type Worker = u32;
/// Nanoseconds on whatever clock the caller uses (wall clock or simulated).
pub type Nanos = u64;

/// What a policy is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `worker`'s gradient for iteration `clock` was applied to the shard (for policies that
    /// may drop gradients, Sync-opt: it arrived and is not applied yet; see `SyncOpt`).
    Push {
        /// The worker.
        worker: Worker,
        /// The iteration of the gradient.
        clock: u64,
        /// When.
        at: Nanos,
    },
    /// `worker` asks to pull at `clock` (its lock-free check did not allow it, or the policy
    /// has no fast path). `req` names the request in the actions.
    Pull {
        /// The worker.
        worker: Worker,
        /// Its clock.
        clock: u64,
        /// Request id.
        req: u64,
        /// When.
        at: Nanos,
    },
    /// Time passes.
    Tick {
        /// Now.
        at: Nanos,
    },
    /// `worker` left (died or was removed): it no longer holds anyone back.
    Leave {
        /// The worker.
        worker: Worker,
        /// When.
        at: Nanos,
    },
    /// `worker` (re)joined with `clock` updates already counted.
    Join {
        /// The worker.
        worker: Worker,
        /// Its applied count.
        clock: u64,
        /// When.
        at: Nanos,
    },
}

impl Event {
    /// When it happened.
    pub fn at(&self) -> Nanos {
        match *self {
            Event::Push { at, .. }
            | Event::Pull { at, .. }
            | Event::Leave { at, .. }
            | Event::Join { at, .. }
            | Event::Tick { at } => at,
        }
    }
}

/// What a policy decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Answer pull `req` of `worker` now, with the latest values.
    Release {
        /// The worker.
        worker: Worker,
        /// The request.
        req: u64,
    },
    /// Pull `req` of `worker` waits (counted as a delayed pull).
    Park {
        /// The worker.
        worker: Worker,
        /// The request.
        req: u64,
    },
    /// Discard `worker`'s gradient for `clock` (it arrived too late to count; Sync-opt).
    DropGradient {
        /// The worker.
        worker: Worker,
        /// The gradient's iteration.
        clock: u64,
    },
    /// `worker`'s gradient for `clock` arrived after its step was made without it: the server
    /// adds it to the next step it applies, as one more gradient of that step's mean but not
    /// toward its quorum (Sync-opt with folding, ours: late work is kept, one or more steps
    /// stale, instead of dropped).
    Fold {
        /// The worker.
        worker: Worker,
        /// The gradient's iteration.
        clock: u64,
    },
    /// `worker`'s gradient pushed for its iteration `clock` counts for step `step`, not for
    /// `clock` (Sync-opt: it was computed on the parameters of version `step`, which the worker
    /// was given at a pull past its own clock). The server aggregates it into that step.
    CountFor {
        /// The worker.
        worker: Worker,
        /// The iteration it pushed for.
        clock: u64,
        /// The step it counts for.
        step: u64,
    },
    /// Offer `helper` unprocessed tasks of `straggler`'s iteration `clock` (EPSP, FlexRR).
    /// An offer, not an order: the task side (the trainer, through the scheduler) hands each
    /// task out once, so an offer may find nothing left to take.
    Transfer {
        /// The worker with time to spare.
        helper: Worker,
        /// The worker behind.
        straggler: Worker,
        /// The straggler's iteration whose tasks are offered.
        clock: u64,
    },
}

/// Whether a worker may pull without asking the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastPath {
    /// Always (ASP).
    Always,
    /// When every live worker's applied count is within this staleness (`≥` bound).
    Within(u64),
    /// Never: every pull is an event (policies that must see each pull).
    Never,
}

/// A synchronization policy for one shard.
pub trait SyncPolicy: Send + std::fmt::Debug {
    /// A short name (`bsp`, `ssp(3)`…).
    fn name(&self) -> String;
    /// Feeds one event; appends the resulting actions to `out`.
    fn on_event(&mut self, ev: Event, out: &mut Vec<Action>);
    /// The lock-free pull rule workers may apply themselves.
    fn fast_path(&self) -> FastPath;
    /// Pulls parked right now.
    fn parked(&self) -> usize;
    /// Pulls ever parked ("delayed" in FluentPS's terms).
    fn delayed_total(&self) -> u64;
    /// True if the policy decides which gradients count (Sync-opt): the server feeds `Push` on
    /// arrival, before applying, discards gradients answered with `DropGradient`, adds one
    /// answered with `Fold` to the next step it applies, and aggregates one answered with
    /// `CountFor` into that step instead of its clock's.
    fn judges_arrivals(&self) -> bool {
        false
    }
    /// The shard's steps changed under the policy: a server restarted from its checkpoint, or
    /// a reattaching worker's lost updates hold places in the waiting steps. `steps` steps were
    /// applied, and `pending` holds the steps waiting with the workers whose gradients (or
    /// places) they hold. Policies that judge arrivals (Sync-opt) take their step count from
    /// it, and release the pulls it allows into `out`; the others learn what they need from the
    /// `Join` events that come with a restore or a reattachment.
    fn restored(&mut self, steps: u64, pending: &[(u64, Vec<Worker>)], out: &mut Vec<Action>) {
        let _ = (steps, pending, out);
    }
    /// How many gradients complete one clock of aggregate-then-apply when `live` workers are
    /// live (every live worker's, unless the policy needs fewer).
    fn step_quorum(&self, live: u32) -> u32 {
        live
    }
    /// Gradients dropped so far.
    fn dropped(&self) -> u64 {
        0
    }
    /// Extra iterations granted to `worker` so far (DSSP's controller).
    fn grants(&self, worker: Worker) -> u64 {
        let _ = worker;
        0
    }
    /// Task transfers offered so far.
    fn transfers(&self) -> u64 {
        0
    }
}

/// A policy by name, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicySpec {
    /// Bulk-synchronous parallel.
    Bsp,
    /// Asynchronous parallel.
    Asp,
    /// Stale-synchronous parallel with bound `s`.
    Ssp {
        /// The staleness bound.
        s: u64,
    },
    /// Dynamic SSP with its threshold chosen in `[s_lower, s_upper]`.
    Dssp {
        /// s_L.
        s_lower: u64,
        /// s_U.
        s_upper: u64,
    },
    /// FluentPS with bound `s` and a pausing variant.
    FluentPs {
        /// The staleness bound.
        s: u64,
        /// How the fastest worker is paused.
        pause: PauseSpec,
    },
    /// Synchronous SGD with `backups` backup workers: the first `workers − backups` gradients
    /// of a clock count, later ones are dropped.
    SyncOpt {
        /// b.
        backups: u32,
        /// Late gradients join the next step instead of being dropped (`syncopt(B,fold)`,
        /// ours; see [`SyncOpt::folding`]).
        fold: bool,
    },
    /// Sync-opt whose backups are the persistent stragglers of EPSP's straggler projection
    /// (`syncopt(auto)`, ours; see [`SyncOpt::auto`]).
    SyncOptAuto {
        /// Late gradients join the next step instead of being dropped (`syncopt(auto,fold)`).
        fold: bool,
    },
    /// Falcon's EPSP (our design, see [`Epsp`]).
    Epsp {
        /// The largest slack bound; with `adaptive` off, the fixed bound.
        s_max: u64,
        /// Switch between enforced and slack from the straggler projection's verdict.
        adaptive: bool,
        /// Offer a blocked pioneer the tasks of the straggler with the most remaining work.
        transfer: bool,
    },
    /// FlexRR: SSP with a small slack plus reassignment of a slow worker's work to helpers.
    FlexRr {
        /// The staleness bound.
        s: u64,
        /// Help is offered to a worker at least this many iterations behind (≥ 1).
        theta: u64,
        /// Helper groups of this many consecutive ranks (0: one group of everyone).
        group: u32,
    },
    /// ElasticBSP with ZipLine barriers, `r` iterations ahead. The barrier plan is one for the
    /// whole job: the scheduler runs ZipLine and each worker waits at its own barrier; the
    /// shards apply pushes as they arrive ([`ElasticBspShard`]).
    ElasticBsp {
        /// R, the look-ahead.
        r: u32,
    },
}

/// FluentPS's pausing variant, as configured (`p` in thousandths so the spec stays `Eq`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PauseSpec {
    /// Every pull past the bound waits.
    RawSsp,
    /// Only the fastest, with probability `permille / 1000`.
    Fastest {
        /// The probability in thousandths.
        permille: u32,
    },
    /// Sigmoid in the gap, any worker.
    Sigmoid,
    /// Sigmoid in the gap, the fastest only.
    FastestSigmoid,
}

impl PolicySpec {
    /// A fresh instance for a shard of a job with `workers` workers.
    pub fn build(&self, workers: u32) -> Box<dyn SyncPolicy> {
        self.build_for(workers, 0)
    }

    /// A fresh instance for shard `shard` (randomized policies seed from it, so shards do not
    /// draw the same sequence).
    pub fn build_for(&self, workers: u32, shard: u32) -> Box<dyn SyncPolicy> {
        match *self {
            PolicySpec::Bsp => Box::new(Bsp::new(workers)),
            PolicySpec::Asp => Box::new(Asp),
            PolicySpec::Ssp { s } => Box::new(Ssp::new(workers, s)),
            PolicySpec::Dssp { s_lower, s_upper } => Box::new(Dssp::new(workers, s_lower, s_upper)),
            PolicySpec::SyncOpt { backups, fold } => Box::new(
                SyncOpt::new(workers, backups.min(workers.saturating_sub(1))).folding(fold),
            ),
            PolicySpec::SyncOptAuto { fold } => Box::new(SyncOpt::auto(workers).folding(fold)),
            PolicySpec::FluentPs { s, pause } => {
                let pause = match pause {
                    PauseSpec::RawSsp => Pause::RawSsp,
                    PauseSpec::Fastest { permille } => Pause::Fastest {
                        p: f64::from(permille) / 1000.0,
                    },
                    PauseSpec::Sigmoid => Pause::Sigmoid,
                    PauseSpec::FastestSigmoid => Pause::FastestSigmoid,
                };
                let seed =
                    0x9E37_79B9_7F4A_7C15u64 ^ u64::from(shard).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                Box::new(FluentPs::new(pause, s, workers, seed))
            }
            PolicySpec::Epsp {
                s_max,
                adaptive,
                transfer,
            } => Box::new(Epsp::new(
                workers,
                EpspConfig {
                    s_max,
                    adaptive,
                    transfer,
                    ..EpspConfig::default()
                },
            )),
            PolicySpec::FlexRr { s, theta, group } => {
                Box::new(FlexRr::new(workers, s, theta, group))
            }
            PolicySpec::ElasticBsp { r } => Box::new(ElasticBspShard::new(r)),
        }
    }

    /// How the servers apply this policy's gradients: per step, aggregated, for the policies
    /// whose every step holds every live worker's gradient of one clock (BSP, Sync-opt, and
    /// EPSP with no slack: `epsp(0)`, BSP plus task transfer); one by one as they arrive for
    /// the others.
    pub fn update_mode(&self) -> crate::update::UpdateMode {
        match self {
            PolicySpec::Bsp
            | PolicySpec::SyncOpt { .. }
            | PolicySpec::SyncOptAuto { .. }
            | PolicySpec::Epsp { s_max: 0, .. } => crate::update::UpdateMode::Sync,
            _ => crate::update::UpdateMode::Async,
        }
    }

    /// True when workers wait at job-wide barriers planned by the scheduler (ElasticBSP).
    pub fn job_barriers(&self) -> Option<u32> {
        match *self {
            PolicySpec::ElasticBsp { r } => Some(r.max(1)),
            _ => None,
        }
    }
}

/// The policies and their arguments, for messages.
const POLICIES: &str = "bsp, asp, ssp(N), dssp(L,U), syncopt(B|auto[,fold]), \
                        fluentps(N[,p=P|sigmoid|fastest-sigmoid]), epsp[(S[,fixed][,no-transfer])], \
                        flexrr[(S[,theta=T][,group=G])], elasticbsp[(R)]";

/// A whole number argument of a policy, or what is wrong with it.
fn whole(what: &str, text: &str) -> Result<u64, String> {
    text.parse::<u64>().map_err(|_| {
        if text.is_empty() {
            format!("{what} is missing (a whole number ≥ 0)")
        } else {
            format!("{what} must be a whole number ≥ 0, not {text}")
        }
    })
}

/// As [`whole`], at most `u32::MAX`.
fn whole_u32(what: &str, text: &str) -> Result<u32, String> {
    let n = whole(what, text)?;
    u32::try_from(n).map_err(|_| format!("{what} = {n} is too large (at most {})", u32::MAX))
}

/// Exactly `n` arguments.
fn arity(name: &str, args: &[&str], n: usize, form: &str) -> Result<(), String> {
    if args.len() == n {
        Ok(())
    } else {
        Err(format!(
            "{name} takes {n} argument{}, got {}: {form}",
            if n == 1 { "" } else { "s" },
            args.len()
        ))
    }
}

/// The spec as `FromStr` reads it back (`ssp(3)`, `epsp(4,fixed)`, `fluentps(3,p=0.5)`).
impl std::fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            PolicySpec::Bsp => write!(f, "bsp"),
            PolicySpec::Asp => write!(f, "asp"),
            PolicySpec::Ssp { s } => write!(f, "ssp({s})"),
            PolicySpec::Dssp { s_lower, s_upper } => write!(f, "dssp({s_lower},{s_upper})"),
            PolicySpec::FluentPs { s, pause } => match pause {
                PauseSpec::RawSsp => write!(f, "fluentps({s})"),
                PauseSpec::Fastest { permille } => {
                    write!(f, "fluentps({s},p={})", f64::from(permille) / 1000.0)
                }
                PauseSpec::Sigmoid => write!(f, "fluentps({s},sigmoid)"),
                PauseSpec::FastestSigmoid => write!(f, "fluentps({s},fastest-sigmoid)"),
            },
            PolicySpec::SyncOpt { backups, fold } => {
                write!(f, "syncopt({backups}{})", if fold { ",fold" } else { "" })
            }
            PolicySpec::SyncOptAuto { fold } => {
                write!(f, "syncopt(auto{})", if fold { ",fold" } else { "" })
            }
            PolicySpec::Epsp {
                s_max,
                adaptive,
                transfer,
            } => {
                write!(f, "epsp({s_max}")?;
                if !adaptive {
                    write!(f, ",fixed")?;
                }
                if !transfer {
                    write!(f, ",no-transfer")?;
                }
                write!(f, ")")
            }
            PolicySpec::FlexRr { s, theta, group } => {
                write!(f, "flexrr({s},theta={theta},group={group})")
            }
            PolicySpec::ElasticBsp { r } => write!(f, "elasticbsp({r})"),
        }
    }
}

impl std::str::FromStr for PolicySpec {
    type Err = crate::Error;
    /// `bsp`, `asp`, `ssp(3)`, `dssp(3,15)`, `syncopt(1)`, `fluentps(3)` (raw SSP),
    /// `fluentps(3,p=0.5)` (fastest only), `fluentps(3,sigmoid)`, `fluentps(3,fastest-sigmoid)`,
    /// `epsp` (= `epsp(0)`: BSP's steps, the straggler's tasks moved to waiting workers),
    /// `epsp(4)` (slack up to 4, adaptive, transfer), `epsp(4,fixed)` (always slack 4;
    /// `epsp(0,fixed)` is always enforced), `epsp(4,no-transfer)`, `flexrr` (= `flexrr(1)`),
    /// `flexrr(1,theta=2,group=4)`, `elasticbsp` (= `elasticbsp(15)`), `elasticbsp(R)`.
    ///
    /// A wrong spec is an [`Error::Config`](crate::Error::Config) saying what is wrong with
    /// it and what that policy accepts.
    fn from_str(s: &str) -> Result<Self, crate::Error> {
        let shown = s.trim();
        parse_policy(&shown.to_ascii_lowercase().replace(' ', ""))
            .map_err(|why| crate::Error::Config(format!("policy {shown}: {why}")))
    }
}

fn parse_policy(l: &str) -> Result<PolicySpec, String> {
    let (name, args) = split_call(l)?;
    if name.is_empty() {
        return Err(format!("no policy named; the policies: {POLICIES}"));
    }
    let a = args.clone().unwrap_or_default();
    match name {
        "bsp" | "asp" => {
            if args.is_some() {
                return Err(format!("{name} takes no arguments: write {name}"));
            }
            Ok(if name == "bsp" {
                PolicySpec::Bsp
            } else {
                PolicySpec::Asp
            })
        }
        "ssp" => {
            arity(name, &a, 1, "ssp(N), N the staleness bound, e.g. ssp(3)")?;
            Ok(PolicySpec::Ssp {
                s: whole("the staleness bound N", a[0])?,
            })
        }
        "dssp" => parse_dssp(&a),
        "syncopt" => {
            let form = "syncopt(B), B backup workers (fewer than the workers), e.g. syncopt(1); \
                        or syncopt(auto), the backups the straggler projection finds; add \
                        fold to keep late gradients for the next step, e.g. syncopt(auto,fold)";
            let fold = match a.as_slice() {
                [_] => false,
                [_, "fold"] => true,
                [_, other] => {
                    return Err(format!("unknown option `{other}` at position 2: {form}"));
                }
                _ => {
                    return Err(format!(
                        "syncopt takes one or two arguments, got {}: {form}",
                        a.len()
                    ));
                }
            };
            if a[0] == "auto" {
                return Ok(PolicySpec::SyncOptAuto { fold });
            }
            Ok(PolicySpec::SyncOpt {
                backups: whole_u32("the backups B", a[0])?,
                fold,
            })
        }
        "elasticbsp" => parse_elasticbsp(&a),
        "epsp" => parse_epsp(&a),
        "flexrr" => parse_flexrr(&a),
        "fluentps" => parse_fluentps(&a),
        other => Err(format!(
            "unknown policy `{other}`; the policies: {POLICIES}"
        )),
    }
}

/// `NAME` or `NAME(ARG,…)`: the name, and the arguments when there are parentheses.
fn split_call(l: &str) -> Result<(&str, Option<Vec<&str>>), String> {
    Ok(match l.split_once('(') {
        None => (l, None),
        Some((name, rest)) => match rest.strip_suffix(')') {
            Some(inner) if !inner.contains(['(', ')']) => (
                name,
                Some(if inner.is_empty() {
                    Vec::new()
                } else {
                    inner.split(',').collect()
                }),
            ),
            _ => {
                return Err(format!(
                    "unbalanced parentheses: write NAME(ARG,…) with one pair; the policies: \
                     {POLICIES}"
                ));
            }
        },
    })
}

/// `dssp(L,U)`.
fn parse_dssp(a: &[&str]) -> Result<PolicySpec, String> {
    arity(
        "dssp",
        a,
        2,
        "dssp(L,U), the bounds s_L ≤ s_U, e.g. dssp(3,15)",
    )?;
    let lo = whole("the lower bound L", a[0])?;
    let hi = whole("the upper bound U", a[1])?;
    if lo > hi {
        return Err(format!(
            "the lower bound L = {lo} is above the upper bound U = {hi}: s_L must be \
                 ≤ s_U, e.g. dssp({hi},{lo})"
        ));
    }
    Ok(PolicySpec::Dssp {
        s_lower: lo,
        s_upper: hi,
    })
}

/// `elasticbsp` or `elasticbsp(R)`.
fn parse_elasticbsp(a: &[&str]) -> Result<PolicySpec, String> {
    let r = match a {
        [] => 15,
        [r] => whole("the look-ahead R", r)?,
        _ => {
            return Err(format!(
                "elasticbsp takes at most one argument, got {}: elasticbsp(R), R the \
                     look-ahead in iterations (1 to 100000; default 15)",
                a.len()
            ));
        }
    };
    if !(1..=100_000).contains(&r) {
        return Err(format!(
            "the look-ahead R = {r} is outside 1 to 100000 iterations"
        ));
    }
    Ok(PolicySpec::ElasticBsp { r: r as u32 })
}

/// `epsp`, `epsp(S)` and its options `fixed`, `no-transfer`.
fn parse_epsp(a: &[&str]) -> Result<PolicySpec, String> {
    let (mut s_max, mut adaptive, mut transfer) = (0u64, true, true);
    for (i, arg) in a.iter().enumerate() {
        match *arg {
            "fixed" => adaptive = false,
            "no-transfer" => transfer = false,
            n if i == 0 => s_max = whole("the slack bound S", n)?,
            other => {
                return Err(format!(
                    "unknown option `{other}` at position {}: epsp takes the slack bound \
                         S (a whole number, first) and the options fixed and no-transfer, \
                         e.g. epsp(4,fixed)",
                    i + 1
                ));
            }
        }
    }
    Ok(PolicySpec::Epsp {
        s_max,
        adaptive,
        transfer,
    })
}

/// `flexrr`, `flexrr(S)` and its options `theta=T`, `group=G`.
fn parse_flexrr(a: &[&str]) -> Result<PolicySpec, String> {
    let (mut s, mut theta, mut group) = (1u64, 1u64, 0u32);
    for (i, arg) in a.iter().enumerate() {
        if let Some(t) = arg.strip_prefix("theta=") {
            theta = whole("theta", t)?;
            if theta == 0 {
                return Err("theta = 0: help goes to a worker at least theta \
                                iterations behind, so theta must be ≥ 1"
                    .into());
            }
        } else if let Some(g) = arg.strip_prefix("group=") {
            group = whole_u32("the group size", g)?;
        } else if i == 0 {
            s = whole("the staleness bound S", arg)?;
        } else {
            return Err(format!(
                "unknown option `{arg}` at position {}: flexrr takes the staleness \
                     bound S (a whole number, first), theta=T (≥ 1) and group=G (0: one \
                     group), e.g. flexrr(1,theta=2,group=4)",
                i + 1
            ));
        }
    }
    Ok(PolicySpec::FlexRr { s, theta, group })
}

/// `fluentps(N)` and its pausing variant `p=P`, `sigmoid` or `fastest-sigmoid`.
fn parse_fluentps(a: &[&str]) -> Result<PolicySpec, String> {
    let form = "fluentps(N[,p=P|sigmoid|fastest-sigmoid]), e.g. fluentps(3,p=0.5)";
    if a.is_empty() || a.len() > 2 {
        return Err(format!(
            "fluentps takes 1 or 2 arguments, got {}: {form}",
            a.len()
        ));
    }
    let n = whole("the staleness bound N", a[0])?;
    let pause = match a.get(1).copied() {
        None => PauseSpec::RawSsp,
        Some("sigmoid") => PauseSpec::Sigmoid,
        Some("fastest-sigmoid") => PauseSpec::FastestSigmoid,
        Some(v) => {
            let Some(p) = v.strip_prefix("p=") else {
                return Err(format!(
                    "unknown pausing variant `{v}`: p=P (P in [0, 1]), sigmoid or \
                         fastest-sigmoid"
                ));
            };
            let p: f64 = p
                .parse()
                .map_err(|_| format!("p must be a number in [0, 1], not {p}"))?;
            if !(0.0..=1.0).contains(&p) {
                return Err(format!(
                    "p = {p} is a probability (of pausing the fastest worker): p must \
                         be in [0, 1]"
                ));
            }
            PauseSpec::Fastest {
                permille: (p * 1000.0).round() as u32,
            }
        }
    };
    Ok(PolicySpec::FluentPs { s: n, pause })
}

/// Pulls parked, kept in release order `(clock, req, worker)`, and how many were ever parked.
/// Releasing takes pulls from the front only: `O(log parked)` per pull, not a pass over every
/// parked pull per event.
#[derive(Clone, Debug, Default)]
pub(crate) struct Parked {
    /// (clock, req, worker).
    set: std::collections::BTreeSet<(u64, u64, Worker)>,
    /// Pulls ever parked.
    pub(crate) delayed: u64,
}

impl Parked {
    /// The SSP rule for a pull of `worker` at `clock`: released at once when within `s` of
    /// the live minimum `min`, parked otherwise. True when parked.
    pub(crate) fn judge(
        &mut self,
        min: u64,
        s: u64,
        (worker, clock, req): (Worker, u64, u64),
        out: &mut Vec<Action>,
    ) -> bool {
        if crate::meta::within_staleness(min, clock, s) {
            out.push(Action::Release { worker, req });
            false
        } else {
            self.park((worker, clock, req), out);
            true
        }
    }

    /// Parks the pull: [`Action::Park`].
    pub(crate) fn park(&mut self, (worker, clock, req): (Worker, u64, u64), out: &mut Vec<Action>) {
        self.set.insert((clock, req, worker));
        self.delayed += 1;
        out.push(Action::Park { worker, req });
    }

    /// Releases, in `(clock, req, worker)` order, every parked pull within staleness `s` of the
    /// live minimum `min` (the SSP rule), calling `on(worker, req)` for each; keeps the others.
    pub(crate) fn release_within(&mut self, min: u64, s: u64, on: impl FnMut(Worker, u64)) {
        self.release_through(min.saturating_add(s), on);
    }

    /// Releases, in order, every parked pull at a clock `≤ last`.
    pub(crate) fn release_through(&mut self, last: u64, mut on: impl FnMut(Worker, u64)) {
        while let Some(&(clock, req, worker)) = self.set.first() {
            if clock > last {
                break;
            }
            self.set.pop_first();
            on(worker, req);
        }
    }

    /// Pulls parked now.
    pub(crate) fn len(&self) -> usize {
        self.set.len()
    }

    /// The parked pulls in release order: (clock, req, worker).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &(u64, u64, Worker)> {
        self.set.iter()
    }
}

/// Bookkeeping shared by the staleness-based policies: applied counts and liveness, with how
/// many live workers stand at each applied count. The live workers' counts span few distinct
/// values (the staleness bound keeps them close), so the slowest and fastest clocks cost
/// `O(log levels)` per event, not a pass over the job. [`Clocks::ranked`] also keeps the live
/// workers in order, for a policy that needs the slowest worker itself.
#[derive(Clone, Debug)]
pub(crate) struct Clocks {
    applied: Vec<u64>,
    live: Vec<bool>,
    /// Live workers per applied count.
    levels: std::collections::BTreeMap<u64, u32>,
    live_count: usize,
    /// The live workers by (applied, rank), when ranked.
    order: Option<std::collections::BTreeSet<(u64, Worker)>>,
}

impl Clocks {
    pub(crate) fn new(workers: u32) -> Clocks {
        Clocks {
            applied: vec![0; workers as usize],
            live: vec![true; workers as usize],
            levels: if workers > 0 {
                std::iter::once((0, workers)).collect()
            } else {
                Default::default()
            },
            live_count: workers as usize,
            order: None,
        }
    }

    /// As [`Clocks::new`], keeping the live workers in order too ([`Clocks::slowest`]).
    pub(crate) fn ranked(workers: u32) -> Clocks {
        Clocks {
            order: Some((0..workers).map(|w| (0, w)).collect()),
            ..Clocks::new(workers)
        }
    }

    /// Updates from an event; false for events about unknown workers (ignored).
    pub(crate) fn observe(&mut self, ev: &Event) -> bool {
        let n = self.applied.len();
        match *ev {
            Event::Push { worker, clock, .. } if (worker as usize) < n => {
                self.raise(worker, clock.saturating_add(1))
            }
            Event::Leave { worker, .. } if (worker as usize) < n => self.set_live(worker, false),
            Event::Join { worker, clock, .. } if (worker as usize) < n => {
                self.set_live(worker, true);
                self.raise(worker, clock);
            }
            Event::Pull { worker, .. } if (worker as usize) < n => {}
            Event::Tick { .. } => {}
            _ => return false,
        }
        true
    }

    fn count(&mut self, (applied, worker): (u64, Worker), present: bool) {
        if present {
            *self.levels.entry(applied).or_insert(0) += 1;
            self.live_count += 1;
        } else if let std::collections::btree_map::Entry::Occupied(mut e) =
            self.levels.entry(applied)
        {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
            self.live_count -= 1;
        }
        if let Some(order) = &mut self.order {
            if present {
                order.insert((applied, worker));
            } else {
                order.remove(&(applied, worker));
            }
        }
    }

    /// Raises `worker`'s applied count to at least `to`.
    pub(crate) fn raise(&mut self, worker: Worker, to: u64) {
        let w = worker as usize;
        let Some(&a) = self.applied.get(w) else {
            return;
        };
        if to <= a {
            return;
        }
        if self.live[w] {
            self.count((a, worker), false);
            self.count((to, worker), true);
        }
        self.applied[w] = to;
    }

    fn set_live(&mut self, worker: Worker, live: bool) {
        let w = worker as usize;
        if self.live[w] != live {
            self.live[w] = live;
            self.count((self.applied[w], worker), live);
        }
    }

    /// Workers, live or not.
    pub(crate) fn workers(&self) -> usize {
        self.applied.len()
    }

    /// `worker`'s applied count (`None` for an unknown worker).
    pub(crate) fn applied(&self, worker: Worker) -> Option<u64> {
        self.applied.get(worker as usize).copied()
    }

    /// True when `worker` is known and live.
    pub(crate) fn is_live(&self, worker: Worker) -> bool {
        self.live.get(worker as usize).copied().unwrap_or(false)
    }

    /// Live workers.
    pub(crate) fn live_count(&self) -> usize {
        self.live_count
    }

    /// The smallest applied count among live workers (u64::MAX when none is live).
    pub(crate) fn min_live(&self) -> u64 {
        self.levels.first_key_value().map_or(u64::MAX, |(&a, _)| a)
    }

    /// The largest applied count among live workers (0 when none is live).
    pub(crate) fn max_live(&self) -> u64 {
        self.levels.last_key_value().map_or(0, |(&a, _)| a)
    }

    /// The slowest live worker (the lowest rank on ties); needs [`Clocks::ranked`] (`None`
    /// otherwise).
    pub(crate) fn slowest(&self) -> Option<Worker> {
        self.order.as_ref()?.first().map(|&(_, w)| w)
    }
}

#[cfg(test)]
mod parse_tests {
    use super::PolicySpec;

    fn err(text: &str) -> String {
        text.parse::<PolicySpec>().expect_err(text).to_string()
    }

    #[test]
    fn display_reads_back_as_the_same_spec() {
        for text in [
            "bsp",
            "asp",
            "ssp(3)",
            "dssp(3,15)",
            "fluentps(3)",
            "fluentps(3,p=0.5)",
            "fluentps(2,sigmoid)",
            "fluentps(2,fastest-sigmoid)",
            "syncopt(1)",
            "syncopt(auto)",
            "syncopt(2,fold)",
            "syncopt(auto,fold)",
            "epsp",
            "epsp(4,fixed)",
            "epsp(2,no-transfer)",
            "epsp(0,fixed,no-transfer)",
            "flexrr",
            "flexrr(1,theta=2,group=4)",
            "elasticbsp(7)",
        ] {
            let spec: PolicySpec = text.parse().unwrap();
            let shown = spec.to_string();
            assert_eq!(
                shown.parse::<PolicySpec>().unwrap(),
                spec,
                "{text} shown as {shown}"
            );
        }
        assert_eq!("epsp".parse::<PolicySpec>().unwrap().to_string(), "epsp(0)");
    }

    #[test]
    fn each_wrong_spec_says_what_is_wrong() {
        for (bad, says) in [
            ("dssp(8,2)", "s_L must be ≤ s_U"),
            ("dssp(3)", "dssp takes 2 arguments, got 1"),
            (
                "dssp(x,2)",
                "the lower bound L must be a whole number ≥ 0, not x",
            ),
            ("fluentps(3,p=2)", "p must be in [0, 1]"),
            ("fluentps(3,p=x)", "p must be a number in [0, 1], not x"),
            ("fluentps(3,fast)", "unknown pausing variant `fast`"),
            ("fluentps", "fluentps takes 1 or 2 arguments, got 0"),
            ("ssp", "ssp takes 1 argument, got 0"),
            (
                "ssp(-1)",
                "the staleness bound N must be a whole number ≥ 0, not -1",
            ),
            ("ssp(3", "unbalanced parentheses"),
            ("syncopt(1,2)", "unknown option `2` at position 2"),
            (
                "syncopt(1,fold,3)",
                "syncopt takes one or two arguments, got 3",
            ),
            ("syncopt", "syncopt takes one or two arguments, got 0"),
            ("syncopt(99999999999)", "too large"),
            ("elasticbsp(0)", "R = 0 is outside 1 to 100000"),
            ("elasticbsp(1,2)", "at most one argument"),
            (
                "epsp(1,sideways)",
                "unknown option `sideways` at position 2",
            ),
            ("epsp(1,2)", "unknown option `2` at position 2"),
            ("flexrr(1,theta=0)", "theta must be ≥ 1"),
            (
                "flexrr(1,theta=x)",
                "theta must be a whole number ≥ 0, not x",
            ),
            ("flexrr(1,2)", "unknown option `2` at position 2"),
            ("bsp(2)", "bsp takes no arguments"),
            ("zz", "unknown policy `zz`; the policies: bsp, asp"),
            ("", "no policy named"),
        ] {
            let e = err(bad);
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains(&format!("policy {bad}:")), "{bad} named: {e}");
        }
    }

    #[test]
    fn defaults_and_spaces_still_parse() {
        assert_eq!(
            "epsp()".parse::<PolicySpec>().unwrap(),
            "epsp".parse().unwrap()
        );
        assert_eq!(
            " DSSP( 3 , 15 ) ".parse::<PolicySpec>().unwrap(),
            PolicySpec::Dssp {
                s_lower: 3,
                s_upper: 15
            }
        );
        assert_eq!(
            "elasticbsp".parse::<PolicySpec>().unwrap(),
            PolicySpec::ElasticBsp { r: 15 }
        );
    }
}
