// The products of the batched kernel: out = in x W^T for M rows of split activations (hs: fp32
// inputs as bf16 hi and lo rows) and bf16 weights in their nn.Linear layout, on mma.sync.
//
// One arithmetic, two schedules. Every output (row n, input row m) is defined as: K cut into
// PIECE-column pieces; a piece is one fp32 mma chain over its 32-column blocks in order (two
// m16n8k16 per block), hi and lo parts in their own accumulator columns, added at the piece's end;
// the pieces' values are added left to right. The register path (few rows) gives each warp one
// (16-row tile, piece) and leaves the pieces to the consumer, which adds them left to right
// (nparts = K / PIECE); the shared-memory path (many rows) tiles rows x inputs and makes each
// piece an item, leaving the pieces to the consumer too (the default), or walks the whole K and
// adds the pieces itself in the same order (nparts = 1). The same value every way, for any M and
// any tile: which inputs share an mma never changes an output's bits.
//
// Fragments. In a 32-column block, lane (g = lane / 4, tq = lane % 4) loads 16 bytes = columns
// 8 tq .. 8 tq + 7 of weight rows g and g + 8 and of its input row (input m = 4 i + g / 2,
// part g % 2): columns 0..3 are the first mma's k-slice (as its k pairs {2tq, 2tq+1} and
// {2tq+8, 2tq+9}), columns 4..7 the second's. Both operands use the same column-to-k map, so each
// mma sums the products of 16 matching columns; no weight is permuted. The accumulator's columns
// 2tq, 2tq + 1 are input 4 i + tq's hi and lo products.
#pragma once
#include "common.cuh"

namespace qbk {

struct Gemm {
  const __nv_bfloat16* w;   // rows 0 .. n1 - 1: [n1][K]
  const __nv_bfloat16* w2;  // rows n1 .. N - 1 (gate|up: up), or null
  int n1, N, K, M;
  int a0, astep;            // input row m is hs row a0 + m * astep
  const __nv_bfloat16* hs;  // [rows][2][KMAX]
  float* out;               // [nparts][M][N]
  bool reg;                 // the register path
  int rb, tb;               // the shared-memory path's tile: rows x inputs
  bool split;               // the shared-memory path: one item per piece, its value a part

