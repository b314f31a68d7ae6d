// One decoder stack (talker or code predictor) over T tokens, as grid-wide phases in the order of
// ops/schedule.cuh (LAYER_PHASES, whose table also names each weight phase's staging slot):
//   P1 input RMSNorm + q|k|v rows (published as LL words, ops/common.cuh: no barrier after it)
//   [P2 talker only: q/k norm, RoPE, KV append, split-K attention (ops/attention.cuh), in the
//       blocks that have a key chunk; its states are LL words too]
//   P2F attention (code predictor) or the merge of P2's chunks (talker) + o_proj partial sums
//       (ops/attn_oproj.cuh)
//   P4 residual + post-norm + gate/up rows -> SwiGLU   P5 down + residual
// and the final-norm + head phase. Each phase waits at the grid barrier (or polls the LL words it
// reads), reads the activations the previous phase published, waits for its weight slice (staged
// by the producer warpgroup, ops/producer.cuh), multiplies, releases the slot, publishes and
// arrives.
#pragma once
#include "attention.cuh"
#include "attn_oproj.cuh"
#include "common.cuh"
#include "matvec.cuh"
#include "sampling.cuh"
#include "schedule.cuh"

namespace qmk {

// Blocks own whole 4-row groups of every matrix (the tensor-core layout, ops/matvec.cuh).
constexpr int ROWS_MAX = rows4_max(QMK_I);  // most gate (and up) rows of a block
constexpr int ROWS_H_MAX = rows4_max(QMK_H);
constexpr int OUT_MAX = 2 * ROWS_MAX * QMK_MAX_T;
static_assert(rows4_max(QMK_QKV) * QMK_MAX_T <= OUT_MAX, "qkv rows");
static_assert(rows4_max(QMK_QKV) <= RED_ROWS && 2 * ROWS_MAX <= RED_ROWS && rows4_max(QMK_VT) <= RED_ROWS, "red");
// Weight staging (matvec.cuh Stage): slot X holds q|k|v, gate|up or a head; slot Y o_proj or
// down (ops/schedule.cuh: consecutive weight phases use different slots, so the producer fills
// one while the compute threads read the other).
constexpr int X_BYTES = 2 * ROWS_MAX * QMK_H * 2;                      // gate + up rows
constexpr int Y_BYTES = ROWS_H_MAX * QMK_I * 2;                        // down rows
constexpr int STAGE_BYTES = X_BYTES + Y_BYTES;
constexpr int slot_bytes(int s) { return s == SLOT_X ? X_BYTES : Y_BYTES; }
static_assert(rows4_max(QMK_QKV) * QMK_H * 2 <= slot_bytes(SLOT_QKV), "q|k|v slice fits its slot");
static_assert(rows4_max(QMK_H, QMK_MIN_BLOCKS / QMK_NKV) * 2 * QMK_HD * 2 <= slot_bytes(SLOT_O), "o_proj partial slice");
static_assert(2 * ROWS_MAX * QMK_H * 2 <= slot_bytes(SLOT_GATE_UP), "gate|up slice");
static_assert(ROWS_H_MAX * QMK_I * 2 <= slot_bytes(SLOT_DOWN), "down slice");
static_assert(rows4_max(QMK_VC) * QMK_H * 2 <= slot_bytes(SLOT_HEAD), "CP head slice");
static_assert(rows4_max(QMK_VT) * QMK_H * 2 <= slot_bytes(SLOT_HEAD), "talker head slice");
// Split activations (matvec.cuh split_store) overwrite xs in place: a token row is XS uint2.
constexpr int XS = QMK_I / 2;
static_assert(QMK_H == 4 * NT, "input loads and norms: one float4 per thread and token");

struct MvSmem {
  float xs[QMK_MAX_T][QMK_I];  // activations [T][K] for K <= 3072
  float out[OUT_MAX];
};
union Smem {
  MvSmem mv;
  AttnSmem at;
  AttnOSmem ao;
  SampleSmem sa;
};

// Where a stack's first layer takes its input from.
struct Input {
  int kind;                        // 1: one row per token   2: frame embedding sum
  const qmk_bf16* row[QMK_MAX_T];  // kind 1 (bf16 embedding rows)
  const float* frow0;              // kind 1: token 0 from an fp32 row instead (past_hidden)
  const qmk_bf16* text;            // kind 2: text-track vector
};

struct Ctx {
  const QmkState& st;
  const QmkModel* m;
  Smem& sm;
  float* red32;                 // smem [NW]
  float* red;                   // smem [RED_FLOATS]: tensor-core matvec per-warp sums
  float (*xown)[ROWS_H_MAX];    // smem [MAX_T][ROWS_H_MAX]: this block's rows of the residual
  float (*xres)[QMK_H];         // smem [MAX_T][H]: the whole residual (P2F's partials add to it)
  int* flag;
  int* codes;                   // smem [16]: this frame's codes
  Grid& g;
  bool exact;                   // bf16-exact rounding points (QMK_FLAG_BF16_EXACT)
  Stage& sg;                    // weight staging slots (dynamic smem) and their mbarriers
  AttnStatic& as;               // smem: the talker attention's norm weights and cos/sin
};

// 4 consecutive bf16 as fp32.
__device__ __forceinline__ float4 ld_bf4(const qmk_bf16* p) {
  const uint2 r = *reinterpret_cast<const uint2*>(p);
  return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y));
}

