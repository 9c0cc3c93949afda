"""Packed sequences: the boundaries of a batch, derived once above the GDN layers and carried to the op adapters.

A batch [B, T] may hold several sequences per row. Without a cache, boundaries come from, in order of
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

One object, ``Packing``, carries the boundaries from the text model to the op adapters, validated when it is
built (``packing_from_*``); nothing downstream derives or validates them again. It also holds the host copy
of the offsets (``offsets``), which the ops read through ``deltafuse.ops._checks.host_offsets`` instead of
copying them back from the accelerator.

The route, in every transformers version:

1. the text-model wrapper derives the ``Packing`` and puts it in the decoder layers' keyword arguments
   (``PACKING_KWARG``; the attention route reads it there);
2. the GDN-layer wrapper takes it from its keywords (5.9+) or, for decoder layers of 5.2-5.8, which call
   ``linear_attn(...)`` without their ``**kwargs``, from the decoder-layer wrapper, which holds it in a
   context variable for its own ``linear_attn`` while it runs;
3. the GDN-layer wrapper holds it while the stock forward runs; the op adapters (``adapters.py``) take it
   from there (``held_packing``) and record that they did. A packed batch that the GDN and conv adapters did
   not both take (ops cached before ``apply``, or a transformers that does not route them) raises
   ``PackingError`` instead of mixing sequences; so does a GDN layer inside a packed text-model call that
   received the boundaries neither way.

Every slot (``_Slot``: a per-thread value with ContextVar's get / set / reset) is set and reset around one
synchronous call (in ``finally``), so nothing outlives it and each thread sees its own; under gradient
checkpointing the recomputation calls the layers with the same keywords and sets them again. The slots are
per-thread attributes rather than ``contextvars`` because dynamo traces attribute reads and writes but not
``ContextVar.get``: ``torch.compile`` of a patched model traces this whole route.

Under ``torch.compile`` the boundaries are derived on the device and never read back while tracing: the
Packing holds only ``seq_idx`` (a cumulative sum; fixed size), not ``cu_seqlens`` (whose size is the number of
sequences: data-dependent) nor ``offsets``; the GDN adapter hands ``seq_idx`` to the custom op
``deltafuse::packed_gated_delta_rule``, which derives the offsets when the graph runs. A batch is then treated
as packed whenever boundaries were looked for (a batch whose rows are its sequences gives the same results
through the packed call). Explicit ``cu_seq_lens_q`` are checked and marked by ``deltafuse::packing_starts``
when the graph runs. Two readings need values and are made as stock makes them while tracing, so that a
traced graph (``torch.compile(fullgraph=True)``, ``torch.export``) holds for every value its inputs may take:
a 2-D ``attention_mask`` is a padding mask (position_ids given with it mark no boundaries, all ones or not),
and [3, B, T] position_ids mark none (equal rows or not). Packed rows under tracing pass no mask, [B, T] or
[4, B, T] position_ids, or ``cu_seq_lens_q`` / ``seq_idx``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from deltafuse.ops import _checks

# Keyword under which the text-model wrapper hands the boundaries to the decoder layers. It travels in their
# **kwargs (recomputed with them under gradient checkpointing, never global state); the GDN wrapper removes it
# before the stock forward runs.
PACKING_KWARG = "deltafuse_packing"

# Keywords transformers uses for explicit boundaries (read by the text-model and GDN wrappers; the GDN wrapper
# removes them before the stock forward runs: the held Packing replaces them).
BOUNDARY_KWARGS = ("cu_seq_lens_q", "seq_idx")


class _Slot(threading.local):
    """A value per thread (None until set) with ContextVar's ``get`` / ``set`` / ``reset``: ``set`` returns the
    token that ``reset`` takes to restore the previous value. Unlike ``contextvars``, dynamo traces it."""

    def __init__(self):
        self.value = None

    def get(self):
        return self.value

    def set(self, value) -> tuple:
        token = (self.value,)
        self.value = value
        return token

    def reset(self, token: tuple) -> None:
        self.value = token[0]


# (GDN layer, Packing) while a decoder layer that holds that GDN layer runs with a packed batch (5.2-5.8).
_LAYER_PACKING = _Slot()
# The Packing of the text-model call in progress: a GDN layer inside it that got no boundaries is an error.
_MODEL_PACKING = _Slot()
# _HeldPacking while the forward of a GDN layer with a packed batch runs: the op adapters take it here.
_OP_PACKING = _Slot()

# Host copies of the offsets of every live Packing: cu_seqlens tensor -> (its version, the offsets).
_HOST_OFFSETS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _known_offsets(cu: torch.Tensor) -> tuple[int, ...] | None:
    """The host copy of ``cu``'s values while ``cu`` is unchanged since a Packing built it, else None."""
    known = _HOST_OFFSETS.get(cu)
    if known is not None and known[0] == cu._version:
        return known[1]
    return None


