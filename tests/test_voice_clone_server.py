"""Voice cloning over the wire with a Base-shaped tiny model: x-vector and in-context modes."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import soundfile

from tts_client.client import TTSClient, build_request


def _wav_bytes(samples, rate) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def _say(address, **kwargs):
    async with TTSClient(address) as client:
        return await client.synthesize(build_request("Clone this voice.", max_duration_s=0.4,
                                                     seed=5, **kwargs), timeout=60)


@pytest.mark.parametrize("transcript", ["", "This is the reference transcript."],
                         ids=["x-vector", "icl"])
async def test_clone_from_reference(base_server, reference_audio, transcript):
    wav, rate = reference_audio
    res = await _say(base_server, reference_audio=_wav_bytes(wav, rate), reference_text=transcript)
    assert res.summary.num_frames == 5 and res.samples.shape[0] == 5 * 1920
    # a 16 kHz reference of the same voice works too (the clone path resamples)
    import soxr

    res16 = await _say(base_server, reference_audio=_wav_bytes(soxr.resample(wav, rate, 16000), 16000),
                       reference_text=transcript)
    assert res16.summary.num_frames == 5


async def test_reference_changes_the_voice(base_server, reference_audio):
    wav, rate = reference_audio
    # greedy: random weights give near-uniform distributions that one seed samples alike
    a = await _say(base_server, reference_audio=_wav_bytes(wav, rate), greedy=True)
    # x-vectors pool statistics over time, so the other voice must differ in spectrum
    noise = 0.3 * np.random.default_rng(1).standard_normal(wav.shape[0]).astype(np.float32)
    b = await _say(base_server, reference_audio=_wav_bytes(noise, rate), greedy=True)
    assert not np.array_equal(a.samples, b.samples)


@pytest.mark.parametrize("kwargs,field", [
    (dict(), "reference"),
    (dict(voice="ryan"), "voice"),
    (dict(reference_audio=b"\x00" * 1000), "reference.audio"),
])
async def test_base_model_request_errors(base_server, kwargs, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _say(base_server, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


async def test_too_short_reference_rejected(base_server):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _say(base_server, reference_audio=_wav_bytes(np.zeros(2400, np.float32), 24000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "0.10 s" in err.value.details()


async def test_repeated_icl_reference_restores_the_primed_codec_state(base_app, base_server,
                                                                       reference_audio):
    """The codec state primed with a reference's frames is kept per voice: the same reference
    again restores it (no priming steps on the engine thread) and gives the same audio."""
    wav, rate = reference_audio
    ref = dict(reference_audio=_wav_bytes(wav, rate), reference_text="This is the reference transcript.")
    worker = base_app.worker
    first = await _say(base_server, **ref)
    hits = worker.primed_voice_hits
    second = await _say(base_server, **ref)
    assert worker.primed_voice_hits == hits + 1
    np.testing.assert_array_equal(first.samples, second.samples)
    await _say(base_server, reference_audio=_wav_bytes(wav[::-1].copy(), rate),
               reference_text="This is the reference transcript.")
    assert worker.primed_voice_hits == hits + 1  # another voice is primed, not restored


async def test_codec_state_is_zeroed_after_the_prefill_launch_and_a_primed_clone_is_kept(
        base_app, base_server, reference_audio, monkeypatch):
    """A stream's codec state is zeroed after its prefill is launched (off the host's path to the
    first frame) and before the codec's first use; an in-context clone's slot is zeroed first and
    then primed, and nothing zeroes it again (the real codec and engine run; their calls are
    recorded in order)."""
    wav, rate = reference_audio
    worker = base_app.worker
    calls = []

    def spy(obj, name, record):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            calls.append(record(*a, **k))
            return real(*a, **k)
        monkeypatch.setattr(obj, name, wrapped)

    spy(worker.codec, "reset_many", lambda slots: ("zero", tuple(int(s) for s in slots)))
    spy(worker.codec, "reset", lambda slot, ref=None: ("prime" if ref is not None else "zero", (int(slot),)))
    spy(worker.codec, "restore", lambda slot, state: ("restore", (int(slot),)))
    spy(worker.codec, "step", lambda slots, codes: ("decode", tuple(int(s) for s in slots)))
    spy(worker.engine, "run", lambda plan, **k: ("run", tuple(a.slot for a in plan.admit)))

    def first(kind, slot, after=0):
        return next(i for i, (k, s) in enumerate(calls) if i >= after and k == kind and slot in s)

    # an x-vector clone (no reference frames): zeroed once its prefill is launched
    await _say(base_server, reference_audio=_wav_bytes(wav, rate))
    run = next(i for i, c in enumerate(calls) if c[0] == "run" and c[1])
    slot = calls[run][1][0]
    assert first("zero", slot) > run, calls[:8]
    assert first("zero", slot) < first("decode", slot)
    # an in-context clone (a voice of its own: the app is shared with the other tests), primed,
    # then the same voice again, restored: each zeroed first and never zeroed again before its audio
    ref = dict(reference_audio=_wav_bytes(0.5 * wav, rate), reference_text="A transcript of its own.")
    for kind in ("prime", "restore"):
        calls.clear()
        await _say(base_server, **ref)
        run = next(i for i, c in enumerate(calls) if c[0] == "run" and c[1])
        slot = calls[run][1][0]
        zero, state = first("zero", slot), first(kind, slot)
        assert zero < state < run, calls[:8]
        assert not any(k == "zero" and slot in s for k, s in calls[state:first("decode", slot)]), calls
