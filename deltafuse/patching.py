"""Public patching API: ``apply``, ``revert`` and ``patched``.

``apply()`` routes the hot ops of the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next modeling modules of the installed
transformers to deltafuse's ops (which pick the implementation per call: the fastest one that is correct on
the tensors' device). ``apply(model)`` additionally re-binds what that model's layers cached at
construction (old transformers design) and accepts the model behind any usual wrapper (PEFT, DDP/FSDP,
accelerate, or an object holding it at ``.model`` / ``.module`` / ``.base_model`` / ``get_base_model()``).

Switches (None = take the environment, see ``deltafuse.config``): ``gdn`` routes the gated delta rule and
the causal conv1d of the GDN layers and keeps packed sequences apart; ``fused_ops`` routes the zero-centred
and gated RMSNorms, the partial RoPE, the SwiGLU MLPs and the causal-LM loss (fused linear cross-entropy:
with labels and gradients on, the output has ``logits=None``; pass ``skip_logits=False`` (alias
``deltafuse_logits=True``) to the model call, or call it without gradients or with ``return_dict=False``, to
get logits from the stock loss path; ``return_token_accuracy=True`` adds ``token_accuracy``); ``moe`` registers deltafuse's
experts function in transformers' experts interface as ``"deltafuse"`` and serves with it every experts
module whose config selects a torch implementation (eager, grouped_mm, batched_mm). ``backend`` forces one
backend for every op that has it ('auto' = DELTAFUSE_BACKEND); an op without a backend of that name keeps
its automatic choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from deltafuse import backends
from deltafuse.backends.settings import load_settings, resolve
from deltafuse.integrations.transformers.patcher import Ledger, PatchReport, ReportRow
from deltafuse.maps import PATCHER, SWITCH_OPS
from deltafuse.integrations.transformers import context_parallel as _context_parallel

__all__ = ["apply", "revert", "patched", "PatchReport", "UnsupportedModelError", "find_model"]

_WRAPPER_ATTRIBUTES = ("get_base_model", "module", "base_model", "model")


@dataclass(frozen=True)
class _Mark:
    """Where ``Applied`` stood when a ``patched`` block began (what its exit restores)."""

    records: int
    context_parallel: int
    override: str | None
    active: bool


@dataclass
class Applied:
    """What ``apply`` changed in this process, which ``revert`` restores: the one object both work on.

    ``records``: the patcher's ledger of every module global, class attribute, instance attribute and mapping
    key replaced, in order (its lock serialises apply, revert and ``patched`` blocks across threads);
    ``active``: an apply is in effect (since the last revert); ``override_before``: the backend override
    (``apply(backend=...)``) in effect before the first apply of that, which ``revert`` puts back. The modules
    marked for context parallelism are kept (and unmarked) by ``context_parallel`` itself.
    """

    records: Ledger
    active: bool = False
    override_before: str | None = None

    @property
    def lock(self):
        return self.records.lock

    def begin(self, backend: str | None) -> None:
        """Force ``backend`` (None: the environment decides), remembering the override found by the first apply."""
        if not self.active:
            self.override_before = backends.backend_override()
            self.active = True
        backends.set_backend_override(backend)

    def mark(self) -> _Mark:
        return _Mark(self.records.mark(), _context_parallel.mark(), backends.backend_override(), self.active)

    def restore(self, since: _Mark | None = None) -> list[ReportRow]:
        """Undo everything (``since`` None) or what came after ``since``; the rows of the objects put back."""
        if since is None:
            rows = self.records.restore()
            _context_parallel.clear()
            if self.active:
                backends.set_backend_override(self.override_before)
                self.active, self.override_before = False, None
            return rows
        rows = self.records.restore(since.records)
        _context_parallel.clear(since=since.context_parallel)
        if not self.active:
            # a revert during the block (another thread's, or the block's own) put back the override from before
            # every apply: the block's mark is older than that and must not bring a forced backend back
            return rows
        backends.set_backend_override(since.override)
        if not since.active and self.active and not self.records.has_records():
            self.active, self.override_before = False, None  # the block's apply was the only one
        return rows


_STATE = Applied(PATCHER.ledger)


class UnsupportedModelError(TypeError, ValueError):
    """``apply(model)`` was given an object holding no Qwen3.5 / Qwen3.5-MoE / Qwen3-Next model."""


def _transformers_version() -> str | None:
    try:
        import transformers

        return transformers.__version__
    except Exception:
        return None


def _supported_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if PATCHER.owns(type(m))]


_MAX_DEPTH = 6  # wrapper levels followed (PEFT + DDP + accelerate + a user holder is 4)
_MAX_VISITED = 32  # objects looked at in all


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_module(obj) -> bool:
    # by the real type: a Mock(spec=nn.Module) passes isinstance() but is no module
    return issubclass(type(obj), torch.nn.Module)


def find_model(obj) -> torch.nn.Module:
    """The torch module holding a supported model, looking through wrappers breadth-first.

    An ``nn.Module`` whose submodules include a supported family's layers is returned as is (PEFT, DDP and
    FSDP wrappers hold the model as a submodule); otherwise ``get_base_model()``, ``.module``, ``.base_model``
    and ``.model`` are followed, at most 6 levels deep and through at most 32 objects, each object once (by
    identity), so objects that answer every attribute (mocks) or refer to themselves end the search. Only an
    ``nn.Module`` (by its real type) is ever returned. ``None`` is not a model: ``apply(None)`` patches the
    modeling modules only, ``find_model(None)`` raises. Raises ``UnsupportedModelError`` (a TypeError and a
    ValueError) naming the type given and every object walked, with the path that reached it.
    """
    if obj is None:
        raise UnsupportedModelError("find_model(None): no model given; pass the model (or its wrapper), or call "
                                    "apply() without a model to patch the modeling modules only")
    walked: list[str] = []
    seen: set[int] = set()
    keep = []  # objects produced by get_base_model() stay alive, so that their ids are not reused
    queue = [("model", obj, 0)]
    cut = False
    while queue:
        path, current, depth = queue.pop(0)
        if id(current) in seen:
            continue
        if len(seen) >= _MAX_VISITED:
            cut = True
            break
        seen.add(id(current))
        keep.append(current)
        walked.append(f"{path}: {_type_name(current)}")
        if _is_module(current) and _supported_modules(current):
            return current
        if depth >= _MAX_DEPTH:
            cut = cut or not _is_module(current)
            continue
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
            if child is not None and child is not current and not isinstance(child, (str, bytes, int, float, bool)):
                queue.append((f"{path}.{name}", child, depth + 1))
    families = ", ".join(f"{m.family} ({m.module})" for m in PATCHER.maps if m.models)
    shown = walked if len(walked) <= 12 else walked[:12] + [f"... {len(walked) - 12} more"]
    limit = (f" The search stopped at its limit ({_MAX_DEPTH} levels, {_MAX_VISITED} objects): each object "
             f"walked had another one behind it (a mock answers every attribute).") if cut or len(seen) >= _MAX_VISITED else ""
    raise UnsupportedModelError(
        f"apply(model=...) found no supported model in the object given (type {_type_name(obj)}). Supported: "
        f"an nn.Module built from {families}, or a wrapper holding one.{limit} "
        f"Walked (through {', '.join(_WRAPPER_ATTRIBUTES)}): " + "; ".join(shown))


def apply(model=None, *, gdn: bool | None = None, fused_ops: bool | None = None, moe: bool | None = None,
          backend: str = "auto", context_parallel=None) -> PatchReport:
    """Route the supported families' hot ops to deltafuse; returns what was patched (see ``PatchReport``).

    Applying again changes nothing (rows show "already applied"). ``revert()`` undoes everything.
    ``context_parallel``: a ``torch.distributed`` process group over which ``model``'s calls are sharded along
    the sequence (rank r holds tokens [r*T/W, (r+1)*T/W) of every row, with global position_ids); see
    ``deltafuse.integrations.transformers.context_parallel``. Needs the model and the gdn and fused_ops routes;
    adds the ``context_parallel`` rows over them, which pass the calls of models not given here on unchanged.
    """
    if context_parallel is not None:  # a ProcessGroup this process belongs to
        context_parallel = _context_parallel.check_group(context_parallel)
    # resolve() checks every argument (the switches are bools or None, backend a registered name)
    forced = None if backend == "auto" else backend
    settings = resolve(load_settings(), gdn=gdn, fused_ops=fused_ops, moe=moe, backend=forced)
    backend = "auto" if forced is None else settings.backend
    target = None
    if model is not None:
        target = find_model(model)
    if context_parallel is not None:
        if target is None:
            raise ValueError("context_parallel=<group> needs the model: call apply(model, context_parallel=group)")
        off = [name for name in ("patch", "gdn", "fused_ops") if not getattr(settings, name)]
        if off:
            raise ValueError(f"context_parallel=<group> runs inside the gdn and fused_ops routes, but {', '.join(off)} "
                             "is off (argument or DELTAFUSE_* variable); allowed: on")
        _context_parallel.check_model(target)
    shown = {"patch": settings.patch, "gdn": settings.gdn, "fused_ops": settings.fused_ops, "moe": settings.moe,
             "backend": backend if backend != "auto" else f"auto (DELTAFUSE_BACKEND={settings.backend})"}
    if context_parallel is not None:
        import torch.distributed as dist

        shown["context_parallel"] = (f"{dist.get_world_size(context_parallel)} ranks (this one: "
                                     f"{dist.get_rank(context_parallel)})")
    model_name = None if target is None else f"{type(target).__module__}.{type(target).__qualname__}"
    report = PatchReport(enabled=settings.patch, settings=shown, transformers=_transformers_version(),
                         model=model_name)
    if not settings.patch:
        report.notes.append("DELTAFUSE_PATCH is off: no module, class or instance attribute was changed")
        return report
    with _STATE.lock:
        _STATE.begin(None if backend == "auto" else backend)
        # the context-parallel rows (over the gdn and fused_ops ones) only for a context-parallel model
        switches = {"gdn": settings.gdn, "fused_ops": settings.fused_ops, "moe": settings.moe,
                    "context_parallel": context_parallel is not None}
        families, rows, notes = PATCHER.apply(switches, target)
        if context_parallel is not None:
            _context_parallel.register(target, context_parallel)
        report.serving_on, report.serving = _serving(target, switches)
    report.families = families
    report.rows = rows
    report.notes.extend(notes)
    report.titles = {m.family: m.title or m.family for m in PATCHER.maps}
    if target is not None:
        report.model_family = _family_of(target)
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


def _family_of(module: torch.nn.Module) -> str | None:
    names = {m.module: m.family for m in PATCHER.maps if m.models}
    for m in module.modules():
        for cls in type(m).__mro__:
            family = names.get(getattr(cls, "__module__", None))
            if family is not None:
                return family
    return None


def _serving(target, switches: dict) -> tuple[str | None, dict]:
    """(device and dtype described, {switch: {op: implementation}}) for a training call: on the model's first
    floating-point parameter's device and dtype, or without a model on the first accelerator (bf16) else the
    CPU (fp32), as ``deltafuse info`` shows them."""
    from deltafuse.backends import probes
    from deltafuse.backends.registry import CallInfo

    device = dtype = None
    if target is not None:
        param = next((p for p in target.parameters() if p.is_floating_point()), None)
        if param is None or param.device.type == "meta":
            return None, {}
        device, dtype = param.device, param.dtype
    else:
        devices = [d for d in probes.visible_devices() if d.type != "cpu"] or [torch.device("cpu")]
        device = devices[0]
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    call = CallInfo(device, dtype, True)
    forced = backends.current_backend()
    serving: dict = {}
    for switch, ops in SWITCH_OPS.items():
        if not switches.get(switch):
            continue
        for op in ops:
            try:
                decisions = backends.REGISTRY.explain(op, call, forced)
            except KeyError:  # an op this build does not register
                continue
            serving.setdefault(switch, {})[op] = next((d.candidate for d in decisions if d.chosen), "none")
    return f"{device} {str(dtype).replace('torch.', '')}", serving


def revert() -> PatchReport:
    """Restore every object ``apply`` replaced (module globals, class attributes, instance attributes)."""
    with _STATE.lock:
        rows = _STATE.restore()
    return _revert_report(rows)


def _revert_report(rows) -> PatchReport:
    report = PatchReport(enabled=True, settings={}, transformers=_transformers_version(), action="revert",
                         titles={m.family: m.title or m.family for m in PATCHER.maps})
    report.rows = rows
    if not rows:
        report.notes.append("nothing was patched")
    return report


@contextlib.contextmanager
def patched(model=None, **kwargs):
    """``with patched(model) as report:`` applies deltafuse and, on exit, reverts what this block applied
    (rows already applied before the block stay) and restores the backend override."""
    with _STATE.lock:
        mark = _STATE.mark()
    report = apply(model, **kwargs)
    try:
        yield report
    finally:
        with _STATE.lock:
            _STATE.restore(since=mark)
