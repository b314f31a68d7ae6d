"""Runs a real Pipecat pipeline (QwenTTSService -> printer) against a running tts-server and prints
every frame with its time: an LLM-style two-sentence turn, then a long sentence interrupted mid-way.
Usage: python scripts/pipecat_transcript.py --address 127.0.0.1:50051"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from loguru import logger

from pipecat.frames.frames import (ErrorFrame, Frame, InterruptionFrame, LLMFullResponseEndFrame,
                                   LLMFullResponseStartFrame, LLMTextFrame, MetricsFrame,
                                   TTSAudioRawFrame, TTSSpeakFrame, TTSStoppedFrame, TTSTextFrame,
                                   TTSUpdateSettingsFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from pipecat_service import QwenTTSService, QwenTTSSettings

QUIET = ("StartFrame", "EndFrame", "MetricsFrame", "AggregatedTextFrame",
         "LLMAssistantPushAggregationFrame")


def stamp(t0: float) -> str:
    """Wall-clock time (to match the server's log) and seconds since t0."""
    now = time.time()
    return f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} " \
           f"{time.perf_counter() - t0:7.3f} s"


class FramePrinter(FrameProcessor):
    """Prints each frame passing by in one direction, with its time; counts frames by type."""

    def __init__(self, t0: float, where: str, direction: FrameDirection):
        super().__init__()
        self.t0, self.where, self.direction = t0, where, direction
        self.counts: dict[str, int] = {}
        self.changed = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        name = type(frame).__name__
        line = describe(frame) if direction == self.direction else None
        if direction == self.direction:
            self.counts[name] = self.counts.get(name, 0) + 1
            self.changed.set()
        if line is not None:
            print(f"{stamp(self.t0)}  {self.where:3} {name:26} {line}", flush=True)
        await self.push_frame(frame, direction)

    async def wait_count(self, name: str, n: int, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while self.counts.get(name, 0) < n:
                self.changed.clear()
                await self.changed.wait()


def describe(frame: Frame) -> str | None:
    ctx = getattr(frame, "context_id", None)
    ctx = f"ctx={ctx[:8]}" if ctx else ""
    if isinstance(frame, TTSAudioRawFrame):
        return f"{len(frame.audio):6d} B  {frame.num_frames / frame.sample_rate * 1000:4.0f} ms " \
               f"@ {frame.sample_rate} Hz  {ctx}"
    if isinstance(frame, (TTSTextFrame, LLMTextFrame)):
        return f"{frame.text!r} {ctx}"
    if isinstance(frame, ErrorFrame):
        return f"{frame.error} (fatal={frame.fatal}, category={frame.category})"
    if isinstance(frame, MetricsFrame):
        values = [f"{type(d).__name__}={getattr(d, 'value', '')}" for d in frame.data
                  if getattr(d, "value", 0)]
        return "  ".join(values) if values else None
    if type(frame).__name__ in QUIET:
        return None
    return ctx


async def main(args) -> None:
    t0 = time.perf_counter()
    # "in": queued into the TTS; "out": what the TTS pushed downstream; "up": upstream (errors).
    head_in = FramePrinter(t0, "in", FrameDirection.DOWNSTREAM)
    head_up = FramePrinter(t0, "up", FrameDirection.UPSTREAM)
    tail = FramePrinter(t0, "out", FrameDirection.DOWNSTREAM)
    tts = QwenTTSService(address=args.address, voice=args.voice,
                         settings=QwenTTSSettings(seed=args.seed, max_duration_s=1.0))
    worker = PipelineWorker(Pipeline([head_up, head_in, tts, tail]), idle_timeout_secs=None,
                            enable_rtvi=False,
                            params=PipelineParams(audio_out_sample_rate=args.rate,
                                                  enable_metrics=True, enable_usage_metrics=True))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())

    def mark(text: str) -> None:
        print(f"{stamp(t0)}  --- {text}", flush=True)

    mark("LLM turn: 'Hello there. How are you today?' as 4 tokens")
    tokens = ["Hello ", "there. How", " are you", " today?"]
    await worker.queue_frames([LLMFullResponseStartFrame(), *map(LLMTextFrame, tokens),
                               LLMFullResponseEndFrame()])
    await tail.wait_count("TTSStoppedFrame", 1)
    mark(f"long sentence (max_duration_s={args.long_s}); interrupt after "
         f"{args.interrupt_after} audio frames")
    num_audio = tail.counts.get("TTSAudioRawFrame", 0)
    await worker.queue_frames([
        TTSUpdateSettingsFrame(delta=QwenTTSSettings(max_duration_s=args.long_s)),
        TTSSpeakFrame("This is a long answer that the user will talk over.")])
    await tail.wait_count("TTSAudioRawFrame", num_audio + args.interrupt_after)
    mark("InterruptionFrame (the user started speaking)")
    await worker.queue_frame(InterruptionFrame())
    await asyncio.sleep(0.5)
    mark("next sentence after the interruption")
    await worker.queue_frames([TTSUpdateSettingsFrame(delta=QwenTTSSettings(max_duration_s=1.0)),
                               TTSSpeakFrame("Sure, go ahead.")])
    await tail.wait_count("TTSStoppedFrame", 2)
    mark("EndFrame")
    await worker.stop_when_done()
    await run
    assert tail.counts.get(TTSStoppedFrame.__name__) == 2


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--voice", default=None)
    p.add_argument("--rate", type=int, default=24000, help="pipeline output sample rate")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--long-s", type=float, default=30.0, help="max_duration_s of the long sentence")
    p.add_argument("--interrupt-after", type=int, default=3,
                   help="audio frames before interrupting")
    p.add_argument("--log-level", default="WARNING", help="Pipecat's log level (stderr)")
    args = p.parse_args()
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    asyncio.run(main(args))
