"""Every map deltafuse applies, assembled in one place above the integrations, and the one patcher that applies them.

The integrations below define rows and import nothing above themselves: one map per model family
(``integrations/transformers/qwen3_5.py`` ...) and one per library built on transformers (TRL's fused LM head,
``integrations/trl.py``; PEFT's LoRA ``Linear``, ``integrations/peft.py``). Their package ``__init__`` files
wire nothing, so every module of the package can be the first one a process imports. Adding a model family:
its map file, and one entry in ``FAMILY_MAPS`` here.
"""

from __future__ import annotations

from deltafuse.integrations import peft, trl  # rows only: importing them imports neither TRL nor PEFT
from deltafuse.integrations.transformers import qwen3_5, qwen3_5_moe, qwen3_next
from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher

FAMILY_MAPS: tuple[FamilyMap, ...] = (qwen3_5.MAP, qwen3_5_moe.MAP, qwen3_next.MAP)
LIBRARY_MAPS: tuple[FamilyMap, ...] = (trl.MAP, peft.MAP)

PATCHER = Patcher(FAMILY_MAPS + LIBRARY_MAPS)

# The ops a training step reaches through each switch's routes: the report's one line says which implementation
# each picks on the model's device (``deltafuse info`` lists every op, decoding ones included).
SWITCH_OPS: dict[str, tuple[str, ...]] = {
    "gdn": ("chunk_gated_delta_rule", "causal_conv1d_fn"),
    "fused_ops": ("rms_norm_zero_centered", "rms_norm_gated", "apply_rotary_pos_emb", "swiglu",
                  "fused_linear_cross_entropy"),
    "moe": ("moe_experts",),
}

__all__ = ["FAMILY_MAPS", "LIBRARY_MAPS", "PATCHER", "SWITCH_OPS"]
