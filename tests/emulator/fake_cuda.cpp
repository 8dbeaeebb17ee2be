// A fake CUDA driver and cuBLAS for tests/gpu_path_emulated.rs: just the calls ferrotron makes
// through cudarc, so that the real binary runs its whole GPU path on a CPU. One "GPU" (compute
// capability 9.0), or FERROTRON_FAKE_GPUS of them (for the fake NCCL, fake_nccl.cpp, one per
// rank), each with its own context and all sharing the host's memory; device memory is host memory (a device pointer is a host address); every call
// is synchronous, so streams and events only record times; a module is the emulated kernels of
// this library (tests/emulator/cuda_bf16.h, linked in with the glue), found by name at
// cuModuleGetFunction and run by cuLaunchKernel, one launch at a time, with the dynamic shared
// memory it gives (past 48 KiB only for a function opted in by cuFuncSetAttribute, as a real
// driver demands); cublasGemmEx is a plain
// column-major GEMM with float accumulation, as cuBLAS defines it, summing over k in pieces
// chosen by the shape as cuBLAS's split-k kernels do. Built as libcuda.so and
// linked as libcublas.so too.
//
// Fault injection: FERROTRON_FAKE_CUDA_FAIL_LAUNCH=N makes the N-th kernel launch fault the way a
// real kernel does, asynchronously: the launch itself succeeds, and from then on the context is
// broken (CUDA_ERROR_ILLEGAL_ADDRESS, 700) for every synchronisation, copy and launch, and
// destroying a cuBLAS handle fails.
//
// Budgets: every call that costs the host or the GPU is counted (host synchronisations, copies
// each way with their bytes, uploads not from page-locked memory (cuMemHostAlloc), memsets, allocations, launches, GEMMs), and with
// FERROTRON_FAKE_CUDA_COUNTS=FILE the totals are written to FILE as JSON when the process ends;
// FP8 casts for GEMMs (fp8_operand_* launches, with the numbers they cast: rows × cols of their
// arguments) and cuBLASLt's heuristic queries are counted apart;
// tests/gpu_path_emulated.rs takes two runs' difference to get one training step's calls.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "cuda_bf16.h"

extern "C" int emu_launch(const char* name, unsigned x, unsigned y, unsigned z, unsigned block, unsigned shared, void** a);
extern "C" int emu_has(const char* name);

