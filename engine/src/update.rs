//! Update rules: how gradients become parameter changes on a server.
//!
//! Two modes: **aggregate-then-apply** (synchronous: the gradients of one clock from every
//! live worker are summed in rank order, scaled, then applied once) and **apply-per-push**
//! (asynchronous: each gradient is applied as it arrives). The exact arithmetic, which the
//! bitwise BSP test mirrors: `g = ((g_0 + g_1) + …) + g_{n-1}` elementwise in rank order; for
//! `Aggregate::Mean`, `g *= 1.0 / n` (one multiply by the reciprocal); then the optimizer.
//!
//! Denormals are flushed to zero in software (see [`keep`]): a value below the normal range
//! (about 1.2e-38) is never stored and no multiply is handed operands whose product would
//! be one. Normal values get exactly the arithmetic above.
//!
//! `GradientScale` is the seam for staleness-aware rules (DynSGD scales by 1/(d+1), ConSGD by
//! a constant): it multiplies a gradient before it is applied, given its version staleness.

use crate::rows::{Parts, Piece, RowIndex, widen};
use serde::{Deserialize, Serialize};

/// When updates are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateMode {
    /// Aggregate one clock's gradients from every live worker, then apply.
    Sync,
    /// Apply each gradient as it arrives.
    Async,
}

/// How aggregated gradients are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Aggregate {
    /// Sum.
    Sum,
    /// Mean (sum × 1/n).
    Mean,
}

/// A server-side optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Optimizer {
    /// `w -= lr · g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// `v = μ·v + g; w -= lr · v`.
    Momentum {
        /// Learning rate.
        lr: f32,
        /// Momentum μ.
        mu: f32,
    },
    /// Adam (Kingma & Ba), bias-corrected; with `wd` > 0, AdamW (Loshchilov & Hutter):
    /// `w -= lr · wd · w` before the step, as PyTorch's AdamW.
    Adam {
        /// Learning rate.
        lr: f32,
        /// β1.
        beta1: f32,
        /// β2.
        beta2: f32,
        /// ε.
        eps: f32,
        /// Decoupled weight decay (0: Adam).
        #[serde(default)]
        wd: f32,
    },
    /// Adagrad (Duchi et al.): `v += g²; w -= lr · g / (√v + ε)`, initial accumulator 0 (as
    /// PyTorch's). A zero gradient changes neither `v` nor `w`: rows a sparse push does not
    /// touch stay as they are.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// ε.
        eps: f32,
    },
    /// The workers apply their own optimizer (`local`). Under synchronous updates each
    /// step's aggregate (the mean of the workers' gradients) replaces the values, which every
    /// worker then takes as its optimizer's gradient; under asynchronous updates the servers
    /// subtract what each worker sends (the change its own optimizer made to its
    /// parameters), `w -= lr · g` at the job's fixed rate (1 / workers, as every asynchronous
    /// gradient), with no schedule.
    Local {
        /// The rate (1 as configured; the launch divides it by the workers under an
        /// asynchronous policy).
        lr: f32,
    },
}

impl Optimizer {
    /// The base learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            Optimizer::Sgd { lr }
            | Optimizer::Momentum { lr, .. }
            | Optimizer::Adam { lr, .. }
            | Optimizer::Adagrad { lr, .. }
            | Optimizer::Local { lr } => lr,
        }
    }
}

/// As the settings spell it, without the rate: `sgd`, `momentum(0.9)`,
/// `adam(0.9,0.999,0.00000001)`, `adagrad(0.0000000001)`.
impl std::fmt::Display for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Optimizer::Sgd { .. } => write!(f, "sgd"),
            Optimizer::Momentum { mu, .. } => write!(f, "momentum({mu})"),
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                wd,
                ..
            } if wd > 0.0 => write!(f, "adamw({beta1},{beta2},{eps},{wd})"),
            Optimizer::Adam {
                beta1, beta2, eps, ..
            } => write!(f, "adam({beta1},{beta2},{eps})"),
            Optimizer::Adagrad { eps, .. } => write!(f, "adagrad({eps})"),
            Optimizer::Local { .. } => write!(f, "local"),
        }
    }
}

impl Optimizer {
    /// The same optimizer at rate `lr`.
    pub fn with_lr(self, lr: f32) -> Optimizer {
        match self {
            Optimizer::Sgd { .. } => Optimizer::Sgd { lr },
            Optimizer::Momentum { mu, .. } => Optimizer::Momentum { lr, mu },
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                wd,
                ..
            } => Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                wd,
            },
            Optimizer::Adagrad { eps, .. } => Optimizer::Adagrad { lr, eps },
            Optimizer::Local { .. } => Optimizer::Local { lr },
        }
    }

    /// Its name as the settings spell it (`sgd`, `momentum`, `adam`, `adamw`, `adagrad`).
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Momentum { .. } => "momentum",
            Optimizer::Adam { wd, .. } if *wd > 0.0 => "adamw",
            Optimizer::Adam { .. } => "adam",
            Optimizer::Adagrad { .. } => "adagrad",
            Optimizer::Local { .. } => "local",
        }
    }

    /// Whether a gradient of zero leaves a value and its state as they are (SGD, Adagrad):
    /// the rule sparse row pushes need.
    pub fn zero_is_identity(&self) -> bool {
        matches!(
            self,
            Optimizer::Sgd { .. } | Optimizer::Adagrad { .. } | Optimizer::Local { .. }
        )
    }

    /// Parses an optimizer's text, given the learning rate: `sgd`, `momentum(MU)` (0 ≤ MU <
    /// 1; PyTorch's SGD with momentum, no dampening), `adam` or `adam(B1,B2,EPS)` (defaults
    /// 0.9, 0.999, 1e-8), `adamw` or `adamw(B1,B2,EPS,WD)` (PyTorch's defaults: WD 0.01).
    /// A wrong text is an [`Error::Config`](crate::Error::Config) saying what is accepted.
    pub fn parse(text: &str, lr: f32) -> Result<Optimizer, crate::Error> {
        let shown = text.trim();
        let l = shown.to_ascii_lowercase().replace(' ', "");
        let err = |why: &str| {
            crate::Error::Config(format!(
                "optimizer {shown}: {why}; the optimizers: sgd, momentum(MU), adam, \
                 adam(B1,B2,EPS), adamw, adamw(B1,B2,EPS,WD), adagrad, adagrad(EPS), local \
                 (the workers apply their own)"
            ))
        };
        let (name, args) = match l.split_once('(') {
            Some((n, rest)) => {
                let a = rest
                    .strip_suffix(')')
                    .ok_or_else(|| err("its arguments lack their ')'"))?;
                let v = a
                    .split(',')
                    .map(|x| x.parse::<f32>().ok().filter(|v| v.is_finite()))
                    .collect::<Option<Vec<f32>>>()
                    .ok_or_else(|| err("its arguments must be finite numbers"))?;
                (n, Some(v))
            }
            None => (l.as_str(), None),
        };
        match (name, args.as_deref()) {
            ("sgd", None) => Ok(Optimizer::Sgd { lr }),
            ("momentum", Some(&[mu])) if (0.0..1.0).contains(&mu) => {
                Ok(Optimizer::Momentum { lr, mu })
            }
            ("momentum", _) => Err(err("momentum takes one factor MU, 0 ≤ MU < 1")),
            ("adam", None) => Ok(Optimizer::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.0,
            }),
            ("adam", Some(&[beta1, beta2, eps]))
                if (0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2) && eps > 0.0 =>
            {
                Ok(Optimizer::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    wd: 0.0,
                })
            }
            ("adam", _) => Err(err(
                "adam takes none or three arguments: B1 and B2 in [0, 1), EPS > 0",
            )),
            ("adamw", None) => Ok(Optimizer::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.01,
            }),
            ("adamw", Some(&[beta1, beta2, eps, wd]))
                if (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && eps > 0.0
                    && wd >= 0.0 =>
            {
                Ok(Optimizer::Adam {
                    lr,
                    beta1,
                    beta2,
                    eps,
                    wd,
                })
            }
            ("adamw", _) => Err(err(
                "adamw takes none or four arguments: B1 and B2 in [0, 1), EPS > 0, WD ≥ 0",
            )),
            ("adagrad", None) => Ok(Optimizer::Adagrad { lr, eps: 1e-10 }),
            ("adagrad", Some(&[eps])) if eps > 0.0 => Ok(Optimizer::Adagrad { lr, eps }),
            ("adagrad", _) => Err(err("adagrad takes none or one argument: EPS > 0")),
            // The rate is the servers' fixed 1 (the workers' optimizers hold the real one).
            ("local", None) => Ok(Optimizer::Local { lr: 1.0 }),
            ("local", _) => Err(err("local takes no arguments")),
            _ => Err(err("unknown optimizer")),
        }
    }
}

