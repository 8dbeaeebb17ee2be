// warp_ptx.h for the CPU emulator: the PTX instructions kernels/flash_attention.cu uses, with the
// per-lane semantics of the PTX ISA, so that a wrong fragment index gives a wrong result here as
// it would on a GPU. (On a GPU the kernel file wraps the same names around inline `asm`.)
//
//   mma_16x8x16     mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: C (16×8, fp32) += A (16×16,
//                   bf16) · B (16×8, bf16), the operands spread over the warp's 32 lanes: lane l is
//                   in group g = l / 4 at place t = l % 4 and holds
//                     A: a0 = A[g][2t..2t+1]   a1 = A[g+8][2t..2t+1]   a2 = A[g][2t+8..]   a3 = A[g+8][2t+8..]
//                     B: b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//                     C: c0, c1 = C[g][2t], C[g][2t+1]   c2, c3 = C[g+8][2t], C[g+8][2t+1]
//                   (two bf16 in a 32-bit register: the lower-numbered element in the low half).
//   smem_t, smem    a shared-memory address: on a GPU the 32-bit address of the shared window
//                   (cvta.to.shared, made once per tile, then plus constant offsets); here a byte
//                   pointer, so that the same `base + bytes` arithmetic reaches the same element.
//   fast_exp2       ex2.approx.ftz.f32: 2^x in one MUFU instruction (relative error about 2^-22,
//                   subnormal results flushed to zero); here exp2f, with the same flush.
//   ldmatrix_x4     ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8×8 bf16 matrices from shared
//                   memory; lanes 8i..8i+7 give the addresses of the 8 rows of matrix i (16 bytes
//                   each, 16-byte aligned); register i of lane l gets row l / 4, columns 2(l % 4)
//                   and 2(l % 4) + 1 of matrix i. With .trans (ldmatrix_x4_trans) it gets column
//                   l / 4, rows 2(l % 4) and 2(l % 4) + 1: the matrix transposed.
//   cp_async_16     cp.async.cg.shared.global, 16 bytes (zeros where the source is not valid):
//                   the copy happens later, when a cp.async.wait_group retires its group. Here it
//                   happens exactly then, so a kernel that reads before waiting reads old data.
//   cp_async_commit cp.async.commit_group: the copies issued since the last commit form a group.
//   cp_async_wait<N> cp.async.wait_group N: every group but the newest N has landed.
//   red_add         red.global.add.f32: *p += v in the memory system, no value returned.
//   DYNAMIC_SHARED  extern __shared__ (the block's dynamic shared memory, sized by the launch), and
//   dynamic_shared_bytes  that size (%dynamic_smem_size): the window of emu::run.
//
// A warp-collective instruction needs all 32 lanes: one reached after some lanes returned stops
// the emulator, as would a misaligned address. Each instruction also adds what it would cost a GPU
// to emu::costs (cuda_bf16.h): ldmatrix its bank wavefronts, cp.async its sectors, mma.sync the
// copies in flight while it runs.
#pragma once
#include "cuda_bf16.h"

namespace emu {
inline void whole_warp(const char* instruction) {
    if (warp().sync.expected != 32) {
        fprintf(stderr, "emulator: %s after some lanes of the warp returned\n", instruction);
        abort();
    }
}
inline void aligned(const void* p, unsigned bytes, const char* instruction) {
    if ((uintptr_t)p % bytes != 0) {
        fprintf(stderr, "emulator: %s at %p, not %u-byte aligned\n", instruction, p, bytes);
        abort();
    }
}
inline float low(unsigned r) { return __bfloat162float({(uint16_t)(r & 0xffff)}); }
inline float high(unsigned r) { return __bfloat162float({(uint16_t)(r >> 16)}); }
} // namespace emu

typedef char* smem_t;
inline smem_t smem(const void* p) { return (char*)p; }

// extern __shared__: the launch's window (cuda_bf16.h), and its size as %dynamic_smem_size gives it.
#define DYNAMIC_SHARED(name) unsigned char* name = emu::dynamic_window()
inline unsigned dynamic_shared_bytes() { return emu::window_bytes; }

inline float fast_exp2(float x) {
    float y = exp2f(x);
    return y < 1.17549435e-38f ? 0.0f : y; // ftz: a subnormal result is flushed to zero
}

