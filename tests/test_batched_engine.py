"""BatchedEngine: greedy codes vs TorchEngine, batch invariance, paged KV, per-slot failures (CPU,
tiny synthetic model, ops' torch references), and the GPU evidence (`gpu` marker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_server.engines.batched import checks
from tts_server.engines.batched.checks import GREEDY, bf16_rounded, random_prompt, step_codes
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.batched.params import fused_bytes
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan
from tts_server.engines.torch_ref import TorchEngine
from tts_server.model.prompt import PromptBuilder
from tts_server.model.weights import decode_weights

TEXTS = ["Hello world, this is a batched engine test.", "Short one.",
         "A somewhat longer sentence, with a comma and more words in it than the others."]


@pytest.fixture(scope="module")
def weights(tiny_custom):
    return decode_weights(tiny_custom.model)


@pytest.fixture(scope="module")
def prompts(tiny_custom):
    """Three real prompts (streaming and non-streaming text), rounded to bf16 values (the engine
    keeps the text track in bf16)."""
    b = PromptBuilder(tiny_custom.model)
    ids = [tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(t)])[0] for t in TEXTS]
    return [bf16_rounded(b.build(ids[0], "english", "ryan", non_streaming=False)),
            bf16_rounded(b.build(ids[1], "english", "aiden", non_streaming=True)),
            bf16_rounded(b.build(ids[2], "auto", "eric", non_streaming=False))]


def _engine(weights, **kw) -> BatchedEngine:
    kw.setdefault("max_streams", 4)
    kw.setdefault("max_positions", 128)
    return BatchedEngine(weights, **kw)


@pytest.mark.slow
def test_greedy_codes_equal_torch_engine_alone_and_in_batch(weights, prompts):
    """fp32 KV: the engine's greedy codes are TorchEngine's (fp32 over the same bf16 weights)
    for 20 frames, each prompt alone and all three (plus a sampled neighbour) in one step."""
    frames = 20
    ref = TorchEngine(bf16_rounded(weights), max_streams=1, max_positions=128)
    eng = _engine(weights, kv_dtype=torch.float32)
    want = []
    for p in prompts:
        want.append(step_codes(ref, [0], frames, (Admission(0, p, GREEDY),))[0])
        np.testing.assert_array_equal(step_codes(eng, [0], frames, (Admission(0, p, GREEDY),))[0], want[-1])
    admit = tuple(Admission(s, p, GREEDY) for s, p in zip((3, 0, 2), prompts)) + (
        Admission(1, random_prompt(1, 9, prompts[0].embeds.shape[1]), SamplingConfig(seed=5)),)
    got = step_codes(eng, [1, 3, 0, 2], frames, admit)
    for s, w in zip((3, 0, 2), want):
        np.testing.assert_array_equal(got[s], w)


def test_fused_and_unfused_code_predictor_agree(weights, prompts):
    """The fused code-predictor pass (one launch per layer) and the paged-attention path give the
    same codes and logits within 1e-5 (CPU: the fused path's torch twin)."""
    got = []
    for fused in (True, False):
        eng = _engine(weights, fused_cp=fused, dump_logits=True)
        codes = step_codes(eng, [1], 3, (Admission(1, prompts[2], SamplingConfig(seed=3)),))[1]
        got.append((codes, eng.frame.dump[0].clone()))
    np.testing.assert_array_equal(got[0][0], got[1][0])
    assert (got[0][1] - got[1][1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["bf16-kv", "fp32-kv"])
def test_admissions_prefill_the_same_alone_or_together(weights, prompts, kv_dtype):
    """A prompt admitted alone or with others (any order) gets bitwise the same K/V blocks, last
    hidden state, first-frame logits and codes (batched prefill: fp32 attention for a bf16 pool)."""
    got = []
    for group in ([0], [0, 1, 2], [2, 1, 0]):
        eng = _engine(weights, kv_dtype=kv_dtype, dump_logits=True, block_size=8)
        out = eng.run(StepPlan(admit=tuple(Admission(s, prompts[s], GREEDY) for s in group), decode=tuple(group)))
        row = group.index(0)
        blocks = eng.kv.blocks(0)
        got.append((out.frames[row].codes, eng.frame.dump[row].clone(), eng.state.past_hidden[0].clone(),
                    eng.kv.k[:, blocks].clone(), eng.kv.v[:, blocks].clone()))
    for other in got[1:]:
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(other, got[0]))


def test_greedy_check_can_fail(weights, prompts):
    """Another prompt gives other codes: the equality above is not vacuous."""
    eng = _engine(weights, kv_dtype=torch.float32)
    a = step_codes(eng, [0], 4, (Admission(0, prompts[0], GREEDY),))[0]
    b = step_codes(eng, [0], 4, (Admission(0, prompts[1], GREEDY),))[0]
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["bf16-kv", "fp32-kv"])
def test_sampled_codes_invariant_to_neighbours_slot_and_row(weights, prompts, kv_dtype):
    """A seeded stream's sampled codes are the same alone and among 1 or 3 others, in other
    slots and row positions; another seed changes them."""
    eng = _engine(weights, kv_dtype=kv_dtype)
    sampling = SamplingConfig(seed=1234, temperature=1.2)
    res = checks.invariance(eng, prompts[0], sampling, sizes=(1, 2, 4), frames=6, neighbour_len=(5, 30))
    assert all(r["codes_equal"] for r in res.values()), res
    assert len({r["slot"] for r in res.values()}) == 3 and len({r["row"] for r in res.values()}) == 3
    a = step_codes(eng, [0], 6, (Admission(0, prompts[0], SamplingConfig(seed=1234, temperature=1.2)),))[0]
    b = step_codes(eng, [0], 6, (Admission(0, prompts[0], SamplingConfig(seed=4321, temperature=1.2)),))[0]
    assert not np.array_equal(a, b)


