// CUDA twins of the talker's decode attention split (tk_attention._attn_split_tc_kernel with
// bf16 pools, 16-position pages, 64-position splits, 2 query heads a kv head padded to 16 rows, 2
// bf16 terms, 4 warps), meant to give its bits, so that a small-batch launch can run the talker's
// attention too (issue 16: the talker's layers in an LL launch). Written from Triton 3.6's PTX for
// sm_90a of that configuration (compiled offline: benchmarks/results/h200-s42/ptx/), which does:
//   s = scale * (q_hi K^T + q_lo K^T)  mma.sync m16n8k16 bf16 chains over d: 8 steps of q_hi, then
//       8 of q_lo, one accumulator (q_hi = bf16(q) to nearest even, q_lo = bf16(q - q_hi))
//   s = -inf where the position is past the length; m = the row's max (exact in any order)
//   p = ex2.approx(((s - m) * log2(e)))  (mul by 0x3FB8AA3B, ex2.approx.f32 without ftz)
//   l = the row's sum of p in Triton's reduction order: a warp holds columns c = 8w + 2t + {0, 1}
//       and c + 32 (the mma layout's warps along N at 8 columns, repeated at 32), in a thread
//       ((p[c] + p[c + 1]) + p[c + 32]) + p[c + 33], across the quad's lanes (x0 + x2) + (x1 + x3)
//       (butterflies 2 then 1), across the warps (v0 + v2) + (v1 + v3)
//   acc = p_hi V + p_lo V  4 steps over the 64 positions each, one accumulator
// K and V past the length load as zeros (Triton's masked loads), so that p = 0 there multiplies a
// zero, not whatever the page holds. Every operand value is what Triton's fragments hold (the mma
// instruction, its operands and the chain's order are the same), so the bits are the same; the
// fragments here are loaded straight from global memory instead of through shared memory.
// Also the merge of the splits (_attn_combine_kernel, fp16 out) and the q / k norm + RoPE + K/V
// store before them (tk_glue._qk_rope_store_kernel): csrc/attn/glue_twin.cuh's twins, in kernels
// below. scripts/gpu_attn_twin.py compares each with its Triton kernel bitwise (needs a GPU).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int HD = 128, BLOCK = 16, PPS = 4, SPLIT = PPS * BLOCK, G = 2;

#include "../csrc/attn/twin_math.cuh"

// One split (64 positions from sp * 64) of one row and kv head, run by the block's 4 warps: q
// [G][HD] fp32 (the kv head's query heads), the row's page table, its length n -> m [G], l [G],
// acc [G][HD] (unnormalised), each at its own stride.
__device__ void attn_split_twin(const float* q, const __nv_bfloat16* kpool, const __nv_bfloat16* vpool,
                                const int* table, int nkv, int kvh, int sp, int n, float scale, float* m_out,
                                float* l_out, float* acc_out, int ml_stride, int acc_stride) {
  __shared__ float red[2][64];                  // [max, sum][row * 4 + warp] (rows 0..15)
  __shared__ __nv_bfloat16 ph[2][G][SPLIT];     // p's two terms, rows 0..G-1
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  // the address of position j's (0..63) row of K or V, or null past the length
  auto kv_row = [&](const __nv_bfloat16* pool, int j) -> const __nv_bfloat16* {
    const int pos = sp * SPLIT + j;
    if (pos >= n) return nullptr;
    const long long page = table[sp * PPS + j / BLOCK];
    return pool + ((page * nkv + kvh) * BLOCK + j % BLOCK) * HD;
  };
  auto ld2 = [](const __nv_bfloat16* row, int d) -> uint32_t {
    return row ? *reinterpret_cast<const uint32_t*>(row + d) : 0u;
  };

  // ---- s: rows g (< G: the query heads) and g + 8 (padding, zero) of the warp's two 8-position tiles
  float s[2][4] = {};
  const __nv_bfloat16* krow[2] = {kv_row(kpool, 8 * w + g), kv_row(kpool, 32 + 8 * w + g)};
  for (int term = 0; term < 2; ++term)
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4] = {0u, 0u, 0u, 0u};
      if (g < G) {
        const float* qr = q + g * HD + 16 * kk + 2 * t;
        __nv_bfloat16 h0, l0, h1, l1, h8, l8, h9, l9;
        split2(qr[0], h0, l0), split2(qr[1], h1, l1), split2(qr[8], h8, l8), split2(qr[9], h9, l9);
        a[0] = term == 0 ? pack(h0, h1) : pack(l0, l1);
        a[2] = term == 0 ? pack(h8, h9) : pack(l8, l9);
      }
      for (int r = 0; r < 2; ++r)
        mma_bf16(s[r], a, ld2(krow[r], 16 * kk + 2 * t), ld2(krow[r], 16 * kk + 2 * t + 8));
    }
  split_softmax(s, sp * SPLIT, n, scale, w, g, t, red, ph, m_out, l_out, ml_stride);
  // ---- acc: the warp's four 8-column tiles of d (8w + 32r), 4 steps of 16 positions a term
  float acc[4][4] = {};
  for (int term = 0; term < 2; ++term)
    for (int kk = 0; kk < SPLIT / 16; ++kk) {
      uint32_t a[4];
      p_fragment(a, ph, term, kk, g, t);
      const __nv_bfloat16* vr[4];
      for (int i = 0; i < 4; ++i) vr[i] = kv_row(vpool, 16 * kk + 2 * t + (i & 1) + (i >> 1) * 8);
      for (int r = 0; r < 4; ++r) {
        const int d = 8 * w + 32 * r + g;
        __nv_bfloat16 e[4];
        for (int i = 0; i < 4; ++i) e[i] = vr[i] ? vr[i][d] : __float2bfloat16_rn(0.0f);
        mma_bf16(acc[r], a, pack(e[0], e[1]), pack(e[2], e[3]));
      }
    }
  if (g < G)
    for (int r = 0; r < 4; ++r) {
      float* o = acc_out + (size_t)g * acc_stride + 8 * w + 32 * r + 2 * t;
      o[0] = acc[r][0], o[1] = acc[r][1];
    }
}

