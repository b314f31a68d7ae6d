"""Attribute an Nsight Compute SASS source page (warp-stall samples, excess shared wavefronts) to
CUDA source lines through nvdisasm's line table (scripts/profile_kernel.sh)."""

from __future__ import annotations

import collections
import csv
import re
import sys


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(out: str, sass: str, top: int) -> None:
    rows = list(csv.reader(open(f"{out}/details.csv")))
    if rows:
        hdr = rows[0]
        for r in rows[1:]:
            d = dict(zip(hdr, r))
            if d.get("Metric Name"):
                print(f"{d.get('Section Name', '')[:24]:24s} {d['Metric Name'][:50]:50s} "
                      f"{d.get('Metric Value', '')} {d.get('Metric Unit', '')}")
    where, fn, cur = {}, None, None  # address in qmk_frame_kernel -> (file, line)
    for ln in open(sass):
        if ln.startswith("//---") and ".text." in ln:
            fn = ln.split(".text.")[1].split()[0]
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            cur = (m.group(1).split("/csrc/")[-1], int(m.group(2)))
        m = re.search(r"/\*([0-9a-f]{4,})\*/", ln)
        if m and fn and "qmk_frame_kernel" in fn and cur:
            where[int(m.group(1), 16)] = cur
    src = list(csv.reader(open(f"{out}/source_sass.csv")))
    h = next((i for i, r in enumerate(src) if any("Address" in c for c in r)), None)
    if h is None:
        print("no SASS page header:", src[:3])
        return
    cols = src[h]
    print("sass columns:", cols)
    ai = next(i for i, c in enumerate(cols) if "Address" in c)
    si = next((i for i, c in enumerate(cols) if "Warp Stall Sampling (All" in c), None)
    ni = next((i for i, c in enumerate(cols) if "Warp Stall Sampling (Not" in c), None)
    wi = next((i for i, c in enumerate(cols) if "Shared Excessive" in c), None)
    agg: dict = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    base = None  # the page lists absolute addresses: offsets from the kernel's first instruction
    for r in src[h + 1:]:
        if len(r) <= ai:
            continue
        try:
            a = int(r[ai], 16)
        except ValueError:
            continue
        base = a if base is None else base
        v = agg[where.get(a - base, ("?", 0))]
        for j, c in enumerate((si, ni, wi)):
            if c is not None and c < len(r):
                v[j] += num(r[c])
    text: dict = {}

    def line_text(f: str, n: int) -> str:
        if f not in text:
            try:
                text[f] = open(f"csrc/{f}").read().split("\n")
            except OSError:
                text[f] = []
        t = text[f]
        return t[n - 1].strip()[:80] if 0 < n <= len(t) else ""

    tot = sum(v[0] for v in agg.values()) or 1.0
    totw = sum(v[2] for v in agg.values()) or 1.0
    print(f"warp-stall samples {tot:.0f}; source lines by share (all samples, not-issued):")
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{100 * v[0] / tot:5.1f}% {100 * v[1] / tot:5.1f}%  {k[0]}:{k[1]}  {line_text(*k)}")
    print(f"excess shared wavefronts {totw:.0f}; lines by share:")
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1][2])[:12]:
        print(f"{100 * v[2] / totw:5.1f}%  {k[0]}:{k[1]}  {line_text(*k)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
