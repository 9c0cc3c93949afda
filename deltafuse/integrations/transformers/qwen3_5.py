"""Qwen3.5 (dense): which objects of ``transformers.models.qwen3_5.modeling_qwen3_5`` deltafuse routes."""

from deltafuse.integrations.transformers.cp_rows import context_parallel_routes
from deltafuse.integrations.transformers.fused_rows import fused_routes
from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap
from deltafuse.integrations.transformers.tiny import TINY_GDN

MAP = FamilyMap(
    family="qwen3_5",
    module="transformers.models.qwen3_5.modeling_qwen3_5",
    routes=gdn_routes(gdn="Qwen3_5GatedDeltaNet", text_model="Qwen3_5TextModel",
                     decoder_layer="Qwen3_5DecoderLayer")
    + fused_routes(rms_norm="Qwen3_5RMSNorm", rms_norm_gated="Qwen3_5RMSNormGated", mlp="Qwen3_5MLP",
                   causal_lm="Qwen3_5ForCausalLM", attention="Qwen3_5Attention")
    + context_parallel_routes(gdn="Qwen3_5GatedDeltaNet", text_model="Qwen3_5TextModel",
                              causal_lm="Qwen3_5ForCausalLM", attention="Qwen3_5Attention"),
    title="Qwen3.5",
    config_classes=("Qwen3_5TextConfig", "Qwen3_5Config"),
    model_classes=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5TextModel", "Qwen3_5Model"),
    tiny_name="tiny",
    tiny_config=dict(TINY_GDN),
    doc="Qwen3.5 dense, 4 layers, hidden 64 (CPU)",
)
