#!/usr/bin/env python
"""Implicit host waits on the serving path (GPU, full-size synthetic model): the server's worker
in-process (as gpu_c1_profile.py), a few requests one at a time and then a few at once, with
torch's sync debug mode on ("warn": every op that makes the host wait for the device, such as a
copy from pageable memory or to a non-pinned host tensor, .item(), nonzero, warns). Prints each
distinct Python stack that warned (innermost 6 frames of this repo) with its count. Intended waits
(the PCM to the host) show too: read the list, do not assert on it.

  PYTHONPATH=. python3 scripts/gpu_sync_audit.py --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_client.workloads import ENGLISH  # noqa: E402
from tts_server.api import SamplingConfig, StreamEnd, SynthesisRequest  # noqa: E402
from tts_server.app import build_app  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--together", type=int, default=6)
    args = ap.parse_args()
    loaded = load_model("synthetic", "cuda")
    app = build_app(ServerConfig(model="synthetic", max_streams=8, port=0), loaded)
    worker = app.worker
    texts = [u.text for u in ENGLISH]
    seen: collections.Counter = collections.Counter()
    orig = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return orig(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if str(ROOT) in f.filename][-6:]
        key = (str(message).splitlines()[0][:90],) + tuple(
            f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}: {(f.line or '').strip()[:80]}" for f in frames)
        seen[key] += 1

    async def one(i: int) -> None:
        req = SynthesisRequest(f"a{i}", texts[i % len(texts)], None, "english", SamplingConfig(seed=i), 1, 24000)
        async for ev in worker.submit(req, asyncio.get_running_loop()):
            if isinstance(ev, StreamEnd):
                break

    async def run() -> None:
        for i in range(3):
            await one(i)
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(args.requests):
                await one(10 + i)
            await asyncio.gather(*(one(20 + i) for i in range(args.together)))
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = orig

    asyncio.run(run())
    worker.stop(10)
    res = [{"count": n, "what": k[0], "stack": list(k[1:])} for k, n in seen.most_common()]
    for r in res:
        print(f"{r['count']:5d}x {r['what']}")
        for f in r["stack"]:
            print("        ", f)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sync_audit.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
