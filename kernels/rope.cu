// rope.cu — rotary position embedding, Hugging Face's half rotation, forward and backward.
//
// Math: for each head and i < half = head_dim/2, with angle = pos · theta^(−2i/head_dim):
//   (x[i], x[i+half]) ← (x[i]·cos − x[i+half]·sin, x[i+half]·cos + x[i]·sin).
// The backward of a rotation is the rotation by −angle, applied to the gradient in place
// (`inverse` = 1). One thread per (row, head, i) pair; the angle is computed in double for the
// large positions of long sequences, as the CPU reference does.

template <typename T>
__device__ void rope(T* x, const unsigned* positions, long rows, int heads, int head_dim, double theta, int inverse) {
    int half = head_dim / 2;
    long n = rows * heads * half;
    for (long k = blockIdx.x * (long)blockDim.x + threadIdx.x; k < n; k += (long)gridDim.x * blockDim.x) {
        int i = k % half;
        long rh = k / half; // row * heads + head
        long row = rh / heads;
        double angle = (double)positions[row] * pow(theta, -2.0 * i / head_dim);
        float c = (float)cos(angle), s = (float)(inverse ? -sin(angle) : sin(angle));
        long base = rh * head_dim;
        float a = load(x, base + i), b = load(x, base + i + half);
        store(x, base + i, a * c - b * s);
        store(x, base + i + half, b * c + a * s);
    }
}

#define EXPORT(T, suffix)                                                                                        \
    extern "C" __global__ void rope_##suffix(T* x, const unsigned* positions, long rows, int heads, int head_dim, \
                                             double theta, int inverse) {                                        \
        rope(x, positions, rows, heads, head_dim, theta, inverse);                                               \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