/// The learning-rate schedule hook: the rate for update number `step` (0-based).
pub trait LrSchedule: Send + Sync {
    /// The rate to use.
    fn lr(&self, base: f32, step: u64) -> f32;
}

/// A constant rate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Constant;

impl LrSchedule for Constant {
    fn lr(&self, base: f32, _step: u64) -> f32 {
        base
    }
}

/// Step decay: × `gamma` every `every` updates.
#[derive(Clone, Copy, Debug)]
pub struct StepDecay {
    /// Updates per step.
    pub every: u64,
    /// Factor per step.
    pub gamma: f32,
}

impl LrSchedule for StepDecay {
    fn lr(&self, base: f32, step: u64) -> f32 {
        base * self.gamma.powi((step / self.every.max(1)) as i32)
    }
}

/// Scales a gradient by its staleness before it is applied (the DynSGD/ConSGD seam).
pub trait GradientScale: Send + Sync {
    /// The factor for a gradient computed `staleness` versions ago.
    fn scale(&self, staleness: u64) -> f32;
}

/// No scaling.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unscaled;

impl GradientScale for Unscaled {
    fn scale(&self, _staleness: u64) -> f32 {
        1.0
    }
}

/// DynSGD (Jiang et al., SIGMOD 2017): a gradient `d` versions stale is scaled by 1/(d+1).
#[derive(Clone, Copy, Debug, Default)]
pub struct DynSgd;

impl GradientScale for DynSgd {
    fn scale(&self, staleness: u64) -> f32 {
        1.0 / (staleness as f32 + 1.0)
    }
}

/// ConSGD: every gradient scaled by one constant server-side factor.
#[derive(Clone, Copy, Debug)]
pub struct ConSgd {
    /// The factor.
    pub factor: f32,
}

impl GradientScale for ConSgd {
    fn scale(&self, _staleness: u64) -> f32 {
        self.factor
    }
}

/// The gradient scaling of a job, as configured (it travels in the address book).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum ScaleSpec {
    /// None.
    #[default]
    Unscaled,
    /// DynSGD: 1/(d+1).
    DynSgd,
    /// ConSGD with a constant factor.
    ConSgd {
        /// The factor.
        factor: f32,
    },
}

impl ScaleSpec {
    /// How a configuration names it after its policy: `""`, `"+dynsgd"`, `"+consgd(F)"`.
    pub fn suffix(&self) -> String {
        match *self {
            ScaleSpec::Unscaled => String::new(),
            ScaleSpec::DynSgd => "+dynsgd".into(),
            ScaleSpec::ConSgd { factor } => format!("+consgd({factor})"),
        }
    }

    /// The rule.
    pub fn build(&self) -> std::sync::Arc<dyn GradientScale> {
        match *self {
            ScaleSpec::Unscaled => std::sync::Arc::new(Unscaled),
            ScaleSpec::DynSgd => std::sync::Arc::new(DynSgd),
            ScaleSpec::ConSgd { factor } => std::sync::Arc::new(ConSgd { factor }),
        }
    }
}

impl std::str::FromStr for ScaleSpec {
    type Err = crate::Error;
    /// `none`, `dynsgd`, `consgd(0.5)`. A wrong spec is an
    /// [`Error::Config`](crate::Error::Config) saying what is wrong and what is accepted.
    fn from_str(s: &str) -> Result<Self, crate::Error> {
        let shown = s.trim();
        let l = shown.to_ascii_lowercase().replace(' ', "");
        let err = |why: String| crate::Error::Config(format!("gradient scaling {shown}: {why}"));
        match l.as_str() {
            "none" | "unscaled" => return Ok(ScaleSpec::Unscaled),
            "dynsgd" => return Ok(ScaleSpec::DynSgd),
            _ => {}
        }
        let Some(rest) = l.strip_prefix("consgd") else {
            return Err(err(
                "unknown scaling; the scalings: none, dynsgd, consgd(F) (F a factor > 0)".into(),
            ));
        };
        let Some(f) = rest.strip_prefix('(').and_then(|r| r.strip_suffix(')')) else {
            return Err(err(
                "consgd takes its factor in parentheses: consgd(F), e.g. consgd(0.5)".into(),
            ));
        };
        let factor: f32 = f
            .parse()
            .map_err(|_| err(format!("the factor F must be a number, not `{f}`")))?;
        if !(factor.is_finite() && factor > 0.0) {
            return Err(err(format!(
                "the factor F = {factor} must be a finite number > 0"
            )));
        }
        Ok(ScaleSpec::ConSgd { factor })
    }
}

/// What a push asks of the update it takes part in: its learning rate and weight decay as
/// multiples of the job's (a worker's learning-rate schedule and its parameter groups' decay,
/// carried with each push; see [`crate::Worker::set_rates`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// × the job's learning rate (after the servers' own schedule).
    pub lr: f32,
    /// × the job's decoupled weight decay (AdamW; the other rules have none).
    pub wd: f32,
}

// Rates are finite numbers (`Rates::valid`; a trailer's others are none), so equality is
// an equivalence.
impl Eq for Rates {}

impl Default for Rates {
    fn default() -> Rates {
        Rates { lr: 1.0, wd: 1.0 }
    }
}

impl Rates {
    /// Whether both are finite numbers ≥ 0 (what a worker may ask for).
    pub fn valid(&self) -> bool {
        self.lr.is_finite() && self.lr >= 0.0 && self.wd.is_finite() && self.wd >= 0.0
    }
}

/// One shard's optimizer state.
pub struct ShardOptimizer {
    opt: Optimizer,
    schedule: std::sync::Arc<dyn LrSchedule>,
    m: Vec<f32>,
    v: Vec<f32>,
    step: u64,
    /// The rates the next update takes (set for each by the shard's core).
    rates: Rates,
    /// [`Optimizer::Local`] under synchronous updates: a step's aggregate replaces the
    /// values (they are the step's mean gradient, which every worker's own optimizer takes).
    assign: bool,
}

impl ShardOptimizer {
    /// State for a shard of `len` parameters.
    pub fn new(opt: Optimizer, schedule: std::sync::Arc<dyn LrSchedule>, len: usize) -> Self {
        let (m, v) = match opt {
            Optimizer::Sgd { .. } | Optimizer::Local { .. } => (Vec::new(), Vec::new()),
            Optimizer::Momentum { .. } => (vec![0.0; len], Vec::new()),
            Optimizer::Adam { .. } => (vec![0.0; len], vec![0.0; len]),
            Optimizer::Adagrad { .. } => (Vec::new(), vec![0.0; len]),
        };
        ShardOptimizer {
            opt,
            schedule,
            m,
            v,
            step: 0,
            rates: Rates::default(),
            assign: false,
        }
    }

