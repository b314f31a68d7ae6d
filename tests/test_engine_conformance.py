"""Every decode engine through the same step-contract cases: the torch reference, the batched
engine, the fault injector (wrapping the reference), and on a GPU the batched engine with CUDA
graphs, the megakernel and the reference on CUDA. Weights and prompts are rounded to bf16 values
so that every engine computes over the same numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_server.engines.batched.checks import bf16_rounded
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan
from tts_server.engines.torch_ref import TorchEngine
from tts_server.model.prompt import Prompt, PromptBuilder
from tts_server.model.weights import decode_weights

GREEDY = SamplingConfig(do_sample=False, subtalker_do_sample=False)
SAMPLED = SamplingConfig(seed=77, temperature=1.1)
TEXTS = ["The first stream speaks here.", "Second.", "A third stream with a few more words in it."]
SLOTS, POSITIONS = 4, 160


def _make(name: str, weights):
    if name == "torch":
        return TorchEngine(weights, SLOTS, POSITIONS)
    if name == "faults":
        from tts_server.testing.faults import FaultInjectingEngine

        return FaultInjectingEngine(TorchEngine(weights, SLOTS, POSITIONS), "")
    if name == "batched":
        from tts_server.engines.batched.engine import BatchedEngine

        return BatchedEngine(weights, SLOTS, POSITIONS, kv_dtype=torch.float32)
    dev = torch.device("cuda")
    cuda_w = bf16_rounded(weights, torch.bfloat16)
    cuda_w = type(cuda_w)(**{f: _to(getattr(cuda_w, f), dev) for f in cuda_w.__dataclass_fields__})
    if name in ("batched-cuda", "batched-cuda-fp16"):
        from tts_server.engines.batched.engine import BatchedEngine

        dtype = torch.float16 if name in APPROXIMATE else torch.bfloat16  # bf16: two activation terms
        return BatchedEngine(cuda_w, SLOTS, POSITIONS, kv_dtype=torch.float32, gemm_dtype=dtype)
    if name == "megakernel":
        from tts_server.engines import megakernel

        if not megakernel.is_available():
            pytest.skip("the megakernel library is not built on this GPU machine (make kernel)")
        if weights.talker.config.hidden_size != megakernel.load_library().layout.H:
            pytest.skip("the megakernel is compiled for the 0.6B shapes only; this suite runs the "
                        "tiny model (tests/test_megakernel.py covers it at full size)")
        return megakernel.MegakernelEngine(cuda_w, SLOTS, POSITIONS)
    raise ValueError(name)


def _to(obj, dev):
    from dataclasses import fields, is_dataclass, replace

    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, tuple):
        return tuple(_to(o, dev) for o in obj)
    if is_dataclass(obj):
        return replace(obj, **{f.name: _to(getattr(obj, f.name), dev) for f in fields(obj)})
    return obj


ENGINES = ["torch", "faults", "batched",
           pytest.param("batched-cuda", marks=pytest.mark.gpu),
           pytest.param("batched-cuda-fp16", marks=pytest.mark.gpu),
           pytest.param("megakernel", marks=pytest.mark.gpu)]
# engines whose GEMM activations are rounded to fp16 (the batched engine's CUDA default): held to
# issue 16's accuracy bar against the fp32 reference (test_batched_engine's GPU test), not to its
# exact greedy codes
APPROXIMATE = {"batched-cuda-fp16"}


@pytest.fixture(scope="module")
def weights(tiny_custom):
    return bf16_rounded(decode_weights(tiny_custom.model))


@pytest.fixture(scope="module")
def prompts(tiny_custom) -> list[Prompt]:
    b = PromptBuilder(tiny_custom.model)
    ids = [tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(t)])[0] for t in TEXTS]
    return [bf16_rounded(b.build(i, "english", "ryan", non_streaming=n))
            for i, n in zip(ids, (True, False, True))]


def _codes(engine, slots, frames, admit=()):
    got = {s: [] for s in slots}
    for f in range(frames):
        out = engine.run(StepPlan(decode=tuple(slots), admit=admit if f == 0 else ()))
        assert not out.failed, out.failed
        assert [r.slot for r in out.frames] == list(slots)  # plan order
        assert out.prefill_s >= 0 and out.decode_s >= 0
        for r in out.frames:
            assert r.error is None, r.error
            assert r.codes.shape == (16,) and r.codes.dtype == np.int64
            got[r.slot].append(r.codes)
    for s in slots:
        engine.release(s)
    return {s: np.stack(v) for s, v in got.items()}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, weights):
    return request.param, _make(request.param, weights)


def test_greedy_codes_equal_the_reference(engine, weights, prompts):
    name, eng = engine
    if name in APPROXIMATE:
        pytest.skip("fp16 activations: held to the teacher-forced accuracy bar, not to exact greedy codes")
    ref = TorchEngine(weights, 1, POSITIONS)
    for p in prompts:
        want = _codes(ref, [0], 8, (Admission(0, p, GREEDY),))[0]
        got = _codes(eng, [1], 8, (Admission(1, _dev(p, eng), GREEDY),))[1]
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_admitted_slots_decode_in_the_same_step_and_stay_invariant(engine, prompts):
    """Admission + first frame in one call; a seeded stream's codes are the same alone and among
    others, in another slot; releasing a slot resets it (re-admission repeats the codes)."""
    name, eng = engine
    alone = _codes(eng, [2], 6, (Admission(2, _dev(prompts[0], eng), SAMPLED),))[2]
    again = _codes(eng, [2], 6, (Admission(2, _dev(prompts[0], eng), SAMPLED),))[2]
    np.testing.assert_array_equal(again, alone, err_msg=name)
    admit = (Admission(1, _dev(prompts[1], eng), SamplingConfig(seed=5)),
             Admission(3, _dev(prompts[0], eng), SAMPLED),
             Admission(0, _dev(prompts[2], eng), GREEDY))
    together = _codes(eng, [1, 3, 0], 6, admit)
    np.testing.assert_array_equal(together[3], alone, err_msg=name)
    assert not np.array_equal(together[1], alone)


def test_a_failed_admission_fails_only_its_slot(engine, prompts, weights):
    name, eng = engine
    h = weights.talker.config.hidden_size
    too_long = Prompt(embeds=torch.zeros(POSITIONS + 5, h), trailing=torch.zeros(1, h),
                      pad_embed=torch.zeros(h))
    out = eng.run(StepPlan(decode=(0, 1), admit=(Admission(0, _dev(too_long, eng), GREEDY),
                                                 Admission(1, _dev(prompts[1], eng), GREEDY))))
    assert set(out.failed) == {0} and out.failed[0]
    assert [r.slot for r in out.frames] == [1] and out.frames[0].error is None
    eng.release(0)
    eng.release(1)


def _dev(prompt: Prompt, eng) -> Prompt:
    dev = getattr(eng, "device", None) or getattr(getattr(eng, "inner", None), "device", None)
    return _to(prompt, dev) if dev is not None and torch.device(dev).type == "cuda" else prompt