namespace {
typedef int CUresult;
const CUresult OK = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700;
CUresult sticky = OK; // the error a faulted kernel left behind
long launches_so_far = 0;

struct Counts {
    std::atomic<long> syncs{0}, dtoh{0}, dtoh_bytes{0}, htod{0}, htod_bytes{0}, htod_pageable{0}, dtod{0}, memsets{0},
        allocs{0}, launches{0}, gemms{0}, fp8_casts{0}, fp8_cast_numbers{0}, lt_heuristics{0};
    ~Counts() {
        const char* path = getenv("FERROTRON_FAKE_CUDA_COUNTS");
        FILE* f = path ? fopen(path, "w") : nullptr;
        if (!f) return;
        fprintf(f,
                "{\"syncs\": %ld, \"dtoh\": %ld, \"dtoh_bytes\": %ld, \"htod\": %ld, \"htod_bytes\": %ld, "
                "\"htod_pageable\": %ld, \"dtod\": %ld, \"memsets\": %ld, \"allocs\": %ld, \"launches\": %ld, "
                "\"gemms\": %ld, \"fp8_casts\": %ld, \"fp8_cast_numbers\": %ld, \"lt_heuristics\": %ld}\n",
                syncs.load(), dtoh.load(), dtoh_bytes.load(), htod.load(), htod_bytes.load(), htod_pageable.load(),
                dtod.load(), memsets.load(), allocs.load(), launches.load(), gemms.load(), fp8_casts.load(),
                fp8_cast_numbers.load(), lt_heuristics.load());
        fclose(f);
    }
} counts;
CUresult synced() { counts.syncs++; return sticky; }

// With FERROTRON_EMULATOR_COSTS=1, what the emulated kernels' memory instructions would cost a
// GPU (emu::Costs, cuda_bf16.h), per kernel and per launch, printed to stderr when the process
// ends: `ferrotron bench --op attention` on the fake driver reports its kernels' bank wavefronts,
// sectors and copies in flight.
struct CostsByKernel {
    std::map<std::string, std::pair<long, emu::Costs>> kernels; // name → launches, summed costs
    void add(const char* name, const emu::Costs& before, const emu::Costs& after) {
        auto& [launches, c] = kernels[name];
        launches++;
        c.ldmatrix += after.ldmatrix - before.ldmatrix, c.wavefronts += after.wavefronts - before.wavefronts;
        c.copies += after.copies - before.copies, c.sectors += after.sectors - before.sectors;
        c.copy_bytes += after.copy_bytes - before.copy_bytes;
        c.groups += after.groups - before.groups, c.mmas_in_flight += after.mmas_in_flight - before.mmas_in_flight;
    }
    ~CostsByKernel() {
        if (!getenv("FERROTRON_EMULATOR_COSTS")) return;
        auto per = [](unsigned long a, unsigned long b) { return b ? (double)a / b : 0.0; };
        fprintf(stderr, "emulator costs (tests/emulator/warp_ptx.h): ldmatrix and cp.async a launch; wavefronts an "
                        "ldmatrix (4: no bank conflict); sectors per 512 bytes copied (16: coalesced); mma.sync a group's copies "
                        "were in flight for (0: none hidden)\n");
        fprintf(stderr, "%-36s %8s %9s %11s %9s %12s %13s\n", "kernel", "launches", "ldmatrix", "wavefronts", "cp.async",
                "sectors/512B", "mma in flight");
        for (auto& [name, k] : kernels) {
            auto& [n, c] = k;
            if (!c.ldmatrix && !c.copies) continue; // a kernel without these instructions
            fprintf(stderr, "%-36s %8ld %9.1f %11.2f %9.1f %12.2f %13.2f\n", name.c_str(), n, per(c.ldmatrix, n),
                    per(c.wavefronts, c.ldmatrix), per(c.copies, n), per(512 * c.sectors, c.copy_bytes), per(c.mmas_in_flight, c.groups));
        }
    }
} costs_by_kernel;
} // namespace
extern "C" void fake_count_heuristic() { counts.lt_heuristics++; } // fake_cublaslt.cpp
namespace {
// page-locked host buffers (cuMemHostAlloc), start → bytes: a copy from anywhere else is "pageable"
std::map<uintptr_t, size_t> pinned;
std::mutex pinned_lock;
void count_upload(const void* src, size_t n) {
    counts.htod++, counts.htod_bytes += n;
    std::lock_guard<std::mutex> g(pinned_lock);
    auto at = pinned.upper_bound((uintptr_t)src);
    bool inside = at != pinned.begin() && (uintptr_t)src + n <= std::prev(at)->first + std::prev(at)->second;
    if (!inside) counts.htod_pageable++;
}
const int MAX_GPUS = 64;
int contexts[MAX_GPUS], pool_token, handle_token; // a context is the address of its ordinal's slot
thread_local void* current = &contexts[0];

int gpu_count() {
    const char* n = getenv("FERROTRON_FAKE_GPUS");
    int count = n ? atoi(n) : 1;
    return count < 1 ? 1 : count > MAX_GPUS ? MAX_GPUS : count;
}
std::mutex launches; // the emulator runs one launch at a time

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
} // namespace

