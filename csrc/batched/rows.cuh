// The row phases of a code-predictor pass (everything between two products): pass input + RMSNorm,
// residual add + RMSNorm, SwiGLU, and the attention. Each output row depends on its own row alone,
// computed in a fixed order, so these phases are batch-invariant by construction.
#pragma once
#include "common.cuh"
#include "params.h"

namespace qbk {

__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
__device__ __forceinline__ float4 mul4(float4 a, float s) { return make_float4(a.x * s, a.y * s, a.z * s, a.w * s); }

constexpr int HP = H / PIECE;       // parts of a product over the hidden size (q|k|v, gate|up, heads)
constexpr int GATHER = 8;          // logits per lane whose parts are loaded together in a draw

// A product's 4 outputs at `off`: its np parts added left to right (gemm.cuh), loaded NP at a
// time (one L2 latency per NP parts, not per part).
template <int NP>
__device__ __forceinline__ float4 sum_parts4(const float* parts, int np, size_t pstride, size_t off) {
  float4 y;
  for (int p0 = 0; p0 < np; p0 += NP) {
    float4 v[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p)
      if (p0 + p < np) v[p] = ldcg4(parts + (p0 + p) * pstride + off);
#pragma unroll
    for (int p = 0; p < NP; ++p)
      if (p0 + p < np) y = p0 + p == 0 ? v[p] : add4(y, v[p]);
  }
  return y;
}

// The same for one output (np <= NP: the heads' parts).
template <int NP>
__device__ __forceinline__ float sum_parts(const float* parts, int np, size_t pstride, size_t off) {
  float v[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p)
    if (p < np) v[p] = __ldcg(parts + p * pstride + off);
  float y = v[0];
#pragma unroll
  for (int p = 1; p < NP; ++p)
    if (p < np) y += v[p];
  return y;
}

// Row m of a head product (V logits per row, np parts) into xs (a warp's shared memory; lane l
// holds ids l + 32 j): each logit's raw value into the dump at column dump_col (when dumping),
// then f(id, value) into xs. The parts of GATHER logits per lane are loaded before the first is
// added.
template <int V, class F>
__device__ __forceinline__ void gather_logits(const QbkParams& P, int np, int B, int m, int64_t dump_col, float* xs,
                                              F f) {
  const int lane = threadIdx.x & 31;
  for (int i0 = 0; i0 < V / 32; i0 += GATHER) {
    float g[GATHER];
#pragma unroll
    for (int u = 0; u < GATHER; ++u) g[u] = sum_parts<HP>(P.parts, np, (size_t)B * V, (size_t)m * V + lane + 32 * (i0 + u));
#pragma unroll
    for (int u = 0; u < GATHER; ++u) {
      const int v = lane + 32 * (i0 + u);
      if (P.dump != nullptr) P.dump[m * P.dump_stride + dump_col + v] = g[u];
      xs[v] = f(v, g[u]);
    }
  }
}

__device__ __forceinline__ __nv_bfloat16* hs_row(const QbkParams& P, int r) { return P.hs + (size_t)r * 2 * KMAX; }

// Block-wide, thread t owning dims 4t..4t+3 of a row x: hs row r = split(w * (x * rsqrt(mean(x^2)
// + eps))) (as Qwen3TTSRMSNorm in fp32; the batched engine's add_rms); hout (optional): the normed
// row in fp32 too.
__device__ __forceinline__ void norm_store(const QbkParams& P, int r, float4 x, const float* w, float* red,
                                           float* hout = nullptr) {
  const int d = threadIdx.x * 4;
  const float4 wv = __ldg(reinterpret_cast<const float4*>(w + d));  // in flight during the block sum
  const float ss = block_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w, red);
  const float rs = 1.0f / sqrtf(ss / (float)H + (float)P.eps);
  const float4 n = make_float4(wv.x * (x.x * rs), wv.y * (x.y * rs), wv.z * (x.z * rs), wv.w * (x.w * rs));
  __nv_bfloat16* h = hs_row(P, r);
  split_store4(h, h + KMAX, d, n);
  if (hout != nullptr) *reinterpret_cast<float4*>(hout + d) = n;
}

__device__ __forceinline__ int code0_of(const QbkParams& P, int64_t slot) {
  const int c = P.ints[P.f_code0 * P.num_slots + slot];
  return c < 0 ? 0 : c >= VT ? VT - 1 : c;
}

