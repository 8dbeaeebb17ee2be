// flash_attention.cu — causal grouped-query attention, FlashAttention-2 style, on tensor cores (bf16).
//
// The math is attention.cu's (which stays the readable version and the f32 path):
//   s_ij = q_i·k_j / √D where key position ≤ query position,   p_ij = exp(s_ij − lse_i),
//   o_i = Σ_j p_ij v_j;   backward: dp_ij = do_i·v_j,  ds_ij = p_ij (dp_ij − δ_i),  δ_i = do_i·o_i,
//   dq_i = Σ_j ds_ij k_j / √D,  dk_j = Σ_i ds_ij q_i / √D,  dv_j = Σ_i p_ij do_i.
// The same outputs (o, lse; dq, dk, dv, the backward's through fp32 parts in scratch memory) and
// positions per row, so that a ring or zigzag context-parallel block is the same kernel; a row
// that sees no key gets o = 0 and lse = −∞ (and dq = 0).
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
// The forward splits the work by query rows (a block: 64 queries of one head, 4 warps); the
// backward by key rows (a block: a tile of keys at a time, for one query head) and makes dq, dk
// and dv in one pass, FlashAttention-2's five products (S, dP, dV, dK, dQ) instead of seven (a
// separate dq kernel would make S and dP again). It computes the transposed products Sᵀ = K·Qᵀ
// and dPᵀ = V·dOᵀ, so that Pᵀ and dSᵀ are A operands for dV += Pᵀ·dO and dK += dSᵀ·Q. No atomics
// decide an order: every sum runs in a fixed order, the results are the same bits every run (the
// pieces of dq and of a GQA group's dk, dv are added by flash_attention_sum_parts; below). δ
// comes from attention.cu's attention_delta, run first.
//
// D (16, 32, 64, 128) is a template parameter, so fragment arrays are indexed by constants and
// stay in registers (tests/kernels_compile.rs checks: no spills). Shared memory sets the tiles
// (ForwardTiles, KeyTiles below). A static `__shared__` array may take at most 48 KiB a block;
// past that, memory must be dynamic (`extern __shared__`, DYNAMIC_SHARED here): its size is given
// at each launch, and a function must opt in to more than 48 KiB before its first launch (the
// attribute CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, up to 227 KiB on an H100). The
// forward keeps its K and V tiles there (72 KiB at D 64, 68 KiB at D 128: tiles of twice the keys
// static memory allowed, which halves what each product pays of a tile's other costs; below).
//
// How fast, and why: four things a tensor-core kernel is tuned by, with this kernel's numbers
// (one H100, smollm-135m's shapes: batch 8, 2048 tokens, 9 heads, 3 KV heads, D 64; forward +
// backward a layer; `ferrotron bench --op attention`; BENCHMARKS.md has the rest).
//  1. Issue slots. A scheduler (4 an SM) issues one instruction a clock; one mma.sync keeps its
//     tensor core busy about 4–6 clocks. Past about 6 instructions per HMMA, the issue slots set
//     the speed. The first version issued 15 (forward), 10 (dq) and 11 (dk/dv) per HMMA: 42
//     instructions of 64-bit address math per 16-byte copy, exp2f without fast math (4 a value),
//     the position mask on every score. Now each copy and ldmatrix is one base address a tile plus
//     a compile-time offset (load_rows, load_a; one global offset serves the two tensors a tile
//     copies, and shared addresses come from the compiler's own conversion, smem), exponentials
//     are one MUFU.EX2 (fast_exp2), and only a tile across the diagonal is masked: the forward
//     walks its clear tiles in one loop and the tiles across the diagonal in a second
//     (next_key_tile), so the loop nearly every tile runs has no mask in it, not even a branch
//     around one (the backward masks behind a warp-uniform branch). Which tile comes next is
//     arithmetic where positions are consecutive (a range found once a block: key_range,
//     next_query_tile), and a scan of the positions only where they are not (zigzag's). What a
//     tile costs besides its products (finding the next tile, its copies and positions, the
//     barriers, each row's maximum and rescaling) is paid once for however many keys the tile
//     holds: with its tiles in dynamic shared memory the forward takes 128 keys a tile at D ≤ 64
//     and 64 at D 128, where static memory's 48 KiB allowed 64 and 32. Per HMMA at D 64 and 128
//     (tests/kernels_sass.rs, counting the scan too): forward 9.8 and 8.5 → 5.8 and 5.0 (its
//     loop across the diagonal 7.3 and 5.8; a turn that takes the range skips 46 of the 744 at
//     D 64: 5.5); the one-pass backward 5.9 and 6.0 (the dq and dk/dv kernels it replaced: 7.8
//     and 7.4 at D 64).
//  2. Occupancy. Latency (a global load: about 1 µs) is hidden by other warps; with 8 warps an SM
//     (2 a scheduler) a stalled scheduler often has nothing else to issue. __launch_bounds__ asked
//     ptxas for 128 registers a thread in the forward (16 warps an SM): alone that took the layer
//     from 1.020 to 0.911 ms. Its 128-key tiles (below) trade some of that back: 168 registers
//     and 74 KiB of shared memory a block leave 3 blocks (12 warps) an SM, for a quarter fewer
//     instructions a product (the SASS estimate at D 64: 10.2 clocks per HMMA, against about
//     11.4 for 64-key tiles at 16 warps, which spill at 128 registers; not yet timed on a GPU,
//     which decides; ForwardTiles holds both numbers). The backward holds dK and dV (64
//     registers at D 64) besides a tile's Pᵀ: at 168 registers (12 warps) ptxas spilled three
//     values in the loop, so it runs at 2 blocks (8 warps) with about 210.
//  3. Overlap. The forward's loop issues the next tile's copies, then waits for this tile's
//     (issued a whole turn earlier: `cp.async.wait_group 1`), then computes: copies and products
//     run at once, for a second buffer of shared memory. The backward has no room for a second
//     Q/dO buffer, so it issues the next tile's copies as soon as this tile's last read of Q and
//     dO is done, and dQ's products (a fifth of the tile's) run while they fly.
//  4. Balance. A grid's blocks start in index order as slots free up; under causal order blocks
//     differ up to 32× in work, so the forward puts the heaviest tiles first (query_block_start),
//     and the backward deals its key tiles to splits like a snake, so that each split's walk is
//     about as long (tests/attention_balance.rs plays both launches on 132 SMs).
// With the dq and dk/dv kernels, and an 8-threads-a-row δ (0.108 → 0.018 ms), these took the layer
// from 1.528 to 0.754 ms on the H100 (PyTorch's FlashAttention-2: 0.766, cuDNN: 0.479); the
// one-pass backward has not run on a GPU yet. What only a GPU can say is how these trade against
// each other (the backward's splits trade balance for fp32 dQ copies to zero and add: at
// smollm-135m, 3 of 37.7 MB each a layer); what the SASS says without one is where the issue
// slots, the registers and the waits go (and an estimate of scheduler clocks per HMMA from them:
// 10.2 for the forward, 13.7 for the backward at D 64, against FlashAttention-2's measured 17),
// and what the emulator says is what the addresses cost: 4 bank wavefronts an ldmatrix (PAD),
// 16 sectors a warp's 512 bytes of copies, and products in flight during each copy group
// (FERROTRON_EMULATOR_COSTS=1; kernels/README.md). Those hold them between measurements.

