"""The causal-LM keywords of the patched forward (Liger's protocol): ``skip_logits``, ``return_token_accuracy``,
the ``deltafuse_logits`` alias, and ``return_dict=False`` tuples with stock's arity, on the three families."""

from __future__ import annotations

import pytest
import torch

import deltafuse.ops
from deltafuse import patching
from deltafuse.integrations.transformers import adapters_loss as al
from deltafuse.models import TINY_NAMES, build_model
from tests.helpers import input_gen, input_seed
from tests.integrations import RTOL, assert_grads_close, grads, rel_max

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

NAMES = list(TINY_NAMES)
SMALL = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=97)


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = deltafuse.ops.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(kwargs.get("return_token_accuracy", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(deltafuse.ops, "fused_linear_cross_entropy", counting)
    return calls


def _setup(name, seed=0):
    """A model and a batch whose labels are the stock model's own argmax on half the positions, so the token
    accuracy is far from 0 and 1 (10 to 12 of the 22 counted targets, and the others' one-in-97 chance matches).
    Each position drawn with probability 0.5 instead put over 80 % of them on the argmax about once in 460 draws
    (CI seed 1400705415: 20 of 22)."""
    model = build_model(name, seed=input_seed("model", seed), **SMALL).train()
    gen = input_gen(seed + 1)
    ids = torch.randint(0, 97, (2, 13), generator=gen)
    with torch.no_grad():
        pred = model(input_ids=ids, use_cache=False).logits.argmax(-1)
    labels = torch.randint(0, 97, (2, 13), generator=gen)
    take = torch.zeros(2, 13, dtype=torch.bool)
    take[:, 1:] = (torch.randperm(24, generator=gen) < 12).view(2, 12)  # 12 of the 24 shifted positions
    labels[:, 1:] = torch.where(take[:, 1:], pred[:, :-1], labels[:, 1:])  # label t+1 predicted at t
    labels[0, :3] = -100
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    if hasattr(model.config, "num_experts"):
        kwargs["output_router_logits"] = True
    return model, kwargs


def _accuracy(logits, labels):
    """From stock logits: counted shifted targets whose argmax is the target / counted targets (float64)."""
    targets = labels[:, 1:]
    pred = logits[:, :-1].argmax(-1)
    valid = targets != -100
    return ((pred == targets) & valid).sum().item() / valid.sum().item()


def _step(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out[0].backward() if isinstance(out, tuple) else out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("name", NAMES)
def test_skip_logits_both_ways_and_token_accuracy_from_stock_logits(name, fused_calls):
    model, kwargs = _setup(name)
    ref, ref_grads = _step(model, kwargs)
    want = _accuracy(ref.logits, kwargs["labels"])
    assert 0.2 < want < 0.8
    with patching.patched(model):
        skipped, got = _step(model, {**kwargs, "skip_logits": True, "return_token_accuracy": True})
        assert fused_calls == [True] and skipped.logits is None
        assert abs(skipped.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
        assert_grads_close(got, ref_grads)
        assert skipped.token_accuracy.item() == pytest.approx(want, abs=1e-6)
        assert not skipped.token_accuracy.requires_grad
        kept, got = _step(model, {**kwargs, "skip_logits": False, "return_token_accuracy": True})
        assert fused_calls == [True]  # the stock path: logits with their gradient
        assert rel_max(kept.logits, ref.logits) < RTOL and kept.logits.requires_grad
        assert kept.token_accuracy.item() == pytest.approx(want, abs=1e-6)
        assert_grads_close(got, ref_grads)
        default, _ = _step(model, kwargs)  # training default: skipped, no accuracy field
        assert fused_calls == [True, False] and default.logits is None and "token_accuracy" not in default
        alias, _ = _step(model, {**kwargs, al.LOGITS_KWARG: True})
        assert fused_calls == [True, False] and rel_max(alias.logits, ref.logits) < RTOL
        with torch.no_grad():
            evaluated = model(**kwargs, return_token_accuracy=True)  # evaluation default: logits
            assert fused_calls == [True, False] and rel_max(evaluated.logits, ref.logits) < RTOL
            lean = model(**kwargs, skip_logits=True, return_token_accuracy=True)  # asked to skip: fused
            assert fused_calls == [True, False, True] and lean.logits is None
    assert abs(evaluated.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert abs(lean.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert evaluated.token_accuracy.item() == pytest.approx(want, abs=1e-6)
    assert lean.token_accuracy.item() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_return_dict_false_keeps_stock_tuple_arity(name, fused_calls):
    """return_dict=False: stock's tuple (logits computed) by default; skip_logits=True: the same arity with
    None in the logits slot and every other element in stock's place; token accuracy appended last."""
    model, kwargs = _setup(name, seed=3)
    ref = model(**kwargs, return_dict=False)
    logits_at = 2 if hasattr(model.config, "num_experts") else 1  # (loss, aux_loss, logits, router_logits)
    assert rel_max(ref[logits_at], model(**kwargs).logits) == 0
    with patching.patched(model):
        default = model(**kwargs, return_dict=False)
        assert fused_calls == []
        skipped = model(**kwargs, return_dict=False, skip_logits=True)
        assert fused_calls == [False]
        with_acc = model(**kwargs, return_dict=False, skip_logits=True, return_token_accuracy=True)
        stock_acc = model(**kwargs, return_dict=False, return_token_accuracy=True)
    for got in (default, skipped):
        assert isinstance(got, tuple) and len(got) == len(ref)
    assert len(with_acc) == len(stock_acc) == len(ref) + 1
    assert skipped[logits_at] is None and with_acc[logits_at] is None
    assert rel_max(default[logits_at], ref[logits_at]) < RTOL and rel_max(stock_acc[logits_at], ref[logits_at]) < RTOL
    for i, r in enumerate(ref):
        if i == logits_at:
            continue
        for got in (default, skipped, with_acc, stock_acc):
            if isinstance(r, tuple):  # router logits: one tensor per layer
                assert len(got[i]) == len(r) and all(rel_max(a, b) < RTOL for a, b in zip(got[i], r))
            else:
                assert rel_max(got[i], r) < RTOL
    want = _accuracy(ref[logits_at], kwargs["labels"])
    assert with_acc[-1].item() == pytest.approx(want, abs=1e-6) and stock_acc[-1].item() == pytest.approx(want,
                                                                                                      abs=1e-6)


def test_keyword_errors_name_the_keyword_value_and_what_is_allowed():
    model, kwargs = _setup("tiny", seed=5)
    patching.apply(model)
    with pytest.raises(ValueError, match=r"skip_logits='no'; allowed: True, False or None"):
        model(**kwargs, skip_logits="no")
    with pytest.raises(ValueError, match=r"return_token_accuracy=1; allowed: True or False"):
        model(**kwargs, return_token_accuracy=1)
    with pytest.raises(ValueError, match=r"deltafuse_logits=True asks for logits and skip_logits=True skips"):
        model(**kwargs, skip_logits=True, deltafuse_logits=True)
    no_labels = dict(kwargs, labels=None)
    with pytest.raises(ValueError, match=r"skip_logits=True needs labels \(or shift_labels\); got none"):
        model(**no_labels, skip_logits=True)
    with pytest.raises(ValueError, match=r"return_token_accuracy=True needs labels"):
        model(**no_labels, return_token_accuracy=True)
    with pytest.raises(ValueError, match=r"return_token_accuracy=True needs the logits of every position; "
                                         r"got logits_to_keep=1 \(allowed: 0\)"):
        model(**kwargs, logits_to_keep=1, return_token_accuracy=True)
    # skip_logits=False and deltafuse_logits=True agree; deltafuse_logits=False is the default
    assert model(**kwargs, skip_logits=False, deltafuse_logits=True).logits is not None
    assert model(**kwargs, deltafuse_logits=False).logits is None
