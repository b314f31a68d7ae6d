// The code predictor's layers for a pass of one row at one position (passes 2..15 of a frame of
// one stream) in one persistent launch, with the Triton graphs' bits (issue 16's small-batch
// kernel; tts_server/engines/batched/small_kernel.py serves it, scripts/gpu_cp_layer_engine.py
// checks every phase bitwise and times it). No grid barrier: a layer is four dependent products,
// each one hop:
//   q|k|v   input: the residual + RMSNorm of the previous layer's down parts (layer 0: given rows,
//           or the RMSNorm of the residual as tk_gemm._rms_norm_kernel makes it: nrm0)
//   o_proj  input: the attention of the block's q heads over the q|k|v outputs
//   gate|up input: the residual + RMSNorm of the o_proj parts
//   down    input: gate|up's SwiGLU outputs (all of them: one block a 16-row tile, its six K pieces
//           on six warps, publishing their sum)
// Every product's outputs go out as LL words {32-bit payload, flag} (no fence, no barrier: a word
// carries its own flag, new for every product of every launch); the next product's staging polls
// exactly the words it needs. A launch's flags come from an epoch word in device memory (sync[1]),
// which the last block out advances, so that a CUDA graph replays the launch with new flags; when
// the epoch would wrap, that block zeroes the words first. The row work between products is done
// again by every block that needs it (its own inputs, nothing more to wait for): the RMSNorm with
// the Triton kernel's bits (common.cuh's twin of tk_glue._add_rms_kernel, the residual kept in each
// block's shared memory), the attention by attend_twin, tk_glue._cp_attend_kernel's arithmetic
// written out from its Triton 3.6 PTX, its inputs straight from the words and its cached K/V copied
// into shared memory while the words are on their way (session 39, H200: a layer at one row 24.2
// µs, a graph of the Triton launches 27.3; the kernel's own PTX as a device function took 29.0).
// Its K/V writes are identical from every block that makes them. The products: a producer warp
// streams tiled weight units (tile() in small_kernel.py) through a ring of NU, 7 consumer warps run
// each task as one mma.sync chain per K piece. Block 0 ends the launch with the last layer's
// residual + final norm (out_h).
// cp_layers_kernel<true> (session 45) runs the talker's layers of one row the same way (the same
// products and norms; small_kernel.TalkerKernel serves it): its attention over the paged bf16 pool
// is o_proj's staging, in two parts: each block first computes its (split, kv head) items of the
// row with csrc/attn's split math and the store kernel's q / k twin (the new K / V into the pool
// too), publishing each split's outputs and then a release flag; then it merges its piece's four
// heads over their splits once the flags are there. Block 0 ends the launch with the last down
// product and the residual it adds to (x_out, d_out): the final norm (fp32 out) stays a Triton launch.
#include <cuda_fp16.h>
#include <cstdint>
#include <algorithm>

#include "common.cuh"
#include "../attn/decode_split.cuh"  // the talker's split attention (namespace qda)

