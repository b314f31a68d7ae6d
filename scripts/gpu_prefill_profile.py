"""What a step's admissions cost on the engine thread (GPU, full-size synthetic model), by batch
size: prompt preparation (RequestPreparer.prepare, one request at a time, and prepare_many, all of
a step's requests at once) and the engine's batched prefill (row graphs), each timed with a device
sync around it (median of --repeats); then a kernel profile of one prefill of --profile-prompts.

  PYTHONPATH=. python3 scripts/gpu_prefill_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_server.api import SamplingConfig, SynthesisRequest  # noqa: E402
from tts_server.app import create_engine  # noqa: E402
from tts_server.config import ServerConfig  # noqa: E402
from tts_server.engines.batched import engine as engine_mod  # noqa: E402
from tts_server.engines.contract import Admission, StepPlan  # noqa: E402
from tts_server.model.loader import load_model  # noqa: E402
from tts_server.serving.prepare import RequestPreparer  # noqa: E402
from tts_client.workloads import ENGLISH  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_admission_profile import timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-streams", type=int, default=64)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-prompts", default="32", help="comma list of prompt counts to profile ('' for none)")
    ap.add_argument("--share-ab", action="store_true",
                    help="also time each admission without the shared prompt prefix (engine.SHARE_PREFIX off)")
    args = ap.parse_args()
    loaded = load_model("synthetic", "cuda")
    engine = create_engine("batched", loaded, ServerConfig(max_streams=args.max_streams))
    if loaded.text_table is None:  # as the server does on a GPU (app.py): prompts' text rows are gathers
        from tts_server.model.prompt import project_vocabulary

        loaded.text_table = project_vocabulary(loaded.model)
    prep = RequestPreparer(loaded)
    voice = next(iter(loaded.model.config.talker_config.spk_id or {}), None) if loaded.model_type == "custom_voice" else None
    texts = [u.text for u in ENGLISH] * (1 + args.max_streams // len(ENGLISH))
    reqs = [SynthesisRequest(f"r{i}", t, voice, "auto", SamplingConfig(seed=i), 100, 24000)
            for i, t in enumerate(texts[:args.max_streams])]
    ids = [prep.text_ids(r.text) for r in reqs]
    res: dict = {"device": torch.cuda.get_device_name(), "max_streams": args.max_streams, "voice": voice,
                 "levels": {}}

    def admit(prompts):
        plan = StepPlan(decode=(), admit=tuple(Admission(i, p.prompt, SamplingConfig(seed=i))
                                               for i, p in enumerate(prompts)))
        return engine.run(plan)

    def release(n):
        for i in range(n):
            engine.release(i)

    for a in [int(x) for x in args.batches.split(",") if int(x) <= args.max_streams]:
        one, many, run, unshared = [], [], [], []
        for r in range(args.repeats + 1):
            prompts, t1 = timed(lambda: [prep.prepare(q, i) for q, i in zip(reqs[:a], ids[:a])])
            t2 = None
            if hasattr(prep, "prepare_many"):  # as the server builds a step's prompts (shared prefixes keyed)
                prompts, t2 = timed(lambda: prep.prepare_many(reqs[:a], ids[:a]))
            _, t3 = timed(lambda: admit(prompts))
            release(a)
            if args.share_ab:  # the same admission, every prompt computing its own prefix rows
                engine_mod.SHARE_PREFIX = False
                _, t4 = timed(lambda: admit(prompts))
                release(a)
                engine_mod.SHARE_PREFIX = True
            if r == 0:
                continue  # warm-up
            one.append(t1)
            run.append(t3)
            if args.share_ab:
                unshared.append(t4)
            if t2 is not None:
                many.append(t2)
        rows = sum(p.prompt.embeds.shape[0] for p in prompts)
        lvl = {"rows": rows, "prepare_one_by_one_ms": round(statistics.median(one), 3),
               "engine_admit_ms": round(statistics.median(run), 3)}
        if many:
            lvl["prepare_many_ms"] = round(statistics.median(many), 3)
        if unshared:
            lvl["engine_admit_unshared_ms"] = round(statistics.median(unshared), 3)
        res["levels"][a] = lvl
        print(a, lvl, flush=True)

    res["profiles"] = {}
    for a in [min(int(x), args.max_streams) for x in str(args.profile_prompts).split(",") if x]:
        prompts = [prep.prepare(q, i) for q, i in zip(reqs[:a], ids[:a])]
        admit(prompts)
        release(a)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            admit(prompts)
            torch.cuda.synchronize()
        release(a)
        kernels, gpu_us = {}, 0.0  # kernels, and the CPU ops that launched them (their time counted once)
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0) > 0:
                t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
                if t > 0 and ev.key not in kernels:
                    kernels[ev.key[:120]] = {"us": round(t, 1), "count": ev.count}
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        gpu_us += t
        top = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:30]
        prof_res = {"prompts": a, "rows": sum(p.prompt.embeds.shape[0] for p in prompts),
                    "gpu_us_total": round(gpu_us, 1), "top": top}
        res["profiles"][a] = prof_res
        print(json.dumps(prof_res, indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefill_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
