// Block-level bf16 matrix x vector for T tokens: the block's rows of W (staged in shared memory
// by the producer warpgroup, ops/producer.cuh) times smem activations.
#pragma once
#include "common.cuh"

namespace qmk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Weight staging: slots filled by the producer warpgroup (ops/producer.cuh) ----------------
// Every phase's weight slice is copied into shared memory by the block's producer thread (bulk
// copies, a few KB in flight at a time) in the order the phases consume them; the compute threads
// wait for a slot's "full" mbarrier, multiply, and release the slot on its "empty" mbarrier.
// Slots: X (q|k|v, gate|up, heads), Y (o_proj, down).
enum { SLOT_X = 0, SLOT_Y = 1, NSLOTS = 2 };

__device__ __forceinline__ bool mbar_try_wait(uint32_t a, uint32_t parity) {
  uint32_t ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok)
               : "r"(a), "r"(parity)
               : "memory");
  return ok != 0;
}

struct Stage {
  uint4* slot[NSLOTS];  // dynamic smem
  uint64_t* mbar;       // smem [NSLOTS] "full": the producer's arrival + the slice's bytes per use
  uint64_t* empty;      // smem [NSLOTS]: every compute thread arrives once the slot is consumed
  uint32_t parity;      // bit s: parity of mbar[s]'s next completion (same in every thread)
  uint32_t* sync;       // the instance's sync words (the bounded wait's error word)
  uint64_t timeout_ns;

  // Every thread of the launch (producers included) passes its __syncthreads.
  __device__ void init() {
    if (threadIdx.x == 0)
      for (int s = 0; s < NSLOTS; ++s) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(mbar + s)) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(empty + s)), "r"(NT)
                     : "memory");
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    parity = 0;
  }

  // Every thread: wait until slot s's slice has landed. Bounded (Spin): on a timeout or another
  // block's error it returns anyway; the phase then computes on whatever the slot holds, and the
  // next grid wait or poll sees the error and leaves.
  __device__ __forceinline__ void wait(int s) {
    const uint32_t par = (parity >> s) & 1u;
    const uint32_t a = smem_u32(mbar + s);
    Spin<1023u> spin;
    while (!mbar_try_wait(a, par) && !spin.give_up(sync, timeout_ns)) {
    }
    parity ^= 1u << s;
  }
  // Every compute thread, once done reading slot s (each arrives for its own reads: the producer's
  // wait then orders all of them before its copies; thread 0 alone after the block barrier
  // measured the same, but compute-sanitizer's racecheck does not follow that chain): the
  // producer may refill it. A phase that ends at a grid barrier releases its slot after the barrier arrive, so
  // that the producer's next piece is not yet in flight when the arrive's release fence runs (the
  // fence waits for the SM's bulk copies): H100, same call, frame 1750-1766 us vs 1827-1835 with
  // the release right after the matvec, talker step 507-512 vs 525-543.
  __device__ __forceinline__ void release(int s) const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(empty + s)) : "memory");
  }
};

// ---- Tensor-core matrix x vector (mma.sync m16n8k16, bf16 in, fp32 accumulate) ----------------
// Rows go in groups of 4 and columns in chunks of 64. One mma multiplies a 4-row x 64-column
// weight block by the activations: its 16 A rows are (quarter hf of the chunk, row r) and its 8 B
// columns (quarter hf, part p), so the products with hf(A row) == hf(B column) are the wanted
// ones and the others are discarded (the 16 x 8 product is free; the bytes are not).
//
// Activations are fp32. They enter as two bf16 parts, hi = bf16(x) and lo = bf16(x - hi)
// (16 significant bits, |x - hi - lo| <= 2^-17 |x|); bf16 x bf16 products are exact in fp32 and
// accumulate in fp32. In bf16-exact mode the activations are bf16 already, so lo = 0 and the
// product is exact.
//
// Weights (host side, megakernel.py mma_layout): each 4-row group is stored chunk by chunk, 512
// bytes per chunk, lane l's 16 bytes being its A fragment: with g = l / 4 = 4q + r and tq = l % 4,
// rows r, columns 64c + 16q + 4tq + {0,1}, 64c + 32 + 16q + 4tq + {0,1}, then + {2,3} of both.
// A block's slice of whole 4-row groups stays one contiguous range (one bulk copy).
//
// Activations (split_store): per token, chunk c is 128 bf16 (32 lanes x 4): lane l = 4(2hf + p) + tq
// holds part p of x[64c + 16hf + 4tq + 0..3], its B fragment. Same bytes as the fp32 vector, so
// the split can overwrite it in place.

// Most rows of an n-row matrix a block owns (whole 4-row groups, grids of >= QMK_MIN_BLOCKS).
constexpr int rows4_max(int n, int blocks = QMK_MIN_BLOCKS) { return 4 * ((n / 4 + blocks - 1) / blocks); }

