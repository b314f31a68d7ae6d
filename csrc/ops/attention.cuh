// The talker's phase "split-K attention": per-head q/k RMSNorm, rotate-half RoPE, KV append and
// GQA attention over key chunks (flash-decoding style). Each item writes its chunk's
// online-softmax state (m, l, acc); the next phase (ops/attn_oproj.cuh) merges the chunks of its
// head pair before its o_proj partial.
#pragma once
#include "common.cuh"

namespace qmk {

// K/V cache element: bf16 (default) or fp32 (KV_FP32). load4: dims [0, 4) at p; store: one value.
__device__ __forceinline__ void kv_load4(const qmk_bf16* p, float* f) {
  const uint2 r = ld_u2_cg(p);
  f[0] = lo_bf(r.x); f[1] = hi_bf(r.x); f[2] = lo_bf(r.y); f[3] = hi_bf(r.y);
}
__device__ __forceinline__ void kv_load4(const float* p, float* f) {
  const float4 r = __ldcg(reinterpret_cast<const float4*>(p));
  f[0] = r.x; f[1] = r.y; f[2] = r.z; f[3] = r.w;
}
__device__ __forceinline__ void kv_store(qmk_bf16* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }

template <typename KV>
struct AttnLayer {
  const float* qkv;         // scratch [T][QKV]: raw q | k | v linear outputs
  KV* kc;                   // this layer's K cache [NKV][ld_pos][HD] (post-norm, post-RoPE)
  KV* vc;                   // this layer's V cache [NKV][ld_pos][HD]
  int ld_pos;               // positions per head in the cache
  const qmk_bf16* q_norm;   // [HD]
  const qmk_bf16* k_norm;   // [HD]
  const float* inv_freq;    // [HD/2]
  float eps;
  float* part;              // [MAX_T * NH][MAX_CHUNKS][HD + 2] split-K partials (m, l, acc)
  bool exact;               // bf16-exact rounding points
};

struct AttnSmem {
  float y[3 * QMK_MAX_T][QMK_HD];               // normed rows before RoPE: 2T q rows, T k rows
  float q[2 * QMK_MAX_T][QMK_HD];               // q after RoPE, row = t * 2 + j
  float merge[QMK_WARPS][2 * QMK_MAX_T][QMK_HD + 2];  // per-warp online-softmax states
};

// Key chunks per kv head: enough items to spread long contexts over the grid, at least
// QMK_ATTN_CHUNK keys each.
#ifndef QMK_ATTN_CHUNK
#define QMK_ATTN_CHUNK 32
#endif
__device__ __forceinline__ int attn_chunks(int ctx, int T) {
  if (T > 1) return 1;  // T new keys must sit in one chunk (the talker runs T = 1)
  int n = (ctx + QMK_ATTN_CHUNK - 1) / QMK_ATTN_CHUNK;
  const int cap = min((int)gridDim.x / QMK_NKV, QMK_MAX_CHUNKS);
  return max(1, min(n, cap));
}

// Cached keys/values (positions < p0, written in earlier launches or phases) of the first
// ATTN_KH keys each warp walks in this block's (first) item: loaded before the barrier wait.
constexpr int ATTN_KH = 4;
struct AttnPrefetch {
  float k[ATTN_KH][4], v[ATTN_KH][4];
};
template <int T, typename KV>
__device__ __forceinline__ void attention_prefetch(const AttnLayer<KV>& a, int p0, AttnPrefetch& pf) {
  const int ctx = p0 + T;
  const int nchunks = attn_chunks(ctx, T);
  const int chunk = (ctx + nchunks - 1) / nchunks;
  const int item = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ATTN_KH; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) pf.k[i][e] = pf.v[i][e] = 0.f;
  if (item >= QMK_NKV * nchunks) return;
  const int h = item % QMK_NKV, c = item / QMK_NKV;
  const int c0 = c * chunk, c1 = min(ctx, c0 + chunk);
  const KV* kbase = a.kc + (size_t)h * a.ld_pos * QMK_HD + lane * 4;
  const KV* vbase = a.vc + (size_t)h * a.ld_pos * QMK_HD + lane * 4;
#pragma unroll
  for (int i = 0; i < ATTN_KH; ++i) {
    const int j = c0 + warp + NW * i;
    if (j < c1 && j < p0) {
      kv_load4(kbase + (size_t)j * QMK_HD, pf.k[i]);
      kv_load4(vbase + (size_t)j * QMK_HD, pf.v[i]);
    }
  }
}