// xs[t][0..H) = the layer input; each thread owns dims [4*tid, 4*tid + 4) (NT * 4 == H).
template <int T>
__device__ void load_input(const Ctx& c, const Input& in) {
  float(*xs)[QMK_I] = c.sm.mv.xs;
  const int d = threadIdx.x * 4;
  float4 v[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    if (in.kind == 1) {
      v[t] = (t == 0 && in.frow0 != nullptr) ? *reinterpret_cast<const float4*>(in.frow0 + d) : ld_bf4(in.row[t] + d);
    } else {  // qwen-tts: cat(16 embeddings).sum(1) (fp32 accumulate, one rounding) + text
      constexpr int HALF = QMK_GROUPS / 2;
      const float4 tx = ld_bf4(in.text + d);
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k0 = 0; k0 < QMK_GROUPS; k0 += HALF) {
        float4 e[HALF];
#pragma unroll
        for (int k = k0; k < k0 + HALF; ++k)
          e[k - k0] = ld_bf4(k == 0 ? c.m->codec_emb + (size_t)c.codes[0] * QMK_H + d
                                    : c.m->cp_emb[k - 1] + (size_t)c.codes[k] * QMK_H + d);
#pragma unroll
        for (int k = 0; k < HALF; ++k) { s.x += e[k].x; s.y += e[k].y; s.z += e[k].z; s.w += e[k].w; }
      }
      v[t] = make_float4(rnd(rnd(s.x, c.exact) + tx.x, c.exact), rnd(rnd(s.y, c.exact) + tx.y, c.exact),
                         rnd(rnd(s.z, c.exact) + tx.z, c.exact), rnd(rnd(s.w, c.exact) + tx.w, c.exact));
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) *reinterpret_cast<float4*>(&xs[t][d]) = v[t];
  bsync();
}

// In place: xs[t] = w * bf16(xs[t] * rsqrt(mean(xs[t]^2) + eps)), as Qwen3TTSRMSNorm, stored split
// for the tensor-core matvec (split_store). Each thread owns dims [4*tid, 4*tid + 4). hidden_out
// (optional): token 0's normed values in fp32.
template <int T>
__device__ void rmsnorm_xs(const Ctx& c, const float4 wv, float* hidden_out = nullptr) {
  float(*xs)[QMK_I] = c.sm.mv.xs;
  const int d = threadIdx.x * 4;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float4 x = *reinterpret_cast<const float4*>(&xs[t][d]);
    const float ss = block_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w, c.red32);
    const float rinv = 1.0f / sqrtf(ss / (float)QMK_H + c.st.eps);
    const bool e = c.exact;
    x = make_float4(rnd(wv.x * rnd(x.x * rinv, e), e), rnd(wv.y * rnd(x.y * rinv, e), e),
                    rnd(wv.z * rnd(x.z * rinv, e), e), rnd(wv.w * rnd(x.w * rinv, e), e));
    // the 16 threads of a 64-dim chunk (one half warp) read their fp32 values before the block
    // reduction above, so the split can overwrite them
    split_store(reinterpret_cast<uint2*>(xs[t]), d, x);
    if (t == 0 && hidden_out != nullptr) *reinterpret_cast<float4*>(hidden_out + d) = x;
  }
  bsync();
}

