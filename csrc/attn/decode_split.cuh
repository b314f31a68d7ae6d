// The talker's decode attention split as a persistent kernel (v2 of scripts/attn_persist.cu, where
// it was measured against v1 and v3): the same outputs, bit for bit, as the Triton kernel
// tk_attention._attn_split_tc_kernel for bf16 pools of 64-position pages (one page a split), 2
// query heads a kv head, 2 bf16 terms. A grid of a few blocks an SM (the occupancy API's count)
// loops over work items (row b, kv head, split sp) with an S-stage cp.async pipeline that keeps the
// next items' K / V tiles (16 KB each, contiguous in the pool) and q rows in flight across items.
//   items: the used splits of every row as one list in (b, sp, kv head) order (a prefix over the
//          rows' used splits, built by each block in shared memory); block x takes items x, x + grid,
//          ... Each item's outputs depend on its own inputs alone, so the bits do not depend on the
//          grid, the stages or the order.
//   loads: 16-byte cp.async.cg, positions past the row's length zero-filled (Triton's masked loads
//          read zeros there); 16-byte chunk c of tile row r stored at chunk c ^ (r & 7), which makes
//          the fragment reads free of bank conflicts.
//   math:  the twin of the Triton kernel's PTX (scripts/attn_split_twin.cu, bitwise equal on an
//          H200): the same mma.sync chains in the same order, the same masks, exp and reduction
//          orders; the fragments from shared memory.
// Included by csrc/attn/decode_split.cu (the engine's library) and scripts/attn_persist.cu (the
// experiment, with v1 and v3).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

namespace qda {

constexpr int HD = 128, SPLIT = 64, G = 2, NKV = 8, NH = NKV * G, MAX_B = 256, THREADS = 128;
constexpr int ROW_BYTES = HD * 2;                 // one position's K (or V) row, bf16
constexpr int TILE_BYTES = SPLIT * ROW_BYTES;     // 16 KB: one (page, kv head) of K or of V
constexpr int Q_STRIDE = HD + 8;                  // floats a q row in smem (the 2 rows on other banks)
constexpr int STAGE_BYTES = 2 * TILE_BYTES + G * Q_STRIDE * 4;
static_assert(STAGE_BYTES % 16 == 0, "stages must keep 16-byte alignment");

#include "twin_math.cuh"

// ---- cp.async and shared memory ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared; bytes = 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// the same under an L2 cache policy (evict_first_policy(): lines read once leave L2 first)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src), "r"(bytes),
               "l"(policy)
               : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// the byte offset of 16-byte chunk c (0..15) of row r in a swizzled tile
__device__ __forceinline__ int swz(int r, int c) { return r * ROW_BYTES + ((c ^ (r & 7)) << 4); }
__device__ __forceinline__ uint32_t lds32(const unsigned char* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t lds16(const unsigned char* p) { return *reinterpret_cast<const uint16_t*>(p); }

struct Item {
  int b, kvh, sp, n;
};

// the kernels' arguments (MATH false: q, m, l, acc unused; MATH true: sink unused)
struct Args {
  const float* q;
  const __nv_bfloat16 *kpool, *vpool;
  const int *table, *lens;
  float *m, *l, *acc;
  uint32_t* sink;
  float scale;
  int batch, max_blocks, nsplit;
  int* err;  // v3: bits set where a bounded wait gave up (null: not reported)
};

// lens_s[b] = lens[b] (0 past the batch) and off[b]: the items (used splits x kv heads) of rows < b,
// two rows a thread of the block's first 128 (the others only pass the barriers; B <= 256);
// `between` runs before the first barrier. Every thread of the block must call it.
template <class F>
__device__ __forceinline__ void row_offsets(const Args& a, int* lens_s, int* off, int* wtot, F between) {
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const bool mine = tid < THREADS;
  int c[2] = {0, 0}, x = 0;
  if (mine) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = 2 * tid + e, n = b < a.batch ? a.lens[b] : 0;
      lens_s[b] = n;
      c[e] = (n + SPLIT - 1) / SPLIT * NKV;
    }
    x = c[0] + c[1];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) wtot[w] = x;
  }
  between();
  __syncthreads();
  if (mine) {
    for (int i = 0; i < w; ++i) x += wtot[i];
    off[2 * tid + 1] = x - c[1];
    off[2 * tid + 2] = x;
    if (tid == 0) off[0] = 0;
  }
  __syncthreads();
}

