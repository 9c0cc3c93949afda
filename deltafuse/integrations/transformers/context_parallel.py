"""Context parallelism: every row's tokens split into contiguous shards over a process group, computed exactly.

``deltafuse.apply(model, context_parallel=group)``: with W ranks in ``group``, rank r holds tokens
[r*T/W, (r+1)*T/W) of every row ([B, T/W] inputs, the same B and T/W on every rank) with their global
``position_ids`` (packed rows: positions restart at 0 at each sequence start, also inside a shard; a sequence
may cross any shard edge). ``position_ids`` left out mean one sequence per row (global positions r*T/W + t).
Boundaries come from the global positions only: every rank gathers them (B*T integers) and derives the
sequences of the whole row, so a sequence start exactly at a shard edge is seen as such.

What crosses the shards, forward and backward, and nothing else:

* GDN layers (``relay_gated_delta_rule``): rank r receives from rank r-1 the final recurrent state of each
  row's last sequence, runs its shard with it as the initial state of the row's first sequence when that
  sequence continues across the edge (zeros otherwise), and sends its own final states to rank r+1. Backward
  runs the chain in reverse: the gradient of the final state comes from r+1, the initial state's goes to r-1.
  The ranks run one after another (a sequential relay): exact, not yet faster than one rank. The exchanges are
  two autograd functions around the op (``_ReceiveState`` before, ``_SendState`` after), so the op's own
  autograd keeps what its backward needs (and gradient checkpointing frees and recomputes it).
* causal conv1d (``halo_conv1d``): rank r receives the last kernel-1 inputs of rank r-1 as the initial conv
  state, with the positions of another sequence than its first token's zeroed; their gradient goes back.
* full attention (``attention``): K and V of the whole row are all-gathered
  (torch.distributed.nn.functional.all_gather, whose backward is a reduce-scatter; W*L*Hk*D values each, also
  the ranks after this one's, which no local query reads). A local sequence's queries are the last lq of its
  keys (from its start, possibly on an earlier rank, to this shard's end): causal attention aligned at the
  lower right, computed without a mask tensor (``causal_attention_lower_right``): on CUDA in 16-bit one
  ``varlen_attn`` call over every local sequence (separate query and key offsets; flash attention aligns
  causality at the lower right), else one ``scaled_dot_product_attention`` per sequence with torch's
  ``causal_lower_right`` bias (CUDA: the flash kernel with the grouped K/V as they are, or the memory-efficient
  one with K/V heads repeated; CPU: torch builds the [lq, lk] mask, exact in fp32).
* gradient checkpointing (HF's, reentrant or not): what a layer received in its first forward (its conv halo
  and incoming states) is kept on the call's ``Shard`` keyed by the layer; the recomputation inside the
  backward reuses it and sends nothing, so each exchange happens once forward and its gradient once backward.
  Attention's all-gather runs again in the recomputation (a collective every rank reaches in the same order).
* the loss (``causal_lm_forward``): labels are shifted globally (the last token of rank r predicts the first
  label of rank r+1, the last rank's last token nothing); each rank sums the losses of its own tokens, divides
  by the global count of counted targets and the result is all-reduced: ``loss`` on every rank equals the
  single-process mean loss. A ``num_items_in_batch`` given (gradient accumulation: the count over the
  accumulated micro-batches) replaces that count; it must be the same number on every rank, counted over the
  whole rows (the single-process meaning: the loss is the sum over the targets divided by it). The loss's
  backward all-reduces the seed, so each rank's parameter gradients are W times its share: averaged over the
  group (what DDP and FSDP do by default), or summed and divided by W, they equal the single-process
  gradients. So FSDP2 on the same ranks (2-D: parameters and sequence sharded over one group; ``fully_shard``
  the layers and the model after ``apply``) gives the single-process gradients after its reduce-scatter.

Refused (one-line errors naming the argument): a cache, an attention mask with zeros, explicit
``cu_seq_lens_q`` / ``seq_idx``, multimodal [3, B, T] positions, unequal shapes across ranks, shards shorter
than the conv kernel - 1, attention implementations other than ``sdpa``, attention dropout, ``logits_to_keep``,
``return_token_accuracy``, router aux losses, a ``num_items_in_batch`` that differs between the ranks,
torch.compile.

A model's calls reach all this through the ``context_parallel`` rows (``cp_rows.py``, functions in
``cp_adapters.py``), which ``apply`` adds over the ``gdn`` and ``fused_ops`` rows for a context-parallel model
only. This module holds what a model's calls start from: the group's checks, the marking of a model's modules
(``register`` / ``clear``), the ``Shard`` of a call and the text model's forward that derives it. The parts
live beside it: the GDN state relay in ``cp_relay.py``, the conv halo in ``cp_halo.py``, the attention in
``cp_attention.py``, the loss in ``cp_loss.py``, and the exchanges between the ranks (with what a
recomputation reuses) in ``cp_exchange.py``.
"""