// The norm weights of this thread's 4 dims: loaded raw ahead of a barrier wait or poll,
// unpacked by norm_cvt after the wait.
__device__ __forceinline__ uint2 norm_raw(const qmk_bf16* w) {
  return *reinterpret_cast<const uint2*>(w + threadIdx.x * 4);
}
__device__ __forceinline__ float4 norm_cvt(uint2 r) {
  return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y));
}

// xs[t] = src[t][0..N*4*NT), split for the tensor-core matvec (fp32 scratch published by other
// blocks: read through L2).
template <int T, int N>
__device__ void load_scratch(const Ctx& c, const float* src) {
  constexpr int n = N * 4 * NT;
  float4 v[T][N];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int i = 0; i < N; ++i) v[t][i] = __ldcg(reinterpret_cast<const float4*>(src + t * n) + i * NT + threadIdx.x);
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int i = 0; i < N; ++i) split_store(reinterpret_cast<uint2*>(c.sm.mv.xs[t]), 4 * (i * NT + threadIdx.x), v[t][i]);
  bsync();
}

// Residual update of this block's rows [r0, r0 + n): x = x + delta, kept in smem and published
// as LL words with flag f (read by the next layer's P1 and the head phase, which poll them: no
// grid barrier after P5).
template <int T>
__device__ void residual_add(const Ctx& c, int r0, int n, const float* delta, uint32_t f) {
  for (int idx = threadIdx.x; idx < n * T; idx += NT) {
    const int r = idx / T, t = idx % T;
    const float x = rnd(c.xown[t][r] + rnd(delta[idx], c.exact), c.exact);
    c.xown[t][r] = x;
    ll_put(c.st.x + t * QMK_H + r0 + r, x, f);
  }
}

// xs[t][0..H) = residual rows t0 + t (LL words of st.x, flag f; each thread polls its 4 dims).
// False (every thread) on a timeout or another block's error.
template <int T>
__device__ bool load_x(const Ctx& c, uint32_t f, int t0 = 0) {
  static_assert(QMK_H == 4 * NT, "one 4-word group per thread and token");
  const int d = 4 * threadIdx.x;
  bool ok = true;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float v[4];
    ok = ok && c.g.ll_get<4>(c.st.x + (size_t)(t0 + t) * QMK_H + d, f, v);
    *reinterpret_cast<float4*>(&c.sm.mv.xs[t][d]) = make_float4(v[0], v[1], v[2], v[3]);
  }
  return !bsync_or(!ok);
}

