// attention_tc.cu — the attention of attention.cu on tensor cores: bf16 products, fp32 sums.
//
// Same math, same arguments and outputs (o, lse; dq, dk, dv) as attention.cu, which stays the
// readable version and the f32 path. Here every product of two tiles — S = Q·Kᵀ, dP = dO·Vᵀ,
// O += P·V, dQ += dS·K, dV += Pᵀ·dO, dK += dSᵀ·Q — is a warp-wide WMMA matrix multiply on 16×16
// bf16 fragments with fp32 accumulators (`nvcuda::wmma`, sm_80+). The element-wise softmax work
// in between (masking by position, exp, the row statistics) stays on CUDA cores, two threads per
// row (lane r and lane r + 16 take half of the row's columns each), reading the products from
// shared memory; the fp32 score tiles' rows are padded by 4 floats, so that the 16 rows a warp
// reads at once fall on different banks (4-way conflicts instead of 16-way).
//
// A block is WARPS = 2 warps; warp w owns 16 rows of the block's TILE = 32 (query rows in the
// forward and dq, key rows in dk/dv) and keeps its output rows in registers, as WMMA
// accumulators, for the whole loop over the other side's tiles (TILE rows each, staged in shared
// memory). Tiles that the positions mask completely (every key after every query) are skipped:
// with causal order that is half of all tiles.
//
// The forward makes two passes over the keys instead of rescaling the output as each tile
// arrives (flash-attention's online softmax): pass 1 computes each row's lse = m + log Σ exp(s − m)
// from the scores alone, pass 2 forms p = exp(s − lse) — the final probabilities — and
// accumulates O += P·V. WMMA accumulators hold their elements in an unspecified order, so
// rescaling their rows would mean a trip through shared memory; the second Q·Kᵀ costs less.
//
// The head size D is a template parameter (16, 32, 64, 128), so that the per-warp accumulator
// arrays are indexed by constants and live in registers; other sizes use attention.cu.

#include <mma.h>
using namespace nvcuda;

#define WARPS 2
#define TILE (16 * WARPS)
#define LDS (TILE + 4) // row stride of the fp32 score tiles
#define HALF (TILE / 2) // the columns of a score row each of its two threads takes
typedef __nv_bfloat16 bf16;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt; // a transposed operand
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// A tile of TILE rows of one head in shared memory; rows padded by 8 elements (16 bytes) so that
// the fragment loads of consecutive rows start on different banks.
template <int D>
struct Rows {
    bf16 x[TILE][D + 8];
};

// Stages rows r0..r0+TILE of head `head` of x [batch*len, n_heads*D] into `t` (zeros past len).
template <int D>
__device__ void stage(const Shape& s, const bf16* x, int b, int len, int n_heads, int head, int r0, Rows<D>& t) {
    for (int e = threadIdx.x; e < TILE * D; e += blockDim.x) {
        int r = e / D, c = e % D;
        t.x[r][c] = r0 + r < len ? x[at(s, b, len, r0 + r, n_heads, head) + c] : __float2bfloat16(0.0f);
    }
}

// The smallest position of rows r0..r0+TILE that exist (a tile of keys is masked for every
// query that comes before it), and the largest. Every thread computes the same value.
__device__ unsigned min_position(const unsigned* pos, int r0, int len) {
    unsigned m = 0xffffffffu;
    for (int r = r0; r < min(r0 + TILE, len); r++) m = min(m, pos[r]);
    return m;
}
__device__ unsigned max_position(const unsigned* pos, int r0, int len) {
    unsigned m = 0;
    for (int r = r0; r < min(r0 + TILE, len); r++) m = max(m, pos[r]);
    return m;
}

