// For scripts/gpu_products_engine.py (issue 16's small-batch kernel, its first question): how fast
// can a persistent kernel run the decode frame's fp16 products for a few rows when a producer warp
// streams every block's weight tiles into shared memory ahead of the consumers, and each product
// keeps the Triton graphs' bits (one mma.sync chain per 16-column step of a K piece, from zero:
// scripts/gpu_dot_bits.py)?
//
// The launch runs a list of products in order (the frame's products depend on their predecessors).
// A product is N x K fp16 weights in pieces of `piece` columns (512 or 1,024), times M <= 16 fp16
// input rows (two 8-row mma tiles), out: the pieces as fp32 parts [S][M][N] (q|k|v, o_proj, down)
// or, `swiglu`, gate rows 0..N-1 and up rows of `w2` into fp16 silu(g) * u * scale (the SwiGLU
// epilogue of tk_gemm's PTX: ex2.approx, div.full). A task is 16 weight rows x one piece (gate and
// up rows together for swiglu; `xa`: 8 rows, the weights as the mma's B operand); task t goes to
// block t % G, whose 8 consumer warps take its tasks in turn. The producer warp copies each of its
// block's tasks, in the order the consumers take them, into a ring of shared-memory units of 16 rows
// x 512 columns (cp.async.bulk, L2 evict-first): one copy a row (1 KB; rows padded by 16 bytes, so
// ldmatrix reads them without bank conflicts) or, `tiled`, one 16 KB copy a unit from a tiled copy
// of the matrix (16-byte chunks swizzled for ldmatrix), waiting only for a unit to be released; a
// chain releases each unit but its last as soon as it has passed its columns. The ring has NU units.
//
// Between products, either a grid barrier (release/acquire counter) and then every block stages the
// inputs of its pieces from global memory; or (`words`, the LL mode) no barrier: each block
// publishes a share of the next product's inputs as 64-bit words {2 fp16 values, flag} once its own
// chains are done (as if its outputs had made them), and the next product's staging polls those
// words until they carry that product's flag.
//
// Built with ROW_PHASES, a phase may also be a row phase: the programs of a Triton row kernel, its
// own PTX made a device function (scripts/ptx_func.py) that the host script links in with the
// row_call it generates (scripts/gpu_cp_layer_engine.py: whole code-predictor layers).
//
// Sessions 38-39 (H200; BENCHMARKS.md): every variant gives the Triton products' bits; LL + tiled
// weights (a ring of 8 units) runs a layer's four products in 15.8 µs at one row against 19.0 for a
// CUDA graph of the Triton products (19.7 against 19.2 at 8 rows); whole layers with the row phases
// and grid barriers, bitwise equal, 33.9 against 28.3. What it costs: the scripts print the traces.
#include <cuda_fp16.h>
#include <cstdint>
#include <algorithm>
#include <cstring>

