//! Heterogeneity injection per worker: the ways the papers made workers slow (algorithms.md
//! §11), behind one spec, [`Hetero`], and one per-worker [`Injector`].
//!
//! | spec                   | string form          | after an iteration of compute time d            |
//! |------------------------|----------------------|-------------------------------------------------|
//! | [`Hetero::None`]       | `none`               | nothing                                         |
//! | [`Hetero::Ratio`]      | `h=0.25`             | sleep (1/h − 1)·d: speed h × full (Falcon demo) |
//! | [`Hetero::Gaussian`]   | `gauss(5,2)`         | sleep max(0, N(μ ms, σ ms)) (FluentPS)          |
//! | [`Hetero::Episodes`]   | `episodes(10,3,4)`   | iterations k with k mod 10 < 3 run 4× slower    |
//! | [`Hetero::Contention`] | `contention(2)`      | nothing; 2 CPU-burning threads while it lives   |
//! | [`Hetero::Trace`]      | `trace(slow.txt)`    | iteration k runs f\[k mod len\]× slower: sleep (f − 1)·d |
//!
//! Delays are pure functions of `(spec, seed, iteration, d)` ([`Hetero::delay`]), so a run is
//! reproducible from its seed and the simulator can ask for any iteration's delay without
//! sleeping; [`Injector::after_iteration`] is the same delay, slept.
//!
//! Specs parse from the strings above ([`Hetero::parse`], also `FromStr`), print back to them
//! (`Display`, exactly: `parse(x.to_string()) == x`), and (de)serialize with serde as that
//! string — or, when deserializing, as a table such as `{ kind = "ratio", h = 0.25 }`.
//!
//! # Measured traces
//!
//! `trace(PATH)` and `trace(PATH,WORKER)` replay slowdowns measured elsewhere. The file is read
//! once, when the spec is parsed ([`Hetero::load_trace`]); the factors live in an `Arc`, so
//! cloning the spec is cheap, and the path is kept for the string form (printing it back
//! re-reads the file when parsed). The path is taken verbatim (case and inner spaces kept,
//! surrounding spaces trimmed; relative to the working directory). Two kinds of file:
//!
//! - **plain text**: one slowdown factor per line (finite, ≥ 1); blank lines and `#` comments
//!   are ignored. `WORKER` does not apply.
//! - **metrics** (`falcon train --metrics`, recognised by its first line starting with `{`): one
//!   JSON object per line with at least `worker`, `iteration`, `compute_s` and `injected_s`,
//!   and `iteration_s` (the iteration as the job saw it: compute and injected slowness). An
//!   iteration lasts `iteration_s` (files without it: `compute_s + injected_s`). The trace is
//!   worker `WORKER`'s lines (default: the slowest worker, by total iteration time; ties go
//!   to the lowest rank), in iteration order, each iteration divided by the fastest worker's
//!   median iteration (the worker with the smallest median; ties: lowest rank), clamped to
//!   ≥ 1.
//!
//! Iteration k then runs `factor[k mod len]` times slower: `delay = (factor − 1)·d`, applied
//! per task like [`Hetero::Ratio`] ([`Hetero::per_task`]). A missing or unreadable file, a
//! line that is not a number (or not a metrics object), a factor below 1 or not finite, an
//! empty trace and an unknown worker are [`Error::Config`]s naming the file and line.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The most contention threads a spec accepts.
pub const MAX_CONTENTION_THREADS: usize = 1024;

const FORMS: &str = "none, h=H (0 < H ≤ 1), gauss(MEAN_MS,STD_MS) (STD_MS ≥ 0), \
                     episodes(EVERY,LENGTH,SLOWDOWN) (1 ≤ EVERY, LENGTH ≤ EVERY, SLOWDOWN ≥ 1), \
                     contention(THREADS) (1 to 1024), \
                     trace(PATH[,WORKER]) (a file of slowdown factors ≥ 1, one a line, or a \
                     `falcon train --metrics` file and the worker to replay, default the slowest)";