extern "C" {
CUresult cuInit(unsigned) { return OK; }
CUresult cuDriverGetVersion(int* v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int* n) { *n = gpu_count(); return OK; }
CUresult cuDeviceGet(int* d, int ordinal) { return ordinal >= 0 && ordinal < gpu_count() ? (*d = ordinal, OK) : INVALID_DEVICE; }
CUresult cuDeviceGetName(char* name, int len, int) {
    const char* posing = getenv("FERROTRON_FAKE_GPU_NAME"); // a test's stand-in for a GPU of the device table
    snprintf(name, len, "%s", posing ? posing : "Fake CUDA device (CPU emulator)");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int) { *bytes = (size_t)16 << 30; return OK; }
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    *free_bytes = *total = (size_t)16 << 30;
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attribute, int) {
    switch (attribute) {
    case 75: *v = 9; break;   // compute capability major
    case 76: *v = 0; break;   // minor
    case 16: *v = 132; break; // multiprocessors
    case 115: *v = 1; break;  // memory pools supported
    case 8: *v = 48 << 10; break;   // shared memory a block, without opting in
    case 97: *v = 227 << 10; break; // shared memory a block, opted in (an H100's)
    default: *v = 0;
    }
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int d) { *ctx = &contexts[d]; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuCtxSetCurrent(void* ctx) { current = ctx; return OK; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = current; return OK; }
CUresult cuCtxGetDevice(int* d) { *d = (int*)current - contexts; return OK; }
CUresult cuCtxSynchronize() { return synced(); }
CUresult cuGetErrorString(CUresult r, const char** s) {
    *s = r == ILLEGAL_ADDRESS ? "an illegal memory access was encountered" : "fake CUDA driver error";
    return OK;
}
CUresult cuGetErrorName(CUresult r, const char** s) {
    *s = r == ILLEGAL_ADDRESS ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_FAKE";
    return OK;
}

CUresult cuStreamCreate(void** s, unsigned) { *s = malloc(1); return OK; }
CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { *s = malloc(1); return OK; }
CUresult cuStreamDestroy_v2(void* s) { free(s); return OK; }
CUresult cuStreamSynchronize(void*) { return synced(); }
CUresult cuStreamQuery(void*) { return OK; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return OK; }

// An event holds the time it was recorded at (everything before it has run: calls are synchronous).
CUresult cuEventCreate(void** e, unsigned) { *e = new double(0.0); return OK; }
CUresult cuEventDestroy_v2(void* e) { delete (double*)e; return OK; }
CUresult cuEventRecord(void* e, void*) { *(double*)e = now_ms(); return OK; }
CUresult cuEventSynchronize(void*) { return synced(); }
CUresult cuEventQuery(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* start, void* end) {
    *ms = (float)(*(double*)end - *(double*)start);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) { return cuEventElapsedTime(ms, start, end); }

CUresult cuMemAlloc_v2(uint64_t* p, size_t bytes) {
    counts.allocs++;
    size_t size = (bytes + 255) / 256 * 256 + 256;
    void* m = aligned_alloc(256, size);
    if (!m) return 2;   // out of memory
    memset(m, 0xff, size); // NaN in f32 and bf16: a kernel that skips an element of its output shows
    *p = (uint64_t)m;
    return OK;
}
CUresult cuMemAllocAsync(uint64_t* p, size_t bytes, void*) { return cuMemAlloc_v2(p, bytes); }
CUresult cuMemFree_v2(uint64_t p) { free((void*)p); return OK; }
CUresult cuMemFreeAsync(uint64_t p, void*) { return cuMemFree_v2(p); }
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = malloc(bytes ? bytes : 1);
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned[(uintptr_t)*p] = bytes;
    return *p ? OK : 2;
}
CUresult cuMemFreeHost(void* p) {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned.erase((uintptr_t)p);
    free(p);
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t n, void*) {
    count_upload(src, n);
    memcpy((void*)dst, src, n);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, uint64_t src, size_t n, void*) {
    counts.dtoh++, counts.dtoh_bytes += n;
    memcpy(dst, (void*)src, n);
    return sticky;
}
CUresult cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t n, void*) {
    counts.dtod++;
    memmove((void*)dst, (void*)src, n);
    return OK;
}
CUresult cuMemcpyHtoD_v2(uint64_t dst, const void* src, size_t n) {
    count_upload(src, n);
    memcpy((void*)dst, src, n);
    return OK;
}
CUresult cuMemcpyDtoH_v2(void* dst, uint64_t src, size_t n) {
    counts.dtoh++, counts.dtoh_bytes += n, counts.syncs++; // a synchronous copy waits for the GPU
    memcpy(dst, (void*)src, n);
    return sticky;
}
CUresult cuMemsetD8Async(uint64_t p, unsigned char v, size_t n, void*) {
    counts.memsets++;
    memset((void*)p, v, n);
    return OK;
}
CUresult cuMemsetD8_v2(uint64_t p, unsigned char v, size_t n) {
    counts.memsets++;
    memset((void*)p, v, n);
    return OK;
}
CUresult cuDeviceGetDefaultMemPool(void** pool, int) { *pool = &pool_token; return OK; }
CUresult cuMemPoolSetAttribute(void* pool, int, void* value) { return pool == &pool_token && value ? OK : INVALID_VALUE; }

