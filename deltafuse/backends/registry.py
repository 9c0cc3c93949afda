"""Backend selection as data.

Each public op owns an ordered list of ``Candidate`` rows. A candidate says whether it can exist here at
all (``available``: imports, versions; checked once), whether it can serve a particular call
(``supports``: device, dtype, shapes) and whether it is known to give wrong results for that call
(``known_bad``). The first candidate that passes all three serves the call. Decisions are cached per
(op, device, dtype, needs_grad, forced backend) so the per-call cost is one dictionary lookup.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch


class BackendError(RuntimeError):
    """No candidate can serve a call, or a forced backend cannot."""


class UnknownBackendError(BackendError, ValueError):
    """A call forced a backend name that its op does not have."""


@dataclass(frozen=True)
class CallInfo:
    """What selection may look at: never tensor values, only metadata."""

    device: torch.device
    dtype: torch.dtype
    needs_grad: bool

    @property
    def key(self):
        return (self.device.type, self.device.index, self.dtype, self.needs_grad)

    def describe(self) -> str:
        mode = "training (backward needed)" if self.needs_grad else "inference"
        return f"{self.device} {str(self.dtype).replace('torch.', '')} {mode}"


def call_info(*tensors: torch.Tensor | None) -> CallInfo:
    """CallInfo of an op call from its tensor arguments (the first tensor gives device and dtype)."""
    first = next(t for t in tensors if t is not None)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return CallInfo(first.device, first.dtype, needs_grad)


def _ok(*_args) -> str | None:
    return None


@dataclass(frozen=True)
class Candidate:
    """One implementation of an op.

    available() -> reason it cannot be used in this process, or None (cached once per process).
    supports(call) -> reason it cannot serve this call, or None.
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


@dataclass
class Registry:
    ops: dict[str, list[Candidate]] = field(default_factory=dict)
    _selected: dict = field(default_factory=dict)
    _available: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0  # bumped by every register/unregister (caches keyed on the set of names use it)

    def register(self, op: str, candidate: Candidate, *, before: str | None = None) -> None:
        rows = self.ops.setdefault(op, [])
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
        self.ops[op] = [c for c in self.ops.get(op, []) if c.name != name]
        self.version += 1
        self.clear_cache()

    def backend_names(self, op: str | None = None) -> tuple[str, ...]:
        """The candidate names of ``op``, or of every op (each once, in registration order)."""
        rows = self.candidates(op) if op is not None else [c for cands in self.ops.values() for c in cands]
        return tuple(dict.fromkeys(c.name for c in rows))

    def clear_cache(self) -> None:
        with self._lock:
            self._selected.clear()
            self._available.clear()

    def candidates(self, op: str) -> list[Candidate]:
        if op not in self.ops:
            raise KeyError(f"unknown op {op!r}; known: {sorted(self.ops)}")
        return self.ops[op]

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

    def select(self, op: str, call: CallInfo, backend: str = "auto") -> Callable:
        """The implementation that serves ``call``; raises BackendError when none can."""
        key = (op, backend, call.key)
        hit = self._selected.get(key)
        if hit is not None:
            return hit
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


REGISTRY = Registry()
