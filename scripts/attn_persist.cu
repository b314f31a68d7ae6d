// A persistent-grid version of the talker's decode attention split (tk_attention._attn_split_tc_kernel
// with bf16 pools of 64-position pages, one page a split, 2 query heads a kv head, 2 bf16 terms), meant
// to give its bits while streaming K/V closer to the memory bandwidth. The Triton kernel's short
// programs keep too few loads in flight (H200, B = 64 mixed: 2.8 TB/s); here a grid of a few blocks
// an SM (the occupancy API's count) loops over work items (row b, kv head, split sp), with an S-stage
// cp.async pipeline that keeps the next S - 1 items' K / V tiles (16 KB each, contiguous in the pool)
// and q rows in flight across item boundaries.
//   items: the used splits of every row as one list in (b, sp, kv head) order (a prefix over the
//          rows' used splits, built by each block in shared memory); block x takes items x, x + grid,
//          ... Each item's outputs depend on its own inputs alone, so the bits do not depend on the
//          grid, the stages or the order.
//   loads: 16-byte cp.async.cg, positions past the row's length zero-filled (Triton's masked loads
//          read zeros there); 16-byte chunk c of tile row r stored at chunk c ^ (r & 7), which makes
//          the fragment reads below free of bank conflicts.
//   math:  scripts/attn_split_twin.cu's split (verified bitwise against the Triton kernel on an H200)
//          unchanged: the same mma.sync chains in the same order, the same masks, exp and reduction
//          orders; only the fragments come from shared memory, read element for element as the twin
//          reads them from global memory.
// Also the same walk and pipeline with the math left out (the ceiling of this walk), and the grid
// query; and v2 (attn_persist_v2_*, below): the same items and math with a shorter path an item.
// scripts/gpu_attn_persist.py checks the bits of both against Triton and times them (needs a GPU).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr int HD = 128, SPLIT = 64, G = 2, NKV = 8, NH = NKV * G, MAX_B = 256, THREADS = 128;
constexpr int ROW_BYTES = HD * 2;                 // one position's K (or V) row, bf16
constexpr int TILE_BYTES = SPLIT * ROW_BYTES;     // 16 KB: one (page, kv head) of K or of V
constexpr int Q_STRIDE = HD + 8;                  // floats a q row in smem (the 2 rows on other banks)
constexpr int STAGE_BYTES = 2 * TILE_BYTES + G * Q_STRIDE * 4;
static_assert(STAGE_BYTES % 16 == 0, "stages must keep 16-byte alignment");

// ---- the twin's helpers ----
#include "attn_twin_math.cuh"

// ---- cp.async and shared memory ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared; bytes = 0 writes zeros and reads nothing
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
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
// item v (< the total) of the (b, sp, kv head) list; bc: the row of an earlier item of this walk
// (items only grow along a walk, so the row search is amortised over it)
__device__ __forceinline__ Item decode(int v, int& bc, const int* off, const int* lens) {
  while (off[bc + 1] <= v) ++bc;
  const int r = v - off[bc];
  return {bc, r % NKV, r / NKV, lens[bc]};
}

// item it's K and V tiles (page `page`) and (WITH_Q) its q rows -> stage at st (shared address),
// zeros past n
template <bool WITH_Q>
__device__ __forceinline__ void issue(uint32_t st, const Item& it, int page, const float* q,
                                      const __nv_bfloat16* kpool, const __nv_bfloat16* vpool) {
  const int tid = threadIdx.x;
  const size_t tile = ((size_t)page * NKV + it.kvh) * (SPLIT * HD);
  const char* kt = reinterpret_cast<const char*>(kpool + tile);
  const char* vt = reinterpret_cast<const char*>(vpool + tile);
#pragma unroll
  for (int i = 0; i < TILE_BYTES / 16 / THREADS; ++i) {
    const int id = i * THREADS + tid, r = id >> 4, c = id & 15;
    const int bytes = it.sp * SPLIT + r < it.n ? 16 : 0;
    cp_async16(st + swz(r, c), kt + id * 16, bytes);
    cp_async16(st + TILE_BYTES + swz(r, c), vt + id * 16, bytes);
  }
  if (WITH_Q && tid < G * HD / 4) {  // q: the kv head's G rows, 32 chunks each
    const int g = tid >> 5, c = tid & 31;
    cp_async16(st + 2 * TILE_BYTES + g * Q_STRIDE * 4 + c * 16,
               q + (size_t)(it.b * NH + it.kvh * G + g) * HD + c * 4, 16);
  }
}

