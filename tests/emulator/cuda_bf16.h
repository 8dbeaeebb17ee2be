// cuda_bf16.h for the CPU emulator (tests/kernels_emulated.rs): just enough of CUDA to run
// ferrotron's kernels on a CPU, one OS thread per CUDA thread. `kernels/common.cuh` includes
// <cuda_bf16.h>; with this folder first on the include path, it gets this file instead.
//
// A launch runs its blocks one after the other; a block's threads run at once, so
// `__syncthreads()` is a barrier over the block and `__shfl_xor_sync` an exchange through a
// barrier over the warp. `__shared__` variables are statics: shared by the block that runs.
// A thread that returns early leaves both barriers, as an exited CUDA thread does.
// gridDim, blockDim and the __shared__ statics are process-wide: one launch at a time.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

#define __global__
#define __device__ static
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

struct __nv_bfloat16 {
    uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) { // round to nearest, ties to even, as the GPU does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)}; // a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1);
    return {(uint16_t)(u >> 16)};
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

namespace emu {
struct Warp {
    std::barrier<> sync{32};
    float values[32];
};
// The barriers of one block: a thread that returns early leaves them (arrive_and_drop), as an
// exited CUDA thread stops counting for __syncthreads; the next block gets fresh ones.
struct Block {
    std::barrier<> sync;
    std::vector<Warp> warps;
    explicit Block(unsigned threads) : sync((ptrdiff_t)threads), warps(threads / 32) {}
};
inline thread_local std::barrier<>* block_sync;
inline thread_local Warp* warp_of_thread;
inline thread_local int lane_of_thread;

// Runs `kernel(args)` on every thread of every block of the grid: `threads` OS threads (a
// multiple of 32, as every launch has), which take the blocks one after the other.
inline void run(void (*kernel)(void**), void** args, dim3 grid, unsigned threads) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    std::vector<std::unique_ptr<Block>> blocks;
    for (unsigned b = 0; b < grid.x * grid.y * grid.z; b++) blocks.push_back(std::make_unique<Block>(threads));
    std::barrier<> between((ptrdiff_t)threads);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; t++)
        pool.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            lane_of_thread = t % 32;
            unsigned b = 0;
            for (unsigned z = 0; z < grid.z; z++)
                for (unsigned y = 0; y < grid.y; y++)
                    for (unsigned x = 0; x < grid.x; x++, b++) {
                        blockIdx = {x, y, z};
                        block_sync = &blocks[b]->sync;
                        warp_of_thread = &blocks[b]->warps[t / 32];
                        kernel(args);
                        block_sync->arrive_and_drop();
                        warp_of_thread->sync.arrive_and_drop();
                        between.arrive_and_wait(); // the block is done before the next one starts
                    }
        });
    for (auto& th : pool) th.join();
}
} // namespace emu

inline void __syncthreads() { emu::block_sync->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    emu::Warp* w = emu::warp_of_thread;
    w->values[emu::lane_of_thread] = v;
    w->sync.arrive_and_wait();
    float other = w->values[emu::lane_of_thread ^ offset];
    w->sync.arrive_and_wait();
    return other;
}

inline void __syncwarp(unsigned = 0xffffffff) { emu::warp_of_thread->sync.arrive_and_wait(); }