// One warp: out[16][TILE] (fp32, row-major) = a[16 rows] · b[TILE rows]ᵀ, over D columns.
template <int D>
__device__ void times_transposed(const bf16 (*a)[D + 8], const Rows<D>& b, float (*out)[LDS]) {
    for (int n = 0; n < TILE / 16; n++) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < D; k += 16) {
            FragA fa;
            FragBt fb;
            wmma::load_matrix_sync(fa, &a[0][k], D + 8);
            wmma::load_matrix_sync(fb, &b.x[16 * n][k], D + 8);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(&out[0][16 * n], acc, LDS, wmma::mem_row_major);
    }
}

// One warp: acc (16 × D, as D/16 fragments) += p[16][TILE] · b[TILE rows].
template <int D>
__device__ void accumulate(const bf16 (*p)[TILE], const Rows<D>& b, Acc* acc) {
    for (int k = 0; k < TILE; k += 16) {
        FragA fa;
        wmma::load_matrix_sync(fa, &p[0][k], TILE);
        for (int n = 0; n < D / 16; n++) {
            FragB fb;
            wmma::load_matrix_sync(fb, &b.x[k][16 * n], D + 8);
            wmma::mma_sync(acc[n], fa, fb, acc[n]);
        }
    }
}

// One warp writes its 16 rows (r0.. of head `head`, rows past len skipped) of acc × factor to y,
// a fragment at a time through `scratch`.
template <int D>
__device__ void write_rows(const Shape& s, Acc* acc, float factor, float (*scratch)[LDS], bf16* y, int b, int len,
                           int n_heads, int head, int r0) {
    int lane = threadIdx.x % 32;
    for (int n = 0; n < D / 16; n++) {
        wmma::store_matrix_sync(&scratch[0][0], acc[n], LDS, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            int r = e / 16, c = e % 16;
            if (r0 + r < len) y[at(s, b, len, r0 + r, n_heads, head) + 16 * n + c] = __float2bfloat16(scratch[r][c] * factor);
        }
        __syncwarp();
    }
}

template <int D>
__device__ void forward(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                        const unsigned* k_pos, bf16* out, float* lse) {
    __shared__ __align__(32) Rows<D> qs, ks, vs;
    __shared__ __align__(32) float sc[WARPS][16][LDS];
    __shared__ __align__(32) bf16 ps[WARPS][16][TILE];
    __shared__ unsigned kp[TILE];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads), i0 = blockIdx.x * TILE;
    int w = threadIdx.x / 32, r = threadIdx.x % 16, c0 = threadIdx.x % 32 / 16 * HALF, i = i0 + 16 * w + r;
    bool row = i < s.seq; // this thread does half of the softmax of query row i: columns c0..c0+HALF
    unsigned pi = row ? q_pos[i] : 0, last = max_position(q_pos, i0, s.seq);
    float scale = rsqrtf((float)D), m = -INFINITY, l = 0.0f;
    stage<D>(s, q, b, s.seq, s.heads, h, i0, qs);
    Acc o[D / 16];
    for (int n = 0; n < D / 16; n++) wmma::fill_fragment(o[n], 0.0f);
    for (int pass = 1; pass <= 2; pass++) {
        for (int j0 = 0; j0 < s.kv_seq; j0 += TILE) {
            if (min_position(k_pos, j0, s.kv_seq) > last) continue; // every key after every query
            stage<D>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
            if (pass == 2) stage<D>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs);
            for (int e = threadIdx.x; e < TILE; e += blockDim.x) kp[e] = j0 + e < s.kv_seq ? k_pos[j0 + e] : 0xffffffffu;
            __syncthreads();
            times_transposed<D>(&qs.x[16 * w], ks, sc[w]);
            __syncwarp();
            if (row && pass == 1) { // running max and sum of exp over this half row's visible keys
                for (int jj = c0; jj < c0 + HALF; jj++) {
                    if (kp[jj] > pi) continue;
                    float sij = sc[w][r][jj] * scale, m_new = fmaxf(m, sij);
                    l = l * expf(m - m_new) + expf(sij - m_new);
                    m = m_new;
                }
            }
            if (pass == 2) {
                for (int jj = c0; jj < c0 + HALF; jj++) // the final probabilities, bf16 for the next product
                    ps[w][r][jj] = __float2bfloat16(row && l > 0.0f && kp[jj] <= pi ? expf(sc[w][r][jj] * scale - m) : 0.0f);
                __syncwarp();
                accumulate<D>(ps[w], vs, o);
            }
            __syncthreads(); // every warp is done with ks, vs, kp before the next tile
        }
        if (pass == 1) { // the two halves' (m, l) combined; from here on m holds the row's lse, l Σ exp
            float m_other = __shfl_xor_sync(0xffffffff, m, 16), l_other = __shfl_xor_sync(0xffffffff, l, 16);
            float top = fmaxf(m, m_other);
            l = (l > 0.0f ? l * expf(m - top) : 0.0f) + (l_other > 0.0f ? l_other * expf(m_other - top) : 0.0f);
            m = l > 0.0f ? top + logf(l) : -INFINITY;
        }
    }
    if (row && c0 == 0) lse[((long)b * s.heads + h) * s.seq + i] = m;
    __syncwarp(); // the warp together again before its fragments are stored
    write_rows<D>(s, o, 1.0f, sc[w], out, b, s.seq, s.heads, h, i0 + 16 * w);
}

