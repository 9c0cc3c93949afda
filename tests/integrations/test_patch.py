"""apply / revert / patched: what is patched where, identity restore, idempotence, switches, wrappers,
device-correct backend choice, the stock fallback out of reach, and generation parity."""

from __future__ import annotations

import json

import pytest
import torch

from deltafuse import backends, patching
from deltafuse.backends import REGISTRY, Candidate
from deltafuse.config import SettingsError
from deltafuse.integrations.transformers import adapters
from deltafuse.maps import FAMILY_MAPS, PATCHER
from deltafuse.integrations.transformers import boundaries as bd
from deltafuse.models import TINY_NAMES, build_model
from tests.helpers import input_gen, input_seed
from tests.integrations import (RTOL, assert_same_objects, family_modules, grads, packed_inputs, rel_max,
                                snapshot)

FAMILY_OF = {"tiny": "qwen3_5", "tiny-moe": "qwen3_5_moe", "tiny-next": "qwen3_next"}
GDN_CLASS = {"qwen3_5": "Qwen3_5GatedDeltaNet", "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
             "qwen3_next": "Qwen3NextGatedDeltaNet"}
INSTANCE_ATTRS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")


pytestmark = pytest.mark.usefixtures("clean_deltafuse")


def old_design(family="qwen3_5") -> bool:
    return hasattr(family_modules()[family], "is_fast_path_available")


def gdn_layers(model, family="qwen3_5"):
    cls = getattr(family_modules()[family], GDN_CLASS[family])
    return [m for m in model.modules() if isinstance(m, cls)]


# --- apply / revert --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TINY_NAMES))
def test_apply_then_revert_restores_every_object(name):
    model = build_model(name)
    family = FAMILY_OF[name]
    before = snapshot(model)
    report = patching.apply(model)
    during = snapshot(model)
    changed = {k for k in before if before[k] is not during[k]}
    module = family_modules()[family]
    fmod = module.__name__
    assert (fmod, "Qwen3_5TextModel" if family == "qwen3_5" else
            {"qwen3_5_moe": "Qwen3_5MoeTextModel", "qwen3_next": "Qwen3NextModel"}[family], "forward") in changed
    assert (fmod, GDN_CLASS[family], "forward") in changed
    if old_design(family):
        # globals read by __init__, and what every built layer cached
        for attr in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update"):
            assert (fmod, attr) in changed
        layers = gdn_layers(model, family)
        assert len(layers) == 3
        for layer in layers:
            assert layer.chunk_gated_delta_rule is adapters.chunk_gated_delta_rule
            assert layer.recurrent_gated_delta_rule is adapters.recurrent_gated_delta_rule
            assert layer.causal_conv1d_fn is adapters.causal_conv1d_fn
            assert layer.causal_conv1d_update is adapters.causal_conv1d_update
    else:
        assert module.torch_chunk_gated_delta_rule is adapters.chunk_gated_delta_rule
        assert module.torch_recurrent_gated_delta_rule is adapters.recurrent_gated_delta_rule
        assert module.causal_conv1d_fn is adapters.causal_conv1d_fn
        assert module.causal_conv1d_update is adapters.causal_conv1d_update
        assert not any(a in vars(layer) for layer in gdn_layers(model, family) for a in INSTANCE_ATTRS)
    # one report row per route (instances of a class grouped, with a count), every change accounted for
    instance_changes = sum(1 for k in changed if len(k) == 4)
    grouped = sum(r.count for r in report.applied if "(instance)" in r.target)
    assert instance_changes == grouped
    assert sum(1 for k in changed if len(k) != 4) <= len([r for r in report.applied if "(instance)" not in r.target])
    revert_report = patching.revert()
    assert revert_report.applied
    assert_same_objects(before, snapshot(model))


def test_apply_twice_changes_nothing():
    model = build_model("tiny")
    first = patching.apply(model)
    assert first.applied and not first.already_applied
    after_first = snapshot(model)
    second = patching.apply(model)
    assert not second.applied
    assert {r.target for r in second.already_applied} == {r.target for r in first.applied}
    assert_same_objects(after_first, snapshot(model))
    assert "already applied" in str(second)
    # and a third call without the model does not touch the instances either
    third = patching.apply()
    assert not third.applied
    assert_same_objects(after_first, snapshot(model))