/// How one worker is made slow. See the [module documentation](self).
///
/// In a configuration file it is the string form, or a table tagged by `kind` with the
/// variant's fields (`{ kind = "episodes", every = 10, length = 2, slowdown = 3 }`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
// The table form is derived here, as inherent functions (`remote = "Self"`); the trait
// implementations below accept the string form too, and validate.
#[serde(
    remote = "Self",
    tag = "kind",
    rename_all = "snake_case",
    deny_unknown_fields
)]
pub enum Hetero {
    /// Full speed.
    #[default]
    None,
    /// Runs at fraction `h` of full speed: after an iteration of duration d, sleep
    /// (1/h − 1)·d (the Falcon authors' demo code).
    Ratio {
        /// Relative speed, in (0, 1].
        h: f64,
    },
    /// After every iteration, sleep max(0, N(mean, std)) milliseconds, drawn from the seed
    /// (FluentPS's injection).
    Gaussian {
        /// Mean sleep in milliseconds (finite).
        mean_ms: f64,
        /// Standard deviation in milliseconds (finite, ≥ 0).
        std_ms: f64,
    },
    /// On/off transient slowdowns: iterations k with `k mod every < length` run `slowdown`
    /// times slower (sleep (slowdown − 1)·d).
    Episodes {
        /// Period in iterations (≥ 1).
        every: u64,
        /// Slow iterations at the start of each period (≤ every).
        length: u64,
        /// Slowdown factor of a slow iteration (finite, ≥ 1).
        slowdown: f64,
    },
    /// CPU contention: this many threads burn CPU for as long as the [`Injector`] lives.
    Contention {
        /// How many burning threads (1 to [`MAX_CONTENTION_THREADS`]).
        threads: usize,
    },
    /// A measured trace (see [Measured traces](self#measured-traces)): iteration k runs
    /// `factors[k mod len]` times slower (sleep (factor − 1)·d). Build it with
    /// [`Hetero::load_trace`] or [`Hetero::parse`].
    Trace {
        /// The file the factors were read from (the string form prints it back).
        path: PathBuf,
        /// The worker of a metrics file whose iterations were taken (`None`: the slowest;
        /// always `None` for a plain-text file).
        #[serde(default)]
        worker: Option<u32>,
        /// The slowdown factors, in iteration order (at least one; each finite and ≥ 1;
        /// read from `path` when the table form is read).
        #[serde(skip)]
        factors: Arc<[f64]>,
    },
}

fn config(spec: &str, why: &str) -> Error {
    Error::Config(format!(
        "heterogeneity `{spec}`: {why}; accepted forms: {FORMS}"
    ))
}

impl Hetero {
    /// Parses the string forms of the [module documentation](self) (case-insensitive,
    /// whitespace ignored; `ratio(H)` and `gaussian(…)` are accepted as aliases). Anything
    /// else is an [`Error::Config`] listing the accepted forms.
    pub fn parse(spec: &str) -> Result<Hetero> {
        if let Some(inner) = trace_args(spec) {
            let inner = inner.ok_or_else(|| config(spec, "trace(PATH[,WORKER]) lacks its ')'"))?;
            let (path, worker) = split_trace_args(inner).map_err(|why| config(spec, &why))?;
            let factors = read_trace(path, worker).map_err(|why| config(spec, &why))?;
            return Ok(Hetero::Trace {
                path: path.to_path_buf(),
                worker,
                factors,
            });
        }
        let s: String = spec
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .to_ascii_lowercase();
        let number = |text: &str| -> Result<f64> {
            text.parse::<f64>()
                .map_err(|_| config(spec, &format!("`{text}` is not a number")))
        };
        let integer = |text: &str| -> Result<u64> {
            text.parse::<u64>()
                .map_err(|_| config(spec, &format!("`{text}` is not a whole number")))
        };
        let parsed = if s == "none" {
            Hetero::None
        } else if let Some(h) = s.strip_prefix("h=") {
            Hetero::Ratio { h: number(h)? }
        } else if let Some((name, args)) = s.strip_suffix(')').and_then(|call| call.split_once('('))
        {
            let args: Vec<&str> = args.split(',').collect();
            let arity = |n: usize| -> Result<()> {
                if args.len() == n {
                    Ok(())
                } else {
                    Err(config(
                        spec,
                        &format!("{name} takes {n} argument(s), got {}", args.len()),
                    ))
                }
            };
            match name {
                "ratio" => {
                    arity(1)?;
                    Hetero::Ratio {
                        h: number(args[0])?,
                    }
                }
                "gauss" | "gaussian" => {
                    arity(2)?;
                    Hetero::Gaussian {
                        mean_ms: number(args[0])?,
                        std_ms: number(args[1])?,
                    }
                }
                "episodes" => {
                    arity(3)?;
                    Hetero::Episodes {
                        every: integer(args[0])?,
                        length: integer(args[1])?,
                        slowdown: number(args[2])?,
                    }
                }
                "contention" => {
                    arity(1)?;
                    Hetero::Contention {
                        threads: usize::try_from(integer(args[0])?)
                            .map_err(|_| config(spec, "too many threads"))?,
                    }
                }
                _ => return Err(config(spec, &format!("unknown kind `{name}`"))),
            }
        } else {
            return Err(config(spec, "not understood"));
        };
        parsed.validate().map_err(|why| config(spec, &why))?;
        Ok(parsed)
    }

    /// The measured trace in the file at `path` (see [Measured traces](self#measured-traces)):
    /// its factors, or, for a metrics file, those of `worker` (`None`: the slowest). A bad file
    /// is an [`Error::Config`] saying what is wrong and where.
    pub fn load_trace(path: impl AsRef<Path>, worker: Option<u32>) -> Result<Hetero> {
        let path = path.as_ref();
        let factors = read_trace(path, worker).map_err(|why| {
            let spec = match worker {
                Some(w) => format!("trace({},{w})", path.display()),
                None => format!("trace({})", path.display()),
            };
            config(&spec, &why)
        })?;
        Ok(Hetero::Trace {
            path: path.to_path_buf(),
            worker,
            factors,
        })
    }