_checks.register_host_offsets(_known_offsets)


class PackingError(ValueError):
    """Packed-sequence arguments that do not describe the batch they come with."""


@dataclass(frozen=True)
class Packing:
    """Sequence boundaries of a [B, T] batch.

    seq_idx: [B, T] int64, the sequence of every token; ids grow along the flat B*T axis and differ between
        rows, so it serves both causal-conv1d's per-row convention and a flattened call.
    cu_seqlens: [N + 1] int32 offsets of the N sequences on the flat B*T axis; None when derived inside a
        compiled graph (their number is data-dependent there; the ops derive them from seq_idx when it runs).
    offsets: the same offsets as Python ints (known when the boundaries were found: no device read); None
        when derived inside a compiled graph.
    block_causal: the attention mask transformers builds for this batch is exactly "causal within each
        sequence" (no attention mask, no cache, position_ids restarting at these boundaries), so attention may
        be computed sequence by sequence.
    context: under context parallelism, this rank's ``Shard`` (``context_parallel.py``): the batch is one
        contiguous shard of every row, and a row's first sequence may continue the previous rank's last one.
    """

    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor | None
    batch: int
    length: int
    offsets: tuple[int, ...] | None = ()
    block_causal: bool = False
    context: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.offsets is not None and len(self.offsets) != self.cu_seqlens.numel():
            # not given: read once from the tensor
            object.__setattr__(self, "offsets", tuple(int(v) for v in self.cu_seqlens.tolist()))

    @property
    def num_sequences(self) -> int | None:
        """The number of sequences (None when derived inside a compiled graph)."""
        return None if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @property
    def rows_are_sequences(self) -> bool:
        """Every row holds exactly one sequence (the ordinary batched call is then exact). False when the
        offsets are not known on the host (compiled): the packed call is exact in every case."""
        if self.offsets is None:
            return False
        return self.num_sequences == self.batch and all(
            b - a == self.length for a, b in zip(self.offsets, self.offsets[1:]))

    def row_sequences(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of the first and of the last sequence of every row: the sequences of its first and its last
        token."""
        seq_idx = self.seq_idx.to(device=device, dtype=torch.long)
        return seq_idx[:, 0].contiguous(), seq_idx[:, -1].contiguous()

    def positions(self) -> torch.Tensor:
        """[B, T] int64 position of every token within its sequence (0 at each sequence start)."""
        flat = torch.arange(self.batch * self.length, device=self.seq_idx.device)
        if self.cu_seqlens is None:  # compiled: the start of every token's sequence, by a running maximum
            sid = self.seq_idx.reshape(-1)
            is_start = torch.ones_like(sid, dtype=torch.bool)
            is_start[1:] = sid[1:] != sid[:-1]
            first = torch.cummax(torch.where(is_start, flat, torch.zeros_like(flat)), 0).values
            return (flat - first).view(self.batch, self.length)
        starts = self.cu_seqlens.to(device=flat.device, dtype=torch.int64)[:-1]
        return (flat - starts[self.seq_idx.reshape(-1)]).view(self.batch, self.length)

    def check(self, batch: int, length: int | None, where: str) -> None:
        """Raise unless this Packing describes a [batch, length] batch (``length`` None: any length)."""
        if batch != self.batch or (length is not None and length != self.length):
            got = f"[{batch}, {length if length is not None else '?'}]"
            raise PackingError(f"{where} got a {got} batch but its packed-sequence boundaries describe "
                               f"[{self.batch}, {self.length}]")


@dataclass
class _HeldPacking:
    packing: Packing
    used: set = dataclasses.field(default_factory=set)  # "gdn", "conv": the op adapters that took it
    layer: object = None  # the GDN layer whose forward holds it (context parallelism keys its exchanges by it)


@torch.library.custom_op("deltafuse::packing_starts", mutates_args=())
def packing_starts(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[batch, length] bool: True at the first token of every sequence of the offsets ``cu_seqlens`` (on the
    flat axis) and at every row start; the offsets are checked (as ``packing_from_cu_seqlens`` does eagerly)
    when it runs, which inside a compiled graph is when the graph runs."""
    cu = cu_seqlens.to(torch.int64)
    total = batch * length
    _check_given_offsets(cu, total, batch, length)
    flat = torch.zeros(total + 1, dtype=torch.bool, device=cu.device)
    flat[cu] = True  # the end offset marks the extra last slot
    starts = flat[:total].view(batch, length).clone()
    starts[:, 0] = True
    return starts


@packing_starts.register_fake
def _(cu_seqlens, batch, length):
    return cu_seqlens.new_empty((batch, length), dtype=torch.bool)


def packing_from_starts(starts: torch.Tensor) -> Packing | None:
    """Packing from a [B, T] bool tensor marking the first token of every sequence (row starts implied).

    Returns None when every row holds exactly one sequence (the ordinary batched call is then exact). While
    dynamo traces a graph nothing is read back: the Packing holds only ``seq_idx`` and is returned even when
    the rows are the sequences.
    """
    B, T = starts.shape
    if T == 0:
        return None
    starts = starts.clone()
    starts[:, 0] = True
    flat = starts.reshape(-1)
    seq_idx = (flat.to(torch.int64).cumsum(0) - 1).view(B, T)
    if torch.compiler.is_compiling():
        return Packing(seq_idx, None, B, T, None)
    offsets = flat.nonzero().squeeze(1)
    if offsets.numel() == B:
        return None
    end = torch.tensor([B * T], device=offsets.device, dtype=offsets.dtype)
    cu_seqlens = torch.cat([offsets, end]).to(torch.int32)
    # nonzero() above already waited for the device: keep a host copy so that no layer reads it back again
    host = tuple(int(v) for v in offsets.tolist()) + (B * T,)
    remember_host_offsets(cu_seqlens, host)
    return Packing(seq_idx, cu_seqlens, B, T, host)


def remember_host_offsets(cu_seqlens: torch.Tensor, offsets: tuple[int, ...]) -> None:
    """Keep ``offsets``, the values of ``cu_seqlens``, on the host for the ops while the tensor lives unchanged."""
    _HOST_OFFSETS[cu_seqlens] = (cu_seqlens._version, tuple(offsets))


def text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The positions that carry sequence boundaries: [B, T] / [1, T] / [T] as given, the first (text) row of
    [4, B, T], the common row of a [3, B, T] whose three rows are equal (text); None for a [3, B, T] whose
    rows differ (multimodal RoPE, where e.g. image tokens share a temporal position: no sequence signal)."""
    pos = position_ids
    if pos.dim() == 3:
        if pos.shape[0] == 4:
            return pos[0]
        if pos.shape[0] == 3:
            if torch.compiler.is_compiling():  # equal rows or not is unknown while tracing: stock's reading
                return None
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


def _check_given_offsets(cu: torch.Tensor, total: int, batch, length) -> None:
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise PackingError(f"cu_seq_lens_q must run from 0 to B*T = {batch}*{length} = {total} (offsets on the "
                           f"flattened batch), got {first} ... {last}")
    if bool((cu[1:] < cu[:-1]).any()):  # (from 0 to B*T and never decreasing: every offset in range)
        raise PackingError(f"cu_seq_lens_q must not decrease (offsets of consecutive sequences), got "
                           f"{cu.tolist()}")


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> Packing | None:
    """cu_seqlens are offsets on the flat B*T axis; a row start that is not an offset still starts a sequence."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise PackingError(f"cu_seq_lens_q must be a 1-D tensor of at least 2 offsets, got {got}")
    cu = cu_seqlens.to(torch.int64)
    total = batch * length
    if torch.compiler.is_compiling():  # no host read while tracing: checked and marked when the graph runs
        return packing_from_starts(packing_starts(cu_seqlens, batch, length))
    _check_given_offsets(cu, total, batch, length)
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


def held_packing(op: str, batch: int, length: int | None) -> Packing | None:
    """The Packing of the GDN forward in progress, if any, for the op adapter ``op`` ("gdn" or "conv") called
    on a [batch, length] input (``length`` None: not checked); records that ``op`` took it."""
    held = _OP_PACKING.get()
    if held is None:
        return None
    held.packing.check(batch, length, f"the {op} op inside a GDN layer")
    held.used.add(op)
    return held.packing


def held_layer():
    """The GDN layer whose forward is in progress with a held Packing (None outside one)."""
    held = _OP_PACKING.get()
    return None if held is None else held.layer


# --- forward wrappers --------------------------------------------------------------------------------
def call_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, default=None):
    """The value of parameter ``name`` in a call (self excluded from ``args``)."""
    if name in kwargs:
        return kwargs[name]
    params = list(signature.parameters)[1:]  # drop self
    if name in params:
        index = params.index(name)
        if index < len(args):
            return args[index]
    return default


