#!/usr/bin/env python
"""Read a torch.profiler chrome trace of gpu_c1_profile.py --trace and print, for one traced
request, the GPU's idle gaps (where the first audio waits for the host) with the CUDA runtime
calls made during each (the profiler records those from every thread, but CPU ops only from the
thread that started it, not the engine's), then the runtime calls by name.

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
    rt = [e for e in win if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    print(f"request{args.request}: {(t1 - t0) / 1e3:.2f} ms; {len(gpu)} GPU events, busy "
          f"{sum(e['dur'] for e in gpu) / 1e3:.2f} ms")
    # GPU idle gaps >= min-us, and the CPU ops running on each thread during the gap
    busy_end = gpu[0]["ts"] if gpu else t0
    print(f"  host until the first GPU work: {(busy_end - t0) / 1e3:.2f} ms")
    for e in gpu:
        gap = e["ts"] - busy_end
        if gap >= args.min_us:
            during = [c["name"] for c in rt if busy_end <= c["ts"] < e["ts"] and "Capturing" not in c["name"]]
            print(f"  GPU idle {gap:7.0f} us at +{(busy_end - t0) / 1e3:6.2f} ms before {e['name'][:40]}; host: "
                  + ", ".join(during[:6]))
        busy_end = max(busy_end, e["ts"] + e["dur"])
    print(f"  after the last GPU work: {(t1 - busy_end) / 1e3:.2f} ms")
    tot: dict[str, list[float]] = {}
    for c in rt:
        tot.setdefault(c["name"], []).append(c["dur"])
    print("  CUDA runtime calls (us total, count):")
    for k, v in sorted(tot.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"    {sum(v):8.0f} {len(v):4d} {k}")

if __name__ == "__main__":
    main()
