#!/usr/bin/env bash
# Side-by-side timing of kernel build variants on a CUDA machine, in one call (issue 3 tuning).
#   VARIANTS="cur:;trace:-DQMK_TRACE=1"   name:DEFS pairs, ';'-separated (a name containing "trace"
#     gets the per-phase trace analysis instead of timings). QMK_TRACE is the kernel's one build
#     switch; to time a change to the code, put the edited tree (or the unchanged one) in BASE.
#   BASE=".base .other"  optional: copies of other trees (their csrc/, scripts/, tts_server/) whose
#                  kernels are built and timed by their own bench_kernel.py in the same call, for a
#                  same-run baseline across ABI changes
#   MODEL=synthetic|random   FRAMES=16 (teacher-forced check per variant; 0 = none)   CTX=100 (talker
#   context of the timings)   LIBS="a.so b.so"  already-built libraries of the same ABI to time beside
#   the variants (e.g. an older tree's csrc built with its own make)
# Logs and JSON land in $OUT. Wheels (qwen-tts, transformers 4.57.3, ...) may be carried in .whl/.
source "$(dirname "$0")/gpu_env.sh"
SM90="-gencode arch=compute_90a,code=sm_90a"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"
MODEL=${MODEL:-synthetic}
if [ "$MODEL" = synthetic ] && ! $PY -c "import sys; sys.path.insert(0, 'scripts'); import bench_kernel as b; \
b.stub_audio_modules(); import tts_server.model.synthetic" >"$OUT/import.log" 2>&1; then
  echo "synthetic model unavailable here (see import.log): using --model random"
  MODEL=random
fi

libs=()
IFS=';' read -ra specs <<<"${VARIANTS:-cur:}"
for spec in "${specs[@]}"; do
  name=${spec%%:*}
  defs=${spec#*:}
  if make -C csrc LIB="build/$name.so" DEFS="$defs" ARCHS="$SM90" >"$OUT/build_$name.log" 2>&1; then
    grep -E "spill" "$OUT/build_$name.log" | tail -1 | sed "s/^/$name: /"
    libs+=("csrc/build/$name.so")
  else
    echo "build $name failed"; tail -20 "$OUT/build_$name.log"
  fi
done

for base in ${BASE:-}; do
  [ -d "$base/csrc" ] || continue
  tag=$(basename "$base" | tr -d .)
  (cd "$base" && make -C csrc LIB=build/base.so ARCHS="$SM90" >"$OUT/build_$tag.log" 2>&1 &&
    timeout "${BASE_TIMEOUT:-150}" $PY scripts/bench_kernel.py --model "$MODEL" --variants csrc/build/base.so \
      --variant-frames "${BASE_FRAMES:-0}" --out "$OUT/$tag" >"$OUT/$tag.log" 2>&1)
  echo "$tag rc=$? :: $(grep -E '^base ' "$OUT/$tag.log" | tail -1 | cut -c1-500)"
done

for lib in ${LIBS:-}; do [ -f "$lib" ] && libs+=("$lib"); done
if [ ${#libs[@]} -gt 0 ]; then
  list=$(IFS=,; echo "${libs[*]}")
  timeout "${RUN_TIMEOUT:-360}" $PY scripts/bench_kernel.py --model "$MODEL" --variants "$list" \
    --variant-frames "${FRAMES:-16}" --variant-ctx "${CTX:-100}" --out "$OUT" >"$OUT/variants.log" 2>&1
  echo "variants rc=$?"
  grep -vE "^\s*$" "$OUT/variants.log" | grep -vE "^frame 0 rel err" | tail -60
fi
