"""Candidates for the causal depthwise conv1d ops of the GDN layer, in order of preference.

``causal_conv1d_update`` (decoding) prefers deltafuse's one-launch Triton kernel on CUDA over the torch
function (concatenation, state copy, conv, activation: several launches). To prefer the torch one instead,
register the torch row first (or give the Triton row ``auto_skip=triton_forced_only(reason)``); a call can
also force either with ``backend=``.
"""

from __future__ import annotations

from deltafuse.backends.common import (load_attr, torch_supports, triton_available, triton_supports,
                                       triton_auto_skip)
from deltafuse.backends.registry import REGISTRY, CallInfo, Candidate, Registry

CONV = "causal_conv1d_fn"
CONV_UPDATE = "causal_conv1d_update"
KERNEL = "deltafuse.ops.conv1d.kernel"
KERNEL_UPDATE = "deltafuse.ops.conv1d.kernel_update"
REFERENCE = "deltafuse.ops.conv1d.reference"

# The widest kernel deltafuse's Triton conv takes: the last W-1 inputs live in registers (Qwen3.5 and
# Qwen3-Next use W = 4). The decoding kernel takes any width.
TRITON_MAX_W = 4


def kernel_width(shapes: tuple) -> tuple:
    """The shape fact of a conv call: the kernel width W (``shapes``: x, weight, ...)."""
    weight = shapes[1]
    return (("W", int(weight[1])),) if weight is not None and len(weight) == 2 else ()


def _triton_conv_supports(call: CallInfo) -> str | None:
    reason = triton_supports(call)
    if reason is not None:
        return reason
    W = call.fact("W")
    if W is not None and W > TRITON_MAX_W:
        return f"kernel width W={W} is over {TRITON_MAX_W}, the widest deltafuse's Triton conv takes"
    return None


def _triton_update_supports(call: CallInfo) -> str | None:
    reason = triton_supports(call)
    if reason is not None:
        return reason
    if call.needs_grad:
        return "the Triton conv update writes conv_state in place and has no backward (a differentiable step)"
    return None


def register(registry: Registry) -> None:
    registry.register(CONV, Candidate(
        "triton", load_attr(KERNEL, "causal_conv1d_fn_triton"), triton_available(KERNEL), _triton_conv_supports,
        auto_skip=triton_auto_skip,
        note="deltafuse's Triton causal conv1d + SiLU with sequence resets (fwd+bwd, W <= 4)"))
    registry.register(CONV, Candidate("torch", load_attr(REFERENCE, "causal_conv1d_fn_torch"),
                                      supports=torch_supports,
                                      note="deltafuse's boundary-aware torch conv (any device)"))
    registry.register(CONV_UPDATE, Candidate(
        "triton", load_attr(KERNEL_UPDATE, "causal_conv1d_update_triton"), triton_available(KERNEL_UPDATE),
        _triton_update_supports, auto_skip=triton_auto_skip,
        note="deltafuse's one-launch Triton decoding step (state updated in place; inference)"))
    registry.register(CONV_UPDATE, Candidate("torch", load_attr(REFERENCE, "causal_conv1d_update_torch"),
                                             supports=torch_supports,
                                             note="deltafuse's torch single-step conv update"))
    registry.set_facts(CONV, kernel_width)


register(REGISTRY)  # on import: the op's package imports this module before anything else of the op
