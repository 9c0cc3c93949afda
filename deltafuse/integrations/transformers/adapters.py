"""Thin functions that present deltafuse's ops with the call signatures transformers uses, plus packing.

Two kinds of function live here, and nothing else:

* op adapters (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
  ``causal_conv1d_update``): accept every way the GDN layers of transformers 5.x call these ops (old design:
  instance attributes called with FLA / causal-conv1d keywords; new design: module functions called with
  the layer's whole ``**kwargs``), turn the packed-sequence arguments into deltafuse's (``cu_seqlens`` on a
  flat token axis, ``seq_idx`` per token), and call ``deltafuse.ops``, which picks the implementation per
  call through the backend registry.
* forward wrappers (``wrap_text_model_forward``, ``wrap_decoder_layer_forward``, ``wrap_gdn_forward``): derive
  sequence boundaries once per model forward above the GDN layer (which never sees ``position_ids``) and hand
  them to every GDN layer, in the names each design forwards to its ops (``cu_seq_lens_q``, ``seq_idx``).

Packing. A batch [B, T] may hold several sequences per row. Without a cache, boundaries come from, in order of
precedence, ``cu_seq_lens_q`` (offsets on the flat B*T axis), ``seq_idx`` ([B, T], a sequence id per token) or
``position_ids``: a new sequence starts wherever the position does not grow by exactly 1 (transformers' own
rule for its packed attention mask). position_ids count when there is no attention mask or a 2-D mask of all
ones; they are read from [B, T] / [1, T] / [T], from the first (text) row of [4, B, T], and from [3, B, T] when
its three rows are equal (text; rows that differ are a multimodal RoPE layout, no boundary signal). Every row
start is a boundary too: sequences never span rows. For a packed batch, an all-ones 2-D mask is dropped and
equal [3, B, T] positions are passed as their one [B, T] row, so that transformers builds its block-causal
mask for the full-attention layers from the restarting positions in every version. A mask with zeros (padding)
or a 4-D mask is kept as given: position_ids are then positions only, and only ``cu_seq_lens_q`` / ``seq_idx``
separate sequences (in the GDN and conv layers; the full-attention layers follow the given mask).
When rows hold several sequences, the GDN op runs once on the flattened [1, B*T] axis with the combined
offsets, and the result is reshaped back; recurrent states map between rows and sequences (a row's initial
state continues its first sequence, its final state is that of its last sequence).

How the boundaries reach the GDN layers. The text model puts them in the decoder layers' keyword arguments
(``deltafuse_packing``; the attention route reads them there). Decoder layers of transformers 5.2-5.8 call
``linear_attn(...)`` without their ``**kwargs``, so the decoder-layer wrapper also holds the boundaries in a
context variable, for its own ``linear_attn`` and for the duration of its call only (reset in ``finally``;
under gradient checkpointing the recomputation calls the decoder layer with the same keywords and sets it
again). A GDN layer that runs inside a packed text-model call and receives the boundaries neither way raises
``PackingError`` instead of mixing sequences.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch

from deltafuse import ops
from deltafuse.ops._checks import remember_host_offsets

# Keyword under which the text-model wrapper hands the boundaries to the decoder layers. It travels in their
# **kwargs (recomputed with them under gradient checkpointing, never global state); the GDN wrapper removes it
# before the stock forward runs.
PACKING_KWARG = "deltafuse_packing"

# (GDN layer, Packing) while a decoder layer that holds that GDN layer runs with a packed batch: the route to
# GDN layers whose decoder layer does not forward its **kwargs (transformers 5.2-5.8). Set and reset around
# each decoder-layer call, so nothing outlives the call (and each thread / task sees its own).
_LAYER_PACKING: contextvars.ContextVar = contextvars.ContextVar("deltafuse_layer_packing", default=None)
# The Packing of the text-model call in progress: a GDN layer inside it that got no boundaries is an error.
_MODEL_PACKING: contextvars.ContextVar = contextvars.ContextVar("deltafuse_model_packing", default=None)
# _HeldPacking while the forward of a GDN layer that takes no **kwargs (5.2-5.8: it calls its ops without
# boundaries) runs: the op adapters read the boundaries here and record that they did.
_OP_PACKING: contextvars.ContextVar = contextvars.ContextVar("deltafuse_op_packing", default=None)

# Keywords transformers forwards along with the GDN op calls that do not change the maths.
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "seq_idx")


class PackingError(ValueError):
    """Packed-sequence arguments that do not describe the batch they come with."""


@dataclass(frozen=True)
class Packing:
    """Sequence boundaries of a [B, T] batch.

    seq_idx: [B, T] int64, the sequence of every token; ids grow along the flat B*T axis and differ between
        rows, so it serves both causal-conv1d's per-row convention and a flattened call.
    cu_seqlens: [N + 1] int32 offsets of the N sequences on the flat B*T axis.
    block_causal: the attention mask transformers builds for this batch is exactly "causal within each
        sequence" (no attention mask, no cache, position_ids restarting at these boundaries), so attention may
        be computed sequence by sequence.
    """

    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor
    batch: int
    length: int
    block_causal: bool = False

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def positions(self) -> torch.Tensor:
        """[B, T] int64 position of every token within its sequence (0 at each sequence start)."""
        flat = torch.arange(self.batch * self.length, device=self.seq_idx.device)
        starts = self.cu_seqlens.to(device=flat.device, dtype=torch.int64)[:-1]
        return (flat - starts[self.seq_idx.reshape(-1)]).view(self.batch, self.length)

    def check(self, batch: int, length: int, where: str) -> None:
        if (batch, length) != (self.batch, self.length):
            raise PackingError(f"{where}: packed-sequence boundaries describe a [{self.batch}, {self.length}] "
                               f"batch but the hidden states are [{batch}, {length}]")


@dataclass
class _HeldPacking:
    packing: Packing
    used: set = dataclasses.field(default_factory=set)  # "gdn", "conv": the op adapters that applied it


def packing_from_starts(starts: torch.Tensor) -> Packing | None:
    """Packing from a [B, T] bool tensor marking the first token of every sequence (row starts implied).

    Returns None when every row holds exactly one sequence (the ordinary batched call is then exact).
    """
    B, T = starts.shape
    if T == 0:
        return None
    starts = starts.clone()
    starts[:, 0] = True
    flat = starts.reshape(-1)
    offsets = flat.nonzero().squeeze(1)
    if offsets.numel() == B:
        return None
    seq_idx = (flat.to(torch.int64).cumsum(0) - 1).view(B, T)
    end = torch.tensor([B * T], device=offsets.device, dtype=offsets.dtype)
    cu_seqlens = torch.cat([offsets, end]).to(torch.int32)
    # nonzero() above already waited for the device: keep a host copy so that no layer reads it back again
    remember_host_offsets(cu_seqlens, offsets.tolist() + [B * T])
    return Packing(seq_idx, cu_seqlens, B, T)


def text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The positions that carry sequence boundaries: [B, T] / [1, T] / [T] as given, the first (text) row of
    [4, B, T], the common row of a [3, B, T] whose three rows are equal (text); None for a [3, B, T] whose
    rows differ (multimodal RoPE, where e.g. image tokens share a temporal position: no sequence signal)."""
    pos = position_ids
    if pos.dim() == 3:
        if pos.shape[0] == 4:
            return pos[0]
        if pos.shape[0] == 3:
            return pos[0] if bool((pos[1:] == pos[:1]).all()) else None
    return pos


