"""Generate the checked-in gRPC stubs under tts_client/pb, or check they are current (--check).

The proto lives at protos/tts/v1/tts.proto (package tts.v1). protoc is given the virtual
import root `tts_client/pb`, so the stubs import each other as `tts_client.pb.tts.v1` and no
import rewriting is needed. grpcio-tools is pinned to 1.81.1: newer releases emit protobuf-7
gencode, which does not load beside pipecat-ai 1.14 (protobuf < 7).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = "tts_client/pb"
PROTOS = ["tts/v1/tts.proto"]
MAX_GENCODE_MAJOR = 6  # protobuf runtime is pinned < 7


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"--proto_path={OUT_PACKAGE}={PROTO_ROOT}",
        f"--proto_path={Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ] + [str(PROTO_ROOT / p) for p in PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    pkg_root = out_dir / OUT_PACKAGE
    files = sorted(p for p in pkg_root.rglob("*") if p.is_file())
    for pkg in {f.parent for f in files}:
        while pkg != pkg_root:
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text('"""Generated gRPC stubs; do not edit (scripts/gen_protos.py)."""\n')
            pkg = pkg.parent
    return sorted(p for p in pkg_root.rglob("*") if p.is_file())


def check_gencode_version(files: list[Path]) -> None:
    for f in files:
        m = re.search(r"Protobuf Python Version: (\d+)\.", f.read_text())
        if m and int(m.group(1)) > MAX_GENCODE_MAJOR:
            raise SystemExit(f"{f.name}: gencode for protobuf {m.group(1)}.x; runtime is pinned < 7")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if checked-in stubs differ")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        files = generate(tmp_dir)
        check_gencode_version(files)
        gen_root = tmp_dir / OUT_PACKAGE
        dest_root = ROOT / OUT_PACKAGE
        rel = sorted(str(f.relative_to(gen_root)) for f in files)
        if args.check:
            stale = [r for r in rel if not (dest_root / r).exists()
                     or not filecmp.cmp(gen_root / r, dest_root / r, shallow=False)]
            if stale:
                print("stale generated stubs (run `make protos`):", *stale, sep="\n  ")
                return 1
            print(f"generated stubs are current ({len(rel)} files)")
            return 0
        for r in rel:
            (dest_root / r).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(gen_root / r, dest_root / r)
        print(f"wrote {len(rel)} files under {OUT_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
