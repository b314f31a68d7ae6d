"""scripts/ptx_func.py (issue 16's persistent kernel running the frame's Triton kernels as device
functions): a real Triton kernel of the frame, compiled for sm_90 without a GPU (the compile-only
driver of scripts/triton_sm90_check.py, in a child process), becomes a `.func` whose launch state
is all parameters, and ptxas assembles it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PTXAS = shutil.which("ptxas") or (str(Path(shutil.which("nvcc")).parent / "ptxas") if shutil.which("nvcc") else None)

COMPILE = """
import os, sys, torch
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, {root!r}); sys.path.insert(0, {scripts!r})
import triton_sm90_check
from triton.runtime import driver
driver.set_active(triton_sm90_check._Sm90Driver())
from tts_server.engines.batched import tk_glue
m, d = 3, 1024
k = tk_glue._add_rms_kernel.warmup(torch.zeros(m, d), torch.zeros(4, m, d), torch.zeros(d), torch.zeros(m, d),
                                   torch.zeros(m, d, dtype=torch.float16), 1e-6, m * d, D=d, DP2=d, PARTS=4,
                                   GDC=True, grid=(m,))
open({out!r}, "w").write(k.asm["ptx"])
"""


def _ptx_func():
    spec = importlib.util.spec_from_file_location("ptx_func", ROOT / "scripts" / "ptx_func.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_frame_kernel_becomes_a_device_function_that_assembles(tmp_path):
    src = tmp_path / "add_rms.ptx"
    code = COMPILE.format(root=str(ROOT), scripts=str(ROOT / "scripts"), out=str(src))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=300)
    ptx = src.read_text()
    assert ".entry _add_rms_kernel" in ptx and "%ctaid.x" in ptx and "bar.sync" in ptx and "griddepcontrol" in ptx
    text, decl, threads = _ptx_func().convert(ptx, "add_rms_fn")
    assert threads == 128
    assert ".visible .func add_rms_fn(" in text and ".entry" not in text
    for gone in ("%ctaid", "%tid", "global_smem", "griddepcontrol", ".reqntid", "bar.sync \t0;"):
        assert gone not in text, gone
    assert "bar.sync \t%fx5, 128;" in text
    # the caller's view: 7 arguments of the kernel, Triton's 2 scratch pointers, then the six
    assert decl.startswith('extern "C" __device__ void add_rms_fn(') and decl.count("unsigned") == 2 + 6
    if PTXAS is None:
        pytest.skip("no ptxas on this machine: the conversion was checked, not its assembly")
    out = tmp_path / "add_rms_fn.ptx"
    out.write_text(text)
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-c", "-o", str(tmp_path / "f.o"), str(out)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr


def test_what_a_device_function_cannot_take_is_refused():
    ptx_func = _ptx_func()
    kernel = ("//\n.version 8.7\n.target sm_90a\n.address_size 64\n.visible .entry k(\n"
              "\t.param .u64 .ptr .global .align 1 k_param_0\n)\n.reqntid 128\n{\n\t.reg .b32 \t%r<3>;\n"
              "\tmov.u32 \t%r1, %nctaid.x;\n\tret;\n}\n")
    with pytest.raises(ValueError, match="%nctaid"):
        ptx_func.convert(kernel, "f")
    plain = kernel.replace("%nctaid.x", "%ctaid.x")
    assert "%fx0" in ptx_func.convert(plain, "f")[0]
    with pytest.raises(ValueError, match="parameter"):
        ptx_func.convert(plain.replace(".param .u64 .ptr .global .align 1 k_param_0", ".param .v2 .f32 k_param_0"),
                         "f")
