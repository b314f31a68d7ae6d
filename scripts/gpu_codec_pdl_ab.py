#!/usr/bin/env python
"""Same-process A/B of programmatic dependent launch in the batched codec's graphs
(codec/batched.py PDL_MAX_ROWS): per variant (PDL for buckets of up to N rows; 0 = off) a fresh
BatchedCodecDecoder (full-size synthetic codec, bf16, 256 slots) with its graphs captured under
that setting; the graph-replay step time per bucket (median of 3 CUDA-event-timed runs), and the
PCM of one stream alone and of 64 streams over 12 frames, which must be bitwise equal across
variants (PDL changes when a kernel starts, never what it computes).

  PYTHONPATH=. python3 scripts/gpu_codec_pdl_ab.py --out $OUT [--variants 0,8,64,256,0]
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

from tts_server.testing.audio_stubs import stub_audio_modules  # noqa: E402

stub_audio_modules()

from tts_server.codec import batched  # noqa: E402
from tts_server.model.synthetic import codec_config  # noqa: E402


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def replay_ms(graph, iters: int) -> float:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters


def pcm(bd, slots: list[int], frames: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2048, (frames, len(slots), bd.num_quantizers), generator=g)
    for s in slots:
        bd.reset(s)
    return np.stack([bd.step(slots, codes[i]) for i in range(frames)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--variants", default="0,8,64,256,0")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as qm

    torch.manual_seed(0)
    dec = qm.Qwen3TTSTokenizerV2Model(codec_config("full")).eval().decoder.cuda()
    res: dict = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                     commit=os.environ.get("COMMIT", "?"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     variants=[])
    base = None
    for n in [int(v) for v in args.variants.split(",")]:
        batched.PDL_MAX_ROWS = n
        bd = batched.BatchedCodecDecoder(dec, 256, dtype=torch.bfloat16)
        v = dict(pdl_max_rows=n, capture_s=round(bd.capture_s, 1), step_ms={})
        for bp in bd.buckets:
            v["step_ms"][bp] = round(float(np.median([replay_ms(bd._graphs[bp][0], args.iters) for _ in range(3)])), 4)
        sig = dict(alone=pcm(bd, [5], 12, 1), many=pcm(bd, list(range(64)), 12, 2))
        if base is None:
            base = sig
        v["bitwise_equal_to_first"] = {k: bool(np.array_equal(a, base[k])) for k, a in sig.items()}
        log(f"PDL up to {n} rows: {v['step_ms']} bitwise {v['bitwise_equal_to_first']}")
        res["variants"].append(v)
        del bd
        torch.cuda.empty_cache()
        (out / "codec_pdl_ab.json").write_text(json.dumps(res, indent=1))


T0 = time.perf_counter()
if __name__ == "__main__":
    main()