  __device__ int nparts() const { return reg || split ? K / PIECE : 1; }
  __device__ const __nv_bfloat16* wrow(int n) const {
    return (w2 != nullptr && n >= n1) ? w2 + (size_t)(n - n1) * K : w + (size_t)n * K;
  }
  __device__ const __nv_bfloat16* xrow(int m, int part) const {
    return hs + ((size_t)(a0 + m * astep) * 2 + part) * KMAX;
  }
  __device__ int ntasks() const { return (N / 16) * (K / PIECE); }
};

// The shared-memory schedule of an N x M product: a tile of rows x inputs and whether each item
// walks all of K or one piece of it (split: the K / PIECE piece values are parts, added by the
// consumer as the register path's). Measured on an H100 over every candidate (session 15,
// scripts/gpu_cuda_frame.py --sections tiles): splitting always paid, and the best tile went
// 128 x 32 (M <= 32), 64 x 64 (M <= 128), 128 x 64 (more); a bytes-vs-mma cost model picked
// tiles up to 1.3x slower. Tuning knobs (the same bits every way): split_mode 1 never splits,
// 2 (and 0) split wherever K has several pieces; tile 1..6 forces one candidate where N allows.
__device__ __forceinline__ void choose_tile(int N, int M, int K, int split_mode, int tile, int& rb, int& tb,
                                            bool& split) {
  const int cand[6][2] = {{128, 64}, {64, 64}, {128, 32}, {64, 32}, {32, 64}, {32, 32}};
  int c = M <= 32 ? 2 : M <= 128 ? 1 : 0;
  if (tile > 0 && N % cand[tile - 1][0] == 0) c = tile - 1;
  rb = cand[c][0];
  tb = cand[c][1];
  split = split_mode != 1 && K > PIECE;
}

__device__ __forceinline__ Gemm make_gemm(const __nv_bfloat16* w, const __nv_bfloat16* w2, int n1, int N, int K, int M,
                                          int a0, int astep, const __nv_bfloat16* hs, float* out, int reg_max_m,
                                          int split_mode, int tile = 0) {
  Gemm g{w, w2, n1, N, K, M, a0, astep, hs, out, M <= reg_max_m, 0, 0, false};
  if (!g.reg) choose_tile(N, M, K, split_mode, tile, g.rb, g.tb, g.split);
  return g;
}

// ---- register path -----------------------------------------------------------------------------
// The weights of register task `task` (16-row tile task / P, piece task % P): lane l's fragments
// j (weight row g, then g + 8) at st[32 (2 j + r)] (st: this lane's first unit in its warp's
// area). Needs nothing of the previous phase, so it is issued while the block waits at the grid
// barrier.
__device__ __forceinline__ void reg_stage_w(const Gemm& g, int task, uint4* st) {
  const int P = g.K / PIECE, rt = task / P, p = task % P;
  const int lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
  const __nv_bfloat16* r0 = g.wrow(16 * rt + gid) + PIECE * p + 8 * tq;
  const __nv_bfloat16* r8 = g.wrow(16 * rt + gid + 8) + PIECE * p + 8 * tq;
#pragma unroll
  for (int j = 0; j < PIECE / 32; ++j) {
    cp_async16(st + 32 * (2 * j), r0 + 32 * j, 16);
    cp_async16(st + 32 * (2 * j + 1), r8 + 32 * j, 16);
  }
}

// Every task of this warp (the first one's weights staged at st): all M inputs, 4 per mma.
__device__ inline void reg_run(const Gemm& g, const uint4* st) {
  const int P = g.K / PIECE, ntask = g.ntasks();
  const int nw = gridDim.x * WARPS;
  const int lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
  const int ngrp = (g.M + 3) >> 2;
  for (int task = global_warp(); task < ntask; task += nw) {
    const int rt = task / P, p = task % P;
    uint4 wa[PIECE / 32], wb[PIECE / 32];
    if (task == global_warp()) {
#pragma unroll
      for (int j = 0; j < PIECE / 32; ++j) {
        wa[j] = st[32 * (2 * j)];
        wb[j] = st[32 * (2 * j + 1)];
      }
    } else {
      const __nv_bfloat16* r0 = g.wrow(16 * rt + gid) + PIECE * p + 8 * tq;
      const __nv_bfloat16* r8 = g.wrow(16 * rt + gid + 8) + PIECE * p + 8 * tq;
#pragma unroll
      for (int j = 0; j < PIECE / 32; ++j) {
        wa[j] = ldg16(r0 + 32 * j);
        wb[j] = ldg16(r8 + 32 * j);
      }
    }
    for (int tg = 0; tg < ngrp; ++tg) {
      const int m = 4 * tg + (gid >> 1);
      uint4 xv[PIECE / 32];
      if (m < g.M) {
        const __nv_bfloat16* xr = g.xrow(m, gid & 1) + PIECE * p + 8 * tq;
#pragma unroll
        for (int j = 0; j < PIECE / 32; ++j) xv[j] = ldcg16(xr + 32 * j);
      } else {
#pragma unroll
        for (int j = 0; j < PIECE / 32; ++j) xv[j] = make_uint4(0u, 0u, 0u, 0u);
      }
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < PIECE / 32; ++j) mma_k32(d, wa[j], wb[j], xv[j]);
      const int mo = 4 * tg + tq;
      if (mo < g.M) {
        float* o = g.out + ((size_t)p * g.M + mo) * g.N + 16 * rt + gid;
        o[0] = d[0] + d[1];
        o[8] = d[2] + d[3];
      }
    }
  }
}

// ---- shared-memory path ------------------------------------------------------------------------
// 16-byte unit c (0..7) of a 128-byte tile row r lives at unit c ^ swz(r): the 8 lanes of a
// quarter warp (rows g, g + 1 of two lane groups, units 4h + tq) hit 8 distinct units.
__device__ __forceinline__ int swz(int r) { return ((r & 1) << 2) | ((r >> 1) & 3); }

