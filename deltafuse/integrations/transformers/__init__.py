"""transformers integration: one patcher (``patcher.py``) and one map of rows per model family, plus the maps of
libraries built on transformers (TRL's fused LM head, ``deltafuse.integrations.trl``; PEFT's LoRA ``Linear``,
``deltafuse.integrations.peft``)."""

from deltafuse.integrations.transformers import qwen3_5, qwen3_5_moe, qwen3_next
from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher, PatchReport, ReportRow, Route

FAMILY_MAPS: tuple[FamilyMap, ...] = (qwen3_5.MAP, qwen3_5_moe.MAP, qwen3_next.MAP)


def _library_maps() -> tuple[FamilyMap, ...]:
    from deltafuse.integrations import peft, trl  # rows only: importing them does not import TRL or PEFT

    return (trl.MAP, peft.MAP)


LIBRARY_MAPS: tuple[FamilyMap, ...] = _library_maps()

PATCHER = Patcher(FAMILY_MAPS + LIBRARY_MAPS)

__all__ = ["FAMILY_MAPS", "LIBRARY_MAPS", "PATCHER", "FamilyMap", "Patcher", "PatchReport", "ReportRow", "Route"]