def test_report_rows_str_and_dict():
    model = build_model("tiny")
    report = patching.apply(model)
    fmod = "transformers.models.qwen3_5.modeling_qwen3_5"
    rows = {r.target: r for r in report.rows if r.module == fmod}
    if old_design():
        inst = rows[f"{fmod}.Qwen3_5GatedDeltaNet(instance).chunk_gated_delta_rule"]
        assert inst.count == 3 and inst.status == "applied"
        assert inst.old.endswith("torch_chunk_gated_delta_rule")  # what the stock __init__ cached without FLA
        assert rows[f"{fmod}.chunk_gated_delta_rule"].new.endswith("adapters.chunk_gated_delta_rule")
        assert report.families["qwen3_5"].startswith("old design")
    else:
        row = rows[f"{fmod}.torch_chunk_gated_delta_rule"]
        assert row.old == f"{fmod}.torch_chunk_gated_delta_rule"
        assert row.new.endswith("adapters.chunk_gated_delta_rule") and row.status == "applied"
        assert report.families["qwen3_5"].startswith("new design")
    fwd = rows[f"{fmod}.Qwen3_5TextModel.forward"]
    assert fwd.new.startswith("deltafuse.wrap_text_model_forward(")
    assert {r.switch for r in report.rows} == {"gdn", "fused_ops", "moe"}
    text = report.details()
    assert "Qwen3_5GatedDeltaNet.forward" in text and "applied" in text
    assert "no routes exist yet" not in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["enabled"] is True and data["settings"]["gdn"] is True
    assert len(data["rows"]) == len(report.rows)
    assert {"switch", "target", "old", "new", "status", "count"} <= set(data["rows"][0])


def test_report_is_one_line_by_default_and_every_row_on_request():
    model = build_model("tiny")
    report = patching.apply(model)
    line = str(report)
    design = "old design" if old_design() else "new design"
    import transformers

    changed = [r for r in report.rows if r.status in ("applied", "applied (built while patched)")]
    assert "\n" not in line and len(line) < 300, line
    assert line.startswith(f"deltafuse: applied {len(changed)} routes (gdn ")
    assert f"to Qwen3.5, Qwen3.5-MoE, Qwen3-Next (transformers {transformers.__version__}, {design})" in line
    # where the model's training calls go: its device and dtype, the registry's choice there
    assert "Qwen3.5 model: training calls on cpu float32 -> torch" in line
    assert report.serving["gdn"] == {"chunk_gated_delta_rule": "torch", "causal_conv1d_fn": "torch"}
    assert line.endswith("details: report.details()")
    details = report.details()
    assert details.splitlines()[0].startswith("deltafuse apply: ") and len(details.splitlines()) > len(report.rows)
    assert all(r.short(r.target) in details for r in report.rows)
    assert report.to_dict()["summary"] == line
    assert str(patching.revert()).startswith(f"deltafuse: reverted {len(changed)} routes (gdn ")
    assert str(patching.revert()) == "deltafuse: revert: nothing was patched"


def test_report_one_line_names_a_mixed_choice_and_what_was_left_out():
    report = patching.PatchReport(enabled=True, settings={"gdn": True, "fused_ops": True, "moe": False},
                                  transformers="5.24.0", families={"qwen3_5": "new design (m)",
                                                                   "trl": "not imported (trl is routed ...)"},
                                  titles={"qwen3_5": "Qwen3.5"}, model_family="qwen3_5",
                                  serving_on="cuda:0 bfloat16",
                                  serving={"gdn": {"chunk_gated_delta_rule": "triton", "causal_conv1d_fn": "triton"},
                                           "fused_ops": {"rms_norm_zero_centered": "triton", "swiglu": "torch",
                                                         "apply_rotary_pos_emb": "triton"}},
                                  notes=["x"])
    assert str(report) == ("deltafuse: applied 0 routes to Qwen3.5 (transformers 5.24.0, new design); Qwen3.5 model: "
                           "training calls on cuda:0 bfloat16 -> gdn triton, fused_ops triton (swiglu torch); "
                           "moe off; trl not imported; 1 note: report.details()")


