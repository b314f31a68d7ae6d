"""StreamSynthesize over a real loopback server (tiny synthetic models, torch engine): audio before
the text ends, the same audio however the text was split or paused, flush acks and word timings,
cancel and barge-in, idle contexts, and bad sequences that end only their context."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import numpy as np
import pytest

from tts_client.client import TTSClient, build_request
from tts_client.pb.tts.v1 import tts_pb2
from tts_client.text_stream import ContextResult

GREEDY = dict(voice="ryan", language="english", greedy=True, seed=3)


async def _drain(call, results: dict, until: set, t0: float = 0.0, timeout: float = 60.0):
    """Read responses into results[context_id] until every context in `until` is done."""
    await asyncio.wait_for(call.collect(until, results, clock=lambda: time.perf_counter() - t0), timeout)


async def _speak(address, pieces, config=None, pause=None, **cfg):
    """One context fed `pieces` (pause: {index: seconds} before that piece), then end."""
    async with TTSClient(address) as client:
        call = client.text_stream(timeout=120)
        await call.open("c", config, **({} if config is not None else cfg))
        for i, p in enumerate(pieces):
            if pause and i in pause:
                await asyncio.sleep(pause[i])
            await call.text("c", p)
        await call.end("c")
        results = {}
        await _drain(call, results, {"c"})
        await call.close()
        return results["c"]


def _splits(text: str, rng: random.Random, n: int) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(n, len(text) - 1)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


async def test_first_audio_before_the_last_word_is_sent(tiny_server):
    words = ("Streaming text in means the voice can start speaking long before the language model "
             "has finished its sentence, which is the whole point of this test here.").split()
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=120)
        await call.open("c", **GREEDY)
        results, t0 = {}, time.perf_counter()
        reader = asyncio.create_task(_drain(call, results, {"c"}, t0))
        for w in words:
            await call.text("c", w + " ")
            await asyncio.sleep(0.01)
        last_sent = time.perf_counter() - t0
        await call.end("c")
        await reader
        await call.close()
    r = results["c"]
    assert r.done.finish_reason in (tts_pb2.FINISH_REASON_EOS, tts_pb2.FINISH_REASON_MAX_LENGTH)
    assert r.chunk_times and r.chunk_times[0] < last_sent, (r.chunk_times[:1], last_sent)
    assert r.done.num_frames >= len(words)  # never an early end: every token entered


@pytest.fixture(scope="module")
def reference_wav(reference_audio):
    import io

    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, reference_audio[0], reference_audio[1], format="WAV")
    return buf.getvalue()


EQUAL_TEXTS = ["Hello there, it's a streaming test.", "你好，世界。今天天气很好。",
               "Emoji 👨‍👩‍👧 and 🇩🇪 flags 👍🏽!"]


@pytest.mark.parametrize("text,greedy", [(t, True) for t in EQUAL_TEXTS] + [(EQUAL_TEXTS[0], False)],
                         ids=["english", "cjk", "emoji", "english-sampled"])
async def test_pieces_equal_one_shot_synthesize(base_server, reference_wav, text, greedy):
    """Base model (both calls use the streaming-text prompt): the audio of a context fed in 5
    random splits (inside words and multi-byte characters) is byte-identical to Synthesize's, greedy
    or sampled with the same seed (each frame's draws depend on the seed and the frame, not on
    when the text came)."""
    common = dict(greedy=greedy, seed=1, max_duration_s=2.0, reference_audio=reference_wav)
    async with TTSClient(base_server) as client:
        whole = await client.synthesize(build_request(text, **common), timeout=120)
    assert whole.samples.size > 0
    rng = random.Random(text)
    for k in (1, 2, 3, 7, len(text)):
        got = await _speak(base_server, _splits(text, rng, k), **common)
        assert got.done.finish_reason == whole.summary.finish_reason
        np.testing.assert_array_equal(got.audio, whole.samples, err_msg=f"{k} pieces")


@pytest.mark.parametrize("where,greedy", [("mid-sentence", True), ("after-the-first-word", True),
                                          ("mid-sentence", False)])
async def test_a_pause_neither_ends_nor_changes_the_audio(tiny_server, where, greedy):
    """A 2 s pause mid-sentence; or a pause right after the first word, so that the context is
    admitted with one token and must wait before its first frame. Greedy, and sampled with a seed."""
    text = "A pause in the middle of this sentence must not end the stream early."
    cfg = dict(max_duration_s=3.0, **(GREEDY | dict(greedy=greedy)))
    want = await _speak(tiny_server, [text], **cfg)
    if where == "mid-sentence":
        pieces, pause = _splits(text, random.Random(5), 6), {3: 2.0}
    else:
        pieces, pause = ["A ", text[2:]], {1: 1.0}
    got = await _speak(tiny_server, pieces, pause=pause, **cfg)
    assert got.done.finish_reason == want.done.finish_reason
    np.testing.assert_array_equal(got.audio, want.audio)


async def test_flush_ack_and_word_timings(tiny_server):
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=60)
        await call.open("c", **GREEDY)
        await call.text("c", "Hello there wonderful wor")
        await call.flush("c", "f1")
        await call.text("c", "ld")
        await call.end("c")
        results = {}
        await _drain(call, results, {"c"})
        await call.close()
    r = results["c"]
    assert r.flush_acks == ["f1"]
    assert [w for w, _ in r.words] == ["Hello", "there", "wonderful", "wor", "ld"]
    offsets = [o for _, o in r.words]
    assert offsets == sorted(offsets) and offsets[0] == 0 and all(o % 1920 == 0 for o in offsets)
    assert offsets[-1] < r.audio.shape[0]


async def test_cancel_frees_the_slot_and_the_next_context_speaks(tiny_server, tiny_app):
    worker = tiny_app.worker
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=60)
        await call.open("a", **GREEDY)
        await call.text("a", "This context will be interrupted by the user before it is done speaking. ")
        results = {}
        async for msg in call:  # wait for its first audio
            results.setdefault(msg.context_id, ContextResult()).add(msg)
            if msg.HasField("audio"):
                break
        frames_at_cancel = worker.frames_generated
        await call.open("b", **GREEDY)  # barge-in: the next context opens while the last cancels
        await call.cancel("a")
        await call.text("b", "The next one speaks.")
        await call.end("b")
        await _drain(call, results, {"a", "b"})
        await call.close()
    a, b = results["a"], results["b"]
    assert a.done.finish_reason == tts_pb2.FINISH_REASON_CANCELLED
    assert b.done.finish_reason in (tts_pb2.FINISH_REASON_EOS, tts_pb2.FINISH_REASON_MAX_LENGTH)
    assert b.audio.size > 0 and b.done.error_code == 0
    # a's slot went at the step after the cancel: at most the step in flight made a frame for it
    assert a.done.num_frames <= frames_at_cancel + 2
    deadline = time.monotonic() + 5
    while worker.num_outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert worker.num_outstanding == 0 and worker.num_free_slots == worker.max_streams


async def test_idle_context_ends_with_a_clear_status(tiny_server, tiny_app, monkeypatch):
    monkeypatch.setattr(tiny_app.worker.texts, "idle_timeout_s", 0.5)
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=60)
        await call.open("c", **GREEDY)
        await call.text("c", "Hello there and then nothing")
        results = {}
        await _drain(call, results, {"c"}, timeout=20)
        await call.close()
    d = results["c"].done
    assert d.finish_reason == tts_pb2.FINISH_REASON_IDLE_TIMEOUT
    assert d.error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "idle-text-timeout-s" in d.error_message and d.num_frames >= 3


async def test_bad_sequences_end_only_their_context(tiny_server):
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=60)
        results = {}
        await call.text("early", "text before config")
        await call.open("twice", **GREEDY)
        await call.open("twice", **GREEDY)
        await call.open("ended", **GREEDY)
        await call.text("ended", "Some text.")
        await call.end("ended")
        await call.text("ended", "text after end")
        await _drain(call, results, {"early", "twice", "ended"})
        await call.open("big", **GREEDY)
        await call.text("big", "x" * 1999)
        await call.text("big", "yy")
        await call.open("empty", **GREEDY)
        await call.end("empty")
        await call.open("voice", voice="nobody")
        await _drain(call, results, {"big", "empty", "voice"})
        await call.open("good", **GREEDY)
        await call.text("good", "Still serving.")
        await call.end("good")
        await _drain(call, results, {"good"})
        await call.close()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    fields = {"early": "config", "twice": "config", "ended": "text", "big": "text", "empty": "text",
              "voice": "config.voice"}
    for name, field in fields.items():
        d = results[name].done
        assert d.finish_reason == tts_pb2.FINISH_REASON_ERROR, name
        assert d.error_code == invalid and d.error_message.startswith(field + ":"), (name, d.error_message)
    assert results["good"].done.error_code == 0 and results["good"].audio.size > 0


async def test_message_without_content_ends_the_call(tiny_server):
    async with TTSClient(tiny_server) as client:
        call = client.text_stream(timeout=30)
        await call.call.write(tts_pb2.StreamSynthesizeRequest(context_id="c"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "content" in e.value.details()


async def test_text_bench_reports_both_latencies(tiny_server):
    """tts_client.text_bench (the H100 evidence script) end to end at a small scale."""
    from tts_client.text_bench import run

    report = await run(tiny_server, [1, 2], 0.01, "ryan", 1.0)
    for n in (1, 2):
        level = report["levels"][n]
        assert level["first_audio_ms"]["n"] == n and level["end_to_last_audio_ms"]["n"] == n
        assert 0 < level["first_audio_ms"]["p50"] <= level["first_audio_ms"]["max"]
