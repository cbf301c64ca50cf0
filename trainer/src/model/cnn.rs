//! A small convolutional network: two 5×5 "same" convolutions, each followed by a ReLU and a
//! 2×2 max-pool, then one dense layer and softmax cross-entropy.
//!
//! Convolutions are im2col + sgemm in both directions; activations are NHWC (channels
//! innermost), so an im2col row is a few contiguous copies.

use super::{
    Model, Scratch, add_column_sums, broadcast_rows, check_len, check_pass, checked_product,
    chunk_for, fill_uniform, gemm, he_limit, mat, mat_mut, relu, relu_backward,
    softmax_cross_entropy, xavier_limit,
};
use crate::{Error, Result};

/// Kernel side.
const K: usize = 5;
/// Zero padding on each side ("same" output size at stride 1).
const PAD: usize = K / 2;
/// Most examples per internal chunk.
const MAX_CHUNK: usize = 16;

/// Scratch float buffers, by index into [`Cnn::floats_per_example`] (and in the order
/// [`Cnn::buffers`] destructures them).
mod buf {
    pub const COL1: usize = 0;
    pub const A1: usize = 1;
    pub const P1: usize = 2;
    pub const COL2: usize = 3;
    pub const A2: usize = 4;
    pub const P2: usize = 5;
    pub const LOGITS: usize = 6;
    pub const DP2: usize = 7;
    pub const DA2: usize = 8;
    pub const DP1: usize = 9;
    pub const DA1: usize = 10;
    pub const COUNT: usize = 11;
}

/// A small CNN on single-channel `height × width` images.
///
/// `conv(1→c1, 5×5, stride 1, pad 2) – ReLU – maxpool 2×2 – conv(c1→c2, 5×5, pad 2) – ReLU –
/// maxpool 2×2 – dense(c2·(height/4)·(width/4) → classes)`, softmax cross-entropy.
///
/// Inputs are `height × width` row-major per example. **Parameter layout**:
/// `W1` (`25·1 × c1`), `b1` (`c1`), `W2` (`25·c1 × c2`), `b2` (`c2`), `W3` (`(height/4)·
/// (width/4)·c2 × classes`), `b3` (`classes`), all row-major. A convolution kernel's rows are
/// ordered `(ky, kx, c_in)` and its columns are the output channels; `W3`'s rows follow the
/// pooled map in `(y, x, channel)` order. [`Cnn::small`] on 28×28 has 11,274 parameters.
#[derive(Debug, Clone)]
pub struct Cnn {
    height: usize,
    width: usize,
    c1: usize,
    c2: usize,
    classes: usize,
    /// Offsets of W1, b1, W2, b2, W3, b3, and the total.
    offsets: [usize; 7],
    floats_per_example: [usize; buf::COUNT],
    indices_per_example: [usize; 2],
    chunk: usize,
}

impl Cnn {
    /// `Cnn::new(c1, c2)` on 28×28 images with 10 classes.
    pub fn new(c1: usize, c2: usize) -> Result<Self> {
        Self::with_input(28, 28, c1, c2, 10)
    }

    /// The reference small CNN: `Cnn::new(8, 16)`.
    pub fn small() -> Self {
        Self::layout(28, 28, 8, 16, 10)
    }

    /// A CNN on `height × width` single-channel images (both multiples of 4) with `c1` and
    /// `c2` convolution channels and `classes` outputs; fails with [`Error::Config`] otherwise.
    pub fn with_input(
        height: usize,
        width: usize,
        c1: usize,
        c2: usize,
        classes: usize,
    ) -> Result<Self> {
        if height == 0 || width == 0 || !height.is_multiple_of(4) || !width.is_multiple_of(4) {
            return Err(Error::Config(format!(
                "cnn input must be a positive multiple of 4 on each side (two 2×2 pools), \
                 got {height}×{width}"
            )));
        }
        if c1 == 0 || c2 == 0 || classes == 0 {
            return Err(Error::Config(format!(
                "cnn channels and classes must be positive, got c1={c1} c2={c2} \
                 classes={classes}"
            )));
        }
        // The largest products used in `layout`; everything else is smaller.
        let fits = [
            checked_product(&[K * K, c1, c2]),
            checked_product(&[height, width, c2, classes]),
            checked_product(&[height, width, K * K, c1, 4]),
        ]
        .iter()
        .all(Option::is_some);
        if !fits {
            return Err(Error::Config(format!(
                "cnn {height}×{width} c1={c1} c2={c2} classes={classes} is too large"
            )));
        }
        Ok(Self::layout(height, width, c1, c2, classes))
    }

