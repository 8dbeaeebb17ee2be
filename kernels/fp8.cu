// FP8 casts with per-tensor current scaling (the math: src/ops/fp8.rs; the GEMM that reads them:
// one cuBLASLt call, src/ops/gpu_fp8.rs).
//
// A tensor x of n numbers ([rows, cols]) becomes FP8 bytes q = fp8(x · s) with s = largest /
// amax(|x|) rounded down to a power of two, and 1/s, which cuBLASLt multiplies the product by.
// Two launches, no host wait:
//   fp8_amax_*     block b takes the b-th slice of x and writes its max |x| to partial[b]
//                  (a non-finite number counts as +∞, so the cast below writes NaN);
//   fp8_operand_*  every block first reduces the partials (each thread one, then a block max) to
//                  amax and s; then the block casts one 64 × 64 tile of x and writes it twice, as
//                  both GEMMs that will read the tensor want it. Hopper's FP8 GEMMs read both
//                  operands with the summed index contiguous ("TN"), and a linear layer sums x over
//                  its columns in forward but over its rows for dW (W, dy likewise): so
//                    y  [rows, ld]   y[i, j]  = q[i, j], ld = cols rounded up to 16,
//                    yt [cols, ldt]  yt[j, i] = q[i, j], ldt = rows rounded up to 16,
//                  the padding written as zeros (which add nothing to a sum). A thread casts 4
//                  neighbours of a row and writes them as one 32-bit word of y; the tile waits in
//                  shared memory, and a thread then gathers 4 neighbours of a column, one word of
//                  yt: both writes coalesced (a warp writes 128 contiguous bytes), where writing yt
//                  straight from the row-major read would scatter single bytes `ldt` apart.
//                  Block 0 writes 1/s.
// A grid-wide maximum needs every block done before any can cast: in one launch that is a grid
// barrier (a cooperative launch, every block resident at once); two launches cost one more read
// of x (a third of the cast's traffic) and nothing else, and the amax is taken once a tensor,
// whatever number of GEMMs reads its two layouts (src/ops/gpu_fp8.rs keeps them with the tensor).
//   fp8_cast_*     the same cast into one contiguous array, for a weight packed for the wire
//                  (src/ops/packing.rs: E4M3, scaled by the all-reduced maxima of every chunk).
// The rounding is the CPU reference's, bit for bit: to nearest, ties to even, saturating at the
// largest value (as __NV_SATFINITE), NaN for NaN and ±∞.

// x rounded to E4M3 (e5m2 = 0) or E5M2 (e5m2 = 1), as its byte: sign, exponent, mantissa.
__device__ unsigned char to_fp8(float x, int e5m2) {
    const int m = e5m2 ? 2 : 3, e_min = e5m2 ? -14 : -6, bias = e5m2 ? 15 : 7;
    const float largest = e5m2 ? 57344.0f : 448.0f;
    if (!isfinite(x)) return 0x7f; // NaN in both formats
    unsigned sign = (__float_as_uint(x) >> 24) & 0x80;
    float a = fabsf(x);
    // the spacing around a (a power of two, never below the subnormals'): a / step is exact, and
    // adding 1.5·2²³ rounds it to an integer, ties to even
    int e = max((int)((__float_as_uint(a) >> 23) & 0xff) - 127, e_min) - m;
    float step = __uint_as_float((unsigned)(127 + e) << 23), inverse = __uint_as_float((unsigned)(127 - e) << 23);
    float r = fminf(((a * inverse + 12582912.0f) - 12582912.0f) * step, largest);
    unsigned bits = __float_as_uint(r), code;
    if (r < __uint_as_float((unsigned)(127 + e_min) << 23)) // a subnormal: r in subnormal steps
        code = (unsigned)(r * __uint_as_float((unsigned)(127 + m - e_min) << 23));
    else
        code = ((((bits >> 23) & 0xff) - 127 + bias) << m) | ((bits >> (23 - m)) & ((1u << m) - 1));
    return (unsigned char)(sign | code);
}

