#!/usr/bin/env python
"""How fast one persistent block per SM streams weights from HBM, by method (`scripts/stream_bw.cu`):
bulk copies (cp.async.bulk into a ring of shared-memory units, by copy size, unit size, ring depth
and issuing lanes) and plain 16-byte loads (by loads in flight a thread and blocks a launch). The
products prototype (`products_engine.cu`) streamed at ~1.9 TB/s with 1 KB copies on an H200: this
says which way its producer can go faster. Writes $OUT/stream_bw.json.

  PYTHONPATH=. python3 scripts/gpu_stream_bw.py --out $OUT
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KB = 1024


def build() -> ctypes.CDLL:
    lib = Path(tempfile.mkdtemp()) / "libstream_bw.so"
    subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                    str(ROOT / "scripts" / "stream_bw.cu")], check=True)
    so = ctypes.CDLL(str(lib))
    so.stream_bw_run.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p] + [ctypes.c_int] * 7 + [
        ctypes.c_void_p]
    so.stream_bw_per_block.restype = ctypes.c_ulonglong
    so.stream_bw_per_block.argtypes = [ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int]
    return so


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--gib", type=float, default=2.0)
    a = ap.parse_args()
    so = build()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nbytes = int(a.gib * 2**30)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    buf.fill_(1)
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def seconds(fn, reps=5) -> float:
        """fn's device time between two events: median of reps runs after one warm-up run."""
        ts = []
        for _ in range(reps + 1):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(ts[1:])

    def rate(blocks, method, c=16 * KB, u=16 * KB, r=8, i=1, loads=4) -> float:
        def launch():
            err = so.stream_bw_run(buf.data_ptr(), nbytes, sink.data_ptr(), blocks, method, c, u, r, i, loads, stream)
            assert err == 0, f"error {err}"

        return so.stream_bw_per_block(nbytes, blocks, u) * blocks / seconds(launch) / 1e12  # TB/s

    results = []

    def rec(label, tbs, **kw):
        results.append({"what": label, "tb_s": round(tbs, 3), **kw})
        print(f"{label:60s} {tbs:.3f} TB/s", flush=True)

    for c in (1, 2, 4, 8, 16):
        rec(f"bulk: copies of {c} KB, units 16 KB, ring 12, 1 issuer", rate(sms, 0, c * KB, 16 * KB, 12), c=c)
    for r in (4, 8, 13):
        rec(f"bulk: copies of 16 KB, units 16 KB, ring {r}, 1 issuer", rate(sms, 0, 16 * KB, 16 * KB, r), r=r)
    for c, i in ((1, 2), (1, 4), (1, 8), (16, 2), (16, 4)):
        rec(f"bulk: copies of {c} KB, units 16 KB, ring 12, {i} issuers", rate(sms, 0, c * KB, 16 * KB, 12, i),
            c=c, i=i)
    for u, r in ((32, 6), (64, 3)):
        rec(f"bulk: copies of {u} KB, units {u} KB, ring {r}, 1 issuer", rate(sms, 0, u * KB, u * KB, r), u=u, r=r)
    rec("bulk: copies of 32 KB, units 32 KB, ring 6, 2 issuers", rate(sms, 0, 32 * KB, 32 * KB, 6, 2))
    for blocks in (sms, 2 * sms, 4 * sms):
        for loads in (1, 4, 8, 16):
            rec(f"loads: 16 B x {loads} in flight a thread, {blocks} blocks of 256", rate(blocks, 1, loads=loads),
                blocks=blocks, loads=loads)
    # the device-to-device copy, for scale (bytes read + written)
    half, other = buf[: nbytes // 2], buf[nbytes // 2:]
    rec("torch copy_ (read + write bytes)", 2 * half.numel() / seconds(lambda: other.copy_(half)) / 1e12)
    env = {"device": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__}
    Path(a.out, "stream_bw.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(json.dumps(env))


if __name__ == "__main__":
    main()
