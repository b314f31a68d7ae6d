// The talker's phase "split-K attention": per-head q/k RMSNorm, rotate-half RoPE, KV append and
// GQA attention over key chunks (flash-decoding style). Each item polls its head's q|k|v rows (LL
// words of the q|k|v phase: no grid barrier before this phase) and publishes its chunk's
// online-softmax state (m, l, acc) as LL words; the next phase (ops/attn_oproj.cuh) polls and
// merges the chunks of its head pair before its o_proj partial.
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
  const uint64_t* qkv;      // LL [T][QKV]: raw q | k | v linear outputs
  KV* kc;                   // this layer's K cache [NKV][ld_pos][HD] (post-norm, post-RoPE)
  KV* vc;                   // this layer's V cache [NKV][ld_pos][HD]
  int ld_pos;               // positions per head in the cache
  float eps;                // (the q/k norm weights and RoPE's cos/sin come in AttnStatic)
  uint64_t* part;           // LL [MAX_T * NH][MAX_CHUNKS][HD + 2] split-K partials (m, l, acc)
  bool exact;               // bf16-exact rounding points
};

struct AttnSmem {
  float q[2 * QMK_MAX_T][QMK_HD];               // q after RoPE, row = t * 2 + j
  float merge[QMK_WARPS][2 * QMK_MAX_T][QMK_HD + 2];  // per-warp online-softmax states
};

// Key chunks per kv head: enough items to spread long contexts over the grid, at least
// ATTN_CHUNK keys each. H100, ctx 100: 8 / 16 keys +30 / 0 us per frame (the merge of more
// partials costs what the shorter chains save), 64 / 128 keys +80 / +145 us.
constexpr int ATTN_CHUNK = 32;
__device__ __forceinline__ int attn_chunks(int ctx, int T) {
  if (T > 1) return 1;  // T new keys must sit in one chunk (the talker runs T = 1)
  int n = (ctx + ATTN_CHUNK - 1) / ATTN_CHUNK;
  const int cap = min((int)gridDim.x / QMK_NKV, QMK_MAX_CHUNKS);
  return max(1, min(n, cap));
}

// Cached keys/values (positions < p0, written in earlier launches or phases) of the first
// ATTN_KH keys each warp walks in this block's (first) item: loaded before the poll.
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

// What the split-K phase needs before its q|k|v rows arrive, prepared by its blocks during the
// q|k|v phase (the loads are issued before that phase's poll of the residual rows and stored once
// they have returned), so that the phase starts with its poll: the q/k norm weights and RoPE's cos/sin
// of the new positions (bf16-rounded where the model rounds).
struct AttnStatic {
  float nq[QMK_HD], nk[QMK_HD];
  float cs[QMK_MAX_T][QMK_HD], sn[QMK_MAX_T][QMK_HD];
};
struct AttnStaticRaw {
  float nw, fr;
};
__device__ __forceinline__ AttnStaticRaw attention_static_load(const qmk_bf16* q_norm, const qmk_bf16* k_norm,
                                                               const float* inv_freq) {
  const int i = threadIdx.x;
  AttnStaticRaw r{0.f, 0.f};
  if (i < 2 * QMK_HD) r.nw = bf2f(i < QMK_HD ? q_norm[i] : k_norm[i - QMK_HD]);
  if (i < QMK_HD) r.fr = inv_freq[i & (QMK_HD / 2 - 1)];
  return r;
}
template <int T>
__device__ __forceinline__ void attention_static_store(const AttnStaticRaw& r, int p0, bool exact, AttnStatic& s) {
  const int i = threadIdx.x;
  if (i < QMK_HD) s.nq[i] = r.nw;
  else if (i < 2 * QMK_HD) s.nk[i - QMK_HD] = r.nw;
  if (i < QMK_HD) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float sn, cs;
      sincosf((float)(p0 + t) * r.fr, &sn, &cs);  // one argument reduction for both (same values as sinf / cosf)
      s.cs[t][i] = rnd(cs, exact);
      s.sn[t][i] = rnd(sn, exact);
    }
  }
}

