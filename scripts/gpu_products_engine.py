#!/usr/bin/env python
"""Issue 16's small-batch question, products only: the code predictor's four fp16 products per
layer (q|k|v, o_proj, gate|up + SwiGLU, down) for M = 1..16 rows, as the Triton graphs run them
and as `scripts/products_engine.cu` runs them (one persistent launch; a producer warp per block
streams its weight tiles into shared memory ahead of the consumers, across the grid barriers
between products; each product one mma.sync chain per K piece, the Triton graphs' arithmetic).

Checks every output against `tk_gemm.linear_parts` / `tk_gemm.swiglu` bitwise, then times L
layers (distinct weights, 30 MB a layer: they stream from HBM) both ways: the engine's launch and
a CUDA graph of the Triton products (PDL as the engine's graphs), median of 20, µs per layer.
Writes $OUT/products_engine.json.

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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.engines.batched import ops, tk_gemm  # noqa: E402

H, QKV, QD, I = 1024, 4096, 2048, 3072


class Product(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("x", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("N", ctypes.c_int), ("K", ctypes.c_int), ("piece", ctypes.c_int), ("scale", ctypes.c_float)]


def build() -> ctypes.CDLL:
    lib = Path(tempfile.mkdtemp()) / "libproducts_engine.so"
    subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                    str(ROOT / "scripts" / "products_engine.cu")], check=True)
    so = ctypes.CDLL(str(lib))
    so.products_engine_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_ulonglong, ctypes.c_void_p]
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
    a = ap.parse_args()
    so = build()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    layers = [layer_weights(dev, gen) for _ in range(a.layers)]
    sync = torch.zeros(4, dtype=torch.int32, device=dev)
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    results = []
    for m in (1, 4, 8, 16):
        prods = products_of(layers, m, dev, gen)
        arr = (Product * len(prods))(*[Product(w.data_ptr(), w2.data_ptr() if w2 is not None else 0, x.data_ptr(),
                                               o.data_ptr(), n, k, piece, 2.0 ** -ops.MLP_SHIFT)
                                       for _, w, w2, x, o, n, k, piece in prods])

        def engine():
            sync.zero_()
            err = so.products_engine_run(ctypes.addressof(arr), len(prods), m, ctypes.c_void_p(sync.data_ptr()), sms,
                                         2_000_000_000, stream())
            assert err == 0, f"launch error {err}"

        engine()
        torch.cuda.synchronize()
        assert int(sync[2]) == 0, f"the engine gave up a wait (error {int(sync[2])})"
        ref = triton_run(prods)
        torch.cuda.synchronize()
        equal = total = 0
        for (kind, *_rest), r in zip(prods, ref):
            o = _rest[3]
            view = torch.int16 if o.dtype == torch.float16 else torch.int32
            equal += int((o.view(view) == r.reshape(o.shape).view(view)).sum())
            total += o.numel()

        def timed(fn, reps=20):
            ts = []
            for _ in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1000.0)
            return statistics.median(ts)

        t_engine = timed(engine)
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
        rec = {"m": m, "layers": a.layers, "bitwise_equal": equal, "values": total,
               "engine_us_per_layer": t_engine / a.layers, "triton_graph_us_per_layer": t_triton / a.layers}
        results.append(rec)
        print(f"M={m:2d}: bits {equal}/{total}; µs per layer of 4 products: engine {rec['engine_us_per_layer']:.1f}, "
              f"Triton graph {rec['triton_graph_us_per_layer']:.1f}", flush=True)
    env = {"device": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    Path(a.out, "products_engine.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