def test_no_fla_note_without_fla():
    """The gated-norm row's note ("old design with FLA installed ...") only where FLA's FusedRMSNormGated is
    what the module holds: never in the new design, nor in the old one without FLA."""
    import importlib.util

    report = patching.apply(build_model("tiny"))
    has_fla = any(getattr(m, "FusedRMSNormGated", None) is not None for m in family_modules().values())
    if importlib.util.find_spec("fla") is None:
        assert not has_fla
    notes = [r.note for r in report.rows if r.note] + report.notes
    assert any("FLA" in n for n in notes) == has_fla, notes


def _fake_family(name, fla_norm):
    """An old-design modeling module (``is_fast_path_available``) holding ``fla_norm`` as FusedRMSNormGated."""
    import types

    mod = types.ModuleType(name)
    mod.is_fast_path_available = fla_norm is not None
    mod.FusedRMSNormGated = fla_norm
    mod.GatedNorm = type("GatedNorm", (), {"forward": lambda self, x: x, "__module__": name})
    return mod


@pytest.mark.parametrize("fla", [True, False])
def test_fla_note_follows_the_modules_fla_norm(fla, monkeypatch):
    import sys

    from deltafuse.integrations.transformers.patcher import FamilyMap, Patcher, Route

    name = "deltafuse_fake_old_design"
    monkeypatch.setitem(sys.modules, name, _fake_family(name, type("FusedRMSNormGated", (), {}) if fla else None))
    fmap = FamilyMap(family="fake", module=name, routes=(
        Route("gdn", "global", "", "FusedRMSNormGated", None, design="old", note="gdn fla note",
              note_if="FusedRMSNormGated"),
        Route("fused_ops", "class", "GatedNorm", "forward", lambda f: f, wrap=True, note="fused fla note",
              note_if="FusedRMSNormGated"),
    ))
    patcher = Patcher([fmap])
    families, rows, _ = patcher.apply({"gdn": True, "fused_ops": True})
    try:
        assert families["fake"].startswith("old design")
        # the gdn row replaced FusedRMSNormGated first: the note still follows the value transformers set
        assert [r.note for r in rows] == (["gdn fla note", "fused fla note"] if fla else ["", ""])
    finally:
        patcher.revert()


def test_patch_off_changes_nothing(monkeypatch):
    monkeypatch.setenv("DELTAFUSE_PATCH", "off")
    model = build_model("tiny")
    before = snapshot(model)
    report = patching.apply(model, gdn=True, backend="torch")
    assert report.enabled is False and report.rows == []
    assert "off" in str(report) and "nothing was changed" in str(report)
    assert_same_objects(before, snapshot(model))
    assert backends.current_backend() == "auto"
    assert not PATCHER.has_records()


def test_gdn_switch_off_by_argument_and_environment(monkeypatch):
    model = build_model("tiny")
    before = snapshot(model)
    report = patching.apply(model, gdn=False, fused_ops=False, moe=False)
    assert report.rows == [] and any("gdn is off" in n for n in report.notes)
    assert_same_objects(before, snapshot(model))
    assert not [r for r in patching.apply(model, gdn=False).rows if r.switch == "gdn"]
    patching.revert()
    monkeypatch.setenv("DELTAFUSE_GDN", "0")
    assert not [r for r in patching.apply(model).rows if r.switch == "gdn"]
    assert patching.apply(model, gdn=True).applied  # the argument wins over the environment


def test_bad_arguments_name_the_value():
    with pytest.raises(SettingsError, match=r"backend='cuda'") as err:
        patching.apply(backend="cuda")
    allowed = str(err.value).split("allowed", 1)[-1]
    assert all(name in allowed for name in ("auto", "triton", "fla", "npu", "torch"))
    with pytest.raises(SettingsError, match=r"gdn='yes' must be True, False or None"):
        patching.apply(gdn="yes")
    assert not PATCHER.has_records()


