"""PEFT integration: the forward of PEFT's LoRA ``Linear`` without the dtype round trip and the full-width scaling.

PEFT's ``lora.Linear.forward`` (vanilla LoRA) computes, per active adapter,
``result = result + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling``. Two parts of it move whole
activations for nothing in a mixed-precision LoRA step (16-bit base weights, PEFT's fp32 adapter weights,
autocast to the activations' 16-bit dtype, which ``deltafuse train`` and transformers' Trainer use):

* ``x.to(float32)`` copies the [tokens, in] input to fp32, and autocast casts it straight back to the 16-bit
  dtype for ``lora_A``'s matmul: an exact round trip (16-bit -> fp32 -> 16-bit), two copies in the forward and
  two more (the ``ToCopyBackward`` of each) in the backward. Under autocast to x's own dtype the input is
  passed as it is: the matmul sees the same 16-bit values, and its input gradient the same 16-bit values.
* ``* scaling`` multiplies the [tokens, out] LoRA output (and, in the backward, its [tokens, out] gradient).
  For a scaling that is a power of two (alpha / r with the default alpha = 2r gives 2; alpha = r gives 1),
  scaling the [tokens, r] ``lora_A`` output instead is the same arithmetic: multiplying by a power of two
  is exact in binary floating point, and it commutes with the matmul's fp32 accumulation and its rounding to
  the output dtype, forward and backward (the only exceptions are values beyond the dtype's range or in the
  fp32 subnormal range, ~1e-38, where stock's own intermediates would overflow or lose digits first). A
  scaling of 1 is not multiplied at all. fp16 and other scalings keep stock's order.

Every other call runs PEFT's forward: disabled or merged adapters, mixed-batch ``adapter_names``, LoRA
variants (DoRA ...), dropout > 0, LoRA bias, non-Linear adapter modules, adapter modules with hooks, extra
arguments. The map is applied only when ``peft`` is already imported (as TRL's; ``apply`` does not import it).
"""

from __future__ import annotations

import functools
import math

import torch

from deltafuse.integrations.transformers.patcher import FamilyMap, Route

PEFT_MODULE = "peft.tuners.lora.layer"
_HALF = (torch.bfloat16, torch.float16)


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def _autocast_dtype(device_type: str):
    """The dtype autocast casts matmul inputs to on this device type, or None when autocast is off there."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a torch or device type without per-device autocast queries
        return None


def _power_of_two(s) -> bool:
    return isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 1 \
        and math.frexp(s)[0] == 0.5


def lora_plan(layer, x, args, kwargs):
    """[(A, B, skip_cast, fold, scaling)] for the active adapters when the lean forward computes this call exactly,
    else None (PEFT's forward serves it). skip_cast: pass x to A without PEFT's fp32 cast (autocast casts it
    back to x's dtype); fold: the scaling, applied to A's output (None: applied as stock does)."""
    if args or kwargs or not isinstance(x, torch.Tensor) or getattr(layer, "disable_adapters", True) \
            or getattr(layer, "merged", True) or _hooked(layer):
        return None
    variants = getattr(layer, "lora_variant", {})
    lora_bias = getattr(layer, "lora_bias", {})
    cast = getattr(layer, "cast_input_dtype_enabled", True)
    autocast = _autocast_dtype(x.device.type)
    plan = []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        A, B = layer.lora_A[name], layer.lora_B[name]
        if name in variants or lora_bias.get(name) or type(A) is not torch.nn.Linear \
                or type(B) is not torch.nn.Linear or A.bias is not None or B.bias is not None \
                or _hooked(A) or _hooked(B) or type(layer.lora_dropout[name]) is not torch.nn.Identity:
            return None
        s = layer.scaling[name]
        if not isinstance(s, (int, float)) or isinstance(s, bool):
            return None
        # PEFT casts x to A's dtype; under autocast to x's 16-bit dtype that fp32 copy is cast straight back
        skip_cast = (cast and x.dtype in _HALF and A.weight.dtype == torch.float32 and autocast == x.dtype)
        out_dtype = autocast if autocast is not None else A.weight.dtype
        fold = s if (_power_of_two(s) and out_dtype in (torch.bfloat16, torch.float32)) else None
        plan.append((A, B, skip_cast, fold, s))
    return plan


def wrap_lora_linear_forward(original):
    """``peft.tuners.lora.layer.Linear.forward`` without the input's fp32 round trip under autocast and with a
    power-of-two scaling applied to the rank-r product (see the module docstring); PEFT's forward otherwise."""

    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        plan = lora_plan(self, x, args, kwargs)
        if plan is None:
            return original(self, x, *args, **kwargs)
        result = self.base_layer(x)
        result_dtype = result.dtype
        for A, B, skip_cast, fold, s in plan:
            if not skip_cast:
                x = self._cast_input_dtype(x, A.weight.dtype)
            if fold is not None:
                a = A(x)
                result = result + B(a if fold == 1 else a * fold)
            else:
                result = result + B(A(x)) * s
        return result.to(result_dtype)

    forward.__deltafuse_wraps__ = original
    forward.__deltafuse_factory__ = "deltafuse.wrap_lora_linear_forward"
    return forward


MAP = FamilyMap(
    family="peft",
    module=PEFT_MODULE,
    routes=(
        Route("fused_ops", "class", "Linear", "forward", wrap_lora_linear_forward, wrap=True,
              note="vanilla LoRA: no fp32 round trip of the input under autocast to its 16-bit dtype, a "
                   "power-of-two scaling on the rank-r product; variants, dropout, LoRA bias, merged or "
                   "disabled adapters, adapter_names and hooked adapter modules run PEFT's forward"),
    ),
    models=False,
    when_imported="peft",
    doc="PEFT's LoRA Linear (mixed-precision LoRA steps)",
)

__all__ = ["MAP", "lora_plan", "wrap_lora_linear_forward"]
