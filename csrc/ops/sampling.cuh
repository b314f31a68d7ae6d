// On-GPU sampling with qwen-tts's (Hugging Face) rules, done by one block over logits in smem:
// greedy argmax (ties -> lowest index, as torch.argmax) or temperature -> top-k -> top-p ->
// categorical draw. The draw is Gumbel-max with a counter-based hash RNG keyed by
// (seed, counter, stream, token id): reproducible and identical in every block that runs it.
#pragma once
#include "common.cuh"

namespace qmk {

struct SampleParams {
  int do_sample;
  float temperature;
  int top_k;
  float top_p;
};

struct SampleSmem {
  float l[QMK_VT];          // working logits
  uint8_t removed[QMK_VT];  // top-p removals
  uint32_t hist[256];
  float fred[NW];
  int ired[NW];
  float fred2[NW];
  int bin, rank, result;
  int ncand;
  float kth;
  // bucket_kth: the boundary bucket's values. 16-byte aligned: the rank loop's vector loads of
  // cand[j..j+3] must not also cover kth, which another thread writes in that loop.
  __align__(16) float cand[512];
};

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) for token `idx` of draw (counter, stream).
__device__ __forceinline__ float uniform01(uint64_t seed, uint32_t counter, uint32_t stream, uint32_t idx) {
  const uint64_t key = ((uint64_t)counter << 16) | ((uint64_t)(stream & 15u) << 12) | (idx & 4095u);
  const uint64_t h = splitmix64(splitmix64(seed) ^ key);
  return ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Order-preserving float <-> uint32 key.
__device__ __forceinline__ uint32_t fkey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float fkey_inv(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Block-wide (value, index) maximum of every thread's (bv, bi); ties -> lowest index. Same result
// in every thread (0 if every value is -inf).
__device__ int block_argmax_reduce(float bv, int bi, SampleSmem& sm) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
  }
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  bsync();
  if (lane == 0) { sm.fred[w] = bv; sm.ired[w] = bi; }
  bsync();
  if (w == 0) {
    bv = lane < NW ? sm.fred[lane] : neg_inf();
    bi = lane < NW ? sm.ired[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) sm.result = bi == 0x7fffffff ? 0 : bi;
  }
  bsync();
  return sm.result;
}

// Index of the largest l[i]; ties -> lowest index. Same result in every thread.
__device__ int block_argmax(const float* l, int V, SampleSmem& sm) {
  float bv = neg_inf();
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += NT) {
    const float v = l[i];
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
  }
  return block_argmax_reduce(bv, bi, sm);
}

// Warp 0 (every lane): walks the 256 counts of sm.hist from bin 255 down to 0 (down) or from 0 up,
// and writes the first bin where the running count reaches k to sm.bin, k's rank inside that bin to
// sm.rank; sm.bin = -1 when the counts never reach k. The caller synchronizes before reading them.
__device__ __forceinline__ void warp_find_bin(SampleSmem& sm, int k, bool down) {
  const int lane = threadIdx.x & 31;
  uint32_t c[8], tot = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c[i] = sm.hist[down ? 255 - lane * 8 - i : lane * 8 + i];
    tot += c[i];
  }
  uint32_t incl = tot;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  const uint32_t hit = __ballot_sync(0xffffffffu, incl >= (uint32_t)k);
  if (hit == 0) {
    if (lane == 0) sm.bin = -1;
  } else if (lane == __ffs(hit) - 1) {
    uint32_t cum = incl - tot;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (cum + c[i] >= (uint32_t)k) {
        sm.bin = down ? 255 - lane * 8 - i : lane * 8 + i;
        sm.rank = k - (int)cum;
        break;
      }
      cum += c[i];
    }
  }
}

