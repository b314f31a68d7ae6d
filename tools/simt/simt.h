// SIMT on the CPU, for tests: a CUDA kernel written against csrc/batched/arch.cuh, compiled by a
// host C++ compiler, runs with every CUDA thread a fiber on one OS thread. Warp collectives
// (shuffles, votes, mma.sync), __syncthreads and polling loops yield to a scheduler; cp.async
// copies are queued and done when a wait_group retires their group, so a read that the kernel
// does before its wait sees the old bytes, as it could on a GPU. Dynamic shared memory starts as
// 0xFF bytes (NaN floats). Semantics follow PTX for what the kernels use; arithmetic is the
// host's IEEE fp32 / fp64 (an mma adds its 16 products to the accumulator in k order), so results
// match a GPU to rounding, not bitwise. A launch in which every live thread waits is a deadlock:
// simt::launch throws.
#pragma once
#include <setjmp.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <vector>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)

// ---- CUDA vector and bf16 types (the parts the kernels use) -------------------------------------
struct uint3 { unsigned x, y, z; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

struct __nv_bfloat16 { uint16_t bits; };
struct alignas(4) __nv_bfloat162 { __nv_bfloat16 x, y; };  // x: the low 16 bits
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {(uint16_t)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = (uint32_t)h.bits << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }

inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  const unsigned old = *p;
  if (old == cmp) *p = v;
  return old;
}

namespace simt {

struct Copy {
  void* dst;
  const void* src;
  int bytes;
};
struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  std::vector<char> stack;
  uint3 tid, bid;
  int block = 0, warp = 0;
  bool started = false, done = false;
  const unsigned* wait_gen = nullptr;  // blocked while *wait_gen == wait_val
  unsigned wait_val = 0;
  std::vector<Copy> open;                  // cp.async copies of the group not yet committed
  std::vector<std::vector<Copy>> groups;   // committed, not yet retired
};
struct Group {
  unsigned count = 0, gen = 0;
};
struct WarpState {
  Group bar;
  uint32_t slot[32][8];
};
struct BlockState {
  Group bar;
  std::vector<uint8_t> smem;
};
struct Launch {
  uint3 grid{1, 1, 1}, block{1, 1, 1};
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<BlockState> blocks;
  jmp_buf sched;
  Fiber* cur = nullptr;
  std::function<void()> body;
};

inline Launch*& launch_ptr() {
  static Launch* p = nullptr;
  return p;
}
inline Launch& L() { return *launch_ptr(); }
inline Fiber* cur() { return L().cur; }
inline uint8_t* block_smem() { return L().blocks[cur()->block].smem.data(); }

// Back to the scheduler; resumes here when picked again.
__attribute__((noinline)) inline void yield() {
  Fiber* f = cur();
  if (_setjmp(f->jb) == 0) _longjmp(L().sched, 1);
}
inline void barrier(Group& g, unsigned n) {
  const unsigned gen = g.gen;
  if (++g.count == n) {
    g.count = 0;
    ++g.gen;
    return;
  }
  Fiber* f = cur();
  f->wait_gen = &g.gen;
  f->wait_val = gen;
  yield();
}

inline void trampoline() {
  L().body();
  Fiber* f = cur();
  for (auto& g : f->groups)
    for (auto& c : g) c.bytes ? (void)memcpy(c.dst, c.src, 16) : (void)memset(c.dst, 0, 16);
  f->done = true;
  _longjmp(L().sched, 1);
}

// body() in every thread of a 1-D grid of 1-D blocks (block a multiple of 32), each block with
// smem_bytes of dynamic shared memory; returns when every thread has returned.
inline void launch(unsigned grid, unsigned block, size_t smem_bytes, std::function<void()> body,
                   size_t stack_bytes = 128 << 10) {
  if (block % 32) throw std::invalid_argument("simt: block size must be a multiple of 32");
  Launch l;
  l.grid = {grid, 1, 1};
  l.block = {block, 1, 1};
  l.body = std::move(body);
  l.fibers.resize((size_t)grid * block);
  l.warps.resize((size_t)grid * block / 32);
  l.blocks.resize(grid);
  for (auto& b : l.blocks) b.smem.assign(smem_bytes, 0xFF);
  for (size_t i = 0; i < l.fibers.size(); ++i) {
    Fiber& f = l.fibers[i];
    f.tid = {(unsigned)(i % block), 0, 0};
    f.bid = {(unsigned)(i / block), 0, 0};
    f.block = (int)(i / block);
    f.warp = (int)(i / 32);
    f.stack.resize(stack_bytes);
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack.data();
    f.uc.uc_stack.ss_size = f.stack.size();
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, trampoline, 0);
  }
  Launch* prev = launch_ptr();
  launch_ptr() = &l;
  for (;;) {
    bool alive = false, progress = false;
    for (auto& f : l.fibers) {
      if (f.done) continue;
      alive = true;
      if (f.wait_gen != nullptr && *f.wait_gen == f.wait_val) continue;
      f.wait_gen = nullptr;
      progress = true;
      l.cur = &f;
      if (_setjmp(l.sched) == 0) {
        if (!f.started) {
          f.started = true;
          ucontext_t from;
          swapcontext(&from, &f.uc);
        } else {
          _longjmp(f.jb, 1);
        }
      }
    }
    if (!alive) break;
    if (!progress) {
      launch_ptr() = prev;
      throw std::runtime_error("simt: deadlock (every live thread waits at a barrier)");
    }
  }
  launch_ptr() = prev;
}

