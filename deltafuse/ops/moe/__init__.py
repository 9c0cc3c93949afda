from deltafuse.ops.moe.api import moe_experts

__all__ = ["moe_experts"]