typedef __nv_bfloat16 bf16;
#define WARPS 4
#define THREADS (32 * WARPS) // a block of the forward
#define BM (16 * WARPS)      // query rows a block of the forward
#define PAD 8                // bf16 added to each shared row
#define LOG2E 1.4426950408889634f
#define NO_KEY 0xffffffffu // the position of a padding key: no query sees it

// ---- the PTX instructions (on the CPU emulator: tests/emulator/warp_ptx.h) -------------------
#ifdef FERROTRON_EMULATOR
#include "warp_ptx.h"
#else
// A shared-memory address: the 32-bit offset in the block's shared window. Made once per tile
// from a generic pointer; each copy and ldmatrix then adds a compile-time offset, which the
// instruction carries as an immediate: no address arithmetic in the hot loop. The conversion is
// the compiler's intrinsic, not an inline cvta.to.shared: it sees that the pointer came from a
// shared array and folds the conversion away, where the asm made it build the 64-bit generic
// address first (the window's base from two special registers) at every tile.
typedef unsigned smem_t;
__device__ __forceinline__ smem_t smem(const void* p) { return (smem_t)__cvta_generic_to_shared(p); }
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
// *p += v, done by the memory system (L2): the thread issues it and goes on, waiting for no value.
// Two of one thread to one address land in the order issued (the same-address order of the PTX
// memory model), so a sum made only by one thread's adds comes out the same every run.
__device__ __forceinline__ void red_add(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
// The block's dynamic shared memory: sized by the launch (cuLaunchKernel's sharedMemBytes), past
// 48 KiB only for a kernel whose CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES allows it (set
// when the kernels load: cuda/device.rs). The size a launch gave: %dynamic_smem_size.
#define DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
__device__ __forceinline__ unsigned dynamic_shared_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
#endif

// ---- helpers shared by the forward and the backward --------------------------------------------------------

// Scores are scaled by log2(e)/√D, so that exp(s/√D − ·) is one exp2: a compile-time constant
// (an immediate in the multiply, no register).
template <int D>
__device__ __forceinline__ constexpr float log2e_over_sqrt() {
    static_assert(D == 16 || D == 32 || D == 64 || D == 128, "a tensor-core head size");
    return LOG2E / (D == 16 ? 4.0f : D == 32 ? 5.656854249f : D == 64 ? 8.0f : 11.3137085f);
}

// Two floats as the bf16 pair of one operand register (the first in the low half).
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16(lo)) |
           (unsigned)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16;
}

