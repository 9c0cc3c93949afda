#!/usr/bin/env bash
# Set up and run the whole CPU test suite: everything on the newest transformers, then the model, training
# and bench tests again on transformers 5.9.0 (the older modeling design). Triton kernels run under
# TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
bash scripts/setup.sh .venv-tf59 "transformers==5.9.0"

echo "== tests, newest transformers =="
.venv/bin/python -m pytest -q -p no:cacheprovider tests
echo "== model, training and bench tests, transformers 5.9.0 =="
.venv-tf59/bin/python -m pytest -q -p no:cacheprovider \
  tests/integrations tests/test_verify.py tests/test_auto.py tests/train tests/bench