// One split from a stage (K, V tiles swizzled, q [G][Q_STRIDE] fp32) by the block's 4 warps, as
// attn_split_twin: -> m, l [B][NH][nsplit], acc [B][NH][nsplit][HD] for the kv head's query heads.
__device__ __forceinline__ void split_math(const unsigned char* st, const Item& it, float scale, float* m_out,
                                           float* l_out, float* acc_out, int nsplit, float (&red)[2][64],
                                           __nv_bfloat16 (&ph)[2][G][SPLIT]) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const unsigned char* ks = st;
  const unsigned char* vs = st + TILE_BYTES;
  const float* qs = reinterpret_cast<const float*>(st + 2 * TILE_BYTES);
  // K fragments: b0 = K[pos][16kk + 2t, +1], b1 = K[pos][16kk + 2t + 8, +9], pos = 32r + 8w + g (the
  // twin's krow[r]); chunks 2kk, 2kk + 1 of that row
  uint32_t kb[2][HD / 16][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const int row = 32 * r + 8 * w + g;
      kb[r][kk][0] = lds32(ks + swz(row, 2 * kk) + 4 * t);
      kb[r][kk][1] = lds32(ks + swz(row, 2 * kk + 1) + 4 * t);
    }
  // V fragments: V[16kk + 2t + {0, 1, 8, 9}][d], d = 8w + 32r + g (chunk w + 4r, element g), packed
  // as the twin packs them
  uint32_t vb[SPLIT / 16][4][2];
#pragma unroll
  for (int kk = 0; kk < SPLIT / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pos = 16 * kk + 2 * t + (i & 1) + (i >> 1) * 8;
        e[i] = lds16(vs + swz(pos, w + 4 * r) + 2 * g);
      }
      vb[kk][r][0] = e[0] | (e[1] << 16);
      vb[kk][r][1] = e[2] | (e[3] << 16);
    }

  // ---- s: rows g (< G: the query heads) and g + 8 (padding, zero) of the warp's two 8-position tiles
  float s[2][4] = {};
#pragma unroll
  for (int term = 0; term < 2; ++term)
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4] = {0u, 0u, 0u, 0u};
      if (g < G) {
        const float* qr = qs + g * Q_STRIDE + 16 * kk + 2 * t;
        const float2 x01 = *reinterpret_cast<const float2*>(qr), x89 = *reinterpret_cast<const float2*>(qr + 8);
        __nv_bfloat16 h0, l0, h1, l1, h8, l8, h9, l9;
        split2(x01.x, h0, l0), split2(x01.y, h1, l1), split2(x89.x, h8, l8), split2(x89.y, h9, l9);
        a[0] = term == 0 ? pack(h0, h1) : pack(l0, l1);
        a[2] = term == 0 ? pack(h8, h9) : pack(l8, l9);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) mma_bf16(s[r], a, kb[r][kk][0], kb[r][kk][1]);
    }
  // scale, mask: c0, c1 at positions 2t, 2t + 1 of the tile (row g), c2, c3 the same (row g + 8)
  float v[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 32 * r + 8 * w + 2 * t + (e & 1);
      v[r][e] = it.sp * SPLIT + j < it.n ? __fmul_rn(scale, s[r][e]) : -__int_as_float(0x7f800000);
    }
  // ---- the rows' max: in the thread, across the quad, across the warps
  const auto fmax = [](float x, float y) { return fmaxf(x, y); };
  const auto fadd = [](float x, float y) { return __fadd_rn(x, y); };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float x = quad_reduce(v[0][2 * h], v[0][2 * h + 1], v[1][2 * h], v[1][2 * h + 1], fmax);
    if (t == 0) red[0][4 * (g + 8 * h) + w] = x;
  }
  __syncthreads();
  const float m[2] = {warps_reduce(red[0] + 4 * g, fmax), warps_reduce(red[0] + 4 * (g + 8), fmax)};
  // ---- p and the rows' sums in Triton's order
  const float LOG2E = __int_as_float(0x3FB8AA3B);
  float p[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[r][e] = ex2_approx(__fmul_rn(__fsub_rn(v[r][e], m[e >> 1]), LOG2E));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float x = quad_reduce(p[0][2 * h], p[0][2 * h + 1], p[1][2 * h], p[1][2 * h + 1], fadd);
    if (t == 0) red[1][4 * (g + 8 * h) + w] = x;
  }
  if (g < G)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 32 * r + 8 * w + 2 * t + e;
        split2(p[r][e], ph[0][g][j], ph[1][g][j]);
      }
  __syncthreads();
  const int row0 = it.b * NH + it.kvh * G;
  if (threadIdx.x < G) {
    const int row = threadIdx.x;
    m_out[(size_t)(row0 + row) * nsplit + it.sp] = warps_reduce(red[0] + 4 * row, fmax);
    l_out[(size_t)(row0 + row) * nsplit + it.sp] = warps_reduce(red[1] + 4 * row, fadd);
  }
  // ---- acc: the warp's four 8-column tiles of d (8w + 32r), 4 steps of 16 positions a term
  float acc[4][4] = {};
