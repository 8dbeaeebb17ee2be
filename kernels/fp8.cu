// FP8 casts with per-tensor current scaling (the math: src/ops/fp8.rs; the GEMM that reads them:
// one cuBLASLt call, src/ops/gpu_fp8.rs).
//
// A tensor x of n numbers ([rows, cols]) becomes FP8 bytes q = fp8(x · s) with s = largest /
// amax(|x|) rounded down to a power of two, and 1/s, which cuBLASLt multiplies the product by. Two launches, no host wait:
//   fp8_amax_*   block b takes the b-th slice of x and writes its max |x| to partial[b]
//                (a non-finite number counts as +∞, so the cast below writes NaN);
//   fp8_cast_*   every block first reduces the partials (each thread one, then a block max) to
//                amax and s, then each thread casts elements: y[i, j] = fp8(x[i, j] · s), or, with
//                `transposed`, y[j, i] — Hopper's FP8 GEMMs read both operands with the summed
//                index contiguous, so the backward GEMMs need W, x and dy transposed. Rows of y
//                are `ld` long: the summed length padded to a multiple of 16 (the caller zeroes
//                the padding; zeros add nothing to the sums). Block 0 writes 1/s.
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

template <typename T>
__device__ void amax_partial(const T* x, long n, float* partial) {
    __shared__ float scratch[32];
    long per_block = (n + gridDim.x - 1) / gridDim.x;
    long start = blockIdx.x * per_block, end = min(n, start + per_block);
    float m = 0.0f;
    for (long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float v = load(x, i);
        m = fmaxf(m, isfinite(v) ? fabsf(v) : INFINITY);
    }
    m = block_max(m, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

template <typename T>
__device__ void cast(const T* x, long rows, long cols, long ld, int transposed, int e5m2, const float* partial,
                     int partials, unsigned char* y, float* inverse_scale) {
    __shared__ float scratch[32];
    float m = 0.0f;
    for (int b = threadIdx.x; b < partials; b += blockDim.x) m = fmaxf(m, partial[b]);
    float amax = block_max(m, scratch);
    float s = scale_for(amax, e5m2 ? 57344.0f : 448.0f);
    if (inverse_scale && blockIdx.x == 0 && threadIdx.x == 0) *inverse_scale = 1.0f / s;
    long n = rows * cols;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long r = i / cols, c = i % cols;
        y[transposed ? c * ld + r : r * ld + c] = to_fp8(load(x, i) * s, e5m2);
    }
}

// An E4M3 byte's value (the inverse of to_fp8): sign, exponent (bias 7), mantissa.
__device__ float from_e4m3(unsigned char b) {
    int e = (b & 0x7f) >> 3, m = b & 7;
    float sign = b & 0x80 ? -1.0f : 1.0f;
    if ((b & 0x7f) == 0x7f) return __uint_as_float(0x7fc00000); // NaN
    if (e == 0) return sign * m * __uint_as_float((unsigned)(127 - 9) << 23); // m · 2⁻⁹
    return sign * (1.0f + m / 8.0f) * __uint_as_float((unsigned)(127 + e - 7) << 23);
}

// A weight gathered as E4M3 bytes (ops/wire.rs): out[i] = value(q[i]) / s, s from the same
// all-reduced maxima the cast used, in the compute dtype.
template <typename T>
__device__ void decode(const unsigned char* q, long n, const float* partial, int partials, T* out) {
    __shared__ float scratch[32];
    float m = 0.0f;
    for (int b = threadIdx.x; b < partials; b += blockDim.x) m = fmaxf(m, partial[b]);
    float amax = block_max(m, scratch);
    float inverse = 1.0f / scale_for(amax, 448.0f);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        store(out, i, from_e4m3(q[i]) * inverse);
}

#define EXPORT(T, suffix)                                                                                    \
    extern "C" __global__ void fp8_amax_##suffix(const T* x, long n, float* partial) {                        \
        amax_partial(x, n, partial);                                                                         \
    }                                                                                                        \
    extern "C" __global__ void fp8_cast_##suffix(const T* x, long rows, long cols, long ld, int transposed,  \
                                                 int e5m2, const float* partial, int partials,               \
                                                 unsigned char* y, float* inverse_scale) {                   \
        cast(x, rows, cols, ld, transposed, e5m2, partial, partials, y, inverse_scale);                      \
    }                                                                                                        \
    extern "C" __global__ void fp8_decode_##suffix(const unsigned char* q, long n, const float* partial,      \
                                                   int partials, T* out) {                                   \
        decode(q, n, partial, partials, out);                                                                \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
