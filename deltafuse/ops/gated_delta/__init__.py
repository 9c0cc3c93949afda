from deltafuse.ops.gated_delta import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.gated_delta.api import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
