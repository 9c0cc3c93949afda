"""``deltafuse verify``: stock transformers vs deltafuse on the same model and batch.

* ``args``: the command line (arguments, help, exit codes) and its entry, light to import (no torch);
* ``core``: the runs and the checks (``verify_model``, ``run``; see its docstring for what is compared);
* ``report``: one comparison per tensor and the text / JSON report;
* ``float64``: the mode in which a float64 copy of a stock model computes in float64 throughout.

``python -m deltafuse.verify ARGS`` is ``deltafuse verify ARGS``. The names of ``core`` (``verify_model``,
``DTYPES``, ...) are reachable from here too; ``core`` is imported on first use, so importing this package
stays light.
"""

from __future__ import annotations


def main(argv=None) -> int:
    """`python -m deltafuse.verify ARGS`: the same as `deltafuse verify ARGS`."""
    from deltafuse.cli import command_main

    return command_main("verify", argv)


def __getattr__(name: str):
    import importlib

    # submodules: the import system loads them
    if name.startswith("__") or name in ("args", "core", "report", "float64"):
        raise AttributeError(f"module 'deltafuse.verify' has no attribute {name!r}")
    core = importlib.import_module("deltafuse.verify.core")

    try:
        return getattr(core, name)
    except AttributeError:
        raise AttributeError(f"module 'deltafuse.verify' has no attribute {name!r}") from None
