// For scripts/gpu_dot_bits.py: the fp16 products of the batched engine's Triton GEMMs
// (tk_gemm.linear_parts with fp16 matrices: x rounded to fp16, one dot per K step, K cut into
// pieces) recomputed by a plain mma.sync chain, to see whether a hand-written CUDA kernel can give
// the Triton graphs' bits. parts[s][m][n] = sum over k in piece s of x[m][k] * w[n][k], as one fp32
// mma.sync.m16n8k16 chain over the piece's 16-column steps in order, from zero.
// A warp per (16 weight rows, 8 input rows, piece); slow on purpose (scalar loads): only the bits
// matter here.
#include <cuda_fp16.h>
#include <cstdint>

#include "../csrc/small/common.cuh"

namespace {

__device__ __forceinline__ uint32_t pack(__half lo, __half hi) {
  return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

__global__ void parts_fp16(const __half* __restrict__ x, const __half* __restrict__ w, float* __restrict__ parts,
                           int M, int N, int K, int kper) {
  const int n0 = blockIdx.x * 16, m0 = blockIdx.y * 8, s = blockIdx.z;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int k_lo = s * kper, k_hi = min(K, k_lo + kper);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  const __half zero = __float2half(0.f);
  auto W = [&](int n, int k) { return n < N && k < k_hi ? w[(size_t)n * K + k] : zero; };
  auto X = [&](int m, int k) { return m < M && k < k_hi ? x[(size_t)m * K + k] : zero; };
  for (int k = k_lo; k < k_hi; k += 16) {
    // A = w rows n0.. (16 x 16, row-major), B = x rows m0.. as columns (16 x 8), D = [n][m]
    const uint32_t a0 = pack(W(n0 + g, k + 2 * t), W(n0 + g, k + 2 * t + 1));
    const uint32_t a1 = pack(W(n0 + g + 8, k + 2 * t), W(n0 + g + 8, k + 2 * t + 1));
    const uint32_t a2 = pack(W(n0 + g, k + 2 * t + 8), W(n0 + g, k + 2 * t + 9));
    const uint32_t a3 = pack(W(n0 + g + 8, k + 2 * t + 8), W(n0 + g + 8, k + 2 * t + 9));
    const uint32_t b0 = pack(X(m0 + g, k + 2 * t), X(m0 + g, k + 2 * t + 1));
    const uint32_t b1 = pack(X(m0 + g, k + 2 * t + 8), X(m0 + g, k + 2 * t + 9));
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // d0, d1: row n0 + g, columns (inputs) m0 + 2t, 2t + 1; d2, d3: row n0 + g + 8
  const int n = n0 + g, m = m0 + 2 * t;
  float* p = parts + (size_t)s * M * N;
  if (m < M && n < N) p[(size_t)m * N + n] = d[0];
  if (m + 1 < M && n < N) p[(size_t)(m + 1) * N + n] = d[1];
  if (m < M && n + 8 < N) p[(size_t)m * N + n + 8] = d[2];
  if (m + 1 < M && n + 8 < N) p[(size_t)(m + 1) * N + n + 8] = d[3];
}





// out[m][d] = (e * r) * w[d] over the thread's elements (rounded to fp16 for an fp16 out).
template <bool F16, typename Out>
__device__ __forceinline__ void store_norm(Out* out, const float* w, const float (&e)[8], float r, int m) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = owned<F16>(threadIdx.x, i);
    const float y = __fmul_rn(__fmul_rn(e[i], r), w[d]);
    if constexpr (F16) out[(size_t)m * 1024 + d] = __float2half_rn(y);
    else out[(size_t)m * 1024 + d] = y;
  }
}

// tk_glue._add_rms_kernel (D = 1024) written from its sm_90 PTX under Triton 3.6: a block of 128
// threads per row, thread t holding elements owned<F16>(t, 0..7) (fp16 out: 8t..8t+7, checked on an
// H200 in session 37; fp32 out: written then, not yet run); y = ((p0 + p1) + p2) + ..., s = y + x;
// the thread's sum of squares e1*e1, then fma e0, e2, ..., e7; warp butterfly xor 16..1; the 4 warp
// sums by threads 0..3, butterfly xor 2, 1; mean by div.full, + eps, sqrt.approx.ftz, 1 / it by
// div.full; out = (s * r) * w (rounded to fp16 for an fp16 out). Every operation an intrinsic:
// nothing contracted.
template <typename Out>
__global__ void add_rms_twin(const float* __restrict__ x, const float* __restrict__ parts, const float* __restrict__ w,
                             float* __restrict__ sum, Out* __restrict__ out, float eps, int M, int P) {
  constexpr bool F16 = sizeof(Out) == 2;
  constexpr int D = 1024;
  __shared__ float red[4];
  const int m = blockIdx.x, t = threadIdx.x;
  float e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const size_t off = (size_t)m * D + owned<F16>(t, i);
    float y = parts[off];
    for (int p = 1; p < P; ++p) y = __fadd_rn(y, parts[(size_t)p * M * D + off]);
    e[i] = __fadd_rn(y, x[off]);
    sum[off] = e[i];
  }
  store_norm<F16>(out, w, e, div_full(1.0f, sqrt_approx_ftz(__fadd_rn(eps, mean_square(e, red, D, threadIdx.x, 0u)))), m);
}