def test_fp16_matrices_hand_fp16_inputs_to_every_product_and_stay_invariant(weights, prompts, monkeypatch):
    """With fp16 GEMM matrices (the default on a GPU) the frame's norms and attention outputs go to
    q|k|v, o_proj, gate|up and the code-predictor heads in fp16 (rounded once by their producer),
    the final talker state stays fp32, and a seeded stream's codes stay the same alone and among
    others (CPU: the ops' torch references over fp16 inputs)."""
    from tts_server.engines.batched import ops

    monkeypatch.setenv("TTS_GEMM_DTYPE", "fp16")
    seen = []
    for name in ("linear", "linear_parts", "swiglu"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda x, *a, _real=real, _name=name:
                            seen.append((_name, x.dtype, a[0].dtype, x.shape[-1])) or _real(x, *a))
    eng = _engine(weights)
    assert eng.p.talker.wqkv[0].dtype == torch.float16
    res = checks.invariance(eng, prompts[0], SamplingConfig(seed=99), sizes=(1, 3), frames=3, neighbour_len=(5, 30))
    assert all(r["codes_equal"] for r in res.values()), res
    fp16_in = {n for n, xd, wd, _ in seen if xd == torch.float16}
    assert fp16_in == {"linear", "linear_parts", "swiglu"}, seen[:8]
    # every product's matrix is fp16, the down projections' inputs too (swiglu's scaled rows)
    assert all(wd == torch.float16 for _, xd, wd, _ in seen)
    downs = [xd for n, xd, _, k in seen if n == "linear_parts" and k == eng.p.talker.cfg.intermediate_size]
    assert downs and all(xd == torch.float16 for xd in downs)
    assert eng.state.past_hidden.dtype == torch.float32


