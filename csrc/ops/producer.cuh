// The producer warpgroup (QMK_PRODUCER, ops/matvec.cuh): QMK_PRODUCER_THREADS threads beside the
// compute threads that load every weight slice of the frame, in the order the phases consume
// them, into the two staging slots (X: q|k|v, gate|up, heads; Y: o_proj, down). Per slice: wait
// until the slot's "empty" mbarrier says the compute threads are done with it, copy the slice's
// row ranges with 16-byte loads into registers (QMK_PRODUCER_DEPTH per thread in flight) and
// stores to shared memory, then every producer thread arrives on the slot's "full" mbarrier
// (release; the compute threads' wait acquires). The ranges and slot layouts are those of the
// bulk-copy issue functions (ops/layer.cuh issue_*), which do nothing in this mode.
#pragma once
#include "layer.cuh"

#ifndef QMK_PRODUCER_DEPTH
#define QMK_PRODUCER_DEPTH 6
#endif
#ifndef QMK_PRODUCER_ASYNC
#define QMK_PRODUCER_ASYNC 0
#endif


namespace qmk {

struct Producer {
  uint32_t slot0, full0, empty0;  // shared-memory addresses: slot X (Y follows), the mbarriers
  uint32_t pace0;                 // QMK_PRODUCER_BULK: QMK_PACE pacing mbarriers
  uint32_t pidx, pparity;         // pieces issued; bit i: parity of pace[i]'s next completion
  uint32_t eparity;               // bit s: parity to wait for on empty[s] (starts at 1: a fresh slot is empty)
  const uint32_t* sync;
  uint64_t timeout_ns;

  __device__ void init(const Stage& sg, const uint32_t* sync_, uint64_t timeout, uint64_t* pace) {
    pace0 = smem_u32(pace);
    pidx = 0;
    pparity = 0;
    slot0 = smem_u32(sg.slot[0]);
    full0 = smem_u32(sg.mbar);
    empty0 = smem_u32(sg.empty);
    eparity = (1u << NSLOTS) - 1u;
    sync = sync_;
    timeout_ns = timeout;
  }
  __device__ __forceinline__ uint32_t slot_addr(int s) const { return slot0 + (s == SLOT_X ? 0u : (uint32_t)X_BYTES); }

  // Every producer thread: wait until slot s may be written. False on a timeout or another
  // block's error (the compute threads may have left).
  __device__ bool acquire(int s) {
    const uint32_t par = (eparity >> s) & 1u;
    uint32_t ok = 0, spins = 0;
    uint64_t t0 = 0;
    while (true) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok)
                   : "r"(empty0 + 8u * s), "r"(par)
                   : "memory");
      if (ok) break;
      if ((++spins & 255u) == 0) {
        if (*reinterpret_cast<const volatile uint32_t*>(sync + QMK_SYNC_ERR) != 0) return false;
        const uint64_t now = globaltimer();
        if (t0 == 0) t0 = now;
        else if (now - t0 > timeout_ns) return false;
      }
    }
    eparity ^= 1u << s;
    // the compute threads' generic reads of the slot (ordered by the mbarrier) before async writes
    if (QMK_PRODUCER_BULK) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    return true;
  }
  // QMK_PRODUCER_BULK: wait for the piece that last used pacing barrier i.
  __device__ __forceinline__ void pace_wait(uint32_t i) {
    const uint32_t par = (pparity >> i) & 1u;
    uint32_t ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok)
                   : "r"(pace0 + 8u * i), "r"(par)
                   : "memory");
    pparity ^= 1u << i;
  }
  // Wait for every piece in flight (before the slot is published).
  __device__ __forceinline__ void pace_drain() {
    const uint32_t n = pidx < QMK_PACE ? pidx : QMK_PACE;
    for (uint32_t k = 0; k < n; ++k) pace_wait((pidx - n + k) % QMK_PACE);
    pidx = 0;
  }

  // bytes (multiple of 16) from src to slot s at byte offset off. QMK_PRODUCER_ASYNC: 16-byte
  // cp.async (no registers), committed in groups of D per thread with at most two groups in
  // flight; else rounds of D 16-byte loads into registers, then their stores.
  __device__ __forceinline__ void copy(int s, uint32_t off, const void* src, uint32_t bytes, bool keep) {
    constexpr int D = QMK_PRODUCER_DEPTH;
    constexpr uint32_t STEP = QMK_PRODUCER_THREADS * 16;
    const uint32_t t16 = (threadIdx.x - QMK_THREADS) * 16u;
    const char* g = static_cast<const char*>(src) + t16;
    const uint32_t d = slot_addr(s) + off + t16;
    uint64_t pol;
    if (keep) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    else asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#if QMK_PRODUCER_BULK
    for (uint32_t o = 0; o < bytes; o += QMK_PIECE) {
      const uint32_t nb = min((uint32_t)QMK_PIECE, bytes - o);
      const uint32_t i = pidx % QMK_PACE;
      if (pidx >= QMK_PACE) pace_wait(i);
      pidx += 1;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(pace0 + 8u * i), "r"(nb) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
              slot_addr(s) + off + o),
          "l"(static_cast<const char*>(src) + o), "r"(nb), "r"(pace0 + 8u * i), "l"(pol)
          : "memory");
    }
    return;
