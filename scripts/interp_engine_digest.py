"""A BatchedEngine's admissions and frames, then a digest of the codes and past hidden states:
two trees printing the same digest compute the same bits (for refactors that must not change a
value). On the CPU through the Triton interpreter (tiny model, ~1 min):

    cd <tree> && TRITON_INTERPRET=1 python3 scripts/interp_engine_digest.py

On a GPU (full-size synthetic, bf16 weights, 8 streams of mixed greedy/sampled, 48 frames):

    cd <tree> && python3 scripts/interp_engine_digest.py --device cuda
"""
import argparse, sys, time
import torch
sys.path.insert(0, ".")
from tts_server.model.synthetic import SYNTHETIC_NAMES, build_synthetic, build_tts_model
from tts_server.model.weights import decode_weights
from tts_server.engines.batched import checks
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.contract import Admission, SamplingConfig

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
args = ap.parse_args()
gpu = args.device != "cpu"
t0 = time.time()
if gpu:  # as scripts/gpu_batched_engine.py loads it
    model = build_tts_model(SYNTHETIC_NAMES["synthetic"])
    model.talker.model.text_embedding = None
    w = decode_weights(model.to(args.device, torch.bfloat16).eval())
else:
    w = decode_weights(build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"]).model)
n, frames = (8, 48) if gpu else (3, 3)
eng = BatchedEngine(w, max_streams=n, max_positions=512 if gpu else 128)
h = eng.p.talker.cfg.hidden_size
admit = tuple(Admission(i, checks.random_prompt(100 + i, 6 + 3 * i, h, device=args.device),
                        SamplingConfig(seed=i, do_sample=i != 1)) for i in range(n))
codes = checks.step_codes(eng, list(range(n)), frames, admit)
for s in range(n):
    print(s, codes[s][:4].tolist() if gpu else codes[s].tolist())
print("DIGEST", checks.digest(eng, codes), f"{time.time() - t0:.0f}s")
