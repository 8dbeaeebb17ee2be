// moe.cu — the routing of a mixture of experts: the router's top-k, the rows sorted by expert
// and back, and their backwards (src/ops/moe.rs is the CPU reference; the expert GEMMs are cuBLAS).
//
// Shapes: T rows (tokens), E experts, k experts per token, d features, n = T·k routed rows.
//
// route            probs[t, :] = softmax(logits[t, :]); the k largest (ties to the lower id),
//                  weights[t, j] = probs[t, ids[t, j]] / Σ_j' probs[t, ids[t, j']].
//                  One thread per row: E and k are small (Mixtral: 8 and 2), so a row's E
//                  exponentials and k passes over them are a few hundred flops. The ids are
//                  written as floats (exact below 2^24): the host reads them back once per layer
//                  to size the experts' GEMMs (a CPU–GPU sync point, as every MoE trainer has).
// route_backward   dp_i = balance_i + Σ_{j: ids_j = i} (dw_j − Σ_j' dw_j'·w_j') / S (S the taken
//                  probabilities' sum); dlogits_i = p_i · (dp_i − Σ_i' p_i'·dp_i'). One thread
//                  per row, dp_i recomputed from the k ids where needed (no per-thread array).
// permute_rows     out[i, :] = x[order[i], :]. One block per output row, threads over d.
// weighted_sum     y[t, :] = Σ_j w[t, j] · ys[slot[t·k + j], :] (w = 1 when absent): each token
//                  adds its k rows in j order, no atomics. One block per token, threads over d.
// weighted_sum_backward
//                  dys[slot[t·k + j], :] = w[t, j] · dy[t, :] and dw[t, j] = dy[t, :] · ys[slot, :].
//                  One block per routed pair (t, j), threads over d, the dot product a block sum.

template <typename T>
__device__ void route(const T* logits, long rows, int experts, int k, float* probs, float* weights, float* ids) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows) return;
    const T* z = logits + t * experts;
    float* p = probs + t * experts;
    float max = -INFINITY, sum = 0.0f;
    for (int i = 0; i < experts; i++) max = fmaxf(max, load(z, i));
    for (int i = 0; i < experts; i++) {
        p[i] = expf(load(z, i) - max);
        sum += p[i];
    }
    for (int i = 0; i < experts; i++) p[i] /= sum;
    float taken = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < experts; i++) {
            bool free = true;
            for (int jj = 0; jj < j; jj++) free = free && (int)ids[t * k + jj] != i;
            if (free && (best < 0 || p[i] > p[best])) best = i;
        }
        ids[t * k + j] = (float)best;
        weights[t * k + j] = p[best];
        taken += p[best];
    }
    for (int j = 0; j < k; j++) weights[t * k + j] /= taken;
}

// The gradient on probability i of row t (see the header): `through` = Σ dw·w, `taken` = S.
__device__ float route_dp(int i, const float* dw, const float* ids, int k, float through, float taken,
                          const float* balance) {
    float dp = balance ? balance[i] : 0.0f;
    for (int j = 0; j < k; j++)
        if ((int)ids[j] == i) dp += (dw[j] - through) / taken;
    return dp;
}

template <typename T>
__device__ void route_backward(const float* dweights, const float* probs, const float* weights, const float* ids,
                               const float* balance, long rows, int experts, int k, T* dlogits) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows) return;
    const float *p = probs + t * experts, *w = weights + t * k, *dw = dweights + t * k, *id = ids + t * k;
    float taken = 0.0f, through = 0.0f;
    for (int j = 0; j < k; j++) {
        taken += p[(int)id[j]];
        through += dw[j] * w[j];
    }
    float mean = 0.0f;
    for (int i = 0; i < experts; i++) mean += p[i] * route_dp(i, dw, id, k, through, taken, balance);
    for (int i = 0; i < experts; i++)
        store(dlogits, t * experts + i, p[i] * (route_dp(i, dw, id, k, through, taken, balance) - mean));
}

template <typename T>
__device__ void permute_rows(const T* x, const unsigned* order, int dim, T* out) {
    long i = blockIdx.x, from = order[i];
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = x[from * dim + d];
}

template <typename T>
__device__ void weighted_sum(const T* ys, const unsigned* slot, const float* weights, int k, int dim, T* y) {
    long t = blockIdx.x;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += (weights ? weights[t * k + j] : 1.0f) * load(ys, (long)slot[t * k + j] * dim + d);
        store(y, t * dim + d, acc);
    }
}

template <typename T>
__device__ void weighted_sum_backward(const T* dy, const T* ys, const unsigned* slot, const float* weights, int k, int dim,
                                 T* dys, float* dweights) {
    __shared__ float scratch[32];
    long pair = blockIdx.x, t = pair / k, s = slot[pair];
    float w = weights[pair], dot = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float g = load(dy, t * dim + d);
        store(dys, s * dim + d, w * g);
        dot += g * load(ys, s * dim + d);
    }
    dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) dweights[pair] = dot;
}

#define EXPORT(T, suffix)                                                                                          \
    extern "C" __global__ void route_##suffix(const T* logits, long rows, int experts, int k, float* probs,        \
                                              float* weights, float* ids) {                                        \
        route(logits, rows, experts, k, probs, weights, ids);                                                      \
    }                                                                                                              \
    extern "C" __global__ void route_backward_##suffix(const float* dweights, const float* probs,                  \
                                                       const float* weights, const float* ids,                    \
                                                       const float* balance, long rows, int experts, int k,       \
                                                       T* dlogits) {                                               \
        route_backward(dweights, probs, weights, ids, balance, rows, experts, k, dlogits);                        \
    }                                                                                                              \
    extern "C" __global__ void permute_rows_##suffix(const T* x, const unsigned* order, int dim, T* out) {        \
        permute_rows(x, order, dim, out);                                                                         \
    }                                                                                                              \
    extern "C" __global__ void weighted_sum_##suffix(const T* ys, const unsigned* slot, const float* weights,      \
                                                     int k, int dim, T* y) {                                       \
        weighted_sum(ys, slot, weights, k, dim, y);                                                                \
    }                                                                                                              \
    extern "C" __global__ void weighted_sum_backward_##suffix(const T* dy, const T* ys, const unsigned* slot,      \
                                                              const float* weights, int k, int dim, T* dys,        \
                                                              float* dweights) {                                   \
        weighted_sum_backward(dy, ys, slot, weights, k, dim, dys, dweights);                                       \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