// Current scaling's scale (src/ops/fp8.rs, scale_for): largest / amax rounded down to a power of
// two, at most 2^127; 1 for an amax of 0 or not finite.
__device__ float scale_for(float amax, float largest) {
    if (!(amax > 0.0f && isfinite(amax))) return 1.0f;
    float s = fminf(largest / amax, __uint_as_float(254u << 23));
    return __uint_as_float(__float_as_uint(s) & 0xff800000u);
}

// 8 numbers of x from i (a multiple of 8, so 16- or 32-byte aligned) as floats, in 128-bit loads:
// a memory-bound pass needs many bytes in flight, and a 2-byte load a thread keeps too few.
__device__ void load8(const __nv_bfloat16* x, long i, float* v) {
    uint4 u = *(const uint4*)(x + i);
    unsigned w[4] = {u.x, u.y, u.z, u.w};
    for (int j = 0; j < 4; j++) {
        v[2 * j] = __uint_as_float(w[j] << 16); // the low half is the first number
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}
__device__ void load8(const float* x, long i, float* v) {
    for (int h = 0; h < 2; h++) {
        uint4 u = *(const uint4*)(x + i + 4 * h);
        v[4 * h] = __uint_as_float(u.x), v[4 * h + 1] = __uint_as_float(u.y);
        v[4 * h + 2] = __uint_as_float(u.z), v[4 * h + 3] = __uint_as_float(u.w);
    }
}

// 4 numbers of x from i (a multiple of 4: 8- or 16-byte aligned) as floats, in one load.
__device__ void load4(const __nv_bfloat16* x, long i, float* v) {
    uint2 u = *(const uint2*)(x + i);
    v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
    v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ void load4(const float* x, long i, float* v) {
    uint4 u = *(const uint4*)(x + i);
    v[0] = __uint_as_float(u.x), v[1] = __uint_as_float(u.y), v[2] = __uint_as_float(u.z), v[3] = __uint_as_float(u.w);
}

// Block b's slice: a multiple of 16 numbers long, read 16 a thread an iteration (two 128-bit loads
// in flight each), the tail one by one.
template <typename T>
__device__ void amax_partial(const T* x, long n, float* partial) {
    __shared__ float scratch[32];
    long per_block = ((n + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
    long start = blockIdx.x * per_block, end = min(n, start + per_block);
    float m = 0.0f;
    for (long i = start + 16 * threadIdx.x; i < end; i += 16L * blockDim.x) {
        float v[16];
        if (i + 16 <= end) {
            load8(x, i, v);
            load8(x, i + 8, v + 8);
        } else {
            for (int j = 0; j < 16; j++) v[j] = i + j < end ? load(x, i + j) : 0.0f;
        }
        for (int j = 0; j < 16; j++) m = fmaxf(m, isfinite(v[j]) ? fabsf(v[j]) : INFINITY);
    }
    m = block_max(m, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

// The amax of the `partials` maxima, and current scaling's scale for it (every thread gets both).
__device__ float scale_of_partials(const float* partial, int partials, float largest, float* scratch) {
    float m = 0.0f;
    for (int b = threadIdx.x; b < partials; b += blockDim.x) m = fmaxf(m, partial[b]);
    return scale_for(block_max(m, scratch), largest);
}

#define TILE 64 // a block's tile: TILE × TILE numbers, 256 threads (THREADS), 16 numbers a thread

template <typename T>
__device__ void operand(const T* x, long rows, long cols, int e5m2, const float* partial, int partials,
                        unsigned char* y, unsigned char* yt, float* inverse_scale) {
    __shared__ float scratch[32];
    __shared__ unsigned char tile[TILE][TILE + 4]; // +4: a column's bytes fall in different banks
    float s = scale_of_partials(partial, partials, e5m2 ? 57344.0f : 448.0f, scratch);
    if (blockIdx.x == 0 && threadIdx.x == 0) *inverse_scale = 1.0f / s;
    long ld = (cols + 15) / 16 * 16, ldt = (rows + 15) / 16 * 16;
    long tiles_c = (ld + TILE - 1) / TILE;
    long r0 = blockIdx.x / tiles_c * TILE, c0 = blockIdx.x % tiles_c * TILE;
    int quad = threadIdx.x % 16 * 4; // this thread's 4 neighbours: columns (then rows) quad..quad+3
    bool whole = cols % 4 == 0;       // then 4 neighbours of a row are one aligned 8- or 16-byte load
    // rows of the tile: cast, keep in shared memory, write to y (past cols: the zero padding); the
    // stride is a constant (THREADS = 256 threads, 16 a row), so the loop unrolls and its 4 loads
    // are in flight together
#pragma unroll
    for (int i = threadIdx.x / 16; i < TILE; i += 16) {
        long r = r0 + i, c = c0 + quad;
        float v[4];
        if (r < rows && c + 4 <= cols && whole)
            load4(x, r * cols + c, v);
        else
            for (int j = 0; j < 4; j++) v[j] = r < rows && c + j < cols ? load(x, r * cols + c + j) : 0.0f;
        unsigned word = 0;
        for (int j = 0; j < 4; j++) {
            unsigned char q = r < rows && c + j < cols ? to_fp8(v[j] * s, e5m2) : 0;
            tile[i][quad + j] = q;
            word |= (unsigned)q << (8 * j);
        }
        if (r < rows && c < ld) *(unsigned*)(y + r * ld + c) = word;
    }
    __syncthreads();
    // columns of the tile: 4 neighbours of a column, one word of yt (past rows: the padding)
#pragma unroll
    for (int j = threadIdx.x / 16; j < TILE; j += 16) {
        long c = c0 + j;
        if (c >= cols || r0 + quad >= ldt) continue;
        unsigned word = 0;
        for (int i = 0; i < 4; i++) word |= (unsigned)tile[quad + i][j] << (8 * i);
        *(unsigned*)(yt + c * ldt + r0 + quad) = word;
    }
}

// The cast into one contiguous array (a weight for the wire, E4M3).
template <typename T>
__device__ void cast(const T* x, long n, const float* partial, int partials, unsigned char* y) {
    __shared__ float scratch[32];
    float s = scale_of_partials(partial, partials, 448.0f, scratch);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = to_fp8(load(x, i) * s, 0);
}

// An E4M3 byte's value (the inverse of to_fp8): sign, exponent (bias 7), mantissa.
__device__ float from_e4m3(unsigned char b) {
    int e = (b & 0x7f) >> 3, m = b & 7;
    float sign = b & 0x80 ? -1.0f : 1.0f;
    if ((b & 0x7f) == 0x7f) return __uint_as_float(0x7fc00000); // NaN
    if (e == 0) return sign * m * __uint_as_float((unsigned)(127 - 9) << 23); // m · 2⁻⁹
    return sign * (1.0f + m / 8.0f) * __uint_as_float((unsigned)(127 + e - 7) << 23);
}

// A weight gathered as E4M3 bytes (ops/packing.rs): out[i] = value(q[i]) / s, s from the same
// all-reduced maxima the cast used, in the compute dtype.
template <typename T>
__device__ void decode(const unsigned char* q, long n, const float* partial, int partials, T* out) {
    __shared__ float scratch[32];
    float inverse = 1.0f / scale_of_partials(partial, partials, 448.0f, scratch);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        store(out, i, from_e4m3(q[i]) * inverse);
}

#define EXPORT(T, suffix)                                                                                    \
    extern "C" __global__ void fp8_amax_##suffix(const T* x, long n, float* partial) {                        \
        amax_partial(x, n, partial);                                                                         \
    }                                                                                                        \
    extern "C" __global__ void fp8_operand_##suffix(const T* x, long rows, long cols, int e5m2,                \
                                                    const float* partial, int partials, unsigned char* y,    \
                                                    unsigned char* yt, float* inverse_scale) {               \
        operand(x, rows, cols, e5m2, partial, partials, y, yt, inverse_scale);                               \
    }                                                                                                        \
    extern "C" __global__ void fp8_cast_##suffix(const T* x, long n, const float* partial, int partials,      \
                                                 unsigned char* y) {                                         \
        cast(x, n, partial, partials, y);                                                                    \
    }                                                                                                        \
    extern "C" __global__ void fp8_decode_##suffix(const unsigned char* q, long n, const float* partial,      \
                                                   int partials, T* out) {                                   \
        decode(q, n, partial, partials, out);                                                                \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
