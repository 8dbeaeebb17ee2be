// flash_attention.cu — causal grouped-query attention, FlashAttention-2 style, on tensor cores (bf16).
//
// The math is attention.cu's (which stays the readable version and the f32 path):
//   s_ij = q_i·k_j / √D where key position ≤ query position,   p_ij = exp(s_ij − lse_i),
//   o_i = Σ_j p_ij v_j;   backward: dp_ij = do_i·v_j,  ds_ij = p_ij (dp_ij − δ_i),  δ_i = do_i·o_i,
//   dq_i = Σ_j ds_ij k_j / √D,  dk_j = Σ_i ds_ij q_i / √D,  dv_j = Σ_i p_ij do_i.
// Same arguments and outputs (o, lse; dq, dk, dv), positions per row, so that a ring or zigzag
// context-parallel block is the same kernel; a row that sees no key gets o = 0 and lse = −∞.
//
// Tiling (FlashAttention-2, Dao 2023). The seq × seq score matrix never exists: it is cut into
// tiles of 16 rows per warp × N columns that live only in registers.
//
//            keys → (a tile of BN at a time, through shared memory)
//          ┌────┬────┬────┬────┐
//  warp 0  │ S  │ S  │ ·  │    │   each warp: 16 query rows, its Q fragments and its O
//  warp 1  │ S  │ S  │ S  │    │   accumulators in registers for the whole walk over the keys;
//  warp 2  │ S  │ S  │ S  │ ·  │   a tile whose keys every query of the block precedes is
//  warp 3  │ S  │ S  │ S  │ S  │   skipped (half of all tiles, with causal order)
//          └────┴────┴────┴────┘
//
// Online softmax, and why it is exact: after the keys seen so far a row holds m (the largest
// score), l = Σ exp(s − m) and O = Σ exp(s − m) v. A new tile with a larger maximum m' only
// changes the common factor: l ← l·exp(m − m') + Σ_new exp(s − m'), O likewise, so after the last
// tile O / l is the softmax-weighted sum exactly (up to rounding), with one pass over the keys.
// Exponentials are exp2 of scores pre-multiplied by log2(e)/√D (one multiply, then the fast ex2).
//
// What a lane holds. Every product is `mma.sync.m16n8k16` (bf16 in, fp32 accumulate): a warp
// multiplies a 16×16 A by a 16×8 B into a 16×8 C, and lane l (group g = l/4, place t = l%4) holds
// C's rows g and g+8 at columns 2t, 2t+1. The trick that keeps the softmax in registers: the C
// fragments of two adjacent 8-column tiles of S are, element for element, the A fragment of the
// next product P·V (rows g, g+8; columns 2t.., 2t+8..), so P goes from accumulator to operand with
// a cast and no trip through shared memory. A row's maximum and sum need the 4 lanes of a group:
// two xor-shuffles. Operands come from shared memory by `ldmatrix` (.trans gives a tile
// transposed, for the B of P·V, whose rows are keys), and tiles come from global memory by 16-byte
// `cp.async` copies that run while the warp computes: the V tile is in flight during S = Q·Kᵀ and
// the softmax, the next K tile during O += P·V. Shared rows are padded by 8 bf16 (16 bytes), so
// that the 8 rows an ldmatrix reads fall on 8 different bank groups (no conflicts).
//
// Forward and dq split the work by query rows (a block: 64 queries of one head, 4 warps), dk/dv
// by key rows (a block: the keys of one KV head; it walks every query head of its group, so GQA
// needs no repeated K/V and no atomics). Each output row has one owner, every sum runs in a fixed
// order: the results are the same bits every run. dk/dv computes the transposed products
// Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, so that Pᵀ and dSᵀ are again A operands for dV += Pᵀ·dO and
// dK += dSᵀ·Q. δ comes from attention.cu's attention_delta, run first.
//
// D (16, 32, 64, 128) is a template parameter, so fragment arrays are indexed by constants and
// stay in registers (tests/kernels_compile.rs checks: no spills). Static shared memory is at most
// 48 KiB a block, which sets the tiles: K and V tiles of 64 rows, Q staged through the V tile
// before the first V arrives; dk/dv at D = 128 takes 32 keys a block (2 warps) and 32 queries a tile.

typedef __nv_bfloat16 bf16;
#define WARPS 4
#define BM (16 * WARPS) // query rows a block of the forward and of dq
#define BN 64           // key rows a tile of the forward and of dq
#define PAD 8           // bf16 added to each shared row
#define LOG2E 1.4426950408889634f
#define NO_KEY 0xffffffffu // the position of a padding key: no query sees it

