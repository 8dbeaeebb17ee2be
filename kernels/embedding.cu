// embedding.cu — rows of a (possibly vocab-sliced) table picked by token id, and the backward.
//
// Math: out[t, :] = table[tokens[t] − first, :] if the id is in this rank's slice of `rows` ids,
// else 0 (vocab-parallel embedding); backward: dtable[id − first, :] += dout[t, :].
// Forward: one block per token, threads over the features.
// Backward, deterministic: a token id can appear many times, so instead of atomics each thread
// owns one feature column and walks the tokens in order, adding into its column: the same
// summation order as the CPU reference, every run.

template <typename T>
__device__ void embedding_forward(const T* table, const unsigned* tokens, long first, long rows, int dim, T* out) {
    long t = blockIdx.x;
    long id = (long)tokens[t] - first;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        store(out, t * dim + d, (id >= 0 && id < rows) ? load(table, id * dim + d) : 0.0f);
}

// dtable is f32 (gradients are f32 in both modes); dout is the compute type.
template <typename T>
__device__ void embedding_backward(const T* dout, const unsigned* tokens, long n_tokens, long first, long rows, int dim, float* dtable) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    for (long t = 0; t < n_tokens; t++) {
        long id = (long)tokens[t] - first;
        if (id >= 0 && id < rows) dtable[id * dim + d] += load(dout, t * dim + d);
    }
}

#define EXPORT(T, suffix)                                                                                          \
    extern "C" __global__ void embedding_forward_##suffix(const T* table, const unsigned* tokens, long first,       \
                                                          long rows, int dim, T* out) {                            \
        embedding_forward(table, tokens, first, rows, dim, out);                                                   \
    }                                                                                                              \
    extern "C" __global__ void embedding_backward_##suffix(const T* dout, const unsigned* tokens, long n_tokens,   \
                                                           long first, long rows, int dim, float* dtable) {        \
        embedding_backward(dout, tokens, n_tokens, first, rows, dim, dtable);                                      \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
