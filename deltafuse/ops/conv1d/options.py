"""Tunables of the Triton causal conv1d kernels (``ConvOptions``) and the default a ``configured`` block sets.

A call takes its options as an argument; one that passes none reads, once at its start, what the innermost
``configured`` block set, else the device's defaults (``INTERPRET_OPTIONS`` under the interpreter: tiny blocks, so
tests cross block edges; ``DEFAULT_OPTIONS`` on a GPU). The forward's autograd context keeps them for its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from deltafuse.config import triton_interpreting
from deltafuse.ops._scoped import ScopedDefault


@dataclass(frozen=True)
class ConvOptions:
    """Tunables of the conv kernels on a GPU.

    ``*_block_c``: channels per program (a power of two); ``*_block_t``: tokens per program (any int >= 1;
    the backward adds W-1 warm-up steps); ``*_warps``: warps per program (a power of two); ``*_stages``:
    Triton's software-pipelining depth of the token loop (1: none); ``*_prefetch``: rows loaded ahead by the
    kernel itself, 0 to 4 (each step then waits only for a load issued that many steps earlier: the loads in
    flight that keep memory busy). ``update_*``: the decoding kernel.
    """

    fwd_block_c: int = 256
    fwd_block_t: int = 64
    fwd_warps: int = 1
    fwd_stages: int = 1
    fwd_prefetch: int = 4
    bwd_block_c: int = 128
    bwd_block_t: int = 64
    bwd_warps: int = 1
    bwd_stages: int = 1
    bwd_prefetch: int = 4
    update_block_c: int = 256
    update_warps: int = 2

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name.endswith("_prefetch") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: an int >= {low}")
            if f.name.endswith("_prefetch") and value > 4:
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: 0 to 4")
            if f.name.endswith(("_block_c", "_warps")) and value & (value - 1):
                raise ValueError(f"ConvOptions.{f.name}={value!r}; allowed: a power of two")


DEFAULT_OPTIONS = ConvOptions()
# Under the interpreter: blocks of 8 channels and 4 tokens, so that tiny test shapes cross block edges.
INTERPRET_OPTIONS = ConvOptions(fwd_block_c=8, fwd_block_t=4, fwd_warps=1, fwd_stages=1, bwd_block_c=8,
                                bwd_block_t=4, bwd_warps=1, bwd_stages=1, update_block_c=8, update_warps=1,
                                fwd_prefetch=2, bwd_prefetch=3)
# options set by ``configured`` for calls that pass none, else None (the defaults for the device); see ops._scoped
# for where a block reaches
_DEFAULT: ScopedDefault[ConvOptions | None] = ScopedDefault("deltafuse_conv_options", None)


def _check(options) -> None:
    if options is not None and not isinstance(options, ConvOptions):
        raise TypeError(f"options must be a ConvOptions or None, got {type(options).__name__}")


def configured(options: ConvOptions | None = None):
    """Calls of the conv kernels inside the block that pass no ``options`` run with these (also under the
    interpreter); None: the device's defaults. What was in effect before is restored on exit. A call reads them
    once, at its start, and a forward's backward runs with the forward's. The block also reaches calls during a
    backward that no block of their own reaches (a checkpoint's recompute on autograd's thread;
    ``deltafuse.ops._scoped``)."""
    _check(options)
    return _DEFAULT.block(options)


def current_options() -> ConvOptions:
    """The options a call that passes none runs with now: the ``configured`` block's, else the device's defaults."""
    options = _DEFAULT.get()
    if options is not None:
        return options
    return INTERPRET_OPTIONS if triton_interpreting() else DEFAULT_OPTIONS


def resolve(options: ConvOptions | None) -> ConvOptions:
    """The options of one call: ``options`` when given, else ``current_options()``."""
    _check(options)
    return current_options() if options is None else options
