"""One-call GPU evidence for the batched codec step (full-size synthetic codec): exactness against
the per-stream and whole-sequence oracles, bf16 distance beside qwen-tts's own bf16 decode,
bitwise batch/bucket/graph invariance, step time vs B, the official decoder's graph time, memory."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from tts_server.testing.audio_stubs import stub_audio_modules  # noqa: E402

stub_audio_modules()

from test_codec_streaming import _make_decoder  # noqa: E402  (the tests' "every path matters" codec)

from tts_server.codec import StreamingCodecDecoder  # noqa: E402
from tts_server.codec.batched import BatchedCodecDecoder  # noqa: E402
from tts_server.codec.offline import decode_full  # noqa: E402

R: dict = {}


def log(*a):
    print(*a, flush=True)


def codes(n, seed, b=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 16) if b is None else (b, n, 16)
    return torch.randint(0, 2048, shape, generator=g)


def run_stream(bd, slot, c):
    """c [T, 16] through one slot alone -> [T * 1920]."""
    return np.concatenate([bd.step([slot], c[i : i + 1]) for i in range(c.shape[0])], 1).reshape(-1)


def exactness(dec, n):
    c2 = codes(n, 10, b=2)
    full = [decode_full(dec, c2[i]).cpu().numpy() for i in range(2)]
    sd = StreamingCodecDecoder(dec)
    st = sd.new_state()
    oracle = torch.cat([sd.decode(st, c2[0, i : i + 1]) for i in range(n)]).cpu().numpy()
    bd = BatchedCodecDecoder(dec, 4, dtype=torch.float32)
    out = np.concatenate([bd.step([3, 1], c2[:, i]) for i in range(n)], 1)  # [2, n*1920]
    R["exact_fp32"] = dict(
        frames=n, vs_full=[float(np.abs(out[i] - full[i]).max()) for i in range(2)],
        vs_streaming=float(np.abs(out[0] - oracle).max()),
        streaming_vs_full=float(np.abs(oracle - full[0]).max()),
        signal_rms=float(full[0].std()), capture_s=bd.capture_s)
    log("exactness", R["exact_fp32"])
    return c2[0], full[0]


def precision(dec, c, full):
    n = c.shape[0]
    dec16 = _clone_bf16(dec)
    q16 = decode_full(dec16, c).float().cpu().numpy()
    bd = BatchedCodecDecoder(dec, 2, dtype=torch.bfloat16)
    ours = run_stream(bd, 0, c)
    d = lambda a: dict(max_abs=float(np.abs(a - full).max()), rms=float(np.sqrt(((a - full) ** 2).mean())))
    R["bf16"] = dict(frames=n, qwen_bf16_vs_fp32=d(q16), ours_bf16_vs_fp32=d(ours))
    log("bf16", R["bf16"])
    del dec16


def _clone_bf16(dec):
    import copy
    return copy.deepcopy(dec).to(torch.bfloat16)


def invariance(dec, dtype, kernels, n=40, slots=256):
    """A stream's bytes: alone (bucket 1, slot 0) vs among 100 (bucket 128, slot 77) vs among 200
    (bucket 256, slot 255) vs the eager (no graph) path."""
    a = codes(n, 50)
    others = codes(n, 51, b=200)
    res = {}
    bd = BatchedCodecDecoder(dec, slots, dtype=dtype, kernels=kernels, use_graphs=kernels == "triton")
    alone = run_stream(bd, 0, a)
    for label, m, slot in (("among_100", 100, 77), ("among_200", 200, 255)):
        ids = [s for s in range(slots) if s != slot][:m - 1] + [slot]
        for s in ids:
            bd.reset(s)
        rows = []
        for i in range(n):
            cc = torch.cat([others[: m - 1, i], a[i : i + 1]])
            rows.append(bd.step(ids, cc)[-1])
        res[label] = bool(np.array_equal(np.concatenate(rows), alone))
        res[label + "_maxdiff"] = float(np.abs(np.concatenate(rows) - alone).max())
    if kernels == "triton":
        eager = BatchedCodecDecoder(dec, 4, dtype=dtype, use_graphs=False)
        res["eager_eq_graph"] = bool(np.array_equal(run_stream(eager, 2, a), alone))
    R[f"invariance_{kernels}_{str(dtype).split('.')[-1]}"] = res
    log("invariance", kernels, dtype, res)


def cudnn_invariance(dec, n=8):
    """The official decoder (cuDNN/cuBLAS): one utterance alone vs row 0 of a batch of 16."""
    c = codes(n, 60, b=16).transpose(1, 2).cuda()  # [16, 16, n]
    with torch.inference_mode():
        alone = dec(c[:1]).float()
        batch = dec(c)[:1].float()
    R["official_batch_invariant"] = dict(equal=bool(torch.equal(alone, batch)),
                                         maxdiff=float((alone - batch).abs().max()))
    log("official invariance", R["official_batch_invariant"])


def time_graph(fn_replay, iters=30):
    for _ in range(3):
        fn_replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn_replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def speed(dec, dtype, max_slots, label, tiles=None, ref=None):
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    bd = BatchedCodecDecoder(dec, max_slots, dtype=dtype, tiles=tiles)
    rows = []
    for bp in bd.buckets:
        g, _ = bd._graphs[bp]
        ms = time_graph(g.replay)
        rows.append(dict(B=bp, step_ms=ms, us_per_stream_frame=1e3 * ms / bp))
        log(label, rows[-1])
    c1 = codes(1, 70)
    for _ in range(3):
        bd.step([0], c1)
    t0 = time.perf_counter()
    for _ in range(20):
        bd.step([0], c1)
    host_ms = (time.perf_counter() - t0) / 20 * 1e3
    extra = {}
    if ref is not None:  # a variant: its own bitwise invariance and bf16 distance, same call
        c, full = ref
        bd.reset(0)
        alone = run_stream(bd, 0, c[:24])
        oth = codes(24, 52, b=99)
        ids = list(range(1, 100)) + [200]
        for sl in ids:
            bd.reset(sl)
        mixed = np.concatenate([bd.step(ids, torch.cat([oth[:, i], c[i : i + 1]]))[-1] for i in range(24)])
        bd.reset(0)
        ours = run_stream(bd, 0, c)
        extra = dict(invariant_among_100=bool(np.array_equal(mixed, alone)),
                     bf16_vs_fp32_max_abs=float(np.abs(ours - full).max()),
                     bf16_vs_fp32_rms=float(np.sqrt(((ours - full) ** 2).mean())), tiles=str(tiles))
    R[f"speed_{label}"] = dict(
        rows=rows, step_api_ms_B1=host_ms, capture_s=bd.capture_s, **extra,
        graph_memory_bytes=bd.graph_memory_bytes, state_bytes=bd.state_bytes,
        estimate_bytes=BatchedCodecDecoder.memory_bytes(dec, max_slots, dtype),
        allocated_bytes=torch.cuda.memory_allocated() - base, buckets=bd.buckets)
    log(label, {k: v for k, v in R[f"speed_{label}"].items() if k != "rows"})
    return bd


def breakdown(bd, b):
    """Eager step at B rows with CUDA events around every GEMM stage: where the time goes."""
    recs = []
    orig = BatchedCodecDecoder._gemm

    def timed(self, g, x, idx, **kw):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = orig(self, g, x, idx, **kw)
        e1.record()
        recs.append((f"rows{x.shape[1]}_cin{g.cin}_n{g.w.shape[1]}_taps{g.taps}_d{g.dil}", e0, e1))
        return out

    bd.use_graphs = False
    c = codes(1, 81, b=b)[:, 0]
    slots = list(range(b))
    bd.step(slots, c)
    BatchedCodecDecoder._gemm = timed
    try:
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        bd.step(slots, c)
        t1.record()
        torch.cuda.synchronize()
    finally:
        BatchedCodecDecoder._gemm = orig
        bd.use_graphs = True
    agg: dict = {}
    for name, e0, e1 in recs:
        agg[name] = agg.get(name, 0.0) + e0.elapsed_time(e1)
    top = sorted(agg.items(), key=lambda kv: -kv[1])
    R[f"breakdown_B{b}"] = dict(eager_step_ms=t0.elapsed_time(t1), gemm_stage_ms_sum=sum(agg.values()),
                               stages=[(k, round(v, 4)) for k, v in top[:30]])
    log("breakdown", b, R[f"breakdown_B{b}"])


def profile(bd, b, out):
    from torch.profiler import ProfilerActivity, profile as prof
    bd.use_graphs = False
    c = codes(1, 80, b=b)[:, 0]
    slots = list(range(b))
    bd.step(slots, c)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        bd.step(slots, c)
        torch.cuda.synchronize()
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(out, f"profile_B{b}.txt"), "w") as f:
        f.write(table)
    log(table)
    bd.use_graphs = True


def official(dec, bs=(1, 32, 128)):
    """The qwen-tts decoder in bf16, one call on codes [B, 16, 1], CUDA-graph replay."""
    dec16 = _clone_bf16(dec)
    res = []
    for b in bs:
        c = codes(1, 90, b=b).transpose(1, 2).contiguous().cuda()
        with torch.inference_mode():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    dec16(c)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                dec16(c)
        ms = time_graph(g.replay)
        res.append(dict(B=b, step_ms=ms, us_per_stream_frame=1e3 * ms / b))
        log("official bf16", res[-1])
        del g
    R["official_bf16_graph"] = res
    del dec16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--frames", type=int, default=640)
    ap.add_argument("--max-slots", type=int, default=256)
    ap.add_argument("--stages", default="pytest,exact,bf16,invariance,speed,official,breakdown,variants,fp32,profile")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    st = a.stages.split(",")
    R["device"] = torch.cuda.get_device_name()
    R["torch"], R["commit"] = torch.__version__, os.environ.get("COMMIT", "")
    if "pytest" in st:  # the gpu-marked tests, in this process (the audio stubs apply)
        import pytest
        rc = pytest.main(["tests/test_codec_batched.py", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          "-s", f"--junitxml={os.path.join(a.out, 'pytest_gpu.xml')}"])
        R["pytest_gpu_rc"] = int(rc)
        log("pytest gpu rc", int(rc))
    t0 = time.time()
    dec = _make_decoder("full").cuda().eval()
    log(f"decoder built in {time.time() - t0:.1f}s")

    def guarded(name, fn, *args):
        if name not in st:
            return None
        try:
            return fn(*args)
        except Exception as e:  # record and go on: one call must bring back everything it can
            import traceback
            traceback.print_exc()
            R[f"error_{name}"] = repr(e)
        finally:
            with open(os.path.join(a.out, "codec_results.json"), "w") as f:
                json.dump(R, f, indent=1)

    cf = guarded("exact", exactness, dec, a.frames)
    if cf is not None:
        guarded("bf16", precision, dec, *cf)
    guarded("invariance", invariance, dec, torch.bfloat16, "triton")
    guarded("invariance", invariance, dec, torch.float32, "triton")
    guarded("invariance", invariance, dec, torch.float32, "torch")
    guarded("invariance", cudnn_invariance, dec)
    bd = guarded("speed", speed, dec, torch.bfloat16, a.max_slots, "bf16")
    guarded("official", official, dec)
    if bd is not None:
        guarded("breakdown", breakdown, bd, 128)
        guarded("breakdown", breakdown, bd, 1)
        del bd
    variants = {"hi128x128w8": {"high": (128, 128, 64, 8)}, "hi128x64w4": {"high": (128, 64, 64, 4)},
                "lo32x64w4": {"low": (32, 64, 64, 4)}}  # the default high tile is 64x128, 4 warps
    if os.environ.get("CODEC_VARIANTS"):  # {name: {"high"|"low": [BM, BN, BK, warps]}}: speed only
        variants = {k: {h: tuple(t) for h, t in v.items()} for k, v in json.loads(os.environ["CODEC_VARIANTS"]).items()}
    for name, tiles in variants.items():
        if cf is not None or os.environ.get("CODEC_VARIANTS"):
            guarded("variants", speed, dec, torch.bfloat16, a.max_slots, f"bf16_{name}", tiles, cf)
    guarded("fp32", speed, dec, torch.float32, 64, "fp32")
    if "profile" in st:
        bd = BatchedCodecDecoder(dec, 128)
        guarded("profile", profile, bd, 128, a.out)
        guarded("profile", profile, bd, 1, a.out)
    log(json.dumps(R, indent=1))


if __name__ == "__main__":
    main()
