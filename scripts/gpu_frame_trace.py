#!/usr/bin/env python
"""Where the batched frame kernels' time goes (csrc/batched/), from their barrier trace: every
block's arrival at and exit from every grid barrier (globaltimer), for predict and advance at
B = 1, 8, 64, 256 (mixed contexts). Per phase type: the phase's span (first exit of the barrier
before it to the last arrival at the barrier after it), the barrier's latency (last arrival to
first exit) and the mean per-block work, summed over the launch. JSON under --out.

  PYTHONPATH=. python3 scripts/gpu_frame_trace.py --out $OUT [--sizes 1,8,64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.cuda_frame import CudaFrame, barrier_phases  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.state import POS, SUB_DO_SAMPLE, SUB_TOP_K  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_cuda_frame import fake_streams, time_ms  # noqa: E402


def analyse(tr: np.ndarray, names: list[str]) -> dict:
    """tr: [blocks, events, 2] ns. Phase k ends at barrier k (arrivals), starts at barrier k - 1's
    exits (the launch's first phase: at the earliest arrival, as a lower bound)."""
    n = len(names)
    arr, ext = tr[:, :n, 0].astype(np.float64), tr[:, :n, 1].astype(np.float64)
    t0 = arr[:, 0].min()
    by: dict[str, dict] = {}
    for k, name in enumerate(names):
        start_first = ext[:, k - 1].min() if k else t0
        start_b = ext[:, k - 1] if k else np.full(arr.shape[0], t0)
        d = by.setdefault(name, dict(count=0, span_us=0.0, barrier_us=0.0, mean_work_us=0.0))
        d["count"] += 1
        d["span_us"] += (arr[:, k].max() - start_first) / 1e3
        d["barrier_us"] += (ext[:, k].min() - arr[:, k].max()) / 1e3
        d["mean_work_us"] += float(np.mean(arr[:, k] - start_b)) / 1e3
    total = (ext[:, n - 1].max() - t0) / 1e3
    for d in by.values():
        d["per_instance_span_us"] = d["span_us"] / d["count"]
        d["per_instance_barrier_us"] = d["barrier_us"] / d["count"]
        for key in ("span_us", "barrier_us", "mean_work_us"):
            d[key] = round(d[key], 1)
        d["per_instance_span_us"] = round(d["per_instance_span_us"], 2)
        d["per_instance_barrier_us"] = round(d["per_instance_barrier_us"], 2)
    return dict(traced_us=round(total, 1), barriers=n, phases=by)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,8,64,256")
    ap.add_argument("--reg-max-m", type=int, default=None)
    ap.add_argument("--variants", default="", help="also the first size with: no_top_k, greedy")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    w = checks.random_weights("cuda")
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1, use_graphs=False)
    cf = CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)
    if a.reg_max_m is not None:
        cf.reg_max_m = a.reg_max_m
    cp_layers, t_layers = eng.p.predictor.cfg.num_layers, eng.p.talker.cfg.num_layers
    res = {}
    runs = [(int(x), "default") for x in a.sizes.split(",")]
    runs += [(int(a.sizes.split(",")[0]), v) for v in a.variants.split(",") if v]
    for b, variant in runs:
        fake_streams(eng, checks.mixed_lengths(b), seed=5)
        if variant == "no_top_k":  # the code predictor's draws without the top-k filter
            eng.state.ints[SUB_TOP_K, :b] = 0
        elif variant == "greedy":
            eng.state.ints[SUB_DO_SAMPLE, :b] = 0
        rows = torch.arange(b, device="cuda")
        pos0 = eng.state.ints[POS].clone()
        for half in ("predict", "advance"):
            names = barrier_phases(half, cp_layers if half == "predict" else t_layers)
            tr = torch.zeros(cf.blocks, len(names) + 8, 2, dtype=torch.int64, device="cuda")

            def go():
                eng.state.ints[POS].copy_(pos0)
                (cf.predict(rows, b) if half == "predict" else cf.advance(rows, b))

            ms = time_ms(go, iters=10)
            cf.set_trace(tr)
            go()
            torch.cuda.synchronize()
            cf.set_trace(None)
            cf.check()
            r = analyse(tr.cpu().numpy(), names)
            r["event_ms"] = round(ms, 3)
            res[f"{half}_B{b}" + ("" if variant == "default" else "_" + variant)] = r
            top = sorted(r["phases"].items(), key=lambda kv: -kv[1]["span_us"])
            print(f"{half} B={b} {variant}: {ms * 1e3:.0f} us (events), traced {r['traced_us']:.0f} us over {r['barriers']} "
                  f"barriers", flush=True)
            for name, d in top:
                print(f"   {name:8s} x{d['count']:4d}  span {d['span_us']:8.1f} us ({d['per_instance_span_us']:6.2f} each)"
                      f"  barrier {d['barrier_us']:7.1f} ({d['per_instance_barrier_us']:5.2f} each)"
                      f"  mean work {d['mean_work_us']:8.1f}", flush=True)
        eng.state.ints[POS].copy_(pos0)
    (out / "frame_trace.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