// Value of the k-th largest l[i] (counting multiplicity): radix select over 4 bytes of the key
// (bucket_kth's fallback). Its first pass puts ~all logits into a few top-byte bins; aggregating
// those atomics per warp (__match_any_sync) measured slower (+8 us per draw, csrc/PERF_LOG.md v8a).
__device__ float kth_largest(const float* l, int V, int k, SampleSmem& sm) {
  uint32_t prefix = 0, mask = 0;
  int kk = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += NT) sm.hist[i] = 0;
    bsync();
    for (int i = threadIdx.x; i < V; i += NT) {
      const uint32_t key = fkey(l[i]);
      if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & 255u], 1u);
    }
    bsync();
    if (threadIdx.x < 32) warp_find_bin(sm, kk, true);
    bsync();
    prefix |= (uint32_t)sm.bin << shift;
    mask |= 255u << shift;
    kk = sm.rank;
    bsync();
  }
  return fkey_inv(prefix);
}

// Value of the k-th largest l[i] (counting multiplicity), the same value as kth_largest, in fewer
// block barriers and without its contended first histogram pass (there, ~all logits share a few
// top-byte bins): bucket b(i) = floor((M - l[i]) / D) with M the max and D = (M - mean) / 32 over
// the finite logits (b is monotone in l, so every value of a lower bucket is larger than every
// value of a higher one); count buckets 0..255 (farther values are not counted); the scan finds
// the bucket holding the k-th largest, and its few values are ranked exactly. Falls back to
// kth_largest when the counted buckets hold fewer than k values, the boundary bucket more than 512,
// or D is not a positive finite number.
__device__ float bucket_kth(const float* l, int V, int k, SampleSmem& sm) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 1) max, sum and count of the finite logits in one block reduction; zero the histogram.
  float mx = neg_inf(), sum = 0.f, cnt = 0.f;
  for (int i = threadIdx.x; i < V; i += NT) {
    const float v = l[i];
    if (v != neg_inf()) { mx = fmaxf(mx, v); sum += v; cnt += 1.f; }
  }
  for (int i = threadIdx.x; i < 256; i += NT) sm.hist[i] = 0;
  mx = warp_max(mx);
  sum = warp_sum(sum);
  cnt = warp_sum(cnt);
  if (lane == 0) { sm.fred[w] = mx; sm.fred2[w] = sum; sm.ired[w] = (int)cnt; }
  if (threadIdx.x == 0) sm.ncand = 0;
  bsync();
  mx = lane < NW ? sm.fred[lane] : neg_inf();
  sum = lane < NW ? sm.fred2[lane] : 0.f;
  cnt = lane < NW ? (float)sm.ired[lane] : 0.f;
  mx = warp_max(mx);
  sum = warp_sum(sum);
  cnt = warp_sum(cnt);
  const float d = (mx - sum / fmaxf(cnt, 1.f)) * (1.0f / 32.0f);
  if (!(d > 0.f) || !isfinite(d) || cnt < (float)k) return kth_largest(l, V, k, sm);  // same in every thread
  const float inv = 1.0f / d;
  // 2) histogram of the near buckets.
  for (int i = threadIdx.x; i < V; i += NT) {
    const float b = (mx - l[i]) * inv;  // -inf logits give +inf: not counted
    if (b < 256.f) atomicAdd(&sm.hist[(int)b], 1u);
  }
  bsync();
  // 3) warp 0: the bucket where the count from the top reaches k, and k's rank inside it.
  if (w == 0) warp_find_bin(sm, k, false);
  bsync();
  const int bin = sm.bin, rank = sm.rank;
  if (bin < 0 || sm.hist[bin] > 512u) return kth_largest(l, V, k, sm);  // cand[] holds 512
  // 4) the boundary bucket's values, then the rank-th largest among them.
  for (int i = threadIdx.x; i < V; i += NT) {
    const float b = (mx - l[i]) * inv;
    if (b < 256.f && (int)b == bin) sm.cand[atomicAdd(&sm.ncand, 1)] = l[i];
  }
  bsync();
  const int nc = sm.ncand;
  for (int i = threadIdx.x; i < nc; i += NT) {
    const float v = sm.cand[i];
    int gt = 0, ge = 0;
    for (int j = 0; j < nc; ++j) {
      const float u = sm.cand[j];
      gt += u > v;
      ge += u >= v;
    }
    if (gt < rank && rank <= ge) sm.kth = v;  // every writer holds the same value
  }
  bsync();
  return sm.kth;
}

