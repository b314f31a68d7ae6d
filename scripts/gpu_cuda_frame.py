#!/usr/bin/env python
"""The batched frame kernels (csrc/batched/, cuda_frame.py) on one CUDA device, in one call (JSON
under --out): the code-predictor half (`predict`) and the talker step (`advance`).

  smoke        B = 1, 5, 40: both launches complete, codes in range, no error word
  vs_triton    the same state through each kernel and through FrameStep.predict / advance (the
               Triton path): logits relative error, codes, the talker's state commit, B = 64
  invariance   one stream in another row of launches of B = 1/3/17/64/256 with other
               neighbours, through either product path: bitwise logits and codes; then whole
               engine steps (frame_kernel="cuda") with checks.invariance (B 1/3/17/64, 64 frames)
  bench        predict and advance times vs B at mixed contexts (mean 500) and 1000 (CUDA events,
               median) beside the Triton graphs; the register-path threshold sweep
  tiles        the shared-memory path's tile and K-split choices against its default (B 32..256)

  PYTHONPATH=. python3 scripts/gpu_cuda_frame.py --out $OUT [--sections smoke,vs_triton,...]
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
from tts_server.engines.batched.cuda_frame import CudaFrame  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.batched.graphs import bucket_for  # noqa: E402
from tts_server.engines.batched.state import CODE0, N_SAMPLED, POS  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
H = 1024
T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def fake_streams(eng: BatchedEngine, lengths: list[int], greedy: bool = False, seed: int = 0) -> None:
    """Slots 0..n-1 at the given talker positions without a prefill (KV contents random, blocks
    for length + 8), random past hidden states, codes 0, seeds: all a frame reads."""
    n = len(lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for s in sorted(eng.positions, reverse=True):  # back onto the free list in reverse: the same blocks again
        eng.release(s)
    for s, m in enumerate(lengths):
        assert eng.kv.ensure(s, m + 8), "pool too small"
        eng.positions[s] = m
    samp = [SamplingConfig(seed=1000 * seed + i, do_sample=not greedy, subtalker_do_sample=not greedy) for i in range(n)]
    eng.state.admit_many(list(range(n)), samp, lengths, [torch.zeros(0, H)] * n, [torch.zeros(H)] * n,
                         torch.randn(n, H, device="cuda", generator=g), [0] * n)
    eng.state.ints[CODE0, :n] = torch.randint(0, 2048, (n,), device="cuda", generator=g, dtype=torch.int32)
    eng.state.ints[N_SAMPLED, :n] = torch.randint(2, 50, (n,), device="cuda", generator=g, dtype=torch.int32)
    eng.kv.k.normal_(generator=g)
    eng.kv.v.normal_(generator=g)
    eng.kv.sync()


def run(eng, cf: CudaFrame, slots: list[int], half: str) -> None:
    rows = torch.tensor(slots, dtype=torch.int64, device="cuda")
    if half == "predict":
        cf.predict(rows, len(slots))
    else:
        cf.advance(rows, len(slots))
    torch.cuda.synchronize()
    cf.check()


def smoke(eng, cf) -> dict:
    out = {}
    for b in (1, 5, 40):
        fake_streams(eng, [20 + 7 * i for i in range(b)], seed=b)
        run(eng, cf, list(range(b)), "predict")
        run(eng, cf, list(range(b)), "advance")
        o = eng.frame.out[:b].cpu().numpy()
        ok = bool((o[:, :17] >= 0).all() and (o[:, 1:16] < 2048).all() and (o[:, 16] < 3072).all())
        finite = bool(torch.isfinite(eng.frame.dump[:b, :15, :2048]).all() and torch.isfinite(eng.frame.dump[:b, 15]).all())
        out[b] = dict(codes_in_range=ok, logits_finite=finite, error_bits=o[:, 17].tolist()[:5], first=o[0].tolist())
        log("smoke", b, out[b])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1)).max())


def vs_triton(eng, cf, b: int = 64) -> dict:
    """Greedy, same state: each kernel vs the Triton half (eager) it replaces."""
    fake_streams(eng, checks.mixed_lengths(b), greedy=True, seed=11)
    rows = torch.arange(b, dtype=torch.int64, device="cuda")
    eng.frame.predict(rows)
    torch.cuda.synchronize()
    tc, td = eng.frame.out[:b].clone(), eng.frame.dump[:b].clone()
    run(eng, cf, list(range(b)), "predict")
    kc, kd = eng.frame.out[:b].clone(), eng.frame.dump[:b].clone()
    errs, same = [], 0
    for r in range(b):
        for k in range(15):
            if not torch.equal(tc[r, :k + 1], kc[r, :k + 1]):
                break
            errs.append(rel_err(kd[r, k, :2048], td[r, k, :2048]))
        same += bool(torch.equal(tc[r, :16], kc[r, :16]))
    res = dict(predict=dict(rel_err_median=float(np.median(errs)), rel_err_max=float(np.max(errs)),
                            passes_compared=len(errs), rows_all_16_codes_equal=same, rows=b))
    # the talker step from the same codes (the Triton predict's) and state
    eng.frame.out[:b] = tc
    st = (eng.state.ints.clone(), eng.state.past_hidden.clone(), eng.state.seen.clone(), eng.kv.k.clone(), eng.kv.v.clone())
    eng.frame.advance(rows)
    torch.cuda.synchronize()
    want = (eng.frame.out[:b].clone(), eng.frame.dump[:b, 15].clone(), eng.state.ints[:, :b].clone(),
            eng.state.past_hidden[:b].clone())
    eng.state.ints.copy_(st[0]), eng.state.past_hidden.copy_(st[1]), eng.state.seen.copy_(st[2])
    eng.kv.k.copy_(st[3]), eng.kv.v.copy_(st[4])
    eng.frame.out[:b] = tc
    run(eng, cf, list(range(b)), "advance")
    got = (eng.frame.out[:b].clone(), eng.frame.dump[:b, 15].clone(), eng.state.ints[:, :b].clone(),
           eng.state.past_hidden[:b].clone())
    res["advance"] = dict(logits_rel_err_max=rel_err(got[1], want[1]), hidden_rel_err_max=rel_err(got[3], want[3]),
                          next_code0_equal=int((got[0][:, 16] == want[0][:, 16]).sum()),
                          state_equal_rows=int((got[2] == want[2]).all(0).sum()), rows=b)
    log("vs_triton", res)
    return res


def invariance(eng, cf, w) -> dict:
    res = {}
    for name, greedy in (("sampled", False), ("greedy", True)):
        rr = {}
        target, ref = 5, None
        for b in (1, 3, 17, 64, 256):
            for regm, split in (((16, 0), (0, 1), (0, 2), (64, 0)) if b <= 64 else ((16, 0), (0, 2))):
                cf.reg_max_m, cf.split_mode = regm, split
                fake_streams(eng, checks.mixed_lengths(256), greedy=greedy, seed=3)
                others = [s for s in range(256) if s != target][(7 * b) % 3:][: b - 1]
                row = b // 2
                slots = others[:row] + [target] + others[row:]
                run(eng, cf, slots, "predict")
                run(eng, cf, slots, "advance")
                got = (eng.frame.out[row].clone(), eng.frame.dump[row, :15, :2048].clone(),
                       eng.frame.dump[row, 15].clone(), eng.state.past_hidden[target].clone())
                ref = ref or got
                rr[f"B{b}_reg{regm}_split{split}"] = dict(row=row, bitwise=all(torch.equal(a, c) for a, c in zip(got, ref)))
        cf.reg_max_m, cf.split_mode = 16, 0
        res[name] = rr
        log("invariance", name, rr)
    e2 = BatchedEngine(w, max_streams=64, max_positions=256, dump_logits=True, frame_kernel="cuda")
    p = checks.random_prompt(0, 12, H, device="cuda")
    for name, s in (("engine_greedy", checks.GREEDY), ("engine_sampled", SamplingConfig(seed=7))):
        res[name] = checks.invariance(e2, p, s, sizes=(1, 3, 17, 64), frames=64)
        log(name, res[name])
    return res


def time_ms(fn, iters: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for e0, e1 in ev:
        e0.record()
        fn()
        e1.record()
    torch.cuda.synchronize()
    return float(np.median([e0.elapsed_time(e1) for e0, e1 in ev]))


def tiles(w) -> dict:
    """The shared-memory path's schedules against its default: predict and advance times (ms)
    at B = 32..256 (mixed contexts, register path off) for every tile candidate (1..6: rows x
    inputs 128x64, 64x64, 128x32, 64x32, 32x64, 32x32) whole-K (split 1) or split (2), and the
    default choice (tile 0, split 0)."""
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1, use_graphs=False)
    cf = CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)
    out = {}
    for b in (32, 64, 128, 256):
        fake_streams(eng, checks.mixed_lengths(b), seed=5)
        rows = torch.arange(b, device="cuda")
        pos0 = eng.state.ints[POS].clone()
        cf.reg_max_m = 16
        r = {}
        for tile, split in [(0, 0)] + [(t, sp) for t in range(1, 7) for sp in (1, 2)]:
            cf.tile, cf.split_mode = tile, split
            kp = time_ms(lambda: cf.predict(rows, b), iters=5, warm=1)
            ka = time_ms(lambda: (eng.state.ints[POS].copy_(pos0), cf.advance(rows, b)), iters=5, warm=1)
            r[f"t{tile}s{split}"] = (round(kp, 3), round(ka, 3))
        eng.state.ints[POS].copy_(pos0)
        cf.tile, cf.split_mode = 0, 0
        best_p = min(r.items(), key=lambda kv: kv[1][0])
        best_a = min(r.items(), key=lambda kv: kv[1][1])
        out[b] = dict(times=r, model=r["t0s0"], best_predict=best_p, best_advance=best_a)
        log(f"tiles B {b}: model {r['t0s0']}  best predict {best_p}  best advance {best_a}")
    return out


def bench(w) -> dict:
    """The Triton graphs and the kernels over the same state (an engine with graphs, a CudaFrame
    on its buffers); positions restored before every timing."""
    eng = BatchedEngine(w, max_streams=256, max_positions=2048, num_blocks=256 * 17 + 1)
    cf = CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)
    rows = []
    for ctx in ("mixed", "1000"):
        for b in SIZES:
            lengths = checks.mixed_lengths(b) if ctx == "mixed" else [1000] * b
            fake_streams(eng, lengths, seed=5)
            nb = bucket_for(b, eng.sizes)
            eng.rows_dev[:b] = torch.arange(b, device="cuda")
            eng.rows_dev[b:nb] = eng.state.scratch
            pos0 = eng.state.ints[POS].clone()
            reset = lambda: eng.state.ints[POS].copy_(pos0)  # noqa: E731
            kp = time_ms(lambda: cf.predict(eng.rows_dev, b, nb))
            tp = time_ms(lambda: eng.graphs.predict[nb].replay())
            ka = time_ms(lambda: (reset(), cf.advance(eng.rows_dev, b)))
            ta = time_ms(lambda: (reset(), eng.graphs.advance[nb].replay()))
            reset()
            rows.append(dict(ctx=ctx, B=b, predict_kernel_ms=kp, predict_triton_ms=tp, advance_kernel_ms=ka,
                             advance_triton_ms=ta, frame_kernel_ms=kp + ka, frame_triton_ms=tp + ta))
            log(f"ctx {ctx:>5} B {b:3d}: predict kernel {kp:7.3f} / Triton {tp:7.3f} ms   advance kernel {ka:7.3f} "
                f"/ Triton {ta:7.3f} ms   frame {kp + ka:7.3f} / {tp + ta:7.3f} ms")
    sweep = []
    fake_streams(eng, checks.mixed_lengths(32), seed=6)
    for b in (1, 2, 4, 8, 16, 32):
        eng.rows_dev[:b] = torch.arange(b, device="cuda")
        row = dict(B=b)
        for regm in (0, 2, 4, 8, 16, 32, 64):
            cf.reg_max_m = regm
            row[regm] = time_ms(lambda: cf.predict(eng.rows_dev, b, b), iters=10)
        sweep.append(row)
        log("reg_max_m sweep (predict ms)", row)
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
    eng = BatchedEngine(w, max_streams=256, max_positions=1024, num_blocks=256 * 10 + 1, dump_logits=True,
                        use_graphs=False)
    cf = CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)
    log(f"kernel grid: {cf.blocks} blocks; engine ready")

    def section(name, fn):
        if name not in wanted:
            return
        log(f"== {name}")
        try:
            res[name] = fn()
        except Exception:
            res[name] = dict(error=traceback.format_exc())
            log(res[name]["error"])
        (out_dir / "cuda_frame.json").write_text(json.dumps(res, indent=1, default=str))

    section("smoke", lambda: smoke(eng, cf))
    section("vs_triton", lambda: vs_triton(eng, cf))
    section("invariance", lambda: invariance(eng, cf, w))
    del eng, cf
    torch.cuda.empty_cache()
    section("bench", lambda: bench(w))
    section("tiles", lambda: tiles(w))
    log("done")


if __name__ == "__main__":
    main()
