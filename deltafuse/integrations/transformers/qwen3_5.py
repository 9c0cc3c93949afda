"""Qwen3.5 (dense): which objects of ``transformers.models.qwen3_5.modeling_qwen3_5`` deltafuse routes."""

from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap

MAP = FamilyMap(
    family="qwen3_5",
    module="transformers.models.qwen3_5.modeling_qwen3_5",
    routes=gdn_routes(gdn="Qwen3_5GatedDeltaNet", text_model="Qwen3_5TextModel"),
)