    /// The rates the next updates take, until set again (a push's, or the default).
    pub fn set_rates(&mut self, rates: Rates) {
        self.rates = rates;
    }

    /// The rule as the next update applies it: AdamW's decay × the rates' factor.
    fn rule(&self) -> Optimizer {
        match self.opt {
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                wd,
            } if wd > 0.0 => Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                wd: wd * self.rates.wd,
            },
            o => o,
        }
    }

    /// This optimizer as the shard's update `mode` applies it: under synchronous updates
    /// [`Optimizer::Local`] leaves each step's aggregate (the mean gradient) as the values,
    /// exactly; under asynchronous ones it subtracts what each worker sends.
    pub fn for_mode(mut self, mode: UpdateMode) -> Self {
        self.assign = matches!(self.opt, Optimizer::Local { .. }) && mode == UpdateMode::Sync;
        self
    }

    /// Updates applied so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The state a checkpoint keeps: first moments, second moments, steps taken.
    pub fn state(&self) -> (&[f32], &[f32], u64) {
        (&self.m, &self.v, self.step)
    }

    /// Restores a checkpointed state; refused when its shape is not this optimizer's.
    pub fn restore(&mut self, m: &[f32], v: &[f32], step: u64) -> Result<(), String> {
        if m.len() != self.m.len() || v.len() != self.v.len() {
            return Err(format!(
                "optimizer state of {} + {} values; this optimizer keeps {} + {}",
                m.len(),
                v.len(),
                self.m.len(),
                self.v.len()
            ));
        }
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
        self.step = step;
        Ok(())
    }

    /// Applies a gradient given as some ranges of `w` (`(first, count)`, in order, possibly
    /// repeated) with their values one range after another; the rest of the gradient is
    /// zero. Under SGD and Adagrad (a zero gradient leaves a value and its state alone) this
    /// is exactly [`ShardOptimizer::apply`] of the whole gradient, at the cost of the ranges;
    /// under momentum and Adam it widens the gradient and applies that. One update either way.
    /// Under SGD and Adagrad a long packed index (a key-value request's rows) is applied in
    /// pieces shared with the process's helper threads where it has any
    /// ([`RowIndex::spread`]): the pieces' rows lie in disjoint ranges of `w`, and every
    /// float's update is the same as in one pass.
    pub fn apply_ranges(&mut self, w: &mut [f32], index: &RowIndex, values: &[f32]) {
        if self.assign {
            // The step's gradient is the rows given, zero elsewhere.
            let ranges = index.to_vec();
            return self.apply(w, &widen(w.len(), ranges.as_slice(), values));
        }
        if index.disjoint() {
            if self.opt.zero_is_identity()
                && let Some(pieces) = index.spread()
            {
                return self.apply_pieces(w, index, &pieces, values);
            }
            return self.apply_parts(w, index, values);
        }
        let ranges = index.to_vec();
        match merge_repeats(&ranges, values) {
            None => self.apply_parts(w, ranges.as_slice(), values),
            Some(Some((r, v))) => self.apply_parts(w, r.as_slice(), &v),
            // Overlapping ranges must be summed before the rule sees them.
            Some(None) => self.apply(w, &widen(w.len(), ranges.as_slice(), values)),
        }
    }

    /// Applies `values` to `parts`, none overlapping another, one part's values after
    /// another's.
    fn apply_parts<P: Parts + ?Sized>(&mut self, w: &mut [f32], parts: &P, values: &[f32]) {
        if !self.opt.zero_is_identity() {
            // A rule that moves weights without a gradient sees the whole (zero elsewhere).
            return self.apply(w, &widen(w.len(), parts, values));
        }
        let rate = self.next_rate();
        let (opt, v) = (self.rule(), &mut self.v);
        parts.each_block(|i, offs| rows_block(opt, rate, w, v, 0, offs, &values[i..]));
    }

    /// The rate of the next update and its floor ([`floor_for`]); counts the update.
    fn next_rate(&mut self) -> (f32, f32) {
        let lr = match self.opt {
            // What the workers send is applied as it is: no schedule.
            Optimizer::Local { lr } => lr,
            _ => self.schedule.lr(self.opt.lr(), self.step) * self.rates.lr,
        };
        self.step += 1;
        (lr, floor_for(lr))
    }

    /// [`ShardOptimizer::apply_parts`] of a packed index cut into `pieces`, shared with the
    /// helper threads: each piece updates its own range of `w` (and of Adagrad's state).
    fn apply_pieces(&mut self, w: &mut [f32], index: &RowIndex, pieces: &[Piece], values: &[f32]) {
        let rate = self.next_rate();
        let opt = self.rule();
        // Adagrad keeps a sum of squares per float, as long as `w`; SGD keeps nothing.
        let stateful = matches!(opt, Optimizer::Adagrad { .. });
        debug_assert!(!stateful || self.v.len() == w.len());
        let mut shares = Vec::with_capacity(pieces.len());
        let (mut rest_w, mut rest_v, mut from) = (w, self.v.as_mut_slice(), 0);
        for p in pieces {
            let (_, tail) = rest_w.split_at_mut(p.lo - from);
            let (w, tail) = tail.split_at_mut(p.hi - p.lo);
            rest_w = tail;
            let v = if stateful {
                let (_, tail) = rest_v.split_at_mut(p.lo - from);
                let (v, tail) = tail.split_at_mut(p.hi - p.lo);
                rest_v = tail;
                v
            } else {
                &mut []
            };
            from = p.hi;
            shares.push((p, w, v));
        }
        falcon_transport::spread::for_each_mut(&mut shares, |_, (p, w, v)| {
            index.each_block_in(p, |i, offs| {
                rows_block(opt, rate, w, v, p.lo, offs, &values[i..])
            })
        });
    }

    /// Applies gradient `g` (already aggregated and scaled) to `w`.
    ///
    /// Flush-to-zero in software: no multiply here is ever handed operands whose product
    /// would be denormal, and no denormal is stored (see [`keep`]). Values in the normal range
    /// are untouched, so ordinary streams get exactly the textbook arithmetic; a stream of
    /// tiny updates costs what an ordinary one does instead of several times more.
    pub fn apply(&mut self, w: &mut [f32], g: &[f32]) {
        debug_assert_eq!(w.len(), g.len());
        if self.assign {
            self.step += 1;
            w.copy_from_slice(g);
            return;
        }
        let (lr, lr_floor) = self.next_rate();
        let (opt, step) = (self.rule(), self.step);
        for_each_part(w, &mut self.m, &mut self.v, |p| {
            pulp::Arch::new().dispatch(ApplyOp {
                opt,
                lr,
                lr_floor,
                step,
                g: &g[p.at..p.at + p.w.len()],
                w: &mut *p.w,
                m: &mut *p.m,
                v: &mut *p.v,
            })
        });
    }

    /// [`ShardOptimizer::apply`] of a gradient that lies elsewhere (a worker's slot): its
    /// `w.len()` floats are read by `read(at, block)` a block of [`APPLY_BLOCK`] at a time
    /// onto the stack, each block multiplied by `scale` as [`scale_in_place`] would (unless
    /// `scale` is 1), then applied. One pass over the gradient instead of a copy and a pass
    /// over the copy; the same arithmetic, bit for bit.
    pub fn apply_blocks(
        &mut self,
        w: &mut [f32],
        scale: f32,
        read: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        if self.assign {
            self.step += 1;
            for (k, w) in w.chunks_mut(APPLY_BLOCK).enumerate() {
                read(k * APPLY_BLOCK, w);
                if scale != 1.0 {
                    scale_in_place(w, scale);
                }
            }
            return;
        }
        let (lr, lr_floor) = self.next_rate();
        let (opt, step) = (self.rule(), self.step);
        for_each_part(w, &mut self.m, &mut self.v, |p| {
            let arch = pulp::Arch::new();
            let mut block = [0f32; APPLY_BLOCK];
            for (k, w) in p.w.chunks_mut(APPLY_BLOCK).enumerate() {
                let at = k * APPLY_BLOCK;
                let n = w.len();
                let g = &mut block[..n];
                read(p.at + at, g);
                if scale != 1.0 {
                    scale_in_place(g, scale);
                }
                // Momentum keeps `m`, Adam both, Adagrad `v`; the others are empty.
                let m = match p.m.len() {
                    0 => &mut [][..],
                    _ => &mut p.m[at..at + n],
                };
                let v = match p.v.len() {
                    0 => &mut [][..],
                    _ => &mut p.v[at..at + n],
                };
                arch.dispatch(ApplyOp {
                    opt,
                    lr,
                    lr_floor,
                    step,
                    w,
                    g,
                    m,
                    v,
                });
            }
        });
    }
}

