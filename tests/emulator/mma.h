// mma.h for the CPU emulator: the WMMA subset that kernels/attention_tc.cu uses (16×16×16 bf16
// fragments, fp32 accumulators). On a GPU a fragment is spread over the 32 threads of a warp in
// an unspecified layout; here every thread of the warp holds the whole 16×16 matrix and computes
// the whole product, which gives the same results as long as a kernel touches fragments only
// through these calls (as the WMMA rules require anyway). A store is written by lane 0 alone;
// like on a GPU, the warp must __syncwarp() before reading it back. The alignment and leading-
// dimension rules of the real API (pointers on 32 bytes; ldm a multiple of 16 bytes) are checked.
#pragma once
#include "cuda_bf16.h"
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    float x[16][16];
};

inline float value(float v) { return v; }
inline float value(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
void check(const T* p, unsigned ldm) {
    if ((uintptr_t)p % 32 != 0 || (ldm * sizeof(T)) % 16 != 0) {
        fprintf(stderr, "wmma: pointer %p not 32-byte aligned or ldm %u not a multiple of 16 bytes\n", (void*)p, ldm);
        abort();
    }
}

template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
    for (auto& r : f.x)
        for (float& e : r) e = v;
}

// matrix_a / matrix_b: element (r, c) of the 16×16 operand; row_major reads p[r*ldm + c].
template <typename Use, typename T, typename L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
    check(p, ldm);
    constexpr bool rows = std::is_same_v<L, row_major>;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r][c] = value(rows ? p[r * ldm + c] : p[c * ldm + r]);
}

template <typename A, typename B>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[16][16];
    for (int r = 0; r < 16; r++)
        for (int col = 0; col < 16; col++) {
            float acc = c.x[r][col];
            for (int k = 0; k < 16; k++) acc += a.x[r][k] * b.x[k][col];
            out[r][col] = acc;
        }
    memcpy(d.x, out, sizeof out);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout) {
    check(p, ldm);
    if (emu::lane() != 0) return;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r][c];
}
} // namespace nvcuda::wmma

namespace nvcuda {} // `using namespace nvcuda;` as on a GPU
