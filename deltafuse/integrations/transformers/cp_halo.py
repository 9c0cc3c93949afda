"""Context parallelism's causal conv1d: each rank's conv starts from the previous rank's last kernel-1 inputs.

``halo_conv1d``: rank r receives the last W-1 inputs of rank r-1 (the halo) as the initial conv state, with the
positions of another sequence than its first token's zeroed; their gradient goes back to rank r-1. Under
gradient checkpointing the recomputation reuses the halo the first forward received (``cp_exchange``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltafuse.integrations.transformers import cp_exchange as exchange
from deltafuse.integrations.transformers.cp_exchange import refuse

if TYPE_CHECKING:
    from deltafuse.integrations.transformers.context_parallel import Shard


class _Halo(torch.autograd.Function):
    """The previous rank's ``tail`` (zeros on rank 0); backward returns the gradient to where it came from."""

    @staticmethod
    def forward(ctx, shard, layer, tail):
        ctx.shard = shard
        return exchange.received_once(shard, "halo", layer, lambda: exchange.shift(tail, shard, +1))

    @staticmethod
    def backward(ctx, grad):
        return None, None, exchange.shift(grad, ctx.shard, -1)


def halo_conv1d(conv, x, weight, bias, activation, seq_idx, shard: Shard, layer=None):
    """``conv(x, weight, bias, seq_idx=..., initial_states=..., activation=...)`` on this rank's shard with the
    previous rank's last W-1 inputs as the initial state of each row's first sequence (positions of another
    sequence zeroed: a boundary at or just before the edge stops it). ``layer``: the GDN layer calling it (its
    halo is received once per model call, see ``cp_exchange.received_once``)."""
    W = weight.shape[1]
    if W == 1 or shard.world == 1:
        return conv(x, weight, bias, seq_idx=seq_idx, activation=activation)
    B, C, L = x.shape
    if L < W - 1:
        raise refuse(f"a conv input of {L} tokens with a kernel of {W}", f"at least {W - 1} tokens per rank")
    halo = _Halo.apply(shard, layer, x[:, :, L - (W - 1):])
    if shard.rank == 0 or "halo" in exchange.DISABLED:
        keep = torch.zeros(B, W - 1, dtype=torch.bool, device=x.device)
    else:
        seq = shard.global_seq.to(x.device)
        keep = seq[:, shard.start - (W - 1):shard.start] == seq[:, shard.start:shard.start + 1]
    initial = halo * keep[:, None, :].to(halo.dtype)
    return conv(x, weight, bias, seq_idx=seq_idx, initial_states=initial, activation=activation)