def test_backend_argument_forces_every_op_and_revert_restores_it():
    report = patching.apply(backend="torch")
    assert backends.current_backend() == "torch"
    assert report.settings["backend"] == "torch"
    patching.revert()
    assert backends.current_backend() == "auto"


def test_patched_context_manager_reverts_only_its_block():
    model = build_model("tiny")
    before = snapshot(model)
    with patching.patched(model) as report:
        assert report.applied
        assert snapshot(model) != before
    assert_same_objects(before, snapshot(model))
    patching.apply()  # modules only
    outer = snapshot(model)
    with patching.patched(model, backend="torch"):
        assert backends.current_backend() == "torch"
    assert backends.current_backend() == "auto"
    assert_same_objects(outer, snapshot(model))  # the rows applied before the block stay


@pytest.fixture
def forced_before():
    """A backend override set before any apply ('fla'), put back to none afterwards."""
    backends.set_backend_override("fla")
    yield "fla"
    backends.set_backend_override(None)


def test_apply_with_two_backends_then_revert_restores_the_original_override(forced_before):
    before = snapshot()
    patching.apply(backend="torch")
    assert backends.current_backend() == "torch"
    patching.apply(backend="triton")
    assert backends.current_backend() == "triton"
    assert patching.revert().applied
    assert backends.backend_override() == forced_before
    assert_same_objects(before, snapshot())
    again = patching.revert()  # a second revert changes nothing
    assert not again.rows and str(again) == "deltafuse: revert: nothing was patched"
    assert backends.backend_override() == forced_before and not PATCHER.has_records()


def test_revert_without_apply_keeps_an_override_it_did_not_set(forced_before):
    assert not patching.revert().rows
    assert backends.backend_override() == forced_before


def test_patched_block_inside_apply_restores_the_applied_override():
    patching.apply(backend="torch")
    with patching.patched(backend="triton"):
        assert backends.current_backend() == "triton"
    assert backends.current_backend() == "torch" and PATCHER.has_records()
    patching.revert()
    assert backends.backend_override() is None and not PATCHER.has_records()


def test_apply_inside_a_patched_block_is_undone_by_the_block(forced_before):
    before = snapshot()
    with patching.patched(backend="torch"):
        patching.apply(backend="triton")
        assert backends.current_backend() == "triton"
    assert backends.backend_override() == forced_before and not PATCHER.has_records()
    assert_same_objects(before, snapshot())
    backends.set_backend_override("npu")  # set after the block: no later revert takes it back
    assert not patching.revert().rows
    assert backends.backend_override() == "npu"


def test_a_revert_inside_a_patched_block_is_not_undone_by_its_exit():
    """What a thread's revert does while another thread's ``patched`` block runs, in one thread: the block's exit
    must not bring back the backend forced before it (its mark is older than the revert); a later revert finds
    nothing forced and nothing patched."""
    patching.apply(backend="torch")
    with patching.patched(backend="triton"):
        patching.revert()
    assert backends.backend_override() is None and not PATCHER.has_records()
    patching.revert()
    assert backends.backend_override() is None and not PATCHER.has_records()