namespace {

constexpr int WARPS = 8;                  // consumer warps a block
constexpr int THREADS = (WARPS + 1) * 32;  // + the producer warp
constexpr int UC = 512;                    // a unit's columns
constexpr int URS = UC * 2 + 16;           // a unit's row stride in bytes
constexpr int UNIT = 16 * URS;             // a ring unit: 16 rows x 512 columns + row padding
constexpr int NU = 8;                      // ring units (a power of two: slot and phase are bit operations;
                                           // 8-12 units measured alike, 4-6 slower)
constexpr int MAXP = 64;                   // products a launch
// trace words per (block, product): staging done, arrival at the barrier, then per consumer warp
// its weights' arrival (the full-barrier waits done) and its chains' end (ns; 0: no task), then per
// warp its chains' clock cycles, then per warp when it picked its task (before the waits) and when
// its outputs were stored and its units released (ns)
constexpr int TR = 2 + 5 * WARPS;
constexpr int UTR = 256;                   // ring units traced a block (utrace)
constexpr int WORDS = 16 * 3072 / 2;       // LL words a product's input (M <= 16, K <= 3072)

// A phase of the launch: a product (kind 0), or (ROW_PHASES builds) a row phase: the programs of a
// Triton row kernel (its own PTX as a device function, which the generated row_call runs by kind).
struct Product {
  const __half* w;   // [N][K]
  const __half* w2;  // swiglu: up rows [N][K]; else null
  const __half* x;   // [M][K]
  void* out;         // fp32 parts [S][M][N], or fp16 [M][N] (swiglu)
  int N, K, piece;
  float scale;       // the outputs' power-of-two scale (swiglu: before the fp16 rounding)
  int kind;          // 0: a product; else a row phase, row_call's kind
  int gx, gy;        // row phase: the Triton grid (program (x, y) = p % gx, p / gx)
  int warps;         // row phase: warps a program (1, 2, 4 or 8)
  int smem_per;      // row phase: shared-memory bytes a program
  const void* args[10];  // row phase: the launch's pointer arguments, in order
  unsigned uargs[6];     // row phase: its 32-bit scalar arguments (fp32 as bits), in order
};

#ifdef ROW_PHASES
// Generated by the host script (scripts/gpu_cp_layer_engine.py) from the Triton kernels' PTX: runs
// program (pid_x, pid_y) of row kernel `kind` with this thread as its thread `tid`, its shared memory
// at `smem` (a 32-bit shared address), its barrier `bar`.
extern "C" __device__ void row_call(int kind, const void* const* args, const unsigned* uargs, unsigned pid_x,
                                    unsigned pid_y, unsigned tid, unsigned smem, unsigned bar);
#endif

struct Params {
  Product p[MAXP];
  int np, M;
  unsigned* sync;    // [0] barrier arrivals, [2] error (zeroed by the host before the launch)
  unsigned long long timeout_ns;
  unsigned* trace;   // null, or [G][np][TR] u32: ns since the product's start (see TR)
  unsigned long long* t0s;  // null, or [G][np + 1]: globaltimer at each product's start, and the end
  unsigned long long* utrace;  // null, or [G][UTR][3]: per ring unit (in sequence) the producer's issue, the
                               // consumer's wait start and its wait end (globaltimer)
  unsigned long long* ptrace;  // null, or [G][np][3]: the producer's first and last issue of each product's
                               // units (globaltimer) and its wait for free units meanwhile (ns)
  unsigned long long* words;  // null, or LL mode: [np][WORDS] words {2 fp16 inputs, flag}; no grid barriers
  unsigned flag_base;         // LL: this launch's flags are flag_base | (product + 1); new for every launch
  int tiled;         // 1: w / w2 are tiled copies: [N/16][K/512][16][512], 16-byte chunks at chunk ^ (row & 7)
                     // (a unit is one 16 KB bulk copy; not with xa)
  int xa;            // 1: tasks of 8 weight rows, the inputs the mma's A operand (see chain_xa)
  int smem;          // dynamic shared memory bytes (the staged inputs, then the ring): what the device allows
                     // beside the kernel's static shared memory
  unsigned poll_ns;  // LL: a failed poll sleeps this long (0: spins)
  int mode;          // 0: as served; 3: consumers skip the chains; 4: no copies, no chains (barriers only);
                     // 5: chains on whatever shared memory holds, no copies; 7: one consumer lane
                     // releases every unit at once (3-7: timing only)
};

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
// Bounded: false after timeout_ns or once another block has raised the error word.
__device__ bool mbar_wait(uint32_t a, uint32_t parity, const Params& P) {
  unsigned long long t0 = 0;
  for (uint32_t i = 0; !mbar_try(a, parity); ++i) {
    if ((i & 255u) == 255u) {
      if (*reinterpret_cast<volatile unsigned*>(P.sync + 2) != 0) return false;
      const unsigned long long now = gtime();
      if (t0 == 0) t0 = now;
      else if (now - t0 > P.timeout_ns) { atomicCAS(P.sync + 2, 0u, 1u); return false; }
    }
  }
  return true;
}

// The tasks of product q, and the ring units one takes (piece / 512 a weight tile, gate and up
// tiles each; xa: tasks of 8 rows, one unit a weight tile)
__device__ __host__ __forceinline__ int ntasks(const Product& q, int xa) {
  return q.kind ? 0 : (q.N / (xa ? 8 : 16)) * (q.K / q.piece);
}
__device__ __forceinline__ int units_of(const Product& q, int xa) {
  return (xa ? 1 : q.piece / UC) * (q.w2 ? 2 : 1);
}

// Grid barrier of the consumer warps (named barrier 1, 256 threads): an arrival counter that only
// grows (epoch e is complete at e * gridDim.x arrivals; the host zeroes it before the launch),
// thread 0 adds with release semantics and polls with acquire loads (csrc/ops/common.cuh's design).
__device__ bool grid_sync(const Params& P, unsigned& epoch, int* s_ok) {
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
  epoch += 1;
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(P.sync) : "memory");
    const unsigned target = epoch * gridDim.x;
    int ok = 1;
    unsigned long long t0 = 0;
    for (uint32_t i = 0;; ++i) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(P.sync) : "memory");
      if (v >= target) break;
      if ((i & 255u) == 255u) {
        if (*reinterpret_cast<volatile unsigned*>(P.sync + 2) != 0) { ok = 0; break; }
        const unsigned long long now = gtime();
        if (t0 == 0) t0 = now;
        else if (now - t0 > P.timeout_ns) { atomicCAS(P.sync + 2, 0u, 2u); ok = 0; break; }
      }
    }
    *s_ok = ok;
  }
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
  return *reinterpret_cast<volatile int*>(s_ok) != 0;
}

