//! A multi-layer perceptron: dense layers, ReLU between them, softmax cross-entropy on top.

use super::{
    Model, Scratch, add_column_sums, broadcast_rows, check_len, check_pass, checked_product,
    chunk_for, fill_uniform, gemm, he_limit, mat, mat_mut, relu, relu_backward,
    softmax_cross_entropy, xavier_limit,
};
use crate::{Error, Result};

/// Most examples per internal chunk.
const MAX_CHUNK: usize = 256;

/// A multi-layer perceptron on a flat parameter buffer.
///
/// For widths `[d0, d1, …, dL]` there are `L` dense layers; layer `l` maps `d(l-1)` inputs to
/// `d(l)` outputs, hidden layers are followed by a ReLU, the last one produces the logits of
/// a softmax cross-entropy over `dL` classes.
///
/// **Parameter layout**, layer after layer: `W` (`d(l-1) × d(l)`, row-major, so the output
/// of an example is `x · W + b`) then `b` (`d(l)`). `[784, 256, 10]` holds
/// 784·256 + 256 + 256·10 + 10 = 203,530 floats.
#[derive(Debug, Clone)]
pub struct Mlp {
    sizes: Vec<usize>,
    layers: Vec<Dense>,
    num_params: usize,
    /// Scratch floats per example: one activation buffer per layer (the last holds the
    /// logits), then one delta buffer as wide as the widest hidden layer.
    scratch_per_example: Vec<usize>,
    chunk: usize,
}

/// One dense layer's place in the flat buffer.
#[derive(Debug, Clone, Copy)]
struct Dense {
    fan_in: usize,
    fan_out: usize,
    /// Offset of `W` (`fan_in × fan_out`).
    w: usize,
    /// Offset of `b` (`fan_out`).
    b: usize,
}

impl Dense {
    fn w_range(&self) -> std::ops::Range<usize> {
        self.w..self.w + self.fan_in * self.fan_out
    }

    fn b_range(&self) -> std::ops::Range<usize> {
        self.b..self.b + self.fan_out
    }
}

impl Mlp {
    /// An MLP with these widths: input, hidden layers…, classes (e.g. `&[784, 256, 10]`).
    ///
    /// Fails with [`Error::Config`] with fewer than two widths, a zero width, or a
    /// parameter count that does not fit in memory.
    pub fn new(sizes: &[usize]) -> Result<Self> {
        // The widths as written in a model spec: `784-256-10`.
        let shown = sizes
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("-");
        if sizes.len() < 2 {
            return Err(Error::Config(format!(
                "an mlp needs at least an input and an output width, got mlp:{shown}"
            )));
        }
        if sizes.contains(&0) {
            return Err(Error::Config(format!(
                "mlp widths must be positive, got mlp:{shown}"
            )));
        }
        let too_big = || Error::Config(format!("mlp:{shown} has too many parameters"));
        let mut layers = Vec::with_capacity(sizes.len() - 1);
        let mut offset = 0usize;
        for pair in sizes.windows(2) {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let w = offset;
            let b = checked_product(&[fan_in, fan_out])
                .and_then(|n| w.checked_add(n))
                .ok_or_else(too_big)?;
            offset = b.checked_add(fan_out).ok_or_else(too_big)?;
            layers.push(Dense {
                fan_in,
                fan_out,
                w,
                b,
            });
        }
        let widest_hidden = sizes[1..sizes.len() - 1].iter().copied().max().unwrap_or(0);
        let mut scratch_per_example = sizes[1..].to_vec();
        scratch_per_example.push(widest_hidden);
        Ok(Self {
            sizes: sizes.to_vec(),
            layers,
            num_params: offset,
            chunk: chunk_for(&scratch_per_example, &[], MAX_CHUNK),
            scratch_per_example,
        })
    }

    /// The layer widths this MLP was built with.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Forward pass on one chunk of `n` examples: fills `acts[l]` with layer `l`'s output
    /// (after ReLU for hidden layers; the last is the logits).
    fn forward(&self, params: &[f32], x: &[f32], n: usize, acts: &mut [Vec<f32>]) -> Result<()> {
        for (l, layer) in self.layers.iter().enumerate() {
            let (done, rest) = acts.split_at_mut(l);
            let input = if l == 0 { x } else { &done[l - 1][..] };
            let out = &mut rest[0][..n * layer.fan_out];
            broadcast_rows(out, &params[layer.b_range()]);
            let a = mat(input, n, layer.fan_in)?;
            let w = mat(&params[layer.w_range()], layer.fan_in, layer.fan_out)?;
            gemm(&a, &w, 1.0, &mut mat_mut(out, n, layer.fan_out)?);
            if l + 1 < self.layers.len() {
                relu(out);
            }
        }
        Ok(())
    }