/// Floats of a shard that one thread updates at a time when a large apply is shared with
/// the process's helper threads ([`falcon_transport::spread`]); a shard of fewer than two
/// parts is updated by its caller alone. A multiple of [`APPLY_BLOCK`].
pub const SPREAD_FLOATS: usize = 64 * APPLY_BLOCK;

/// A part of a shard's update: its first float, its weights and its optimizer state (empty
/// where the rule keeps none).
struct Part<'a> {
    at: usize,
    w: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
}

/// Runs `one` on every part of `w` and its state ([`SPREAD_FLOATS`] floats a part), the
/// parts shared with the helper threads; a shard of one part is updated here, as it is.
fn for_each_part(w: &mut [f32], m: &mut [f32], v: &mut [f32], one: impl Fn(&mut Part<'_>) + Sync) {
    if w.len() <= SPREAD_FLOATS {
        return one(&mut Part { at: 0, w, m, v });
    }
    let mut parts: Vec<Part<'_>> = w
        .chunks_mut(SPREAD_FLOATS)
        .enumerate()
        .map(|(k, w)| Part {
            at: k * SPREAD_FLOATS,
            w,
            m: &mut [],
            v: &mut [],
        })
        .collect();
    // State the rule keeps is as long as `w`; state it does not keep is empty.
    for (p, m) in parts.iter_mut().zip(m.chunks_mut(SPREAD_FLOATS)) {
        p.m = m;
    }
    for (p, v) in parts.iter_mut().zip(v.chunks_mut(SPREAD_FLOATS)) {
        p.v = v;
    }
    falcon_transport::spread::for_each_mut(&mut parts, |_, p| one(p));
}

/// Floats of a gradient read onto the stack at a time by [`ShardOptimizer::apply_blocks`].
pub const APPLY_BLOCK: usize = 1024;

struct ApplyOp<'a> {
    opt: Optimizer,
    lr: f32,
    lr_floor: f32,
    step: u64,
    w: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
}

impl pulp::WithSimd for ApplyOp<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let ApplyOp {
            opt,
            lr,
            lr_floor,
            step,
            w,
            g,
            m,
            v,
        } = self;
        apply_rule(opt, lr, lr_floor, step, w, g, m, v)
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn apply_rule(
    opt: Optimizer,
    lr: f32,
    lr_floor: f32,
    step: u64,
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    match opt {
        Optimizer::Sgd { .. } | Optimizer::Local { .. } => {
            for (wi, gi) in w.iter_mut().zip(g) {
                *wi = keep(*wi - lr * keep(*gi, lr_floor), TINY);
            }
        }
        Optimizer::Momentum { mu, .. } => {
            let mu_floor = floor_for(mu);
            for ((wi, gi), vi) in w.iter_mut().zip(g).zip(m) {
                *vi = keep(mu * keep(*vi, mu_floor) + keep(*gi, TINY), TINY);
                *wi = keep(*wi - lr * keep(*vi, lr_floor), TINY);
            }
        }
        Optimizer::Adam {
            beta1,
            beta2,
            eps,
            wd,
            ..
        } => {
            if wd > 0.0 {
                // AdamW's decoupled decay, before the step (as PyTorch's).
                let keep_w = 1.0 - lr * wd;
                let w_floor = floor_for(keep_w);
                for wi in w.iter_mut() {
                    *wi = keep(keep_w * keep(*wi, w_floor), TINY);
                }
            }
            let t = step as i32;
            let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
            let (b1_floor, b2_floor) = (floor_for(beta1), floor_for(beta2));
            let g1_floor = floor_for(1.0 - beta1);
            // (1 − β2)·g·g is normal when |g| ≥ √(TINY / (1 − β2)).
            let g2_floor = floor_for(1.0 - beta2).sqrt() * (1.0 + 1e-6);
            for (((wi, gi), mi), vi) in w.iter_mut().zip(g).zip(m).zip(v) {
                *mi = keep(
                    beta1 * keep(*mi, b1_floor) + (1.0 - beta1) * keep(*gi, g1_floor),
                    TINY,
                );
                let g2 = keep(*gi, g2_floor);
                *vi = keep(beta2 * keep(*vi, b2_floor) + (1.0 - beta2) * g2 * g2, TINY);
                let step = lr * keep(*mi / c1, lr_floor) / ((*vi / c2).sqrt() + eps);
                *wi = keep(*wi - keep(step, TINY), TINY);
            }
        }
        Optimizer::Adagrad { eps, .. } => {
            // g·g is normal when |g| ≥ √TINY.
            let sq_floor = TINY.sqrt() * (1.0 + 1e-6);
            for ((wi, gi), vi) in w.iter_mut().zip(g).zip(v) {
                let g2 = keep(*gi, sq_floor);
                *vi = keep(*vi + g2 * g2, TINY);
                let step = lr * keep(*gi, lr_floor) / (vi.sqrt() + eps);
                *wi = keep(*wi - keep(step, TINY), TINY);
            }
        }
    }
}

/// Ranges that repeat, summed: `None` when no two ranges overlap (nothing to do),
/// `Some(Some(..))` the ranges with each repeated one once and its values summed in order,
/// `Some(None)` when ranges overlap without being equal (the caller widens instead).
#[allow(clippy::type_complexity)]
fn merge_repeats(
    ranges: &[(u32, u32)],
    values: &[f32],
) -> Option<Option<(Vec<(u32, u32)>, Vec<f32>)>> {
    // The common case, rows sorted and distinct, in one pass.
    if ranges.windows(2).all(|p| p[0].0 + p[0].1 <= p[1].0) {
        return None;
    }
    let mut at = Vec::with_capacity(ranges.len());
    let mut start = 0usize;
    for &(_, n) in ranges {
        at.push(start);
        start += n as usize;
    }
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].0, i));
    let overlaps = order
        .windows(2)
        .any(|p| ranges[p[0]].0 + ranges[p[0]].1 > ranges[p[1]].0);
    if !overlaps {
        return None;
    }
    let (mut out_r, mut out_v): (Vec<(u32, u32)>, Vec<f32>) = (Vec::new(), Vec::new());
    for i in order {
        let (off, n) = ranges[i];
        let src = &values[at[i]..at[i] + n as usize];
        match out_r.last() {
            Some(&(o, m)) if o == off && m == n => {
                let base = out_v.len() - n as usize;
                for (d, v) in out_v[base..].iter_mut().zip(src) {
                    *d += v;
                }
            }
            Some(&(o, m)) if o + m > off => return Some(None),
            _ => {
                out_r.push((off, n));
                out_v.extend_from_slice(src);
            }
        }
    }
    Some(Some((out_r, out_v)))
}