__device__ __forceinline__ uint32_t pack_bf2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // a in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Dims d .. d + 3 (d % 4 == 0) of one token's activations, split into hi / lo parts, into the
// B-fragment layout at xsp (that token's row).
__device__ __forceinline__ void split_store(uint2* xsp, int d, const float4 v) {
  const float h0 = rbf(v.x), h1 = rbf(v.y), h2 = rbf(v.z), h3 = rbf(v.w);
  const int c = d >> 6, hf = (d >> 4) & 3, tq = (d >> 2) & 3;
  uint2* p = xsp + c * 32 + 8 * hf + tq;
  p[0] = make_uint2(pack_bf2(h0, h1), pack_bf2(h2, h3));
  p[4] = make_uint2(pack_bf2(v.x - h0, v.y - h1), pack_bf2(v.z - h2, v.w - h3));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint4 a, const uint2 b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}

// Warps along K per product (0: min(K/64, NW)). Row groups per block (G = 132): q|k|v 7-8,
// gate|up 10-12, o_proj partial 15-16, heads 3-6, down 1-2. Whole rows per
// warp (KW = 1) where there are about as many groups as warps: 65 us per frame faster (H100,
// same call) than splitting K over all 8 warps there.
constexpr int KW_QKV = 1;   // q|k|v
constexpr int KW_GU = 1;    // gate|up
constexpr int KW_CPO = 1;   // the o_proj partial (attention + o_proj phase)
constexpr int KW_HEAD = 2;  // the heads
constexpr int KW_DOWN = 0;  // down (K = 3072, 1-2 row groups)

// Per-warp partial sums of the tensor-core matvec: [NW][RED_ROWS][MAX_T] fp32 (shared memory).
constexpr int RED_ROWS = 2 * rows4_max(QMK_I) > rows4_max(QMK_H, QMK_MIN_BLOCKS / QMK_NKV)
                             ? 2 * rows4_max(QMK_I) : rows4_max(QMK_H, QMK_MIN_BLOCKS / QMK_NKV);
constexpr int RED_FLOATS = NW * RED_ROWS * QMK_MAX_T;

// out_s[r * T + t] = dot(row r, x[t]) in fp32 for the block's nrows rows (a multiple of 4) staged
// in `stage` (mma layout, K columns); xsp: the split activations, token rows XS uint2 apart.
// KW warps split the K/64 chunks and NW / KW split the row groups (KW_ = 0: KW = min(K/64, NW));
// each keeps its chunks' activation fragments in registers, runs the mma over its row groups and
// folds each row's useful products with two shuffles; with KW > 1 the per-warp sums are added in
// a fixed order (shared memory, one more block barrier). Results are bitwise reproducible. The
// caller has waited for the slot. Ends with bsync() (the slot may be refilled after it).
template <int T, int K, int XS, int KW_ = 0>
__device__ __forceinline__ void mv_mma(int nrows, const uint4* stage, const uint2* xsp, float* out_s, float* red) {
  constexpr int NC = K / 64;
  constexpr int KW = KW_ ? KW_ : NC < NW ? NC : NW;
  constexpr int GW = NW / KW;
  constexpr int CPW = NC / KW;
  static_assert(K % 64 == 0 && NC % KW == 0 && NW % KW == 0, "K: whole chunks per warp");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kw = warp % KW, gw = warp / KW, c0 = kw * CPW;
  uint2 xb[T][CPW];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int j = 0; j < CPW; ++j) xb[t][j] = xsp[t * XS + (c0 + j) * 32 + lane];
  const int q = lane >> 4, tq = lane & 3;
  const int ng = nrows >> 2;
#pragma unroll 2
  for (int gi = gw; gi < ng; gi += GW) {
    float acc[T][4];
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    const uint4* wp = stage + ((size_t)gi * NC + c0) * 32 + lane;
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
      const uint4 w = wp[j * 32];
#pragma unroll
      for (int t = 0; t < T; ++t) mma_bf16(acc[t], w, xb[t][j]);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      // lane (g = 4q + r, tq): C rows g (quarter q) and g + 8 (quarter q + 2), columns 2tq, 2tq + 1
      // (quarter tq, parts hi / lo). Row r = the four quarters, in lanes 4r, 4r + 2, 4r + 17, 4r + 19.
      float v = tq == q ? acc[t][0] + acc[t][1] : tq == q + 2 ? acc[t][2] + acc[t][3] : 0.f;
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      v += __shfl_xor_sync(0xffffffffu, v, 17);
      if ((lane & 0x13) == 0) {
        if (KW == 1) out_s[(gi * 4 + (lane >> 2)) * T + t] = v;
        else red[(kw * RED_ROWS + gi * 4 + (lane >> 2)) * T + t] = v;
      }
    }
  }
  bsync();
  if (KW == 1) return;
  for (int idx = threadIdx.x; idx < nrows * T; idx += NT) {
    float s = red[idx];
#pragma unroll
    for (int k = 1; k < KW; ++k) s += red[k * RED_ROWS * T + idx];
    out_s[idx] = s;
  }
  bsync();
}

}  // namespace qmk
