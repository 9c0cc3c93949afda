"""Context parallelism's loss: labels shifted across the ranks, the loss reduced to the single-process mean.

``causal_lm_forward``: the last token of rank r predicts the first label of rank r+1 (the last rank's last token
nothing); each rank sums the losses of its own tokens, divides by the global count of counted targets (or the
``num_items_in_batch`` given, the same on every rank) and the result is all-reduced, with a backward that
all-reduces the seed (``_SumOverRanks``). ``context_parallel.py`` says what this means for the gradients.
"""

from __future__ import annotations

import torch

from deltafuse.integrations.transformers.cp_exchange import distributed, gather, refuse, same_shapes


def causal_lm_forward(inner, positional, self, group, args, kwargs):
    """The causal LM's forward on this rank's shard, with the labels shifted across ranks and the loss reduced
    to the single-process mean (see the module docstring)."""
    if args:
        if len(args) > len(positional) or any(n in kwargs for n in positional[:len(args)]):
            return inner(self, *args, **kwargs)  # let the stock forward report the bad call
        kwargs = {**dict(zip(positional, args)), **kwargs}
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep != 0:
        raise refuse(f"logits_to_keep={keep!r}", "0")
    if kwargs.get("return_token_accuracy"):
        raise refuse("return_token_accuracy=True", "False")
    if kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False)):
        raise refuse("output_router_logits=True (a router aux loss over this rank's tokens only)", "False")
    labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is None and shift is None:
        return inner(self, **kwargs)
    ignore = kwargs.get("ignore_index", -100)
    target = labels if shift is None else shift
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise refuse(f"labels of shape {getattr(target, 'shape', type(target).__name__)}", "[B, T/W]")
    given = kwargs.get("num_items_in_batch")
    if given is not None:
        _same_count(given, group, target.device)
    same_shapes(tuple(target.shape), group, "the label shapes [B, T/W]", target.device)
    if shift is None:
        dist = distributed()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        firsts = gather(labels[:, :1], group)
        nxt = firsts[rank + 1] if rank + 1 < world else torch.full_like(labels[:, :1], ignore)
        kwargs["shift_labels"] = torch.cat([labels[:, 1:], nxt.to(labels.device)], dim=1)
    elif labels is None:
        kwargs["labels"] = shift  # the stock forward computes a loss only with labels; shift_labels wins
    if given is None:
        count = (kwargs["shift_labels"] != ignore).sum().to(torch.int64)
        distributed().all_reduce(count, group=group)
        kwargs["num_items_in_batch"] = count
    out = inner(self, **kwargs)
    if isinstance(out, tuple):
        return (_SumOverRanks.apply(group, out[0]),) + tuple(out[1:]) if out and out[0] is not None else out
    if out.get("loss") is not None:
        out["loss"] = _SumOverRanks.apply(group, out["loss"])
    return out


def _same_count(given, group, device) -> None:
    """Raise unless ``num_items_in_batch`` is one number, the same on every rank."""
    if isinstance(given, bool) or not isinstance(given, (int, float, torch.Tensor)) or (
            isinstance(given, torch.Tensor) and given.numel() != 1):
        raise refuse(f"num_items_in_batch={given!r}", "None or one number (a Python number or a one-element tensor)")
    value = torch.as_tensor(given, dtype=torch.float64).reshape(1).to(device)
    got = [float(v) for v in torch.cat(gather(value, group)).tolist()]
    if any(v != got[0] for v in got):
        raise refuse(f"num_items_in_batch differs between the ranks: {got}", "the same count on every rank: the "
                     "targets of the whole rows (every rank's shard), summed over the accumulated micro-batches, "
                     "or None (then the count of this call's targets over all ranks)")


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) with autograd: the backward sums the seeds of every rank (each rank seeds its own copy of
    the summed loss), so a rank's gradients are W times its share and their mean over the ranks is exact."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        distributed().all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _SumOverRanks.apply(ctx.group, grad)
