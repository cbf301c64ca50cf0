//! The MLP and the CNN on a CUDA device (feature `cuda`).
//!
//! Same layout, same conventions and same [`Model`] API as the CPU path: parameters and
//! gradients are one flat buffer each, laid out exactly as [`Mlp`] and [`Cnn`] lay them out,
//! and [`GpuModel`] is a [`Model`] whose `grad` adds the gradient of the summed loss into the
//! caller's host buffer (so the trainer, its regions and the parameter server are unchanged).
//! On the device the parameters, the activations and the gradient are flat device buffers;
//! products are cuBLAS sgemm, everything else is the NVRTC-compiled kernels of
//! `kernels.cu` (bias, ReLU, softmax cross-entropy, im2col/col2im, max-pool, SGD).
//!
//! Several tasks of an iteration run at once on different streams: each call takes a
//! [`Workspace`] (a stream with its cuBLAS handle and device buffers) from a pool and puts it
//! back after, so concurrent calls from the trainer's thread pool overlap on the device.
//! [`GpuModel::session`] keeps the parameters on the device for whole training steps
//! (forward, backward and the SGD update without leaving the device but for the batch and
//! the loss).

use std::sync::{Arc, Mutex};

use falcon_transport::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PinnedHostSlice};
use falcon_transport::cuda::{self, Arg, Gpu, Kernels, Lane, Signature, Ty};

use super::{Cnn, Mlp, Model, Scratch, check_batch, check_inputs, check_len};
use crate::{Error, Result};

/// The kernels' CUDA C++ source.
pub const KERNELS_SRC: &str = include_str!("kernels.cu");

/// Every kernel of [`KERNELS_SRC`] with its parameters after the count.
pub const SIGNATURES: &[Signature] = &[
    sig("bias_rows", &[Ty::F32sMut, Ty::F32s, Ty::U32]),
    sig("relu", &[Ty::F32sMut]),
    sig("relu_mask", &[Ty::F32sMut, Ty::F32s]),
    sig("relu_grad_over", &[Ty::F32sMut, Ty::F32s]),
    sig(
        "softmax_xent",
        &[
            Ty::F32sMut,
            Ty::U8s,
            Ty::U32,
            Ty::U32,
            Ty::F32sMut,
            Ty::F32sMut,
        ],
    ),
    sig(
        "im2col",
        &[Ty::F32s, Ty::F32sMut, Ty::U32, Ty::U32, Ty::U32],
    ),
    sig(
        "col2im",
        &[Ty::F32s, Ty::F32sMut, Ty::U32, Ty::U32, Ty::U32],
    ),
    sig(
        "maxpool",
        &[
            Ty::F32s,
            Ty::F32sMut,
            Ty::U32sMut,
            Ty::U32,
            Ty::U32,
            Ty::U32,
        ],
    ),
    sig("maxpool_back", &[Ty::F32s, Ty::U32s, Ty::F32sMut]),
    sig("sgd", &[Ty::F32sMut, Ty::F32s, Ty::F32]),
];

const fn sig(name: &'static str, params: &'static [Ty]) -> Signature {
    Signature { name, params }
}

/// Compiles every kernel to a cubin for `arch` (`sm_80`, `sm_90`…) and checks that each
/// declared kernel is in it. Needs NVRTC, no device.
pub fn compile_kernels(arch: &str) -> Result<Vec<u8>> {
    let cubin = cuda::compile_cubin(KERNELS_SRC, arch).map_err(cuda_err)?;
    for s in SIGNATURES {
        let name = s.name.as_bytes();
        let found = cubin
            .windows(name.len() + 2)
            .any(|w| w[0] == 0 && &w[1..=name.len()] == name && w[name.len() + 1] == 0);
        if !found {
            return Err(Error::Cuda(format!(
                "kernel {} is missing from the {arch} cubin",
                s.name
            )));
        }
    }
    Ok(cubin)
}

fn cuda_err(e: impl std::fmt::Display) -> Error {
    Error::Cuda(e.to_string())
}

/// The device and its loaded kernels, shared by every model of the process.
#[derive(Debug, Clone)]
pub struct Device {
    gpu: Gpu,
    kernels: Arc<Kernels>,
}

impl Device {
    /// Opens device `ordinal` and loads the kernels, once per process (later calls share
    /// them). Fails with [`Error::Cuda`] naming what is missing: libcuda, a device, libnvrtc
    /// or libcublas. Never panics.
    pub fn open(ordinal: usize) -> Result<Self> {
        static OPENED: Mutex<Vec<Device>> = Mutex::new(Vec::new());
        let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = opened.iter().find(|d| d.gpu.info().ordinal == ordinal) {
            return Ok(d.clone());
        }
        let gpu = Gpu::open(ordinal).map_err(cuda_err)?;
        // A lane needs cuBLAS: fail here, not in the first training step.
        gpu.lane().map_err(cuda_err)?;
        let kernels = Arc::new(gpu.load(KERNELS_SRC, SIGNATURES).map_err(cuda_err)?);
        let d = Device { gpu, kernels };
        opened.push(d.clone());
        Ok(d)
    }

    /// The device's description.
    pub fn info(&self) -> &cuda::DeviceInfo {
        self.gpu.info()
    }

    fn launch(&self, lane: &Lane, name: &str, n: usize, args: &mut [Arg<'_, '_>]) -> Result<()> {
        let n = u32::try_from(n)
            .map_err(|_| Error::Cuda(format!("kernel {name}: {n} threads is too many")))?;
        let k = self.kernels.get(name).map_err(cuda_err)?;
        lane.launch(k, n, args).map_err(cuda_err)
    }
}

