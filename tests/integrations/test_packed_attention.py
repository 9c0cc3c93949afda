"""Sequence-by-sequence causal attention for long packed rows: equal to transformers' dense block-causal
attention, and used only when transformers' mask is exactly block-causal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltafuse import verify
from deltafuse.integrations.transformers import adapters, adapters_fused
from deltafuse.ops.attention import packed as packed_ops

pytestmark = pytest.mark.usefixtures("clean_deltafuse")


def _dense_block_causal(q, k, v, offsets, scaling):
    """Reference: one SDPA over each whole row with the [T, T] block-causal mask, float64."""
    B, Hq, T, _ = q.shape
    seq = torch.zeros(B * T, dtype=torch.long)
    for i, (s, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        seq[s:e] = i
    seq = seq.view(B, T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    mask = (seq[:, :, None] == seq[:, None, :]) & causal  # [B, T, T]
    group = Hq // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask[:, None], scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2), (6, 1)])
def test_by_sequence_equals_dense_block_causal(Hq, Hk):
    g = torch.Generator().manual_seed(Hq * 10 + Hk)
    B, T, D = 2, 37, 8
    offsets = (0, 5, 6, 20, 37, 38, 60, 74)  # row 0: 5, 1, 14, 17; row 1: 1, 22, 14 (length-1 sequences)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hk, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    got = packed_ops.causal_attention_by_sequence(q, k, v, offsets, scaling=0.4)
    assert got.shape == (B, T, Hq, D) and got.is_contiguous()
    grads = torch.autograd.grad((got * dy).sum(), (q, k, v))
    want = _dense_block_causal(q, k, v, offsets, 0.4)
    want_grads = torch.autograd.grad((want * dy).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_rows_must_start_sequences():
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="crosses the end of row 0"):
        packed_ops.causal_attention_by_sequence(q, q, q, (0, 6, 8))


def test_block_causal_only_without_mask_and_explicit_boundaries():
    """The text-model wrapper marks the packing block-causal only when transformers' mask comes from the
    restarting position_ids alone."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    seen = []

    def original(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                 inputs_embeds=None, use_cache=None, **kwargs):
        seen.append(kwargs.get(adapters.PACKING_KWARG))
        return None

    wrapped = adapters.wrap_text_model_forward(original)
    ids = torch.zeros(1, 6, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    wrapped(m, input_ids=ids, position_ids=pos)
    assert seen[-1].block_causal
    wrapped(m, input_ids=ids, cu_seq_lens_q=torch.tensor([0, 3, 6]))  # positions set from the boundaries
    assert seen[-1].block_causal
    wrapped(m, input_ids=ids, position_ids=torch.arange(6)[None], cu_seq_lens_q=torch.tensor([0, 3, 6]))
    assert not seen[-1].block_causal  # the user's positions do not restart: transformers builds plain causal


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", "tiny-next"])
def test_packed_model_with_the_route_equals_per_sequence_stock(monkeypatch, model):
    calls = []
    real = packed_ops.causal_attention_by_sequence

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(adapters_fused, "PACKED_ATTENTION_MIN_TOKENS", 1)
    monkeypatch.setattr(packed_ops, "causal_attention_by_sequence", counting)
    from deltafuse import backends

    backends.REGISTRY.clear_cache()
    try:
        result = verify.verify_model(model, packed=True)
    finally:
        backends.REGISTRY.clear_cache()
    assert result.ok, result.format()
    assert calls, "the sequence-by-sequence route was not used"
    rows = verify.PACKED_ROWS
    want = [0]
    for row in rows:
        for n in row:
            want.append(want[-1] + n)
    assert all(tuple(c) == tuple(want) for c in calls)
