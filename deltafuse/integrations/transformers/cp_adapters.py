"""What the context-parallel rows (``cp_rows.py``) put over the plain ones: each serves the calls of a model
marked for context parallelism (``packing.CONTEXT_PARALLEL_ATTR``, set by ``context_parallel.register``) or of
one shard of its rows (``Packing.context``), and hands every other call, unchanged, to what the plain row put
there (``packing.py``, ``adapters.py``, ``adapters_fused.py``, ``adapters_loss.py``).

* text model ``forward``: a marked model's call derives the rank's shard (``Sharding.text_model_forward``);
* GDN layer ``forward``: a layer of a marked model called outside its text model's forward is refused;
* the GDN ops (chunked and recurrent) and ``causal_conv1d_fn``: a shard's call runs over the ranks
  (``Shard.gated_delta_rule``: the state relay; ``Shard.conv1d``: the halo);
* causal LM ``forward``: labels shifted and the loss reduced across the ranks (``Sharding.causal_lm_forward``);
* the ``sdpa`` attention function: a shard's queries against the keys of the whole row (``Shard.attention``).

Nothing here imports ``context_parallel``: the calls go through the objects the modules and the Packing hold.
"""

from __future__ import annotations

import dataclasses
import functools

from deltafuse import ops
from deltafuse.integrations.transformers import adapters as a
from deltafuse.integrations.transformers.adapters_loss import positional_names
from deltafuse.integrations.transformers.boundaries import PackingError, packing_from_kwargs
from deltafuse.integrations.transformers.call_args import call_argument, call_signature, mark_wrapper
from deltafuse.integrations.transformers.packing import (
    CONTEXT_PARALLEL_ATTR, PACKING_KWARG, held_layer, layer_packing,
)


# --- forwards ------------------------------------------------------------------------------------------------
def wrap_text_model_forward(inner):
    """Text-model forward (over ``packing.wrap_text_model_forward``): a marked model's call derives the Packing of
    the rank's shard and runs ``inner`` with it in the decoder layers' keywords."""
    signature = call_signature(inner)

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        sharding = getattr(self, CONTEXT_PARALLEL_ATTR, None)
        if sharding is None or PACKING_KWARG in kwargs:
            return inner(self, *args, **kwargs)
        return sharding.text_model_forward(inner, signature, self, args, kwargs)

    return mark_wrapper(forward, inner, "context_parallel.wrap_text_model_forward")


def wrap_gdn_forward(inner):
    """GDN-layer forward (over ``packing.wrap_gdn_forward``) that refuses a layer of a marked model called without
    its shard's Packing: outside its text model's forward, which shares the boundaries and states between the
    ranks."""
    signature = call_signature(inner)

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        if getattr(self, CONTEXT_PARALLEL_ATTR, None) is not None:
            packing = kwargs.get(PACKING_KWARG)
            if packing is None:
                packing = layer_packing(self)
            if packing is None or packing.context is None:
                _refuse_outside_model(self, signature, args, kwargs, packing)
        return inner(self, *args, **kwargs)

    return mark_wrapper(forward, inner, "context_parallel.wrap_gdn_forward")


def _refuse_outside_model(layer, signature, args, kwargs, packing) -> None:
    """Raise for a call that the plain GDN forward would run: one with [B, T, C] hidden states (boundaries given
    in ``cu_seq_lens_q`` / ``seq_idx`` that do not fit raise their own error first, as there)."""
    hidden = call_argument(signature, args, kwargs, "hidden_states")
    if hidden is None or hidden.dim() != 3:
        return
    if packing is None:
        packing_from_kwargs(kwargs, int(hidden.shape[0]), int(hidden.shape[1]))
    raise PackingError(f"{type(layer).__name__} (layer {getattr(layer, 'layer_idx', '?')}) belongs to a "
                       "context-parallel model but was called outside its text model's forward (which "
                       "shares the sequence boundaries and states between the ranks); call the model")


def wrap_causal_lm_forward(inner):
    """Causal-LM forward (over ``adapters_loss.wrap_causal_lm_forward``): a marked model's call runs ``inner`` on
    the rank's shard with the labels shifted across the ranks and the loss reduced over them."""
    positional = positional_names(call_signature(inner))

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        sharding = getattr(self, CONTEXT_PARALLEL_ATTR, None)
        if sharding is None:
            return inner(self, *args, **kwargs)
        return sharding.causal_lm_forward(inner, positional, self, args, kwargs)

    return mark_wrapper(forward, inner, "context_parallel.wrap_causal_lm_forward")


def wrap_sdpa_attention(inner):
    """transformers' ``sdpa`` attention function (over ``adapters_fused.wrap_sdpa_attention``): a shard's call
    attends to the keys of the whole row."""

    @functools.wraps(inner)
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
        packing = kwargs.get(PACKING_KWARG)
        if packing is not None and packing.context is not None:
            return packing.context.attention(module, query, key, value, dropout, scaling, packing), None
        return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)

    return mark_wrapper(sdpa_attention_forward, inner, "context_parallel.wrap_sdpa_attention")


# --- op adapters ---------------------------------------------------------------------------------------------
def _gdn(op, q, k, v, g, beta, scale, initial_state, output_final_state, l2, packing):
    if packing is None or packing.context is None:
        return a.gdn_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, l2, packing)
    local = dataclasses.replace(packing, context=None)

    def run(q_, k_, v_, g_, b_, h0):
        return a.gdn_call(op, q_, k_, v_, g_, b_, scale, h0, True, l2, local)

    with_cache = op is not ops.chunk_gated_delta_rule or initial_state is not None or bool(output_final_state)
    return packing.context.gated_delta_rule(run, q, k, v, g, beta, held_layer(), with_cache=with_cache), None


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """``adapters.chunk_gated_delta_rule``; a shard's call relays the recurrent states between the ranks."""
    return _gdn(ops.chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, a.gdn_packing(q, cu_seqlens, kwargs))


def recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                               **kwargs):
    """``adapters.recurrent_gated_delta_rule``; a shard's call is refused (decoding needs a cache)."""
    return _gdn(ops.fused_recurrent_gated_delta_rule, q, k, v, g, beta, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, a.gdn_packing(q, cu_seqlens, kwargs))


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, cu_seqlens=None, **kwargs):
    """``adapters.causal_conv1d_fn``; a shard's call takes its first taps from the previous rank."""
    packing = a.conv_packing(x, seq_idx, cu_seqlens, kwargs)
    if packing is None or packing.context is None:
        return a.conv1d_call(x, weight, bias, packing, initial_states, return_final_states, final_states_out,
                             activation)
    return packing.context.conv1d(ops.causal_conv1d_fn, x, weight, bias, activation, a.conv_seq_idx(x, packing),
                                  held_layer(), with_cache=initial_states is not None or bool(return_final_states))