// Modules: the PTX is ignored; kernels are the emulated ones, looked up by name.
CUresult cuModuleLoadData(void** m, const void* ptx) { *m = (void*)ptx; return ptx ? OK : INVALID_VALUE; }
CUresult cuModuleUnload(void*) { return OK; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    if (!emu_has(name)) return NOT_FOUND;
    *f = strdup(name);
    return OK;
}
// Dynamic shared memory: a launch may give a block up to 48 KiB of it; more only to a function
// whose CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8) was raised first, at most to the
// device's opt-in limit (an H100's 227 KiB) — as a real driver, which fails such a launch with
// CUDA_ERROR_INVALID_VALUE. The attribute is kept per function (name).
const int STATIC_LIMIT = 48 << 10, OPT_IN_LIMIT = 227 << 10, MAX_DYNAMIC_SHARED = 8;
std::map<std::string, int> dynamic_shared_allowed;
std::mutex attributes;
CUresult cuFuncSetAttribute(void* f, int attribute, int value) {
    if (attribute != MAX_DYNAMIC_SHARED || value < 0 || value > OPT_IN_LIMIT) return INVALID_VALUE;
    std::lock_guard<std::mutex> lock(attributes);
    dynamic_shared_allowed[(const char*)f] = value;
    return OK;
}
CUresult cuFuncGetAttribute(int* v, int attribute, void* f) {
    if (attribute != MAX_DYNAMIC_SHARED) return INVALID_VALUE;
    std::lock_guard<std::mutex> lock(attributes);
    auto it = dynamic_shared_allowed.find((const char*)f);
    *v = it == dynamic_shared_allowed.end() ? STATIC_LIMIT : it->second;
    return OK;
}
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, void*, void** params, void** extra) {
    if (by != 1 || bz != 1 || bx % 32 != 0 || extra) return INVALID_VALUE;
    int allowed;
    cuFuncGetAttribute(&allowed, MAX_DYNAMIC_SHARED, f);
    if (shared_bytes > (unsigned)std::max(allowed, STATIC_LIMIT)) return INVALID_VALUE;
    std::lock_guard<std::mutex> one_at_a_time(launches);
    counts.launches++;
    if (!strncmp((const char*)f, "fp8_operand_", 12)) // (x, rows, cols, …)
        counts.fp8_casts++, counts.fp8_cast_numbers += *(const long*)params[1] * *(const long*)params[2];
    if (sticky != OK) return sticky;
    const char* fail = getenv("FERROTRON_FAKE_CUDA_FAIL_LAUNCH");
    if (fail && ++launches_so_far == atol(fail)) {
        sticky = ILLEGAL_ADDRESS; // this kernel "faults": the error shows at the next sync
        return OK;
    }
    emu::Costs before = emu::costs;
    int launched = emu_launch((const char*)f, gx, gy, gz, bx, shared_bytes, params);
    costs_by_kernel.add((const char*)f, before, emu::costs);
    return launched == 0 ? OK : NOT_FOUND;
}

// cuBLAS: C = alpha·op(A)·op(B) + beta·C, column-major, f32 or bf16 matrices, float arithmetic.
int cublasCreate_v2(void** h) { *h = &handle_token; return 0; }
int cublasDestroy_v2(void*) { return sticky == OK ? 0 : 14; } // CUBLAS_STATUS_INTERNAL_ERROR
int cublasSetStream_v2(void*, void*) { return 0; }
int cublasGemmEx(void*, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int atype, int lda,
                 const void* b, int btype, int ldb, const void* beta, void* c, int ctype, int ldc, int, int) {
    auto at = [](const void* p, int type, long i) {
        return type == 0 ? ((const float*)p)[i] : __bfloat162float(((const __nv_bfloat16*)p)[i]);
    };
    counts.gemms++;
    float al = *(const float*)alpha, be = *(const float*)beta;
    // cuBLAS picks its kernel by the shape, and so the order of the sum over k: a small output
    // over a long k is split into pieces summed apart, then added (split-k). Modelled so that, as
    // on a GPU, the same rows multiplied in a product of another shape (fewer rows a rank, half
    // the columns) can round differently — which the CPU's products never do.
    int pieces = (long)m * n <= 4096 && k >= 256 ? 4 : (long)m * n <= 65536 && k >= 128 ? 2 : 1;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int piece = 0; piece < pieces; piece++) {
                float part = 0.0f;
                for (int l = (long)k * piece / pieces; l < (long)k * (piece + 1) / pieces; l++) {
                    float x = ta ? at(a, atype, (long)i * lda + l) : at(a, atype, (long)l * lda + i);
                    float y = tb ? at(b, btype, (long)l * ldb + j) : at(b, btype, (long)j * ldb + l);
                    part += x * y;
                }
                acc += part;
            }
            long o = (long)j * ldc + i;
            float v = al * acc + (be == 0.0f ? 0.0f : be * at(c, ctype, o));
            if (ctype == 0) ((float*)c)[o] = v;
            else ((__nv_bfloat16*)c)[o] = __float2bfloat16(v);
        }
    return 0;
}
}
