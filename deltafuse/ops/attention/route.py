"""The registry's choice for transformers' attention calls."""

from __future__ import annotations

from deltafuse import backends
from deltafuse.ops.attention.candidates import PACKED_ATTENTION, SDPA


def stock_attention(*args, **kwargs):
    """Marker chosen by the registry where transformers' function serves; the adapter calls that function."""
    raise RuntimeError("stock_attention is a marker: the caller runs transformers' own attention function")


def _select(op: str, query, key, value):
    return backends.select(op, backends.call_info(query, key, value))


def sdpa_route(query, key, value):
    """The registry's SDPA implementation for these tensors, or None where transformers' own function serves."""
    impl = _select(SDPA, query, key, value)
    return None if impl is stock_attention else impl


def packed_attention(query, key, value):
    """The registry's implementation of sequence-by-sequence causal attention for these tensors."""
    return _select(PACKED_ATTENTION, query, key, value)
