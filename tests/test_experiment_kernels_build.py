"""The CUDA files of issue 16's GPU experiments (scripts/*.cu: the bit checks, the products
prototype, the streaming microbenchmark, the talker attention's twin and its persistent version;
csrc/small/ is built by `make -C csrc check`) build for sm_90 here, so that a change that breaks
one is caught in CI and not on a device call. What they measure runs on a GPU
(scripts/gpu_dot_bits.py, gpu_products_engine.py, gpu_stream_bw.py, gpu_attn_twin.py,
gpu_attn_persist.py); this checks only that nvcc accepts them without a warning."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dot_bits.cu", "products_engine.cu", "stream_bw.cu", "attn_split_twin.cu", "attn_persist.cu")
# products_engine.cu with its row phases (scripts/gpu_cp_layer_engine.py links it with the Triton
# kernels' PTX): relocatable device code, the row_call left for the link
ROW_PHASES = ["-rdc=true", "-DROW_PHASES"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name, flags", [(s, []) for s in SOURCES]
                         + [("products_engine.cu", ROW_PHASES)])
def test_experiment_kernel_builds_for_sm90_without_warnings(name, flags, tmp_path):
    res = subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-Xcompiler", "-fPIC", *flags, "-c", "-o",
                          str(tmp_path / "k.o"), str(ROOT / "scripts" / name)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-3000:]
