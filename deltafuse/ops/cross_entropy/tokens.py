"""Per-token log-probabilities of ``hidden @ weight.T (+ bias)`` (and entropy, top-1) without [tokens, V] logits.

The loss of ``driver.py`` is a scalar, so its gradients are known in the forward; per-token outputs get an
arbitrary upstream gradient per token (a weighted loss, a policy-gradient advantage), so this one differs:

* Forward: token chunks are projected a vocabulary block at a time, and each block is folded into per-row
  online statistics (fp32; fp64 for fp64 inputs): the running maximum ``m`` and sum of exponentials ``l`` of
  the temperature-scaled logits ``z = logits / temperature``, the target's ``z``, and when asked for
  ``sum exp(z - m) * z`` (entropy = lse - E_p[z]) and the largest ``z`` before the target's index (top-1
  with ties to the first index, as ``torch.argmax``). Rounding points follow transformers' stock path: the
  projection in the input dtype, then fp32.
* Frozen head and bias (LoRA): each row's log-probability depends only on its own hidden row, so
  ``d log_p / d hidden = (W[target] - softmax @ W) / temperature`` is accumulated online in the forward
  (the blocked fused loss's accumulator, rescaled whenever the running maximum moves) and kept, [N, H]
  fp32; the backward multiplies its rows by the incoming per-token gradients. Two matmuls per token in all.
* Trainable head or bias, or a gradient arriving for the entropy: the backward projects each block again
  and turns it into the logits' gradient in place,
  ``(g_lp * (one_hot - p) - g_ent * p * (log p + entropy)) / temperature`` (rounded to the input dtype, as
  the stock linear backward sees it), then accumulates the hidden, weight and bias gradients in fp32 (the
  weight's for large 16-bit heads in its dtype, as the fused loss does).

Rows whose target is ``ignore_index`` give log-probability 0, entropy 0, top-1 False and no gradient.

``TokenSteps`` are the per-block steps; the Triton backend passes kernels that write over the logits.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from deltafuse.ops._amp import no_autocast_backward
from deltafuse.ops.cross_entropy.driver import (BLOCKED_CHUNK, FP32_ACCUMULATE_MAX, VOCAB_CHUNK, _add_mm,
                                                   _compute_dtype, default_chunk_size)

OUTPUTS = ("log_probs", "entropy", "is_top1")


class TokenSteps(NamedTuple):
    """``online(logits, targets, v0, ignore_index, inv_t, m, l, xt, xs, mbt, acc)`` folds the block
    [v0, v0 + w) into the running statistics (updated in place; ``xs``/``mbt``/``acc`` may be None) and, with
    ``acc``, rescales it to the new maximum and returns exp(z - new m) in the logits' dtype (else None);
    ``grad(logits, targets, v0, ignore_index, inv_t, lse, ent, g_lp, g_ent)`` returns the block's logits
    gradient in the logits' dtype (``g_lp``/``g_ent`` may be None; both are 0 on ignored rows)."""
    online: Callable
    grad: Callable