def packing_from_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> Packing | None:
    """Boundaries where the position does not grow by 1 (transformers' ``find_packed_sequence_indices``),
    read from the rows ``text_positions`` picks."""
    if position_ids.dim() == 3 and position_ids.shape[0] not in (3, 4):
        raise PackingError(f"position_ids of shape {tuple(position_ids.shape)} do not fit a [{batch}, {length}] "
                           "batch; expected [B, T], [1, T], [T] or [3|4, B, T]")
    pos = text_positions(position_ids)
    if pos is None:
        return None
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
        raise PackingError(f"position_ids of shape {tuple(position_ids.shape)} do not fit a [{batch}, {length}] "
                           "batch; expected [B, T], [1, T], [T] or [3|4, B, T]")
    pos = pos.expand(batch, length)
    if length < 2:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    return packing_from_starts(starts)


def packing_from_seq_idx(seq_idx: torch.Tensor, batch: int, length: int) -> Packing | None:
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or tuple(seq_idx.shape) != (batch, length):
        got = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise PackingError(f"seq_idx must be a [B, T] = [{batch}, {length}] integer tensor, got {got}")
    if length < 2:
        return None
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return packing_from_starts(starts)


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> Packing | None:
    """cu_seqlens are offsets on the flat B*T axis; a row start that is not an offset still starts a sequence."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise PackingError(f"cu_seq_lens_q must be a 1-D tensor of at least 2 offsets, got {got}")
    cu = cu_seqlens.to(torch.int64)
    total = batch * length
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise PackingError(f"cu_seq_lens_q must run from 0 to B*T = {batch}*{length} = {total} (offsets on the "
                               f"flattened batch), got {first} ... {last}")
    flat = torch.zeros(total, dtype=torch.bool, device=cu.device)
    offsets = cu[:-1]
    flat[offsets[offsets < total]] = True  # an empty trailing sequence starts at the end: no token to mark
    return packing_from_starts(flat.view(batch, length))


def packing_from_kwargs(kwargs: dict, batch: int, length: int, position_ids=None) -> Packing | None:
    """Boundaries from explicit packed-sequence keywords, else from restarting position_ids (or None)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return packing_from_cu_seqlens(kwargs["cu_seq_lens_q"], batch, length)
    if kwargs.get("seq_idx") is not None:
        return packing_from_seq_idx(kwargs["seq_idx"], batch, length)
    if position_ids is not None:
        return packing_from_position_ids(position_ids, batch, length)
    return None