#endif
    const uint32_t n = bytes > t16 ? (bytes - t16 + STEP - 1) / STEP : 0;  // this thread's 16-byte pieces
    for (uint32_t i0 = 0; i0 < n; i0 += D) {
#if QMK_PRODUCER_ASYNC
#pragma unroll
      for (int i = 0; i < D; ++i)
        if (i0 + i < n)
          asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d + (i0 + i) * STEP),
                       "l"(g + (size_t)(i0 + i) * STEP), "l"(pol)
                       : "memory");
      asm volatile("cp.async.commit_group;" ::: "memory");
      asm volatile("cp.async.wait_group 1;" ::: "memory");
#else
      uint4 r[D];
#pragma unroll
      for (int i = 0; i < D; ++i)
        if (i0 + i < n)
          asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                       : "=r"(r[i].x), "=r"(r[i].y), "=r"(r[i].z), "=r"(r[i].w)
                       : "l"(g + (size_t)(i0 + i) * STEP), "l"(pol));
#pragma unroll
      for (int i = 0; i < D; ++i)
        if (i0 + i < n)
          asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(d + (i0 + i) * STEP), "r"(r[i].x), "r"(r[i].y),
                       "r"(r[i].z), "r"(r[i].w)
                       : "memory");
#endif
    }
  }
  __device__ __forceinline__ void publish(int s) {
    if (QMK_PRODUCER_ASYNC) asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's pieces landed
    if (QMK_PRODUCER_BULK) pace_drain();  // the slice's pieces landed (seen through the pacing barriers)
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(full0 + 8u * s) : "memory");
  }

  // One layer's four slices (as issue_qkv, issue_oproj, issue_gate_up, issue_rows<I> down).
  __device__ bool layer(const QmkLayer& w, bool cp, int L) {
    const int G = gridDim.x, b = blockIdx.x;
    constexpr uint32_t RB = QMK_H * 2;
    const bool keep = cp && l2_keep(L, false), keep_big = cp && l2_keep(L, true), keep_qkv = cp && l2_keep(L, true, true);
    int q0, qn;
    rows4_of(b, G, QMK_QKV, q0, qn);
    if (!acquire(SLOT_X)) return false;
    for (int part = 0; part < 3; ++part) {
      const int lo = part == 0 ? 0 : part == 1 ? QMK_QD : QMK_QD + QMK_KVD;
      const int hi = part == 0 ? QMK_QD : part == 1 ? QMK_QD + QMK_KVD : QMK_QKV;
      const int a = max(q0, lo), e = min(q0 + qn, hi);
      if (a < e) {
        const qmk_bf16* base = part == 0 ? w.q : part == 1 ? w.k : w.v;
        copy(SLOT_X, (a - q0) * RB, base + (size_t)(a - lo) * QMK_H, (e - a) * RB, keep_qkv);
      }
    }
    publish(SLOT_X);
    {
      int g, gi, r0, n;
      oproj_rows(g, gi, r0, n);
      if (!acquire(SLOT_Y)) return false;
      copy(SLOT_Y, 0, w.o + ((size_t)g * QMK_H + r0) * (2 * QMK_HD), n * 2 * QMK_HD * 2, keep);
      publish(SLOT_Y);
    }
    int i0, in_;
    rows4_of(b, G, QMK_I, i0, in_);
    if (!acquire(SLOT_X)) return false;
    copy(SLOT_X, 0, w.gate + (size_t)i0 * QMK_H, in_ * RB, keep_big);
    copy(SLOT_X, in_ * RB, w.up + (size_t)i0 * QMK_H, in_ * RB, keep_big);
    publish(SLOT_X);
    int h0, hn;
    rows4_of(b, G, QMK_H, h0, hn);
    if (!acquire(SLOT_Y)) return false;
    copy(SLOT_Y, 0, w.down + (size_t)h0 * QMK_I, hn * QMK_I * 2, keep);
    publish(SLOT_Y);
    return true;
  }
  __device__ bool head(const qmk_bf16* w, int V) {
    int r0, n;
    rows4_of(blockIdx.x, gridDim.x, V, r0, n);
    if (!acquire(SLOT_X)) return false;
    copy(SLOT_X, 0, w + (size_t)r0 * QMK_H, n * QMK_H * 2, false);
    publish(SLOT_X);
    return true;
  }

  // The frame's slices in the order run_stack / head_phase consume them (megakernel.cu).
  __device__ void run(const QmkModel* m, bool cp_runs, bool talker_runs) {
#ifdef QMK_PRODUCER_EMPTY
    return;
#endif
    if (cp_runs)
      for (int k = 0; k < QMK_GROUPS - 1; ++k) {
        for (int L = 0; L < QMK_CP_LAYERS; ++L)
          if (!layer(m->cp[L], true, L)) return;
        if (!head(m->cp_head[k], QMK_VC)) return;
      }
    if (talker_runs) {
      for (int L = 0; L < QMK_TALKER_LAYERS; ++L)
        if (!layer(m->talker[L], false, L)) return;
      head(m->codec_head, QMK_VT);
    }
  }
};

}  // namespace qmk
