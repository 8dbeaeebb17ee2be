// attention.cu — causal grouped-query attention in the flash-attention style, forward and backward.
//
// Math, per (sequence b, query head h, KV head g = h / (heads / kv_heads)):
//   s_ij = q_i · k_j / sqrt(head_dim) where key position ≤ query position (else masked),
//   p_ij = exp(s_ij − lse_i), lse_i = log Σ_j exp(s_ij), o_i = Σ_j p_ij v_j.
// Queries and keys carry their positions, so the same kernel computes one block of ring
// attention (a row that sees no key gets o = 0 and lse = −∞; blocks merge by their lse).
//
// Forward: a block handles BQ query rows of one (b, h); each thread owns one query row. The keys
// and values are walked in tiles of TILE rows staged in shared memory; each thread keeps a running
// max m, sum l and output accumulator and rescales them as each key arrives (online softmax), so
// no seq × seq matrix ever exists. It writes o and lse (kept for backward and for ring merges).
// Backward recomputes p from lse, in three kernels and without atomics (deterministic):
//   attention_delta:  delta_i = Σ_d do_id · o_id            (8 threads per query row)
//   attention_dq:     dq_i = Σ_j p_ij (do_i·v_j − delta_i) k_j / sqrt(d)   (thread per query row)
//   attention_dkdv:   dk_j = Σ_{h in group, i} ds_ij q_i / sqrt(d), dv_j = Σ p_ij do_i (thread per key row)
//
// Head sizes. Each thread holds its row of q and o (dq: q, do, dq; dk/dv: k, v, dk, dv) in an
// array of MAXD floats, and a block stages TILE rows of two tensors in f32 shared memory. The
// kernels named attention_* take heads up to 128 (MAXD 128, TILE 32: 32 KiB of tiles); those named
// attention_wide_* are the same code for heads up to 640 (latent attention's: 192 a head when it
// trains, 576 in generate's absorbed form, which the tensor-core kernels are not built for), with
// tiles of 8 rows so that two stay within the 48 KiB of static shared memory a block may have
// (40 KiB). This is the slow road, stated: a thread's rows, indexed by a head size known only at
// run time, live in local memory (cached, 10 KiB a thread for dk/dv), and a tile of 8 keys pays
// a barrier for a quarter of the work. The host refuses heads wider than 640 (ops/gpu.rs).

#define BQ 64 // query rows (threads) a block of the forward and of dq
#define BK 32 // key rows (threads) a block of dk/dv

// The block stages key/value rows j0..j0+TILE of KV head g into shared memory (zeros past the end,
// and a position no query reaches, so padding is masked), then waits for every thread.
template <int MAXD, int TILE, typename T>
__device__ void load_kv_tile(const Shape& s, const T* k, const T* v, const unsigned* k_pos, int b, int g, int j0,
                             float (*ks)[MAXD], float (*vs)[MAXD], unsigned* kp) {
    int d = s.head_dim;
    for (int e = threadIdx.x; e < TILE * d; e += blockDim.x) {
        int j = j0 + e / d, c = e % d;
        ks[e / d][c] = j < s.kv_seq ? load(k, at(s, b, s.kv_seq, j, s.kv_heads, g) + c) : 0.0f;
        vs[e / d][c] = j < s.kv_seq ? load(v, at(s, b, s.kv_seq, j, s.kv_heads, g) + c) : 0.0f;
    }
    for (int e = threadIdx.x; e < TILE; e += blockDim.x) kp[e] = j0 + e < s.kv_seq ? k_pos[j0 + e] : 0xffffffffu;
    __syncthreads();
}

template <int MAXD, int TILE, typename T>
__device__ void attention_forward(Shape s, const T* q, const T* k, const T* v, const unsigned* q_pos, const unsigned* k_pos, T* out, float* lse) {
    __shared__ float ks[TILE][MAXD], vs[TILE][MAXD];
    __shared__ unsigned kp[TILE];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads);
    int i = blockIdx.x * BQ + threadIdx.x, d = s.head_dim;
    bool active = i < s.seq;
    float scale = rsqrtf((float)d), qi[MAXD], acc[MAXD];
    float m = -INFINITY, l = 0.0f;
    unsigned pi = active ? q_pos[i] : 0;
    for (int c = 0; c < d; c++) {
        qi[c] = active ? load(q, at(s, b, s.seq, i, s.heads, h) + c) * scale : 0.0f;
        acc[c] = 0.0f;
    }
    for (int j0 = 0; j0 < s.kv_seq; j0 += TILE) {
        load_kv_tile<MAXD, TILE>(s, k, v, k_pos, b, g, j0, ks, vs, kp);
        for (int jj = 0; jj < TILE && active; jj++) {
            if (kp[jj] > pi) continue; // masked: the key comes after the query (or is padding)
            float sij = 0.0f;
            for (int c = 0; c < d; c++) sij += qi[c] * ks[jj][c];
            float m_new = fmaxf(m, sij), correction = expf(m - m_new), p = expf(sij - m_new);
            l = l * correction + p;
            for (int c = 0; c < d; c++) acc[c] = acc[c] * correction + p * vs[jj][c];
            m = m_new;
        }
        __syncthreads();
    }
    if (!active) return;
    for (int c = 0; c < d; c++) store(out, at(s, b, s.seq, i, s.heads, h) + c, l > 0.0f ? acc[c] / l : 0.0f);
    lse[((long)b * s.heads + h) * s.seq + i] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// delta, DELTA_LANES threads a row: each reads 16 bytes of o and of do at a time (8 bf16 or 4 f32;
