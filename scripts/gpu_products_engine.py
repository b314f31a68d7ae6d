#!/usr/bin/env python
"""Issue 16's small-batch question, products only: the code predictor's four fp16 products per
layer (q|k|v, o_proj, gate|up + SwiGLU, down) for M = 1..16 rows, as the Triton graphs run them
and as `scripts/products_engine.cu` runs them (one persistent launch; a producer warp per block
streams its weight tiles into shared memory ahead of the consumers; each product one mma.sync
chain per K piece, the Triton graphs' arithmetic; between products a grid barrier or LL words).

Checks every output of each variant against `tk_gemm.linear_parts` / `tk_gemm.swiglu` bitwise,
then times L layers (distinct weights, 31.5 MB a layer: they stream from HBM): each engine
variant inside the kernel (the first block's start to the last block's end, globaltimer; median
of 7 launches), a CUDA graph of the Triton products with events (20 replays back to back, less an
empty graph's replay); the engine's timing-only modes (copies alone, chains alone, barriers
alone) and its producer's streaming rate alone by copy shape (M = 1); and a per-block trace of
each product's parts (staging, the weights' wait, the chains, the barrier). Writes
$OUT/products_engine.json.

  PYTHONPATH=. python3 scripts/gpu_products_engine.py --out $OUT [--layers 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import ops, tk_gemm  # noqa: E402
from tts_server.engines.batched.small_kernel import tile  # noqa: E402

H, QKV, QD, I = 1024, 4096, 2048, 3072
# products_engine.cu's modes: (mode, LL input words instead of grid barriers)
# products_engine.cu's modes: (mode, LL input words instead of grid barriers, 8-row tasks, tiled weights)
MODE_ARGS = {"barrier": (0, False, 0, 0), "ll": (0, True, 0, 0), "ll_xa": (0, True, 1, 0),
             "barrier_tiled": (0, False, 0, 1), "ll_tiled": (0, True, 0, 1), "copies": (3, False, 0, 0),
             "ll_copies": (3, True, 0, 0), "ll_copies_tiled": (3, True, 0, 1), "barriers": (4, False, 0, 0),
             "chains": (5, False, 0, 0), "free_rows": (7, False, 0, 0), "free_tiled": (7, False, 0, 1)}
MODES = {"barrier": "grid barriers", "ll": "LL input words, no grid barriers",
         "ll_xa": "LL input words, 8-row tasks", "barrier_tiled": "grid barriers, tiled weights",
         "ll_tiled": "LL input words, tiled weights", "ll_copies_tiled": "copies without chains, tiled, no barriers",
         "copies": "copies without chains", "ll_copies": "copies without chains, no barriers",
         "barriers": "barriers only", "chains": "chains without copies",
         "free_rows": "copies alone, one lane releasing (rows)",
         "free_tiled": "copies alone, one lane releasing (tiled)"}


class Product(ctypes.Structure):
    """products_engine.cu's phase: a product (kind 0; scale: its outputs' power-of-two scale), or
    a row phase (kind > 0: a Triton row kernel's programs, see gpu_cp_layer_engine.py)."""
    _fields_ = [("w", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("x", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("N", ctypes.c_int), ("K", ctypes.c_int), ("piece", ctypes.c_int), ("scale", ctypes.c_float),
                ("kind", ctypes.c_int), ("gx", ctypes.c_int), ("gy", ctypes.c_int), ("warps", ctypes.c_int),
                ("smem_per", ctypes.c_int), ("args", ctypes.c_void_p * 10), ("uargs", ctypes.c_uint * 6)]


def build() -> ctypes.CDLL:
    lib = Path(tempfile.mkdtemp()) / "libproducts_engine.so"
    subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                    str(ROOT / "scripts" / "products_engine.cu")], check=True)
    so = ctypes.CDLL(str(lib))
    so.products_engine_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_uint,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_uint, ctypes.c_void_p]
    so.products_engine_error_string.restype = ctypes.c_char_p
    assert so.products_engine_sizeof() == ctypes.sizeof(Product)
    return so


def piece_cols(kind: str, n: int, k: int) -> int:
    """The K piece of tk_gemm's arithmetic for this shape (the same for every row count)."""
    cols = set()
    for m in (1, 16, 64, 256):
        bm, bn, bk, warps, stages, chunk, _ = tk_gemm.config(kind, n, k, m, fp16=True, x16=True)
        cols.add(tk_gemm._pieces(kind == "swiglu", k, chunk, bk)[1])
    assert len(cols) == 1, (kind, n, k, cols)
    return cols.pop()


def layer_weights(dev, gen):
    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=gen) * 0.03).to(torch.bfloat16).to(torch.float16)

    return dict(qkv=w(QKV, H), o=w(H, QD), gate=w(I, H), up=w(I, H), down=w(H, I))


