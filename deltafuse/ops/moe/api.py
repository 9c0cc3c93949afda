"""Public MoE experts op (Qwen3.5-MoE / Qwen3-Next layout); the registry picks the implementation per call."""

from __future__ import annotations

import torch

from deltafuse import backends
from deltafuse.ops.moe.candidates import MOE_EXPERTS
from deltafuse.ops import _library
from deltafuse.ops import _checks as check

ACTIVATIONS = ("silu",)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


@check.public_op(MOE_EXPERTS)
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str = "silu",
                *, backend: str | None = None, **kwargs) -> torch.Tensor:
    """Routed experts exactly as transformers' ``Qwen3_5MoeExperts`` / ``Qwen3NextExperts`` compute them.

    hidden: [N, H]; top_k_index: [N, k] integer expert ids in [0, E); top_k_weights: [N, k] routing weights
    (any float dtype; used in hidden's dtype, as the stock router returns them); gate_up_proj: [E, 2I, H]
    with gate rows first, then up rows; down_proj: [E, H, I]; both of hidden's dtype. Returns [N, H]:
    ``sum_j w[n, j] * down[e] @ (silu(gate) * up)``. Gradients reach hidden, the routing weights and both
    expert weights (also when they are computed per call, e.g. with LoRA on the experts). Experts that receive
    no token get zero weight gradients. ``backend=`` may force 'torch'.
    """
    if kwargs:
        check.fail(f"unexpected keyword argument(s) {sorted(kwargs)}; allowed: backend")
    if act not in ACTIVATIONS:
        check.fail(f"act must be one of {', '.join(map(repr, ACTIVATIONS))} (the Qwen3.5 experts' hidden_act), "
                   f"got {act!r}")
    check.tensor("hidden", hidden, 2)
    N, H = hidden.shape
    check.tensor("gate_up_proj", gate_up_proj, 3)
    E = gate_up_proj.shape[0]
    if gate_up_proj.shape[2] != H or gate_up_proj.shape[1] % 2 or gate_up_proj.shape[1] == 0 or E == 0:
        check.fail(f"gate_up_proj must be [E, 2I, H] = [E, 2I, {H}] with E, I > 0, got {check.shape(gate_up_proj)}")
    inter = gate_up_proj.shape[1] // 2
    check.tensor("down_proj", down_proj, 3)
    if tuple(down_proj.shape) != (E, H, inter):
        check.fail(f"down_proj must be [E, H, I] = {(E, H, inter)} for gate_up_proj of shape "
                   f"{check.shape(gate_up_proj)}, got {check.shape(down_proj)}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != hidden.dtype:
            check.fail(f"{name} has dtype {t.dtype} but hidden has {hidden.dtype}; they must match")
    check.tensor("top_k_index", top_k_index, 2, dtypes=_INT_DTYPES)
    if top_k_index.shape[0] != N or top_k_index.shape[1] == 0:
        check.fail(f"top_k_index must be [N, k] = [{N}, k] with k > 0, got {check.shape(top_k_index)}")
    check.tensor("top_k_weights", top_k_weights, 2)
    if top_k_weights.shape != top_k_index.shape:
        check.fail(f"top_k_weights must have top_k_index's shape {check.shape(top_k_index)}, "
                   f"got {check.shape(top_k_weights)}")
    check.same_device("hidden", hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                      gate_up_proj=gate_up_proj, down_proj=down_proj)
    _check_ids(top_k_index, E)
    if backend is not None:
        backends.call_backend(MOE_EXPERTS, backend)
    mask = _library.grad_mask(hidden, top_k_weights, gate_up_proj, down_proj)
    return _moe_op(hidden, top_k_index.to(torch.int64), top_k_weights, gate_up_proj, down_proj, backend, mask,
                   torch.compiler.is_compiling())[0]


def _check_ids(top_k_index, E):
    if check.values_checkable(top_k_index) and top_k_index.numel():
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        if lo < 0 or hi >= E:
            check.fail(f"top_k_index must hold expert ids in [0, {E}), got values in [{lo}, {hi}]")


def _moe_fake(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, backend, grad_mask, validate):
    return _library.fake_outputs(torch.empty_like(hidden), like=hidden)


@_library.define(MOE_EXPERTS, ("hidden", "top_k_weights", "gate_up_proj", "down_proj"), _moe_fake)
def _moe_op(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, backend: str | None, grad_mask: list[bool],
            validate: bool) -> list[torch.Tensor]:
    if validate:
        _library.named_errors(MOE_EXPERTS, _check_ids, top_k_index, gate_up_proj.shape[0])
    impl = _library.select(MOE_EXPERTS, backend, grad_mask, hidden, top_k_weights, gate_up_proj, down_proj)
    return _library.run_forward([hidden, top_k_weights, gate_up_proj, down_proj], grad_mask,
                                lambda h, w, gu, d: (impl(h, top_k_index, w, gu, d),), hidden.device.type)
