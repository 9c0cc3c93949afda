"""Fused linear cross-entropy: the driver shared by the torch and Triton backends, and the torch steps.

``fused_linear_cross_entropy_driver`` chooses between the two ways below and runs it with the softmax steps
it is given: the torch steps here (``fused_linear_cross_entropy_torch``, any device) or the Triton kernels of
``kernel.py``.

Two ways to avoid [tokens, V] logits; both compute the gradients during the forward (the loss is a scalar, so
d(loss)/d(logits) = (softmax - one-hot) times the reduction's scale is known there) and keep only those
([N, H], [V, H], [V]) for the backward, which multiplies them by the incoming scalar gradient.

* **Token chunks** (``fused_linear_cross_entropy_chunked``): ``chunk_size`` tokens at a time are projected to
  the whole vocabulary; the largest temporaries are [chunk, V]. Three matmuls per token (projection,
  gradient of hidden, gradient of the weight when the head trains).
* **Token chunks x vocabulary blocks** (``fused_linear_cross_entropy_blocked``): each token chunk is projected
  ``vocab_chunk`` columns at a time, so the largest temporaries are [chunk, vocab_chunk] plus a [chunk, H]
  accumulator. With a frozen head one pass suffices: a running maximum and sum of exponentials per row give
  the log-sum-exp, and the hidden gradient ``softmax @ W - W[target]`` is accumulated from the unnormalised
  block probabilities, rescaled whenever the running maximum moves (the online-softmax rule), so the matmul
  count equals the token-chunk way. A trainable head (or bias) needs the normalised softmax for its gradient,
  so the blocks are projected twice (log-sum-exp first, gradients second): one matmul more per token.

Rounding points follow transformers' stock path (``lm_head`` in the input dtype, then ``logits.float()``
and an fp32 softmax; the logits gradient, or the block probabilities, are rounded to the input dtype before
the matmuls of the linear backward), so a low-precision run matches the stock loss up to summation order. A
float64 input is computed in float64 throughout.

The weight gradient is accumulated across chunks in the weight's dtype when that is fp32/fp64, and in fp32
otherwise when ``V * H`` is small; for large bf16/fp16 heads it is accumulated in the weight dtype (a
[V, H] fp32 buffer would cost 2 GiB at Qwen3.5's 248,320 x 2,048 head). LoRA training freezes the head, so
that case computes no weight gradient at all.

``chunk_fn(logits, targets, ignore_index, row_scale) -> (row_losses, dlogits)`` is the per-chunk softmax
step and ``BlockSteps`` the per-block steps of the blocked way; the Triton backend passes fused kernels that
write over the logits in place.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from deltafuse.ops._amp import no_autocast_backward

# Default chunk: about as many logits as the hidden states hold (chunk * V ~ N * H, rounded up to a power of two),
# so a chunk's logits cost about what the hidden-state gradient costs. The floor keeps the matmuls efficient
# (H200, H=2,048, V=248,320, 4,096 tokens, frozen head: 64-token chunks took 41 ms against stock's 23 ms,
# 128 took 23 ms, 512 took 16 ms; BENCHMARKS.md#loss-chunks);
# with a trainable head every chunk also reads and writes the whole [V, H] weight-gradient accumulator, so
# chunks are kept large there (few passes over it, and few roundings when it is accumulated in bf16).
MIN_CHUNK = 256
MIN_CHUNK_TRAINABLE_HEAD = 1024
# Vocabulary-blocked way: vocabulary columns per block and tokens per chunk by default. A chunk then holds a
# [chunk, block] tile of logits (64 MiB in bf16) and a [chunk, H] fp32 accumulator (32 MiB at H = 2,048).
# Chosen on the H200 (frozen head, H = 2,048, V = 248,320, 4,096 / 16,384 tokens): each tile costs host time
# (several launches), so fewer, larger tiles keep the GPU fed. 4096 x 8192 took 14.4 / 56.6 ms at 112 / 160 MiB
# against 22.3 / 67.4 ms at 40 / 88 MiB for 1024 x 8192 and 14.6 / 58.1 ms for 2048 x 8192, in one run
# (BENCHMARKS.md#loss-tiles-s13); stock takes 97.6 ms and 46,560 MiB at 16,384 tokens. Earlier runs:
# BENCHMARKS.md#loss-vocab-blocks.
VOCAB_CHUNK = 8192
BLOCKED_CHUNK = 4096
# A [V, H] fp32 weight-gradient accumulator is used for low-precision heads up to this many elements.
FP32_ACCUMULATE_MAX = 1 << 24


def default_chunk_size(n_tokens: int, vocab: int, hidden: int, trainable_head: bool = False) -> int:
    n_tokens = max(n_tokens, 1)
    rows = -(-n_tokens * hidden // max(vocab, 1))
    rows = 1 << max(rows - 1, 0).bit_length()
    return min(n_tokens, max(rows, MIN_CHUNK_TRAINABLE_HEAD if trainable_head else MIN_CHUNK))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunk_softmax_grad_torch(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                             row_scale: torch.Tensor | None):
    """Row losses (fp32; 0 on ignored rows) and, when row_scale is given, d(loss)/d(logits) in logits' dtype.

    logits: [c, V] (input dtype); targets: [c] int64; row_scale: [c] fp32 (the reduction's scale, 0 on
    ignored rows).
    """
    x = logits.to(_compute_dtype(logits.dtype))
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    lse = torch.logsumexp(x, dim=-1)
    rows = torch.where(valid, lse - x.gather(1, safe).squeeze(1), torch.zeros_like(lse))
    if row_scale is None:
        return rows, None
    if x.data_ptr() == logits.data_ptr():  # fp32/fp64 input: do not overwrite the caller's logits
        x = x.clone()
    x.sub_(lse.unsqueeze(1)).exp_()
    x.scatter_add_(1, safe, -valid.to(x.dtype).unsqueeze(1))
    x.mul_(row_scale.to(x.dtype).unsqueeze(1))
    return rows, x.to(logits.dtype)


def _denominator(targets, ignore_index, reduction, num_items_in_batch, device):
    """The divisor of the summed loss as an fp32 (fp64) tensor, or None for reduction='sum'."""
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            return num_items_in_batch.to(device=device, dtype=torch.float32)
        return torch.tensor(float(num_items_in_batch), dtype=torch.float32, device=device)
    if reduction == "sum":
        return None
    return (targets != ignore_index).sum().to(torch.float32)


def online_block_step_torch(logits: torch.Tensor, targets: torch.Tensor, v0: int, ignore_index: int,
                            m: torch.Tensor, l: torch.Tensor, xt: torch.Tensor, acc: torch.Tensor | None):
    """One vocabulary block [v0, v0 + w) of the online log-sum-exp, for a chunk of rows.

    logits: [c, w] (input dtype); m, l, xt: [c] running maximum, running sum of exp(x - m), and the target's
    logit (compute dtype), updated in place. ``acc`` ([c, H], compute dtype) is an accumulator of terms
    scaled by exp(-m): it is rescaled in place to the new maximum, and the block's probabilities
    exp(logits - new m) are returned in the logits' dtype for the caller to add into it. Without ``acc``
    returns None.
    """
    x = logits.to(_compute_dtype(logits.dtype))
    w = x.shape[1]
    local = targets - v0
    hit = (targets != ignore_index) & (local >= 0) & (local < w)
    xt.copy_(torch.where(hit, x.gather(1, local.clamp(0, w - 1).unsqueeze(1)).squeeze(1), xt))
    m_new = torch.maximum(m, x.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(x - m_new.unsqueeze(1))
    l.mul_(alpha).add_(p.sum(dim=1))
    m.copy_(m_new)
    if acc is None:
        return None
    acc.mul_(alpha.unsqueeze(1))
    return p.to(logits.dtype)


def block_grad_step_torch(logits: torch.Tensor, targets: torch.Tensor, v0: int, ignore_index: int,
                          lse: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(logits) for the vocabulary block [v0, v0 + w): (exp(x - lse) - one-hot) * row_scale, in the
    logits' dtype."""
    ct = _compute_dtype(logits.dtype)
    x = logits.to(ct)
    w = x.shape[1]
    local = targets - v0
    hit = (targets != ignore_index) & (local >= 0) & (local < w)
    g = torch.exp(x - lse.unsqueeze(1))
    g.scatter_add_(1, local.clamp(0, w - 1).unsqueeze(1), -hit.to(ct).unsqueeze(1))
    g.mul_(row_scale.to(ct).unsqueeze(1))
    return g.to(logits.dtype)


