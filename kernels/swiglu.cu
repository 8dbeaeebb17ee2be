// swiglu.cu — the SwiGLU activation of Llama's MLP, forward and backward.
//
// Math: h = silu(g) · u with silu(g) = g · σ(g); silu'(g) = σ(g) · (1 + g · (1 − σ(g))).
// Backward: dg = dh · u · silu'(g), du = dh · silu(g). One thread per element.

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__device__ void swiglu_forward(const T* gate, const T* up, T* h, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = load(gate, i);
        store(h, i, g * sigmoid(g) * load(up, i));
    }
}

template <typename T>
__device__ void swiglu_backward(const T* dh, const T* gate, const T* up, T* dgate, T* dup, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = load(gate, i), u = load(up, i), d = load(dh, i), s = sigmoid(g);
        store(dgate, i, d * u * s * (1.0f + g * (1.0f - s)));
        store(dup, i, d * g * s);
    }
}

#define EXPORT(T, suffix)                                                                                       \
    extern "C" __global__ void swiglu_forward_##suffix(const T* gate, const T* up, T* h, long n) {              \
        swiglu_forward(gate, up, h, n);                                                                         \
    }                                                                                                           \
    extern "C" __global__ void swiglu_backward_##suffix(const T* dh, const T* gate, const T* up, T* dgate,      \
                                                        T* dup, long n) {                                       \
        swiglu_backward(dh, gate, up, dgate, dup, n);                                                           \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
