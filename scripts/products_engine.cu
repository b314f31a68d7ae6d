// For scripts/gpu_products_engine.py (issue 16's small-batch kernel, its first question): how fast
// can a persistent kernel run the decode frame's fp16 products for a few rows when a producer warp
// streams every block's weight tiles into shared memory ahead of the consumers, across the grid
// barriers between dependent products, and each product keeps the Triton graphs' bits (one
// mma.sync chain per 16-column step of a K piece, from zero: scripts/gpu_dot_bits.py).
//
// The launch runs a list of products in order, a grid barrier after each (the frame's products
// depend on their predecessors). A product is N x K fp16 weights in pieces of `piece` columns, times
// M <= 16 fp16 input rows (two 8-row mma tiles), out: the pieces as fp32 parts [S][M][N] (q|k|v,
// o_proj, down) or, `swiglu`, gate rows 0..N-1 and up rows of `w2` into fp16 silu(g) * u * scale
// (the SwiGLU epilogue of tk_gemm's PTX: ex2.approx, div.full). A task is 16 weight rows x one piece
// (gate and up rows together for swiglu); task t goes to block t % G, whose 8 consumer warps take its
// tasks in turn. The producer warp copies each of its block's tasks, in the order the consumers take
// them, into a ring of shared-memory units (cp.async.bulk, one row a copy, rows padded by 16 bytes:
// ldmatrix without bank conflicts), waiting only for a unit to be released, never for the barrier.
// Written in session 37; not yet run on a GPU.
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr int WARPS = 8;                  // consumer warps a block
constexpr int THREADS = (WARPS + 1) * 32;  // + the producer warp
constexpr int UNIT = 16384 + 512;          // a ring unit: 16 KB of weights + row padding
constexpr int NUNITS = 12;
constexpr int MAXP = 64;                   // products a launch

struct Product {
  const __half* w;   // [N][K]
  const __half* w2;  // swiglu: up rows [N][K]; else null
  const __half* x;   // [M][K]
  void* out;         // fp32 parts [S][M][N], or fp16 [M][N] (swiglu)
  int N, K, piece;
  float scale;       // swiglu: the output's power-of-two scale
};

