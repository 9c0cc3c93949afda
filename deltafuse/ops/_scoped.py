"""What a ``configured`` block sets for the calls of an op that pass no options, and where it reaches.

A block reaches the calls made in its own context (its thread, and tasks that copy its context). It also reaches the
calls made during a backward pass in a context of no block at all: autograd runs a CUDA backward on a thread of its
own, and a non-reentrant checkpoint's recompute is a new call of the op there, which would otherwise run with the
defaults while the first forward ran with the block's options (and the op's backward runs with what its forward
read). Those calls take the innermost block open in the process, so a block around both the forward and the
backward covers the recompute too. A recompute that runs after its block has closed gets the defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Generic, Iterator, TypeVar

import torch

T = TypeVar("T")
_UNSET = object()


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (a checkpoint's recompute is called from one)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class ScopedDefault(Generic[T]):
    """The value calls that pass none take: the innermost ``block`` open in the caller's context; else, for calls
    inside a backward pass, the innermost block open in the process; else ``default``."""

    def __init__(self, name: str, default: T):
        self.default = default
        self._var: contextvars.ContextVar = contextvars.ContextVar(name, default=_UNSET)
        self._open: list[tuple[object, T]] = []  # (key, value) of every open block, any thread, in opening order
        self._lock = threading.Lock()

    def get(self) -> T:
        value = self._var.get()
        if value is not _UNSET:
            return value
        if self._open and _in_backward():
            with self._lock:
                if self._open:
                    return self._open[-1][1]
        return self.default

    @contextlib.contextmanager
    def block(self, value: T) -> Iterator[None]:
        """Inside: ``get()`` returns ``value`` (see the class); what was in effect before is restored on exit."""
        key = object()
        token = self._var.set(value)
        with self._lock:
            self._open.append((key, value))
        try:
            yield
        finally:
            with self._lock:
                self._open[:] = [entry for entry in self._open if entry[0] is not key]
            self._var.reset(token)