#pragma unroll
  for (int term = 0; term < 2; ++term)
#pragma unroll
    for (int kk = 0; kk < SPLIT / 16; ++kk) {
      uint32_t a[4] = {0u, 0u, 0u, 0u};
      if (g < G) {
        const __nv_bfloat16* pr = ph[term][g] + 16 * kk + 2 * t;
        a[0] = pack(pr[0], pr[1]);
        a[2] = pack(pr[8], pr[9]);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) mma_bf16(acc[r], a, vb[kk][r][0], vb[kk][r][1]);
    }
  if (g < G) {
    float* o = acc_out + ((size_t)(row0 + g) * nsplit + it.sp) * HD + 8 * w + 2 * t;
#pragma unroll
    for (int r = 0; r < 4; ++r) *reinterpret_cast<float2*>(o + 32 * r) = make_float2(acc[r][0], acc[r][1]);
  }
}

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

// The persistent walk: S stages of (K tile, V tile, q rows); MATH false: the same walk and pipeline
// with each stage only touched (a word a thread of K and of V xor-ed into sink[block][thread]).
template <int S, bool MATH>
__global__ void __launch_bounds__(THREADS) attn_persist_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ int lens_s[MAX_B], off[MAX_B + 1], wtot[THREADS / 32];
  __shared__ float red[2][64];               // [max, sum][row * 4 + warp] (rows 0..15)
  __shared__ __nv_bfloat16 ph[2][G][SPLIT];  // p's two terms, rows 0..G-1
  const int tid = threadIdx.x;

  row_offsets(a, lens_s, off, wtot, [] {});
  const int total = off[a.batch], stride = gridDim.x;
  const uint32_t base = smem_u32(stages);

  // the load cursor: item lv (decoded in li, its page in lpage, read one item ahead of its issue)
  int lv = blockIdx.x, lb = 0, lpage = 0;
  Item li{0, 0, 0, 0};
  auto fetch = [&]() {
    if (lv < total) {
      li = decode(lv, lb, off, lens_s);
      lpage = a.table[(size_t)li.b * a.max_blocks + li.sp];
    }
  };
  auto issue_next = [&](int slot) {
    if (lv < total) issue<MATH>(base + slot * STAGE_BYTES, li, lpage, a.q, a.kpool, a.vpool);
    cp_async_commit();  // empty groups past the end keep the wait counts right
    lv += stride;
    fetch();
  };
  fetch();
