"""Early codes: the batched engine hands a frame's 16 codes over (`run(plan, on_codes=...)`)
before its talker step has sampled the next code 0, and the serving loop decodes and posts that
audio then; a stream ends (EOS, errors) only once the call returns. CPU, tiny synthetic model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tts_client.client import TTSClient, build_request
from tts_server.engines.batched.checks import GREEDY, bf16_rounded
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.contract import Admission, StepPlan
from tts_server.model.prompt import PromptBuilder
from tts_server.model.weights import decode_weights


@pytest.fixture(scope="module")
def prompts(tiny_custom):
    b = PromptBuilder(tiny_custom.model)
    texts = ["Early codes, first prompt.", "And a second one."]
    ids = [tiny_custom._tokenize_texts([tiny_custom._build_assistant_text(t)])[0] for t in texts]
    return [bf16_rounded(b.build(i, "english", "ryan", non_streaming=False)) for i in ids]


def test_codes_come_before_the_talker_step(tiny_custom, prompts):
    """on_codes gets every decoded slot's codes once, equal to the returned frames' codes, with no
    EOS yet; a talker failure (a NaN text vector: the code predictor never reads it) shows only in
    the returned frame."""
    eng = BatchedEngine(decode_weights(tiny_custom.model), max_streams=4, max_positions=128)
    eng.run(StepPlan(admit=(Admission(0, prompts[0], GREEDY), Admission(2, prompts[1], GREEDY))))
    early = []
    for step in range(2):
        if step == 1:
            eng.state.trailing[0] = float("nan")
            eng.state.pad_embed[0] = float("nan")
        out = eng.run(StepPlan(decode=(0, 2)), on_codes=early.append)
        assert len(early) == step + 1
        got = early[-1]
        assert [r.slot for r in got.frames] == [0, 2] and not got.failed
        for e, r in zip(got.frames, out.frames):
            np.testing.assert_array_equal(e.codes, r.codes)
            assert e.error is None and not e.next_is_eos
    assert out.frames[0].error == "non-finite talker logits" and out.frames[1].error is None


def test_on_launch_gives_the_device_codes_before_on_codes(tiny_custom, prompts):
    """on_launch gets the decoded slots and a view of their codes as soon as the frame is
    launched, before on_codes for the same slots, holding the codes on_codes then reports."""
    eng = BatchedEngine(decode_weights(tiny_custom.model), max_streams=4, max_positions=128)
    assert eng.launches_codes
    eng.run(StepPlan(admit=(Admission(0, prompts[0], GREEDY), Admission(2, prompts[1], GREEDY))))
    events = []
    for _ in range(3):
        out = eng.run(StepPlan(decode=(2, 0)), on_codes=lambda e: events.append(("codes", e)),
                      on_launch=lambda slots, codes, ready: events.append(("launch", slots, codes.clone(), ready)))
        (kind0, slots, codes, ready), (kind1, early) = events[-2:]
        assert (kind0, kind1) == ("launch", "codes") and slots == [2, 0] and ready is None
        assert codes.dtype == torch.int32 and codes.shape == (2, 16)
        np.testing.assert_array_equal(codes.numpy(), np.stack([r.codes for r in early.frames]))
        np.testing.assert_array_equal(codes.numpy(), np.stack([r.codes for r in out.frames]))


async def _synthesize(tiny_custom, monkeypatch, requests, inject_fault=None, together=False, early_codec=False):
    """A loopback server whose engine is the (CPU, eager) batched engine; the requests one
    after another, or all at once (together)."""
    import asyncio

    import torch

    from tts_server import app as app_mod
    from tts_server.config import ServerConfig
    from tts_server.model.loader import LoadedModel
    from tts_server.rpc.server import TTSServer

    monkeypatch.setattr(app_mod, "resolve_engine", lambda name, loaded: "batched")
    monkeypatch.setattr(app_mod, "_create_engine", lambda name, loaded, cfg: BatchedEngine(
        decode_weights(loaded.model), 4, cfg.max_positions))
    cfg = ServerConfig(model="synthetic-tiny", port=0, max_streams=4, max_queue=4, inject_fault=inject_fault,
                       early_codec=early_codec)
    loaded = LoadedModel("synthetic-tiny", tiny_custom, True, torch.device("cpu"), torch.float32)
    app = app_mod.build_app(cfg, loaded)
    srv = TTSServer(app.worker, app.info, cfg, owns_worker=False)
    await srv.start()
    try:
        async with TTSClient(f"127.0.0.1:{srv.port}") as client:
            if together:
                return await asyncio.gather(*(client.synthesize(r, timeout=120) for r in requests))
            return [await client.synthesize(r, timeout=120) for r in requests]
    finally:
        await srv.stop(grace=0.5)
        app.worker.stop(10)


@pytest.mark.slow
async def test_codec_on_the_device_codes_gives_the_host_paths_bytes(tiny_custom, monkeypatch):
    """With --early-codec the serving loop queues the codec on the engine's device codes
    (on_launch); three streams at once (one resampled) give the bytes they give when the codec
    decodes the codes from the host (the default path)."""
    from tts_server.serving import loop as loop_mod

    reqs = [build_request(t, seed=s, sample_rate_hz=r, request_id=f"r{s}", max_duration_s=0.64)
            for t, s, r in (("Device codes, first.", 5, 0), ("A second one.", 6, 16000), ("Third.", 7, 0))]
    launches = []
    real = loop_mod.Worker._launch
    monkeypatch.setattr(loop_mod.Worker, "_launch", lambda self, *a: launches.append(a[1]) or real(self, *a))
    device = await _synthesize(tiny_custom, monkeypatch, reqs, together=True, early_codec=True)
    assert launches and max(map(len, launches)) > 1, "the loop did not queue the codec on the device codes"
    launches.clear()
    host = await _synthesize(tiny_custom, monkeypatch, reqs, together=True)
    assert not launches
    for d, h in zip(device, host):
        assert d.samples.size > 0
        np.testing.assert_array_equal(d.samples, h.samples)


@pytest.mark.slow
@pytest.mark.parametrize("early_codec", [True, False], ids=["device-codes", "host-codes"])
@pytest.mark.parametrize("rate", [0, 16000], ids=["24k", "16k"])
async def test_eos_after_early_audio_gives_the_same_bytes(tiny_custom, monkeypatch, rate, early_codec):
    """A stream whose talker draws EOS at frame 4 has already had frame 4's audio decoded and
    resampled (not as the last); the end flushes it. Its bytes equal a stream capped at 4 frames
    by length (the frame resampled as the last one), at 24 kHz and resampled; with the codec
    queued on the device codes (the default) and decoding the host's codes."""
    reqs = [build_request("The same words twice.", seed=3, sample_rate_hz=rate, request_id="eos-4",
                          max_duration_s=2.0),
            build_request("The same words twice.", seed=3, sample_rate_hz=rate, request_id="capped",
                          max_duration_s=0.32)]
    from tts_server.serving import loop as loop_mod

    launches = []
    real = loop_mod.Worker._launch
    monkeypatch.setattr(loop_mod.Worker, "_launch", lambda self, *a: launches.append(a[1]) or real(self, *a))
    eos, capped = await _synthesize(tiny_custom, monkeypatch, reqs, inject_fault="eos:eos-4@4", early_codec=early_codec)
    assert bool(launches) == early_codec, "the codec was (not) queued on the device codes"
    from tts_client.pb.tts.v1 import tts_pb2

    assert eos.summary.finish_reason == tts_pb2.FINISH_REASON_EOS
    assert capped.summary.finish_reason == tts_pb2.FINISH_REASON_MAX_LENGTH
    assert eos.summary.num_frames == capped.summary.num_frames == 4
    assert eos.samples.size > 0
    np.testing.assert_array_equal(eos.samples, capped.samples)