def _scaled(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    z = logits.to(_compute_dtype(logits.dtype))
    return z if inv_t == 1.0 else z * inv_t


def online_step_torch(logits, targets, v0, ignore_index, inv_t, m, l, xt, xs, mbt, acc):
    z = _scaled(logits, inv_t)
    w = z.shape[1]
    local = targets - v0
    hit = (targets != ignore_index) & (local >= 0) & (local < w)
    xt.copy_(torch.where(hit, z.gather(1, local.clamp(0, w - 1).unsqueeze(1)).squeeze(1), xt))
    if mbt is not None:  # the largest z at an index below the target's (the target is top-1 only above it)
        before = torch.arange(w, device=z.device) < local.unsqueeze(1)
        mbt.copy_(torch.maximum(mbt, z.masked_fill(~before, float("-inf")).amax(dim=1)))
    m_new = torch.maximum(m, z.amax(dim=1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(z - m_new.unsqueeze(1))
    l.mul_(alpha).add_(p.sum(dim=1))
    if xs is not None:
        xs.mul_(alpha).add_((p * z).sum(dim=1))
    m.copy_(m_new)
    if acc is None:
        return None
    acc.mul_(alpha.unsqueeze(1))
    return p.to(logits.dtype)


def grad_step_torch(logits, targets, v0, ignore_index, inv_t, lse, ent, g_lp, g_ent):
    z = _scaled(logits, inv_t)
    w = z.shape[1]
    log_p = z - lse.unsqueeze(1)
    p = torch.exp(log_p)
    g = torch.zeros_like(z)
    if g_lp is not None:  # d log p_t / d z_j = 1[j = t] - p_j
        local = targets - v0
        hit = (targets != ignore_index) & (local >= 0) & (local < w)
        g -= g_lp.unsqueeze(1) * p
        g.scatter_add_(1, local.clamp(0, w - 1).unsqueeze(1), (g_lp * hit).unsqueeze(1))
    if g_ent is not None:  # d entropy / d z_j = -p_j (log p_j + entropy)
        g -= g_ent.unsqueeze(1) * p * (log_p + ent.unsqueeze(1))
    if inv_t != 1.0:
        g *= inv_t
    return g.to(logits.dtype)


TORCH_TOKEN_STEPS = TokenSteps(online_step_torch, grad_step_torch)


class _Plan(NamedTuple):
    chunk: int
    blocks: tuple[tuple[int, int], ...]
    steps: TokenSteps


def _project(h, weight, bias, v0, v1):
    return F.linear(h, weight[v0:v1], bias[v0:v1] if bias is not None else None)


def _forward(hidden, weight, bias, targets, ignore_index, inv_t, plan: _Plan, want_entropy, want_top1, precompute):
    n, H = hidden.shape
    device = hidden.device
    ct = _compute_dtype(hidden.dtype)
    lse_all = torch.empty((n,), dtype=ct, device=device)
    log_probs = torch.empty((n,), dtype=ct, device=device)
    entropy = torch.empty((n,), dtype=ct, device=device) if want_entropy else None
    top1 = torch.empty((n,), dtype=torch.bool, device=device) if want_top1 else None
    pre = torch.empty((n, H), dtype=ct, device=device) if precompute else None
    zero = torch.zeros((), dtype=ct, device=device)
    for s in range(0, n, plan.chunk):
        e = min(n, s + plan.chunk)
        h, t = hidden[s:e], targets[s:e].contiguous()
        c = e - s
        m = torch.full((c,), float("-inf"), dtype=ct, device=device)
        l = torch.zeros((c,), dtype=ct, device=device)
        xt = torch.zeros((c,), dtype=ct, device=device)
        xs = torch.zeros((c,), dtype=ct, device=device) if want_entropy else None
        mbt = torch.full((c,), float("-inf"), dtype=ct, device=device) if want_top1 else None
        acc = torch.zeros((c, H), dtype=ct, device=device) if precompute else None
        for v0, v1 in plan.blocks:
            probs = plan.steps.online(_project(h, weight, bias, v0, v1), t, v0, ignore_index, inv_t, m, l, xt, xs,
                                      mbt, acc)
            if acc is not None:
                _add_mm(acc, probs, weight[v0:v1])
            del probs
        valid = t != ignore_index
        lse = m + torch.log(l)
        lse_all[s:e] = lse
        log_probs[s:e] = torch.where(valid, xt - lse, zero)
        if want_entropy:
            entropy[s:e] = torch.where(valid, lse - xs / l, zero)
        if want_top1:
            top1[s:e] = valid & (xt >= m) & (xt > mbt)
        if precompute:
            # d log p_t / d hidden = (W[t] - softmax @ W) / temperature; softmax @ W = acc / l
            safe = torch.where(valid, t, torch.zeros_like(t))
            acc.div_(l.unsqueeze(1)).neg_().add_(weight[safe].to(ct))
            if inv_t != 1.0:
                acc.mul_(inv_t)
            pre[s:e] = torch.where(valid.unsqueeze(1), acc, zero)
    return log_probs, entropy, top1, lse_all, pre


def _backward(hidden, weight, bias, targets, ignore_index, inv_t, plan: _Plan, lse, ent, g_lp, g_ent, needs):
    need_dh, need_dw, need_db = needs
    n, H = hidden.shape
    device = hidden.device
    ct = _compute_dtype(hidden.dtype)
    dh = torch.empty((n, H), dtype=hidden.dtype, device=device) if need_dh else None
    dw = None
    if need_dw:
        acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) or \
            weight.numel() > FP32_ACCUMULATE_MAX else torch.float32
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=device)
    db = torch.zeros((weight.shape[0],), dtype=ct, device=device) if need_db else None
    for s in range(0, n, plan.chunk):
        e = min(n, s + plan.chunk)
        h, t = hidden[s:e], targets[s:e].contiguous()
        acc = torch.zeros((e - s, H), dtype=ct, device=device) if need_dh else None
        chunk_lse = lse[s:e].contiguous()
        chunk_ent = ent[s:e].contiguous() if g_ent is not None else None
        chunk_glp = g_lp[s:e].contiguous() if g_lp is not None else None
        chunk_gent = g_ent[s:e].contiguous() if g_ent is not None else None
        for v0, v1 in plan.blocks:
            g = plan.steps.grad(_project(h, weight, bias, v0, v1), t, v0, ignore_index, inv_t, chunk_lse, chunk_ent,
                                chunk_glp, chunk_gent)
            if need_dh:
                _add_mm(acc, g, weight[v0:v1])
            if need_dw:
                _add_mm(dw[v0:v1], g.t(), h)
            if need_db:
                db[v0:v1] += g.sum(0, dtype=ct)
            del g
        if need_dh:
            dh[s:e].copy_(acc)
    return dh, (dw.to(weight.dtype) if dw is not None else None), (db.to(bias.dtype) if db is not None else None)


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, inv_t, plan, want_entropy, want_top1):
        ctx.set_materialize_grads(False)  # entropy is often only logged: no zeros gradient for it
        needs = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        precompute = needs[0] and not (needs[1] or needs[2])
        log_probs, entropy, top1, lse, pre = _forward(hidden, weight, bias, targets, ignore_index, inv_t, plan,
                                                      want_entropy, want_top1, precompute)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, pre)
        ctx.meta = (ignore_index, inv_t, plan, needs)
        if top1 is not None:
            ctx.mark_non_differentiable(top1)
        return log_probs, entropy, top1

    @staticmethod
    @no_autocast_backward
    def backward(ctx, g_lp, g_ent, _g_top1):
        hidden, weight, bias, targets, lse, entropy, pre = ctx.saved_tensors
        ignore_index, inv_t, plan, needs = ctx.meta
        none = (None,) * 6
        if not any(needs) or (g_lp is None and g_ent is None):
            return (None, None, None) + none
        valid = targets != ignore_index
        ct = lse.dtype
        zero = torch.zeros((), dtype=ct, device=lse.device)
        if g_lp is not None:
            g_lp = torch.where(valid, g_lp.to(ct), zero)
        if g_ent is not None:
            g_ent = torch.where(valid, g_ent.to(ct), zero)
        if pre is not None and g_ent is None and not (needs[1] or needs[2]):
            dh = (pre * g_lp.unsqueeze(1)).to(hidden.dtype) if needs[0] else None
            return (dh, None, None) + none
        dh, dw, db = _backward(hidden, weight, bias, targets, ignore_index, inv_t, plan, lse, entropy, g_lp, g_ent,
                               needs)
        return (dh, dw, db) + none