from __future__ import annotations

import weakref

import torch

from deltafuse.integrations.transformers import packing as p
from deltafuse.integrations.transformers.boundaries import Packing, text_positions
from deltafuse.integrations.transformers.call_args import all_ones_mask, call_argument, set_call_argument
from deltafuse.integrations.transformers.cp_attention import attention
from deltafuse.integrations.transformers.cp_exchange import (
    ContextParallelError, distributed, gather, refuse, same_shapes,
)
from deltafuse.integrations.transformers.cp_halo import halo_conv1d
from deltafuse.integrations.transformers.cp_loss import causal_lm_forward
from deltafuse.integrations.transformers.cp_relay import relay_gated_delta_rule
from deltafuse.ops._checks import remember_host_offsets

# The modules given the group attribute (``packing.CONTEXT_PARALLEL_ATTR``), to remove it on revert.
_REGISTERED: list = []


def check_group(group) -> object:
    """The group, checked: a torch.distributed ProcessGroup this process belongs to (raises otherwise)."""
    allowed = "None or a torch.distributed ProcessGroup this process belongs to (e.g. dist.group.WORLD)"
    if not torch.distributed.is_available():
        raise TypeError(f"context_parallel={group!r}: torch.distributed is not available in this torch; allowed: "
                        "None")
    dist = distributed()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"context_parallel={group!r} (type {type(group).__name__}); allowed: {allowed}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"context_parallel={group!r}: this process (global rank {dist.get_rank()}) is not a member "
                         f"of the group; allowed: {allowed}")
    if dist.get_world_size(group) < 1:
        raise ValueError(f"context_parallel={group!r} has world size {dist.get_world_size(group)}; allowed: >= 1")
    return group


def check_model(target: torch.nn.Module) -> None:
    """Raise unless every config in ``target`` selects an attention implementation served here (sdpa)."""
    for module in target.modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl is not None and impl != "sdpa":
            raise ValueError(f"context_parallel: the model's attention implementation is {impl!r} "
                             f"({type(module).__name__}.config._attn_implementation); allowed: 'sdpa'")
        dropout = getattr(config, "attention_dropout", 0.0) if config is not None else 0.0
        if dropout:
            raise ValueError(f"context_parallel: attention_dropout={dropout} ({type(module).__name__}.config); "
                             "allowed: 0.0")


class Sharding:
    """What a context-parallel model's modules hold under ``packing.CONTEXT_PARALLEL_ATTR``: the group their
    rows are split over, and the calls the context-parallel rows' text-model and causal-LM forwards
    (``cp_adapters.py``) hand such a model's calls to (so that they never import this module)."""

    def __init__(self, group):
        self.group = group

    def text_model_forward(self, original, signature, module, args, kwargs):
        return text_model_forward(original, signature, module, self.group, args, kwargs)

    def causal_lm_forward(self, inner, positional, module, args, kwargs):
        return causal_lm_forward(inner, positional, module, self.group, args, kwargs)


def register(target: torch.nn.Module, group) -> None:
    """Mark every module of ``target`` as sharding its context over ``group``."""
    sharding = Sharding(group)
    for module in target.modules():
        previous = vars(module).get(p.CONTEXT_PARALLEL_ATTR)
        if getattr(previous, "group", None) is not group:
            vars(module)[p.CONTEXT_PARALLEL_ATTR] = sharding
            _REGISTERED.append((weakref.ref(module), previous))


def mark() -> int:
    return len(_REGISTERED)