// tk_gemm._rms_norm_kernel (D = 1024, 4 warps) from its sm_90 PTX under Triton 3.6: as add_rms_twin
// without the parts, the square root IEEE (sqrt.rn) where add_rms's is sqrt.approx.ftz, and the
// mean's divisor the runtime D converted to float; out = (r * x) * w, fp16 (rounded) or fp32
// (the elements owned<F16>).
// (Written from the PTX in session 37, not yet run on a GPU.)
template <typename Out>
__global__ void rms_norm_twin(const float* __restrict__ x, const float* __restrict__ w, Out* __restrict__ out,
                              float eps, int D) {
  constexpr bool F16 = sizeof(Out) == 2;
  __shared__ float red[4];
  const int m = blockIdx.x, t = threadIdx.x;
  float e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = x[(size_t)m * 1024 + owned<F16>(t, i)];
  store_norm<F16>(out, w, e, div_full(1.0f, __fsqrt_rn(__fadd_rn(eps, mean_square(e, red, D, threadIdx.x, 0u)))), m);
}

// tk_gemm's SwiGLU product with fp16 matrices and fp16 out (the MLP's gate|up before an fp16 down
// projection): the gate and up values as one mma.sync chain each over all of K (swiglu never
// splits), then the epilogue of its sm_90 PTX under Triton 3.6: e = ex2.approx((0 - g) * log2 e),
// q = div.full(g, e + 1), h = u * q, out = h * scale rounded to fp16. A warp per (16 rows, 8 inputs).
// (Written from the PTX in session 37, not yet run on a GPU.)
__global__ void swiglu_twin(const __half* __restrict__ x, const __half* __restrict__ wg, const __half* __restrict__ wu,
                            __half* __restrict__ out, int M, int N, int K, float scale) {
  const int n0 = blockIdx.x * 16, m0 = blockIdx.y * 8;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
  const __half zero = __float2half(0.f);
  auto X = [&](int m, int k) { return m < M ? x[(size_t)m * K + k] : zero; };
  for (int k = 0; k < K; k += 16) {
    const uint32_t b0 = pack(X(m0 + g, k + 2 * t), X(m0 + g, k + 2 * t + 1));
    const uint32_t b1 = pack(X(m0 + g, k + 2 * t + 8), X(m0 + g, k + 2 * t + 9));
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      const __half* w = which == 0 ? wg : wu;
      float* d = which == 0 ? dg : du;
      auto W = [&](int n, int kk) { return w[(size_t)n * K + kk]; };
      const uint32_t a0 = pack(W(n0 + g, k + 2 * t), W(n0 + g, k + 2 * t + 1));
      const uint32_t a1 = pack(W(n0 + g + 8, k + 2 * t), W(n0 + g + 8, k + 2 * t + 1));
      const uint32_t a2 = pack(W(n0 + g, k + 2 * t + 8), W(n0 + g, k + 2 * t + 9));
      const uint32_t a3 = pack(W(n0 + g + 8, k + 2 * t + 8), W(n0 + g + 8, k + 2 * t + 9));
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  const float log2e = __int_as_float(0x3FB8AA3B);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = n0 + g + (j >= 2 ? 8 : 0), m = m0 + 2 * t + (j & 1);
    float e;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(__fsub_rn(0.f, dg[j]), log2e)));
    const float h = __fmul_rn(du[j], div_full(dg[j], __fadd_rn(e, 1.0f)));
    if (m < M && n < N) out[(size_t)m * N + n] = __float2half_rn(__fmul_rn(h, scale));
  }
}

