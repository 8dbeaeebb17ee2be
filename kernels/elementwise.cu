// elementwise.cu — casts, residual adds, scaling, and the sum of squares for the gradient norm.
//
// Math: y = bf16(x) and back; a += b; a *= s; partial[b] = Σ x² over block b's elements;
// out[r] = Σ_j x[r, j]; x = 0.
// Decomposition: one thread per element, grid-stride loops. The sum of squares is deterministic:
// each block reduces a fixed range in a fixed order into partial[blockIdx.x], then `sum_rows`
// adds the partials in a fixed order (no atomics): the same bits every run.

extern "C" __global__ void cast_f32_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

extern "C" __global__ void cast_bf16_to_f32(const __nv_bfloat16* x, float* y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = __bfloat162float(x[i]);
}

template <typename T>
__device__ void add_assign(T* a, const T* b, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        store(a, i, load(a, i) + load(b, i));
}

template <typename T>
__device__ void scale(T* a, float s, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        store(a, i, load(a, i) * s);
}

// Gradients are f32 in both modes, so the norm reads f32 only. One launch sums the squares of up
// to LIST_TENSORS gradients (common.cuh): block b writes the sum of its chunk to partial[b], in a
// fixed order, and `sum_rows` adds every launch's partials in a fixed order.
extern "C" __global__ void sum_squares_list_f32(TensorList list, float* partial) {
    __shared__ float scratch[32];
    long start;
    int t = list_tensor(list.first_block, list.count, start);
    const float* x = list.x[t];
    long end = min(list.n[t], start + LIST_CHUNK);
    float acc = 0.0f;
    for (long i = start + threadIdx.x; i < end; i += blockDim.x) acc += x[i] * x[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Zeroes up to LIST_TENSORS f32 tensors (the gradients before a step), a chunk a block.
extern "C" __global__ void zero_list_f32(TensorList list) {
    long start;
    int t = list_tensor(list.first_block, list.count, start);
    long end = min(list.n[t], start + LIST_CHUNK);
    for (long i = start + threadIdx.x; i < end; i += blockDim.x) list.x[t][i] = 0.0f;
}

extern "C" __global__ void sum_rows_f32(const float* x, int cols, float* out) {
    __shared__ float scratch[32];
    long row = blockIdx.x;
    float acc = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) acc += x[row * cols + j];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[row] = acc;
}

#define EXPORT(T, suffix)                                                                             \
    extern "C" __global__ void add_assign_##suffix(T* a, const T* b, long n) { add_assign(a, b, n); } \
    extern "C" __global__ void scale_##suffix(T* a, float s, long n) { scale(a, s, n); }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