# --- forward wrappers --------------------------------------------------------------------------------
def _argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, default=None):
    """The value of parameter ``name`` in a call (self excluded from ``args``)."""
    if name in kwargs:
        return kwargs[name]
    params = list(signature.parameters)[1:]  # drop self
    if name in params:
        index = params.index(name)
        if index < len(args):
            return args[index]
    return default


def _set_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, value) -> tuple:
    params = list(signature.parameters)[1:]
    if name in params and params.index(name) < len(args):
        args = list(args)
        args[params.index(name)] = value
        return tuple(args)
    kwargs[name] = value
    return args


def _all_ones_mask(mask) -> bool:
    """A 2-D attention mask that masks nothing (what tokenizers and many collators return for unpadded rows)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 1).all())


def wrap_text_model_forward(original):
    """Text-model forward that derives the packing once per call and passes it to every decoder layer.

    For a packed batch without a cache: an all-ones 2-D ``attention_mask`` is dropped, equal [3, B, T]
    position_ids of a multimodal-RoPE model are passed as their [B, T] row, and position_ids are derived from
    explicit boundaries when none are given, so that transformers builds its block-causal full-attention mask
    from them (it does so only without a mask and without a cache); ``use_cache`` is turned off for this call
    (a cache of a packed batch would mix sequences).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if PACKING_KWARG in kwargs:
            return original(self, *args, **kwargs)
        ids = _argument(signature, args, kwargs, "input_ids")
        embeds = _argument(signature, args, kwargs, "inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None or ref.dim() < 2:
            return original(self, *args, **kwargs)
        batch, length = int(ref.shape[0]), int(ref.shape[1])
        cache = None
        for name in ("cache", "past_key_values", "cache_params"):
            cache = cache if cache is not None else _argument(signature, args, kwargs, name)
        explicit = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None
        position_ids = _argument(signature, args, kwargs, "position_ids")
        if position_ids is None and not explicit:
            return original(self, *args, **kwargs)
        mask = _argument(signature, args, kwargs, "attention_mask")
        mask_free = cache is None and (mask is None or _all_ones_mask(mask))
        use_positions = position_ids if mask_free else None
        packing = packing_from_kwargs(kwargs, batch, length, use_positions)
        if packing is None:
            return original(self, *args, **kwargs)
        if cache is None:
            if mask is not None and mask_free:
                # transformers builds the packed (block-causal) mask only when no mask is passed
                args = _set_argument(signature, args, kwargs, "attention_mask", None)
                mask = None
            if position_ids is None:
                # boundaries given only as cu_seq_lens_q / seq_idx: positions restart with every sequence (what
                # RoPE and transformers' packed attention mask need to treat each sequence as if alone)
                args = _set_argument(signature, args, kwargs, "position_ids", packing.positions())
                explicit = False
            elif (position_ids.dim() == 3 and position_ids.shape[0] == 3 and _is_mrope(self)
                  and text_positions(position_ids) is not None):
                # equal rows: the same RoPE from their [B, T] row, which every version also reads as the text
                # positions of its packed mask (5.15+ read none from a [3, B, T])
                args = _set_argument(signature, args, kwargs, "position_ids", position_ids[0])
        # transformers' mask is block-causal exactly when it comes from these restarting positions alone
        packing = dataclasses.replace(packing, block_causal=mask is None and cache is None and not explicit)
        kwargs[PACKING_KWARG] = packing
        if cache is None and _argument(signature, args, kwargs, "use_cache") is not False:
            args = _set_argument(signature, args, kwargs, "use_cache", False)
        token = _MODEL_PACKING.set(packing)
        try:
            return original(self, *args, **kwargs)
        finally:
            _MODEL_PACKING.reset(token)

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_text_model_forward"
    return forward


def _is_mrope(text_model) -> bool:
    """Whether the model reads [3, B, T] position_ids (interleaved multimodal RoPE: Qwen3.5 families)."""
    return hasattr(getattr(text_model, "rotary_emb", None), "mrope_section")


def wrap_decoder_layer_forward(original):
    """Decoder-layer forward that holds the packing of its keywords for its own ``linear_attn`` while it runs.

    transformers 5.2-5.8 call ``self.linear_attn(hidden_states, cache_params, cache_position, attention_mask)``
    without the layer's ``**kwargs``; the boundaries reach the GDN wrapper through ``_LAYER_PACKING`` there.
    Under gradient checkpointing the recomputation calls this forward with the same keywords again.
    """
    if getattr(getattr(original, "__code__", None), "co_name", "") == "forward_with_checkpointing":
        # newer transformers checkpoint the class's forward and compare it by identity: wrapping it would turn
        # gradient checkpointing off (their decoder layers pass the boundaries in their keywords anyway)
        raise RuntimeError(f"wrap_decoder_layer_forward: {original.__qualname__} is transformers' checkpointing "
                           "forward, which must stay the class attribute; this row is for transformers 5.2-5.14")

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        packing = kwargs.get(PACKING_KWARG)
        gdn = getattr(self, "linear_attn", None) if packing is not None else None
        if gdn is None:
            return original(self, *args, **kwargs)
        token = _LAYER_PACKING.set((gdn, packing))
        try:
            return original(self, *args, **kwargs)
        finally:
            _LAYER_PACKING.reset(token)

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_decoder_layer_forward"
    return forward


def _transformers_version() -> str:
    try:
        import transformers  # only for the message; this module never needs it otherwise

        return transformers.__version__
    except Exception:  # pragma: no cover - transformers is what calls this code
        return "?"


def wrap_gdn_forward(original):
    """GDN-layer forward that presents the packing in the keywords the stock forward hands to its ops.

    Both designs forward ``kwargs["cu_seq_lens_q"]`` to the chunked GDN op as ``cu_seqlens``; the old design
    forwards ``kwargs["seq_idx"]`` to the conv, the new one all of ``kwargs``. The packing comes from the
    keywords (5.9+), else from the decoder layer that holds this layer (``_LAYER_PACKING``); called without
    the text-model wrapper (a layer used on its own), the boundaries are derived here from the keywords.
    """
    signature = inspect.signature(original)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        packing = kwargs.pop(PACKING_KWARG, None)
        if packing is None:
            held = _LAYER_PACKING.get()
            if held is not None and held[0] is self:
                packing = held[1]
        hidden = _argument(signature, args, kwargs, "hidden_states")
        if hidden is None or hidden.dim() != 3:
            return original(self, *args, **kwargs)
        batch, length = int(hidden.shape[0]), int(hidden.shape[1])
        if packing is None:
            packing = packing_from_kwargs(kwargs, batch, length)
        if packing is None:
            expected = _MODEL_PACKING.get()
            if expected is not None and (expected.batch, expected.length) == (batch, length):
                raise PackingError(
                    f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) runs inside a packed "
                    f"batch of {expected.num_sequences} sequences but received no sequence boundaries: its "
                    f"decoder layer (transformers {_transformers_version()}) passes them neither in its keywords "
                    "nor through a 'linear_attn' attribute; refusing to mix the sequences")
            # explicit boundaries that hold one sequence per row: nothing to separate
            for name in _BOUNDARY_KWARGS:
                kwargs.pop(name, None)
            return original(self, *args, **kwargs)
        packing.check(batch, length, type(self).__name__)
        _check_cached_ops(self)
        if takes_kwargs:
            kwargs["cu_seq_lens_q"] = packing.cu_seqlens
            kwargs["seq_idx"] = packing.seq_idx
            return original(self, *args, **kwargs)
        # 5.2-5.8: the stock forward calls its (instance-bound, deltafuse) ops without boundaries
        held = _HeldPacking(packing)
        token = _OP_PACKING.set(held)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _OP_PACKING.reset(token)
        if held.used != {"gdn", "conv"}:
            missing = sorted({"gdn", "conv"} - held.used)
            raise PackingError(
                f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}, transformers "
                f"{_transformers_version()}) ran a packed batch without calling deltafuse's {' and '.join(missing)} "
                "op, so its sequences may have mixed; this transformers version is not supported for packed batches")
        return out

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_gdn_forward"
    return forward


