"""Packed sequences: the route that carries a batch's boundaries from the text model to the op adapters.

The boundaries are read once, above the GDN layers, into one ``Packing`` (``boundaries.py``: what marks a
sequence start, how it is validated, what a compiled graph derives on the device); nothing downstream
derives or validates them again.

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

A context-parallel model (``apply(model, context_parallel=group)``) takes this route with one more layer of rows
over these wrappers (``cp_rows.py``): its text model derives the Packing of the rank's shard (``Packing.context``
holds the ``Shard``) and hands it down the same way; nothing here looks for context parallelism.

Every slot (``_Slot``: a per-thread value with ContextVar's get / set / reset) is set and reset around one
synchronous call (in ``finally``), so nothing outlives it and each thread sees its own; under gradient
checkpointing the recomputation calls the layers with the same keywords and sets them again. The slots are
per-thread attributes rather than ``contextvars`` because dynamo traces attribute reads and writes but not
``ContextVar.get``: ``torch.compile`` of a patched model traces this whole route.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from dataclasses import dataclass

import torch

from deltafuse.integrations.transformers.boundaries import Packing, PackingError, packing_from_kwargs, text_positions
from deltafuse.integrations.transformers.call_args import (all_ones_mask, call_argument, call_signature,
                                                           set_call_argument)

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


@dataclass
class _HeldPacking:
    packing: Packing
    used: set = dataclasses.field(default_factory=set)  # "gdn", "conv": the op adapters that took it
    layer: object = None  # the GDN layer whose forward holds it (context parallelism keys its exchanges by it)


def held_packing(op: str, batch: int, length: int | None) -> Packing | None:
    """The Packing of the GDN forward in progress, if any, for the op adapter ``op`` ("gdn" or "conv") called
    on a [batch, length] input (``length`` None: not checked); records that ``op`` took it."""
    held = _OP_PACKING.get()
    if held is None:
        return None
    held.packing.check(batch, length, f"the {op} op inside a GDN layer")
    held.used.add(op)
    return held.packing


def layer_packing(gdn) -> Packing | None:
    """The Packing a decoder layer of 5.2-5.8 holds for its ``linear_attn`` ``gdn`` while it runs, else None."""
    held = _LAYER_PACKING.get()
    return held[1] if held is not None and held[0] is gdn else None


def held_layer():
    """The GDN layer whose forward is in progress with a held Packing (None outside one)."""
    held = _OP_PACKING.get()
    return None if held is None else held.layer


# --- forward wrappers --------------------------------------------------------------------------------
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
# the group and the calls to hand the model's calls to). Only the context-parallel rows read it (cp_adapters.py),
# and they read shards of a row as ``Packing.context``; neither they nor this module import context_parallel.
CONTEXT_PARALLEL_ATTR = "_deltafuse_context_parallel"


def wrap_text_model_forward(original):
    """Text-model forward that derives the packing once per call and passes it to every decoder layer.

    For a packed batch without a cache: an all-ones 2-D ``attention_mask`` is dropped, equal [3, B, T]
    position_ids of a multimodal-RoPE model are passed as their [B, T] row, and position_ids are derived from
    explicit boundaries when none are given, so that transformers builds its block-causal full-attention mask
    from them (it does so only without a mask and without a cache); ``use_cache`` is turned off for this call
    (a cache of a packed batch would mix sequences).
    """
    signature = call_signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if PACKING_KWARG in kwargs:
            return original(self, *args, **kwargs)
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
    signature = call_signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        packing = kwargs.pop(PACKING_KWARG, None)
        if packing is None:
            packing = layer_packing(self)
        hidden = call_argument(signature, args, kwargs, "hidden_states")
        if hidden is None or hidden.dim() != 3:
            return original(self, *args, **kwargs)
        batch, length = int(hidden.shape[0]), int(hidden.shape[1])
        if packing is None:
            packing = packing_from_kwargs(kwargs, batch, length)
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
