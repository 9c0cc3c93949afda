"""Compile ahead: every Triton kernel a step launches, compiled in parallel before the step runs.

Triton compiles a kernel the first time it is launched with a new specialisation, in the launching thread, and
builds a C launcher for its signature and loads its binary at its first run. A training step launches its
kernels one after another, so on an empty Triton cache the first step waits for each compilation in turn.

``compile_ahead(step)`` runs ``step`` once with every Triton launch replaced by its compilation, handed to a
pool of threads (Triton's own ``AsyncCompileMode``); each thread also builds its kernel's launcher and loads
it. The launches see the real tensors, so the specialisations (dtypes, 16-byte alignment, integer
divisibility) are those of a real step with the same inputs, and that step then finds every kernel compiled.

What ``step`` computes is not meaningful: every Triton kernel's output is left as allocated. The caller
discards it (for a training step: the gradients it accumulated). While ``step`` runs no other thread may launch
Triton kernels (the launch method is replaced for the whole process).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class AheadReport:
    """What ``compile_ahead`` did: the kernels it compiled (distinct specialisations), the Triton launches the
    step made, its wall time and the worker threads; ``skipped`` says why nothing was compiled ahead."""
    compiled: int
    launches: int
    seconds: float
    workers: int
    skipped: str | None = None


def default_workers() -> int:
    """One compile thread per CPU this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machinery():
    """(JITFunction, Triton's asynchronous compilation module) of the installed Triton, or a reason why
    compiling ahead cannot run."""
    try:
        from triton.runtime import _async_compile
        from triton.runtime import jit as tjit
    except ImportError as exc:
        return None, f"this Triton has no asynchronous compilation ({exc})"
    if not (hasattr(tjit.JITFunction, "run") and hasattr(_async_compile, "AsyncCompileMode")
            and hasattr(_async_compile, "active_mode")):
        return None, f"this Triton ({getattr(tjit, '__name__', '?')}) lacks JITFunction.run or AsyncCompileMode"
    return (tjit.JITFunction, _async_compile), None


class _LoadingPool(concurrent.futures.Executor):
    """Threads that compile a kernel, then build its launcher and load its binary on the caller's device."""

    def __init__(self, workers: int, device: int | None):
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="deltafuse-compile")
        self._device = device
        self.compiled = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        def compile_and_load():
            if self._device is not None:
                import torch

                torch.cuda.set_device(self._device)
            kernel = fn(*args, **kwargs)
            init = getattr(kernel, "_init_handles", None)
            if init is not None:
                try:
                    init()
                except Exception:  # noqa: BLE001 - the kernel's first real launch raises it again, in the step
                    pass
            with self._lock:
                self.compiled += 1
            return kernel

        return self._pool.submit(compile_and_load)

    def shutdown(self, wait=True, *, cancel_futures=False):
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def compile_ahead(step: Callable[[], object], *, workers: int | None = None) -> AheadReport:
    """Run ``step()`` once with each Triton launch compiled (in ``workers`` threads, default: the CPUs this
    process may use) instead of run; see the module docstring for what the caller must discard."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"compile_ahead(workers={workers!r}); allowed: a whole number >= 1, or None (one per CPU)")
    from deltafuse.config import triton_interpreting

    n = workers or default_workers()
    if triton_interpreting():
        return AheadReport(0, 0, 0.0, n, "TRITON_INTERPRET=1: the interpreter compiles nothing")
    parts, why = _machinery()
    if parts is None:
        return AheadReport(0, 0, 0.0, n, why)
    jit_function, async_compile = parts
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    pool = _LoadingPool(n, device)
    # a kernel that fails to compile is left to fail (or be avoided) in the real step, as without compile_ahead
    mode = async_compile.AsyncCompileMode(pool, ignore_errors=True)
    active = async_compile.active_mode
    original = jit_function.run
    launches = [0]

    def compile_only(self, *args, grid, warmup, **kwargs):
        launches[0] += 1
        if active.get() is None:
            # a launch from another thread (autograd runs the backward in threads of its own), where the
            # context variable that makes Triton compile asynchronously is not set: set it for this launch
            token = active.set(mode)
            try:
                return original(self, *args, grid=grid, warmup=True, **kwargs)
            finally:
                active.reset(token)
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    t0 = time.perf_counter()
    jit_function.run = compile_only
    try:
        with mode:
            step()
    finally:
        jit_function.run = original
        pool.shutdown(wait=True)
    if device is not None:
        torch.cuda.synchronize(device)
    return AheadReport(pool.compiled, launches[0], time.perf_counter() - t0, n)
