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
"""

from __future__ import annotations

import weakref

import torch

from deltafuse.integrations.transformers import packing as p

# Exchanges a test may turn off to show that the parity tests see them ("relay", "halo"); never set otherwise.
_DISABLED: set = set()

# The modules given the group attribute (``packing.CONTEXT_PARALLEL_ATTR``), to remove it on revert.
_REGISTERED: list = []


class ContextParallelError(ValueError):
    """A call that context parallelism cannot compute exactly."""


def _dist():
    import torch.distributed as dist

    return dist


def check_group(group) -> object:
    """The group, checked: a torch.distributed ProcessGroup this process belongs to (raises otherwise)."""
    allowed = "None or a torch.distributed ProcessGroup this process belongs to (e.g. dist.group.WORLD)"
    if not torch.distributed.is_available():
        raise TypeError(f"context_parallel={group!r}: torch.distributed is not available in this torch; allowed: "
                        "None")
    dist = _dist()
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
    rows are split over, and the calls the text-model and causal-LM wrappers hand such a model's calls to (so
    that they never import this module)."""

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


def _refuse(what: str, allowed: str) -> ContextParallelError:
    return ContextParallelError(f"context parallelism: {what}; allowed: {allowed}")


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
        return _dist().get_global_rank(self.group, self.rank + offset)

    # What the op adapters call on the ``Packing.context`` of a shard (they never import this module).
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
        """Causal attention of this shard's queries against every rank's keys (module function ``attention``)."""
        return attention(module, query, key, value, dropout, scaling, packing)


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    dist = _dist()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _same_shapes(shape: tuple[int, ...], group, what: str, device) -> None:
    shapes = _gather(torch.tensor(shape, dtype=torch.int64, device=device), group)
    got = [tuple(int(v) for v in s.tolist()) for s in shapes]
    if any(s != got[0] for s in got):
        raise _refuse(f"{what} differ between the ranks: {got}", "the same shape on every rank (rank r holds "
                      "tokens [r*T/W, (r+1)*T/W) of every row)")