#pragma unroll
  for (int s = 0; s < S - 1; ++s) issue_next(s);

  uint32_t sum = 0;
  int cb = 0, k = 0;
  for (int cv = blockIdx.x; cv < total; cv += stride, ++k) {
    cp_async_wait<S - 2>();  // this thread's copies of item k have landed
    __syncthreads();         // everyone's have, and item k - 1's stage is free
    issue_next((k + S - 1) % S);
    const Item it = decode(cv, cb, off, lens_s);
    const unsigned char* st = stages + (k % S) * STAGE_BYTES;
    if (MATH)
      split_math(st, it, a.scale, a.m, a.l, a.acc, a.nsplit, red, ph);
    else
      sum ^= lds32(st + 4 * tid) ^ lds32(st + TILE_BYTES + 4 * tid) ^ (uint32_t)it.n;
  }
  cp_async_wait<0>();
  if (!MATH) a.sink[(size_t)blockIdx.x * THREADS + tid] = sum;
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
__device__ __forceinline__ void issue_v2(int tid, uint32_t st, const Item& it, int page, const float* q,
                                         const __nv_bfloat16* kpool, const __nv_bfloat16* vpool) {
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
    cp_async16(d + i * ROWS * ROW_BYTES, kt + i * ROWS * ROW_BYTES, bytes);
    cp_async16(d + TILE_BYTES + i * ROWS * ROW_BYTES, vt + i * ROWS * ROW_BYTES, bytes);
  }
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
__global__ void __launch_bounds__(THREADS) attn_persist_v2_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ int lens_s[MAX_B], off[MAX_B + 1], wtot[THREADS / 32];
  __shared__ float red[2][32];              // [max, sum][row * 4 + warp] (rows 0..7)
  __shared__ uint32_t ph[2][G][PH_STRIDE];  // p's packed terms [term][row][word]
  const int tid = threadIdx.x;

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
    if (lv < total) issue_v2(tid, base + slot * STAGE_BYTES, li, lpage, a.q, a.kpool, a.vpool);
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

// ---- v3: NG groups of 4 warps a block on one ring of R stages ----
// v2 holds a block's S whole stages, so an SM fits 3 blocks (12 warps of math) at S = 2. Here one
// block an SM runs NG groups (NG * 4 warps, 128 registers a thread at NG = 4) on R shared stages
// (R = 6: 1.5 a group), each group computing with its own named barrier (bar.sync 1 + group, 128)
// and its own reduction scratch, so the groups do not wait on each other.
//   items  block item j (global item blockIdx.x + j * grid) goes to stage j % R and group j % NG;
//          j < R are issued at the start (by group j % NG), item j + R by item j's group right
//          after its row-max barrier, into the stage it just read (no other group reads it)
//   landed per stage an mbarrier of 128 arrivals (cp.async.mbarrier.arrive.noinc by each issuing
//          thread), and ticket[stage] = the item last issued into it; item j's warps wait until
//          ticket == j (item j - R released, so the barrier's previous phase is complete and the
//          parity test cannot alias), then for phase j / R. No block barrier after the setup.
//   scratch per group; the row max goes out from registers (the group's next item may overwrite
//          red[0] before warp 0 reads it, once the sum barrier is passed)
// Both waits are bounded (~2^26 cycles, then a bit in *err and on with whatever is there): a broken
// hand-off shows as wrong values and a flag, not a hang.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// the mbarrier's arrival once this thread's earlier cp.async copies have landed
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// the tickets: item j's warps see ticket == j only after the writer's own waits on the stage's
// previous phase (release / acquire)
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"(smem_u32(p)) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(smem_u32(p)), "r"(v) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// waits until ok(); gives up after ~2^26 cycles (~35 ms, far past any load), or at once when a wait
// anywhere already gave up, setting bit in *err
template <class Ok>
__device__ __forceinline__ void wait_bounded(Ok ok, int* err, int bit) {
  if (ok()) return;
  const long long t0 = clock64();
  while (!ok()) {
    if (err != nullptr && *reinterpret_cast<volatile int*>(err) != 0) return;
    if (clock64() - t0 > (1ll << 26)) {
      if (err != nullptr) atomicOr(err, bit);
      return;
    }
  }
}