// The latency of the products' accumulator chain: one warp runs `steps` dependent
// mma.sync.m16n8k16 (fp16 in, fp32 accumulate, as one piece of a product) in CHAINS independent
// chains interleaved (fully unrolled by 8 steps); out[0] = clock cycles, out[1] = a sum (kept live).
template <int CHAINS>
__global__ void mma_chain(long long* out, int steps) {
  float d[CHAINS][4] = {};
  uint32_t a = 0x3c003c00u, b = 0x3c003c00u;  // 1.0 halves
  asm volatile("" : "+r"(a), "+r"(b));        // not constants the compiler could fold
  __syncwarp();
  const long long t0 = clock64();
  for (int i = 0; i < steps; i += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
#pragma unroll
      for (int c = 0; c < CHAINS; ++c)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
            : "r"(a), "r"(b));
    }
  }
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) sum += d[c][0];
  if (threadIdx.x == 0) {
    out[0] = t1 - t0;
    out[1] = (long long)sum;
  }
}

// The chain as a product runs it, its operands from shared memory (session 38: the products
// prototype's chains took ~43 cycles a step against mma_chain's ~27): one warp, 64 dependent
// mma.sync.m16n8k16 (a 1,024-column piece), the operands of step s + L loaded before step s's
// mma (fully unrolled, a ring of L + 2 register frames). VAR 0: A (16 weight rows) by ldmatrix.x4,
// B (8 input rows) by two 32-bit shared loads, as the prototype; 1: A only (B in registers); 2: B
// only; 3: neither (mma_chain's case); 4: A by ldmatrix.x4, B by one ldmatrix.x4 every two steps.
// Rows padded by 16 bytes (conflict-free). out[0] = cycles of the 64 steps, out[1] = a sum.
constexpr int CS_RS = 512 * 2 + 16;  // rows of 512 columns (step s reads columns 16s mod 512)
__device__ __forceinline__ void cs_ldsm4(uint32_t a, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ uint32_t cs_lds(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
template <int L, int VAR>
__global__ void chain_smem(long long* out) {
  __shared__ __align__(16) unsigned char sw[16 * CS_RS];
  __shared__ __align__(16) unsigned char sx[8 * CS_RS];
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int i = lane; i < 16 * CS_RS / 4; i += 32) reinterpret_cast<uint32_t*>(sw)[i] = 0x3c003c00u;
  for (int i = lane; i < 8 * CS_RS / 4; i += 32) reinterpret_cast<uint32_t*>(sx)[i] = 0x3c003c00u;
  __syncwarp();
  const uint32_t wb = (uint32_t)__cvta_generic_to_shared(sw) + ((lane & 7) + ((lane >> 3) & 1) * 8) * CS_RS +
                      ((lane >> 4) ? 16u : 0u);
  const uint32_t xb = (uint32_t)__cvta_generic_to_shared(sx) + g * CS_RS + 4 * t;
  const uint32_t xm = (uint32_t)__cvta_generic_to_shared(sx) + (lane & 7) * CS_RS + (lane >> 3) * 16;
  constexpr int RING = L + 2;
  uint32_t A[RING][4], B[RING][2];
  uint32_t a0 = 0x3c003c00u, b0 = 0x3c003c00u;
  asm volatile("" : "+r"(a0), "+r"(b0));
#pragma unroll
  for (int i = 0; i < RING; ++i) {
    A[i][0] = A[i][1] = A[i][2] = A[i][3] = a0;
    B[i][0] = B[i][1] = b0;
  }
  float d[4] = {};
  auto load = [&](int s) {
    const int r = s % RING, k = (16 * s) & 511;
    if (VAR == 0 || VAR == 1 || VAR == 4) cs_ldsm4(wb + 2 * k, A[r]);
    if (VAR == 0 || VAR == 2) B[r][0] = cs_lds(xb + 2 * k), B[r][1] = cs_lds(xb + 2 * k + 16);
    if (VAR == 4 && (s & 1) == 0) {
      uint32_t q[4];
      cs_ldsm4(xm + 2 * k, q);
      B[r][0] = q[0], B[r][1] = q[1], B[(s + 1) % RING][0] = q[2], B[(s + 1) % RING][1] = q[3];
    }
  };
  __syncwarp();
  const long long t0 = clock64();
#pragma unroll
  for (int s = 0; s < L; ++s) load(s);
#pragma unroll
  for (int s = 0; s < 64; ++s) {
    if (s + L < 64) load(s + L);
    const int r = s % RING;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(A[r][0]), "r"(A[r][1]), "r"(A[r][2]), "r"(A[r][3]), "r"(B[r][0]), "r"(B[r][1]));
  }
  const long long t1 = clock64();
  if (lane == 0) {
    out[0] = t1 - t0;
    out[1] = (long long)(d[0] + d[1] + d[2] + d[3]);
  }
}