/// A row rule that leaves untouched rows alone (SGD, else Adagrad with its state `v`) on a
/// block of floats: `offs` their places in `w` (and `v`) plus `base`, `g` their gradients
/// (from the first). The rules are written out per element: a call per range costs more
/// than the update when ranges are single rows of one float.
#[inline(always)]
fn rows_block(
    opt: Optimizer,
    (lr, lr_floor): (f32, f32),
    w: &mut [f32],
    v: &mut [f32],
    base: usize,
    offs: &[usize],
    g: &[f32],
) {
    match opt {
        Optimizer::Adagrad { eps, .. } => {
            for (&off, &gi) in offs.iter().zip(g) {
                let k = off - base;
                adagrad_one(&mut w[k], &mut v[k], gi, lr, lr_floor, eps);
            }
        }
        _ => sgd_block(w, base, offs, &g[..offs.len()], lr, lr_floor),
    }
}

/// SGD on a block of single floats: `offs` their places in `w` plus `base`, `g` their
/// gradients. The block's steps first, in one pass over its values (several at a time), then
/// its floats' weights, in order.
#[inline(always)]
fn sgd_block(w: &mut [f32], base: usize, offs: &[usize], g: &[f32], lr: f32, lr_floor: f32) {
    let mut steps = [0f32; crate::rows::BLOCK];
    let steps = &mut steps[..offs.len()];
    for (d, &g) in steps.iter_mut().zip(g) {
        *d = lr * keep(g, lr_floor);
    }
    for (&off, &step) in offs.iter().zip(steps.iter()) {
        let wi = &mut w[off - base];
        *wi = keep(*wi - step, TINY);
    }
}

/// Adagrad on one float: its weight, its sum of squared gradients and its gradient.
#[inline(always)]
fn adagrad_one(wi: &mut f32, vi: &mut f32, gi: f32, lr: f32, lr_floor: f32, eps: f32) {
    let sq_floor = TINY.sqrt() * (1.0 + 1e-6);
    let g2 = keep(gi, sq_floor);
    *vi = keep(*vi + g2 * g2, TINY);
    let step = lr * keep(gi, lr_floor) / (vi.sqrt() + eps);
    *wi = keep(*wi - keep(step, TINY), TINY);
}

/// The smallest normal `f32`: below it a value is denormal (subnormal).
pub const TINY: f32 = f32::MIN_POSITIVE;

/// `x`, or zero where `|x| < floor`. It compiles to a compare and a mask, which cost the same
/// whatever `x` holds: flushing this way never pays the CPU's slow path for denormals, which
/// an arithmetic instruction pays whenever it reads or produces one (3× and more per float,
/// measured by the `apply_cost` example). With `floor ≥ TINY` it also clears denormal
/// inputs, as the CPU's denormals-are-zero mode would, without changing the thread's
/// floating-point environment (which the compiler assumes is the default).
#[inline(always)]
pub fn keep(x: f32, floor: f32) -> f32 {
    // On magnitudes, the order of the bit patterns is the order of the values (NaN lies
    // above infinity, so it is kept); integer compares vectorize where float selects do not.
    let mag = (x.to_bits() & 0x7fff_ffff) as i32;
    let mask = -((mag >= floor.to_bits() as i32) as i32) as u32;
    f32::from_bits(x.to_bits() & mask)
}

/// The floor under which `x` must be flushed so that `k · x` is not denormal: `TINY / |k|`,
/// a hair above against rounding, and never below `TINY` (so denormal `x` is flushed too).
/// A zero `k` gives infinity: `k · x` is zero whatever `x` is.
pub fn floor_for(k: f32) -> f32 {
    if k == 0.0 {
        return f32::INFINITY;
    }
    ((TINY / k.abs()) * (1.0 + 1e-6)).max(TINY)
}

/// Multiplies every value by `k`, flushing the ones whose product would be denormal.
pub fn scale_in_place(x: &mut [f32], k: f32) {
    let floor = floor_for(k);
    for v in x {
        *v = k * keep(*v, floor);
    }
}