def test_a_failed_admission_is_reported_with_the_codes_and_released(tiny_custom, prompts):
    """Admissions are not waited for: a prompt whose prefill logits are not finite (NaN embeds)
    fails by the time the step's codes arrive (early and final `failed`, no frame), its slot is
    released, and the admission beside it makes the codes it makes alone."""
    import dataclasses

    w = decode_weights(tiny_custom.model)
    alone = BatchedEngine(w, max_streams=4, max_positions=128)
    want = alone.run(StepPlan(admit=(Admission(2, prompts[1], GREEDY),), decode=(2,))).frames[0].codes
    eng = BatchedEngine(w, max_streams=4, max_positions=128)
    bad = dataclasses.replace(prompts[0], embeds=prompts[0].embeds * float("nan"))
    early = []
    out = eng.run(StepPlan(admit=(Admission(0, bad, GREEDY), Admission(2, prompts[1], GREEDY)), decode=(0, 2)),
                  on_codes=early.append)
    why = "non-finite talker logits after prefill"
    assert out.failed == {0: why} and early[0].failed == {0: why}
    assert [r.slot for r in out.frames] == [2] == [r.slot for r in early[0].frames]
    np.testing.assert_array_equal(out.frames[0].codes, want)
    assert 0 not in eng.positions and eng.blocks_in_use == len(eng.kv.blocks(2))
