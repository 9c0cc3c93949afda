"""Public SwiGLU op (the activation and product of the Qwen3.5 MLPs); the registry picks the implementation."""

from __future__ import annotations

import torch

from deltafuse import backends
from deltafuse.ops.swiglu.candidates import SWIGLU
from deltafuse.ops import _library
from deltafuse.ops import _checks as check


@check.public_op(SWIGLU)
def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None, **kwargs) -> torch.Tensor:
    """``silu(gate) * up`` elementwise. gate, up: [..., C] of one shape and dtype. Returns gate's shape/dtype.

    ``backend=`` may force 'triton' or 'torch'.
    """
    if kwargs:
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: backend")
    check.tensor("gate", gate)
    check.tensor("up", up)
    if gate.dim() < 1:
        check.fail(f"gate must have at least one dimension, got shape {check.shape(gate)}")
    if up.shape != gate.shape:
        check.fail(f"up must have gate's shape {check.shape(gate)}, got {check.shape(up)}")
    if up.dtype != gate.dtype:
        check.fail(f"up has dtype {up.dtype} but gate has {gate.dtype}; they must match")
    check.same_device("gate", gate, up=up)
    if backend is not None:
        backends.call_backend(SWIGLU, backend)
    return _swiglu_op(gate, up, backend, _library.grad_mask(gate, up))[0]


def _swiglu_fake(gate, up, backend, grad_mask):
    return _library.fake_outputs(torch.empty_like(gate), like=gate)


@_library.define(SWIGLU, ("gate", "up"), _swiglu_fake)
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, backend: str | None, grad_mask: list[bool]) -> list[torch.Tensor]:
    impl = _library.select(SWIGLU, backend, grad_mask, gate, up)
    return _library.run_forward([gate, up], grad_mask, lambda g, u: (impl(g, u),), gate.device.type)
