"""Every module of the package can be the first import of a fresh interpreter (no import cycle, no import-time
wiring that needs another module imported first)."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import deltafuse

ROOT = Path(deltafuse.__file__).resolve().parent.parent


def _modules() -> list[str]:
    # ``__main__`` modules are ``python -m`` entry points: importing one runs its command
    return [m.name for m in pkgutil.walk_packages(deltafuse.__path__, "deltafuse.")
            if m.name.rsplit(".", 1)[-1] != "__main__"]


def _import_alone(module: str) -> tuple[str, int, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    return module, proc.returncode, proc.stderr.strip()[-1500:]


@pytest.mark.slow  # ~110 interpreters, each importing torch (minutes on 2 cores); CI's newest run includes it
def test_every_module_imports_first_in_a_fresh_interpreter():
    modules = _modules()
    assert {"deltafuse.integrations.trl", "deltafuse.integrations.peft", "deltafuse.integrations.trainer",
            "deltafuse.maps", "deltafuse.patching"} <= set(modules)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(_import_alone, modules))
    failed = {m: err.splitlines()[-1] if err else f"exit {rc}" for m, rc, err in results if rc != 0}
    assert not failed, "\n".join(f"{m}: {e}" for m, e in failed.items())


def test_the_integration_packages_wire_nothing_on_import():
    """Their ``__init__`` files import no submodule: the maps are assembled in ``deltafuse.maps``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys, deltafuse.integrations.transformers; "
            "print(sorted(m for m in sys.modules if m.startswith('deltafuse.integrations')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         check=True).stdout
    assert out.strip() == "['deltafuse.integrations', 'deltafuse.integrations.transformers']"