namespace {

constexpr int H = 1024, NH = 16, NKV = 8, HD = 128, QKV = 4096, QD = 2048, INTER = 3072;
constexpr int MAXL = 8;  // layers a launch (the code predictor's)
constexpr int TL = 28;   // layers a launch of the talker's (cp_layers_kernel<true>)
// One row: its RMSNorm is one 128-thread program (warps 0-3), its attention four warps (one a query
// head of the block's piece). Seven consumer warps and the producer make a 256-thread block, two
// warps on each of the SM's register quadrants: ptxas gives it ~250 registers a thread and spills
// nothing (session 41, H200: a layer 22.2 -> 19.2 µs; a 9-warp block, which two rows need, puts
// three warps on a quadrant, caps them at 168 registers and spilled; two rows were slower than
// the graphs anyway, session 40). A block has at most 3 tasks a product at one row.
constexpr int MAXM = 1;
constexpr int CW = 7;  // consumer warps (warp CW is the producer)
constexpr int BLOCK = (CW + 1) * 32;
// The down product: one block a 16-row tile (blocks G - DN_TILES ..), its six K pieces on warps 0-5,
// publishing their sum in add_rms's order (the same bits), so that the next RMSNorm polls one word
// an element (8 KB a block at one row) instead of six; gate|up's fp16 outputs go out two a word, so
// that a down block polls 12 KB (session 41, H200: a layer 19.0 -> 18.1 µs; with the parts summed
// but one fp16 a word, the down blocks' 24 KB staging made the down hop 2 µs later and cost what
// the norm gained)
constexpr int DN_TILES = H / 16, DN_PIECES = INTER / 512;
__device__ __forceinline__ int down_tile(int b, int G) { return b - (G - DN_TILES); }  // < 0: none
constexpr int R = 8;     // staged input rows (one 8-row mma tile)
enum { P_QKV = 0, P_O = 1, P_GU = 2, P_DN = 3, P_ATT = 4 };  // P_ATT: the talker's attention splits (flags only)

struct Shape {
  int N, K, piece;
};
__host__ __device__ __forceinline__ Shape shape_of(int p) {
  return p == P_QKV ? Shape{QKV, H, 1024} : p == P_O ? Shape{H, QD, 512} : p == P_GU ? Shape{INTER, H, 1024}
                                                                          : Shape{H, INTER, 512};
}
// where product p's output words start in a layer's words, over M: q|k|v [M][4096], o_proj's four
// parts [4][M][1024], gate|up [M][3072] (its first half used: two fp16 a word), down's summed parts
// [M][1024] (room for six)
__host__ __device__ __forceinline__ int words_before(int p) {
  return p == P_QKV ? 0 : p == P_O ? QKV : p == P_GU ? QKV + 4 * H : QKV + 4 * H + INTER;
}
constexpr int WORDS_ROW_LAYER = QKV + 4 * H + INTER + 6 * H;  // 17,408

struct Layer {
  const __half* w[5];  // tiled copies (small_kernel.tile): q|k|v, o_proj, gate, up, down
  const float* post;   // the RMSNorm weights after o_proj and after down [H]
  const float* nxt;
  const float* qn;     // the attention's q / k norm weights [HD]
  const float* kn;
  float* kpool;        // this layer's code-predictor K / V cache [M][NKV][16][HD] fp32, or the talker's
  float* vpool;        // paged pool [pages][NKV][64][HD] bf16
};

template <int NL>
struct ArgsT {
  Layer L[NL];
  int nl, M;
  const float* x0;     // [M][H] the residual entering layer 0
  const __half* h0;    // [M][H] its normed rows (layer 0's q|k|v input), or null: made here with
  const float* nrm0;   // these norm weights [H] (tk_gemm._rms_norm_kernel's bits, fp16 out)
  const float* cos;    // [HD] the position's RoPE row
  const float* sin;
  unsigned pos;        // the position (the cache holds 0..pos-1)
  float eps, scale;
  unsigned long long* words;  // LL words, WORDS_LEN (per layer: each product's [parts][M][N]; zeros at first)
  unsigned* sync;             // [4]: [0] error, [1] the epoch, [2] blocks done (zeros at first; kept by the kernel)
                              // errors: 1 a ring wait timed out, 3 a poll's, 5 a block with more than one o_proj
                              // piece, 6 a split flag's wait timed out, 7 lens[0] outside 1..64 msplit
  __half* out_h;              // [M][H]: the last layer's residual + final norm (block 0)
  unsigned long long timeout_ns;
  int smem, xbytes;           // qsk_setup's: dynamic shared memory; the staged inputs' share (at its start)
  // checks and timing (null in serving)
  float* qkv_g;               // null, or [nl][M][QKV]: the attention's inputs (as polled)
  __half* att_g;              // null, or [nl][M][QD]: its outputs
  float* dbg_o;               // null, or [nl][4][M][H]: the o_proj parts (plain copies, for the bit check)
  __half* dbg_inner;          // null, or [nl][M][INTER]
  float* dbg_down;            // null, or [nl][6][M][H]
  float* dbg_r;               // null, or [2 nl][M][H]: the residual after each RMSNorm (block 0)
  __half* dbg_h;              // null, or [2 nl][M][H]: the normed rows
  unsigned long long* t0s;    // null, or [G][4 nl + 1]: each product's start in each block, and its end
  unsigned* trace;            // null, or [G][4 nl][TRACE]: thread 0's marks in each product (ns since its start)
  // the talker's layers (cp_layers_kernel<true>; unused by the code predictor's):
  const int* table;           // [msplit] the row's page table (64-position pages: a page a split)
  const int* lens;            // [1] the row's positions with the new one (pos + 1; its K / V go to pos)
  float* ml;                  // [nl][2][NH][msplit]: each split's m, then each split's l
  float* accb;                // [nl][NH][msplit][HD]: each split's acc
  unsigned* iflags;           // [nl][msplit][NKV]: a split's flag once its outputs are out (zeros at first)
  int msplit;                 // the splits a row can have (its positions / 64)
  float* x_out;               // [M][H]: the residual entering the last layer's add after down (block 0)
  float* d_out;               // [M][H]: the last layer's down product, its six parts summed (block 0)
};
using Args = ArgsT<MAXL>;
using TArgs = ArgsT<TL>;
constexpr size_t WORDS_LEN = (size_t)MAXL * MAXM * WORDS_ROW_LAYER;
constexpr size_t T_WORDS_LEN = (size_t)TL * MAXM * WORDS_ROW_LAYER;
// flags a launch: 4 nl + 1 <= 33 (the code predictor's), 5 nl + 1 <= 141 (the talker's)
template <bool TALK>
constexpr unsigned EPOCH_STEP = TALK ? 256 : 64;
constexpr unsigned EPOCH_WRAP = 0xFFFFFF00u;    // an epoch from here on starts again at 0, the words zeroed
// trace marks: 0 its own polls done (the inputs there), 2 the attention done (o_proj), 3 the
// staging done, 4 warp 0's first weights there, 5 warp 0's last task stored, 6 the product done
// (every warp), 7 warp 0's first task picked (before its weights' wait)
constexpr int TRACE = 8;

constexpr int KV_TILE = 4 * 8 * 32 * 4;  // floats of one (row, kv head)'s cached K/V in attend_twin's layout
constexpr int KV_BYTES = MAXM * 2 * KV_TILE * 4;  // shared memory for a piece's two kv heads, every row
// the talker's attention area instead: a split's stage (K / V tiles and its two q rows, qda's layout),
// the polled q / k / v rows [4][HD] fp32, the split's reductions and p's terms
constexpr int T_STAGE = qda::STAGE_BYTES, T_XQ = T_STAGE, T_RED = T_XQ + 4 * HD * 4, T_PH = T_RED + 2 * 32 * 4;
constexpr int T_KV_BYTES = T_PH + 2 * qda::G * qda::PH_STRIDE * 4;
static_assert(qda::HD == HD && qda::NKV == NKV && qda::NH == NH, "the talker's attention shapes");

// product p of layer l (or P_ATT: its attention splits): its flag in a launch of epoch fb
template <bool TALK>
__device__ __forceinline__ unsigned flag_of(unsigned fb, int l, int p) {
  return fb + (TALK ? 5u : 4u) * l + p + 1u;
}

template <class A>
__device__ __forceinline__ void fail(const A& a, unsigned code) {
  atomicCAS(a.sync, 0u, code);
  asm volatile("trap;");
}

// N pairs of LL words, pair k at w + off[k] (16-byte aligned), once every word carries `flag`: all
// loads of a round issued together (one L2 round trip a round, not one a pair); after the first
// round only the pairs still missing are loaded again (a predicated load: a pair already there
// keeps its words), so that a block waiting for the last writers does not keep reading what came
// (session 41, H200: 19.2 -> 19.0 µs a layer). `out` holds zeros at the call.
template <int N, class A>
__device__ __forceinline__ void poll_many(const unsigned long long* w, const int (&off)[N], int n, unsigned flag,
                                          uint2 (&out)[N], const A& a) {
  static_assert(N <= 32, "a round's pairs are the bits of a word");
  uint32_t need = ~0u;
  for (uint32_t round = 0;; ++round) {
    const uint32_t cur = need;
    bool all = true;
    need = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (k >= n) break;
      unsigned long long w0 = (unsigned long long)flag << 32 | out[k].x, w1 = (unsigned long long)flag << 32 | out[k].y;
      asm volatile("{ .reg .pred p; setp.ne.b32 p, %3, 0; @p ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2]; }"
                   : "+l"(w0), "+l"(w1) : "l"(w + off[k]), "r"(cur & (1u << k)) : "memory");
      out[k] = make_uint2((unsigned)w0, (unsigned)w1);
      const bool ok = (unsigned)(w0 >> 32) == flag && (unsigned)(w1 >> 32) == flag;
      all = all && ok;
      need |= ok ? 0u : 1u << k;
    }
    if (all) return;
    if ((round & 63u) == 63u && *reinterpret_cast<volatile unsigned*>(a.sync) != 0) asm volatile("trap;");
    if (round > (1u << 26)) fail(a, 3u);
  }
}
__device__ __forceinline__ void put_word(unsigned long long* w, unsigned payload, unsigned flag) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(w), "l"(((unsigned long long)flag << 32) | payload)
               : "memory");
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"r"(CW * 32) : "memory"); }