def set_call_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, value) -> tuple:
    params = list(signature.parameters)[1:]
    if name in params and params.index(name) < len(args):
        args = list(args)
        args[params.index(name)] = value
        return tuple(args)
    kwargs[name] = value
    return args


def all_ones_mask(mask) -> bool:
    """A 2-D attention mask that masks nothing (what tokenizers and many collators return for unpadded rows)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 1).all())


def _is_mrope(text_model) -> bool:
    """Whether the model reads [3, B, T] position_ids (interleaved multimodal RoPE: Qwen3.5 families)."""
    return hasattr(getattr(text_model, "rotary_emb", None), "mrope_section")


def _transformers_version() -> str:
    try:
        import transformers  # only for the message; this module never needs it otherwise

        return transformers.__version__
    except Exception:  # pragma: no cover - transformers is what calls this code
        return "?"


# Instance attribute holding the ``Sharding`` of a context-parallel model's modules (context_parallel.py sets it:
# the group and the calls to hand the model's calls to; an attribute lookup, which torch.compile traces, costs
# nothing on other models). Shards of a row reach the op adapters as ``Packing.context``; neither this module
# nor the adapters import context_parallel.
CONTEXT_PARALLEL_ATTR = "_deltafuse_context_parallel"




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
        sharding = getattr(self, CONTEXT_PARALLEL_ATTR, None)
        if sharding is not None:
            return sharding.text_model_forward(original, signature, self, args, kwargs)
        ids = call_argument(signature, args, kwargs, "input_ids")
        embeds = call_argument(signature, args, kwargs, "inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None or ref.dim() < 2:
            return original(self, *args, **kwargs)
        batch, length = int(ref.shape[0]), int(ref.shape[1])
        cache = None
        for name in ("cache", "past_key_values", "cache_params"):
            cache = cache if cache is not None else call_argument(signature, args, kwargs, name)
        explicit = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None
        position_ids = call_argument(signature, args, kwargs, "position_ids")
        if position_ids is None and not explicit:
            return original(self, *args, **kwargs)
        mask = call_argument(signature, args, kwargs, "attention_mask")
        # while torch.compile / torch.export traces, a mask's values are unknown: a given mask is read as stock
        # reads it (a padding mask, position_ids then mark no boundaries), the same for every value it may hold
        mask_free = cache is None and (mask is None or (not torch.compiler.is_compiling() and all_ones_mask(mask)))
        use_positions = position_ids if mask_free else None
        packing = packing_from_kwargs(kwargs, batch, length, use_positions)
        if packing is None:
            return original(self, *args, **kwargs)
        if cache is None:
            if mask is not None and mask_free:
                # transformers builds the packed (block-causal) mask only when no mask is passed
                args = set_call_argument(signature, args, kwargs, "attention_mask", None)
                mask = None
            if position_ids is None:
                # boundaries given only as cu_seq_lens_q / seq_idx: positions restart with every sequence (what
                # RoPE and transformers' packed attention mask need to treat each sequence as if alone)
                args = set_call_argument(signature, args, kwargs, "position_ids", packing.positions())
                explicit = False
            elif (position_ids.dim() == 3 and position_ids.shape[0] == 3 and _is_mrope(self)
                  and text_positions(position_ids) is not None):
                # equal rows: the same RoPE from their [B, T] row, which every version also reads as the text
                # positions of its packed mask (5.15+ read none from a [3, B, T])
                args = set_call_argument(signature, args, kwargs, "position_ids", position_ids[0])
        # transformers' mask is block-causal exactly when it comes from these restarting positions alone
        packing = dataclasses.replace(packing, block_causal=mask is None and cache is None and not explicit)
        return run_packed_text_model(original, signature, self, args, kwargs, packing, cache_off=cache is None)

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_text_model_forward"
    return forward


def run_packed_text_model(original, signature: inspect.Signature, module, args: tuple, kwargs: dict,
                          packing: Packing, cache_off: bool = True):
    """Run the text model's stock ``original`` forward on a packed batch: ``packing`` goes to the decoder layers in
    their keywords (``PACKING_KWARG``) and is held as the model call in progress (a GDN layer that receives it
    neither way is an error); with ``cache_off``, ``use_cache`` is turned off for the call (a cache of a packed
    batch would mix sequences)."""
    kwargs[PACKING_KWARG] = packing
    if cache_off and call_argument(signature, args, kwargs, "use_cache") is not False:
        args = set_call_argument(signature, args, kwargs, "use_cache", False)
    token = _MODEL_PACKING.set(packing)
    try:
        return original(module, *args, **kwargs)
    finally:
        _MODEL_PACKING.reset(token)


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


def wrap_gdn_forward(original):
    """GDN-layer forward that holds the packing for the op adapters while the stock forward runs.

    The packing comes from the keywords (5.9+), else from the decoder layer that holds this layer
    (``_LAYER_PACKING``, 5.2-5.8); called without the text-model wrapper (a layer used on its own), it is
    derived here from ``cu_seq_lens_q`` / ``seq_idx``. Those two keywords never reach the stock forward: the op
    adapters take the held Packing instead (one object from the text model to the kernels, in every design).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        packing = kwargs.pop(PACKING_KWARG, None)
        if packing is None:
            held = _LAYER_PACKING.get()
            if held is not None and held[0] is self:
                packing = held[1]
        hidden = call_argument(signature, args, kwargs, "hidden_states")
        if hidden is None or hidden.dim() != 3:
            return original(self, *args, **kwargs)
        batch, length = int(hidden.shape[0]), int(hidden.shape[1])
        if packing is None:
            packing = packing_from_kwargs(kwargs, batch, length)
        if (packing is None or packing.context is None) and getattr(self, CONTEXT_PARALLEL_ATTR, None) is not None:
            raise PackingError(f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) belongs to a "
                               "context-parallel model but was called outside its text model's forward (which "
                               "shares the sequence boundaries and states between the ranks); call the model")
        for name in BOUNDARY_KWARGS:
            kwargs.pop(name, None)
        if packing is None:
            expected = _MODEL_PACKING.get()
            if expected is not None and (expected.batch, expected.length) == (batch, length):
                raise PackingError(
                    f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) runs inside a packed "
                    f"batch of {expected.num_sequences or 'several'} sequences but received no sequence boundaries: its "
                    f"decoder layer (transformers {_transformers_version()}) passes them neither in its keywords "
                    "nor through a 'linear_attn' attribute; refusing to mix the sequences")
            return original(self, *args, **kwargs)  # one sequence per row: nothing to separate
        packing.check(batch, length, type(self).__name__)
        held = _HeldPacking(packing, layer=self)
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
                "op, so its sequences would mix. A layer built before deltafuse.apply holds the ops transformers "
                "cached then: call deltafuse.apply(model) with this model to re-bind them; otherwise this "
                "transformers version is not supported for packed batches")
        return out

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_gdn_forward"
    return forward
