//! A residual multi-layer perceptron: an input layer, `blocks` residual blocks of one dense
//! layer each, and an output layer. Deeper than [`super::Mlp`] at the same width, and trained
//! stably by the skip connections: the model of the experiments where depth decides how much
//! staleness costs.

use super::{
    Model, Scratch, add_column_sums, broadcast_rows, check_len, check_pass, checked_product,
    chunk_for, fill_uniform, gemm, he_limit, mat, mat_mut, relu, relu_backward,
    softmax_cross_entropy, xavier_limit,
};
use crate::{Error, Result};

/// Most examples per internal chunk.
const MAX_CHUNK: usize = 256;

/// A residual MLP on a flat parameter buffer.
///
/// For input `d`, width `w`, `B` blocks and `k` classes:
/// - `h0 = relu(x · W0 + b0)` (`W0`: `d × w`);
/// - block `j` (1..=B): `h_j = h_(j-1) + relu(h_(j-1) · W_j + b_j)` (`W_j`: `w × w`);
/// - logits `= h_B · Wo + bo` (`Wo`: `w × k`), softmax cross-entropy on top.
///
/// **Parameter layout**, in that order: `W0`, `b0`, then `W_j`, `b_j` for each block, then
/// `Wo`, `bo`; every `W` row-major. `resmlp:784-64x4-10` holds 784·64 + 64 + 4·(64·64 + 64)
/// + 64·10 + 10 = 67,530 floats.
#[derive(Debug, Clone)]
pub struct ResMlp {
    input: usize,
    width: usize,
    blocks: usize,
    classes: usize,
    num_params: usize,
    /// Scratch floats per example: `h0`, then `r_j` and `h_j` per block (the block's ReLU
    /// output and its sum), the logits, and one `w`-wide delta buffer.
    scratch_per_example: Vec<usize>,
    chunk: usize,
}

impl ResMlp {
    /// A residual MLP: `input` features, `width` units in every hidden layer, `blocks`
    /// residual blocks (0 is an MLP of one hidden layer), `classes` outputs.
    ///
    /// Fails with [`Error::Config`] on a zero input, width or class count, or a parameter
    /// count that does not fit in memory.
    pub fn new(input: usize, width: usize, blocks: usize, classes: usize) -> Result<Self> {
        let shown = format!("resmlp:{input}-{width}x{blocks}-{classes}");
        if input == 0 || width == 0 || classes == 0 {
            return Err(Error::Config(format!(
                "resmlp widths must be positive, got {shown}"
            )));
        }
        let too_big = || Error::Config(format!("{shown} has too many parameters"));
        let block = checked_product(&[width, width])
            .and_then(|n| n.checked_add(width))
            .ok_or_else(too_big)?;
        let num_params = checked_product(&[input, width])
            .and_then(|n| n.checked_add(width))
            .and_then(|n| n.checked_add(checked_product(&[block, blocks])?))
            .and_then(|n| n.checked_add(checked_product(&[width, classes])?))
            .and_then(|n| n.checked_add(classes))
            .ok_or_else(too_big)?;
        let mut scratch_per_example = vec![width; 1 + 2 * blocks];
        scratch_per_example.push(classes);
        scratch_per_example.push(width);
        Ok(Self {
            input,
            width,
            blocks,
            classes,
            num_params,
            chunk: chunk_for(&scratch_per_example, &[], MAX_CHUNK),
            scratch_per_example,
        })
    }

    /// `(input, width, blocks, classes)`.
    pub fn shape(&self) -> (usize, usize, usize, usize) {
        (self.input, self.width, self.blocks, self.classes)
    }

    /// Offsets of `W` and `b` of layer `l`: 0 the input layer, 1..=B the blocks, B + 1 the
    /// output layer; with its fan-in and fan-out.
    fn layer(&self, l: usize) -> (usize, usize, usize, usize) {
        let (d, w, k) = (self.input, self.width, self.classes);
        let first = d * w + w;
        let block = w * w + w;
        if l == 0 {
            (0, d * w, d, w)
        } else if l <= self.blocks {
            let o = first + (l - 1) * block;
            (o, o + w * w, w, w)
        } else {
            let o = first + self.blocks * block;
            (o, o + w * k, w, k)
        }
    }

    fn forward(&self, params: &[f32], x: &[f32], n: usize, acts: &mut [Vec<f32>]) -> Result<()> {
        let w = self.width;
        let dense = |input: &[f32], l: usize, out: &mut [f32]| -> Result<()> {
            let (wo, bo, fan_in, fan_out) = self.layer(l);
            broadcast_rows(out, &params[bo..bo + fan_out]);
            let a = mat(input, n, fan_in)?;
            let m = mat(&params[wo..wo + fan_in * fan_out], fan_in, fan_out)?;
            gemm(&a, &m, 1.0, &mut mat_mut(out, n, fan_out)?);
            Ok(())
        };
        dense(x, 0, &mut acts[0][..n * w])?;
        relu(&mut acts[0][..n * w]);
        for j in 1..=self.blocks {
            // acts[2j-2] = h_(j-1); acts[2j-1] = r_j; acts[2j] = h_j.
            let (done, rest) = acts.split_at_mut(2 * j - 1);
            let h_prev = &done[2 * j - 2][..n * w];
            let (r, h) = rest.split_at_mut(1);
            let r = &mut r[0][..n * w];
            dense(h_prev, j, r)?;
            relu(r);
            let h = &mut h[0][..n * w];
            for ((o, &a), &b) in h.iter_mut().zip(h_prev).zip(r.iter()) {
                *o = a + b;
            }
        }
        let last = 2 * self.blocks;
        let (hs, logits) = acts.split_at_mut(last + 1);
        dense(
            &hs[last][..n * w],
            self.blocks + 1,
            &mut logits[0][..n * self.classes],
        )
    }

