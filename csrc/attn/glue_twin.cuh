// CUDA twins of the talker layer's two row kernels around the decode attention split, written from
// their Triton 3.6 PTX for sm_90a (session 42, benchmarks/results/h200-s42/ptx/; bitwise equal to the
// Triton kernels on an H200, session 43, scripts/gpu_attn_twin.py):
//   qk_norm_rope_twin   tk_glue._qk_rope_store_kernel's per-head RMSNorm + RoPE of q or k
//   attn_combine_twin   tk_attention._attn_combine_kernel's merge of a (row, head)'s splits, fp16 out
// Included by scripts/attn_split_twin.cu (each twin checked alone) and csrc/small/cp_layers.cu (the
// small-batch kernel's talker layers). The includer provides HD (128), ex2_approx, div_full and
// sqrt_approx_ftz (the PTX instructions of those names).
#pragma once
#include <cuda_fp16.h>

// the sum of squares of v over a Triton warp's 32 elements as its PTX reduces them: a lane's fma
// of its own square with lane ^ 16's rounded square, then butterflies 8, 4, 2, 1; lane 0's value
__device__ __forceinline__ float warp_sumsq(float v) {
  float y = __fmaf_rn(v, v, __shfl_xor_sync(0xffffffffu, __fmul_rn(v, v), 16));
  for (int m = 8; m >= 1; m >>= 1) y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, m));
  return __shfl_sync(0xffffffffu, y, 0);
}

// A head's q / k RMSNorm + RoPE as tk_glue._qk_rope_store_kernel computes it (4 warps: halves x1 =
// x[0:64], x2 = x[64:128]; each half's sum of squares as warp 0's 32 + warp 1's 32 (warp_sumsq
// each); r = div.full(1, sqrt.approx.ftz(eps + div.full(sum1 + sum2, 128))); xn = (r x) w; y1 =
// fma(x1n, c1, -(x2n s1)), y2 = fma(x2n, c2, x1n s2)) by one warp: lane l gets dims l, l + 32
// (y[0], y[1]) and 64 + l, 96 + l (y[2], y[3]). x in any memory the warp can read.
__device__ __forceinline__ void qk_norm_rope_twin(const float* x, const float* w, const float* cs, const float* sn,
                                                  float eps, float (&y)[4]) {
  const int lane = threadIdx.x & 31;
  float a[2][2], sum[2];
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 2; ++k) a[h][k] = x[64 * h + 32 * k + lane];
    sum[h] = __fadd_rn(warp_sumsq(a[h][0]), warp_sumsq(a[h][1]));
  }
  const float r = div_full(1.0f, sqrt_approx_ftz(__fadd_rn(eps, div_full(__fadd_rn(sum[0], sum[1]), 128.0f))));
  for (int k = 0; k < 2; ++k) {
    const int d = 32 * k + lane;
    const float x1 = __fmul_rn(__fmul_rn(r, a[0][k]), w[d]), x2 = __fmul_rn(__fmul_rn(r, a[1][k]), w[64 + d]);
    y[k] = __fmaf_rn(x1, cs[d], -__fmul_rn(x2, sn[d]));
    y[2 + k] = __fmaf_rn(x2, cs[64 + d], __fmul_rn(x1, sn[64 + d]));
  }
}

// The merge of one (row, head)'s used splits in split order (tk_attention._attn_combine_kernel, fp16
// out; its PTX: m' = max(m, m_s), a = ex2((m - m') log2 e), a_s = ex2((m_s - m') log2 e), l' =
// fma(l, a, a_s * l_s), acc' = fma(acc, a, a_s * acc_s), out = fp16_rn(div.full(acc, l)); no
// splits: zeros) by one warp, dims 4 lane .. 4 lane + 3 into out (element-wise: any lane may take
// any dims). m, l [used], acc [used][HD] read through L2 (ld.global.cg: written by other blocks of a
// running launch, or by an earlier kernel).
__device__ __forceinline__ void attn_combine_twin(const float* m, const float* l, const float* acc, int used,
                                                  __half (&out)[4]) {
  const int lane = threadIdx.x & 31;
  const float LOG2E = __int_as_float(0x3FB8AA3B);
  float mm = -__int_as_float(0x7f800000), ll = 0.0f, a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // (m and l of 32 splits at once, handed out by shuffles, with acc's loads unrolled 4 ahead, was
  // slower inside the talker's layers: session 45, 857 -> 877 µs at 2,000 positions)
  // 8 splits' m, l and acc loaded before their fold (the same fold, in split order; session 46:
  // the talker's layers at 2,000 positions 792 / 798 -> 786 / 787 µs, shorter contexts unchanged)
  for (int s0 = 0; s0 < used; s0 += 8) {
    float mb[8], lb[8];
    float4 vb[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (s0 + j < used) {
        mb[j] = __ldcg(m + s0 + j), lb[j] = __ldcg(l + s0 + j);
        vb[j] = __ldcg(reinterpret_cast<const float4*>(acc + (size_t)(s0 + j) * HD) + lane);
      }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (s0 + j >= used) break;
      const float ms = mb[j], mn = fmaxf(mm, ms);
      const float a_old = ex2_approx(__fmul_rn(__fsub_rn(mm, mn), LOG2E));
      const float a_new = ex2_approx(__fmul_rn(__fsub_rn(ms, mn), LOG2E));
      ll = __fmaf_rn(ll, a_old, __fmul_rn(a_new, lb[j]));
      const float4 v = vb[j];
      a[0] = __fmaf_rn(a[0], a_old, __fmul_rn(a_new, v.x));
      a[1] = __fmaf_rn(a[1], a_old, __fmul_rn(a_new, v.y));
      a[2] = __fmaf_rn(a[2], a_old, __fmul_rn(a_new, v.z));
      a[3] = __fmaf_rn(a[3], a_old, __fmul_rn(a_new, v.w));
      mm = mn;
    }
  }
  if (used <= 0) ll = 1.0f;
  for (int i = 0; i < 4; ++i) out[i] = used > 0 ? __float2half_rn(div_full(a[i], ll)) : __float2half_rn(0.0f);
}
