#!/usr/bin/env bash
# Set up a virtual environment for deltafuse (default .venv) and install the package with its extras.
#   scripts/setup.sh [VENV_DIR] [TRANSFORMERS_SPEC] [BASE_VENV]
# BASE_VENV: an existing environment set up by this script whose packages the new one reuses (a path file puts
# them after its own), so only what differs (transformers at TRANSFORMERS_SPEC and what that version needs) is
# installed into VENV; the test script builds its older-transformers environments this way.
# The venv sees the system's site-packages, so a torch the user already has is reused, never replaced.
# With no torch present, torch==2.13.0 is installed (a CPU build on CPU-only machines that carry it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
TRANSFORMERS_SPEC="${2:-}"
BASE_VENV="${3:-}"
PY="${PYTHON:-python3}"

if [ -n "$BASE_VENV" ] && [ ! -x "$BASE_VENV/bin/python" ]; then
    echo "setup: BASE_VENV=$BASE_VENV is not a virtual environment (no $BASE_VENV/bin/python); allowed: a directory" \
         "set up by scripts/setup.sh" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
if [ -n "$BASE_VENV" ]; then
  purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
  purelib "$BASE_VENV/bin/python" > "$(purelib "$VPY")/_deltafuse_base_venv.pth"
fi
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch found; installing torch==2.13.0"
  pip_q "torch==2.13.0"
else
  echo "setup: using the installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
fi
# An environment on top of BASE_VENV sees the base's packages, among them the hub-kernels package `kernels` that
# transformers 5.25+ requires; an older transformers breaks on a `kernels` newer than its own `kernels` extra names
# (5.9.0 with kernels 0.19: ValueError at import), so it gets the one that extra names, ahead of the base's.
if [ -n "$BASE_VENV" ] && [ -n "$TRANSFORMERS_SPEC" ]; then
  TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC/#transformers/transformers[kernels]}"
fi
# one resolver run, so no extra can move transformers off the requested version
pip_q -e ".[test,train]" $TRANSFORMERS_SPEC
"$VPY" -c "import torch, transformers; print('setup: torch', torch.__version__, '| transformers', transformers.__version__)"