    /// Offsets and scratch sizes; the sizes must already be known not to overflow.
    fn layout(height: usize, width: usize, c1: usize, c2: usize, classes: usize) -> Self {
        let (hw, hw2, hw4) = (height * width, height * width / 4, height * width / 16);
        let lens = [
            K * K * c1,
            c1,
            K * K * c1 * c2,
            c2,
            hw4 * c2 * classes,
            classes,
        ];
        let mut offsets = [0; 7];
        for (i, len) in lens.iter().enumerate() {
            offsets[i + 1] = offsets[i] + len;
        }
        let mut floats_per_example = [0; buf::COUNT];
        floats_per_example[buf::COL1] = hw * K * K;
        floats_per_example[buf::A1] = hw * c1;
        floats_per_example[buf::P1] = hw2 * c1;
        floats_per_example[buf::COL2] = hw2 * K * K * c1;
        floats_per_example[buf::A2] = hw2 * c2;
        floats_per_example[buf::P2] = hw4 * c2;
        floats_per_example[buf::LOGITS] = classes;
        floats_per_example[buf::DP2] = hw4 * c2;
        floats_per_example[buf::DA2] = hw2 * c2;
        floats_per_example[buf::DP1] = hw2 * c1;
        floats_per_example[buf::DA1] = hw * c1;
        let indices_per_example = [hw2 * c1, hw4 * c2];
        Self {
            height,
            width,
            c1,
            c2,
            classes,
            offsets,
            floats_per_example,
            indices_per_example,
            chunk: chunk_for(&floats_per_example, &indices_per_example, MAX_CHUNK),
        }
    }

    /// Channels of the two convolutions.
    pub fn channels(&self) -> (usize, usize) {
        (self.c1, self.c2)
    }

    /// Image height and width.
    pub fn image_size(&self) -> (usize, usize) {
        (self.height, self.width)
    }

