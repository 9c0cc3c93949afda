"""transformers integration: one patcher (``patcher.py``) and one map of rows per model family."""

from deltafuse.integrations.transformers import qwen3_5, qwen3_5_moe, qwen3_next
from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher, PatchReport, ReportRow, Route

FAMILY_MAPS: tuple[FamilyMap, ...] = (qwen3_5.MAP, qwen3_5_moe.MAP, qwen3_next.MAP)

PATCHER = Patcher(FAMILY_MAPS)

__all__ = ["FAMILY_MAPS", "PATCHER", "FamilyMap", "Patcher", "PatchReport", "ReportRow", "Route"]
