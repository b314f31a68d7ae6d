// The talker step's own phases (advance.cu): the frame's input rows, attention over the paged KV
// pool in chunks with their merge, and the code-0 draw with the slot's state commit. Like every
// phase here, a row's values depend on that row alone, in a fixed order.
#pragma once
#include <type_traits>

#include "rows.cuh"
#include "sample.cuh"

namespace qbk {

__device__ __forceinline__ int ival(const QbkParams& P, int64_t field, int64_t slot) {
  return P.ints[field * P.num_slots + slot];
}

// Input row m: codec_embedding[code 0] + the 15 code groups' embeddings of the frame's codes (in
// order, fp32; frame.py embed_sum) + the slot's next text-track vector (pending text, else
// tts_pad); hs row m = its RMSNorm.
__device__ __noinline__ inline void phase_talker_input(const QbkParams& P, int B, float* red) {
  const int d = threadIdx.x * 4;
  for (int m = blockIdx.x; m < B; m += gridDim.x) {
    const int64_t slot = P.rows[m];
    float4 x = ld_bf4(P.codec_emb + (size_t)code0_of(P, slot) * H + d);
    const int32_t* codes = P.out + m * P.out_stride;
    for (int k = 0; k < PASSES; ++k) {
      int c = __ldcg(codes + 1 + k);
      c = c < 0 ? 0 : c >= VC ? VC - 1 : c;
      x = add4(x, ld_bf4(P.emb + ((size_t)k * VC + c) * H + d));
    }
    const int ts = ival(P, P.f_text_step, slot);
    const int step = ts < P.max_trailing - 1 ? ts : (int)P.max_trailing - 1;
    const __nv_bfloat16* text = ts < ival(P, P.f_n_trailing, slot)
                                    ? P.trailing + ((size_t)slot * P.max_trailing + step) * H
                                    : P.pad_embed + (size_t)slot * H;
    x = add4(x, ld_bf4(text + d));
    *reinterpret_cast<float4*>(P.x + (size_t)m * H + d) = x;
    norm_store(P, m, x, P.t_in_norm[0], red);
  }
}

// A stream of n keys: chunks of `per` 64-key units, `n` of them (at most MAXCH).
struct Chunks {
  int n, per;
};
__device__ __forceinline__ Chunks chunks_of(int nkeys) {
  const int units = (nkeys + ATT_UNIT - 1) / ATT_UNIT;
  const int per = (units + MAXCH - 1) / MAXCH;
  return {(units + per - 1) / per, per};
}

// 4 dims of key / value j of (slot, layer L, kv head) in the paged pool, as fp32.
struct Pool {
  const QbkParams& P;
  int L;
  __device__ size_t at(int64_t slot, int kvh, int j, int d) const {
    const int bs = (int)P.kv_block_size;
    const int64_t blk = P.block_table[slot * P.table_stride + j / bs];
    return ((((size_t)L * P.kv_blocks + blk) * NKV + kvh) * bs + j % bs) * HD + d;
  }
  __device__ float4 load(const void* base, size_t i) const {
    if (P.kv_fp32) return ldcg4(static_cast<const float*>(base) + i);
    const uint2 r = __ldcg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + i));
    return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y));
  }
  // v rounded to the pool's type (the value a later read returns), stored at i.
  __device__ float4 store(void* base, size_t i, float4 v) const {
    if (P.kv_fp32) {
      *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = v;
      return v;
    }
    const uint2 r = make_uint2(pack_bf2(v.x, v.y), pack_bf2(v.z, v.w));
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(base) + i) = r;
    return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y));
  }
};

// Keys whose loads are in flight together: a group (8 from a bf16 pool, 4 from an fp32 one; two
// groups in registers at a time; 16 from bf16 measured slower: 940 vs 816 us per layer at
// B = 256). A group never spans a pool block (the host requires block sizes that are multiples
// of 16).
template <bool F32>
constexpr int kg() { return F32 ? 4 : 8; }

