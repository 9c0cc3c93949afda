"""`benchmarks/profile_train.py --force-backend OP=NAME`: checked before anything runs, and inside the block every
call of OP that leaves the choice to the registry is served by NAME (calls that name a backend keep it)."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from deltafuse.backends import REGISTRY
from tests.helpers import input_gen

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("profile_train", os.path.join(ROOT, "benchmarks", "profile_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value,match", [
    ("moe=torch", "expected OP=NAME with OP one of .*moe_experts"),
    ("moe_experts", "expected OP=NAME"),
    ("moe_experts=cuda", "moe_experts has no candidate 'cuda'; allowed: triton, npu, torch"),
])
def test_bad_force_backend_is_one_line_naming_the_value_and_what_is_allowed(value, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        _script().main([str(tmp_path / "out.json"), "--force-backend", value, "--", "--model", "tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--force-backend {value!r}" in err
    assert re.search(match, err), err
    assert not (tmp_path / "out.json").exists()


def test_forcing_serves_the_op_by_the_named_candidate_and_leaves_explicit_backends(monkeypatch):
    from deltafuse.ops import moe_experts

    seen = []
    original = REGISTRY.select_tensors

    def spy(op, backend, needs_grad, tensors):
        seen.append((op, backend))
        return original(op, backend, needs_grad, tensors)

    monkeypatch.setattr(REGISTRY, "select_tensors", spy)
    gen = input_gen(3)
    x, w = torch.randn(4, 8, generator=gen), torch.rand(4, 2, generator=gen)
    idx = torch.randint(0, 3, (4, 2), generator=gen)
    gu, dn = torch.randn(3, 8, 8, generator=gen), torch.randn(3, 8, 4, generator=gen)
    script = _script()
    with script._forcing({"moe_experts": "torch"}):
        inside = moe_experts(x, idx, w, gu, dn)
        moe_experts(x, idx, w, gu, dn, backend="auto")
    after = moe_experts(x, idx, w, gu, dn)
    experts = [b for op, b in seen if op == "moe_experts"]
    assert experts == ["torch", "auto", "auto"], seen
    assert torch.equal(inside, after)