inline WarpState& warp() { return L().warps[cur()->warp]; }
inline int lane() { return (int)(cur()->tid.x & 31u); }

template <class T>
inline T shfl_xor(T v, int o) {
  static_assert(sizeof(T) <= sizeof(WarpState::slot[0]), "shuffle of a larger type");
  WarpState& w = warp();
  const int l = lane();
  memcpy(w.slot[l], &v, sizeof(T));
  barrier(w.bar, 32);
  T r;
  memcpy(&r, w.slot[l ^ o], sizeof(T));
  barrier(w.bar, 32);
  return r;
}

}  // namespace simt

#define threadIdx (simt::cur()->tid)
#define blockIdx (simt::cur()->bid)
#define gridDim (simt::L().grid)
#define blockDim (simt::L().block)

inline void __syncthreads() { simt::barrier(simt::L().blocks[simt::cur()->block].bar, simt::L().block.x); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int o) { return simt::shfl_xor(v, o); }
inline unsigned __ballot_sync(unsigned, int pred) {
  simt::WarpState& w = simt::warp();
  const int l = simt::lane();
  w.slot[l][0] = pred != 0;
  simt::barrier(w.bar, 32);
  unsigned m = 0;
  for (int i = 0; i < 32; ++i) m |= (w.slot[i][0] ? 1u : 0u) << i;
  simt::barrier(w.bar, 32);
  return m;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::barrier(simt::warp().bar, 32); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }

// ---- csrc/batched/arch.cuh's primitives ----------------------------------------------------------
namespace qbk {

inline uint64_t globaltimer() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline void red_release_add(uint32_t* p, uint32_t v) { *p += v; }
inline uint32_t ld_acquire(const uint32_t* p) {
  simt::yield();  // a polling loop lets the other threads run
  return *p;
}

// m16n8k16 row.col bf16 -> fp32 with PTX's fragment layout: lane (g = lane / 4, t = lane % 4)
// holds A rows g and g + 8 at k = 2t, 2t + 1 (a0: row g, a1: row g + 8) and k = 2t + 8, 2t + 9
// (a2, a3); B column g at k = 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1); D rows g, g + 8 at
// columns 2t, 2t + 1. Each lane computes its own four outputs.
inline void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  simt::WarpState& w = simt::warp();
  const int l = simt::lane();
  uint32_t* s = w.slot[l];
  s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3, s[4] = b0, s[5] = b1;
  simt::barrier(w.bar, 32);
  const int g = l >> 2, t = l & 3;
  auto half = [](uint32_t r, int hi) { return __bfloat162float(__nv_bfloat16{(uint16_t)(hi ? r >> 16 : r & 0xffffu)}); };
  auto A = [&](int row, int k) {  // row < 16, k < 16
    const int src = (row & 7) * 4 + ((k & 7) >> 1);
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half(w.slot[src][reg], k & 1);
  };
  auto B = [&](int k, int col) {
    const int src = col * 4 + ((k & 7) >> 1);
    return half(w.slot[src][4 + (k >= 8 ? 1 : 0)], k & 1);
  };
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
  simt::barrier(w.bar, 32);
}

inline void cp_async16(void* dst, const void* src, int src_bytes) {
  simt::cur()->open.push_back({dst, src, src_bytes});
}
inline void cp_async_commit() {
  simt::Fiber* f = simt::cur();
  f->groups.push_back(std::move(f->open));
  f->open.clear();
}
template <int N>
inline void cp_async_wait() {
  simt::Fiber* f = simt::cur();
  while (f->groups.size() > (size_t)N) {
    for (auto& c : f->groups.front()) c.bytes ? (void)memcpy(c.dst, c.src, 16) : (void)memset(c.dst, 0, 16);
    f->groups.erase(f->groups.begin());
  }
}

}  // namespace qbk
