// The arithmetic of the talker decode attention's CUDA twins (scripts/attn_split_twin.cu, and the
// persistent split in decode_split.cuh): the mma.sync chain step, ex2.approx, the bf16 pair packing,
// the two-term bf16 split and the row reductions in Triton's order. Included inside the including
// file's namespace.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
// the two bf16 terms of x: hi = bf16(x), lo = bf16(x - hi), both to nearest even
__device__ __forceinline__ void split2(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(__fsub_rn(x, __bfloat162float(hi)));
}

// A row's four values in a lane, ((a op b) op c) op d, then across its quad (butterflies 2, 1):
// the first two steps of Triton's row reductions over the mma layout (every lane must call it)
template <class Op>
__device__ __forceinline__ float quad_reduce(float a, float b, float c, float d, Op op) {
  float x = op(op(op(a, b), c), d);
  x = op(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return op(x, __shfl_xor_sync(0xffffffffu, x, 1));
}
// the last: the four warps' partials of a row (rr[w]) as (v0 op v2) op (v1 op v3)
template <class Op>
__device__ __forceinline__ float warps_reduce(const float* rr, Op op) {
  return op(op(rr[0], rr[2]), op(rr[1], rr[3]));
}