# Ops an old-design GDN layer caches in __init__ (transformers <= 5.14): name -> what deltafuse binds there.
_CACHED_OPS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")


def _check_cached_ops(layer) -> None:
    """A packed batch must not reach the ops a layer cached before deltafuse was applied to it: transformers'
    torch fallback ignores the boundaries (state leaks from one sequence into the next)."""
    attrs = vars(layer)
    stale = [name for name in _CACHED_OPS if name in attrs and attrs[name] is not _BOUND[name]]
    if stale:
        raise PackingError(
            f"{type(layer).__name__} (layer {getattr(layer, 'layer_idx', '?')}) got a packed batch but still "
            f"holds the ops transformers cached when it was built ({', '.join(stale)}), which let state leak "
            "across packed sequences; call deltafuse.apply(model) with this model to re-bind them")


# --- op adapters -------------------------------------------------------------------------------------
def _row_sequences(cu: torch.Tensor, batch: int, length: int):
    """Index of the first and of the last sequence of every row, for offsets on the flat B*T axis."""
    row_starts = torch.arange(batch, device=cu.device, dtype=cu.dtype) * length
    first = torch.searchsorted(cu, row_starts, right=True) - 1
    last = torch.searchsorted(cu, row_starts + length, right=False) - 1
    return first, last


