"""Which implementation serves each call: the selection mechanism only (registry, probes, predicates).

It knows no op. Each op declares its candidates in its own folder (``deltafuse/ops/<op>/candidates.py``) and
registers them into ``REGISTRY`` when its package is imported; the registry imports its sources (the package
root declares ``deltafuse.ops``) before it first answers, so every op is there whoever asks. See
``deltafuse.backends.registry`` for the resolution order.
"""

from __future__ import annotations

from deltafuse.backends.registry import (
    REGISTRY,
    BackendError,
    CallInfo,
    Candidate,
    Decision,
    Registry,
    UnknownBackendError,
    call_info,
)
from deltafuse.backends import settings

__all__ = ["REGISTRY", "BackendError", "CallInfo", "Candidate", "Decision", "Registry", "UnknownBackendError",
           "backend_override", "call_backend", "call_info", "current_backend", "select", "select_tensors",
           "set_backend_override"]

_forced: str | None = None  # the backend apply(backend=...) forces; read by every op call (a global lookup)
_call_backends: dict = {}  # (op, backend argument, registry version) -> the checked name


def set_backend_override(name: str | None) -> None:
    """Force a backend for every op that has it (``apply(backend=...)``); None returns to the environment.
    An op without a backend of that name keeps its automatic choice."""
    global _forced
    _forced = None if name is None else settings.parse_backend("backend", name)


def backend_override() -> str | None:
    """The backend forced by apply(backend=...), or None when the environment decides."""
    return _forced


def current_backend() -> str:
    """The forced backend in effect: apply()'s argument, else DELTAFUSE_BACKEND, else 'auto'."""
    if _forced is not None:
        return _forced
    return settings.env_backend()


def call_backend(op: str, backend) -> str:
    """A per-call ``backend=`` argument checked against ``op``'s own candidates: 'auto' or one of them.

    A wrong type is a TypeError, a name the op does not have an ``UnknownBackendError`` (a ValueError);
    both name the op, the value and the op's backends. Unlike the global switch (DELTAFUSE_BACKEND,
    ``apply(backend=...)``), which ops without that backend ignore, a call that asks for a backend its op
    lacks is refused."""
    try:
        key = (op, backend, REGISTRY.version)
        hit = _call_backends.get(key)
    except TypeError:  # unhashable value: certainly not a name
        key, hit = None, None
    if hit is not None:
        return hit
    allowed = ("auto",) + REGISTRY.backend_names(op)
    shown = ", ".join(repr(n) for n in allowed)
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend must be a backend name (a str), got {type(backend).__name__} "
                        f"({backend!r}); allowed: {shown}")
    word = backend.strip().lower()
    if word not in allowed:
        raise UnknownBackendError(f"{op}: backend={backend!r} is not one of its backends; allowed: {shown}")
    _call_backends[key] = word
    return word


def select(op: str, call: CallInfo, backend: str | None = None):
    """The implementation of ``op`` for ``call``. ``backend`` None: the global switch in effect (ops without
    that backend keep their automatic choice); else a per-call name ``op`` must have (see ``call_backend``)."""
    return REGISTRY.select(op, call, current_backend() if backend is None else call_backend(op, backend))


def select_tensors(op: str, backend: str | None, needs_grad: bool, tensors: tuple):
    """``select`` for a call of ``op`` on ``tensors`` (its tensor arguments, in the order its shape facts
    read them; the first one present gives device and dtype), ``needs_grad`` as the op's grad mask says. The
    ops' per-call path: with the decision cached it builds no CallInfo."""
    if backend is None:
        name = _forced
        if name is None:
            name = settings.env_backend()
    else:
        name = call_backend(op, backend)
    return REGISTRY.select_tensors(op, name, needs_grad, tensors)