    /// Backward pass on one chunk, after [`Mlp::forward`] and the softmax backward (which
    /// left d(loss)/d(logits) in the last activation buffer). Adds into `grad`; destroys
    /// `acts` (each hidden activation is replaced by its delta).
    fn backward(
        &self,
        params: &[f32],
        x: &[f32],
        n: usize,
        acts: &mut [Vec<f32>],
        tmp: &mut [f32],
        grad: &mut [f32],
    ) -> Result<()> {
        for (l, layer) in self.layers.iter().enumerate().rev() {
            let (below, rest) = acts.split_at_mut(l);
            let delta = &rest[0][..n * layer.fan_out];
            let delta_m = mat(delta, n, layer.fan_out)?;
            let input = if l == 0 {
                x
            } else {
                &below[l - 1][..n * layer.fan_in]
            };
            // dW += inputᵀ · delta ; db += Σ_rows delta
            let input_m = mat(input, n, layer.fan_in)?;
            gemm(
                &input_m.t(),
                &delta_m,
                1.0,
                &mut mat_mut(&mut grad[layer.w_range()], layer.fan_in, layer.fan_out)?,
            );
            add_column_sums(delta, &mut grad[layer.b_range()]);
            if l == 0 {
                break;
            }
            // delta_below = (delta · Wᵀ) ⊙ relu'(act_below), stored over act_below.
            let tmp = &mut tmp[..n * layer.fan_in];
            let w = mat(&params[layer.w_range()], layer.fan_in, layer.fan_out)?;
            gemm(&delta_m, &w.t(), 0.0, &mut mat_mut(tmp, n, layer.fan_in)?);
            let act_below = &mut below[l - 1][..n * layer.fan_in];
            relu_backward(tmp, act_below);
            act_below.copy_from_slice(tmp);
        }
        Ok(())
    }

    /// Shared body of `grad` (with `Some(grad)`) and `evaluate` (with `None`).
    fn run(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        mut grad: Option<&mut [f32]>,
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        check_pass(self, params, x, y, grad.as_deref())?;
        if y.is_empty() {
            return Ok((0.0, 0));
        }
        let (bufs, _) = scratch.prepare(&self.scratch_per_example, &[], y.len().min(self.chunk));
        let (acts, tmp) = bufs.split_at_mut(self.layers.len());
        let classes = self.classes();
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for (xc, yc) in x
            .chunks(self.chunk * self.input_len())
            .zip(y.chunks(self.chunk))
        {
            let n = yc.len();
            self.forward(params, xc, n, acts)?;
            let logits = &mut acts[self.layers.len() - 1][..n * classes];
            let (l, c) = softmax_cross_entropy(logits, yc, classes, grad.is_some());
            loss += l;
            correct += c;
            if let Some(g) = grad.as_deref_mut() {
                self.backward(params, xc, n, acts, &mut tmp[0], g)?;
            }
        }
        Ok((loss as f32, correct))
    }
}

impl Model for Mlp {
    fn name(&self) -> String {
        let widths: Vec<String> = self.sizes.iter().map(usize::to_string).collect();
        format!("mlp:{}", widths.join("-"))
    }

    fn num_params(&self) -> usize {
        self.num_params
    }

    fn input_len(&self) -> usize {
        self.sizes[0]
    }

    fn classes(&self) -> usize {
        self.sizes[self.sizes.len() - 1]
    }

    fn chunk(&self) -> usize {
        self.chunk
    }

    fn init(&self, params: &mut [f32], seed: u64) -> Result<()> {
        check_len("params", self.num_params, params.len())?;
        let mut rng = fastrand::Rng::with_seed(seed);
        for (l, layer) in self.layers.iter().enumerate() {
            let limit = if l + 1 < self.layers.len() {
                he_limit(layer.fan_in)
            } else {
                xavier_limit(layer.fan_in, layer.fan_out)
            };
            fill_uniform(&mut rng, &mut params[layer.w_range()], limit);
            params[layer.b_range()].fill(0.0);
        }
        Ok(())
    }

    fn scratch(&self, batch: usize) -> Scratch {
        let mut scratch = Scratch::new();
        scratch.prepare(&self.scratch_per_example, &[], batch.min(self.chunk));
        scratch
    }

    fn pass(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grad: Option<&mut [f32]>,
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        self.run(params, x, y, grad, scratch)
    }
}
