// Block-level bf16 matrix x vector for T tokens: the block's rows of W (staged in shared memory
// by the bulk copy engine) times smem activations.
#pragma once
#include "common.cuh"

namespace qmk {

// The 8 activations of this lane's 8 weight columns, x = 32-byte aligned, lane * 8 floats into a
// 256-column segment. Read in column order, the 16-byte loads of lanes 4 apart hit the same banks
// (2-way conflicts: 98% of the kernel's excess shared-memory wavefronts in the H100 profile); lanes
// with bit 2 set read the upper half first, so each quarter warp touches 32 distinct banks.
__device__ __forceinline__ void ld_x8(const float* x, float4& a, float4& b) {
  const int sw = (threadIdx.x >> 2) & 1;
  const float4 p = *reinterpret_cast<const float4*>(x + 4 * sw);
  const float4 q = *reinterpret_cast<const float4*>(x + 4 - 4 * sw);
  a = sw ? q : p;
  b = sw ? p : q;
}

// 8 bf16 weights dot 8 fp32 activations held in registers.
__device__ __forceinline__ float dot8r(const uint4 w, const float4 a, const float4 b) {
  float s = lo_bf(w.x) * a.x;
  s = fmaf(hi_bf(w.x), a.y, s);
  s = fmaf(lo_bf(w.y), a.z, s);
  s = fmaf(hi_bf(w.y), a.w, s);
  s = fmaf(lo_bf(w.z), b.x, s);
  s = fmaf(hi_bf(w.z), b.y, s);
  s = fmaf(lo_bf(w.w), b.z, s);
  s = fmaf(hi_bf(w.w), b.w, s);
  return s;
}

// 8 bf16 weights (one uint4) dot the 8 fp32 activations at x (shared memory).
__device__ __forceinline__ float dot8(const uint4 w, const float* x) {
  float4 a, b;
  ld_x8(x, a, b);
  return dot8r(w, a, b);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Weight staging with the bulk copy engine (TMA, sm_90) ----------------------------------
// A phase's weight slice is a few contiguous row ranges; one thread per range issues a
// cp.async.bulk into shared memory that completes on the slot's mbarrier. No thread is held up
// issuing (unlike per-thread cp.async, whose issue stalled on a full memory queue), so the next
// phase's slice can stream in while this phase computes and waits at its grid barrier.
// Slots: X (q|k|v, gate|up, talker head), Y (o_proj, down), H (CP head, upper part of X).
enum { SLOT_X = 0, SLOT_Y = 1, SLOT_H = 2, NSLOTS = 3 };

// The warp that issues the bulk copies. Warp 1 (so that thread 0's barrier release and poll
// would not wait behind the issue) measured slower on the H100 than warp 0: frame 2890 vs
// 2660 us, same run.
#ifndef QMK_ISSUE_WARP
#define QMK_ISSUE_WARP 0
#endif
__device__ __forceinline__ bool is_issuer() { return (threadIdx.x >> 5) == QMK_ISSUE_WARP; }
__device__ __forceinline__ int issue_lane() { return threadIdx.x & 31; }

struct Stage {
  uint4* slot[NSLOTS];  // dynamic smem
  uint64_t* mbar;       // smem [NSLOTS], one arrival (the expect_tx) per use
  uint32_t parity;      // bit s: parity of mbar[s]'s next completion (same in every thread)

  __device__ void init() {
    if (threadIdx.x == 0)
      for (int s = 0; s < NSLOTS; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(mbar + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    parity = 0;
  }

  // Issuer warp: lane 0 announces `bytes` on slot s's mbarrier; then lanes issue their ranges.
  __device__ __forceinline__ void expect(int s, uint32_t bytes) const {
    if (issue_lane() == 0) {
      // generic-proxy reads of the slot (ordered by an earlier __syncthreads) before async writes
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(mbar + s)), "r"(bytes)
                   : "memory");
    }
    __syncwarp();
  }
  // One range: bytes (multiple of 16) from global src to slot s at byte offset off.
  __device__ __forceinline__ void copy(int s, uint32_t off, const void* src, uint32_t bytes) const {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(slot[s]) + off),
                 "l"(src), "r"(bytes), "r"(smem_u32(mbar + s))
                 : "memory");
  }
  // Every thread: wait until slot s's slice has landed.
  __device__ __forceinline__ void wait(int s) {
    const uint32_t par = (parity >> s) & 1u;
    const uint32_t a = smem_u32(mbar + s);
    uint32_t ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok)
                   : "r"(a), "r"(par)
                   : "memory");
    parity ^= 1u << s;
  }
};

