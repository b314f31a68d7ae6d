#!/usr/bin/env python
"""Same-call A/B of programmatic dependent launch in the batched engine (tts_server/engines/batched/pdl.py):
variants off (TTS_PDL=0) / the default (frame graphs of B <= graphs.PDL_MAX_ROWS) / every bucket /
rowsN (frame graphs of B <= N) / pfN (the prefill graphs of <= N rows) / swN (the draw's program
with N warps: tk_sample.NUM_WARPS),
each a fresh engine with its graphs captured under that setting (the GEMMs' weight tiles loaded
before the PDL wait were measured slower with this script: benchmarks/results/h100-gemm-preload-ab-*).
Per variant: graph-replay frame time at B 1 / 8 / 64 / 256 (mixed contexts, median of
CUDA-event-timed replays), one stream's admission + first frame, and the codes and hidden state
of 64 and of 4 real admissions (4: a PDL bucket) over 16 sampled frames, which must be bitwise
equal across variants; and the admission of 4 / 16 / 64 prompts of 60 rows in one step.

  PYTHONPATH=. python3 scripts/gpu_pdl_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_batched_engine import fake_admit, first_frame, load_weights, log, time_replays, timed_run  # noqa: E402
from tts_server.engines.batched.checks import mixed_lengths  # noqa: E402

from tts_server.api import SamplingConfig  # noqa: E402
from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.contract import Admission, StepPlan  # noqa: E402

# (environment, graphs.PDL_MAX_ROWS or None: unchanged)
VARIANTS = {"off": ({"TTS_PDL": "0"}, None), "default": ({"TTS_PDL": "1"}, None),
            "all": ({"TTS_PDL": "1"}, 1 << 30), "default_again": ({"TTS_PDL": "1"}, None)}
VARIANTS.update({f"rows{n}": ({"TTS_PDL": "1"}, n) for n in (16, 32, 64, 128)})  # PDL up to n rows
# pfN: the frame graphs at the default, the prefill graphs (prompt-length and row buckets) with PDL
# up to N rows (prefill.PDL_MAX_ROWS)
PREFILL_ROWS = {f"pf{n}": n for n in (128, 256, 512, 1 << 30)}
VARIANTS.update({name: ({"TTS_PDL": "1"}, None) for name in PREFILL_ROWS})
# the decode attention's programs in (row, kv head) order instead of (kv head, row) (tk_attention;
# run it after the variants that expect the default)
VARIANTS["kvminor"] = ({"TTS_PDL": "1", "TTS_ATTN_KV_MAJOR": "0", "TTS_ATTN_TC_TERMS": "2"}, None)
# and with 3 bf16 parts of q and of the softmax weights instead of 2 (tk_attention.TC_TERMS)
VARIANTS["terms3"] = ({"TTS_PDL": "1", "TTS_ATTN_KV_MAJOR": "1", "TTS_ATTN_TC_TERMS": "3"}, None)
# the draw's program with 2, 4 or 16 warps instead of 8 (tk_sample.NUM_WARPS)
VARIANTS.update({f"sw{n}": ({"TTS_PDL": "1", "TTS_SAMPLE_WARPS": str(n)}, None) for n in (2, 4, 8, 16)})
# the talker's layers of steps of one stream through the graphs instead of the small-batch kernel's
# talker variant (engine.BatchedEngine._talker_kernel)
VARIANTS["talker_off"] = ({"TTS_PDL": "1", "TTS_TALKER_KERNEL": "0"}, None)
# the small-batch kernel (both variants) launched plain (cooperative) inside the PDL graphs instead of
# as a programmatic dependent (small_kernel._pdl), and on 132 blocks (TTS_SMALL_BLOCKS; qsk_grid
# leaves an SM to the kernel before it: 128 on 132 SMs)
VARIANTS["small_nopdl"] = ({"TTS_PDL": "1", "TTS_SMALL_PDL": "0"}, None)
VARIANTS["small_b132"] = ({"TTS_PDL": "1", "TTS_SMALL_BLOCKS": "132"}, None)
# the draws' noise made at the frame's start for frames of up to N streams (frame.NOISE_ROWS)
VARIANTS.update({f"noise{n}": ({"TTS_PDL": "1", "TTS_FRAME_NOISE_ROWS": str(n)}, None) for n in (1, 4, 16, 64)})
# the layers' products summed as sub-pieces of 256 columns (tk_gemm.SUB_COLS, opt-in: TTS_GEMM_SUB)
# and the small-batch kernel built to match (csrc/build/qsk_sub256.so: make -C csrc
# build/qsk_sub256.so SMALL_LIB=build/qsk_sub256.so DEFS=-DQSK_SUB=256, carried); its bits differ
# from the default's by design
VARIANTS["sub256"] = ({"TTS_PDL": "1", "TTS_GEMM_SUB": "256", "QSK_LIB": "csrc/build/qsk_sub256.so"}, None)
# every setting a variant makes: popped before each variant, so that a later one (e.g.
# default_again after kvminor) runs with the tree's default for what it does not set itself
VARIANT_ONLY = {key for env, _ in VARIANTS.values() for key in env}


def admissions(eng, counts=(4, 16, 64), length: int = 60) -> dict:
    """k prompts of `length` rows admitted in one step with their first frame (host wall, device
    synchronised; median of 5 after a warm-up), and the step's prefill part."""
    h = eng.p.talker.cfg.hidden_size
    out = {}
    for k in counts:
        prompts = [checks.random_prompt(500 + i, length, h, device="cuda") for i in range(k)]
        rows = []
        for r in range(6):
            plan = StepPlan(admit=tuple(Admission(i, prompts[i], SamplingConfig(seed=r)) for i in range(k)),
                            decode=tuple(range(k)))
            dt, o = timed_run(eng, plan, wait=True)
            rows.append((dt, o.prefill_s))
        med = np.median(np.array(rows[1:]) * 1e3, axis=0)
        out[k] = dict(total_ms=float(med[0]), prefill_ms=float(med[1]))
        log(f"admission of {k} x {length}-row prompts: {out[k]}")
    return out


def signature(eng: BatchedEngine, n: int, frames: int = 16) -> dict:
    """The codes and past hidden states (as uint32) of n seeded admissions after `frames`
    sampled frames: equal between two engines = the same bits."""
    for s in list(eng.positions):
        eng.release(s)
    h = eng.p.talker.cfg.hidden_size
    admit = tuple(Admission(i, checks.random_prompt(1000 + i, 8 + i % 23, h, device="cuda"), SamplingConfig(seed=i))
                  for i in range(n))
    codes = checks.step_codes(eng, list(range(n)), frames, admit)
    return {f"codes{n}": np.stack([codes[s] for s in range(n)]),
            f"hidden{n}": eng.state.past_hidden[:n].detach().cpu().numpy().copy().view(np.uint32)}


def run_variant(w, sizes, iters: int, sig_rows=(64, 4)) -> tuple[dict, dict]:
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1)
    res = dict(capture_s=eng.capture_s, replay_ms={}, small_kernel=eng.small_kernel,
               attn_kernel=getattr(eng, "attn_kernel", "absent"),  # (a base tree may predate them)
               talker_kernel=getattr(eng, "talker_kernel", "absent"))
    log(f"  engine: small-batch kernel {res['small_kernel']}, decode attention kernel {res['attn_kernel']}, "
        f"talker kernel {res['talker_kernel']}")
    for b in sizes:
        ms = [time_replays(eng, fake_admit(eng, mixed_lengths(b), margin=64), iters) for _ in range(3)]
        res["replay_ms"][b] = float(np.median(ms))
        log(f"  B {b:3d} mixed: {res['replay_ms'][b]:.3f} ms (runs {', '.join(f'{m:.3f}' for m in ms)})")
    res["first_frame"] = first_frame(eng)
    res["admissions"] = admissions(eng)
    sig = {}
    for n in sig_rows:
        sig |= signature(eng, n)
    del eng
    torch.cuda.empty_cache()
    return res, sig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sizes", default="1,8,64,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sig-rows", default="64,4", help="admissions whose codes and hidden states are compared")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                     commit=os.environ.get("COMMIT", "?"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     variants={})
    w = load_weights("synthetic")
    sizes = [int(s) for s in args.sizes.split(",")]
    sigs = {}
    from tts_server.engines.batched import graphs, prefill

    from tts_server.engines.batched import tk_sample

    default_rows, default_prefill, default_warps = graphs.PDL_MAX_ROWS, prefill.PDL_MAX_ROWS, tk_sample.NUM_WARPS
    for name in args.variants.split(","):
        env, rows = VARIANTS[name]
        for key in VARIANT_ONLY:
            os.environ.pop(key, None)
        os.environ.update(env)
        graphs.PDL_MAX_ROWS = default_rows if rows is None else rows
        prefill.PDL_MAX_ROWS = PREFILL_ROWS.get(name, default_prefill)
        tk_sample.NUM_WARPS = int(os.environ.get("TTS_SAMPLE_WARPS", default_warps))
        log(f"== {name} {env} PDL_MAX_ROWS={graphs.PDL_MAX_ROWS} prefill {prefill.PDL_MAX_ROWS}")
        try:
            res["variants"][name], sigs[name] = run_variant(w, sizes, args.iters,
                                                            [int(n) for n in args.sig_rows.split(",")])
        except Exception:  # keep the other variants
            import traceback
            res["variants"][name] = dict(error=traceback.format_exc())
            log(res["variants"][name]["error"])
        (out / "pdl_ab.json").write_text(json.dumps(res, indent=1, default=str))
    base = next(iter(sigs), None)
    res["bitwise_equal_to_" + str(base)] = {
        n: {k: bool(np.array_equal(v, sigs[base][k])) for k, v in s.items()} for n, s in sigs.items()}
    log("bitwise:", res["bitwise_equal_to_" + str(base)])
    (out / "pdl_ab.json").write_text(json.dumps(res, indent=1, default=str))
    if base is not None:  # for comparing trees (scripts/gpu_frames_ab.sh)
        np.savez(out / "sigs.npz", **sigs[base])


if __name__ == "__main__":
    main()