__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sqrt_approx_ftz(float x) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
#include "../csrc/attn/glue_twin.cuh"

// The Triton kernel's grid and outputs at one split a program: program (b, kv head, c) -> m, l
// [B][NH][NSPLIT], acc [B][NH][NSPLIT][HD] for the query heads kvh * G .. (unused splits: untouched)
__global__ void __launch_bounds__(128) attn_split_twin_kernel(const float* q, const __nv_bfloat16* kpool,
                                                              const __nv_bfloat16* vpool, const int* table,
                                                              const int* lens, float* m, float* l, float* acc,
                                                              float scale, int max_blocks, int nsplit, int nkv) {
  const int b = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z, n = lens[b];
  if (sp * SPLIT >= n) return;
  const int nh = nkv * G, row0 = b * nh + kvh * G;
  attn_split_twin(q + (size_t)row0 * HD, kpool, vpool, table + (size_t)b * max_blocks, nkv, kvh, sp, n, scale,
                  m + (size_t)row0 * nsplit + sp, l + (size_t)row0 * nsplit + sp,
                  acc + ((size_t)row0 * nsplit + sp) * HD, nsplit, nsplit * HD);
}

// program (b, h) of the combine: the used splits of row b, head h -> out [B][NH][HD] fp16
__global__ void __launch_bounds__(32) attn_combine_twin_kernel(const float* m, const float* l, const float* acc,
                                                               const int* lens, __half* out, int nh, int nsplit) {
  const int b = blockIdx.x, h = blockIdx.y, used = (lens[b] + SPLIT - 1) / SPLIT;
  const size_t base = (size_t)(b * nh + h) * nsplit;
  __half o[4];
  attn_combine_twin(m + base, l + base, acc + base * HD, used, o);
  for (int i = 0; i < 4; ++i) out[(size_t)(b * nh + h) * HD + 4 * (threadIdx.x & 31) + i] = o[i];
}

// program (m, head) of tk_glue._qk_rope_store_kernel (bf16 pools, 16-position pages): q heads ->
// q_out [M][NH][HD] fp32; kv heads -> K (normed, roped) and V at pool[blk[m]][kvh][off[m]], bf16
__global__ void __launch_bounds__(32) qk_rope_store_twin_kernel(const float* qkv, const float* qn, const float* kn,
                                                                const float* cs, const float* sn, int cs_stride,
                                                                float* q_out, __nv_bfloat16* kpool,
                                                                __nv_bfloat16* vpool, const long long* blk,
                                                                const long long* off, float eps, int nh, int nkv) {
  const int m = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31;
  const float* row = qkv + (size_t)m * (nh + 2 * nkv) * HD;
  float y[4];
  qk_norm_rope_twin(row + (size_t)h * HD, h < nh ? qn : kn, cs + (size_t)m * cs_stride, sn + (size_t)m * cs_stride,
                    eps, y);
  const int dims[4] = {lane, 32 + lane, 64 + lane, 96 + lane};
  if (h < nh) {
    for (int i = 0; i < 4; ++i) q_out[((size_t)m * nh + h) * HD + dims[i]] = y[i];
  } else {
    const int kvh = h - nh;
    const size_t base = (((size_t)blk[m] * nkv + kvh) * BLOCK + (size_t)off[m]) * HD;
    const float* v = row + (size_t)(nh + nkv + kvh) * HD;
    for (int i = 0; i < 4; ++i) {
      kpool[base + dims[i]] = __float2bfloat16_rn(y[i]);
      vpool[base + dims[i]] = __float2bfloat16_rn(v[dims[i]]);
    }
  }
}

}  // namespace

extern "C" int qk_rope_store_twin_run(const float* qkv, const float* qn, const float* kn, const float* cs,
                                      const float* sn, int cs_stride, float* q_out, void* kpool, void* vpool,
                                      const long long* blk, const long long* off, float eps, int rows, int nh, int nkv,
                                      void* stream) {
  qk_rope_store_twin_kernel<<<dim3(rows, nh + nkv), 32, 0, (cudaStream_t)stream>>>(
      qkv, qn, kn, cs, sn, cs_stride, q_out, static_cast<__nv_bfloat16*>(kpool), static_cast<__nv_bfloat16*>(vpool),
      blk, off, eps, nh, nkv);
  return (int)cudaGetLastError();
}

extern "C" int attn_combine_twin_run(const float* m, const float* l, const float* acc, const int* lens, void* out,
                                     int batch, int nh, int nsplit, void* stream) {
  attn_combine_twin_kernel<<<dim3(batch, nh), 32, 0, (cudaStream_t)stream>>>(m, l, acc, lens,
                                                                             static_cast<__half*>(out), nh, nsplit);
  return (int)cudaGetLastError();
}

extern "C" int attn_split_twin_run(const float* q, const void* kpool, const void* vpool, const int* table,
                                   const int* lens, float* m, float* l, float* acc, float scale, int batch,
                                   int max_blocks, int nsplit, int nkv, void* stream) {
  attn_split_twin_kernel<<<dim3(batch, nkv, nsplit), 128, 0, (cudaStream_t)stream>>>(
      q, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool), table, lens, m, l, acc,
      scale, max_blocks, nsplit, nkv);
  return (int)cudaGetLastError();
}