    /// Checks the ranges documented on each variant.
    fn validate(&self) -> std::result::Result<(), String> {
        match *self {
            Hetero::None => Ok(()),
            Hetero::Ratio { h } if !(h > 0.0 && h <= 1.0) => {
                Err(format!("h = {h} is outside (0, 1]"))
            }
            Hetero::Trace { ref factors, .. } => check_factors(factors),
            Hetero::Gaussian { mean_ms, std_ms }
                if !mean_ms.is_finite() || !std_ms.is_finite() || std_ms < 0.0 =>
            {
                Err(format!(
                    "mean {mean_ms} ms must be finite and std {std_ms} ms finite and ≥ 0"
                ))
            }
            Hetero::Episodes {
                every,
                length,
                slowdown,
            } if every == 0 || length > every || !(slowdown.is_finite() && slowdown >= 1.0) => {
                Err(format!(
                    "episodes need every ≥ 1 (got {every}), length ≤ every (got {length}) and \
                     a finite slowdown ≥ 1 (got {slowdown})"
                ))
            }
            Hetero::Contention { threads } if threads == 0 || threads > MAX_CONTENTION_THREADS => {
                Err(format!(
                    "{threads} contention threads; use 1 to {MAX_CONTENTION_THREADS} (or none)"
                ))
            }
            _ => Ok(()),
        }
    }

    /// True for the multiplicative slowdowns ([`Hetero::Ratio`], [`Hetero::Episodes`],
    /// [`Hetero::Trace`]): the
    /// trainer applies them to each task (a slow machine computes every task slowly, so its
    /// unprocessed tasks wait in its queue where helpers can take them), the others once per
    /// iteration. `delay` is linear in `compute` for these, so the iteration's total sleep is
    /// the same either way.
    pub fn per_task(&self) -> bool {
        matches!(
            self,
            Hetero::Ratio { .. } | Hetero::Episodes { .. } | Hetero::Trace { .. }
        )
    }

    /// The sleep injected after iteration `iter` whose compute took `compute`, for a worker
    /// seeded with `seed`. Pure: the same arguments always give the same delay, whatever was
    /// asked before. [`Hetero::Contention`] and [`Hetero::None`] give zero.
    pub fn delay(&self, seed: u64, iter: u64, compute: Duration) -> Duration {
        match *self {
            Hetero::Trace { ref factors, .. } => {
                // Validated factors are ≥ 1 and finite; a hand-built empty trace is no delay.
                let Some(len) = u64::try_from(factors.len()).ok().filter(|&l| l > 0) else {
                    return Duration::ZERO;
                };
                let f = factors[(iter % len) as usize];
                times(compute, f - 1.0)
            }
            Hetero::None | Hetero::Contention { .. } => Duration::ZERO,
            Hetero::Ratio { h } => times(compute, 1.0 / h - 1.0),
            Hetero::Gaussian { mean_ms, std_ms } => {
                let z = standard_normal(&mut fastrand::Rng::with_seed(mix(seed, iter)));
                secs((mean_ms + std_ms * z).max(0.0) / 1e3)
            }
            Hetero::Episodes {
                every,
                length,
                slowdown,
            } => {
                if iter % every < length {
                    times(compute, slowdown - 1.0)
                } else {
                    Duration::ZERO
                }
            }
        }
    }
}

/// `d · f` (`f` below 0 or NaN counts as 0), like `Duration::mul_f64` without its panic on
/// overflow: a valid spec with a huge factor (`h=1e-300`, `episodes(1,1,1e300)`) saturates.
fn times(d: Duration, f: f64) -> Duration {
    secs(d.as_secs_f64() * f.max(0.0))
}

/// `Duration::from_secs_f64` without its panic on overflow: too long saturates.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

/// Recognises `trace(…)` (the name case-insensitive, spaces around it ignored): `None` when
/// `spec` is not a trace, `Some(None)` when its `)` is missing, else the text between the
/// parentheses, verbatim (paths keep their case and inner spaces).
fn trace_args(spec: &str) -> Option<Option<&str>> {
    let (name, rest) = spec.trim().split_once('(')?;
    if !name.trim().eq_ignore_ascii_case("trace") {
        return None;
    }
    Some(rest.strip_suffix(')'))
}

/// Splits `PATH[,WORKER]`: the text after the last comma is the worker when it looks like a
/// whole number (digits, maybe signed), else part of the path.
fn split_trace_args(inner: &str) -> std::result::Result<(&Path, Option<u32>), String> {
    let (path, worker) = match inner.rsplit_once(',') {
        Some((path, w))
            if {
                let w = w.trim();
                let digits = w.strip_prefix(['+', '-']).unwrap_or(w);
                !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
            } =>
        {
            let w = w.trim();
            let worker = w
                .parse::<u32>()
                .map_err(|_| format!("worker `{w}` is not a worker rank"))?;
            (path.trim(), Some(worker))
        }
        _ => (inner.trim(), None),
    };
    if path.is_empty() {
        return Err("trace needs a file: trace(PATH[,WORKER])".into());
    }
    Ok((Path::new(path), worker))
}

