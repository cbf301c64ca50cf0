// The trainer's CUDA kernels, compiled at run time with NVRTC (see gpu.rs).
//
// Every kernel takes the thread count `n` first and returns at once on a thread whose index
// is `n` or more: the caller launches at least `n` threads and checks that the buffers hold
// what that count reads and writes. The layouts are the CPU path's (model/mlp.rs, cnn.rs):
// row-major matrices, NHWC images, 5×5 "same" convolutions, 2×2 max-pools.

#define K 5
#define PAD 2

__device__ __forceinline__ unsigned int tid() { return blockIdx.x * blockDim.x + threadIdx.x; }

// out[i] = bias[i % cols]: the bias of every row, before the sgemm adds onto it.
extern "C" __global__ void bias_rows(unsigned int n, float* out, const float* bias, unsigned int cols) {
    unsigned int i = tid();
    if (i >= n) return;
    out[i] = bias[i % cols];
}

extern "C" __global__ void relu(unsigned int n, float* v) {
    unsigned int i = tid();
    if (i >= n) return;
    v[i] = fmaxf(v[i], 0.0f);
}

// ReLU backward: zero the gradient where the activation is not positive.
extern "C" __global__ void relu_mask(unsigned int n, float* delta, const float* act) {
    unsigned int i = tid();
    if (i >= n) return;
    delta[i] = act[i] > 0.0f ? delta[i] : 0.0f;
}

// The same, written over the activation: act = relu'(act) ⊙ delta.
extern "C" __global__ void relu_grad_over(unsigned int n, float* act, const float* delta) {
    unsigned int i = tid();
    if (i >= n) return;
    act[i] = act[i] > 0.0f ? delta[i] : 0.0f;
}

// Softmax cross-entropy, one thread per row of `classes` logits: the row's loss and whether
// its first maximum is the label; with `backward`, the row becomes softmax − one_hot(label).
extern "C" __global__ void softmax_xent(unsigned int n, float* logits, const unsigned char* labels,
                                        unsigned int classes, unsigned int backward, float* loss,
                                        float* correct) {
    unsigned int r = tid();
    if (r >= n) return;
    float* row = logits + (size_t)r * classes;
    unsigned int label = labels[r];
    unsigned int best = 0;
    float mx = row[0];
    for (unsigned int j = 1; j < classes; ++j) {
        if (row[j] > mx) { mx = row[j]; best = j; }
    }
    float sum = 0.0f;
    for (unsigned int j = 0; j < classes; ++j) sum += expf(row[j] - mx);
    float lse = mx + logf(sum);
    loss[r] = lse - row[label];
    correct[r] = best == label ? 1.0f : 0.0f;
    if (backward) {
        for (unsigned int j = 0; j < classes; ++j) row[j] = expf(row[j] - lse);
        row[label] -= 1.0f;
    }
}

// im2col for a 5×5 "same" convolution on NHWC input (h × w × c per image): one thread per
// column entry; a row per output position (img, oy, ox) in (ky, kx, c) order, zero where the
// window overhangs the image.
extern "C" __global__ void im2col(unsigned int n, const float* input, float* col, unsigned int h,
                                  unsigned int w, unsigned int c) {
    unsigned int i = tid();
    if (i >= n) return;
    unsigned int row_len = K * K * c;
    unsigned int pos = i / row_len, r = i % row_len;
    unsigned int img = pos / (h * w), p = pos % (h * w);
    int oy = p / w, ox = p % w;
    int ky = r / (K * c), kx = (r / c) % K, ch = r % c;
    int iy = oy + ky - PAD, ix = ox + kx - PAD;
    float v = 0.0f;
    if (iy >= 0 && iy < (int)h && ix >= 0 && ix < (int)w)
        v = input[(((size_t)img * h + iy) * w + ix) * c + ch];
    col[i] = v;
}

// The adjoint of im2col: one thread per input entry gathers every column entry copied from
// it (no atomics, so the sum is deterministic); writes, does not add.
extern "C" __global__ void col2im(unsigned int n, const float* col, float* out, unsigned int h,
                                  unsigned int w, unsigned int c) {
    unsigned int i = tid();
    if (i >= n) return;
    unsigned int ch = i % c, pix = i / c;
    unsigned int img = pix / (h * w), p = pix % (h * w);
    int iy = p / w, ix = p % w;
    size_t row_len = K * K * c;
    float s = 0.0f;
    for (int ky = 0; ky < K; ++ky) {
        int oy = iy - ky + PAD;
        if (oy < 0 || oy >= (int)h) continue;
        for (int kx = 0; kx < K; ++kx) {
            int ox = ix - kx + PAD;
            if (ox < 0 || ox >= (int)w) continue;
            size_t pos = ((size_t)img * h + oy) * w + ox;
            s += col[pos * row_len + (ky * K + kx) * c + ch];
        }
    }
    out[i] = s;
}

// 2×2 max-pool at stride 2 on NHWC input: one thread per output; `idx` gets the offset in
// the input of the first maximum (row-major order within the window, as on the CPU).
extern "C" __global__ void maxpool(unsigned int n, const float* input, float* out, unsigned int* idx,
                                   unsigned int h, unsigned int w, unsigned int c) {
    unsigned int i = tid();
    if (i >= n) return;
    unsigned int w2 = w / 2, h2 = h / 2;
    unsigned int ch = i % c, q = i / c;
    unsigned int ox = q % w2, oy = (q / w2) % h2, img = q / (w2 * h2);
    unsigned int corner = ((img * h + 2 * oy) * w + 2 * ox) * c + ch;
    unsigned int offs[3] = {c, w * c, w * c + c};
    float best = input[corner];
    unsigned int at = corner;
    for (int t = 0; t < 3; ++t) {
        float v = input[corner + offs[t]];
        if (v > best) { best = v; at = corner + offs[t]; }
    }
    out[i] = best;
    idx[i] = at;
}

// Max-pool backward: each output's gradient to its argmax. The windows do not overlap, so
// each input entry gets at most one; the caller zeroes `dinput` first.
extern "C" __global__ void maxpool_back(unsigned int n, const float* dout, const unsigned int* idx,
                                        float* dinput) {
    unsigned int i = tid();
    if (i >= n) return;
    dinput[idx[i]] = dout[i];
}

// Plain SGD: params −= lr · grad.
extern "C" __global__ void sgd(unsigned int n, float* params, const float* grad, float lr) {
    unsigned int i = tid();
    if (i >= n) return;
    params[i] -= lr * grad[i];
}

// acc += v (accumulating a chunk's gradient into the caller's).
extern "C" __global__ void add(unsigned int n, float* acc, const float* v) {
    unsigned int i = tid();
    if (i >= n) return;
    acc[i] += v[i];
}
