// The producer warpgroup: QMK_PRODUCER_THREADS threads launched beside the compute threads of
// every block, of which one thread copies every weight slice of the frame into the two staging
// slots, in the order the phases consume them: ops/schedule.cuh (which slice, which slot).
//
// Why a separate thread, and why small pieces: a whole slice (32-96 KB per SM) issued at once by
// every SM makes each dependent L2 read of a phase wait behind it (an L2 hit took ~1.3 us with a
// 64 KB bulk copy in flight per SM against ~0.18 us with 16 KB: tools/probes/latency_probe.cu), and
// the grid barrier's release fence waits for the SM's bulk copies in flight
// (tools/probes/fence_probe.cu). So the slice goes as PIECE-byte bulk copies, one in flight: a
// shallow, continuous stream that no compute thread has to issue.
//
// Per slice: wait until the slot's "empty" mbarrier says the compute threads are done with it,
// then copy the pieces (Producer::copy); the last piece completes on the slot's "full" mbarrier,
// which the compute threads wait for (Stage::wait).
#pragma once
#include "layer.cuh"

namespace qmk {

// The weight stream is copied with an L2 evict-first policy, so that it does not push the small,
// reused data (norm weights, activations, KV caches) out of L2. The exception: code-predictor
// slices that each of the frame's 15 passes reads again are copied evict-last, so that their
// copies come from L2 and complete sooner: the big slices (q|k|v, gate|up) of the first
// L2_KEEP_BIG CP layers and the q|k|v slices of the first L2_KEEP_QKV (29 MB in all). H100, same
// call, ctx 100: big slices of layer 0 (21 MB) CP pass 90.4-90.5 vs 92.8-93.6 us, frame 1934-1943
// vs 1945-1953; + layer 1's q|k|v (8.4 MB) CP pass 88.4-88.6 vs 89.3-90.3, frame 1920-1927 vs
// 1941-1947; every slice of layer 0 (32 MB) CP pass 89.0-91.3; q|k|v of 3 layers (38 MB), big
// slices of 2 (42 MB) or more thrash the 50 MB L2 (slower).
constexpr int L2_KEEP_BIG = 1;
constexpr int L2_KEEP_QKV = 2;
// Whether CP layer L's slices (big: q|k|v or gate|up; qkv: q|k|v) are copied evict-last.
__host__ __device__ constexpr bool l2_keep(int L, bool big, bool qkv = false) {
  return (big && L < L2_KEEP_BIG) || (qkv && L < L2_KEEP_QKV);
}
// Bytes per bulk copy, one in flight. H100, same call (csrc/PERF_LOG.md round 7): 16 KB frame
// 1750-1766 us; 8 KB 2075-2084, 32 KB 2027-2036; a later call 16 KB 1686-1699, 12 KB 1782-1804,
// 24 KB 1752-1781. Two 16 KB pieces in flight (round 6): 2021-2027 vs 1805-1809.
constexpr uint32_t PIECE = 16384;

struct Producer {
  uint32_t slot0, full0, empty0;  // shared-memory addresses: slot X (Y follows), the mbarriers
  uint32_t pace;                  // the pacing mbarrier of the pieces
  uint32_t last_bar, last_par;    // the mbarrier and parity the piece in flight completes on
  bool in_flight;
  uint32_t eparity;               // bit s: parity to wait for on empty[s] (starts at 1: a fresh slot is empty)
  uint32_t fparity;               // bit s: parity of full[s]'s next completion
  uint32_t pparity;               // parity of pace's next completion
  uint64_t evict_first, evict_last;
  uint32_t* sync;
  uint64_t timeout_ns;

  __device__ void init(const Stage& sg, uint64_t* pace_bar) {
    slot0 = smem_u32(sg.slot[0]);
    full0 = smem_u32(sg.mbar);
    empty0 = smem_u32(sg.empty);
    pace = smem_u32(pace_bar);
    in_flight = false;
    eparity = (1u << NSLOTS) - 1u;
    fparity = 0;
    pparity = 0;
    sync = sg.sync;
    timeout_ns = sg.timeout_ns;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(evict_last));
  }
  __device__ __forceinline__ uint32_t slot_addr(int s) const { return slot0 + (s == SLOT_X ? 0u : (uint32_t)X_BYTES); }

