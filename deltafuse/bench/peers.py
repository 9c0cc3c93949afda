"""Peer runs of `deltafuse bench e2e`: the same training with deltafuse OFF and FLA and/or Liger-Kernel on.

Every run of the benchmark except the deltafuse one starts here (``python -m deltafuse.bench.peers``), which
sets the process up before transformers is imported and then runs ``deltafuse train`` in it:

- FLA is kept out of every run that does not name it (the stock OFF run and the Liger-only run): transformers
  picks FLA for the GDN layers by itself whenever ``import fla`` works (5.15+: the decorated module functions
  at import; 5.2-5.14: ``is_flash_linear_attention_available()``), so ``sys.modules["fla"]`` is set to None,
  which makes ``import fla`` fail and ``importlib.util.find_spec("fla")`` answer None. Those runs use
  transformers' torch fallback, as on a machine without FLA.
- FLA runs wrap FLA's ``chunk_gated_delta_rule`` (every module attribute that holds it) in a call counter
  before transformers takes it; ``--fla-lift-hopper-guard`` sets ``fla.ops.common.chunk_o.IS_NVIDIA_HOPPER``
  to False where FLA's guard is active (Hopper, Triton >= 3.4, < 3.7.1), for timing only.
- Liger runs apply Liger-Kernel's patches for the three model families (``apply_liger_kernel_to_qwen3_5``,
  ``_qwen3_5_moe``, ``_qwen3_next``: RMSNorm, SwiGLU MLPs, fused linear cross-entropy) before the model is
  built, and count the calls of its fused linear cross-entropy.

Each run writes a JSON report (the calls counted, versions, whether FLA was visible, and the error when the
run stopped) that the benchmark turns into one row: the numbers, or why there are none ("refused: ...",
"not installed: ...", "not available on cpu: ...", "peer not used: ..."). A peer whose code was never
called is never reported under its name.

This module imports only the standard library at the top: nothing may import transformers before the set-up.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback

PEERS = ("fla", "liger", "fla+liger")
LABELS = {"off": "OFF (stock)", "on": "ON (deltafuse)", "fla": "FLA", "liger": "Liger", "fla+liger": "FLA+Liger"}
FLA_OP = "chunk_gated_delta_rule"
LIGER_OP = "liger_fused_linear_cross_entropy"
LIGER_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
GUARD_NOTE = "FLA's Hopper guard lifted for timing; its backward is known to be wrong on this stack"

COUNTS: dict[str, int] = {}


# --- names ---------------------------------------------------------------------------------------------
def parse_peers(text: str) -> list[str]:
    """``--peers`` value: ``none`` or a comma-separated subset of fla, liger, fla+liger (order kept)."""
    import argparse

    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in PEERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed; allowed: none, or a comma-separated list of {', '.join(PEERS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a peer twice; name each of {', '.join(PEERS)} once")
    return names


def parts(run: str) -> tuple[str, ...]:
    """The peers a run enables: () for off/on, ('fla',), ('liger',), ('fla', 'liger')."""
    return tuple(run.split("+")) if run in PEERS else ()


def run_dir_name(run: str) -> str:
    return run.replace("+", "-")


# --- set-up inside the child ---------------------------------------------------------------------------
def block_fla() -> None:
    """Make FLA invisible to this process: ``import fla`` fails and ``find_spec('fla')`` is None."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    sys.modules["fla"] = None  # type: ignore[assignment]


def counted(fn, key: str):
    COUNTS.setdefault(key, 0)

    @functools.wraps(fn)  # keeps the signature: transformers filters keyword arguments by it
    def wrapper(*args, **kwargs):
        COUNTS[key] += 1
        return fn(*args, **kwargs)

    return wrapper


def _rebind_everywhere(prefix: str, name: str, original, replacement) -> list[str]:
    """Replace ``original`` by ``replacement`` in every loaded ``prefix``/``prefix.*`` module that holds it."""
    where = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        if getattr(mod, name, None) is original:
            setattr(mod, name, replacement)
            where.append(mod_name)
    return sorted(where)


def install_fla(lift_guard: bool) -> dict:
    import fla
    import fla.ops.gated_delta_rule as gdr

    info = {"version": getattr(fla, "__version__", "unknown"), "path": os.path.dirname(fla.__file__),
            "hopper_guard_active": False, "hopper_guard_lifted": False}
    original = getattr(gdr, FLA_OP)
    info["wrapped_in"] = _rebind_everywhere("fla", FLA_OP, original, counted(original, FLA_OP))
    try:
        import fla.ops.common.chunk_o as chunk_o
    except ImportError:
        chunk_o = None
    if chunk_o is not None:
        info["hopper_guard_active"] = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
                                           and getattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
                                           and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", False))
        if lift_guard and info["hopper_guard_active"]:
            chunk_o.IS_NVIDIA_HOPPER = False
            info["hopper_guard_lifted"] = True
    return info


def install_liger() -> dict:
    import importlib
    import importlib.metadata

    import liger_kernel.transformers as lt
    import liger_kernel.transformers.functional as lf

    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get("liger_kernel"), "__version__", "unknown")
    info = {"version": version, "path": os.path.dirname(lt.__file__), "families": [], "missing": []}
    original = getattr(lf, LIGER_OP)
    info["wrapped_in"] = _rebind_everywhere("liger_kernel", LIGER_OP, original, counted(original, LIGER_OP))
    for family in LIGER_FAMILIES:
        apply = getattr(lt, f"apply_liger_kernel_to_{family}", None)
        if apply is None:
            info["missing"].append(family)
            continue
        try:
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:  # this transformers has no such family: nothing to patch
            continue
        apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True)
        info["families"].append(family)
    return info