class BlockSteps(NamedTuple):
    """The per-block steps of the vocabulary-blocked loss (see ``online_block_step_torch`` and
    ``block_grad_step_torch`` for the contracts; other implementations may write over ``logits``)."""
    online: Callable
    grad: Callable


TORCH_BLOCK_STEPS = BlockSteps(online_block_step_torch, block_grad_step_torch)


@functools.lru_cache(maxsize=None)
def _mixed_addmm_in_place_works(device_type: str) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)`` (16-bit inputs, fp32 accumulator,
    output aliasing the addend) exists on this device type and gives the right answer."""
    try:
        a = torch.arange(6, dtype=torch.bfloat16, device=device_type).reshape(2, 3)
        b = torch.arange(12, dtype=torch.bfloat16, device=device_type).reshape(3, 4)
        acc = torch.ones(2, 4, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        want = torch.ones(2, 4) + a.float().cpu() @ b.float().cpu()
        return bool(torch.equal(acc.cpu(), want))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, where a and b are in the input dtype and acc may be wider (an fp32 accumulator for
    16-bit inputs: the product is then accumulated in fp32 without rounding it to 16 bits first)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif _mixed_addmm_in_place_works(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += torch.mm(a, b).to(acc.dtype)


def _outputs(hidden, weight, bias, needs):
    """The buffers both ways fill: the summed row losses and the gradients asked for (dh, dw, db)."""
    need_dh, need_dw, need_db = needs
    device = hidden.device
    dh = torch.empty_like(hidden) if need_dh else None
    dw = None
    if need_dw:
        acc = weight.dtype if weight.dtype in (torch.float32, torch.float64) or \
            weight.numel() > FP32_ACCUMULATE_MAX else torch.float32
        dw = torch.zeros(weight.shape, dtype=acc, device=device)
    db = torch.zeros((weight.shape[0],), dtype=_compute_dtype(bias.dtype), device=device) if need_db else None
    total = torch.zeros((), dtype=_compute_dtype(hidden.dtype), device=device)
    return total, dh, dw, db


def _hits(predicted: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """How many counted rows (target != ignore_index) predict their target (int64 scalar)."""
    return ((predicted == targets) & (targets != ignore_index)).sum()


def _chunked_pass(hidden, weight, bias, targets, ignore_index, row_scale, needs, *, chunk_size, logits_out,
                  chunk_fn, count_hits=False):
    """Token chunks against the whole vocabulary. Returns (summed row losses, dh, dw, db, hits): ``hits``
    counts the counted rows whose logits' argmax (first maximum) is the target, when ``count_hits``."""
    need_dh, need_dw, need_db = needs
    n = hidden.shape[0]
    ct = _compute_dtype(hidden.dtype)
    total, dh, dw, db = _outputs(hidden, weight, bias, needs)
    hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        h = hidden[s:e]
        logits = F.linear(h, weight, bias)
        if logits_out is not None:
            logits_out[s:e].copy_(logits)
        if count_hits:  # before chunk_fn, which may write over the logits
            hits += _hits(logits.argmax(dim=1), targets[s:e], ignore_index)
        rows, dlogits = chunk_fn(logits, targets[s:e], ignore_index,
                                 row_scale[s:e] if row_scale is not None else None)
        del logits
        total += rows.sum(dtype=ct)
        if dlogits is None:
            continue
        if need_dh:
            torch.mm(dlogits, weight, out=dh[s:e])
        if need_dw:
            _add_mm(dw, dlogits.t(), h)
        if need_db:
            db += dlogits.sum(0, dtype=db.dtype)
        del dlogits
    return total, dh, dw, db, hits