// one row of a 64-wide bf16 head is one load per thread), and the lanes' sums meet by shuffles in
// a fixed order. Rows of any head size: 16-byte loads where a row is a whole number of them.
#define DELTA_LANES 8

template <typename T>
__device__ __forceinline__ float dot_16_bytes(const T* a, const T* b) {
    constexpr int N = 16 / sizeof(T);
    struct __align__(16) Piece { T x[N]; };
    Piece pa = *(const Piece*)a, pb = *(const Piece*)b;
    float sum = 0.0f;
    for (int e = 0; e < N; e++) sum += load(pa.x, e) * load(pb.x, e);
    return sum;
}

template <typename T>
__device__ void attention_delta(Shape s, const T* out, const T* dout, float* delta) {
    constexpr int N = 16 / sizeof(T); // elements in 16 bytes
    long id = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long r = id / DELTA_LANES; // over batch * heads * seq, lse layout
    int part = id % DELTA_LANES;
    float acc = 0.0f;
    if (r < (long)s.batch * s.heads * s.seq) {
        int i = r % s.seq, h = (r / s.seq) % s.heads, b = r / ((long)s.seq * s.heads);
        long base = at(s, b, s.seq, i, s.heads, h);
        if (s.head_dim % N == 0)
            for (int c = part * N; c < s.head_dim; c += N * DELTA_LANES) acc += dot_16_bytes(dout + base + c, out + base + c);
        else
            for (int c = part; c < s.head_dim; c += DELTA_LANES) acc += load(dout, base + c) * load(out, base + c);
    }
    for (int o = DELTA_LANES / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o); // every lane takes part
    if (part == 0 && r < (long)s.batch * s.heads * s.seq) delta[r] = acc;
}

template <int MAXD, int TILE, typename T>
__device__ void attention_dq(Shape s, const T* q, const T* k, const T* v, const unsigned* q_pos, const unsigned* k_pos, const float* lse, const float* delta, const T* dout, T* dq) {
    __shared__ float ks[TILE][MAXD], vs[TILE][MAXD];
    __shared__ unsigned kp[TILE];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads);
    int i = blockIdx.x * BQ + threadIdx.x, d = s.head_dim;
    bool active = i < s.seq;
    float scale = rsqrtf((float)d), qi[MAXD], doi[MAXD], acc[MAXD];
    long row = ((long)b * s.heads + h) * s.seq + i;
    float li = active ? lse[row] : 0.0f, di = active ? delta[row] : 0.0f;
    unsigned pi = active ? q_pos[i] : 0;
    for (int c = 0; c < d; c++) {
        qi[c] = active ? load(q, at(s, b, s.seq, i, s.heads, h) + c) * scale : 0.0f;
        doi[c] = active ? load(dout, at(s, b, s.seq, i, s.heads, h) + c) : 0.0f;
        acc[c] = 0.0f;
    }
    for (int j0 = 0; j0 < s.kv_seq; j0 += TILE) {
        load_kv_tile<MAXD, TILE>(s, k, v, k_pos, b, g, j0, ks, vs, kp);
        for (int jj = 0; jj < TILE && active; jj++) {
            if (kp[jj] > pi) continue;
            float sij = 0.0f, dp = 0.0f;
            for (int c = 0; c < d; c++) {
                sij += qi[c] * ks[jj][c];
                dp += doi[c] * vs[jj][c];
            }
            float ds = expf(sij - li) * (dp - di);
            for (int c = 0; c < d; c++) acc[c] += ds * ks[jj][c];
        }
        __syncthreads();
    }
    if (!active) return;
    for (int c = 0; c < d; c++) store(dq, at(s, b, s.seq, i, s.heads, h) + c, acc[c] * scale);
}

