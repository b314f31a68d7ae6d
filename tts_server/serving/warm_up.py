"""One short request through an engine's whole path before the server says SERVING.

Start-up compiles every kernel and captures every graph, yet the first request after a start
took 24-55 ms in its first frame against 2.3-2.7 for the next ones (first audio 31-64 ms against
8-11; an H200, empty and filled Triton caches, benchmarks/results/h200-s35/startup*): first-time
work on the engine thread's path of a request (admission, first draws, the frame, the codes'
copy, the codec's launch) that nothing at start-up reaches. Not the graphs' first launch
(replaying each at start-up changed nothing); what it is was not found (per-thread library
state is a candidate: the engine thread is not the one that captured). This request takes that
cost instead of a user's (first audio of the first request then 10.7-11.0 ms). Its stream ends
and frees its slot like any other (an admission rewrites the slot's KV, state and codec
history), so it changes no later request's bytes."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import numpy as np

from ..api import AudioChunk, FinishReason, ModelInfo, ReferenceAudio, SamplingConfig, StreamEnd, SynthesisRequest

log = logging.getLogger(__name__)

FRAMES = 4  # a few frames: the first frame's path and the steps that follow it


def warm_up_request(info: ModelInfo, frames: int = FRAMES) -> SynthesisRequest:
    """A short request this model takes: a voice of its own, or (Base models) a second of quiet
    tone as the reference to clone (x-vector only)."""
    reference = None
    if info.requires_reference:
        t = np.arange(info.sample_rate, dtype=np.float32) / info.sample_rate
        reference = ReferenceAudio(0.1 * np.sin(2 * np.pi * 220.0 * t).astype(np.float32), info.sample_rate, "")
    return SynthesisRequest(request_id="warm-up", text="Hello there.", voice=None if info.requires_reference
                            else info.default_voice, language="auto", sampling=SamplingConfig(seed=0),
                            max_frames=frames, output_sample_rate=info.sample_rate, reference=reference)


def enabled() -> bool:
    """TTS_WARM_UP_REQUEST=0 turns it off (A/B measurements only)."""
    return os.environ.get("TTS_WARM_UP_REQUEST", "1") != "0"


def run_warm_up(worker, info: ModelInfo, timeout_s: float = 120.0) -> float:
    """Submit warm_up_request to a started worker (a serving.loop.Worker) and read its stream to
    the end, as a handler would; seconds taken. Raises if it fails: a server whose engine cannot
    make four frames must not say SERVING."""
    request = warm_up_request(info)

    async def run() -> None:
        handle = worker.submit(request, asyncio.get_running_loop())
        end = None
        try:
            async for event in handle:
                if isinstance(event, AudioChunk):
                    handle.mark_sent(event.samples.shape[0])
                elif isinstance(event, StreamEnd):
                    end = event
        finally:  # (timed out: the engine drops the stream at its next step)
            handle.cancel()
        if end is None or end.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"the start-up's warm-up request failed: {end and end.error}")

    t0 = time.perf_counter()
    try:
        asyncio.run(asyncio.wait_for(run(), timeout_s))
    except TimeoutError:
        raise RuntimeError(f"the start-up's warm-up request did not end in {timeout_s:g} s") from None
    took = time.perf_counter() - t0
    log.info("warm-up request on %s: %d frames in %.0f ms", worker.label, request.max_frames, took * 1e3)
    return took