// ---- v2: the same walk and the same per-item math, with a shorter path per item ----
// v1 spends most of an item's time in its math (a block holding 1 item a time is ~1.75x slower than
// 3; the walk alone streams at 4-4.7 TB/s). v2 keeps the mma chains, masks, exp and reduction
// orders (so the bits) and changes what surrounds them:
//   fragments  ldmatrix (x4; .trans for V) instead of 96 scalar shared loads and the V packing: 16
//              instructions a warp, the same 16-bit values in the same registers
//   q          its hi / lo terms converted in pairs (cvt.rn.bf16x2.f32, the same rounding as split2)
//              for all 16 steps before the s chain, without a branch (lanes of padding rows select
//              0), instead of one by one inside the chain (v1: a divergent branch and 4 dependent
//              F2F a step in the lo term)
//   p          only rows g (rows g + 8 are padding whose max, p and sum reach no output); its
//              terms written as packed pairs and read back as words
//   stages     a stage is read (fragments to registers, q) before the row-max barrier, so the next
//              item's loads go into it right after that barrier: S items in flight during the rest
//              of the math instead of v1's S - 1 during all of it
//   walk       each item decoded once, when its loads are issued (a ballot row search), and kept
//              in registers until computed; the copies' addresses a base plus constants
// The barriers stay three an item (landed, row max, row sum).
__device__ __forceinline__ void ldsm_x4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
// split2 of x0 and x1 at once: hi = pack(hi(x0), hi(x1)), lo = pack(lo(x0), lo(x1)) (x0 in the low half)
__device__ __forceinline__ void split2_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = bf162_bits(__floats2bfloat162_rn(x0, x1));
  const float f0 = __uint_as_float(hi << 16), f1 = __uint_as_float(hi & 0xffff0000u);
  lo = bf162_bits(__floats2bfloat162_rn(__fsub_rn(x0, f0), __fsub_rn(x1, f1)));
}

// issue<true> with the addresses as a per-thread base plus constants (v1's compiles to 64-bit
// arithmetic for each chunk): the same copies, the same stage layout and zero-fill
// (K / V's copies under `policy`: evict_first_policy()). issue_kv_v2: K / V alone (rows from
// it.n on zero-filled), for a caller that writes q into the stage itself (the small-batch
// kernel's talker layers, csrc/small/cp_layers.cu).
__device__ __forceinline__ void issue_kv_v2(int tid, uint32_t st, const Item& it, int page,
                                            const __nv_bfloat16* kpool, const __nv_bfloat16* vpool,
                                            uint64_t policy) {
  const int r0 = tid >> 4, c = tid & 15;  // tid: the thread in its 128
  constexpr int ROWS = THREADS / 16;  // tile rows a pass
  const size_t tile = ((size_t)page * NKV + it.kvh) * (SPLIT * HD);
  const char* kt = reinterpret_cast<const char*>(kpool + tile) + tid * 16;
  const char* vt = reinterpret_cast<const char*>(vpool + tile) + tid * 16;
  const uint32_t d = st + swz(r0, c);  // row r0 + ROWS i: d + i ROWS ROW_BYTES (ROWS % 8 == 0)
  const int rows = it.n - it.sp * SPLIT - r0;  // row r0 + ROWS i is in the row's length if ROWS i < rows
  static_assert(ROWS % 8 == 0, "the swizzle repeats every 8 rows");
#pragma unroll
  for (int i = 0; i < SPLIT / ROWS; ++i) {
    const int bytes = ROWS * i < rows ? 16 : 0;
    cp_async16(d + i * ROWS * ROW_BYTES, kt + i * ROWS * ROW_BYTES, bytes, policy);
    cp_async16(d + TILE_BYTES + i * ROWS * ROW_BYTES, vt + i * ROWS * ROW_BYTES, bytes, policy);
  }
}
__device__ __forceinline__ void issue_v2(int tid, uint32_t st, const Item& it, int page, const float* q,
                                         const __nv_bfloat16* kpool, const __nv_bfloat16* vpool,
                                         uint64_t policy) {
  issue_kv_v2(tid, st, it, page, kpool, vpool, policy);
  if (tid < G * HD / 4) {
    const int g = tid >> 5, cq = tid & 31;
    cp_async16(st + 2 * TILE_BYTES + g * Q_STRIDE * 4 + cq * 16,
               q + (size_t)(it.b * NH + it.kvh * G + g) * HD + cq * 4, 16);
  }
}

