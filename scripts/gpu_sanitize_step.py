"""One B = 8 step of the batched engine (8 admissions prefilled together, then one frame for all 8,
eager: no CUDA graphs) for compute-sanitizer. Seeded random 0.6B-shaped weights, paged bf16 KV.

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 scripts/gpu_sanitize_step.py
  (scripts/gpu_sanitize_step.sh runs memcheck and racecheck and prints both summaries)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_server.engines.batched import checks  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan  # noqa: E402


def main() -> None:
    weights = checks.random_weights("cuda")
    engine = BatchedEngine(weights, max_streams=8, max_positions=512, use_graphs=False)
    h = weights.talker.config.hidden_size
    admit = tuple(Admission(i, checks.random_prompt(i, 12 + 7 * i, h), SamplingConfig(seed=i))
                  for i in range(8))
    out = engine.run(StepPlan(decode=tuple(range(8)), admit=admit))
    torch.cuda.synchronize()
    assert not out.failed and len(out.frames) == 8 and all(f.error is None for f in out.frames), out
    out = engine.run(StepPlan(decode=tuple(range(8)), admit=()))  # a step without admissions
    torch.cuda.synchronize()
    assert len(out.frames) == 8 and all(f.error is None for f in out.frames), out
    print("sanitize step ok: B = 8, codes", [f.codes[:4].tolist() for f in out.frames[:2]])


if __name__ == "__main__":
    main()