// T new tokens at positions p0 .. p0+T-1; keys 0 .. p0+T-1. pf: attention_prefetch's registers.
// f: the flag of the q|k|v words to poll and of the partials to publish. False (every thread) on a
// poll timeout or an error raised elsewhere.
template <int T, typename KV>
__device__ bool attention_phase(const AttnLayer<KV>& a, int p0, AttnSmem& sm, const AttnPrefetch& pf,
                                const AttnStatic& as, const Grid& g, uint32_t f) {
  const int ctx = p0 + T;
  const int nchunks = attn_chunks(ctx, T);
  const int chunk = (ctx + nchunks - 1) / nchunks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = 0.08838834764831845f;  // head_dim ** -0.5
  constexpr int NQ = 2 * T;                  // (token, q head) pairs per kv head
  static_assert(NQ + 2 * T <= NW, "one warp per q / new k / new v row");

  for (int item = blockIdx.x; item < QMK_NKV * nchunks; item += gridDim.x) {
    const int h = item % QMK_NKV, c = item / QMK_NKV;
    const int c0 = c * chunk, c1 = min(ctx, c0 + chunk);
    const bool owner = (c == nchunks - 1);  // holds the new positions: appends K/V

    // 1) one warp per row: the q rows (t, j) and, in the owner, the new k and v rows. The norm
    //    weights and RoPE's cos/sin were prepared in the q|k|v phase (AttnStatic); the row's
    //    values arrive with the poll. Per-head RMSNorm (fp32, cast, times weight), then
    //    rotate-half RoPE (cos/sin in fp32, cast to bf16; every product rounded as in bf16
    //    torch): dims d and d +- 64 sit in lanes l and l ^ 16.
    const bool isq = warp < NQ, isk = owner && !isq && warp < NQ + T, isv = owner && !isq && !isk && warp < NQ + 2 * T;
    bool ok = true;
    if (isq || isk || isv) {
      const int t = isq ? warp / 2 : isk ? warp - NQ : warp - NQ - T;
      const int pos = p0 + t;
      const float4 nw = *reinterpret_cast<const float4*>(&(isq ? as.nq : as.nk)[lane * 4]);
      const float4 cs = *reinterpret_cast<const float4*>(&as.cs[t][lane * 4]);
      const float4 sn = *reinterpret_cast<const float4*>(&as.sn[t][lane * 4]);
      const float nwv[4] = {nw.x, nw.y, nw.z, nw.w}, csv[4] = {cs.x, cs.y, cs.z, cs.w}, snv[4] = {sn.x, sn.y, sn.z, sn.w};
      const uint64_t* src =
          a.qkv + t * QMK_QKV + (isq ? (2 * h + (warp & 1)) * QMK_HD : (isk ? QMK_QD : QMK_QD + QMK_KVD) + h * QMK_HD);
      float x[4];
      uint32_t rounds = 0;
      g.mark(3);
      ok = __all_sync(0xffffffffu, g.ll_get<4>(src + lane * 4, f, x, QMK_TRACE ? &rounds : nullptr));
      g.mark(4);
      g.stamp(5, rounds);
      const size_t off = ((size_t)h * a.ld_pos + pos) * QMK_HD + lane * 4;
      if (ok && isv) {
#pragma unroll
        for (int i = 0; i < 4; ++i) kv_store(a.vc + off + i, x[i]);
      } else if (ok) {
        float r[4];
        norm_rope(x, nwv, csv, snv, a.eps, a.exact, lane, r);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (isq) sm.q[warp][lane * 4 + i] = r[i];
          else kv_store(a.kc + off + i, r[i]);
        }
      }
    }
    if (bsync_or(!ok)) return false;
    g.mark(2);

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
    bsync();

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
      uint64_t* pp = a.part + ((size_t)(t * QMK_NH + head) * QMK_MAX_CHUNKS + c) * (QMK_HD + 2);
      if (d == 0) { ll_put(pp, mx, f); ll_put(pp + 1, L, f); }
      ll_put(pp + 2 + d, A, f);
    }
    bsync();
  }
  return true;
}

}  // namespace qmk
