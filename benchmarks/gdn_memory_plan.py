"""The chunked GDN op's allocation plan: live bytes after every stage of one forward+backward, and the peak.

Runs on any machine, CPU included: every Triton kernel is replaced by a no-op, so only the launcher runs and
allocates its buffers at full size (uninitialised, never touched). Live bytes are counted per tensor storage from
its creation (a ``TorchDispatchMode`` sees every op's output) to its release; the inputs, the output gradient and
the caller's output o count as they do in ``bench_gdn.py``: the base holds the inputs and do, the peak counts o,
the intermediates and the input gradients. The figure is what the CUDA caching allocator must hold at least; its
own rounding adds a little, so a GPU run of ``bench_gdn.py`` checks it.

    python benchmarks/gdn_memory_plan.py                                   # 1x65536, H=16, HV=32, D=128
    python benchmarks/gdn_memory_plan.py --shape 1,16384,16,32,128 --options wy_recompute_t=1,bwd_group_loop=1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltafuse.ops.gated_delta import chunk_launch  # noqa: E402
from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.chunk_options import ChunkOptions  # noqa: E402


class _NoKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now and at most, counting each storage once, from the op that made it."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self.add(t)
        return out


@contextlib.contextmanager
def kernels_replaced(stand_in: Callable[[str, object], object]):
    """Every Triton kernel of ``chunk_launch`` replaced by ``stand_in(name, kernel)`` until the block ends."""
    kernels = {name: obj for name, obj in vars(chunk_launch).items()
               if type(obj).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner")}
    try:
        for name, kernel in kernels.items():
            setattr(chunk_launch, name, stand_in(name, kernel))
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(chunk_launch, name, kernel)


def plan(shape: tuple[int, ...], options: ChunkOptions, dtype=torch.bfloat16) -> tuple[list[tuple[str, int]], int]:
    """([(stage, live bytes above the base after it)], peak bytes above the base) of one forward+backward."""
    B, T, H, HV, D = shape
    with kernels_replaced(lambda name, kernel: _NoKernel()):
        return _run(B, T, H, HV, D, options, dtype)


def _run(B, T, H, HV, D, options, dtype):
    leaf = lambda *s: torch.empty(*s, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v, g, beta = leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, HV, D), leaf(B, T, HV), leaf(B, T, HV)
    do = torch.empty(B, T, HV, D, dtype=dtype)
    mode = LiveBytes()
    for t in (q, k, v, g, beta, do):
        mode.add(t)
    base = mode.now
    mode.peak = base
    stages = []
    prefix = ["f:"]
    hook = lambda name: stages.append((prefix[0] + name, mode.now - base))  # noqa: E731
    with mode:
        o, _ = chunk_mod.chunk_gated_delta_rule_triton(q, k, v, g, beta, D**-0.5, None, False, True, None,
                                                       options=options, stage_hook=hook)
        prefix[0] = "b:"
        torch.autograd.backward(o, do)
    return stages, mode.peak - base


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tune_gdn import shape_and_options

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,65536,16,32,128", help="B,T,H,HV,D")
    ap.add_argument("--options", default="", help="ChunkOptions overrides, FIELD=VALUE,...")
    args = ap.parse_args()
    shape, options = shape_and_options(ap, args.shape, args.options)
    stages, peak = plan(shape, options)
    for name, live in stages:
        print(f"after {name:12s} {live / 2**30:7.3f} GiB")
    print(f"peak {peak / 2**30:.3f} GiB above the inputs and do (shape {args.shape}, options {args.options or 'defaults'})")


if __name__ == "__main__":
    main()