// ---- the PTX instructions (on the CPU emulator: tests/emulator/warp_ptx.h) -------------------
#ifdef FERROTRON_EMULATOR
#include "warp_ptx.h"
#else
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// c += A·B on a 16×16×8 tile; the lane's registers as in the header.
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Four 8×8 matrices; lanes 8i..8i+7 point at the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
// 16 bytes global → shared, asynchronously; zeros where `valid` is false (nothing is read).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#endif

// ---- helpers shared by the three kernels --------------------------------------------------------

// Two floats as the bf16 pair of one operand register (the first in the low half).
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16(lo)) |
           (unsigned)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16;
}

// Starts copying rows r0..r0+N of head `head` of x [batch*len, heads*D] into t (zeros past len),
// 16 bytes per cp.async, spread over the block's threads. The caller commits and waits.
template <int D, int N>
__device__ void load_rows(const Shape& s, const bf16* x, int b, int len, int n_heads, int head, int r0,
                          bf16 (*t)[D + PAD]) {
    for (int e = threadIdx.x; e < N * D / 8; e += blockDim.x) {
        int r = e / (D / 8), c = e % (D / 8) * 8;
        bool in = r0 + r < len;
        cp_async_16(&t[r][c], x + at(s, b, len, in ? r0 + r : 0, n_heads, head) + c, in); // an address inside x even for padding
    }
}

// A fragments of the 16 rows at `rows` (a shared tile), one per 16 columns: ldmatrix's matrices
// 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
template <int D>
__device__ void load_a(unsigned (*a)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    for (int kk = 0; kk < D / 16; kk++) ldmatrix_x4(a[kk], &rows[lane % 16][16 * kk + lane / 16 * 8]);
}

// c[n] (16 × N scores, as N/8 fragments) = A (16 rows × D, fragments a) · Bᵀ, B the N rows at `rows`:
// B's fragment b0 = B[2t..][g] is row g of the tile, columns 2t.., so a plain ldmatrix gives it;
// matrices 0..3 are (rows 0-7, cols k..k+7), (rows 0-7, k+8..), (rows 8-15, k..), (rows 8-15, k+8..).
template <int D, int N>
__device__ void times_transposed(float (*c)[4], const unsigned (*a)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    for (int n = 0; n < N / 8; n++)
        for (int e = 0; e < 4; e++) c[n][e] = 0.0f;
    for (int np = 0; np < N / 16; np++)
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned b[4];
            ldmatrix_x4(b, &rows[16 * np + lane / 16 * 8 + lane % 8][16 * kk + lane / 8 % 2 * 8]);
            mma_16x8x16(c[2 * np], a[kk], &b[0]);
            mma_16x8x16(c[2 * np + 1], a[kk], &b[2]);
        }
}

// acc (16 × D, as D/8 fragments) += P · B, P (16 × N) the fp32 fragments p (C layout, cast to bf16
// A operands two tiles at a time), B the N rows × D at `rows`, read transposed by ldmatrix.trans.
template <int D, int N>
__device__ void accumulate(float (*acc)[4], const float (*p)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    for (int kk = 0; kk < N / 16; kk++) {
        const float *lo = p[2 * kk], *hi = p[2 * kk + 1];
        unsigned a[4] = {pack(lo[0], lo[1]), pack(lo[2], lo[3]), pack(hi[0], hi[1]), pack(hi[2], hi[3])};
        for (int np = 0; np < D / 16; np++) {
            unsigned b[4];
            ldmatrix_x4_trans(b, &rows[16 * kk + lane / 8 % 2 * 8 + lane % 8][16 * np + lane / 16 * 8]);
            mma_16x8x16(acc[2 * np], a, &b[0]);
            mma_16x8x16(acc[2 * np + 1], a, &b[2]);
        }
    }
}

// Writes rows r0 + g and r0 + g + 8 (those below len) of the 16 × D fragments acc × factor to y.
template <int D>
__device__ void write_rows(const Shape& s, const float (*acc)[4], const float* factor, bf16* y, int b, int len,
                           int n_heads, int head, int r0) {
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int half = 0; half < 2; half++) {
        int r = r0 + g + 8 * half;
        if (r >= len) continue;
        unsigned* row = (unsigned*)(y + at(s, b, len, r, n_heads, head));
        for (int n = 0; n < D / 8; n++)
            row[4 * n + t] = pack(acc[n][2 * half] * factor[half], acc[n][2 * half + 1] * factor[half]);
    }
}

