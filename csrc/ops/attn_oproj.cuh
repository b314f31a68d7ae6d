// Phase "attention + o_proj partial" of every layer (code predictor and talker): one grid barrier
// less per layer than an o_proj phase of its own, and every block has work.
//
// Blocks are split into 8 groups by kv head (g = block % 8). Every block of group g gets the
// attention output of kv head g (its 2 q heads, T tokens), then multiplies its share of o_proj
// rows, restricted to the 256 columns of those 2 heads, into a partial sum opart[g][t][row]. The
// next phase adds x + (opart[0] + ... + opart[7]) in a fixed order in every block
// (deterministic). The attention output comes one of two ways:
// - code predictor (cp_attn_oproj): every block of the group recomputes, from the raw q|k|v
//   linear outputs, the per-head q/k RMSNorm + RoPE and the tiny attention (<= 16 keys); block g
//   (first of its group) appends the new K/V rows. Keys of earlier positions were written in
//   earlier passes (many barriers ago), so they are loaded before the barrier wait together with
//   the o_proj weight slice.
// - talker (merge_oproj): the split-K phase before (ops/attention.cuh) left one online-softmax
//   state per key chunk; every block of the group merges its head pair's chunks. (Recomputing
//   the talker's attention over all keys in every block of the group, with no split-K phase,
//   measured slower: talker step 644-701 vs 600-616 us at ctx 100, H100.)
#pragma once
#include "common.cuh"
#include "matvec.cuh"
#include "schedule.cuh"

namespace qmk {

constexpr int CP_KPW = (QMK_CP_POS + NW - 1) / NW;  // keys per warp (16 positions / 8 warps)
static_assert(2 * QMK_MAX_T + 2 * QMK_MAX_T <= NW, "one warp per q / k / v row of a kv head");

struct AttnOSmem {
  float q[2 * QMK_MAX_T][QMK_HD];   // q after norm + RoPE, row = t * 2 + j
  float kn[QMK_MAX_T][QMK_HD];      // new k rows (norm + RoPE)
  float vn[QMK_MAX_T][QMK_HD];      // new v rows
  float merge[NW][2 * QMK_MAX_T][QMK_HD + 2];
  uint2 a[QMK_MAX_T][QMK_HD];       // attention output of the 2 q heads (o_proj columns 256g..),
                                    // split for the tensor cores (matvec.cuh split_store)
  float out[RED_ROWS * QMK_MAX_T];  // this block's o_proj partial rows
};

// This block's kv-head group g and its o_proj rows [r0, r0 + n) within the group.
__device__ __forceinline__ void oproj_rows(int& g, int& gi, int& r0, int& n) {
  const int G = gridDim.x, b = blockIdx.x;
  g = b % QMK_NKV;
  gi = b / QMK_NKV;
  const int gn = (G - g + QMK_NKV - 1) / QMK_NKV;
  rows4_of(gi, gn, QMK_H, r0, n);
}

// Every o_proj arrives head-group major (host side, megakernel.py grouped_o): o[g][row][256]
// = o_proj[row][256 g + .], so a block's slice (n rows x the 256 columns of group g) is one
// contiguous range (ops/producer.cuh).

// The phase's end: this block's o_proj rows x the group's 256 columns (the attention output split
// in s.a), on the tensor cores, -> opart[g]; then the barrier arrive.
template <int T>
__device__ __forceinline__ void oproj_partial(const QmkState& st, Grid& grid, Stage& sg, AttnOSmem& s, float* red) {
  int g, gi, r0, n;
  oproj_rows(g, gi, r0, n);
  bsync();
  grid.mark(3);
  sg.wait(SLOT_O);
  grid.mark(4);
  mv_mma<T, 2 * QMK_HD, QMK_HD, KW_CPO>(n, sg.slot[SLOT_O], &s.a[0][0], s.out, red);
  for (int idx = threadIdx.x; idx < n * T; idx += NT) {
    const int r = idx / T, t = idx % T;
    __stcg(st.opart + ((size_t)g * QMK_MAX_T + t) * QMK_H + r0 + r, s.out[idx]);
  }
  grid.mark(5);
  grid.arrive();
  sg.release(SLOT_O);
}

// Code predictor. kc / vc: this layer's CP cache [NKV][CP_POS][HD]; T new tokens at positions
// p0 ... Polls the q|k|v rows (LL words, flag grid.ll_flag()), computes, arrives.
template <int T>
__device__ __forceinline__ bool cp_attn_oproj(const QmkState& st, const QmkLayer& w, float* kc, float* vc, int p0,
                                              const float* inv_freq, bool exact, Grid& grid, Stage& sg,
                                              AttnOSmem& s, float* red) {
  constexpr int NQ = 2 * T;
  int g, gi, r0, n;
  oproj_rows(g, gi, r0, n);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ctx = p0 + T;
  // Static loads ahead of the wait: cached keys/values of this warp, norm weights, inv_freq.
  const float* kb = kc + (size_t)g * QMK_CP_POS * QMK_HD + lane * 4;
  const float* vb = vc + (size_t)g * QMK_CP_POS * QMK_HD + lane * 4;
  float4 kf[CP_KPW], vf[CP_KPW];
#pragma unroll
  for (int i = 0; i < CP_KPW; ++i) {
    const int j = warp + NW * i;
    kf[i] = vf[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < p0) {
      kf[i] = __ldcg(reinterpret_cast<const float4*>(kb + (size_t)j * QMK_HD));
      vf[i] = __ldcg(reinterpret_cast<const float4*>(vb + (size_t)j * QMK_HD));
    }
  }
  const bool isq = warp < NQ, isk = !isq && warp < NQ + T, isv = !isq && !isk && warp < NQ + 2 * T;
  float nw[4], fr[4];
  {
    const qmk_bf16* np = (isq ? w.q_norm : w.k_norm) + lane * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) nw[i] = bf2f(np[i]);
    const float4 f4 = *reinterpret_cast<const float4*>(inv_freq + ((lane * 4) & (QMK_HD / 2 - 1)));
    fr[0] = f4.x; fr[1] = f4.y; fr[2] = f4.z; fr[3] = f4.w;
  }

