"""Shared pieces of the op benchmarks: model sizes, RoPE tables, Liger's counterparts of deltafuse's ops.

Used by `deltafuse bench ops` and by the GPU scripts in ``benchmarks/`` (``bench_block_ops.py``,
``bench_loss_moe.py``), so that every benchmark times the same cases. Torch is imported inside the functions
that use it: ``deltafuse bench ops``'s arguments (``ops_args``) read the sizes' token counts for their help
without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Sizes:
    """Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig defaults) at ``tokens`` tokens."""

    tokens: int = 4096
    hidden: int = 2048
    head_dim: int = 256
    q_heads: int = 16
    kv_heads: int = 2
    partial_rotary_factor: float = 0.25
    linear_value_heads: int = 32
    linear_value_head_dim: int = 128
    linear_key_heads: int = 16
    linear_key_head_dim: int = 128
    conv_kernel: int = 4
    moe_intermediate: int = 512
    shared_expert_intermediate: int = 512
    num_experts: int = 256
    experts_per_token: int = 8
    vocab: int = 248_320
    eps: float = 1e-6

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def with_tokens(self, tokens: int) -> "Sizes":
        return replace(self, tokens=tokens)


QWEN35_35B_A3B = Sizes()
# The same structure, small enough for a CPU run in well under a second per op.
CPU_SIZES = Sizes(tokens=64, hidden=64, head_dim=32, q_heads=4, kv_heads=2, linear_value_heads=4,
                  linear_value_head_dim=16, linear_key_heads=2, linear_key_head_dim=16, moe_intermediate=32,
                  shared_expert_intermediate=32, num_experts=8, experts_per_token=2, vocab=512)


def rope_cos_sin(tokens: int, rotary_dim: int, device, dtype, base: float = 10_000.0):
    """cos, sin of shape [1, tokens, rotary_dim] as the text rotary embedding returns them (rotate-half layout)."""
    import torch

    pos = torch.arange(tokens, device=device, dtype=torch.float32)
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    freqs = pos[:, None] * inv
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


# --- Liger-Kernel's counterparts (CUDA only; imported when called) ----------------------------------------
def liger_rms_norm(dim: int, eps: float):
    """LigerRMSNorm computing Qwen3.5's zero-centred norm: offset 1.0, gemma casting (fp32), zeros init."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    return LigerRMSNorm(dim, eps=eps, offset=1.0, casting_mode="gemma", init_fn="zeros")


def liger_partial_rope(rotary_dim: int):
    """Liger's RoPE applied to the rotary slice of each head, the other channels concatenated back (Liger
    rotates the whole head, Qwen3.5 only the first ``rotary_dim`` channels)."""
    import torch
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def apply(q, k, cos, sin):
        qr, kr = liger_rotary_pos_emb(q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous(), cos, sin)
        return torch.cat([qr, q[..., rotary_dim:]], -1), torch.cat([kr, k[..., rotary_dim:]], -1)

    return apply


def liger_swiglu():
    """Liger's silu(gate) * up."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply


def liger_fused_linear_cross_entropy(ignore_index: int = -100):
    """fn(hidden [..., T, H], weight [V, H], labels [..., T]) -> mean loss, with transformers' causal shift."""
    import torch
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)

    def apply(hidden, weight, labels):
        pad = labels.new_full(labels.shape[:-1] + (1,), ignore_index)
        shifted = torch.cat([labels[..., 1:], pad], dim=-1).reshape(-1)
        return loss(weight, hidden.reshape(-1, hidden.shape[-1]), shifted)

    return apply


# --- TRL's fused LM head (imported when called) -----------------------------------------------------------
# The per-token fields TRL's SFTTrainer asks its fused head for (log_probs feeds the loss, the rest the metrics).
TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


def trl_token_logprobs(outputs: tuple[str, ...] = TRL_SFT_OUTPUTS):
    """fn(hidden [N, H], weight [V, H], targets [N]) -> (log_probs, entropy) from TRL's ``ChunkedLogProbFunction``
    (entropy None unless asked for), with the vocabulary tile width TRL's fused head uses."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    def apply(hidden, weight, targets):
        out = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                                           1.0, outputs)
        return out[0], out[1]

    return apply


def trl_chunked_logprob_loss(outputs: tuple[str, ...] = TRL_SFT_OUTPUTS, ignore_index: int = -100):
    """fn(hidden [..., T, H], weight [V, H], labels [..., T]) -> mean loss, the way TRL's ``add_fused_lm_head``
    computes it: positions whose shifted label is counted are gathered, ``ChunkedLogProbFunction`` gives their
    log-probabilities (and the ``outputs`` fields), the loss is their negated mean."""
    per_token = trl_token_logprobs(outputs)

    def apply(hidden, weight, labels):
        h = hidden[..., :-1, :].reshape(-1, hidden.shape[-1])
        y = labels[..., 1:].reshape(-1)
        mask = y != ignore_index
        log_probs = per_token(h[mask], weight, y[mask])[0]
        return -log_probs.sum() / mask.sum().clamp(min=1)

    return apply