def _blocked_pass(hidden, weight, bias, targets, ignore_index, row_scale, needs, *, chunk_size, vocab_chunk,
                  steps: BlockSteps, count_hits=False):
    """Token chunks against vocabulary blocks. Returns (summed row losses, dh, dw, db, hits), as
    ``_chunked_pass``: the argmax is tracked across blocks (a later block wins only with a larger maximum, so
    ties go to the first index, as ``torch.argmax``)."""
    need_dh, need_dw, need_db = needs
    n, H = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    ct = _compute_dtype(hidden.dtype)
    total, dh, dw, db = _outputs(hidden, weight, bias, needs)
    hits = torch.zeros((), dtype=torch.int64, device=device)
    blocks = [(v0, min(vocab, v0 + vocab_chunk)) for v0 in range(0, vocab, vocab_chunk)]
    # Frozen head and bias: the hidden gradient is accumulated online in the first (only) pass.
    one_pass = not (need_dw or need_db)

    def project(h, v0, v1):
        return F.linear(h, weight[v0:v1], bias[v0:v1] if bias is not None else None)

    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        h, t = hidden[s:e], targets[s:e].contiguous()
        c = e - s
        m = torch.full((c,), float("-inf"), dtype=ct, device=device)
        l = torch.zeros((c,), dtype=ct, device=device)
        xt = torch.zeros((c,), dtype=ct, device=device)
        acc = torch.zeros((c, H), dtype=ct, device=device) if need_dh else None
        online_dh = one_pass and need_dh
        if count_hits:
            best = torch.full((c,), float("-inf"), dtype=ct, device=device)
            best_at = torch.zeros((c,), dtype=torch.int64, device=device)
        for v0, v1 in blocks:
            logits = project(h, v0, v1)
            if count_hits:  # before the step, which may write over the logits
                value, at = logits.max(dim=1)
                value = value.to(ct)
                won = value > best
                best = torch.where(won, value, best)
                best_at = torch.where(won, at + v0, best_at)
            probs = steps.online(logits, t, v0, ignore_index, m, l, xt, acc if online_dh else None)
            del logits
            if online_dh:
                _add_mm(acc, probs, weight[v0:v1])
            del probs
        lse = m + torch.log(l)
        valid = t != ignore_index
        if count_hits:
            hits += _hits(best_at, t, ignore_index)
        total += torch.where(valid, lse - xt, torch.zeros((), dtype=ct, device=device)).sum()
        if row_scale is None:
            continue
        scale = row_scale[s:e].unsqueeze(1)
        if online_dh:
            # softmax @ W = acc / sum; minus the target's row of W (the one-hot part); times the row's scale
            safe = torch.where(valid, t, torch.zeros_like(t))
            acc.div_(l.unsqueeze(1)).sub_(weight[safe]).mul_(scale)
            dh[s:e].copy_(acc)
            continue
        chunk_scale = row_scale[s:e].contiguous()
        for v0, v1 in blocks:
            g = steps.grad(project(h, v0, v1), t, v0, ignore_index, lse, chunk_scale)
            if need_dh:
                _add_mm(acc, g, weight[v0:v1])
            if need_dw:
                _add_mm(dw[v0:v1], g.t(), h)
            if need_db:
                db[v0:v1] += g.sum(0, dtype=db.dtype)
            del g
        if need_dh:
            dh[s:e].copy_(acc)
    return total, dh, dw, db, hits


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, run_pass, needs):
        device = hidden.device
        ct = _compute_dtype(hidden.dtype)
        denom = _denominator(targets, ignore_index, reduction, num_items_in_batch, device)
        row_scale = None
        if any(needs):
            valid = targets != ignore_index
            if denom is None:
                row_scale = valid.to(ct)
            else:  # where(): an all-ignored batch (denominator 0) gives zero gradients, as the stock loss does
                row_scale = torch.where(valid, 1.0 / denom.to(ct), torch.zeros((), dtype=ct, device=device))
        total, dh, dw, db, hits = run_pass(hidden, weight, bias, targets, ignore_index, row_scale, needs)
        loss = total if denom is None else total / denom.to(ct)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        ctx.save_for_backward(dh, dw, db)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    @no_autocast_backward
    def backward(ctx, grad_loss, grad_hits):
        dh, dw, db = ctx.saved_tensors
        # The usual incoming gradient is exactly 1 (loss.backward()): hand the precomputed gradients over
        # as they are instead of allocating scaled copies (one [V, H] copy for a trainable head). This reads
        # one scalar back from the device.
        one = bool(grad_loss == 1)

        def scaled(t):
            if t is None or one:
                return t
            return t * grad_loss.to(t.dtype)

        return scaled(dh), scaled(dw), scaled(db), None, None, None, None, None, None


