//! Models whose parameters live in one flat `&[f32]` and whose gradients go into one flat
//! `&mut [f32]` of the same length.
//!
//! A model never owns its parameters: the trainer keeps them (and the gradient buffer) in
//! regions registered with the parameter server, so pushing a gradient is zero-copy. A model
//! only knows the *layout* of that buffer — which offsets hold which layer's weights and
//! biases — and computes on views into it (ndarray views, sgemm through matrixmultiply, and a
//! hand-written backward pass that the tests check against finite differences).
//!
//! Conventions shared by every [`Model`]:
//! - `x` is `n × input_len` row-major f32 and `y` holds `n` labels, each `< classes`.
//! - [`Model::grad`] **adds** the gradient of the **sum** of the per-example cross-entropy
//!   losses into `grad`: it neither clears `grad` nor divides by `n`. Several tasks can thus
//!   accumulate into one buffer, and the trainer divides by the batch size (or folds that
//!   into the learning rate) itself.
//! - Both [`Model::grad`] and [`Model::evaluate`] return `(loss_sum, correct)`: the sum over
//!   the batch of the cross-entropy losses and how many examples the argmax got right.
//! - Lengths and labels are checked before anything is written; a bad call returns
//!   [`Error::WrongLength`] or [`Error::Config`] and leaves `grad` untouched. Nothing panics.
//! - Big batches are processed in chunks of at most [`Model::chunk`] examples, so the
//!   [`Scratch`] buffers stay small (evaluating a 10,000-image test set does not need
//!   gigabytes of im2col buffers).

#![warn(missing_docs)]

mod cnn;
#[cfg(feature = "cuda")]
pub mod gpu;
mod mlp;
mod resmlp;

use std::fmt;
use std::str::FromStr;

use ndarray::{ArrayView2, ArrayViewMut2};
use serde::{Deserialize, Serialize};

pub use cnn::Cnn;
pub use mlp::Mlp;
pub use resmlp::ResMlp;

use crate::{Error, Result};

/// A classifier computing on a flat parameter buffer it does not own.
///
/// See the [module documentation](self) for the conventions every implementation follows.
pub trait Model: Send + Sync + fmt::Debug {
    /// A short human-readable description, e.g. `mlp:784-256-10`.
    fn name(&self) -> String;

    /// Length of the flat parameter buffer (and of the gradient buffer).
    fn num_params(&self) -> usize;

    /// Floats per example (784 for 28×28 images).
    fn input_len(&self) -> usize;

    /// Number of classes; labels must be smaller.
    fn classes(&self) -> usize;

    /// Most examples one internal pass handles; bigger batches are split into chunks of
    /// this size, which bounds the [`Scratch`] memory.
    fn chunk(&self) -> usize;

    /// Writes initial parameters into `params`: He-uniform weights for layers followed by a
    /// ReLU, Xavier-uniform for the output layer, zero biases. Deterministic in `seed`.
    ///
    /// Fails with [`Error::WrongLength`] if `params.len() != self.num_params()`.
    fn init(&self, params: &mut [f32], seed: u64) -> Result<()>;

    /// Scratch buffers sized for batches of up to `batch` examples (capped at
    /// [`Model::chunk`]), so that a step with such a batch does not allocate.
    fn scratch(&self, batch: usize) -> Scratch;

    /// One pass over `n = y.len()` examples: forward, and backward into `grad` when it is
    /// given (with [`Model::grad`]'s contract). Returns `(loss_sum, correct)`.
    fn pass(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grad: Option<&mut [f32]>,
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)>;

    /// Forward and backward pass on `n = y.len()` examples.
    ///
    /// **Adds** d(loss_sum)/d(params) into `grad` — the gradient of the *sum* of the
    /// per-example cross-entropy losses, not of their mean: the caller clears `grad` when it
    /// wants to and divides by the batch size itself. Returns `(loss_sum, correct)`.
    ///
    /// Fails, without touching `grad`, if `params` or `grad` is not [`Model::num_params`]
    /// long, if `x` is not `n ×` [`Model::input_len`] long, or if a label is not smaller
    /// than [`Model::classes`].
    fn grad(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grad: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        self.pass(params, x, y, Some(grad), scratch)
    }

