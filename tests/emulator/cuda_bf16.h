// cuda_bf16.h for the CPU emulator (tests/kernels_emulated.rs, tests/gpu_path_emulated.rs): just
// enough of CUDA to run ferrotron's kernels on a CPU. `kernels/common.cuh` includes
// <cuda_bf16.h>; with this folder first on the include path, it gets this file instead.
//
// Every CUDA thread is a fiber (a ucontext with its own stack) on the calling OS thread. A launch
// runs its blocks one after the other; within a block the fibers take turns: each runs until it
// reaches a barrier (`__syncthreads`, `__syncwarp`, the two halves of a warp shuffle), then
// yields; a barrier opens when every thread of its block (or warp) that has not returned has
// reached it, as on a GPU, where an exited thread stops counting. A round in which no thread
// moves means some threads wait at a barrier others never reach: the emulator says so and stops.
// `__shared__` variables are statics: shared by the block that runs; dynamic shared memory
// (`extern __shared__`, warp_ptx.h's DYNAMIC_SHARED) is a window sized by the launch, poisoned at
// each block and guarded past its end (emu::window). One launch at a time.
// Kernels that use PTX (kernels/flash_attention.cu) test FERROTRON_EMULATOR and include
// warp_ptx.h, which emulates those instructions lane by lane.
#pragma once
#define FERROTRON_EMULATOR 1
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <ucontext.h>
#include <vector>

using std::max;
using std::min;

#define __global__
#define __device__ static
#define __forceinline__ inline
#define __launch_bounds__(...) // register and occupancy hints: nothing to do on the CPU
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct __align__(8) uint2 {
    unsigned x, y;
};
struct __align__(16) uint4 {
    unsigned x, y, z, w;
};
struct __align__(8) float2 {
    float x, y;
};
struct __align__(16) float4 {
    float x, y, z, w;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline dim3 threadIdx, blockIdx;
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
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

namespace emu {
// A barrier of `expected` threads; `generation` counts its openings.
struct Barrier {
    unsigned expected = 0, arrived = 0, generation = 0;
};
// A copy of cp.async (warp_ptx.h): `bytes` of `src` land at `dst` when a wait retires its group;
// `bytes` < 16 fills the rest with zeros.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes;
};
struct Fiber {
    ucontext_t context;
    std::vector<char> stack = std::vector<char>(256 << 10);
    bool done = false;
    std::vector<AsyncCopy> issued;                 // cp.async copies not yet committed to a group
    std::vector<std::vector<AsyncCopy>> groups;    // committed groups, oldest first, not yet retired
    unsigned long copies = 0, mmas = 0;            // cp.async and mma.sync this thread ran in its block
    std::vector<unsigned long> committed_at;       // `mmas` when each group in `groups` was committed
};
// What the kernels' memory instructions would cost a GPU, counted as they run (warp_ptx.h), so
// that a change to a kernel's layout or pipelining shows without a GPU:
//   ldmatrix, wavefronts   warp ldmatrix.x4 instructions, and the shared-memory wavefronts they
//                          take: a wavefront serves 32 banks of 4 bytes, so each 8-row matrix
//                          takes as many as the most distinct words any one bank holds in it
//                          (4 an instruction: no bank conflict)
//   copies, sectors, copy_bytes  warp cp.async instructions (a thread's n-th copy with its
//                          warp's n-th copies), the 32-byte global sectors they read and the bytes
//                          they copy (16 a lane): 16 sectors per 512 bytes when every warp reads
//                          whole sectors (coalesced)
//   groups, mmas_in_flight copy groups with copies retired by a wait (each thread's), and the
//                          mma.sync its warp ran between the group's commit and that wait: the
//                          work the copies hide behind (0: each is waited for before any product)
struct Costs {
    unsigned long ldmatrix = 0, wavefronts = 0, copies = 0, sectors = 0, copy_bytes = 0, groups = 0, mmas_in_flight = 0;
};
inline Costs costs;
// A warp's n-th cp.async: the sectors its lanes' valid copies read.
struct WarpCopy {
    std::vector<uintptr_t> sectors;
};
// What the lanes of a warp exchange at a warp-collective instruction: each lane writes its slot,
// the warp meets at `sync`, each lane reads the slots it needs, the warp meets again.
struct Warp {
    Barrier sync;
    alignas(16) unsigned char slot[32][64];
    std::vector<WarpCopy> copies; // by n, folded into `costs` when the block ends
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline Fiber* current;
inline Barrier block_sync;
inline std::vector<Warp> warps;
inline unsigned long moves; // arrivals at barriers, openings and exits: a round without any is stuck
inline void (*running_kernel)(void**);
inline void** running_args;
// Dynamic shared memory (`extern __shared__`, its size given by the launch): a kernel file's
// DYNAMIC_SHARED (warp_ptx.h) names this window. Each block finds it filled with 0xff bytes (a bf16
// or f32 NaN: a read before a write shows in the results), and past its end GUARD more of them: a
// block that wrote there stops the emulator, one that read there computes NaN.
constexpr unsigned GUARD = 1024;
inline std::vector<unsigned char> window;
inline unsigned window_bytes;
inline unsigned char* dynamic_window() { return window.data() + (128 - (uintptr_t)window.data() % 128) % 128; }

inline int lane() { return threadIdx.x % 32; }
inline Warp& warp() { return warps[threadIdx.x / 32]; }

inline void yield() { swapcontext(&current->context, &scheduler); }

inline void open_if_full(Barrier& b) {
    if (b.arrived > 0 && b.arrived == b.expected) {
        b.arrived = 0;
        b.generation++;
        moves++;
    }
}

inline void wait(Barrier& b) {
    unsigned generation = b.generation;
    b.arrived++;
    moves++;
    open_if_full(b);
    while (b.generation == generation) yield();
}

inline void fiber_main() {
    running_kernel(running_args);
    current->done = true;
    moves++;
    block_sync.expected--; // an exited thread stops counting
    open_if_full(block_sync);
    warp().sync.expected--;
    open_if_full(warp().sync);
} // returns to the scheduler (uc_link)

// Runs `kernel(args)` on every thread of every block of the grid (`threads` a multiple of 32, as
// every launch has), each block with `shared_bytes` of dynamic shared memory.
inline void run(void (*kernel)(void**), void** args, dim3 grid, unsigned threads, unsigned shared_bytes) {
    gridDim = grid;
    blockDim = {threads, 1, 1};
    running_kernel = kernel;
    running_args = args;
    window_bytes = shared_bytes;
    window.resize(shared_bytes + GUARD + 128); // (+128: room to start on 128 bytes)
    if (fibers.size() < threads) fibers.resize(threads);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                memset(dynamic_window(), 0xff, shared_bytes + GUARD);
                block_sync = Barrier{threads};
                warps.assign(threads / 32, Warp{Barrier{32}, {}});
                for (unsigned t = 0; t < threads; t++) {
                    Fiber& f = fibers[t];
                    f.done = false;
                    f.issued.clear();
                    f.groups.clear();
                    f.copies = f.mmas = 0;
                    f.committed_at.clear();
                    getcontext(&f.context);
                    f.context.uc_stack = {f.stack.data(), 0, f.stack.size()};
                    f.context.uc_link = &scheduler;
                    makecontext(&f.context, fiber_main, 0);
                }
                for (unsigned live = threads; live > 0;) {
                    unsigned long before = moves;
                    live = 0;
                    for (unsigned t = 0; t < threads; t++) {
                        if (fibers[t].done) continue;
                        current = &fibers[t];
                        threadIdx = {t, 0, 0};
                        swapcontext(&scheduler, &current->context);
                        live += !fibers[t].done;
                    }
                    if (live > 0 && moves == before) {
                        fprintf(stderr, "emulator: block (%u,%u,%u): %u threads wait at a barrier that the others never reach\n", x, y, z, live);
                        abort();
                    }
                }
                for (unsigned i = 0; i < GUARD; i++)
                    if (dynamic_window()[shared_bytes + i] != 0xff) {
                        fprintf(stderr, "emulator: block (%u,%u,%u) wrote past the %u bytes of dynamic shared memory its launch gave\n", x, y, z, shared_bytes);
                        abort();
                    }
                for (Warp& w : warps) // each warp copy: the distinct sectors its lanes read
                    for (WarpCopy& c : w.copies) {
                        std::sort(c.sectors.begin(), c.sectors.end());
                        costs.copies++;
                        costs.copy_bytes += 16 * c.sectors.size();
                        costs.sectors += std::unique(c.sectors.begin(), c.sectors.end()) - c.sectors.begin();
                    }
            }
}
} // namespace emu

