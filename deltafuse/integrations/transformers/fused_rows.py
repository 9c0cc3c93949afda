"""The block-op, loss (switch ``fused_ops``) and experts (switch ``moe``) rows, built from a family's class names.

Both transformers designs (5.2-5.14 and 5.15+) define these classes and the module global
``apply_rotary_pos_emb`` (looked up by the attention forward at call time) in the same way, so the rows
have ``design="any"``. Old design with FLA importable: GDN layers built before ``apply`` hold FLA's
``FusedRMSNormGated`` instead of ``*RMSNormGated``; the ``gdn`` rows make models built afterwards use the
torch class, built ones keep FLA's norm (the note on the row says so, only where the module's
``FusedRMSNormGated`` is FLA's: the new design has no such global, and the old one sets it to None without FLA).
"""

from __future__ import annotations

from deltafuse.integrations.transformers import adapters_fused as f
from deltafuse.integrations.transformers import adapters_loss as loss
from deltafuse.integrations.transformers.patcher import Route

EXPERTS_MAPPING = "transformers.integrations.moe.ExpertsInterface._global_mapping"
ATTENTION_MAPPING = "transformers.modeling_utils.AttentionInterface._global_mapping"


def fused_routes(rms_norm: str, rms_norm_gated: str, mlp: str, causal_lm: str, attention: str) -> tuple[Route, ...]:
    """Norm, RoPE, SwiGLU, loss and attention rows for a family whose zero-centred norm class is ``rms_norm``,
    gated norm ``rms_norm_gated``, dense MLP / shared expert ``mlp``, causal LM ``causal_lm`` and full attention
    layer ``attention``."""
    return (
        Route("fused_ops", "class", rms_norm, "forward", f.wrap_rms_norm_forward, wrap=True),
        Route("fused_ops", "class", rms_norm_gated, "forward", f.wrap_rms_norm_gated_forward, wrap=True,
              note="old design with FLA installed: GDN layers built before apply hold FLA's FusedRMSNormGated, "
                   "which is left as it is", note_if="FusedRMSNormGated"),
        Route("fused_ops", "global", "", "apply_rotary_pos_emb", f.wrap_apply_rotary_pos_emb, wrap=True),
        Route("fused_ops", "class", mlp, "forward", f.wrap_mlp_forward, wrap=True,
              note="SiLU activations only; other activations run the stock forward"),
        Route("fused_ops", "class", causal_lm, "forward", loss.wrap_causal_lm_forward, wrap=True,
              note="fused loss with labels and gradients on; logits returned by the stock path (no grad, "
                   f"logits_to_keep != 0, return_dict=False, {loss.SKIP_LOGITS_KWARG}=False or "
                   f"{loss.LOGITS_KWARG}=True); {loss.ACCURACY_KWARG}=True adds {loss.ACCURACY_FIELD}"),
        # transformers' "sdpa" attention function (shared by every model that selects sdpa)
        Route("fused_ops", "mapping", attention, "sdpa", f.wrap_sdpa_attention, wrap=True, mapping=ATTENTION_MAPPING,
              note="causal self-attention on npu tensors through the registry's route (Ascend's fused kernel); "
                   f"packed rows of >= {f.PACKED_ATTENTION_MIN_TOKENS} tokens sequence by sequence; other calls "
                   "run transformers' function"),
    )


def moe_routes(experts: str) -> tuple[Route, ...]:
    """Experts rows for a family whose experts class is ``experts`` (decorated with transformers'
    ``use_experts_implementation``, which dispatches by ``config._experts_implementation``)."""
    return (
        # the name in transformers' experts interface (from_pretrained(experts_implementation="deltafuse"),
        # model.set_experts_implementation("deltafuse")) ...
        Route("moe", "mapping", experts, f.EXPERTS_NAME, f.experts_forward, mapping=EXPERTS_MAPPING,
              note="plain experts use ops.moe_experts; other layouts transformers' grouped_mm"),
        # ... and what serves every module whose config selects a torch implementation, built before or after
        Route("moe", "class", experts, "forward", f.wrap_experts_forward, wrap=True,
              note=f"configs selecting {', '.join(f.TORCH_EXPERTS)} (or none) use deltafuse's experts; "
                   "other selections dispatch as before"),
    )
