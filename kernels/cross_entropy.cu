// cross_entropy.cu — softmax cross-entropy over a (possibly vocab-sliced) row of logits, fused
// with its gradient: no probabilities are stored.
//
// Math, per row: lse = max + log Σ exp(x − max); loss = lse − x[target]; and
// dlogits = (exp(x − lse) − onehot(target)) · scale, zero where target < 0 (ignored rows).
// Vocab-parallel: each rank holds columns first..first+vocab of the logits; the row statistics
// (row_max, row_sum_exp, target_logit) are computed per slice and all-reduced between the calls,
// exactly as `src/parallel/tensor_parallel.rs` does around the op-layer calls. One block per row, threads over the vocab
// (target_logit and log_sum_exp: one thread per row; add_loss: one block for all rows).

template <typename T>
__device__ void row_max(const T* logits, int vocab, float* max) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, load(logits, row * vocab + j));
    m = block_max(m, scratch);
    if (threadIdx.x == 0) max[row] = m;
}

template <typename T>
__device__ void row_sum_exp(const T* logits, int vocab, const float* max, float* sum) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(load(logits, row * vocab + j) - max[row]);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) sum[row] = s;
}

// One thread per row: the target's logit when it is in this slice, else 0.
template <typename T>
__device__ void target_logit(const T* logits, int vocab, const int* targets, long first, long rows, float* z) {
    long row = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (row >= rows) return;
    long c = (long)targets[row] - first;
    z[row] = (targets[row] >= 0 && c >= 0 && c < vocab) ? load(logits, row * vocab + c) : 0.0f;
}

template <typename T>
__device__ void cross_entropy_backward(const T* logits, const int* targets, long first, const float* lse, float scale, int vocab, T* dlogits) {
    long row = blockIdx.x;
    int t = targets[row];
    long c = (long)t - first;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float d = 0.0f;
        if (t >= 0) d = (expf(load(logits, row * vocab + j) - lse[row]) - (j == c ? 1.0f : 0.0f)) * scale;
        store(dlogits, row * vocab + j, d);
    }
}

// The loss stays on the GPU: loss[0] += scale · Σ (lse − z) over the rows with a target, so the
// training loop adds up its micro-batches here and reads the step's loss once. One block; its
// threads stride over the rows, then one block sum.
extern "C" __global__ void add_loss(const float* lse, const float* z, const int* targets, long rows, float scale,
                                    float* loss) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (long r = threadIdx.x; r < rows; r += blockDim.x)
        if (targets[r] >= 0) s += lse[r] - z[r];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) loss[0] += s * scale;
}

// lse = max + log(sum) per row, after the statistics were all-reduced. One thread per row.
extern "C" __global__ void log_sum_exp(const float* max, const float* sum, float* lse, long rows) {
    long row = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (row < rows) lse[row] = max[row] + logf(sum[row]);
}

#define EXPORT(T, suffix)                                                                                          \
    extern "C" __global__ void row_max_##suffix(const T* logits, int vocab, float* max) { row_max(logits, vocab, max); } \
    extern "C" __global__ void row_sum_exp_##suffix(const T* logits, int vocab, const float* max, float* sum) {     \
        row_sum_exp(logits, vocab, max, sum);                                                                      \
    }                                                                                                              \
    extern "C" __global__ void target_logit_##suffix(const T* logits, int vocab, const int* targets, long first,    \
                                                     long rows, float* z) {                                        \
        target_logit(logits, vocab, targets, first, rows, z);                                                      \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_backward_##suffix(const T* logits, const int* targets, long first,     \
                                                               const float* lse, float scale, int vocab,           \
                                                               T* dlogits) {                                       \
        cross_entropy_backward(logits, targets, first, lse, scale, vocab, dlogits);                                \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