// The largest (or, with `smallest`, the smallest) of positions pos[r0..r0+n) that exist, by every
// warp on its own (no block barrier).
__device__ unsigned extreme_position(const unsigned* pos, int r0, int n, int len, bool smallest) {
    unsigned m = smallest ? NO_KEY : 0;
    for (int r = r0 + threadIdx.x % 32; r < min(r0 + n, len); r += 32) m = smallest ? min(m, pos[r]) : max(m, pos[r]);
    for (int o = 16; o > 0; o >>= 1) {
        unsigned other = __shfl_xor_sync(0xffffffff, m, o);
        m = smallest ? min(m, other) : max(m, other);
    }
    return m;
}

// The first tile of n rows at or after r0 (len if none) holding a row that the block sees:
// a key with position ≤ last (forward, dq), or, with `queries`, a query with position ≥ first (dk/dv).
__device__ int next_tile(const unsigned* pos, int r0, int n, int len, unsigned bound, bool queries) {
    for (; r0 < len; r0 += n) {
        bool seen = false;
        for (int r = r0 + threadIdx.x % 32; r < min(r0 + n, len); r += 32) seen |= queries ? pos[r] >= bound : pos[r] <= bound;
        if (__any_sync(0xffffffff, seen)) return r0;
    }
    return len;
}

// The positions of key rows j0..j0+N into kp (NO_KEY past the end); plain stores, seen after the
// next __syncthreads.
template <int N>
__device__ void load_key_positions(const unsigned* k_pos, int j0, int kv_seq, unsigned* kp) {
    for (int e = threadIdx.x; e < N; e += blockDim.x) kp[e] = j0 + e < kv_seq ? k_pos[j0 + e] : NO_KEY;
}

// ---- forward ----------------------------------------------------------------------------------

template <int D>
__device__ void forward(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                        const unsigned* k_pos, bf16* out, float* lse) {
    __shared__ __align__(16) bf16 ks[BN][D + PAD], vs[BN][D + PAD];
    __shared__ unsigned kp[BN];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads), i0 = blockIdx.x * BM;
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = i0 + 16 * w;
    unsigned last = extreme_position(q_pos, i0, BM, s.seq, false), pi[2];
    for (int half = 0; half < 2; half++) pi[half] = r0 + row + 8 * half < s.seq ? q_pos[r0 + row + 8 * half] : 0;
    // Q through vs (free until the first V tile), beside the first K tile
    load_rows<D, BM>(s, q, b, s.seq, s.heads, h, i0, vs);
    int j0 = next_tile(k_pos, 0, BN, s.kv_seq, last, false);
    if (j0 < s.kv_seq) {
        load_rows<D, BN>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
        load_key_positions<BN>(k_pos, j0, s.kv_seq, kp);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[D / 16][4];
    load_a<D>(qf, &vs[16 * w]);
    __syncthreads(); // every warp has its Q before V overwrites it
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; // m in log2 units
    float scale = rsqrtf((float)D) * LOG2E;
    while (j0 < s.kv_seq) {
        load_rows<D, BN>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs); // lands while S and the softmax run
        cp_async_commit();
        float sc[BN / 8][4];
        times_transposed<D, BN>(sc, qf, ks);
        float top[2] = {-INFINITY, -INFINITY};
        for (int n = 0; n < BN / 8; n++)
            for (int e = 0; e < 4; e++) { // masked (a later or padding key) → −∞
                sc[n][e] = kp[8 * n + 2 * t + e % 2] <= pi[e / 2] ? sc[n][e] * scale : -INFINITY;
                top[e / 2] = fmaxf(top[e / 2], sc[n][e]);
            }
        for (int half = 0; half < 2; half++) {
            for (int x = 1; x <= 2; x <<= 1) top[half] = fmaxf(top[half], __shfl_xor_sync(0xffffffff, top[half], x));
            float m_new = fmaxf(m[half], top[half]);
            float base = m_new == -INFINITY ? 0.0f : m_new; // a row with no visible key yet: exp2(−∞) = 0
            float correction = exp2f(m[half] - base);
            l[half] *= correction; // this lane's part of the row sum; the group's parts are added at the end
            for (int n = 0; n < D / 8; n++) o[n][2 * half] *= correction, o[n][2 * half + 1] *= correction;
            for (int n = 0; n < BN / 8; n++)
                for (int e = 2 * half; e < 2 * half + 2; e++) {
                    sc[n][e] = exp2f(sc[n][e] - base);
                    l[half] += sc[n][e];
                }
            m[half] = m_new;
        }
        cp_async_wait<0>();
        __syncthreads(); // V has landed for all; every warp is done with ks and kp
        int next = next_tile(k_pos, j0 + BN, BN, s.kv_seq, last, false);
        if (next < s.kv_seq) {
            load_rows<D, BN>(s, k, b, s.kv_seq, s.kv_heads, g, next, ks); // lands while P·V runs
            load_key_positions<BN>(k_pos, next, s.kv_seq, kp);
        }
        cp_async_commit();
        accumulate<D, BN>(o, sc, vs);
        cp_async_wait<0>();
        __syncthreads(); // the next K has landed; every warp is done with vs
        j0 = next;
    }
    float inverse[2];
    for (int half = 0; half < 2; half++) {
        for (int x = 1; x <= 2; x <<= 1) l[half] += __shfl_xor_sync(0xffffffff, l[half], x);
        inverse[half] = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
        int i = r0 + row + 8 * half;
        if (t == 0 && i < s.seq)
            lse[((long)b * s.heads + h) * s.seq + i] = l[half] > 0.0f ? (m[half] + log2f(l[half])) / LOG2E : -INFINITY;
    }
    write_rows<D>(s, o, inverse, out, b, s.seq, s.heads, h, r0);
}