// Starts copying rows r0..r0+N of head `head` of each x[k] [batch*len, heads*D] (tensors of the
// same layout: K and V, or Q and dO) into t[k] (zeros past len), 16 bytes per cp.async by each of
// the block's NT threads; the caller commits and waits. A thread copies the same 16-byte column of
// rows NT/(D/8) apart, so its addresses are one global offset and one shared base plus
// compile-time steps: the 64-bit address math runs once a tile (for all T tensors), not once a copy.
template <int D, int N, int NT, int T>
__device__ __forceinline__ void load_rows(const bf16* const (&x)[T], int b, int len, int n_heads, int head, int r0,
                                          bf16 (*const (&t)[T])[D + PAD]) {
    constexpr int CHUNKS = D / 8, STEP = NT / CHUNKS; // 16-byte pieces a row; rows between a thread's copies
    constexpr int COPIES = N < STEP ? 1 : N / STEP; // a thread's copies (threads past row N have none)
    static_assert(NT % CHUNKS == 0 && (N % STEP == 0 || STEP % N == 0), "the block's threads tile the rows exactly");
    int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS * 8;
    if (N < STEP && r >= N) return;
    long step = (long)STEP * n_heads * D; // elements between a thread's rows
    long at = ((long)b * len + r0 + r) * n_heads * D + (long)head * D + c;
    if (r0 + N <= len) { // every row exists (all tiles but a sequence's last): no test, no select
#pragma unroll
        for (int k = 0; k < T; k++)
#pragma unroll
            for (int i = 0; i < COPIES; i++) cp_async_16(smem(&t[k][r][c]) + i * STEP * (D + PAD) * 2, x[k] + at + i * step, true);
    } else { // a sequence's last tile, once a walk: a loop kept rolled (fewer instructions in the loop around it)
#pragma unroll 1
        for (int i = 0; i < COPIES; i++) {
            bool in = r0 + r + i * STEP < len;
#pragma unroll
            for (int k = 0; k < T; k++) // padding: an address inside x[k]
                cp_async_16(smem(&t[k][r][c]) + i * STEP * (D + PAD) * 2, in ? x[k] + at + i * step : x[k], in);
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

// acc (16 × C, as C/8 fragments) += A · B for one 16-wide slice of the inner dimension: a the A
// fragment (16 × 16), B's 16 rows × C columns at `b` (a shared address: this lane's row of the
// slice, as `b_lane` gives it), read transposed by ldmatrix.trans.
template <int C>
__device__ __forceinline__ void add_product(float (*acc)[4], const unsigned* a, smem_t b) {
#pragma unroll
    for (int np = 0; np < C / 16; np++) {
        unsigned f[4];
        ldmatrix_x4_trans(f, b + 16 * np * 2);
        mma_16x8x16(acc[2 * np], a, &f[0]);
        mma_16x8x16(acc[2 * np + 1], a, &f[2]);
    }
}

// This lane's row address in a tile of rows W wide, for `add_product`'s B.
template <int W>
__device__ __forceinline__ smem_t b_lane(const bf16 (*rows)[W + PAD]) {
    int lane = threadIdx.x % 32;
    return smem(&rows[lane / 8 % 2 * 8 + lane % 8][lane / 16 * 8]);
}

// acc (16 × D, as D/8 fragments) += P · B, P (16 × N) the fp32 fragments p (C layout, cast to bf16
// A operands two tiles at a time), B the N rows × D at `rows`.
template <int D, int N>
__device__ __forceinline__ void accumulate(float (*acc)[4], const float (*p)[4], const bf16 (*rows)[D + PAD]) {
    smem_t base = b_lane<D>(rows);
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        const float *lo = p[2 * kk], *hi = p[2 * kk + 1];
        unsigned a[4] = {pack(lo[0], lo[1]), pack(lo[2], lo[3]), pack(hi[0], hi[1]), pack(hi[2], hi[3])};
        add_product<D>(acc, a, base + 16 * kk * (D + PAD) * 2);
    }
}

// Two adjacent values of a row, as one store: bf16 (the outputs) or fp32 (the backward's parts).
__device__ __forceinline__ void store_pair(bf16* p, float a, float b) { *(unsigned*)p = pack(a, b); }
__device__ __forceinline__ void store_pair(float* p, float a, float b) { *(float2*)p = {a, b}; }

// Writes rows r0 + g and r0 + g + 8 (those below len) of the 16 × D fragments acc × factor to y.
template <int D, typename T>
__device__ void write_rows(const Shape& s, const float (*acc)[4], const float* factor, T* y, int b, int len,
                           int n_heads, int head, int r0) {
    int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int r = r0 + g + 8 * half;
        if (r >= len) continue;
        T* row = y + at(s, b, len, r, n_heads, head) + 2 * t;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            store_pair(row + 8 * n, acc[n][2 * half] * factor[half], acc[n][2 * half + 1] * factor[half]);
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

// The first tile of N query rows at or after r0 (len if none) holding a query that sees the
// block's keys: one with position ≥ bound, the block's first key position (the backward's walk;
// the forward has next_key_tile, below). Queries at consecutive positions q0, q0 + 1, … (one
// sequence, or a ring block's; `consecutive` and q0, found once per block) make it arithmetic:
// the tile of row bound − q0, and every tile after it. Other positions (zigzag's) are read, a
// tile at a time.
template <int N>
__device__ int next_query_tile(const unsigned* pos, int r0, int len, unsigned bound, bool consecutive, unsigned q0) {
    if (consecutive) {
        int row = (int)(bound - q0); // the first query that sees the keys (positions < 2^31 apart)
        return min(max(r0, row > 0 ? row / N * N : 0), len);
    }
    int lane = threadIdx.x % 32;
    for (; r0 < len; r0 += N) {
        bool seen = false;
#pragma unroll
        for (int k = 0; k < (N + 31) / 32; k++) {
            int r = r0 + lane + 32 * k;
            if (lane + 32 * k < N && r < len) seen |= pos[r] >= bound;
        }
        if (__any_sync(0xffffffff, seen)) return r0;
    }
    return len;
}

// Whether pos[0..len) are consecutive, pos[0] + r at row r (none: not), for the whole block (one
// barrier).
template <int NT>
__device__ bool consecutive_positions(const unsigned* pos, int len) {
    __shared__ bool gap_of_warp[NT / 32];
    bool gap = len == 0;
    for (int r = threadIdx.x; r < len; r += NT) gap |= pos[r] != pos[0] + r;
    gap = __any_sync(0xffffffff, gap);
    if (threadIdx.x % 32 == 0) gap_of_warp[threadIdx.x / 32] = gap;
    __syncthreads();
    bool consecutive = true;
    for (int u = 0; u < NT / 32; u++) consecutive &= !gap_of_warp[u];
    return consecutive;
}

// The positions of key rows j0..j0+N into kp (NO_KEY past the end); plain stores, seen after the
// next __syncthreads.
template <int N>
__device__ void load_key_positions(const unsigned* k_pos, int j0, int kv_seq, unsigned* kp) {
    for (int e = threadIdx.x; e < N; e += blockDim.x) kp[e] = j0 + e < kv_seq ? k_pos[j0 + e] : NO_KEY;
}

// Starts copying the N key and value rows j.. of KV head g into kt and vt, and their positions
// into kp (the forward's next tile).
template <int D, int N>
__device__ __forceinline__ void load_kv_tile(const Shape& s, const bf16* k, const bf16* v, const unsigned* k_pos, int b,
                                             int g, int j, bf16 (*kt)[D + PAD], bf16 (*vt)[D + PAD], unsigned* kp) {
    load_rows<D, N, THREADS>({k, v}, b, s.kv_seq, s.kv_heads, g, j, {kt, vt});
    load_key_positions<N>(k_pos, j, s.kv_seq, kp);
}

// The order blocks run in. A GPU starts a grid's blocks in the order of their linear index (x
// fastest, then y, then z) as slots free up, so the grid puts heads in x, the batch in y and the
// tiles in z, the heaviest tiles at z = 0: every head's heaviest blocks start first and the
// grid ends on short ones (longest-first list scheduling; tests/attention_balance.rs plays it on
// an H100's 132 SMs). Under causal order the last queries see the most keys: the forward's blocks
// walk the tiles in reverse. (The backward's grid is (heads, batch, splits): see there.)
__device__ __forceinline__ int query_block_start() { return (gridDim.z - 1 - blockIdx.z) * BM; }

// ---- forward ----------------------------------------------------------------------------------
// The walk, a tile ahead: K and V tiles are double-buffered, and the copies of the next tile run
// during this tile's products and softmax. The wait for a tile comes at the top of its turn, a
// whole turn after its copies were issued. (With V copied during S and waited for before P·V,
// ptxas hoisted that wait and its barrier above the softmax: the copy had only S to hide behind.)

template <int D>
struct ForwardTiles {
    static constexpr int BN = D <= 64 ? 128 : 64; // key rows a tile
    static constexpr int ROWS = 2 * BN > BM ? 2 * BN : BM; // rows of each of ks, vs: two tiles, or Q's staging
    // Q is staged in vs's last BM rows; where tile 0 lies apart from them, the two loads run together
    static constexpr bool Q_APART = BN + BM <= ROWS;
    // resident blocks an SM (__launch_bounds__): at D ≤ 64, 3 (≤ 168 registers), as many as its
    // shared memory allows at D 64 (3 × 75 KiB of an H100's 228); at D ≤ 32, 4 blocks (128
    // registers) spill the two loops' scores. The way back to 16 warps at D 64: BN 64, BLOCKS 4
    // and launch_table/attention.rs's forward_shared to match (7.7 instructions per HMMA and a
    // 16-byte spill, against 5.8)
    static constexpr int BLOCKS = D <= 64 ? 3 : 2;
    // ks and vs, in dynamic shared memory: at D 128 they take 68 KiB, past the 48 KiB that static
    // arrays may (launch_table/attention.rs gives a launch these bytes; cuda/device.rs opts in)
    static constexpr unsigned SHARED = 2 * ROWS * (D + PAD) * sizeof(bf16);
};

// The forward's walk takes its key tiles in two phases: first the clear ones, which every query row
// of the block sees whole (every key exists and is at or before the block's first query position:
// no mask), then the ones across the diagonal, which some row sees (a key at or before the block's
// last position) but not every row all of (masked). Each phase is its own loop, so the clear
// tiles, nearly all of them, run a loop with no mask in it. Under causal order this is the keys'
// own order, and so it stays for a ring or zigzag block's keys; keys out of position order may be
// walked out of their order (only the sum's rounding can change).
//
// Which tile is which comes from the positions. Keys at consecutive positions k0, k0 + 1, … (one
// sequence, or a ring block's) make the walk a range, computed once per block (key_range):
// tiles [0, clear) clear, [clear, seen) across. Other positions (zigzag's two chunks, any order)
// are read: next_key_tile scans them a tile at a time.
struct KeyWalk {
    unsigned first, last; // the block's first and last query positions
    int clear, seen;      // the range (seen < 0: the keys' positions are not consecutive)
};

// The range of keys at consecutive positions k0, k0 + 1, …: tile t (a multiple of N) is clear if
// its N keys exist and the last, k0 + t + N − 1, is at most `first`; seen if t < len and k0 + t ≤
// last.
template <int N>
__device__ void key_range(KeyWalk& walk, unsigned k0, int len) {
    long long clear_keys = (long long)walk.first - k0 + 1, seen_keys = (long long)walk.last - k0 + 1;
    walk.clear = (int)min(clear_keys > 0 ? clear_keys / N : 0, (long long)(len / N)) * N;
    walk.seen = (int)min(seen_keys > 0 ? (seen_keys + N - 1) / N : 0, (long long)((len + N - 1) / N)) * N;
}

// The first tile of N keys at or after r0 that the walk's phase (`across`) takes (len if none).
// Scanning, the clear phase notes the first tile across the diagonal that it passes (`diagonal`),
// and when no clear tile is left it turns back to that one: `across` becomes true, and stays.
template <int N>
__device__ int next_key_tile(const unsigned* pos, int r0, int len, const KeyWalk& walk, bool& across, int& diagonal) {
    if (walk.seen >= 0) { // consecutive keys: the range (clear ≤ seen)
        int next = across || r0 < walk.clear ? r0 : walk.clear;
        across |= next >= walk.clear;
        return next < walk.seen ? next : len;
    }
    int lane = threadIdx.x % 32;
    for (; r0 < len; r0 += N) {
        bool seen = false, clear = true;
#pragma unroll
        for (int k = 0; k < (N + 31) / 32; k++) {
            int r = r0 + lane + 32 * k;
            unsigned p = r < len ? pos[r] : NO_KEY; // a padding key: masked
            seen |= p <= walk.last, clear &= p <= walk.first;
        }
        bool whole = !__any_sync(0xffffffff, !clear); // (whole implies seen: first ≤ last)
        if (!across && whole) return r0;
        if (!whole && __any_sync(0xffffffff, seen)) {
            if (across) return r0;
            diagonal = min(diagonal, r0);
        }
    }
    if (across || diagonal == len) return len;
    across = true;
    return diagonal;
}

// What a warp holds over the walk for its 16 query rows: Q's fragments, each row's position, and
// the online softmax's m (the largest score so far, in log2 units), l (this lane's part of the row
// sum; the group's parts are added at the end) and O.
template <int D>
struct ForwardRows {
    unsigned qf[D / 16][4], pi[2];
    float o[D / 8][4], m[2], l[2];
};

// One turn of the walk: the next tile's copies go out, tile j0 (in buffer buf) lands, and its
// scores update the rows; ACROSS for a tile across the diagonal, which is masked. Returns the next
// tile (and leaves `across` telling its phase).
template <int D, bool ACROSS>
__device__ __forceinline__ int forward_turn(const Shape& s, const bf16* k, const bf16* v, const unsigned* k_pos, int b,
                                            int g, int j0, int& buf, bf16 (*ks)[D + PAD], bf16 (*vs)[D + PAD],
                                            unsigned (*kp)[ForwardTiles<D>::BN], const KeyWalk& walk, bool& across,
                                            int& diagonal, ForwardRows<D>& r) {
    constexpr int BN = ForwardTiles<D>::BN;
    constexpr float scale = log2e_over_sqrt<D>();
    int t = threadIdx.x % 4;
    int next = next_key_tile<BN>(k_pos, j0 + BN, s.kv_seq, walk, across, diagonal);
    if (next < s.kv_seq) // into the other buffer, read last by the previous tile (barrier below)
        load_kv_tile<D, BN>(s, k, v, k_pos, b, g, next, &ks[(buf ^ 1) * BN], &vs[(buf ^ 1) * BN], kp[buf ^ 1]);
    cp_async_commit(); // (an empty group when there is no next tile: the count stays the same)
    cp_async_wait<1>(); // this tile has landed; the next may still be in flight
    __syncthreads();    // ... for every thread's copies
    float sc[BN / 8][4];
    times_transposed<D, BN>(sc, r.qf, &ks[buf * BN]);
    if (ACROSS)
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) // a later or padding key → −∞
                if (kp[buf][8 * n + 2 * t + e % 2] > r.pi[e / 2]) sc[n][e] = -INFINITY;
    float top[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) top[e / 2] = fmaxf(top[e / 2], sc[n][e]);
    for (int half = 0; half < 2; half++) {
        for (int x = 1; x <= 2; x <<= 1) top[half] = fmaxf(top[half], __shfl_xor_sync(0xffffffff, top[half], x));
        float m_new = fmaxf(r.m[half], top[half] * scale);
        float base = m_new == -INFINITY ? 0.0f : m_new; // a row with no visible key yet: exp2(−∞) = 0
        float correction = fast_exp2(r.m[half] - base);
        r.l[half] *= correction;
#pragma unroll
        for (int n = 0; n < D / 8; n++) r.o[n][2 * half] *= correction, r.o[n][2 * half + 1] *= correction;
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; e++) {
                sc[n][e] = fast_exp2(fmaf(sc[n][e], scale, -base));
                r.l[half] += sc[n][e];
            }
        r.m[half] = m_new;
    }
    accumulate<D, BN>(r.o, sc, &vs[buf * BN]);
    __syncthreads(); // every warp is done with this tile before the turn after next overwrites it
    buf ^= 1;
    return next;
}

template <int D>
__device__ void forward(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                        const unsigned* k_pos, bf16* out, float* lse) {
    constexpr int BN = ForwardTiles<D>::BN, ROWS = ForwardTiles<D>::ROWS;
    static_assert(BN % 32 == 0, "next_key_tile gives each lane whole keys of a tile");
    DYNAMIC_SHARED(window);
    if (dynamic_shared_bytes() < ForwardTiles<D>::SHARED) __trap(); // a launch that gave the tiles too little
    typedef bf16 Row[D + PAD];
    Row *ks = (Row*)window, *vs = ks + ROWS; // tile u at rows u·BN.. of each
    __shared__ unsigned kp[2][BN];
    int b = blockIdx.y, h = blockIdx.x, g = h / (s.heads / s.kv_heads), i0 = query_block_start();
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4, r0 = i0 + 16 * w;
    // What the walk knows of the positions waits in shared memory, read once a tile: this keeps
    // the walk within its registers (ForwardTiles::BLOCKS). The first tile is found by scanning;
    // while it is copied, the block looks for a gap in the keys' positions and makes its range
    // (or not) for the rest of the walk.
    __shared__ KeyWalk walk;
    KeyWalk scan = {extreme_position(q_pos, i0, BM, s.seq, true), extreme_position(q_pos, i0, BM, s.seq, false), 0, -1};
    ForwardRows<D> r = {{}, {}, {}, {-INFINITY, -INFINITY}, {0.0f, 0.0f}};
    bool across = false;     // the walk is past its clear tiles
    int diagonal = s.kv_seq; // the first tile across the diagonal
    int j0 = next_key_tile<BN>(k_pos, 0, s.kv_seq, scan, across, diagonal), buf = 0;
    load_rows<D, BM, THREADS>({q}, b, s.seq, s.heads, h, i0, {&vs[ROWS - BM]});
    if (ForwardTiles<D>::Q_APART && j0 < s.kv_seq) load_kv_tile<D, BN>(s, k, v, k_pos, b, g, j0, &ks[0], &vs[0], kp[0]); // beside Q
    cp_async_commit();
    bool consecutive = consecutive_positions<THREADS>(k_pos, s.kv_seq);
    if (threadIdx.x == 0) {
        walk = scan;
        if (consecutive) key_range<BN>(walk, k_pos[0], s.kv_seq);
    }
    cp_async_wait<0>();
    __syncthreads();
    load_a<D>(r.qf, &vs[ROWS - BM + 16 * w]);
    __syncthreads(); // every warp has its Q before a tile overwrites it
    if (!ForwardTiles<D>::Q_APART && j0 < s.kv_seq) load_kv_tile<D, BN>(s, k, v, k_pos, b, g, j0, &ks[0], &vs[0], kp[0]);
    cp_async_commit();
    // the two phases, each its own loop (`across` tells the phase of tile j0)
    while (j0 < s.kv_seq && !across)
        j0 = forward_turn<D, false>(s, k, v, k_pos, b, g, j0, buf, ks, vs, kp, walk, across, diagonal, r);
    // the rows' positions, for the mask: read here, they take no register in the clear tiles' loop
    for (int half = 0; half < 2; half++) r.pi[half] = r0 + row + 8 * half < s.seq ? q_pos[r0 + row + 8 * half] : 0;
    while (j0 < s.kv_seq)
        j0 = forward_turn<D, true>(s, k, v, k_pos, b, g, j0, buf, ks, vs, kp, walk, across, diagonal, r);
    cp_async_wait<0>();
    float inverse[2];
    for (int half = 0; half < 2; half++) {
        for (int x = 1; x <= 2; x <<= 1) r.l[half] += __shfl_xor_sync(0xffffffff, r.l[half], x);
        inverse[half] = r.l[half] > 0.0f ? 1.0f / r.l[half] : 0.0f;
        int i = r0 + row + 8 * half;
        if (t == 0 && i < s.seq)
            lse[((long)b * s.heads + h) * s.seq + i] = r.l[half] > 0.0f ? (r.m[half] + log2f(r.l[half])) / LOG2E : -INFINITY;
    }
    write_rows<D>(s, r.o, inverse, out, b, s.seq, s.heads, h, r0);
}

// ---- backward: dk, dv and dq in one pass (FlashAttention-2's 5 products) ---------------------
// A block per (query head, batch, split): it walks its split's key tiles, and for each the query
// tiles that see them, making the five products of a tile pair once: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
// (recomputed from lse: no score is kept from the forward), then dV += Pᵀ·dO, dK += dSᵀ·Q and
// dQ += dS·K. dK and dV of a key tile are finished when its walk ends; dQ of a query tile gets a
// piece from every key tile that it sees, and those live in other blocks. Adding them with atomics
// into one dQ would make the bits depend on which block came first, so (FlashAttention-2's
// deterministic mode) each split has its own fp32 copy of dQ (`dq_parts`): a block owns its rows
// of it, zeroes them, and adds its key tiles' pieces in its own order (a `red.add` of a thread
// lands after that thread's earlier ones to the same address); `flash_attention_sum_parts` then
// adds the splits in order. With GQA, heads of one group meet at the same K and V: each block
// writes its head's dK and dV (`dk_parts`, `dv_parts`, one per query head) and the same kernel
// adds the group's heads in order. The splits divide the key tiles like a snake (0, 2s−1, 2s,
// 4s−1, … for split 0 of s), so that heavy first tiles and light last ones pair up; the launch
// table picks s for an H100's 132 SMs (tests/attention_balance.rs). dS goes from registers
// (where it is dSᵀ: rows are keys) through shared memory, read back transposed as dQ's A operand.

template <int D>
struct KeyTiles {
    static constexpr int KEYS = D <= 64 ? 64 : 32;       // key rows a tile (16 a warp)
    static constexpr int QUERIES = KEYS;                 // query rows a tile: dQ's 16 a warp, as the keys
    static constexpr int NT = KEYS * 2;                  // threads a block: a warp per 16 keys
    static constexpr int BLOCKS = D <= 64 ? 2 : 4;       // resident blocks an SM: 8 warps (at 3, ptxas spills)
    static constexpr int DQ_COLUMNS = D <= 32 ? D : 32; // dQ's columns made at a time (16 accumulators a lane)
};

// dQ rows r0.. (a warp's 16) += dS · K, added to `part` (fp32 rows of this head): A = dS, the
// transpose of dst (N keys × the tile's queries, the warp's columns at q0) by ldmatrix.trans, B =
// the N key rows at `ks`, read transposed as in `accumulate`; C columns at a time.
template <int D, int N, int C>
__device__ __forceinline__ void add_dq(float* part, const Shape& s, int b, int h, int r0, int q0,
                                       const bf16 (*dst)[N + PAD], const bf16 (*ks)[D + PAD]) {
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    smem_t a_base = smem(&dst[lane / 16 * 8 + lane % 8][q0 + lane / 8 % 2 * 8]), b_base = b_lane<D>(ks);
    // this lane's two rows of dQ (g and g + 8), made once: each add below is a constant offset
    float* rows[2] = {part + at(s, b, s.seq, r0 + g, s.heads, h) + 2 * t};
    rows[1] = rows[0] + 8L * s.heads * D;
#pragma unroll
    for (int c0 = 0; c0 < D; c0 += C) {
        float acc[C / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < N / 16; kk++) {
            unsigned a[4]; // (read again for each C columns: registers are what this loop lacks)
            ldmatrix_x4_trans(a, a_base + 16 * kk * (N + PAD) * 2);
            add_product<C>(acc, a, b_base + (16 * kk * (D + PAD) + c0) * 2);
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if (r0 + g + 8 * half >= s.seq) continue;
#pragma unroll
            for (int n = 0; n < C / 8; n++)
                red_add(rows[half] + c0 + 8 * n, acc[n][2 * half]), red_add(rows[half] + c0 + 8 * n + 1, acc[n][2 * half + 1]);
        }
    }
}

// Starts copying query rows i0.. of head h of q and dO into qs and dos, and stages their positions,
// lse (in log2 units) and δ in shared memory (plain stores, seen after the next __syncthreads).
template <int D, int N, int NT>
__device__ __forceinline__ void load_query_tile(const Shape& s, const bf16* q, const bf16* dout, const unsigned* q_pos,
                                                const float* lse, const float* delta, int b, int h, int i0,
                                                bf16 (*qs)[D + PAD], bf16 (*dos)[D + PAD], unsigned* qp, float* ls,
                                                float* dl) {
    load_rows<D, N, NT>({q, dout}, b, s.seq, s.heads, h, i0, {qs, dos});
    stage_query_rows(s, q_pos, lse, delta, b, h, i0, N, LOG2E, qp, ls, dl);
}

// The block's split's copy of dQ (made where it is used: a pointer kept in registers across the
// loop costs two of them, and the loop has none to spare at D = 64).
__device__ __forceinline__ float* dq_part(const Shape& s, float* dq_parts) {
    return dq_parts + (long)blockIdx.z * s.batch * s.seq * s.heads * s.head_dim;
}

template <int D>
__device__ void backward(Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos,
                         const unsigned* k_pos, const float* lse, const float* delta, const bf16* dout,
                         float* dq_parts, float* dk_parts, float* dv_parts) {
    constexpr int KEYS = KeyTiles<D>::KEYS, QUERIES = KeyTiles<D>::QUERIES, NT = KeyTiles<D>::NT;
    static_assert(QUERIES == 16 * (NT / 32), "dQ gives each warp 16 of a tile's queries");
    __shared__ __align__(16) bf16 ks[KEYS][D + PAD], vs[KEYS][D + PAD], qs[QUERIES][D + PAD], dos[QUERIES][D + PAD];
    __shared__ __align__(16) bf16 dst[KEYS][QUERIES + PAD]; // this tile pair's dSᵀ
    // (kept here, not in registers: the loop has none to spare at D = 64)
    __shared__ unsigned kp[KEYS], first, last_of_warp[NT / 32];
    // a lane reads columns 2t and 2t + 1 of these together, in one 8-byte load (ls2, dl2, qp2 below)
    __shared__ __align__(8) unsigned qp[QUERIES];
    __shared__ __align__(8) float ls[QUERIES], dl[QUERIES];
    int h = blockIdx.x, b = blockIdx.y, split = blockIdx.z, splits = gridDim.z, g = h / (s.heads / s.kv_heads);
    int w = threadIdx.x / 32, row = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    constexpr float scale = log2e_over_sqrt<D>();
    // this block's rows of its split's dQ, zeroed: its key tiles add into them
    for (int e = threadIdx.x; e < s.seq * (D / 4); e += NT)
        *(float4*)(dq_part(s, dq_parts) + at(s, b, s.seq, e / (D / 4), s.heads, h) + e % (D / 4) * 4) = {0.0f, 0.0f, 0.0f, 0.0f};
    bool consecutive = consecutive_positions<NT>(q_pos, s.seq);
    unsigned q0 = consecutive ? q_pos[0] : 0;
    int tiles = (s.kv_seq + KEYS - 1) / KEYS;
    for (int turn = 0; turn < 2 * ((tiles + 2 * splits - 1) / (2 * splits)); turn++) {
        // the snake: tiles split and 2·splits − 1 − split of each run of 2·splits
        int j0 = (turn / 2 * 2 * splits + (turn % 2 == 0 ? split : 2 * splits - 1 - split)) * KEYS, r0 = j0 + 16 * w;
        if (j0 >= s.kv_seq) continue;
        unsigned key_first = extreme_position(k_pos, j0, KEYS, s.kv_seq, true);
        // a tile of queries all at or after the warp's last key needs no mask; a warp of padding keys
        // always masks (with no key to see, a query row's lse is −∞: unmasked, p would be ∞ there, and
        // its dS, times the zeros of the padding K, NaN in dQ)
        unsigned warp_last = r0 < s.kv_seq ? extreme_position(k_pos, r0, 16, s.kv_seq, false) : NO_KEY;
        __syncthreads(); // every warp is done with the previous key tile (its K, in its last dQ)
        int i0 = next_query_tile<QUERIES>(q_pos, 0, s.seq, key_first, consecutive, q0);
        load_rows<D, KEYS, NT>({k, v}, b, s.kv_seq, s.kv_heads, g, j0, {ks, vs});
        if (i0 < s.seq) load_query_tile<D, QUERIES, NT>(s, q, dout, q_pos, lse, delta, b, h, i0, qs, dos, qp, ls, dl);
        cp_async_commit();
        load_key_positions<KEYS>(k_pos, j0, s.kv_seq, kp);
        if (threadIdx.x % 32 == 0) last_of_warp[w] = warp_last;
        if (threadIdx.x == 0) first = key_first;
        float dka[D / 8][4] = {}, dva[D / 8][4] = {};
        while (i0 < s.seq) {
            cp_async_wait<0>(); // this query tile (and, the first time, the key tile)
            __syncthreads();
            // Sᵀ = K·Qᵀ for this warp's 16 keys, then Pᵀ, then dV += Pᵀ·dO; then dPᵀ = V·dOᵀ 16 queries
            // at a time, each turned at once into dSᵀ = Pᵀ (dPᵀ − δ) in place of Pᵀ; then dK += dSᵀ·Q.
            // In this order Pᵀ and a whole dPᵀ are never held together (32 registers fewer than
            // making both first), which keeps the loop within 168 registers. K and V fragments are
            // re-read each tile, for the same reason.
            float st[QUERIES / 8][4];
            {
                unsigned kf[D / 16][4];
                load_a<D>(kf, &ks[16 * w]);
                times_transposed<D, QUERIES>(st, kf, qs);
            }
            // pᵀ; rows past the end have lse = +∞, so p = 0
            // (this lane's columns of fragment n are 8n + 2t and 8n + 2t + 1: pair 4n + t)
            const float2 *ls2 = (const float2*)ls, *dl2 = (const float2*)dl;
            const uint2* qp2 = (const uint2*)qp;
            if (extreme_position(qp, 0, QUERIES, QUERIES, true) >= last_of_warp[w]) { // every query sees every key
#pragma unroll
                for (int n = 0; n < QUERIES / 8; n++) {
                    float2 l = ls2[4 * n + t];
#pragma unroll
                    for (int e = 0; e < 4; e++) st[n][e] = fast_exp2(fmaf(st[n][e], scale, -(e % 2 ? l.y : l.x)));
                }
            } else {
                unsigned key[2] = {kp[16 * w + row], kp[16 * w + row + 8]};
#pragma unroll
                for (int n = 0; n < QUERIES / 8; n++) {
                    float2 l = ls2[4 * n + t];
                    uint2 p = qp2[4 * n + t];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        bool seen = key[e / 2] <= (e % 2 ? p.y : p.x);
                        st[n][e] = seen ? fast_exp2(fmaf(st[n][e], scale, -(e % 2 ? l.y : l.x))) : 0.0f;
                    }
                }
            }
            accumulate<D, QUERIES>(dva, st, dos);
            {
                unsigned vf[D / 16][4];
                load_a<D>(vf, &vs[16 * w]);
#pragma unroll
                for (int np = 0; np < QUERIES / 16; np++) {
                    float dpt[2][4];
                    times_transposed<D, 16>(dpt, vf, &dos[16 * np]);
#pragma unroll
                    for (int n = 0; n < 2; n++) {
                        float2 d = dl2[4 * (2 * np + n) + t];
#pragma unroll
                        for (int e = 0; e < 4; e++) st[2 * np + n][e] *= dpt[n][e] - (e % 2 ? d.y : d.x);
                    }
                }
            }
            // dSᵀ to shared memory in bf16; this warp reads its rows back as dK's A operand (so the
            // fp32 dSᵀ dies here, before dK's products), and every warp reads columns for dQ
#pragma unroll
            for (int n = 0; n < QUERIES / 8; n++)
#pragma unroll
                for (int half = 0; half < 2; half++)
                    *(unsigned*)&dst[16 * w + row + 8 * half][8 * n + 2 * t] = pack(st[n][2 * half], st[n][2 * half + 1]);
            __syncwarp();
            {
                smem_t a_base = smem(&dst[16 * w + threadIdx.x % 16][threadIdx.x % 32 / 16 * 8]), b_base = b_lane<D>(qs);
#pragma unroll
                for (int kk = 0; kk < QUERIES / 16; kk++) {
                    unsigned a[4];
                    ldmatrix_x4(a, a_base + 32 * kk);
                    add_product<D>(dka, a, b_base + 16 * kk * (D + PAD) * 2);
                }
            }
            __syncthreads(); // every warp is done with qs, dos and the staged rows, and dst is whole
            // the next query tile's copies, in flight during dQ's products
            int next = next_query_tile<QUERIES>(q_pos, i0 + QUERIES, s.seq, first, consecutive, q0);
            if (next < s.seq) load_query_tile<D, QUERIES, NT>(s, q, dout, q_pos, lse, delta, b, h, next, qs, dos, qp, ls, dl);
            cp_async_commit();
            add_dq<D, KEYS, KeyTiles<D>::DQ_COLUMNS>(dq_part(s, dq_parts), s, b, h, i0 + 16 * w, 16 * w, dst, ks);
            i0 = next;
        }
        cp_async_wait<0>(); // K and V, where no query tile was seen
        const float one[2] = {1.0f, 1.0f}; // (1/√D is applied when the parts are added)
        write_rows<D>(s, dka, one, dk_parts, b, s.kv_seq, s.heads, h, r0);
        write_rows<D>(s, dva, one, dv_parts, b, s.kv_seq, s.heads, h, r0);
    }
}

