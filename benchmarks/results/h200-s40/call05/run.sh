source scripts/gpu_env.sh
for v in A B C; do (cd .variants/v$v && nvcc -O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -shared -o ../v$v.so cp_layers.cu) || echo "build v$v failed"; done
timeout 100 $PY scripts/gpu_small_timeline.py --out $OUT --sizes 1 --modes off 2>&1 | grep -E "^\{|small kernel" | cut -c1-400
for v in A B C C A B; do
  QSK_LIB=$PWD/.variants/v$v.so timeout 100 $PY scripts/gpu_small_timeline.py --out $OUT --sizes 1 --modes on 2>&1 | grep -E "^\{|small kernel" | cut -c1-330 | sed "s/^/v$v /"
done
