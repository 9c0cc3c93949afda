"""Packed (padding-free) and padded batches of the same rows give the same loss and gradients under deltafuse.

Stock transformers' torch fallback lets GDN and conv state leak across packed sequences when only
``position_ids`` mark the boundaries (what padding-free collators give); the second test shows that leak, so
the first one can fail.
"""

from __future__ import annotations

import pytest
import torch

from deltafuse.models import TINY_NAMES, build_model
from deltafuse.train import data, packing
from deltafuse.train.tokenizer import build_byte_tokenizer

ROWS = [{"prompt": "Ava has 3 apples and buys 4 more. How many?", "completion": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"prompt": "2*6?", "completion": "#### 12"},
        {"prompt": "A train goes 20 km per hour for 3 hours. How far?",
         "completion": "20 * 3 = <<20*3=60>>60 km.\n#### 60"}]


def batches(row_tokens=None):
    tok = build_byte_tokenizer()
    examples = data.encode_rows(tok, ROWS, 512, data.DataStats())
    assert len({len(e["input_ids"]) for e in examples}) == 3  # different lengths, so padding is exercised
    packed = packing.PackedCollator(tok.pad_token_id, row_tokens)([examples])
    return packed, packing.PaddedCollator(tok.pad_token_id)(examples)


def make_model(name):
    # fp32: the MoE experts' grouped_mm has no fp64 kernel. initializer_range 0.2 (not 0.02) gives activations
    # large enough that a leak across sequences shows clearly in the loss (>1e-3) and the gradients.
    return build_model(name, dtype=torch.float32, seed=1, initializer_range=0.2).train()


def loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("row_tokens", [None, 512], ids=["padding-free", "filled-to-512"])
@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_packed_equals_padded_with_deltafuse(name, row_tokens):
    import deltafuse

    packed, padded = batches(row_tokens)
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == 3
    if row_tokens:  # the row is filled by a pad sequence of its own, and it is the loss of the real ones
        assert packed["input_ids"].shape[1] == row_tokens and packed["labels"][0, -1] == -100
    model = make_model(name)
    with deltafuse.patched(model):
        lp, gp = loss_and_grads(model, packed)
        lu, gu = loss_and_grads(model, padded)
    torch.testing.assert_close(lp, lu, rtol=0, atol=1e-5)
    assert gp.keys() == gu.keys() and len(gp) > 10
    for n in gp:
        scale = gu[n].abs().max().item()
        err = (gp[n] - gu[n]).abs().max().item()
        assert err <= 2e-4 * scale + 1e-7, f"{n}: max |packed - padded| = {err:.3g}, max |padded| = {scale:.3g}"


@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_stock_transformers_leaks_state_across_packed_sequences(name):
    packed, padded = batches()
    model = make_model(name)
    lp, gp = loss_and_grads(model, packed)
    lu, gu = loss_and_grads(model, padded)
    # a leak 100x the tolerance above, so the deltafuse test can fail
    assert abs(lp.item() - lu.item()) > 1e-3, "stock no longer leaks; the deltafuse test lost its contrast"
