"""The CUDA megakernel (csrc/, tts_server/kernels/megakernel.py).

CPU tests: the library compiles with nvcc for sm_90a (where nvcc exists), the ctypes mirrors match
csrc/layout.h, and the sampling-settings packing. GPU tests (marked `gpu`) run the full-size
synthetic model against the fp32 reference and the PyTorch engine (scripts/bench_kernel.py has
the same checks at evidence scale).
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
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


def _layout_define(name: str) -> int:
    text = (ROOT / "csrc" / "layout.h").read_text()
    m = re.search(rf"#define {name} \(?(\d+)", text)
    assert m, name
    return int(m.group(1))


def test_python_mirrors_layout_h():
    assert mk.ABI_VERSION == _layout_define("QMK_ABI_VERSION")
    for py, c in ((mk.H, "QMK_H"), (mk.NH, "QMK_NH"), (mk.NKV, "QMK_NKV"), (mk.HD, "QMK_HD"), (mk.I, "QMK_I"),
                  (mk.TALKER_LAYERS, "QMK_TALKER_LAYERS"), (mk.CP_LAYERS, "QMK_CP_LAYERS"), (mk.VT, "QMK_VT"),
                  (mk.VC, "QMK_VC"), (mk.GROUPS, "QMK_GROUPS"), (mk.CP_POS, "QMK_CP_POS"),
                  (mk.MAX_T, "QMK_MAX_T"), (mk.MAX_CHUNKS, "QMK_MAX_CHUNKS"), (mk.SYNC_WORDS, "QMK_SYNC_WORDS"),
                  (mk.SYNC_ERR, "QMK_SYNC_ERR"), (mk.OUT_WORDS, "QMK_OUT_WORDS"),
                  (mk.FLAG_TALKER_ONLY, "QMK_FLAG_TALKER_ONLY"), (mk.FLAG_CP_ONLY, "QMK_FLAG_CP_ONLY"),
                  (mk.FLAG_NO_COMMIT, "QMK_FLAG_NO_COMMIT"), (mk.FLAG_BARRIER_BENCH, "QMK_FLAG_BARRIER_BENCH"),
                  (mk.FLAG_BF16_EXACT, "QMK_FLAG_BF16_EXACT"), (mk.FLAG_KV_FP32, "QMK_FLAG_KV_FP32"),
                  (mk.BARRIER_BENCH_N, "QMK_BARRIER_BENCH_N")):
        assert py == _layout_define(c), c
    assert ctypes.sizeof(mk.QmkState) == 23 * 8 + 8 * 4 + 8


def test_sampling_bytes_layout():
    b = mk.sampling_bytes(SamplingConfig(seed=2**40 + 5, top_k=50, temperature=0.9))
    assert len(b) == 48
    assert int.from_bytes(b[40:48], "little") == 2**40 + 5


def test_grouped_o_proj_layout():
    """Every o_proj handed to the kernel is head-group major: o[g, r, c] = o_proj[r, 256 g + c]
    (csrc/ops/attn_oproj.cuh reads one contiguous slice per block)."""
    import torch

    o = torch.randn(mk.H, mk.NH * mk.HD)
    g = mk.grouped_o(o)
    assert g.shape == (mk.NKV, mk.H, 2 * mk.HD) and g.is_contiguous()
    for grp, row, col in ((0, 0, 0), (3, 17, 5), (7, 1023, 255)):
        assert g[grp, row, col] == o[row, 2 * mk.HD * grp + col]


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


def test_trace_labels_count_barriers():
    """One label per grid barrier of a frame: 4 per CP layer (attention and o_proj fused), 5 per
    talker layer (split-K attention, then its merge fused with o_proj), one head per stack (the
    QMK_TRACE analysis in bench_kernel depends on it)."""
    bk = _bench_module()
    n = len(bk.trace_labels())
    assert n == 15 * (5 * 4 + 1) + 28 * 5 + 1
    assert n < bk.TRACE_EPOCHS


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed: CUDA build not checked")
def test_kernel_compiles_for_sm90():
    r = subprocess.run(["make", "-C", str(ROOT / "csrc"), "check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "spill" not in r.stderr or "0 bytes spill stores" in r.stderr


def test_library_loads_when_built():
    lib_path = ROOT / "csrc" / mk.LIB_NAME
    if not lib_path.exists():
        pytest.skip("csrc/libqwen_megakernel.so not built (make kernel)")
    lib = mk.load_library(lib_path)  # checks ABI version and struct sizes
    assert lib.qmk_model_size() == (11 * 33 + 4 + 30 + 2) * 8


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