def test_paged_kv_blocks_follow_length_and_come_back(weights, prompts):
    """Blocks are taken as positions grow (one per block_size positions) and all return on release."""
    bs = 4
    eng = _engine(weights, block_size=bs, num_blocks=64)
    n0 = prompts[1].embeds.shape[0]
    out = eng.run(StepPlan(admit=(Admission(2, prompts[1], GREEDY),)))
    assert not out.failed
    assert eng.blocks_in_use == -(-n0 // bs)
    for f in range(6):
        eng.run(StepPlan(decode=(2,)))
        assert eng.blocks_in_use == -(-(n0 + f + 1) // bs)
    table = eng.kv.table[2, :eng.blocks_in_use].tolist()
    assert sorted(table) == sorted(eng.kv.blocks(2)) and 0 not in table
    eng.release(2)
    assert eng.blocks_in_use == 0 and not eng.kv.table_host[2].any()


def test_slot_without_kv_blocks_fails_alone(weights, prompts):
    """A pool sized so that one stream runs dry: that slot fails with a clear error, the other's
    codes are those it gets alone."""
    bs = 4
    n_a, n_b = prompts[1].embeds.shape[0], prompts[0].embeds.shape[0]
    alone = step_codes(_engine(weights, block_size=bs), [1], 3, (Admission(1, prompts[0], GREEDY),))[1]
    eng = _engine(weights, block_size=bs, num_blocks=1 + -(-n_a // bs) + -(-(n_b + 3) // bs))
    eng.run(StepPlan(admit=(Admission(0, prompts[1], GREEDY), Admission(1, prompts[0], GREEDY))))
    assert eng.kv.ensure(1, n_b + 3) and not eng.kv.alloc.free  # slot 1's 3 frames reserved: pool empty
    errors, got = [], []
    for _ in range(3):
        out = eng.run(StepPlan(decode=(0, 1)))
        errors.append(out.frames[0].error)
        assert out.frames[1].error is None
        got.append(out.frames[1].codes)
    assert any(e is not None and "no KV blocks" in e for e in errors), errors
    np.testing.assert_array_equal(np.stack(got), alone)
    eng.release(0)
    eng.release(1)
    assert eng.blocks_in_use == 0
    tiny = _engine(weights, block_size=bs, num_blocks=2)
    out = tiny.run(StepPlan(admit=(Admission(0, prompts[0], GREEDY),)))
    assert "no KV blocks" in out.failed[0] and tiny.blocks_in_use == 0


def test_non_finite_logits_fail_only_their_slot(weights, prompts):
    """NaN in one slot's past hidden: that slot reports non-finite code-predictor logits, the
    other slot's codes are those it gets alone."""
    alone = step_codes(_engine(weights), [2], 2, (Admission(2, prompts[2], GREEDY),))[2]
    eng = _engine(weights)
    eng.run(StepPlan(admit=(Admission(0, prompts[0], GREEDY), Admission(2, prompts[2], GREEDY))))
    eng.state.past_hidden[0] = float("nan")
    got = []
    for f in range(2):
        out = eng.run(StepPlan(decode=(0, 2)))
        if f == 0:  # the next frame starts from finite inputs again (the loop releases a failed slot)
            assert out.frames[0].error == "non-finite code-predictor logits (code group 1)"
        assert out.frames[1].error is None
        got.append(out.frames[1].codes)
    np.testing.assert_array_equal(np.stack(got), alone)


def test_context_full_and_bad_admissions_fail_alone(weights, prompts):
    short, long_ = sorted(prompts, key=lambda p: p.embeds.shape[0])[::2]
    n = short.embeds.shape[0]
    assert long_.embeds.shape[0] >= n + 2
    eng = _engine(weights, max_positions=n + 2)
    out = eng.run(StepPlan(decode=(0,), admit=(Admission(0, short, GREEDY), Admission(1, long_, GREEDY),
                                               Admission(9, short, GREEDY))))
    assert set(out.failed) == {1, 9} and "exceeds" in out.failed[1] and "out of range" in out.failed[9]
    assert [r.slot for r in out.frames] == [0] and out.frames[0].error is None
    errs = [eng.run(StepPlan(decode=(0,))).frames[0].error for _ in range(2)]
    assert errs == [None, "talker context is full"]


def test_memory_bytes_counts_what_the_engine_allocates(weights):
    eng = _engine(weights, max_streams=5, max_positions=100, num_blocks=40, block_size=8)
    want = BatchedEngine.memory_bytes(5, 100, weights, num_blocks=40, block_size=8, graphs=False)
    s, f = eng.state, eng.frame
    got = sum(t.numel() * t.element_size() for t in (
        eng.kv.k, eng.kv.v, eng.kv.table, s.ints, s.floats, s.seed, s.past_hidden, s.trailing, s.pad_embed,
        s.seen, f.cp_k, f.cp_v, f.out, f.rope, *([] if f.noise is None else [f.noise])))
    assert got + fused_bytes(weights, eng.gemm_dtype) == want


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_bytes_are_the_new_tensors_of_prepare(weights, monkeypatch, dtype):
    """What the memory plan counts beside bf16 weights is what `prepare` allocates: the fused
    q|k|v, the stacked tables and, for fp16 GEMMs, the fp16 matrices."""
    from dataclasses import fields, is_dataclass

    from tts_server.engines.batched import params

    monkeypatch.setenv("TTS_GEMM_DTYPE", dtype)
    w16 = checks.bf16_rounded(weights, torch.bfloat16)

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, tuple):
            for o in obj:
                yield from tensors(o)
        elif is_dataclass(obj):
            for f in fields(obj):
                yield from tensors(getattr(obj, f.name))

    old = {t.untyped_storage().data_ptr() for t in tensors(w16)}
    p = params.prepare(w16)
    want = params.FP16 if dtype == "fp16" else params.BF16
    assert (p.talker.wo[0].dtype, p.talker.down[0].dtype) == (want, want)
    new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(p)
           if t.untyped_storage().data_ptr() not in old and t.dtype != torch.float32}  # (norms: fp32 copies)
    assert sum(new.values()) == fused_bytes(w16, params.gemm_dtype("cpu"))


@pytest.mark.gpu
def test_gpu_invariance_and_fidelity():
    """The GPU evidence on random full-size weights (the script runs the same with more frames)."""
    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=64, max_positions=256, dump_logits=True)
    p = random_prompt(0, 12, 1024, device="cuda")
    for s in (GREEDY, SamplingConfig(seed=7)):
        res = checks.invariance(eng, p, s, sizes=(1, 3, 17, 64), frames=64)
        assert all(r["codes_equal"] and r["logits_equal"] for r in res.values()), res
    for kv in (torch.bfloat16, torch.float32):
        e2 = BatchedEngine(w, max_streams=8, max_positions=256, dump_logits=True, kv_dtype=kv)
        r = checks.teacher_forced(e2, w, [random_prompt(i, 12 + i, 1024, device="cuda") for i in range(8)], 64)
        assert r["rel_err_max"] <= 1e-2 and r["top1"] >= 0.995, r


_GLUE_CHECK = r"""
import sys
import torch
from tts_server.engines.batched import glue
dev = sys.argv[1]  # cpu: the Triton interpreter; cuda: the compiled kernels
g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g).to(dev)


def rounded16(a16, a):  # fp16 out = the fp32 out rounded (on a GPU its own kernel variant: within half an ulp)
    if dev == "cpu":
        return a16.dtype == torch.float16 and torch.equal(a16, a.half())
    return a16.dtype == torch.float16 and bool(((a16.double() - a.double()).abs()
                                                <= a.double().abs() * 2 ** -11 * 1.001 + 1e-7).all())


nh, nkv, hd, bs, m = 4, 2, 16, 8, 5
qkv, qn, kn = r(m, (nh + 2 * nkv) * hd), 1 + 0.1 * r(hd), 1 + 0.1 * r(hd)
cos, sin = r(m, hd), r(m, hd)
blk, off = torch.tensor([3, 1, 2, 0, 3], device=dev), torch.tensor([0, 5, 7, 2, 1], device=dev)
worst, worst16, same = 0.0, 0.0, True
for dt in (torch.float32, torch.bfloat16):
    pools = [torch.zeros(4, nkv, bs, hd, dtype=dt, device=dev) for _ in range(4)]
    q1 = glue.qk_rope_store(qkv, qn, kn, cos, sin, pools[0], pools[1], blk, off, nh, nkv, 1e-6)
    q2 = glue.qk_rope_store_torch(qkv, qn, kn, cos, sin, pools[2], pools[3], blk, off, nh, nkv, 1e-6)
    pool_diff = max(((pools[i].float() - pools[i + 2].float()).abs() / pools[i + 2].float().abs().clamp(min=1e-3)).max().item()
                    for i in (0, 1))
    worst = max(worst, (q1 - q2).abs().max().item())
    if dt == torch.float32:
        worst = max(worst, pool_diff)
    else:
        worst16 = max(worst16, pool_diff)
    one = glue.qk_rope_store(qkv[2:3], qn, kn, cos[2:3], sin[2:3], pools[0], pools[1], blk[2:3], off[2:3], nh, nkv, 1e-6)
    same &= torch.equal(one[0], q1[2])
x, y, w = r(m, 64), r(m, 64), 1 + 0.1 * r(64)
(s1, h1), (s2, h2) = glue.add_rms(x, y, w, 1e-6), glue.add_rms_torch(x, y, w, 1e-6)
worst = max(worst, (s1 - s2).abs().max().item(), (h1 - h2).abs().max().item())
same &= torch.equal(glue.add_rms(x[3:4], y[3:4], w, 1e-6)[1][0], h1[3])
for pos in (1, 5, 15):  # the fused code-predictor pass (row m's scratch block is m; 16 positions)
    kp, vp = r(m, nkv, 16, hd), r(m, nkv, 16, hd)
    kp2, vp2 = kp.clone(), vp.clone()
    a = glue.cp_attend(qkv, qn, kn, cos[:1], sin[:1], kp, vp, pos, nh, nkv, 1e-6, hd ** -0.5)
    b = glue.cp_attend_torch(qkv, qn, kn, cos[:1], sin[:1], kp2, vp2, pos, nh, nkv, 1e-6, hd ** -0.5)
    worst = max(worst, (a - b).abs().max().item(), (kp - kp2).abs().max().item(), (vp - vp2).abs().max().item())
    a1 = glue.cp_attend(qkv[:1], qn, kn, cos[:1], sin[:1], kp, vp, pos, nh, nkv, 1e-6, hd ** -0.5)
    same &= torch.equal(a1[0], a[0])
    a16 = glue.cp_attend(qkv, qn, kn, cos[:1], sin[:1], kp, vp, pos, nh, nkv, 1e-6, hd ** -0.5, torch.float16)
    same &= rounded16(a16, a)
# the first pass: rows 2b, 2b + 1 at positions 0, 1 of block b (stale values past them must not count)
qkv6 = r(6, (nh + 2 * nkv) * hd)
kp, vp = r(3, nkv, 16, hd), r(3, nkv, 16, hd)
kp2, vp2 = kp.clone(), vp.clone()
a = glue.cp_attend0(qkv6, qn, kn, cos[:2], sin[:2], kp, vp, nh, nkv, 1e-6, hd ** -0.5)
b = glue.cp_attend0_torch(qkv6, qn, kn, cos[:2], sin[:2], kp2, vp2, nh, nkv, 1e-6, hd ** -0.5)
worst = max(worst, (a - b).abs().max().item(), (kp[:, :, :2] - kp2[:, :, :2]).abs().max().item(),
            (vp[:, :, :2] - vp2[:, :, :2]).abs().max().item())
v0 = qkv6[0::2, (nh + nkv) * hd:].reshape(3, nkv, 1, hd).expand(3, nkv, nh // nkv, hd).reshape(3, nh, hd)
same &= torch.equal(a[0::2], v0)  # position 0 attends to itself alone: its own v
a1 = glue.cp_attend0(qkv6[2:4], qn, kn, cos[:2], sin[:2], kp[1:], vp[1:], nh, nkv, 1e-6, hd ** -0.5)
same &= torch.equal(a1, a[2:4])
a16 = glue.cp_attend0(qkv6, qn, kn, cos[:2], sin[:2], kp, vp, nh, nkv, 1e-6, hd ** -0.5, torch.float16)
same &= rounded16(a16, a)
print("RESULT", worst, worst16, same)
"""


def _glue_check(dev: str) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1") if dev == "cpu" else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _GLUE_CHECK, dev], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    assert line, out.stderr[-2000:]
    worst, worst16, same = line[0].split()[1:]
    assert float(worst) <= 1e-5 and float(worst16) <= 2 ** -7 and same == "True", line


def test_triton_glue_matches_torch_and_is_row_invariant():
    """The fused Triton glue (q/k norm + RoPE + store, add + RMSNorm, the fused code-predictor passes,
    the first one included; interpreter) vs its torch twins: max abs diff <= 1e-5 (bf16 pools:
    one bf16 rounding apart at most: <= 2^-7 relative), and row m alone gives the same bits as inside M = 5."""
    _glue_check("cpu")


@pytest.mark.gpu
def test_triton_glue_matches_torch_on_gpu():
    """The same check with the compiled kernels (the first pass's position 1 reads what position 0
    stored in the same program, which the interpreter cannot get wrong)."""
    _glue_check("cuda")
