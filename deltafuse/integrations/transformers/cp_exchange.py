"""Context parallelism's exchanges between the ranks of a group, and the errors of the layer.

Collectives every rank reaches in the same order (``gather``, ``same_shapes``), point-to-point sends and
receives between neighbouring ranks (``send``, ``recv``, ``shift``), and the bookkeeping that makes each
layer's exchange happen once per model call under gradient checkpointing (``received_once``, ``sends_once``:
the recomputation inside the backward reuses what the first forward received and sends nothing). The GDN state
relay (``cp_relay.py``) and the conv halo (``cp_halo.py``) are built on them; ``context_parallel.py`` describes
the whole layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltafuse.integrations.transformers.context_parallel import Shard

# Exchanges a test may turn off to show that the parity tests see them ("relay", "halo"); never set otherwise.
DISABLED: set = set()


class ContextParallelError(ValueError):
    """A call that context parallelism cannot compute exactly."""


def distributed():
    """``torch.distributed``, imported when a context-parallel call first needs it."""
    import torch.distributed as dist

    return dist


def refuse(what: str, allowed: str) -> ContextParallelError:
    """The one-line error of a call context parallelism refuses: what was given and what is allowed."""
    return ContextParallelError(f"context parallelism: {what}; allowed: {allowed}")


# --- collectives ----------------------------------------------------------------------------------------------
def gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (the same shape on each), in rank order."""
    dist = distributed()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def same_shapes(shape: tuple[int, ...], group, what: str, device) -> None:
    """Raise unless ``shape`` (``what``, for the message) is the same on every rank."""
    shapes = gather(torch.tensor(shape, dtype=torch.int64, device=device), group)
    got = [tuple(int(v) for v in s.tolist()) for s in shapes]
    if any(s != got[0] for s in got):
        raise refuse(f"{what} differ between the ranks: {got}", "the same shape on every rank (rank r holds "
                     "tokens [r*T/W, (r+1)*T/W) of every row)")


# --- point-to-point exchanges ----------------------------------------------------------------------------------
def send(tensor: torch.Tensor, shard: Shard, offset: int) -> None:
    """Send ``tensor`` to rank + ``offset`` of the shard's group."""
    distributed().send(tensor.contiguous(), dst=shard.peer(offset), group=shard.group)


def recv(like: torch.Tensor, shard: Shard, offset: int) -> torch.Tensor:
    """Receive a tensor shaped as ``like`` from rank + ``offset`` of the shard's group."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    distributed().recv(out, src=shard.peer(offset), group=shard.group)
    return out


def shift(tensor: torch.Tensor, shard: Shard, to: int) -> torch.Tensor:
    """Send ``tensor`` to rank + ``to`` and receive the same shape from rank - ``to`` (zeros where that rank does
    not exist); every rank posts both before waiting (deadlock-free for any W)."""
    dist = distributed()
    out = torch.zeros_like(tensor, memory_format=torch.contiguous_format)
    works = []
    if 0 <= shard.rank - to < shard.world:
        works.append(dist.irecv(out, src=shard.peer(-to), group=shard.group))
    if 0 <= shard.rank + to < shard.world:
        works.append(dist.isend(tensor.contiguous(), dst=shard.peer(to), group=shard.group))
    for work in works:
        work.wait()
    return out


# --- exchanges under recomputation ----------------------------------------------------------------------------
def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: gradient checkpointing recomputing a layer (reentrant or
    not), the only way a context-parallel model's layers run there."""
    return torch._C._current_graph_task_id() != -1


def _refuse_unless_recomputing(layer) -> None:
    """A layer's exchange seen a second time in one model call: only a recomputation may do that."""
    if not _recomputing():
        raise refuse(f"{type(layer).__name__} (layer {getattr(layer, 'layer_idx', '?')}) ran twice in one model "
                     "call outside a recomputation", "each layer once per call (gradient checkpointing recomputes "
                     "it inside the backward)")


def received_once(shard: Shard, kind: str, layer, receive) -> torch.Tensor:
    """What ``receive()`` returns, received once per layer and model call: the first forward receives it (and
    keeps it, detached, on the Shard); a recomputation of the same layer under gradient checkpointing gets a copy
    of the same values without exchanging anything (the neighbour sends nothing then: its recomputation does not
    send either). The gradients are exchanged by the backward of the graph that autograd runs, once."""
    key = (kind, layer)
    kept = shard.received.get(key)
    if kept is not None:
        _refuse_unless_recomputing(layer)
        return kept.clone()
    if layer is None:
        raise RuntimeError(f"context-parallel {kind}: called outside a GDN layer's forward (no layer to key the "
                           "exchange by)")
    value = receive()
    shard.received[key] = value.detach()
    return value


def sends_once(shard: Shard, kind: str, layer) -> bool:
    """Whether to send now: in the first forward of the layer, not in its recomputation."""
    key = (kind, layer)
    if key in shard.sent:
        _refuse_unless_recomputing(layer)
        return False
    shard.sent.add(key)
    return True