/// Sums `grads` in the order given into `out`, then applies `agg` over `n` gradients: the
/// exact arithmetic of aggregate-then-apply.
pub fn aggregate<'a>(out: &mut [f32], grads: impl IntoIterator<Item = &'a [f32]>, agg: Aggregate) {
    let mut n = 0u32;
    for g in grads {
        if n == 0 {
            for (o, x) in out.iter_mut().zip(g) {
                *o = keep(*x, TINY);
            }
        } else {
            for (o, x) in out.iter_mut().zip(g) {
                *o = keep(*o + keep(*x, TINY), TINY);
            }
        }
        n += 1;
    }
    if agg == Aggregate::Mean && n > 1 {
        scale_in_place(out, 1.0 / n as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn scale_specs_say_what_is_wrong() {
        assert_eq!(
            "consgd(0.5)".parse::<ScaleSpec>().unwrap(),
            ScaleSpec::ConSgd { factor: 0.5 }
        );
        assert_eq!(" DynSGD ".parse::<ScaleSpec>().unwrap(), ScaleSpec::DynSgd);
        for (bad, says) in [
            ("consgd(0)", "the factor F = 0 must be a finite number > 0"),
            ("consgd(nan)", "must be a finite number > 0"),
            ("consgd(x)", "the factor F must be a number, not `x`"),
            ("consgd", "consgd takes its factor in parentheses"),
            (
                "adam",
                "unknown scaling; the scalings: none, dynsgd, consgd(F)",
            ),
        ] {
            let e = bad.parse::<ScaleSpec>().unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains(&format!("gradient scaling {bad}:")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn optimizers_move_downhill_on_a_quadratic() {
        // f(w) = ½‖w − 3‖²: gradient w − 3; every optimizer must approach 3.
        for opt in [
            Optimizer::Sgd { lr: 0.1 },
            Optimizer::Momentum { lr: 0.05, mu: 0.9 },
            Optimizer::Adagrad {
                lr: 0.5,
                eps: 1e-10,
            },
            Optimizer::Adam {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.0,
            },
        ] {
            let mut w = vec![0.0f32; 4];
            let mut o = ShardOptimizer::new(opt, Arc::new(Constant), 4);
            for _ in 0..500 {
                let g: Vec<f32> = w.iter().map(|x| x - 3.0).collect();
                o.apply(&mut w, &g);
            }
            assert!(w.iter().all(|x| (x - 3.0).abs() < 1e-2), "{opt:?}: {w:?}");
            assert_eq!(o.steps(), 500);
        }
    }

    fn opts() -> [Optimizer; 4] {
        [
            Optimizer::Adagrad {
                lr: 1e-3,
                eps: 1e-10,
            },
            Optimizer::Sgd { lr: 1e-3 },
            Optimizer::Momentum { lr: 1e-3, mu: 0.9 },
            Optimizer::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.0,
            },
        ]
    }

    fn no_denormals(what: &str, xs: &[f32]) {
        let bad = xs.iter().filter(|x| x.is_subnormal()).count();
        assert_eq!(bad, 0, "{what}: {bad} denormal values stored");
    }

    #[test]
    fn a_gradient_given_as_ranges_is_exactly_the_whole_gradient() {
        let mut rng = fastrand::Rng::with_seed(12);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut forms = [0; 2];
        for round in 0..200 {
            let len = rng.usize(1..60);
            let w0: Vec<f32> = (0..len).map(|_| rng.f32() - 0.5).collect();
            // Rows of 3 (the last may be cut), some repeated; every few rounds a range that
            // overlaps another without being equal.
            let mut ranges: Vec<(u32, u32)> = (0..rng.usize(0..8))
                .map(|_| {
                    let off = rng.usize(0..len) / 3 * 3;
                    (off as u32, (len - off).min(3) as u32)
                })
                .collect();
            if round % 5 == 0 && len > 2 {
                ranges.push((1, 1));
                ranges.push((0, 2));
            }
            let n: usize = ranges.iter().map(|&(_, n)| n as usize).sum();
            let values: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let mut dense = vec![0f32; len];
            let mut at = 0;
            for &(off, k) in &ranges {
                for j in 0..k as usize {
                    dense[off as usize + j] += values[at + j];
                }
                at += k as usize;
            }
            // As they travel: packed where they are sorted whole rows, else plain.
            let mut raw = Vec::new();
            let parts = || ranges.iter().map(|&(o, k)| (u64::from(o), u64::from(k)));
            crate::rows::encode_index(ranges.len() as u64, parts, &mut raw);
            let index = crate::rows::index_of_pull(raw).unwrap();
            forms[usize::from(index.disjoint())] += 1;
            for opt in opts() {
                let mut a = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let mut b = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let (mut wa, mut wb) = (w0.clone(), w0.clone());
                for _ in 0..3 {
                    a.apply_ranges(&mut wa, &index, &values);
                    b.apply(&mut wb, &dense);
                }
                assert_eq!(bits(&wa), bits(&wb), "{opt:?} {ranges:?}");
                assert_eq!(bits(a.state().1), bits(b.state().1), "{opt:?} state");
                assert_eq!(a.steps(), 3);
            }
        }
        assert!(forms.iter().all(|&k| k >= 5), "plain and packed: {forms:?}");
    }

    /// The index of `rows` (distinct, `dim` floats each) as it travels, and the dense
    /// gradient of `len` floats that `values` (one row's after another's) give them.
    fn rows_and_dense(len: usize, dim: u64, rows: &[u64], values: &[f32]) -> (RowIndex, Vec<f32>) {
        let mut dense = vec![0f32; len];
        for (k, &r) in rows.iter().enumerate() {
            for j in 0..dim as usize {
                dense[(r * dim) as usize + j] = values[k * dim as usize + j];
            }
        }
        let mut raw = Vec::new();
        let parts = || rows.iter().map(|&r| (r * dim, dim));
        crate::rows::encode_index(rows.len() as u64, parts, &mut raw);
        (crate::rows::index_of_pull(raw).unwrap(), dense)
    }

    #[test]
    fn a_long_packed_index_applies_as_the_whole_gradient_block_after_block() {
        // Sorted single floats and rows of 3 over several blocks of places, with a tail and
        // gaps of more than a byte (read one by one), under every rule.
        let mut rng = fastrand::Rng::with_seed(21);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut long = 0;
        for round in 0..40 {
            let dim = [1u64, 1, 3][round % 3];
            let table = 5_000u64;
            let len = (table * dim) as usize;
            let every = [1u64, 7, 200][round % 3];
            let mut rows: Vec<u64> = (0..rng.usize(1..1500))
                .map(|_| rng.u64(0..table) / every * every)
                .collect();
            rows.sort_unstable();
            rows.dedup();
            let n = rows.len() * dim as usize;
            let values: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
            let (index, dense) = rows_and_dense(len, dim, &rows, &values);
            if index.disjoint() && n > 2 * crate::rows::BLOCK {
                long += 1;
            }
            let w0: Vec<f32> = (0..len).map(|_| rng.f32() - 0.5).collect();
            for opt in opts() {
                let mut a = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let mut b = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let (mut wa, mut wb) = (w0.clone(), w0.clone());
                for _ in 0..2 {
                    a.apply_ranges(&mut wa, &index, &values);
                    b.apply(&mut wb, &dense);
                }
                assert_eq!(bits(&wa), bits(&wb), "{opt:?}, round {round}, {n} floats");
            }
        }
        assert!(long >= 20, "{long} packed indexes over several blocks");
    }

    #[test]
    fn a_packed_index_applied_in_pieces_is_the_whole_gradient() {
        // Pieces as the helpers take them, small here; and a request long enough to be
        // shared where the process has helpers: bit for bit the dense update.
        let mut rng = fastrand::Rng::with_seed(22);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let cases = [
            (3_000u64, 700usize, 1u64),
            (2_000, 2_000, 3),
            (1_000_000, 400_000, 1),
        ];
        for (round, (table, draws, dim)) in cases.into_iter().enumerate() {
            let mut rows: Vec<u64> = (0..draws).map(|_| rng.u64(0..table)).collect();
            rows.sort_unstable();
            rows.dedup();
            let len = (table * dim) as usize;
            let values: Vec<f32> = (0..rows.len() * dim as usize)
                .map(|_| rng.f32() - 0.5)
                .collect();
            let (index, dense) = rows_and_dense(len, dim, &rows, &values);
            let pieces = index.cut(128).unwrap();
            assert!(pieces.len() > 3, "{} pieces", pieces.len());
            let w0: Vec<f32> = (0..len).map(|_| rng.f32() - 0.5).collect();
            for opt in [
                Optimizer::Sgd { lr: 0.1 },
                Optimizer::Adagrad { lr: 0.1, eps: 1e-8 },
            ] {
                let mut a = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let mut b = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let mut c = ShardOptimizer::new(opt, Arc::new(Constant), len);
                let (mut wa, mut wb, mut wc) = (w0.clone(), w0.clone(), w0.clone());
                for _ in 0..2 {
                    a.apply_pieces(&mut wa, &index, &pieces, &values);
                    b.apply(&mut wb, &dense);
                    c.apply_ranges(&mut wc, &index, &values);
                }
                assert_eq!(bits(&wa), bits(&wb), "{opt:?}, round {round}: in pieces");
                assert_eq!(bits(&wc), bits(&wb), "{opt:?}, round {round}: apply_ranges");
                assert_eq!(bits(a.state().1), bits(b.state().1), "{opt:?} state");
                assert_eq!(a.steps(), 2);
            }
        }
    }

    #[test]
    fn a_zero_gradient_leaves_sgd_and_adagrad_rows_alone() {
        let mut rng = fastrand::Rng::with_seed(6);
        let w0: Vec<f32> = (0..64).map(|_| rng.f32() - 0.5).collect();
        for opt in opts() {
            let mut o = ShardOptimizer::new(opt, Arc::new(Constant), 64);
            let mut w = w0.clone();
            // Every row gets a gradient once; then rows 0..32 get gradients and rows 32..64
            // zeros, twice: momentum and Adam still move those rows, SGD and Adagrad do not.
            o.apply(&mut w, &[0.2; 64]);
            let w1 = w.clone();
            let g: Vec<f32> = (0..64).map(|i| if i < 32 { 0.3 } else { 0.0 }).collect();
            o.apply(&mut w, &g);
            o.apply(&mut w, &g);
            let untouched = w[32..] == w1[32..];
            assert_eq!(untouched, opt.zero_is_identity(), "{opt:?}");
            assert!(w[..32] != w1[..32], "{opt:?} moved the rows it got");
        }
        assert_eq!(
            Optimizer::parse("adagrad", 0.1).unwrap(),
            Optimizer::Adagrad {
                lr: 0.1,
                eps: 1e-10
            }
        );
        assert_eq!(
            Optimizer::parse("Adagrad(1e-8)", 0.1).unwrap(),
            Optimizer::Adagrad { lr: 0.1, eps: 1e-8 }
        );
        assert!(
            Optimizer::parse("adagrad(0)", 0.1)
                .unwrap_err()
                .to_string()
                .contains("adagrad takes none or one argument: EPS > 0")
        );
    }

    #[test]
    fn a_gradient_applied_by_blocks_is_the_whole_apply_bit_for_bit() {
        let opts = [
            Optimizer::Sgd { lr: 0.1 },
            Optimizer::Momentum { lr: 0.05, mu: 0.9 },
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                wd: 0.0,
            },
            Optimizer::Adagrad { lr: 0.1, eps: 1e-8 },
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        // Large passes shared with helper threads, where a host has them.
        falcon_transport::spread::set_helpers(2);
        // Shorter than a block, a whole block, blocks with a ragged end, and parts (shared
        // with helpers) with a ragged end.
        for len in [
            5,
            APPLY_BLOCK,
            3 * APPLY_BLOCK + 17,
            2 * SPREAD_FLOATS + 3 * APPLY_BLOCK + 17,
        ] {
            for opt in opts {
                let sched: Arc<dyn LrSchedule> = Arc::new(StepDecay {
                    every: 2,
                    gamma: 0.5,
                });
                let mut a = ShardOptimizer::new(opt, sched.clone(), len);
                let mut b = ShardOptimizer::new(opt, sched.clone(), len);
                // The rule over the whole shard at once, on this thread: the reference.
                let (mut mr, mut vr) = (a.m.clone(), a.v.clone());
                let mut wa: Vec<f32> = (0..len).map(|_| rng.f32() - 0.5).collect();
                let mut wb = wa.clone();
                let mut wr = wa.clone();
                for step in 0..5 {
                    // Ordinary values, some tiny ones (flushed) and a staleness scale.
                    let g: Vec<f32> = (0..len)
                        .map(|i| match i % 11 {
                            0 => 1e-39,
                            _ => rng.f32() * 2.0 - 1.0,
                        })
                        .collect();
                    let scale = if step % 2 == 0 { 1.0 } else { 0.25 };
                    let mut scaled = g.clone();
                    if scale != 1.0 {
                        scale_in_place(&mut scaled, scale);
                    }
                    let lr = sched.lr(opt.lr(), step);
                    apply_rule(
                        opt,
                        lr,
                        floor_for(lr),
                        step + 1,
                        &mut wr,
                        &scaled,
                        &mut mr,
                        &mut vr,
                    );
                    a.apply(&mut wa, &scaled);
                    let reads = std::sync::Mutex::new(Vec::new());
                    b.apply_blocks(&mut wb, scale, |at, out| {
                        reads.lock().unwrap().push((at, out.len()));
                        out.copy_from_slice(&g[at..at + out.len()]);
                    });
                    for (w, how) in [(&wa, "apply"), (&wb, "apply_blocks")] {
                        assert!(
                            wr.iter().zip(w).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{how}: {} at {len} floats, step {step}",
                            opt.name()
                        );
                    }
                    // Every float read once, a block at a time.
                    let mut reads = reads.into_inner().unwrap();
                    reads.sort_unstable();
                    let mut next = 0;
                    for (at, n) in reads {
                        assert_eq!(at, next);
                        assert!(n <= APPLY_BLOCK);
                        next += n;
                    }
                    assert_eq!(next, len);
                }
                assert_eq!(a.state(), b.state());
                assert_eq!(a.state(), (&mr[..], &vr[..], 5));
            }
        }
    }

    #[test]
    fn tiny_updates_are_flushed_and_no_denormal_is_stored() {
        let mut rng = fastrand::Rng::with_seed(3);
        let n = 4096;
        // Parameters at the bottom of the normal range (some already denormal, as a
        // checkpoint or an init push may hold) and steps whose products fall below it.
        let w0: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * 4e-38).collect();
        let g: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * 1e-35).collect();
        assert!(
            w0.iter().any(|x| x.is_subnormal()),
            "the stream starts denormal"
        );
        for opt in opts() {
            let mut o = ShardOptimizer::new(opt, Arc::new(Constant), n);
            let mut w = w0.clone();
            for _ in 0..5 {
                o.apply(&mut w, &g);
                no_denormals(&format!("{opt:?} parameters"), &w);
                let (m, v, _) = o.state();
                no_denormals(&format!("{opt:?} first moments"), m);
                no_denormals(&format!("{opt:?} second moments"), v);
            }
        }
        // Staleness scaling and the mean flush too.
        let mut x: Vec<f32> = g.iter().map(|v| v * 1e3).collect();
        scale_in_place(&mut x, 1e-5);
        no_denormals("a scaled gradient", &x);
        let mut out = vec![0.0; n];
        aggregate(&mut out, [w0.as_slice(), &w0, &g], Aggregate::Mean);
        no_denormals("a mean of tiny gradients", &out);
    }

    #[test]
    fn ordinary_values_get_exactly_the_textbook_arithmetic() {
        let mut rng = fastrand::Rng::with_seed(4);
        let n = 1000;
        let w0: Vec<f32> = (0..n).map(|_| rng.f32() - 0.5).collect();
        let gs: Vec<Vec<f32>> = (0..3)
            .map(|_| (0..n).map(|_| rng.f32() - 0.5).collect())
            .collect();
        for opt in opts() {
            let mut o = ShardOptimizer::new(opt, Arc::new(Constant), n);
            let mut w = w0.clone();
            let (mut rw, mut rm, mut rv) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
            for (t, g) in gs.iter().enumerate() {
                o.apply(&mut w, g);
                for i in 0..n {
                    match opt {
                        Optimizer::Sgd { lr } | Optimizer::Local { lr } => rw[i] -= lr * g[i],
                        Optimizer::Momentum { lr, mu } => {
                            rm[i] = mu * rm[i] + g[i];
                            rw[i] -= lr * rm[i];
                        }
                        Optimizer::Adam {
                            lr,
                            beta1,
                            beta2,
                            eps,
                            ..
                        } => {
                            let t = t as i32 + 1;
                            let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                            rm[i] = beta1 * rm[i] + (1.0 - beta1) * g[i];
                            rv[i] = beta2 * rv[i] + (1.0 - beta2) * g[i] * g[i];
                            rw[i] -= lr * (rm[i] / c1) / ((rv[i] / c2).sqrt() + eps);
                        }
                        Optimizer::Adagrad { lr, eps } => {
                            rv[i] += g[i] * g[i];
                            rw[i] -= lr * g[i] / (rv[i].sqrt() + eps);
                        }
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w), bits(&rw), "{opt:?}: bit for bit");
        }
    }

    #[test]
    fn a_kept_value_times_its_factor_is_never_denormal() {
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..20_000 {
            let k = f32::from_bits(rng.u32(0x0080_0000..0x7f00_0000)) * 1e-3;
            let floor = floor_for(k);
            // Values around the floor, where rounding could undershoot.
            for x in [
                floor,
                floor * (1.0 + f32::EPSILON),
                -floor,
                floor * 0.999_999,
            ] {
                let p = k * keep(x, floor);
                assert!(!p.is_subnormal(), "{k:e} × {x:e} = {p:e}");
            }
        }
        assert!(keep(f32::NAN, 1.0).is_nan(), "NaN is kept, not hidden");
        assert_eq!(keep(-0.5, 1.0), 0.0);
        assert_eq!(keep(-2.0, 1.0), -2.0);
        assert_eq!(floor_for(0.0), f32::INFINITY);
    }

    #[test]
    fn aggregate_is_rank_ordered_sum_then_reciprocal() {
        let (a, b, c) = (vec![1.0f32, 2.0], vec![3.0f32, 4.0], vec![5.0f32, 6.5]);
        let mut out = vec![0.0; 2];
        aggregate(&mut out, [a.as_slice(), &b, &c], Aggregate::Mean);
        let inv = 1.0f32 / 3.0;
        assert_eq!(
            out,
            vec![((1.0 + 3.0) + 5.0) * inv, ((2.0 + 4.0) + 6.5) * inv]
        );
        aggregate(&mut out, [a.as_slice(), &b], Aggregate::Sum);
        assert_eq!(out, vec![4.0, 6.0]);
    }

    #[test]
    fn staleness_scaling_rules() {
        assert_eq!(DynSgd.scale(0), 1.0);
        assert_eq!(DynSgd.scale(3), 0.25);
        assert_eq!(ConSgd { factor: 0.5 }.scale(9), 0.5);
        assert_eq!("dynsgd".parse::<ScaleSpec>().unwrap(), ScaleSpec::DynSgd);
        assert_eq!(
            "consgd(0.5)".parse::<ScaleSpec>().unwrap(),
            ScaleSpec::ConSgd { factor: 0.5 }
        );
        assert!("consgd(-1)".parse::<ScaleSpec>().is_err());
        assert!("bogus".parse::<ScaleSpec>().is_err());
    }

    #[test]
    fn step_decay_schedule() {
        let s = StepDecay {
            every: 10,
            gamma: 0.5,
        };
        assert_eq!(s.lr(1.0, 9), 1.0);
        assert_eq!(s.lr(1.0, 10), 0.5);
        assert_eq!(s.lr(1.0, 25), 0.25);
    }

    #[test]
    fn local_leaves_a_steps_mean_under_sync_and_subtracts_under_async() {
        let opt = Optimizer::parse("local", 0.3).unwrap();
        assert_eq!(
            opt,
            Optimizer::Local { lr: 1.0 },
            "the rate is the servers' fixed 1"
        );
        assert_eq!(opt.to_string(), "local");
        assert!(Optimizer::parse("local(2)", 1.0).is_err());
        // A schedule does not reach it: what the workers send is applied as it is.
        struct Halving;
        impl LrSchedule for Halving {
            fn lr(&self, base: f32, step: u64) -> f32 {
                base / 2f32.powi(step as i32 + 1)
            }
        }
        let g = [0.25f32, -1.5, 3.0];
        let mut sync = ShardOptimizer::new(opt, Arc::new(Halving), 3).for_mode(UpdateMode::Sync);
        let mut w = [9.0f32, 9.0, 9.0];
        sync.apply(&mut w, &g);
        assert_eq!(w, g, "sync: the values are the step's aggregate, exactly");
        sync.apply_blocks(&mut w, 0.5, |at, out| {
            out.copy_from_slice(&g[at..at + out.len()])
        });
        assert_eq!(w, [0.125, -0.75, 1.5]);
        let mut asy =
            ShardOptimizer::new(opt.with_lr(0.5), Arc::new(Halving), 3).for_mode(UpdateMode::Async);
        let mut w = [1.0f32, 1.0, 1.0];
        asy.apply(&mut w, &g);
        asy.apply(&mut w, &g);
        assert_eq!(
            w,
            [0.75, 2.5, -2.0],
            "async: w -= lr · g twice, no schedule"
        );
    }

    /// PyTorch's AdamW, one float at a time in f64: `w · (1 − lr·wd)`, then Adam's step.
    fn adamw_reference(
        w: &mut [f64],
        m: &mut [f64],
        v: &mut [f64],
        g: &[f32],
        t: i32,
        lr: f64,
        wd: f64,
    ) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
        for i in 0..w.len() {
            let gi = f64::from(g[i]);
            w[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            w[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }

    #[test]
    fn adamw_and_each_pushs_rates_follow_pytorchs_rule() {
        // Rates per update: the learning rate's factor (a worker's schedule) and the decay's
        // (0 for a group without decay), against the reference at the product rates.
        let opt = Optimizer::parse("adamw(0.9,0.999,1e-8,0.1)", 0.01).unwrap();
        let len = 3 * APPLY_BLOCK + 5;
        let mut rng = fastrand::Rng::with_seed(3);
        let mut o = ShardOptimizer::new(opt, Arc::new(Constant), len);
        let mut w: Vec<f32> = (0..len).map(|_| rng.f32() - 0.5).collect();
        let mut wr: Vec<f64> = w.iter().map(|&x| f64::from(x)).collect();
        let (mut m, mut v) = (vec![0f64; len], vec![0f64; len]);
        let rates = [(1.0, 1.0), (0.5, 1.0), (0.25, 0.0), (0.0, 1.0), (2.0, 3.0)];
        for (t, &(lr, wd)) in rates.iter().enumerate() {
            let g: Vec<f32> = (0..len).map(|_| rng.f32() * 2.0 - 1.0).collect();
            o.set_rates(Rates { lr, wd });
            if t % 2 == 0 {
                o.apply(&mut w, &g);
            } else {
                o.apply_blocks(&mut w, 1.0, |at, b| b.copy_from_slice(&g[at..at + b.len()]));
            }
            let (lr, wd) = (0.01 * f64::from(lr), 0.1 * f64::from(wd));
            adamw_reference(&mut wr, &mut m, &mut v, &g, t as i32 + 1, lr, wd);
            for (a, b) in w.iter().zip(&wr) {
                assert!(
                    (f64::from(*a) - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "update {t}: {a} vs {b}"
                );
            }
        }
        // Without decay (Adam), the decay's factor changes nothing; the rate's still does.
        let adam = Optimizer::parse("adam", 0.01).unwrap();
        let (mut a, mut b) = (
            ShardOptimizer::new(adam, Arc::new(Constant), 4),
            ShardOptimizer::new(adam.with_lr(0.005), Arc::new(Constant), 4),
        );
        let (mut wa, mut wb) = (vec![1.0f32; 4], vec![1.0f32; 4]);
        a.set_rates(Rates { lr: 0.5, wd: 7.0 });
        for _ in 0..3 {
            a.apply(&mut wa, &[0.5, -0.5, 0.1, 0.0]);
            b.apply(&mut wb, &[0.5, -0.5, 0.1, 0.0]);
        }
        assert_eq!(wa, wb);
    }

    #[test]
    fn optimizers_parse_and_refuse_with_the_accepted_forms() {
        assert_eq!(
            Optimizer::parse("sgd", 0.5).unwrap(),
            Optimizer::Sgd { lr: 0.5 }
        );
        assert_eq!(
            Optimizer::parse(" Momentum(0.9) ", 0.1).unwrap(),
            Optimizer::Momentum { lr: 0.1, mu: 0.9 }
        );
        assert_eq!(
            Optimizer::parse("adam(0.8, 0.99, 1e-6)", 0.01).unwrap(),
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.8,
                beta2: 0.99,
                eps: 1e-6,
                wd: 0.0,
            }
        );
        assert!(matches!(
            Optimizer::parse("adam", 1.0).unwrap(),
            Optimizer::Adam { .. }
        ));
        let adamw = Optimizer::parse("adamw(0.9,0.95,1e-8,0.1)", 0.01).unwrap();
        assert_eq!(
            adamw,
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                wd: 0.1,
            }
        );
        assert_eq!(adamw.name(), "adamw");
        assert_eq!(Optimizer::parse(&adamw.to_string(), 0.01).unwrap(), adamw);
        assert!(matches!(
            Optimizer::parse("adamw", 1.0).unwrap(),
            Optimizer::Adam { wd: 0.01, .. }
        ));
        for bad in [
            "rmsprop",
            "momentum",
            "momentum(1.5)",
            "adam(1,2)",
            "adamw(0.9,0.999,1e-8)",
            "adamw(0.9,0.999,1e-8,-1)",
            "sgd(0.1)",
            "momentum(0.9",
        ] {
            let e = Optimizer::parse(bad, 0.1).unwrap_err().to_string();
            assert!(e.contains("the optimizers: sgd"), "{bad}: {e}");
        }
    }
}
