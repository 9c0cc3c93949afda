"""Argument checks shared by the public ops. Every error names the argument, its value and what is allowed.

Checks that would read tensor values (and so synchronise an accelerator) run only for CPU tensors, or
everywhere when DELTAFUSE_VALIDATE=1.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(message: str) -> None:
    raise ValueError(message)


def shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def tensor(name: str, t, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        fail(f"{name} must have {ndim} dimensions, got shape {shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; allowed: {allowed}")


def same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            fail(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all tensors must share a device")


def values_checkable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" or os.environ.get("DELTAFUSE_VALIDATE", "").strip().lower() in (
        "1", "true", "yes", "on")


_HOST = "_deltafuse_host_offsets"


def remember_host_offsets(cu: torch.Tensor, values) -> torch.Tensor:
    """Attach the host-side copy of an offsets tensor's values (known to whoever built it), so that ops
    reading them do not copy them back from the accelerator (a synchronisation per call). Returns ``cu``."""
    setattr(cu, _HOST, (cu._version, tuple(int(v) for v in values)))
    return cu


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of a 1-D offsets tensor as Python ints: the attached copy while the tensor is unchanged,
    else read from the tensor (which waits for the accelerator)."""
    known = getattr(cu, _HOST, None)
    if known is not None and known[0] == cu._version and len(known[1]) == cu.numel():
        return known[1]
    return tuple(int(x) for x in cu.tolist())


def cu_seqlens(cu: torch.Tensor, batch: int, total: int) -> int:
    """Validate cu_seqlens for a [1, total, ...] packed batch; returns the number of sequences."""
    if not isinstance(cu, torch.Tensor):
        fail(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dtype.is_complex:
        fail(f"cu_seqlens must be a 1-D integer tensor, got shape {shape(cu)} dtype {cu.dtype}")
    if cu.numel() < 2:
        fail(f"cu_seqlens must hold at least 2 offsets (0 and T), got {cu.numel()}")
    if batch != 1:
        fail(f"cu_seqlens needs the batch dimension to be 1 (sequences packed along T), got B={batch}")
    if values_checkable(cu) or getattr(cu, _HOST, None) is not None:
        vals = list(host_offsets(cu))
        if vals[0] != 0:
            fail(f"cu_seqlens must start at 0, got {vals[0]}")
        if any(b <= a for a, b in zip(vals, vals[1:])):
            fail(f"cu_seqlens must be strictly increasing, got {vals if len(vals) <= 16 else vals[:16] + ['...']}")
        if vals[-1] != total:
            fail(f"cu_seqlens must end at T={total} (the packed length), got {vals[-1]}")
    return cu.numel() - 1
