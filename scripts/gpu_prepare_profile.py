"""The host time of a burst's prompt building on the engine thread (GPU, full-size synthetic model):
`RequestPreparer.prepare_many` for waves of 1..128 English requests (their ids tokenized before, as
the engine process does at submit), median of 5 with a device sync after each, alone and with a
second thread tokenizing meanwhile (as the engine process's pipe thread does while a burst's calls
arrive, a request every 0.4 ms: the GIL is shared; and nonstop), then one 128-request wave under
cProfile.

  PYTHONPATH=. python3 scripts/gpu_prepare_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_client.workloads import ENGLISH  # noqa: E402
from tts_server.api import SamplingConfig, SynthesisRequest  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.model.prompt import project_vocabulary  # noqa: E402
from tts_server.serving.prepare import RequestPreparer  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wave_ms(prep: RequestPreparer, reqs, ids, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        prep.prepare_many(reqs, ids)
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(ts), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    a = ap.parse_args()
    loaded = load_model(a.model, device=a.device)
    loaded.text_table = project_vocabulary(loaded.model)  # as the server does (app.build_worker)
    prep = RequestPreparer(loaded)
    prep.builder.warm_up()
    texts = [u.text for u in ENGLISH]
    reqs = [SynthesisRequest(f"r{i}", texts[i % len(texts)], "aiden", "english", SamplingConfig(), 75, 24000)
            for i in range(128)]
    ids = [prep.text_ids(r.text) for r in reqs]
    res: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__, "alone": {}, "contended": {}}
    for n in (1, 16, 64, 128):
        wave_ms(prep, reqs[:n], ids[:n], 2)
        res["alone"][n] = wave_ms(prep, reqs[:n], ids[:n])
    stop = threading.Event()
    count = [0]

    def tokenize(gap_s: float) -> None:  # the pipe thread in a burst: a request every gap_s
        while not stop.is_set():
            prep.text_ids(texts[count[0] % len(texts)])
            count[0] += 1
            if gap_s:
                time.sleep(gap_s)

    for name, gap in (("contended", 0.0004), ("contended_busy", 0.0)):
        stop.clear()
        count[0] = 0
        res[name] = {}
        th = threading.Thread(target=tokenize, args=(gap,), daemon=True)
        th.start()
        t0 = time.perf_counter()
        for n in (1, 16, 64, 128):
            res[name][n] = wave_ms(prep, reqs[:n], ids[:n], 3)
        stop.set()
        th.join()
        res[name + "_tokenized_per_s"] = round(count[0] / (time.perf_counter() - t0))
    res["switch_interval_s"] = sys.getswitchinterval()
    pr = cProfile.Profile()
    sync()
    pr.enable()
    prep.prepare_many(reqs, ids)
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    res["profile_128"] = s.getvalue()
    print(json.dumps({k: v for k, v in res.items() if k != "profile_128"}, indent=1))
    print(res["profile_128"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "prepare_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