// Gumbel(0, 1) noise of token i of draw (counter, stream).
__device__ __forceinline__ float gumbel(uint64_t seed, uint32_t counter, uint32_t stream, uint32_t i) {
  return -logf(-logf(uniform01(seed, counter, stream, i)));
}

// Draw one token from processed logits l[0..V) (smem; overwritten). Same result in every thread.
// scaled: the caller has already divided l by p.temperature.
__device__ int block_sample(float* l, int V, const SampleParams& p, uint64_t seed, uint32_t counter,
                            uint32_t stream, SampleSmem& sm, bool scaled = false) {
  if (!p.do_sample) return block_argmax(l, V, sm);
  if (p.temperature != 1.0f && !scaled) {
    for (int i = threadIdx.x; i < V; i += NT) l[i] = l[i] / p.temperature;
    bsync();
  }
  const bool topk = p.top_k > 0 && p.top_k < V;
  const float kth = topk ? bucket_kth(l, V, p.top_k, sm) : neg_inf();
  if (p.top_p >= 1.0f) {
    // One pass: the top-k filter, the Gumbel noise of the kept tokens and their argmax (the same
    // draw as masking, adding the noise and taking the argmax in separate passes).
    float bv = neg_inf();
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += NT) {
      const float v = l[i];
      if (v != neg_inf() && v >= kth) {
        const float g = v + gumbel(seed, counter, stream, (uint32_t)i);
        if (g > bv || (g == bv && i < bi)) { bv = g; bi = i; }
      }
    }
    return block_argmax_reduce(bv, bi, sm);
  }
  if (topk) {
    for (int i = threadIdx.x; i < V; i += NT)
      if (l[i] < kth) l[i] = neg_inf();
    bsync();
  }
  if (p.top_p < 1.0f) {
    // HF: sort ascending, cumulative softmax, drop tokens with cum <= 1 - top_p (never the top).
    float mx = neg_inf();
    for (int i = threadIdx.x; i < V; i += NT) mx = fmaxf(mx, l[i]);
    mx = block_max(mx, sm.fred);
    float z = 0.f;
    for (int i = threadIdx.x; i < V; i += NT) z += expf(l[i] - mx);
    z = block_sum(z, sm.fred);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = w; i < V; i += NW) {
      const float li = l[i];
      bool rm = false;
      if (li != neg_inf()) {
        float cum = 0.f;
        for (int j = lane; j < V; j += 32) {
          const float lj = l[j];
          if (lj < li || (lj == li && j <= i)) cum += expf(lj - mx);
        }
        cum = warp_sum(cum) / z;
        rm = cum <= 1.0f - p.top_p && li != mx;
      }
      if (lane == 0) sm.removed[i] = rm;
    }
    bsync();
    for (int i = threadIdx.x; i < V; i += NT)
      if (sm.removed[i]) l[i] = neg_inf();
    bsync();
  }
  for (int i = threadIdx.x; i < V; i += NT) {
    if (l[i] != neg_inf()) l[i] += gumbel(seed, counter, stream, (uint32_t)i);
  }
  bsync();
  return block_argmax(l, V, sm);
}

// Talker logits processors in HF order: repetition penalty over the code-0 history, EOS masked
// for the first min_new samples, ids [sup_start, V) except EOS suppressed. src: global fp32.
__device__ void talker_process(float* l, const float* src, const uint8_t* seen, float penalty,
                               int n_sampled, int min_new, int eos, int sup_start, int V) {
  for (int i = threadIdx.x; i < V; i += NT) {
    float v = __ldcg(src + i);
    if (seen[i] && penalty != 1.0f) v = v < 0.f ? v * penalty : v / penalty;
    if ((i >= sup_start && i != eos) || (i == eos && n_sampled < min_new)) v = neg_inf();
    l[i] = v;
  }
  bsync();
}

}  // namespace qmk
