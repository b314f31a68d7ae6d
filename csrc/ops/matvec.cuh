// Block-level bf16 matrix x vector for T tokens: the block's rows of W times smem activations.
#pragma once
#include "common.cuh"

namespace qmk {

constexpr int MV_PRELOAD = 4;   // 16-byte weight loads per lane issued before the phase's barrier wait
constexpr int MV_INFLIGHT = 8; // 16-byte weight loads in flight per lane in the streaming loop

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

// The first MV_PRELOAD units of each warp, loaded into registers before the phase's barrier
// wait, so HBM latency overlaps the barrier and the activation loads.
struct MvRegs {
  uint4 w[MV_PRELOAD];
};

// Units: one row x 256 columns (32 lanes x 16 bytes); warp w takes units w, w + NW, ...
//   rowptr(r): pointer to local row r (r in [0, nrows)), K contiguous bf16 values
template <int K, class RowPtr>
__device__ __forceinline__ void mv_issue(RowPtr rowptr, int nrows, MvRegs& r) {
  constexpr int S = K / 256;
  const int nunits = nrows * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < MV_PRELOAD; ++i) {
    const int u = warp + i * NW;
    if (u < nunits) r.w[i] = ld_weight(rowptr(u / S) + (u % S) * 256 + lane * 8);
  }
}

template <int T, int K>
__device__ __forceinline__ void mv_consume(const uint4& w, int u, const float* xs, float* red) {
  constexpr int S = K / 256;
  const int lane = threadIdx.x & 31;
  const float* xp = xs + (u % S) * 256 + lane * 8;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const float s = warp_sum(dot8(w, xp + t * QMK_I));
    if (lane == 0) red[u * T + t] = s;
  }
}

// out_s[r * T + t] = dot(row r, xs[t]) in fp32 for the block's nrows rows, using the registers
// from mv_issue for the first units and loading the rest here.
//   xs: smem fp32 [T][QMK_I] (row stride QMK_I, first K used); red: smem fp32 [nrows * K/256 * T];
//   out_s: smem fp32 [nrows * T]. Partial dots are summed per row in a fixed order, so results
// are bitwise reproducible. Ends with __syncthreads().
template <int T, int K, class RowPtr>
__device__ __forceinline__ void mv_finish(RowPtr rowptr, int nrows, const MvRegs& r, const float* xs,
                                          float* red, float* out_s) {
  static_assert(K % 256 == 0, "K must be a multiple of 256");
  constexpr int S = K / 256;
  const int nunits = nrows * S;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < MV_PRELOAD; ++i) {
    const int u = warp + i * NW;
    if (u < nunits) mv_consume<T, K>(r.w[i], u, xs, red);
  }
  for (int base = warp + MV_PRELOAD * NW; base < nunits; base += NW * MV_INFLIGHT) {
    uint4 w[MV_INFLIGHT];
#pragma unroll
    for (int i = 0; i < MV_INFLIGHT; ++i) {
      const int u = base + i * NW;
      if (u < nunits) w[i] = ld_weight(rowptr(u / S) + (u % S) * 256 + lane * 8);
    }
#pragma unroll
    for (int i = 0; i < MV_INFLIGHT; ++i) {
      const int u = base + i * NW;
      if (u < nunits) mv_consume<T, K>(w[i], u, xs, red);
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nrows * T; idx += NT) {
    const int row = idx / T, t = idx % T;
    float s = 0.f;
#pragma unroll
    for (int seg = 0; seg < S; ++seg) s += red[(row * S + seg) * T + t];
    out_s[idx] = s;
  }
  __syncthreads();
}

}  // namespace qmk