/// Which network runs on the device.
#[derive(Debug, Clone)]
enum Net {
    Mlp(Mlp),
    Cnn(Cnn),
}

/// Most examples per device chunk.
const MAX_CHUNK_MLP: usize = 4096;
const MAX_CHUNK_CNN: usize = 256;
/// Most floats of activations per chunk (256 MiB).
const DEVICE_BUDGET_FLOATS: usize = 1 << 26;

/// An [`Mlp`] or a [`Cnn`] computing on a CUDA device; see the [module docs](self).
#[derive(Debug)]
pub struct GpuModel {
    net: Net,
    device: Device,
    /// Device floats per example of each activation buffer.
    per_example: Vec<usize>,
    /// Device indices per example of each max-pool index buffer.
    idx_per_example: Vec<usize>,
    chunk: usize,
    pool: Mutex<Vec<Workspace>>,
}

/// A stream and the device buffers for one chunk; one per concurrent call.
#[derive(Debug)]
struct Workspace {
    lane: Lane,
    bufs: Vec<CudaSlice<f32>>,
    idx: Vec<CudaSlice<u32>>,
    /// `chunk · rows per example` ones, for bias gradients as sgemm.
    ones: CudaSlice<f32>,
    loss: CudaSlice<f32>,
    correct: CudaSlice<f32>,
    params: CudaSlice<f32>,
    grad: CudaSlice<f32>,
    x: CudaSlice<f32>,
    y: CudaSlice<u8>,
    host_loss: Vec<f32>,
    host_correct: Vec<f32>,
    /// Page-locked staging of the parameters going up and the gradient coming down.
    pinned_params: PinnedHostSlice<f32>,
    pinned_grad: PinnedHostSlice<f32>,
}

impl GpuModel {
    /// The MLP `mlp` on `device`.
    pub fn mlp(mlp: Mlp, device: Device) -> Result<Self> {
        let sizes = mlp.sizes();
        let widest_hidden = sizes[1..sizes.len() - 1].iter().copied().max().unwrap_or(0);
        let mut per_example = sizes[1..].to_vec();
        per_example.push(widest_hidden.max(1));
        Self::new(
            Net::Mlp(mlp),
            device,
            per_example,
            Vec::new(),
            MAX_CHUNK_MLP,
        )
    }

    /// The CNN `cnn` on `device`.
    pub fn cnn(cnn: Cnn, device: Device) -> Result<Self> {
        let (h, w) = cnn.image_size();
        let (c1, c2) = cnn.channels();
        let (hw, hw2, hw4) = (h * w, h * w / 4, h * w / 16);
        let kk = 25;
        let per_example = vec![
            hw * kk,       // col1
            hw * c1,       // a1
            hw2 * c1,      // p1
            hw2 * kk * c1, // col2
            hw2 * c2,      // a2
            hw4 * c2,      // p2
            cnn.classes(), // logits
            hw4 * c2,      // dp2
            hw2 * c2,      // da2
            hw2 * c1,      // dp1
            hw * c1,       // da1
        ];
        let idx = vec![hw2 * c1, hw4 * c2];
        Self::new(Net::Cnn(cnn), device, per_example, idx, MAX_CHUNK_CNN)
    }

    /// The model of `spec`'s kind on `device`.
    pub fn build(model: &super::ModelSpec, device: Device) -> Result<Self> {
        match model {
            super::ModelSpec::Mlp { sizes } => Self::mlp(Mlp::new(sizes)?, device),
            super::ModelSpec::Cnn { c1, c2 } => Self::cnn(Cnn::new(*c1, *c2)?, device),
            super::ModelSpec::ResMlp { .. } => Err(crate::Error::Config(format!(
                "{model} runs on the CPU only (--device cpu); the device path has mlp and cnn"
            ))),
        }
    }

    fn new(
        net: Net,
        device: Device,
        per_example: Vec<usize>,
        idx_per_example: Vec<usize>,
        max_chunk: usize,
    ) -> Result<Self> {
        let floats: usize =
            per_example.iter().sum::<usize>() + idx_per_example.iter().sum::<usize>();
        let rows = Self::rows_per_example(&net);
        let widest = per_example
            .iter()
            .chain(&idx_per_example)
            .copied()
            .chain([rows])
            .max()
            .unwrap_or(1)
            .max(1);
        // Kernels index with 32 bits: every buffer of a chunk must stay below 2³².
        let chunk = (DEVICE_BUDGET_FLOATS / floats.max(1))
            .min(u32::MAX as usize / widest)
            .clamp(1, max_chunk);
        if widest
            .checked_mul(chunk)
            .is_none_or(|n| n > u32::MAX as usize)
        {
            return Err(Error::Config(
                "model too large for the device path (32-bit kernel indices)".to_string(),
            ));
        }
        Ok(Self {
            net,
            device,
            per_example,
            idx_per_example,
            chunk,
            pool: Mutex::new(Vec::new()),
        })
    }

    /// Rows of the sgemms per example (pixels for the CNN's first convolution): the length
    /// of the ones vector per example.
    fn rows_per_example(net: &Net) -> usize {
        match net {
            Net::Mlp(_) => 1,
            Net::Cnn(c) => {
                let (h, w) = c.image_size();
                h * w
            }
        }
    }

    fn inner(&self) -> &dyn Model {
        match &self.net {
            Net::Mlp(m) => m,
            Net::Cnn(c) => c,
        }
    }

