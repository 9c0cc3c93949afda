"""Qwen3-Next: which objects of ``transformers.models.qwen3_next.modeling_qwen3_next`` deltafuse routes."""

from deltafuse.integrations.transformers.cp_rows import context_parallel_routes
from deltafuse.integrations.transformers.fused_rows import fused_routes, moe_routes
from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap
from deltafuse.integrations.transformers.tiny import TINY_GDN, TINY_MOE

MAP = FamilyMap(
    family="qwen3_next",
    module="transformers.models.qwen3_next.modeling_qwen3_next",
    routes=gdn_routes(gdn="Qwen3NextGatedDeltaNet", text_model="Qwen3NextModel",
                     decoder_layer="Qwen3NextDecoderLayer")
    + fused_routes(rms_norm="Qwen3NextRMSNorm", rms_norm_gated="Qwen3NextRMSNormGated", mlp="Qwen3NextMLP",
                   causal_lm="Qwen3NextForCausalLM", attention="Qwen3NextAttention")
    + moe_routes(experts="Qwen3NextExperts")
    + context_parallel_routes(gdn="Qwen3NextGatedDeltaNet", text_model="Qwen3NextModel",
                              causal_lm="Qwen3NextForCausalLM", attention="Qwen3NextAttention"),
    title="Qwen3-Next",
    config_classes=("Qwen3NextConfig",),
    model_classes=("Qwen3NextForCausalLM", "Qwen3NextModel"),
    tiny_name="tiny-next",
    tiny_config={**TINY_GDN, **TINY_MOE, "norm_topk_prob": True},
    doc="Qwen3-Next, 4 layers, 8 experts top-2 (CPU)",
)