__device__ __forceinline__ float* apart_at(const QbkParams& P, int m, int kvh, int c, int h) {
  return P.apart + ((((size_t)m * NKV + kvh) * MAXCH + c) * 2 + h) * APART;
}

// A group's keys and values as loaded (the pool's type: 4 fp32 or 4 bf16 per lane and key).
template <bool F32>
struct KVGroup {
  using Raw = typename std::conditional<F32, float4, uint2>::type;
  Raw k[kg<F32>()], v[kg<F32>()];
  __device__ static float4 f(const float4& r) { return r; }
  __device__ static float4 f(const uint2& r) { return make_float4(lo_bf(r.x), hi_bf(r.x), lo_bf(r.y), hi_bf(r.y)); }
};

// Keys j .. j + kg - 1 (< j1; the new position pos is not read: it is the caller's kn / vn) of
// (slot, kv head), one block-table read for the group.
template <bool F32>
__device__ __forceinline__ void load_group(const Pool& pool, int64_t slot, int kvh, int j, int j1, int pos, int d,
                                           KVGroup<F32>& g) {
  using Raw = typename KVGroup<F32>::Raw;
  using Elem = typename std::conditional<F32, float, __nv_bfloat16>::type;
  const size_t at = j < j1 ? pool.at(slot, kvh, j, d) : 0;  // past the chunk: nothing is read
  const Raw* kb = reinterpret_cast<const Raw*>(static_cast<const Elem*>(pool.P.kv_k) + at);
  const Raw* vb = reinterpret_cast<const Raw*>(static_cast<const Elem*>(pool.P.kv_v) + at);
  constexpr int step = HD / 4;  // Raw units per key row
#pragma unroll
  for (int u = 0; u < kg<F32>(); ++u) {
    if (j + u < j1 && j + u != pos) {
      g.k[u] = __ldcg(kb + u * step);
      g.v[u] = __ldcg(vb + u * step);
    } else {
      g.k[u] = g.v[u] = Raw{};
    }
  }
}