    /// Parameter tensor `i` (0..6: W1, b1, W2, b2, W3, b3) as a range of the flat buffer.
    pub(super) fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
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
        let (floats, indices) = scratch.prepare(
            &self.floats_per_example,
            &self.indices_per_example,
            y.len().min(self.chunk),
        );
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for (xc, yc) in x
            .chunks(self.chunk * self.input_len())
            .zip(y.chunks(self.chunk))
        {
            let n = yc.len();
            let mut b = self.buffers(floats, indices, n)?;
            self.forward(params, xc, n, &mut b)?;
            let (l, c) = softmax_cross_entropy(b.logits, yc, self.classes, grad.is_some());
            loss += l;
            correct += c;
            if let Some(g) = grad.as_deref_mut() {
                self.backward(params, n, &mut b, g)?;
            }
        }
        Ok((loss as f32, correct))
    }

    /// The scratch buffers' prefixes for a chunk of `n` images.
    fn buffers<'a>(
        &self,
        floats: &'a mut [Vec<f32>],
        indices: &'a mut [Vec<usize>],
        n: usize,
    ) -> Result<Buffers<'a>> {
        let ([col1, a1, p1, col2, a2, p2, logits, dp2, da2, dp1, da1], [idx1, idx2]) =
            (floats, indices)
        else {
            return Err(Error::Config("cnn: scratch buffers missing".into()));
        };
        let per = &self.floats_per_example;
        let idx = &self.indices_per_example;
        Ok(Buffers {
            col1: &mut col1[..n * per[buf::COL1]],
            a1: &mut a1[..n * per[buf::A1]],
            p1: &mut p1[..n * per[buf::P1]],
            col2: &mut col2[..n * per[buf::COL2]],
            a2: &mut a2[..n * per[buf::A2]],
            p2: &mut p2[..n * per[buf::P2]],
            logits: &mut logits[..n * per[buf::LOGITS]],
            dp2: &mut dp2[..n * per[buf::DP2]],
            da2: &mut da2[..n * per[buf::DA2]],
            dp1: &mut dp1[..n * per[buf::DP1]],
            da1: &mut da1[..n * per[buf::DA1]],
            idx1: &mut idx1[..n * idx[0]],
            idx2: &mut idx2[..n * idx[1]],
        })
    }

    /// Forward pass on a chunk of `n` images, leaving the logits in `b.logits`.
    fn forward(&self, params: &[f32], x: &[f32], n: usize, b: &mut Buffers<'_>) -> Result<()> {
        let (h, w, c1, c2) = (self.height, self.width, self.c1, self.c2);
        let (h2, w2) = (h / 2, w / 2);
        let flat = (h / 4) * (w / 4) * c2;

        // conv1 + ReLU + pool
        im2col(x, n, h, w, 1, b.col1);
        let (w1, b1) = (&params[self.range(0)], &params[self.range(1)]);
        conv_forward(b.col1, w1, b1, n * h * w, b.a1)?;
        maxpool_forward(b.a1, n, h, w, c1, b.p1, b.idx1);

        // conv2 + ReLU + pool
        im2col(b.p1, n, h2, w2, c1, b.col2);
        let (w2_, b2) = (&params[self.range(2)], &params[self.range(3)]);
        conv_forward(b.col2, w2_, b2, n * h2 * w2, b.a2)?;
        maxpool_forward(b.a2, n, h2, w2, c2, b.p2, b.idx2);

        // dense
        broadcast_rows(b.logits, &params[self.range(5)]);
        gemm(
            &mat(b.p2, n, flat)?,
            &mat(&params[self.range(4)], flat, self.classes)?,
            1.0,
            &mut mat_mut(b.logits, n, self.classes)?,
        );
        Ok(())
    }

    /// Backward pass on a chunk, after the forward pass and the softmax backward (which left
    /// d(loss)/d(logits) in `b.logits`). Adds into `grad`.
    fn backward(
        &self,
        params: &[f32],
        n: usize,
        b: &mut Buffers<'_>,
        grad: &mut [f32],
    ) -> Result<()> {
        let (h, w, c1, c2) = (self.height, self.width, self.c1, self.c2);
        let (h2, w2) = (h / 2, w / 2);
        let flat = (h / 4) * (w / 4) * c2;
        let classes = self.classes;

        // dense: dW3 += p2ᵀ · dlogits, db3 += Σ dlogits, dp2 = dlogits · W3ᵀ
        let dlogits = mat(b.logits, n, classes)?;
        gemm(
            &mat(b.p2, n, flat)?.t(),
            &dlogits,
            1.0,
            &mut mat_mut(&mut grad[self.range(4)], flat, classes)?,
        );
        add_column_sums(b.logits, &mut grad[self.range(5)]);
        gemm(
            &dlogits,
            &mat(&params[self.range(4)], flat, classes)?.t(),
            0.0,
            &mut mat_mut(b.dp2, n, flat)?,
        );

        // pool2 and ReLU backward
        maxpool_backward(b.dp2, b.idx2, b.da2);
        relu_backward(b.da2, b.a2);

        // conv2: dW2 += col2ᵀ · da2, db2 += Σ da2; then dcol2 = da2 · W2ᵀ (over col2) and
        // col2im gives d(pool1 output)
        let rows2 = n * h2 * w2;
        conv_backward_weights(b.col2, b.da2, rows2, c2, grad, self.range(2), self.range(3))?;
        gemm(
            &mat(b.da2, rows2, c2)?,
            &mat(&params[self.range(2)], K * K * c1, c2)?.t(),
            0.0,
            &mut mat_mut(b.col2, rows2, K * K * c1)?,
        );
        b.dp1.fill(0.0);
        col2im_add(b.col2, n, h2, w2, c1, b.dp1);

        // pool1 and ReLU backward
        maxpool_backward(b.dp1, b.idx1, b.da1);
        relu_backward(b.da1, b.a1);

        // conv1: dW1 += col1ᵀ · da1, db1 += Σ da1 (the input needs no gradient)
        let rows1 = n * h * w;
        conv_backward_weights(b.col1, b.da1, rows1, c1, grad, self.range(0), self.range(1))
    }
}

