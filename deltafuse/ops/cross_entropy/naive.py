"""Float64 oracle for the fused linear cross-entropy, written from the definition (no shared code with the ops).

Projects every token at once (tiny shapes only), shifts the labels the way transformers' ``ForCausalLMLoss``
does (pad with ``ignore_index`` on the right, drop the first), and reduces: mean over non-ignored tokens,
sum, or sum / num_items_in_batch. An all-ignored batch gives NaN for the mean, as the stock loss does.
"""

from __future__ import annotations

import torch


def naive_linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean",
                               num_items_in_batch=None, shift=True, dtype=torch.float64):
    h = hidden.to(dtype)
    logits = h @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    if shift:
        pad = torch.full(labels.shape[:-1] + (1,), ignore_index, dtype=labels.dtype, device=labels.device)
        labels = torch.cat([labels[..., 1:], pad], dim=-1)
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    total = logits.new_zeros(())
    count = 0
    for i in range(labels.shape[0]):
        t = int(labels[i])
        if t == ignore_index:
            continue
        row = logits[i]
        m = row.max().detach()
        total = total + (m + torch.log(torch.exp(row - m).sum())) - row[t]
        count += 1
    if num_items_in_batch is not None:
        return total / float(num_items_in_batch)
    if reduction == "sum":
        return total
    return total / count if count else total * float("nan")


def naive_token_logprobs(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=-100,
                         dtype=torch.float64):
    """Per-token (log_probs, entropy, is_top1) from the full logits in ``dtype``: log_softmax(logits / T) at
    the target, -sum p log p, and whether ``argmax`` (first maximum) is the target; 0, 0, False where the
    target is ``ignore_index``. Differentiable (log_probs and entropy) w.r.t. the inputs' ``dtype`` copies."""
    z = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    z = z / temperature
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).to(torch.int64)
    log_p = torch.log_softmax(z, dim=-1)
    log_probs = torch.where(valid, log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=dtype))
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), torch.zeros((), dtype=dtype))
    is_top1 = valid & (z.argmax(dim=-1) == safe)
    return log_probs, entropy, is_top1
