"""Attention routes for transformers' attention interface.

Not public ops: transformers' own attention functions serve every call that has no route here. The routes:
Ascend's fused attention kernel (``npu.sdpa_npu``) for npu tensors, and sequence-by-sequence causal attention
(``packed.causal_attention_by_sequence``) for long packed rows whose mask is block-causal.
"""

from __future__ import annotations


def stock_attention(*args, **kwargs):
    """Marker chosen by the registry where transformers' function serves; the adapter calls that function."""
    raise RuntimeError("stock_attention is a marker: the caller runs transformers' own attention function")


def _select(op: str, query, key, value):
    from deltafuse import backends

    return backends.select(op, backends.call_info(query, key, value))


def sdpa_route(query, key, value):
    """The registry's SDPA implementation for these tensors, or None where transformers' own function serves."""
    from deltafuse.backends.attention import SDPA

    impl = _select(SDPA, query, key, value)
    return None if impl is stock_attention else impl


def packed_attention(query, key, value):
    """The registry's implementation of sequence-by-sequence causal attention for these tensors."""
    from deltafuse.backends.attention import PACKED_ATTENTION

    return _select(PACKED_ATTENTION, query, key, value)
