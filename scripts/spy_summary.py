#!/usr/bin/env python
"""Summarise a `py-spy record --threads --gil --format raw` file of the server: the samples taken
while serving (start-up stacks dropped), per thread, and the functions holding the GIL, by own
samples (the innermost frame) and inclusive (any frame, counted once per stack) for the
server's and grpc's own code.

  python3 scripts/spy_summary.py spy.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

# frames only start-up runs (model build, graph capture, compile, warm-up)
STARTUP = ("load_model", "build_synthetic", "StepGraphs", "RowPrefillGraphs", "warm_up", "_warm_admissions",
           "capture", "_serve_startup", "memory_plan", "preflight", "__init__ (tts_server/engines")
FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^:()]*)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    f = m.group("file")
    for marker in ("site-packages/", "python3.12/", "/main/", "/repo/"):
        if marker in f:
            f = f.split(marker, 1)[1]
    return f"{m.group('fn')} ({f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    per_thread: Counter = Counter()
    own: Counter = Counter()
    incl: Counter = Counter()
    kinds: Counter = Counter()
    total = startup = 0
    for line in open(args.path):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, n = line.rpartition(" ")
        n = int(n)
        frames = stack.split(";")
        total += n
        if any(s in stack for s in STARTUP):
            startup += n
            continue
        thread, frames = frames[0], [short(f) for f in frames[1:]]
        joined = ";".join(frames)
        kind = ("engine loop" if "tts-engine" in thread else "watchdog" if "tts-watchdog" in thread else
                "event loop" if "MainThread" in thread else "other")
        kinds[kind] += n
        per_thread[(thread, kind)] += n
        if frames:
            own[frames[-1]] += n
        for f in dict.fromkeys(frames):
            if "tts_server" in f or "tts_client" in f or "grpc" in f:
                incl[f] += n
    serving = total - startup
    print(f"samples: {total} total, {startup} start-up, {serving} while serving (GIL held)")
    print("by kind:", {k: f"{v} ({100 * v / max(serving, 1):.0f}%)" for k, v in kinds.most_common()})
    print("by thread:")
    for (t, k), v in per_thread.most_common(8):
        print(f"  {v:7d} {100 * v / max(serving, 1):5.1f}%  {k:11s} {t}")
    print(f"own (innermost frame), top {args.top}:")
    for f, v in own.most_common(args.top):
        print(f"  {v:7d} {100 * v / max(serving, 1):5.1f}%  {f}")
    print(f"inclusive (server, client and grpc frames), top {args.top}:")
    for f, v in incl.most_common(args.top):
        print(f"  {v:7d} {100 * v / max(serving, 1):5.1f}%  {f}")


if __name__ == "__main__":
    main()
