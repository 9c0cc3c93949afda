"""Context parallelism's GDN layers: the recurrent state relayed from rank to rank, forward and backward.

``relay_gated_delta_rule``: rank r receives from rank r-1 the final recurrent state of each row's last sequence,
runs its shard with it as the initial state of the row's first sequence when that sequence continues across the
edge (zeros otherwise), and sends its own final states to rank r+1; the backward runs the chain in reverse. The
exchanges are two autograd functions around the op (``_ReceiveState`` before, ``_SendState`` after), so the
op's own autograd keeps what its backward needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltafuse.integrations.transformers import cp_exchange as exchange

if TYPE_CHECKING:
    from deltafuse.integrations.transformers.context_parallel import Shard


class _ReceiveState(torch.autograd.Function):
    """The previous rank's final GDN states [B, HV, K, V] (zeros on rank 0). Its output requires a gradient
    whenever one of ``anchors`` (the op's inputs) does, the same condition under which the previous rank's
    ``_SendState`` waits for that gradient; the backward sends it (zeros when autograd has none)."""

    @staticmethod
    def forward(ctx, shard, layer, shape, dtype, *anchors):
        ctx.shard, ctx.count = shard, len(anchors)
        like = anchors[0].new_zeros(shape, dtype=dtype)
        if shard.rank == 0:
            return like
        return exchange.received_once(shard, "state", layer, lambda: exchange.recv(like, shard, -1))

    @staticmethod
    def backward(ctx, grad):
        if ctx.shard.rank > 0:
            exchange.send(grad, ctx.shard, -1)
        return (None, None, None, None) + (None,) * ctx.count


class _SendState(torch.autograd.Function):
    """Identity on the GDN output ``o`` that sends this rank's ``final`` states to the next rank (once per layer
    and model call); its backward receives their gradient from the next rank."""

    @staticmethod
    def forward(ctx, shard, layer, o, final):
        ctx.shard = shard
        ctx.state = (final.shape, final.dtype, final.device)
        if shard.rank < shard.world - 1 and exchange.sends_once(shard, "state", layer):
            exchange.send(final.detach(), shard, +1)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        dfinal = None
        if ctx.shard.rank < ctx.shard.world - 1:
            shape, dtype, device = ctx.state
            dfinal = exchange.recv(torch.empty(shape, dtype=dtype, device=device), ctx.shard, +1)
        return None, None, do, dfinal


def relay_gated_delta_rule(run, q, k, v, g, beta, shard: Shard, layer=None):
    """``run(q, k, v, g, beta, initial_state) -> (o, final state per row)`` on this rank's shard, with the
    state relay to and from the neighbouring ranks (see the module docstring). The exchanges are two autograd
    functions around the op (receive before, send after), so the op's own autograd saves what it needs (freed
    and recomputed under gradient checkpointing like any other layer's) and a recomputation exchanges nothing:
    it reuses the state the first forward received (``layer`` keys it)."""
    state_shape = (shard.batch, v.shape[2], q.shape[3], v.shape[3])
    state_dtype = torch.promote_types(q.dtype, torch.float32)
    if shard.world == 1:
        return run(q, k, v, g, beta, None)[0]
    incoming = _ReceiveState.apply(shard, layer, state_shape, state_dtype, q, k, v, g, beta)
    continues = shard.continues if "relay" not in exchange.DISABLED else (False,) * shard.batch
    # every rank but the first always takes the previous rank's states into its graph (zeroed for rows whose first
    # sequence starts at the edge), so that the gradient the previous rank waits for is always sent back
    mask = torch.tensor(continues, device=incoming.device).view(shard.batch, 1, 1, 1)
    o, final = run(q, k, v, g, beta, incoming * mask.to(incoming.dtype))
    if final.shape != state_shape or final.dtype != state_dtype:
        raise RuntimeError(f"context-parallel GDN: final state {tuple(final.shape)} {final.dtype}, expected "
                           f"{state_shape} {state_dtype}")
    return _SendState.apply(shard, layer, o, final)