  // No grid barrier: the q|k|v rows of kv head g are polled as LL words (ops/common.cuh).
  grid.mark(1);

  // 1) one warp per row: q rows (t, j), new k rows, new v rows of kv head g.
  bool ok = true;
  if (isq || isk || isv) {
    const int t = isq ? warp >> 1 : (isk ? warp - NQ : warp - NQ - T);
    const uint64_t* src = st.qkv + t * QMK_QKV +
                          (isq ? (2 * g + (warp & 1)) * QMK_HD : (isk ? QMK_QD : QMK_QD + QMK_KVD) + g * QMK_HD);
    float xr[4];
    ok = __all_sync(0xffffffffu, grid.ll_get<4>(src + lane * 4, grid.ll_flag(), xr));
    const float4 raw = make_float4(xr[0], xr[1], xr[2], xr[3]);
    const size_t coff = ((size_t)g * QMK_CP_POS + p0 + t) * QMK_HD + lane * 4;
    if (ok && isv) {
      *reinterpret_cast<float4*>(&s.vn[t][lane * 4]) = raw;
      if (gi == 0) *reinterpret_cast<float4*>(vc + coff) = raw;
    } else if (ok) {
      const float x[4] = {raw.x, raw.y, raw.z, raw.w};
      float cs[4], sn[4], r[4];
      const float ang0 = (float)(p0 + t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sincosf(ang0 * fr[i], &sn[i], &cs[i]);  // one argument reduction for both (same values as sinf / cosf)
        cs[i] = rnd(cs[i], exact);
        sn[i] = rnd(sn[i], exact);
      }
      norm_rope(x, nw, cs, sn, st.eps, exact, lane, r);
      const float4 r4 = make_float4(r[0], r[1], r[2], r[3]);
      if (isq) {
        *reinterpret_cast<float4*>(&s.q[warp][lane * 4]) = r4;
      } else {
        *reinterpret_cast<float4*>(&s.kn[t][lane * 4]) = r4;
        if (gi == 0) *reinterpret_cast<float4*>(kc + coff) = r4;
      }
    }
  }
  if (bsync_or(!ok)) return false;
  grid.mark(2);