// dq_i = Σ_j ds_ij k_j / sqrt(d), ds_ij = p_ij (dp_ij − delta_i), dp = dO·Vᵀ: a block per 32 query rows.
template <int D>
__device__ void dq(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                   const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dq) {
    __shared__ __align__(32) Rows<D> qs, dos, ks, vs;
    __shared__ __align__(32) float sc[WARPS][16][LDS], dp[WARPS][16][LDS];
    __shared__ __align__(32) bf16 ds[WARPS][16][TILE];
    __shared__ unsigned kp[TILE];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads), i0 = blockIdx.x * TILE;
    int w = threadIdx.x / 32, r = threadIdx.x % 16, c0 = threadIdx.x % 32 / 16 * HALF, i = i0 + 16 * w + r;
    bool row = i < s.seq;
    long at_i = ((long)b * s.heads + h) * s.seq + i;
    unsigned pi = row ? q_pos[i] : 0, last = max_position(q_pos, i0, s.seq);
    float scale = rsqrtf((float)D), li = row ? lse[at_i] : 0.0f, di = row ? delta[at_i] : 0.0f;
    stage<D>(s, q, b, s.seq, s.heads, h, i0, qs);
    stage<D>(s, dout, b, s.seq, s.heads, h, i0, dos);
    Acc acc[D / 16];
    for (int n = 0; n < D / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
    for (int j0 = 0; j0 < s.kv_seq; j0 += TILE) {
        if (min_position(k_pos, j0, s.kv_seq) > last) continue;
        stage<D>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
        stage<D>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs);
        for (int e = threadIdx.x; e < TILE; e += blockDim.x) kp[e] = j0 + e < s.kv_seq ? k_pos[j0 + e] : 0xffffffffu;
        __syncthreads();
        times_transposed<D>(&qs.x[16 * w], ks, sc[w]);
        times_transposed<D>(&dos.x[16 * w], vs, dp[w]);
        __syncwarp();
        for (int jj = c0; jj < c0 + HALF; jj++) {
            bool seen = row && kp[jj] <= pi;
            ds[w][r][jj] = __float2bfloat16(seen ? expf(sc[w][r][jj] * scale - li) * (dp[w][r][jj] - di) : 0.0f);
        }
        __syncwarp();
        accumulate<D>(ds[w], ks, acc);
        __syncthreads();
    }
    __syncwarp();
    write_rows<D>(s, acc, scale, sc[w], dq, b, s.seq, s.heads, h, i0 + 16 * w);
}

