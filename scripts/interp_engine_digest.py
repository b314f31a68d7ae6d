"""A tiny BatchedEngine's admissions and frames through the Triton kernels on the CPU (the
interpreter), then a digest of the codes and past hidden states: two trees printing the same
digest compute the same bits there (for refactors that must not change a value). ~1 min.

    cd <tree> && TRITON_INTERPRET=1 python3 scripts/interp_engine_digest.py
"""
import hashlib, sys, time
import numpy as np
import torch
sys.path.insert(0, ".")
from tts_server.model.synthetic import SYNTHETIC_NAMES, build_synthetic
from tts_server.model.weights import decode_weights
from tts_server.engines.batched import checks
from tts_server.engines.batched.engine import BatchedEngine
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan

t0 = time.time()
m = build_synthetic(SYNTHETIC_NAMES["synthetic-tiny"])
w = decode_weights(m.model)
eng = BatchedEngine(w, max_streams=3, max_positions=128)
h = eng.p.talker.cfg.hidden_size
admit = tuple(Admission(i, checks.random_prompt(100 + i, 6 + 3 * i, h), SamplingConfig(seed=i, do_sample=i != 1))
              for i in range(3))
codes = checks.step_codes(eng, [0, 1, 2], 3, admit)
dig = hashlib.sha256()
for s in range(3):
    dig.update(np.ascontiguousarray(codes[s]).tobytes())
    print(s, codes[s].tolist())
dig.update(eng.state.past_hidden[:3].numpy().tobytes())
print("DIGEST", dig.hexdigest(), f"{time.time() - t0:.0f}s")