// y[r, c] = factor · Σ_p x[r · row_stride + p · part_stride + c] for r < rows, c < width (4
// columns a thread; width, the strides and x on 16 bytes), the parts added in order p = 0, 1, …:
// dQ from its splits (factor 1/√D), dK and dV from the heads of their group (1/√D and 1).
extern "C" __global__ void flash_attention_sum_parts(const float* x, bf16* y, long rows, int width, long row_stride,
                                                     long part_stride, int parts, float factor) {
    long e = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (e >= rows * width) return;
    long r = e / width, c = e % width;
    const float* from = x + r * row_stride + c;
    float4 sum = *(const float4*)from;
    for (int p = 1; p < parts; p++) {
        float4 more = *(const float4*)(from + p * part_stride);
        sum.x += more.x, sum.y += more.y, sum.z += more.z, sum.w += more.w;
    }
    *(uint2*)(y + e) = {pack(sum.x * factor, sum.y * factor), pack(sum.z * factor, sum.w * factor)};
}

#define EXPORT(D)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, ForwardTiles<D>::BLOCKS) flash_attention_forward_d##D(       \
        Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos, const unsigned* k_pos, bf16* out, \
        float* lse) {                                                                                                  \
        forward<D>(s, q, k, v, q_pos, k_pos, out, lse);                                                                \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(KeyTiles<D>::NT, KeyTiles<D>::BLOCKS) flash_attention_backward_d##D(  \
        Shape s, const bf16* q, const bf16* k, const bf16* v, const unsigned* q_pos, const unsigned* k_pos,            \
        const float* lse, const float* delta, const bf16* dout, float* dq_parts, float* dk_parts, float* dv_parts) {   \
        backward<D>(s, q, k, v, q_pos, k_pos, lse, delta, dout, dq_parts, dk_parts, dv_parts);                         \
    }
EXPORT(16)
EXPORT(32)
EXPORT(64)
EXPORT(128)
