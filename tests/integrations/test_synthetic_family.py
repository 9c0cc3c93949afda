"""A family is one map entry: a synthetic family (transformers' Qwen3.5 modeling code with every class renamed,
loaded as a new transformers package) gets a FamilyMap built from a dict, and deltafuse patches it, computes
with it and restores every original object."""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import pytest
import torch

from deltafuse import models
from deltafuse.integrations.transformers import packing as pk
from deltafuse.integrations.transformers.fused_rows import fused_routes
from deltafuse.integrations.transformers.gdn_rows import gdn_routes
from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher
from deltafuse.integrations.transformers.tiny import TINY_GDN
from tests.helpers import input_seed
from tests.integrations import RTOL, assert_same_objects, count_op_calls, packed_inputs, rel_max

PACKAGE = "transformers.models.synth_gdn"


def _load(source_module: str, name: str):
    """``source_module``'s file with Qwen3_5 / qwen3_5 renamed, executed as module ``name``."""
    src = importlib.util.find_spec(source_module).origin
    with open(src, encoding="utf-8") as fh:
        code = re.sub("Qwen3_5", "SynthGdn", fh.read()).replace("qwen3_5", "synth_gdn")
    module = types.ModuleType(name)
    module.__file__ = src
    module.__package__ = PACKAGE
    sys.modules[name] = module
    exec(compile(code, src, "exec"), module.__dict__)
    return module


@pytest.fixture
def synthetic(monkeypatch):
    pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    monkeypatch.setitem(sys.modules, PACKAGE, package)
    config = _load("transformers.models.qwen3_5.configuration_qwen3_5", f"{PACKAGE}.configuration_synth_gdn")
    modeling = _load("transformers.models.qwen3_5.modeling_qwen3_5", f"{PACKAGE}.modeling_synth_gdn")
    package.SynthGdnTextConfig = config.SynthGdnTextConfig
    package.SynthGdnForCausalLM = modeling.SynthGdnForCausalLM
    yield modeling
    for name in (f"{PACKAGE}.configuration_synth_gdn", f"{PACKAGE}.modeling_synth_gdn"):
        sys.modules.pop(name, None)


# everything a family needs, as data
SPEC = dict(
    family="synth_gdn", module=f"{PACKAGE}.modeling_synth_gdn", title="SynthGdn",
    config_classes=("SynthGdnTextConfig",), model_classes=("SynthGdnForCausalLM",),
    tiny_name="tiny-synth", tiny_config=dict(TINY_GDN), doc="a renamed Qwen3.5 (test)",
    classes=dict(gdn="SynthGdnGatedDeltaNet", text_model="SynthGdnTextModel", decoder_layer="SynthGdnDecoderLayer",
                 rms_norm="SynthGdnRMSNorm", rms_norm_gated="SynthGdnRMSNormGated", mlp="SynthGdnMLP",
                 causal_lm="SynthGdnForCausalLM", attention="SynthGdnAttention"),
)


def family_map(spec: dict) -> FamilyMap:
    spec = dict(spec)
    c = spec.pop("classes")
    routes = gdn_routes(c["gdn"], c["text_model"], c["decoder_layer"]) + fused_routes(
        c["rms_norm"], c["rms_norm_gated"], c["mlp"], c["causal_lm"], c["attention"])
    return FamilyMap(routes=routes, **spec)


def _originals(fmap: FamilyMap, module, model) -> dict:
    """Every object a row of ``fmap`` may replace: module globals, own class attributes, instance attributes."""
    snap = {}
    for route in fmap.routes:
        if route.kind == "global":
            snap[route.attr] = vars(module).get(route.attr, "<absent>")
        elif route.kind == "class":
            snap[(route.owner, route.attr)] = vars(getattr(module, route.owner)).get(route.attr, "<absent>")
        elif route.kind == "instance":
            for i, m in enumerate(model.modules()):
                if isinstance(m, getattr(module, route.owner)):
                    snap[(route.owner, i, route.attr)] = vars(m).get(route.attr, "<absent>")
    return snap


def test_a_family_from_a_dict_is_patched_computes_and_reverts(synthetic, monkeypatch):
    fmap = family_map(SPEC)
    monkeypatch.setitem(models.FAMILIES, fmap.family, fmap)
    monkeypatch.setitem(models.NAMED_MODELS, fmap.tiny_name, models.NamedModel(fmap.family, fmap.tiny_config))
    model = models.build_model("tiny-synth", seed=input_seed("model", 3)).eval()
    assert type(model) is synthetic.SynthGdnForCausalLM
    assert models.model_family(model) == "synth_gdn" and models.config_family(model.config) == "synth_gdn"
    assert "SynthGdn causal LMs" in models.supported_families()

    rows = [[torch.randint(0, 512, (n,)) for n in (5, 1, 8)], [torch.randint(0, 512, (n,)) for n in (9, 5)]]
    ids, pos, _, _, _ = packed_inputs(rows)
    with torch.no_grad():
        ref = torch.cat([torch.cat([model(input_ids=s[None], use_cache=False).logits for s in r], 1)
                         for r in rows])
    before = _originals(fmap, synthetic, model)
    patcher = Patcher([fmap])
    families, applied, _ = patcher.apply({"gdn": True, "fused_ops": True}, model)
    design = Patcher.design(fmap, synthetic)
    assert families == {"synth_gdn": f"{design} design ({fmap.module})"}
    expected = [r for r in fmap.routes if r.design in ("any", design) and r.kind != "mapping"]
    # "in place": a global already holding the replacement (FLA's norm absent: None stays None)
    targets = {row.target for row in applied if row.status.startswith("applied") or row.status == "in place"}
    assert all(r.target_name(fmap.module) in targets for r in expected), (expected, applied)
    assert not [row for row in applied if row.status == "not found"]
    assert _originals(fmap, synthetic, model) != before

    calls = count_op_calls(monkeypatch, ["chunk_gated_delta_rule", "causal_conv1d_fn"])
    try:
        with torch.no_grad():
            got = model(input_ids=ids, position_ids=pos).logits  # packed: per-sequence results
    finally:
        patcher.revert()
    n_gdn = sum(isinstance(m, synthetic.SynthGdnGatedDeltaNet) for m in model.modules())
    assert calls == {"chunk_gated_delta_rule": n_gdn, "causal_conv1d_fn": n_gdn}
    assert rel_max(got, ref) < RTOL
    assert_same_objects(before, _originals(fmap, synthetic, model))
    assert not patcher.has_records()
    assert pk._OP_PACKING.get() is None


def test_family_lookup_is_by_exact_class_names(synthetic, monkeypatch):
    fmap = family_map(SPEC)
    monkeypatch.setitem(models.FAMILIES, fmap.family, fmap)
    # a class of the family's package that the map does not name (the GDN layer) is no model of the family
    layer_cls = synthetic.SynthGdnGatedDeltaNet
    assert models._family_of(layer_cls, "model_classes") is None
    # the same class name defined outside the family's package is not the family's either
    outsider = type("SynthGdnForCausalLM", (), {"__module__": "elsewhere.modeling"})
    assert models._family_of(outsider, "model_classes") is None
    # a user subclass of the family's causal LM is
    sub = type("MyLM", (synthetic.SynthGdnForCausalLM,), {"__module__": "user_code"})
    assert models._family_of(sub, "model_classes") == "synth_gdn"
