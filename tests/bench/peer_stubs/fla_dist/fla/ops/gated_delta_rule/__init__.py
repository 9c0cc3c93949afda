"""FLA's chunk_gated_delta_rule, computed by transformers' torch fallback and counted."""

import inspect

import torch

import fla
from fla.ops.common import chunk_o


class _Guard(torch.autograd.Function):
    """Identity; its backward refuses as FLA 0.6 does when the Hopper guard is active."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        chunk_o.check_backward()
        return grad


def _torch_fallback():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    if scale is not None or cu_seqlens is not None:
        raise NotImplementedError("the stand-in serves scale=None and cu_seqlens=None only")
    fla.CALLS["chunk_gated_delta_rule"] += 1
    out, state = _torch_fallback()(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return _Guard.apply(out), state