// One decoder stack over T tokens at positions p0.. (K/V cache: kc/vc + layer * lstride, ld_pos
// positions per kv head). The caller has no barrier pending; on return the last phase has arrived
// but not waited. CP: the code predictor (attention recomputed in P2F), else the talker (P2 +
// merge).
template <int T, typename KV, bool CP>
__device__ __forceinline__ bool run_stack(const Ctx& c, const QmkLayer* layers, int nlayers, const Input& in0, int p0,
                                          KV* kc, KV* vc, size_t lstride, int ld_pos, const float* inv_freq) {
  const QmkState& st = c.st;
  const int G = gridDim.x, b = blockIdx.x;
  float* out = c.sm.mv.out;
  const uint2* xsp = reinterpret_cast<const uint2*>(&c.sm.mv.xs[0][0]);
  int h0, hn, i0, in_, q0, qn;  // this block's rows of the H-, I- and QKV-row matrices
  rows4_of(b, G, QMK_H, h0, hn);
  rows4_of(b, G, QMK_I, i0, in_);
  rows4_of(b, G, QMK_QKV, q0, qn);
  const int nchunks = CP ? 0 : attn_chunks(p0 + T, T);
  for (int L = 0; L < nlayers; ++L) {
    const QmkLayer& w = layers[L];
    const int d4 = threadIdx.x * 4;
    // P1: input RMSNorm (every block, redundantly) + this block's q|k|v rows (slot X).
    const bool attn_block = !CP && (int)blockIdx.x < QMK_NKV * nchunks;  // has a split-K item
    uint2 wn = norm_raw(w.in_norm);  // static: loaded before the poll
    KV* kcl = kc + L * lstride;
    KV* vcl = vc + L * lstride;
    // the split-K items' norm weights and inv_freq, loaded ahead of this phase's input
    const AttnStaticRaw asr = attn_block ? attention_static_load(w.q_norm, w.k_norm, inv_freq) : AttnStaticRaw{0.f, 0.f};
    if (L == 0) {
      load_input<T>(c, in0);
      for (int idx = threadIdx.x; idx < T * hn; idx += NT) {
        const int t = idx / hn, r = idx % hn;
        c.xown[t][r] = c.sm.mv.xs[t][h0 + r];
      }
    } else {
      c.g.mark(1);
      if (!load_x<T>(c, c.g.ll_flag())) return false;  // the previous layer's P5 rows
      c.g.mark(2);
    }
    // keep the raw residual: P4 adds the o_proj partials to it
#pragma unroll
    for (int t = 0; t < T; ++t)
      *reinterpret_cast<float4*>(&c.xres[t][d4]) = *reinterpret_cast<const float4*>(&c.sm.mv.xs[t][d4]);
    rmsnorm_xs<T>(c, norm_cvt(wn));
    if (attn_block) attention_static_store<T>(asr, p0, c.exact, c.as);  // read after P1's closing sync
    c.g.mark(3);
    c.sg.wait(SLOT_QKV);
    c.g.mark(4);
    mv_mma<T, QMK_H, XS, KW_QKV>(qn, c.sg.slot[SLOT_QKV], xsp, out, c.red);
    c.sg.release(SLOT_QKV);
    c.g.mark(5);
    // published as LL words: only the attention's blocks read them, and they poll (no barrier)
    const uint32_t llf = c.g.ll_next();
    for (int idx = threadIdx.x; idx < qn * T; idx += NT)
      ll_put(st.qkv + (idx % T) * QMK_QKV + q0 + idx / T, rnd(out[idx], c.exact), llf);
    c.g.tick();

    if constexpr (CP) {
      if (!cp_attn_oproj<T>(st, w, kcl, vcl, p0, inv_freq, c.exact, c.g, c.sg, c.sm.ao, c.red)) return false;
    } else {
      // P2: split-K attention in the blocks that have an item (cached keys loaded before the
      // polls); P2F merges the chunks. Neither waits at a grid barrier: both poll LL words.
      if (attn_block) {
        const AttnLayer<KV> al{st.qkv, kcl, vcl, ld_pos, st.eps, st.part, c.exact};
        AttnPrefetch pf;
        attention_prefetch<T, KV>(al, p0, pf);
        c.g.mark(1);
        if (!attention_phase<T, KV>(al, p0, c.sm.at, pf, c.as, c.g, c.g.ll_flag())) return false;
      }
      c.g.tick();
      if (!merge_oproj<T>(st, nchunks, c.exact, c.g, c.sg, c.sm.ao, c.red)) return false;
    }

    // P4: x += opart[0] + ... + opart[7] (fixed order: every block computes the same residual),
    // post-attention RMSNorm + this block's gate/up rows (X) -> SwiGLU activations.
    wn = norm_raw(w.post_norm);  // static: loaded before the barrier wait
    if (!c.g.wait(c.flag)) return false;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float4 p[QMK_NKV];
#pragma unroll
      for (int g = 0; g < QMK_NKV; ++g)
        p[g] = __ldcg(reinterpret_cast<const float4*>(st.opart + ((size_t)g * QMK_MAX_T + t) * QMK_H + d4));
      float4 o = p[0];
#pragma unroll
      for (int g = 1; g < QMK_NKV; ++g) { o.x += p[g].x; o.y += p[g].y; o.z += p[g].z; o.w += p[g].w; }
      const float4 xr = *reinterpret_cast<const float4*>(&c.xres[t][d4]);
      const bool e = c.exact;
      const float4 xn = make_float4(rnd(xr.x + rnd(o.x, e), e), rnd(xr.y + rnd(o.y, e), e),
                                    rnd(xr.z + rnd(o.z, e), e), rnd(xr.w + rnd(o.w, e), e));
      *reinterpret_cast<float4*>(&c.xres[t][d4]) = xn;
      *reinterpret_cast<float4*>(&c.sm.mv.xs[t][d4]) = xn;
    }
    bsync();
    for (int idx = threadIdx.x; idx < T * hn; idx += NT) {
      const int t = idx / hn, r = idx % hn;
      c.xown[t][r] = c.xres[t][h0 + r];
    }
    rmsnorm_xs<T>(c, norm_cvt(wn));
    c.g.mark(3);
    c.sg.wait(SLOT_GATE_UP);
    c.g.mark(4);
    mv_mma<T, QMK_H, XS, KW_GU>(2 * in_, c.sg.slot[SLOT_GATE_UP], xsp, out, c.red);
    c.g.mark(5);
    for (int idx = threadIdx.x; idx < in_ * T; idx += NT) {
      const int r = idx / T, t = idx % T;
      const float gt = rnd(out[r * T + t], c.exact), up = rnd(out[(in_ + r) * T + t], c.exact);
      st.act[t * QMK_I + i0 + r] = rnd(rnd(gt / (1.0f + expf(-gt)), c.exact) * up, c.exact);
    }
    c.g.arrive();
    c.sg.release(SLOT_GATE_UP);

    // P5: down_proj (Y) + residual on this block's rows.
    if (!c.g.wait(c.flag)) return false;
    load_scratch<T, QMK_I / (4 * NT)>(c, st.act);
    c.g.mark(3);
    c.sg.wait(SLOT_DOWN);
    c.g.mark(4);
    mv_mma<T, QMK_I, XS, KW_DOWN>(hn, c.sg.slot[SLOT_DOWN], xsp, out, c.red);
    c.g.mark(5);
    residual_add<T>(c, h0, hn, out, c.g.ll_next());
    c.g.tick();
    c.sg.release(SLOT_DOWN);
  }
  return true;
}

