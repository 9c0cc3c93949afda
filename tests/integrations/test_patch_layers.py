"""Rows of layer 1 over rows of layer 0 (the context-parallel rows over the plain ones), on a fake modeling module:
each layer has its own record, re-applying either layer is recognised, a partial revert puts back the layer it
applied, a layer built while both were applied is recognised as such, and revert restores every stock object."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher, Route

NAME = "deltafuse_fake_layers"


def stock_op(x):
    return x


def plain_op(x):
    return x + 1


def cp_op(x):
    return x + 2


def _wrap(tag):
    def factory(inner):
        def forward(self, *args, **kwargs):
            return (tag, inner(self, *args, **kwargs))

        forward.__deltafuse_wraps__ = inner
        forward.__deltafuse_factory__ = f"deltafuse.{tag}"
        return forward

    return factory


@pytest.fixture
def fake(monkeypatch):
    mod = types.ModuleType(NAME)
    mod.is_fast_path_available = False  # the old design: instance rows apply
    mod.op = stock_op
    mod.TABLE = {"sdpa": stock_op}

    def layer_init(self):
        torch.nn.Module.__init__(self)
        self.cached_op = mod.op  # what an old-design __init__ caches

    mod.Layer = type("Layer", (torch.nn.Module,), {"__init__": layer_init, "forward": lambda self: "stock",
                                                   "__module__": NAME})
    monkeypatch.setitem(sys.modules, NAME, mod)
    routes = (
        Route("gdn", "global", "", "op", plain_op),
        Route("gdn", "instance", "Layer", "cached_op", plain_op, init_from=("op",)),
        Route("gdn", "class", "Layer", "forward", _wrap("plain"), wrap=True),
        Route("fused_ops", "mapping", "Layer", "sdpa", _wrap("plain"), wrap=True, mapping=f"{NAME}.TABLE"),
        Route("context_parallel", "global", "", "op", cp_op, layer=1),
        Route("context_parallel", "instance", "Layer", "cached_op", cp_op, init_from=("op",), layer=1),
        Route("context_parallel", "class", "Layer", "forward", _wrap("cp"), wrap=True, layer=1),
        Route("context_parallel", "mapping", "Layer", "sdpa", _wrap("cp"), wrap=True, mapping=f"{NAME}.TABLE",
              layer=1),
    )
    patcher = Patcher([FamilyMap(family="fake", module=NAME, routes=routes)])
    stock_forward = mod.Layer.forward
    yield mod, patcher, stock_forward
    patcher.revert()


PLAIN = {"gdn": True, "fused_ops": True}
BOTH = {**PLAIN, "context_parallel": True}


def _model(mod):
    model = torch.nn.Sequential(mod.Layer())
    hooked = mod.Layer()  # an accelerate hook captured its forward
    hooked._old_forward = types.MethodType(mod.Layer.forward, hooked)
    model.append(hooked)
    return model


def _state(mod, model):
    return (mod.op, vars(mod.Layer)["forward"], mod.TABLE["sdpa"], model[0].cached_op, model[1]._old_forward)


def test_layers_apply_twice_and_revert(fake):
    mod, patcher, stock_forward = fake
    model = _model(mod)
    _, rows, _ = patcher.apply(BOTH, model)
    assert {r.status for r in rows} == {"applied"}
    assert mod.op is cp_op and model[0].cached_op is cp_op
    assert model[0]() == ("cp", ("plain", "stock")) and model[1]._old_forward() == ("cp", ("plain", "stock"))
    assert mod.TABLE["sdpa"].__deltafuse_wraps__.__deltafuse_wraps__ is stock_op
    layered = _state(mod, model)
    for switches in (BOTH, PLAIN):  # either layer again: recognised under the layer above it
        _, rows, _ = patcher.apply(switches, model)
        assert {r.status for r in rows} == {"already applied"}, [(r.target, r.status) for r in rows]
        assert all(a is b for a, b in zip(_state(mod, model), layered))
    patcher.revert()
    assert mod.op is stock_op and model[0].cached_op is stock_op and mod.TABLE["sdpa"] is stock_op
    assert vars(mod.Layer)["forward"] is stock_forward and model[1]._old_forward.__func__ is stock_forward


def test_partial_revert_puts_back_the_layer_below(fake):
    mod, patcher, _ = fake
    model = _model(mod)
    patcher.apply(PLAIN, model)
    plain = _state(mod, model)
    mark = patcher.mark()
    _, rows, _ = patcher.apply(BOTH, model)
    assert sorted({(r.switch, r.status) for r in rows}) == [("context_parallel", "applied"),
                                                            ("fused_ops", "already applied"),
                                                            ("gdn", "already applied")]
    patcher.revert(since=mark)
    assert all(a is b for a, b in zip(_state(mod, model), plain))


def test_layer_built_while_both_applied(fake):
    mod, patcher, _ = fake
    patcher.apply(BOTH)
    model = torch.nn.Sequential(mod.Layer())
    assert model[0].cached_op is cp_op
    _, rows, _ = patcher.apply(PLAIN, model)  # the plain layer alone: the model gets the plain op
    row = next(r for r in rows if r.target.endswith("(instance).cached_op"))
    assert row.status == "applied (built while patched)" and row.old.endswith("stock_op")
    assert model[0].cached_op is plain_op
    _, rows, _ = patcher.apply(BOTH, model)
    assert model[0].cached_op is cp_op
    patcher.revert()
    assert model[0].cached_op is stock_op and mod.op is stock_op


def test_layer_must_be_known():
    with pytest.raises(ValueError, match="Route.layer=2; allowed: 0, 1"):
        Route("gdn", "global", "", "op", plain_op, layer=2)
