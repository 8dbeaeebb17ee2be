// rmsnorm.cu — RMSNorm forward and backward.
//
// Math: rstd = 1/sqrt(mean(x²) + eps), y = x · rstd · w.
// Backward: with g = dy · w, dx = rstd · g − x · rstd³ · mean(g · x); dw += Σ_rows dy · x · rstd.
// Forward and dx: one block per row, threads over the features, block reductions.
// dw, deterministic: one thread per feature column walks the rows in order (no atomics).

template <typename T>
__device__ void rmsnorm_forward(const T* x, const T* w, float eps, int dim, T* y, float* rstd) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = load(x, row * dim + d);
        ss += v * v;
    }
    float r = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) store(y, row * dim + d, load(x, row * dim + d) * r * load(w, d));
    if (threadIdx.x == 0) rstd[row] = r;
}

template <typename T>
__device__ void rmsnorm_backward_dx(const T* dy, const T* x, const T* w, const float* rstd, int dim, T* dx) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float r = rstd[row], dot = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dot += load(dy, row * dim + d) * load(w, d) * load(x, row * dim + d);
    float mean = block_sum(dot, scratch) / dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float g = load(dy, row * dim + d) * load(w, d);
        store(dx, row * dim + d, r * g - load(x, row * dim + d) * r * r * r * mean);
    }
}

template <typename T>
__device__ void rmsnorm_backward_dw(const T* dy, const T* x, const float* rstd, long rows, int dim, float* dw) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float acc = 0.0f;
    for (long row = 0; row < rows; row++) acc += load(dy, row * dim + d) * load(x, row * dim + d) * rstd[row];
    dw[d] += acc;
}

#define EXPORT(T, suffix)                                                                                         \
    extern "C" __global__ void rmsnorm_forward_##suffix(const T* x, const T* w, float eps, int dim, T* y,          \
                                                        float* rstd) {                                            \
        rmsnorm_forward(x, w, eps, dim, y, rstd);                                                                 \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_backward_dx_##suffix(const T* dy, const T* x, const T* w, const float* rstd,\
                                                            int dim, T* dx) {                                     \
        rmsnorm_backward_dx(dy, x, w, rstd, dim, dx);                                                             \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_backward_dw_##suffix(const T* dy, const T* x, const float* rstd, long rows, \
                                                            int dim, float* dw) {                                 \
        rmsnorm_backward_dw(dy, x, rstd, rows, dim, dw);                                                          \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
