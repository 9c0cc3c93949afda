"""benchmarks/bench_decode.py --smoke: the decode benchmark end to end on CPU (interpreted Triton, the tiny
model), its correctness columns and its table."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run(tmp_path, capsys):
    out = tmp_path / "decode.json"
    _load().main(["--smoke", "--out", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["results"]
    ops_rows = [r for r in rows if r["section"] == "op"]
    impls = {r["impl"] for r in ops_rows}
    assert {"deltafuse triton", "deltafuse triton in place", "deltafuse op in place", "hf torch fallback"} <= impls
    for r in ops_rows:
        assert "error" not in r, r
        assert r["finite"] and r["rel_o"] < 1e-4 and r["rel_state"] < 1e-4, r
        assert r["eager_us_per_call"] > 0 and r["eager_tok_s"] > 0
    assert sorted({r["batch"] for r in ops_rows}) == [1, 2]
    gen = [r for r in rows if r["section"] == "generate"]
    assert [(r["batch"], r["impl"]) for r in gen] == [(1, "stock"), (1, "deltafuse"), (2, "stock"), (2, "deltafuse")]
    for r in gen:
        assert "error" not in r, r
        assert r["reps"] == 2 and r["gdn_functions"]["recurrent_gated_delta_rule"]
        if r["decode_tok_s"] is None:  # refused: the full run was not slower than the prefill
            assert r["total_s"] <= r["prefill_s"] and "no decode rate" in r["note"]
        else:
            assert r["total_s"] > r["prefill_s"]
            assert r["decode_tok_s"] == pytest.approx(r["batch"] * 3 / (r["total_s"] - r["prefill_s"]))
            assert r["ms_per_step"] == pytest.approx((r["total_s"] - r["prefill_s"]) / 3 * 1e3)
    stock = [r for r in gen if r["impl"] == "stock"]
    assert all(r["gdn"].startswith("op: ") for r in stock)
    assert {r["impl"] for r in rows if r["section"] == "generate-step"} == {"stock", "deltafuse"}
    assert all(r["ids_match"] and r["first_divergence"] is None for r in gen if r["impl"] == "deltafuse")
    printed = capsys.readouterr().out
    assert "| shape | batch | impl |" in printed and "| model | batch | impl |" in printed


def _tiny_step(mod, seed=3):
    return mod.make_step(2, 2, 4, 16, 16, "cpu", dtype=torch.float32, seed=seed)


def test_hf_row_repeats_qk_for_layer_calling_contract(monkeypatch):
    """transformers <= 5.22's torch fallback assumes H == HV (the layer repeats q/k first): the benchmark's HF
    row must hand it q/k repeated to the value heads, and then match the float64 oracle."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    mod = _load()
    real = getattr(m.torch_recurrent_gated_delta_rule, "__wrapped__", m.torch_recurrent_gated_delta_rule)
    seen = []

    def old_contract(q, k, v, g, beta, **kw):
        assert q.shape[2] == k.shape[2] == v.shape[2], (q.shape, v.shape)  # what 5.17 needs (else a size error)
        seen.append(q.shape)
        return real(q, k, v, g, beta, **kw)

    monkeypatch.setattr(m, "torch_recurrent_gated_delta_rule", old_contract)
    fn, label = mod.load_hf()
    x = _tiny_step(mod)
    res = mod.check(fn, x, 1e-4)
    assert seen == [(2, 1, 4, 16)] and res["check"] == "ok", res


def test_fla_row_passes_beta_by_keyword(monkeypatch):
    """FLA's signature is (q, k, v, g, gk, gv, beta, scale, ...): a fake with that signature (computing with
    the oracle, refusing a gk) must receive beta by keyword and the row must pass the check."""
    import sys
    import types

    from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule

    calls = []

    def fake(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
             output_final_state=False, use_qk_l2norm_in_kernel=False, **kw):
        assert gk is None and gv is None and beta is not None
        calls.append(1)
        return naive_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel)

    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    gdr = types.ModuleType("fla.ops.gated_delta_rule")
    gdr.fused_recurrent_gated_delta_rule = fake
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", gdr)
    mod = _load()
    fn, label = mod.load_fla()
    assert fn is not None and "fla" in label
    res = mod.check(fn, _tiny_step(mod), 1e-4)
    assert calls == [1] and res["check"] == "ok", res


def test_failing_row_is_marked_and_not_timed(capsys):
    mod = _load()

    def wrong(x, state):  # the state's update left out
        o, ht = mod.impl_ours(False)(x, state)
        return o, state

    args = mod.argparse.Namespace(batches=[1], layers=1, reps=1, warmup=1, no_graph=True, dtype=torch.float32)
    results = []
    mod.op_rows(args, torch.device("cpu"), [("wrong", wrong)], [((2, 4, 16, 16), "tiny")], results)
    (row,) = results
    assert row["check"] == "FAIL" and "not timed" in row["note"] and "eager_us_per_call" not in row
    assert "| wrong | FAIL" in mod.table(results)


def test_gdn_label_read_from_layer_attributes():
    """transformers <= 5.22 holds the functions on the layer: FLA's op with the torch conv update (no
    causal_conv1d) is labelled as such, not as the torch fallback."""
    mod = _load()

    def fused_recurrent_gated_delta_rule(*a, **k):
        pass

    fused_recurrent_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.fused_recurrent"

    def torch_causal_conv1d_update(*a, **k):
        pass

    torch_causal_conv1d_update.__module__ = "transformers.models.qwen3_5.modeling_qwen3_5"

    class Qwen3_5GatedDeltaNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
            self.chunk_gated_delta_rule = fused_recurrent_gated_delta_rule
            self.causal_conv1d_update = torch_causal_conv1d_update
            self.causal_conv1d_fn = None

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Qwen3_5GatedDeltaNet())
    fns = mod.gdn_functions(model)
    assert fns["recurrent_gated_delta_rule"] == "fla.ops.gated_delta_rule.fused_recurrent." \
        "test_gdn_label_read_from_layer_attributes.<locals>.fused_recurrent_gated_delta_rule"
    assert fns["causal_conv1d_fn"] == "none (nn.Conv1d)"
    assert mod.gdn_label(fns) == "op: fla, conv: torch fallback"


def test_generate_refuses_rate_when_total_not_above_prefill(tmp_path, monkeypatch):
    mod = _load()
    times = iter([5.0, 4.0] * 8)  # prefill 5 s, full run 4 s (a cold first run)

    def fake_timed(model, ids, kwargs, n, reps, device):
        return next(times), torch.zeros(ids.shape[0], ids.shape[1] + n, dtype=torch.long)

    monkeypatch.setattr(mod, "_timed_generate", fake_timed)
    args = mod.argparse.Namespace(model="tiny", gen_batches=[1], prompt=8, new_tokens=4, gen_reps=2)
    results = []
    mod.generate_rows(args, torch.device("cpu"), results)
    gen = [r for r in results if r["section"] == "generate"]
    assert len(gen) == 2
    for r in gen:
        assert r["decode_tok_s"] is None and r["ms_per_step"] is None and "no decode rate" in r["note"]
        assert r["prefill_s"] == 5.0 and r["total_s"] == 4.0
    assert "n/a (total <= prefill)" in mod.table(results)
