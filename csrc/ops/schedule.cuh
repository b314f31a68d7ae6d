// The order of a frame's phases, written once. The producer warpgroup copies the weight slices in
// this order (ops/producer.cuh), the compute phases wait for the staging slot this table names
// (ops/layer.cuh, ops/attn_oproj.cuh), and the QMK_TRACE analysis labels its rows with the names
// (qmk_phase_name, scripts/bench_kernel.py trace_labels).
//
// A frame is QMK_GROUPS stacks: stacks 0 .. GROUPS-2 are the code-predictor passes (pass k draws
// code k + 1), stack GROUPS-1 the talker step. A stack is its layers, each LAYER_PHASES in order,
// then HEAD_PHASE. Every phase ends at a grid-barrier arrive or with its LL words published (one
// trace row each).
#pragma once
#include "matvec.cuh"

namespace qmk {

// The matrix whose slice a phase multiplies (MAT_NONE: the phase streams no weights).
enum Mat : int { MAT_NONE, MAT_QKV, MAT_O, MAT_GATE_UP, MAT_DOWN, MAT_HEAD };

struct Phase {
  const char* name;  // trace label
  Mat mat;
  int slot;          // staging slot of its slice (matvec.cuh SLOT_X / SLOT_Y; -1: none)
  bool talker_only;  // the code predictor's layers skip it
};

// One decoder layer (ops/layer.cuh run_stack).
constexpr Phase LAYER_PHASES[] = {
    {"P1", MAT_QKV, SLOT_X, false},      // input RMSNorm + q|k|v rows (LL words)
    {"P2", MAT_NONE, -1, true},          // split-K attention (ops/attention.cuh)
    {"P2F", MAT_O, SLOT_Y, false},       // attention (CP) or the merge of P2's chunks, + o_proj
                                         // partial sums (ops/attn_oproj.cuh)
    {"P4", MAT_GATE_UP, SLOT_X, false},  // residual + post-norm + gate|up -> SwiGLU
    {"P5", MAT_DOWN, SLOT_Y, false},     // down + residual (LL words)
};
constexpr int N_LAYER_PHASES = sizeof(LAYER_PHASES) / sizeof(LAYER_PHASES[0]);
// After a stack's last layer: final RMSNorm + the head's rows (ops/layer.cuh head_phase).
constexpr Phase HEAD_PHASE = {"HEAD", MAT_HEAD, SLOT_X, false};

constexpr int phase_of(Mat m) {
  for (int i = 0; i < N_LAYER_PHASES; ++i)
    if (LAYER_PHASES[i].mat == m) return i;
  return -1;
}
constexpr int slot_of(Mat m) { return m == MAT_HEAD ? HEAD_PHASE.slot : LAYER_PHASES[phase_of(m)].slot; }
// What the compute phases wait for (scalars: usable in device code).
constexpr int SLOT_QKV = slot_of(MAT_QKV), SLOT_O = slot_of(MAT_O), SLOT_GATE_UP = slot_of(MAT_GATE_UP),
              SLOT_DOWN = slot_of(MAT_DOWN), SLOT_HEAD = slot_of(MAT_HEAD);

// run_stack's code runs the weight phases in this order.
static_assert(phase_of(MAT_QKV) < phase_of(MAT_O) && phase_of(MAT_O) < phase_of(MAT_GATE_UP) &&
                  phase_of(MAT_GATE_UP) < phase_of(MAT_DOWN) && phase_of(MAT_QKV) >= 0,
              "LAYER_PHASES: q|k|v, o_proj, gate|up, down");
// Consecutive weight phases of a layer, and a layer's last and the next layer's first, use
// different slots: the producer fills one while the compute threads read the other.
constexpr bool slots_alternate() {
  int prev = -1, first = -1;
  for (int i = 0; i < N_LAYER_PHASES; ++i) {
    const int s = LAYER_PHASES[i].slot;
    if (s < 0) continue;
    if (s == prev) return false;
    if (first < 0) first = s;
    prev = s;
  }
  return prev != first;
}
static_assert(slots_alternate(), "weight phases alternate between the two slots");

// The stacks of a frame, read by the producer and by the frame kernel (megakernel.cu).
constexpr int TALKER_STACK = QMK_GROUPS - 1;
struct Stack {
  const QmkLayer* layers;
  int nlayers;
  const qmk_bf16* norm;  // final RMSNorm
  const qmk_bf16* head;  // [rows, H]
  int rows;
};
__device__ __forceinline__ Stack frame_stack(const QmkModel* m, int s) {
  return s < TALKER_STACK ? Stack{m->cp, QMK_CP_LAYERS, m->cp_norm, m->cp_head[s], QMK_VC}
                          : Stack{m->talker, QMK_TALKER_LAYERS, m->talker_norm, m->codec_head, QMK_VT};
}

}  // namespace qmk
