#!/usr/bin/env python
"""Batched engine evidence on one CUDA device, in one call (results as JSON under --out):

  correctness  batch invariance (B 1/3/17/64, greedy + sampled, bitwise logits and codes), greedy
               codes vs TorchEngine fp32 alone and inside B = 64, teacher-forced logits vs an fp32
               reference (bf16 and fp32 KV) inside B = 64
  bench        graph-replay frame time vs B at talker contexts 100 / 1000 / mixed (mean 500):
               median of many CUDA-event-timed replays, GB/s (weights + KV), frames/s; host step time
  start-up     capture time and graph memory; KV memory per slot at 2048 positions, slots that fit

  PYTHONPATH=. python3 scripts/gpu_batched_engine.py --out $OUT [--weights synthetic|random]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.api import SamplingConfig  # noqa: E402
from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.graphs import bucket_for  # noqa: E402
from tts_server.engines.batched.state import CODE0, N_SAMPLED  # noqa: E402
from tts_server.engines.contract import Admission, StepPlan  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
T0 = time.perf_counter()
ENGINE_KW: dict = {}  # fused_cp=False if the preflight finds the fused code-predictor kernel broken


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def load_weights(kind: str):
    """The full-size synthetic model's decode weights (qwen-tts classes, seeded) in bf16, or
    plain random tensors of the same shapes."""
    if kind == "synthetic":
        from tts_server.model.synthetic import SYNTHETIC_NAMES, build_tts_model
        from tts_server.model.weights import decode_weights

        model = build_tts_model(SYNTHETIC_NAMES["synthetic"])
        model.talker.model.text_embedding = None  # not read while decoding
        return decode_weights(model.to("cuda", torch.bfloat16).eval())
    return checks.random_weights("cuda")


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of the distinct tensors in a (nested) weights dataclass."""
    from dataclasses import fields, is_dataclass

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.data_ptr() in seen:
            return 0
        seen.add(obj.data_ptr())
        return obj.numel() * obj.element_size()
    if isinstance(obj, tuple):
        return sum(tensor_bytes(o, seen) for o in obj)
    if is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name), seen) for f in fields(obj))
    return 0


def frame_weight_bytes(eng: BatchedEngine) -> tuple[int, int]:
    """(bytes of weights one frame streams, multiply-adds per row of one frame)."""
    p = eng.p

    def mats(sp):
        return [*sp.wqkv, *sp.wo, *sp.gate, *sp.up, *sp.down]

    t = sum(m.numel() for m in mats(p.talker)) + p.codec_head.numel()
    c = p.num_passes * sum(m.numel() for m in mats(p.predictor)) + sum(h.numel() for h in p.predictor_heads)
    return 2 * (t + c), t + c


def fake_admit(eng: BatchedEngine, lengths: list[int], margin: int) -> list[int]:
    """Put len(lengths) streams at the given talker positions without a prefill (KV contents
    arbitrary, blocks allocated for length + margin): the state a benchmark step needs."""
    for s in list(eng.positions):
        eng.release(s)
    h = eng.p.talker.cfg.hidden_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for slot, n in enumerate(lengths):
        assert eng.kv.ensure(slot, n + margin), "pool too small"
        past = torch.randn(h, device="cuda", generator=g)
        eng.state.admit(slot, SamplingConfig(seed=slot), n, torch.zeros(0, h), torch.zeros(h), past)
        eng.state.ints[CODE0, slot] = slot % 2048
        eng.state.ints[N_SAMPLED, slot] = 1
        eng.positions[slot] = n
    return list(range(len(lengths)))


def time_replays(eng: BatchedEngine, slots: list[int], iters: int, warm: int = 3) -> float:
    """Median ms of `iters` graph replays of the bucket holding `slots` (CUDA events)."""
    n = len(slots)
    b = bucket_for(n, eng.sizes)
    eng.rows_host[:n] = torch.tensor(slots)
    eng.rows_host[n:b] = eng.state.scratch
    eng.kv.sync()
    eng.rows_dev[:b].copy_(eng.rows_host[:b])
    for _ in range(warm):
        eng.replay_frame(n, b)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for e0, e1 in ev:
        e0.record()
        eng.replay_frame(n, b)
        e1.record()
    torch.cuda.synchronize()
    for s in slots:
        eng.positions[s] += warm + iters
    return float(np.median([e0.elapsed_time(e1) for e0, e1 in ev]))