// T new tokens at positions p0 .. p0+T-1; keys 0 .. p0+T-1. pf: attention_prefetch's registers.
template <int T, typename KV>
__device__ void attention_phase(const AttnLayer<KV>& a, int p0, AttnSmem& sm, const AttnPrefetch& pf) {
  const int ctx = p0 + T;
  const int nchunks = attn_chunks(ctx, T);
  const int chunk = (ctx + nchunks - 1) / nchunks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = 0.08838834764831845f;  // head_dim ** -0.5
  constexpr int NQ = 2 * T;                  // (token, q head) pairs per kv head

  for (int item = blockIdx.x; item < QMK_NKV * nchunks; item += gridDim.x) {
    const int h = item % QMK_NKV, c = item / QMK_NKV;
    const int c0 = c * chunk, c1 = min(ctx, c0 + chunk);
    const bool owner = (c == nchunks - 1);  // holds the new positions: appends K/V
    const int nrows = NQ + (owner ? T : 0);

    // 1) per-head RMSNorm of the q rows (and the new k rows): fp32, cast, times weight. The
    //    owner's next T warps append the new v rows.
    if (owner && warp >= nrows && warp < nrows + T) {
      const int t = warp - nrows;
      const float4 v4 = __ldcg(reinterpret_cast<const float4*>(a.qkv + t * QMK_QKV + QMK_QD + QMK_KVD + h * QMK_HD) + lane);
      KV* dst = a.vc + ((size_t)h * a.ld_pos + p0 + t) * QMK_HD + lane * 4;
      kv_store(dst + 0, v4.x); kv_store(dst + 1, v4.y); kv_store(dst + 2, v4.z); kv_store(dst + 3, v4.w);
    }
    if (warp < nrows) {
      const bool isq = warp < NQ;
      const int t = isq ? warp / 2 : warp - NQ;
      const float* src = a.qkv + t * QMK_QKV + (isq ? (2 * h + (warp & 1)) * QMK_HD : QMK_QD + h * QMK_HD);
      const float4 raw = __ldcg(reinterpret_cast<const float4*>(src + lane * 4));
      const float x[4] = {raw.x, raw.y, raw.z, raw.w};
      const float ss = warp_sum(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
      const float rinv = 1.0f / sqrtf(ss / (float)QMK_HD + a.eps);
      const qmk_bf16* nw = isq ? a.q_norm : a.k_norm;
#pragma unroll
      for (int i = 0; i < 4; ++i) sm.y[warp][lane * 4 + i] = rnd(bf2f(nw[lane * 4 + i]) * rnd(x[i] * rinv, a.exact), a.exact);
    }
    __syncthreads();

    // 2) rotate-half RoPE (cos/sin in fp32, cast to bf16; every product rounded as in bf16 torch).
    for (int idx = threadIdx.x; idx < nrows * QMK_HD; idx += NT) {
      const int row = idx / QMK_HD, d = idx % QMK_HD;
      const int t = row < NQ ? row / 2 : row - NQ;
      const int pos = p0 + t;
      const float ang = (float)pos * a.inv_freq[d & (QMK_HD / 2 - 1)];
      float cs, sn;
      sincosf(ang, &sn, &cs);  // one argument reduction for both (same values as sinf / cosf)
      cs = rnd(cs, a.exact);
      sn = rnd(sn, a.exact);
      const float yv = sm.y[row][d];
      const float rot = d < QMK_HD / 2 ? -sm.y[row][d + QMK_HD / 2] : sm.y[row][d - QMK_HD / 2];
      const float r = rnd(rnd(yv * cs, a.exact) + rnd(rot * sn, a.exact), a.exact);
      if (row < NQ) {
        sm.q[row][d] = r;
      } else {
        const size_t off = ((size_t)h * a.ld_pos + pos) * QMK_HD + d;
        kv_store(a.kc + off, r);
      }
    }
    __syncthreads();

    // 3) each warp walks keys c0 + warp, c0 + warp + NW, ...; lanes hold 4 dims; online softmax.
    float qv[NQ][4], m[NQ], l[NQ], acc[NQ][4];
    softmax_begin<NQ>(sm.q, lane, qv, m, l, acc);
    const KV* kbase = a.kc + (size_t)h * a.ld_pos * QMK_HD + lane * 4;
    const KV* vbase = a.vc + (size_t)h * a.ld_pos * QMK_HD + lane * 4;
    const bool first = item == (int)blockIdx.x;  // pf holds this item's first keys
    const auto key = [&](int j, const float* kf, const float* vf) {
      attend_key<NQ>(qv, kf, vf, j, p0, scale, m, l, acc);
    };
    // keys c0 + warp + NW * i in order: the first ATTN_KH from registers where prefetched.
#pragma unroll
    for (int i = 0; i < ATTN_KH; ++i) {
      const int j = c0 + warp + NW * i;
      if (j < c1) {
        if (first && j < p0) {
          key(j, pf.k[i], pf.v[i]);
        } else {
          float kf[4], vf[4];
          kv_load4(kbase + (size_t)j * QMK_HD, kf);
          kv_load4(vbase + (size_t)j * QMK_HD, vf);
          key(j, kf, vf);
        }
      }
    }
#pragma unroll 2
    for (int j = c0 + warp + NW * ATTN_KH; j < c1; j += NW) {
      float kf[4], vf[4];
      kv_load4(kbase + (size_t)j * QMK_HD, kf);
      kv_load4(vbase + (size_t)j * QMK_HD, vf);
      key(j, kf, vf);
    }
    softmax_save<NQ>(sm.merge[warp], lane, m, l, acc);
    __syncthreads();

    // 4) merge the warps into this chunk's state (m, l, acc) of each row.
    for (int idx = threadIdx.x; idx < NQ * QMK_HD; idx += NT) {
      const int r = idx / QMK_HD, d = idx % QMK_HD;
      float mx = neg_inf();
      for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm.merge[w][r][0]);
      float L = 0.f, A = 0.f;
      for (int w = 0; w < NW; ++w) {
        const float e = sm.merge[w][r][0] == neg_inf() ? 0.f : expf(sm.merge[w][r][0] - mx);
        L = fmaf(sm.merge[w][r][1], e, L);
        A = fmaf(sm.merge[w][r][2 + d], e, A);
      }
      const int t = r / 2, head = 2 * h + (r & 1);
      float* pp = a.part + ((size_t)(t * QMK_NH + head) * QMK_MAX_CHUNKS + c) * (QMK_HD + 2);
      if (d == 0) { __stcg(pp, mx); __stcg(pp + 1, L); }
      __stcg(pp + 2 + d, A);
    }
    __syncthreads();
  }
}

}  // namespace qmk