    /// The device this model computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn workspace(&self) -> Result<Workspace> {
        if let Some(ws) = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(ws);
        }
        let lane = self.device.gpu.lane().map_err(cuda_err)?;
        let s = lane.stream().clone();
        let n = self.chunk;
        let alloc = |len: usize| s.alloc_zeros::<f32>(len.max(1)).map_err(cuda_err);
        let mut bufs = Vec::with_capacity(self.per_example.len());
        for &per in &self.per_example {
            bufs.push(alloc(per * n)?);
        }
        let mut idx = Vec::with_capacity(self.idx_per_example.len());
        for &per in &self.idx_per_example {
            idx.push(s.alloc_zeros::<u32>((per * n).max(1)).map_err(cuda_err)?);
        }
        let rows = Self::rows_per_example(&self.net) * n;
        let ones = s.clone_htod(&vec![1.0f32; rows]).map_err(cuda_err)?;
        let p = self.num_params();
        Ok(Workspace {
            ones,
            loss: alloc(n)?,
            correct: alloc(n)?,
            params: alloc(p)?,
            grad: alloc(p)?,
            x: alloc(n * self.input_len())?,
            y: s.alloc_zeros::<u8>(n).map_err(cuda_err)?,
            host_loss: vec![0.0; n],
            host_correct: vec![0.0; n],
            pinned_params: self.device.gpu.pinned(p).map_err(cuda_err)?,
            pinned_grad: self.device.gpu.pinned(p).map_err(cuda_err)?,
            bufs,
            idx,
            lane,
        })
    }

    fn give_back(&self, ws: Workspace) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).push(ws);
    }

    /// Forward (and backward into `ws.grad` when `backward`) over the examples, in chunks,
    /// with the parameters already in `ws.params`. Returns `(loss_sum, correct)`.
    fn run_device(
        &self,
        ws: &mut Workspace,
        x: &[f32],
        y: &[u8],
        backward: bool,
    ) -> Result<(f32, usize)> {
        let (mut loss, mut correct) = (0.0f64, 0usize);
        let d = self.input_len();
        for (xc, yc) in x.chunks(self.chunk * d).zip(y.chunks(self.chunk)) {
            let n = yc.len();
            let s = ws.lane.stream().clone();
            s.memcpy_htod(xc, &mut ws.x.slice_mut(..xc.len()))
                .map_err(cuda_err)?;
            s.memcpy_htod(yc, &mut ws.y.slice_mut(..n))
                .map_err(cuda_err)?;
            match &self.net {
                Net::Mlp(m) => self.mlp_chunk(m, ws, n, backward)?,
                Net::Cnn(c) => self.cnn_chunk(c, ws, n, backward)?,
            }
            s.memcpy_dtoh(&ws.loss.slice(..n), &mut ws.host_loss[..n])
                .map_err(cuda_err)?;
            s.memcpy_dtoh(&ws.correct.slice(..n), &mut ws.host_correct[..n])
                .map_err(cuda_err)?;
            loss += ws.host_loss[..n].iter().map(|&l| f64::from(l)).sum::<f64>();
            correct += ws.host_correct[..n].iter().filter(|&&c| c > 0.5).count();
        }
        Ok((loss as f32, correct))
    }

    /// The loss on the logits in `logits` (rows of `classes`), and its backward in place.
    #[allow(clippy::too_many_arguments)]
    fn loss(
        &self,
        lane: &Lane,
        logits: &mut CudaSlice<f32>,
        y: &CudaSlice<u8>,
        n: usize,
        backward: bool,
        loss: &mut CudaSlice<f32>,
        correct: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let classes = self.classes();
        self.device.launch(
            lane,
            "softmax_xent",
            n,
            &mut [
                Arg::F32sMut(&mut logits.slice_mut(..n * classes)),
                Arg::U8s(&y.slice(..n)),
                Arg::U32(classes as u32),
                Arg::U32(u32::from(backward)),
                Arg::F32sMut(&mut loss.slice_mut(..n)),
                Arg::F32sMut(&mut correct.slice_mut(..n)),
            ],
        )
    }

    fn mlp_chunk(&self, m: &Mlp, ws: &mut Workspace, n: usize, backward: bool) -> Result<()> {
        let sizes = m.sizes();
        let layers = sizes.len() - 1;
        let dev = &self.device;
        let Workspace {
            lane,
            bufs,
            ones,
            loss,
            correct,
            params,
            grad,
            x,
            y,
            ..
        } = ws;
        let (acts, tmp) = bufs.split_at_mut(layers);
        // Offsets of each layer's W and b.
        let mut offsets = Vec::with_capacity(layers);
        let mut off = 0;
        for pair in sizes.windows(2) {
            let (fi, fo) = (pair[0], pair[1]);
            offsets.push((off, off + fi * fo));
            off += fi * fo + fo;
        }
        for l in 0..layers {
            let (fi, fo) = (sizes[l], sizes[l + 1]);
            let (w, b) = offsets[l];
            let (done, rest) = acts.split_at_mut(l);
            let input = if l == 0 {
                x.slice(..n * fi)
            } else {
                done[l - 1].slice(..n * fi)
            };
            let mut out = rest[0].slice_mut(..n * fo);
            dev.launch(
                lane,
                "bias_rows",
                n * fo,
                &mut [
                    Arg::F32sMut(&mut out),
                    Arg::F32s(&params.slice(b..b + fo)),
                    Arg::U32(fo as u32),
                ],
            )?;
            lane.sgemm(
                (false, false),
                (n, fo, fi),
                1.0,
                &input,
                &params.slice(w..w + fi * fo),
                1.0,
                &mut out,
            )
            .map_err(cuda_err)?;
            if l + 1 < layers {
                dev.launch(lane, "relu", n * fo, &mut [Arg::F32sMut(&mut out)])?;
            }
        }
        self.loss(lane, &mut acts[layers - 1], y, n, backward, loss, correct)?;
        if !backward {
            return Ok(());
        }
        for l in (0..layers).rev() {
            let (fi, fo) = (sizes[l], sizes[l + 1]);
            let (w, b) = offsets[l];
            let (below, rest) = acts.split_at_mut(l);
            let delta = rest[0].slice(..n * fo);
            {
                let input = if l == 0 {
                    x.slice(..n * fi)
                } else {
                    below[l - 1].slice(..n * fi)
                };
                // dW += inputᵀ · delta ; db += onesᵀ · delta
                lane.sgemm(
                    (true, false),
                    (fi, fo, n),
                    1.0,
                    &input,
                    &delta,
                    1.0,
                    &mut grad.slice_mut(w..w + fi * fo),
                )
                .map_err(cuda_err)?;
            }
            lane.sgemm(
                (false, false),
                (1, fo, n),
                1.0,
                &ones.slice(..n),
                &delta,
                1.0,
                &mut grad.slice_mut(b..b + fo),
            )
            .map_err(cuda_err)?;
            if l == 0 {
                break;
            }
            // delta_below = (delta · Wᵀ) ⊙ relu'(act_below), written over act_below.
            let mut t = tmp[0].slice_mut(..n * fi);
            lane.sgemm(
                (false, true),
                (n, fi, fo),
                1.0,
                &delta,
                &params.slice(w..w + fi * fo),
                0.0,
                &mut t,
            )
            .map_err(cuda_err)?;
            dev.launch(
                lane,
                "relu_grad_over",
                n * fi,
                &mut [
                    Arg::F32sMut(&mut below[l - 1].slice_mut(..n * fi)),
                    Arg::F32s(&t.as_view()),
                ],
            )?;
        }
        Ok(())
    }

    fn cnn_chunk(&self, c: &Cnn, ws: &mut Workspace, n: usize, backward: bool) -> Result<()> {
        let dev = &self.device;
        let (h, w) = c.image_size();
        let (c1, c2) = c.channels();
        let classes = c.classes();
        let (h2, w2) = (h / 2, w / 2);
        let flat = (h / 4) * (w / 4) * c2;
        let kk = 25;
        let pe = &self.per_example;
        let Workspace {
            lane,
            bufs,
            idx,
            ones,
            loss,
            correct,
            params,
            grad,
            x,
            y,
            ..
        } = ws;
        let [col1, a1, p1, col2, a2, p2, logits, dp2, da2, dp1, da1] = &mut bufs[..] else {
            return Err(Error::Cuda("cnn: device buffers missing".into()));
        };
        let [idx1, idx2] = &mut idx[..] else {
            return Err(Error::Cuda("cnn: device index buffers missing".into()));
        };
        let r = |i: usize| c.range(i);
        let pv = |i: usize| params.slice(r(i));
        let u = |v: usize| v as u32;
        let (rows1, rows2) = (n * h * w, n * h2 * w2);

        // conv1 + ReLU + pool
        dev.launch(
            lane,
            "im2col",
            n * pe[0],
            &mut [
                Arg::F32s(&x.slice(..n * h * w)),
                Arg::F32sMut(&mut col1.slice_mut(..n * pe[0])),
                Arg::U32(u(h)),
                Arg::U32(u(w)),
                Arg::U32(1),
            ],
        )?;
        self.conv_forward(
            lane,
            &col1.slice(..n * pe[0]),
            &pv(0),
            &pv(1),
            rows1,
            &mut a1.slice_mut(..n * pe[1]),
        )?;
        self.pool(lane, a1, p1, idx1, n, h, w, c1)?;
        // conv2 + ReLU + pool
        dev.launch(
            lane,
            "im2col",
            n * pe[3],
            &mut [
                Arg::F32s(&p1.slice(..n * pe[2])),
                Arg::F32sMut(&mut col2.slice_mut(..n * pe[3])),
                Arg::U32(u(h2)),
                Arg::U32(u(w2)),
                Arg::U32(u(c1)),
            ],
        )?;
        self.conv_forward(
            lane,
            &col2.slice(..n * pe[3]),
            &pv(2),
            &pv(3),
            rows2,
            &mut a2.slice_mut(..n * pe[4]),
        )?;
        self.pool(lane, a2, p2, idx2, n, h2, w2, c2)?;
        // dense
        {
            let mut lg = logits.slice_mut(..n * classes);
            dev.launch(
                lane,
                "bias_rows",
                n * classes,
                &mut [
                    Arg::F32sMut(&mut lg),
                    Arg::F32s(&pv(5)),
                    Arg::U32(u(classes)),
                ],
            )?;
            lane.sgemm(
                (false, false),
                (n, classes, flat),
                1.0,
                &p2.slice(..n * flat),
                &pv(4),
                1.0,
                &mut lg,
            )
            .map_err(cuda_err)?;
        }
        self.loss(lane, logits, y, n, backward, loss, correct)?;
        if !backward {
            return Ok(());
        }

        // dense: dW3 += p2ᵀ · dlogits, db3 += Σ dlogits, dp2 = dlogits · W3ᵀ
        let dl = logits.slice(..n * classes);
        lane.sgemm(
            (true, false),
            (flat, classes, n),
            1.0,
            &p2.slice(..n * flat),
            &dl,
            1.0,
            &mut grad.slice_mut(r(4)),
        )
        .map_err(cuda_err)?;
        lane.sgemm(
            (false, false),
            (1, classes, n),
            1.0,
            &ones.slice(..n),
            &dl,
            1.0,
            &mut grad.slice_mut(r(5)),
        )
        .map_err(cuda_err)?;
        lane.sgemm(
            (false, true),
            (n, flat, classes),
            1.0,
            &dl,
            &pv(4),
            0.0,
            &mut dp2.slice_mut(..n * flat),
        )
        .map_err(cuda_err)?;

        // pool2 and ReLU backward
        self.unpool(lane, dp2, idx2, da2, n * pe[5], n * pe[4])?;
        dev.launch(
            lane,
            "relu_mask",
            n * pe[4],
            &mut [
                Arg::F32sMut(&mut da2.slice_mut(..n * pe[4])),
                Arg::F32s(&a2.slice(..n * pe[4])),
            ],
        )?;

        // conv2: dW2 += col2ᵀ · da2, db2 += Σ da2, dcol2 = da2 · W2ᵀ over col2, col2im
        let d2 = da2.slice(..n * pe[4]);
        conv_param_grads(
            lane,
            (&col2.slice(..n * pe[3]), &d2, &ones.slice(..rows2)),
            (kk * c1, c2, rows2),
            grad,
            (r(2), r(3)),
        )?;
        lane.sgemm(
            (false, true),
            (rows2, kk * c1, c2),
            1.0,
            &d2,
            &pv(2),
            0.0,
            &mut col2.slice_mut(..n * pe[3]),
        )
        .map_err(cuda_err)?;
        dev.launch(
            lane,
            "col2im",
            n * pe[9],
            &mut [
                Arg::F32s(&col2.slice(..n * pe[3])),
                Arg::F32sMut(&mut dp1.slice_mut(..n * pe[9])),
                Arg::U32(u(h2)),
                Arg::U32(u(w2)),
                Arg::U32(u(c1)),
            ],
        )?;

        // pool1 and ReLU backward
        self.unpool(lane, dp1, idx1, da1, n * pe[9], n * pe[10])?;
        dev.launch(
            lane,
            "relu_mask",
            n * pe[10],
            &mut [
                Arg::F32sMut(&mut da1.slice_mut(..n * pe[10])),
                Arg::F32s(&a1.slice(..n * pe[1])),
            ],
        )?;

        // conv1: dW1 += col1ᵀ · da1, db1 += Σ da1
        let d1 = da1.slice(..n * pe[10]);
        conv_param_grads(
            lane,
            (&col1.slice(..n * pe[0]), &d1, &ones.slice(..rows1)),
            (kk, c1, rows1),
            grad,
            (r(0), r(1)),
        )
    }

    /// `out = relu(col · W + b)` for `rows` output positions.
    fn conv_forward<'a>(
        &self,
        lane: &Lane,
        col: &CudaView<'a, f32>,
        w: &CudaView<'a, f32>,
        b: &CudaView<'a, f32>,
        rows: usize,
        out: &mut CudaViewMut<'a, f32>,
    ) -> Result<()> {
        let c_out = b.len();
        let k = w.len() / c_out;
        self.device.launch(
            lane,
            "bias_rows",
            rows * c_out,
            &mut [Arg::F32sMut(out), Arg::F32s(b), Arg::U32(c_out as u32)],
        )?;
        lane.sgemm((false, false), (rows, c_out, k), 1.0, col, w, 1.0, out)
            .map_err(cuda_err)?;
        self.device
            .launch(lane, "relu", rows * c_out, &mut [Arg::F32sMut(out)])
    }

    /// 2×2 max-pool of `n` NHWC images `h × w × c`.
    #[allow(clippy::too_many_arguments)]
    fn pool(
        &self,
        lane: &Lane,
        input: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        idx: &mut CudaSlice<u32>,
        n: usize,
        h: usize,
        w: usize,
        c: usize,
    ) -> Result<()> {
        let outs = n * (h / 2) * (w / 2) * c;
        self.device.launch(
            lane,
            "maxpool",
            outs,
            &mut [
                Arg::F32s(&input.slice(..n * h * w * c)),
                Arg::F32sMut(&mut out.slice_mut(..outs)),
                Arg::U32sMut(&mut idx.slice_mut(..outs)),
                Arg::U32(h as u32),
                Arg::U32(w as u32),
                Arg::U32(c as u32),
            ],
        )
    }

    /// Max-pool backward: `dinput` (`ins` floats) zeroed, then each of the `outs` gradients
    /// at its argmax (offsets below `ins`, written by [`GpuModel::pool`]).
    fn unpool(
        &self,
        lane: &Lane,
        dout: &CudaSlice<f32>,
        idx: &CudaSlice<u32>,
        dinput: &mut CudaSlice<f32>,
        outs: usize,
        ins: usize,
    ) -> Result<()> {
        let mut din = dinput.slice_mut(..ins);
        lane.stream().memset_zeros(&mut din).map_err(cuda_err)?;
        self.device.launch(
            lane,
            "maxpool_back",
            outs,
            &mut [
                Arg::F32s(&dout.slice(..outs)),
                Arg::U32s(&idx.slice(..outs)),
                Arg::F32sMut(&mut din),
            ],
        )
    }

    /// A training session with the parameters resident on the device.
    pub fn session(&self, params: &[f32]) -> Result<Session<'_>> {
        check_len("params", self.num_params(), params.len())?;
        let mut ws = self.workspace()?;
        let s = ws.lane.stream().clone();
        s.memcpy_htod(params, &mut ws.params).map_err(cuda_err)?;
        Ok(Session {
            model: self,
            ws: Some(ws),
        })
    }
}

