#!/usr/bin/env bash
# Nsight Compute profile of one megakernel frame on a CUDA machine (the --sanitize-frame run: random
# weights, context 20, sampled): warp-stall sampling per SASS instruction of a -lineinfo build,
# attributed to CUDA source lines through nvdisasm's line table (scripts/profile_lines.py), plus the
# warp-state, scheduler and memory sections. The report, the CSVs and the SASS land in $OUT.
#   DEFS="-DQMK_..."   build switches (default: none)   TOP=45   lines to print
source "$(dirname "$0")/gpu_env.sh"

make -C csrc LIB=build/prof.so DEFS="${DEFS:-}" ARCHS="-gencode arch=compute_90a,code=sm_90a" \
  NVCCFLAGS="-O3 -std=c++17 -Xcompiler -fPIC -Xptxas -v --expt-relaxed-constexpr -lineinfo" >"$OUT/build.log" 2>&1 \
  || { tail -20 "$OUT/build.log"; exit 1; }
export QMK_LIB=$ROOT/csrc/build/prof.so

timeout "${NCU_TIMEOUT:-420}" ncu --target-processes all --kernel-name qmk_frame_kernel --launch-count 1 \
  --section WarpStateStats --section SourceCounters --section SchedulerStats --section MemoryWorkloadAnalysis \
  --import-source yes -f -o "$OUT/frame" $PY scripts/bench_kernel.py --sanitize-frame >"$OUT/ncu.log" 2>&1
echo "ncu rc=$? ($(tail -1 "$OUT/ncu.log"))"

ncu -i "$OUT/frame.ncu-rep" --page details --csv >"$OUT/details.csv" 2>/dev/null
ncu -i "$OUT/frame.ncu-rep" --page source --csv --print-source sass >"$OUT/source_sass.csv" 2>"$OUT/source.err"
# SASS address -> source line of this build (nvdisasm's line table), to attribute the samples.
tmp=$(mktemp -d)
(cd "$tmp" && cuobjdump -xelf all "$ROOT/csrc/build/prof.so" >/dev/null 2>&1)
cubin=$(ls "$tmp"/*sm_90a*.cubin 2>/dev/null | head -1)
nvdisasm -c -g "$cubin" >"$tmp/prof.sass" 2>/dev/null
gzip -c "$tmp/prof.sass" >"$OUT/prof.sass.gz"
rm -f "$OUT/build.log"
$PY scripts/profile_lines.py "$OUT" "$tmp/prof.sass" "${TOP:-45}"
