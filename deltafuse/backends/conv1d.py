"""Candidates for the causal depthwise conv1d ops of the GDN layer."""

from __future__ import annotations

import torch

from deltafuse.backends.registry import CallInfo, Candidate, Registry

CONV = "causal_conv1d_fn"
CONV_UPDATE = "causal_conv1d_update"


def _torch_supports(call: CallInfo) -> str | None:
    ok = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return None if call.dtype in ok else f"dtype {call.dtype} is not one of fp16, bf16, fp32, fp64"


def _load_conv():
    from deltafuse.ops.conv1d.reference import causal_conv1d_fn_torch

    return causal_conv1d_fn_torch


def _load_update():
    from deltafuse.ops.conv1d.reference import causal_conv1d_update_torch

    return causal_conv1d_update_torch


def register(registry: Registry) -> None:
    registry.register(CONV, Candidate("torch", _load_conv, supports=_torch_supports,
                                      note="deltafuse's boundary-aware torch conv (any device)"))
    registry.register(CONV_UPDATE, Candidate("torch", _load_update, supports=_torch_supports,
                                             note="deltafuse's torch single-step conv update"))