def _gdn_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              cu_seqlens, seq_idx):
    B, T = q.shape[:2]
    if cu_seqlens is None and seq_idx is not None:
        packing = packing_from_seq_idx(seq_idx, B, T)
        cu_seqlens = None if packing is None else packing.cu_seqlens
    if cu_seqlens is None:
        return op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if cu_seqlens.device != q.device:
        cu_seqlens = cu_seqlens.to(q.device)
    cu = cu_seqlens.to(torch.int64)
    N = cu.numel() - 1
    rows_are_sequences = N == B and B > 1 and bool((cu[1:] - cu[:-1] == T).all())
    if rows_are_sequences:
        return op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    first = last = None
    state = initial_state
    if initial_state is not None or output_final_state:
        first, last = _row_sequences(cu, B, T)
    if initial_state is not None and not (B == 1 and N == 1):
        if initial_state.shape[0] != B:
            raise PackingError(f"initial_state has {initial_state.shape[0]} rows but the batch has B={B}")
        state = initial_state.new_zeros((N,) + tuple(initial_state.shape[1:]))
        state[first] = initial_state
    flat = [t.reshape((1, B * T) + tuple(t.shape[2:])) for t in (q, k, v, g, beta)]
    o, final = op(*flat, scale=scale, initial_state=state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    o = o.reshape((B, T) + tuple(o.shape[2:]))
    if final is not None and final.shape[0] != B:
        final = final[last]
    return o, final


def _boundary_arguments(cu_seqlens, kwargs):
    """cu_seqlens / seq_idx from an op call; every other keyword transformers forwards is dropped."""
    if cu_seqlens is None:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
    return cu_seqlens, kwargs.get("seq_idx")


def _held_packing(op: str, batch: int, length: int | None) -> Packing | None:
    """The boundaries of the GDN forward in progress (5.2-5.8, which calls its ops without them), if any;
    records that ``op`` ("gdn" or "conv") applied them."""
    held = _OP_PACKING.get()
    if held is None:
        return None
    packing = held.packing
    if batch != packing.batch or (length is not None and length != packing.length):
        raise PackingError(f"the {op} op got a [{batch}, {length if length is not None else '?'}] batch inside a "
                           f"GDN layer whose packed-sequence boundaries describe [{packing.batch}, {packing.length}]")
    held.used.add(op)
    return packing


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """``chunk_gated_delta_rule`` as every transformers design calls it (FLA's signature plus the layer's
    keywords); q/k may have H heads (5.23+) or HV heads (repeated, up to 5.22)."""
    cu_seqlens, seq_idx = _boundary_arguments(cu_seqlens, kwargs)
    if cu_seqlens is None and seq_idx is None:
        held = _held_packing("gdn", q.shape[0], q.shape[1])
        cu_seqlens = None if held is None else held.cu_seqlens
    return _gdn_call(ops.chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens, seq_idx)


def recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                               **kwargs):
    """The decoding GDN op (``fused_recurrent_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``)."""
    cu_seqlens, seq_idx = _boundary_arguments(cu_seqlens, kwargs)
    if cu_seqlens is None and seq_idx is None:
        held = _held_packing("gdn", q.shape[0], q.shape[1])
        cu_seqlens = None if held is None else held.cu_seqlens
    return _gdn_call(ops.fused_recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state,
                     output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, seq_idx)