// Items (rb x tb tiles of rows x inputs, one piece of K or, not split, all of it) of this block;
// a ring of STAGES stages, each a 64-column chunk of the tile's weight rows (A: [RB][64]) and
// input rows (B: [2 TB][64], row 2 t + part). GW: input groups of 4 per warp (= RB TB / 512).
template <int GW>
__device__ __noinline__ void smem_run(const Gemm& g, uint8_t* smem) {
  const int RB = g.rb, TB = g.tb;
  const int rtiles = RB / 16;
  const int kp = g.split ? g.K / PIECE : 1;  // items per tile: its pieces, or all of K
  const int nrb = g.N / RB, ntb = (g.M + TB - 1) / TB, nitems = nrb * ntb * kp;
  const int nchunk = (g.split ? PIECE : g.K) / CHUNK;
  const int G = gridDim.x;
  const int myitems = (int)blockIdx.x < nitems ? (nitems - 1 - (int)blockIdx.x) / G + 1 : 0;
  const int total = myitems * nchunk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
  const int wr = warp % rtiles, wt = warp / rtiles;
  const int a_bytes = RB * CHUNK * 2;

  auto issue = [&](int q) {
    if (q < total) {
      uint8_t* st = smem + (q % STAGES) * STAGE_BYTES;
      const int item = blockIdx.x + (q / nchunk) * G, j = q % nchunk;
      const int rb = (item / kp) % nrb, tb = item / kp / nrb;
      const int k0 = (item % kp) * PIECE + j * CHUNK;
      for (int seg = threadIdx.x; seg < RB * 8; seg += THREADS) {
        const int r = seg >> 3, c = seg & 7;
        cp_async16(st + (r * 8 + (c ^ swz(r))) * 16, g.wrow(rb * RB + r) + k0 + 8 * c, 16);
      }
      uint8_t* bt = st + a_bytes;
      for (int seg = threadIdx.x; seg < TB * 16; seg += THREADS) {
        const int rr = seg >> 3, c = seg & 7;
        const int m = tb * TB + (rr >> 1);
        const bool ok = m < g.M;
        cp_async16(bt + (rr * 8 + (c ^ swz(rr))) * 16, g.xrow(ok ? m : 0, rr & 1) + k0 + 8 * c, ok ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  float acc[GW][4], run[GW][2];
#pragma unroll
  for (int i = 0; i < GW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = run[i][0] = run[i][1] = 0.f;
#pragma unroll
  for (int q = 0; q < STAGES - 1; ++q) issue(q);
  for (int q = 0; q < total; ++q) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int item = blockIdx.x + (q / nchunk) * G, j = q % nchunk;
    const int tb = item / kp / nrb;
    const int mbase = tb * TB + wt * 4 * GW;  // this warp's first input
    if ((j & 3) == 0) {
#pragma unroll
      for (int i = 0; i < GW; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    }
    const uint4* A = reinterpret_cast<const uint4*>(smem + (q % STAGES) * STAGE_BYTES);
    const uint4* Bt = reinterpret_cast<const uint4*>(smem + (q % STAGES) * STAGE_BYTES + a_bytes);
    const int ra = 16 * wr + gid, ra8 = ra + 8;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 4 * h + tq;
      const uint4 wg = A[ra * 8 + (c ^ swz(ra))], wg8 = A[ra8 * 8 + (c ^ swz(ra8))];
#pragma unroll
      for (int i = 0; i < GW; ++i) {
        if (mbase + 4 * i >= g.M) break;  // warp-uniform: no input of this group
        const int rr = 2 * (wt * 4 * GW + 4 * i) + gid;
        mma_k32(acc[i], wg, wg8, Bt[rr * 8 + (c ^ swz(rr))]);
      }
    }
    if ((j & 3) == 3) {  // a piece ends: add it to the running sum, left to right
      const bool first = j == 3;
#pragma unroll
      for (int i = 0; i < GW; ++i) {
        const float v0 = acc[i][0] + acc[i][1], v1 = acc[i][2] + acc[i][3];
        run[i][0] = first ? v0 : run[i][0] + v0;
        run[i][1] = first ? v1 : run[i][1] + v1;
      }
    }
    if (j == nchunk - 1) {
      const int n = ((item / kp) % nrb) * RB + 16 * wr + gid;
      const size_t part = kp > 1 ? (size_t)(item % kp) * g.M : 0;
#pragma unroll
      for (int i = 0; i < GW; ++i) {
        const int m = mbase + 4 * i + tq;
        if (m < g.M) {
          float* o = g.out + (part + m) * g.N + n;
          o[0] = run[i][0];
          o[8] = run[i][1];
        }
      }
    }
    issue(q + STAGES - 1);
  }
  cp_async_wait<0>();
  __syncthreads();
}

__device__ __forceinline__ void smem_dispatch(const Gemm& g, uint8_t* smem) {
  switch (g.rb * g.tb / 512) {
    case 16: smem_run<16>(g, smem); break;
    case 8: smem_run<8>(g, smem); break;
    case 4: smem_run<4>(g, smem); break;
    default: smem_run<2>(g, smem); break;
  }
}

}  // namespace qbk