// ---- backward: dq, a block per 64 query rows ----------------------------------------------------
// Key tiles of KN rows: 16 at D = 128, where Q, dO and dQ already take 128 registers a lane (at
// 32, ptxas spills).

template <int D>
__device__ void dq(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                   const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dq_) {
    constexpr int KN = D <= 64 ? 64 : 16;
    __shared__ __align__(16) bf16 ks[BM][D + PAD], vs[BM][D + PAD]; // Q and dO are staged through these first
    __shared__ unsigned kp[KN];
    int b = blockIdx.z, h = blockIdx.y, g = h / (s.heads / s.kv_heads), i0 = blockIdx.x * BM;
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = i0 + 16 * w;
    unsigned last = extreme_position(q_pos, i0, BM, s.seq, false), pi[2];
    float ls[2], dl[2], scale = rsqrtf((float)D) * LOG2E;
    for (int half = 0; half < 2; half++) {
        int i = r0 + row + 8 * half;
        bool in = i < s.seq;
        long at_i = ((long)b * s.heads + h) * s.seq + i;
        pi[half] = in ? q_pos[i] : 0;
        ls[half] = in ? lse[at_i] * LOG2E : 0.0f;
        dl[half] = in ? delta[at_i] : 0.0f;
    }
    load_rows<D, BM>(s, q, b, s.seq, s.heads, h, i0, ks);
    load_rows<D, BM>(s, dout, b, s.seq, s.heads, h, i0, vs);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[D / 16][4], dof[D / 16][4];
    load_a<D>(qf, &ks[16 * w]);
    load_a<D>(dof, &vs[16 * w]);
    float acc[D / 8][4] = {};
    for (int j0 = next_tile(k_pos, 0, KN, s.kv_seq, last, false); j0 < s.kv_seq;
         j0 = next_tile(k_pos, j0 + KN, KN, s.kv_seq, last, false)) {
        __syncthreads(); // every warp is done with the previous tile (or with Q and dO)
        load_rows<D, KN>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
        load_rows<D, KN>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs);
        load_key_positions<KN>(k_pos, j0, s.kv_seq, kp);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        float sc[KN / 8][4], dp[KN / 8][4];
        times_transposed<D, KN>(sc, qf, ks);
        times_transposed<D, KN>(dp, dof, vs);
        for (int n = 0; n < KN / 8; n++)
            for (int e = 0; e < 4; e++) { // ds = p (dp − δ), 0 where masked
                bool seen = kp[8 * n + 2 * t + e % 2] <= pi[e / 2];
                sc[n][e] = seen ? exp2f(sc[n][e] * scale - ls[e / 2]) * (dp[n][e] - dl[e / 2]) : 0.0f;
            }
        accumulate<D, KN>(acc, sc, ks);
    }
    float factor[2] = {rsqrtf((float)D), rsqrtf((float)D)};
    write_rows<D>(s, acc, factor, dq_, b, s.seq, s.heads, h, r0);
}

// ---- backward: dk and dv, a block per KEYS key rows of one KV head ------------------------------

template <int D>
struct KeyTiles {
    static constexpr int KEYS = D <= 64 ? 64 : 32;    // key rows a block (16 a warp)
    static constexpr int QUERIES = D <= 64 ? 64 : 32; // query rows a tile
};

