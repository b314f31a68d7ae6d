"""The small-batch kernel (csrc/small/cp_layers.cu, tts_server/engines/batched/small_kernel.py):
its C ABI against the Python view of its arguments (the sm_90a check build: CI has nvcc, no GPU),
the tiled weight layout, the engine's reasons to leave it off, and on a GPU that it serves steps of
one stream with the graphs' bits, its code-predictor passes and its talker layers (and that each
start-up check can fail)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from tts_server.engines.batched import checks, small_kernel
from tts_server.engines.batched.params import prepare

ROOT = Path(__file__).resolve().parents[1]
CHECK_LIB = ROOT / "csrc" / "build" / "check" / "libqwen_small.so"


@pytest.fixture(scope="module")
def check_lib():
    nvcc = subprocess.run(["which", "nvcc"], capture_output=True).returncode == 0
    if not nvcc:
        pytest.skip("needs nvcc (the sm_90a check build)")
    subprocess.run(["make", "-s", "-C", str(ROOT / "csrc"), "build/check/libqwen_small.so"], check=True,
                   capture_output=True, timeout=600)
    return small_kernel.load(CHECK_LIB)


def test_abi_matches_the_python_arguments(check_lib):
    # load() checks the version and sizeof(Args) against the ctypes structure
    assert check_lib.qsk_max_rows() == small_kernel.MAX_ROWS
    assert check_lib.qsk_max_layers() == len(small_kernel.Args().L)
    assert check_lib.qsk_words_len() == 8 * 1 * (4096 + 4 * 1024 + 3072 + 6 * 1024)
    # one o_proj piece a block: a multiple of 4 blocks, one an SM, one at least a down tile (64), an
    # SM left over where that still leaves 64
    assert [check_lib.qsk_grid(n) for n in (132, 114, 78, 67, 64, 63, 3)] == [128, 112, 76, 64, 64, -1, -1]
    a = small_kernel.Args(nl=5, M=2)
    assert check_lib.qsk_run(ctypes.byref(a), 132, None, 0) == -1  # 2 rows: refused before any CUDA call
    # the talker's variant (load() checked sizeof(TArgs) too): 28 layers of words, and a launch
    # without its attention's buffers or table refused before any CUDA call
    assert check_lib.qtk_max_layers() == len(small_kernel.TArgs().L) == small_kernel.TALKER_LAYERS
    assert check_lib.qtk_words_len() == 28 * 1 * (4096 + 4 * 1024 + 3072 + 6 * 1024)
    t = small_kernel.TArgs(nl=28, M=1, smem=1 << 17, words=8, sync=8, nrm0=8, lens=8, ml=8, accb=8, iflags=8,
                           msplit=16, x_out=8, d_out=8)
    assert check_lib.qtk_run(ctypes.byref(t), 132, None, 0) == -1  # no table
    t.table, t.M = 8, 2
    assert check_lib.qtk_run(ctypes.byref(t), 132, None, 0) == -1  # two rows


def test_load_refuses_a_kernel_of_another_sub_piece_order(check_lib, monkeypatch):
    # the products' sub-pieces are part of their bits: a library built for another order than the
    # graphs' (TTS_GEMM_SUB) is refused with the reason, and accepted when they agree
    assert check_lib.qsk_sub_cols() == 0
    monkeypatch.setenv("TTS_GEMM_SUB", "256")
    with pytest.raises(RuntimeError, match="built with QSK_SUB=0, the graphs sum sub-pieces of 256 columns"):
        small_kernel.load(CHECK_LIB)
    monkeypatch.setenv("TTS_GEMM_SUB", "0")
    assert small_kernel.load(CHECK_LIB).qsk_sub_cols() == 0


def test_tile_puts_every_weight_where_the_kernel_reads_it():
    n, k = 32, 1024
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    t = small_kernel.tile(w)
    assert t.shape == (n // 16, k // 512, 16, 64, 8)
    for row, col in ((0, 0), (5, 17), (17, 600), (31, 1023), (9, 511)):
        r = row % 16
        chunk = (col % 512) // 8
        assert t[row // 16, col // 512, r, chunk ^ (r & 7), col % 8] == w[row, col]


def test_unsupported_names_the_reason():
    tiny = prepare(checks.random_weights("cpu", layers=(1, 1)), dtype=torch.bfloat16)
    assert small_kernel.unsupported(tiny.predictor, tiny.predictor_heads) == "matrices not fp16"
    w16 = prepare(checks.random_weights("cpu", layers=(1, 1)), dtype=torch.float16)
    assert small_kernel.unsupported(w16.predictor, w16.predictor_heads) is None
    w9 = prepare(checks.random_weights("cpu", layers=(1, 9)), dtype=torch.float16)
    assert small_kernel.unsupported(w9.predictor, w9.predictor_heads) == "9 layers (at most 8)"
    assert small_kernel.unsupported(w9.predictor, (), small_kernel.TALKER_LAYERS) is None
    pool = lambda dtype, page: torch.zeros(1, 2, 8, page, 128, dtype=dtype)  # noqa: E731
    assert small_kernel.talker_unsupported(w16.talker, pool(torch.bfloat16, 64)) is None
    assert small_kernel.talker_unsupported(w16.talker, pool(torch.float32, 64)) == \
        "a float32 KV pool of 64-position pages (the kernel takes bf16, 64)"
    assert small_kernel.talker_unsupported(w16.talker, pool(torch.bfloat16, 16)) == \
        "a bfloat16 KV pool of 16-position pages (the kernel takes bf16, 64)"


@pytest.mark.gpu
def test_gpu_small_kernel_serves_one_stream_with_the_graphs_bits(monkeypatch):
    """B = 1 runs passes 2..15 through the kernel (its epoch word advances by one launch a pass),
    B = 2 and 3 through the graphs; a stream's codes and logits are the same in all three, greedy
    and sampled. Then the start-up check refuses a kernel that computes something else."""
    from tts_server.engines.batched.engine import BatchedEngine
    from tts_server.engines.contract import SamplingConfig

    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=4, max_positions=256, dump_logits=True)
    assert eng.small_kernel == "on", eng.small_kernel
    assert eng.talker_kernel == "on", eng.talker_kernel
    k, tk = eng.frame.small, eng.frame.talker_k
    p = checks.random_prompt(0, 12, 1024, device="cuda")
    for s in (checks.GREEDY, SamplingConfig(seed=7)):
        before, before_t = int(k.sync[1]), int(tk.sync[1])
        res = checks.invariance(eng, p, s, sizes=(1, 2, 3), frames=32)
        assert all(r["codes_equal"] and r["logits_equal"] for r in res.values()), res
        # 32 frames at B = 1: 14 launches a frame, 64 flags a launch; the talker's one, 256 flags
        assert (int(k.sync[1]) - before) & 0xFFFFFFFF >= 64 * 14 * 32
        assert (int(tk.sync[1]) - before_t) & 0xFFFFFFFF >= 256 * 32
    assert int(k.sync[0]) == 0 and int(tk.sync[0]) == 0
    # the talker's variant normalising with another epsilon: refused the same way
    bad_t = small_kernel.TalkerKernel(eng.p.talker, eng.kv.k, eng.kv.v, eng.kv.max_blocks)
    bad_t.base.eps = bad_t.base.eps * 4
    eng.frame.talker_k = None
    why = eng.frame.use_talker_kernel(bad_t)
    assert why is not None and "differ from the graphs'" in why, why
    assert eng.frame.talker_k is None
    # a kernel that normalises with another epsilon: the check names the difference, the frame keeps the graphs
    bad = small_kernel.SmallKernel(eng.p.predictor, eng.frame.cp_k, eng.frame.cp_v)
    bad.base.eps = bad.base.eps * 4
    eng.frame.small = None
    why = eng.frame.use_small_kernel(bad)
    assert why is not None and "differs from the graphs'" in why, why
    assert eng.frame.small is None
    monkeypatch.setenv("TTS_SMALL_KERNEL", "0")
    monkeypatch.setenv("TTS_TALKER_KERNEL", "0")
    off = BatchedEngine(w, max_streams=2, max_positions=256, use_graphs=False)
    assert off.small_kernel == "off: TTS_SMALL_KERNEL=0" and off.frame.small is None
    assert off.talker_kernel == "off: TTS_TALKER_KERNEL=0" and off.frame.talker_k is None