// The cost of a %globaltimer read (the traces' clock) and of a clock64 read: one thread, 64 reads
// each folded into a sum (kept live); out[0] / out[1] = clock cycles of the 64 reads.
__global__ void timer_reads(long long* out) {
  unsigned long long acc = 0;
  long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < 64; ++i) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    acc += t;
  }
  long long t1 = clock64();
#pragma unroll 1
  for (int i = 0; i < 64; ++i) acc += (unsigned long long)clock64();
  long long t2 = clock64();
  out[0] = t1 - t0;
  out[1] = t2 - t1;
  out[2] = (long long)(acc & 1);
}

template <int L>
void chain_smem_var(long long* o, int var, cudaStream_t st) {
  if (var == 0) chain_smem<L, 0><<<1, 32, 0, st>>>(o);
  else if (var == 1) chain_smem<L, 1><<<1, 32, 0, st>>>(o);
  else if (var == 2) chain_smem<L, 2><<<1, 32, 0, st>>>(o);
  else if (var == 3) chain_smem<L, 3><<<1, 32, 0, st>>>(o);
  else chain_smem<L, 4><<<1, 32, 0, st>>>(o);
}

}  // namespace

extern "C" int dot_bits_timer_reads(void* out, void* stream) {
  timer_reads<<<1, 1, 0, (cudaStream_t)stream>>>((long long*)out);
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_chain_smem(void* out, int lookahead, int var, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  long long* o = (long long*)out;
  if (var < 0 || var > 4) return -1;
  if (lookahead == 1) chain_smem_var<1>(o, var, st);
  else if (lookahead == 2) chain_smem_var<2>(o, var, st);
  else if (lookahead == 4) chain_smem_var<4>(o, var, st);
  else if (lookahead == 8) chain_smem_var<8>(o, var, st);
  else return -1;
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_mma_chain(void* out, int steps, int chains, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  long long* o = (long long*)out;
  if (chains == 1) mma_chain<1><<<1, 32, 0, st>>>(o, steps);
  else if (chains == 2) mma_chain<2><<<1, 32, 0, st>>>(o, steps);
  else if (chains == 4) mma_chain<4><<<1, 32, 0, st>>>(o, steps);
  else mma_chain<8><<<1, 32, 0, st>>>(o, steps);
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_rms_norm(const void* x, const void* w, void* out, int fp16_out, float eps, int M, int D,
                                 void* stream) {
  if (fp16_out) rms_norm_twin<__half><<<M, 128, 0, (cudaStream_t)stream>>>((const float*)x, (const float*)w,
                                                                           (__half*)out, eps, D);
  else rms_norm_twin<float><<<M, 128, 0, (cudaStream_t)stream>>>((const float*)x, (const float*)w, (float*)out,
                                                                  eps, D);
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_swiglu(const void* x, const void* wg, const void* wu, void* out, int M, int N, int K,
                               float scale, void* stream) {
  dim3 grid((N + 15) / 16, (M + 7) / 8);
  swiglu_twin<<<grid, 32, 0, (cudaStream_t)stream>>>((const __half*)x, (const __half*)wg, (const __half*)wu,
                                                     (__half*)out, M, N, K, scale);
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_add_rms(const void* x, const void* parts, const void* w, void* sum, void* out, int fp16_out,
                                float eps, int M, int P, void* stream) {
  if (fp16_out)
    add_rms_twin<__half><<<M, 128, 0, (cudaStream_t)stream>>>((const float*)x, (const float*)parts, (const float*)w,
                                                              (float*)sum, (__half*)out, eps, M, P);
  else
    add_rms_twin<float><<<M, 128, 0, (cudaStream_t)stream>>>((const float*)x, (const float*)parts, (const float*)w,
                                                             (float*)sum, (float*)out, eps, M, P);
  return (int)cudaGetLastError();
}

extern "C" int dot_bits_parts_fp16(const void* x, const void* w, void* parts, int M, int N, int K, int kper,
                                   void* stream) {
  const int S = (K + kper - 1) / kper;
  dim3 grid((N + 15) / 16, (M + 7) / 8, S);
  parts_fp16<<<grid, 32, 0, (cudaStream_t)stream>>>((const __half*)x, (const __half*)w, (float*)parts, M, N, K,
                                                    kper);
  return (int)cudaGetLastError();
}