def _shard_packing(group, positions: torch.Tensor) -> p.Packing:
    """The Packing of this rank's [B, L] shard, from its global positions, with the Shard attached."""
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, L = positions.shape
    full = torch.cat(_gather(positions.to(torch.int64), group), dim=1)  # [B, W*L]
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
    p.remember_host_offsets(cu_seqlens, offsets)
    shard = Shard(group, rank, world, B, L, global_seq, continues, tuple(first_start))
    return p.Packing(seq_idx, cu_seqlens, B, L, offsets, block_causal=False, context=shard)


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
        raise _refuse("torch.compile of a context-parallel model", "eager calls")
    ids = p.call_argument(signature, args, kwargs, "input_ids")
    embeds = p.call_argument(signature, args, kwargs, "inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None or ref.dim() < 2:
        raise _refuse("a call without [B, T] input_ids or inputs_embeds", "[B, T/W] tokens of every row")
    B, L = int(ref.shape[0]), int(ref.shape[1])
    for name in ("cache", "past_key_values", "cache_params"):
        if p.call_argument(signature, args, kwargs, name) is not None:
            raise _refuse(f"{name} given (a cache)", "no cache (training and scoring)")
    for name in p.BOUNDARY_KWARGS:
        if kwargs.get(name) is not None:
            raise _refuse(f"{name} given", "sequence boundaries as global position_ids only")
    mask = p.call_argument(signature, args, kwargs, "attention_mask")
    if mask is not None:
        if not p.all_ones_mask(mask):
            raise _refuse("an attention_mask that masks tokens (padding) or is not 2-D",
                          "no attention_mask, or a 2-D one of all ones")
        args = p.set_call_argument(signature, args, kwargs, "attention_mask", None)
    impl = getattr(self.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise _refuse(f"attention implementation {impl!r}", "'sdpa'")
    dist = _dist()
    rank = dist.get_rank(group)
    position_ids = p.call_argument(signature, args, kwargs, "position_ids")
    if position_ids is None:
        text = (rank * L + torch.arange(L, device=ref.device)).expand(B, L)
    else:
        if position_ids.dim() == 3 and position_ids.shape[0] not in (3, 4):
            raise _refuse(f"position_ids of shape {tuple(position_ids.shape)}", "[B, T/W], [1, T/W], [T/W] or "
                          "[3|4, B, T/W]")
        text = p.text_positions(position_ids)
        if text is None:
            raise _refuse("[3, B, T] position_ids whose rows differ (multimodal RoPE)", "text positions")
        if text.dim() == 1:
            text = text[None]
        if text.dim() != 2 or text.shape[1] != L or text.shape[0] not in (1, B):
            raise _refuse(f"position_ids of shape {tuple(position_ids.shape)} for a [{B}, {L}] shard",
                          "[B, T/W], [1, T/W], [T/W] or [3|4, B, T/W]")
        text = text.expand(B, L)
        if position_ids.dim() == 3 and position_ids.shape[0] == 3:
            args = p.set_call_argument(signature, args, kwargs, "position_ids", text)
    _same_shapes((B, L), group, "the shard shapes [B, T/W]", ref.device)
    kernel = getattr(self.config, "linear_conv_kernel_dim", 1)
    if dist.get_world_size(group) > 1 and L < kernel - 1:
        raise _refuse(f"shards of {L} tokens with a conv kernel of {kernel}", f"at least {kernel - 1} tokens "
                      "per rank")
    packing = _shard_packing(group, text)
    if position_ids is None:
        args = p.set_call_argument(signature, args, kwargs, "position_ids", text)
    out = p.run_packed_text_model(original, signature, self, args, kwargs, packing)
    expected = _full_attention_layers(self.config)
    if expected is not None and packing.context.attention_calls != expected:
        raise _refuse(f"{packing.context.attention_calls} of {expected} full-attention layers ran deltafuse's "
                      "context-parallel attention (the sdpa route is not applied, or a layer calls another "
                      "attention function)", "deltafuse.apply(model, context_parallel=...) with fused_ops on")
    return out


# --- point-to-point exchanges with autograd ------------------------------------------------------------------
def _send(tensor: torch.Tensor, shard: Shard, offset: int) -> None:
    _dist().send(tensor.contiguous(), dst=shard.peer(offset), group=shard.group)


def _recv(like: torch.Tensor, shard: Shard, offset: int) -> torch.Tensor:
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    _dist().recv(out, src=shard.peer(offset), group=shard.group)
    return out


def _exchange(tensor: torch.Tensor, shard: Shard, to: int) -> torch.Tensor:
    """Send ``tensor`` to rank + ``to`` and receive the same shape from rank - ``to`` (zeros where that rank does
    not exist); every rank posts both before waiting (deadlock-free for any W)."""
    dist = _dist()
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
        raise _refuse(f"{type(layer).__name__} (layer {getattr(layer, 'layer_idx', '?')}) ran twice in one model "
                      "call outside a recomputation", "each layer once per call (gradient checkpointing recomputes "
                      "it inside the backward)")


def _received_once(shard: Shard, kind: str, layer, receive) -> torch.Tensor:
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


def _sends_once(shard: Shard, kind: str, layer) -> bool:
    """Whether to send now: in the first forward of the layer, not in its recomputation."""
    key = (kind, layer)
    if key in shard.sent:
        _refuse_unless_recomputing(layer)
        return False
    shard.sent.add(key)
    return True


class _Halo(torch.autograd.Function):
    """The previous rank's ``tail`` (zeros on rank 0); backward returns the gradient to where it came from."""

    @staticmethod
    def forward(ctx, shard, layer, tail):
        ctx.shard = shard
        return _received_once(shard, "halo", layer, lambda: _exchange(tail, shard, +1))

    @staticmethod
    def backward(ctx, grad):
        return None, None, _exchange(grad, ctx.shard, -1)


def halo_conv1d(conv, x, weight, bias, activation, seq_idx, shard: Shard, layer=None):
    """``conv(x, weight, bias, seq_idx=..., initial_states=..., activation=...)`` on this rank's shard with the
    previous rank's last W-1 inputs as the initial state of each row's first sequence (positions of another
    sequence zeroed: a boundary at or just before the edge stops it). ``layer``: the GDN layer calling it (its
    halo is received once per model call, see ``_received_once``)."""
    W = weight.shape[1]
    if W == 1 or shard.world == 1:
        return conv(x, weight, bias, seq_idx=seq_idx, activation=activation)
    B, C, L = x.shape
    if L < W - 1:
        raise _refuse(f"a conv input of {L} tokens with a kernel of {W}", f"at least {W - 1} tokens per rank")
    halo = _Halo.apply(shard, layer, x[:, :, L - (W - 1):])
    if shard.rank == 0 or "halo" in _DISABLED:
        keep = torch.zeros(B, W - 1, dtype=torch.bool, device=x.device)
    else:
        seq = shard.global_seq.to(x.device)
        keep = seq[:, shard.start - (W - 1):shard.start] == seq[:, shard.start:shard.start + 1]
    initial = halo * keep[:, None, :].to(halo.dtype)
    return conv(x, weight, bias, seq_idx=seq_idx, initial_states=initial, activation=activation)


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
        return _received_once(shard, "state", layer, lambda: _recv(like, shard, -1))

    @staticmethod
    def backward(ctx, grad):
        if ctx.shard.rank > 0:
            _send(grad, ctx.shard, -1)
        return (None, None, None, None) + (None,) * ctx.count


class _SendState(torch.autograd.Function):
    """Identity on the GDN output ``o`` that sends this rank's ``final`` states to the next rank (once per layer
    and model call); its backward receives their gradient from the next rank."""

    @staticmethod
    def forward(ctx, shard, layer, o, final):
        ctx.shard = shard
        ctx.state = (final.shape, final.dtype, final.device)
        if shard.rank < shard.world - 1 and _sends_once(shard, "state", layer):
            _send(final.detach(), shard, +1)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        dfinal = None
        if ctx.shard.rank < ctx.shard.world - 1:
            shape, dtype, device = ctx.state
            dfinal = _recv(torch.empty(shape, dtype=dtype, device=device), ctx.shard, +1)
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
    continues = shard.continues if "relay" not in _DISABLED else (False,) * shard.batch
    # every rank but the first always takes the previous rank's states into its graph (zeroed for rows whose first
    # sequence starts at the edge), so that the gradient the previous rank waits for is always sent back
    mask = torch.tensor(continues, device=incoming.device).view(shard.batch, 1, 1, 1)
    o, final = run(q, k, v, g, beta, incoming * mask.to(incoming.dtype))
    if final.shape != state_shape or final.dtype != state_dtype:
        raise RuntimeError(f"context-parallel GDN: final state {tuple(final.shape)} {final.dtype}, expected "
                           f"{state_shape} {state_dtype}")
    return _SendState.apply(shard, layer, o, final)


# --- attention ------------------------------------------------------------------------------------------------
def attention_segments(packing: p.Packing, shard: Shard) -> list[tuple[int, int, int, int, int]]:
    """(row b, first local query i0, query count lq, first key k0, key count lk) of every local sequence: its
    queries are the columns [i0, i0 + lq) of the shard, its keys the global columns [k0, k0 + lk) of the row,
    from its start to the shard's last query of it. The queries are the last lq of the keys: causal attention
    aligned at the lower right (query i sees keys up to k0 + lk - lq + i). Within a row the key ranges of its
    local sequences are consecutive: together [first_start[b], shard end)."""
    L = packing.length
    out = []
    for s, e in zip(packing.offsets[:-1], packing.offsets[1:]):
        b = s // L
        i0, lq = s - b * L, e - s
        g0 = shard.start + i0
        k0 = shard.first_start[b] if i0 == 0 else g0
        out.append((b, i0, lq, k0, g0 + lq - k0))
    return out


def _flash_takes_gqa(query, key, value) -> bool:
    """Whether torch's flash kernel serves this call with fewer key/value heads as they are (CUDA, 16-bit, head
    size <= 256): ``causal_lower_right`` then reaches it without a mask and without repeating K/V."""
    if query.device.type != "cuda":
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        return bool(can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, True)))
    except (ImportError, TypeError, RuntimeError):
        return False


