"""Every module of the package can be the first import of a fresh interpreter (no import cycle, no import-time
wiring that needs another module imported first)."""

from __future__ import annotations

import json
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


# One interpreter per batch of modules imports torch and transformers (not deltafuse modules), then forks a child per
# module that imports that module first of any deltafuse module: what a fresh interpreter would do for the package, for
# a fork instead of a ~1 s torch import per module. The child's traceback comes back on a pipe.
_FORK_EACH = r"""
import json, os, sys, traceback
import torch, transformers  # noqa: F401 - preloaded (not deltafuse): each child starts without any deltafuse module
assert not any(m == "deltafuse" or m.startswith("deltafuse.") for m in sys.modules), "deltafuse imported by preload"
failed = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            err = ""
        except BaseException:
            err = traceback.format_exc()[-1500:] or "failed"
        os.write(w, err.encode())
        os._exit(1 if err else 0)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code or err:
        failed[name] = err or f"exit {code}"
print(json.dumps(failed))
"""


def _import_each(modules: list[str]) -> dict[str, str]:
    """{module: its traceback} for every module of ``modules`` that fails as the first deltafuse import."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _FORK_EACH, *modules], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~150 forked imports after one torch import per batch (about 30 s on 2 cores)
def test_every_module_imports_first_in_a_fresh_interpreter():
    modules = _modules()
    assert {"deltafuse.integrations.trl", "deltafuse.integrations.peft", "deltafuse.integrations.trainer",
            "deltafuse.maps", "deltafuse.patching"} <= set(modules)
    # the harness reports a module that fails to import (here one that does not exist) and runs every other
    probe = "deltafuse._no_such_module"
    batches = [modules[i::2] + [probe] for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_import_each, batches))
    for got in results:
        assert "ModuleNotFoundError: No module named 'deltafuse._no_such_module'" in got.pop(probe, "")
    failed = {m: err.strip().splitlines()[-1] for got in results for m, err in got.items()}
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
