#!/usr/bin/env python
"""Do two running servers give the same bytes? The same requests (English prompts, fixed seeds,
one at 16 kHz) go to each server, all at once, and each request's audio is compared: equal
bytes, or the first differing sample. For A/Bs of changes that must not change the audio
(scripts/gpu_server_ab.sh runs it with COMPARE=1).

  python scripts/compare_servers.py HOST:PORT HOST:PORT [--requests 16] [--max-duration 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_client.client import TTSClient, build_request  # noqa: E402
from tts_client.workloads import ENGLISH  # noqa: E402


async def _run(address: str, reqs) -> list[np.ndarray]:
    async with TTSClient(address) as client:
        res = await asyncio.gather(*(client.synthesize(r, timeout=300) for r in reqs))
    return [r.samples for r in res]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-duration", type=float, default=1.5)
    args = ap.parse_args()
    reqs = [build_request(ENGLISH[i % len(ENGLISH)].text, seed=1000 + i, request_id=f"cmp-{i}",
                          sample_rate_hz=16000 if i % 4 == 3 else 0, max_duration_s=args.max_duration)
            for i in range(args.requests)]
    a = asyncio.run(_run(args.a, reqs))
    b = asyncio.run(_run(args.b, reqs))
    diff = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not np.array_equal(x, y):
            n = min(x.size, y.size)
            first = int(np.flatnonzero(x[:n] != y[:n])[0]) if (x[:n] != y[:n]).any() else n
            diff.append(dict(request=i, samples=(int(x.size), int(y.size)), first_difference=first))
    print(json.dumps(dict(requests=len(reqs), equal=len(reqs) - len(diff), samples=int(sum(x.size for x in a)),
                          differ=diff)))
    return 1 if diff or not all(x.size for x in a) else 0


if __name__ == "__main__":
    sys.exit(main())