/// Factors must be at least one, each finite and ≥ 1.
fn check_factors(factors: &[f64]) -> std::result::Result<(), String> {
    if factors.is_empty() {
        return Err("the trace is empty (no factors)".into());
    }
    match factors.iter().position(|f| !(f.is_finite() && *f >= 1.0)) {
        Some(i) => Err(format!(
            "factor {} (the {}th) must be finite and ≥ 1",
            factors[i],
            i + 1
        )),
        None => Ok(()),
    }
}

/// Reads a trace file (see [Measured traces](self#measured-traces)); the error says what is
/// wrong, with the file and line.
fn read_trace(path: &Path, worker: Option<u32>) -> std::result::Result<Arc<[f64]>, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read trace file {shown}: {e}"))?;
    let first = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'));
    let factors = if first.is_some_and(|l| l.starts_with('{')) {
        metrics_factors(&text, worker).map_err(|why| format!("metrics file {shown}: {why}"))?
    } else {
        if let Some(w) = worker {
            return Err(format!(
                "trace file {shown} is a list of factors, not a metrics file: worker {w} \
                 does not apply"
            ));
        }
        plain_factors(&text).map_err(|why| format!("trace file {shown}: {why}"))?
    };
    check_factors(&factors).map_err(|why| format!("trace file {shown}: {why}"))?;
    Ok(factors.into())
}

/// One factor per line; blank lines and `#` comments ignored.
fn plain_factors(text: &str) -> std::result::Result<Vec<f64>, String> {
    let mut factors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line
            .split_once('#')
            .map_or(line, |(before, _)| before)
            .trim();
        if line.is_empty() {
            continue;
        }
        let f: f64 = line
            .parse()
            .map_err(|_| format!("line {}: `{line}` is not a number", i + 1))?;
        if !(f.is_finite() && f >= 1.0) {
            return Err(format!(
                "line {}: factor {f} must be finite and ≥ 1 (a slowdown)",
                i + 1
            ));
        }
        factors.push(f);
    }
    Ok(factors)
}

/// The fields of a `falcon train --metrics` line the trace needs (others are ignored).
#[derive(Deserialize)]
struct MetricsLine {
    worker: u32,
    iteration: u64,
    compute_s: f64,
    injected_s: f64,
    /// The iteration as the job saw it (compute and injected slowness); older files lack it.
    #[serde(default)]
    iteration_s: Option<f64>,
}

/// The median of `xs` (not empty): the mean of the two middle values when even.
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

/// A metrics file's factors for `worker` (`None`: the slowest).
fn metrics_factors(text: &str, worker: Option<u32>) -> std::result::Result<Vec<f64>, String> {
    // Per worker, its (iteration, compute + injected seconds), in file order.
    let mut per: BTreeMap<u32, Vec<(u64, f64)>> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let m: MetricsLine = serde_json::from_str(line)
            .map_err(|e| format!("line {}: not a metrics object: {e}", i + 1))?;
        let secs = m.iteration_s.unwrap_or(m.compute_s + m.injected_s);
        if !(m.compute_s >= 0.0 && m.injected_s >= 0.0 && secs.is_finite() && secs >= 0.0) {
            return Err(format!(
                "line {}: compute_s {} and injected_s {} must be finite and ≥ 0",
                i + 1,
                m.compute_s,
                m.injected_s
            ));
        }
        per.entry(m.worker).or_default().push((m.iteration, secs));
    }
    let total = |lines: &[(u64, f64)]| lines.iter().map(|&(_, s)| s).sum::<f64>();
    let chosen = match worker {
        Some(w) => w,
        None => {
            let mut slowest: Option<(u32, f64)> = None;
            for (&w, lines) in &per {
                let t = total(lines);
                if slowest.is_none_or(|(_, best)| t > best) {
                    slowest = Some((w, t));
                }
            }
            slowest.ok_or("no iterations (empty trace)")?.0
        }
    };
    let Some(lines) = per.get(&chosen) else {
        let known: Vec<String> = per.keys().map(u32::to_string).collect();
        return Err(if known.is_empty() {
            "no iterations (empty trace)".into()
        } else {
            format!(
                "no iterations of worker {chosen} (the file has workers {})",
                known.join(", ")
            )
        });
    };
    let mut fastest: Option<f64> = None;
    for lines in per.values() {
        let secs: Vec<f64> = lines.iter().map(|&(_, s)| s).collect();
        let m = median(&secs);
        if fastest.is_none_or(|best| m < best) {
            fastest = Some(m);
        }
    }
    let reference = fastest.unwrap_or(0.0);
    if reference <= 0.0 {
        return Err(format!(
            "the fastest worker's median iteration takes {reference} s: no reference speed"
        ));
    }
    let mut lines = lines.clone();
    lines.sort_by_key(|&(iteration, _)| iteration);
    let factors: Vec<f64> = lines
        .iter()
        .map(|&(_, s)| (s / reference).max(1.0))
        .collect();
    if let Some(&f) = factors.iter().find(|f| !f.is_finite()) {
        return Err(format!(
            "an iteration of worker {chosen} is {f} times the fastest worker's median"
        ));
    }
    Ok(factors)
}

