from deltafuse.ops.cross_entropy.api import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]