// One warp per (row m, kv head, chunk c) that exists: the two q heads (q|k|v parts, q-norm, RoPE
// at the stream's position) over the chunk's keys, in order, as an online softmax; the chunk that
// holds the new position first stores that position's k (k-norm, RoPE) and v into the pool, in
// the pool's type, and uses the stored values. Each chunk's state (o, max, sum) per head goes to
// apart. The keys go in groups of kg, the next group's loads issued before the current group's
// arithmetic (the first group's before the q|k|v sums).
template <bool F32>
__device__ __noinline__ void talker_attention(const QbkParams& P, int L, int B, int np) {
  const size_t ps = (size_t)B * QKV;
  const int lane = threadIdx.x & 31, d = 4 * lane;
  const float eps = (float)P.eps, scale = (float)P.scale;
  const float4 qw = *reinterpret_cast<const float4*>(P.t_q_norm[L] + d);
  const float4 kw = *reinterpret_cast<const float4*>(P.t_k_norm[L] + d);
  const Pool pool{P, L};
  constexpr int KG = kg<F32>();
  for (int item = global_warp(); item < B * NKV * MAXCH; item += gridDim.x * WARPS) {
    const int c = item % MAXCH, kvh = (item / MAXCH) % NKV, m = item / (MAXCH * NKV);
    const int64_t slot = P.rows[m];
    const int pos = ival(P, P.f_pos, slot);
    const Chunks ch = chunks_of(pos + 1);
    if (c >= ch.n) continue;
    const int j0 = c * ch.per * ATT_UNIT, j1 = pos + 1 < j0 + ch.per * ATT_UNIT ? pos + 1 : j0 + ch.per * ATT_UNIT;
    KVGroup<F32> cur, nxt;
    load_group<F32>(pool, slot, kvh, j0, j1, pos, d, cur);
    const size_t row = (size_t)m * QKV + d;
    const float4 cs = *reinterpret_cast<const float4*>(P.t_rope_cos + (size_t)pos * HD + d);
    const float4 sn = *reinterpret_cast<const float4*>(P.t_rope_sin + (size_t)pos * HD + d);
    float4 q[2];
    for (int h = 0; h < 2; ++h)
      q[h] = norm_rope(sum_parts4<HP>(P.parts, np, ps, row + (2 * kvh + h) * HD), qw, eps, cs, sn, lane);
    float4 kn = make_float4(0.f, 0.f, 0.f, 0.f), vn = kn;
    if (j1 == pos + 1) {
      const size_t at = pool.at(slot, kvh, pos, d);
      kn = pool.store(P.kv_k, at, norm_rope(sum_parts4<HP>(P.parts, np, ps, row + QD + kvh * HD), kw, eps, cs, sn, lane));
      vn = pool.store(P.kv_v, at, sum_parts4<HP>(P.parts, np, ps, row + QD + KVD + kvh * HD));
    }
    // per group: its scores, one softmax rescale, its values in order
    float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float4 o[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    for (int j = j0; j < j1; j += KG) {
      load_group<F32>(pool, slot, kvh, j + KG, j1, pos, d, nxt);  // (all zeros past the chunk)
      const int nk = j1 - j < KG ? j1 - j : KG;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float s[KG], gm = -INFINITY;
#pragma unroll
        for (int u = 0; u < KG; ++u) {
          s[u] = u < nk ? warp_sum(dot4(q[h], j + u == pos ? kn : KVGroup<F32>::f(cur.k[u]))) * scale : -INFINITY;
          gm = fmaxf(gm, s[u]);
        }
        const float mn = fmaxf(mx[h], gm), a = expf(mx[h] - mn);
        float4 acc = make_float4(o[h].x * a, o[h].y * a, o[h].z * a, o[h].w * a);
        float lsum = l[h] * a;
#pragma unroll
        for (int u = 0; u < KG; ++u) {
          if (u >= nk) break;
          const float p = expf(s[u] - mn);
          const float4 vu = j + u == pos ? vn : KVGroup<F32>::f(cur.v[u]);
          lsum += p;
          acc = make_float4(acc.x + p * vu.x, acc.y + p * vu.y, acc.z + p * vu.z, acc.w + p * vu.w);
        }
        o[h] = acc;
        l[h] = lsum;
        mx[h] = mn;
      }
      cur = nxt;
    }
    for (int h = 0; h < 2; ++h) {
      float* st = apart_at(P, m, kvh, c, h);
      *reinterpret_cast<float4*>(st + d) = o[h];
      if (lane == 0) {
        st[HD] = mx[h];
        st[HD + 1] = l[h];
      }
    }
  }
}

__device__ __forceinline__ void phase_talker_attention(const QbkParams& P, int L, int B, int np) {
  if (P.kv_fp32) talker_attention<true>(P, L, B, np);
  else talker_attention<false>(P, L, B, np);
}