    /// Forward pass only: returns `(loss_sum, correct)` over the `n = y.len()` examples,
    /// with the same checks as [`Model::grad`].
    fn evaluate(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        self.pass(params, x, y, None, scratch)
    }

    /// Convenience: a fresh parameter vector initialised by [`Model::init`].
    fn init_vec(&self, seed: u64) -> Vec<f32> {
        let mut params = vec![0.0; self.num_params()];
        // The length is right by construction, so `init` cannot fail here.
        let _ = self.init(&mut params, seed);
        params
    }
}

/// Reusable activation buffers, so that a training step does not allocate.
///
/// Get one from [`Model::scratch`] (pre-sized) or [`Scratch::new`] (grows on first use).
/// It is model-agnostic: handing it to another model only resizes its buffers. Keep one per
/// thread; a `Scratch` is `Send` but calls need `&mut`.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    floats: Vec<Vec<f32>>,
    indices: Vec<Vec<usize>>,
}

impl Scratch {
    /// An empty scratch; the first call that uses it allocates.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently reserved by the buffers (their capacity).
    pub fn allocated_bytes(&self) -> usize {
        let floats: usize = self.floats.iter().map(|b| b.capacity()).sum();
        let indices: usize = self.indices.iter().map(|b| b.capacity()).sum();
        floats * size_of::<f32>() + indices * size_of::<usize>()
    }

    /// Sizes buffer `i` of each kind to `n · floats_per_example[i]` /
    /// `n · indices_per_example[i]` elements (contents unspecified) and returns them.
    /// Allocates only when a buffer must grow.
    fn prepare(
        &mut self,
        floats_per_example: &[usize],
        indices_per_example: &[usize],
        n: usize,
    ) -> (&mut [Vec<f32>], &mut [Vec<usize>]) {
        if self.floats.len() < floats_per_example.len() {
            self.floats.resize_with(floats_per_example.len(), Vec::new);
        }
        if self.indices.len() < indices_per_example.len() {
            self.indices
                .resize_with(indices_per_example.len(), Vec::new);
        }
        for (buf, &len) in self.floats.iter_mut().zip(floats_per_example) {
            buf.resize(len * n, 0.0);
        }
        for (buf, &len) in self.indices.iter_mut().zip(indices_per_example) {
            buf.resize(len * n, 0);
        }
        (
            &mut self.floats[..floats_per_example.len()],
            &mut self.indices[..indices_per_example.len()],
        )
    }
}

/// A model configuration that can be parsed, printed and (de)serialised, then built.
///
/// Text forms: `mlp:784-256-10` (layer widths, input first, classes last) and `cnn:8-16`
/// (the two conv channel counts of a [`Cnn`] on 28×28 images with 10 classes); a bare `cnn`
/// means [`Cnn::small`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSpec {
    /// A multi-layer perceptron with these layer widths (see [`Mlp::new`]).
    Mlp {
        /// Widths: input, hidden layers…, classes.
        sizes: Vec<usize>,
    },
    /// A two-conv-layer network on 28×28 single-channel images with 10 classes (see
    /// [`Cnn::new`]).
    Cnn {
        /// Channels of the first convolution.
        c1: usize,
        /// Channels of the second convolution.
        c2: usize,
    },
    /// A residual MLP (see [`ResMlp::new`]): `resmlp:784-64x4-10`.
    ResMlp {
        /// Input features.
        input: usize,
        /// Units of every hidden layer.
        width: usize,
        /// Residual blocks.
        blocks: usize,
        /// Classes.
        classes: usize,
    },
}

impl ModelSpec {
    /// Builds the model, checking the configuration.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        Ok(match self {
            Self::Mlp { sizes } => Box::new(Mlp::new(sizes)?),
            Self::Cnn { c1, c2 } => Box::new(Cnn::new(*c1, *c2)?),
            Self::ResMlp {
                input,
                width,
                blocks,
                classes,
            } => Box::new(ResMlp::new(*input, *width, *blocks, *classes)?),
        })
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mlp { sizes } => {
                f.write_str("mlp:")?;
                for (i, s) in sizes.iter().enumerate() {
                    if i > 0 {
                        f.write_str("-")?;
                    }
                    write!(f, "{s}")?;
                }
                Ok(())
            }
            Self::Cnn { c1, c2 } => write!(f, "cnn:{c1}-{c2}"),
            Self::ResMlp {
                input,
                width,
                blocks,
                classes,
            } => write!(f, "resmlp:{input}-{width}x{blocks}-{classes}"),
        }
    }
}

