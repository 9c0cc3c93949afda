"""Public ops: pure functions on tensors. The registry picks the implementation for each call.

Each op folder declares its candidates (``candidates.py``) and registers them when it is imported, before
anything else of the op. Importing this package imports every op folder, in the order below, so the set and
the order of the registered backends are always the same, whichever op module was asked for first.
"""

# isort: off
from deltafuse.ops.gated_delta.api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from deltafuse.ops.conv1d.api import causal_conv1d_fn, causal_conv1d_update
from deltafuse.ops.norm.api import rms_norm_gated, rms_norm_zero_centered
from deltafuse.ops.rope.api import apply_rotary_pos_emb
from deltafuse.ops.swiglu.api import swiglu
from deltafuse.ops.cross_entropy.api import fused_linear_cross_entropy, token_logprobs
from deltafuse.ops.moe.api import moe_experts
from deltafuse.ops import attention  # noqa: F401  (transformers' attention routes: registers their candidates)
# isort: on

__all__ = [
    "apply_rotary_pos_emb",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_linear_cross_entropy",
    "fused_recurrent_gated_delta_rule",
    "moe_experts",
    "rms_norm_gated",
    "rms_norm_zero_centered",
    "swiglu",
    "token_logprobs",
]