// decode with the row search a warp at a time: lane i tests row bc + 1 + i (off is non-decreasing, so
// the rows at or before v's are a prefix); the same row as decode's loop. Every lane of the warp.
__device__ __forceinline__ Item decode_warp(int v, int& bc, const int* off, const int* lens, int batch) {
  const int lane = threadIdx.x & 31;
  for (;;) {
    const int j = bc + 1 + lane;
    const unsigned past = __ballot_sync(0xffffffffu, j <= batch && off[j] <= v);
    bc += __popc(past);
    if (past != 0xffffffffu) break;
  }
  const int r = v - off[bc];
  return {bc, r % NKV, r / NKV, lens[bc]};
}

constexpr int PH_STRIDE = SPLIT / 2 + 4;  // words a row of p's packed terms (row 1 on other banks)
static_assert(G == 2, "q rows and p rows are picked as g & 1");

// split_math's item from a stage by the 128 threads gtid = 0..127 (sync: their barrier), with the
// operands brought in as above; release() is called by every thread once the stage is no longer
// read (after the row-max barrier).
template <class Sync, class Release>
__device__ __forceinline__ void split_math_v2(int gtid, Sync sync, const unsigned char* st, const Item& it,
                                              float scale, float* m_out, float* l_out, float* acc_out, int nsplit,
                                              float (&red)[2][32], uint32_t (&ph)[2][G][PH_STRIDE],
                                              Release release) {
  const int lane = gtid & 31, w = gtid >> 5, g = lane >> 2, t = lane & 3;
  const int lr = lane & 7, lm = lane >> 3;  // ldmatrix: the row this lane addresses, in matrix lm
  const uint32_t ks = smem_u32(st), vs = ks + TILE_BYTES;
  const float* qs = reinterpret_cast<const float*>(st + 2 * TILE_BYTES);
  // K: matrix lm of (r, k2) = rows 32r + 8w + 0..7, chunk 4 k2 + lm -> kb[r][2 k2 + lm / 2][lm % 2]
  uint32_t kb[2][HD / 16][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int k2 = 0; k2 < HD / 32; ++k2) {
      uint32_t d[4];
      ldsm_x4(d, ks + swz(32 * r + 8 * w + lr, 4 * k2 + lm));
      kb[r][2 * k2][0] = d[0], kb[r][2 * k2][1] = d[1], kb[r][2 * k2 + 1][0] = d[2], kb[r][2 * k2 + 1][1] = d[3];
    }
  // V (transposed): matrix lm of (kk, r2) = rows 16kk + 8 (lm % 2) + 0..7, chunk w + 4 (2 r2 + lm / 2)
  // -> vb[kk][2 r2 + lm / 2][lm % 2]
  uint32_t vb[SPLIT / 16][4][2];
#pragma unroll
  for (int kk = 0; kk < SPLIT / 16; ++kk)
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      uint32_t d[4];
      ldsm_x4_trans(d, vs + swz(16 * kk + 8 * (lm & 1) + lr, w + 4 * (2 * r2 + (lm >> 1))));
      vb[kk][2 * r2][0] = d[0], vb[kk][2 * r2][1] = d[1], vb[kk][2 * r2 + 1][0] = d[2], vb[kk][2 * r2 + 1][1] = d[3];
    }
  // q's a fragments (a[0], a[2]) of both terms; 0 in the padding rows' lanes
  uint32_t qa[2][HD / 16][2];
  const float* qr = qs + (g & 1) * Q_STRIDE + 2 * t;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 x = *reinterpret_cast<const float2*>(qr + 16 * kk + 8 * h);
      uint32_t hi, lo;
      split2_pair(x.x, x.y, hi, lo);
      qa[0][kk][h] = g < G ? hi : 0u;
      qa[1][kk][h] = g < G ? lo : 0u;
    }

  // ---- s, as split_math
  float s[2][4] = {};
