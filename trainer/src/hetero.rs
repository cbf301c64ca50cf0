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
//!
//! Delays are pure functions of `(spec, seed, iteration, d)` ([`Hetero::delay`]), so a run is
//! reproducible from its seed and the simulator can ask for any iteration's delay without
//! sleeping; [`Injector::after_iteration`] is the same delay, slept.
//!
//! Specs parse from the strings above ([`Hetero::parse`], also `FromStr`), print back to them
//! (`Display`, exactly: `parse(x.to_string()) == x`), and (de)serialize with serde as that
//! string — or, when deserializing, as a table such as `{ kind = "ratio", h = 0.25 }`.

use std::fmt;
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
                     contention(THREADS) (1 to 1024)";

/// How one worker is made slow. See the [module documentation](self).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "HeteroRepr", into = "String")]
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
}

fn config(spec: &str, why: &str) -> Error {
    Error::Config(format!(
        "heterogeneity {spec:?}: {why}; accepted forms: {FORMS}"
    ))
}

impl Hetero {
    /// Parses the string forms of the [module documentation](self) (case-insensitive,
    /// whitespace ignored; `ratio(H)` and `gaussian(…)` are accepted as aliases). Anything
    /// else is an [`Error::Config`] listing the accepted forms.
    pub fn parse(spec: &str) -> Result<Hetero> {
        let s: String = spec
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .to_ascii_lowercase();
        let number = |text: &str| -> Result<f64> {
            text.parse::<f64>()
                .map_err(|_| config(spec, &format!("{text:?} is not a number")))
        };
        let integer = |text: &str| -> Result<u64> {
            text.parse::<u64>()
                .map_err(|_| config(spec, &format!("{text:?} is not a whole number")))
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
                _ => return Err(config(spec, &format!("unknown kind {name:?}"))),
            }
        } else {
            return Err(config(spec, "not understood"));
        };
        parsed.validate().map_err(|why| config(spec, &why))?;
        Ok(parsed)
    }

    /// Checks the ranges documented on each variant.
    fn validate(&self) -> std::result::Result<(), String> {
        match *self {
            Hetero::None => Ok(()),
            Hetero::Ratio { h } if !(h > 0.0 && h <= 1.0) => {
                Err(format!("h = {h} is outside (0, 1]"))
            }
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

    /// True for the multiplicative slowdowns ([`Hetero::Ratio`], [`Hetero::Episodes`]): the
    /// trainer applies them to each task (a slow machine computes every task slowly, so its
    /// unprocessed tasks wait in its queue where helpers can take them), the others once per
    /// iteration. `delay` is linear in `compute` for these, so the iteration's total sleep is
    /// the same either way.
    pub fn per_task(&self) -> bool {
        matches!(self, Hetero::Ratio { .. } | Hetero::Episodes { .. })
    }

    /// The sleep injected after iteration `iter` whose compute took `compute`, for a worker
    /// seeded with `seed`. Pure: the same arguments always give the same delay, whatever was
    /// asked before. [`Hetero::Contention`] and [`Hetero::None`] give zero.
    pub fn delay(&self, seed: u64, iter: u64, compute: Duration) -> Duration {
        match *self {
            Hetero::None | Hetero::Contention { .. } => Duration::ZERO,
            Hetero::Ratio { h } => compute.mul_f64(1.0 / h - 1.0),
            Hetero::Gaussian { mean_ms, std_ms } => {
                let z = standard_normal(&mut fastrand::Rng::with_seed(mix(seed, iter)));
                Duration::from_secs_f64((mean_ms + std_ms * z).max(0.0) / 1e3)
            }
            Hetero::Episodes {
                every,
                length,
                slowdown,
            } => {
                if iter % every < length {
                    compute.mul_f64(slowdown - 1.0)
                } else {
                    Duration::ZERO
                }
            }
        }
    }
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
        }
    }
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
    Table(HeteroTable),
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum HeteroTable {
    None,
    Ratio {
        h: f64,
    },
    Gaussian {
        mean_ms: f64,
        std_ms: f64,
    },
    Episodes {
        every: u64,
        length: u64,
        slowdown: f64,
    },
    Contention {
        threads: usize,
    },
}

impl TryFrom<HeteroRepr> for Hetero {
    type Error = Error;
    fn try_from(repr: HeteroRepr) -> Result<Hetero> {
        let table = match repr {
            HeteroRepr::Text(s) => return Hetero::parse(&s),
            HeteroRepr::Table(t) => t,
        };
        let h = match table {
            HeteroTable::None => Hetero::None,
            HeteroTable::Ratio { h } => Hetero::Ratio { h },
            HeteroTable::Gaussian { mean_ms, std_ms } => Hetero::Gaussian { mean_ms, std_ms },
            HeteroTable::Episodes {
                every,
                length,
                slowdown,
            } => Hetero::Episodes {
                every,
                length,
                slowdown,
            },
            HeteroTable::Contention { threads } => Hetero::Contention { threads },
        };
        h.validate().map_err(|why| config(&h.to_string(), &why))?;
        Ok(h)
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