def _needs(hidden, weight, bias):
    grad = torch.is_grad_enabled()
    return (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)


def _token_accuracy(hits, targets, ignore_index):
    """Counted rows predicting their target / counted rows, fp32 (NaN when every row is ignored)."""
    return hits.to(torch.float32) / (targets != ignore_index).sum().to(torch.float32)


def fused_linear_cross_entropy_chunked(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                       chunk_size, return_logits, chunk_fn: Callable = chunk_softmax_grad_torch,
                                       token_accuracy: bool = False):
    """hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64 (already shifted).

    Returns (loss, logits [N, V] or None), and the token accuracy (fp32 scalar, no gradient) after them with
    ``token_accuracy=True``. The logits, when asked for, are filled chunk by chunk from the same
    projection the loss uses and carry no gradient.
    """
    needs = _needs(hidden, weight, bias)
    n, vocab = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n, vocab, hidden.shape[1], needs[1])
    logits_out = None
    if return_logits:
        logits_out = torch.empty((n, vocab), dtype=torch.promote_types(hidden.dtype, weight.dtype),
                                 device=hidden.device)
    run_pass = functools.partial(_chunked_pass, chunk_size=chunk_size, logits_out=logits_out, chunk_fn=chunk_fn,
                                 count_hits=token_accuracy)
    loss, hits = _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, reduction,
                                                num_items_in_batch, run_pass, needs)
    if token_accuracy:
        return loss, logits_out, _token_accuracy(hits, targets, ignore_index)
    return loss, logits_out