#pragma unroll
  for (int term = 0; term < 2; ++term)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t a[4] = {qa[term][kk][0], 0u, qa[term][kk][1], 0u};
#pragma unroll
      for (int r = 0; r < 2; ++r) mma_bf16(s[r], a, kb[r][kk][0], kb[r][kk][1]);
    }
  float v[2][2];  // row g's (c0, c1) of the two tiles
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 32 * r + 8 * w + 2 * t + e;
      v[r][e] = it.sp * SPLIT + j < it.n ? __fmul_rn(scale, s[r][e]) : -__int_as_float(0x7f800000);
    }
  // ---- the row max and p, rows g only: rows g + 8 (padding) feed nothing that is written (their p
  // are not in p's terms, their m and l are not stored), so v2 leaves them out
  const auto fmax = [](float x, float y) { return fmaxf(x, y); };
  const auto fadd = [](float x, float y) { return __fadd_rn(x, y); };
  {
    const float x = quad_reduce(v[0][0], v[0][1], v[1][0], v[1][1], fmax);
    if (t == 0) red[0][4 * g + w] = x;
  }
  sync();  // the row max; every warp is done with the stage
  const float m = warps_reduce(red[0] + 4 * g, fmax);
  release();
  const float LOG2E = __int_as_float(0x3FB8AA3B);
  float p[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 2; ++e) p[r][e] = ex2_approx(__fmul_rn(__fsub_rn(v[r][e], m), LOG2E));
  {
    const float x = quad_reduce(p[0][0], p[0][1], p[1][0], p[1][1], fadd);
    if (t == 0) red[1][4 * g + w] = x;
  }
  if (g < G)
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // positions 32r + 8w + 2t, +1: word 16r + 4w + t
      uint32_t hi, lo;
      split2_pair(p[r][0], p[r][1], hi, lo);
      ph[0][g][16 * r + 4 * w + t] = hi;
      ph[1][g][16 * r + 4 * w + t] = lo;
    }
  sync();  // the row sum, p's terms
  const int row0 = it.b * NH + it.kvh * G;
  if (w == 0 && t == 0 && g < G) {  // lanes 0 and 4: rows 0 and 1
    m_out[(size_t)(row0 + g) * nsplit + it.sp] = m;
    l_out[(size_t)(row0 + g) * nsplit + it.sp] = warps_reduce(red[1] + 4 * g, fadd);
  }
  // ---- acc, as split_math: a[0] = p's positions 16kk + 2t, +1 (word 8kk + t), a[2] 8 positions on
  float acc[4][4] = {};
#pragma unroll
  for (int term = 0; term < 2; ++term)