// c (this lane's 4 accumulators) += A · B; a: this lane's 4 registers of A, b: its 2 of B.
inline void mma_16x8x16(float* c, const unsigned* a, const unsigned* b) {
    emu::whole_warp("mma.sync");
    emu::Warp& w = emu::warp();
    emu::current->mmas++;
    unsigned mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    memcpy(w.slot[emu::lane()], mine, sizeof mine);
    emu::wait(w.sync);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        unsigned r[6];
        memcpy(r, w.slot[l], sizeof r);
        int g = l / 4, t = l % 4;
        for (int half = 0; half < 2; half++) { // the registers' two elements: columns 2t and 2t + 1
            auto part = half ? emu::high : emu::low;
            A[g][2 * t + half] = part(r[0]);
            A[g + 8][2 * t + half] = part(r[1]);
            A[g][2 * t + 8 + half] = part(r[2]);
            A[g + 8][2 * t + 8 + half] = part(r[3]);
            B[2 * t + half][g] = part(r[4]);
            B[2 * t + 8 + half][g] = part(r[5]);
        }
    }
    emu::wait(w.sync);
    int g = emu::lane() / 4, t = emu::lane() % 4;
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float sum = c[e];
        for (int k = 0; k < 16; k++) sum += A[row][k] * B[k][col];
        c[e] = sum;
    }
}

namespace emu {
inline void ldmatrix(unsigned* r, smem_t address, bool transposed) {
    const __nv_bfloat16* row = (const __nv_bfloat16*)address;
    whole_warp("ldmatrix");
    aligned(row, 16, "ldmatrix");
    Warp& w = warp();
    memcpy(w.slot[lane()], &row, sizeof row);
    wait(w.sync);
    int l = lane();
    if (l == 0) { // the instruction's wavefronts: per matrix, its busiest bank's distinct words
        costs.ldmatrix++;
        for (int i = 0; i < 4; i++) {
            uintptr_t words[32];
            for (int r = 0; r < 8; r++) {
                uintptr_t at;
                memcpy(&at, w.slot[8 * i + r], sizeof at);
                for (int k = 0; k < 4; k++) words[4 * r + k] = at / 4 + k;
            }
            std::sort(words, words + 32);
            unsigned distinct = std::unique(words, words + 32) - words, per_bank[32] = {}, busiest = 0;
            for (unsigned k = 0; k < distinct; k++) busiest = std::max(busiest, ++per_bank[words[k] % 32]);
            costs.wavefronts += busiest;
        }
    }
    for (int i = 0; i < 4; i++) {
        auto at = [&](int r, int c) { // element (r, c) of matrix i: row r's address came from lane 8i + r
            const __nv_bfloat16* p;
            memcpy(&p, w.slot[8 * i + r], sizeof p);
            return __bfloat16_as_ushort(p[c]);
        };
        unsigned lo = transposed ? at(2 * (l % 4), l / 4) : at(l / 4, 2 * (l % 4));
        unsigned hi = transposed ? at(2 * (l % 4) + 1, l / 4) : at(l / 4, 2 * (l % 4) + 1);
        r[i] = lo | hi << 16;
    }
    wait(w.sync);
}
} // namespace emu

inline void ldmatrix_x4(unsigned* r, smem_t row) { emu::ldmatrix(r, row, false); }
inline void ldmatrix_x4_trans(unsigned* r, smem_t row) { emu::ldmatrix(r, row, true); }

inline void red_add(float* p, float v) { *p += v; } // the fibers take turns: no other lane is between

inline void cp_async_16(smem_t dst, const void* src, bool valid) {
    emu::aligned(dst, 16, "cp.async (shared)");
    emu::aligned(src, 16, "cp.async (global)");
    emu::current->issued.push_back({dst, src, valid ? 16u : 0u});
    auto& copies = emu::warp().copies; // this lane's n-th copy joins its warp's n-th
    unsigned long n = emu::current->copies++;
    if (copies.size() <= n) copies.resize(n + 1);
    if (valid) copies[n].sectors.push_back((uintptr_t)src / 32); // (src-size 0 reads nothing)
}

inline void cp_async_commit() {
    emu::current->groups.push_back(std::move(emu::current->issued));
    emu::current->committed_at.push_back(emu::current->mmas);
    emu::current->issued.clear();
}

template <int N>
inline void cp_async_wait() {
    auto& groups = emu::current->groups;
    auto& committed_at = emu::current->committed_at;
    while (groups.size() > (size_t)N) {
        for (const emu::AsyncCopy& c : groups.front()) {
            memset(c.dst, 0, 16);
            memcpy(c.dst, c.src, c.bytes);
        }
        if (!groups.front().empty()) { // an empty group hides nothing
            emu::costs.groups++;
            emu::costs.mmas_in_flight += emu::current->mmas - committed_at.front();
        }
        groups.erase(groups.begin());
        committed_at.erase(committed_at.begin());
    }
}