template <int MAXD, int TILE, typename T>
__device__ void attention_dkdv(Shape s, const T* q, const T* k, const T* v, const unsigned* q_pos, const unsigned* k_pos, const float* lse, const float* delta, const T* dout, T* dk, T* dv) {
    __shared__ float qs[TILE][MAXD], dos[TILE][MAXD];
    __shared__ float ls[TILE], ds_[TILE];
    __shared__ unsigned qp[TILE];
    int b = blockIdx.z, g = blockIdx.y, groups = s.heads / s.kv_heads;
    int j = blockIdx.x * BK + threadIdx.x, d = s.head_dim;
    bool active = j < s.kv_seq;
    float scale = rsqrtf((float)d), kj[MAXD], vj[MAXD], dkj[MAXD], dvj[MAXD];
    unsigned pj = active ? k_pos[j] : 0xffffffffu;
    for (int c = 0; c < d; c++) {
        kj[c] = active ? load(k, at(s, b, s.kv_seq, j, s.kv_heads, g) + c) : 0.0f;
        vj[c] = active ? load(v, at(s, b, s.kv_seq, j, s.kv_heads, g) + c) : 0.0f;
        dkj[c] = dvj[c] = 0.0f;
    }
    for (int h = g * groups; h < (g + 1) * groups; h++) {
        for (int i0 = 0; i0 < s.seq; i0 += TILE) {
            for (int e = threadIdx.x; e < TILE * d; e += blockDim.x) {
                int i = i0 + e / d, c = e % d;
                qs[e / d][c] = i < s.seq ? load(q, at(s, b, s.seq, i, s.heads, h) + c) * scale : 0.0f;
                dos[e / d][c] = i < s.seq ? load(dout, at(s, b, s.seq, i, s.heads, h) + c) : 0.0f;
            }
            stage_query_rows(s, q_pos, lse, delta, b, h, i0, TILE, 1.0f, qp, ls, ds_);
            __syncthreads();
            for (int ii = 0; ii < TILE && active; ii++) {
                if (pj > qp[ii]) continue;
                float sij = 0.0f, dp = 0.0f;
                for (int c = 0; c < d; c++) {
                    sij += qs[ii][c] * kj[c];
                    dp += dos[ii][c] * vj[c];
                }
                float p = expf(sij - ls[ii]), dsij = p * (dp - ds_[ii]);
                for (int c = 0; c < d; c++) {
                    dvj[c] += p * dos[ii][c];
                    dkj[c] += dsij * qs[ii][c]; // qs already carries the 1/sqrt(d)
                }
            }
            __syncthreads();
        }
    }
    if (!active) return;
    for (int c = 0; c < d; c++) {
        store(dk, at(s, b, s.kv_seq, j, s.kv_heads, g) + c, dkj[c]);
        store(dv, at(s, b, s.kv_seq, j, s.kv_heads, g) + c, dvj[c]);
    }
}

// Ring attention's merge of one block's (o_b, lse_b) into the running (o, lse), per query row:
//   lse' = log(e^lse + e^lse_b),  o ← e^(lse − lse')·o + e^(lse_b − lse')·o_b.
// One thread per (b, h, i) row of the lse layout; a block that saw no key (lse_b = −∞) adds nothing.
template <typename T>
__device__ void attention_merge(Shape s, T* out, float* lse, const T* block_out, const float* block_lse) {
    long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (r >= (long)s.batch * s.heads * s.seq) return;
    float l = lse[r], bl = block_lse[r];
    if (bl == -INFINITY) return;
    float merged = l == -INFINITY ? bl : fmaxf(l, bl) + log1pf(expf(-fabsf(l - bl)));
    float keep = expf(l - merged), add = expf(bl - merged);
    int i = r % s.seq, h = (r / s.seq) % s.heads, b = r / ((long)s.seq * s.heads);
    long base = at(s, b, s.seq, i, s.heads, h);
    for (int c = 0; c < s.head_dim; c++) store(out, base + c, load(out, base + c) * keep + load(block_out, base + c) * add);
    lse[r] = merged;
}

// The kernels a head size reads (above): attention_{name}_{suffix} up to 128, attention_wide_* up to 640.
#define READABLE(T, suffix, wide, MAXD, TILE)                                                                          \
    extern "C" __global__ void attention##wide##_forward_##suffix(Shape s, const T* q, const T* k, const T* v,         \
                                                                  const unsigned* q_pos, const unsigned* k_pos,        \
                                                                  T* out, float* lse) {                                \
        attention_forward<MAXD, TILE>(s, q, k, v, q_pos, k_pos, out, lse);                                             \
    }                                                                                                                  \
    extern "C" __global__ void attention##wide##_dq_##suffix(Shape s, const T* q, const T* k, const T* v,              \
                                                             const unsigned* q_pos, const unsigned* k_pos,             \
                                                             const float* lse, const float* delta, const T* dout,      \
                                                             T* dq) {                                                  \
        attention_dq<MAXD, TILE>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq);                                      \
    }                                                                                                                  \
    extern "C" __global__ void attention##wide##_dkdv_##suffix(Shape s, const T* q, const T* k, const T* v,            \
                                                               const unsigned* q_pos, const unsigned* k_pos,           \
                                                               const float* lse, const float* delta, const T* dout,    \
                                                               T* dk, T* dv) {                                         \
        attention_dkdv<MAXD, TILE>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dk, dv);                                \
    }

#define EXPORT(T, suffix)                                                                                              \
    READABLE(T, suffix, , 128, 32)                                                                                     \
    READABLE(T, suffix, _wide, 640, 8)                                                                                 \
    extern "C" __global__ void attention_delta_##suffix(Shape s, const T* out, const T* dout, float* delta) {          \
        attention_delta(s, out, dout, delta);                                                                          \
    }                                                                                                                  \
    extern "C" __global__ void attention_merge_##suffix(Shape s, T* out, float* lse, const T* block_out,               \
                                                        const float* block_lse) {                                      \
        attention_merge(s, out, lse, block_out, block_lse);                                                            \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