__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float fmax_ptx(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float bfly_sum(float x, int from) {  // butterflies xor from, from / 2, .. 1
  for (int o = from; o >= 1; o >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
}  // namespace
namespace {  // the talker's q / k norm + RoPE and merge twins (they take HD, div_full, .. from here)
#include "../attn/glue_twin.cuh"

// until *f == flag (ld.acquire: what its writer stored before its release is then visible)
__device__ __forceinline__ void wait_flag(const unsigned* f, unsigned flag, unsigned* sync) {
  for (uint32_t round = 0;; ++round) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    if (v == flag) return;
    if ((round & 63u) == 63u && *reinterpret_cast<volatile unsigned*>(sync) != 0) asm volatile("trap;");
    if (round > (1u << 26)) {
      atomicCAS(sync, 0u, 6u);
      asm volatile("trap;");
    }
  }
}

// tk_glue._cp_attend_kernel's program (row m, query head h) with one query head a program (Triton 3.6's
// sm_90 PTX, one warp: benchmarks/results/h200-s39/call12-cp-attend-ptx/), its arithmetic instruction
// for instruction, one warp: lane l holds elements 2l, 2l + 1 of each 64-wide half (blocked1), and in
// the [16 positions][64] tiles positions r2 + 2i (i = 0..7, r2 = bit 4 of the lane) at columns
// 4 c16 .. 4 c16 + 3 (c16 = the lane's low 4 bits). Its inputs: the q|k|v values (q1 / q2 / k1 / k2 /
// v1 / v2: this lane's two values of each half), the position's RoPE rows, the norm weights, and kv:
// the cached K/V of positions 0..pos-1 in shared memory ([kp1, kp2, vp1, vp2][i][lane] float4,
// zeros past pos). Writes the new position's K/V (store_kv) into the pools and returns this lane's
// outputs: o1 / o2 (4 columns of each half, 4 c16 + e; the same in both r2 halves of the warp).
struct AttIn {
  float q1[2], q2[2], k1[2], k2[2], v1[2], v2[2];
};
// This lane's RoPE and norm weights (elements d0, d0 + 1 of each 64-wide half), loaded once the
// q|k|v words are there (loaded before the polls they cost registers: slower, session 40).
struct AttConst {
  float2 c1, c2, s1, s2, qn1, qn2, kn1, kn2;
};
__device__ __forceinline__ AttConst att_const(const float* cosv, const float* sinv, const float* qn, const float* kn) {
  const int d0 = 2 * (threadIdx.x & 31);
  auto f2 = [&](const float* p) { return __ldg(reinterpret_cast<const float2*>(p)); };
  return AttConst{f2(cosv + d0), f2(cosv + 64 + d0), f2(sinv + d0), f2(sinv + 64 + d0),
                  f2(qn + d0),   f2(qn + 64 + d0),   f2(kn + d0),   f2(kn + 64 + d0)};
}
__device__ __forceinline__ void attend_twin(const AttIn& in, const AttConst& w, const float* kvs, float* kdst,
                                            float* vdst, bool store_kv, int pos, float eps, float scale,
                                            float (&o1)[4], float (&o2)[4]) {
  const int lane = threadIdx.x & 31, r2 = (lane >> 4) & 1, c16 = lane & 15, d0 = 2 * lane;
  const float c1[2] = {w.c1.x, w.c1.y}, c2[2] = {w.c2.x, w.c2.y};
  const float s1[2] = {w.s1.x, w.s1.y}, s2[2] = {w.s2.x, w.s2.y};
  const float qn1[2] = {w.qn1.x, w.qn1.y}, qn2[2] = {w.qn2.x, w.qn2.y};
  const float kn1[2] = {w.kn1.x, w.kn1.y}, kn2[2] = {w.kn2.x, w.kn2.y};
  // the RMS of a 128-wide vector held as two halves: per half b * b, then fma a, a; butterflies 16..1
  auto inv_rms = [&](const float (&x1)[2], const float (&x2)[2]) {
    const float a = bfly_sum(__fmaf_rn(x1[0], x1[0], __fmul_rn(x1[1], x1[1])), 16);
    const float b = bfly_sum(__fmaf_rn(x2[0], x2[0], __fmul_rn(x2[1], x2[1])), 16);
    return div_full(1.0f, sqrt_approx_ftz(__fadd_rn(eps, div_full(__fadd_rn(a, b), 128.0f))));
  };
  // k: normed (r k) kn, roped: k1' = k1n c1 - k2n s1 (one fma), k2' = k1n s2 + k2n c2 (one fma)
  const float rk = inv_rms(in.k1, in.k2);
  float k1r[2], k2r[2];
  for (int e = 0; e < 2; ++e) {
    const float k1n = __fmul_rn(__fmul_rn(rk, in.k1[e]), kn1[e]);
    const float k2n = __fmul_rn(__fmul_rn(rk, in.k2[e]), kn2[e]);
    k1r[e] = __fmaf_rn(k1n, c1[e], -__fmul_rn(k2n, s1[e]));
    k2r[e] = __fmaf_rn(k1n, s2[e], __fmul_rn(k2n, c2[e]));
  }
  if (store_kv) {
    *reinterpret_cast<float2*>(kdst + d0) = make_float2(k1r[0], k1r[1]);
    *reinterpret_cast<float2*>(kdst + 64 + d0) = make_float2(k2r[0], k2r[1]);
    *reinterpret_cast<float2*>(vdst + d0) = make_float2(in.v1[0], in.v1[1]);
    *reinterpret_cast<float2*>(vdst + 64 + d0) = make_float2(in.v2[0], in.v2[1]);
  }
  // q: the same norm; roped: q1' = q1n c1 - q2n s1, q2' = q2n c2 + q1n s2 (the other fma than k's)
  const float rq = inv_rms(in.q1, in.q2);
  float q1r[2], q2r[2];
  for (int e = 0; e < 2; ++e) {
    const float q1n = __fmul_rn(__fmul_rn(rq, in.q1[e]), qn1[e]);
    const float q2n = __fmul_rn(__fmul_rn(rq, in.q2[e]), qn2[e]);
    q1r[e] = __fmaf_rn(q1n, c1[e], -__fmul_rn(q2n, s1[e]));
    q2r[e] = __fmaf_rn(q2n, c2[e], __fmul_rn(q1n, s2[e]));
  }
  // the new position's score: per half b' b'', fma a' a''; butterflies 16..1; the halves added
  const float sn_raw = __fadd_rn(bfly_sum(__fmaf_rn(k1r[0], q1r[0], __fmul_rn(k1r[1], q1r[1])), 16),
                                 bfly_sum(__fmaf_rn(k2r[0], q2r[0], __fmul_rn(k2r[1], q2r[1])), 16));
  const float sn = __fmul_rn(scale, sn_raw);
  // q' at this lane's tile columns 4 c16 .. + 3 (from lanes 2 c16 and 2 c16 + 1)
  float qa[4], qb[4];
  for (int e = 0; e < 4; ++e) {
    qa[e] = __shfl_sync(0xffffffffu, q1r[e & 1], 2 * c16 + (e >> 1));
    qb[e] = __shfl_sync(0xffffffffu, q2r[e & 1], 2 * c16 + (e >> 1));
  }
  const float4* kv4 = reinterpret_cast<const float4*>(kvs);
  auto tile = [&](int t, int i) { return kv4[(t * 8 + i) * 32 + lane]; };
  // the cached positions' scores: per position q[1] k[1], fma q[0] k[0], q[2] k[2], q[3] k[3];
  // butterflies 8..1 (the 16 lanes of its r2); the halves added, times scale; -inf past pos
  float sp[8];
  for (int i = 0; i < 8; ++i) {
    const float4 a = tile(0, i), b = tile(1, i);
    float x = __fmaf_rn(qa[3], a.w, __fmaf_rn(qa[2], a.z, __fmaf_rn(qa[0], a.x, __fmul_rn(qa[1], a.y))));
    float y = __fmaf_rn(qb[3], b.w, __fmaf_rn(qb[2], b.z, __fmaf_rn(qb[0], b.x, __fmul_rn(qb[1], b.y))));
    x = bfly_sum(x, 8), y = bfly_sum(y, 8);
    sp[i] = r2 + 2 * i < pos ? __fmul_rn(scale, __fadd_rn(x, y)) : __int_as_float(0xff800000);
  }
  float mx = sp[0];
  for (int i = 1; i < 8; ++i) mx = fmax_ptx(mx, sp[i]);
  mx = fmax_ptx(fmax_ptx(mx, __shfl_xor_sync(0xffffffffu, mx, 16)), sn);
  float pp[8];
  for (int i = 0; i < 8; ++i) pp[i] = ex2_approx(__fmul_rn(__fsub_rn(sp[i], mx), __int_as_float(0x3FB8AA3B)));
  const float pn = ex2_approx(__fmul_rn(__fmaf_rn(scale, sn_raw, -mx), __int_as_float(0x3FB8AA3B)));
  float ssum = __fadd_rn(pp[0], pp[1]);
  for (int i = 2; i < 8; ++i) ssum = __fadd_rn(ssum, pp[i]);
  ssum = __fadd_rn(ssum, __shfl_xor_sync(0xffffffffu, ssum, 16));
  const float inv = div_full(1.0f, __fadd_rn(pn, ssum));
  // outputs: per column pp1 v1, fma pp0 v0, pp2 v2 .. pp7 v7; + the other r2 half; + pn v; times inv
  float pv1[2] = {__fmul_rn(pn, in.v1[0]), __fmul_rn(pn, in.v1[1])};
  float pv2[2] = {__fmul_rn(pn, in.v2[0]), __fmul_rn(pn, in.v2[1])};
  for (int t = 2; t < 4; ++t) {
    float acc[4];
    const float4 v0 = tile(t, 0), v1 = tile(t, 1);
    const float a0[4] = {v0.x, v0.y, v0.z, v0.w}, a1[4] = {v1.x, v1.y, v1.z, v1.w};
    for (int e = 0; e < 4; ++e) acc[e] = __fmaf_rn(pp[0], a0[e], __fmul_rn(pp[1], a1[e]));
    for (int i = 2; i < 8; ++i) {
      const float4 vi = tile(t, i);
      const float ai[4] = {vi.x, vi.y, vi.z, vi.w};
      for (int e = 0; e < 4; ++e) acc[e] = __fmaf_rn(pp[i], ai[e], acc[e]);
    }
    float* o = t == 2 ? o1 : o2;
    const float* pv = t == 2 ? pv1 : pv2;
    for (int e = 0; e < 4; ++e) {
      const float sum = __fadd_rn(acc[e], __shfl_xor_sync(0xffffffffu, acc[e], 16));
      o[e] = __fmul_rn(inv, __fadd_rn(sum, __shfl_sync(0xffffffffu, pv[e & 1], 2 * c16 + (e >> 1))));
    }
  }
}

}  // namespace

// TALK: the talker's layers of one row (ArgsT<TL>): the attention over the paged pool in o_proj's
// staging (its splits, then their merge), the last layer's down and residual out for the final norm
template <bool TALK>
__global__ void __launch_bounds__(BLOCK, 1) cp_layers_kernel(const __grid_constant__ ArgsT<TALK ? TL : MAXL> a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long full[NU], empty[NU];
  __shared__ float red[2][4];
  __shared__ unsigned epoch_s, last_s;
  __shared__ float dsum[DN_PIECES][16];  // the down tile's pieces (row 0)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int G = gridDim.x, b = blockIdx.x, M = a.M;
  unsigned char* ring = smem + (a.smem - NU * UNIT);
  float* resid = reinterpret_cast<float*>(smem + a.xbytes);  // [MAXM][H]: this block's copy of the residual
  if (threadIdx.x == 0) ring_init(full, empty, NU);
  __syncthreads();

  if (warp == CW) {  // the producer: lane 0 issues each task's units in the consumers' order
    if (lane != 0) return;
    uint32_t seq = 0;
    const uint64_t policy = evict_first_policy();
    // the next ring unit: 16 KB of `w` from element `unit` on, once the consumers released the slot
    auto issue = [&](const __half* w, size_t unit) {
      const int u = seq % NU;
      if (seq >= (uint32_t)NU && !mbar_wait_err(smem_u32(empty + u), ((seq / NU) - 1) & 1u, a.sync, a.timeout_ns))
        asm volatile("trap;");
      expect_bytes(smem_u32(full + u), 16 * UC * 2);
      bulk_copy(smem_u32(ring + (size_t)u * UNIT), w + unit, 16 * UC * 2, smem_u32(full + u), policy);
      ++seq;
    };
    for (int l = 0; l < a.nl; ++l)
      for (int p = 0; p < 4; ++p) {
        const Shape sh = shape_of(p);
        const int S = sh.K / sh.piece, T = (sh.N / 16) * S, per = sh.piece / UC;
        if (p == P_DN) {  // the block's tile, all six pieces (one unit each)
          const int tile = down_tile(b, G);
          for (int s = 0; tile >= 0 && s < DN_PIECES; ++s)
            issue(a.L[l].w[4], ((size_t)tile * (sh.K / UC) + (size_t)s) * (16 * UC));
          continue;
        }
        for (int task = b; task < T; task += G) {
          const int tile = task / S, s = task % S;
          for (int half = 0; half < (p == P_GU ? 2 : 1); ++half) {
            const __half* w = a.L[l].w[p == P_QKV ? 0 : p == P_O ? 1 : p == P_GU ? 2 + half : 4];
            for (int kc = 0; kc < per; ++kc)
              issue(w, ((size_t)tile * (sh.K / UC) + (size_t)s * per + kc) * (16 * UC));
          }
        }
      }
    return;
  }

  // consumers (warps 0..CW-1). Launched as a programmatic dependent (qsk_run / qtk_run with pdl),
  // the block may start while the kernel before it (the draw) still runs: the producer above
  // streams the first products' weights (constants) meanwhile; the consumers wait here for that
  // kernel's results. The launch does not trigger its own dependents early (they start at its end):
  // with griddepcontrol.launch_dependents here a B = 1 frame took 2.331 / 2.321 ms, in the last
  // layer 2.329 / 2.335, without it 2.263 / 2.268, launched cooperative without PDL 2.308 / 2.302
  // (H200, session 46).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // the epoch (the last launch's last block set it) and the residual entering layer 0
  if (tid == 0) epoch_s = *reinterpret_cast<volatile unsigned*>(a.sync + 1);
  for (int i = tid; i < M * H; i += CW * 32) resid[i] = a.x0[i];
  consumer_sync();
  const unsigned fb = epoch_s;
  const uint32_t xs = smem_u32(smem);
  uint32_t seq = 0;
  const int grp = warp >> 2, gt = tid & 127;  // RMSNorm: warps 0-3 row 0 (warps 4..: none)

  // The RMSNorm after a product with `parts` <= 4 K pieces (o_proj's 4; down's come summed: 1; its LL
  // words at `w`, parts [parts][M][H]) into the block's residual and, fp16, row m of the staged inputs
  // (one 1,024-column piece, stride xrs); dbg: its outputs' index among the launch's norms (block 0
  // writes them), or -1.
  auto add_rms = [&](const unsigned long long* w, int parts, unsigned flag, const float* nw, int xrs, int dbg,
                     auto polled) {
    const int m = grp;
    if (m < M) {
      // the thread's 8 values of each part: 4 word pairs a part, all polled in one round
      int off[16];
      uint2 v[16] = {};
#pragma unroll
      for (int k = 0; k < 16; ++k) off[k] = ((k >> 2) * M + m) * H + 8 * gt + 2 * (k & 3);
      // (the norm's weights are loaded after the polls: loaded before them, they held 8 registers
      // across the polls, the chains spilled more and a frame was 2.5% slower, session 40)
      poll_many<16>(w, off, 4 * parts, flag, v, a);
      const float4 nw0 = __ldg(reinterpret_cast<const float4*>(nw + 8 * gt));
      const float4 nw1 = __ldg(reinterpret_cast<const float4*>(nw + 8 * gt) + 1);
      polled();
      float e[8];
#pragma unroll
      for (int i = 0; i < 8; i += 2) e[i] = __uint_as_float(v[i >> 1].x), e[i + 1] = __uint_as_float(v[i >> 1].y);
#pragma unroll
      for (int pp = 1; pp < 4; ++pp)
#pragma unroll
        for (int i = 0; i < 8; i += 2)
          if (pp < parts) {
            const uint2 u = v[4 * pp + (i >> 1)];
            e[i] = __fadd_rn(e[i], __uint_as_float(u.x)), e[i + 1] = __fadd_rn(e[i + 1], __uint_as_float(u.y));
          }
      float* r = resid + m * H + 8 * gt;
#pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = __fadd_rn(e[i], r[i]), r[i] = e[i];
      const float rr = div_full(1.0f, sqrt_approx_ftz(__fadd_rn(a.eps, mean_square(e, red[grp], H, gt, 2u + grp))));
      __half hv[8];
      const float wv[8] = {nw0.x, nw0.y, nw0.z, nw0.w, nw1.x, nw1.y, nw1.z, nw1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) hv[i] = __float2half_rn(__fmul_rn(__fmul_rn(e[i], rr), wv[i]));
      *reinterpret_cast<uint4*>(smem + (size_t)m * xrs + 16 * gt) = *reinterpret_cast<const uint4*>(hv);
      if (dbg == 2 * a.nl - 1 && b == 0 && a.out_h)  // the final norm: the launch's output
        *reinterpret_cast<uint4*>(a.out_h + (size_t)m * H + 8 * gt) = *reinterpret_cast<const uint4*>(hv);
      if (dbg >= 0 && b == 0) {
        if (a.dbg_r)
          for (int i = 0; i < 8; ++i) a.dbg_r[((size_t)dbg * M + m) * H + 8 * gt + i] = e[i];
        if (a.dbg_h) *reinterpret_cast<uint4*>(a.dbg_h + ((size_t)dbg * M + m) * H + 8 * gt) =
                         *reinterpret_cast<const uint4*>(hv);
      }
    }
  };

  for (int l = 0; l < a.nl; ++l) {
    const Layer& L = a.L[l];
    unsigned long long* lw = a.words + (size_t)l * M * WORDS_ROW_LAYER;
    for (int p = 0; p < 4; ++p) {
      unsigned long long tstart = 0;
      if ((a.t0s || a.trace) && tid == 0) tstart = gtime();
      if (a.t0s && tid == 0) a.t0s[(size_t)b * (4 * a.nl + 1) + 4 * l + p] = tstart;
      unsigned* tr = a.trace && tid == 0 ? a.trace + ((size_t)b * 4 * a.nl + 4 * l + p) * TRACE : nullptr;
      auto mark = [&](int k) {
        if (tr) tr[k] = (unsigned)(gtime() - tstart);
      };
      const Shape sh = shape_of(p);
      const int S = sh.K / sh.piece, T = (sh.N / 16) * S, per = sh.piece / UC, xrs = sh.piece * 2 + 16;
      const bool dual = p == P_GU;
      const int upt = per * (dual ? 2 : 1);
      const unsigned flag = flag_of<TALK>(fb, l, p);
      // the block's tasks b, b + G, ... as (tile, piece) pairs by additions (G = gq S + gr), and the
      // pieces it has (slot of piece s: the pieces below it that it has)
      const int gq = G / S, gr = G - gq * S, t_b = b / S, s_b = b - t_b * S;
      unsigned pieces = 0;
      for (int task = b, sp = s_b; task < T; task += G) {
        pieces |= 1u << sp;
        sp += gr;
        if (sp >= S) sp -= S;
      }
      auto slot = [&](int s) { return __popc(pieces & ((1u << s) - 1u)); };

      if (TALK && p == P_QKV && warp < 4) {
        // the block's first attention item's K / V, copied while q|k|v runs (the stage is free then;
        // session 45: the talker's layers 620 -> 602 µs at 100 positions, 869 -> 855 at 2,000)
        const int n = *a.lens, pos = n - 1, nsp = (n + qda::SPLIT - 1) / qda::SPLIT;
        if (n < 1 || n > a.msplit * qda::SPLIT) fail(a, 7u);  // (before any table or pool read)
        if (b < nsp * NKV) {
          const int sp = b / NKV, kvh = b % NKV;
          qda::issue_kv_v2(tid, smem_u32(smem + a.xbytes + MAXM * H * 4), qda::Item{0, kvh, sp, pos},
                           __ldg(a.table + sp), reinterpret_cast<const __nv_bfloat16*>(a.L[l].kpool),
                           reinterpret_cast<const __nv_bfloat16*>(a.L[l].vpool), qda::evict_first_policy());
        }
        qda::cp_async_commit();
      }
      // ---- staging: this product's inputs in shared memory, rows 0..M-1 of each piece it has
      if (p == P_QKV && l == 0 && !a.h0) {
        // the residual's RMSNorm as tk_gemm._rms_norm_kernel computes it (fp16 out, Triton 3.6: as
        // add_rms without the parts, the square root IEEE; the twin of scripts/dot_bits.cu)
        const int m = grp;
        if (m < M) {
          const float4 w0 = __ldg(reinterpret_cast<const float4*>(a.nrm0 + 8 * gt));
          const float4 w1 = __ldg(reinterpret_cast<const float4*>(a.nrm0 + 8 * gt) + 1);
          const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
          float e[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) e[i] = resid[m * H + 8 * gt + i];
          const float rr = div_full(1.0f, __fsqrt_rn(__fadd_rn(a.eps, mean_square(e, red[grp], H, gt, 2u + grp))));
          __half hv[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) hv[i] = __float2half_rn(__fmul_rn(__fmul_rn(e[i], rr), wv[i]));
          *reinterpret_cast<uint4*>(smem + (size_t)m * xrs + 16 * gt) = *reinterpret_cast<const uint4*>(hv);
        }
      } else if (p == P_QKV && l == 0) {
        for (int i = tid; i < M * (H / 8); i += CW * 32) {
          const int m = i / (H / 8), c = i % (H / 8);
          *reinterpret_cast<uint4*>(smem + (size_t)m * xrs + 16 * c) =
              __ldcg(reinterpret_cast<const uint4*>(a.h0 + (size_t)m * H) + c);
        }
      } else if (p == P_QKV || p == P_GU) {  // (one piece of 1,024 columns: slot 0)
        const bool after_o = p == P_GU;
        const unsigned long long* src = after_o ? lw + (size_t)M * words_before(P_O)
                                                : a.words + (size_t)(l - 1) * M * WORDS_ROW_LAYER +
                                                      (size_t)M * words_before(P_DN);
        // (o_proj's four parts; down's six come summed)
        add_rms(src, after_o ? 4 : 1, after_o ? flag_of<TALK>(fb, l, P_O) : flag_of<TALK>(fb, l - 1, P_DN),
                after_o ? L.post : a.L[l - 1].nxt, xrs, after_o ? 2 * l : 2 * l - 1, [&] { mark(0); });
      } else if (TALK && p == P_O) {
        // The talker's attention of the row (one row): first the block's splits, items b, b + G, ..
        // of (split sp, kv head) in (sp, kv head) order, by warps 0-3 with qda's split math (the
        // Triton split kernel's bits, csrc/attn/decode_split.cuh) from a stage in the attention
        // area: K / V copied from the pool while the q|k|v words are polled, q (and, in the split
        // holding the new position, k) normed and roped by qk_norm_rope_twin (the Triton store
        // kernel's bits) into the stage, the new K / V also into the pool; each split's m, l, acc to
        // a.ml / a.accb, then its flag. Then the merge of the block's piece s (q heads 4s .. 4s + 3:
        // kv heads 2s, 2s + 1), a warp a head, once their splits' flags are there (the Triton merge
        // kernel's bits), fp16 into the staged inputs.
        if (__popc(pieces) != 1) fail(a, 5u);  // (one piece a block: G a multiple of 4)
        const int s = __ffs(pieces) - 1, n = *a.lens, pos = n - 1;  // (n checked at q|k|v)
        const int nsp = (n + qda::SPLIT - 1) / qda::SPLIT, last = pos / qda::SPLIT, j_new = pos % qda::SPLIT;
        unsigned char* area = smem + a.xbytes + MAXM * H * 4;
        float* xq = reinterpret_cast<float*>(area + T_XQ);  // the polled rows: q heads 2 kvh, 2 kvh + 1, k, v
        auto& red2 = *reinterpret_cast<float(*)[2][32]>(area + T_RED);
        auto& ph = *reinterpret_cast<uint32_t(*)[2][qda::G][qda::PH_STRIDE]>(area + T_PH);
        const unsigned aflag = flag_of<TALK>(fb, l, P_ATT);
        float* mb = a.ml + (size_t)l * 2 * NH * a.msplit;
        float* lb = mb + (size_t)NH * a.msplit;
        float* ab = a.accb + (size_t)l * NH * a.msplit * HD;
        unsigned* fl = a.iflags + (size_t)l * a.msplit * NKV;
        __nv_bfloat16* kp = reinterpret_cast<__nv_bfloat16*>(L.kpool);
        __nv_bfloat16* vp = reinterpret_cast<__nv_bfloat16*>(L.vpool);
        if (warp < 4) {
          const auto sync4 = [] { asm volatile("bar.sync 7, 128;" ::: "memory"); };
          const uint64_t pol = qda::evict_first_policy();
          const unsigned long long* qw = lw + (size_t)M * words_before(P_QKV);  // (row 0)
          for (int it = b; it < nsp * NKV; it += G) {
            const int sp = it / NKV, kvh = it % NKV, page = __ldg(a.table + sp);
            const bool nw = sp == last;  // the split holding the new position
            // K / V of the positions below pos (the new one's row zero-filled, written below)
            if (it != b) {  // (the first item's: issued before q|k|v)
              qda::issue_kv_v2(tid, smem_u32(area), qda::Item{0, kvh, sp, pos}, page, kp, vp, pol);
              qda::cp_async_commit();
            }
            if (warp < 2 || nw) {  // warp w: q head 2 kvh + w (w < 2), k (2) / v (3) of kv head kvh
              const int col = warp < 2 ? (2 * kvh + warp) * HD : ((warp == 2 ? NH : NH + NKV) + kvh) * HD;
              int off[2] = {col + 2 * lane, col + 64 + 2 * lane};
              uint2 v[2] = {};
              poll_many<2>(qw, off, 2, flag_of<TALK>(fb, l, P_QKV), v, a);
              float* x = xq + warp * HD;
              *reinterpret_cast<uint2*>(x + 2 * lane) = v[0];
              *reinterpret_cast<uint2*>(x + 64 + 2 * lane) = v[1];
              __syncwarp();
            }
            if (it == b) mark(0);
            qda::cp_async_wait<0>();
            sync4();  // every copy into the stage there
            const int dims[4] = {lane, 32 + lane, 64 + lane, 96 + lane};
            const size_t prow = (((size_t)page * NKV + kvh) * qda::SPLIT + j_new) * HD;  // the new row in the pool
            if (warp < 3 && (warp < 2 || nw)) {
              float y[4];
              qk_norm_rope_twin(xq + warp * HD, warp < 2 ? L.qn : L.kn, a.cos, a.sin, a.eps, y);
              if (warp < 2) {
                float* qs = reinterpret_cast<float*>(area + 2 * qda::TILE_BYTES) + warp * qda::Q_STRIDE;
                for (int i = 0; i < 4; ++i) qs[dims[i]] = y[i];
              } else {
                for (int i = 0; i < 4; ++i) {
                  const __nv_bfloat16 kb = __float2bfloat16_rn(y[i]);
                  kp[prow + dims[i]] = kb;
                  *reinterpret_cast<__nv_bfloat16*>(area + qda::swz(j_new, dims[i] >> 3) + (dims[i] & 7) * 2) = kb;
                }
              }
            } else if (warp == 3 && nw) {
              for (int i = 0; i < 4; ++i) {
                const __nv_bfloat16 vb = __float2bfloat16_rn(xq[3 * HD + dims[i]]);
                vp[prow + dims[i]] = vb;
                *reinterpret_cast<__nv_bfloat16*>(area + qda::TILE_BYTES + qda::swz(j_new, dims[i] >> 3) +
                                                  (dims[i] & 7) * 2) = vb;
              }
            }
            sync4();  // q and the new K / V row in the stage
            qda::split_math_v2(tid, sync4, area, qda::Item{0, kvh, sp, n}, a.scale, mb, lb, ab, a.msplit, red2, ph,
                               [] {});
            sync4();  // every output stored; the stage free again
            // the flag: a release store after the barrier (the barrier orders the 128 threads' stores
            // before it, the release publishes them at gpu scope; a __threadfence() before it as well
            // cost 10-30 µs a launch, session 45)
            if (tid == 0)
              asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(fl + sp * NKV + kvh), "r"(aflag) : "memory");
          }
          if (b >= nsp * NKV && tid == 0) mark(0);
          // the merge of head 4s + warp over its kv head's splits
          const int h = 4 * s + warp, kvh = h / qda::G;
          for (int sp = lane; sp < nsp; sp += 32) wait_flag(fl + sp * NKV + kvh, aflag, a.sync);
          __syncwarp();
          __half o[4];
          attn_combine_twin(mb + (size_t)h * a.msplit, lb + (size_t)h * a.msplit, ab + (size_t)h * a.msplit * HD, nsp,
                            o);
          *reinterpret_cast<uint2*>(smem + (size_t)(warp * HD + 4 * lane) * 2) = *reinterpret_cast<const uint2*>(o);
          if (a.att_g)  // (checks)
            *reinterpret_cast<uint2*>(a.att_g + (size_t)l * M * QD + h * HD + 4 * lane) =
                *reinterpret_cast<const uint2*>(o);
        }
        mark(2);
      } else if (p == P_O) {
        // the attention of the block's piece s (its q heads 4s .. 4s + 3) by attend_twin: warp w < 4
        // runs head 4s + w (warps w / 4 >= M: none); warps 2k and 2k + 1 share kv head 2s + k, whose cached K/V they
        // copy into shared memory (half each, cp.async) while the q|k|v words are on their way
        if (__popc(pieces) != 1) fail(a, 5u);  // (one piece a block: G a multiple of 4)
        const int s = __ffs(pieces) - 1, m = warp >> 2, hh = warp & 3, kk = hh >> 1;
        const int h = 4 * s + hh, kvh = 2 * s + kk, r2 = (lane >> 4) & 1, c16 = lane & 15, d0 = 2 * lane;
        float* kvs = reinterpret_cast<float*>(smem + a.xbytes + MAXM * H * 4) +
                     (size_t)(m * 2 + kk) * KV_TILE;
        const int pos = (int)a.pos;
        if (m < M) {
          const size_t base = ((size_t)m * NKV + kvh) * 16 * HD;
          for (int i = 4 * (hh & 1); i < 4 * (hh & 1) + 4; ++i) {
            const int j = r2 + 2 * i;
            for (int t = 0; t < 4; ++t) {
              const float* src = (t < 2 ? L.kpool : L.vpool) + base + (size_t)j * HD + (t & 1) * 64 +
                                 4 * c16;
              asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(
                               smem_u32(kvs + ((t * 8 + i) * 32 + lane) * 4)),
                           "l"(src), "r"(j < pos ? 16 : 0) : "memory");
            }
          }
          asm volatile("cp.async.commit_group;" ::: "memory");
          const unsigned long long* qw = lw + (size_t)M * words_before(P_QKV) + (size_t)m * QKV;
          int off[6] = {h * HD + d0, h * HD + 64 + d0, (NH + kvh) * HD + d0, (NH + kvh) * HD + 64 + d0,
                        (NH + NKV + kvh) * HD + d0, (NH + NKV + kvh) * HD + 64 + d0};
          uint2 v[6] = {};
          poll_many<6>(qw, off, 6, flag_of<TALK>(fb, l, P_QKV), v, a);
          const AttConst wc = att_const(a.cos, a.sin, L.qn, L.kn);
          AttIn in;
          float* dsts[6] = {in.q1, in.q2, in.k1, in.k2, in.v1, in.v2};
          float* qg = a.qkv_g ? a.qkv_g + (size_t)(l * M + m) * QKV : nullptr;
          for (int k = 0; k < 6; ++k) {
            dsts[k][0] = __uint_as_float(v[k].x), dsts[k][1] = __uint_as_float(v[k].y);
            if (qg && (k < 2 || (hh & 1) == 0)) *reinterpret_cast<uint2*>(qg + off[k]) = v[k];  // (checks)
          }
          mark(0);
          asm volatile("cp.async.wait_all;" ::: "memory");
          asm volatile("bar.sync %0, 64;" ::"r"(2 + (warp >> 1)) : "memory");  // the pair's copies both there
          float o1[4], o2[4];
          attend_twin(in, wc, kvs, L.kpool + base + (size_t)pos * HD,
                      L.vpool + base + (size_t)pos * HD, (hh & 1) == 0, pos, a.eps, a.scale, o1, o2);
          if (r2 == 0) {  // (both halves hold the outputs)
            __half ho[8];
            for (int e = 0; e < 4; ++e) ho[e] = __float2half_rn(o1[e]), ho[4 + e] = __float2half_rn(o2[e]);
            unsigned char* dst = smem + (size_t)m * xrs + (size_t)(hh * HD + 4 * c16) * 2;  // (slot 0)
            *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(ho);
            *reinterpret_cast<uint2*>(dst + 128) = *reinterpret_cast<const uint2*>(ho + 4);
            if (a.att_g) {  // (checks)
              __half* ag = a.att_g + (size_t)(l * M + m) * QD + h * HD + 4 * c16;
              *reinterpret_cast<uint2*>(ag) = *reinterpret_cast<const uint2*>(ho);
              *reinterpret_cast<uint2*>(ag + 64) = *reinterpret_cast<const uint2*>(ho + 4);
            }
          }
        } else if (tid == 0) {
          mark(0);
        }
        mark(2);
      } else if (down_tile(b, G) >= 0) {  // down: every gate|up output (the tile takes all six pieces), two fp16 a word
        const unsigned long long* gw = lw + (size_t)M * words_before(P_GU);
        constexpr int GROUPS = INTER / 8, PER_T = (GROUPS + CW * 32 - 1) / (CW * 32);  // 8-column groups (one row)
        int off[2 * PER_T];  // (two fp16 a word)
        uint2 v[2 * PER_T] = {};
        int n = 0;
#pragma unroll
        for (int q = 0; q < PER_T; ++q) {
          const int i = tid + q * CW * 32;
#pragma unroll
          for (int k = 0; k < 2; ++k) off[2 * q + k] = i < GROUPS ? 4 * i + 2 * k : 0;
          if (i < GROUPS) n += 2;
        }
        poll_many<2 * PER_T>(gw, off, n, flag_of<TALK>(fb, l, P_GU), v, a);
#pragma unroll
        for (int q = 0; q < PER_T; ++q) {
          const int i = tid + q * CW * 32, c = i % (sh.piece / 8);
          if (i >= GROUPS) continue;
          *reinterpret_cast<uint4*>(smem + (size_t)(i / (sh.piece / 8)) * R * xrs + 16 * c) =
              make_uint4(v[2 * q].x, v[2 * q].y, v[2 * q + 1].x, v[2 * q + 1].y);
        }
        mark(0);
      }
      consumer_sync();
      mark(3);

      unsigned long long* ow = lw + (size_t)M * words_before(p);
      if (p == P_DN) {  // the block's tile: piece s on warp s, then their sum in order (warp 0)
        const int dt = down_tile(b, G);
        if (dt >= 0 && warp < DN_PIECES) {
          const int s = warp;
          if (s == 0) mark(7);
          if (!mbar_wait_err(smem_u32(full + (seq + s) % NU), ((seq + s) / NU) & 1u, a.sync, a.timeout_ns))
            asm volatile("trap;");
          if (s == 0) mark(4);
          float d[2][4] = {}, e[2][4] = {};
          const int g = lane >> 2, t = lane & 3;
          const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
          const int sw = (lrow & 7) | ((lane >> 4) << 3);
          const uint32_t w0 = smem_u32(ring + (size_t)((seq + s) % NU) * UNIT) + (uint32_t)(lrow * UC * 2);
          chain(false, false, w0, w0, w0, w0, xs + (uint32_t)(s * R * xrs + g * xrs + 4 * t), xrs, 1, d, e, 0u, 0u,
                sw);
          __syncwarp();
          if (lane == 0) mbar_arrive(smem_u32(empty + (seq + s) % NU));
          if (t == 0) {  // row 0: rows g and g + 8 of the tile, times 2^6 (undoing the input's scale: exact)
            dsum[s][g] = __fmul_rn(d[0][0], 64.0f), dsum[s][g + 8] = __fmul_rn(d[0][2], 64.0f);
            if (a.dbg_down) {
              a.dbg_down[((size_t)l * DN_PIECES + s) * H + 16 * dt + g] = dsum[s][g];
              a.dbg_down[((size_t)l * DN_PIECES + s) * H + 16 * dt + g + 8] = dsum[s][g + 8];
            }
          }
          asm volatile("bar.sync 6, %0;" ::"r"(DN_PIECES * 32) : "memory");
          if (warp == 0 && lane < 16) {  // add_rms's order: ((p0 + p1) + p2) .. + p5
            float v = dsum[0][lane];
#pragma unroll
            for (int q = 1; q < DN_PIECES; ++q) v = __fadd_rn(v, dsum[q][lane]);
            put_word(ow + 16 * dt + lane, __float_as_uint(v), flag);
          }
          if (s == 0) mark(5);
        }
        if (dt >= 0) seq += DN_PIECES;
      }
      // ---- the tasks: warp j % CW takes the block's j-th
      int j = 0, tile = t_b - gq, s = s_b - gr;
      for (int task = p == P_DN ? T : b; task < T; task += G, ++j, seq += upt) {
        tile += gq, s += gr;
        if (s >= S) s -= S, tile += 1;
        if (j % CW != warp) continue;
        if (j == 0) mark(7);
        bool ok = true;
        for (int i = 0; i < upt; ++i) {
          const uint32_t n = seq + i;
          ok = ok && mbar_wait_err(smem_u32(full + n % NU), (n / NU) & 1u, a.sync, a.timeout_ns);
        }
        if (!ok) asm volatile("trap;");
        if (j == 0) mark(4);
        float d[2][4] = {}, e[2][4] = {};
        const int g = lane >> 2, t = lane & 3;
        const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
        const uint32_t lofs = (uint32_t)(lrow * UC * 2);
        const int sw = (lrow & 7) | ((lane >> 4) << 3);
        const uint32_t xa = xs + (uint32_t)(slot(s) * R * xrs + g * xrs + 4 * t);
        auto unit = [&](int n) { return smem_u32(ring + (size_t)((seq + n) % NU) * UNIT) + lofs; };
        const uint32_t rel0 = per == 2 ? smem_u32(empty + seq % NU) : 0u;
        const uint32_t rel20 = per == 2 && dual ? smem_u32(empty + (seq + per) % NU) : 0u;
        chain(false, dual, unit(0), unit(per - 1), unit(per), unit(2 * per - 1), xa, xrs, per, d, e, rel0, rel20, sw);
        __syncwarp();
        if (lane == 0)
          for (int i = 0; i < upt; ++i) {
            if (per == 2 && !(i & 1)) continue;  // released by the chain
            mbar_arrive(smem_u32(empty + (seq + i) % NU));
          }
        if (p == P_GU) {
          // tk_gemm's SwiGLU epilogue, then times 2^-6 rounded to fp16 (the down's scaled input); two
          // adjacent outputs a word: lane 4 (g + 1) + t holds output n + 1 of lane 4 g + t's n
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const int n = 16 * tile + g + (jj >= 2 ? 8 : 0), m = 2 * t + (jj & 1);
            const float v = d[0][jj];
            float ex;
            asm("ex2.approx.f32 %0, %1;" : "=f"(ex) : "f"(__fmul_rn(__fsub_rn(0.f, v), __int_as_float(0x3FB8AA3B))));
            const __half hv = __float2half_rn(__fmul_rn(__fmul_rn(e[0][jj], div_full(v, __fadd_rn(ex, 1.0f))),
                                                        0.015625f));
            const unsigned lo = __half_as_ushort(hv), hi = __shfl_down_sync(0xffffffffu, lo, 4);
            if (m >= M) continue;
            if (!(g & 1)) put_word(ow + ((size_t)m * INTER + n) / 2, lo | hi << 16, flag);
            if (a.dbg_inner) a.dbg_inner[((size_t)l * M + m) * INTER + n] = hv;
          }
        }
#pragma unroll
        for (int jj = 0; jj < 4 && p != P_GU; ++jj) {
          const int n = 16 * tile + g + (jj >= 2 ? 8 : 0), m = 2 * t + (jj & 1);
          if (m >= M) continue;
          const float v = d[0][jj];
          if (p == P_QKV) {
            put_word(ow + (size_t)m * QKV + n, __float_as_uint(v), flag);
          } else {  // o_proj's part s (the down product has its own path above)
            put_word(ow + ((size_t)s * M + m) * H + n, __float_as_uint(v), flag);
            if (a.dbg_o) a.dbg_o[(((size_t)l * S + s) * M + m) * H + n] = v;
          }
        }
        mark(5);
      }
      consumer_sync();  // (every chain done with the staged inputs before the next staging)
      mark(6);
    }
  }
  if (a.t0s && tid == 0) a.t0s[(size_t)b * (4 * a.nl + 1) + 4 * a.nl] = gtime();
  if (b == 0) {  // the last layer's residual and normed rows (norm 2 nl - 1): out_h
    const int l = a.nl - 1;
    const unsigned long long* dw = a.words + (size_t)l * M * WORDS_ROW_LAYER + (size_t)M * words_before(P_DN);
    if (TALK) {  // the talker's: its down sum and the residual it adds to, for glue.add_rms (fp32 out)
      for (int i = tid; i < M * H / 2; i += CW * 32) {
        const int off[1] = {2 * i};
        uint2 v[1] = {};
        poll_many<1>(dw, off, 1, flag_of<TALK>(fb, l, P_DN), v, a);
        *reinterpret_cast<uint2*>(a.d_out + 2 * i) = v[0];
        *reinterpret_cast<float2*>(a.x_out + 2 * i) = *reinterpret_cast<const float2*>(resid + 2 * i);
      }
    } else {
      add_rms(dw, 1, flag_of<TALK>(fb, l, P_DN), a.L[l].nxt, H * 2 + 16, 2 * l + 1, [] {});
    }
  }
  // the last block out advances the epoch for the next launch (stream order makes it visible
  // there); at the wrap it first zeroes every word, so that no word left from an old launch can
  // carry a flag of a new one
  consumer_sync();
  if (tid == 0) last_s = atomicAdd(a.sync + 2, 1u) == (unsigned)G - 1u;
  consumer_sync();
  if (last_s) {
    const bool wrap = fb >= EPOCH_WRAP;
    if (wrap) {
      for (size_t i = tid; i < (TALK ? T_WORDS_LEN : WORDS_LEN); i += CW * 32) a.words[i] = 0ull;
      if (TALK)
        for (size_t i = tid; i < (size_t)a.nl * a.msplit * NKV; i += CW * 32) a.iflags[i] = 0u;
      consumer_sync();
    }
    if (tid == 0) {
      a.sync[2] = 0u;
      a.sync[1] = wrap ? 0u : fb + EPOCH_STEP<TALK>;
    }
  }
}

