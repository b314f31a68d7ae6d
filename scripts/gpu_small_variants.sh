#!/usr/bin/env bash
# Variants of the small-batch kernel (csrc/small/cp_layers.cu) side by side in one device call:
# VARIANTS names source files (HEAD: csrc/small/cp_layers.cu; others e.g. .variants/vB/cp_layers.cu
# beside a copy of common.cuh), each run through gpu_cp_layer_engine.py at MS rows (bits against
# the Triton launches, µs a layer inside the kernel, thread 0's marks), ROUNDS times alternating.
# NCU: variants to profile once more under Nsight Compute (warp states, the SASS with its stall
# samples), where the machine's runtime lets ncu read the counters. FRAMES: variants whose library
# then serves a B = 1 frame (gpu_small_timeline.py, graph replays and the profiler's view), with
# one run of the graphs alone first. TESTS: GPU test files, run with the library of TEST_VARIANT
# (default HEAD: csrc's build) serving them (QSK_LIB), e.g. tests/test_small_kernel.py: the engine's
# start-up check and a stream alone through the kernel against B = 2 and 3 through the graphs.
#   VARIANTS="HEAD .variants/vB/cp_layers.cu" NCU=HEAD FRAMES="HEAD .variants/vB/cp_layers.cu" \
#     TESTS=tests/test_small_kernel.py TEST_VARIANT=.variants/vB/cp_layers.cu bash scripts/gpu_small_variants.sh
source "$(dirname "$0")/gpu_env.sh"
VARIANTS=${VARIANTS:-HEAD}
src_of() { [ "$1" = HEAD ] && echo "$ROOT/csrc/small/cp_layers.cu" || echo "$ROOT/$1"; }
name_of() { [ "$1" = HEAD ] && echo HEAD || basename "$(dirname "$1")"; }
for r in $(seq "${ROUNDS:-1}"); do
  for v in $VARIANTS; do
    n=$(name_of "$v")
    mkdir -p "$OUT/$n-$r"
    QSK_SRC=$(src_of "$v") timeout "${LAYERS_TIMEOUT:-200}" $PY scripts/gpu_cp_layer_engine.py --only-ll --ms ${MS:-1} \
      --out "$OUT/$n-$r" > "$OUT/layers-$n-$r.log" 2>&1 || echo "$n: rc $?"
    echo "== $n round $r"; grep -E "bits DIFFER|LL marks|end skew|serving kernel:|Error|error" "$OUT/layers-$n-$r.log" | cut -c1-260
  done
done
for v in ${NCU:-}; do
  n=$(name_of "$v")
  QSK_SRC=$(src_of "$v") QSK_NVCCFLAGS=-lineinfo timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none \
    -k regex:cp_layers_kernel --launch-skip 12 --launch-count 1 --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section LaunchStats -o "$OUT/ncu-$n" -f \
    $PY scripts/gpu_cp_layer_engine.py --only-ll --ms 1 --out /tmp > "$OUT/ncu-$n.log" 2>&1
  echo "ncu $n rc $?"; grep -E "==PROF==|==ERROR==|==WARNING==" "$OUT/ncu-$n.log" | head -5
  if [ -f "$OUT/ncu-$n.ncu-rep" ]; then
    ncu -i "$OUT/ncu-$n.ncu-rep" --page details > "$OUT/ncu-$n-details.txt" 2>&1
    ncu -i "$OUT/ncu-$n.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$n-sass.csv" 2>&1
    grep -iE "stall|warp cycles|issued|eligible" "$OUT/ncu-$n-details.txt" | head -30
  fi
done
if [ -n "${FRAMES:-}" ]; then
  mkdir -p "$OUT/libs"
  timeout 150 $PY scripts/gpu_small_timeline.py --out "$OUT" --sizes 1 --modes off 2>&1 | grep -E "^\{|small kernel" \
    | cut -c1-400 | sed "s/^/graphs /"
  for v in $FRAMES; do
    n=$(name_of "$v")
    nvcc -O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -shared -o "$OUT/libs/$n.so" \
      "$(src_of "$v")" || { echo "build $n failed"; continue; }
    QSK_LIB=$OUT/libs/$n.so timeout 150 $PY scripts/gpu_small_timeline.py --out "$OUT" --sizes 1 --modes on 2>&1 \
      | grep -E "^\{|small kernel" | cut -c1-330 | sed "s/^/$n /"
  done
  rm -rf "$OUT/libs"
fi
if [ -n "${TESTS:-}" ]; then
  tv=${TEST_VARIANT:-HEAD}
  nvcc -O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -shared -o /tmp/qsk-test.so \
    "$(src_of "$tv")" || echo "build $(name_of "$tv") failed"
  QSK_LIB=/tmp/qsk-test.so PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} timeout "${TEST_TIMEOUT:-300}" $PY -m pytest \
    -q -m gpu $TESTS -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests ($(name_of "$tv")) rc $?"; tail -6 "$OUT/tests.log"
fi
save_triton_cache
# everything in one archive (the device tool brings back a few files only)
(cd "$OUT" && tar czf /tmp/results.tgz --exclude='*.ncu-rep' --exclude=triton-cache.tgz . \
  && find . -mindepth 1 -maxdepth 1 ! -name '*.ncu-rep' ! -name triton-cache.tgz -exec rm -rf {} + \
  && mv /tmp/results.tgz .)