impl Model for GpuModel {
    fn name(&self) -> String {
        format!("{} on {}", self.inner().name(), self.device.info().name)
    }

    fn num_params(&self) -> usize {
        self.inner().num_params()
    }

    fn input_len(&self) -> usize {
        self.inner().input_len()
    }

    fn classes(&self) -> usize {
        self.inner().classes()
    }

    fn chunk(&self) -> usize {
        self.chunk
    }

    fn init(&self, params: &mut [f32], seed: u64) -> Result<()> {
        self.inner().init(params, seed)
    }

    /// The host scratch is not used: the device buffers live in the model's workspaces.
    fn scratch(&self, _batch: usize) -> Scratch {
        Scratch::new()
    }

    fn pass(
        &self,
        params: &[f32],
        x: &[f32],
        y: &[u8],
        grad: Option<&mut [f32]>,
        _scratch: &mut Scratch,
    ) -> Result<(f32, usize)> {
        check_batch(self, params, x, y)?;
        if let Some(g) = grad.as_deref() {
            check_len("grad", self.num_params(), g.len())?;
        }
        if y.is_empty() {
            return Ok((0.0, 0));
        }
        let mut ws = self.workspace()?;
        let out = (|| {
            let s = ws.lane.stream().clone();
            // Through page-locked staging: one host copy each way, the transfers are DMA.
            ws.pinned_params.as_mut_slice().map_err(cuda_err)?[..params.len()]
                .copy_from_slice(params);
            s.memcpy_htod(&ws.pinned_params, &mut ws.params)
                .map_err(cuda_err)?;
            if grad.is_some() {
                s.memset_zeros(&mut ws.grad).map_err(cuda_err)?;
            }
            let r = self.run_device(&mut ws, x, y, grad.is_some())?;
            if let Some(g) = grad {
                s.memcpy_dtoh(&ws.grad, &mut ws.pinned_grad)
                    .map_err(cuda_err)?;
                let staged = ws.pinned_grad.as_slice().map_err(cuda_err)?;
                for (a, &d) in g.iter_mut().zip(staged) {
                    *a += d;
                }
            }
            Ok(r)
        })();
        // A workspace whose stream failed is dropped, not reused.
        if out.is_ok() {
            self.give_back(ws);
        }
        out
    }
}

