#!/usr/bin/env bash
# Set up and run the whole CPU test suite: everything on the newest transformers, then the model, training
# and bench tests again on transformers 5.9.0 (the older modeling design), then packed batches and context
# parallelism on 5.2.0 (the oldest supported: decoder layers that do not pass their keywords to the GDN layer) and
# 5.14.1 (the last release of the older design). Triton kernels run under TRITON_INTERPRET=1. The older-transformers runs go
# alongside the newest one, and after them the newest transformers' slowest interpreted kernel tests (kernel_tests),
# so that the two legs take about as long on CI's 2 cores (the newest run alone took 22 min, the older ones 11). Their
# output is printed after the newest run's; the script fails if any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# one base seed for the random inputs of every pytest run below (tests/helpers.py input_seed): fresh each time unless
# TEST_SEED names one, printed first so that a failure's inputs can be drawn again
seed=${TEST_SEED:-$(( (RANDOM << 16 | RANDOM) % 2147483648 ))}
if ! [[ $seed =~ ^[0-9]+$ ]] || (( 10#$seed > 2147483647 )); then
  echo "scripts/test.sh: TEST_SEED='$seed'; allowed: a whole number from 0 to 2147483647" >&2
  exit 2
fi
seed=$((10#$seed))
echo "== test seed $seed (TEST_SEED=$seed bash scripts/test.sh, or pytest --test-seed $seed, repeats these inputs) =="
bash scripts/setup.sh .venv
bash scripts/setup.sh .venv-tf59 "transformers==5.9.0" .venv
bash scripts/setup.sh .venv-tf52 "transformers==5.2.0" .venv
bash scripts/setup.sh .venv-tf514 "transformers==5.14.1" .venv

older_transformers() {
  echo "== model, training and bench tests, transformers 5.9.0 (the multi-process peer runs only in the newest) =="
  .venv-tf59/bin/python -m pytest -q -p no:cacheprovider --test-seed "$seed" --basetemp "$work/tf59" -m "not slow" \
    tests/integrations tests/test_verify.py tests/test_auto.py tests/train tests/bench
  for venv in .venv-tf52 .venv-tf514; do
    echo "== packed batches and context parallelism, transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)') =="
    for model in tiny tiny-moe tiny-next; do
      "$venv/bin/python" -m deltafuse verify --model "$model" --packed
    done
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --test-seed "$seed" --basetemp "$work/$venv" \
      tests/integrations/test_packed.py tests/integrations/test_packing_route.py \
      tests/integrations/test_context_parallel.py
  done
}

kernel_tests=(tests/ops/test_conv1d_triton.py tests/ops/test_gdn_triton.py tests/ops/test_gdn_fla_options.py
              tests/ops/test_gdn_keep_states.py)
newest_kernels() {
  echo "== interpreted kernel tests, newest transformers =="
  .venv/bin/python -m pytest -q -p no:cacheprovider --test-seed "$seed" --basetemp "$work/kernels" "${kernel_tests[@]}"
}

# each run its own pytest temporary directory (concurrent sessions must not clean up each other's)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
older_log="$work/older.log"
( set -e; older_transformers; newest_kernels ) > "$older_log" 2>&1 &
older_pid=$!

echo "== tests, newest transformers (the kernel tests of kernel_tests run beside it) =="
newest_rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --test-seed "$seed" --basetemp "$work/newest" tests \
  "${kernel_tests[@]/#/--ignore=}" || newest_rc=$?
older_rc=0
wait "$older_pid" || older_rc=$?
cat "$older_log"
echo "== newest transformers: exit $newest_rc; older transformers and the kernel tests: exit $older_rc =="
[ "$newest_rc" -eq 0 ] && [ "$older_rc" -eq 0 ]
