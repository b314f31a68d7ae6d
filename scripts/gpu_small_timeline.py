#!/usr/bin/env python
"""Where a small step's frame time goes with and without the small-batch kernel: one engine each
way (TTS_SMALL_KERNEL), B streams at mixed contexts, graph replays of the frame under the torch
profiler; from the last replay's kernels (device timestamps): the predict half's kernels by name
(count, total µs), the gaps between consecutive kernels (total, and around cp_layers_kernel), and
one code-predictor pass's span (from a draw's end to the next draw's end); the kernels in order
(seq-<label>.json: start and duration in µs from the replay's first kernel, name).

  PYTHONPATH=. python3 scripts/gpu_small_timeline.py --out $OUT [--sizes 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_batched_engine import fake_admit, time_replays  # noqa: E402

from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.graphs import bucket_for  # noqa: E402


def timeline(eng: BatchedEngine, slots: list[int], out: Path, label: str, replays_only: bool = False) -> dict:
    n = len(slots)
    b = bucket_for(n, eng.sizes)
    ms = time_replays(eng, slots, 20)
    if replays_only:  # (under Nsight Compute, whose CUPTI the torch profiler cannot share)
        rec = dict(label=label, B=n, replay_ms=round(ms, 4))
        print(json.dumps(rec), flush=True)
        return rec
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.replay_frame(n, b)
        torch.cuda.synchronize()
    path = out / f"trace-{label}.json"
    prof.export_chrome_trace(str(path))
    ev = [e for e in json.loads(path.read_text())["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    # the last replay: from the last predict_inputs kernel on
    starts = [i for i, e in enumerate(ev) if "predict_inputs" in e["name"]]
    last = ev[starts[-1]:] if starts else ev
    by = defaultdict(lambda: [0, 0.0])
    gaps, around = [], []
    for i, e in enumerate(last):
        by[e["name"][:60]][0] += 1
        by[e["name"][:60]][1] += e["dur"]
        if i:
            g = e["ts"] - (last[i - 1]["ts"] + last[i - 1]["dur"])
            gaps.append(g)
            if "cp_layers" in e["name"] or "cp_layers" in last[i - 1]["name"]:
                around.append(round(g, 2))
    span = last[-1]["ts"] + last[-1]["dur"] - last[0]["ts"]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:14]
    small = [round(e["dur"], 2) for e in last if "cp_layers" in e["name"]]
    rec = dict(label=label, B=n, replay_ms=round(ms, 4), kernels=len(last), span_us=round(span, 1),
               busy_us=round(sum(e["dur"] for e in last), 1), gaps_us=round(float(np.sum(gaps)), 1),
               gaps_around_small_us=around[:8], small_kernel_us=small[:15],
               top=[(k, c, round(t, 1)) for k, (c, t) in top])
    print(json.dumps(rec), flush=True)
    # the replay's kernels in order (µs from its first kernel's start: start, duration, name), so
    # that a pass's critical path (a launch's end to the next one's start) can be read off
    t0 = last[0]["ts"]
    (out / f"seq-{label}.json").write_text(json.dumps(
        [(round(e["ts"] - t0, 2), round(e["dur"], 2), e["name"][:40]) for e in last]))
    path.unlink()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--max-streams", type=int, default=8)
    ap.add_argument("--modes", nargs="*", default=["off", "on"], help="off: the graphs alone (TTS_SMALL_KERNEL=0)")
    ap.add_argument("--replays-only", action="store_true", help="time the replays, no torch profiler (for ncu)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    w = checks.random_weights("cuda")
    recs = []
    for mode in a.modes:
        os.environ["TTS_SMALL_KERNEL"] = "0" if mode == "off" else "1"
        eng = BatchedEngine(w, max_streams=max(a.max_streams, *a.sizes), max_positions=2048)
        print(f"{mode}: small kernel {eng.small_kernel}", flush=True)
        for b in a.sizes:
            slots = fake_admit(eng, checks.mixed_lengths(b), margin=128)
            recs.append(timeline(eng, slots, out, f"{mode}-B{b}", a.replays_only))
        del eng
        torch.cuda.empty_cache()
    (out / "small_timeline.json").write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
