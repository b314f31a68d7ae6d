#!/usr/bin/env python
"""One stream's first-audio parts on the GPU, for A/Bs of launch settings that must not change a
bit (e.g. TTS_PDL_PREFILL_ROWS): the engine's admission (prefill + first draw, GPU time) and first
frame at prompts of 20 / 60 / 100 positions (gpu_batched_engine.first_frame), and a digest of 4
admissions x 8 frames (codes + past hidden) that must match across settings.

  TTS_PDL_PREFILL_ROWS=64 PYTHONPATH=. python3 scripts/gpu_first_audio_parts.py --out $OUT/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_batched_engine import first_frame, load_weights, log  # noqa: E402
from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.contract import Admission, SamplingConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = load_weights("synthetic")
    eng = BatchedEngine(w, max_streams=8, max_positions=1024)
    h = eng.p.talker.cfg.hidden_size
    res = dict(env={k: v for k, v in os.environ.items() if k.startswith("TTS_PDL")},
               first_frame=first_frame(eng))
    for s in list(eng.positions):
        eng.release(s)
    admit = tuple(Admission(i, checks.random_prompt(500 + i, 12 + 17 * i, h, device="cuda"),
                            SamplingConfig(seed=i, do_sample=i != 1)) for i in range(4))
    res["digest"] = checks.digest(eng, checks.step_codes(eng, list(range(4)), 8, admit))
    log(json.dumps(res, default=str))
    (out / "first_audio_parts.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