// One warp per (row m, kv head): its chunks' states merged in chunk order -> the two heads'
// attention outputs into hs (o_proj's input).
__device__ __noinline__ inline void phase_talker_combine(const QbkParams& P, int B) {
  constexpr int CB = 4;
  const int lane = threadIdx.x & 31, d = 4 * lane;
  for (int item = global_warp(); item < B * NKV; item += gridDim.x * WARPS) {
    const int m = item / NKV, kvh = item % NKV;
    const Chunks ch = chunks_of(ival(P, P.f_pos, P.rows[m]) + 1);
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY, l = 0.f;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int c0 = 0; c0 < ch.n; c0 += CB) {  // CB chunks' loads in flight at once
        float4 os[CB];
        float2 ml[CB];
#pragma unroll
        for (int u = 0; u < CB; ++u) {
          if (c0 + u < ch.n) {
            const float* st = apart_at(P, m, kvh, c0 + u, h);
            os[u] = ldcg4(st + d);
            ml[u] = __ldcg(reinterpret_cast<const float2*>(st + HD));
          }
        }
#pragma unroll
        for (int u = 0; u < CB; ++u) {
          if (c0 + u >= ch.n) break;
          const float mc = ml[u].x, lc = ml[u].y;
          const float4 oc = os[u];
          const float mn = fmaxf(mx, mc), a = expf(mx - mn), b = expf(mc - mn);
          o = make_float4(o.x * a + oc.x * b, o.y * a + oc.y * b, o.z * a + oc.z * b, o.w * a + oc.w * b);
          l = l * a + lc * b;
          mx = mn;
        }
      }
      __nv_bfloat16* hr = hs_row(P, m);
      split_store4(hr, hr + KMAX, (2 * kvh + h) * HD + d, make_float4(o.x / l, o.y / l, o.z / l, o.w / l));
    }
  }
}

// Stream m's draw, by one warp: the codec head's logits (dumped raw), the talker's processors
// (repetition penalty over the slot's code-0 history, ids from suppress_start on masked except
// EOS, EOS masked before min_new_tokens draws or while the text track is open), the draw (stream
// 0, counter = the draws so far) and the commit: position, code 0, draws, text step, the history
// byte, out[16] and the talker's error bit (bit 15 of out's error column).
__device__ __forceinline__ void talker_draw_row(const QbkParams& P, int m, int B, int np, uint8_t* smem, int warp,
                                                int lane) {
  const int64_t slot = P.rows[m], ns = P.num_slots;
  const int nsamp = ival(P, P.f_n_sampled, slot);
  const int gate = nsamp >= ival(P, P.f_eos_from, slot) ? nsamp : -1;
  const float pen = P.floats[P.f_penalty * ns + slot];
  const uint8_t* seen = P.seen + slot * VT;
  float* xs = reinterpret_cast<float*>(smem) + warp * VT;
  int* kept = reinterpret_cast<int*>(smem) + WARPS * VT + warp * KEPT_MAX;
  gather_logits<VT>(P, np, B, m, PASSES * P.dump_pass, xs, [&](int v, float x) {
    if (seen[v]) x = x < 0.f ? x * pen : __fdiv_rn(x, pen);
    if (v >= P.suppress_start && v != P.eos) x = -INFINITY;
    if (v == P.eos && gate < P.min_new_tokens) x = -INFINITY;
    return x;
  });
  const Draw dr{ival(P, P.f_t_do_sample, slot), P.floats[P.f_t_temperature * ns + slot],
                ival(P, P.f_t_top_k, slot),     P.floats[P.f_t_top_p * ns + slot],
                P.seed[slot],                    (int64_t)nsamp,
                0};
  bool finite;
  int code = warp_sample<VT / 32>(xs, kept, dr, finite);
  code = code < 0 ? 0 : code >= VT ? VT - 1 : code;
  if (lane == 0) {
    int32_t* o = P.out + m * P.out_stride;
    o[GROUPS] = code;
    if (!finite) o[P.out_err] |= 1 << PASSES;
    P.seen[slot * VT + code] = 1;
    P.ints[P.f_pos * ns + slot] += 1;
    P.ints[P.f_code0 * ns + slot] = code;
    P.ints[P.f_n_sampled * ns + slot] = nsamp + 1;
    P.ints[P.f_text_step * ns + slot] += 1;
  }
}

// Every stream's draw, a warp each (a block takes WARPS streams a round).
__device__ __noinline__ inline void phase_talker_draw(const QbkParams& P, int B, int np, uint8_t* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int m = blockIdx.x * WARPS + warp; m < B; m += gridDim.x * WARPS) talker_draw_row(P, m, B, np, smem, warp, lane);
}

}  // namespace qbk
