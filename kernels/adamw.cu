// adamw.cu — the AdamW update on fp32 master weights, writing the compute copy.
//
// Math (step t ≥ 1, bias-corrected, decoupled decay; g is the gradient times `grad_scale`, the
// clipping factor, so that clipping costs no pass of its own over the gradients):
//   m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  p ← p·(1 − lr·wd) − lr · (m/(1−β₁ᵗ)) / (sqrt(v/(1−β₂ᵗ)) + ε)
// p and g are f32; the moments m, v are f32, or bf16 (`train.optimizer_dtype = "bf16"`: read
// into f32, updated in f32, stored rounded to nearest; half the optimizer's memory); `copy` (bf16
// in mixed precision, absent in f32 mode) receives the new p rounded for the next forward.

// (`load` and `store` read and write either dtype as f32: common.cuh.)

// One launch updates up to LIST_TENSORS parameters (common.cuh): block b takes LIST_CHUNK elements
// of one of them, one thread per element in a block-stride loop; each parameter has its own
// weight decay (0 for norm weights) and compute copy (null without one).
struct AdamWList {
    float* p[LIST_TENSORS];
    const float* g[LIST_TENSORS];
    void* m[LIST_TENSORS];
    void* v[LIST_TENSORS];
    __nv_bfloat16* copy[LIST_TENSORS];
    long n[LIST_TENSORS];
    float decay[LIST_TENSORS];
    int first_block[LIST_TENSORS + 1];
    int count;
};

template <typename M>
__device__ void adamw(const AdamWList& list, float lr, float beta1, float beta2, float eps, int step, float grad_scale) {
    long start;
    int t = list_tensor(list.first_block, list.count, start);
    float* p = list.p[t];
    const float* g = list.g[t];
    M* m = (M*)list.m[t];
    M* v = (M*)list.v[t];
    __nv_bfloat16* copy = list.copy[t];
    long end = min(list.n[t], start + LIST_CHUNK);
    float wd = list.decay[t];
    float c1 = 1.0f - powf(beta1, (float)step), c2 = 1.0f - powf(beta2, (float)step);
    for (long i = start + threadIdx.x; i < end; i += blockDim.x) {
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

extern "C" __global__ void adamw_list_m32(AdamWList list, float lr, float beta1, float beta2, float eps, int step,
                                          float grad_scale) {
    adamw<float>(list, lr, beta1, beta2, eps, step, grad_scale);
}

// The same with bf16 moments.
extern "C" __global__ void adamw_list_m16(AdamWList list, float lr, float beta1, float beta2, float eps, int step,
                                          float grad_scale) {
    adamw<__nv_bfloat16>(list, lr, beta1, beta2, eps, step, grad_scale);
}