def clear(since: int = 0) -> None:
    """Unmark the modules marked after ``mark()`` returned ``since`` (all by default)."""
    for ref, previous in reversed(_REGISTERED[since:]):
        module = ref()
        if module is None:
            continue
        if previous is None:
            vars(module).pop(p.CONTEXT_PARALLEL_ATTR, None)
        else:
            vars(module)[p.CONTEXT_PARALLEL_ATTR] = previous
    del _REGISTERED[since:]


# --- the shard ----------------------------------------------------------------------------------------------
class Shard:
    """Rank ``rank`` of ``world``: columns [rank*length, (rank+1)*length) of [batch, world*length] rows.

    global_seq: [B, T] sequence id of every global token (ids grow along each row and differ between rows);
    continues: per row, whether its first local token continues the previous rank's last sequence;
    first_start: per row, the global column where the sequence of its first local token starts.
    """

    def __init__(self, group, rank: int, world: int, batch: int, length: int, global_seq: torch.Tensor,
                 continues: tuple[bool, ...], first_start: tuple[int, ...]):
        self.group, self.rank, self.world = group, rank, world
        self.batch, self.length = batch, length
        self.global_seq = global_seq
        self.continues = continues
        self.first_start = first_start
        self.attention_calls = 0
        # what this rank received / sent in the first forward of each layer, keyed by (kind, layer): a
        # recomputation under gradient checkpointing reuses it instead of exchanging again
        self.received: dict = {}
        self.sent: set = set()

    @property
    def start(self) -> int:
        return self.rank * self.length

    def peer(self, offset: int) -> int:
        return distributed().get_global_rank(self.group, self.rank + offset)

    # What the context-parallel rows' op adapters and attention (``cp_adapters.py``) call on the
    # ``Packing.context`` of a shard (they never import this module).
    def gated_delta_rule(self, run, q, k, v, g, beta, layer, *, with_cache: bool):
        """The chunked GDN op over this shard, its entry state relayed from the previous rank (``run(q, k, v, g,
        beta, h0) -> (o, final)`` runs it on the local tokens); ``with_cache``: the call has a cache (an initial or
        final state, or the recurrent op), which is refused."""
        if with_cache:
            raise ContextParallelError("context parallelism: a GDN call with a cache (decoding, an initial or a "
                                       "final state); allowed: the chunked op without a cache")
        return relay_gated_delta_rule(run, q, k, v, g, beta, self, layer)

    def conv1d(self, conv, x, weight, bias, activation, seq_idx, layer, *, with_cache: bool):
        """The causal conv ``conv`` over this shard, its first taps received from the previous rank;
        ``with_cache``: the call has initial or final states, which is refused."""
        if with_cache or x.shape[-1] != self.length:
            raise ContextParallelError("context parallelism: a conv call with a cache (initial or final states); "
                                       "allowed: the conv over the shard without a cache")
        return halo_conv1d(conv, x, weight, bias, activation, seq_idx, self, layer)

    def attention(self, module, query, key, value, dropout, scaling, packing):
        """Causal attention of this shard's queries against every rank's keys (``cp_attention.attention``)."""
        return attention(module, query, key, value, dropout, scaling, packing)


def _shard_packing(group, positions: torch.Tensor) -> Packing:
    """The Packing of this rank's [B, L] shard, from its global positions, with the Shard attached."""
    dist = distributed()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, L = positions.shape
    full = torch.cat(gather(positions.to(torch.int64), group), dim=1)  # [B, W*L]
    starts = torch.ones_like(full, dtype=torch.bool)
    starts[:, 1:] = (full[:, 1:] - full[:, :-1]) != 1
    global_seq = (starts.reshape(-1).to(torch.int64).cumsum(0) - 1).view(B, world * L)
    lo = rank * L
    local = starts[:, lo:lo + L].clone()
    continues = tuple(bool(v) for v in (~local[:, 0]).tolist())
    local[:, 0] = True
    first_start = []
    for b in range(B):
        first_start.append(int(starts[b, :lo + 1].nonzero()[-1]))
    flat = local.reshape(-1)
    seq_idx = (flat.to(torch.int64).cumsum(0) - 1).view(B, L)
    offsets = tuple(int(v) for v in flat.nonzero().squeeze(1).tolist()) + (B * L,)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=positions.device)
    remember_host_offsets(cu_seqlens, offsets)
    shard = Shard(group, rank, world, B, L, global_seq, continues, tuple(first_start))
    return Packing(seq_idx, cu_seqlens, B, L, offsets, block_causal=False, context=shard)


