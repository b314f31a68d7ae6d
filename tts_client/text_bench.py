"""Incremental-text latency (#20 evidence): N concurrent StreamSynthesize calls, each one context
fed one word every --word-ms (as an LLM streams), against a running server.

Per context: first text delta -> first audio, and `end` -> last audio (client clock). Method: all
N calls start together after one warm-up context; every context speaks the same text with its own
seed; the report gives p50/p95/max per concurrency level as JSON.

    python -m tts_client.text_bench --address 127.0.0.1:50051 --concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from .client import TTSClient

TEXT = ("Thanks for waiting. I looked at your order and it shipped this morning, so it should "
        "arrive on Thursday; I will send you the tracking link by email right away.")


async def one_context(client: TTSClient, seed: int, word_s: float, voice: str, max_s: float) -> dict:
    call = client.text_stream(timeout=300)
    await call.open("c", voice=voice, seed=seed, max_duration_s=max_s)
    t = {"first_audio": None, "last_audio": None, "done": None}

    async def read():
        async for msg in call:
            kind = msg.WhichOneof("content")
            now = time.perf_counter()
            if kind == "audio":
                t["first_audio"] = t["first_audio"] or now
                t["last_audio"] = now
            elif kind == "done":
                t["done"] = msg.done
                return

    reader = asyncio.create_task(read())
    words = TEXT.split(" ")
    t0 = time.perf_counter()
    for i, w in enumerate(words):
        await call.text("c", w if i == 0 else " " + w)
        await asyncio.sleep(word_s)
    t_end = time.perf_counter()
    await call.end("c")
    await reader
    await call.close()
    done = t["done"]
    return {"first_audio_ms": (t["first_audio"] - t0) * 1e3 if t["first_audio"] else None,
            "end_to_last_audio_ms": (t["last_audio"] - t_end) * 1e3 if t["last_audio"] else None,
            "text_ms": (t_end - t0) * 1e3, "frames": done.num_frames if done else 0,
            "finish_reason": int(done.finish_reason) if done else 0}


def _summary(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}
    return {"p50": statistics.median(values), "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
            "max": values[-1], "n": len(values)}


async def run(address: str, levels: list[int], word_s: float, voice: str, max_s: float) -> dict:
    out = {"method": f"one context per call, one word per {word_s * 1e3:g} ms, {len(TEXT.split())} "
                     f"words, all calls started together, one warm-up context first", "levels": {}}
    async with TTSClient(address) as client:
        await one_context(client, 0, 0.0, voice, max_s)  # warm-up
        for n in levels:
            rows = await asyncio.gather(*[one_context(client, i + 1, word_s, voice, max_s) for i in range(n)])
            out["levels"][n] = {"first_audio_ms": _summary([r["first_audio_ms"] for r in rows]),
                                "end_to_last_audio_ms": _summary([r["end_to_last_audio_ms"] for r in rows]),
                                "text_ms": _summary([r["text_ms"] for r in rows])}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port of a running tts-server")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated numbers of calls")
    p.add_argument("--word-ms", type=float, default=10.0, help="time between words")
    p.add_argument("--voice", default="", help="voice (empty: the server's default)")
    p.add_argument("--max-duration-s", type=float, default=20.0, help="cap per context")
    p.add_argument("--json", help="also write the report here")
    a = p.parse_args(argv)
    report = asyncio.run(run(a.address, [int(x) for x in a.concurrency.split(",")], a.word_ms / 1e3,
                             a.voice, a.max_duration_s))
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
