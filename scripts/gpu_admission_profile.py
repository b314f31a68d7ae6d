"""Where one admission's host time goes on the engine thread (GPU, full-size synthetic model):
tokenize, prompt build, codec reset, resampler, then the engine's admission + first frame and the
first codec step, each timed with a device sync around it (median over the prompt set).

  PYTHONPATH=. python3 scripts/gpu_admission_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.api import SamplingConfig  # noqa: E402
from tts_server.app import create_codec, create_engine  # noqa: E402
from tts_server.codec.pcm import StreamResampler  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.engines.contract import Admission, StepPlan  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.serving.prepare import RequestPreparer  # noqa: E402
from tts_client.workloads import ENGLISH  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=30)
    args = ap.parse_args()
    loaded = load_model("synthetic", "cuda")
    cfg = ServerConfig(max_streams=8)
    engine = create_engine("batched", loaded, cfg)
    codec = create_codec(loaded, 8)
    prep = RequestPreparer(loaded)
    tts = prep.tts
    parts: dict[str, list[float]] = {k: [] for k in (
        "tokenize", "build", "codec_reset", "resampler", "engine_admit_and_frame", "engine_prefill",
        "engine_first_frame", "codec_first_step", "total")}
    for i, text in enumerate([u.text for u in ENGLISH * 4][: args.prompts + 3]):
        t0 = time.perf_counter()
        ids, a = timed(lambda: prep._ids(tts._build_assistant_text(text)))
        prompt, b = timed(lambda: prep.builder.build(ids, "auto", None, non_streaming=prep.non_streaming))
        _, c = timed(lambda: codec.reset(0, None))
        _, d = timed(lambda: StreamResampler(codec.sample_rate, 24000))
        adm = Admission(0, prompt, SamplingConfig(seed=i))
        out, e = timed(lambda: engine.run(StepPlan(decode=(0,), admit=(adm,))))
        _, f = timed(lambda: codec.step([0], np.stack([out.frames[0].codes])))
        total = (time.perf_counter() - t0) * 1e3
        engine.release(0)
        if i < 3:
            continue  # warm-up
        for k, v in zip(parts, (a, b, c, d, e, out.prefill_s * 1e3, out.decode_s * 1e3, f, total)):
            parts[k].append(v)
    res = {k: {"median_ms": round(statistics.median(v), 3), "max_ms": round(max(v), 3)}
           for k, v in parts.items()}
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "admission_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