def _full_attention_layers(config) -> int | None:
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    return sum(t == "full_attention" for t in types[:getattr(config, "num_hidden_layers", len(types))])


def text_model_forward(original, signature, self, group, args, kwargs):
    """The text model's forward on this rank's shard: derives the Shard and hands it to the layers."""
    if p.PACKING_KWARG in kwargs:
        return original(self, *args, **kwargs)
    if torch.compiler.is_compiling():
        raise refuse("torch.compile of a context-parallel model", "eager calls")
    ids = call_argument(signature, args, kwargs, "input_ids")
    embeds = call_argument(signature, args, kwargs, "inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None or ref.dim() < 2:
        raise refuse("a call without [B, T] input_ids or inputs_embeds", "[B, T/W] tokens of every row")
    B, L = int(ref.shape[0]), int(ref.shape[1])
    for name in ("cache", "past_key_values", "cache_params"):
        if call_argument(signature, args, kwargs, name) is not None:
            raise refuse(f"{name} given (a cache)", "no cache (training and scoring)")
    for name in p.BOUNDARY_KWARGS:
        if kwargs.get(name) is not None:
            raise refuse(f"{name} given", "sequence boundaries as global position_ids only")
    mask = call_argument(signature, args, kwargs, "attention_mask")
    if mask is not None:
        if not all_ones_mask(mask):
            raise refuse("an attention_mask that masks tokens (padding) or is not 2-D",
                         "no attention_mask, or a 2-D one of all ones")
        args = set_call_argument(signature, args, kwargs, "attention_mask", None)
    impl = getattr(self.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise refuse(f"attention implementation {impl!r}", "'sdpa'")
    dist = distributed()
    rank = dist.get_rank(group)
    position_ids = call_argument(signature, args, kwargs, "position_ids")
    if position_ids is None:
        text = (rank * L + torch.arange(L, device=ref.device)).expand(B, L)
    else:
        if position_ids.dim() == 3 and position_ids.shape[0] not in (3, 4):
            raise refuse(f"position_ids of shape {tuple(position_ids.shape)}", "[B, T/W], [1, T/W], [T/W] or "
                         "[3|4, B, T/W]")
        text = text_positions(position_ids)
        if text is None:
            raise refuse("[3, B, T] position_ids whose rows differ (multimodal RoPE)", "text positions")
        if text.dim() == 1:
            text = text[None]
        if text.dim() != 2 or text.shape[1] != L or text.shape[0] not in (1, B):
            raise refuse(f"position_ids of shape {tuple(position_ids.shape)} for a [{B}, {L}] shard",
                         "[B, T/W], [1, T/W], [T/W] or [3|4, B, T/W]")
        text = text.expand(B, L)
        if position_ids.dim() == 3 and position_ids.shape[0] == 3:
            args = set_call_argument(signature, args, kwargs, "position_ids", text)
    same_shapes((B, L), group, "the shard shapes [B, T/W]", ref.device)
    kernel = getattr(self.config, "linear_conv_kernel_dim", 1)
    if dist.get_world_size(group) > 1 and L < kernel - 1:
        raise refuse(f"shards of {L} tokens with a conv kernel of {kernel}", f"at least {kernel - 1} tokens "
                     "per rank")
    packing = _shard_packing(group, text)
    if position_ids is None:
        args = set_call_argument(signature, args, kwargs, "position_ids", text)
    out = p.run_packed_text_model(original, signature, self, args, kwargs, packing)
    expected = _full_attention_layers(self.config)
    if expected is not None and packing.context.attention_calls != expected:
        raise refuse(f"{packing.context.attention_calls} of {expected} full-attention layers ran deltafuse's "
                     "context-parallel attention (the sdpa route is not applied, or a layer calls another "
                     "attention function)", "deltafuse.apply(model, context_parallel=...) with fused_ops on")
    return out
