// Block-level bf16 matrix x vector for T tokens: the block's rows of W times smem activations.
#pragma once
#include "common.cuh"

namespace qmk {

// 8 bf16 weights (one uint4) dot 8 fp32 activations.
__device__ __forceinline__ float dot8(const uint4 w, const float* x) {
  const float4 a = *reinterpret_cast<const float4*>(x);
  const float4 b = *reinterpret_cast<const float4*>(x + 4);
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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// Units: one row x 256 columns (512 bytes). Stage all of the block's units of one matrix into
// shared memory with cp.async (no register cost, so the whole slice is in flight at once); issued
// before the phase's barrier wait so HBM latency overlaps the barrier and the activation loads.
//   rowptr(r): pointer to local row r (r in [0, nrows)), K contiguous bf16 values
//   stage: smem [>= nrows * K/256 * 32] uint4
template <int K, class RowPtr>
__device__ __forceinline__ void mv_issue(RowPtr rowptr, int nrows, uint4* stage) {
  constexpr int S = K / 256;
  const int n = nrows * S * 32;
  for (int idx = threadIdx.x; idx < n; idx += NT) {
    const int u = idx >> 5;
    cp_async16(stage + idx, rowptr(u / S) + (u % S) * 256 + (idx & 31) * 8);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// out_s[r * T + t] = dot(row r, xs[t]) in fp32 for the block's nrows rows staged by mv_issue.
//   xs: smem fp32 [T][QMK_I] (row stride QMK_I, first K used); out_s: smem fp32 [nrows * T].
// Warp w owns rows w, w + NW, ...: it accumulates a row's K/256 units in registers and reduces
// once, in a fixed order, so results are bitwise reproducible. Ends with __syncthreads() (the stage
// may be refilled after it).
template <int T, int K>
__device__ __forceinline__ void mv_finish(int nrows, const uint4* stage, const float* xs, float* out_s) {
  static_assert(K % 256 == 0, "K must be a multiple of 256");
  constexpr int S = K / 256;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
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

}  // namespace qmk