def _repeat_heads(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Each key/value head ``group`` times in a row (repeat_interleave's order) through one expand + reshape."""
    if group == 1:
        return x
    shape = list(x.shape)
    expanded = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], group, *shape[dim + 1:])
    shape[dim] *= group
    return expanded.reshape(shape)


def _by_sequence(query, key, value, segments, scaling):
    """One ``scaled_dot_product_attention`` per local sequence with torch's lower-right causal bias (no mask
    tensor on CUDA: the flash kernel (16-bit, head size <= 256, grouped K/V as they are) or the memory-efficient
    one (K/V heads repeated); CPU builds the [lq, lk] mask itself and computes in the given dtype)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    B, Hq, L, D = query.shape
    group = Hq // key.shape[1]
    native = group == 1 or query.device.type != "cuda" or _flash_takes_gqa(query[:1, :, :1], key[:1, :, :1],
                                                                            value[:1, :, :1])
    rows = [[] for _ in range(B)]
    for b, i0, lq, k0, lk in segments:
        q = query[b:b + 1, :, i0:i0 + lq]
        k, v = key[b:b + 1, :, k0:k0 + lk], value[b:b + 1, :, k0:k0 + lk]
        if not native:
            k, v = _repeat_heads(k, group, 1), _repeat_heads(v, group, 1)
        rows[b].append(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), scale=scaling,
                                                      enable_gqa=native and group > 1))
    out = torch.cat([torch.cat(parts, dim=2) for parts in rows], dim=0)
    return out.transpose(1, 2).contiguous()


def _varlen(query, key, value, segments, scaling, cu_q):
    """All local sequences in one ``varlen_attn`` call (flash attention, CUDA, 16-bit): queries flattened on the
    B*L axis, keys the concatenated key ranges of the rows, causal (flash aligns it at the lower right when a
    sequence has more keys than queries). None when this torch or this call cannot use it."""
    from deltafuse.ops.attention.packed import VARLEN_MAX_HEAD_DIM, varlen_api, varlen_causal_call

    api = varlen_api()
    B, Hq, L, D = query.shape
    if (api is None or query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16)
            or D > VARLEN_MAX_HEAD_DIM or key.dtype != query.dtype or value.shape[-1] != D):
        return None
    if not api[2] and not (scaling is None or scaling == D ** -0.5):  # a torch without scale=
        return None
    q = query.transpose(1, 2).reshape(B * L, Hq, D)
    spans = []  # per row, its consecutive key range
    for b in range(B):
        mine = [s for s in segments if s[0] == b]
        spans.append((b, mine[0][3], mine[-1][3] + mine[-1][4]))
    k = torch.cat([key[b, :, lo:hi].transpose(0, 1) for b, lo, hi in spans])
    v = torch.cat([value[b, :, lo:hi].transpose(0, 1) for b, lo, hi in spans])
    lengths_k = [s[4] for s in segments]
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int64).cumsum(0).to(device=query.device, dtype=torch.int32)
    kwargs, k, v = varlen_causal_call(api, scaling, Hq, k, v)
    out = api[0](q, k, v, cu_q.to(device=query.device, dtype=torch.int32), cu_k,
                 max(s[2] for s in segments), max(lengths_k), **kwargs)
    return out.view(B, L, Hq, D)


def causal_attention_lower_right(query, key, value, segments, scaling=None, cu_seqlens_q=None):
    """Local queries [B, Hq, L, D] against the gathered keys/values [B, Hk, T, D] of their rows, sequence by
    sequence as ``segments`` (``attention_segments``) says; returns [B, L, Hq, D] (contiguous). No [lq, lk] mask
    and no repeated K/V on CUDA: ``varlen_attn`` (one call, 16-bit) when ``cu_seqlens_q`` (the local offsets) are
    given and it serves the call, else the per-sequence loop (``_by_sequence``)."""
    B, Hq, L, D = query.shape
    if Hq % key.shape[1]:
        raise ValueError(f"query has {Hq} heads and key {key.shape[1]}; the query heads must be a multiple of the "
                         "key heads")
    if cu_seqlens_q is not None:
        out = _varlen(query, key, value, segments, scaling, cu_seqlens_q)
        if out is not None:
            return out
    return _by_sequence(query, key, value, segments, scaling)


def attention(module, query, key, value, dropout, scaling, packing: p.Packing):
    """Causal attention of the local queries [B, Hq, L, D] against every rank's keys of their own sequence.
    Returns [B, L, Hq, D] (contiguous), what transformers' attention functions return.

    K and V of the whole row are all-gathered (the ranks after this one included, although only the keys up to
    this shard's end are used: W*L*Hk*D values each, 64 MiB per tensor at 65,536 tokens with 2 K/V heads of 256
    in bf16); under gradient checkpointing the recomputation gathers them again (a collective every rank runs in
    the same order)."""
    shard = packing.context
    if dropout:
        raise _refuse(f"attention dropout {dropout}", "0.0 (config.attention_dropout=0 or model.eval())")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; the query heads must be a "
                         "multiple of the key heads")
    if shard.world > 1:
        from torch.distributed.nn.functional import all_gather

        Hk = key.shape[1]
        both = torch.cat([key, value], dim=1) if key.shape[-1] == value.shape[-1] else None
        if both is not None:
            full = torch.cat(all_gather(both, group=shard.group), dim=2)
            key, value = full[:, :Hk], full[:, Hk:]
        else:
            key = torch.cat(all_gather(key, group=shard.group), dim=2)
            value = torch.cat(all_gather(value, group=shard.group), dim=2)
    shard.attention_calls += 1
    return causal_attention_lower_right(query, key, value, attention_segments(packing, shard), scaling,
                                        packing.cu_seqlens)


# --- the loss -----------------------------------------------------------------------------------------------
def causal_lm_forward(inner, positional, self, group, args, kwargs):
    """The causal LM's forward on this rank's shard, with the labels shifted across ranks and the loss reduced
    to the single-process mean (see the module docstring)."""
    if args:
        if len(args) > len(positional) or any(n in kwargs for n in positional[:len(args)]):
            return inner(self, *args, **kwargs)  # let the stock forward report the bad call
        kwargs = {**dict(zip(positional, args)), **kwargs}
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep != 0:
        raise _refuse(f"logits_to_keep={keep!r}", "0")
    if kwargs.get("return_token_accuracy"):
        raise _refuse("return_token_accuracy=True", "False")
    if kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False)):
        raise _refuse("output_router_logits=True (a router aux loss over this rank's tokens only)", "False")
    labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is None and shift is None:
        return inner(self, **kwargs)
    ignore = kwargs.get("ignore_index", -100)
    target = labels if shift is None else shift
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise _refuse(f"labels of shape {getattr(target, 'shape', type(target).__name__)}", "[B, T/W]")
    given = kwargs.get("num_items_in_batch")
    if given is not None:
        _same_count(given, group, target.device)
    _same_shapes(tuple(target.shape), group, "the label shapes [B, T/W]", target.device)
    if shift is None:
        dist = _dist()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        firsts = _gather(labels[:, :1], group)
        nxt = firsts[rank + 1] if rank + 1 < world else torch.full_like(labels[:, :1], ignore)
        kwargs["shift_labels"] = torch.cat([labels[:, 1:], nxt.to(labels.device)], dim=1)
    elif labels is None:
        kwargs["labels"] = shift  # the stock forward computes a loss only with labels; shift_labels wins
    if given is None:
        count = (kwargs["shift_labels"] != ignore).sum().to(torch.int64)
        _dist().all_reduce(count, group=group)
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
        raise _refuse(f"num_items_in_batch={given!r}", "None or one number (a Python number or a one-element tensor)")
    value = torch.as_tensor(given, dtype=torch.float64).reshape(1).to(device)
    got = [float(v) for v in torch.cat(_gather(value, group)).tolist()]
    if any(v != got[0] for v in got):
        raise _refuse(f"num_items_in_batch differs between the ranks: {got}", "the same count on every rank: the "
                      "targets of the whole rows (every rank's shard), summed over the accumulated micro-batches, "
                      "or None (then the count of this call's targets over all ranks)")


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) with autograd: the backward sums the seeds of every rank (each rank seeds its own copy of
    the summed loss), so a rank's gradients are W times its share and their mean over the ranks is exact."""

    @staticmethod
    def forward(ctx, group, tensor):
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        _dist().all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, _SumOverRanks.apply(ctx.group, grad)