def time_steps(eng: BatchedEngine, slots: list[int], iters: int) -> float:
    """Median ms of whole `run` calls (host copy of rows, replay, one result copy, Python)."""
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        eng.run(StepPlan(decode=tuple(slots)))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def bench(w, deadline: float, iters: int = 30) -> dict:
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1, **ENGINE_KW)
    wbytes, macs = frame_weight_bytes(eng)
    cfg = eng.p.talker.cfg
    kv_pos = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * eng.kv.k.element_size()
    res = dict(capture_s=eng.capture_s, graph_memory_bytes=eng.graph_memory_bytes, weight_bytes_per_frame=wbytes,
               kv_bytes_per_position=kv_pos, rows=[])
    log(f"bench engine: capture {eng.capture_s:.1f} s, graph memory {eng.graph_memory_bytes / 2**20:.0f} MiB")
    for ctx in ("100", "1000", "mixed"):
        for b in SIZES:
            if time.perf_counter() > deadline:
                res["truncated"] = True
                return res
            lengths = checks.mixed_lengths(b) if ctx == "mixed" else [int(ctx)] * b
            slots = fake_admit(eng, lengths, margin=64)
            ms = time_replays(eng, slots, iters)
            step_ms = time_steps(eng, slots, 10)
            kv = sum(n + 20 for n in lengths) * kv_pos  # mean position over the timed replays
            row = dict(ctx=ctx, B=b, replay_ms=ms, step_ms=step_ms, frames_per_s=b / ms * 1e3,
                       gb_per_s=(wbytes + kv) / ms / 1e6, kv_gb=kv / 1e9, tflops=2 * macs * b / ms / 1e9)
            res["rows"].append(row)
            log(f"ctx {ctx:>5} B {b:3d}: replay {ms:7.3f} ms  step {step_ms:7.3f} ms  "
                f"{row['frames_per_s']:8.0f} frames/s  {row['gb_per_s']:6.0f} GB/s  {row['tflops']:5.1f} TFLOP/s")
    try:
        if eng.frame_kernel == "triton":  # the Triton code predictor: fused vs unfused glue
            res["unfused_cp"] = unfused_cp(w, eng, iters)
        res["first_frame"] = first_frame(eng)  # default: batched prefill rows
        pg = BatchedEngine(w, max_streams=4, max_positions=1024, prefill_graphs=True, **ENGINE_KW)
        res["first_frame_prefill_graphs"] = dict(first_frame(pg), error=pg.prefill_graph_error)
        del pg
        res["profile"] = profile(eng)
    except Exception:
        res["profile"] = traceback.format_exc()
        log(res["profile"])
    return res


def unfused_cp(w, fused: BatchedEngine, iters: int) -> dict:
    """Replay ms with the code-predictor passes 2..15 unfused (q/k glue + paged attention, 3
    launches per layer) beside the fused default, at B = 1 and 64, mixed contexts."""
    other = BatchedEngine(w, max_streams=64, max_positions=2048, num_blocks=64 * 17 + 1, fused_cp=False)
    out = {}
    for b in (1, 64):
        t = [time_replays(e, fake_admit(e, checks.mixed_lengths(b), margin=64), iters) for e in (fused, other)]
        out[b] = dict(default_ms=t[0], unfused_cp_ms=t[1])
        log(f"B {b} mixed: default {t[0]:.3f} ms, code-predictor unfused {t[1]:.3f} ms")
    return out


