#!/usr/bin/env python
"""One stream's admission step on the engine thread as a timeline (GPU, full-size synthetic model,
no profiler): the step `engine.run(admit + decode of the same slot)` as c = 1 runs it, with the
engine's phases wrapped: host time at each phase's entry and exit, and a CUDA event at each, so
that the table shows where the host runs ahead of the device and where the device waits for it.
Median over --repeats admissions of real English prompts (RequestPreparer), ms from run()'s entry.

  PYTHONPATH=. python3 scripts/gpu_admit_timeline.py --out $OUT [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_client.workloads import ENGLISH  # noqa: E402
from tts_server.api import SamplingConfig, SynthesisRequest  # noqa: E402
from tts_server.app import create_engine  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.engines.batched import engine as engine_mod  # noqa: E402
from tts_server.engines.batched import kv_pool, prefill, state  # noqa: E402
from tts_server.engines.contract import Admission, StepPlan  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.serving.prepare import RequestPreparer  # noqa: E402

PHASES = [(engine_mod.BatchedEngine, "_reserve"), (engine_mod.BatchedEngine, "_rows"),
          (prefill.RowPrefillGraphs, "_stage"), (prefill.RowPrefillGraphs, "run"),
          (state.SlotState, "admit_many"), (kv_pool.PagedKV, "sync"), (engine_mod.BatchedEngine, "_first_draws"),
          (engine_mod.BatchedEngine, "_admit_rows"), (engine_mod.BatchedEngine, "_predict"),
          (engine_mod.BatchedEngine, "_advance"), (engine_mod.BatchedEngine, "_step"),
          (engine_mod.BatchedEngine, "_finish_step")]

marks: list = []  # (name, "in"/"out", host s, CUDA event or None)
on = {"v": False, "main_thread": True}  # recording; whether the main thread's calls count


def _event():
    if not torch.cuda.is_available():
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def wrap(cls, name) -> None:
    """Record host time and a CUDA event at each entry and exit of cls.name while on["v"]."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def f(*a, **k):
        if not on["v"] or (not on["main_thread"] and threading.current_thread() is threading.main_thread()):
            return orig(*a, **k)
        marks.append((name, "in", time.perf_counter(), _event()))
        try:
            return orig(*a, **k)
        finally:
            marks.append((name, "out", time.perf_counter(), _event()))
    setattr(cls, name, f)


def collect(rows: dict, t0: float, base) -> None:
    """This run's marks into rows ({"name#i in|out": [(host ms, gpu ms)]}), from t0 / base."""
    seen: dict[str, int] = {}
    for name, io, t, ev in list(marks):
        k = f"{name}#{seen.get(name + io, 0)} {io}"
        seen[name + io] = seen.get(name + io, 0) + 1
        rows.setdefault(k, []).append(((t - t0) * 1e3, base.elapsed_time(ev) if base is not None else 0.0))


def table(rows: dict, min_runs: int = 1) -> list:
    """Print and return [(phase, runs, host ms, gpu ms)] medians, in host order (phases seen in
    fewer than min_runs runs left out)."""
    out = []
    print(f"{'phase':32s} {'n':>3s} {'host ms':>8s} {'gpu ms':>8s}")
    for k in sorted(rows, key=lambda k: statistics.median(h for h, _ in rows[k])):
        if len(rows[k]) < min_runs:
            continue
        h = statistics.median(x for x, _ in rows[k])
        g = statistics.median(y for _, y in rows[k])
        out.append((k, len(rows[k]), round(h, 3), round(g, 3)))
        print(f"{k:32s} {len(rows[k]):3d} {h:8.3f} {g:8.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    loaded = load_model("synthetic", "cuda")
    engine = create_engine("batched", loaded, ServerConfig(max_streams=8))
    if loaded.text_table is None:
        from tts_server.model.prompt import project_vocabulary
        loaded.text_table = project_vocabulary(loaded.model)
    prep = RequestPreparer(loaded)
    voice = next(iter(loaded.model.config.talker_config.spk_id or {}), None) if loaded.model_type == "custom_voice" else None
    for cls, name in PHASES:
        wrap(cls, name)
    rows: dict[str, list] = {}
    totals = []
    for i in range(args.repeats + 3):
        text = ENGLISH[i % len(ENGLISH)].text
        req = SynthesisRequest(f"r{i}", text, voice, "auto", SamplingConfig(seed=i), 100, 24000)
        p = prep.prepare(req, prep.text_ids(text))
        plan = StepPlan(decode=(0,), admit=(Admission(0, p.prompt, SamplingConfig(seed=i)),))
        torch.cuda.synchronize()
        marks.clear()
        on["v"] = True
        base = _event()
        t0 = time.perf_counter()
        engine.run(plan)
        t1 = time.perf_counter()
        on["v"] = False
        torch.cuda.synchronize()
        engine.release(0)
        if i < 3:
            continue
        totals.append((t1 - t0) * 1e3)
        collect(rows, t0, base)
    res = {"device": torch.cuda.get_device_name(), "repeats": args.repeats,
           "run_ms_median": round(statistics.median(totals), 3)}
    print(f"engine.run (admit + first frame), host wall median {res['run_ms_median']:.3f} ms")
    res["timeline"] = table(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "admit_timeline.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
