// The arithmetic of the talker decode attention's CUDA twins (scripts/attn_split_twin.cu, and the
// persistent split in decode_split.cuh): the mma.sync chain step, ex2.approx, the bf16 pair packing,
// the two-term bf16 split, the row reductions in Triton's order, the split's softmax built on them and
// the PV product's p fragments. Included inside the including file's namespace.
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

// A split's softmax as the Triton kernel's PTX does it, by the block's 4 warps (w, and g, t of the
// lane): the lane's fragment s of the scores of its two 8-position tiles (rows g and g + 8, row g +
// 8 padding) scaled, -inf past n (the split's first position p0), the rows' max, p = ex2((s - m)
// log2 e), the rows' sums in Triton's order; p's two bf16 terms of rows < G into ph, and m and l of
// row r < G (by thread r) into m_out[r * stride], l_out[r * stride]. Two block barriers.
template <int G, int SPLIT>
__device__ __forceinline__ void split_softmax(const float (&s)[2][4], int p0, int n, float scale, int w, int g, int t,
                                              float (&red)[2][64], __nv_bfloat16 (&ph)[2][G][SPLIT], float* m_out,
                                              float* l_out, size_t stride) {
  // scale, mask: c0, c1 at positions 2t, 2t + 1 of the tile (row g), c2, c3 the same (row g + 8)
  float v[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 32 * r + 8 * w + 2 * t + (e & 1);
      v[r][e] = p0 + j < n ? __fmul_rn(scale, s[r][e]) : -__int_as_float(0x7f800000);
    }
  // ---- the rows' max: in the thread, across the quad, across the warps (exact in any order)
  const auto fmax = [](float x, float y) { return fmaxf(x, y); };
  const auto fadd = [](float x, float y) { return __fadd_rn(x, y); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // h: row g, then row g + 8 (c0, c1 / c2, c3 of each tile)
    const float x = quad_reduce(v[0][2 * h], v[0][2 * h + 1], v[1][2 * h], v[1][2 * h + 1], fmax);
    if (t == 0) red[0][4 * (g + 8 * h) + w] = x;
  }
  __syncthreads();
  const float m[2] = {warps_reduce(red[0] + 4 * g, fmax), warps_reduce(red[0] + 4 * (g + 8), fmax)};
  // ---- p and the rows' sums in Triton's order
  const float LOG2E = __int_as_float(0x3FB8AA3B);
  float p[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[r][e] = ex2_approx(__fmul_rn(__fsub_rn(v[r][e], m[e >> 1]), LOG2E));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float x = quad_reduce(p[0][2 * h], p[0][2 * h + 1], p[1][2 * h], p[1][2 * h + 1], fadd);
    if (t == 0) red[1][4 * (g + 8 * h) + w] = x;
  }
  // p's terms for the second product (rows < G)
  if (g < G)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 32 * r + 8 * w + 2 * t + e;
        split2(p[r][e], ph[0][g][j], ph[1][g][j]);
      }
  __syncthreads();
  if (threadIdx.x < G) {  // rows 0..G-1: m and l
    const int row = threadIdx.x;
    m_out[row * stride] = warps_reduce(red[0] + 4 * row, fmax);
    l_out[row * stride] = warps_reduce(red[1] + 4 * row, fadd);
  }
}

// The A fragment of p's bf16 term `term` at the PV product's step kk (16 positions) from split_softmax's
// ph: p[g][16 kk + 2t, +1] and p[g][16 kk + 2t + 8, +9] for the rows g < G, zeros for the others.
template <int G, int SPLIT>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const __nv_bfloat16 (&ph)[2][G][SPLIT], int term, int kk,
                                           int g, int t) {
  a[0] = a[1] = a[2] = a[3] = 0u;
  if (g < G) {
    const __nv_bfloat16* pr = ph[term][g] + 16 * kk + 2 * t;
    a[0] = pack(pr[0], pr[1]);
    a[2] = pack(pr[8], pr[9]);
  }
}