/// Parameters resident on the device for whole SGD steps (see [`GpuModel::session`]).
#[derive(Debug)]
pub struct Session<'m> {
    model: &'m GpuModel,
    ws: Option<Workspace>,
}

impl Session<'_> {
    fn ws(&mut self) -> Result<&mut Workspace> {
        self.ws
            .as_mut()
            .ok_or_else(|| Error::Cuda("the session failed earlier".to_string()))
    }

    /// One SGD step on the batch: the gradient of the summed loss, then
    /// `params −= lr · grad`, all on the device. Returns `(loss_sum, correct)` of the batch
    /// before the update.
    pub fn step(&mut self, x: &[f32], y: &[u8], lr: f32) -> Result<(f32, usize)> {
        let model = self.model;
        let p = model.num_params();
        check_inputs(model, x, y)?;
        let ws = self.ws()?;
        let result = (|| {
            ws.lane
                .stream()
                .memset_zeros(&mut ws.grad)
                .map_err(cuda_err)?;
            let r = model.run_device(ws, x, y, true)?;
            let Workspace {
                lane, params, grad, ..
            } = ws;
            model.device.launch(
                lane,
                "sgd",
                p,
                &mut [
                    Arg::F32sMut(&mut params.slice_mut(..p)),
                    Arg::F32s(&grad.slice(..p)),
                    Arg::F32(lr),
                ],
            )?;
            Ok(r)
        })();
        if result.is_err() {
            self.ws = None;
        }
        result
    }

    /// The current parameters.
    pub fn params(&mut self) -> Result<Vec<f32>> {
        let ws = self.ws()?;
        ws.lane.stream().clone_dtoh(&ws.params).map_err(cuda_err)
    }

    /// Waits for the work queued so far (for timing).
    pub fn synchronize(&mut self) -> Result<()> {
        self.ws()?.lane.synchronize().map_err(cuda_err)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if let Some(ws) = self.ws.take() {
            self.model.give_back(ws);
        }
    }
}