__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
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
// One unit's 512 columns of the chain. The shared-memory loads run two steps ahead of the mma that
// use them (in program order: the asm statements are volatile, so the compiler keeps their order).
// (A loop of two steps an iteration measured ~43 cycles a step in this kernel on the H200; a chain
// fully unrolled with its operands from shared memory ~25, dot_bits.cu's chain_smem.)
template <bool TWO, bool DUAL>
__device__ __forceinline__ void chain_unit(uint32_t w0, uint32_t w1, uint32_t xa, int xrs, float (*d)[4],
                                           float (*e)[4], int sw) {
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
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(rel0) : "memory");
        if (DUAL) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(rel20) : "memory");
      }
    }
    chain_unit<TWO, DUAL>(wa1, wb1, xa + 2 * UC, xrs, d, e, sw);
  }
}

// xa mode (tasks of 8 weight rows): the inputs' 16-row tile is the mma's A (rows g, g + 8 at
// columns 2t.. and 8 + 2t..; rows 8-15 zero unless M > 8), the 8 weight rows its B (this lane's row
// g at columns 2t.. and 8 + 2t.., plain 32-bit shared loads: the rows' padding spreads them over the
// banks). A task's unit holds its 8 rows' columns 0..511 in rows 0-7 and 512..1,023 in rows 8-15.
// Loads two steps ahead, as chain_unit. The same bits as the weights-as-A chain (measured).
struct FragX {
  uint32_t a[4], b[2], c[2];
};
template <bool TWO, bool DUAL>
__device__ __forceinline__ void load_x(FragX& f, uint32_t wg, uint32_t wu, uint32_t xg, int xrs, int k) {
  f.a[0] = lds32(xg + 2 * k), f.a[2] = lds32(xg + 2 * k + 16);
  f.a[1] = TWO ? lds32(xg + 8 * xrs + 2 * k) : 0u, f.a[3] = TWO ? lds32(xg + 8 * xrs + 2 * k + 16) : 0u;
  f.b[0] = lds32(wg + 2 * k), f.b[1] = lds32(wg + 2 * k + 16);
  if (DUAL) f.c[0] = lds32(wu + 2 * k), f.c[1] = lds32(wu + 2 * k + 16);
}
template <bool TWO, bool DUAL>
__device__ __forceinline__ void chain_xa_t(uint32_t wg, uint32_t wu, uint32_t xg, int xrs, int segs, float* d,
                                           float* e) {
  for (int h = 0; h < segs; ++h) {
    const uint32_t g0 = wg + 8 * URS * h, u0 = wu + 8 * URS * h, x0 = xg + 2 * UC * h;
    FragX f0, f1;
    load_x<TWO, DUAL>(f0, g0, u0, x0, xrs, 0);
    load_x<TWO, DUAL>(f1, g0, u0, x0, xrs, 16);
#pragma unroll 2
    for (int k = 0; k < UC; k += 32) {
      mma(d, f0.a[0], f0.a[1], f0.a[2], f0.a[3], f0.b[0], f0.b[1]);
      if (DUAL) mma(e, f0.a[0], f0.a[1], f0.a[2], f0.a[3], f0.c[0], f0.c[1]);
      load_x<TWO, DUAL>(f0, g0, u0, x0, xrs, min(k + 32, UC - 16));
      mma(d, f1.a[0], f1.a[1], f1.a[2], f1.a[3], f1.b[0], f1.b[1]);
      if (DUAL) mma(e, f1.a[0], f1.a[1], f1.a[2], f1.a[3], f1.c[0], f1.c[1]);
      load_x<TWO, DUAL>(f1, g0, u0, x0, xrs, min(k + 48, UC - 16));
    }
  }
}
__device__ __forceinline__ void chain_xa(bool two, bool dual, uint32_t wg, uint32_t wu, uint32_t xg, int xrs,
                                         int segs, float* d, float* e) {
  if (two) {
    if (dual) chain_xa_t<true, true>(wg, wu, xg, xrs, segs, d, e);
    else chain_xa_t<true, false>(wg, wu, xg, xrs, segs, d, e);
  } else {
    if (dual) chain_xa_t<false, true>(wg, wu, xg, xrs, segs, d, e);
    else chain_xa_t<false, false>(wg, wu, xg, xrs, segs, d, e);
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

// Outside the anonymous namespace: nvcc 13 does not register a kernel of internal linkage that no
// <<<>>> launch names, and cudaLaunchCooperativeKernel on its stub fails (error 400).
__global__ void __launch_bounds__(THREADS, 1) products_engine_kernel(const __grid_constant__ Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[NU], empty[NU];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  unsigned char* ring = smem + (P.smem - NU * UNIT);  // the staged inputs below it
  if (threadIdx.x == 0) {
    for (int u = 0; u < NU; ++u) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + u)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(empty + u)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == WARPS) {  // the producer warp: lane 0 issues every row's copy
    if (P.mode == 4 || P.mode == 5 || lane != 0) return;
    uint32_t seq = 0;   // this block's unit sequence number
    // weights are read once a pass: evict them from L2 first, so that the activations stay
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int pi = 0; pi < P.np; ++pi) {
      const Product& q = P.p[pi];
      if (q.kind) continue;  // a row phase: no weights
      const int T = ntasks(q, P.xa), S = q.K / q.piece;
      // producer trace: when this product's first and last unit were issued, and how long the
      // producer waited for free units meanwhile (globaltimer ns)
      unsigned long long* pt = P.ptrace ? P.ptrace + ((size_t)b * P.np + pi) * 3 : nullptr;
      if (pt) pt[0] = 0, pt[2] = 0;
      for (int task = b; task < T; task += G) {
        const int tile = task / S, s = task % S;
        for (int half = 0; half < (q.w2 ? 2 : 1); ++half) {
          const __half* w = half ? q.w2 : q.w;
          // a unit: 16 rows x 512 columns (xa: 8 rows x 1,024 columns, the second 512 in rows 8-15)
          const int nu = P.xa ? 1 : q.piece / UC, rows = P.xa ? 8 : 16, segs = P.xa ? q.piece / UC : 1;
          for (int kc = 0; kc < nu; ++kc, ++seq) {
            const int u = seq % NU;
            const unsigned long long w0 = pt ? gtime() : 0;
            if (seq >= (uint32_t)NU && !mbar_wait(smem_u32(empty + u), ((seq / NU) - 1) & 1u, P)) asm volatile("trap;");
            if (pt) {
              const unsigned long long now = gtime();
              pt[2] += now - w0;
              if (pt[0] == 0) pt[0] = now;
              pt[1] = now;
              if (P.utrace && seq < UTR) P.utrace[((size_t)b * UTR + seq) * 3] = now;
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + u)),
                         "r"((uint32_t)(rows * segs * UC * 2)) : "memory");
            if (P.tiled) {  // the unit is 16 KB in a row of the tiled copy: one bulk copy
              const size_t unit = ((size_t)tile * (q.K / UC) + (size_t)s * (q.piece / UC) + kc) * (16 * UC);
              asm volatile(
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
                  "[%3], %4;" ::"r"(smem_u32(ring + (size_t)u * UNIT)),
                  "l"(w + unit), "r"((uint32_t)(16 * UC * 2)), "r"(smem_u32(full + u)), "l"(policy)
                  : "memory");
              continue;
            }
            for (int sg = 0; sg < segs; ++sg)
              for (int r = 0; r < rows; ++r) {
                const __half* src = w + (size_t)(rows * tile + r) * q.K + (size_t)s * q.piece + (size_t)(kc + sg) * UC;
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
                    "[%3], %4;" ::"r"(smem_u32(ring + (size_t)u * UNIT + (r + 8 * sg) * URS)),
                    "l"(src), "r"((uint32_t)(UC * 2)), "r"(smem_u32(full + u)), "l"(policy)
                    : "memory");
              }
          }
        }
      }
    }
    return;
  }

  // consumers: the block's tasks of each product in turn, warp j % WARPS takes the j-th. At a
  // product's start they stage the inputs' columns of the block's pieces in shared memory (rows
  // 0..R-1, R = 8 or 16, rows >= M zero; a row's stride padded by 16 bytes: the chains' fragment
  // reads are conflict-free); the chains read them there.
  __shared__ int s_ok;
  unsigned epoch = 0;
  uint32_t seq = 0;
  const int tid = threadIdx.x, R = P.M > 8 ? 16 : 8;
  if (P.mode == 7) {  // timing only: one lane takes every unit in order and releases it at once
    if (tid != 0) return;
    if (P.t0s) P.t0s[(size_t)b * (P.np + 1)] = gtime();
    uint32_t total = 0;
    for (int pi = 0; pi < P.np; ++pi)
      for (int task = b; task < ntasks(P.p[pi], P.xa); task += G) total += units_of(P.p[pi], P.xa);
    for (uint32_t n = 0; n < total; ++n) {
      if (!mbar_wait(smem_u32(full + n % NU), (n / NU) & 1u, P)) asm volatile("trap;");
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + n % NU)) : "memory");
    }
    if (P.t0s) P.t0s[(size_t)b * (P.np + 1) + P.np] = gtime();
    return;
  }
  const uint32_t xs = smem_u32(smem);
  for (int pi = 0; pi < P.np; ++pi) {
    const Product& q = P.p[pi];
    if (q.kind) {  // a row phase: program p on warp group (p / G) % (WARPS / warps) of block p % G
      if (P.t0s && tid == 0) P.t0s[(size_t)b * (P.np + 1) + pi] = gtime();
#ifdef ROW_PHASES
      const int nw = q.warps, ppb = WARPS / nw, grp = warp / nw, nprog = q.gx * q.gy;
      for (int p = b + G * grp; p < nprog; p += G * ppb)
        row_call(q.kind, q.args, q.uargs, (unsigned)(p % q.gx), (unsigned)(p / q.gx), (unsigned)(tid - grp * nw * 32),
                 xs + (uint32_t)(grp * q.smem_per), 2u + (unsigned)grp);
#else
      asm volatile("trap;");  // (a build without row phases)
#endif
      if (!grid_sync(P, epoch, &s_ok)) asm volatile("trap;");
      continue;
    }
    const int T = ntasks(q, P.xa), S = q.K / q.piece, upt = units_of(q, P.xa), per = q.piece / UC;
    const int xrs = q.piece * 2 + 16;
    // the product's fields read once into registers: indexed by a run-time pi they are indexed
    // constant loads (LDC c[R + ofs]), which the compiler otherwise repeats after every volatile asm
    const int qN = q.N;
    const bool dual = q.w2 != nullptr;
    const float qscale = q.scale;
    void* const qout = q.out;
    const unsigned flag = P.flag_base | (pi + 1);  // (LL) the flag of this product's input words
    unsigned long long tstart = 0;
    unsigned* tr = P.trace ? P.trace + ((size_t)b * P.np + pi) * TR : nullptr;
    if (tr || (P.t0s && tid == 0)) {  // (the timer read only where a trace or the span needs it)
      tstart = gtime();
      if (P.t0s && tid == 0) P.t0s[(size_t)b * (P.np + 1) + pi] = tstart;
    }
    int slot_of[8], ns = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) slot_of[i] = -1;
    // the block's tasks b, b + G, ... as (tile, piece) pairs kept by additions, not a division each
    // (G = gq S + gr); integer division was most of the consumers' path (session 38)
    const int gq = G / S, gr = G - gq * S, t_b = b / S, s_b = b - t_b * S;
    for (int task = b, sp = s_b; task < T; task += G) {
      if (slot_of[sp] < 0) slot_of[sp] = ns++;
      sp += gr;
      if (sp >= S) sp -= S;
    }
    if (ns * R * xrs > P.smem - NU * UNIT) asm volatile("trap;");  // (the host sizes the ring for this)
    // LL: this block's share of the next product's input words (as if its outputs made them),
    // loaded before the staging (whose polls hide the load's latency: loaded after it, the value's
    // first use stalled the warps ~0.4 µs before their tasks), published once its chains are done
    unsigned mine = 0;  // (loaded unconditionally, so that no move waits for the load)
    int mine_at = -1;
    if (P.words && pi + 1 < P.np) {
      const Product& nq = P.p[pi + 1];
      const int nw = P.M * nq.K / 2, lo = b * nw / G, hi = (b + 1) * nw / G;  // (< 2^31: 132 x 24,576)
      mine_at = lo + tid < hi ? lo + tid : -1;
      mine = __ldcg(reinterpret_cast<const unsigned*>(nq.x) + (mine_at < 0 ? lo : mine_at));
      if (hi - lo > WARPS * 32) asm volatile("trap;");
    }
    const bool nochain = P.mode == 3;  // copies alone
    if (!nochain && P.mode != 4) {
      const int cpr = q.piece / 8, lc = __ffs(cpr) - 1;  // 16-byte chunks a row (a power of two)
      for (int sp = 0; sp < S; ++sp) {
        if (slot_of[sp] < 0) continue;
        unsigned char* dst = smem + (size_t)slot_of[sp] * R * xrs;
        for (int i = tid; i < R * cpr; i += WARPS * 32) {
          const int r = i >> lc, c = i & (cpr - 1);
          uint4 v = make_uint4(0, 0, 0, 0);
          if (r < P.M && P.words && pi > 0) {  // LL: poll the 4 words of these 8 values until they carry the flag
            const unsigned long long* w = P.words + (size_t)pi * WORDS + ((size_t)r * q.K + (size_t)sp * q.piece) / 2 + 4 * c;
            unsigned long long a0, a1, a2, a3;
            for (uint32_t round = 0;; ++round) {
              asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a0), "=l"(a1) : "l"(w) : "memory");
              asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a2), "=l"(a3) : "l"(w + 2) : "memory");
              if ((unsigned)(a0 >> 32) == flag && (unsigned)(a1 >> 32) == flag && (unsigned)(a2 >> 32) == flag &&
                  (unsigned)(a3 >> 32) == flag)
                break;
              if ((round & 63u) == 63u && *reinterpret_cast<volatile unsigned*>(P.sync + 2) != 0) asm volatile("trap;");
              if (round > (1u << 26)) { atomicCAS(P.sync + 2, 0u, 3u); asm volatile("trap;"); }
              if (P.poll_ns) __nanosleep(P.poll_ns);  // less L2 traffic while the words are not there
            }
            v = make_uint4((unsigned)a0, (unsigned)a1, (unsigned)a2, (unsigned)a3);
          } else if (r < P.M) {
            v = __ldcg(reinterpret_cast<const uint4*>(q.x + (size_t)r * q.K + (size_t)sp * q.piece) + c);
          }
          *reinterpret_cast<uint4*>(dst + (size_t)r * xrs + 16 * c) = v;
        }
      }
      asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
    }
    if (tr && tid == 0) tr[0] = (unsigned)(gtime() - tstart);
    int j = 0, tile = t_b - gq, s = s_b - gr;  // (the loop's first step makes them task b's)
    for (int task = b; task < T; task += G, ++j, seq += upt) {
      tile += gq, s += gr;
      if (s >= S) s -= S, tile += 1;
      if (j % WARPS != warp) continue;
      if (P.mode == 4) continue;
      if (tr && lane == 0) tr[2 + 3 * WARPS + warp] = (unsigned)(gtime() - tstart);
      bool ok = true;
      for (int i = 0; i < upt && P.mode != 5; ++i) {
        const uint32_t n = seq + i;
        unsigned long long* ut = P.utrace && lane == 0 && n < UTR ? P.utrace + ((size_t)b * UTR + n) * 3 : nullptr;
        if (ut) ut[1] = gtime();
        ok = ok && mbar_wait(smem_u32(full + n % NU), (n / NU) & 1u, P);
        if (ut) ut[2] = gtime();
      }
      if (!ok) asm volatile("trap;");  // a lost copy or another block's error: end the launch
      if (tr && lane == 0) tr[2 + 2 * warp] = (unsigned)(gtime() - tstart);
      const long long c0 = clock64();
      float d[2][4] = {}, e[2][4] = {};
      const int g = lane >> 2, t = lane & 3;
      // this lane's ldmatrix row (lanes 0-7 rows 0-7, 8-15 rows 8-15, again for columns + 8)
      const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
      const uint32_t lofs = P.tiled ? (uint32_t)(lrow * UC * 2) : (uint32_t)(lrow * URS + ((lane >> 4) ? 16 : 0));
      const int sw = P.tiled ? (lrow & 7) | ((lane >> 4) << 3) : -1;
      const uint32_t xa = xs + (uint32_t)(slot_of[s] * R * xrs + g * xrs + 4 * t);
      const bool early = P.mode != 5 && !P.xa;  // release each unit but the last once the chain has passed it
      if (P.xa) {
        const uint32_t wg = smem_u32(ring + (size_t)(seq % NU) * UNIT) + g * URS + 4 * t;
        const uint32_t wu = smem_u32(ring + (size_t)((seq + 1) % NU) * UNIT) + g * URS + 4 * t;
        if (!nochain) chain_xa(R == 16, dual, wg, dual ? wu : 0u, xa, xrs, per, d[0], e[0]);
      } else {
        // unit h of the gate tile: seq + h; of the up tile: seq + per + h
        auto unit = [&](int n) { return smem_u32(ring + (size_t)((seq + n) % NU) * UNIT) + lofs; };
        const uint32_t rel0 = early && per == 2 ? smem_u32(empty + seq % NU) : 0u;
        const uint32_t rel20 = early && per == 2 && dual ? smem_u32(empty + (seq + per) % NU) : 0u;
        if (!nochain)
          chain(R == 16, dual, unit(0), unit(per - 1), unit(per), unit(2 * per - 1), xa, xrs, per, d, e,
                rel0, rel20, sw);
      }
      __syncwarp();
      if (tr && lane == 0) {
        tr[3 + 2 * warp] = (unsigned)(gtime() - tstart);
        tr[2 + 2 * WARPS + warp] = (unsigned)(clock64() - c0);
      }
      if (lane == 0 && P.mode != 5)
        for (int i = 0; i < upt; ++i) {
          if (early && !nochain && per == 2 && !(i & 1)) continue;  // released by the chain (per: 1 or 2)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + (seq + i) % NU)) : "memory");
        }
#pragma unroll
      for (int it = 0; it < 2; ++it)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          int n, m;
          if (P.xa) {  // d[0][jj]: input row g + 8 (jj >> 1), weight row 8 tile + 2t + (jj & 1)
            if (it) continue;
            n = 8 * tile + 2 * t + (jj & 1), m = g + 8 * (jj >> 1);
          } else {
            n = 16 * tile + g + (jj >= 2 ? 8 : 0), m = 8 * it + 2 * t + (jj & 1);
          }
          if (m >= P.M) continue;
          if (dual) {
            float ex;
            asm("ex2.approx.f32 %0, %1;" : "=f"(ex) : "f"(__fmul_rn(__fsub_rn(0.f, d[it][jj]), __int_as_float(0x3FB8AA3B))));
            const float h = __fmul_rn(e[it][jj], div_full(d[it][jj], __fadd_rn(ex, 1.0f)));
            static_cast<__half*>(qout)[m * qN + n] = __float2half_rn(__fmul_rn(h, qscale));
          } else {
            static_cast<float*>(qout)[(s * P.M + m) * qN + n] = __fmul_rn(d[it][jj], qscale);  // (exact)
          }
        }
      if (tr && lane == 0) tr[2 + 4 * WARPS + warp] = (unsigned)(gtime() - tstart);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
    if (P.words) {  // LL: no grid barrier, the next product's input words carry its flag
      if (mine_at >= 0) {
        const unsigned long long w = ((unsigned long long)(P.flag_base | (pi + 2)) << 32) | (unsigned long long)mine;
        asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(P.words + (size_t)(pi + 1) * WORDS + mine_at), "l"(w)
                     : "memory");
      }
      if (tr && tid == 0) tr[1] = (unsigned)(gtime() - tstart);
      continue;
    }
    if (tr && tid == 0) tr[1] = (unsigned)(gtime() - tstart);
    if (!grid_sync(P, epoch, &s_ok)) asm volatile("trap;");  // (the error word says which wait gave up)
  }
  if (P.t0s && tid == 0) P.t0s[(size_t)b * (P.np + 1) + P.np] = gtime();
}

