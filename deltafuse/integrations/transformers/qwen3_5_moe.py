"""Qwen3.5-MoE: which objects of ``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe`` deltafuse routes."""

from deltafuse.integrations.transformers.cp_rows import context_parallel_routes
from deltafuse.integrations.transformers.fused_rows import fused_routes, moe_routes
from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap
from deltafuse.integrations.transformers.tiny import TINY_GDN, TINY_MOE

MAP = FamilyMap(
    family="qwen3_5_moe",
    module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    routes=gdn_routes(gdn="Qwen3_5MoeGatedDeltaNet", text_model="Qwen3_5MoeTextModel",
                     decoder_layer="Qwen3_5MoeDecoderLayer")
    + fused_routes(rms_norm="Qwen3_5MoeRMSNorm", rms_norm_gated="Qwen3_5MoeRMSNormGated", mlp="Qwen3_5MoeMLP",
                   causal_lm="Qwen3_5MoeForCausalLM", attention="Qwen3_5MoeAttention")
    + moe_routes(experts="Qwen3_5MoeExperts")
    + context_parallel_routes(gdn="Qwen3_5MoeGatedDeltaNet", text_model="Qwen3_5MoeTextModel",
                              causal_lm="Qwen3_5MoeForCausalLM", attention="Qwen3_5MoeAttention"),
    title="Qwen3.5-MoE",
    config_classes=("Qwen3_5MoeTextConfig", "Qwen3_5MoeConfig"),
    model_classes=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeTextModel",
                   "Qwen3_5MoeModel"),
    tiny_name="tiny-moe",
    tiny_config={k: v for k, v in {**TINY_GDN, **TINY_MOE}.items() if k != "intermediate_size"},
    doc="Qwen3.5-MoE, 4 layers, 8 experts top-2 (CPU)",
)
