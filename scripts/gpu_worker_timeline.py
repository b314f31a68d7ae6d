#!/usr/bin/env python
"""One stream's first audio through the server's worker as a host timeline (GPU, full-size
synthetic model, in-process worker as gpu_c1_profile.py, no profiler): requests one at a time,
the worker's and the engine's phases wrapped with host times (and a CUDA event each: the device's
view), ms from the request's submit; the first chunk's arrival in the asyncio loop last. Median
over --requests of the English prompts. The engine process's pipe is not in this path (the
server's queue and write parts include it).

  PYTHONPATH=. python3 scripts/gpu_worker_timeline.py --out $OUT [--requests 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_client.workloads import ENGLISH  # noqa: E402
from tts_server.api import AudioChunk, SamplingConfig, StreamEnd, SynthesisRequest  # noqa: E402
from tts_server.app import build_app  # noqa: E402
from tts_server.codec import batched as codec_mod  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.engines.batched import engine as engine_mod  # noqa: E402
from tts_server.model import prompt as prompt_mod  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.serving import loop as loop_mod  # noqa: E402
from tts_server.serving import prepare as prepare_mod  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_admit_timeline import _event, collect, marks, on, table, wrap  # noqa: E402

W, E, C = loop_mod.Worker, engine_mod.BatchedEngine, codec_mod.BatchedCodecDecoder
PHASES = [(W, "_step"), (W, "_prepare_all"), (prepare_mod.RequestPreparer, "prepare_many"),
          (prompt_mod.PromptBuilder, "plan"), (prompt_mod.PromptBuilder, "materialise"), (C, "reset_many"),
          (C, "reset"), (W, "_prepare"), (W, "_run_step"), (E, "run"), (E, "_admit_rows"), (E, "_step"),
          (W, "_launch"), (C, "launch"), (W, "_audio"), (C, "collect"), (W, "_add_audio"), (E, "_finish_step")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    on["main_thread"] = False  # the engine thread's calls only (submit tokenizes on the main one)
    for cls, name in PHASES:
        wrap(cls, name)
    loaded = load_model(args.model, args.device)
    app = build_app(ServerConfig(model=args.model, max_streams=8, port=0), loaded)
    worker = app.worker
    texts = [u.text for u in ENGLISH]
    rows: dict[str, list] = {}
    firsts = []

    async def one(i: int, record: bool) -> None:
        req = SynthesisRequest(f"t{i}", texts[i % len(texts)], None, "english", SamplingConfig(seed=i), 1, 24000)
        marks.clear()
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.synchronize()
        base = _event()
        on["v"] = record
        t0 = time.perf_counter()
        first = None
        async for ev in worker.submit(req, asyncio.get_running_loop()):
            if isinstance(ev, AudioChunk) and first is None:
                first = time.perf_counter()
                on["v"] = False
            if isinstance(ev, StreamEnd):
                break
        on["v"] = False
        if not record:
            return
        if gpu:
            torch.cuda.synchronize()
        firsts.append((first - t0) * 1e3)
        collect(rows, t0, base)

    async def run() -> None:
        for i in range(4):
            await one(i, False)
        for i in range(args.requests):
            await one(10 + i, True)
            await asyncio.sleep(0.03)

    asyncio.run(run())
    worker.stop(10)
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "requests": args.requests,
           "first_chunk_ms_median": round(statistics.median(firsts), 3)}
    print(f"submit -> first chunk in the loop: median {res['first_chunk_ms_median']:.3f} ms")
    res["timeline"] = table(rows, args.requests // 2)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "worker_timeline.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