namespace {
// The most shared memory any block stages for its inputs (its pieces x R rows) with `blocks` blocks.
int staged_bytes(int blocks) {
  int xbytes = 0;
  for (int p = 0; p < 4; ++p) {
    const Shape sh = shape_of(p);
    const int S = sh.K / sh.piece, T = (sh.N / 16) * S;
    if (p == P_DN) {
      xbytes = std::max(xbytes, DN_PIECES * R * (sh.piece * 2 + 16));
      continue;
    }
    for (int b = 0; b < blocks; ++b) {
      unsigned seen = 0;
      for (int task = b; task < T; task += blocks) seen |= 1u << (task % S);
      xbytes = std::max(xbytes, __builtin_popcount(seen) * R * (sh.piece * 2 + 16));
    }
  }
  return ((xbytes + 127) / 128) * 128;
}

// Before the first launch of kernel K (outside a graph capture): the shared memory carve-up into
// args (smem, xbytes) for this grid, the row work's area `area`, and K's shared-memory attribute.
template <bool TALK>
int setup(ArgsT<TALK ? TL : MAXL>& a, int blocks, int area) {
  if (blocks < DN_TILES || blocks % 4) return -1;
  int dev = 0, optin = 0;
  cudaFuncAttributes fa;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, cp_layers_kernel<TALK>);
  if (e != cudaSuccess) return -(int)e;
  a.xbytes = staged_bytes(blocks);
  a.smem = ((optin - (int)fa.sharedSizeBytes) / 128) * 128;
  if (a.xbytes + MAXM * H * 4 + area + NU * UNIT > a.smem) return -2;
  e = cudaFuncSetAttribute(cp_layers_kernel<TALK>, cudaFuncAttributeMaxDynamicSharedMemorySize, a.smem);
  return e == cudaSuccess ? 0 : -(int)e;
}
// One launch (capturable in a CUDA graph): cooperative (every block resident at once), or with pdl
// a programmatic dependent of the kernel before it: its blocks may start while that kernel runs
// (the ones that find no room then start as it ends; nothing this launch waits for needs them
// before), streaming their first weights until the consumers' griddepcontrol.wait returns.
template <bool TALK>
int run(const ArgsT<TALK ? TL : MAXL>& a, int blocks, void* stream, int pdl) {
  if (!pdl) {
    void* kargs[] = {const_cast<ArgsT<TALK ? TL : MAXL>*>(&a)};
    const cudaError_t e = cudaLaunchCooperativeKernel((const void*)cp_layers_kernel<TALK>, blocks, BLOCK, kargs,
                                                      a.smem, (cudaStream_t)stream);
    return e == cudaSuccess ? 0 : -(int)e;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(BLOCK);
  cfg.dynamicSmemBytes = a.smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, cp_layers_kernel<TALK>, a);
  return e == cudaSuccess ? 0 : -(int)e;
}
}  // namespace

