#!/usr/bin/env python
"""Where one stream's first audio goes, in-process (no gRPC): the server's worker on the full-size
synthetic model (--max-streams 8), requests submitted one at a time from an asyncio loop; per
request the time from submit to the first AudioChunk reaching the loop, and the engine thread's
admission steps under cProfile (top functions by own and by cumulative time).

  PYTHONPATH=. python3 scripts/gpu_c1_profile.py --out $OUT [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_client.workloads import ENGLISH  # noqa: E402
from tts_server.api import AudioChunk, SamplingConfig, StreamEnd, SynthesisRequest  # noqa: E402
from tts_server.app import build_app  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.serving import loop as loop_mod  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trace", type=int, default=0,
                    help="also record N more requests under torch.profiler into trace.json: kernels "
                         "and CUDA runtime calls of every thread (CPU ops of this thread only), for "
                         "the GPU's idle gaps (scripts/trace_gaps.py)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    profiling = {"on": False}
    orig = loop_mod.Worker._step

    def step(self, plan):
        if plan.admit and profiling["on"]:
            prof.enable()
            try:
                return orig(self, plan)
            finally:
                prof.disable()
        return orig(self, plan)

    loop_mod.Worker._step = step
    loaded = load_model(args.model, args.device)
    app = build_app(ServerConfig(model=args.model, max_streams=8, port=0), loaded)
    worker = app.worker
    texts = [u.text for u in ENGLISH]

    async def one(i: int) -> dict:
        req = SynthesisRequest(f"p{i}", texts[i % len(texts)], None, "english", SamplingConfig(seed=i), 2, 24000)
        t0 = time.monotonic()
        handle = worker.submit(req, asyncio.get_running_loop())
        first, timings = None, None
        async for ev in handle:
            if isinstance(ev, AudioChunk) and first is None:
                first, timings = time.monotonic(), ev.timings
            if isinstance(ev, StreamEnd):
                break
        rec = {"ttfc_ms": (first - t0) * 1e3}
        rec.update({k: v for k, v in (timings or {}).items() if k != "ready_at"})
        if timings and "ready_at" in timings:
            rec["post_to_loop_ms"] = (first - timings["ready_at"]) * 1e3
        return rec

    async def run() -> list[dict]:
        for i in range(5):  # warm-up
            await one(i)
        profiling["on"] = True
        recs = []
        for i in range(args.requests):
            recs.append(await one(i))
            await asyncio.sleep(0.05)  # the engine idle again, as at c = 1
        profiling["on"] = False
        if args.trace:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts, with_stack=False) as tp:
                for i in range(args.trace):
                    with torch.profiler.record_function(f"request{i}"):
                        recs_t.append(await one(100 + i))
                    await asyncio.sleep(0.05)
            tp.export_chrome_trace(str(out / "trace.json"))
        return recs

    recs_t: list[dict] = []
    recs = asyncio.run(run())
    worker.stop(10)
    keys = sorted({k for r in recs for k in r})
    summary = {k: round(statistics.median([r[k] for r in recs if k in r]), 3) for k in keys}
    print("median ms:", json.dumps(summary))
    res = dict(summary_median_ms=summary, records=recs, traced=recs_t)
    for sort in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(35)
        res[f"profile_{sort}"] = s.getvalue()
        print(s.getvalue()[:6000])
    (out / "c1_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
