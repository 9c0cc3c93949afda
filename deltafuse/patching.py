"""Public patching API: ``apply``, ``revert`` and ``patched``.

``apply()`` routes the hot ops of the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next modeling modules of the installed
transformers to deltafuse's ops (which pick the implementation per call: the fastest one that is correct on
the tensors' device). ``apply(model)`` additionally re-binds what that model's layers cached at
construction (old transformers design) and accepts the model behind any usual wrapper (PEFT, DDP/FSDP,
accelerate, or an object holding it at ``.model`` / ``.module`` / ``.base_model`` / ``get_base_model()``).

Switches (None = take the environment, see ``deltafuse.config``): ``gdn`` routes the gated delta rule and
the causal conv1d of the GDN layers and keeps packed sequences apart; ``fused_ops`` routes the zero-centred
and gated RMSNorms, the partial RoPE, the SwiGLU MLPs and the causal-LM loss (fused linear cross-entropy:
with labels and gradients on, the output has ``logits=None``; pass ``deltafuse_logits=True`` to the model
call, or call it without gradients, to get logits from the stock loss path); ``moe`` registers deltafuse's
experts function in transformers' experts interface as ``"deltafuse"`` and serves with it every experts
module whose config selects a torch implementation (eager, grouped_mm, batched_mm). ``backend`` forces one
backend for every op ('auto' = DELTAFUSE_BACKEND).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from deltafuse import backends
from deltafuse.config import load_settings, resolve
from deltafuse.integrations.transformers import PATCHER, PatchReport

__all__ = ["apply", "revert", "patched", "PatchReport", "UnsupportedModelError", "find_model"]

_WRAPPER_ATTRIBUTES = ("get_base_model", "module", "base_model", "model")
_lock = threading.RLock()
_saved_override: list = []  # backend override in effect before the first apply (restored by revert)


class UnsupportedModelError(ValueError):
    """``apply(model)`` was given an object holding no Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model."""


def _transformers_version() -> str | None:
    try:
        import transformers

        return transformers.__version__
    except Exception:
        return None


def _supported_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if PATCHER.owns(type(m))]


def find_model(obj) -> torch.nn.Module:
    """The torch module holding a supported model, looking through wrappers breadth-first.

    An ``nn.Module`` whose submodules include a supported family's layers is returned as is (PEFT, DDP and
    FSDP wrappers hold the model as a submodule); otherwise ``get_base_model()``, ``.module``, ``.base_model``
    and ``.model`` are followed. Raises ``UnsupportedModelError`` naming every type walked.
    """
    walked: list[str] = []
    seen: set[int] = set()
    queue = [("model", obj)]
    while queue:
        path, current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        walked.append(f"{path}: {type(current).__module__}.{type(current).__qualname__}")
        if isinstance(current, torch.nn.Module) and _supported_modules(current):
            return current
        for name in _WRAPPER_ATTRIBUTES:
            try:
                child = getattr(current, name)
                if name == "get_base_model":
                    if not callable(child):
                        continue
                    child = child()
                    name = "get_base_model()"
            except Exception:  # wrappers may raise anything from properties; it only means "not here"
                continue
            if child is not None and not isinstance(child, (str, bytes, int, float, bool)):
                queue.append((f"{path}.{name}", child))
    families = ", ".join(f"{m.family} ({m.module})" for m in PATCHER.maps)
    raise UnsupportedModelError(
        f"apply(model=...) found no supported model in the object given (type "
        f"{type(obj).__module__}.{type(obj).__qualname__}). Supported: models built from {families}. "
        f"Walked (through {', '.join(_WRAPPER_ATTRIBUTES)}): " + "; ".join(walked))


def apply(model=None, *, gdn: bool | None = None, fused_ops: bool | None = None, moe: bool | None = None,
          backend: str = "auto") -> PatchReport:
    """Route the supported families' hot ops to deltafuse; returns what was patched (see ``PatchReport``).

    Applying again changes nothing (rows show "already applied"). ``revert()`` undoes everything.
    """
    # resolve() checks every argument (the switches are bools or None, backend one of BACKENDS)
    forced = None if backend == "auto" else backend
    settings = resolve(load_settings(), gdn=gdn, fused_ops=fused_ops, moe=moe, backend=forced)
    backend = "auto" if forced is None else settings.backend
    target = None
    if model is not None:
        target = find_model(model)
    shown = {"patch": settings.patch, "gdn": settings.gdn, "fused_ops": settings.fused_ops, "moe": settings.moe,
             "backend": backend if backend != "auto" else f"auto (DELTAFUSE_BACKEND={settings.backend})"}
    model_name = None if target is None else f"{type(target).__module__}.{type(target).__qualname__}"
    report = PatchReport(enabled=settings.patch, settings=shown, transformers=_transformers_version(),
                         model=model_name)
    if not settings.patch:
        report.notes.append("DELTAFUSE_PATCH is off: no module, class or instance attribute was changed")
        return report
    with _lock:
        if not _saved_override:
            _saved_override.append(backends.backend_override())
        backends.set_backend_override(None if backend == "auto" else backend)
        switches = {"gdn": settings.gdn, "fused_ops": settings.fused_ops, "moe": settings.moe}
        families, rows, notes = PATCHER.apply(switches, target)
    report.families = families
    report.rows = rows
    report.notes.extend(notes)
    for switch, what in (("fused_ops", "norm, RoPE, SwiGLU and loss"), ("moe", "experts")):
        if not getattr(settings, switch):
            report.notes.append(f"{switch} is off: the {what} routes were not applied")
    if not settings.gdn:
        report.notes.append("gdn is off: the GDN and causal conv1d routes were not applied")
    elif target is None and any(str(d).startswith("old design") for d in families.values()):
        report.notes.append("no model given: models built from now on use deltafuse; a model built before "
                            "keeps the ops its layers cached (this transformers caches them per layer): call "
                            "apply(model) to re-bind them")
    return report


def revert() -> PatchReport:
    """Restore every object ``apply`` replaced (module globals, class attributes, instance attributes)."""
    with _lock:
        rows = PATCHER.revert()
        if _saved_override:
            backends.set_backend_override(_saved_override.pop())
    return _revert_report(rows)


def _revert_report(rows) -> PatchReport:
    report = PatchReport(enabled=True, settings={}, transformers=_transformers_version(), action="revert")
    report.rows = rows
    if not rows:
        report.notes.append("nothing was patched")
    return report


@contextlib.contextmanager
def patched(model=None, **kwargs):
    """``with patched(model) as report:`` applies deltafuse and, on exit, reverts what this block applied
    (rows already applied before the block stay) and restores the backend override."""
    with _lock:
        mark = PATCHER.mark()
        override = backends.backend_override()
        first = not _saved_override
    report = apply(model, **kwargs)
    try:
        yield report
    finally:
        with _lock:
            PATCHER.revert(since=mark)
            backends.set_backend_override(override)
            if first and _saved_override and not PATCHER.has_records():
                _saved_override.clear()