struct Params {
  Product p[MAXP];
  int np, M;
  unsigned* sync;    // [0] barrier count, [1] barrier generation, [2] error
  unsigned long long timeout_ns;
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

// The tasks of product p, and how many ring units one takes (8 rows of 1,024 columns or 16 of 512
// per unit; gate and up rows each).
__device__ __forceinline__ int ntasks(const Product& q) { return (q.N / 16) * (q.K / q.piece); }
__device__ __forceinline__ int rows_per_unit(const Product& q) { return q.piece >= 1024 ? 8 : 16; }
__device__ __forceinline__ int units_of(const Product& q) { return (16 / rows_per_unit(q)) * (q.w2 ? 2 : 1); }
__device__ __forceinline__ int row_stride(const Product& q) { return q.piece * 2 + 16; }

// Grid barrier of the consumer warps (named barrier 1, 256 threads): release, count, acquire.
__device__ bool grid_sync(const Params& P, unsigned& gen) {
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
  bool ok = true;
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned target = gen + 1;
    if (atomicAdd(P.sync, 1u) == gridDim.x - 1) {
      atomicExch(P.sync, 0u);
      __threadfence();
      atomicExch(P.sync + 1, target);
    } else {
      unsigned long long t0 = 0;
      for (uint32_t i = 0; *reinterpret_cast<volatile unsigned*>(P.sync + 1) != target; ++i) {
        if ((i & 255u) == 255u) {
          if (*reinterpret_cast<volatile unsigned*>(P.sync + 2) != 0) { ok = false; break; }
          const unsigned long long now = gtime();
          if (t0 == 0) t0 = now;
          else if (now - t0 > P.timeout_ns) { atomicCAS(P.sync + 2, 0u, 2u); ok = false; break; }
        }
      }
    }
    __threadfence();
  }
  gen += 1;
  asm volatile("bar.sync 1, %0;" ::"r"(WARPS * 32) : "memory");
  return ok && *reinterpret_cast<volatile unsigned*>(P.sync + 2) == 0;
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

// One 16-row weight tile (rows at `tile` in shared memory, row stride rs bytes, rows 0-7 and 8-15
// possibly in different units: r8 is row 8's address) times the inputs' columns [k0, k0 + piece):
// d[t] for input tile t (rows 8t..8t+7), one chain each, k order. The inputs' fragments come from
// global memory (L2) a group of GRP steps ahead of the chain that uses them, so that the chain
// waits for the tensor core, not for L2.
constexpr int GRP = 8;

template <bool TWO>
__device__ __forceinline__ void load_group(uint32_t (&b)[GRP][2][2], const __half* xa, const __half* xb, bool ra,
                                           bool rb, int k) {
#pragma unroll
  for (int i = 0; i < GRP; ++i) {
    const int kk = k + 16 * i;
    b[i][0][0] = ra ? *reinterpret_cast<const uint32_t*>(xa + kk) : 0u;
    b[i][0][1] = ra ? *reinterpret_cast<const uint32_t*>(xa + kk + 8) : 0u;
    if (TWO) {
      b[i][1][0] = rb ? *reinterpret_cast<const uint32_t*>(xb + kk) : 0u;
      b[i][1][1] = rb ? *reinterpret_cast<const uint32_t*>(xb + kk + 8) : 0u;
    }
  }
}

template <bool TWO>
__device__ __forceinline__ void chain_t(uint32_t r0, uint32_t r8, int rs, const __half* x, int K, int M, int k0,
                                        int piece, float (*d)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // ldmatrix x4: lanes 0-7 rows 0-7 at k, 8-15 rows 8-15 at k, 16-23 rows 0-7 at k + 8, 24-31 rows 8-15 at k + 8
  const uint32_t base = ((lane >> 3) & 1 ? r8 : r0) + (lane & 7) * rs + ((lane >> 4) ? 16u : 0u);
  const __half* xa = x + (size_t)g * K + k0 + 2 * t;       // input row g (tile 0)
  const __half* xb = x + (size_t)(g + 8) * K + k0 + 2 * t;  // input row g + 8 (tile 1)
  const bool ra = g < M, rb = g + 8 < M;
  uint32_t cur[GRP][2][2], nxt[GRP][2][2];
  load_group<TWO>(cur, xa, xb, ra, rb, 0);
  for (int k = 0; k < piece; k += 16 * GRP) {
    if (k + 16 * GRP < piece) load_group<TWO>(nxt, xa, xb, ra, rb, k + 16 * GRP);
#pragma unroll
    for (int i = 0; i < GRP; ++i) {
      uint32_t a0, a1, a2, a3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(base + 2 * (k + 16 * i)));
      mma(d[0], a0, a1, a2, a3, cur[i][0][0], cur[i][0][1]);
      if (TWO) mma(d[1], a0, a1, a2, a3, cur[i][1][0], cur[i][1][1]);
    }
#pragma unroll
    for (int i = 0; i < GRP; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) cur[i][j][0] = nxt[i][j][0], cur[i][j][1] = nxt[i][j][1];
  }
}

__device__ __forceinline__ void chain(uint32_t r0, uint32_t r8, int rs, const __half* x, int K, int M, int k0,
                                      int piece, float (*d)[4]) {
  if (M > 8) chain_t<true>(r0, r8, rs, x, K, M, k0, piece, d);
  else chain_t<false>(r0, r8, rs, x, K, M, k0, piece, d);
}

