"""TRL integration: TRL's fused LM head served by deltafuse's per-token op (``ops.token_logprobs``).

TRL's trainers (SFT, GRPO, RLOO, DPO, KTO) call ``trl.trainer.utils.add_fused_lm_head(model, outputs=...)``,
whose forward looks up the module global ``_ChunkedLogProbFunction`` (``trl.kernels.ChunkedLogProbFunction``)
at call time and calls ``.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)`` for per-token ``(log_probs, entropy, log_sum_sq_probs,
mean_logits, is_top1)``. The row below replaces that global with an object of the same ``.apply`` signature
that serves the call from ``ops.token_logprobs`` when it can, and from TRL's own function otherwise
(``fallback_reason`` says when: fields or arguments deltafuse does not implement, DeepSpeed ZeRO-3 or DTensor
heads, fp64, dtypes TRL would cast between), so every call gets every field it asked for, computed exactly.
TRL's ``chunk_size`` (its vocabulary tile width) is not used: deltafuse tiles the head its own way.

The map is applied only when ``trl`` is already imported (importing TRL costs seconds, so ``apply`` does not
import it for users who do not use it): call ``deltafuse.apply`` after ``import trl`` (TRL's trainers look
the global up on every forward, so applying any time before training is enough). TRL imported later is not
served; the report says so ("not imported").
"""

from __future__ import annotations

import math

import torch

from deltafuse import ops
from deltafuse.ops._checks import plain_tensor
from deltafuse.integrations.transformers.patcher import FamilyMap, Route

TRL_MODULE = "trl.trainer.utils"
TRL_GLOBAL = "_ChunkedLogProbFunction"
SERVED_OUTPUTS = ("log_probs", "entropy", "is_top1")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fallback_reason(hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale,
                    outputs) -> str | None:
    """Why deltafuse cannot serve this ``ChunkedLogProbFunction.apply`` call exactly, or None when it can."""
    if not isinstance(outputs, (tuple, list)) or not all(isinstance(n, str) for n in outputs):
        return f"outputs={outputs!r} is not a tuple of field names"
    missing = [n for n in outputs if n not in SERVED_OUTPUTS]
    if missing:
        return f"field(s) {missing} are not implemented (deltafuse computes {', '.join(SERVED_OUTPUTS)})"
    if final_logit_softcapping is not None:
        return f"final_logit_softcapping={final_logit_softcapping!r} is not supported"
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or logit_scale != 1.0:
        return f"logit_scale={logit_scale!r} is not supported (only 1.0)"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not (math.isfinite(temperature) and temperature > 0):
        return f"temperature={temperature!r} is not a finite number > 0"
    # DTensor (FSDP2) and other tensor subclasses go to TRL, which knows how to treat them
    if not all(plain_tensor(t) for t in (hidden, weight, targets)) or \
            (bias is not None and not plain_tensor(bias)):
        return "a tensor subclass (e.g. DTensor) among the inputs"
    if any(hasattr(t, "ds_id") for t in (weight, bias) if t is not None):
        return "a DeepSpeed ZeRO-3 parameter (TRL gathers it again in its backward)"
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1 or (bias is not None and bias.dim() != 1):
        return "shapes other than hidden [N, H], weight [V, H], bias [V], targets [N]"
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        return f"targets of dtype {targets.dtype}"
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if any(t.dtype not in _DTYPES for t in tensors):
        return "a dtype other than fp32, fp16, bf16 (TRL returns fp32 statistics)"
    if not torch.is_autocast_enabled(hidden.device.type) and any(t.dtype != hidden.dtype for t in tensors):
        return "weight or bias dtype differs from hidden's (TRL casts the head to hidden's dtype)"
    if any(t.device != hidden.device for t in tensors + [targets]):
        return "inputs on different devices"
    return None


def trl_is_faster(weight, bias) -> str | None:
    """Why TRL's own function serves a call deltafuse could serve, or None.

    A trainable head: measured on an H200 (hidden 2,048, vocabulary 248,320, bf16, SFT's three fields,
    forward + backward), TRL's function took 27.1 ms at 4,096 tokens and 105.2 ms at 16,384 against 31.5 and
    116.0 ms for ``ops.token_logprobs`` (which used a third of the memory: 1.0 vs 3.2 GiB). With a frozen head
    (LoRA) ours is faster: 15.2 vs 20.0 ms and 56.4 vs 79.8 ms, with 89 vs 295 MiB and 355 vs 493 MiB.
    """
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return "a trainable head: TRL's function is faster there (BENCHMARKS.md#trl-fused-head)"
    return None


class TokenLogProbFunction:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction`` (only ``.apply`` is used by TRL)."""

    __deltafuse_factory__ = "deltafuse.integrations.trl.TokenLogProbFunction"

    def __init__(self, original):
        self.original = original
        self.__deltafuse_wraps__ = original

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=None):
        if outputs is None:  # TRL's default: every optional field, some of which deltafuse does not compute
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale)
        if fallback_reason(hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale,
                           outputs) is not None or trl_is_faster(weight, bias) is not None:
            return self.original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, outputs)
        out = ops.token_logprobs(hidden, weight, targets, bias=bias, temperature=float(temperature),
                                 outputs=tuple(outputs))
        return out.log_probs, out.entropy, None, None, out.is_top1

    def __getattr__(self, name):  # anything else TRL (or a user) reads from the class
        return getattr(self.__dict__["original"], name)


MAP = FamilyMap(
    family="trl",
    module=TRL_MODULE,
    routes=(
        Route("fused_ops", "global", "", TRL_GLOBAL, TokenLogProbFunction, wrap=True,
              note="add_fused_lm_head's per-token log_probs / entropy / is_top1 from ops.token_logprobs; "
                   "a trainable head (TRL's is faster there), softcapping, logit_scale != 1, log_sum_sq_probs, "
                   "mean_logits, ZeRO-3 and DTensor heads call TRL's function"),
    ),
    models=False,
    when_imported="trl",
    doc="TRL's fused LM head (add_fused_lm_head)",
)

__all__ = ["MAP", "SERVED_OUTPUTS", "TokenLogProbFunction", "fallback_reason", "trl_is_faster"]
