// rmsnorm.cu — RMSNorm forward and backward.
//
// Math: rstd = 1/sqrt(mean(x²) + eps), y = x · rstd · w; `add_rmsnorm` first adds the residual
// branch in place (x += add, as the block's h = x + attention), then normalises x as stored.
// Backward: with g = dy · w, dx = rstd · g − x · rstd³ · mean(g · x) (+ the residual's gradient,
// which passes the norm by: one pass instead of a norm and an add); dw += Σ_rows dy · x · rstd.
// Forward and dx: one block per row, threads over the features, block reductions.
// dw, deterministic (no atomics) and spread over the whole GPU, in two launches: each block of
// rmsnorm_backward_dw_partial sums one chunk of rows (threads over the feature columns) into
// partial[chunk][dim]; then rmsnorm_backward_dw_sum, one thread per column, adds the chunks in
// order into dw. (One thread per column walking every row would use a few dozen warps of the GPU.)

template <typename T>
__device__ void rmsnorm_forward(T* x, const T* add, const T* w, float eps, int dim, T* y, float* rstd) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = load(x, row * dim + d);
        if (add) { // the residual add first: x += add, stored, and normalised as stored (rounded)
            store(x, row * dim + d, v + load(add, row * dim + d));
            v = load(x, row * dim + d);
        }
        ss += v * v;
    }
    float r = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) store(y, row * dim + d, load(x, row * dim + d) * r * load(w, d));
    if (threadIdx.x == 0) rstd[row] = r;
}

template <typename T>
__device__ void rmsnorm_backward_dx(const T* dy, const T* x, const T* w, const float* rstd, const T* residual, int dim,
                                    T* dx) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float r = rstd[row], dot = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dot += load(dy, row * dim + d) * load(w, d) * load(x, row * dim + d);
    float mean = block_sum(dot, scratch) / dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float g = load(dy, row * dim + d) * load(w, d);
        float v = r * g - load(x, row * dim + d) * r * r * r * mean;
        store(dx, row * dim + d, residual ? v + load(residual, row * dim + d) : v);
    }
}

template <typename T>
__device__ void rmsnorm_backward_dw_partial(const T* dy, const T* x, const float* rstd, long rows, int dim,
                                            int chunk_rows, float* partial) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    long chunk = blockIdx.y, first = chunk * chunk_rows, end = min(rows, first + chunk_rows);
    if (d >= dim) return;
    float acc = 0.0f;
    for (long row = first; row < end; row++) acc += load(dy, row * dim + d) * load(x, row * dim + d) * rstd[row];
    partial[chunk * dim + d] = acc;
}

extern "C" __global__ void rmsnorm_backward_dw_sum(const float* partial, int chunks, int dim, float* dw) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float acc = 0.0f;
    for (int c = 0; c < chunks; c++) acc += partial[(long)c * dim + d];
    dw[d] += acc;
}

#define EXPORT(T, suffix)                                                                                         \
    extern "C" __global__ void rmsnorm_forward_##suffix(const T* x, const T* w, float eps, int dim, T* y,          \
                                                        float* rstd) {                                            \
        rmsnorm_forward((T*)x, (const T*)nullptr, w, eps, dim, y, rstd);                                          \
    }                                                                                                             \
    extern "C" __global__ void add_rmsnorm_forward_##suffix(T* x, const T* add, const T* w, float eps, int dim,    \
                                                            T* y, float* rstd) {                                  \
        rmsnorm_forward(x, add, w, eps, dim, y, rstd);                                                            \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_backward_dx_##suffix(const T* dy, const T* x, const T* w, const float* rstd,\
                                                            const T* residual, int dim, T* dx) {                  \
        rmsnorm_backward_dx(dy, x, w, rstd, residual, dim, dx);                                                   \
    }                                                                                                             \
    extern "C" __global__ void rmsnorm_backward_dw_partial_##suffix(const T* dy, const T* x, const float* rstd,    \
                                                                    long rows, int dim, int chunk_rows,           \
                                                                    float* partial) {                             \
        rmsnorm_backward_dw_partial(dy, x, rstd, rows, dim, chunk_rows, partial);                                 \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
