// The experiment behind csrc/attn/decode_split.cuh: persistent-grid versions of the talker's decode
// attention split (tk_attention._attn_split_tc_kernel with bf16 pools of 64-position pages, one page a
// split, 2 query heads a kv head, 2 bf16 terms) meant to give its bits while streaming K/V closer to
// the memory bandwidth (the Triton kernel's short programs keep too few loads in flight: H200, B = 64
// mixed, 2.8 TB/s). The walk, the pipeline and v2 live in that header (see it); here:
//   v1     the walk with the twin's math read from shared memory element for element as
//          scripts/attn_split_twin.cu reads it from global memory (S - 1 items in flight while one is
//          computed), and the same walk with the math left out (the walk's ceiling)
//   v3     NG groups of 4 warps a block on one ring of R stages (below)
// and the grid queries and launchers of all three. scripts/gpu_attn_persist.py checks the bits of
// each against Triton and times them (needs a GPU). H200, session 43: v2 is the fastest (v3 within
// 2%), so the engine's library (csrc/attn/decode_split.cu) builds v2.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

#include "../csrc/attn/decode_split.cuh"

namespace qda {

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
  const int row0 = it.b * NH + it.kvh * G;
  split_softmax(s, it.sp * SPLIT, it.n, scale, w, g, t, red, ph, m_out + (size_t)row0 * nsplit + it.sp,
                l_out + (size_t)row0 * nsplit + it.sp, nsplit);
  // ---- acc: the warp's four 8-column tiles of d (8w + 32r), 4 steps of 16 positions a term
  float acc[4][4] = {};
#pragma unroll
  for (int term = 0; term < 2; ++term)
#pragma unroll
    for (int kk = 0; kk < SPLIT / 16; ++kk) {
      uint32_t a[4];
      p_fragment(a, ph, term, kk, g, t);
#pragma unroll
      for (int r = 0; r < 4; ++r) mma_bf16(acc[r], a, vb[kk][r][0], vb[kk][r][1]);
    }
  if (g < G) {
    float* o = acc_out + ((size_t)(row0 + g) * nsplit + it.sp) * HD + 8 * w + 2 * t;
#pragma unroll
    for (int r = 0; r < 4; ++r) *reinterpret_cast<float2*>(o + 32 * r) = make_float2(acc[r][0], acc[r][1]);
  }
}

// The persistent walk (v1): S stages of (K tile, V tile, q rows); MATH false: the same walk and
// pipeline with each stage only touched (a word a thread of K and of V xor-ed into sink[block][thread]).
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
  // (K / V under v2's L2 evict_first policy since session 45; v3 was measured before without it)
  const uint64_t policy = evict_first_policy();

  // the start: items j < R, group j % NG issuing (lb: this group's issue cursor, items only grow)
  int lb = 0;
  for (int j = grp; j < R; j += NG) {
    const int v = blockIdx.x + j * stride;
    if (v < total) {
      const Item it = decode_warp(v, lb, off, lens_s, a.batch);
      issue_v2(gtid, base + j * STAGE_BYTES, it, a.table[(size_t)it.b * a.max_blocks + it.sp], a.q, a.kpool,
               a.vpool, policy);
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
                      issue_v2(gtid, base + s * STAGE_BYTES, ni, npage, a.q, a.kpool, a.vpool, policy);
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

}  // namespace qda

using namespace qda;

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
