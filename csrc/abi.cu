// What the host reads from the library instead of retyping layout.h (C ABI, host code only):
//   qmk_layout_count / qmk_layout_name / qmk_layout_value: every constant the host uses (dims,
//     flags, error words, trace shape) and the size and field offsets of every struct it builds,
//     by name ("H", "FLAG_NO_COMMIT", "sizeof(QmkState)", "QmkState.kv_k", ...);
//   qmk_phase_count / qmk_phase_name / qmk_phase_talker_only: the phase table of ops/schedule.cuh
//     (a layer's phases, then the head), which labels the QMK_TRACE rows;
//   qmk_status_string: the text of an error code the kernel writes to sync[QMK_SYNC_ERR].
// tts_server/engines/megakernel.py reads them at load time, after checking qmk_abi_version.
#include <cstddef>
#include <cstdint>

#include "ops/schedule.cuh"

namespace {

struct Named {
  const char* name;
  int64_t value;
};

#define QMK_CONST(n) {#n, (int64_t)(QMK_##n)},
#define QMK_SIZE(s) {"sizeof(" #s ")", (int64_t)sizeof(s)},
#define QMK_OFF(s, f) {#s "." #f, (int64_t)offsetof(s, f)},

const Named kLayout[] = {
    // clang-format off
    QMK_CONST(ABI_VERSION)
    QMK_CONST(H) QMK_CONST(NH) QMK_CONST(NKV) QMK_CONST(HD) QMK_CONST(QD) QMK_CONST(KVD) QMK_CONST(QKV)
    QMK_CONST(I) QMK_CONST(TALKER_LAYERS) QMK_CONST(CP_LAYERS) QMK_CONST(VT) QMK_CONST(VC) QMK_CONST(GROUPS)
    QMK_CONST(CP_POS) QMK_CONST(MAX_T) QMK_CONST(MAX_CHUNKS) QMK_CONST(MIN_BLOCKS)
    QMK_CONST(FLAG_TALKER_ONLY) QMK_CONST(FLAG_CP_ONLY) QMK_CONST(FLAG_NO_COMMIT) QMK_CONST(FLAG_BARRIER_BENCH)
    QMK_CONST(FLAG_BF16_EXACT) QMK_CONST(FLAG_KV_FP32) QMK_CONST(BARRIER_BENCH_N)
    QMK_CONST(ERR_TIMEOUT) QMK_CONST(ERR_CONTEXT_FULL) QMK_CONST(SYNC_ERR) QMK_CONST(SYNC_WORDS) QMK_CONST(OUT_WORDS)
    QMK_CONST(TRACE_EPOCHS) QMK_CONST(TRACE_MARKS)
    QMK_CONST(X_WORDS) QMK_CONST(QKV_WORDS) QMK_CONST(PART_WORDS) QMK_CONST(OPART_FLOATS) QMK_CONST(ACT_FLOATS)
    QMK_CONST(CP_KV_FLOATS)
    QMK_SIZE(QmkState)
    QMK_OFF(QmkState, kv_k) QMK_OFF(QmkState, kv_v) QMK_OFF(QmkState, pos) QMK_OFF(QmkState, code0)
    QMK_OFF(QmkState, n_sampled) QMK_OFF(QmkState, text_step) QMK_OFF(QmkState, n_trailing)
    QMK_OFF(QmkState, past_hidden) QMK_OFF(QmkState, trailing) QMK_OFF(QmkState, pad_embed) QMK_OFF(QmkState, seen)
    QMK_OFF(QmkState, samp) QMK_OFF(QmkState, out) QMK_OFF(QmkState, x) QMK_OFF(QmkState, qkv)
    QMK_OFF(QmkState, opart) QMK_OFF(QmkState, act) QMK_OFF(QmkState, logits) QMK_OFF(QmkState, part)
    QMK_OFF(QmkState, cp_k) QMK_OFF(QmkState, cp_v) QMK_OFF(QmkState, sync) QMK_OFF(QmkState, dump)
    QMK_OFF(QmkState, max_pos) QMK_OFF(QmkState, max_trailing) QMK_OFF(QmkState, num_slots) QMK_OFF(QmkState, eos)
    QMK_OFF(QmkState, suppress_start) QMK_OFF(QmkState, min_new_tokens) QMK_OFF(QmkState, eps)
    QMK_OFF(QmkState, ll_seq) QMK_OFF(QmkState, timeout_ns)
    QMK_SIZE(QmkSampling)
    QMK_OFF(QmkSampling, do_sample) QMK_OFF(QmkSampling, top_k) QMK_OFF(QmkSampling, temperature)
    QMK_OFF(QmkSampling, top_p) QMK_OFF(QmkSampling, repetition_penalty) QMK_OFF(QmkSampling, sub_do_sample)
    QMK_OFF(QmkSampling, sub_top_k) QMK_OFF(QmkSampling, sub_temperature) QMK_OFF(QmkSampling, sub_top_p)
    QMK_OFF(QmkSampling, pad0) QMK_OFF(QmkSampling, seed)
    QMK_SIZE(QmkLayer)
    QMK_OFF(QmkLayer, in_norm) QMK_OFF(QmkLayer, q) QMK_OFF(QmkLayer, k) QMK_OFF(QmkLayer, v)
    QMK_OFF(QmkLayer, q_norm) QMK_OFF(QmkLayer, k_norm) QMK_OFF(QmkLayer, o) QMK_OFF(QmkLayer, post_norm)
    QMK_OFF(QmkLayer, gate) QMK_OFF(QmkLayer, up) QMK_OFF(QmkLayer, down)
    QMK_SIZE(QmkModel)
    QMK_OFF(QmkModel, talker) QMK_OFF(QmkModel, cp) QMK_OFF(QmkModel, talker_norm) QMK_OFF(QmkModel, cp_norm)
    QMK_OFF(QmkModel, codec_emb) QMK_OFF(QmkModel, codec_head) QMK_OFF(QmkModel, cp_emb) QMK_OFF(QmkModel, cp_head)
    QMK_OFF(QmkModel, inv_freq_talker) QMK_OFF(QmkModel, inv_freq_cp)
    // clang-format on
};
constexpr int kLayoutCount = sizeof(kLayout) / sizeof(kLayout[0]);

// A layer's phases, then the head phase.
qmk::Phase phase(int i) { return i < qmk::N_LAYER_PHASES ? qmk::LAYER_PHASES[i] : qmk::HEAD_PHASE; }

}  // namespace

extern "C" {

int qmk_layout_count() { return kLayoutCount; }
const char* qmk_layout_name(int i) { return i >= 0 && i < kLayoutCount ? kLayout[i].name : nullptr; }
int64_t qmk_layout_value(int i) { return i >= 0 && i < kLayoutCount ? kLayout[i].value : 0; }

int qmk_phase_count() { return qmk::N_LAYER_PHASES + 1; }
const char* qmk_phase_name(int i) { return i >= 0 && i <= qmk::N_LAYER_PHASES ? phase(i).name : nullptr; }
int qmk_phase_talker_only(int i) { return i >= 0 && i <= qmk::N_LAYER_PHASES && phase(i).talker_only; }

const char* qmk_status_string(int code) {
  switch (code) {
    case 0: return "ok";
    case QMK_ERR_TIMEOUT: return "a grid barrier wait or LL poll timed out (blocks not co-resident or a hang)";
    case QMK_ERR_CONTEXT_FULL: return "talker context is full";
    default: return "unknown kernel error code";
  }
}

}  // extern "C"