// The C ABI (tts_server/engines/batched/small_kernel.py). Errors: a CUDA error negated, -1 for
// arguments out of range, -2 when shared memory is short. args: an Args / TArgs (a pointer to void:
// a type of internal linkage in the signature would hide the symbol). qsk_*: the code predictor's
// layers; qtk_*: the talker's.
extern "C" int qsk_abi_version() { return 6; }
extern "C" int qsk_sub_cols() { return QSK_SUB; }  // tk_gemm.sub_cols' order (0: one chain a piece)
extern "C" int qsk_args_size() { return (int)sizeof(Args); }
extern "C" long long qsk_words_len() { return (long long)WORDS_LEN; }
extern "C" int qsk_max_rows() { return MAXM; }
extern "C" int qsk_max_layers() { return MAXL; }
// The grid for `sms` multiprocessors: a multiple of 4 (one o_proj piece a block), one block an SM,
// at least one block a down tile (-1: too few), and one SM at least left to the kernel before it, so
// that every block can start early as its programmatic dependent (132 SMs: 128 blocks; a B = 1
// frame 2.277 / 2.274 ms on 132, 2.250 / 2.257 on 128, H200, session 46).
extern "C" int qsk_grid(int sms) {
  const int spare = (sms - 1) / 4 * 4, all = sms / 4 * 4;
  return spare >= DN_TILES ? spare : all >= DN_TILES ? all : -1;
}
extern "C" int qsk_setup(void* args, int blocks) { return setup<false>(*static_cast<Args*>(args), blocks, KV_BYTES); }
// pdl: launched as a programmatic dependent of the kernel before it (run() above).
extern "C" int qsk_run(const void* args, int blocks, void* stream, int pdl) {
  const Args& a = *static_cast<const Args*>(args);
  if (a.nl < 1 || a.nl > MAXL || a.M < 1 || a.M > MAXM || blocks < DN_TILES || blocks % 4 || a.smem <= 0 || !a.out_h ||
      !a.words || !a.sync || (!a.h0 && !a.nrm0))
    return -1;
  return run<false>(a, blocks, stream, pdl);
}
extern "C" int qtk_args_size() { return (int)sizeof(TArgs); }
extern "C" long long qtk_words_len() { return (long long)T_WORDS_LEN; }
extern "C" int qtk_max_layers() { return TL; }
extern "C" int qtk_setup(void* args, int blocks) { return setup<true>(*static_cast<TArgs*>(args), blocks, T_KV_BYTES); }
// The talker's layers of one row at position lens[0] - 1 (device memory, as the table and the
// RoPE rows: a graph replays the launch for any position; its K / V go there, the pool holds
// positions 0..pos-1): lens[0] <= 64 msplit (else the launch fails: error 7), the table's first
// pos / 64 + 1 pages the row's.
extern "C" int qtk_run(const void* args, int blocks, void* stream, int pdl) {
  const TArgs& a = *static_cast<const TArgs*>(args);
  if (a.nl < 1 || a.nl > TL || a.M != 1 || blocks < DN_TILES || blocks % 4 || a.smem <= 0 || !a.words || !a.sync ||
      (!a.h0 && !a.nrm0) || !a.table || !a.lens || !a.ml || !a.accb || !a.iflags || a.msplit < 1 || !a.x_out ||
      !a.d_out)
    return -1;
  return run<true>(a, blocks, stream, pdl);
}
extern "C" const char* qsk_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }
