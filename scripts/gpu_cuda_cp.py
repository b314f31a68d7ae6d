#!/usr/bin/env python
"""The code-predictor kernel (csrc/batched/, cuda_cp.py) on one CUDA device, in one call (JSON
under --out):

  smoke        B = 1, 5, 40 launches complete, every code in range, no error word
  vs_triton    the same state through the kernel and through FrameStep.predict (Triton, the
               previous serving path): per-pass logits relative error and greedy codes, B = 64
  invariance   one stream (sampled and greedy) in another row of launches of B = 1/3/17/64/256
               with other neighbours, and with the register path forced off (reg_max_m = 0) or
               wide (64): bitwise identical logits (every pass) and codes
  bench        predict time vs B (CUDA events, median): the kernel and the Triton graph; the
               talker step's graph beside it; the register-path threshold sweep

  PYTHONPATH=. python3 scripts/gpu_cuda_cp.py --out $OUT [--sections smoke,vs_triton,...]
"""

from __future__ import annotations

import argparse
import json
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
from tts_server.engines.batched.cuda_cp import CudaPredictor  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.graphs import bucket_for  # noqa: E402
from tts_server.engines.batched.state import CODE0, N_SAMPLED  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def fill_state(eng: BatchedEngine, n: int, seed: int = 0, greedy: bool = False) -> None:
    """Slots 0..n-1 with random past hidden states, codes 0 and seeds (no prefill needed: the
    code-predictor half reads only these)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = eng.p.talker.cfg.hidden_size
    samp = [SamplingConfig(seed=1000 * seed + i, subtalker_do_sample=not greedy) for i in range(n)]
    past = torch.randn(n, h, device="cuda", generator=g)
    eng.state.admit_many(list(range(n)), samp, [10] * n, [torch.zeros(0, h)] * n, [torch.zeros(h)] * n, past,
                         [0] * n)
    eng.state.ints[CODE0, :n] = torch.randint(0, 2048, (n,), device="cuda", generator=g, dtype=torch.int32)
    eng.state.ints[N_SAMPLED, :n] = torch.randint(1, 50, (n,), device="cuda", generator=g, dtype=torch.int32)


def run_cp(eng: BatchedEngine, cp: CudaPredictor, slots: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """The kernel over `slots` -> (out rows [B, 18], dump rows [B, 16, V] copies)."""
    rows = torch.tensor(slots, dtype=torch.int64, device="cuda")
    cp.predict(rows, len(slots))
    torch.cuda.synchronize()
    cp.check()
    return eng.frame.out[:len(slots)].cpu().numpy().copy(), eng.frame.dump[:len(slots)].clone()


def smoke(eng, cp) -> dict:
    out = {}
    for b in (1, 5, 40):
        fill_state(eng, b, seed=b)
        codes, dump = run_cp(eng, cp, list(range(b)))
        ok = bool((codes[:, :16] >= 0).all() and (codes[:, 1:16] < 2048).all() and (codes[:, 17] == 0).all())
        finite = bool(torch.isfinite(dump[:, :15, :2048]).all())
        out[b] = dict(codes_in_range=ok, logits_finite=finite, first=codes[0, :16].tolist())
        log("smoke", b, out[b])
    return out


def vs_triton(eng, cp, b: int = 64) -> dict:
    """Greedy, same state: the kernel vs the Triton predict (eager); logits of pass k are only
    comparable while the codes before k agree."""
    fill_state(eng, b, seed=11, greedy=True)
    rows = torch.arange(b, dtype=torch.int64, device="cuda")
    eng.frame.predict(rows)
    torch.cuda.synchronize()
    tc, td = eng.frame.out[:b].cpu().numpy().copy(), eng.frame.dump[:b].clone()
    kc, kd = run_cp(eng, cp, list(range(b)))
    errs, agree = [], []
    for r in range(b):
        for k in range(15):
            if not np.array_equal(tc[r, :k + 1], kc[r, :k + 1]):  # an earlier code differs
                break
            a, t = kd[r, k, :2048].double(), td[r, k, :2048].double()
            errs.append(float((a - t).norm() / t.norm()))
        agree.append(int(np.argmin(np.append(tc[r, :16] == kc[r, :16], False))))
    res = dict(rows=b, rel_err_median=float(np.median(errs)), rel_err_max=float(np.max(errs)),
               passes_compared=len(errs), rows_all_16_codes_equal=int(sum(a == 16 for a in agree)),
               codes_equal_prefix_min=int(min(agree)), error_bits_equal=bool(np.array_equal(tc[:, 17], kc[:, 17])))
    log("vs_triton", res)
    return res


def invariance(eng, cp, max_rows: int) -> dict:
    res = {}
    for name, greedy in (("sampled", False), ("greedy", True)):
        fill_state(eng, max_rows, seed=3, greedy=greedy)
        target = 5
        ref = None
        rows_res = {}
        for b in (1, 3, 17, 64, 256):
            if b > max_rows:
                continue
            for regm in ((16, 0, 64) if b <= 64 else (16,)):
                cp.reg_max_m = regm
                others = [s for s in range(max_rows) if s != target][(7 * b) % 3:][: b - 1]
                row = b // 2
                slots = others[:row] + [target] + others[row:]
                codes, dump = run_cp(eng, cp, slots)
                got = (codes[row, :16].copy(), codes[row, 17], dump[row, :15, :2048].clone())
                if ref is None:
                    ref = got
                rows_res[f"B{b}_reg{regm}"] = dict(
                    row=row, codes_equal=bool(np.array_equal(got[0], ref[0]) and got[1] == ref[1]),
                    logits_equal=bool(torch.equal(got[2], ref[2])),
                    max_abs_diff=float((got[2] - ref[2]).abs().max()))
        cp.reg_max_m = 16
        res[name] = rows_res
        log("invariance", name, rows_res)
    return res


def time_ms(fn, iters: int = 30, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for e0, e1 in ev:
        e0.record()
        fn()
        e1.record()
    torch.cuda.synchronize()
    return float(np.median([e0.elapsed_time(e1) for e0, e1 in ev]))


def bench(w) -> dict:
    """The Triton graphs (cuda_cp=False engine) and the kernel over the same state."""
    eng = BatchedEngine(w, max_streams=256, max_positions=256, num_blocks=256 * 2 + 1, cuda_cp=False)
    f = eng.frame
    cp = CudaPredictor(eng.p, eng.state, f.out, f.cp_k, f.cp_v, f.cp_cos, f.cp_sin, None)
    fill_state(eng, 256, seed=5)
    for s in range(256):  # positions for the talker step: 100 each
        eng.kv.ensure(s, 200)
    eng.state.ints[0, :256] = 100
    eng.kv.sync()
    rows = []
    for b in SIZES:
        nb = bucket_for(b, eng.sizes)
        eng.graphs.rows[:b] = torch.arange(b, device="cuda")
        eng.graphs.rows[b:nb] = eng.state.scratch
        kern = time_ms(lambda: cp.predict(eng.graphs.rows, b, nb))
        trit = time_ms(lambda: eng.graphs.predict[nb].replay())
        talk = time_ms(lambda: eng.graphs.advance[nb].replay(), iters=10)
        eng.state.ints[0, :256] = 100  # advance moved the positions; reset
        rows.append(dict(B=b, kernel_ms=kern, triton_graph_ms=trit, talker_graph_ms=talk,
                         frame_kernel_ms=kern + talk, frame_triton_ms=trit + talk))
        log(f"B {b:3d}: code predictor kernel {kern:7.3f} ms  Triton graph {trit:7.3f} ms  "
            f"(talker step {talk:6.3f} ms)")
    sweep = []
    for b in (1, 2, 4, 8, 16, 32):
        row = dict(B=b)
        for regm in (0, 2, 4, 8, 16, 32, 64):
            cp.reg_max_m = regm
            eng.graphs.rows[:b] = torch.arange(b, device="cuda")
            row[regm] = time_ms(lambda: cp.predict(eng.graphs.rows, b, b), iters=15)
        sweep.append(row)
        log("reg_max_m sweep", row)
    return dict(rows=rows, reg_max_m_sweep=sweep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sections", default="smoke,vs_triton,invariance,bench")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     weights="checks.random_weights (0.6B shapes, seeded)")
    w = checks.random_weights("cuda")
    wanted = set(args.sections.split(","))
    max_rows = 256 if wanted & {"invariance"} else 64
    eng = BatchedEngine(w, max_streams=max_rows, max_positions=64, num_blocks=max_rows + 1, dump_logits=True,
                        use_graphs=False, cuda_cp=False)
    f = eng.frame
    cp = CudaPredictor(eng.p, eng.state, f.out, f.cp_k, f.cp_v, f.cp_cos, f.cp_sin, f.dump)
    log(f"kernel grid: {cp.blocks} blocks; engine ready")

    def section(name, fn):
        if name not in wanted:
            return
        log(f"== {name}")
        try:
            res[name] = fn()
        except Exception:
            res[name] = dict(error=traceback.format_exc())
            log(res[name]["error"])
        (out_dir / "cuda_cp.json").write_text(json.dumps(res, indent=1, default=str))

    section("smoke", lambda: smoke(eng, cp))
    section("vs_triton", lambda: vs_triton(eng, cp))
    section("invariance", lambda: invariance(eng, cp, max_rows))
    del eng, cp
    torch.cuda.empty_cache()
    section("bench", lambda: bench(w))
    log("done")


if __name__ == "__main__":
    main()
