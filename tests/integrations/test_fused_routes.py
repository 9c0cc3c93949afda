"""The ``fused_ops`` rows (norms, RoPE, SwiGLU, fused loss) and the ``moe`` rows (experts interface) on the
three families: parity with stock (loss, logits where returned, every gradient) per switch and together,
packed batches, PEFT LoRA (head and experts), that the routes fire, revert/idempotence, the switches, the
report, and the generic ``mapping`` row kind of the patcher."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deltafuse import patching
from deltafuse.maps import FAMILY_MAPS
from deltafuse.integrations.transformers import adapters_fused as af
from deltafuse.integrations.transformers import adapters_loss as al
from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher, Route
from deltafuse.models import TINY_NAMES, build_model
from tests.helpers import input_gen, input_seed
from tests.integrations import (RTOL, assert_grads_close, count_op_calls, family_modules, grads, packed_inputs,
                                per_sequence_stock, rel_max)

pytestmark = pytest.mark.usefixtures("clean_deltafuse")

NAMES = list(TINY_NAMES)
SMALL = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=97)
OPS = ("rms_norm_zero_centered", "rms_norm_gated", "apply_rotary_pos_emb", "swiglu", "fused_linear_cross_entropy",
       "moe_experts")
OFF = dict(gdn=False, fused_ops=False, moe=False)


def _model(name, seed=0, **overrides):
    return build_model(name, seed=input_seed("model", seed), **{**SMALL, **overrides}).train()


def _is_moe(model) -> bool:
    return hasattr(model.config, "num_experts")


def _batch(model, B=2, T=13, seed=1):
    gen = input_gen(seed)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    if _is_moe(model):
        kwargs["output_router_logits"] = True  # the router aux loss joins the loss as in stock
    return kwargs


def _step(model, kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, grads(model)


@pytest.fixture
def spy(monkeypatch):
    return count_op_calls(monkeypatch, OPS)


def _expected_calls(model) -> dict[str, int]:
    """Calls per forward of a model built with SMALL: one GDN and one full-attention layer."""
    cfg = model.config
    layers = cfg.num_hidden_layers
    full = sum(t == "full_attention" for t in cfg.layer_types)
    linear = layers - full
    return {"rms_norm_zero_centered": 2 * layers + 1 + 2 * full,  # input/post-attention, final, q/k norms
            "rms_norm_gated": linear, "apply_rotary_pos_emb": full,
            "swiglu": layers,  # the dense MLP or the shared expert of every layer
            "moe_experts": layers if _is_moe(model) else 0, "fused_linear_cross_entropy": 1}


# --- parity: each switch alone and all together ------------------------------------------------------
SWITCHES = {"fused_ops": dict(OFF, fused_ops=True), "moe": dict(OFF, moe=True),
            "all": dict(gdn=True, fused_ops=True, moe=True)}


@pytest.mark.parametrize("name,switch", [(n, s) for n in NAMES for s in SWITCHES if (n, s) != ("tiny", "moe")])
def test_switch_equals_stock_loss_logits_and_every_gradient(name, switch, spy):
    model = _model(name)
    kwargs = _batch(model)
    ref, ref_grads = _step(model, kwargs)
    with torch.no_grad():
        ref_eval = model(**kwargs)
    with patching.patched(model, **SWITCHES[switch]) as report:
        assert report.applied
        assert all(r.switch != "gdn" for r in report.rows) or switch == "all"
        for k in spy:
            spy[k] = 0
        out, got = _step(model, kwargs)
        fired = dict(spy)
        with torch.no_grad():  # evaluation: stock loss path, logits returned
            out_eval = model(**kwargs)
    want = _expected_calls(model)
    if switch == "moe":
        want = {k: v if k == "moe_experts" else 0 for k, v in want.items()}
    elif switch == "fused_ops":
        want["moe_experts"] = 0
    assert fired == want
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert_grads_close(got, ref_grads)
    if switch == "moe":
        assert rel_max(out.logits, ref.logits) < RTOL  # the loss path is stock with moe alone
    else:
        assert out.logits is None  # the fused loss never builds [tokens, vocab] logits
    assert rel_max(out_eval.logits, ref_eval.logits) < RTOL
    assert abs(out_eval.loss.item() - ref_eval.loss.item()) <= 2e-6 * abs(ref_eval.loss.item())
    if _is_moe(model):
        assert out.aux_loss is not None and rel_max(out.aux_loss, ref.aux_loss) < RTOL


@pytest.mark.parametrize("name", NAMES)
def test_packed_batch_equals_per_sequence_stock_with_everything_on(name, spy):
    model = _model(name, seed=2)
    gen = input_gen(3)
    rows = [[torch.randint(0, 97, (n,), generator=gen) for n in row] for row in ([9, 1, 14], [5, 19])]
    model.zero_grad(set_to_none=True)
    ref_loss, ref_logits = per_sequence_stock(model, rows)
    ref_grads = grads(model)
    ids, pos, labels, _, _ = packed_inputs(rows)
    model.zero_grad(set_to_none=True)
    with patching.patched(model):
        out = model(input_ids=ids, position_ids=pos, labels=labels)
        out.loss.backward()
        got = grads(model)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=pos).logits
    assert spy["fused_linear_cross_entropy"] == 1 and out.logits is None
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert_grads_close(got, ref_grads)
    assert rel_max(logits, ref_logits) < RTOL


# --- logits and the loss path's conditions ---------------------------------------------------------
def test_logits_when_asked_and_stock_loss_path_conditions(spy):
    model = _model("tiny", seed=4)
    kwargs = _batch(model)
    ref, ref_grads = _step(model, kwargs)
    patching.apply(model)
    fused = spy["fused_linear_cross_entropy"]
    out, got = _step(model, {**kwargs, al.LOGITS_KWARG: True})
    assert spy["fused_linear_cross_entropy"] == fused  # asked for logits: the stock loss path
    assert rel_max(out.logits, ref.logits) < RTOL and out.logits.requires_grad
    assert_grads_close(got, ref_grads)
    out = model(input_ids=kwargs["input_ids"], labels=kwargs["labels"][:, -1:], logits_to_keep=1)
    assert out.logits.shape[1] == 1 and spy["fused_linear_cross_entropy"] == fused
    # positional arguments: the fused path; with return_dict=False the stock path (stock's tuple)
    out = model(kwargs["input_ids"], None, None, None, None, kwargs["labels"], use_cache=False)
    assert spy["fused_linear_cross_entropy"] == fused + 1 and out.logits is None
    assert rel_max(out.loss, ref.loss) < RTOL
    as_tuple = model(kwargs["input_ids"], None, None, None, None, kwargs["labels"], return_dict=False)
    assert spy["fused_linear_cross_entropy"] == fused + 1
    assert isinstance(as_tuple, tuple) and rel_max(as_tuple[0], ref.loss) < RTOL
    assert rel_max(as_tuple[1], ref.logits) < RTOL
    # a custom loss function: stock path (it receives the logits)
    seen = []

    def custom(logits, labels, vocab_size, **kw):
        seen.append(logits.shape)
        return logits.float().mean()

    model.loss_function = custom
    model(**kwargs).loss.backward()
    assert seen and spy["fused_linear_cross_entropy"] == fused + 1
    with pytest.raises(ValueError, match=r"deltafuse_logits='yes'; allowed: True or False"):
        model(**kwargs, deltafuse_logits="yes")
    blocker = al.fused_loss_blocker
    assert blocker(model, kwargs) == "the model has a custom loss function"
    del model._loss_function
    assert blocker(model, kwargs) is None
    assert blocker(model, dict(kwargs, labels=None)) == "no labels"
    assert blocker(model, dict(kwargs, logits_to_keep=torch.tensor([1]))).startswith("logits_to_keep=")
    assert blocker(model, kwargs, skip_logits=False).startswith("the caller asked for logits")
    assert blocker(model, dict(kwargs, return_dict=False)).startswith("return_dict=False")
    assert blocker(model, dict(kwargs, return_dict=False), skip_logits=True) is None
    with torch.no_grad():
        assert blocker(model, kwargs).startswith("gradients are off")
        assert blocker(model, kwargs, skip_logits=True) is None


def test_num_items_in_batch_and_shift_labels_as_stock(spy):
    model = _model("tiny-moe", seed=5)
    kwargs = _batch(model)
    shifted = torch.nn.functional.pad(kwargs["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    calls = [dict(kwargs, num_items_in_batch=torch.tensor(7)), dict(kwargs, shift_labels=shifted),
             dict(kwargs, labels=kwargs["labels"].masked_fill(kwargs["labels"] == 3, 4).masked_fill(
                 kwargs["labels"] == -100, 3), ignore_index=3)]
    for call in calls:
        ref, ref_grads = _step(model, call)
        with patching.patched(model):
            out, got = _step(model, call)
        assert out.logits is None
        assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
        assert_grads_close(got, ref_grads)
    assert spy["fused_linear_cross_entropy"] == len(calls)


def test_tied_embedding_head_gets_both_gradients(spy):
    model = _model("tiny", seed=6, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    kwargs = _batch(model)
    ref, ref_grads = _step(model, kwargs)
    with patching.patched(model):
        out, got = _step(model, kwargs)
    assert spy["fused_linear_cross_entropy"] == 1
    assert_grads_close(got, ref_grads)


def test_head_weight_rules():
    lin = torch.nn.Linear(4, 6)
    assert al.head_weight(lin) == (lin.weight, lin.bias)
    handle = lin.register_forward_hook(lambda *a: None)
    assert al.head_weight(lin) is None  # a hooked head (tensor parallelism, offloading): stock path
    handle.remove()
    lin.forward = lambda x: x
    assert al.head_weight(lin) is None
    assert al.head_weight(torch.nn.Sequential(torch.nn.Linear(4, 6))) is None


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_fsdp2_head_rules():
    """An FSDP2 module (torch swaps in the class ``FSDP<cls>`` and registers its state's forward hooks) with a plain
    Linear underneath qualifies; one more hook, or another class underneath, does not. Built without a process
    group: the class and hooks exactly as ``fully_shard`` makes them (tests/integrations/test_fsdp.py shards)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, _register_group_forward_hooks

    def fsdp(module, group=False):
        module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
        state = FSDPState()
        if group:  # fully_shard([norm, lm_head]), as accelerate shards the head
            _register_group_forward_hooks([module], state._pre_forward, state._post_forward, set(),
                                          state._cast_output_dtype)
        else:
            module.register_forward_pre_hook(state._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(state._post_forward)
        return module

    for group in (False, True):
        head = fsdp(torch.nn.Linear(4, 6, bias=False), group)
        assert al.fused_head(head) and al.head_weight(head) == (head.weight, None)
        handle = head.register_forward_hook(lambda *a: None)
        assert not al.fused_head(head)  # another hook besides FSDP's: stock path
        handle.remove()
        assert al.fused_head(head)
        assert not al.fused_head(fsdp(torch.nn.Embedding(6, 4), group))
    assert not al._hooked(torch.nn.Linear(4, 6), allow_fsdp=True)
    plain = torch.nn.Linear(4, 6)
    plain.register_forward_pre_hook(FSDPState()._pre_forward, with_kwargs=True)
    assert not al.fused_head(plain)  # FSDP's hook on a module that is not an FSDP module: not recognised


def test_head_weight_of_a_tensor_subclass_computes_stock_logits_and_loss(monkeypatch, spy):
    """A head whose weight is a tensor subclass during its call (a DTensor under FSDP2 with tensor parallelism):
    the head computes stock's logits inside the call and the stock loss follows: loss, logits and every gradient
    as stock, for dict and tuple outputs and with the token accuracy."""
    model = _model("tiny-moe", seed=9)
    kwargs = _batch(model)
    ref, ref_grads = _step(model, kwargs)
    patching.apply(model)
    monkeypatch.setattr(al, "plain_tensor", lambda t: False)
    out, got = _step(model, kwargs)
    assert spy["fused_linear_cross_entropy"] == 0
    assert rel_max(out.loss, ref.loss) < 1e-6 and rel_max(out.logits, ref.logits) < RTOL
    assert out.aux_loss is not None and rel_max(out.aux_loss, ref.aux_loss) < 1e-6
    assert_grads_close(got, ref_grads)
    out = model(**kwargs, return_token_accuracy=True)
    want = al.token_accuracy_from_logits(ref.logits, kwargs["labels"], None, -100)
    assert out.token_accuracy == want and out.logits is not None
    as_tuple = model(**kwargs, return_dict=False, skip_logits=True)  # stock's order: loss, aux_loss, logits, ...
    assert len(as_tuple) == len(ref.to_tuple()) and rel_max(as_tuple[0], ref.loss) < 1e-6
    assert rel_max(as_tuple[1], ref.aux_loss) < 1e-6 and rel_max(as_tuple[2], ref.logits) < RTOL


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_peft_lora_on_head_modules_and_experts(dropout, spy):
    """LoRA on lm_head, attention, GDN and MLP modules and (target_parameters, which PEFT allows only without
    dropout) on the experts: same loss and LoRA gradients as stock with everything on; LoRA dropout on the
    head keeps the stock loss path."""
    peft = pytest.importorskip("peft")
    model = _model("tiny-moe", seed=7)
    experts = [] if dropout else ["experts.gate_up_proj", "experts.down_proj"]
    config = peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj", "in_proj_qkv", "out_proj", "gate_proj"],
                             target_parameters=experts, lora_dropout=dropout, init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head" in n for n in lora) and any("experts" in n for n in lora) == (not dropout)
    kwargs = _batch(model.get_base_model())

    def step():
        torch.manual_seed(input_seed(8))  # the same dropout masks in both runs
        model.zero_grad(set_to_none=True)
        out = model(**kwargs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if n in lora}

    ref, ref_grads = step()
    with patching.patched(model) as report:
        assert report.applied
        out, got = step()
    assert spy["moe_experts"] == 2
    assert spy["fused_linear_cross_entropy"] == (0 if dropout else 1)
    assert (out.logits is None) == (not dropout)
    assert abs(out.loss.item() - ref.loss.item()) <= 2e-6 * abs(ref.loss.item())
    assert_grads_close(got, ref_grads)


# --- experts selection -------------------------------------------------------------------------------
@pytest.mark.parametrize("impl,served", [("grouped_mm", True), ("eager", True), ("batched_mm", True),
                                         (af.EXPERTS_NAME, True), ("a-kernel", False)])
def test_experts_served_by_selection_for_models_built_before_and_after(impl, served, spy):
    """Torch selections (and the registered name) are served by deltafuse's experts, in models built before
    or after apply (no model given); another registered implementation dispatches as before."""
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    calls = []
    if impl == "a-kernel":
        ExpertsInterface._global_mapping[impl] = lambda self, *a: calls.append(1) or grouped_mm_experts_forward(
            self, *a)
    try:
        before = _model("tiny-next", seed=9)
        patching.apply()
        after = _model("tiny-moe", seed=9)
        ids = torch.tensor([[1, 2, 3]])
        for model in (before, after):
            model.config._experts_implementation_internal = impl
            with torch.no_grad():
                model(input_ids=ids)
            assert model.config._experts_implementation == impl  # the selection itself is not changed
        assert ExpertsInterface._global_mapping[af.EXPERTS_NAME] is af.experts_forward
        assert spy["moe_experts"] == (4 if served else 0) and len(calls) == (0 if served else 4)
        patching.revert()
        assert af.EXPERTS_NAME not in ExpertsInterface._global_mapping
        before.config._experts_implementation_internal = "grouped_mm"
        with torch.no_grad():
            before(input_ids=ids)
        assert spy["moe_experts"] == (4 if served else 0)  # reverted: stock again
    finally:
        ExpertsInterface._global_mapping.pop("a-kernel", None)


def test_experts_with_another_layout_use_grouped_mm(monkeypatch, spy):
    import transformers.integrations.moe as hf_moe

    model = _model("tiny-moe", seed=10)
    experts = model.model.layers[0].mlp.experts
    assert af.experts_plain(experts)
    used = []
    real = hf_moe.grouped_mm_experts_forward
    monkeypatch.setattr(hf_moe, "grouped_mm_experts_forward", lambda *a: used.append(1) or real(*a))
    x = torch.randn(5, model.config.hidden_size)
    idx = torch.randint(0, model.config.num_experts, (5, 2))
    w = torch.rand(5, 2)
    ref = af.experts_forward(experts, x, idx, w)
    experts.num_experts = model.config.num_experts // 2  # an expert-parallel shard keeps half the experts
    assert not af.experts_plain(experts)
    experts.num_experts = model.config.num_experts
    experts.is_transposed = True
    assert not af.experts_plain(experts)
    experts.is_transposed = False
    silu, experts.act_fn = experts.act_fn, torch.nn.GELU()
    assert not af.experts_plain(experts)
    experts.act_fn = silu
    default_gate = type(experts)._apply_gate
    monkeypatch.setattr(type(experts), "_apply_gate", lambda self, gate_up: gate_up[..., ::2])
    assert not af.experts_plain(experts)
    monkeypatch.setattr(type(experts), "_apply_gate", default_gate)
    assert af.experts_plain(experts)
    assert spy["moe_experts"] == 1 and not used
    experts.has_bias = True
    experts.gate_up_proj_bias = torch.zeros(model.config.num_experts, 2 * model.config.moe_intermediate_size)
    experts.down_proj_bias = torch.zeros(model.config.num_experts, model.config.hidden_size)
    assert rel_max(af.experts_forward(experts, x, idx, w), ref) < RTOL
    assert used == [1] and spy["moe_experts"] == 1


def test_non_silu_mlp_and_gateless_norm_run_stock(spy):
    model = _model("tiny", seed=11)
    mlp = model.model.layers[0].mlp
    mlp.act_fn = torch.nn.GELU()
    x = torch.randn(2, 3, model.config.hidden_size)
    ref = mlp(x)
    with patching.patched(model):
        assert torch.equal(mlp(x), ref)
        assert spy["swiglu"] == 0
        norm = model.model.layers[0].linear_attn.norm
        with pytest.raises(AttributeError):  # stock behaviour without a gate
            norm(torch.randn(3, norm.weight.shape[0]))
    assert spy["rms_norm_gated"] == 0


def test_a_norm_class_without_eps_runs_its_own_forward(spy):
    """Liger's patches put their own zero-centred norm class in the modeling module under the family's name, and it
    keeps its epsilon as ``variance_epsilon``: the wrapped forward then runs that class's own forward."""

    class OtherNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * 2 + self.weight

    forward = af.wrap_rms_norm_forward(OtherNorm.forward)
    norm, x = OtherNorm(), torch.randn(3, 8)
    assert torch.equal(forward(norm, x), x * 2 + norm.weight)
    assert spy["rms_norm_zero_centered"] == 0


# --- switches, report, revert ------------------------------------------------------------------------
def _row_targets(model) -> dict:
    """Identity snapshot of every object a fused_ops / moe row may change."""
    from transformers.integrations.moe import ExpertsInterface

    snap = {"mapping": ExpertsInterface._global_mapping.get(af.EXPERTS_NAME, "<absent>")}
    mods = family_modules()
    for fmap in FAMILY_MAPS:
        module = mods[fmap.family]
        for route in fmap.routes:
            if route.switch not in ("fused_ops", "moe"):
                continue
            if route.kind == "global":
                snap[(fmap.family, route.attr)] = vars(module).get(route.attr, "<absent>")
            elif route.kind == "class":
                snap[(fmap.family, route.owner, route.attr)] = vars(getattr(module, route.owner)).get(
                    route.attr, "<absent>")
    return snap


def _assert_same(before, after):
    assert before.keys() == after.keys()
    assert not [k for k in before if before[k] is not after[k]], "objects not restored"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_apply_twice_and_revert_restore_every_object(name):
    model = _model(name)
    before = _row_targets(model)
    first = patching.apply(model)
    changed = {k for k, v in _row_targets(model).items() if v is not before[k]}
    assert changed == set(before)  # every class, global, registry entry and config the rows name
    assert not first.already_applied
    assert "mapping" in changed
    after_first = _row_targets(model)
    second = patching.apply(model)
    assert not second.applied and second.already_applied
    third = patching.apply()
    assert not third.applied
    _assert_same(after_first, _row_targets(model))
    patching.revert()
    _assert_same(before, _row_targets(model))


@pytest.mark.parametrize("env,switch", [("DELTAFUSE_FUSED_OPS", "fused_ops"), ("DELTAFUSE_MOE", "moe")])
def test_switch_off_applies_none_of_its_rows(monkeypatch, env, switch):
    model = _model("tiny-next")
    before = _row_targets(model)
    monkeypatch.setenv(env, "0")
    report = patching.apply(model)
    assert report.applied and not [r for r in report.rows if r.switch == switch]
    after = _row_targets(model)
    mine = {k for fmap in FAMILY_MAPS for r in fmap.routes if r.switch == switch
            for k in ((fmap.family, r.attr), (fmap.family, r.owner, r.attr))}
    if switch == "moe":
        mine.add("mapping")
    assert all(after[k] is before[k] for k in mine if k in before)
    assert any(after[k] is not before[k] for k in before if k not in mine)  # the other switch's rows applied


def test_report_lists_the_rows():
    model = _model("tiny-moe")
    report = patching.apply(model)
    text = report.details()
    for fmap in FAMILY_MAPS:
        for route in fmap.routes:
            if route.switch in ("fused_ops", "moe") and route.kind != "instance":
                assert any(r.target == route.target_name(fmap.module) for r in report.rows), route
    for piece in ("[fused_ops] Qwen3_5MoeRMSNorm.forward", "deltafuse.wrap_causal_lm_forward(",
                  "[moe] transformers.integrations.moe.ExpertsInterface._global_mapping['deltafuse']",
                  "deltafuse.wrap_experts_forward(", "(applied (shared))"):
        assert piece in text, piece
    assert "no routes exist yet" not in text
    data = report.to_dict()
    assert {"fused_ops", "moe"} <= {r["switch"] for r in data["rows"]}


# --- the generic mapping row kind of the patcher ---------------------------------------------------------
@pytest.fixture
def scratch(monkeypatch):
    """A stand-in modeling module with a class, and a registry dict of named implementations."""
    module = types.ModuleType("deltafuse_scratch_modeling")

    class Layer(torch.nn.Module):
        pass

    def stock_fn():
        return "stock"

    module.Layer = Layer
    module.REGISTRY = {"stock": stock_fn}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_mapping_rows_apply_revert_restore_identity_and_are_idempotent(scratch):
    """A new key and a replaced key; a second family naming the same key shares it; revert restores the very
    objects (the replaced value, the absence of the new key); applying again changes nothing."""
    stock_fn = scratch.REGISTRY["stock"]
    where = f"{scratch.__name__}.REGISTRY"
    rows = (Route("moe", "mapping", "Layer", "fast", af.experts_forward, mapping=where),
            Route("moe", "mapping", "Layer", "stock", af.experts_forward, mapping=where))
    patcher = Patcher([FamilyMap("scratch", scratch.__name__, rows),
                       FamilyMap("scratch2", scratch.__name__, rows[:1])])
    _, applied, _ = patcher.apply({"moe": True})
    assert [r.status for r in applied] == ["applied", "applied", "applied (shared)"]
    assert applied[0].old == "<absent>" and applied[1].old.endswith("stock_fn")
    assert scratch.REGISTRY == {"stock": af.experts_forward, "fast": af.experts_forward}
    _, again, _ = patcher.apply({"moe": True})
    assert [r.status for r in again] == ["already applied"] * 3
    _, off, _ = patcher.apply({"moe": False})
    assert off == []
    rows_back = patcher.revert()
    assert [r.status for r in rows_back] == ["reverted", "reverted"]
    assert scratch.REGISTRY == {"stock": stock_fn} and scratch.REGISTRY["stock"] is stock_fn
    assert not patcher.has_records()


def test_mapping_row_arguments_and_missing_targets(scratch):
    with pytest.raises(ValueError, match=r"mapping='' with kind='mapping'"):
        Route("moe", "mapping", "Layer", "fast", "fast-fn")
    with pytest.raises(ValueError, match=r"mapping='x.y' with kind='class'"):
        Route("moe", "class", "Layer", "forward", "fast-fn", mapping="x.y")
    rows = (Route("moe", "mapping", "Layer", "fast", "f", mapping="deltafuse_no_such_module.REGISTRY"),
            Route("moe", "mapping", "Absent", "fast", "f", mapping=f"{scratch.__name__}.REGISTRY"))
    _, applied, _ = Patcher([FamilyMap("scratch", scratch.__name__, rows)]).apply({"moe": True})
    assert [r.status for r in applied] == ["not found", "not found"]
    assert "not an importable dict" in applied[0].note and "has no class Absent" in applied[1].note
    assert list(scratch.REGISTRY) == ["stock"]
