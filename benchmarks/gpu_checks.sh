#!/usr/bin/env bash
# Everything that needs a GPU, in one call of a lent machine (about 5 minutes for all parts):
#   tests     tests/gpu: the engine's fault-injection tests with the model on CUDA, the one-sync
#             promise checked by CUDA's sync debug mode, pinned-loader batches, CUDA snapshots;
#   overhead  the overhead benchmark on the GPU: the four models and two GPU-sized ones,
#             against the plain loop and the plain loop that reads its loss every step;
#   bf16      the same under bf16 autocast, for the models whose steps bf16 shortens;
#   suite     the whole suite under the machine's own torch (another version than CI's).
# Logs go to $OUT (the device tool brings them back). Each part has its own time limit, so one
# that hangs cannot take the others' time.
#
# Run: bash benchmarks/gpu_checks.sh [PART...]   (all parts by default; PY=python3 and
# OUT=/tmp/gpu_out by default; a package the machine lacks, omegaconf, can be put in .gpu_site/,
# which goes first on PYTHONPATH.)
set -u
OUT=${OUT:-/tmp/gpu_out}
PY=${PY:-python3}
PARTS=${*:-tests overhead bf16 suite}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu_site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GOMP_SPINCOUNT=10000
BENCH="$PY benchmarks/fit_overhead.py --device cuda --threads 8 --block 5"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee "$OUT/env.txt"
$PY -c "import sys, torch, safetensors, omegaconf; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'safetensors', safetensors.__version__, 'omegaconf', omegaconf.__version__)" \
    2>&1 | tee -a "$OUT/env.txt"

for part in $PARTS; do
    echo "== $part"
    case $part in
    tests) timeout 150 $PY -m pytest tests/gpu -rfEs -p no:cacheprovider >"$OUT/gpu_tests.txt" 2>&1
        echo "rc $?"; tail -15 "$OUT/gpu_tests.txt" ;;
    overhead) timeout 200 $BENCH --seconds 8 --models mlp,transformer,cnn,tiny,mlp_wide,transformer_big \
        --variants plain_item,eager_skip,lazy,guard,guard_lazy,isnan_hooks,anomaly >"$OUT/overhead_cuda.md" 2>&1
        echo "rc $?"; cat "$OUT/overhead_cuda.md" ;;
    bf16) timeout 90 $BENCH --seconds 8 --amp bfloat16 --models transformer,mlp_wide,transformer_big \
        --variants plain_item,guard,guard_lazy >"$OUT/overhead_cuda_bf16.md" 2>&1
        echo "rc $?"; cat "$OUT/overhead_cuda_bf16.md" ;;
    suite) timeout 120 $PY -m pytest -n 12 -rfE -p no:cacheprovider >"$OUT/suite.txt" 2>&1
        echo "rc $?"; tail -15 "$OUT/suite.txt" ;;
    *) echo "unknown part $part (tests, overhead, bf16, suite)"; exit 2 ;;
    esac
done
