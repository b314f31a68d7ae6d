// Block-level bf16 matrix x vector for T tokens: the block's rows of W times smem activations.
#pragma once
#include "common.cuh"

namespace qmk {

constexpr int MV_INFLIGHT = 16;  // 16-byte weight loads in flight per lane before the first FMA

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

// out_s[r * T + t] = dot(row r, xs[t]) in fp32 for the block's nrows rows.
//   rowptr(r): pointer to local row r (r in [0, nrows)), K contiguous bf16 values
//   xs: smem fp32 [T][QMK_I] (row stride QMK_I, first K used); red: smem fp32 [nrows * K/256 * T]; out_s: smem fp32 [nrows * T]
// A unit is one row x 256 columns (32 lanes x 16 bytes); warps stride over units so the block's
// 16 warps read 8 KB of consecutive weights per step. Partial dots are summed per row in a fixed
// order, so results are bitwise reproducible. Ends with __syncthreads().
template <int T, int K, class RowPtr>
__device__ __forceinline__ void block_matvec(RowPtr rowptr, int nrows, const float* xs, float* red,
                                             float* out_s) {
  static_assert(K % 256 == 0, "K must be a multiple of 256");
  constexpr int S = K / 256;
  const int nunits = nrows * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int base = warp; base < nunits; base += NW * MV_INFLIGHT) {
    uint4 w[MV_INFLIGHT];
#pragma unroll
    for (int i = 0; i < MV_INFLIGHT; ++i) {
      const int u = base + i * NW;
      if (u < nunits) w[i] = ld_weight(rowptr(u / S) + (u % S) * 256 + lane * 8);
    }
#pragma unroll
    for (int i = 0; i < MV_INFLIGHT; ++i) {
      const int u = base + i * NW;
      if (u < nunits) {
        const float* xp = xs + (u % S) * 256 + lane * 8;
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float s = warp_sum(dot8(w[i], xp + t * QMK_I));
          if (lane == 0) red[u * T + t] = s;
        }
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nrows * T; idx += NT) {
    const int r = idx / T, t = idx % T;
    float s = 0.f;
#pragma unroll
    for (int seg = 0; seg < S; ++seg) s += red[(r * S + seg) * T + t];
    out_s[idx] = s;
  }
  __syncthreads();
}

// Ask L2 for rows [0, nrows) of rowptr (rowlen bf16 each): the next phase's weights stream from
// HBM while this phase computes and waits at its barrier.
template <class RowPtr>
__device__ __forceinline__ void block_prefetch_rows(RowPtr rowptr, int nrows, int rowlen) {
  const int lines = rowlen * 2 / 128;
  for (int i = threadIdx.x; i < nrows * lines; i += NT)
    prefetch_l2(reinterpret_cast<const char*>(rowptr(i / lines)) + (i % lines) * 128);
}

}  // namespace qmk