/// SplitMix64 of `seed` and `iter`: independent-looking streams per (worker, iteration).
fn mix(seed: u64, iter: u64) -> u64 {
    let mut z = seed ^ iter.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One N(0, 1) draw (Box–Muller).
fn standard_normal(rng: &mut fastrand::Rng) -> f64 {
    let u1 = 1.0 - rng.f64(); // (0, 1], so ln is finite
    let u2 = rng.f64();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl fmt::Display for Hetero {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hetero::None => write!(f, "none"),
            Hetero::Ratio { h } => write!(f, "h={h}"),
            Hetero::Gaussian { mean_ms, std_ms } => write!(f, "gauss({mean_ms},{std_ms})"),
            Hetero::Episodes {
                every,
                length,
                slowdown,
            } => write!(f, "episodes({every},{length},{slowdown})"),
            Hetero::Contention { threads } => write!(f, "contention({threads})"),
            Hetero::Trace {
                path, worker: None, ..
            } => write!(f, "trace({})", path.display()),
            Hetero::Trace {
                path,
                worker: Some(w),
                ..
            } => write!(f, "trace({},{w})", path.display()),
        }
    }
}

/// Assigns heterogeneity to the workers of a job of `workers` from entries `RANKS:SPEC`,
/// where RANKS is a worker rank `N`, a range `A-B` or `*` (every worker); later entries win.
/// Workers no entry names run at full speed. A rank that is not a worker of the job, a
/// missing `:` or a bad spec is an [`Error::Config`] naming the entry and saying what is
/// wrong.
pub fn assign<S: AsRef<str>>(workers: u32, entries: &[S]) -> Result<Vec<Hetero>> {
    let mut out = vec![Hetero::None; workers as usize];
    assign_onto(&mut out, entries)?;
    Ok(out)
}

/// As [`assign`], onto `base` (one spec per worker of the job): the workers the entries
/// name get their spec, the others keep theirs.
pub fn assign_onto<S: AsRef<str>>(base: &mut [Hetero], entries: &[S]) -> Result<()> {
    let workers = u32::try_from(base.len()).unwrap_or(u32::MAX);
    let out = base;
    for entry in entries {
        let entry = entry.as_ref().trim();
        let bad = |why: String| Error::Config(format!("heterogeneity entry `{entry}`: {why}"));
        let (ranks, spec) = entry.split_once(':').ok_or_else(|| {
            bad(
                "expected RANKS:SPEC, e.g. 3:h=0.25 (RANKS: a worker rank N, a range A-B or *)"
                    .into(),
            )
        })?;
        let spec = Hetero::parse(spec)?;
        let (lo, hi) = falcon_engine::checks::worker_ranks(ranks, workers).map_err(bad)?;
        for slot in &mut out[lo as usize..=hi as usize] {
            *slot = spec.clone();
        }
    }
    Ok(())
}

/// The entries of a `;`-separated list such as `FALCON_HETERO` (`0:h=0.5;2-3:gauss(5,2)`),
/// without empty ones.
pub fn split_entries(list: &str) -> Vec<&str> {
    list.split(';')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect()
}

impl FromStr for Hetero {
    type Err = Error;
    fn from_str(s: &str) -> Result<Hetero> {
        Hetero::parse(s)
    }
}

impl From<Hetero> for String {
    fn from(h: Hetero) -> String {
        h.to_string()
    }
}

/// What serde reads: the string form, or a table tagged by `kind`.
#[derive(Deserialize)]
#[serde(untagged)]
enum HeteroRepr {
    Text(String),
    Table(#[serde(deserialize_with = "Hetero::deserialize")] Hetero),
}

impl<'de> Deserialize<'de> for Hetero {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Hetero, D::Error> {
        let h = match HeteroRepr::deserialize(d)? {
            HeteroRepr::Text(s) => Hetero::parse(&s),
            HeteroRepr::Table(Hetero::Trace { path, worker, .. }) => {
                Hetero::load_trace(path, worker)
            }
            HeteroRepr::Table(h) => match h.validate() {
                Ok(()) => Ok(h),
                Err(why) => Err(config(&h.to_string(), &why)),
            },
        };
        h.map_err(serde::de::Error::custom)
    }
}

impl Serialize for Hetero {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Threads that burn CPU until dropped (then they stop and are joined).
#[derive(Debug)]
pub struct Contention {
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
}

impl Contention {
    /// Starts `threads` burning threads, named `falcon-burn-<i>`. Failing to spawn is an
    /// [`Error::Io`] (the threads already started are stopped).
    pub fn start(threads: usize) -> Result<Contention> {
        let mut contention = Contention {
            stop: Arc::new(AtomicBool::new(false)),
            handles: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let stop = Arc::clone(&contention.stop);
            let handle = thread::Builder::new()
                .name(format!("falcon-burn-{i}"))
                .spawn(move || burn(&stop))?;
            contention.handles.push(handle);
        }
        Ok(contention)
    }

