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