/// One chunk's scratch buffers (see [`Cnn::floats_per_example`] for their sizes).
struct Buffers<'a> {
    /// im2col of the input.
    col1: &'a mut [f32],
    /// conv1 output after ReLU.
    a1: &'a mut [f32],
    /// pool1 output.
    p1: &'a mut [f32],
    /// im2col of `p1`; reused for its gradient in the backward pass.
    col2: &'a mut [f32],
    /// conv2 output after ReLU.
    a2: &'a mut [f32],
    /// pool2 output, i.e. the dense layer's input.
    p2: &'a mut [f32],
    /// Logits; softmax − one-hot after the loss.
    logits: &'a mut [f32],
    /// Gradient of `p2`.
    dp2: &'a mut [f32],
    /// Gradient of conv2's pre-activation.
    da2: &'a mut [f32],
    /// Gradient of `p1`.
    dp1: &'a mut [f32],
    /// Gradient of conv1's pre-activation.
    da1: &'a mut [f32],
    /// Argmax offsets (into `a1`) of pool1.
    idx1: &'a mut [usize],
    /// Argmax offsets (into `a2`) of pool2.
    idx2: &'a mut [usize],
}

impl Model for Cnn {
    fn name(&self) -> String {
        format!(
            "cnn:{}-{} ({}×{}, {} classes)",
            self.c1, self.c2, self.height, self.width, self.classes
        )
    }

    fn num_params(&self) -> usize {
        self.offsets[6]
    }

    fn input_len(&self) -> usize {
        self.height * self.width
    }

    fn classes(&self) -> usize {
        self.classes
    }

    fn chunk(&self) -> usize {
        self.chunk
    }

    fn init(&self, params: &mut [f32], seed: u64) -> Result<()> {
        check_len("params", self.num_params(), params.len())?;
        let mut rng = fastrand::Rng::with_seed(seed);
        let flat = (self.height / 4) * (self.width / 4) * self.c2;
        fill_uniform(&mut rng, &mut params[self.range(0)], he_limit(K * K));
        fill_uniform(
            &mut rng,
            &mut params[self.range(2)],
            he_limit(K * K * self.c1),
        );
        fill_uniform(
            &mut rng,
            &mut params[self.range(4)],
            xavier_limit(flat, self.classes),
        );
        for bias in [1, 3, 5] {
            params[self.range(bias)].fill(0.0);
        }
        Ok(())
    }