impl FromStr for ModelSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Config(format!(
                "model `{s}`: {why} (expected e.g. mlp:784-256-10, resmlp:784-64x4-10, cnn:8-16 or cnn)"
            ))
        };
        let (kind, dims) = s.split_once(':').unwrap_or((s, ""));
        if kind.trim().eq_ignore_ascii_case("resmlp") {
            let parts: Vec<&str> = dims.split('-').map(str::trim).collect();
            let num = |t: &str| {
                t.parse::<usize>()
                    .map_err(|e| bad(&format!("bad width `{t}`: {e}")))
            };
            let [input, hidden, classes] = parts[..] else {
                return Err(bad("a resmlp is INPUT-WIDTHxBLOCKS-CLASSES"));
            };
            let Some((width, blocks)) = hidden.split_once(['x', 'X']) else {
                return Err(bad("a resmlp's hidden part is WIDTHxBLOCKS, e.g. 64x4"));
            };
            return Ok(Self::ResMlp {
                input: num(input)?,
                width: num(width)?,
                blocks: num(blocks)?,
                classes: num(classes)?,
            });
        }
        let dims: Vec<usize> = if dims.is_empty() {
            Vec::new()
        } else {
            dims.split('-')
                .map(|d| d.trim().parse::<usize>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| bad(&format!("bad width: {e}")))?
        };
        match kind.trim().to_ascii_lowercase().as_str() {
            "mlp" if dims.len() >= 2 => Ok(Self::Mlp { sizes: dims }),
            "mlp" => Err(bad("an mlp needs at least an input and an output width")),
            "cnn" => match dims[..] {
                [] => Ok(Self::Cnn { c1: 8, c2: 16 }),
                [c1, c2] => Ok(Self::Cnn { c1, c2 }),
                _ => Err(bad("a cnn takes exactly two channel counts")),
            },
            _ => Err(bad("unknown model kind")),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers shared by the models.

/// Most floats a model's scratch should hold per chunk (16 MiB); sets [`Model::chunk`].
const SCRATCH_BUDGET_FLOATS: usize = 1 << 22;

/// Chunk size for a model needing these scratch buffers per example.
fn chunk_for(floats_per_example: &[usize], indices_per_example: &[usize], max: usize) -> usize {
    let floats: usize = floats_per_example.iter().sum();
    let indices: usize = indices_per_example.iter().sum();
    // An index is two floats wide on 64-bit targets.
    let per_example = floats.saturating_add(indices.saturating_mul(2)).max(1);
    (SCRATCH_BUDGET_FLOATS / per_example).clamp(1, max)
}

/// Checks a buffer's length.
fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::WrongLength {
            what,
            expected,
            got,
        })
    }
}

/// The checks of every pass before it computes: the batch, and the gradient's length.
fn check_pass(
    model: &dyn Model,
    params: &[f32],
    x: &[f32],
    y: &[u8],
    grad: Option<&[f32]>,
) -> Result<()> {
    check_batch(model, params, x, y)?;
    if let Some(g) = grad {
        check_len("grad", model.num_params(), g.len())?;
    }
    Ok(())
}

/// Checks everything a forward pass reads: parameters, inputs and labels.
fn check_batch(model: &dyn Model, params: &[f32], x: &[f32], y: &[u8]) -> Result<()> {
    check_len("params", model.num_params(), params.len())?;
    check_inputs(model, x, y)
}

/// Checks a batch's inputs and labels against the model.
fn check_inputs(model: &dyn Model, x: &[f32], y: &[u8]) -> Result<()> {
    let expected = y
        .len()
        .checked_mul(model.input_len())
        .ok_or_else(|| Error::Config(format!("batch of {} examples is too large", y.len())))?;
    check_len("x", expected, x.len())?;
    let classes = model.classes();
    if let Some((i, &label)) = y
        .iter()
        .enumerate()
        .find(|&(_, &l)| usize::from(l) >= classes)
    {
        return Err(Error::Config(format!(
            "label {label} of example {i} is out of range: {} has {classes} classes",
            model.name()
        )));
    }
    Ok(())
}

/// The product of `factors`, or `None` on overflow.
fn checked_product(factors: &[usize]) -> Option<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
}

