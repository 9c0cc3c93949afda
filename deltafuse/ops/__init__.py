"""Public ops: pure functions on tensors. The registry picks the implementation for each call."""

from deltafuse.ops.conv1d.api import causal_conv1d_fn, causal_conv1d_update
from deltafuse.ops.gated_delta.api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
]