def test_apply_and_revert_from_threads_leave_one_consistent_state():
    import threading

    before = snapshot()
    names = ("torch", "triton", "auto")
    errors = []

    def work(i):
        try:
            for j in range(4):
                patching.apply(backend=names[(i + j) % len(names)])
                if (i + j) % 2:
                    patching.revert()
                with patching.patched(backend=names[j % len(names)]):
                    pass
        except Exception as exc:  # reported below, with the thread's index
            errors.append((i, exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    patching.revert()
    assert backends.backend_override() is None and not PATCHER.has_records()
    assert_same_objects(before, snapshot())


def test_model_built_after_apply_and_revert():
    """apply() without a model: models built afterwards use deltafuse; revert restores what stock __init__
    would have cached (old design), so the model then runs stock again."""
    patching.apply()
    model = build_model("tiny")
    if old_design():
        assert all(layer.chunk_gated_delta_rule is adapters.chunk_gated_delta_rule for layer in gdn_layers(model))
        report = patching.apply(model)
        row = next(r for r in report.rows if r.target.endswith("(instance).chunk_gated_delta_rule"))
        assert row.status == "applied (built while patched)"
        assert row.old.endswith("torch_chunk_gated_delta_rule")
    patching.revert()
    module = family_modules()["qwen3_5"]
    for layer in gdn_layers(model):
        if old_design():
            assert layer.chunk_gated_delta_rule is module.torch_chunk_gated_delta_rule
            assert layer.causal_conv1d_fn is None  # stock without causal-conv1d installed
        else:
            assert not any(a in vars(layer) for a in INSTANCE_ATTRS)


# --- wrappers --------------------------------------------------------------------------------------
def _forward_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    base = build_model("tiny")
    ids = torch.randint(0, base.config.vocab_size, (1, 11))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    before = snapshot(model)
    ref = _forward_logits(model, ids)
    report = patching.apply(model)
    assert report.applied
    if old_design():
        assert all(layer.causal_conv1d_fn is adapters.causal_conv1d_fn for layer in gdn_layers(model))
    assert rel_max(_forward_logits(model, ids), ref) < RTOL
    patching.revert()
    assert_same_objects(before, snapshot(model))


def test_ddp_wrapped_model(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        base = build_model("tiny")
        ddp = torch.nn.parallel.DistributedDataParallel(base)
        ids = torch.randint(0, base.config.vocab_size, (1, 9))
        ref = _forward_logits(ddp, ids)
        report = patching.apply(ddp)
        assert report.model.endswith("DistributedDataParallel")
        if old_design():
            assert all(layer.chunk_gated_delta_rule is adapters.chunk_gated_delta_rule for layer in gdn_layers(base))
        assert rel_max(_forward_logits(ddp, ids), ref) < RTOL
    finally:
        dist.destroy_process_group()


class Holder:
    """A trainer-like object that keeps the model somewhere."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class BaseModelHolder:
    def __init__(self, model):
        self._m = model

    def get_base_model(self):
        return self._m


def test_plain_wrappers_are_walked():
    base = build_model("tiny")
    for wrapper in (Holder(module=base), Holder(model=Holder(module=base)), Holder(base_model=base),
                    BaseModelHolder(base)):
        report = patching.apply(wrapper)
        assert report.model.endswith("Qwen3_5ForCausalLM")
        if old_design():
            assert all(layer.causal_conv1d_update is adapters.causal_conv1d_update for layer in gdn_layers(base))
        patching.revert()


def test_object_without_a_supported_model_is_a_clear_error():
    class Broken:
        @property
        def model(self):
            raise RuntimeError("not ready")

    for obj, walked in ((object(), "builtins.object"),
                        (torch.nn.Linear(2, 2), "torch.nn.modules.linear.Linear"),
                        (Holder(model=torch.nn.Linear(2, 2)), "model.model: torch.nn.modules.linear.Linear"),
                        (Broken(), "Broken")):
        with pytest.raises(patching.UnsupportedModelError) as err:
            patching.apply(obj)
        assert isinstance(err.value, ValueError)
        assert "found no supported model" in str(err.value) and walked in str(err.value)
        assert "qwen3_5" in str(err.value)
    assert not PATCHER.has_records()


def test_accelerate_hooked_forward_is_rebound():
    hooks = pytest.importorskip("accelerate.hooks")
    model = build_model("tiny", seed=input_seed("model", 2)).eval()
    hooks.add_hook_to_module(model.model, hooks.ModelHook())
    rows = [[torch.randint(0, 512, (n,)) for n in (7, 1, 12)]]
    ids, pos, _, _, _ = packed_inputs(rows)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s[None], use_cache=False).logits for s in rows[0]], 1)
    before = snapshot(model)
    report = patching.apply(model)
    assert any("_old_forward" in r.target and r.status == "applied" for r in report.rows)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits
    assert rel_max(got, ref) < RTOL  # the hooked text model derived the boundaries
    patching.revert()
    assert_same_objects(before, snapshot(model))


# --- which implementation runs -----------------------------------------------------------------------
def test_cpu_calls_get_torch_even_when_fla_would_be_available():
    """A stand-in 'fla' candidate that imports fine but serves CUDA only: CPU calls still get 'torch'."""
    saved = {op: list(REGISTRY.ops[op]) for op in REGISTRY.ops}
    used = []

    def fake_load():
        def run(*args, **kwargs):
            used.append("fla")
            raise AssertionError("the CUDA-only candidate ran on CPU")
        return run

    def cuda_only(call):
        return None if call.device.type == "cuda" else f"CUDA only, not {call.device.type}"

    try:
        for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
            REGISTRY.unregister(op, "fla")
            REGISTRY.register(op, Candidate("fla", fake_load, available=lambda: None, supports=cuda_only),
                              before="torch")
            call = backends.CallInfo(torch.device("cpu"), torch.float32, True)
            chosen = [d for d in REGISTRY.explain(op, call) if d.chosen]
            assert [d.candidate for d in chosen] == ["torch"]
            cuda_call = backends.CallInfo(torch.device("cuda", 0), torch.float32, False)
            assert REGISTRY.explain(op, cuda_call)[[c.name for c in REGISTRY.candidates(op)].index("fla")].reason \
                in (None, "a candidate earlier in the list serves it")
        model = build_model("tiny").train()
        ids = torch.randint(0, 512, (2, 10))
        ref = model(input_ids=ids, labels=ids, use_cache=False)
        ref.loss.backward()
        ref_grads = grads(model)
        model.zero_grad(set_to_none=True)
        with patching.patched(model):
            out = model(input_ids=ids, labels=ids, use_cache=False, deltafuse_logits=True)
            out.loss.backward()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=2, do_sample=False)
        assert used == []
        assert rel_max(out.logits, ref.logits) < RTOL
        from tests.integrations import assert_grads_close

        assert_grads_close(grads(model), ref_grads)
    finally:
        REGISTRY.ops.clear()
        REGISTRY.ops.update(saved)
        REGISTRY.clear_cache()


def _spy(counter, name, fn):
    def spy(*args, **kwargs):
        counter[name] = counter.get(name, 0) + 1
        return fn(*args, **kwargs)
    return spy


def test_stock_fallback_is_unreachable_once_applied(monkeypatch):
    """Every stock GDN / conv function (the ones that leak across packed sequences) is replaced by a
    counting spy before apply; after apply, packed training and decoding never call one."""
    model = build_model("tiny").train()
    module = family_modules()["qwen3_5"]
    counter: dict[str, int] = {}
    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update", "torch_causal_conv1d_update", "chunk_gated_delta_rule",
             "fused_recurrent_gated_delta_rule"]
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            monkeypatch.setattr(module, name, _spy(counter, name, fn))
    for layer in gdn_layers(model):
        for attr in INSTANCE_ATTRS:
            fn = vars(layer).get(attr)
            if callable(fn):
                monkeypatch.setattr(layer, attr, _spy(counter, attr, fn))
    rows = [[torch.randint(0, 512, (n,)) for n in (6, 1, 9)]]
    ids, pos, labels, _, _ = packed_inputs(rows)

    def exercise():
        out = model(input_ids=ids, position_ids=pos, labels=labels)
        out.loss.backward()
        with torch.no_grad():
            model.generate(ids[:, :6], max_new_tokens=3, do_sample=False)

    patching.apply(model)
    exercise()
    assert counter == {}, f"stock functions ran while deltafuse was applied: {counter}"
    patching.revert()
    exercise()  # the spies are wired: stock runs them again once reverted
    # (new design: module globals; old design: what the layers cached in __init__)
    assert counter.get("torch_chunk_gated_delta_rule", 0) + counter.get("chunk_gated_delta_rule", 0) > 0
    assert counter.get("torch_recurrent_gated_delta_rule", 0) + counter.get("recurrent_gated_delta_rule", 0) > 0
    assert counter.get("causal_conv1d_update", 0) + counter.get("torch_causal_conv1d_update", 0) > 0


def test_generation_matches_stock_and_uses_the_decode_ops(monkeypatch):
    model = build_model("tiny", seed=input_seed("model", 1)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=input_gen(2))
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    counter: dict[str, int] = {}
    for name in ("fused_recurrent_gated_delta_rule", "causal_conv1d_update", "chunk_gated_delta_rule",
                 "causal_conv1d_fn"):
        monkeypatch.setattr(adapters.ops, name, _spy(counter, name, getattr(adapters.ops, name)))
    with patching.patched(model), torch.no_grad():
        out = model.generate(ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        assert rel_max(got, want) < RTOL
    n_gdn = 3
    assert counter["chunk_gated_delta_rule"] == n_gdn and counter["causal_conv1d_fn"] == n_gdn  # prefill
    assert counter["fused_recurrent_gated_delta_rule"] == 5 * n_gdn  # 5 single-token steps
    assert counter["causal_conv1d_update"] == 5 * n_gdn


def test_cached_multi_token_continuation():
    """Prefill, a multi-token chunk continuing from the cache (the conv sees cached inputs prepended),
    then one decode step: equal to stock doing the same and to one uncached forward."""
    import inspect

    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.9"):
        pytest.skip("transformers < 5.9 runs a multi-token chunk after a cache from a zero recurrent state and no "
                    "conv state (its GDN forward passes initial_state=None), stock and patched alike")

    model = build_model("tiny", seed=input_seed("model", 3)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=input_gen(4))
    cache_kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    def run():
        logits, cache = [], None
        with torch.no_grad():
            for s, e in ((0, 8), (8, 15), (15, 16)):
                out = model(input_ids=ids[:, s:e], use_cache=True, **({cache_kw: cache} if cache else {}))
                cache = getattr(out, cache_kw, None) or getattr(out, "past_key_values", None)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    ref = run()
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
    with patching.patched(model):
        got = run()
    assert rel_max(ref, full) < RTOL  # stock is consistent: the reference is sound
    assert rel_max(got, ref) < RTOL and rel_max(got, full) < RTOL


def test_both_qk_layouts_give_the_same_result():
    """Up to transformers 5.22 q/k arrive repeated to the HV value heads, from 5.23 with H heads."""
    torch.manual_seed(input_seed(3))
    B, T, H, HV, K, V = 1, 12, 2, 4, 8, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, g, beta = torch.randn(B, T, HV, V), -torch.rand(B, T, HV), torch.rand(B, T, HV)
    rep = HV // H
    o_h, s_h = adapters.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
    o_hv, s_hv = adapters.chunk_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g=g,
                                                 beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_max(o_h, o_hv) < 1e-6 and rel_max(s_h, s_hv) < 1e-6


def test_maps_are_rows_for_every_family():
    assert {m.family for m in FAMILY_MAPS} == {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
    for fmap in FAMILY_MAPS:
        kinds = {(r.kind, r.design) for r in fmap.routes}
        assert ("instance", "old") in kinds and ("global", "new") in kinds and ("class", "any") in kinds


def test_layers_built_before_apply_without_the_model_refuse_packed_batches():
    """Old design: apply() without the model leaves the ops the layers cached (transformers' fallback would
    let state leak across packed sequences); a packed batch then raises a clear error instead."""
    model = build_model("tiny").eval()
    patching.apply()
    rows = [[torch.randint(0, 512, (n,)) for n in (5, 7)]]
    ids, pos, _, _, _ = packed_inputs(rows)
    if old_design():
        with pytest.raises(bd.PackingError, match=r"call deltafuse.apply\(model\)"):
            with torch.no_grad():
                model(input_ids=ids, position_ids=pos)
        patching.apply(model)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits
        unpacked = model(input_ids=ids).logits  # one sequence per row: no boundaries, no error
    patching.revert()
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s[None], use_cache=False).logits for s in rows[0]], 1)
        assert rel_max(unpacked, model(input_ids=ids, use_cache=False).logits) < RTOL
    assert rel_max(got, ref) < RTOL
