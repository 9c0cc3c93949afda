"""Adapters that route the block ops, the loss and the MoE experts of the three families to ``deltafuse.ops``.

Every function here is either a *forward factory* (``wrap_*``: takes the stock function or method, returns
the replacement, which falls back to the stock one for any call the deltafuse op does not express exactly) or
a value a map row installs (``experts_forward``), or a helper of these. The ops are looked up on
``deltafuse.ops`` at call time; each picks its implementation per call through the registry.

* ``*RMSNorm.forward``       -> ``ops.rms_norm_zero_centered(x, weight, eps)`` (every zero-centred norm:
  input, post-attention, final, q_norm, k_norm).
* ``*RMSNormGated.forward``  -> ``ops.rms_norm_gated(x, gate, weight, variance_epsilon)`` when a gate is given
  and the activation is SiLU.
* ``apply_rotary_pos_emb``   -> ``ops.apply_rotary_pos_emb`` for q/k [B, H, T, D] or [B, T, H, D] with
  cos/sin [B or 1, T, rotary_dim].
* ``*MLP.forward``           -> ``down_proj(ops.swiglu(gate_proj(x), up_proj(x)))`` when the activation is SiLU
  (dense MLPs and the MoE shared expert).
* ``*ForCausalLM.forward``   -> the stock forward with the head bypassed, then
  ``ops.fused_linear_cross_entropy`` on the hidden states (``adapters_loss.wrap_causal_lm_forward``).
* experts                    -> ``experts_forward``: registered in transformers' experts interface under
  ``EXPERTS_NAME`` (selectable by name), and serving every experts module whose config selects a torch
  implementation (``wrap_experts_forward``).
"""

from __future__ import annotations

import functools

import torch

from deltafuse import ops
from deltafuse.integrations.transformers.boundaries import PackingError
from deltafuse.integrations.transformers.call_args import mark_wrapper
from deltafuse.integrations.transformers.packing import PACKING_KWARG

# The name deltafuse's experts function has in transformers' experts interface.
EXPERTS_NAME = "deltafuse"
# Stock experts implementations that compute in torch: modules whose config selects one of these are served by
# deltafuse. Other selections (hub or GPU-library kernels a user chose) are left as they are.
TORCH_EXPERTS = ("eager", "grouped_mm", "batched_mm")


@functools.lru_cache(maxsize=None)
def _silu_types() -> tuple[type, ...]:
    types = [torch.nn.SiLU]
    try:
        from transformers.activations import SiLUActivation

        types.append(SiLUActivation)
    except ImportError:  # an older transformers: only nn.SiLU is a SiLU module
        pass
    return tuple(types)


def _is_silu(act) -> bool:
    return type(act) in _silu_types() or act is torch.nn.functional.silu


# --- norms, RoPE, SwiGLU ---------------------------------------------------------------------------
def wrap_rms_norm_forward(original):
    """``Qwen3_5RMSNorm.forward`` (and its copies): x * rsqrt(mean x^2 + eps) * (1 + w) in fp32."""

    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        # no ``eps``: another class under the family's name (Liger's patches put their own norm, which keeps
        # ``variance_epsilon``, in the modeling module), whose own forward runs
        eps = getattr(self, "eps", None)
        if args or kwargs or eps is None:
            return original(self, x, *args, **kwargs)
        return ops.rms_norm_zero_centered(x, self.weight, eps)

    return mark_wrapper(forward, original, "wrap_rms_norm_forward")


def wrap_rms_norm_gated_forward(original):
    """``Qwen3_5RMSNormGated.forward`` (and its copies): (w * norm(x).to(dtype)) * silu(gate)."""

    @functools.wraps(original)
    def forward(self, hidden_states, gate=None, *args, **kwargs):
        if gate is None or args or kwargs or getattr(self, "activation", "silu") not in ("silu", "swish"):
            return original(self, hidden_states, gate, *args, **kwargs)
        return ops.rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)

    return mark_wrapper(forward, original, "wrap_rms_norm_gated_forward")