// dk_j = Σ_{h in group, i} ds_ij q_i / sqrt(d), dv_j = Σ p_ij do_i: a block per 32 key rows of KV
// head g; warp w computes the transposed tiles Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for its 16 keys.
template <int D>
__device__ void dkdv(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                     const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dk, bf16* dv) {
    __shared__ __align__(32) Rows<D> ks, vs, qs, dos;
    __shared__ __align__(32) float st[WARPS][16][LDS], dpt[WARPS][16][LDS];
    __shared__ __align__(32) bf16 pt[WARPS][16][TILE], dst[WARPS][16][TILE];
    __shared__ unsigned qp[TILE];
    __shared__ float ls[TILE], dl[TILE];
    int b = blockIdx.z, g = blockIdx.y, groups = s.heads / s.kv_heads, j0 = blockIdx.x * TILE;
    int w = threadIdx.x / 32, r = threadIdx.x % 16, c0 = threadIdx.x % 32 / 16 * HALF, j = j0 + 16 * w + r;
    bool row = j < s.kv_seq; // this thread handles half (queries c0..c0+HALF) of key row j
    unsigned pj = row ? k_pos[j] : 0xffffffffu, first = min_position(k_pos, j0, s.kv_seq);
    float scale = rsqrtf((float)D);
    stage<D>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
    stage<D>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs);
    Acc dka[D / 16], dva[D / 16];
    for (int n = 0; n < D / 16; n++) {
        wmma::fill_fragment(dka[n], 0.0f);
        wmma::fill_fragment(dva[n], 0.0f);
    }
    for (int h = g * groups; h < (g + 1) * groups; h++) {
        for (int i0 = 0; i0 < s.seq; i0 += TILE) {
            if (max_position(q_pos, i0, s.seq) < first) continue; // every query before every key
            stage<D>(s, q, b, s.seq, s.heads, h, i0, qs);
            stage<D>(s, dout, b, s.seq, s.heads, h, i0, dos);
            stage_query_rows(s, q_pos, lse, delta, b, h, i0, TILE, qp, ls, dl);
            __syncthreads();
            times_transposed<D>(&ks.x[16 * w], qs, st[w]);
            times_transposed<D>(&vs.x[16 * w], dos, dpt[w]);
            __syncwarp();
#pragma unroll 4 // more would take registers from the 2·D/16 accumulators (spills at D = 128)
            for (int ii = c0; ii < c0 + HALF; ii++) {
                float p = row && pj <= qp[ii] ? expf(st[w][r][ii] * scale - ls[ii]) : 0.0f;
                pt[w][r][ii] = __float2bfloat16(p);
                dst[w][r][ii] = __float2bfloat16(p * (dpt[w][r][ii] - dl[ii]));
            }
            __syncwarp();
            accumulate<D>(pt[w], dos, dva);
            accumulate<D>(dst[w], qs, dka);
            __syncthreads();
        }
    }
    __syncwarp();
    write_rows<D>(s, dka, scale, st[w], dk, b, s.kv_seq, s.kv_heads, g, j0 + 16 * w);
    write_rows<D>(s, dva, 1.0f, st[w], dv, b, s.kv_seq, s.kv_heads, g, j0 + 16 * w);
}

#define EXPORT(D)                                                                                                      \
    extern "C" __global__ void attention_tc_forward_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,         \
                                                         const unsigned* q_pos, const unsigned* k_pos, bf16* out,      \
                                                         float* lse) {                                                 \
        forward<D>(s, q, k, v, q_pos, k_pos, out, lse);                                                                \
    }                                                                                                                  \
    extern "C" __global__ void attention_tc_dq_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,              \
                                                    const unsigned* q_pos, const unsigned* k_pos, const float* lse,    \
                                                    const float* delta, const bf16* dout, bf16* dq_) {                 \
        dq<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq_);                                                        \
    }                                                                                                                  \
    extern "C" __global__ void attention_tc_dkdv_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,            \
                                                      const unsigned* q_pos, const unsigned* k_pos, const float* lse,  \
                                                      const float* delta, const bf16* dout, bf16* dk, bf16* dv) {      \
        dkdv<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dk, dv);                                                   \
    }
EXPORT(16)
EXPORT(32)
EXPORT(64)
EXPORT(128)