def plan_for(n: int, vocab: int, hidden_size: int, trainable: bool, chunk_size, vocab_chunk_size,
             steps: TokenSteps, blocks_by_default: bool) -> _Plan:
    """Token chunk and vocabulary blocks of a call. By default (``blocks_by_default``: the Triton steps)
    1,024-token chunks x 8,192-column blocks, with a trainable head too: the backward projects every block
    again anyway, so blocks cost no extra matmul here, only less memory; the torch steps take
    whole-vocabulary chunks (their per-block elementwise work is what costs)."""
    if vocab_chunk_size is None:
        vocab_chunk_size = VOCAB_CHUNK if blocks_by_default else vocab
    if chunk_size is None:
        if vocab_chunk_size < vocab:
            chunk_size = min(max(n, 1), BLOCKED_CHUNK)
        else:
            chunk_size = default_chunk_size(n, vocab, hidden_size, trainable)
    width = min(vocab_chunk_size, vocab)
    blocks = tuple((v0, min(vocab, v0 + width)) for v0 in range(0, vocab, width))
    return _Plan(chunk_size, blocks, steps)


def token_logprobs_impl(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1,
                        chunk_size, vocab_chunk_size, steps: TokenSteps, blocks_by_default: bool):
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64. Returns (log_probs, entropy or None,
    is_top1 or None), each [N]."""
    trainable = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    plan = plan_for(hidden.shape[0], weight.shape[0], hidden.shape[1], trainable, chunk_size, vocab_chunk_size,
                    steps, blocks_by_default)
    return _TokenLogProbs.apply(hidden, weight, bias, targets, ignore_index, 1.0 / temperature, plan, want_entropy,
                                want_top1)


def token_logprobs_torch(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1,
                         chunk_size, vocab_chunk_size):
    return token_logprobs_impl(hidden, weight, bias, targets, ignore_index, temperature, want_entropy, want_top1,
                               chunk_size, vocab_chunk_size, TORCH_TOKEN_STEPS, blocks_by_default=False)


__all__ = ["OUTPUTS", "TORCH_TOKEN_STEPS", "TokenSteps", "grad_step_torch", "online_step_torch", "plan_for",
           "token_logprobs_impl", "token_logprobs_torch"]
