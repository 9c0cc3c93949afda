#!/usr/bin/env bash
# Gated delta rule on the GPU machine: the GPU test subset, then the benchmark table.
#
#   OUT=/path/to/results bash benchmarks/run_gdn_gpu.sh [extra bench_gdn.py args]
#
# Run from the repository root. FLA is taken from a carried wheel in .whl/ when present (fla_core-*.whl,
# einops-*.whl); FlashQLA from .fqla/site.tar.xz when present (flash-qla with tilelang, apache-tvm-ffi, z3-solver
# and torch-c-dlpack-ext unpacked into one folder and packed with xz: the wheels exceed what a call can carry),
# with TileLang's kernel cache in $TILELANG_CACHE_DIR (default /tmp/tilelang-cache; .fqla/tilelang-cache.tgz
# is unpacked into it when present, and the cache is packed into $OUT/tilelang-cache.tgz at the end, so that a
# later machine need not compile the same shapes again). Writes gdn_tests.log, gdn_bench.log and gdn.json
# under $OUT.
set -uo pipefail
# the GDN GPU tests run in GDN_TEST_WORKERS pytest-xdist processes (below)
workers=${GDN_TEST_WORKERS:-4}
if ! [[ $workers =~ ^[0-9]+$ ]]; then
    echo "run_gdn_gpu.sh: GDN_TEST_WORKERS='$workers'; allowed: a whole number (0: no pytest-xdist)" >&2
    exit 2
fi
OUT=${OUT:-./deltafuse-out}
mkdir -p "$OUT"
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/fla_core-*.whl $(ls .whl/einops-*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
if [[ -f .fqla/site.tar.xz ]]; then
    mkdir -p /tmp/fqla && tar xJf .fqla/site.tar.xz -C /tmp/fqla && export PYTHONPATH=${PYTHONPATH:-}:/tmp/fqla/site
    mkdir -p "$TILELANG_CACHE_DIR"
    [[ -f .fqla/tilelang-cache.tgz ]] && tar xzf .fqla/tilelang-cache.tgz -C "$TILELANG_CACHE_DIR"
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gdn_gpu.txt"
# the tests in $workers pytest-xdist processes on the one GPU (GDN_TEST_WORKERS, default 4; 0: one process): each
# releases its cached memory after every GPU test (tests/conftest.py), and the float64 oracle keeps a 4,097-token
# case's graph small (checkpointed segments), so that workers do not run each other out of memory
xdist=()
(( 10#$workers > 0 )) && xdist=(-n "$workers")
# Some cases run their float64 oracle on the CPU (test_gdn_fla_options.py's bf16 case: 2 x 300 tokens, D = 128). With
# every worker's torch using all the cores, those cases never finished within a call's limit (sessions 21 and 22);
# with the cores shared out (2 threads each for 6 workers on 16 cores) all three passed. OMP_NUM_THREADS, when set,
# is kept.
if (( 10#$workers > 0 )) && [[ -z ${OMP_NUM_THREADS:-} ]]; then
    cores=$(nproc)
    export OMP_NUM_THREADS=$(( cores / 10#$workers > 0 ? cores / 10#$workers : 1 ))
fi
python3 -m pytest tests/ops/test_gdn_triton.py tests/ops/test_gdn_segments.py tests/ops/test_gdn_fla_options.py \
    tests/ops/test_gdn_recurrent_gates.py tests/ops/test_gdn_recurrent_decode.py \
    -m gpu -v -rfE --tb=short "${xdist[@]}" 2>&1 | tee "$OUT/gdn_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/bench_gdn.py --out "$OUT/gdn.json" "$@" 2>&1 | tee "$OUT/gdn_bench.log"
bench_rc=${PIPESTATUS[0]}
if [[ -d $TILELANG_CACHE_DIR ]] && [[ -n $(ls -A "$TILELANG_CACHE_DIR" 2>/dev/null) ]]; then
    tar czf "$OUT/tilelang-cache.tgz" -C "$TILELANG_CACHE_DIR" .
fi
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