def products_of(layers, m, dev, gen):
    """Per layer the four products' (kind, weights, x, out) with fresh inputs and outputs."""
    out = []
    for lw in layers:
        for kind, n, k in (("qkv", QKV, H), ("o", H, QD), ("gate_up", I, H), ("down", H, I)):
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.float16)
            if kind == "gate_up":
                piece = piece_cols("swiglu", n, k)
                o = torch.empty(m, n, dtype=torch.float16, device=dev)
                out.append((kind, lw["gate"], lw["up"], x, o, n, k, piece))
            else:
                piece = piece_cols("linear", n, k)
                o = torch.empty(k // piece, m, n, dtype=torch.float32, device=dev)
                out.append((kind, lw[kind], None, x, o, n, k, piece))
    return out


TR = 2 + 5 * 8  # products_engine.cu's trace words per (block, product)


def trace_summary(tr, t0s, kinds, pt) -> dict:
    """µs per product kind (over the layers after the first; a block's times are since its product
    start): span (a block's start to its next start), staging, the weights' wait after staging and
    the chains (over the warps that had a task), the block's work (start to barrier arrival), the
    barrier (arrival to the next start): each as [mean, p90, max] over blocks (and warps); and the
    producer's side: its first copy of the product's units issued how long before the consumers
    started the product (issue_lead), its last copy how long after (last_issue), and its wait for
    free ring units while issuing them (ring_wait)."""
    out = {}
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind][1:] or [i for i, k in enumerate(kinds) if k == kind]
        nxt = [i + 1 for i in idx]
        span = t0s[:, nxt] - t0s[:, idx]
        sub = tr[:, idx]  # [G, n, TR]
        wait, chain_, cyc = sub[..., 2:18:2], sub[..., 3:18:2], sub[..., 18:26]
        has = chain_ > 0
        issued = pt[:, idx, 0] > 0  # (no copies in the timing-only modes without a producer)
        def stats(v):
            if v.size == 0:
                return [float("nan")] * 3
            return [round(float(v.mean()) / 1e3, 3), round(float(np.percentile(v, 90)) / 1e3, 3),
                    round(float(v.max()) / 1e3, 3)]

        out[kind] = {"tasks_traced": int(has.sum()), "span": stats(span), "staging": stats(sub[..., 0]),
                     "weights_wait": stats(np.clip(wait - sub[..., :1], 0, None)[has]),
                     "chains": stats((chain_ - wait)[has]),
                     "chain_cycles": stats(cyc[has] * 1e3),  # (stats divides by 1e3)
                     "clock_ghz": round(float(cyc[has].sum() / max(1, (chain_ - wait)[has].sum())), 3),
                     "work": stats(sub[..., 1]),
                     "issue_lead": stats((t0s[:, idx] - pt[:, idx, 0]).astype(np.float64)[issued]),
                     "last_issue": stats((pt[:, idx, 1] - t0s[:, idx]).astype(np.float64)[issued]),
                     "ring_wait": stats(pt[:, idx, 2].astype(np.float64)[issued]),
                     "barrier": stats(span - sub[..., 1])}
    return out


def timed(fn, reps=20, rounds=5) -> float:
    """µs per call: reps calls back to back between two events (the host's launch time
    overlapped), median of rounds."""
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000.0 / reps)
    return statistics.median(ts)


