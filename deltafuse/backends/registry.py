"""Backend selection as data.

Resolution order, in one place. Each op owns an ordered list of ``Candidate`` rows, declared in its own folder
(``deltafuse/ops/<op>/candidates.py``). For a call the registry walks the list and asks each candidate, in
turn: can it exist here at all (``available``: imports, versions; checked once per process), can it serve
this call (``supports``: device, dtype and the op's shape facts, e.g. a head size), is it known to give wrong
results for this call (``known_bad``), and, under automatic selection, does it step aside (``auto_skip``: it
serves only when forced). The first candidate that passes serves the call; a forced backend serves or the
call raises, naming every candidate's reason.

Decisions are cached per (op, forced backend, device, dtype, needs_grad, shape facts) so the per-call cost is
one dictionary lookup. The shape facts of an op are the few numbers its candidates judge (declared with
``Registry.set_facts``), never a sequence length, so the cache stays small.

The registry fills itself on first use by importing its *sources* (module names whose import registers
candidates; deltafuse's ``REGISTRY`` names ``deltafuse.ops``), so whoever asks it (``deltafuse info``, the
backend names that can be forced, ``DELTAFUSE_BACKEND``) sees every op. Registering never triggers that
import.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only: the registry imports no torch of its own
    import torch


class BackendError(RuntimeError):
    """No candidate can serve a call, or a forced backend cannot."""


class UnknownBackendError(BackendError, ValueError):
    """A call forced a backend name that its op does not have."""


@dataclass(frozen=True)
class CallInfo:
    """What selection may look at: never tensor values, only metadata.

    ``facts``: the op's named shape facts, e.g. ``(("K", 128), ("V", 128))``, part of the cache key.
    ``shapes``: the shapes of the call's tensor arguments in order (None for a missing one), from which the
    registry derives ``facts`` with the op's ``facts`` function; not part of the key."""

    device: torch.device
    dtype: torch.dtype
    needs_grad: bool
    facts: tuple = ()
    shapes: tuple = field(default=(), compare=False, repr=False)

    @property
    def key(self):
        return (self.device.type, self.device.index, self.dtype, self.needs_grad, self.facts)

    def fact(self, name: str, default=None):
        """The shape fact ``name`` of this call, or ``default`` when the op declares none or it is unknown."""
        for key, value in self.facts:
            if key == name:
                return value
        return default

    def describe(self) -> str:
        mode = "training (backward needed)" if self.needs_grad else "inference"
        facts = "".join(f" {k}={v}" for k, v in self.facts)
        return f"{self.device} {str(self.dtype).replace('torch.', '')} {mode}{facts}"


def call_info(*tensors: torch.Tensor | None) -> CallInfo:
    """CallInfo of an op call from its tensor arguments (the first tensor gives device and dtype; the shapes
    of all of them, in order, give the op's shape facts)."""
    import torch  # here, not at the top: `import deltafuse` (and so the CLI's argument checks) stays torch-free

    first = next(t for t in tensors if t is not None)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    shapes = tuple(None if t is None else t.shape for t in tensors)
    return CallInfo(first.device, first.dtype, needs_grad, (), shapes)


def _ok(*_args) -> str | None:
    return None


@dataclass(frozen=True)
class Candidate:
    """One implementation of an op.

    available() -> reason it cannot be used in this process, or None (cached once per process).
    supports(call) -> reason it cannot serve this call (device, dtype, shape facts), or None.
    known_bad(call) -> reason it would serve this call incorrectly, or None.
    auto_skip(call) -> reason automatic selection passes it over (it still serves when forced), or None.
    load() -> the implementation (a callable with the op's internal signature); imported lazily.
    """

    name: str
    load: Callable[[], Callable]
    available: Callable[[], str | None] = _ok
    supports: Callable[[CallInfo], str | None] = _ok
    known_bad: Callable[[CallInfo], str | None] = _ok
    auto_skip: Callable[[CallInfo], str | None] = _ok
    verified: bool = True
    note: str = ""


@dataclass
class Decision:
    candidate: str
    chosen: bool
    reason: str | None  # why rejected (None for the chosen one)
    verified: bool = True


