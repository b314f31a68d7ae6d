#!/usr/bin/env python
"""Compile, for sm_90 and without a GPU, every Triton kernel specialisation the GPU serving path
launches: the batched engine's (admissions through the row prefill, frames at several batch
sizes with and without PDL, every tuned GEMM tile), the codec step's (B = 1, 8, 64, bf16 and
fp32) and a step's prompt rows (model/embed_rows.py). The real host code runs on CPU tensors at the full-size 0.6B shapes; each launch is
compiled to a cubin instead of run (the values are garbage, integer tensors zeros; the shapes,
dtypes, constexprs and integer specialisations are the launch's own). A device call is
too dear to find a kernel that does not compile; `make check-kernels` runs this.

    .venv/bin/python scripts/triton_sm90_check.py [--quick] [--dump DIR]

`--dump DIR` also writes each distinct compiled specialisation's PTX and TTGIR, with the launch's
constexprs and argument shapes (`<kernel>-<hash>.ptx / .ttgir / .sig`): what the CUDA twins of
`scripts/dot_bits.cu` are written from. The installed Triton is what compiles; the device's (3.6.0
in sessions 30-37) is the one that matters there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be real @jit functions
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Sm90Driver:
    """What compiling (not launching) asks of the active driver: an H100 as the target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--dump", type=Path, help="write each distinct specialisation's PTX / TTGIR here")
    args = ap.parse_args()
    driver.set_active(_Sm90Driver())
    # every kernel module imported while TRITON_INTERPRET is unset (so JITFunctions) ...
    from tts_server.codec import triton_kernels  # noqa: F401
    from tts_server.engines.batched import pdl, tk_attention, tk_gemm, tk_glue, tk_sample, triton_ops  # noqa: F401
    from tts_server.model import embed_rows

    compiled: dict[str, int] = {}
    failures: list[tuple[str, str]] = []
    real_run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        name = self.fn.__name__
        try:
            kernel = real_run(self, *a, grid=grid, warmup=True, **kw)
        except Exception as e:  # noqa: BLE001 - reported with the kernel's name
            failures.append((name, f"{type(e).__name__}: {e}"[:2000]))
            return None
        compiled[name] = compiled.get(name, 0) + 1
        if args.dump is not None:
            _dump(args.dump, name, kernel, a, kw)
        for t in list(a) + list(kw.values()):  # integer outputs (codes, indices, flags) as zeros,
            if isinstance(t, torch.Tensor) and not t.is_floating_point():  # valid for host code that reads them
                try:
                    t.zero_()
                except RuntimeError:  # a broadcast view
                    pass
        return kernel

    JITFunction.run = compile_only
    # ... then the ops take their Triton path on CPU tensors (ops._use_triton), and PDL is on
    os.environ["TRITON_INTERPRET"] = "1"
    pdl._capable = True
    t0 = time.time()

    def section(name, fn):
        t = time.time()
        before = len(failures)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a host-side error of this harness, not a compile error
            failures.append((f"{name} (host code)", f"{type(e).__name__}: {e}"[:2000]))
        print(f"{name}: {time.time() - t:.0f} s, {len(failures) - before} failures", flush=True)

    sizes = (1, 3, 64) if args.quick else (1, 3, 8, 17, 64, 256)
    section("gemm tiles", lambda: _gemms(tk_gemm))
    section("engine", lambda: _engine(sizes, pdl))
    section("codec", lambda: _codec((1, 64) if args.quick else (1, 8, 64)))
    section("prompt rows", lambda: _prompt_rows(embed_rows))
    os.environ.pop("TRITON_INTERPRET", None)
    print(f"{sum(compiled.values())} launches compiled for sm_90 ({len(compiled)} kernels) in "
          f"{time.time() - t0:.0f} s: {', '.join(sorted(compiled))}")
    seen: dict[tuple[str, str], int] = {}
    for name, err in failures:  # one report per kernel and error
        seen[(name, err)] = seen.get((name, err), 0) + 1
    for (name, err), n in seen.items():
        print(f"FAILED {name} ({n} launches): {err}")
    return 1 if failures else 0


def _dump(folder: Path, name: str, kernel, args, kwargs) -> None:
    """The specialisation's PTX and TTGIR, and what it was launched with, once per distinct PTX."""
    import hashlib

    ptx = kernel.asm["ptx"]
    stem = folder / f"{name}-{hashlib.md5(ptx.encode()).hexdigest()[:8]}"
    if stem.with_suffix(".ptx").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".ptx").write_text(ptx)
    stem.with_suffix(".ttgir").write_text(kernel.asm["ttgir"])
    shapes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else t for t in args]
    consts = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    stem.with_suffix(".sig").write_text(f"{consts!r}\n{shapes!r}\n")