#pragma unroll
    for (int kk = 0; kk < SPLIT / 16; ++kk) {
      const uint32_t* pr = ph[term][g & 1] + 8 * kk + t;
      const uint32_t a[4] = {g < G ? pr[0] : 0u, 0u, g < G ? pr[4] : 0u, 0u};
#pragma unroll
      for (int r = 0; r < 4; ++r) mma_bf16(acc[r], a, vb[kk][r][0], vb[kk][r][1]);
    }
  if (g < G) {
    float* o = acc_out + ((size_t)(row0 + g) * nsplit + it.sp) * HD + 8 * w + 2 * t;
#pragma unroll
    for (int r = 0; r < 4; ++r) *reinterpret_cast<float2*>(o + 32 * r) = make_float2(acc[r][0], acc[r][1]);
  }
}

// v1's walk with split_math_v2: S items issued ahead, item k + S into item k's stage once released
template <int S>
// (3 blocks an SM as the shared memory allows: without the bound ptxas took 128 registers and
// spilled once the cache policy was added)
__global__ void __launch_bounds__(THREADS, 3) attn_persist_v2_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ int lens_s[MAX_B], off[MAX_B + 1], wtot[THREADS / 32];
  __shared__ float red[2][32];              // [max, sum][row * 4 + warp] (rows 0..7)
  __shared__ uint32_t ph[2][G][PH_STRIDE];  // p's packed terms [term][row][word]
  const int tid = threadIdx.x;
  // K / V are read once: evict them from L2 first (so the table, q and the outputs the merge reads
  // next stay; session 44, alone: B = 64 mixed 39.1 -> 37.3 µs a layer, B = 256 at 1,000 266 ->
  // 272; session 45, frames B = 16 / 64 / 128 / 256 3.744 / 4.512 / 6.207 / 10.027 -> 3.721 /
  // 4.445 / 6.084 / 9.965 ms, the same bits)
  const uint64_t policy = evict_first_policy();
  // launched with programmatic dependent launch (qda_split's pdl): wait for the predecessor's
  // results, then let the successor launch, as every engine kernel does (pdl.py); no-ops otherwise
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  row_offsets(a, lens_s, off, wtot, [] {});
  const int total = off[a.batch], stride = gridDim.x;
  const uint32_t base = smem_u32(stages);

  // the load cursor as in v1, its row search a warp at a time; pend: the items issued and not yet
  // computed, oldest first (so that an item is decoded once, off its computation's path)
  int lv = blockIdx.x, lb = 0, lpage = 0;
  Item li{0, 0, 0, 0}, pend[S] = {};
  auto fetch = [&]() {
    if (lv < total) {
      li = decode_warp(lv, lb, off, lens_s, a.batch);
      lpage = a.table[(size_t)li.b * a.max_blocks + li.sp];
    }
  };
  auto issue_next = [&](int slot) {
    if (lv < total) issue_v2(tid, base + slot * STAGE_BYTES, li, lpage, a.q, a.kpool, a.vpool, policy);
    cp_async_commit();  // one group an item, empty past the end
    pend[S - 1] = li;   // stale past the end, never computed
    lv += stride;
    fetch();
  };
  fetch();
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int i = 0; i + 1 < S; ++i) pend[i] = pend[i + 1];
    issue_next(s);
  }

  int k = 0;
  for (int cv = blockIdx.x; cv < total; cv += stride, ++k) {
    cp_async_wait<S - 1>();  // groups 0..k (item k's) of this thread have landed
    __syncthreads();         // everyone's have; the last item's red / ph reads are done
    const Item it = pend[0];  // item cv
#pragma unroll
    for (int i = 0; i + 1 < S; ++i) pend[i] = pend[i + 1];
    const int slot = k % S;
    split_math_v2(tid, [] { __syncthreads(); }, stages + slot * STAGE_BYTES, it, a.scale, a.m, a.l, a.acc,
                  a.nsplit, red, ph, [&]() { issue_next(slot); });
  }
  cp_async_wait<0>();
}

}  // namespace qda
