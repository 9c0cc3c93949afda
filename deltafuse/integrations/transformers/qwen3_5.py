"""Qwen3.5 (dense): which objects of ``transformers.models.qwen3_5.modeling_qwen3_5`` deltafuse routes."""

from deltafuse.integrations.transformers.fused_rows import fused_routes
from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap

MAP = FamilyMap(
    family="qwen3_5",
    module="transformers.models.qwen3_5.modeling_qwen3_5",
    routes=gdn_routes(gdn="Qwen3_5GatedDeltaNet", text_model="Qwen3_5TextModel",
                     decoder_layer="Qwen3_5DecoderLayer")
    + fused_routes(rms_norm="Qwen3_5RMSNorm", rms_norm_gated="Qwen3_5RMSNormGated", mlp="Qwen3_5MLP",
                   causal_lm="Qwen3_5ForCausalLM", attention="Qwen3_5Attention"),
)
