// Shared device helpers: bf16 rounding, loads, block reductions and the per-instance grid barrier.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../layout.h"

// QMK_TRACE (diagnostic builds only): thread 0 of blocks 0, G/2 and G-1 records clock64 cycles
// (relative to its block's start) in every phase: 0 its barrier arrive, 1 start and 2 end of the
// barrier wait, 3 start and 4 end of the wait for the phase's staged weight slice, 5 end of the
// matvec, 6 its barrier release done (the release fence passed); into st.dump (reinterpreted as
// uint32 [3][QMK_TRACE_EPOCHS][QMK_TRACE_MARKS]); the logits dump is then off.
#ifndef QMK_TRACE
#define QMK_TRACE 0
#endif
#define QMK_TRACE_EPOCHS 1024
#define QMK_TRACE_MARKS 7

namespace qmk {

constexpr int NT = QMK_THREADS;
constexpr int NW = QMK_WARPS;

// Block barriers of the compute threads (barrier 1, QMK_THREADS threads): the
// launch has a producer warpgroup beside them that never joins these.
__device__ __forceinline__ void bsync() { asm volatile("bar.sync 1, %0;" ::"n"(QMK_THREADS) : "memory"); }
__device__ __forceinline__ bool bsync_or(bool p) {
  uint32_t r;
  asm volatile(
      "{ .reg .pred q, o; setp.ne.u32 q, %1, 0; bar.red.or.pred o, 1, %2, q; selp.u32 %0, 1, 0, o; }"
      : "=r"(r)
      : "r"((uint32_t)p), "n"(QMK_THREADS)
      : "memory");
  return r != 0;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Round an fp32 value to bf16 and back: marks every point where qwen-tts (bf16) rounds.
__device__ __forceinline__ float rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// Rounding point of the bf16 model: applied only in bf16-exact mode.
__device__ __forceinline__ float rnd(float x, bool exact) { return exact ? rbf(x) : x; }
__device__ __forceinline__ float bf2f(qmk_bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ qmk_bf16 f2bf(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float lo_bf(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_bf(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Weights are read-only for the whole launch and streamed once: 16-byte, no L1 allocation.
__device__ __forceinline__ uint4 ld_weight(const qmk_bf16* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Buffers written by other blocks in this launch are read through L2 only (L1 is not coherent).
__device__ __forceinline__ float ld_bf_cg(const qmk_bf16* p) {
  return __uint_as_float(static_cast<uint32_t>(__ldcg(reinterpret_cast<const unsigned short*>(p))) << 16);
}
__device__ __forceinline__ uint2 ld_u2_cg(const void* p) { return __ldcg(reinterpret_cast<const uint2*>(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One key of a causal attention walk with an online softmax, for NQ (token, q head) rows of
// 4 dims per lane: score q.k (summed over the warp), then the running max m, sum l and
// output acc. Row r belongs to token p0 + r / 2 and sees keys j <= its position.
template <int NQ>
__device__ __forceinline__ void attend_key(const float (&qv)[NQ][4], const float* kk, const float* vv,
                                           int j, int p0, float scale, float (&m)[NQ], float (&l)[NQ],
                                           float (&acc)[NQ][4]) {
#pragma unroll
  for (int r = 0; r < NQ; ++r) {
    float sc = qv[r][0] * kk[0];
    sc = fmaf(qv[r][1], kk[1], sc);
    sc = fmaf(qv[r][2], kk[2], sc);
    sc = fmaf(qv[r][3], kk[3], sc);
    sc = warp_sum(sc) * scale;
    if (j <= p0 + r / 2) {  // causal: token t sees keys <= its position
      const float mn = fmaxf(m[r], sc);
      const float corr = expf(m[r] - mn);
      const float p = expf(sc - mn);
      l[r] = l[r] * corr + p;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][e] = fmaf(acc[r][e], corr, p * vv[e]);
      m[r] = mn;
    }
  }
}
// A warp's key walk over NQ rows starts from this lane's 4 dims of each q row (q: shared rows
// [NQ][HD]), max -inf, sum and output 0 ...
template <int NQ>
__device__ __forceinline__ void softmax_begin(const float (*q)[QMK_HD], int lane, float (&qv)[NQ][4], float (&m)[NQ],
                                              float (&l)[NQ], float (&acc)[NQ][4]) {
#pragma unroll
  for (int r = 0; r < NQ; ++r) {
    m[r] = neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) { qv[r][i] = q[r][lane * 4 + i]; acc[r][i] = 0.f; }
  }
}
// ... and ends by saving the state for the block's merge: merge[r] = (m, l, acc[0..HD)) (shared,
// this warp's rows).
template <int NQ>
__device__ __forceinline__ void softmax_save(float (*merge)[QMK_HD + 2], int lane, const float (&m)[NQ],
                                             const float (&l)[NQ], const float (&acc)[NQ][4]) {
#pragma unroll
  for (int r = 0; r < NQ; ++r) {
    if (lane == 0) { merge[r][0] = m[r]; merge[r][1] = l[r]; }
#pragma unroll
    for (int i = 0; i < 4; ++i) merge[r][2 + lane * 4 + i] = acc[r][i];
  }
}
// One q or k row of a head, 4 dims per lane (lane l: dims 4l .. 4l + 3): the per-head RMSNorm
// (fp32, cast, times weight nw) then rotate-half RoPE with cos/sin (already bf16-rounded where the
// model rounds); every product rounded as in bf16 torch in exact mode. Dims d and d +- 64 sit in
// lanes l and l ^ 16.
__device__ __forceinline__ void norm_rope(const float (&x)[4], const float (&nw)[4], const float (&cs)[4],
                                          const float (&sn)[4], float eps, bool exact, int lane, float (&r)[4]) {
  const float ss = warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
  const float rinv = 1.0f / sqrtf(ss / (float)QMK_HD + eps);
  float y[4], yp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = rnd(nw[i] * rnd(x[i] * rinv, exact), exact);
#pragma unroll
  for (int i = 0; i < 4; ++i) yp[i] = __shfl_xor_sync(0xffffffffu, y[i], 16);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float rot = lane < 16 ? -yp[i] : yp[i];
    r[i] = rnd(rnd(y[i] * cs[i], exact) + rnd(rot * sn[i], exact), exact);
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Deterministic block sum of one value per thread (fixed tree order). red: smem [NW].
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  bsync();
  if (l == 0) red[w] = v;
  bsync();
  float s = l < NW ? red[l] : 0.f;
  s = warp_sum(s);
  return s;
}
__device__ __forceinline__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  bsync();
  if (l == 0) red[w] = v;
  bsync();
  float s = l < NW ? red[l] : neg_inf();
  return warp_max(s);
}

// Rows [lo, hi) of n owned by block b of g: contiguous, balanced. 32-bit: n * g stays far below
// 2^31 here (n <= 4096 rows, g <= a few hundred blocks), and a 64-bit division costs registers.
__device__ __forceinline__ void rows_of(int b, int g, int n, int& lo, int& cnt) {
  lo = (n * b) / g;
  cnt = (n * (b + 1)) / g - lo;
}
// The same in whole 4-row groups (weight matrices in the tensor-core layout, ops/matvec.cuh).
__device__ __forceinline__ void rows4_of(int b, int g, int n, int& lo, int& cnt) {
  rows_of(b, g, n / 4, lo, cnt);
  lo *= 4;
  cnt *= 4;
}

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The bound on every spin-wait of the kernel (grid barrier, LL polls, staged slots, the producer's
// slot waits): every MASK + 1 rounds, give up if another block has raised an error, or once
// timeout_ns have passed since the first check (recorded as QMK_ERR_TIMEOUT, so every block leaves).
template <uint32_t MASK>
struct Spin {
  uint32_t rounds = 0;
  uint64_t t0 = 0;
  __device__ __forceinline__ bool give_up(uint32_t* sync, uint64_t timeout_ns) {
    if ((++rounds & MASK) != 0) return false;
    if (*reinterpret_cast<volatile uint32_t*>(sync + QMK_SYNC_ERR) != 0) return true;
    const uint64_t now = globaltimer();
    if (t0 == 0) {
      t0 = now;
    } else if (now - t0 > timeout_ns) {
      atomicCAS(sync + QMK_SYNC_ERR, 0u, (uint32_t)QMK_ERR_TIMEOUT);
      return true;
    }
    return false;
  }
};

__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Split-phase grid barrier over this engine instance's sync words (zeroed by the host before
// every launch, so no count from an earlier launch can leak in). The arrival counter only grows:
// epoch e is complete at e * gridDim.x arrivals. arrive(): after the block's bsync(), thread
// 0 adds 1 with release semantics (no round trip). wait(): thread 0 polls with acquire loads.
// Between the two a block may issue loads that do not depend on other blocks (the next phase's
// weights). The wait is bounded: past timeout_ns the block records QMK_ERR_TIMEOUT and every block
// leaves the kernel instead of hanging.
//
// LL words (NCCL's LL protocol): a phase whose outputs only a few blocks read (q|k|v rows, the
// talker's split-K states) publishes each value as one 64-bit word {fp32 bits, flag} with a
// relaxed gpu-scope store, and its readers poll their own words until the flag is the expected
// one: no barrier, no release fence (which waits for the SM's bulk copies in flight), and the data
// arrive with the poll. A single-copy-atomic 64-bit access never shows half a word, so a reader
// that sees the flag sees the value written with it. Flags are unique per (launch, q|k|v phase):
// ll_base = ll_seq << QMK_LL_USE_BITS (layout.h), and ll_next() numbers the phases. A buffer is
// rewritten only after barriers that every reader of its previous contents has passed.
struct Grid {
  uint32_t* sync;
  uint64_t timeout_ns;
  uint32_t epoch;
  uint32_t ll_base;
  uint32_t ll_use;
#if QMK_TRACE
  uint32_t* tr;   // this block's trace rows, or nullptr
  long long t0;
  uint32_t tep;   // trace row: advanced by every arrive and tick
  __device__ void mark(int k) const {
    if (tr != nullptr && threadIdx.x == 0 && tep < QMK_TRACE_EPOCHS)
      tr[tep * QMK_TRACE_MARKS + k] = (uint32_t)(clock64() - t0);
  }
  __device__ void next_row() { tep += 1; }
  __device__ void stamp(int k, uint32_t v) const {
    if (tr != nullptr && threadIdx.x == 0 && tep < QMK_TRACE_EPOCHS) tr[tep * QMK_TRACE_MARKS + k] = v;
  }
#else
  __device__ void stamp(int, uint32_t) const {}
  __device__ void mark(int) const {}
  __device__ void next_row() {}
#endif

  __device__ void arrive() {
    bsync();
    epoch += 1;
    next_row();
    mark(0);
    if (threadIdx.x == 0) red_release_add(sync + QMK_SYNC_BAR, 1u);
    mark(6);
  }
  // The end of a phase that publishes LL words instead of arriving (a new trace row).
  __device__ void tick() {
    bsync();
    next_row();
    mark(0);
  }

  __device__ bool wait(int* s_flag) {
    mark(1);
    if (threadIdx.x == 0) {
      const uint32_t target = epoch * gridDim.x;
      int ok = 1;
      Spin<255u> spin;
      while (ld_acquire(sync + QMK_SYNC_BAR) < target) {
        if (spin.give_up(sync, timeout_ns)) {
          ok = 0;
          break;
        }
      }
      *s_flag = ok;
    }
    mark(2);
    bsync();
    return *s_flag != 0;
  }

  __device__ bool sync_all(int* s_flag) {
    arrive();
    return wait(s_flag);
  }

  // The flag of the next q|k|v phase's LL words (every block numbers the phases alike).
  __device__ uint32_t ll_next() { return ll_base | ++ll_use; }
  __device__ uint32_t ll_flag() const { return ll_base | ll_use; }

  // Any thread: the N words at p (N even: 16-byte aligned) polled until each carries flag f;
  // their values -> v. Bounded like wait(): false on a timeout (recorded) or another block's error.
  template <int N>
  __device__ bool ll_get(const uint64_t* p, uint32_t f, float (&v)[N], uint32_t* rounds = nullptr) const {
    static_assert(N % 2 == 0, "pairs of words");
    Spin<63u> spin;
    while (true) {
      uint64_t w[N];
#pragma unroll
      for (int i = 0; i < N; i += 2)
        asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(w[i]), "=l"(w[i + 1]) : "l"(p + i) : "memory");
      bool ok = true;
#pragma unroll
      for (int i = 0; i < N; ++i) ok = ok && (uint32_t)(w[i] >> 32) == f;
      if (ok) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = __uint_as_float((uint32_t)w[i]);
        if (rounds != nullptr) *rounds = spin.rounds + 1;
        return true;
      }
      if (spin.give_up(sync, timeout_ns)) return false;
    }
  }
};

// One LL word: value v with flag f (relaxed, gpu scope, single-copy atomic).
__device__ __forceinline__ void ll_put(uint64_t* p, float v, uint32_t f) {
  const uint64_t w = (static_cast<uint64_t>(f) << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

}  // namespace qmk
