"""Public causal depthwise conv1d ops (the GDN layer's short convolution), causal-conv1d's signatures."""

from __future__ import annotations

import torch

from deltafuse import backends
from deltafuse.ops.conv1d.candidates import CONV, CONV_UPDATE
from deltafuse.ops import _amp, _library
from deltafuse.ops import _checks as check

ACTIVATIONS = (None, "silu", "swish")
INT_DTYPES = (torch.int32, torch.int64)


def _activation(activation):
    if activation not in ACTIVATIONS:
        check.fail(f"activation={activation!r} is not supported; allowed: None, 'silu', 'swish'")
    return None if activation is None else "silu"


def _weight_bias(x, weight, bias):
    C = x.shape[1]
    check.tensor("weight", weight, 2)
    if weight.shape[0] != C:
        check.fail(f"weight must be [C, W] with C={C} channels of x, got {check.shape(weight)}")
    if bias is not None:
        check.tensor("bias", bias, 1)
        if bias.shape != (C,):
            check.fail(f"bias must be [C] = ({C},), got {check.shape(bias)}")


@check.public_op(CONV)
def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None, cu_seqlens: torch.Tensor | None = None,
                     *, backend: str | None = None, **kwargs):
    """Causal depthwise conv1d over x [B, C, T] with weight [C, W], resetting at sequence boundaries.

    Boundaries come from ``seq_idx`` [B, T] (a sequence id per token) or ``cu_seqlens`` (B must be 1).
    ``initial_states`` [B, C, W-1] continues a previous segment; ``return_final_states`` also returns the
    last W-1 inputs [B, C, W-1] (written into ``final_states_out`` when given). Returns out [B, C, T] in
    x's dtype, or (out, final_states).
    """
    check.tensor("x", x, 3)
    B, C, T = x.shape
    _weight_bias(x, weight, bias)
    act = _activation(activation)
    W = weight.shape[1]
    if seq_idx is not None:
        check.tensor("seq_idx", seq_idx, 2, INT_DTYPES)
        if seq_idx.shape != (B, T):
            check.fail(f"seq_idx must be [B, T] = {(B, T)}, got {check.shape(seq_idx)}")
    if cu_seqlens is not None:
        if seq_idx is not None:
            check.fail("pass sequence boundaries as seq_idx or as cu_seqlens, not both")
        check.cu_seqlens(cu_seqlens, B, T)
    for name, t in (("initial_states", initial_states), ("final_states_out", final_states_out)):
        if t is not None:
            check.tensor(name, t, 3)
            if t.shape != (B, C, W - 1):
                check.fail(f"{name} must be [B, C, W-1] = {(B, C, W - 1)}, got {check.shape(t)}")
    check.same_device("x", x, weight=weight, bias=bias, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                      initial_states=initial_states, final_states_out=final_states_out)
    if backend is not None:
        backends.call_backend(CONV, backend)
    out = _conv_op(x, weight, bias, initial_states, seq_idx, cu_seqlens, return_final_states, act, backend,
                   _library.grad_mask(x, weight, bias, initial_states), torch.compiler.is_compiling())
    if not return_final_states:
        return out[0]
    final = out[1]
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out[0], final


def _conv_fake(x, weight, bias, initial_states, seq_idx, cu_seqlens, return_final_states, activation, backend,
               grad_mask, validate):
    B, C, _ = x.shape
    final = x.new_empty(B, C, weight.shape[1] - 1) if return_final_states else None
    return _library.fake_outputs(torch.empty_like(x), final, like=x)


@_library.define(CONV, ("x", "weight", "bias", "initial_states"), _conv_fake)
def _conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_states: torch.Tensor | None,
             seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None, return_final_states: bool,
             activation: str | None, backend: str | None, grad_mask: list[bool], validate: bool) -> list[torch.Tensor]:
    if validate and cu_seqlens is not None:
        _library.named_errors(CONV, check.cu_seqlens, cu_seqlens, x.shape[0], x.shape[2])
    impl = _library.select(CONV, backend, grad_mask, x, weight, bias, initial_states)

    def run(x_, w, b, init):
        out = impl(x_, w, b, activation=activation, seq_idx=seq_idx, cu_seqlens=cu_seqlens, initial_states=init,
                   return_final_states=return_final_states)
        y = _library.in_layout_of(out[0] if return_final_states else out, x_)  # the fake's layout
        if not return_final_states:
            return y, None  # the fake's outputs: a placeholder where the final states would be
        # a view into a larger buffer (the last W-1 columns) becomes a [B, C, W-1] tensor of its own
        final = out[1] if out[1].storage_offset() == 0 and out[1].is_contiguous() else out[1].clone()
        return y, final

    return _library.run_forward([x, weight, bias, initial_states], grad_mask, run, x.device.type)


@check.public_op(CONV_UPDATE)
def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         *, backend: str | None = None, **kwargs):
    """One decoding step (or a few): x [B, C, T_new]; conv_state [B, C, S >= W-1] is updated in place."""
    check.tensor("x", x, 3)
    B, C, _ = x.shape
    _weight_bias(x, weight, bias)
    act = _activation(activation)
    check.tensor("conv_state", conv_state, 3)
    if conv_state.shape[:2] != (B, C) or conv_state.shape[2] < weight.shape[1] - 1:
        check.fail(f"conv_state must be [B, C, S] with B={B}, C={C}, S >= W-1 = {weight.shape[1] - 1}, "
                   f"got {check.shape(conv_state)}")
    check.same_device("x", x, conv_state=conv_state, weight=weight, bias=bias)
    if backend is not None:
        backends.call_backend(CONV_UPDATE, backend)
    mask = _library.grad_mask(x, weight, bias)
    if torch.compiler.is_compiling() and not any(mask):
        return _conv_update_op(x, conv_state, weight, bias, act, backend)
    # eager (the custom op's dispatch costs ~100 µs of CPU per call and changes nothing here), or a
    # differentiable decoding step (the op writes into conv_state, so it has no autograd): the implementation
    impl = _library.select(CONV_UPDATE, backend, mask, x, weight, bias)
    if _amp.autocast_dtype(x.device.type) is None:
        return impl(x, conv_state, weight, bias, act)
    with _amp.disabled(x.device.type):
        return impl(x, conv_state, weight, bias, act)


def _conv_update_fake(x, conv_state, weight, bias, activation, backend):
    return torch.empty_like(x)


@torch.library.custom_op(f"{_library.NAMESPACE}::{CONV_UPDATE}", mutates_args=("conv_state",))
def _conv_update_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str | None, backend: str | None) -> torch.Tensor:
    """Writes into conv_state, so without autograd (torch gives in-place custom ops none) and without a handle."""
    impl = _library.select(CONV_UPDATE, backend, [False], x, weight, bias)
    with _amp.disabled(x.device.type):
        return impl(x, conv_state, weight, bias, activation)


_conv_update_op.register_fake(_conv_update_fake)