template <int R, int NG>
__global__ void __launch_bounds__(NG* THREADS, 1) attn_persist_v3_kernel(const Args a) {
  static_assert(NG >= 1 && NG <= R && NG <= 15, "a group's first item is issued at the start; ids 1..15");
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ int lens_s[MAX_B], off[MAX_B + 1], wtot[THREADS / 32];
  __shared__ float red[NG][2][32];
  __shared__ uint32_t ph[NG][2][G][PH_STRIDE];
  __shared__ __align__(8) unsigned long long full[R];
  __shared__ int ticket[R];
  const int tid = threadIdx.x, grp = tid / THREADS, gtid = tid % THREADS;

  // lens and off by group 0; the barriers and tickets
  row_offsets(a, lens_s, off, wtot, [&] {
    if (tid < R) {
      mbar_init(smem_u32(&full[tid]), THREADS);
      ticket[tid] = tid;
    }
  });
  const int total = off[a.batch], stride = gridDim.x;
  const uint32_t base = smem_u32(stages), full0 = smem_u32(full);
  const uint32_t bar_id = 1 + grp;
  const auto gsync = [bar_id]() { asm volatile("bar.sync %0, %1;" ::"r"(bar_id), "n"(THREADS) : "memory"); };

  // the start: items j < R, group j % NG issuing (lb: this group's issue cursor, items only grow)
  int lb = 0;
  for (int j = grp; j < R; j += NG) {
    const int v = blockIdx.x + j * stride;
    if (v < total) {
      const Item it = decode_warp(v, lb, off, lens_s, a.batch);
      issue_v2(gtid, base + j * STAGE_BYTES, it, a.table[(size_t)it.b * a.max_blocks + it.sp], a.q, a.kpool,
               a.vpool);
      cp_async_arrive(full0 + 8 * j);
    }
  }

  int cb = 0;
  for (int j = grp;; j += NG) {
    const int v = blockIdx.x + j * stride;
    if (v >= total) break;
    const Item it = decode_warp(v, cb, off, lens_s, a.batch);
    const int s = j % R;
    // item j + R (issued at this item's release): decoded and its page read now
    const int vn = v + R * stride;
    Item ni{0, 0, 0, 0};
    int npage = 0;
    if (vn < total) {
      ni = decode_warp(vn, lb, off, lens_s, a.batch);
      npage = a.table[(size_t)ni.b * a.max_blocks + ni.sp];
    }
    wait_bounded([&]() { return ld_acquire(&ticket[s]) == j; }, a.err, 1);
    wait_bounded([&]() { return mbar_try(full0 + 8 * s, (uint32_t)(j / R) & 1u); }, a.err, 2);
    __syncwarp();
    split_math_v2(gtid, gsync, stages + s * STAGE_BYTES, it, a.scale, a.m, a.l, a.acc, a.nsplit, red[grp], ph[grp],
                  [&]() {
                    if (vn < total) {
                      issue_v2(gtid, base + s * STAGE_BYTES, ni, npage, a.q, a.kpool, a.vpool);
                      cp_async_arrive(full0 + 8 * s);
                      if (gtid == 0) st_release(&ticket[s], j + R);
                    }
                  });
  }
  cp_async_wait_all();  // no groups are committed here: the copies this thread issued for other groups
}

// the kernel of version V (1: attn_persist_kernel, MATH as asked; 2: attn_persist_v2_kernel; 3:
// attn_persist_v3_kernel with NG groups; 2 and 3 math only) and its threads a block
template <int S, int V, bool MATH, int NG>
constexpr auto kernel_of() {
  static_assert(V == 1 || MATH, "v2 and v3 have no loads-only walk");
  if constexpr (V == 3)
    return attn_persist_v3_kernel<S, NG>;
  else if constexpr (V == 2)
    return attn_persist_v2_kernel<S>;
  else
    return attn_persist_kernel<S, MATH>;
}
constexpr int threads_of(int v, int ng) { return v == 3 ? ng * THREADS : THREADS; }