def _gemms(tk_gemm) -> None:
    """Every tuned tile (tk_gemm.warm_up's row counts) for bf16 and fp16 matrices, and the many-row
    path of the prefill; the fp16 ones also in the opt-in sub-piece order (TTS_GEMM_SUB=256)."""
    tk_gemm.warm_up(torch.device("cpu"), (torch.bfloat16, torch.float16))
    for dtype, terms in ((torch.bfloat16, 2), (torch.float16, 0)):
        for (kind, n, k) in tk_gemm.big_m_tiles(terms):
            w = torch.zeros(n, k, dtype=dtype)
            tk_gemm._gemm(torch.zeros(tk_gemm.big_m_min_rows(terms), k), w, w if kind == "swiglu" else None)
    before = os.environ.get("TTS_GEMM_SUB")
    os.environ["TTS_GEMM_SUB"] = "256"
    try:
        tk_gemm.warm_up(torch.device("cpu"), (torch.float16,))
        for (kind, n, k) in tk_gemm.big_m_tiles(0):
            w = torch.zeros(n, k, dtype=torch.float16)
            tk_gemm._gemm(torch.zeros(tk_gemm.big_m_min_rows(0), k), w, w if kind == "swiglu" else None)
    finally:
        os.environ.pop("TTS_GEMM_SUB")
        if before is not None:
            os.environ["TTS_GEMM_SUB"] = before


def _prompt_rows(embed_rows) -> None:
    """A step's prompt rows (PromptBuilder.materialise on a GPU): bf16 tables (the served model's)
    and fp32 ones, at the 0.6B hidden size."""
    for dtype in (torch.bfloat16, torch.float32):
        text, codec = torch.zeros(64, 1024, dtype=dtype), torch.zeros(32, 1024, dtype=dtype)
        embed_rows.embed_rows(text, codec, torch.zeros(3 * 7 + 4, dtype=torch.long), 7, 4)


def _engine(sizes, pdl) -> None:
    from dataclasses import replace

    from tts_server.api import SamplingConfig
    from tts_server.engines.batched import checks, graphs
    from tts_server.engines.batched.engine import BatchedEngine
    from tts_server.engines.contract import Admission, StepPlan

    w = checks.random_weights("cpu")
    for dtype in (torch.float16, torch.bfloat16):  # the GEMM matrices: CUDA's default, and bf16
        # (the fp16 engine with the draws' noise made at the frame's start for frames of up to 4
        # streams, the bf16 one with it off, so that both settings' kernels compile)
        before = os.environ.get("TTS_FRAME_NOISE_ROWS")
        os.environ["TTS_FRAME_NOISE_ROWS"] = "4" if dtype == torch.float16 else "0"
        eng = BatchedEngine(w, max_streams=max(sizes), max_positions=512, gemm_dtype=dtype)
        os.environ.pop("TTS_FRAME_NOISE_ROWS")
        if before is not None:
            os.environ["TTS_FRAME_NOISE_ROWS"] = before
        h = eng.p.talker.cfg.hidden_size
        # admissions: one short prompt, then three of mixed lengths (row prefill + first draws), the
        # last two with a shared prefix (its copies between scratch blocks)
        for lens in ((20,), (9, 45, 130)):
            adm = tuple(Admission(i, replace(checks.random_prompt(i, n, h), shared=(("voice",), 8) if i else None),
                                  SamplingConfig(seed=i, do_sample=i % 2 == 0))
                        for i, n in enumerate(lens))
            eng.run(StepPlan(admit=adm))
            for a in adm:
                eng.release(a.slot)
        # frames: each batch size, eagerly, with PDL as the frame graphs of small buckets have it
        for b in sizes:
            rows = torch.full((b,), eng.state.scratch, dtype=torch.long)
            for on in {False, b <= graphs.PDL_MAX_ROWS}:
                with pdl.scope(on):
                    eng.frame.predict(rows)
                    eng.frame.advance(rows)
        del eng


def _codec(sizes) -> None:
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as qm

    from tts_server.codec import kernels
    from tts_server.codec.batched import BatchedCodecDecoder
    from tts_server.model.synthetic import codec_config

    kernels._sms[torch.device("cpu")] = 132  # an H100's SMs: the small batches' split-K paths too

    dec = qm.Qwen3TTSTokenizerV2Model(codec_config("full")).eval().decoder
    for dtype in (torch.bfloat16, torch.float32):
        bd = BatchedCodecDecoder(dec, max(sizes), dtype=dtype, use_graphs=False)
        bd._triton = True  # the GPU path's kernels (compiled, not run)
        with torch.inference_mode():
            for b in sizes:
                idx = torch.arange(b)
                bd._forward(idx, torch.zeros(b, bd.num_quantizers, dtype=torch.long))


if __name__ == "__main__":
    sys.exit(main())
