// common.cuh — prepended to every kernel file before NVRTC compiles it (src/cuda/nvrtc.rs).
//
// Storage types: activations and weights used for compute are `float` (f32 mode) or
// `__nv_bfloat16` (mixed precision); every kernel computes in float. `load`/`store` convert.
// Each kernel family is written once as a template and instantiated for both types by the
// EXPORT macros at the end of its file, as `name_f32` and `name_bf16`.
#include <cuda_bf16.h>

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, long i, float v) { p[i] = __float2bfloat16(v); }

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in a fixed order:
// the same bits every run. `scratch` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x / 32;
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// The maximum of `v` over the block, like block_sum.
__device__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x / 32;
    v = lane < warps ? scratch[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The attention shape (attention.cu, attention_tc.cu): queries [batch*seq, heads*head_dim],
// keys and values [batch*kv_seq, kv_heads*head_dim].
struct Shape {
    int batch, seq, kv_seq, heads, kv_heads, head_dim;
};

// Row r of head `head` in a [batch*len, n_heads*head_dim] tensor.
__device__ __forceinline__ long at(const Shape& s, int b, int len, int r, int n_heads, int head) {
    return ((long)(b * len + r) * n_heads + head) * s.head_dim;
}

// For the dk/dv backward: the position, lse and delta of query rows i0..i0+n of head h, staged in
// shared memory by the block, lse multiplied by `lse_scale` (log2(e) for a kernel that takes exp2).
// Rows past the end get lse = +∞, so that p = exp(s − ∞) = 0 for them.
__device__ void stage_query_rows(const Shape& s, const unsigned* q_pos, const float* lse, const float* delta, int b,
                                 int h, int i0, int n, float lse_scale, unsigned* qp, float* ls, float* dl) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        long row = ((long)b * s.heads + h) * s.seq + i0 + e;
        bool in = i0 + e < s.seq;
        qp[e] = in ? q_pos[i0 + e] : 0;
        ls[e] = in ? lse[row] * lse_scale : INFINITY;
        dl[e] = in ? delta[row] : 0.0f;
    }
}

// A list of tensors for one launch of a multi-tensor kernel (the optimizer's: AdamW, the
// gradient norm's sums, zeroing the gradients), passed by value as the kernel's argument, as
// PyTorch's multi_tensor_apply does: one launch for up to LIST_TENSORS tensors instead of one
// each. Block b works on tensor t, the one with first_block[t] ≤ b < first_block[t + 1], on its
// elements [(b − first_block[t]) · LIST_CHUNK, … + LIST_CHUNK). Mirrors `TensorList` and
// `AdamWList` in src/cuda/launch_table.rs.
#define LIST_TENSORS 64
#define LIST_CHUNK 4096
struct TensorList {
    float* x[LIST_TENSORS];
    long n[LIST_TENSORS];
    int first_block[LIST_TENSORS + 1];
    int count;
};

// The tensor of this block and the first element of its chunk (a scan of ≤ 64 numbers held in
// the constant bank, the same for every thread of the block).
__device__ __forceinline__ int list_tensor(const int* first_block, int count, long& start) {
    int t = 0;
    while (t + 1 < count && (int)blockIdx.x >= first_block[t + 1]) t++;
    start = (long)(blockIdx.x - first_block[t]) * LIST_CHUNK;
    return t;
}