/// A `rows × cols` row-major view of the front of `data`.
fn mat(data: &[f32], rows: usize, cols: usize) -> Result<ArrayView2<'_, f32>> {
    let len = rows * cols;
    let data = data
        .get(..len)
        .ok_or_else(|| internal_shape(len, data.len()))?;
    ArrayView2::from_shape((rows, cols), data).map_err(|e| Error::Config(format!("shape: {e}")))
}

/// A mutable `rows × cols` row-major view of the front of `data`.
fn mat_mut(data: &mut [f32], rows: usize, cols: usize) -> Result<ArrayViewMut2<'_, f32>> {
    let len = rows * cols;
    let got = data.len();
    let data = data
        .get_mut(..len)
        .ok_or_else(|| internal_shape(len, got))?;
    ArrayViewMut2::from_shape((rows, cols), data).map_err(|e| Error::Config(format!("shape: {e}")))
}

fn internal_shape(expected: usize, got: usize) -> Error {
    Error::WrongLength {
        what: "internal buffer",
        expected,
        got,
    }
}

/// `c = a · b + beta · c` (sgemm through matrixmultiply); shapes must agree.
fn gemm(
    a: &ArrayView2<'_, f32>,
    b: &ArrayView2<'_, f32>,
    beta: f32,
    c: &mut ArrayViewMut2<'_, f32>,
) {
    ndarray::linalg::general_mat_mul(1.0, a, b, beta, c);
}

/// Writes `bias` into every row of `out` (rows of `bias.len()` floats).
fn broadcast_rows(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        row.copy_from_slice(bias);
    }
}

/// `acc[j] += Σ_rows src[row, j]` for a row-major `src` with `acc.len()` columns.
fn add_column_sums(src: &[f32], acc: &mut [f32]) {
    for row in src.chunks_exact(acc.len()) {
        for (a, &s) in acc.iter_mut().zip(row) {
            *a += s;
        }
    }
}

/// In-place ReLU.
fn relu(v: &mut [f32]) {
    for x in v {
        *x = x.max(0.0);
    }
}

/// Zeroes `delta` where the ReLU output `act` is not positive (ReLU backward).
fn relu_backward(delta: &mut [f32], act: &[f32]) {
    // A select rather than a conditional store, so that it vectorises.
    for (d, &a) in delta.iter_mut().zip(act) {
        *d = if a > 0.0 { *d } else { 0.0 };
    }
}

/// Softmax cross-entropy on the rows of `logits` (`y.len()` rows of `classes` floats).
///
/// Numerically stable (log-sum-exp with the row maximum subtracted). Returns the sum of the
/// losses and the number of rows whose first maximum is the label. With `backward`, each row
/// is overwritten by d(loss)/d(logits) = softmax − one_hot(label). Labels must be checked.
fn softmax_cross_entropy(
    logits: &mut [f32],
    y: &[u8],
    classes: usize,
    backward: bool,
) -> (f64, usize) {
    let mut loss = 0.0f64;
    let mut correct = 0;
    for (row, &label) in logits.chunks_exact_mut(classes).zip(y) {
        let label = usize::from(label);
        let (mut best, mut max) = (0, row[0]);
        for (j, &v) in row.iter().enumerate().skip(1) {
            if v > max {
                (best, max) = (j, v);
            }
        }
        if best == label {
            correct += 1;
        }
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        let log_sum_exp = max + sum.ln();
        loss += f64::from(log_sum_exp - row[label]);
        if backward {
            for v in row.iter_mut() {
                *v = (*v - log_sum_exp).exp();
            }
            row[label] -= 1.0;
        }
    }
    (loss, correct)
}

/// Fills `w` uniformly in `[-limit, limit)`.
fn fill_uniform(rng: &mut fastrand::Rng, w: &mut [f32], limit: f32) {
    for v in w {
        *v = (rng.f32() * 2.0 - 1.0) * limit;
    }
}

/// He-uniform limit for a layer followed by a ReLU.
fn he_limit(fan_in: usize) -> f32 {
    (6.0 / fan_in as f32).sqrt()
}

/// Xavier/Glorot-uniform limit for the (linear) output layer.
fn xavier_limit(fan_in: usize, fan_out: usize) -> f32 {
    (6.0 / (fan_in + fan_out) as f32).sqrt()
}
