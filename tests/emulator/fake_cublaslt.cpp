// A fake cuBLASLt for tests/gpu_path_emulated.rs: the calls src/ops/gpu_fp8.rs makes for an FP8
// GEMM, built into the fake libcuda.so and linked as libcublasLt.so too. cublasLtMatmul computes
// D = scaleA · scaleB · op(A) · op(B) (+ beta · C), column-major, decoding the E4M3 and E5M2
// bytes exactly and summing in float, and it refuses what Hopper's FP8 GEMMs refuse: any layout
// but "TN" (A transposed, B not), and leading dimensions that are not multiples of 16 bytes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_bf16.h"

extern "C" void fake_count_heuristic(); // fake_cuda.cpp's counts

namespace {
const int OK = 0, NOT_SUPPORTED = 15, INVALID_VALUE = 7;
const int R_32F = 0, R_16BF = 14, R_8F_E4M3 = 28, R_8F_E5M2 = 29;
int lt_token;

struct Layout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};
struct Desc {
    int transa = 0, transb = 0;
    const float *a_scale = nullptr, *b_scale = nullptr;
};
struct Heuristic { // cublasLtMatmulHeuristicResult_t
    uint64_t algo[8];
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

// An FP8 byte's value: sign, exponent (bias 7 or 15), mantissa; subnormals below the smallest
// exponent. E4M3 has no infinity (S.1111.111 is NaN); E5M2's top exponent is ∞ and NaN.
float fp8_value(uint8_t byte, int type) {
    const int m = type == R_8F_E4M3 ? 3 : 2, bias = type == R_8F_E4M3 ? 7 : 15;
    const int e = (byte & 0x7f) >> m, frac = byte & ((1 << m) - 1);
    const float sign = byte & 0x80 ? -1.0f : 1.0f;
    if (type == R_8F_E4M3 && (byte & 0x7f) == 0x7f) return NAN;
    if (type == R_8F_E5M2 && e == 31) return frac ? NAN : sign * INFINITY;
    if (e == 0) return sign * std::ldexp((float)frac, 1 - bias - m);
    return sign * std::ldexp(1.0f + (float)frac / (1 << m), e - bias);
}

float value(const void* p, int type, long i) {
    switch (type) {
    case R_32F: return ((const float*)p)[i];
    case R_16BF: return __bfloat162float(((const __nv_bfloat16*)p)[i]);
    default: return fp8_value(((const uint8_t*)p)[i], type);
    }
}
int bytes(int type) { return type == R_32F ? 4 : type == R_16BF ? 2 : 1; }
} // namespace

extern "C" {
int cublasLtCreate(void** h) { *h = &lt_token; return OK; }
int cublasLtDestroy(void*) { return OK; }
int cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    *l = new Layout{type, rows, cols, ld};
    return OK;
}
int cublasLtMatrixLayoutDestroy(void* l) { delete (Layout*)l; return OK; }
int cublasLtMatmulDescCreate(void** d, int, int) { *d = new Desc; return OK; }
int cublasLtMatmulDescDestroy(void* d) { delete (Desc*)d; return OK; }
int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
    Desc* desc = (Desc*)d;
    switch (attr) {
    case 3: desc->transa = *(const int*)buf; return size == 4 ? OK : INVALID_VALUE;
    case 4: desc->transb = *(const int*)buf; return size == 4 ? OK : INVALID_VALUE;
    case 17: desc->a_scale = *(const float* const*)buf; return size == 8 ? OK : INVALID_VALUE;
    case 18: desc->b_scale = *(const float* const*)buf; return size == 8 ? OK : INVALID_VALUE;
    default: return OK;
    }
}
int cublasLtMatmulPreferenceCreate(void** p) { *p = new int(0); return OK; }
int cublasLtMatmulPreferenceDestroy(void* p) { delete (int*)p; return OK; }
int cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return OK; }

int cublasLtMatmulAlgoGetHeuristic(void*, void* d, void* a, void* b, void*, void* dl, void*, int requested,
                                   Heuristic* results, int* count) {
    fake_count_heuristic();
    const Desc* desc = (const Desc*)d;
    const Layout *la = (const Layout*)a, *lb = (const Layout*)b, *ld = (const Layout*)dl;
    bool fp8 = la->type == R_8F_E4M3 || la->type == R_8F_E5M2;
    bool tn = desc->transa == 1 && desc->transb == 0;
    bool aligned = la->ld * bytes(la->type) % 16 == 0 && lb->ld * bytes(lb->type) % 16 == 0;
    bool both_e5m2 = la->type == R_8F_E5M2 && lb->type == R_8F_E5M2;
    *count = 0;
    if (requested < 1 || (fp8 && (!tn || !aligned || both_e5m2)) || ld->type == R_8F_E4M3) return NOT_SUPPORTED;
    memset(results, 0, sizeof(Heuristic));
    *count = 1;
    return OK;
}

int cublasLtMatmul(void*, void* d, const void* alpha, const void* a, void* al, const void* b, void* bl, const void* beta,
                   const void* c, void* cl, void* out, void* dl, const void*, void*, size_t, void*) {
    const Desc* desc = (const Desc*)d;
    const Layout *la = (const Layout*)al, *lb = (const Layout*)bl, *lc = (const Layout*)cl, *ld = (const Layout*)dl;
    if (desc->transa != 1 || desc->transb != 0) return NOT_SUPPORTED;
    long m = ld->rows, n = ld->cols, k = la->rows; // op(A) = Aᵀ: [m, k]; B: [k, n]
    if ((long)la->cols != m || (long)lb->rows != k || (long)lb->cols != n) return INVALID_VALUE;
    float scale = (desc->a_scale ? *desc->a_scale : 1.0f) * (desc->b_scale ? *desc->b_scale : 1.0f);
    float al_ = *(const float*)alpha, be = *(const float*)beta;
    // every byte decoded once (the sums below read each m or n times)
    std::vector<float> av(m * k), bv(n * k);
    for (long i = 0; i < m; i++)
        for (long l = 0; l < k; l++) av[i * k + l] = value(a, la->type, i * la->ld + l);
    for (long j = 0; j < n; j++)
        for (long l = 0; l < k; l++) bv[j * k + l] = value(b, lb->type, j * lb->ld + l);
    for (long j = 0; j < n; j++)
        for (long i = 0; i < m; i++) {
            float acc = 0.0f;
            for (long l = 0; l < k; l++) acc += av[i * k + l] * bv[j * k + l];
            float v = al_ * (acc * scale) + (be == 0.0f ? 0.0f : be * value(c, lc->type, j * lc->ld + i));
            long o = j * ld->ld + i;
            if (ld->type == R_32F) ((float*)out)[o] = v;
            else ((__nv_bfloat16*)out)[o] = __float2bfloat16(v);
        }
    return OK;
}
}
