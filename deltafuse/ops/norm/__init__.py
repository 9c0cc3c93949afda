from deltafuse.ops.norm import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.norm.api import rms_norm_gated, rms_norm_zero_centered

__all__ = ["rms_norm_gated", "rms_norm_zero_centered"]
