"""The persistent decode attention split (csrc/attn/, tts_server/engines/batched/attn_kernel.py): its
C ABI and argument checks (the sm_90a check build: CI has nvcc, no GPU), the engine's reasons to
leave it off, and on a GPU that it gives the Triton split kernel's bits inside the engine (a stream
alone, on Triton, against the same stream among 15 and 16 others, on the kernel) and that its
start-up check can fail. The engine takes it by default; TTS_ATTN_KERNEL=0 turns it off."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_server.engines.batched import attn_kernel

ROOT = Path(__file__).resolve().parents[1]
CHECK_LIB = ROOT / "csrc" / "build" / "check" / "libqwen_attn.so"


@pytest.fixture(scope="module")
def check_lib():
    if subprocess.run(["which", "nvcc"], capture_output=True).returncode != 0:
        pytest.skip("needs nvcc (the sm_90a check build)")
    subprocess.run(["make", "-s", "-C", str(ROOT / "csrc"), "build/check/libqwen_attn.so"], check=True,
                   capture_output=True, timeout=600)
    return attn_kernel.load(CHECK_LIB)


def test_abi_and_argument_checks(check_lib):
    # load() checked the version; bad sizes are refused before any CUDA call (1: cudaErrorInvalidValue)
    split = check_lib.qda_split
    args = [None] * 8 + [0.1]
    assert split(*args, 0, 64, 64, 132, None, 0) == 1  # no rows
    assert split(*args, attn_kernel.MAX_ROWS + 1, 64, 64, 132, None, 0) == 1  # more rows than its offsets hold
    assert split(*args, 16, 64, 32, 132, None, 0) == 1  # fewer splits than table pages
    assert split(*args, 16, 64, 64, 0, None, 0) == 1  # no grid


def test_unsupported_names_the_reason():
    assert attn_kernel.unsupported(16, 8, 128, torch.bfloat16, 64) is None
    assert attn_kernel.unsupported(16, 8, 128, torch.float32, 64) == "torch.float32 KV (bf16 only)"
    assert attn_kernel.unsupported(32, 8, 128, torch.bfloat16, 64) == "32 / 8 heads of 128 (16 / 8 of 128 only)"
    assert attn_kernel.unsupported(16, 8, 128, torch.bfloat16, 16) == "KV pages of 16 positions (64 only)"


def test_the_engine_says_why_it_is_off_without_a_gpu():
    from tts_server.engines.batched import checks
    from tts_server.engines.batched.engine import BatchedEngine

    eng = BatchedEngine(checks.random_weights("cpu", layers=(1, 1)), max_streams=2, max_positions=64)
    assert eng.attn_kernel == "off: not the Triton frame on a GPU"


@pytest.mark.gpu
def test_gpu_decode_split_gives_the_triton_bits(monkeypatch):
    """The engine turns the kernel on by default; paged_attention with it equals the Triton split's merge
    bitwise at B = 16..256; a stream's codes and logits alone (B = 1: Triton) equal those among 15
    and 16 others (the kernel), greedy and sampled. A kernel that computes something else fails the
    start-up check, and with TTS_ATTN_KERNEL=0 the engine leaves paged_attention on Triton."""
    from tts_server.engines.batched import checks, ops, tk_attention
    from tts_server.engines.batched.engine import BatchedEngine
    from tts_server.engines.contract import SamplingConfig

    monkeypatch.delenv("TTS_ATTN_KERNEL", raising=False)
    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=17, max_positions=1024, dump_logits=True)
    assert eng.attn_kernel == "on", eng.attn_kernel
    dev = eng.device
    kernel = tk_attention.CUDA_SPLIT[dev.index]
    gen = torch.Generator(device=dev).manual_seed(3)
    for b in (16, 64, 256):
        lengths = torch.randint(1, 1024, (b,), generator=gen, device=dev).int()
        pages = -(-lengths // 64)
        kp = torch.randn(int(pages.sum()) + 1, 8, 64, 128, device=dev, generator=gen).bfloat16()
        vp = torch.randn_like(kp)
        table = torch.zeros(b, 16, dtype=torch.int32, device=dev)
        at = 1
        for i, k in enumerate(pages.tolist()):
            table[i, :k] = torch.arange(at, at + k, device=dev)
            at += k
        q = torch.randn(b, 16, 128, device=dev, generator=gen)
        with_kernel = ops.paged_attention(q, kp, vp, table, lengths, 0.088)
        del tk_attention.CUDA_SPLIT[dev.index]
        try:
            triton_only = ops.paged_attention(q, kp, vp, table, lengths, 0.088)
        finally:
            tk_attention.CUDA_SPLIT[dev.index] = kernel
        assert torch.equal(with_kernel.view(torch.int32), triton_only.view(torch.int32)), b
    p = checks.random_prompt(0, 12, eng.p.talker.cfg.hidden_size, device="cuda")
    for s in (checks.GREEDY, SamplingConfig(seed=7)):
        res = checks.invariance(eng, p, s, sizes=(1, 16, 17), frames=24)
        assert all(r["codes_equal"] and r["logits_equal"] for r in res.values()), res

    class Off(attn_kernel.DecodeSplit):  # the scale one fp32 ulp larger: the scores move
        def __call__(self, q, k_pool, v_pool, table, lens, m, l, acc, scale):
            up = float(np.nextafter(np.float32(scale), np.float32(1.0)))
            super().__call__(q, k_pool, v_pool, table, lens, m, l, acc, up)
    why = attn_kernel.check(Off(dev))
    assert why is not None and "differs from Triton's" in why, why
    monkeypatch.setenv("TTS_ATTN_KERNEL", "0")
    off = BatchedEngine(w, max_streams=2, max_positions=256, use_graphs=False)
    assert off.attn_kernel == "off: TTS_ATTN_KERNEL=0" and dev.index not in tk_attention.CUDA_SPLIT
