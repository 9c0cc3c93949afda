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


# The package's layers, lowest first (README "How it is built"): a module may import its own layer and the ones
# below, never one above. ``deltafuse.integrations.trainer`` (the Trainer callback, which applies and reverts) is
# an application on ``patching``, not a map, so it sits with train/ and verify/.
LAYERS = (
    ("deltafuse.argtypes", "deltafuse.model_names", "deltafuse.config", "deltafuse.exits"),
    ("deltafuse.backends", "deltafuse"),  # the package root imports nothing at import (lazy __getattr__)
    ("deltafuse.ops",),
    ("deltafuse.integrations",),
    ("deltafuse.maps", "deltafuse.patching", "deltafuse.models", "deltafuse.info", "deltafuse.auto"),
    ("deltafuse.integrations.trainer", "deltafuse.verify", "deltafuse.train"),
    ("deltafuse.bench",),
    ("deltafuse.cli", "deltafuse.__main__"),
)


def _layer(module: str) -> int:
    best, length = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            hit = module == name or (name != "deltafuse" and module.startswith(name + "."))
            if hit and len(name) > length:
                best, length = i, len(name)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def _imports(path: Path, module: str) -> list[tuple[str, str | None]]:
    """(imported deltafuse module, the function it is imported in or None at module level) for every import."""
    import ast

    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                found.extend((a.name, func) for a in child.names if a.name.split(".")[0] == "deltafuse")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and \
                    child.module.split(".")[0] == "deltafuse":
                for a in child.names:  # ``from deltafuse.x import y``: y itself when it is a module
                    sub = f"{child.module}.{a.name}"
                    rel = Path(*sub.split("."))
                    is_module = (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()
                    found.append((sub if is_module else child.module, func))
            visit(child, inner)

    visit(ast.parse(path.read_text()), None)
    return found


def test_no_module_imports_a_layer_above_its_own():
    """The import graph has no arrow up. Two exceptions, both entry points: a ``main`` function, the ``python -m
    deltafuse.X`` entry of a command, hands its arguments to the top-level ``deltafuse.cli`` (which checks them as
    ``deltafuse X`` does); the package root's ``__getattr__`` is the lazy public face (``deltafuse.apply``,
    ``deltafuse.info``), importing what is asked for on first use."""
    up = []
    for path in sorted((ROOT / "deltafuse").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for target, func in _imports(path, module):
            if (func == "main" and target == "deltafuse.cli") or (module == "deltafuse" and func == "__getattr__"):
                continue
            if _layer(target) > _layer(module):
                up.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not up, "\n".join(up)