def timed_run(eng: BatchedEngine, plan: StepPlan, wait: bool = False):
    """eng.run(plan) on an engine with every slot released first -> (host wall seconds from a
    synchronised start, the StepOutput); wait: also until the device is idle again."""
    for s in list(eng.positions):
        eng.release(s)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.run(plan)
    if wait:
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def first_frame(eng: BatchedEngine) -> dict:
    """One stream alone: admission (prefill + first code-0 draw) and its first frame in ONE run
    call, host wall time (synchronised), median of 5 after a warm-up, per prompt length."""
    h = eng.p.talker.cfg.hidden_size
    out = {}
    for n in (20, 60, 100):
        p = checks.random_prompt(300 + n, n, h, device="cuda")
        rows = []
        for i in range(6):
            dt, o = timed_run(eng, StepPlan(admit=(Admission(0, p, SamplingConfig(seed=i)),), decode=(0,)))
            rows.append((dt, o.prefill_s, o.decode_s))
        med = np.median(np.array(rows[1:]) * 1e3, axis=0)
        out[n] = dict(total_ms=med[0], prefill_ms=med[1], first_frame_ms=med[2])
        log(f"first frame, prompt {n}: {out[n]}")
    return out


def profile(eng: BatchedEngine) -> dict:
    """Kernel count and the top kernels by GPU time of one frame at B = 1 and 64 (the engine's
    own: the code-predictor kernel or graph, then the talker step's graph)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    out = {}
    for b in (1, 64):
        slots = fake_admit(eng, [500] * b, margin=8)
        nb = bucket_for(b, eng.sizes)
        eng.rows_dev[:b] = torch.tensor(slots, device="cuda")
        eng.rows_dev[b:nb] = eng.state.scratch
        eng.kv.sync()
        eng.replay_frame(b, nb)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            eng.replay_frame(b, nb)
            torch.cuda.synchronize()
        ev = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in ev)
        top = sorted(ev, key=lambda e: -e.self_device_time_total)[:12]
        out[f"B{b}"] = dict(kernels=int(sum(e.count for e in ev)), gpu_us=total,
                            top=[(e.key[:90], e.count, round(e.self_device_time_total, 1)) for e in top])
        log(f"profile B {b}: {out[f'B{b}']['kernels']} kernels, {total:.0f} us GPU time")
        for t in out[f"B{b}"]["top"]:
            log("   ", t)
    return out


def memory(w, res_bench: dict) -> dict:
    """KV + state bytes per slot at 2048 positions; slots that fit beside the weights, the fused
    copies, the 256-stream graphs and 1 GiB of context / allocator slack on this device."""
    from tts_server.engines.batched.kv_pool import PagedKV
    from tts_server.engines.batched.params import fused_bytes, gemm_dtype

    total = torch.cuda.mem_get_info()[1]
    wb = tensor_bytes(w)
    fused = fused_bytes(w, gemm_dtype("cuda", ENGINE_KW.get("frame_kernel", "triton")))
    out = dict(device_total_bytes=total, model_weight_bytes=wb, fused_copy_bytes=fused,
               graph_memory_bytes_256=res_bench.get("graph_memory_bytes", 0))
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        mb = lambda n: BatchedEngine.memory_bytes(n, 2048, w, kv_dtype=dt, num_blocks=1)  # noqa: E731
        per_slot = PagedKV.nbytes(w.talker.config, 32, 64, dt) + mb(2) - mb(1)
        fixed = wb + mb(1) + out["graph_memory_bytes_256"] + (1 << 30)
        out[name] = dict(bytes_per_slot_2048=per_slot, slots_that_fit=int((total - fixed) // per_slot))
    log("memory", out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--weights", default="synthetic", choices=("synthetic", "random"))
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--frame-kernel", default="triton", choices=("triton", "cuda-predict", "cuda"),
                    help="BatchedEngine(frame_kernel=...) of every engine but the preflight's")
    ap.add_argument("--sections", default="preflight,invariance,bench,memory,teacher_forced,greedy_vs_torch",
                    help="which sections to run (preflight always runs)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ENGINE_KW["frame_kernel"] = args.frame_kernel
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    import triton

    res: dict = dict(frame_kernel=args.frame_kernel, device=torch.cuda.get_device_name(), nvidia_smi=smi, torch=torch.__version__,
                     triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    deadline = T0 + args.budget_s

    wanted = set(args.sections.split(",")) | {"preflight"}

    def section(name, fn):
        if name not in wanted:
            return
        log(f"== {name}")
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:  # keep going: later sections still report
            res[name] = dict(error=traceback.format_exc())
            log(res[name]["error"])
        res.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
        (out_dir / "batched_engine.json").write_text(json.dumps(res, indent=1, default=str))

    try:
        w = load_weights(args.weights)
        res["weights"] = args.weights
    except Exception:
        res["weights"] = f"random (synthetic failed: {traceback.format_exc(limit=2)})"
        w = checks.random_weights("cuda")
    h = w.talker.config.hidden_size
    log("weights:", res["weights"][:60])

    def preflight():
        """2 streams, 2 frames: if the fused code-predictor kernel fails, run everything without it."""
        try:
            eng = BatchedEngine(w, max_streams=2, max_positions=64)
            admit = tuple(Admission(i, checks.random_prompt(i, 9, h, device="cuda"), SamplingConfig(seed=i))
                          for i in range(2))
            checks.step_codes(eng, [0, 1], 2, admit)
            return dict(fused_cp=True, capture_s=eng.capture_s, prefill_graphs=eng.prefill_graphs is not None,
                        prefill_graph_error=eng.prefill_graph_error)
        except Exception:
            ENGINE_KW["fused_cp"] = False
            return dict(fused_cp=False, error=traceback.format_exc())

    section("preflight", preflight)

    def invariance():
        eng = BatchedEngine(w, max_streams=64, max_positions=256, dump_logits=True, **ENGINE_KW)
        r = dict(capture_s_64=eng.capture_s, graph_memory_bytes_64=eng.graph_memory_bytes)
        p = checks.random_prompt(0, 12, h, device="cuda")
        for name, s in (("greedy", checks.GREEDY), ("sampled", SamplingConfig(seed=7))):
            r[name] = checks.invariance(eng, p, s, sizes=(1, 3, 17, 64), frames=64)
            log(name, r[name])
        return r

    def greedy():
        from tts_server.engines.torch_ref import TorchEngine

        ref = TorchEngine(checks.bf16_rounded(w), max_streams=1, max_positions=128)
        prompts = [checks.random_prompt(100 + i, 10 + 7 * i, h, n_trailing=10, device="cuda") for i in range(3)]
        r = {}
        for name, dt in (("fp32_kv", torch.float32), ("bf16_kv", torch.bfloat16)):
            eng = BatchedEngine(w, max_streams=64, max_positions=128, kv_dtype=dt, **ENGINE_KW)
            r[name] = checks.greedy_vs_torch(eng, ref, prompts, 32, batch=64)
            log(name, r[name])
            del eng
            gc.collect()
        return r

    def teacher_forced():
        prompts = [checks.random_prompt(200 + i, 8 + (i * 7) % 40, h, device="cuda") for i in range(64)]
        r = {}
        for name, dt in (("bf16_kv", torch.bfloat16), ("fp32_kv", torch.float32)):
            eng = BatchedEngine(w, max_streams=64, max_positions=320, kv_dtype=dt, dump_logits=True, **ENGINE_KW)
            r[name] = checks.teacher_forced(eng, w, prompts, 200)
            log(name, r[name])
            del eng
            gc.collect()
            torch.cuda.empty_cache()
        return r

    section("invariance", invariance)
    gc.collect()
    torch.cuda.empty_cache()
    section("bench", lambda: bench(w, T0 + 0.6 * args.budget_s))
    gc.collect()
    torch.cuda.empty_cache()
    section("memory", lambda: memory(w, res.get("bench", {})))
    for name, fn in (("teacher_forced", teacher_forced), ("greedy_vs_torch", greedy)):
        if time.perf_counter() < deadline:
            section(name, fn)
        else:
            res[name] = "skipped: out of time"
    log("done")


if __name__ == "__main__":
    main()