def _conv_seq_idx(x: torch.Tensor, seq_idx, cu_seqlens) -> torch.Tensor | None:
    """seq_idx [B, x.shape[-1]] for the conv, or None when every row is one sequence.

    The boundaries describe the T new tokens; when the layer prepended cached inputs (a cache continuing a
    prefix), the extra leading columns belong to each row's first sequence.
    """
    B, _, L = x.shape
    if seq_idx is None and cu_seqlens is None:
        return None
    if seq_idx is None:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        total = int(cu[-1])
        if total % B != 0:
            raise PackingError(f"cu_seqlens end at {total}, which is not B*T for a batch of B={B} rows")
        T = total // B
        packing = packing_from_cu_seqlens(cu, B, T)
        if packing is None:
            return None
        seq_idx = packing.seq_idx
    seq_idx = seq_idx.to(device=x.device, dtype=torch.int64)
    if seq_idx.dim() != 2 or seq_idx.shape[0] != B or seq_idx.shape[1] > L:
        raise PackingError(f"seq_idx of shape {tuple(seq_idx.shape)} does not fit the conv input [B, C, T] = "
                           f"{tuple(x.shape)}")
    extra = L - seq_idx.shape[1]
    if extra:
        seq_idx = torch.cat([seq_idx[:, :1].expand(B, extra), seq_idx], 1)
    return seq_idx.contiguous()


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, cu_seqlens=None, **kwargs):
    """Causal depthwise conv as both designs call it: causal-conv1d's keywords (old), or the layer's kwargs
    with ``cu_seq_lens_q`` / ``seq_idx`` (new). x [B, C, T], weight [C, W]."""
    cu_seqlens, kw_seq_idx = _boundary_arguments(cu_seqlens, kwargs)
    seq_idx = seq_idx if seq_idx is not None else kw_seq_idx
    if seq_idx is None and cu_seqlens is None:
        held = _held_packing("conv", x.shape[0], None)
        seq_idx = None if held is None else held.seq_idx
    sid = _conv_seq_idx(x, seq_idx, cu_seqlens)
    return ops.causal_conv1d_fn(x, weight, bias, seq_idx=sid, initial_states=initial_states,
                                return_final_states=return_final_states, final_states_out=final_states_out,
                                activation=activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **kwargs):
    """One decoding step of the conv; conv_state [B, C, S >= W-1] is updated in place."""
    return ops.causal_conv1d_update(x, conv_state, weight, bias, activation)


# what apply(model) binds for each cached op (the adapter of the same name)
_BOUND = {name: globals()[name] for name in _CACHED_OPS}