  // Bounded wait on mbarrier a's phase: false on a timeout or another block's error (the compute
  // threads may have left).
  __device__ bool wait_bar(uint32_t a, uint32_t par) const {
    Spin<255u> spin;
    while (!mbar_try_wait(a, par))
      if (spin.give_up(sync, timeout_ns)) return false;
    return true;
  }
  // Wait until slot s may be written.
  __device__ bool acquire(int s) {
    if (!wait_bar(empty0 + 8u * s, (eparity >> s) & 1u)) return false;
    eparity ^= 1u << s;
    // the compute threads' generic reads of the slot (ordered by the mbarrier) before async writes
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    return true;
  }
  // bytes (a multiple of 16) from src to slot s at byte offset off, as pieces, one in flight: each
  // piece completes on the pace mbarrier and the next is issued once it has landed. last: this
  // range ends the slot's slice; its last piece completes on "full" (arrive.expect_tx of that
  // piece's bytes: the compute threads see the slot full once it lands, and every earlier piece
  // had landed before it was issued).
  __device__ bool copy(int s, uint32_t off, const void* src, uint32_t bytes, bool keep, bool last) {
    const uint32_t full = full0 + 8u * s;
    if (bytes == 0) {
      if (last) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(full) : "memory");
      return true;
    }
    const uint64_t pol = keep ? evict_last : evict_first;
    for (uint32_t o = 0; o < bytes; o += PIECE) {
      const uint32_t nb = min(PIECE, bytes - o);
      if (in_flight && !wait_bar(last_bar, last_par)) return false;
      uint32_t bar;
      if (last && o + nb == bytes) {
        bar = full;
        last_par = (fparity >> s) & 1u;
        fparity ^= 1u << s;
      } else {
        bar = pace;
        last_par = pparity;
        pparity ^= 1u;
      }
      last_bar = bar;
      in_flight = true;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(nb) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
              slot_addr(s) + off + o),
          "l"(static_cast<const char*>(src) + o), "r"(nb), "r"(bar), "l"(pol)
          : "memory");
    }
    return true;
  }

  // The slice of matrix M (this block's rows) -> slot s. CP layer L's big slices may be kept in L2.
  template <Mat M>
  __device__ bool slice(const QmkLayer& w, bool cp, int L, int s) {
    const int G = gridDim.x, b = blockIdx.x;
    constexpr uint32_t RB = QMK_H * 2;
    if constexpr (M == MAT_QKV) {  // rows [q0, q0 + qn) of the virtual [q; k; v] matrix
      const bool keep = cp && l2_keep(L, true, true);
      int q0, qn;
      rows4_of(b, G, QMK_QKV, q0, qn);
      if (!acquire(s)) return false;
      for (int part = 0; part < 3; ++part) {
        const int lo = part == 0 ? 0 : part == 1 ? QMK_QD : QMK_QD + QMK_KVD;
        const int hi = part == 0 ? QMK_QD : part == 1 ? QMK_QD + QMK_KVD : QMK_QKV;
        const int a = max(q0, lo), e = min(q0 + qn, hi);
        if (a < e) {
          const qmk_bf16* base = part == 0 ? w.q : part == 1 ? w.k : w.v;
          if (!copy(s, (a - q0) * RB, base + (size_t)(a - lo) * QMK_H, (e - a) * RB, keep, e == q0 + qn)) return false;
        }
      }
      return true;
    } else if constexpr (M == MAT_O) {  // o_proj rows x the 256 columns of kv group g (head-group major: one range)
      int g, gi, r0, n;
      oproj_rows(g, gi, r0, n);
      constexpr uint32_t OB = 2 * QMK_HD * 2;
      return acquire(s) && copy(s, 0, w.o + ((size_t)g * QMK_H + r0) * (2 * QMK_HD), n * OB, false, true);
    } else if constexpr (M == MAT_GATE_UP) {  // gate rows then up rows [i0, i0 + in_)
      const bool keep = cp && l2_keep(L, true);
      int i0, in_;
      rows4_of(b, G, QMK_I, i0, in_);
      return acquire(s) && copy(s, 0, w.gate + (size_t)i0 * QMK_H, in_ * RB, keep, false) &&
             copy(s, in_ * RB, w.up + (size_t)i0 * QMK_H, in_ * RB, keep, true);
    } else if constexpr (M == MAT_DOWN) {  // down rows [h0, h0 + hn)
      int h0, hn;
      rows4_of(b, G, QMK_H, h0, hn);
      return acquire(s) && copy(s, 0, w.down + (size_t)h0 * QMK_I, hn * QMK_I * 2, false, true);
    } else {
      static_assert(M == MAT_NONE, "a layer phase's matrix");
      return true;
    }
  }
  // One layer's slices, phase P onwards, in the order of the table (ops/schedule.cuh).
  template <int P = 0>
  __device__ bool layer(const QmkLayer& w, bool cp, int L) {
    if constexpr (P == N_LAYER_PHASES) {
      return true;
    } else {
      constexpr Mat M = LAYER_PHASES[P].mat;
      constexpr int S = LAYER_PHASES[P].slot;
      return slice<M>(w, cp, L, S) && layer<P + 1>(w, cp, L);
    }
  }
  // A head's rows [r0, r0 + n) of [V, H].
  __device__ bool head(const qmk_bf16* w, int V) {
    int r0, n;
    rows4_of(blockIdx.x, gridDim.x, V, r0, n);
    return acquire(SLOT_HEAD) && copy(SLOT_HEAD, 0, w + (size_t)r0 * QMK_H, n * QMK_H * 2, false, true);
  }
  // One stack of the frame (ops/schedule.cuh frame_stack): its layers, then its head.
  __device__ bool stack(const Stack& sk, bool cp) {
    for (int L = 0; L < sk.nlayers; ++L)
      if (!layer(sk.layers[L], cp, L)) return false;
    return head(sk.head, sk.rows);
  }

  // The frame's slices in the order the compute threads consume them (megakernel.cu): the code
  // predictor's passes, then the talker step.
  __device__ void run(const QmkModel* m, bool cp_runs, bool talker_runs) {
    if (cp_runs)
      for (int k = 0; k < TALKER_STACK; ++k)
        if (!stack(frame_stack(m, k), true)) return;
    if (talker_runs) stack(frame_stack(m, TALKER_STACK), false);
  }
};

}  // namespace qmk
