#!/usr/bin/env bash
# Set up and run the whole CPU test suite: everything on the newest transformers, then the model, training
# and bench tests again on transformers 5.9.0 (the older modeling design), then packed batches on 5.2.0 (the
# oldest supported: decoder layers that do not pass their keywords to the GDN layer) and 5.14.1 (the last
# release of the older design). Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
bash scripts/setup.sh .venv-tf59 "transformers==5.9.0" .venv
bash scripts/setup.sh .venv-tf52 "transformers==5.2.0" .venv
bash scripts/setup.sh .venv-tf514 "transformers==5.14.1" .venv

echo "== tests, newest transformers =="
.venv/bin/python -m pytest -q -p no:cacheprovider tests
echo "== model, training and bench tests, transformers 5.9.0 (the multi-process peer runs only above) =="
.venv-tf59/bin/python -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/integrations tests/test_verify.py tests/test_auto.py tests/train tests/bench
for venv in .venv-tf52 .venv-tf514; do
  echo "== packed batches, transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)') =="
  for model in tiny tiny-moe tiny-next; do
    "$venv/bin/python" -m deltafuse verify --model "$model" --packed
  done
  "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/integrations/test_packed.py tests/integrations/test_packing_route.py
done