def fused_linear_cross_entropy_blocked(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                       chunk_size, vocab_chunk, steps: BlockSteps = TORCH_BLOCK_STEPS,
                                       token_accuracy: bool = False):
    """Same contract as ``fused_linear_cross_entropy_chunked`` without logits; ``vocab_chunk`` vocabulary
    columns are projected at a time. Returns the loss, or (loss, token accuracy) with ``token_accuracy``."""
    needs = _needs(hidden, weight, bias)
    if chunk_size is None:
        chunk_size = min(max(hidden.shape[0], 1), BLOCKED_CHUNK)
    run_pass = functools.partial(_blocked_pass, chunk_size=chunk_size, vocab_chunk=vocab_chunk, steps=steps,
                                 count_hits=token_accuracy)
    loss, hits = _FusedLinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, reduction,
                                                num_items_in_batch, run_pass, needs)
    if token_accuracy:
        return loss, _token_accuracy(hits, targets, ignore_index)
    return loss


def blocked_vocab_chunk(vocab: int, vocab_chunk_size: int | None, return_logits: bool, trainable: bool,
                        blocks_by_default: bool) -> int | None:
    """The vocabulary block for a call, or None for whole-vocabulary token chunks.

    Logits for the caller need the whole projection anyway, so they use token chunks; an explicit
    ``vocab_chunk_size`` below V selects blocks of that size. By default (``blocks_by_default``: the Triton
    steps) a frozen head and bias with a vocabulary larger than ``VOCAB_CHUNK`` get blocks of
    ``VOCAB_CHUNK`` columns: same matmuls as token chunks, far less memory. A trainable head or bias keeps
    token chunks by default, because blocks cost it one projection more (H200, 4,096 tokens: 33-35 ms
    against 21.6 ms, for 1,010 instead of 1,471 MiB; BENCHMARKS.md#loss-vocab-blocks); the torch steps keep
    them too, their per-block elementwise work doubles the time (66 against 33 ms).
    """
    if return_logits:
        return None
    if vocab_chunk_size is None:
        if trainable or not blocks_by_default:
            return None
        vocab_chunk_size = VOCAB_CHUNK
    return vocab_chunk_size if vocab_chunk_size < vocab else None


def fused_linear_cross_entropy_driver(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                      chunk_size, return_logits, vocab_chunk_size, chunk_fn, steps,
                                      blocks_by_default, token_accuracy=False):
    """(loss, logits or None), plus the token accuracy with ``token_accuracy``."""
    needs = _needs(hidden, weight, bias)
    block = blocked_vocab_chunk(weight.shape[0], vocab_chunk_size, return_logits, needs[1] or needs[2],
                                blocks_by_default)
    if block is None:
        return fused_linear_cross_entropy_chunked(hidden, weight, bias, targets, ignore_index, reduction,
                                                  num_items_in_batch, chunk_size, return_logits, chunk_fn,
                                                  token_accuracy)
    out = fused_linear_cross_entropy_blocked(hidden, weight, bias, targets, ignore_index, reduction,
                                             num_items_in_batch, chunk_size, block, steps, token_accuracy)
    return (out[0], None, out[1]) if token_accuracy else (out, None)


def fused_linear_cross_entropy_torch(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch,
                                     chunk_size, return_logits, vocab_chunk_size=None, token_accuracy=False):
    return fused_linear_cross_entropy_driver(hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch, chunk_size,
                     return_logits, vocab_chunk_size, chunk_softmax_grad_torch, TORCH_BLOCK_STEPS,
                     blocks_by_default=False, token_accuracy=token_accuracy)
