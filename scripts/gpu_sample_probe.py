"""Where a draw's time goes (issue 16): `sample_tokens` timed in CUDA-graph replays at the frame's
shapes (code-predictor V = 2048 in 2 partial products, talker V = 3072) and B = 1 / 16 / 64 / 256,
in three settings: the released defaults (sampled, temperature 0.9, top-k 50, top-p 1), sampled
without top-k (so the difference is the top-k search) and greedy (the load, the finite check and
the argmax). Also writes every case's codes so that two trees' draws can be compared bitwise.

Usage (run once per tree, the tree's tts_server first on the path):
  PYTHONPATH=. python3 scripts/gpu_sample_probe.py NAME   -> $OUT/sample_probe-NAME.{json,pt}
  python3 scripts/gpu_sample_probe.py --compare A B       -> equal codes? (exit 1 if not)"""

from __future__ import annotations

import json
import os
import sys

import torch

OUT = os.environ.get("OUT", "/tmp/sample_probe")
SIZES = (1, 16, 64, 256)
SHAPES = ((2048, 2), (3072, 1))  # (vocabulary, partial products)


def bench_graph(fn, ncalls: int = 20, reps: int = 7) -> float:
    """Median µs per call of fn(), ncalls captured in one CUDA graph. (gpu_batched_ops.py has the
    same timer, but it imports the tests, which the other tree of an A/B, a `git archive` of
    tts_server/ beside a copy of scripts/, does not have.)"""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ncalls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / ncalls)
    return sorted(ts)[len(ts) // 2]


def cases(b: int, v: int, parts: int):
    g = torch.Generator().manual_seed(1000 * b + v)
    logits = (torch.randn(parts, b, v, generator=g) * 3).cuda()
    ones = torch.ones(b, dtype=torch.int32).cuda()
    seed = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g).cuda()
    ctr = torch.randint(0, 2 ** 40, (b,), generator=g).cuda()
    temp = torch.full((b,), 0.9).cuda()
    p1 = torch.ones(b).cuda()
    return {
        "default": (logits, ones, temp, ones * 50, p1, seed, ctr),
        "no_topk": (logits, ones, temp, ones * 0, p1, seed, ctr),
        "greedy": (logits, ones * 0, temp, ones * 50, p1, seed, ctr),
        # top-p 0.8 (the talker's and the predictor's released default is 1.0; a client may set it)
        "top_p": (logits, ones, temp, ones * 50, torch.full((b,), 0.8).cuda(), seed, ctr),
    }


def probe(name: str) -> None:
    from tts_server.engines.batched import ops, pdl
    os.makedirs(OUT, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}}
    codes = {}
    with pdl.scope(True):
        for v, parts in SHAPES:
            for b in SIZES:
                for kind, args in cases(b, v, parts).items():
                    key = f"{kind}|B{b}|V{v}"
                    res["us"][key] = round(bench_graph(lambda: ops.sample_tokens(*args, 3)), 2)
                    codes[key] = ops.sample_tokens(*args, 3)[0].cpu()
                    print(f"{name:10s} {key:24s} {res['us'][key]:8.2f} us", flush=True)
    torch.save(codes, f"{OUT}/sample_probe-{name}.pt")
    with open(f"{OUT}/sample_probe-{name}.json", "w") as f:
        json.dump(res, f, indent=1)


def compare(a: str, b: str) -> int:
    ca, cb = torch.load(f"{OUT}/sample_probe-{a}.pt"), torch.load(f"{OUT}/sample_probe-{b}.pt")
    bad = [k for k in ca if not torch.equal(ca[k], cb[k])]
    print(f"codes {a} vs {b}: {len(ca) - len(bad)}/{len(ca)} cases equal" + (f", differ: {bad}" if bad else ""))
    ta = json.load(open(f"{OUT}/sample_probe-{a}.json"))["us"]
    tb = json.load(open(f"{OUT}/sample_probe-{b}.json"))["us"]
    for k in ta:
        print(f"  {k:24s} {ta[k]:8.2f} -> {tb[k]:8.2f} us")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    probe(sys.argv[1])
