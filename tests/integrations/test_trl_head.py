"""TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) served by ``ops.token_logprobs``: a tiny Qwen3.5
gives the same ``FusedCausalLMOutput`` fields and every gradient with deltafuse applied as without it, deltafuse's
op is the one called, calls it cannot serve go to TRL's function, and revert restores TRL's object."""

from __future__ import annotations

import sys

import pytest
import torch

import deltafuse
from deltafuse import ops
from deltafuse.integrations import trl as trl_integration
from deltafuse.models import build_model
from tests.helpers import input_gen, input_seed
from tests.integrations import assert_grads_close, grads, rel_max

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")

FIELDS = ("log_probs", "entropy", "is_top1")


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = ops.token_logprobs

    def wrapper(*args, **kwargs):
        calls.append(kwargs.get("outputs"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "token_logprobs", wrapper)
    return calls


def _batch(vocab, seed):
    gen = input_gen(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, 9:] = -100  # padding
    weights = torch.rand(2, 11, generator=gen) + 0.5  # per-token weights on the log-probs (as DFT's)
    ent_weights = torch.randn(2, 11, generator=gen)   # an entropy term (as GRPO's entropy bonus)
    return ids, labels, weights, ent_weights


def _run(model, ids, labels, weights, ent_weights):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    objective = out.loss + (out.log_probs * weights).sum() + (out.entropy * ent_weights).sum()
    objective.backward()
    return out, grads(model)


@pytest.mark.parametrize("frozen_head", [False, True], ids=["trainable_head", "frozen_head"])
def test_tiny_model_matches_trl_and_calls_deltafuse(spy, frozen_head):
    """A frozen head (LoRA) is served by ops.token_logprobs; a trainable one by TRL's function (faster there)."""
    torch.manual_seed(input_seed(0))
    model = build_model("tiny", seed=input_seed("model"))
    model.lm_head.weight.requires_grad_(not frozen_head)
    trl_utils.add_fused_lm_head(model, outputs=FIELDS)
    batch = _batch(model.config.vocab_size, seed=1)
    stock, g_stock = _run(model, *batch)
    assert not spy
    with deltafuse.patched(model) as report:
        assert any(r.target == "trl.trainer.utils._ChunkedLogProbFunction" and r.status == "applied"
                   for r in report.rows), report.details()
        ours, g_ours = _run(model, *batch)
    assert spy == ([FIELDS] if frozen_head else [])
    assert not isinstance(trl_utils._ChunkedLogProbFunction, trl_integration.TokenLogProbFunction)  # reverted
    for name in ("loss", "log_probs", "entropy"):
        assert rel_max(getattr(ours, name), getattr(stock, name)) < 1e-4, name
    assert torch.equal(ours.is_top1, stock.is_top1) and torch.equal(ours.label_mask, stock.label_mask)
    assert ours.log_sum_sq_probs is None and ours.mean_logits is None
    assert_grads_close(g_ours, g_stock)
    assert (g_ours["lm_head.weight"] is None) == frozen_head


def test_revert_restores_trls_function():
    original = trl_utils._ChunkedLogProbFunction
    with deltafuse.patched() as report:
        assert isinstance(trl_utils._ChunkedLogProbFunction, trl_integration.TokenLogProbFunction)
        assert trl_utils._ChunkedLogProbFunction.original is original
        assert "trl.trainer.utils" in report.details()
    assert trl_utils._ChunkedLogProbFunction is original


def test_fused_ops_off_leaves_trl_alone():
    original = trl_utils._ChunkedLogProbFunction
    with deltafuse.patched(fused_ops=False):
        assert trl_utils._ChunkedLogProbFunction is original


def test_trl_not_imported_is_not_imported_by_apply(monkeypatch):
    """apply() does not import TRL; the report says the map was skipped."""
    original = trl_utils._ChunkedLogProbFunction
    monkeypatch.delitem(sys.modules, "trl")
    with deltafuse.patched() as report:
        assert report.families["trl"].startswith("not imported"), report.families
        assert trl_utils._ChunkedLogProbFunction is original
    assert "trl" not in sys.modules


@pytest.mark.parametrize("kwargs,reason", [
    (dict(outputs=("log_probs", "mean_logits")), "field(s) ['mean_logits'] are not implemented"),
    (dict(outputs=("log_probs", "log_sum_sq_probs", "entropy")), "field(s) ['log_sum_sq_probs']"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
    (dict(logit_scale=0.5), "logit_scale=0.5 is not supported"),
    (dict(weight=torch.randn(29, 8, dtype=torch.bfloat16)), "weight or bias dtype differs from hidden's"),
    (dict(weight=torch.randn(29, 8, dtype=torch.float64), hidden=torch.randn(6, 8, dtype=torch.float64)),
     "a dtype other than fp32, fp16, bf16"),
])
def test_calls_deltafuse_cannot_serve_go_to_trl(spy, kwargs, reason):
    gen = input_gen(2)
    args = dict(hidden=torch.randn(6, 8, generator=gen, requires_grad=True), weight=torch.randn(29, 8, generator=gen),
                bias=None, targets=torch.randint(0, 29, (6,), generator=gen), temperature=0.9, chunk_size=16,
                final_logit_softcapping=None, logit_scale=1.0, outputs=FIELDS)
    args.update(kwargs)
    names = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
             "logit_scale", "outputs")
    assert reason in trl_integration.fallback_reason(*(args[n] for n in names if n != "chunk_size"))
    served = trl_integration.TokenLogProbFunction(trl_utils._ChunkedLogProbFunction)
    want = trl_utils._ChunkedLogProbFunction.apply(*(args[n] for n in names))
    got = served.apply(*(args[n] for n in names))
    assert not spy
    assert len(got) == 5
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


def test_served_call_returns_trls_tuple(spy):
    gen = input_gen(3)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(29, 8, generator=gen)
    bias = torch.randn(29, generator=gen)
    targets = torch.randint(0, 29, (6,), generator=gen)
    served = trl_integration.TokenLogProbFunction(trl_utils._ChunkedLogProbFunction)
    for outputs in [("log_probs",), ("log_probs", "is_top1"), FIELDS]:
        got = served.apply(hidden, weight, bias, targets, 0.8, 16, None, 1.0, outputs)
        want = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.8, 16, None, 1.0, outputs)
        assert len(got) == 5 and got[2] is None and got[3] is None
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b) if a.dtype == torch.bool else rel_max(a, b) < 1e-5
    assert spy == [("log_probs",), ("log_probs", "is_top1"), FIELDS]
    # a trainable head or bias: TRL's own function (faster there), the same results
    for trainable in (weight, bias):
        trainable.requires_grad_(True)
        assert "trainable head" in trl_integration.trl_is_faster(weight, bias)
        got = served.apply(hidden, weight, bias, targets, 0.8, 16, None, 1.0, FIELDS)
        want = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, 0.8, 16, None, 1.0, FIELDS)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
        trainable.requires_grad_(False)
    assert len(spy) == 3
    with torch.no_grad():  # no backward, so nothing to be faster at: served
        assert trl_integration.trl_is_faster(weight.requires_grad_(True), bias) is None
