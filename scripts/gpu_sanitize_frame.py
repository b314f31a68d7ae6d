#!/usr/bin/env python
"""One B = 8 frame through both batched kernels (csrc/batched/) with 2 talker and 1
code-predictor layers (every product, attention and draw shape of the full model, fewer layers):
what scripts/gpu_cuda_frame.sh runs under compute-sanitizer memcheck and racecheck."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.cuda_frame import CudaFrame  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan  # noqa: E402

w = checks.random_weights("cuda", layers=(2, 1))
eng = BatchedEngine(w, max_streams=8, max_positions=256, num_blocks=8 * 5 + 1, use_graphs=False)
eng.run(StepPlan(admit=tuple(Admission(i, checks.random_prompt(i, 20 + 9 * i, 1024, device="cuda"),
                                       SamplingConfig(seed=i)) for i in range(8))))
cf = CudaFrame(eng.p, eng.state, eng.kv, eng.frame, eng.max_positions)
rows = torch.arange(8, dtype=torch.int64, device="cuda")
for regm, split in ((16, 0), (0, 1), (0, 2)):  # every product schedule: registers, shared memory whole-K and split
    cf.reg_max_m, cf.split_mode = regm, split
    cf.predict(rows, 8)
    cf.advance(rows, 8)
    torch.cuda.synchronize()
    cf.check()
print("frame codes", eng.frame.out[:8, :17].tolist())