class Registry:
    """The candidates of every op, their shape facts, and the cached decisions."""

    def __init__(self, sources: tuple[str, ...] = ()):
        self._ops: dict[str, list[Candidate]] = {}
        self._facts: dict[str, Callable[[tuple], tuple]] = {}
        self._selected: dict = {}
        self._available: dict = {}
        self._lock = threading.RLock()
        self._sources: list[str] = list(sources)
        self._loaded = not self._sources
        self.version = 0  # bumped by every register/unregister (caches keyed on the set of names use it)

    # --- filling ---------------------------------------------------------------------------------------
    def add_source(self, module: str) -> None:
        """Import ``module`` (which registers candidates) before the registry next answers a question."""
        if module not in self._sources:
            self._sources.append(module)
            self._loaded = False

    def load(self) -> None:
        """Import every source not imported yet (each registers its candidates on import)."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True  # a source that asks the registry while it imports sees what is there
            try:
                for module in self._sources:
                    importlib.import_module(module)
            except BaseException:
                self._loaded = False
                raise

    def register(self, op: str, candidate: Candidate, *, before: str | None = None) -> None:
        rows = self._ops.setdefault(op, [])
        if any(c.name == candidate.name for c in rows):
            raise ValueError(f"op {op!r} already has a candidate named {candidate.name!r}")
        if before is None:
            rows.append(candidate)
        else:
            names = [c.name for c in rows]
            if before not in names:
                raise ValueError(f"before={before!r} is not a candidate of {op!r}; known: {names}")
            rows.insert(names.index(before), candidate)
        self.version += 1
        self.clear_cache()

    def unregister(self, op: str, name: str) -> None:
        self._ops[op] = [c for c in self._ops.get(op, []) if c.name != name]
        self.version += 1
        self.clear_cache()

    def set_facts(self, op: str, facts: Callable[[tuple], tuple]) -> None:
        """``facts(shapes)`` -> the named shape facts of a call of ``op`` (a tuple of (name, int) pairs) from
        the shapes of its tensor arguments, in the order the op passes them to ``call_info``. They are part of
        the cache key: return only numbers that are constant for a model (head sizes), never lengths."""
        self._facts[op] = facts
        self.clear_cache()

    # --- questions -------------------------------------------------------------------------------------
    @property
    def ops(self) -> dict[str, list[Candidate]]:
        """Every op and its candidates, in order of preference."""
        self.load()
        return self._ops

    def backend_names(self, op: str | None = None) -> tuple[str, ...]:
        """The candidate names of ``op``, or of every op (each once, in registration order)."""
        rows = self.candidates(op) if op is not None else [c for cands in self.ops.values() for c in cands]
        return tuple(dict.fromkeys(c.name for c in rows))

    def clear_cache(self) -> None:
        with self._lock:
            self._selected.clear()
            self._available.clear()

    def candidates(self, op: str) -> list[Candidate]:
        ops = self.ops
        if op not in ops:
            raise KeyError(f"unknown op {op!r}; known: {sorted(ops)}")
        return ops[op]

    def with_facts(self, op: str, call: CallInfo) -> CallInfo:
        """``call`` with ``op``'s shape facts filled in from its shapes (unchanged when it has facts already,
        has no shapes, or the op declares none)."""
        fn = self._facts.get(op)
        if fn is None or call.facts or not call.shapes:
            return call
        return CallInfo(call.device, call.dtype, call.needs_grad, fn(call.shapes), call.shapes)

    def _availability(self, op: str, cand: Candidate) -> str | None:
        key = (op, cand.name)
        if key not in self._available:
            try:
                reason = cand.available()
            except Exception as exc:  # an import that fails in an unexpected way is a reason, not a crash
                reason = f"availability check failed: {type(exc).__name__}: {exc}"
            self._available[key] = reason
        return self._available[key]

    def _reject_reason(self, op: str, cand: Candidate, call: CallInfo) -> str | None:
        return self._availability(op, cand) or cand.supports(call) or cand.known_bad(call)

    def explain(self, op: str, call: CallInfo, backend: str = "auto") -> list[Decision]:
        """Every candidate with its verdict for this call, in order; at most one is chosen."""
        call = self.with_facts(op, call)
        rows, chosen = [], False
        names = [c.name for c in self.candidates(op)]
        forced = backend if backend != "auto" and backend in names else None
        for cand in self.candidates(op):
            reason = self._reject_reason(op, cand, call)
            if forced is not None and cand.name != forced and reason is None:
                reason = f"DELTAFUSE_BACKEND/backend forces {forced!r}"
            if forced is None and reason is None:
                reason = cand.auto_skip(call)
            if reason is None and not chosen:
                rows.append(Decision(cand.name, True, None, cand.verified))
                chosen = True
            else:
                rows.append(Decision(cand.name, False, reason or "a candidate earlier in the list serves it",
                                     cand.verified))
        return rows

    def select_tensors(self, op: str, backend: str, needs_grad: bool, tensors: tuple) -> Callable:
        """``select`` for a call on ``tensors`` (the op's tensor arguments in its ``call_info`` order; the
        first one present gives device and dtype), without building a CallInfo when the decision is cached:
        the per-call cost of the ops."""
        for first in tensors:
            if first is not None:
                break
        fn = self._facts.get(op)
        shapes = () if fn is None else tuple([None if t is None else t.shape for t in tensors])
        facts = fn(shapes) if shapes else ()
        device, dtype = first.device, first.dtype
        hit = self._selected.get((op, backend, device.type, device.index, dtype, needs_grad, facts))
        if hit is not None:
            return hit
        return self.select(op, CallInfo(device, dtype, needs_grad, facts, shapes), backend)

    def select(self, op: str, call: CallInfo, backend: str = "auto") -> Callable:
        """The implementation that serves ``call``; raises BackendError when none can."""
        fn = self._facts.get(op)
        facts = fn(call.shapes) if fn is not None and call.shapes and not call.facts else call.facts
        key = (op, backend, call.device.type, call.device.index, call.dtype, call.needs_grad, facts)
        hit = self._selected.get(key)
        if hit is not None:
            return hit
        call = CallInfo(call.device, call.dtype, call.needs_grad, facts, call.shapes)
        decisions = self.explain(op, call, backend)
        chosen = [d for d in decisions if d.chosen]
        if not chosen:
            lines = "; ".join(f"{d.candidate}: {d.reason}" for d in decisions)
            if backend != "auto" and backend in [d.candidate for d in decisions]:
                raise BackendError(f"backend {backend!r} cannot serve {op} for {call.describe()}: {lines}")
            raise BackendError(f"no implementation of {op} can serve {call.describe()}: {lines}")
        cand = next(c for c in self.candidates(op) if c.name == chosen[0].candidate)
        impl = cand.load()
        with self._lock:
            self._selected[key] = impl
        return impl


# deltafuse's registry: it imports the op packages (each registers its candidates) the first time it is asked
REGISTRY = Registry(sources=("deltafuse.ops",))
