#!/usr/bin/env python
"""Read a torch.profiler chrome trace of gpu_c1_profile.py --trace and print, per traced request,
the engine's CPU ops (top level per thread) and the GPU kernels in time order, with the idle gaps
on the GPU: where one stream's first audio waits for the host.

  python3 scripts/trace_gaps.py trace.json[.gz] [--request 0] [--min-us 20]
"""

from __future__ import annotations

import argparse
import gzip
import json


def load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--request", type=int, default=0)
    ap.add_argument("--min-us", type=float, default=20.0)
    args = ap.parse_args()
    ev = [e for e in load(args.trace) if e.get("ph") == "X"]
    req = [e for e in ev if e.get("name") == f"request{args.request}"]
    if not req:
        raise SystemExit(f"no request{args.request} in the trace")
    t0, t1 = req[0]["ts"], req[0]["ts"] + req[0]["dur"]
    win = sorted((e for e in ev if t0 <= e["ts"] <= t1), key=lambda e: e["ts"])
    gpu = [e for e in win if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu = [e for e in win if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    print(f"request{args.request}: {(t1 - t0) / 1e3:.2f} ms; {len(gpu)} GPU events, busy "
          f"{sum(e['dur'] for e in gpu) / 1e3:.2f} ms")
    # GPU idle gaps >= min-us, and the CPU ops running on each thread during the gap
    busy_end = gpu[0]["ts"] if gpu else t0
    print(f"  host until the first GPU work: {(busy_end - t0) / 1e3:.2f} ms")
    for e in gpu:
        gap = e["ts"] - busy_end
        if gap >= args.min_us:
            during = [c for c in cpu if c["ts"] < e["ts"] and c["ts"] + c["dur"] > busy_end]
            tops = sorted(during, key=lambda c: -min(c["ts"] + c["dur"], e["ts"]) + max(c["ts"], busy_end))[:4]
            print(f"  GPU idle {gap:7.0f} us at +{(busy_end - t0) / 1e3:6.2f} ms before {e['name'][:40]}; host: "
                  + "; ".join(f"{c['name'][:40]}({c['dur']:.0f})" for c in tops))
        busy_end = max(busy_end, e["ts"] + e["dur"])
    print(f"  after the last GPU work: {(t1 - busy_end) / 1e3:.2f} ms")
    # CPU ops by name: total time on any thread inside the window (top level only: not nested)
    tot: dict[str, list[float]] = {}
    for tid in {c.get("tid") for c in cpu}:
        end = -1.0
        for c in (x for x in cpu if x.get("tid") == tid):
            if c["ts"] >= end:
                tot.setdefault(c["name"][:60], []).append(c["dur"])
                end = c["ts"] + c["dur"]
    print("  top-level CPU ops (us total, count):")
    for k, v in sorted(tot.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"    {sum(v):8.0f} {len(v):4d} {k}")


if __name__ == "__main__":
    main()