// products: np entries of (w, w2, x, out, N, K, piece, scale) laid out as the Product struct.
// products: np entries of (w, w2, x, out, N, K, piece, scale) laid out as the Product struct.
// Returns a CUDA error, or -1 for arguments out of range, -2 when the staged inputs leave no ring.
extern "C" int products_engine_run(const void* products, int np, int M, unsigned* sync, int blocks,
                                   unsigned long long timeout_ns, int mode, int xa, int tiled,
                                   unsigned long long* words,
                                   unsigned flag_base, unsigned* trace, unsigned long long* t0s,
                                   unsigned long long* ptrace, unsigned long long* utrace, unsigned poll_ns,
                                   void* stream) {
  if (np > MAXP || np < 0 || M < 1 || M > 16) return -1;
  Params P;
  memcpy(P.p, products, sizeof(Product) * np);
  P.np = np;
  P.M = M;
  P.sync = sync;
  P.timeout_ns = timeout_ns;
  P.mode = mode;
  P.xa = xa;
  P.tiled = tiled;
  if (tiled && xa) return -1;
  P.words = words;
  P.flag_base = flag_base;
  P.trace = trace;
  P.t0s = t0s;
  P.ptrace = ptrace;
  P.utrace = utrace;
  P.poll_ns = poll_ns;
  // the staged inputs: the most any block needs (its distinct pieces x R rows), the ring the rest
  int xbytes = 0;
  const int R = M > 8 ? 16 : 8;
  for (int pi = 0; pi < np; ++pi) {
    const Product& q = P.p[pi];
    if (q.kind) {  // a row phase: its programs' shared memory in the staging area
      if (q.warps < 1 || WARPS % q.warps || q.gx < 1 || q.gy < 1) return -1;
      xbytes = std::max(xbytes, (WARPS / q.warps) * q.smem_per);
#ifndef ROW_PHASES
      return -1;
#endif
      continue;
    }
    if (q.piece % UC != 0 || q.piece > 2 * UC || q.K / q.piece > 8) return -1;
    const int T = ntasks(q, xa), S = q.K / q.piece;
    for (int b = 0; b < blocks; ++b) {
      unsigned seen = 0;
      for (int task = b; task < T; task += blocks) seen |= 1u << (task % S);
      xbytes = std::max(xbytes, __builtin_popcount(seen) * R * (q.piece * 2 + 16));
    }
  }
  int dev = 0, optin = 0;
  cudaFuncAttributes fa;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, products_engine_kernel);
  if (e != cudaSuccess) return -(int)e;
  P.smem = ((optin - (int)fa.sharedSizeBytes) / 128) * 128;
  if (((xbytes + 127) / 128) * 128 + NU * UNIT > P.smem) return -2;
  e = cudaFuncSetAttribute(products_engine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, P.smem);
  if (e != cudaSuccess) return -(int)e;
  void* args[] = {&P};
  e = cudaLaunchCooperativeKernel((const void*)products_engine_kernel, blocks, THREADS, args, P.smem,
                                  (cudaStream_t)stream);
  return e == cudaSuccess ? NU : -(int)e;
}

extern "C" int products_engine_sizeof() { return (int)sizeof(Product); }
extern "C" const char* products_engine_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }
