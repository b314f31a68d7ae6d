"""The CUDA megakernel (csrc/, tts_server/engines/megakernel.py).

CPU tests: the library builds with nvcc for sm_90a (where nvcc exists; `make -C csrc check`) and,
loaded without a GPU, reports its layout: the ABI version, the constants, the struct offsets the
ctypes mirrors and the model table follow, the phase table the trace labels come from; plus the
host-side weight layouts and the sampling-settings packing. GPU tests (marked `gpu`) run the full-size
synthetic model against the fp32 reference and the PyTorch engine (scripts/bench_kernel.py has
the same checks at evidence scale).
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tts_server.engines import megakernel as mk
from tts_server.engines.contract import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_kernel", ROOT / "scripts" / "bench_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def check_lib():
    """The sm_90a library of `make -C csrc check` (built here where nvcc exists; loading it and
    reading its layout needs no GPU)."""
    if NVCC is None:
        pytest.skip("nvcc not installed: the CUDA library cannot be built here")
    r = subprocess.run(["make", "-C", str(ROOT / "csrc"), "check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ROOT / "csrc" / "build" / "check" / mk.LIB_NAME


def test_library_reports_its_layout(check_lib):
    """The ABI version matches, the ctypes mirrors match the library field by field (load_library
    checks), and the constants are csrc/layout.h's."""
    L = mk.load_library(check_lib).layout
    assert L.ABI_VERSION == mk.ABI_VERSION
    assert (L.H, L.NH, L.NKV, L.HD, L.I, L.TALKER_LAYERS, L.CP_LAYERS) == (1024, 16, 8, 128, 3072, 28, 5)
    assert L.QKV == L.QD + 2 * L.KVD and L.QD == L.NH * L.HD
    assert L.size("QmkSampling") == ctypes.sizeof(mk.QmkSampling) == 48
    assert L.size("QmkState") == ctypes.sizeof(mk.QmkState)
    assert L.size("QmkModel") == (L.size("QmkLayer") * (L.TALKER_LAYERS + L.CP_LAYERS)
                                  + 8 * (4 + 2 * (L.GROUPS - 1) + 2))
    assert L.PART_WORDS == L.MAX_T * L.NH * L.MAX_CHUNKS * (L.HD + 2)
    with pytest.raises(AttributeError, match="exports no constant 'NOPE'"):
        L.NOPE


def test_abi_mismatch_fails_with_a_clear_message(check_lib, monkeypatch):
    monkeypatch.setattr(mk, "ABI_VERSION", mk.ABI_VERSION - 1)
    with pytest.raises(RuntimeError, match=r"has megakernel ABI \d+, this tts_server needs ABI \d+: rebuild it"):
        mk.load_library(check_lib)


def test_a_mirror_that_differs_is_named(check_lib):
    L = mk.load_library(check_lib).layout

    class QmkSampling(ctypes.Structure):  # seed and top_k swapped
        _fields_ = [(n, t) for n, t in mk.QmkSampling._fields_ if n not in ("top_k", "seed")] + [
            ("seed", ctypes.c_uint64), ("top_k", ctypes.c_int32)]

    with pytest.raises(RuntimeError, match="QmkSampling differs.*top_k"):
        mk.check_mirror(L, QmkSampling, check_lib)


def test_model_table_puts_each_pointer_at_its_field(check_lib):
    """model_table writes every QmkModel word at the offset the library reports (tiny stand-in
    tensors on the CPU: the table only needs their pointers)."""
    import torch

    from tts_server.model.weights import CodecIds, DecodeWeights, LayerWeights, LMConfig, LMWeights

    L = mk.load_library(check_lib).layout
    t = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731

    def lm(n):
        cfg = LMConfig(n, 64, 2, 1, 32, 64, 1e-6, 1e6)
        # matrices 4 x 64 (o_proj 4 x 512: 64 columns per kv-head group), norms 64
        shapes = [(64,), (4, 64), (4, 64), (4, 64), (64,), (64,), (4, 512), (64,), (4, 64), (4, 64), (4, 64)]
        return LMWeights(cfg, tuple(LayerWeights(*(t(*sh) for sh in shapes)) for _ in range(n)), t(64))

    ids = CodecIds(vocab_size=8, eos=5, pad=4, bos=3, suppress_start=6, num_code_groups=L.GROUPS,
                   predictor_vocab_size=8)
    w = DecodeWeights(lm(L.TALKER_LAYERS), t(8, 64), t(8, 64), lm(L.CP_LAYERS),
                      tuple(t(8, 64) for _ in range(L.GROUPS - 1)), tuple(t(8, 64) for _ in range(L.GROUPS - 1)),
                      None, ids)
    keep: list = []
    table = mk.model_table(w, L, keep).tolist()
    assert len(table) * 8 == L.size("QmkModel") and 0 not in table and len(set(table)) == len(table)
    model, layer = L.fields("QmkModel"), L.fields("QmkLayer")
    # tensors passed as they are keep their pointers
    assert table[model["talker_norm"] // 8] == w.talker.final_norm.data_ptr()
    assert table[model["cp_emb"] // 8 + 14] == w.predictor_embeddings[14].data_ptr()
    off = model["cp"] + 3 * L.size("QmkLayer") + layer["post_norm"]
    assert table[off // 8] == w.predictor.layers[3].post_norm.data_ptr()
    off = model["talker"] + 27 * L.size("QmkLayer") + layer["in_norm"]
    assert table[off // 8] == w.talker.layers[27].input_norm.data_ptr()


def test_sampling_bytes_layout():
    b = mk.sampling_bytes(SamplingConfig(seed=2**40 + 5, top_k=50, temperature=0.9))
    assert len(b) == 48
    assert int.from_bytes(b[40:48], "little") == 2**40 + 5
    assert int.from_bytes(b[4:8], "little") == 50


def test_grouped_o_proj_layout():
    """Every o_proj handed to the kernel is head-group major: o[g, r, c] = o_proj[r, 256 g + c]
    (csrc/ops/attn_oproj.cuh reads one contiguous slice per block)."""
    import torch

    o = torch.randn(1024, 2048)
    g = mk.grouped_o(o, 8)
    assert g.shape == (8, 1024, 256) and g.is_contiguous()
    for grp, row, col in ((0, 0, 0), (3, 17, 5), (7, 1023, 255)):
        assert g[grp, row, col] == o[row, 256 * grp + col]


def _mma_matvec_emulated(wl, xsp, rows: int, k: int):
    """The kernel's tensor-core matvec (csrc/ops/matvec.cuh mv_mma) replayed in float64 from its
    inputs as laid out in memory: wl = mma_layout(W) viewed [groups, K/64, 32 lanes, 8], xsp =
    split activations [K/64, 32 lanes, 4]. Each m16n8k16 is built from the lanes' fragments as
    the PTX ISA defines them (A row-major 16x16, B 16x8, C 16x8) and the useful products are
    picked and summed per row exactly as mv_mma does."""
    import torch

    out = torch.zeros(rows, dtype=torch.float64)
    for gi in range(rows // 4):
        for c in range(k // 64):
            a = torch.zeros(16, 16, dtype=torch.float64)
            b = torch.zeros(16, 8, dtype=torch.float64)
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                f = wl[gi, c, lane]
                for e in range(2):  # registers a0a1, a2a3, a4a5, a6a7 in order
                    a[g, 2 * tq + e], a[g + 8, 2 * tq + e] = f[e], f[2 + e]
                    a[g, 2 * tq + 8 + e], a[g + 8, 2 * tq + 8 + e] = f[4 + e], f[6 + e]
                    b[2 * tq + e, g], b[2 * tq + 8 + e, g] = xsp[c, lane, e], xsp[c, lane, 2 + e]
            cm = a @ b
            for lane in range(32):
                g, tq, q = lane // 4, lane % 4, lane // 16
                c0, c1, c2, c3 = cm[g, 2 * tq], cm[g, 2 * tq + 1], cm[g + 8, 2 * tq], cm[g + 8, 2 * tq + 1]
                v = c0 + c1 if tq == q else c2 + c3 if tq == q + 2 else 0.0
                out[4 * gi + g % 4] += v
    return out


def test_mma_layout_and_split_give_the_matvec():
    """Host weight layout (mma_layout) + activation split (as split_store writes it) + the mma
    fragment bookkeeping of mv_mma compute W @ x: checks the permutation and the index algebra
    on the CPU; tests/test_megakernel.py's GPU tests check the kernel against fp32 references."""
    import torch

    rows, k = 8, 128
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(k, generator=gen)
    wl = mk.mma_layout(w).view(rows // 4, k // 64, 32, 8).double()
    assert mk.mma_layout(w).is_contiguous() and mk.mma_layout(w).numel() == w.numel()
    hi = x.to(torch.bfloat16).float()
    lo = (x - hi).to(torch.bfloat16).float()
    xsp = torch.zeros(k // 64, 32, 4, dtype=torch.float64)
    for d in range(0, k, 4):  # split_store(xsp, d, x[d:d+4])
        c, hf, tq = d >> 6, (d >> 4) & 3, (d >> 2) & 3
        xsp[c, 8 * hf + tq] = hi[d:d + 4].double()
        xsp[c, 8 * hf + 4 + tq] = lo[d:d + 4].double()
    got = _mma_matvec_emulated(wl, xsp, rows, k)
    want = w.double() @ (hi.double() + lo.double())
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # and the split keeps 16 significant bits of x
    assert torch.allclose(hi + lo, x, rtol=2.0 ** -16, atol=0)
    # a block's slice of whole 4-row groups is one contiguous range of the layout
    assert torch.equal(mk.mma_layout(w)[1], mk.mma_layout(w[4:8])[0])


def test_trace_labels_count_barriers(check_lib):
    """One label per trace row of a frame, built from the library's phase table: 4 per CP layer
    (attention and o_proj fused), 5 per talker layer (split-K attention, then its merge fused with
    o_proj), one head per stack (the QMK_TRACE analysis in bench_kernel depends on it)."""
    bk = _bench_module()
    L = mk.load_library(check_lib).layout
    lab = bk.trace_labels(L)
    assert len(lab) == 15 * (5 * 4 + 1) + 28 * 5 + 1
    assert len(lab) < L.TRACE_EPOCHS
    assert lab[:4] == [("cp", "P2F"), ("cp", "P4"), ("cp", "P5"), ("cp", "P1")]
    assert lab[19:22] == [("cp", "HEAD"), ("cp", "SAMP+P1"), ("cp", "P2F")]
    assert lab[15 * 21 - 1:15 * 21 + 1] == [("cp", "SAMP+P1"), ("talker", "P2")]
    assert lab[-2:] == [("talker", "HEAD"), ("talker", "END")]


def test_library_loads_when_built():
    lib_path = ROOT / "csrc" / mk.LIB_NAME
    if not lib_path.exists():
        pytest.skip("csrc/libqwen_megakernel.so not built (make kernel)")
    lib = mk.load_library(lib_path)  # checks ABI version and struct layouts
    assert lib.layout.ABI_VERSION == mk.ABI_VERSION


# ---------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def full_weights():
    return _bench_module().synthetic_weights()


@pytest.mark.gpu
@pytest.mark.slow
def test_teacher_forced_logits_match_fp32(full_weights):
    r = _bench_module().teacher_forced(full_weights, frames=24)
    assert r["rel_err_max"] <= 1e-2, r
    assert r["top1"] >= 0.995, r


@pytest.mark.gpu
@pytest.mark.slow
def test_teacher_forced_at_a_long_context(full_weights):
    """Talker contexts 521..528: the split-K attention at its chunk cap (16 chunks per kv head on
    132 SMs, 14 on 114) and the merge of all of them."""
    r = _bench_module().teacher_forced(full_weights, frames=8, length=520)
    assert r["frames"] == 8, r
    assert r["rel_err_max"] <= 1e-2, r
    assert r["top1"] >= 0.995, r


@pytest.mark.gpu
@pytest.mark.slow
def test_greedy_codes_match_torch_engine(full_weights):
    r = _bench_module().greedy_e2e(full_weights, prompts=3, frames=32)
    assert all(p["all_identical"] for p in r["prompts"]), r


@pytest.mark.gpu
@pytest.mark.slow
def test_sampling_is_seeded_and_follows_rules(full_weights):
    r = _bench_module().sampling_repro(full_weights)
    assert all(r.values()), r


@pytest.mark.gpu
def test_context_full_is_reported():
    bk = _bench_module()
    w = bk.random_weights()
    eng = mk.MegakernelEngine(w, max_streams=1, max_positions=24)
    eng.prefill(0, bk.make_prompt(0, length=20), SamplingConfig(seed=0))
    for _ in range(4):
        eng.step([0])
    with pytest.raises(RuntimeError, match="context is full"):
        eng.step([0])
    codes = np.array(eng.out[0, :16].cpu())
    assert (codes[1:] < 2048).all()