def triton_run(prods) -> list:
    res = []
    for kind, w, w2, x, _, n, k, piece in prods:
        if w2 is not None:
            res.append(tk_gemm.swiglu(x, w, w2, torch.float16, ops.MLP_SHIFT))
        else:
            res.append(tk_gemm.linear_parts(x, w))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 4, 8, 16], help="row counts")
    a = ap.parse_args()
    so = build()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers = [layer_weights(dev, gen) for _ in range(a.layers)]
    tiled = {w.data_ptr(): tile(w) for lw in layers for w in lw.values()}  # products_engine.cu's tiled copies
    sync = torch.zeros(4, dtype=torch.int32, device=dev)
    words = torch.zeros(64, 16 * 3072 // 2, dtype=torch.int64, device=dev)  # LL input words (products_engine.cu)
    launches, units = [0], [0]
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    results = []
    for m in a.ms:
        prods = products_of(layers, m, dev, gen)
        scale = lambda w2: 2.0 ** -ops.MLP_SHIFT if w2 is not None else 1.0  # noqa: E731 (swiglu's fp16 scale)
        arr = (Product * len(prods))(*[Product(w.data_ptr(), w2.data_ptr() if w2 is not None else 0, x.data_ptr(),
                                               o.data_ptr(), n, k, piece, scale(w2))
                                       for _, w, w2, x, o, n, k, piece in prods])

        arr_t = (Product * len(prods))(*[Product(tiled[w.data_ptr()].data_ptr(),
                                                 tiled[w2.data_ptr()].data_ptr() if w2 is not None else 0,
                                                 x.data_ptr(), o.data_ptr(), n, k, piece, scale(w2))
                                         for _, w, w2, x, o, n, k, piece in prods])

        # timing only: q|k|v and gate|up in 512-column pieces (twice the tasks, half the chain; not
        # the Triton graphs' arithmetic, so no bits to compare: gate|up's pieces each write their
        # epilogue over the same outputs), for what shorter chains would buy
        p512, keep = [], []  # (keep: the new outputs alive while the table points at them)
        for kind, w, w2, x, o, n, k, piece in prods:
            if kind == "qkv":
                o = torch.empty(k // 512, m, n, dtype=torch.float32, device=dev)
                keep.append(o)
            p512.append(Product(tiled[w.data_ptr()].data_ptr(), tiled[w2.data_ptr()].data_ptr() if w2 is not None
                                else 0, x.data_ptr(), o.data_ptr(), n, k, 512, scale(w2)))
        arr_t512 = (Product * len(prods))(*p512)

        def engine(mode=0, np_=None, trace=None, t0s=None, ll=False, xa=0, tl=0, ptrace=None, poll_ns=0,
                   utrace=None, table=None):
            sync.zero_()
            launches[0] += 1
            table = table if table is not None else (arr_t if tl else arr)
            ret = so.products_engine_run(ctypes.addressof(table), len(prods) if np_ is None else np_,
                                         m, ctypes.c_void_p(sync.data_ptr()), sms, 2_000_000_000, mode, xa, tl,
                                         ctypes.c_void_p(words.data_ptr() if ll else 0), launches[0] << 8,
                                         ctypes.c_void_p(trace.data_ptr() if trace is not None else 0),
                                         ctypes.c_void_p(t0s.data_ptr() if t0s is not None else 0),
                                         ctypes.c_void_p(ptrace.data_ptr() if ptrace is not None else 0),
                                         ctypes.c_void_p(utrace.data_ptr() if utrace is not None else 0), poll_ns,
                                         stream())
            assert ret > 0, (f"launch error {ret}: " + (so.products_engine_error_string(-ret).decode() if ret < -2
                                                        else "arguments"))
            units[0] = ret  # the ring's units

        ref = triton_run(prods)
        torch.cuda.synchronize()
        bits = {}
        for key in ("barrier", "ll", "ll_xa", "ll_tiled", "barrier_tiled"):
            for *_r, o, _n, _k, _p in prods:
                o.view(torch.uint8).fill_(0xFF)
            mode, ll, xa, tl = MODE_ARGS[key]
            engine(mode, ll=ll, xa=xa, tl=tl)
            torch.cuda.synchronize()
            assert int(sync[2]) == 0, f"the engine gave up a wait (error {int(sync[2])})"
            equal = total = 0
            for (kind, *_rest), r in zip(prods, ref):
                o = _rest[3]
                view = torch.int16 if o.dtype == torch.float16 else torch.int32
                equal += int((o.view(view) == r.reshape(o.shape).view(view)).sum())
                total += o.numel()
            bits[key] = equal

        t0s = torch.zeros(sms, len(prods) + 1, dtype=torch.int64, device=dev)

        def span(key, runs=7, poll_ns=0, table=None):
            """µs per layer inside the kernel: the first block's start to the last block's end
            (globaltimer), median of runs (no launch cost, no host)."""
            mode, ll, xa, tl = MODE_ARGS[key] if isinstance(key, str) else key
            ts = []
            for _ in range(runs):
                engine(mode, t0s=t0s, ll=ll, xa=xa, tl=tl, poll_ns=poll_ns, table=table)
                torch.cuda.synchronize()
                t = t0s.cpu().numpy()
                ts.append((t[:, -1].max() - t[:, 0].min()) / 1e3)
            return statistics.median(ts) / a.layers

        t_modes = {key: span(key) for key in MODE_ARGS}
        t_modes["ll_tiled_p512"] = span("ll_tiled", table=arr_t512)
        MODES["ll_tiled_p512"] = "LL, tiled, 512-column pieces (timing only)"
        stream_sweep = {}
        if m == 1:  # the producer alone (no chains, no barriers): TB/s of weights by copy shape
            wbytes = sum(w.numel() * 2 for lw in layers[:1] for w in lw.values())
            for mode, shape, tl in ((3, "rows", 0), (3, "tiled", 1)):
                stream_sweep[shape] = round(wbytes / span((mode, True, 0, tl), runs=5) / 1e6, 3)
            print("  producer alone, TB/s: " + ", ".join(f"{k} {v}" for k, v in stream_sweep.items()), flush=True)
        trace = torch.zeros(sms, len(prods), TR, dtype=torch.int32, device=dev)
        ptrace = torch.zeros(sms, len(prods), 3, dtype=torch.int64, device=dev)
        phases = {}
        for k in ("barrier", "chains", "ll", "ll_tiled", "barrier_tiled"):
            mode, ll, xa, tl = MODE_ARGS[k]
            engine(mode, trace=trace, t0s=t0s, ll=ll, xa=xa, tl=tl, ptrace=ptrace)
            torch.cuda.synchronize()
            phases[MODES[k]] = trace_summary(trace.cpu().numpy().astype(np.int64), t0s.cpu().numpy(),
                                             [p[0] for p in prods], ptrace.cpu().numpy())
        engine(0, trace=trace, t0s=t0s, ll=True, tl=1, ptrace=ptrace, table=arr_t512)
        torch.cuda.synchronize()
        phases[MODES["ll_tiled_p512"]] = trace_summary(trace.cpu().numpy().astype(np.int64), t0s.cpu().numpy(),
                                                       [p[0] for p in prods], ptrace.cpu().numpy())
        # every ring unit's issue, the consumer's wait for it and its arrival (LL, tiled weights)
        utrace = torch.zeros(sms, 256, 3, dtype=torch.int64, device=dev)
        engine(0, trace=trace, t0s=t0s, ll=True, tl=1, ptrace=ptrace, utrace=utrace)
        torch.cuda.synchronize()
        u = utrace.cpu().numpy()
        if m == 1:  # the raw traces of this launch, to read offline
            np.savez_compressed(Path(a.out, "trace_ll_tiled_m1.npz"), trace=trace.cpu().numpy(),
                                t0s=t0s.cpu().numpy(), ptrace=ptrace.cpu().numpy(), utrace=u,
                                kinds=np.array([p[0] for p in prods]))
        ok = (u > 0).all(axis=2)
        issue_to_need = (u[..., 1] - u[..., 0])[ok] / 1e3
        issue_to_arrival = (u[..., 2] - u[..., 0])[ok] / 1e3
        waited = (u[..., 2] - u[..., 1])[ok] / 1e3
        pct = lambda v, qs=(10, 50, 90): [round(float(np.percentile(v, q)), 3) for q in qs]  # noqa: E731
        units_rec = {"units": int(ok.sum()), "issue_to_wait_start_us": pct(issue_to_need),
                     "issue_to_wait_end_us": pct(issue_to_arrival), "waited_us": pct(waited, (10, 50, 90, 99)),
                     "waited_over_0.1us": round(float((waited > 0.1).mean()), 3)}
        print(f"  ring units (LL, tiled; p10/p50/p90): issue to the consumer's wait "
              f"{units_rec['issue_to_wait_start_us']} µs, issue to arrival {units_rec['issue_to_wait_end_us']} µs, "
              f"waited {units_rec['waited_us']} µs (p10/50/90/99), "
              f"{units_rec['waited_over_0.1us']:.0%} waited > 0.1 µs",
              flush=True)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            triton_run(prods)  # compiled and warm
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=s):
                triton_run(prods)
        torch.cuda.current_stream().wait_stream(s)
        t_triton = timed(graph.replay)
        graph_empty = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            with torch.cuda.graph(graph_empty, stream=s):
                sync.zero_()
        torch.cuda.current_stream().wait_stream(s)
        t_triton -= timed(graph_empty.replay)  # the graph launch's own cost
        rec = {"m": m, "layers": a.layers, "ring_units": units[0], "bitwise_equal": bits,
               "values": total, "engine_us_per_layer_in_kernel": t_modes,
               "triton_graph_us_per_layer": t_triton / a.layers,
               "trace_us_by_product": phases, "producer_alone_tb_s": stream_sweep, "ring_units_ll_tiled": units_rec}
        results.append(rec)
        print(f"M={m:2d}: bits equal of {total}: {bits}, {units[0]} ring units; µs per layer of 4 products: "
              f"Triton graph {rec['triton_graph_us_per_layer']:.1f}; engine " +
              ", ".join(f"{MODES[k]} {v:.2f}" for k, v in t_modes.items()),
              flush=True)
        for mode, by_kind in phases.items():
            print(f"  trace, {mode} (µs: mean/p90/max)", flush=True)
            for kind, ph in by_kind.items():
                cells = (f"{k} {'/'.join(f'{x:.2f}' for x in v) if isinstance(v, list) else v}" for k, v in ph.items())
                print(f"    {kind:8s} " + " ".join(cells), flush=True)
    env = {"device": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    Path(a.out, "products_engine.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