    /// How many threads are burning.
    pub fn threads(&self) -> usize {
        self.handles.len()
    }
}

fn burn(stop: &AtomicBool) {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    // Relaxed: the flag carries no data, and the loop only has to see it eventually.
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        std::hint::black_box(x);
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

/// One worker's injector: a [`Hetero`] spec, its seed, and the contention threads it owns.
#[derive(Debug)]
pub struct Injector {
    spec: Hetero,
    seed: u64,
    contention: Option<Contention>,
}

impl Injector {
    /// An injector for `spec` seeded with `seed` (give each worker its own, e.g. base seed +
    /// rank). A [`Hetero::Contention`] spec starts its threads now; they stop when the
    /// injector is dropped. Failing to spawn them is an [`Error::Io`].
    pub fn new(spec: Hetero, seed: u64) -> Result<Injector> {
        let contention = match spec {
            Hetero::Contention { threads } => Some(Contention::start(threads)?),
            _ => None,
        };
        Ok(Injector {
            spec,
            seed,
            contention,
        })
    }

    /// The spec.
    pub fn spec(&self) -> &Hetero {
        &self.spec
    }

    /// How many contention threads this injector runs (0 unless the spec is contention).
    pub fn contention_threads(&self) -> usize {
        self.contention.as_ref().map_or(0, Contention::threads)
    }

    /// The delay [`after_iteration`](Self::after_iteration) would sleep, without sleeping
    /// (see [`Hetero::delay`]).
    pub fn delay(&self, iter: u64, compute: Duration) -> Duration {
        self.spec.delay(self.seed, iter, compute)
    }

    /// Sleeps the delay for iteration `iter` whose compute took `compute`, and returns it.
    pub fn after_iteration(&self, iter: u64, compute: Duration) -> Duration {
        let delay = self.delay(iter, compute);
        if !delay.is_zero() {
            thread::sleep(delay);
        }
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_reads_the_string_or_the_table_form_and_checks_both() {
        let read = |json: &str| serde_json::from_str::<Hetero>(json);
        assert_eq!(read(r#""h=0.5""#).unwrap(), Hetero::Ratio { h: 0.5 });
        assert_eq!(
            read(r#"{"kind": "episodes", "every": 10, "length": 2, "slowdown": 3}"#).unwrap(),
            Hetero::Episodes {
                every: 10,
                length: 2,
                slowdown: 3.0
            }
        );
        assert_eq!(read(r#"{"kind": "none"}"#).unwrap(), Hetero::None);
        // Checked as the string form is: a speed above 1, a field it does not have, a
        // trace file that is not there.
        let bad = |json: &str| read(json).unwrap_err().to_string();
        assert!(bad(r#"{"kind": "ratio", "h": 2}"#).contains("accepted forms"));
        assert!(bad(r#""h=2""#).contains("accepted forms"));
        assert!(read(r#"{"kind": "ratio", "h": 0.5, "x": 1}"#).is_err());
        assert!(bad(r#"{"kind": "trace", "path": "/nonexistent/trace"}"#).contains("trace"));
        // Written back as the string form.
        let h = Hetero::Gaussian {
            mean_ms: 5.0,
            std_ms: 1.0,
        };
        let text = serde_json::to_string(&h).unwrap();
        assert_eq!(read(&text).unwrap(), h);
    }

    #[test]
    fn assignments_name_workers_of_the_job() {
        let h = assign(4, &["1:h=0.5", "2-3:gauss(5,2)", "3:none"]).unwrap();
        assert_eq!(h[0], Hetero::None);
        assert_eq!(h[1], Hetero::Ratio { h: 0.5 });
        assert!(matches!(h[2], Hetero::Gaussian { .. }));
        assert_eq!(h[3], Hetero::None);
        assert!(
            assign(3, &["*:h=0.5"])
                .unwrap()
                .iter()
                .all(|x| *x == Hetero::Ratio { h: 0.5 })
        );
        for (entries, says) in [
            (
                &["7:h=0.25"][..],
                "entry `7:h=0.25`: worker 7 is out of range: this job has 2 worker(s), ranks 0 to 1",
            ),
            (&["1-5:h=0.25"], "worker 5 is out of range"),
            (&["h=0.25"], "expected RANKS:SPEC"),
            (&["x:h=0.25"], "`x` is not a worker rank"),
            (&["1-0:h=0.25"], "the range 1-0 is empty"),
            (&["1:h=2"], "h = 2 is outside (0, 1]"),
        ] {
            let e = assign(2, entries).unwrap_err().to_string();
            assert!(e.contains(says), "{entries:?}: {e}");
        }
        assert_eq!(split_entries(" 0:h=0.5 ;; 1:none;"), ["0:h=0.5", "1:none"]);
    }
    use std::sync::atomic::AtomicU64;

    const MS: Duration = Duration::from_millis(1);

    /// A file under the system's temporary directory with `text`, unique to this test run;
    /// removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str) -> TempFile {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir()
                .join(format!("falcon-trace-{}-{n}-{name}", std::process::id()));
            std::fs::write(&path, text).expect("write a temporary trace");
            TempFile(path)
        }

        fn spec(&self) -> String {
            format!("trace({})", self.0.display())
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn factors(h: &Hetero) -> Vec<f64> {
        match h {
            Hetero::Trace { factors, .. } => factors.to_vec(),
            other => panic!("not a trace: {other:?}"),
        }
    }

    fn config_message(r: Result<Hetero>) -> String {
        match r {
            Err(Error::Config(msg)) => msg,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    /// A metrics line as `falcon train --metrics` writes it.
    fn metrics_line(worker: u32, iteration: u64, compute: f64, injected: f64) -> String {
        serde_json::json!({
            "t": 0.5,
            "worker": worker,
            "iteration": iteration,
            "compute_s": compute,
            "blocked_s": 0.0,
            "injected_s": injected,
            "helping_s": 0.0,
            "threads": 1,
            "tasks_own": 4,
            "tasks_helped": 0,
            "loss": 2.3,
            "bytes": 100,
        })
        .to_string()
    }

    #[test]
    fn plain_trace_parses_skipping_comments_and_blank_lines() {
        let f = TempFile::new(
            "plain.txt",
            "# measured on host 3\n1\n\n  2.5  # a slow one\n1.25\n#end\n",
        );
        let h = Hetero::parse(&f.spec()).unwrap();
        assert_eq!(factors(&h), [1.0, 2.5, 1.25]);
        assert!(h.per_task());
        assert_eq!(
            h,
            Hetero::Trace {
                path: f.0.clone(),
                worker: None,
                factors: vec![1.0, 2.5, 1.25].into(),
            }
        );
        // The kind's name is case-insensitive and spaces around the path are trimmed.
        let loose = format!("  TRACE( {} ) ", f.0.display());
        assert_eq!(Hetero::parse(&loose).unwrap(), h);
        assert_eq!(Hetero::load_trace(&f.0, None).unwrap(), h);
    }

    #[test]
    fn delays_follow_the_factors_cyclically() {
        let h = Hetero::Trace {
            path: "x".into(),
            worker: None,
            factors: vec![1.0, 3.0, 1.5].into(),
        };
        let d = 100 * MS;
        let want = [0, 200, 50];
        for k in 0..12u64 {
            assert_eq!(
                h.delay(k ^ 0x55, k, d),
                want[(k % 3) as usize] * MS,
                "iteration {k}"
            );
        }
        // Linear in compute, like Ratio: the same total whether applied per task or once.
        assert_eq!(h.delay(0, 1, 10 * MS), 20 * MS);
        // A huge factor saturates instead of panicking.
        let huge = Hetero::Trace {
            path: "x".into(),
            worker: None,
            factors: vec![1e300].into(),
        };
        assert_eq!(huge.delay(0, 0, Duration::from_secs(1)), Duration::MAX);
    }

    #[test]
    fn metrics_trace_takes_the_slowest_worker_relative_to_the_fastest_median() {
        // Worker 0: iterations of 0.1, 0.1, 0.3 s (median 0.1); worker 1: 0.2, 0.4, 0.1 s
        // (compute + injected), written out of order; worker 2: 0.15 s each.
        let mut lines = vec![
            metrics_line(0, 0, 0.1, 0.0),
            metrics_line(1, 1, 0.1, 0.3),
            metrics_line(2, 0, 0.15, 0.0),
            metrics_line(0, 1, 0.1, 0.0),
            metrics_line(1, 0, 0.05, 0.15),
            metrics_line(0, 2, 0.2, 0.1),
            metrics_line(2, 1, 0.15, 0.0),
            metrics_line(1, 2, 0.1, 0.0),
            metrics_line(2, 2, 0.15, 0.0),
        ];
        lines.push(String::new());
        let f = TempFile::new("metrics.jsonl", &lines.join("\n"));
        let close = |got: Vec<f64>, want: &[f64]| {
            assert_eq!(got.len(), want.len(), "{got:?}");
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-9, "{got:?} != {want:?}");
            }
        };
        // Default: worker 1 (0.7 s in all), relative to worker 0's median 0.1 s.
        let slowest = Hetero::parse(&f.spec()).unwrap();
        close(factors(&slowest), &[2.0, 4.0, 1.0]);
        assert!(matches!(slowest, Hetero::Trace { worker: None, .. }));
        // A named worker; below-reference iterations are clamped to 1.
        let w0 = Hetero::parse(&format!("trace({},0)", f.0.display())).unwrap();
        close(factors(&w0), &[1.0, 1.0, 3.0]);
        assert!(matches!(
            w0,
            Hetero::Trace {
                worker: Some(0),
                ..
            }
        ));
        let w2 = Hetero::load_trace(&f.0, Some(2)).unwrap();
        close(factors(&w2), &[1.5, 1.5, 1.5]);
        assert_eq!(w2.to_string(), format!("trace({},2)", f.0.display()));
    }

    #[test]
    fn bad_trace_files_are_descriptive_config_errors() {
        let missing = std::env::temp_dir().join("falcon-trace-no-such-file.txt");
        let msg = config_message(Hetero::parse(&format!("trace({})", missing.display())));
        assert!(msg.contains("cannot read trace file"), "{msg}");
        assert!(msg.contains("no-such-file"), "{msg}");
        assert!(msg.contains("accepted forms"), "{msg}");
        let msg = config_message(Hetero::load_trace(&missing, None));
        assert!(msg.contains("cannot read trace file"), "{msg}");

        let cases = [
            ("nan.txt", "1\n2\nfast\n", "line 3: `fast` is not a number"),
            (
                "below.txt",
                "1\n0.5\n",
                "line 2: factor 0.5 must be finite and ≥ 1",
            ),
            ("inf.txt", "inf\n", "line 1: factor inf must be finite"),
            ("empty.txt", "# nothing\n\n", "empty"),
            ("zero.txt", "", "empty"),
            (
                "broken.jsonl",
                &format!("{}\n{{\"worker\": 1}}\n", metrics_line(0, 0, 0.1, 0.0)),
                "line 2: not a metrics object",
            ),
            (
                "negative.jsonl",
                &metrics_line(0, 0, -0.1, 0.0),
                "must be finite and ≥ 0",
            ),
            (
                "instant.jsonl",
                &metrics_line(0, 0, 0.0, 0.0),
                "no reference speed",
            ),
        ];
        for (name, text, want) in cases {
            let f = TempFile::new(name, text);
            let msg = config_message(Hetero::parse(&f.spec()));
            assert!(msg.contains(want), "{name}: {msg}");
            assert!(msg.contains(&f.0.display().to_string()), "{name}: {msg}");
        }

        let m = TempFile::new(
            "two.jsonl",
            &[metrics_line(0, 0, 0.1, 0.0), metrics_line(3, 0, 0.2, 0.0)].join("\n"),
        );
        let msg = config_message(Hetero::parse(&format!("trace({},7)", m.0.display())));
        assert!(msg.contains("no iterations of worker 7"), "{msg}");
        assert!(msg.contains("workers 0, 3"), "{msg}");
        let msg = config_message(Hetero::parse(&format!("trace({},-1)", m.0.display())));
        assert!(msg.contains("not a worker rank"), "{msg}");

        let plain = TempFile::new("plain.txt", "2\n");
        let msg = config_message(Hetero::parse(&format!("trace({},1)", plain.0.display())));
        assert!(msg.contains("worker 1 does not apply"), "{msg}");
        let msg = config_message(Hetero::parse(&format!("trace({}", plain.0.display())));
        assert!(msg.contains("lacks its ')'"), "{msg}");
        let msg = config_message(Hetero::parse("trace( )"));
        assert!(msg.contains("needs a file"), "{msg}");

        // Hand-built traces are checked when deserialized (the factors are re-read) and by
        // `validate`.
        let bad = Hetero::Trace {
            path: "x".into(),
            worker: None,
            factors: vec![1.0, 0.9].into(),
        };
        assert!(bad.validate().unwrap_err().contains("0.9"));
        let empty = Hetero::Trace {
            path: "x".into(),
            worker: None,
            factors: Vec::new().into(),
        };
        assert!(empty.validate().unwrap_err().contains("empty"));
        assert_eq!(empty.delay(0, 3, MS), Duration::ZERO);
    }

    #[test]
    fn trace_string_form_round_trips() {
        let f = TempFile::new("round trip Case.txt", "1.5\n2\n");
        let h = Hetero::parse(&f.spec()).unwrap();
        assert_eq!(h.to_string(), f.spec());
        assert_eq!(Hetero::parse(&h.to_string()).unwrap(), h);
        assert_eq!(h.to_string().parse::<Hetero>().unwrap(), h);

        // Serde: the string form out, the string form or a table in.
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, serde_json::to_string(&f.spec()).unwrap());
        assert_eq!(serde_json::from_str::<Hetero>(&json).unwrap(), h);
        let table = serde_json::json!({ "kind": "trace", "path": f.0 }).to_string();
        assert_eq!(serde_json::from_str::<Hetero>(&table).unwrap(), h);
        let bad = serde_json::json!({ "kind": "trace", "path": "/no/such/trace" }).to_string();
        assert!(serde_json::from_str::<Hetero>(&bad).is_err());

        // Cloning shares the factors.
        let c = h.clone();
        match (&h, &c) {
            (Hetero::Trace { factors: a, .. }, Hetero::Trace { factors: b, .. }) => {
                assert!(Arc::ptr_eq(a, b));
            }
            _ => unreachable!(),
        }

        let m = TempFile::new(
            "m.jsonl",
            &[metrics_line(0, 0, 0.1, 0.0), metrics_line(1, 0, 0.3, 0.0)].join("\n"),
        );
        for spec in [
            format!("trace({})", m.0.display()),
            format!("trace({},1)", m.0.display()),
        ] {
            let h = Hetero::parse(&spec).unwrap();
            assert_eq!(h.to_string(), spec);
            assert_eq!(Hetero::parse(&h.to_string()).unwrap(), h);
            let json = serde_json::to_string(&h).unwrap();
            assert_eq!(serde_json::from_str::<Hetero>(&json).unwrap(), h);
        }
    }
}
