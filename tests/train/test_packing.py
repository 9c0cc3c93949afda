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
from tests.helpers import Float64Everywhere, float64_copy, fp32_gradient_errors, input_seed

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


LOSS_ATOL = 1e-5  # packed against padded: fp32 rounding of the loss (measured: at most 9.5e-7 in 120 draws)
LEAK = 100  # how far outside the gradient bound stock's packed run must be (measured: 1,900x or more in 72 draws)


def make_model(name):
    # fp32: the MoE experts' grouped_mm has no fp64 kernel (the oracle below computes them eagerly). The default
    # initialisation: with initializer_range 0.2 (once used so that a leak showed in the loss) a few tokens' gradients
    # were ill-conditioned, every fp32 run's error in the lower layers grew to 1e-4 - 1e-3 and differed between
    # runs by up to 9x, and a leak stood only about 100x above the bound below.
    return build_model(name, dtype=torch.float32, seed=input_seed("model")).train()


def loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def padded_references(model, padded):
    """The padded batch's gradients in float64 (a float64 copy of the stock model computed in float64 throughout,
    tests/helpers.py ``Float64Everywhere``, eager MoE experts) and in fp32 with stock transformers."""
    with Float64Everywhere():
        want = loss_and_grads(float64_copy(model), padded)[1]
    return want, loss_and_grads(model, padded)[1]


def excess(grads: dict, want: dict, stock: dict) -> dict[str, float]:
    """Per parameter, the gradient's error against float64 over the most it may be for the run to be as accurate
    as stock's fp32 run of the padded batch (tests/helpers.py ``fp32_gradient_errors``)."""
    return {n: mine / bound for n, (mine, bound) in fp32_gradient_errors(grads, want, stock).items()}


@pytest.mark.parametrize("row_tokens", [None, 512], ids=["padding-free", "filled-to-512"])
@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_packed_equals_padded_with_deltafuse(name, row_tokens):
    """The same loss to fp32 rounding, and every gradient of both as close to float64 as stock's padded fp32 run.
    Two fp32 runs that add the same terms in other orders cannot be held to a fixed tolerance of each other: with
    fresh weights (and the larger initialisation this test once used), packed and padded gradients differed by
    more than 2e-4 of their largest element in 3 of 48 draws, while both were as far from float64. Measured over 72
    draws: the largest error, packed or padded, at most 0.07 of the bound."""
    import deltafuse

    packed, padded = batches(row_tokens)
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == 3
    if row_tokens:  # the row is filled by a pad sequence of its own, and it is the loss of the real ones
        assert packed["input_ids"].shape[1] == row_tokens and packed["labels"][0, -1] == -100
    model = make_model(name)
    want, stock = padded_references(model, padded)
    with deltafuse.patched(model):
        lp, gp = loss_and_grads(model, packed)
        lu, gu = loss_and_grads(model, padded)
    torch.testing.assert_close(lp, lu, rtol=0, atol=LOSS_ATOL)
    assert len(gp) > 10
    bad = {f"{what} {n}": r for what, grads in (("packed", gp), ("padded", gu))
           for n, r in excess(grads, want, stock).items() if not r <= 1}
    assert not bad, "gradients farther from float64 than stock's padded run allows (error / bound): " + \
        ", ".join(f"{n} {r:.2f}" for n, r in bad.items())


@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_stock_transformers_leaks_state_across_packed_sequences(name):
    """Stock's packed run, judged as the test above judges deltafuse's gradients, fails it by far, so that test
    can fail. (Its loss alone may not: in 120 draws stock's packed loss was as little as 3.3e-6 off.)"""
    packed, padded = batches()
    model = make_model(name)
    want, stock = padded_references(model, padded)
    worst = max(excess(loss_and_grads(model, packed)[1], want, stock).values())
    assert worst > LEAK, f"stock no longer leaks; the deltafuse test lost its contrast ({worst:.3g}x the bound)"