  // 2) warp w walks keys w, w + 8 (online softmax), then the 8 warps merge (as attention.cuh).
  const float scale = 0.08838834764831845f;  // head_dim ** -0.5
  float qv[NQ][4], m[NQ], l[NQ], acc[NQ][4];
  softmax_begin<NQ>(s.q, lane, qv, m, l, acc);
#pragma unroll
  for (int i = 0; i < CP_KPW; ++i) {
    const int j = warp + NW * i;
    if (j < ctx) {
      float4 k4 = kf[i], v4 = vf[i];
      if (j >= p0) {
        k4 = *reinterpret_cast<const float4*>(&s.kn[j - p0][lane * 4]);
        v4 = *reinterpret_cast<const float4*>(&s.vn[j - p0][lane * 4]);
      }
      const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, vv[4] = {v4.x, v4.y, v4.z, v4.w};
      attend_key<NQ>(qv, kk, vv, j, p0, scale, m, l, acc);
    }
  }
  softmax_save<NQ>(s.merge[warp], lane, m, l, acc);
  bsync();
  // 4 consecutive dims per thread (one split_store each).
  for (int idx = threadIdx.x; idx < NQ * QMK_HD / 4; idx += NT) {
    const int r = idx / (QMK_HD / 4), d = (idx % (QMK_HD / 4)) * 4;
    float mx = neg_inf();
    for (int w2 = 0; w2 < NW; ++w2) mx = fmaxf(mx, s.merge[w2][r][0]);
    float L = 0.f, A[4] = {0.f, 0.f, 0.f, 0.f};
    for (int w2 = 0; w2 < NW; ++w2) {
      const float e = s.merge[w2][r][0] == neg_inf() ? 0.f : expf(s.merge[w2][r][0] - mx);
      L = fmaf(s.merge[w2][r][1], e, L);
#pragma unroll
      for (int i = 0; i < 4; ++i) A[i] = fmaf(s.merge[w2][r][2 + d + i], e, A[i]);
    }
    split_store(s.a[r / 2], (r & 1) * QMK_HD + d,
                make_float4(rnd(A[0] / L, exact), rnd(A[1] / L, exact), rnd(A[2] / L, exact), rnd(A[3] / L, exact)));
  }
  oproj_partial<T>(st, grid, sg, s, red);
  return true;
}

// Talker: merge the nchunks split-K states of heads 2g, 2g + 1 (LL words of the split-K phase,
// flag grid.ll_flag(); every chunk holds >= 1 visible key), then the o_proj partial. The block's
// threads split the chunks PARTS ways (online merges of their chunks, each chunk's words polled
// in one round trip), then the parts are merged in a fixed order.
template <int T>
__device__ __forceinline__ bool merge_oproj(const QmkState& st, int nchunks, bool exact, Grid& grid, Stage& sg,
                                            AttnOSmem& s, float* red) {
  constexpr int NQ = 2 * T, QUADS = NQ * QMK_HD / 4, PARTS = NT / QUADS;
  static_assert(NT % QUADS == 0 && PARTS * QUADS * 6 <= NW * 2 * QMK_MAX_T * (QMK_HD + 2), "merge scratch");
  const int g = blockIdx.x % QMK_NKV;
  const uint32_t f = grid.ll_flag();
  grid.mark(1);
  const int p = threadIdx.x / QUADS, idx = threadIdx.x % QUADS;
  const int r = idx / (QMK_HD / 4), d = (idx % (QMK_HD / 4)) * 4;
  const uint64_t* pp = st.part + (size_t)((r / 2) * QMK_NH + 2 * g + (r & 1)) * QMK_MAX_CHUNKS * (QMK_HD + 2);
  float mx = neg_inf(), L = 0.f, A[4] = {0.f, 0.f, 0.f, 0.f};
  bool ok = true;
  for (int cc = p; cc < nchunks && ok; cc += PARTS) {
    const uint64_t* q = pp + cc * (QMK_HD + 2);
    float ml[2], a[4];
    ok = grid.ll_get<2>(q, f, ml) && grid.ll_get<4>(q + 2 + d, f, a);
    const float mn = fmaxf(mx, ml[0]);
    const float co = expf(mx - mn), e = expf(ml[0] - mn);  // co = 0 on the first chunk
    L = fmaf(L, co, ml[1] * e);
#pragma unroll
    for (int i = 0; i < 4; ++i) A[i] = fmaf(A[i], co, a[i] * e);
    mx = mn;
  }
  float* sc = &s.merge[0][0][0];  // [PARTS][QUADS][6] scratch
  float* mine = sc + (p * QUADS + idx) * 6;
  mine[0] = mx; mine[1] = L;
#pragma unroll
  for (int i = 0; i < 4; ++i) mine[2 + i] = A[i];
  if (bsync_or(!ok)) return false;
  grid.mark(2);
  if (p == 0) {
    float M = neg_inf();
#pragma unroll
    for (int q = 0; q < PARTS; ++q) M = fmaxf(M, sc[(q * QUADS + idx) * 6]);
    float LL = 0.f, AA[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < PARTS; ++q) {
      const float* o = sc + (q * QUADS + idx) * 6;
      const float e = o[0] == neg_inf() ? 0.f : expf(o[0] - M);  // a part without chunks: 0
      LL = fmaf(o[1], e, LL);
#pragma unroll
      for (int i = 0; i < 4; ++i) AA[i] = fmaf(o[2 + i], e, AA[i]);
    }
    split_store(s.a[r / 2], (r & 1) * QMK_HD + d,
                make_float4(rnd(AA[0] / LL, exact), rnd(AA[1] / LL, exact), rnd(AA[2] / LL, exact),
                            rnd(AA[3] / LL, exact)));
  }
  oproj_partial<T>(st, grid, sg, s, red);
  return true;
}

}  // namespace qmk