__global__ void __launch_bounds__(THREADS, 1) products(const __grid_constant__ Params P) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[NUNITS], empty[NUNITS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int G = gridDim.x, b = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int u = 0; u < NUNITS; ++u) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(full + u)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(empty + u)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == WARPS) {  // the producer: lane 0 issues every copy
    if (lane != 0) return;
    uint32_t seq = 0;   // this block's unit sequence number
    for (int pi = 0; pi < P.np; ++pi) {
      const Product& q = P.p[pi];
      const int T = ntasks(q), S = q.K / q.piece, rpu = rows_per_unit(q), rs = row_stride(q);
      for (int task = b; task < T; task += G) {
        const int tile = task / S, s = task % S;
        for (int half = 0; half < (q.w2 ? 2 : 1); ++half) {
          const __half* w = half ? q.w2 : q.w;
          for (int r0 = 0; r0 < 16; r0 += rpu, ++seq) {
            const int u = seq % NUNITS;
            if (seq >= NUNITS && !mbar_wait(smem_u32(empty + u), ((seq / NUNITS) - 1) & 1u, P)) asm volatile("trap;");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            const uint32_t bytes = (uint32_t)(rpu * q.piece * 2);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(full + u)), "r"(bytes)
                         : "memory");
            for (int r = 0; r < rpu; ++r) {
              const __half* src = w + (size_t)(16 * tile + r0 + r) * q.K + (size_t)s * q.piece;
              asm volatile(
                  "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                      smem_u32(smem + (size_t)u * UNIT + r * rs)),
                  "l"(src), "r"((uint32_t)(q.piece * 2)), "r"(smem_u32(full + u))
                  : "memory");
            }
          }
        }
      }
    }
    return;
  }

  // consumers: the block's tasks of each product in turn, warp j % WARPS takes the j-th
  unsigned gen = 0;
  uint32_t seq = 0;
  for (int pi = 0; pi < P.np; ++pi) {
    const Product& q = P.p[pi];
    const int T = ntasks(q), S = q.K / q.piece, rpu = rows_per_unit(q), rs = row_stride(q), upt = units_of(q);
    int j = 0;
    for (int task = b; task < T; task += G, ++j, seq += upt) {
      if (j % WARPS != warp) continue;
      const int tile = task / S, s = task % S;
      bool ok = true;
      for (int i = 0; i < upt; ++i) {
        const uint32_t n = seq + i;
        ok = ok && mbar_wait(smem_u32(full + n % NUNITS), (n / NUNITS) & 1u, P);
      }
      if (!ok) asm volatile("trap;");  // a lost copy or another block's error: end the launch
      float d[2][4] = {}, e[2][4] = {};
      const int per = 16 / rpu;  // units per 16 rows
      auto addr = [&](int half, int row) {  // shared address of row `row` (0..15) of gate (0) / up (1)
        const uint32_t n = seq + half * per + row / rpu;
        return smem_u32(smem + (size_t)(n % NUNITS) * UNIT + (row % rpu) * rs);
      };
      chain(addr(0, 0), addr(0, 8), rs, q.x, q.K, P.M, s * q.piece, q.piece, d);
      if (q.w2) chain(addr(1, 0), addr(1, 8), rs, q.x, q.K, P.M, s * q.piece, q.piece, e);
      __syncwarp();
      if (lane == 0)
        for (int i = 0; i < upt; ++i)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + (seq + i) % NUNITS)) : "memory");
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int it = 0; it < 2; ++it)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int n = 16 * tile + g + (jj >= 2 ? 8 : 0), m = 8 * it + 2 * t + (jj & 1);
          if (m >= P.M) continue;
          if (q.w2) {
            float ex;
            asm("ex2.approx.f32 %0, %1;" : "=f"(ex) : "f"(__fmul_rn(__fsub_rn(0.f, d[it][jj]), __int_as_float(0x3FB8AA3B))));
            const float h = __fmul_rn(e[it][jj], div_full(d[it][jj], __fadd_rn(ex, 1.0f)));
            static_cast<__half*>(q.out)[(size_t)m * q.N + n] = __float2half_rn(__fmul_rn(h, q.scale));
          } else {
            static_cast<float*>(q.out)[((size_t)s * P.M + m) * q.N + n] = d[it][jj];
          }
        }
    }
    if (!grid_sync(P, gen)) asm volatile("trap;");  // (the error word says which wait gave up)
  }
}

}  // namespace

// products: np entries of (w, w2, x, out, N, K, piece, scale) laid out as the Product struct.
extern "C" int products_engine_run(const void* products, int np, int M, unsigned* sync, int blocks,
                                   unsigned long long timeout_ns, void* stream) {
  if (np > MAXP || M < 1 || M > 16) return -1;
  Params P;
  memcpy(P.p, products, sizeof(Product) * np);
  P.np = np;
  P.M = M;
  P.sync = sync;
  P.timeout_ns = timeout_ns;
  const int smem = NUNITS * UNIT;
  cudaFuncSetAttribute(products, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  void* args[] = {&P};
  cudaError_t e = cudaLaunchCooperativeKernel((const void*)products, blocks, THREADS, args, smem,
                                              (cudaStream_t)stream);
  return (int)e;
}

extern "C" int products_engine_sizeof() { return (int)sizeof(Product); }
