"""One B = 8 step of the batched engine (8 admissions prefilled together, then one frame for all 8,
eager: no CUDA graphs) for compute-sanitizer. Seeded random 0.6B-shaped weights, paged bf16 KV.

  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 scripts/gpu_sanitize_step.py
  (scripts/gpu_sanitize_step.sh runs memcheck and racecheck and prints both summaries)
--light: skip the engine's start-up warm-ups and the second step (racecheck instruments every
shared-memory access and is too slow for the ~4,000 launches of the full run)
--layers T,C: talker / code-predictor layers (default 28,5). Fewer layers keep every GEMM, attention
and glue shape of the 0.6B model, so the same kernels run, each fewer times (racecheck at 2,1)
--spp N: the tensor-core decode attention walks N splits per program (2 pipelined stages), as it
does at large B, and the prompts are long enough (12..292 positions) for rows of several splits
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tts_server.engines.batched import checks, ops  # noqa: E402
from tts_server.engines.batched.engine import BatchedEngine  # noqa: E402
from tts_server.engines.contract import Admission, SamplingConfig, StepPlan  # noqa: E402


def main() -> None:
    light = "--light" in sys.argv
    if light:  # the same kernels run in the step itself; only their warm-up launches go
        BatchedEngine._warm_admissions = lambda self: None
        ops.warm_up = lambda device: None
    layers = (28, 5)
    if "--layers" in sys.argv:
        layers = tuple(int(x) for x in sys.argv[sys.argv.index("--layers") + 1].split(","))
    step = 7
    if "--spp" in sys.argv:
        from tts_server.engines.batched import tk_attention

        spp = int(sys.argv[sys.argv.index("--spp") + 1])
        tk_attention.SPP_BY_B = ((1 << 30, spp, 2 if spp > 1 else 1),)
        tk_attention.STRIDE_BY_B = ((1 << 30, 0),)  # SPP runs, not the strided walk
        step = 40
    weights = checks.random_weights("cuda", layers=layers)
    engine = BatchedEngine(weights, max_streams=8, max_positions=512, use_graphs=False)
    print("engine ready", flush=True)
    h = weights.talker.config.hidden_size
    admit = tuple(Admission(i, checks.random_prompt(i, 12 + step * i, h), SamplingConfig(seed=i))
                  for i in range(8))
    out = engine.run(StepPlan(decode=tuple(range(8)), admit=admit))
    torch.cuda.synchronize()
    assert not out.failed and len(out.frames) == 8 and all(f.error is None for f in out.frames), out
    if not light:
        out = engine.run(StepPlan(decode=tuple(range(8)), admit=()))  # a step without admissions
        torch.cuda.synchronize()
        assert len(out.frames) == 8 and all(f.error is None for f in out.frames), out
    print(f"sanitize step ok: B = 8, layers {layers}, codes", [f.codes[:4].tolist() for f in out.frames[:2]])


if __name__ == "__main__":
    main()