// Pass 0's rows: 2b = past_hidden of stream b's slot, 2b + 1 = codec_embedding[code 0]; out's code
// 0 column; rows B..Bpad-1 (the bucket's padding) get codes 0 and no error.
__device__ __noinline__ inline void phase_init(const QbkParams& P, int B, int Bpad, float* red) {
  const int d = threadIdx.x * 4;
  for (int r = blockIdx.x; r < 2 * B; r += gridDim.x) {
    const int b = r >> 1;
    const int64_t slot = P.rows[b];
    float4 x;
    if (r & 1) {
      const int c0 = code0_of(P, slot);
      x = ld_bf4(P.codec_emb + (size_t)c0 * H + d);
      if (threadIdx.x < GROUPS) P.out[b * P.out_stride + threadIdx.x] = threadIdx.x == 0 ? c0 : 0;
      if (threadIdx.x == 0) {
        P.out[b * P.out_stride + P.out_err] = 0;
        P.flags[b] = 0;
      }
    } else {
      x = *reinterpret_cast<const float4*>(P.past_hidden + slot * H + d);
    }
    *reinterpret_cast<float4*>(P.x + (size_t)r * H + d) = x;
    norm_store(P, r, x, P.in_norm[0], red);
  }
  const int n = (Bpad - B) * GROUPS;
  for (int i = blockIdx.x * THREADS + threadIdx.x; i < n; i += gridDim.x * THREADS) {
    int32_t* o = P.out + (B + i / GROUPS) * P.out_stride;
    o[i % GROUPS] = 0;
    if (i % GROUPS == 0) o[P.out_err] = 0;
  }
}

// x[m] += the product's parts; hs row m = RMSNorm(x[m]) with w (to_hidden: also into the row's
// slot of past_hidden: the talker's final norm).
__device__ __noinline__ inline void phase_residual(const QbkParams& P, int M, int np, const float* w, float* red,
                                            bool to_hidden = false) {
  const int d = threadIdx.x * 4;
  for (int m = blockIdx.x; m < M; m += gridDim.x) {
    const float4 y = sum_parts4<HP>(P.parts, np, (size_t)M * H, (size_t)m * H + d);
    float* xr = P.x + (size_t)m * H + d;
    const float4 x = add4(ldcg4(xr), y);
    *reinterpret_cast<float4*>(xr) = x;
    norm_store(P, m, x, w, red, to_hidden ? P.past_hidden + P.rows[m] * H : nullptr);
  }
}

// hs row m = silu(gate) * up from the gate|up product's parts ([np][M][2 I]).
__device__ __noinline__ inline void phase_swiglu(const QbkParams& P, int M, int np) {
  const size_t ps = (size_t)M * NMAX;
  for (int e = blockIdx.x * THREADS + threadIdx.x; e < M * (I / 4); e += gridDim.x * THREADS) {
    const int m = e / (I / 4), i = (e % (I / 4)) * 4;
    const float4 g = sum_parts4<HP>(P.parts, np, ps, (size_t)m * NMAX + i);
    const float4 u = sum_parts4<HP>(P.parts, np, ps, (size_t)m * NMAX + I + i);
    const float4 a = make_float4(g.x / (1.0f + expf(-g.x)) * u.x, g.y / (1.0f + expf(-g.y)) * u.y,
                                 g.z / (1.0f + expf(-g.z)) * u.z, g.w / (1.0f + expf(-g.w)) * u.w);
    __nv_bfloat16* h = hs_row(P, m);
    split_store4(h, h + KMAX, i, a);
  }
}

// Per-head RMSNorm of a 128-dim head held 4 dims per lane, then rotate-half RoPE (the partner of
// dim d is d +- 64, in lane ^ 16).
__device__ __forceinline__ float4 norm_rope(float4 v, float4 w, float eps, float4 c, float4 s, int lane) {
  const float ss = warp_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
  const float r = 1.0f / sqrtf(ss / (float)HD + eps);
  v = make_float4(w.x * (v.x * r), w.y * (v.y * r), w.z * (v.z * r), w.w * (v.w * r));
  float4 o;
  o.x = __shfl_xor_sync(0xffffffffu, v.x, 16);
  o.y = __shfl_xor_sync(0xffffffffu, v.y, 16);
  o.z = __shfl_xor_sync(0xffffffffu, v.z, 16);
  o.w = __shfl_xor_sync(0xffffffffu, v.w, 16);
  if (lane < 16) return make_float4(v.x * c.x - o.x * s.x, v.y * c.y - o.y * s.y, v.z * c.z - o.z * s.z, v.w * c.w - o.w * s.w);
  return make_float4(v.x * c.x + o.x * s.x, v.y * c.y + o.y * s.y, v.z * c.z + o.z * s.z, v.w * c.w + o.w * s.w);
}