    /// Backward after [`ResMlp::forward`] and the softmax backward (d(loss)/d(logits) in the
    /// logits buffer). Adds into `grad`; destroys the activations.
    fn backward(
        &self,
        params: &[f32],
        x: &[f32],
        n: usize,
        acts: &mut [Vec<f32>],
        grad: &mut [f32],
    ) -> Result<()> {
        let w = self.width;
        let b = self.blocks;
        // Layout of `acts`: h0, (r_j, h_j) per block, logits, then the delta buffer `dh`.
        let (hs, tail) = acts.split_at_mut(2 * b + 1);
        let (logits, dh) = tail.split_at_mut(1);
        let (logits, dh) = (&logits[0][..n * self.classes], &mut dh[0][..n * w]);
        // Weight gradients of layer `l` from its input and its output delta.
        let add_dw = |grad: &mut [f32], l: usize, input: &[f32], delta: &[f32]| -> Result<()> {
            let (wo, bo, fan_in, fan_out) = self.layer(l);
            gemm(
                &mat(input, n, fan_in)?.t(),
                &mat(delta, n, fan_out)?,
                1.0,
                &mut mat_mut(&mut grad[wo..wo + fan_in * fan_out], fan_in, fan_out)?,
            );
            add_column_sums(delta, &mut grad[bo..bo + fan_out]);
            Ok(())
        };
        // delta · Wᵀ of layer `l` into `out` (beta 0: overwrite; 1: add).
        let back = |l: usize, delta: &[f32], beta: f32, out: &mut [f32]| -> Result<()> {
            let (wo, _, fan_in, fan_out) = self.layer(l);
            let m = mat(&params[wo..wo + fan_in * fan_out], fan_in, fan_out)?;
            gemm(
                &mat(delta, n, fan_out)?,
                &m.t(),
                beta,
                &mut mat_mut(out, n, fan_in)?,
            );
            Ok(())
        };
        add_dw(grad, b + 1, &hs[2 * b][..n * w], logits)?;
        back(b + 1, logits, 0.0, dh)?;
        for j in (1..=b).rev() {
            // d_z = d_h ⊙ relu'(r_j), over r_j; then d_h(j-1) = d_h + d_z · W_jᵀ.
            let (below, rest) = hs.split_at_mut(2 * j - 1);
            let r = &mut rest[0][..n * w];
            for (z, &d) in r.iter_mut().zip(dh.iter()) {
                *z = if *z > 0.0 { d } else { 0.0 };
            }
            add_dw(grad, j, &below[2 * j - 2][..n * w], r)?;
            back(j, r, 1.0, dh)?;
        }
        relu_backward(dh, &hs[0][..n * w]);
        add_dw(grad, 0, x, dh)
    }
}

impl Model for ResMlp {
    fn name(&self) -> String {
        format!(
            "resmlp:{}-{}x{}-{}",
            self.input, self.width, self.blocks, self.classes
        )
    }

    fn num_params(&self) -> usize {
        self.num_params
    }

    fn input_len(&self) -> usize {
        self.input
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn chunk(&self) -> usize {
        self.chunk
    }

    /// He-uniform for the input layer; the blocks' He limit scaled by `1/√B`, so the sum of
    /// `B` branches keeps the activations' scale; Xavier-uniform for the output; zero biases.
    fn init(&self, params: &mut [f32], seed: u64) -> Result<()> {
        check_len("params", self.num_params, params.len())?;
        let mut rng = fastrand::Rng::with_seed(seed);
        for l in 0..=self.blocks + 1 {
            let (wo, bo, fan_in, fan_out) = self.layer(l);
            let limit = if l == 0 {
                he_limit(fan_in)
            } else if l <= self.blocks {
                he_limit(fan_in) / (self.blocks as f32).sqrt()
            } else {
                xavier_limit(fan_in, fan_out)
            };
            fill_uniform(&mut rng, &mut params[wo..wo + fan_in * fan_out], limit);
            params[bo..bo + fan_out].fill(0.0);
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
        mut grad: Option<&mut [f32]>,
        scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        check_pass(self, params, x, y, grad.as_deref())?;
        if y.is_empty() {
            return Ok((0.0, 0));
        }
        let (acts, _) = scratch.prepare(&self.scratch_per_example, &[], y.len().min(self.chunk));
        let logits_at = 2 * self.blocks + 1;
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for (xc, yc) in x.chunks(self.chunk * self.input).zip(y.chunks(self.chunk)) {
            let n = yc.len();
            self.forward(params, xc, n, acts)?;
            let logits = &mut acts[logits_at][..n * self.classes];
            let (l, c) = softmax_cross_entropy(logits, yc, self.classes, grad.is_some());
            loss += l;
            correct += c;
            if let Some(g) = grad.as_deref_mut() {
                self.backward(params, xc, n, acts, g)?;
            }
        }
        Ok((loss as f32, correct))
    }
}
