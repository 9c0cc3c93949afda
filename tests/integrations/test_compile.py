"""torch.compile of a patched tiny model: no graph break comes from deltafuse's ops or backends, and the
compiled loss and every gradient equal eager's (fp32)."""

from __future__ import annotations

import pytest
import torch

import deltafuse
from deltafuse.models import build_model

OURS = ("deltafuse/ops/", "deltafuse/backends/")


def _inputs(model, packed):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None] if packed else None
    return ids, pos


def _run(fn, model, ids, pos):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, pos)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_compiled_tiny_model_has_no_break_in_our_ops_and_equals_eager(packed):
    torch.manual_seed(0)
    model = build_model("tiny")
    deltafuse.apply(model)
    try:
        ids, pos = _inputs(model, packed)

        def step(ids, pos):
            return model(input_ids=ids, labels=ids, position_ids=pos).loss

        explained = torch._dynamo.explain(step)(ids, pos)
        ours = [r for r in explained.break_reasons
                if any(any(o in f.filename for o in OURS) for f in r.user_stack)]
        assert not ours, [(r.reason, r.user_stack[-1]) for r in ours]
        torch._dynamo.reset()
        eager_loss, eager_grads = _run(step, model, ids, pos)
        loss, grads = _run(torch.compile(step), model, ids, pos)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == eager_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        deltafuse.revert(model)