// out_s[r * T + t] = dot(row r, xs[t]) in fp32 for the block's nrows rows staged in `stage`
// (row-major, K bf16 per row).
//   xs: smem fp32 [T][QMK_I] (row stride QMK_I, first K used); out_s: smem fp32 [nrows * T].
// Warp w owns rows w, w + NW, ...: it accumulates a row's K/256 units in registers and reduces
// once, in a fixed order, so results are bitwise reproducible. The caller has waited for the
// slot. Ends with __syncthreads() (the slot may be refilled after it).
template <int T, int K>
__device__ __forceinline__ void mv_rows(int nrows, const uint4* stage, const float* xs, float* out_s) {
  static_assert(K % 256 == 0, "K must be a multiple of 256");
  constexpr int S = K / 256;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < nrows; r += NW) {
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t] = 0.f;
#pragma unroll 4
    for (int seg = 0; seg < S; ++seg) {
      const uint4 w = stage[(r * S + seg) * 32 + lane];
      const float* xp = xs + seg * 256 + lane * 8;
#pragma unroll
      for (int t = 0; t < T; ++t) acc[t] += dot8(w, xp + t * QMK_I);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[t]);
      if (lane == 0) out_s[r * T + t] = v;
    }
  }
  __syncthreads();
}

// The same product, segment-major: warp w owns rows w, w + NW, ... (at most R of them). It walks
// the K/256 column segments once: each segment's activations are read from shared memory once
// per warp (not once per row) and applied to all of the warp's rows, whose partial sums stay in
// registers; one shuffle reduction per row at the end. Per row the additions happen in the same
// order as a row-by-row walk, so results are bitwise reproducible. With one or two rows per warp
// (o_proj, down: K = 2048, 3072) the segment loop is unrolled so that several weight loads are in
// flight. The caller has waited for the slot. Ends with __syncthreads() (the slot may be refilled
// after it).
template <int T, int K, int R>
__device__ __forceinline__ void mv_segs(int nrows, const uint4* stage, const float* xs, float* out_s) {
  static_assert(K % 256 == 0, "K must be a multiple of 256");
  constexpr int S = K / 256;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float acc[R][T];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[j][t] = 0.f;
  constexpr int UNROLL = R <= 2 ? 4 : 1;
#pragma unroll UNROLL
  for (int seg = 0; seg < S; ++seg) {
    float4 xa[T], xb[T];
#pragma unroll
    for (int t = 0; t < T; ++t) ld_x8(xs + t * QMK_I + seg * 256 + lane * 8, xa[t], xb[t]);
    uint4 w[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int r = warp + NW * j;
      if (r < nrows) w[j] = stage[(r * S + seg) * 32 + lane];
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (warp + NW * j < nrows) {
#pragma unroll
        for (int t = 0; t < T; ++t) acc[j][t] += dot8r(w[j], xa[t], xb[t]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int r = warp + NW * j;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[j][t]);
      if (lane == 0 && r < nrows) out_s[r * T + t] = v;
    }
  }
  __syncthreads();
}

// QMK_MV_CP / QMK_MV_TALKER: the code predictor's / talker's matrix products segment-major
// (mv_segs, 1) or row by row (mv_rows, 0). Both give bitwise the same results.
#ifndef QMK_MV_CP
#define QMK_MV_CP 1
#endif
#ifndef QMK_MV_TALKER
#define QMK_MV_TALKER 0
#endif
template <int T, int K, int R, bool SEGS>
__device__ __forceinline__ void mv_finish(int nrows, const uint4* stage, const float* xs, float* out_s) {
  if constexpr (SEGS) mv_segs<T, K, R>(nrows, stage, xs, out_s);
  else mv_rows<T, K>(nrows, stage, xs, out_s);
}

// Most rows per warp of a slice of `copies` x rows_of(rows) rows (grids of >= QMK_MIN_BLOCKS blocks).
constexpr int rows_per_warp(int rows, int copies = 1) {
  return (copies * ((rows + QMK_MIN_BLOCKS - 1) / QMK_MIN_BLOCKS) + NW - 1) / NW;
}

}  // namespace qmk