template <int D>
__device__ void dkdv(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                     const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dk, bf16* dv) {
    constexpr int KEYS = KeyTiles<D>::KEYS, QUERIES = KeyTiles<D>::QUERIES;
    __shared__ __align__(16) bf16 ks[KEYS][D + PAD], vs[KEYS][D + PAD], qs[QUERIES][D + PAD], dos[QUERIES][D + PAD];
    __shared__ unsigned qp[QUERIES];
    __shared__ float ls[QUERIES], dl[QUERIES];
    int b = blockIdx.z, g = blockIdx.y, groups = s.heads / s.kv_heads, j0 = blockIdx.x * KEYS;
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = j0 + 16 * w;
    unsigned first = extreme_position(k_pos, j0, KEYS, s.kv_seq, true), pj[2];
    for (int half = 0; half < 2; half++) pj[half] = r0 + row + 8 * half < s.kv_seq ? k_pos[r0 + row + 8 * half] : NO_KEY;
    float scale = rsqrtf((float)D) * LOG2E;
    load_rows<D, KEYS>(s, k, b, s.kv_seq, s.kv_heads, g, j0, ks);
    load_rows<D, KEYS>(s, v, b, s.kv_seq, s.kv_heads, g, j0, vs);
    cp_async_commit();
    float dka[D / 8][4] = {}, dva[D / 8][4] = {};
    for (int h = g * groups; h < (g + 1) * groups; h++) {
        for (int i0 = next_tile(q_pos, 0, QUERIES, s.seq, first, true); i0 < s.seq;
             i0 = next_tile(q_pos, i0 + QUERIES, QUERIES, s.seq, first, true)) {
            __syncthreads(); // every warp is done with the previous tile
            load_rows<D, QUERIES>(s, q, b, s.seq, s.heads, h, i0, qs);
            load_rows<D, QUERIES>(s, dout, b, s.seq, s.heads, h, i0, dos);
            cp_async_commit();
            stage_query_rows(s, q_pos, lse, delta, b, h, i0, QUERIES, qp, ls, dl);
            cp_async_wait<0>();
            __syncthreads();
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for this warp's 16 keys; K and V fragments re-read each tile
            // (kept in registers they would leave too few for the four accumulators at D = 128)
            float st[QUERIES / 8][4], dpt[QUERIES / 8][4];
            {
                unsigned kf[D / 16][4];
                load_a<D>(kf, &ks[16 * w]);
                times_transposed<D, QUERIES>(st, kf, qs);
            }
            {
                unsigned vf[D / 16][4];
                load_a<D>(vf, &vs[16 * w]);
                times_transposed<D, QUERIES>(dpt, vf, dos);
            }
            for (int n = 0; n < QUERIES / 8; n++)
                for (int e = 0; e < 4; e++) { // pᵀ, and dsᵀ = pᵀ (dpᵀ − δ) in dpt
                    int c = 8 * n + 2 * t + e % 2;
                    st[n][e] = pj[e / 2] <= qp[c] ? exp2f(st[n][e] * scale - ls[c] * LOG2E) : 0.0f;
                    dpt[n][e] = st[n][e] * (dpt[n][e] - dl[c]);
                }
            accumulate<D, QUERIES>(dva, st, dos);
            accumulate<D, QUERIES>(dka, dpt, qs);
        }
    }
    cp_async_wait<0>(); // K and V, where no query tile was seen
    float factor[2] = {rsqrtf((float)D), rsqrtf((float)D)}, one[2] = {1.0f, 1.0f};
    write_rows<D>(s, dka, factor, dk, b, s.kv_seq, s.kv_heads, g, r0);
    write_rows<D>(s, dva, one, dv, b, s.kv_seq, s.kv_heads, g, r0);
}

#define EXPORT(D)                                                                                                      \
    extern "C" __global__ void flash_attention_forward_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,      \
                                                            const unsigned* q_pos, const unsigned* k_pos, bf16* out,   \
                                                            float* lse) {                                              \
        forward<D>(s, q, k, v, q_pos, k_pos, out, lse);                                                                \
    }                                                                                                                  \
    extern "C" __global__ void flash_attention_dq_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,           \
                                                       const unsigned* q_pos, const unsigned* k_pos, const float* lse, \
                                                       const float* delta, const bf16* dout, bf16* dq_) {              \
        dq<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq_);                                                        \
    }                                                                                                                  \
    extern "C" __global__ void flash_attention_dkdv_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,         \
                                                         const unsigned* q_pos, const unsigned* k_pos,                 \
                                                         const float* lse, const float* delta, const bf16* dout,       \
                                                         bf16* dk, bf16* dv) {                                         \
        dkdv<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dk, dv);                                                   \
    }
EXPORT(16)
EXPORT(32)
EXPORT(64)
EXPORT(128)
