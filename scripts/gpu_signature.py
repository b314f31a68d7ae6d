#!/usr/bin/env python
"""A batched engine's bitwise signature, to compare two trees in one GPU call: the full-size
synthetic model, 64 real admissions of different lengths in one step, then 16 frames (half the
slots sampled, half greedy) -> codes [64, 16, 16] and the last talker hidden state [64, 1024]
(fp32 bits), saved as .npz. `--compare A.npz B.npz` says whether two signatures are identical.

  python3 scripts/gpu_signature.py --tree . --out $OUT/new.npz
  python3 scripts/gpu_signature.py --tree .base --out $OUT/base.npz   # e.g. `git archive` of main
  python3 scripts/gpu_signature.py --compare $OUT/base.npz $OUT/new.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def signature(tree: Path, out: Path) -> None:
    sys.path.insert(0, str(tree.resolve()))
    import torch

    from tts_server.api import SamplingConfig
    from tts_server.engines.batched import checks
    from tts_server.engines.batched.engine import BatchedEngine
    from tts_server.engines.contract import Admission
    from tts_server.model.synthetic import SYNTHETIC_NAMES, build_tts_model
    from tts_server.model.weights import decode_weights

    model = build_tts_model(SYNTHETIC_NAMES["synthetic"])
    model.talker.model.text_embedding = None
    w = decode_weights(model.to("cuda", torch.bfloat16).eval())
    h = w.talker.config.hidden_size
    eng = BatchedEngine(w, max_streams=64, max_positions=512)
    admit = tuple(Admission(i, checks.random_prompt(1000 + i, 8 + i % 23, h, device="cuda"),
                            SamplingConfig(seed=i) if i % 2 else checks.GREEDY) for i in range(64))
    codes = checks.step_codes(eng, list(range(64)), 16, admit)
    np.savez(out, codes=np.stack([codes[s] for s in range(64)]),
             hidden=eng.state.past_hidden[:64].cpu().numpy().view(np.uint32))
    print(f"signature of {tree}: {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=".")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        a, b = (np.load(p) for p in args.compare)
        res = {k: bool(np.array_equal(a[k], b[k])) for k in ("codes", "hidden")}
        print(json.dumps(dict(compare=args.compare, identical=res)))
        sys.exit(0 if all(res.values()) else 1)
    signature(Path(args.tree), Path(args.out))


if __name__ == "__main__":
    main()
