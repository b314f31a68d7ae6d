#!/usr/bin/env python
"""A Triton kernel's compiled PTX as a device function that CUDA code can call (issue 16: a
persistent kernel that computes exactly what the Triton graphs compute, without a hand-written
twin per kernel: it runs the very instructions Triton generated).

The `.entry` becomes a `.visible .func` with six parameters more, which the caller passes in place
of what a launch provided: the program ids (x, y, z), the thread's index among the kernel's
threads, a shared-memory window (32-bit shared address, for Triton's `global_smem`) and a named
barrier id (Triton's `bar.sync 0` becomes `bar.sync id, <its thread count>`, so that only the
warps running this program wait for each other). Debug sections and `.loc` lines are dropped, the
kernel's launch bounds and PDL's `griddepcontrol` too (the caller orders its phases); pointer
parameters become `.b64`, 32-bit ones `.b32`. Refused (with the line): what a device function
cannot replace this way (`%nctaid`, cluster registers, a 2D or 3D thread index).

    python scripts/ptx_func.py kernel.ptx NAME out.ptx   # prints the CUDA declaration to use

The caller: whole warps (lane = thread index % 32, as the PTX assumes), `threads` of them per
program (`.reqntid`), the shared window at least the kernel's shared-memory size.
"""

from __future__ import annotations

import re
import sys

EXTRA = ("pid_x", "pid_y", "pid_z", "tid", "smem", "bar")


def convert(ptx: str, name: str) -> tuple[str, str, int]:
    """-> (the device function's PTX, its CUDA declaration, threads per program)."""
    body = ptx.split("\t.section\t.debug", 1)[0].split(".section\t.debug", 1)[0]
    if re.search(r"\.visible \.entry \w+\(", body) is None:
        raise ValueError("no .entry in this PTX")
    threads = int(re.search(r"\.reqntid (\d+)", body).group(1))
    # PDL's waits and triggers order launches; inside a persistent kernel the caller orders phases
    body = "\n".join(ln for ln in body.splitlines() if "griddepcontrol" not in ln)
    for bad in ("%nctaid", "%clusterid", "%cluster_ctaid", "%ctaid.w"):
        if bad in body:
            line = next(ln for ln in body.splitlines() if bad in ln)
            raise ValueError(f"{bad} cannot be replaced in a device function: {line.strip()}")
    out, params, decl, renames = [], [], [], []  # renames: (the kernel's parameter name, the function's)
    in_params = inserted = False
    for line in body.splitlines():
        s = line.strip()
        if re.match(r"\.(loc|file)\s", s) or s.startswith("//") or s.startswith(".extern .shared"):
            continue
        if s.startswith((".reqntid", ".maxntid", ".maxnreg", ".minnctapersm")):
            continue
        if s.startswith(".visible .entry"):
            out.append(f".visible .func {name}(")
            in_params = True
            continue
        if in_params:
            pm = re.match(r"\.param \.(\w+)(?: \.ptr \.global \.align \d+)? (\w+),?$", s)
            if pm:
                kind = "b64" if pm.group(1) in ("u64", "s64", "b64") else "b32"
                renames.append((pm.group(2), f"{name}_p{len(params)}"))
                params.append(f"\t.param .{kind} {name}_p{len(params)}")
                decl.append("const void*" if kind == "b64" else "unsigned")
                continue
            if s != ")":
                raise ValueError(f"a kernel parameter this does not know: {s}")
            params += [f"\t.param .b32 {name}_{e}" for e in EXTRA]
            out += [",\n".join(params), ")"]
            in_params = False
            continue
        if s == "{" and not inserted:  # the body's first line: the launch state from the parameters
            out += [line, "\t.reg .b32 \t%fx<6>;"]
            out += [f"\tld.param.b32 \t%fx{i}, [{name}_{e}];" for i, e in enumerate(EXTRA)]
            inserted = True
            continue
        line = (line.replace("%ctaid.x", "%fx0").replace("%ctaid.y", "%fx1").replace("%ctaid.z", "%fx2")
                .replace("%tid.x", "%fx3").replace("global_smem", "%fx4"))
        if "%tid.y" in line or "%tid.z" in line:
            raise ValueError(f"a 2D or 3D thread index cannot be replaced: {s}")
        line = re.sub(r"\bbar\.sync \t?0;", f"bar.sync \t%fx5, {threads};", line)
        line = re.sub(r"\bbarrier\.sync(\.aligned)? \t?0;", f"barrier.sync\\1 \t%fx5, {threads};", line)
        if re.search(r"\bbar(rier)?\.(sync|arrive|red)\b", line) and "%fx5" not in line:
            raise ValueError(f"a barrier this cannot rename: {s}")
        out.append(line)
    text = "\n".join(out)
    for a, b in sorted(renames, key=lambda r: -len(r[0])):  # the body reads the kernel's names
        text = re.sub(rf"\b{a}\b", b, text)
    text = text.replace("_$_str", f"{name}_str")  # Triton's assert strings: one set per function
    args = ", ".join(decl + ["unsigned"] * len(EXTRA))
    return text + "\n", f'extern "C" __device__ void {name}({args});', threads


def runtime_args(compiled) -> list[tuple[int, str]]:
    """A Triton CompiledKernel's launch arguments that stay parameters of its PTX (not constexpr,
    not specialised into a constant), in order: [(index among the launch's arguments, type)]; the
    PTX may add trailing pointers of its own (scratch buffers), which a caller passes null."""
    consts = getattr(compiled.src, "constants", {}) or {}
    return [(i, ty) for i, ty in enumerate(compiled.src.signature.values()) if ty != "constexpr" and (i,) not in consts]


def main() -> int:
    src, name, dst = sys.argv[1:4]
    text, cdecl, threads = convert(open(src).read(), name)
    open(dst, "w").write(text)
    print(f"{cdecl}  // {threads} threads a program")
    return 0


if __name__ == "__main__":
    sys.exit(main())
