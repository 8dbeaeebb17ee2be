// adamw.cu — the AdamW update on fp32 master weights, writing the compute copy.
//
// Math (step t ≥ 1, bias-corrected, decoupled decay; g is the gradient times `grad_scale`, the
// clipping factor, so that clipping costs no pass of its own over the gradients):
//   m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  p ← p·(1 − lr·wd) − lr · (m/(1−β₁ᵗ)) / (sqrt(v/(1−β₂ᵗ)) + ε)
// p and g are f32; the moments m, v are f32, or bf16 (`train.optimizer_dtype = "bf16"`: read
// into f32, updated in f32, stored rounded to nearest; half the optimizer's memory); `copy` (bf16
// in mixed precision, absent in f32 mode) receives the new p rounded for the next forward. One
// thread per element.

// (`load` and `store` read and write either dtype as f32: common.cuh.)

template <typename M>
__device__ void adamw(float* p, const float* g, M* m, M* v, long n, float lr, float beta1, float beta2, float eps,
                      float wd, int step, float grad_scale, __nv_bfloat16* copy) {
    float c1 = 1.0f - powf(beta1, (float)step), c2 = 1.0f - powf(beta2, (float)step);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float gi = g[i] * grad_scale;
        float mi = beta1 * load(m, i) + (1.0f - beta1) * gi;
        float vi = beta2 * load(v, i) + (1.0f - beta2) * gi * gi;
        store(m, i, mi);
        store(v, i, vi);
        float pi = p[i] * (1.0f - lr * wd) - lr * (mi / c1) / (sqrtf(vi / c2) + eps);
        p[i] = pi;
        if (copy) copy[i] = __float2bfloat16(pi);
    }
}

extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long n, float lr, float beta1,
                                     float beta2, float eps, float wd, int step, float grad_scale) {
    adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale, nullptr);
}

extern "C" __global__ void adamw_bf16(float* p, const float* g, float* m, float* v, long n, float lr, float beta1,
                                      float beta2, float eps, float wd, int step, float grad_scale, __nv_bfloat16* copy) {
    adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale, copy);
}

// The same with bf16 moments.
extern "C" __global__ void adamw_f32_m16(float* p, const float* g, __nv_bfloat16* m, __nv_bfloat16* v, long n,
                                         float lr, float beta1, float beta2, float eps, float wd, int step, float grad_scale) {
    adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale, nullptr);
}

extern "C" __global__ void adamw_bf16_m16(float* p, const float* g, __nv_bfloat16* m, __nv_bfloat16* v, long n,
                                          float lr, float beta1, float beta2, float eps, float wd, int step,
                                          float grad_scale, __nv_bfloat16* copy) {
    adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale, copy);
}
