// A code-predictor pass's draw, one warp per stream over its 2048 logits (64 per lane, id =
// lane + 32 i): the batched engine's rules and RNG (tts_server/engines/batched/tk_sample.py):
// greedy argmax (first id among ties), or temperature -> top-k (keep values >= the k-th largest,
// found by bisection over order keys) -> top-p (drop the smallest values, ties together, whose
// mass is <= 1 - top_p, never the largest) -> Gumbel-max with 32 hashed bits per (seed, counter,
// stream, id), scored in fp64. Integer counts and arg-maxima do not depend on the order of the
// work; the top-p masses are summed lane by lane in id order, then over the warp in a fixed tree.
#pragma once
#include "common.cuh"

namespace qbk {

__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// fp32 -> int64 with the same order (+0 and -0 equal), as tk_sample._order_key.
__device__ __forceinline__ int64_t order_key(float x) {
  const int32_t b = __float_as_int(x);
  return b < 0 ? -(int64_t)(b & 0x7FFFFFFF) : (int64_t)b;
}

__device__ __forceinline__ int warp_count(int c) {
#pragma unroll 4
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  return c;
}

// Warp-wide argmax of (v, id), first id among equal values; the same in every lane.
template <typename T>
__device__ __forceinline__ int warp_argmax(T v, int id) {
#pragma unroll 4
  for (int o = 16; o > 0; o >>= 1) {
    const T ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, id, o);
    if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
  }
  return id;
}

struct Draw {
  int do_sample;
  float temperature;
  int top_k;
  float top_p;
  int64_t seed, counter;
  int stream;
};

// Gumbel score of kept id `id` (x > -inf) of draw h.
__device__ __forceinline__ double gumbel_score(float x, uint32_t id, uint32_t h) {
  const uint32_t r = mix32(mix32(id + h) ^ h);
  const double u = ((double)r + 0.5) * 2.3283064365386963e-10;
  return (double)x - log(-log(u));
}

// xs: this warp's V = 32 SV logits in shared memory (id i at xs[i], lane l holding ids l + 32 j;
// overwritten); kept: this warp's KEPT_MAX ints of shared memory. Returns the code (same in every
// lane); finite: no NaN or +inf and not every logit -inf.
template <int SV>
__device__ int warp_sample(float* xs, int* kept, const Draw& dr, bool& finite) {
  constexpr int V = 32 * SV;
  const int lane = threadIdx.x & 31;
#define X(i) xs[lane + 32 * (i)]
  int bad = 0;
  float mx = -INFINITY;
#pragma unroll 4
  for (int i = 0; i < SV; ++i) {
    const bool b = X(i) != X(i) || X(i) == INFINITY;
    bad |= b;
    mx = fmaxf(mx, b ? -INFINITY : X(i));
  }
  bad = __any_sync(0xffffffffu, bad);
  mx = warp_max(mx);
  finite = !bad && mx > -INFINITY;
  if (!finite) {
#pragma unroll 4
    for (int i = 0; i < SV; ++i) X(i) = 0.f;
  }
  if (!dr.do_sample) {
    float bv = X(0);
    int bi = lane;
#pragma unroll 4
    for (int i = 1; i < SV; ++i)
      if (X(i) > bv) { bv = X(i); bi = lane + 32 * i; }
    return warp_argmax(bv, bi);
  }
#pragma unroll 4
  for (int i = 0; i < SV; ++i) X(i) = __fdiv_rn(X(i), dr.temperature);
  if (dr.top_k > 0 && dr.top_k < V) {  // the k-th largest order key: the largest t with count(key >= t) >= k
    // the keys in registers for the 32 counting rounds (they fit in 32 bits: no NaN here)
    int32_t key[SV];
#pragma unroll
    for (int i = 0; i < SV; ++i) key[i] = (int32_t)order_key(X(i));
    int64_t lo = -0x7F800000LL, hi = 0x7F800001LL;
    for (int it = 0; it < 32; ++it) {
      const int64_t mid = (lo + hi) >> 1;
      const int32_t m32 = (int32_t)mid;  // |mid| < 2^31
      int c = 0;
#pragma unroll
      for (int i = 0; i < SV; ++i) c += key[i] >= m32;
      if (warp_count(c) >= dr.top_k) lo = mid; else hi = mid;
    }
#pragma unroll
    for (int i = 0; i < SV; ++i)
      if (key[i] < (int32_t)lo) X(i) = -INFINITY;
  }
  if (dr.top_p < 1.0f) {
    float m = -INFINITY;
#pragma unroll 4
    for (int i = 0; i < SV; ++i) m = fmaxf(m, X(i));
    m = warp_max(m);
    // e = exp(x - m) is recomputed where it is summed (no second array of 64 registers)
    float tot = 0.f;
#pragma unroll 4
    for (int i = 0; i < SV; ++i) tot += __expf(X(i) - m);
    const float budget = (1.0f - dr.top_p) * warp_sum(tot);
    // the largest t with mass(key <= t) <= budget (-inf entries carry e = 0)
    int64_t lo = -0x7F800001LL, hi = 0x7F800000LL;
    for (int it = 0; it < 32; ++it) {
      const int64_t mid = (lo + hi) >> 1;
      float s = 0.f;
#pragma unroll 4
      for (int i = 0; i < SV; ++i) s += order_key(X(i)) <= mid ? __expf(X(i) - m) : 0.f;
      if (warp_sum(s) <= budget) lo = mid; else hi = mid;
    }
#pragma unroll 4
    for (int i = 0; i < SV; ++i)
      if (X(i) > -INFINITY && order_key(X(i)) <= lo && X(i) < m) X(i) = -INFINITY;
  }
  uint32_t h = mix32((uint32_t)(dr.seed & 0xFFFFFFFF) ^ 0x9E3779B9u);
  h = mix32(h ^ (uint32_t)(dr.seed >> 32));
  h = mix32(h ^ (uint32_t)(dr.counter & 0xFFFFFFFF));
  h = mix32(h ^ (uint32_t)(dr.counter >> 32));
  h = mix32(h ^ (uint32_t)dr.stream);
  // The score's two fp64 logarithms only for the ids the filters kept (top-k's 50 of 2048 by
  // default): their ids listed in id order, 32 at a time; the largest score, first id among ties,
  // whatever the order (a removed id scores -inf and never wins).
  int nk = 0;
#pragma unroll 4
  for (int i = 0; i < SV; ++i) nk += __popc(__ballot_sync(0xffffffffu, X(i) > -INFINITY));
  double bv = -INFINITY;
  int bi = lane;
  if (nk <= KEPT_MAX) {
    int base = 0;
    const uint32_t below = (1u << lane) - 1u;
#pragma unroll 4
    for (int i = 0; i < SV; ++i) {
      const bool k = X(i) > -INFINITY;
      const uint32_t msk = __ballot_sync(0xffffffffu, k);
      if (k) kept[base + __popc(msk & below)] = lane + 32 * i;
      base += __popc(msk);
    }
    __syncwarp();
    for (int t = lane; t < nk; t += 32) {
      const int id = kept[t];
      const double sc = gumbel_score(xs[id], (uint32_t)id, h);
      if (sc > bv || (sc == bv && id < bi)) { bv = sc; bi = id; }
    }
  } else {
#pragma unroll 4
    for (int i = 0; i < SV; ++i) {
      if (!(X(i) > -INFINITY)) continue;
      const int id = lane + 32 * i;
      const double sc = gumbel_score(X(i), (uint32_t)id, h);
      if (sc > bv) { bv = sc; bi = id; }
    }
  }
  return warp_argmax(bv, bi);
#undef X
}

}  // namespace qbk