/// Opens device 0 for a test, or says why the test skips (on stdout, so `--nocapture` and
/// CI logs show it). With `FALCON_CUDA_REQUIRE_DEVICE=1` a missing device fails instead.
#[doc(hidden)]
pub fn device_for_test(test: &str) -> Option<Device> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("FALCON_CUDA_REQUIRE_DEVICE").as_deref() != Ok("1") => {
            println!("SKIPPED: {test}: no usable CUDA device: {e}");
            None
        }
        Err(e) => panic!("{test}: FALCON_CUDA_REQUIRE_DEVICE=1 but {e}"),
    }
}

/// A conv layer's parameter gradients from `d`, the gradient at its `rows` output positions
/// (`c_out` channels, `k` inputs each; `col` its im2col input, `ones` at least `rows` ones):
/// `dW += colᵀ · d` into `grad[w]`, `db += Σ d` into `grad[b]`.
fn conv_param_grads(
    lane: &Lane,
    (col, d, ones): (&CudaView<'_, f32>, &CudaView<'_, f32>, &CudaView<'_, f32>),
    (k, c_out, rows): (usize, usize, usize),
    grad: &mut CudaSlice<f32>,
    (w, b): (std::ops::Range<usize>, std::ops::Range<usize>),
) -> Result<()> {
    lane.sgemm(
        (true, false),
        (k, c_out, rows),
        1.0,
        col,
        d,
        1.0,
        &mut grad.slice_mut(w),
    )
    .map_err(cuda_err)?;
    lane.sgemm(
        (false, false),
        (1, c_out, rows),
        1.0,
        ones,
        d,
        1.0,
        &mut grad.slice_mut(b),
    )
    .map_err(cuda_err)
}

#[cfg(test)]
mod tests {
    use super::super::{broadcast_rows, cnn, relu, relu_backward, softmax_cross_entropy};
    use super::*;

    fn rand_vec(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect()
    }

    fn close(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1.0);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-4 * scale,
                "{what}[{i}]: gpu {g}, cpu {w}"
            );
        }
    }

    struct T {
        dev: Device,
        lane: Lane,
    }

    impl T {
        fn new(test: &str) -> Option<T> {
            let dev = device_for_test(test)?;
            let lane = dev.gpu.lane().unwrap();
            Some(T { dev, lane })
        }
        fn up<V: falcon_transport::cuda::cudarc::driver::DeviceRepr + Copy>(
            &self,
            v: &[V],
        ) -> CudaSlice<V> {
            self.lane.stream().clone_htod(v).unwrap()
        }
        fn down<V: falcon_transport::cuda::cudarc::driver::DeviceRepr + Default + Copy>(
            &self,
            v: &CudaSlice<V>,
        ) -> Vec<V> {
            self.lane.stream().clone_dtoh(v).unwrap()
        }
        fn go(&self, name: &str, n: usize, args: &mut [Arg<'_, '_>]) {
            self.dev.launch(&self.lane, name, n, args).unwrap();
        }
    }

    #[test]
    fn elementwise_kernels_match_the_cpu() {
        let Some(t) = T::new("elementwise_kernels_match_the_cpu") else {
            return;
        };
        let mut rng = fastrand::Rng::with_seed(1);
        let (rows, cols) = (37, 13);
        let bias = rand_vec(&mut rng, cols);
        let mut want = vec![0.0; rows * cols];
        broadcast_rows(&mut want, &bias);
        let mut out = t.up(&vec![9.0f32; rows * cols]);
        let b = t.up(&bias);
        t.go(
            "bias_rows",
            rows * cols,
            &mut [
                Arg::F32sMut(&mut out.as_view_mut()),
                Arg::F32s(&b.as_view()),
                Arg::U32(cols as u32),
            ],
        );
        close("bias_rows", &t.down(&out), &want);

        let v = rand_vec(&mut rng, 1000);
        let mut want = v.clone();
        relu(&mut want);
        let mut d = t.up(&v);
        t.go("relu", v.len(), &mut [Arg::F32sMut(&mut d.as_view_mut())]);
        close("relu", &t.down(&d), &want);

        let (delta, act) = (rand_vec(&mut rng, 1000), rand_vec(&mut rng, 1000));
        let mut want = delta.clone();
        relu_backward(&mut want, &act);
        let (mut dd, da) = (t.up(&delta), t.up(&act));
        t.go(
            "relu_mask",
            1000,
            &mut [
                Arg::F32sMut(&mut dd.as_view_mut()),
                Arg::F32s(&da.as_view()),
            ],
        );
        close("relu_mask", &t.down(&dd), &want);
        let (mut da, dd) = (t.up(&act), t.up(&delta));
        t.go(
            "relu_grad_over",
            1000,
            &mut [
                Arg::F32sMut(&mut da.as_view_mut()),
                Arg::F32s(&dd.as_view()),
            ],
        );
        close("relu_grad_over", &t.down(&da), &want);

        let (p, g) = (rand_vec(&mut rng, 777), rand_vec(&mut rng, 777));
        let want: Vec<f32> = p.iter().zip(&g).map(|(p, g)| p - 0.25 * g).collect();
        let (mut dp, dg) = (t.up(&p), t.up(&g));
        t.go(
            "sgd",
            777,
            &mut [
                Arg::F32sMut(&mut dp.as_view_mut()),
                Arg::F32s(&dg.as_view()),
                Arg::F32(0.25),
            ],
        );
        close("sgd", &t.down(&dp), &want);
    }

    #[test]
    fn softmax_cross_entropy_matches_the_cpu() {
        let Some(t) = T::new("softmax_cross_entropy_matches_the_cpu") else {
            return;
        };
        let mut rng = fastrand::Rng::with_seed(2);
        let (n, classes) = (300, 10);
        let logits: Vec<f32> = rand_vec(&mut rng, n * classes)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let y: Vec<u8> = (0..n).map(|_| rng.u8(..classes as u8)).collect();
        for backward in [false, true] {
            let mut want = logits.clone();
            let (loss, correct) = softmax_cross_entropy(&mut want, &y, classes, backward);
            let mut dl = t.up(&logits);
            let dy = t.up(&y);
            let mut l = t.up(&vec![0.0f32; n]);
            let mut c = t.up(&vec![0.0f32; n]);
            t.go(
                "softmax_xent",
                n,
                &mut [
                    Arg::F32sMut(&mut dl.as_view_mut()),
                    Arg::U8s(&dy.as_view()),
                    Arg::U32(classes as u32),
                    Arg::U32(u32::from(backward)),
                    Arg::F32sMut(&mut l.as_view_mut()),
                    Arg::F32sMut(&mut c.as_view_mut()),
                ],
            );
            let got_loss: f64 = t.down(&l).iter().map(|&v| f64::from(v)).sum();
            let got_correct = t.down(&c).iter().filter(|&&v| v > 0.5).count();
            assert!(
                (got_loss - loss).abs() <= 1e-4 * loss.abs(),
                "{got_loss} vs {loss}"
            );
            assert_eq!(got_correct, correct);
            close("softmax_xent", &t.down(&dl), &want);
        }
    }

    #[test]
    fn convolution_and_pooling_kernels_match_the_cpu() {
        let Some(t) = T::new("convolution_and_pooling_kernels_match_the_cpu") else {
            return;
        };
        let mut rng = fastrand::Rng::with_seed(3);
        let (n, h, w, c) = (3, 8, 12, 4);
        let input = rand_vec(&mut rng, n * h * w * c);
        let cols = n * h * w * 25 * c;
        let mut want = vec![0.0; cols];
        cnn::im2col(&input, n, h, w, c, &mut want);
        let din = t.up(&input);
        let mut dcol = t.up(&vec![7.0f32; cols]);
        let dims = [Arg::U32(h as u32), Arg::U32(w as u32), Arg::U32(c as u32)];
        let [dh, dw, dc] = dims;
        t.go(
            "im2col",
            cols,
            &mut [
                Arg::F32s(&din.as_view()),
                Arg::F32sMut(&mut dcol.as_view_mut()),
                dh,
                dw,
                dc,
            ],
        );
        close("im2col", &t.down(&dcol), &want);

        let col = rand_vec(&mut rng, cols);
        let mut want = vec![0.0; n * h * w * c];
        cnn::col2im_add(&col, n, h, w, c, &mut want);
        let dcol = t.up(&col);
        let mut dout = t.up(&vec![5.0f32; n * h * w * c]);
        t.go(
            "col2im",
            n * h * w * c,
            &mut [
                Arg::F32s(&dcol.as_view()),
                Arg::F32sMut(&mut dout.as_view_mut()),
                Arg::U32(h as u32),
                Arg::U32(w as u32),
                Arg::U32(c as u32),
            ],
        );
        close("col2im", &t.down(&dout), &want);

        let outs = n * (h / 2) * (w / 2) * c;
        let (mut want, mut want_idx) = (vec![0.0; outs], vec![0usize; outs]);
        cnn::maxpool_forward(&input, n, h, w, c, &mut want, &mut want_idx);
        let mut dp = t.up(&vec![0.0f32; outs]);
        let mut di = t.up(&vec![0u32; outs]);
        t.go(
            "maxpool",
            outs,
            &mut [
                Arg::F32s(&din.as_view()),
                Arg::F32sMut(&mut dp.as_view_mut()),
                Arg::U32sMut(&mut di.as_view_mut()),
                Arg::U32(h as u32),
                Arg::U32(w as u32),
                Arg::U32(c as u32),
            ],
        );
        close("maxpool", &t.down(&dp), &want);
        let got_idx: Vec<usize> = t.down(&di).iter().map(|&i| i as usize).collect();
        assert_eq!(got_idx, want_idx, "maxpool argmax");

        let g = rand_vec(&mut rng, outs);
        let mut want = vec![0.0; n * h * w * c];
        cnn::maxpool_backward(&g, &want_idx, &mut want);
        let dg = t.up(&g);
        let mut dback = t.up(&vec![0.0f32; n * h * w * c]);
        t.go(
            "maxpool_back",
            outs,
            &mut [
                Arg::F32s(&dg.as_view()),
                Arg::U32s(&di.as_view()),
                Arg::F32sMut(&mut dback.as_view_mut()),
            ],
        );
        close("maxpool_back", &t.down(&dback), &want);
    }

    #[test]
    fn sgemm_matches_ndarray_in_every_transposition() {
        let Some(t) = T::new("sgemm_matches_ndarray_in_every_transposition") else {
            return;
        };
        let mut rng = fastrand::Rng::with_seed(4);
        let (m, n, k) = (17, 9, 23);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let a = rand_vec(&mut rng, m * k);
            let b = rand_vec(&mut rng, k * n);
            let c0 = rand_vec(&mut rng, m * n);
            let am = ndarray::Array2::from_shape_vec(if ta { (k, m) } else { (m, k) }, a.clone())
                .unwrap();
            let bm = ndarray::Array2::from_shape_vec(if tb { (n, k) } else { (k, n) }, b.clone())
                .unwrap();
            let am = if ta { am.t().to_owned() } else { am };
            let bm = if tb { bm.t().to_owned() } else { bm };
            let want = am.dot(&bm) * 0.5
                + ndarray::Array2::from_shape_vec((m, n), c0.clone()).unwrap() * 2.0;
            let (da, db) = (t.up(&a), t.up(&b));
            let mut dc = t.up(&c0);
            t.lane
                .sgemm(
                    (ta, tb),
                    (m, n, k),
                    0.5,
                    &da.as_view(),
                    &db.as_view(),
                    2.0,
                    &mut dc.as_view_mut(),
                )
                .unwrap();
            let want: Vec<f32> = want.iter().copied().collect();
            close(&format!("sgemm ta={ta} tb={tb}"), &t.down(&dc), &want);
        }
        // Lengths are checked before cuBLAS sees them.
        let (da, db) = (t.up(&[0.0f32; 10]), t.up(&[0.0f32; 10]));
        let mut dc = t.up(&[0.0f32; 10]);
        let e = t
            .lane
            .sgemm(
                (false, false),
                (4, 4, 4),
                1.0,
                &da.as_view(),
                &db.as_view(),
                0.0,
                &mut dc.as_view_mut(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("sgemm"), "{e}");
    }

    #[test]
    fn a_launch_with_the_wrong_argument_types_is_refused() {
        let Some(t) = T::new("a_launch_with_the_wrong_argument_types_is_refused") else {
            return;
        };
        let d = t.up(&[1.0f32; 4]);
        let e = t
            .dev
            .launch(&t.lane, "relu", 4, &mut [Arg::F32s(&d.as_view())])
            .unwrap_err();
        assert!(e.to_string().contains("relu"), "{e}");
    }
}
