"""Which implementation serves each op: the registry and the candidates of every op."""

from __future__ import annotations

import functools
import os

from deltafuse.backends.registry import (
    REGISTRY,
    BackendError,
    CallInfo,
    Candidate,
    Decision,
    Registry,
    call_info,
)
from deltafuse.config import check_backend

__all__ = ["REGISTRY", "BackendError", "CallInfo", "Candidate", "Decision", "Registry", "backend_override",
           "call_info", "current_backend", "select", "set_backend_override"]

_override: list[str | None] = [None]


def set_backend_override(name: str | None) -> None:
    """Force a backend for every op (``apply(backend=...)``); None returns to the environment."""
    _override[0] = None if name is None else check_backend("backend", name)


def backend_override() -> str | None:
    """The backend forced by apply(backend=...), or None when the environment decides."""
    return _override[0]


@functools.lru_cache(maxsize=16)
def _parse_backend_env(raw: str | None) -> str:
    if raw is None or raw.strip() == "":
        return "auto"
    return check_backend("DELTAFUSE_BACKEND", raw)


def current_backend() -> str:
    """The forced backend in effect: apply()'s argument, else DELTAFUSE_BACKEND, else 'auto'."""
    if _override[0] is not None:
        return _override[0]
    return _parse_backend_env(os.environ.get("DELTAFUSE_BACKEND"))


def select(op: str, call: CallInfo, backend: str | None = None):
    """The implementation of ``op`` for ``call`` (backend None = the one in effect)."""
    return REGISTRY.select(op, call, current_backend() if backend is None else check_backend("backend", backend))


def _register_all() -> None:
    from deltafuse.backends import attention, conv1d, cross_entropy, gated_delta, moe, norm, rope, swiglu

    for module in (gated_delta, conv1d, norm, rope, swiglu, cross_entropy, moe, attention):
        module.register(REGISTRY)


_register_all()