// the dynamic smem size, and the largest smem carveout (the occupancy count assumes it; the loads
// bypass L1), once
template <int S, int V, bool MATH, int NG = 1>
cudaError_t set_attributes() {
  const cudaError_t e = cudaFuncSetAttribute(kernel_of<S, V, MATH, NG>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             S * STAGE_BYTES);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(kernel_of<S, V, MATH, NG>(), cudaFuncAttributePreferredSharedMemoryCarveout,
                              (int)cudaSharedmemCarveoutMaxShared);
}
template <int S, int V, bool MATH, int NG = 1>
cudaError_t prepare() {
  static const cudaError_t err = set_attributes<S, V, MATH, NG>();
  return err;
}

template <int S, int V, bool MATH, int NG = 1>
cudaError_t info(int* out) {
  cudaError_t e = prepare<S, V, MATH, NG>();
  if (e != cudaSuccess) return e;
  int dev = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&out[0], kernel_of<S, V, MATH, NG>(), threads_of(V, NG),
                                                         S * STAGE_BYTES)) != cudaSuccess)
    return e;
  if ((e = cudaDeviceGetAttribute(&out[1], cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  cudaFuncAttributes a;
  if ((e = cudaFuncGetAttributes(&a, kernel_of<S, V, MATH, NG>())) != cudaSuccess) return e;
  out[2] = a.numRegs;
  out[3] = (int)a.localSizeBytes;
  out[4] = (int)a.sharedSizeBytes + S * STAGE_BYTES;
  return cudaSuccess;
}

template <int S, int V, bool MATH, int NG = 1>
cudaError_t launch(const Args& a, int grid, cudaStream_t stream) {
  const cudaError_t e = prepare<S, V, MATH, NG>();
  if (e != cudaSuccess) return e;
  kernel_of<S, V, MATH, NG>()<<<grid, threads_of(V, NG), S * STAGE_BYTES, stream>>>(a);
  return cudaGetLastError();
}

bool args_ok(const Args& a, int grid) { return a.batch >= 1 && a.batch <= MAX_B && grid >= 1 && a.max_blocks >= 1; }

template <bool MATH>
cudaError_t launch_any(const Args& a, int stages, int grid, cudaStream_t stream) {
  if (!args_ok(a, grid)) return cudaErrorInvalidValue;
  switch (stages) {
    case 2: return launch<2, 1, MATH>(a, grid, stream);
    case 3: return launch<3, 1, MATH>(a, grid, stream);
    case 4: return launch<4, 1, MATH>(a, grid, stream);
    case 6: return launch<6, 1, MATH>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_v2(const Args& a, int stages, int grid, cudaStream_t stream) {
  if (!args_ok(a, grid)) return cudaErrorInvalidValue;
  switch (stages) {
    case 2: return launch<2, 2, true>(a, grid, stream);
    case 3: return launch<3, 2, true>(a, grid, stream);
    case 4: return launch<4, 2, true>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

// v3's instantiations: (stages, groups) = (6, 4), (5, 4), (6, 3)
cudaError_t launch_v3(const Args& a, int stages, int groups, int grid, cudaStream_t stream) {
  if (!args_ok(a, grid)) return cudaErrorInvalidValue;
  switch (stages * 16 + groups) {
    case 6 * 16 + 4: return launch<6, 3, true, 4>(a, grid, stream);
    case 5 * 16 + 4: return launch<5, 3, true, 4>(a, grid, stream);
    case 6 * 16 + 3: return launch<6, 3, true, 3>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}
cudaError_t info_v3(int stages, int groups, int* out) {
  switch (stages * 16 + groups) {
    case 6 * 16 + 4: return info<6, 3, true, 4>(out);
    case 5 * 16 + 4: return info<5, 3, true, 4>(out);
    case 6 * 16 + 3: return info<6, 3, true, 3>(out);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// stages (2, 3, 4 or 6), math (1: the split kernel, 0: the loads-only walk) -> out[5]: blocks an SM
// (occupancy), SMs, registers a thread, local (spill) bytes a thread, shared bytes a block. Sets the
// dynamic shared memory attribute (once); the grid is out[0] * out[1].
extern "C" int attn_persist_info(int stages, int math, int* out) {
  switch (stages * 2 + (math ? 1 : 0)) {
    case 5: return (int)info<2, 1, true>(out);
    case 4: return (int)info<2, 1, false>(out);
    case 7: return (int)info<3, 1, true>(out);
    case 6: return (int)info<3, 1, false>(out);
    case 9: return (int)info<4, 1, true>(out);
    case 8: return (int)info<4, 1, false>(out);
    case 13: return (int)info<6, 1, true>(out);
    case 12: return (int)info<6, 1, false>(out);
    default: return (int)cudaErrorInvalidValue;
  }
}

// q [B][16][128] fp32, pools [blocks][8][64][128] bf16, table [B][max_blocks] int32, lens [B] int32 ->
// m, l [B][16][nsplit], acc [B][16][nsplit][128] fp32 for the used splits (sp < ceil(n / 64)); B <= 256
extern "C" int attn_persist_run(const float* q, const void* kpool, const void* vpool, const int* table,
                                const int* lens, float* m, float* l, float* acc, float scale, int batch,
                                int max_blocks, int nsplit, int stages, int grid, void* stream) {
  const Args a{q, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool),
               table, lens, m, l, acc, nullptr, scale, batch, max_blocks, nsplit};
  return (int)launch_any<true>(a, stages, grid, (cudaStream_t)stream);
}

// the same walk, loads only: sink [grid][128] uint32
extern "C" int attn_persist_loads_run(const void* kpool, const void* vpool, const int* table, const int* lens,
                                      unsigned* sink, int batch, int max_blocks, int stages, int grid, void* stream) {
  const Args a{nullptr, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool),
               table, lens, nullptr, nullptr, nullptr, sink, 0.0f, batch, max_blocks, max_blocks};
  return (int)launch_any<false>(a, stages, grid, (cudaStream_t)stream);
}

// v2 (attn_persist_v2_kernel): attn_persist_info's out[5] for stages 2, 3 or 4
extern "C" int attn_persist_v2_info(int stages, int* out) {
  switch (stages) {
    case 2: return (int)info<2, 2, true>(out);
    case 3: return (int)info<3, 2, true>(out);
    case 4: return (int)info<4, 2, true>(out);
    default: return (int)cudaErrorInvalidValue;
  }
}

// v2: attn_persist_run's arguments and outputs (the same bits), stages 2, 3 or 4
extern "C" int attn_persist_v2_run(const float* q, const void* kpool, const void* vpool, const int* table,
                                   const int* lens, float* m, float* l, float* acc, float scale, int batch,
                                   int max_blocks, int nsplit, int stages, int grid, void* stream) {
  const Args a{q, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool),
               table, lens, m, l, acc, nullptr, scale, batch, max_blocks, nsplit};
  return (int)launch_v2(a, stages, grid, (cudaStream_t)stream);
}

// v3 (attn_persist_v3_kernel): attn_persist_info's out[5] (out[0] 1 or 0) for (stages, groups) =
// (6, 4), (5, 4) or (6, 3)
extern "C" int attn_persist_v3_info(int stages, int groups, int* out) { return (int)info_v3(stages, groups, out); }

// v3: attn_persist_run's arguments and outputs, and err (int, zeroed by the caller): bit 1 or 2 set
// where a wait for a stage gave up (the values are then wrong)
extern "C" int attn_persist_v3_run(const float* q, const void* kpool, const void* vpool, const int* table,
                                   const int* lens, float* m, float* l, float* acc, float scale, int batch,
                                   int max_blocks, int nsplit, int stages, int groups, int grid, int* err,
                                   void* stream) {
  const Args a{q, static_cast<const __nv_bfloat16*>(kpool), static_cast<const __nv_bfloat16*>(vpool),
               table, lens, m, l, acc, nullptr, scale, batch, max_blocks, nsplit, err};
  return (int)launch_v3(a, stages, groups, grid, (cudaStream_t)stream);
}