def _package_dirs(*names: str) -> list[str]:
    import importlib.util

    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs += [os.path.abspath(p) + os.sep for p in spec.submodule_search_locations]
    return dirs


def classify_failure(exc: BaseException, run: str, device: str) -> tuple[str, str]:
    """(status, reason) of a run that stopped with ``exc``."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text if len(text) <= 400 else text[:397] + "..."
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    peers = parts(run)
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in ("fla", "liger_kernel"):
        return "not installed", f"not installed: {what}"
    frames = traceback.extract_tb(exc.__traceback__)
    last = os.path.abspath(frames[-1].filename) if frames else ""
    fla_dirs = _package_dirs("fla") if "fla" in peers else []
    if last and any(last.startswith(d) for d in fla_dirs) and "hopper" in text.lower():
        return "refused", f"refused: {text}"
    peer_dirs = _package_dirs(*[{"fla": "fla", "liger": "liger_kernel"}[p] for p in peers], "triton")
    if device == "cpu" and last and any(last.startswith(d) for d in peer_dirs):
        return "not available", f"not available on cpu: {what}"
    return "failed", f"failed: {what}"


# --- the child's entry point ---------------------------------------------------------------------------
def child_main(argv: list[str] | None = None) -> int:
    """``python -m deltafuse.bench.peers --run RUN --report PATH [--fla-lift-hopper-guard] -- TRAIN ARGS``."""
    import argparse
    import importlib.util

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("python -m deltafuse.bench.peers: error: '--' and the `deltafuse train` arguments are required",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m deltafuse.bench.peers",
                                     description="One run of `deltafuse bench e2e` with deltafuse off.")
    parser.add_argument("--run", required=True, choices=("off",) + PEERS)
    parser.add_argument("--report", required=True, metavar="JSON")
    parser.add_argument("--fla-lift-hopper-guard", action="store_true")
    opts = parser.parse_args(argv[:cut])
    train_argv = argv[cut + 1:]
    peers = parts(opts.run)
    report: dict = {"run": opts.run, "peers": list(peers), "status": "ran", "reason": "", "calls": {}}
    device, rc = "unknown", 1
    try:
        if "fla" not in peers:
            block_fla()
        report["fla_visible"] = importlib.util.find_spec("fla") is not None
        if "fla" in peers:
            report["fla"] = install_fla(opts.fla_lift_hopper_guard)
        if "liger" in peers:
            report["liger"] = install_liger()
        from deltafuse.train import setup, trainer
        from deltafuse.train.cli import main as train_main

        trainer.STOCK_TORCH_FALLBACK = False  # the peer's own route, as installed, or its failure as the row

        device = setup.training_device()
        report["device"] = device
        rc = train_main(train_argv)
        if rc != 0:
            report["status"], report["reason"] = "failed", f"failed: `deltafuse train` exited with {rc}"
    except Exception as exc:  # a peer that cannot run is a row with the reason, not a crash of the benchmark
        report["status"], report["reason"] = classify_failure(exc, opts.run, device)
        report["traceback"] = traceback.format_exc()
        print(report["traceback"], file=sys.stderr)
        print(f"deltafuse bench e2e: the {LABELS[opts.run]} run stopped: {report['reason']}", file=sys.stderr)
        rc = 1
    finally:
        report["calls"] = dict(COUNTS)
        if int(os.environ.get("RANK", "0")) == 0:
            os.makedirs(os.path.dirname(os.path.abspath(opts.report)), exist_ok=True)
            with open(opts.report, "w") as fh:
                json.dump(report, fh, indent=2, default=str)
    return rc


# --- the row of a run ----------------------------------------------------------------------------------
def peer_status(run: str, report: dict | None, rc: int, steps: int, max_steps: int) -> tuple[str, str]:
    """(status, reason) of a peer run from its report: "ran" only when every peer's code was really called."""
    if report is None:
        return "failed", f"failed: exit code {rc} and no report (the run's output is above)"
    if report.get("status") != "ran":
        return report["status"], report["reason"]
    if rc != 0:
        return "failed", f"failed: exit code {rc} (the run's output is above)"
    if steps != max_steps:
        return "failed", f"failed: recorded {steps} of {max_steps} steps"
    calls = report.get("calls", {})
    unused = []
    if "fla" in parts(run) and not calls.get(FLA_OP):
        unused.append(f"FLA's {FLA_OP} was called 0 times (transformers did not pick FLA)")
    if "liger" in parts(run) and not calls.get(LIGER_OP):
        fams = ", ".join(report.get("liger", {}).get("families", [])) or "none"
        unused.append(f"Liger's fused linear cross-entropy was called 0 times (families patched: {fams})")
    if unused:
        return "peer not used", "peer not used: " + "; ".join(unused) + "; its numbers would be stock's"
    return "ran", ""


def ran_note(run: str, report: dict) -> str:
    """What a ran peer row says next to its numbers: calls counted, versions, a lifted guard."""
    calls = report.get("calls", {})
    bits = []
    if "fla" in parts(run):
        bits.append(f"FLA {report.get('fla', {}).get('version', '?')}: {FLA_OP} x{calls.get(FLA_OP, 0)}")
    if "liger" in parts(run):
        bits.append(f"Liger {report.get('liger', {}).get('version', '?')}: fused linear CE x{calls.get(LIGER_OP, 0)}")
    note = "ran (" + "; ".join(bits) + ")"
    if report.get("fla", {}).get("hopper_guard_lifted"):
        note += "; " + GUARD_NOTE
    return note


if __name__ == "__main__":
    from deltafuse.exits import guarded  # standard library only: Ctrl-C / SIGTERM here are one line, 130 / 143

    raise SystemExit(guarded("deltafuse bench e2e", child_main))
