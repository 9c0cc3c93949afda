from deltafuse.ops.moe import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.moe.api import moe_experts

__all__ = ["moe_experts"]
