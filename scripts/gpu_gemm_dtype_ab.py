#!/usr/bin/env python
"""Same-call A/B of the batched engine's GEMM matrix dtype (params.gemm_dtype): bf16 with fp32
activations as two bf16 terms (TTS_GEMM_DTYPE=bf16) against fp16 with activations rounded once to
fp16 (TTS_GEMM_DTYPE=fp16, the default on CUDA since session 21: one dot instead of two). Each
variant runs in its own process (the environment is read when the engine is built), on the
full-size synthetic model:

  frames      graph-replay frame time at B 1 / 8 / 64 / 256, mixed contexts (mean 500)
  admissions  one 20-token prompt's admission + first frame (c = 1), and the GPU time of
              admitting 64 and 160 prompts of 8-47 tokens at once (a burst's prefill)
  accuracy    teacher-forced logits inside B = 64 over 200 frames vs the fp32 reference (bf16 KV;
              issue 16's bar: rel err <= 1e-2, top-1 >= 99.5%); bitwise invariance of one stream
              in B 1 / 3 / 17 / 64 over 32 sampled frames (codes and logits)

  PYTHONPATH=. python3 scripts/gpu_gemm_dtype_ab.py --out $OUT [--variants bf16,fp16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_variant(out: Path, sections: set[str]) -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    import numpy as np
    import torch

    from gpu_batched_engine import fake_admit, first_frame, load_weights, log, time_replays, timed_run
    from tts_server.api import SamplingConfig
    from tts_server.engines.batched import checks, params
    from tts_server.engines.batched.engine import BatchedEngine
    from tts_server.engines.contract import Admission, StepPlan

    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = dict(gemm_dtype=str(params.gemm_dtype("cuda")))
    w = load_weights("synthetic")
    h = w.talker.config.hidden_size
    if "frames" in sections or "admissions" in sections:
        eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1)
        res["capture_s"] = eng.capture_s
        if "frames" in sections:
            res["replay_ms"] = {}
            for b in (1, 8, 64, 256):
                ms = [time_replays(eng, fake_admit(eng, checks.mixed_lengths(b), margin=64), 30) for _ in range(3)]
                res["replay_ms"][b] = float(np.median(ms))
                log(f"B {b:3d} mixed: {res['replay_ms'][b]:.3f} ms (runs {', '.join(f'{m:.3f}' for m in ms)})")
        if "admissions" in sections:
            res["first_frame"] = first_frame(eng)
            res["admit_ms"] = {}
            for n in (64, 160):
                prompts = [checks.random_prompt(700 + i, 8 + (i * 13) % 40, h, device="cuda") for i in range(n)]
                admit = tuple(Admission(i, p, SamplingConfig(seed=i)) for i, p in enumerate(prompts))
                ts = [timed_run(eng, StepPlan(admit=admit), wait=True)[0] * 1e3 for _ in range(4)]
                res["admit_ms"][n] = float(np.median(ts[1:]))
                log(f"admit {n} prompts: {res['admit_ms'][n]:.2f} ms (runs {', '.join(f'{t:.2f}' for t in ts)})")
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if "accuracy" in sections:
        prompts = [checks.random_prompt(200 + i, 8 + (i * 7) % 40, h, device="cuda") for i in range(64)]
        eng = BatchedEngine(w, max_streams=64, max_positions=320, dump_logits=True)
        res["teacher_forced_bf16_kv"] = checks.teacher_forced(eng, w, prompts, 200)
        log("teacher forced:", res["teacher_forced_bf16_kv"])
        p = checks.random_prompt(0, 12, h, device="cuda")
        res["invariance_sampled"] = checks.invariance(eng, p, SamplingConfig(seed=7), sizes=(1, 3, 17, 64), frames=32)
        log("invariance:", res["invariance_sampled"])
    name = os.environ.get("TTS_GEMM_DTYPE", "default")
    (out / f"variant-{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--variants", default="bf16,fp16")
    ap.add_argument("--sections", default="frames,admissions,accuracy")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a variant's own process
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    if args.one:
        run_variant(out, sections)
        return
    summary = {}
    for v in args.variants.split(","):
        env = dict(os.environ, TTS_GEMM_DTYPE=v)
        print(f"== {v}", flush=True)
        subprocess.run([sys.executable, __file__, "--one", "--out", str(out), "--sections", args.sections],
                       env=env, check=False, timeout=420)
        f = out / f"variant-{v}.json"
        summary[v] = json.loads(f.read_text()) if f.exists() else "failed"
    (out / "gemm_dtype_ab.json").write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=os.environ.get("COMMIT", "?"),
        variants=summary), indent=1, default=str))


if __name__ == "__main__":
    main()