inline void __syncthreads() { emu::wait(emu::block_sync); }
inline void __trap() { // on a GPU: the launch fails (an unspecified launch failure)
    fprintf(stderr, "emulator: block (%u,%u,%u) thread %u trapped (__trap)\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
    abort();
}

namespace emu {
// Every lane gives `mine` and gets the value of lane `from(lane)`: one exchange through the slots.
template <typename T, typename From>
T exchange(T mine, From from) {
    static_assert(sizeof(T) <= sizeof(Warp::slot[0]));
    Warp& w = warp();
    memcpy(w.slot[lane()], &mine, sizeof(T));
    wait(w.sync);
    T other;
    memcpy(&other, w.slot[from(lane())], sizeof(T));
    wait(w.sync);
    return other;
}
} // namespace emu

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int offset) {
    return emu::exchange(v, [offset](int lane) { return lane ^ offset; });
}

namespace emu {
// One value a lane in, the warp's `op` of them out to every lane (the full mask: every lane present).
template <typename Op>
unsigned reduce(unsigned v, Op op, const char* name) {
    Warp& w = warp();
    if (w.sync.expected != 32) {
        fprintf(stderr, "emulator: %s(0xffffffff) after some lanes of the warp returned\n", name);
        abort();
    }
    memcpy(w.slot[lane()], &v, sizeof v);
    wait(w.sync);
    unsigned all;
    memcpy(&all, w.slot[0], sizeof all);
    for (int l = 1; l < 32; l++) {
        unsigned other;
        memcpy(&other, w.slot[l], sizeof other);
        all = op(all, other);
    }
    wait(w.sync);
    return all;
}
} // namespace emu

// Whether `p` holds on any lane of the warp (every lane gets the same answer).
inline int __any_sync(unsigned, int p) {
    return emu::reduce(p != 0, [](unsigned a, unsigned b) { return a | b; }, "__any_sync");
}

// __reduce_min_sync / __reduce_max_sync (sm_80+, one REDUX instruction): the warp's smallest or
// largest unsigned value, for every lane.
inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    return emu::reduce(v, [](unsigned a, unsigned b) { return a < b ? a : b; }, "__reduce_min_sync");
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    return emu::reduce(v, [](unsigned a, unsigned b) { return a > b ? a : b; }, "__reduce_max_sync");
}

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

inline void __syncwarp(unsigned = 0xffffffff) { emu::wait(emu::warp().sync); }
