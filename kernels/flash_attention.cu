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
// `cp.async` copies. Shared rows are padded by 8 bf16 (16 bytes), so that the 8 rows an ldmatrix
// reads fall on 8 different bank groups (no conflicts).
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
// 48 KiB a block, which sets the tiles (ForwardTiles, DqTiles, KeyTiles below).
//
// How fast, and why: four things a tensor-core kernel is tuned by, with this kernel's numbers
// (one H100, smollm-135m's shapes: batch 8, 2048 tokens, 9 heads, 3 KV heads, D 64; forward +
// backward a layer; `ferrotron bench --op attention`; BENCHMARKS.md has the rest).
//  1. Issue slots. A scheduler (4 an SM) issues one instruction a clock; one mma.sync keeps its
//     tensor core busy about 4–6 clocks. Past about 6 instructions per HMMA, the issue slots set
//     the speed. The first version issued 15 (forward), 10 (dq) and 11 (dk/dv) per HMMA: 42
//     instructions of 64-bit address math per 16-byte copy, exp2f without fast math (4 a value),
//     the position mask on every score. Now each copy and ldmatrix is one base address a tile plus
//     a compile-time offset (load_rows, load_a), exponentials are one MUFU.EX2 (fast_exp2), and
//     only a tile across the diagonal is masked (a warp-uniform branch): 10.2, 7.8 and 7.4 per
//     HMMA counted over the whole loop, the diagonal's mask included (tests/kernels_sass.rs).
//  2. Occupancy. Latency (a global load: about 1 µs) is hidden by other warps; with 8 warps an SM
//     (2 a scheduler) a stalled scheduler often has nothing else to issue. __launch_bounds__ asks
//     ptxas for 128 registers a thread in the forward (16 warps an SM) and 168 in dq and dk/dv
//     (12): alone that took the layer from 1.020 to 0.911 ms.
//  3. Overlap. The forward's and dq's loops issue the next tile's copies, then wait for this
//     tile's (issued a whole turn earlier: `cp.async.wait_group 1`), then compute: copies and
//     products run at once, for a second buffer of shared memory. In dk/dv the same cost smaller
//     tiles, and the GPU said no (below).
//  4. Balance. A grid's blocks start in index order as slots free up; under causal order blocks
//     differ up to 32× in work, so the grids put the heaviest tiles first (query_block_start;
//     tests/attention_balance.rs plays the launch on 132 SMs).
// Together with an 8-threads-a-row δ (0.108 → 0.018 ms) they took the layer from 1.528 to
// 0.754 ms (PyTorch's FlashAttention-2: 0.766, cuDNN: 0.479). What only a GPU can say
// is how these trade against each other; what the SASS says without one is where the issue slots,
// the registers and the waits go (and an estimate of scheduler clocks per HMMA from them: 15.1,
// 13.7, 14.5 at D 64 against FlashAttention-2's measured 17), and what the emulator says is what
// the addresses cost: 4 bank wavefronts an ldmatrix (PAD), 16 sectors a warp's 512 bytes of
// copies, and 32 products in flight during each copy group of the forward and dq, none in dk/dv
// (FERROTRON_EMULATOR_COSTS=1; kernels/README.md). Those hold them between measurements.

typedef __nv_bfloat16 bf16;
#define WARPS 4
#define THREADS (32 * WARPS) // a block of the forward and of dq
#define BM (16 * WARPS)      // query rows a block of the forward and of dq
#define PAD 8                // bf16 added to each shared row
#define LOG2E 1.4426950408889634f
#define NO_KEY 0xffffffffu // the position of a padding key: no query sees it

