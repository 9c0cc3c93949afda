"""deltafuse verify: stock vs deltafuse, loss / logits / every gradient, and that it fails when it should."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from deltafuse import patching, verify
from deltafuse.cli import main
from deltafuse.integrations.transformers import PATCHER, adapters
from deltafuse.models import build_model



pytestmark = pytest.mark.usefixtures("clean_deltafuse")


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-next"])
def test_verify_model_passes(name, packed):
    result = verify.verify_model(name, packed=packed)
    assert result.ok, result.format()
    names = [c.name for c in result.comparisons]
    assert names[:2] == ["loss", "logits"]
    params = [n for n, p in build_model(name).named_parameters() if p.requires_grad]
    assert names[2:] == [f"grad {n}" for n in params]  # every parameter gradient
    assert result.rtol == 1e-4 and result.patch_rows > 0
    assert not PATCHER.has_records()  # verify leaves nothing patched


def test_cli_json_and_table(capsys):
    assert main(["verify", "--model", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["family"] == "qwen3_5" and data["packed"] is False
    assert {c["name"] for c in data["comparisons"]} >= {"loss", "logits", "grad lm_head.weight"}
    assert all({"max_abs", "rel", "ok"} <= set(c) for c in data["comparisons"])
    assert main(["verify", "--model", "tiny-next", "--packed"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "grad model.layers.0.linear_attn.A_log" in out and "max_abs" in out


def test_run_uses_add_arguments():
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--packed", "--dtype", "float32"])
    assert (args.model, args.packed, args.device, args.dtype, args.json) == ("tiny", True, "cpu", "float32", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int8"])


def test_local_directory(tmp_path, capsys):
    model = build_model("tiny-moe", seed=5)
    model.save_pretrained(tmp_path / "m")
    assert main(["verify", "--model", str(tmp_path / "m"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["family"] == "qwen3_5_moe"


def test_unusable_requests_exit_2(capsys, monkeypatch):
    assert main(["verify", "--model", "nonexistent-model"]) == 2
    err = capsys.readouterr().err
    assert "'nonexistent-model'" in err and "tiny" in err
    if not torch.cuda.is_available():
        assert main(["verify", "--model", "tiny", "--device", "cuda"]) == 2
        assert "torch sees no CUDA device" in capsys.readouterr().err
    monkeypatch.setenv("DELTAFUSE_PATCH", "0")
    assert main(["verify", "--model", "tiny"]) == 2
    assert "DELTAFUSE_PATCH is off" in capsys.readouterr().err


def test_refuses_when_already_applied():
    patching.apply()
    with pytest.raises(verify.VerifyError, match="already applied"):
        verify.verify_model("tiny")


def test_fails_when_packed_sequences_leak(monkeypatch, capsys):
    """If the conv ignored the boundaries, verify --packed must say so and exit 1."""
    monkeypatch.setattr(adapters, "_conv_seq_idx", lambda x, seq_idx, cu_seqlens: None)
    assert main(["verify", "--model", "tiny", "--packed"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "logits" in out.split("FAIL")[-1]


def test_fails_on_a_wrong_gradient(monkeypatch):
    """A GDN op that is right forward but wrong backward is caught in the gradients."""
    original = adapters.ops.chunk_gated_delta_rule

    class Skew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.01

    def skewed(*args, **kwargs):
        o, state = original(*args, **kwargs)
        return Skew.apply(o), state

    monkeypatch.setattr(adapters.ops, "chunk_gated_delta_rule", skewed)
    result = verify.verify_model("tiny")
    assert not result.ok
    failing = {c.name for c in result.failures}
    assert "loss" not in failing and "logits" not in failing
    assert any(n.startswith("grad model.layers.0.linear_attn") for n in failing)


# --- MoE routing: ties broken differently are reported, pinned in 16-bit, a failure in fp32 -------------
class ToyTopKRouter(torch.nn.Module):
    """Same contract as transformers' TopKRouter modules: (logits, top-k scores, top-k indices)."""

    def __init__(self, experts=6, hidden=5, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = probs.topk(self.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx


def _route_twice(pin):
    torch.manual_seed(0)
    model = torch.nn.Sequential(ToyTopKRouter())
    x = torch.randn(7, 5)
    routing = verify._Routing(model, pin=pin)
    routing.start("record")
    _, _, stock_idx = model(x)
    routing.start("compare")
    y = x.clone()
    y[3] = -y[3]  # token 3 now scores its experts differently
    logits, scores, idx = model(y)
    routing.start(None)
    routing.close()
    return routing, stock_idx, logits, scores, idx


def test_routing_differences_are_pinned_in_16_bit_runs():
    routing, stock_idx, logits, scores, idx = _route_twice(pin=True)
    moved, tokens = routing.counts["0"]
    assert tokens == 7 and moved >= 1
    assert torch.equal(idx, stock_idx)  # every token goes where stock sent it
    # scores of the pinned tokens follow the router's formula at stock's experts, from this run's logits
    want = torch.softmax(logits.float(), -1).gather(-1, stock_idx)
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(scores, want, rtol=0, atol=0)
    result = verify.VerifyResult("toy", None, False, "cpu", "bfloat16", 0.05, 0.0, "-",
                                 comparisons=[verify.Comparison("loss", 0.0, 0.0, True)],
                                 routing={n: list(c) for n, c in routing.counts.items()}, routing_pinned=True)
    assert result.ok and result.rerouted == moved
    assert f"0 {moved}/7" in result.format() and "routed as stock routed them" in result.format()


def test_routing_differences_fail_an_fp32_run():
    routing, stock_idx, logits, scores, idx = _route_twice(pin=False)
    moved = routing.counts["0"][0]
    assert moved >= 1 and not torch.equal(idx, stock_idx)  # not pinned: the run keeps its own choice
    result = verify.VerifyResult("toy", None, False, "cpu", "float32", 1e-4, 0.0, "-",
                                 comparisons=[verify.Comparison("loss", 0.0, 0.0, True)],
                                 routing={n: list(c) for n, c in routing.counts.items()}, routing_pinned=False)
    assert not result.ok
    assert "routed to other experts than in stock" in result.format()


def test_moe_verify_reports_routing():
    result = verify.verify_model("tiny-moe", packed=True, dtype="bf16")
    assert result.ok, result.format()
    n_tokens = sum(sum(r) for r in verify.PACKED_ROWS)
    assert len(result.routing) == 4 and all(t == n_tokens for _, t in result.routing.values())
    assert "routing:" in result.format()


def test_moe_verify_with_gradient_checkpointing_recomputes_the_same_routing():
    model = build_model("tiny-moe", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    result = verify.verify_model("tiny-moe", packed=True, dtype="bf16", model=model)
    assert result.ok, result.format()
    n_tokens = sum(sum(r) for r in verify.PACKED_ROWS)
    assert all(t == n_tokens for _, t in result.routing.values())  # the recomputation is not counted twice