def wrap_apply_rotary_pos_emb(original):
    """The modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (partial RoPE)."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        plain = (not args and not kwargs and unsqueeze_dim in (1, 2, -3, -2)
                 and all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin))
                 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                 and k.dtype == q.dtype and sin.dtype == cos.dtype
                 and cos.shape[-1] % 2 == 0 and 0 < cos.shape[-1] <= q.shape[-1])
        if not plain:
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    return mark_wrapper(apply_rotary_pos_emb, original, "wrap_apply_rotary_pos_emb")


def wrap_mlp_forward(original):
    """``*MLP.forward``: down(silu(gate(x)) * up(x)) with the activation and product in ``ops.swiglu``."""

    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        if args or kwargs or not _is_silu(getattr(self, "act_fn", None)):
            return original(self, x, *args, **kwargs)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))

    return mark_wrapper(forward, original, "wrap_mlp_forward")



# --- MoE experts ------------------------------------------------------------------------------------
def experts_plain(experts) -> bool:
    """True when ``ops.moe_experts`` computes this experts module exactly: gated, concatenated [gate; up]
    rows, not transposed, no bias, no post-expert norm, SiLU (the module's ``act_fn``) with transformers' default
    gating, every expert local (no expert parallelism: a shard holds fewer experts than the config names)."""
    gate_up = getattr(experts, "gate_up_proj", None)
    return (getattr(experts, "has_gate", True) and not getattr(experts, "has_bias", False)
            and getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_post_expert_norm", False)
            and not getattr(experts, "_is_expert_parallel", False)
            and isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3
            and gate_up.shape[0] == getattr(experts, "num_experts", None)
            and gate_up.shape[0] == getattr(getattr(experts, "config", None), "num_experts", gate_up.shape[0])
            and _is_silu(getattr(experts, "act_fn", None)) and _default_gate(experts))


def _default_gate(experts) -> bool:
    """The experts combine gate and up as transformers' default ``_apply_gate`` does: silu(gate) * up."""
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is None:
        return True
    from transformers.integrations import moe

    return gate is getattr(moe, "_default_apply_gate", None)


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts-interface function ``EXPERTS_NAME``: ``ops.moe_experts`` for plain experts, transformers'
    ``grouped_mm`` experts forward for any other layout (bias, transposed, expert-parallel shards ...)."""
    if not experts_plain(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return ops.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def wrap_experts_forward(original):
    """``*Experts.forward`` (transformers' experts-interface dispatcher): a module whose config selects a torch
    implementation (``TORCH_EXPERTS``, or none) is served by ``experts_forward``; any other selection (a hub or
    GPU-library kernel, or ``EXPERTS_NAME`` itself) dispatches through the interface as before."""

    @functools.wraps(original)
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
        if args or kwargs or (impl is not None and impl not in TORCH_EXPERTS):
            return original(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    return mark_wrapper(forward, original, "wrap_experts_forward")


# --- attention (Ascend NPU) -------------------------------------------------------------------------
# keyword arguments that change the maths of transformers' SDPA function: such calls stay with it
_ATTENTION_EXTRAS = ("position_bias", "softcap", "s_aux", "sliding_window")


def _routable_attention(module, is_causal, kwargs) -> bool:
    if any(kwargs.get(name) is not None for name in _ATTENTION_EXTRAS) or kwargs.get("output_attentions"):
        return False
    return bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))


# Packed rows at least this long get sequence-by-sequence attention instead of transformers' dense
# block-causal mask: all T x T pairs cost ~16x the per-sequence work at 4096 tokens of ~250-token examples
# and grow with T (~260x at 65,536). H200, fwd+bwd of one layer's attention (16 / 2 heads of 256, ~270-token
# sequences, wall time with the host's): 16,384 tokens dense 71 ms, varlen 2.8 ms
# (BENCHMARKS.md#packed-attention); 8,192 / 4,096 / 2,048 / 1,024 tokens dense 18.1 / 5.0 / 1.67 / 0.90 ms,
# varlen 1.52 / 1.25 / 0.98 / 0.91 ms (BENCHMARKS.md#packed-attention-s13): varlen from 2,048 tokens on.
PACKED_ATTENTION_MIN_TOKENS = 2048


def _packed_route(query, key, kwargs):
    """(offsets, cu_seqlens, longest) when this call may be computed sequence by sequence, else None: inside a
    compiled graph the offsets are not known on the host (transformers' block-causal mask then); a ``padded``
    Packing (a captured CUDA graph's: its offsets tensor has a fixed size) goes to ``varlen_attn`` with no host
    offsets and the row's length as the longest sequence (``padded_rows_use_varlen`` says when)."""
    packing = kwargs.get(PACKING_KWARG)
    B, _, T, _ = query.shape
    if (packing is None or not packing.block_causal or T < PACKED_ATTENTION_MIN_TOKENS or key.shape[2] != T
            or (packing.batch, packing.length) != (B, T)):
        return None
    if packing.padded:
        return None, packing.cu_seqlens, T
    if packing.offsets is None:
        return None
    return packing.offsets, packing.cu_seqlens, None


def padded_rows_use_varlen(packing, device: torch.device) -> bool:
    """Whether the full-attention layers of a ``padded`` Packing's batch run ``varlen_attn`` on ``device`` (and so
    never read transformers' block-causal mask): block-causal rows of ``PACKED_ATTENTION_MIN_TOKENS`` or more on a
    GPU that runs it. A call that then cannot (an fp32 query, dropout, a head size over 256) raises instead."""
    from deltafuse.ops.attention.packed import varlen_runs_on

    return (packing is not None and packing.padded and packing.block_causal
            and packing.length >= PACKED_ATTENTION_MIN_TOKENS and varlen_runs_on(device))


def wrap_sdpa_attention(original):
    """transformers' ``sdpa`` attention function: causal self-attention on npu tensors goes to the registry's
    route (Ascend's fused kernel); long packed rows whose mask is block-causal are computed sequence by
    sequence; every other call runs the original."""

    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
        if _routable_attention(module, is_causal, kwargs):
            if query.device.type == "npu":
                from deltafuse.ops.attention import sdpa_route

                impl = sdpa_route(query, key, value)
                if impl is not None:
                    return impl(query, key, value, attention_mask, dropout, scaling, True), None
            else:
                route = _packed_route(query, key, kwargs)
                if route is not None:
                    from deltafuse.ops.attention import packed_attention

                    offsets, cu_seqlens, longest = route  # offsets None: a padded Packing (varlen_attn only)
                    impl = packed_attention(query, key, value)
                    return impl(query, key, value, offsets, scaling, dropout, cu_seqlens=cu_seqlens,
                                longest=longest), None
        packing = kwargs.get(PACKING_KWARG)
        if attention_mask is None and packing is not None and packing.padded and packing.block_causal:
            # a captured graph's padded rows whose mask was left out (padded_rows_use_varlen): transformers' function
            # without a mask would attend across the sequences of a row
            raise PackingError(f"attention of a padded packed batch [{packing.batch}, {packing.length}] got no mask "
                               "and cannot run varlen_attn here; allowed: the block-causal mask, or a call "
                               "varlen_attn serves (fp16/bf16, no dropout, head size <= 256)")
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)

    return mark_wrapper(sdpa_attention_forward, original, "wrap_sdpa_attention")
