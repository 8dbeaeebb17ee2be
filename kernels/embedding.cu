// embedding.cu — rows of a (possibly vocab-sliced) table picked by token id, and the backward.
//
// Math: out[t, :] = table[tokens[t] − first, :] if the id is in this rank's slice of `rows` ids,
// else 0 (vocab-parallel embedding); backward: dtable[id − first, :] += dout[t, :].
// Forward: one block per token, threads over the features.
// Backward, deterministic: a token id can appear many times, so instead of atomics the host
// groups the token positions by id (`launch_table::tokens_by_id`), and one block per distinct id, its
// threads over the features, adds that id's rows of dout in token order: the same summation
// order as the CPU reference, every run, with as many blocks as the batch has distinct tokens.

template <typename T>
__device__ void embedding_forward(const T* table, const unsigned* tokens, long first, long rows, int dim, T* out) {
    long t = blockIdx.x;
    long id = (long)tokens[t] - first;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        store(out, t * dim + d, (id >= 0 && id < rows) ? load(table, id * dim + d) : 0.0f);
}

// dtable is f32 (gradients are f32 in both modes); dout is the compute type. Distinct id u is
// table row rows[u]; its tokens are order[starts[u]] .. order[starts[u + 1] − 1].
template <typename T>
__device__ void embedding_backward(const T* dout, const unsigned* rows, const unsigned* starts, const unsigned* order,
                                   int dim, float* dtable) {
    long u = blockIdx.x, row = rows[u];
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = dtable[row * dim + d];
        for (unsigned e = starts[u]; e < starts[u + 1]; e++) acc += load(dout, (long)order[e] * dim + d);
        dtable[row * dim + d] = acc;
    }
}

#define EXPORT(T, suffix)                                                                                          \
    extern "C" __global__ void embedding_forward_##suffix(const T* table, const unsigned* tokens, long first,       \
                                                          long rows, int dim, T* out) {                            \
        embedding_forward(table, tokens, first, rows, dim, out);                                                   \
    }                                                                                                              \
    extern "C" __global__ void embedding_backward_##suffix(const T* dout, const unsigned* rows,                    \
                                                           const unsigned* starts, const unsigned* order, int dim, \
                                                           float* dtable) {                                        \
        embedding_backward(dout, rows, starts, order, dim, dtable);                                                \
    }
EXPORT(float, f32)
EXPORT(__nv_bfloat16, bf16)
