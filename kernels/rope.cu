// rope.cu — rotary position embedding, Hugging Face's half rotation, forward and backward.
//
// Math: for each head and i < half = head_dim/2, with angle = pos · inv_freq[i] (plain RoPE:
// inv_freq[i] = theta^(−2i/head_dim), made on the host with the rescaled ones of a longer
// context, src/ops/rope_scaling.rs) and cos, sin both times `scale` (1 but under YaRN):
//   (x[i], x[i+half]) ← (x[i]·cos − x[i+half]·sin, x[i+half]·cos + x[i]·sin).
// The backward of a rotation is the rotation by −angle, applied to the gradient in place
// (`inverse` = 1). The angles depend only on the positions, so `rope_table` computes cos and sin
// once per micro-batch, [rows, half] each: in double (the large positions of long sequences need
// it, as in the CPU reference), rounded to float; every layer's q and k, forward and backward,
// then read the table instead of calling cos and sin in double.
// Decomposition: one thread per (row, i) entry of the table; one thread per (row, head, i) pair
// of the rotation.

extern "C" __global__ void rope_table(const unsigned* positions, long rows, int half, const double* inv_freq,
                                      double scale, float* cos_t, float* sin_t) {
    for (long k = blockIdx.x * (long)blockDim.x + threadIdx.x; k < rows * half; k += (long)gridDim.x * blockDim.x) {
        double angle = (double)positions[k / half] * inv_freq[k % half];
        cos_t[k] = (float)(cos(angle) * scale);
        sin_t[k] = (float)(sin(angle) * scale);
    }
}

template <typename T>
__device__ void rope(T* x, const float* cos_t, const float* sin_t, long rows, int heads, int head_dim, int inverse) {
    int half = head_dim / 2;
    long n = rows * heads * half;
    for (long k = blockIdx.x * (long)blockDim.x + threadIdx.x; k < n; k += (long)gridDim.x * blockDim.x) {
        int i = k % half;
        long rh = k / half; // row * heads + head
        long at = rh / heads * half + i;
        float c = cos_t[at], s = inverse ? -sin_t[at] : sin_t[at];
        long base = rh * head_dim;
        float a = load(x, base + i), b = load(x, base + i + half);
        store(x, base + i, a * c - b * s);
        store(x, base + i + half, b * c + a * s);
    }
}

#define EXPORT(T, suffix)                                                                                         \
    extern "C" __global__ void rope_##suffix(T* x, const float* cos_t, const float* sin_t, long rows, int heads,   \
                                             int head_dim, int inverse) {                                         \
        rope(x, cos_t, sin_t, rows, heads, head_dim, inverse);                                                    \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