// Final RMSNorm of token t + this block's rows of a [V, H] head (staged in slot X by the producer,
// ops/producer.cuh) -> st.logits (and dump row); ends with a full barrier so every block can read
// all logits.
__device__ bool head_phase(const Ctx& c, const qmk_bf16* norm_w, int V, int t, float* hidden_out, int dump_row) {
  const int G = gridDim.x, b = blockIdx.x;
  int r0, n;
  rows4_of(b, G, V, r0, n);
  uint2 wn = norm_raw(norm_w);
  c.g.mark(1);
  if (!load_x<1>(c, c.g.ll_flag(), t)) return false;  // the last layer's P5 rows
  c.g.mark(2);
  rmsnorm_xs<1>(c, norm_cvt(wn), b == 0 ? hidden_out : nullptr);
  c.g.mark(3);
  c.sg.wait(SLOT_HEAD);
  c.g.mark(4);
  mv_mma<1, QMK_H, XS, KW_HEAD>(n, c.sg.slot[SLOT_HEAD], reinterpret_cast<const uint2*>(&c.sm.mv.xs[0][0]), c.sm.mv.out,
                                     c.red);
  c.g.mark(5);
  for (int r = threadIdx.x; r < n; r += NT) {
    const float v = rnd(c.sm.mv.out[r], c.exact);
    __stcg(c.st.logits + r0 + r, v);
    if (!QMK_TRACE && c.st.dump != nullptr) c.st.dump[dump_row * QMK_VT + r0 + r] = v;
  }
  c.g.arrive();
  c.sg.release(SLOT_HEAD);
  return c.g.wait(c.flag);
}

}  // namespace qmk