__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// One warp per (stream b, q head): for each of the stream's R rows (pass 0: positions 0 and 1,
// else position pass + 1): its q and its kv head's k, v from the q|k|v product's parts (q/k norm,
// RoPE), the head over positions 0..pos -> hs (o_proj's input); the kv head's first q head's warp
// stores k/v into the frame's code-predictor cache. Keys and values of earlier passes come from
// the cache, all loads issued before the first is used; pass 0's row 1 takes position 0 from
// registers (another warp may still be writing it).
__device__ __noinline__ inline void phase_attention(const QbkParams& P, int L, int pass, int B, int R, int np) {
  const int M = B * R;
  const size_t ps = (size_t)M * QKV;
  const int lane = threadIdx.x & 31, d = 4 * lane;
  const float eps = (float)P.eps, scale = (float)P.scale;
  const float4 qw = *reinterpret_cast<const float4*>(P.q_norm[L] + d);
  const float4 kw = *reinterpret_cast<const float4*>(P.k_norm[L] + d);
  for (int item = global_warp(); item < B * NH; item += gridDim.x * WARPS) {
    const int b = item / NH, head = item % NH, kvh = head / 2;
    const size_t cbase = (((size_t)L * P.max_rows + b) * NKV + kvh) * POS * HD + d;
    float* kc = P.cpk + cbase;
    float* vc = P.cpv + cbase;
    float4 k0 = make_float4(0.f, 0.f, 0.f, 0.f), v0 = k0;  // pass 0: row 0's key and value
    for (int r = 0; r < R; ++r) {
      const int m = b * R + r, pos = pass == 0 ? r : pass + 1;
      const size_t row = (size_t)m * QKV + d;
      const float4 yk = sum_parts4<HP>(P.parts, np, ps, row + QD + kvh * HD);
      const float4 v = sum_parts4<HP>(P.parts, np, ps, row + QD + KVD + kvh * HD);
      const float4 yq = sum_parts4<HP>(P.parts, np, ps, row + head * HD);
      float4 kf[POS];
#pragma unroll
      for (int j = 0; j < POS; ++j) kf[j] = j < pos && pass > 0 ? ldcg4(kc + j * HD) : k0;
      const float4 c = *reinterpret_cast<const float4*>(P.rope_cos + pos * HD + d);
      const float4 s = *reinterpret_cast<const float4*>(P.rope_sin + pos * HD + d);
      const float4 k = norm_rope(yk, kw, eps, c, s, lane);
      if ((head & 1) == 0) {
        *reinterpret_cast<float4*>(kc + pos * HD) = k;
        *reinterpret_cast<float4*>(vc + pos * HD) = v;
      }
      k0 = k;
#pragma unroll
      for (int j = 0; j < POS; ++j) kf[j] = j < pos ? kf[j] : k;
      const float4 q = norm_rope(yq, qw, eps, c, s, lane);
      float sc[POS];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < POS; ++j) {
        if (j > pos) break;
        sc[j] = warp_sum(dot4(q, kf[j])) * scale;
        mx = fmaxf(mx, sc[j]);
      }
      float4 vf[POS];  // the values' loads, after the keys' (their registers)
#pragma unroll
      for (int j = 0; j < POS; ++j) vf[j] = j < pos ? (pass > 0 ? ldcg4(vc + j * HD) : v0) : v;
      v0 = v;
      float l = 0.f;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < POS; ++j) {
        if (j > pos) break;
        const float p = expf(sc[j] - mx);
        l += p;
        o = make_float4(o.x + p * vf[j].x, o.y + p * vf[j].y, o.z + p * vf[j].z, o.w + p * vf[j].w);
      }
      o = make_float4(o.x / l, o.y / l, o.z / l, o.w / l);
      __nv_bfloat16* h = hs_row(P, m);
      split_store4(h, h + KMAX, head * HD + d, o);
    }
  }
}

}  // namespace qbk