// ---- the PTX instructions (on the CPU emulator: tests/emulator/warp_ptx.h) -------------------
#ifdef FERROTRON_EMULATOR
#include "warp_ptx.h"
#else
// A shared-memory address: the 32-bit offset in the block's shared window. Made once per tile
// from a generic pointer (cvta.to.shared); each copy and ldmatrix then adds a compile-time offset,
// which the instruction carries as an immediate: no address arithmetic in the hot loop.
typedef unsigned smem_t;
__device__ __forceinline__ smem_t smem(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 2^x in one MUFU.EX2 (relative error about 2^-22; a subnormal result flushed to zero). exp2f
// without fast math is four instructions (a range check, two multiplies and the MUFU).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// c += A·B on a 16×16×8 tile; the lane's registers as in the header.
__device__ __forceinline__ void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Four 8×8 matrices; lanes 8i..8i+7 give the addresses of the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, smem_t row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, smem_t row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
// 16 bytes global → shared, asynchronously; zeros where `valid` is false (nothing is read).
__device__ __forceinline__ void cp_async_16(smem_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
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
// 16 bytes per cp.async by each of the block's NT threads; the caller commits and waits. A thread
// copies the same 16-byte column of rows NT/(D/8) apart, so its addresses are one global and one
// shared base plus compile-time steps: the 64-bit address math runs once a tile, not once a copy.
template <int D, int N, int NT>
__device__ __forceinline__ void load_rows(const bf16* x, int b, int len, int n_heads, int head, int r0,
                                          bf16 (*t)[D + PAD]) {
    constexpr int CHUNKS = D / 8, STEP = NT / CHUNKS; // 16-byte pieces a row; rows between a thread's copies
    constexpr int COPIES = N < STEP ? 1 : N / STEP; // a thread's copies (threads past row N have none)
    static_assert(NT % CHUNKS == 0 && (N % STEP == 0 || STEP % N == 0), "the block's threads tile the rows exactly");
    int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS * 8;
    if (N < STEP && r >= N) return;
    long step = (long)STEP * n_heads * D; // elements between a thread's rows
    const bf16* src = x + ((long)b * len + r0 + r) * n_heads * D + (long)head * D + c;
    smem_t dst = smem(&t[r][c]);
    if (r0 + N <= len) { // every row exists (all tiles but a sequence's last): no test, no select
#pragma unroll
        for (int i = 0; i < COPIES; i++) cp_async_16(dst + i * STEP * (D + PAD) * 2, src + i * step, true);
    } else {
#pragma unroll
        for (int i = 0; i < COPIES; i++) {
            bool in = r0 + r + i * STEP < len;
            cp_async_16(dst + i * STEP * (D + PAD) * 2, in ? src + i * step : x, in); // padding: an address inside x
        }
    }
}

// A fragments of the 16 rows at `rows` (a shared tile), one per 16 columns: ldmatrix's matrices
// 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
template <int D>
__device__ __forceinline__ void load_a(unsigned (*a)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    smem_t base = smem(&rows[lane % 16][lane / 16 * 8]);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldmatrix_x4(a[kk], base + 32 * kk);
}

// c[n] (16 × N scores, as N/8 fragments) = A (16 rows × D, fragments a) · Bᵀ, B the N rows at `rows`:
// B's fragment b0 = B[2t..][g] is row g of the tile, columns 2t.., so a plain ldmatrix gives it;
// matrices 0..3 are (rows 0-7, cols k..k+7), (rows 0-7, k+8..), (rows 8-15, k..), (rows 8-15, k+8..).
template <int D, int N>
__device__ __forceinline__ void times_transposed(float (*c)[4], const unsigned (*a)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    smem_t base = smem(&rows[lane / 16 * 8 + lane % 8][lane / 8 % 2 * 8]);
#pragma unroll
    for (int n = 0; n < N / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[n][e] = 0.0f;
#pragma unroll
    for (int np = 0; np < N / 16; np++)
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            unsigned b[4];
            ldmatrix_x4(b, base + (16 * np * (D + PAD) + 16 * kk) * 2);
            mma_16x8x16(c[2 * np], a[kk], &b[0]);
            mma_16x8x16(c[2 * np + 1], a[kk], &b[2]);
        }
}

// acc (16 × D, as D/8 fragments) += P · B, P (16 × N) the fp32 fragments p (C layout, cast to bf16
// A operands two tiles at a time), B the N rows × D at `rows`, read transposed by ldmatrix.trans.
template <int D, int N>
__device__ __forceinline__ void accumulate(float (*acc)[4], const float (*p)[4], const bf16 (*rows)[D + PAD]) {
    int lane = threadIdx.x % 32;
    smem_t base = smem(&rows[lane / 8 % 2 * 8 + lane % 8][lane / 16 * 8]);
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        const float *lo = p[2 * kk], *hi = p[2 * kk + 1];
        unsigned a[4] = {pack(lo[0], lo[1]), pack(lo[2], lo[3]), pack(hi[0], hi[1]), pack(hi[2], hi[3])};
#pragma unroll
        for (int np = 0; np < D / 16; np++) {
            unsigned b[4];
            ldmatrix_x4_trans(b, base + (16 * kk * (D + PAD) + 16 * np) * 2);
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
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            row[4 * n + t] = pack(acc[n][2 * half] * factor[half], acc[n][2 * half + 1] * factor[half]);
    }
}

// The largest (or, with `smallest`, the smallest) of positions pos[r0..r0+n) that exist, by every
// warp on its own (no block barrier); NO_KEY (smallest) or 0 (largest) when none does. Also over
// a tile's positions staged in shared memory: whether the whole tile is visible to the warp's
// rows, so that its mask can be skipped (a warp-uniform branch).
__device__ unsigned extreme_position(const unsigned* pos, int r0, int n, int len, bool smallest) {
    unsigned m = smallest ? NO_KEY : 0;
    for (int r = r0 + threadIdx.x % 32; r < min(r0 + n, len); r += 32) m = smallest ? min(m, pos[r]) : max(m, pos[r]);
    return smallest ? __reduce_min_sync(0xffffffff, m) : __reduce_max_sync(0xffffffff, m); // one REDUX
}

// The first tile of N rows at or after r0 (len if none) holding a row that the block sees: a key
// with position ≤ bound (forward, dq), or, with `queries`, a query with position ≥ bound (dk/dv).
// Positions are general (a ring or zigzag block's), so this reads them; called a tile ahead, its
// loads overlap the current tile's products.
template <int N>
__device__ int next_tile(const unsigned* pos, int r0, int len, unsigned bound, bool queries) {
    int lane = threadIdx.x % 32;
    for (; r0 < len; r0 += N) {
        bool seen = false;
#pragma unroll
        for (int k = 0; k < (N + 31) / 32; k++) {
            int r = r0 + lane + 32 * k;
            if (lane + 32 * k < N && r < len) seen |= queries ? pos[r] >= bound : pos[r] <= bound;
        }
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

// Starts copying the N key and value rows j.. of KV head g into kt and vt, and their positions
// into kp (the forward's and dq's next tile).
template <int D, int N>
__device__ __forceinline__ void load_kv_tile(const Shape& s, const bf16* k, const bf16* v, const unsigned* k_pos, int b,
                                             int g, int j, bf16 (*kt)[D + PAD], bf16 (*vt)[D + PAD], unsigned* kp) {
    load_rows<D, N, THREADS>(k, b, s.kv_seq, s.kv_heads, g, j, kt);
    load_rows<D, N, THREADS>(v, b, s.kv_seq, s.kv_heads, g, j, vt);
    load_key_positions<N>(k_pos, j, s.kv_seq, kp);
}

// The order blocks run in. A GPU starts a grid's blocks in the order of their linear index (x
// fastest, then y, then z) as slots free up, so the grid puts heads in x, the batch in y and the
// tiles in z, the heaviest tiles at z = 0: every head's heaviest blocks start first and the
// grid ends on short ones (longest-first list scheduling; tests/attention_balance.rs plays it on
// an H100's 132 SMs). Under causal order the last queries see the most keys (the forward's and
// dq's blocks walk the tiles in reverse), and the first keys are seen by the most queries (dk/dv's
// in order).
__device__ __forceinline__ int query_block_start() { return (gridDim.z - 1 - blockIdx.z) * BM; }

// ---- forward ----------------------------------------------------------------------------------
// The walk, a tile ahead: K and V tiles are double-buffered, and the copies of the next tile run
// during this tile's products and softmax. The wait for a tile comes at the top of its turn, a
// whole turn after its copies were issued. (With V copied during S and waited for before P·V,
// ptxas hoisted that wait and its barrier above the softmax: the copy had only S to hide behind.)

template <int D>
struct ForwardTiles {
    static constexpr int BN = D <= 64 ? 64 : 32;           // key rows a tile
    static constexpr int ROWS = 2 * BN > BM ? 2 * BN : BM; // rows of each of ks, vs: two tiles, or Q's staging
    // Q is staged in vs's last BM rows; where tile 0 lies apart from them, the two loads run together
    static constexpr bool Q_APART = BN + BM <= ROWS;
    static constexpr int BLOCKS = D <= 64 ? 4 : 2; // resident blocks an SM (__launch_bounds__): ≤ 128 registers at D ≤ 64
};

template <int D>
__device__ void forward(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                        const unsigned* k_pos, bf16* out, float* lse) {
    constexpr int BN = ForwardTiles<D>::BN, ROWS = ForwardTiles<D>::ROWS;
    __shared__ __align__(16) bf16 ks[ROWS][D + PAD], vs[ROWS][D + PAD]; // tile u at rows u·BN..
    __shared__ unsigned kp[2][BN];
    int b = blockIdx.y, h = blockIdx.x, g = h / (s.heads / s.kv_heads), i0 = query_block_start();
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = i0 + 16 * w;
    // The block's last query position (a tile with no key at or before it is skipped) and each
    // warp's first (a tile of keys all at or before it needs no mask) wait in shared memory, read
    // once a tile: this keeps the walk within 128 registers (4 blocks an SM).
    __shared__ unsigned last, first_of_warp[WARPS];
    unsigned pi[2], block_last = extreme_position(q_pos, i0, BM, s.seq, false);
    unsigned warp_first = extreme_position(q_pos, r0, 16, s.seq, true);
    if (threadIdx.x == 0) last = block_last;
    if (threadIdx.x % 32 == 0) first_of_warp[w] = warp_first;
    for (int half = 0; half < 2; half++) pi[half] = r0 + row + 8 * half < s.seq ? q_pos[r0 + row + 8 * half] : 0;
    int j0 = next_tile<BN>(k_pos, 0, s.kv_seq, block_last, false), buf = 0;
    load_rows<D, BM, THREADS>(q, b, s.seq, s.heads, h, i0, &vs[ROWS - BM]);
    if (ForwardTiles<D>::Q_APART && j0 < s.kv_seq) load_kv_tile<D, BN>(s, k, v, k_pos, b, g, j0, &ks[0], &vs[0], kp[0]); // beside Q
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[D / 16][4];
    load_a<D>(qf, &vs[ROWS - BM + 16 * w]);
    __syncthreads(); // every warp has its Q before a tile overwrites it
    if (!ForwardTiles<D>::Q_APART && j0 < s.kv_seq) load_kv_tile<D, BN>(s, k, v, k_pos, b, g, j0, &ks[0], &vs[0], kp[0]);
    cp_async_commit();
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; // m in log2 units
    float scale = rsqrtf((float)D) * LOG2E;
    while (j0 < s.kv_seq) {
        int next = next_tile<BN>(k_pos, j0 + BN, s.kv_seq, last, false);
        if (next < s.kv_seq) // into the other buffer, read last by the previous tile (barrier below)
            load_kv_tile<D, BN>(s, k, v, k_pos, b, g, next, &ks[(buf ^ 1) * BN], &vs[(buf ^ 1) * BN], kp[buf ^ 1]);
        cp_async_commit(); // (an empty group when there is no next tile: the count stays the same)
        cp_async_wait<1>(); // this tile has landed; the next may still be in flight
        __syncthreads();    // ... for every thread's copies
        float sc[BN / 8][4];
        times_transposed<D, BN>(sc, qf, &ks[buf * BN]);
        if (extreme_position(kp[buf], 0, BN, BN, false) > first_of_warp[w]) // a tile across the diagonal: mask
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) // a later or padding key → −∞
                    if (kp[buf][8 * n + 2 * t + e % 2] > pi[e / 2]) sc[n][e] = -INFINITY;
        float top[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) top[e / 2] = fmaxf(top[e / 2], sc[n][e]);
        for (int half = 0; half < 2; half++) {
            for (int x = 1; x <= 2; x <<= 1) top[half] = fmaxf(top[half], __shfl_xor_sync(0xffffffff, top[half], x));
            float m_new = fmaxf(m[half], top[half] * scale);
            float base = m_new == -INFINITY ? 0.0f : m_new; // a row with no visible key yet: exp2(−∞) = 0
            float correction = fast_exp2(m[half] - base);
            l[half] *= correction; // this lane's part of the row sum; the group's parts are added at the end
#pragma unroll
            for (int n = 0; n < D / 8; n++) o[n][2 * half] *= correction, o[n][2 * half + 1] *= correction;
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; e++) {
                    sc[n][e] = fast_exp2(fmaf(sc[n][e], scale, -base));
                    l[half] += sc[n][e];
                }
            m[half] = m_new;
        }
        accumulate<D, BN>(o, sc, &vs[buf * BN]);
        __syncthreads(); // every warp is done with this tile before the turn after next overwrites it
        j0 = next, buf ^= 1;
    }
    cp_async_wait<0>();
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
// 32, ptxas spills). K and V tiles are double-buffered: the next tile's copies run during this
// tile's four products. Q and dO are staged through the buffers first.

template <int D>
struct DqTiles {
    static constexpr int KN = D <= 64 ? 64 : 16;                  // key rows a tile
    static constexpr int ROWS = 2 * KN > BM ? 2 * KN : BM; // rows of each of ks, vs: two tiles, or Q's staging
    static constexpr int BLOCKS = 3;                       // resident blocks an SM: ≤ 168 registers
};

template <int D>
__device__ void dq(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                   const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dq_) {
    constexpr int KN = DqTiles<D>::KN, ROWS = DqTiles<D>::ROWS;
    __shared__ __align__(16) bf16 ks[ROWS][D + PAD], vs[ROWS][D + PAD]; // tile u at rows u·KN..
    __shared__ unsigned kp[2][KN];
    int b = blockIdx.y, h = blockIdx.x, g = h / (s.heads / s.kv_heads), i0 = query_block_start();
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = i0 + 16 * w;
    unsigned last = extreme_position(q_pos, i0, BM, s.seq, false), pi[2];
    unsigned first_of_warp = extreme_position(q_pos, r0, 16, s.seq, true);
    float ls[2], dl[2], scale = rsqrtf((float)D) * LOG2E;
    for (int half = 0; half < 2; half++) {
        int i = r0 + row + 8 * half;
        bool in = i < s.seq;
        long at_i = ((long)b * s.heads + h) * s.seq + i;
        pi[half] = in ? q_pos[i] : 0;
        ls[half] = in ? lse[at_i] * LOG2E : 0.0f;
        dl[half] = in ? delta[at_i] : 0.0f;
    }
    load_rows<D, BM, THREADS>(q, b, s.seq, s.heads, h, i0, ks);
    load_rows<D, BM, THREADS>(dout, b, s.seq, s.heads, h, i0, vs);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[D / 16][4], dof[D / 16][4];
    load_a<D>(qf, &ks[16 * w]);
    load_a<D>(dof, &vs[16 * w]);
    __syncthreads(); // every warp has its Q and dO before the first tile overwrites them
    int j0 = next_tile<KN>(k_pos, 0, s.kv_seq, last, false), buf = 0;
    if (j0 < s.kv_seq) load_kv_tile<D, KN>(s, k, v, k_pos, b, g, j0, &ks[0], &vs[0], kp[0]);
    cp_async_commit();
    float acc[D / 8][4] = {};
    while (j0 < s.kv_seq) {
        int next = next_tile<KN>(k_pos, j0 + KN, s.kv_seq, last, false);
        if (next < s.kv_seq) // into the other buffer, read last by the previous tile (barrier below)
            load_kv_tile<D, KN>(s, k, v, k_pos, b, g, next, &ks[(buf ^ 1) * KN], &vs[(buf ^ 1) * KN], kp[buf ^ 1]);
        cp_async_commit();
        cp_async_wait<1>(); // this tile has landed; the next may still be in flight
        __syncthreads();
        float sc[KN / 8][4], dp[KN / 8][4];
        times_transposed<D, KN>(sc, qf, &ks[buf * KN]);
        times_transposed<D, KN>(dp, dof, &vs[buf * KN]);
        if (extreme_position(kp[buf], 0, KN, KN, false) <= first_of_warp) { // every key visible to every row
#pragma unroll
            for (int n = 0; n < KN / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    sc[n][e] = fast_exp2(fmaf(sc[n][e], scale, -ls[e / 2])) * (dp[n][e] - dl[e / 2]);
        } else { // ds = p (dp − δ), 0 where masked (a row with no visible key has lse = −∞)
#pragma unroll
            for (int n = 0; n < KN / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    bool seen = kp[buf][8 * n + 2 * t + e % 2] <= pi[e / 2];
                    sc[n][e] = seen ? fast_exp2(fmaf(sc[n][e], scale, -ls[e / 2])) * (dp[n][e] - dl[e / 2]) : 0.0f;
                }
        }
        accumulate<D, KN>(acc, sc, &ks[buf * KN]);
        __syncthreads(); // every warp is done with this tile before the one after next overwrites it
        j0 = next, buf ^= 1;
    }
    cp_async_wait<0>();
    float factor[2] = {rsqrtf((float)D), rsqrtf((float)D)};
    write_rows<D>(s, acc, factor, dq_, b, s.seq, s.heads, h, r0);
}

// ---- backward: dk and dv, a block per KEYS key rows of one KV head ------------------------------
// The block walks every query head of its group, each over the query tiles that see its keys. One
// Q and dO tile at a time, waited for before its products: double-buffered 32-query tiles (the
// copies of the next during this one's products, as the forward does) measured slower on an H100
// than these 64-query tiles alone (0.375 against 0.311 ms at smollm-135m, same call): twice the
// barriers and per-tile work for half the products, and 12 warps an SM hide much of the wait.

template <int D>
struct KeyTiles {
    static constexpr int KEYS = D <= 64 ? 64 : 32;    // key rows a block (16 a warp)
    static constexpr int QUERIES = D <= 64 ? 64 : 32; // query rows a tile
    static constexpr int NT = KEYS * 2;               // threads a block: a warp per 16 keys
    static constexpr int BLOCKS = D <= 64 ? 3 : 4;    // resident blocks an SM: ≤ 168 registers at D ≤ 64
};

template <int D>
__device__ void dkdv(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                     const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout, bf16* dk, bf16* dv) {
    constexpr int KEYS = KeyTiles<D>::KEYS, QUERIES = KeyTiles<D>::QUERIES, NT = KeyTiles<D>::NT;
    __shared__ __align__(16) bf16 ks[KEYS][D + PAD], vs[KEYS][D + PAD], qs[QUERIES][D + PAD], dos[QUERIES][D + PAD];
    __shared__ unsigned qp[QUERIES];
    __shared__ float ls[QUERIES], dl[QUERIES];
    int b = blockIdx.y, g = blockIdx.x, groups = s.heads / s.kv_heads, j0 = blockIdx.z * KEYS;
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = j0 + 16 * w;
    unsigned first = extreme_position(k_pos, j0, KEYS, s.kv_seq, true), pj[2];
    unsigned last_of_warp = extreme_position(k_pos, r0, 16, s.kv_seq, false); // a tile of queries all ≥ it: no mask
    for (int half = 0; half < 2; half++) pj[half] = r0 + row + 8 * half < s.kv_seq ? k_pos[r0 + row + 8 * half] : NO_KEY;
    float scale = rsqrtf((float)D) * LOG2E;
    load_rows<D, KEYS, NT>(k, b, s.kv_seq, s.kv_heads, g, j0, ks);
    load_rows<D, KEYS, NT>(v, b, s.kv_seq, s.kv_heads, g, j0, vs);
    cp_async_commit();
    float dka[D / 8][4] = {}, dva[D / 8][4] = {};
    // the first query tile that sees these keys: the same for every head (positions are per sequence)
    int first_tile = next_tile<QUERIES>(q_pos, 0, s.seq, first, true);
    for (int h = g * groups; h < (g + 1) * groups; h++) {
        for (int i0 = first_tile; i0 < s.seq;
             i0 = next_tile<QUERIES>(q_pos, i0 + QUERIES, s.seq, first, true)) {
            __syncthreads(); // every warp is done with the previous tile
            load_rows<D, QUERIES, NT>(q, b, s.seq, s.heads, h, i0, qs);
            load_rows<D, QUERIES, NT>(dout, b, s.seq, s.heads, h, i0, dos);
            cp_async_commit();
            stage_query_rows(s, q_pos, lse, delta, b, h, i0, QUERIES, LOG2E, qp, ls, dl); // lse in log2 units
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
            // pᵀ, and dsᵀ = pᵀ (dpᵀ − δ) in dpt; rows past the end have lse = +∞, so p = 0
            if (extreme_position(qp, 0, QUERIES, QUERIES, true) >= last_of_warp) { // every query sees every key
#pragma unroll
                for (int n = 0; n < QUERIES / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int c = 8 * n + 2 * t + e % 2;
                        st[n][e] = fast_exp2(fmaf(st[n][e], scale, -ls[c]));
                        dpt[n][e] = st[n][e] * (dpt[n][e] - dl[c]);
                    }
            } else {
#pragma unroll
                for (int n = 0; n < QUERIES / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int c = 8 * n + 2 * t + e % 2;
                        st[n][e] = pj[e / 2] <= qp[c] ? fast_exp2(fmaf(st[n][e], scale, -ls[c])) : 0.0f;
                        dpt[n][e] = st[n][e] * (dpt[n][e] - dl[c]);
                    }
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
    extern "C" __global__ void __launch_bounds__(THREADS, ForwardTiles<D>::BLOCKS) flash_attention_forward_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,      \
                                                            const unsigned* q_pos, const unsigned* k_pos, bf16* out,   \
                                                            float* lse) {                                              \
        forward<D>(s, q, k, v, q_pos, k_pos, out, lse);                                                                \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, DqTiles<D>::BLOCKS) flash_attention_dq_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,           \
                                                       const unsigned* q_pos, const unsigned* k_pos, const float* lse, \
                                                       const float* delta, const bf16* dout, bf16* dq_) {              \
        dq<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq_);                                                        \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(KeyTiles<D>::NT, KeyTiles<D>::BLOCKS) flash_attention_dkdv_d##D(Shape s, const bf16* q, const bf16* k, const bf16* v,         \
                                                         const unsigned* q_pos, const unsigned* k_pos,                 \
                                                         const float* lse, const float* delta, const bf16* dout,       \
                                                         bf16* dk, bf16* dv) {                                         \
        dkdv<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dk, dv);                                                   \
    }
EXPORT(16)
EXPORT(32)
EXPORT(64)
EXPORT(128)
