// Device code shared by the small-batch kernel (csrc/small/cp_layers.cu) and issue 16's
// persistent-kernel experiments (scripts/products_engine.cu, scripts/stream_bw.cu) and bit checks
// (scripts/dot_bits.cu): timers, mbarrier waits and arrivals, the weight streams' bulk copies, the
// products' mma.sync chains over shared-memory weight tiles (the Triton graphs' arithmetic: one
// chain per K piece, 16-column steps in order, from zero), and the pieces of Triton 3.6's RMSNorm.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int WARPS = 8;                  // consumer warps a block
constexpr int THREADS = (WARPS + 1) * 32;  // + the producer warp
constexpr int UC = 512;                    // a unit's columns
constexpr int URS = UC * 2 + 16;           // a unit's row stride in bytes
constexpr int UNIT = 16 * URS;             // a ring unit: 16 rows x 512 columns + row padding
constexpr int NU = 8;                      // ring units (a power of two: slot and phase are bit operations;
                                           // 8-12 units measured alike, 4-6 slower)

__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ bool mbar_try(uint32_t a, uint32_t parity) {
  uint32_t ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(a), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The weight streams' L2 policy: read once a pass, evicted first (so that activations stay).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
// A ring unit's mbarrier `bar` to expect `bytes` of bulk copies (after the generic proxy's last
// reads of the unit's shared memory).
__device__ __forceinline__ void expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// One bulk copy of `bytes` from global `src` into shared `dst`, completing on mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          uint64_t policy) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
               "[%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy)
               : "memory");
}
// A ring of n units' mbarriers (full: the copies landed; empty: the consumers are done), one
// arrival each; by one thread, before the block's first __syncthreads.
__device__ __forceinline__ void ring_init(unsigned long long* full, unsigned long long* empty, int n) {
  for (int u = 0; u < n; ++u) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + u)) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(empty + u)) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Bounded: false after timeout_ns or once the error word (another block's) is set; sets it to 1.
__device__ bool mbar_wait_err(uint32_t a, uint32_t parity, unsigned* err, unsigned long long timeout_ns) {
  unsigned long long t0 = 0;
  for (uint32_t i = 0; !mbar_try(a, parity); ++i) {
    if ((i & 255u) == 255u) {
      if (*reinterpret_cast<volatile unsigned*>(err) != 0) return false;
      const unsigned long long now = gtime();
      if (t0 == 0) t0 = now;
      else if (now - t0 > timeout_ns) { atomicCAS(err, 0u, 1u); return false; }
    }
  }
  return true;
}

__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float sqrt_approx_ftz(float a) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// Which of a 1,024-wide row's elements thread t (of 128) holds as its i-th value in the norms below:
// with an fp16 out Triton 3.6 lays the row out as 8 consecutive elements a thread (8t..8t+7), with
// an fp32 out as two groups of 4 (4t..4t+3, then 512+4t..512+4t+3), and the sum of squares runs in
// that register order.
template <bool F16>
__device__ __forceinline__ int owned(int t, int i) {
  return F16 ? 8 * t + i : (i < 4 ? 4 * t + i : 512 + 4 * t + (i - 4));
}

// The mean square of a 1,024-wide row held 8 values a thread by 128 threads, as Triton 3.6's norms
// compute it: the thread's e1 * e1, then fma e0, e2 .. e7 (register order); warp butterflies xor
// 16 .. 1; the 4 warp sums by threads 0..3, butterflies xor 2, 1; / D by div.full. red: 4 floats
// of shared memory; the row's 128 threads (t: 0..127 among them) meet at barrier `bar`.
__device__ __forceinline__ float mean_square(const float (&e)[8], float* red, int D, int t, unsigned bar) {
  const int lane = t & 31, warp = t >> 5;
  float ss = __fmul_rn(e[1], e[1]);
  ss = __fmaf_rn(e[0], e[0], ss);
#pragma unroll
  for (int i = 2; i < 8; ++i) ss = __fmaf_rn(e[i], e[i], ss);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
  if (lane == 0) red[warp] = ss;
  asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
  if (warp == 0) {
    float v = lane < 4 ? red[lane] : 0.f;
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    __syncwarp();
    if (lane == 0) red[0] = v;
  }
  asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
  return div_full(red[0], (float)D);
}

__device__ __forceinline__ void mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 16-row weight tile times the staged inputs of its K piece, one mma.sync chain per 8-row
// input tile, k order from zero; DUAL: a second weight tile (the up rows) in chains of its own,
// interleaved with the first's (independent chains overlap on the tensor core). wa / wb: this lane's
// ldmatrix row address in the gate / up tile (lanes 0-7 rows 0-7 at k, 8-15 rows 8-15 at k, 16-23
// rows 0-7 at k + 8, 24-31 rows 8-15 at k + 8); xa: this lane's staged input word (row g, columns
// 2t, 2t + 1), rows xrs bytes apart (row 8 + g for the second input tile).
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ void ldsm4(uint32_t a, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// A step's operands: the weight tile's A fragments (gate; up if DUAL) and the inputs' B fragments.
struct Frag {
  uint32_t a[4], c[4], x0[2], x1[2];
};
// w0 / w1: this lane's ldmatrix row address in the gate / up unit (512 columns), xa: its staged
// input word at the unit's first column.
// sw < 0: rows URS bytes apart, w0 / w1 include the lane's column offset; else (tiled weights) rows
// of 1,024 bytes whose 16-byte chunks sit at chunk ^ (row & 7), sw = (row & 7) | (lane >> 4) << 3.
__device__ __forceinline__ uint32_t wofs(int sw, int k) {
  return sw < 0 ? 2u * k : (uint32_t)((((k >> 3) + (sw >> 3)) ^ (sw & 7)) << 4);
}
template <bool TWO, bool DUAL>
__device__ __forceinline__ void load_step(Frag& f, uint32_t w0, uint32_t w1, uint32_t xa, int xrs, int k, int sw) {
  f.x0[0] = lds32(xa + 2 * k), f.x0[1] = lds32(xa + 2 * k + 16);
  if (TWO) f.x1[0] = lds32(xa + 8 * xrs + 2 * k), f.x1[1] = lds32(xa + 8 * xrs + 2 * k + 16);
  const uint32_t o = wofs(sw, k);
  ldsm4(w0 + o, f.a);
  if (DUAL) ldsm4(w1 + o, f.c);
}
template <bool TWO, bool DUAL>
__device__ __forceinline__ void mma_step(const Frag& f, float (*d)[4], float (*e)[4]) {
  mma(d[0], f.a[0], f.a[1], f.a[2], f.a[3], f.x0[0], f.x0[1]);
  if (DUAL) mma(e[0], f.c[0], f.c[1], f.c[2], f.c[3], f.x0[0], f.x0[1]);
  if (TWO) mma(d[1], f.a[0], f.a[1], f.a[2], f.a[3], f.x1[0], f.x1[1]);
  if (TWO && DUAL) mma(e[1], f.c[0], f.c[1], f.c[2], f.c[3], f.x1[0], f.x1[1]);
}
// The sub-pieces of a K piece (tk_gemm.sub_cols, the Triton graphs' order, opt-in there with
// TTS_GEMM_SUB=256): 256 columns, each an mma chain from zero, added to the piece's sum in order;
// 0 (the default): one chain a piece. With 256 a 512-column unit is two sub-pieces whose chains
// run interleaved on the warp (the tensor core overlaps independent chains: 1, 2 or 4 of them run
// ~25 cycles a step alike): a B = 1 frame 90 µs faster on an H200, but the Triton tiles of 4-256
// rows slower by more (session 47; tk_gemm.SUB_COLS).
#ifndef QSK_SUB
#define QSK_SUB 0
#endif
static_assert(QSK_SUB == 0 || QSK_SUB == 256, "QSK_SUB: 0 or 256 columns");

// One unit's 512 columns of the chain. The shared-memory loads run two steps ahead of the mma that
// use them (in program order: the asm statements are volatile, so the compiler keeps their order).
// (A loop of two steps an iteration measured ~43 cycles a step in this kernel on the H200; a chain
// fully unrolled with its operands from shared memory ~25, dot_bits.cu's chain_smem.)
// QSK_SUB 256: columns 0-255 and 256-511 as two chains from zero, step by step interleaved, then
// d = (d + s0) + s1 (e likewise): tk_gemm._k_walk's order.
template <bool TWO, bool DUAL>
__device__ __forceinline__ void chain_unit(uint32_t w0, uint32_t w1, uint32_t xa, int xrs, float (*d)[4],
                                           float (*e)[4], int sw) {
#if QSK_SUB == 256
  constexpr int HC = UC / 2;
  float p0[2][4] = {}, q0[2][4] = {}, p1[2][4] = {}, q1[2][4] = {};  // sub 0 / 1: gate (p), up (q)
  Frag f0, f1, g0, g1;  // f: sub 0's steps k, k + 16; g: sub 1's
  load_step<TWO, DUAL>(f0, w0, w1, xa, xrs, 0, sw);
  load_step<TWO, DUAL>(g0, w0, w1, xa, xrs, HC, sw);
  load_step<TWO, DUAL>(f1, w0, w1, xa, xrs, 16, sw);
  load_step<TWO, DUAL>(g1, w0, w1, xa, xrs, HC + 16, sw);
#pragma unroll
  for (int k = 0; k < HC; k += 32) {
    mma_step<TWO, DUAL>(f0, p0, q0);
    mma_step<TWO, DUAL>(g0, p1, q1);
    if (k + 32 < HC) {
      load_step<TWO, DUAL>(f0, w0, w1, xa, xrs, k + 32, sw);
      load_step<TWO, DUAL>(g0, w0, w1, xa, xrs, HC + k + 32, sw);
    }
    mma_step<TWO, DUAL>(f1, p0, q0);
    mma_step<TWO, DUAL>(g1, p1, q1);
    if (k + 48 < HC) {
      load_step<TWO, DUAL>(f1, w0, w1, xa, xrs, k + 48, sw);
      load_step<TWO, DUAL>(g1, w0, w1, xa, xrs, HC + k + 48, sw);
    }
  }
#pragma unroll
  for (int i = 0; i < (TWO ? 2 : 1); ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d[i][j] = __fadd_rn(__fadd_rn(d[i][j], p0[i][j]), p1[i][j]);
      if (DUAL) e[i][j] = __fadd_rn(__fadd_rn(e[i][j], q0[i][j]), q1[i][j]);
    }
#else
  Frag f0, f1;
  load_step<TWO, DUAL>(f0, w0, w1, xa, xrs, 0, sw);
  load_step<TWO, DUAL>(f1, w0, w1, xa, xrs, 16, sw);
#pragma unroll
  for (int k = 0; k < UC; k += 32) {  // fully unrolled: every address a base plus a constant
    mma_step<TWO, DUAL>(f0, d, e);
    if (k + 32 < UC) load_step<TWO, DUAL>(f0, w0, w1, xa, xrs, k + 32, sw);
    mma_step<TWO, DUAL>(f1, d, e);
    if (k + 48 < UC) load_step<TWO, DUAL>(f1, w0, w1, xa, xrs, k + 48, sw);
  }
#endif
}

// A task's chain over its piece, unit by unit (the same accumulators: one chain in k order): unit
// 0 (wa0 / wb0: gate / up), then for a 1,024-column piece unit 1, lane 0 releasing unit 0 between
// them (its loads were all consumed by its mma; rel0 / rel20: its empty barriers, 0: none).
template <bool TWO, bool DUAL>
__device__ __forceinline__ void chain_t(uint32_t wa0, uint32_t wa1, uint32_t wb0, uint32_t wb1, uint32_t xa, int xrs,
                                        int units, float (*d)[4], float (*e)[4], uint32_t rel0, uint32_t rel20,
                                        int sw) {
  chain_unit<TWO, DUAL>(wa0, wb0, xa, xrs, d, e, sw);
  if (units == 2) {
    if (rel0) {
      __syncwarp();
      if ((threadIdx.x & 31) == 0) {
        mbar_arrive(rel0);
        if (DUAL) mbar_arrive(rel20);
      }
    }
    chain_unit<TWO, DUAL>(wa1, wb1, xa + 2 * UC, xrs, d, e, sw);
  }
}

__device__ __forceinline__ void chain(bool two, bool dual, uint32_t wa0, uint32_t wa1, uint32_t wb0, uint32_t wb1,
                                      uint32_t xa, int xrs, int units, float (*d)[4], float (*e)[4], uint32_t rel0,
                                      uint32_t rel20, int sw) {
  if (two) {
    if (dual) chain_t<true, true>(wa0, wa1, wb0, wb1, xa, xrs, units, d, e, rel0, rel20, sw);
    else chain_t<true, false>(wa0, wa1, wb0, wb1, xa, xrs, units, d, e, rel0, rel20, sw);
  } else {
    if (dual) chain_t<false, true>(wa0, wa1, wb0, wb1, xa, xrs, units, d, e, rel0, rel20, sw);
    else chain_t<false, false>(wa0, wa1, wb0, wb1, xa, xrs, units, d, e, rel0, rel20, sw);
  }
}

}  // namespace