    fn scratch(&self, batch: usize) -> Scratch {
        let mut scratch = Scratch::new();
        scratch.prepare(
            &self.floats_per_example,
            &self.indices_per_example,
            batch.min(self.chunk),
        );
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

/// `out = relu(col · W + b)` for `rows` output positions; `W` is `(col width) × c_out`.
fn conv_forward(col: &[f32], w: &[f32], b: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
    let c_out = b.len();
    let k = w.len() / c_out;
    broadcast_rows(out, b);
    gemm(
        &mat(col, rows, k)?,
        &mat(w, k, c_out)?,
        1.0,
        &mut mat_mut(out, rows, c_out)?,
    );
    relu(out);
    Ok(())
}

/// `dW += colᵀ · dout`, `db += Σ_rows dout`, with `W` and `b` at `w` and `b` in `grad`.
fn conv_backward_weights(
    col: &[f32],
    dout: &[f32],
    rows: usize,
    c_out: usize,
    grad: &mut [f32],
    w: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> Result<()> {
    let k = w.len() / c_out;
    gemm(
        &mat(col, rows, k)?.t(),
        &mat(dout, rows, c_out)?,
        1.0,
        &mut mat_mut(&mut grad[w], k, c_out)?,
    );
    add_column_sums(dout, &mut grad[b]);
    Ok(())
}

/// For output coordinate `o` along an axis of `size` ("same" padding, stride 1): the kernel
/// taps `lo..hi` that land inside the input, and the input coordinate of tap `lo`.
fn valid_taps(o: usize, size: usize) -> (usize, usize, usize) {
    let lo = PAD.saturating_sub(o);
    let hi = K.min(size + PAD - o);
    // Input coordinate of tap `lo`.
    let first = o + lo - PAD;
    (lo, hi, first)
}

/// im2col for a K×K "same" convolution at stride 1 on NHWC `input` (`n` images of
/// `h × w × c`): `col` gets one row per output position `(img, oy, ox)` holding the
/// receptive field in `(ky, kx, c)` order, zeros where it overhangs the image.
pub(super) fn im2col(input: &[f32], n: usize, h: usize, w: usize, c: usize, col: &mut [f32]) {
    let row_len = K * K * c;
    let image = h * w * c;
    for (src, dst) in input
        .chunks_exact(image)
        .zip(col.chunks_exact_mut(h * w * row_len))
        .take(n)
    {
        for (pos, row) in dst.chunks_exact_mut(row_len).enumerate() {
            let (oy, ox) = (pos / w, pos % w);
            let (kx_lo, kx_hi, ix) = valid_taps(ox, w);
            let (ky_lo, ky_hi, iy) = valid_taps(oy, h);
            for (ky, seg) in row.chunks_exact_mut(K * c).enumerate() {
                if ky < ky_lo || ky >= ky_hi {
                    seg.fill(0.0);
                    continue;
                }
                let start = ((iy + ky - ky_lo) * w + ix) * c;
                seg[..kx_lo * c].fill(0.0);
                seg[kx_lo * c..kx_hi * c].copy_from_slice(&src[start..start + (kx_hi - kx_lo) * c]);
                seg[kx_hi * c..].fill(0.0);
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds each column entry back onto the input position it was
/// copied from (overhanging entries are dropped).
pub(super) fn col2im_add(col: &[f32], n: usize, h: usize, w: usize, c: usize, out: &mut [f32]) {
    let row_len = K * K * c;
    let image = h * w * c;
    for (src, dst) in col
        .chunks_exact(h * w * row_len)
        .zip(out.chunks_exact_mut(image))
        .take(n)
    {
        for (pos, row) in src.chunks_exact(row_len).enumerate() {
            let (oy, ox) = (pos / w, pos % w);
            let (kx_lo, kx_hi, ix) = valid_taps(ox, w);
            let (ky_lo, ky_hi, iy) = valid_taps(oy, h);
            for ky in ky_lo..ky_hi {
                let seg = &row[(ky * K + kx_lo) * c..(ky * K + kx_hi) * c];
                let start = ((iy + ky - ky_lo) * w + ix) * c;
                for (d, &s) in dst[start..start + seg.len()].iter_mut().zip(seg) {
                    *d += s;
                }
            }
        }
    }
}

/// 2×2 max-pool at stride 2 on NHWC `input` (`n × h × w × c`); `idx` records, for each
/// output, the offset in `input` of the (first) maximum.
pub(super) fn maxpool_forward(
    input: &[f32],
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    out: &mut [f32],
    idx: &mut [usize],
) {
    let row = w * c;
    let out_row = (w / 2) * c;
    let pairs = input.chunks_exact(2 * row).take(n * (h / 2));
    let outs = out
        .chunks_exact_mut(out_row)
        .zip(idx.chunks_exact_mut(out_row));
    for (pair_index, (rows, (out, idx))) in pairs.zip(outs).enumerate() {
        let (top, bottom) = rows.split_at(row);
        let base = pair_index * 2 * row;
        let windows = top.chunks_exact(2 * c).zip(bottom.chunks_exact(2 * c));
        let outs = out.chunks_exact_mut(c).zip(idx.chunks_exact_mut(c));
        for (ox, ((t, b), (out, idx))) in windows.zip(outs).enumerate() {
            let corner = base + 2 * ox * c;
            let (t0, t1) = t.split_at(c);
            let (b0, b1) = b.split_at(c);
            for ch in 0..c {
                let (mut best, mut at) = (t0[ch], corner + ch);
                for (v, offset) in [(t1[ch], c), (b0[ch], row), (b1[ch], row + c)] {
                    if v > best {
                        (best, at) = (v, corner + offset + ch);
                    }
                }
                out[ch] = best;
                idx[ch] = at;
            }
        }
    }
}

/// Max-pool backward: `dinput` gets each output gradient at its argmax, zero elsewhere.
pub(super) fn maxpool_backward(dout: &[f32], idx: &[usize], dinput: &mut [f32]) {
    dinput.fill(0.0);
    for (&g, &i) in dout.iter().zip(idx) {
        dinput[i] += g;
    }
}
