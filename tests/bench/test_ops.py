"""`deltafuse bench ops` on CPU: every routed op, deltafuse vs stock, timed, with matching outputs."""

from __future__ import annotations

import json

from deltafuse.backends import REGISTRY
from deltafuse.bench.cli import main


def test_bench_ops_times_every_registry_op_against_stock_and_outputs_agree(tmp_path, capsys):
    path = tmp_path / "ops.json"
    assert main(["ops", "--shape", "1,80,2,4,16", "--tokens", "32", "--reps", "1", "--output", str(path)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == set(REGISTRY.ops)
    for op in REGISTRY.ops:
        impls = [r for r in rows if r["op"] == op]
        if op == "sdpa_attention":  # routed on npu devices only: said so, nothing timed
            assert len(impls) == 1 and "routed only on npu" in impls[0]["note"] and "error" not in impls[0]
            continue
        if op == "packed_causal_attention":  # a whole-step effect: pointed to bench e2e
            assert len(impls) == 1 and "bench e2e" in impls[0]["note"] and "error" not in impls[0]
            continue
        assert impls[0]["impl"].startswith("deltafuse ("), impls
        # the stock counterpart: transformers' code, or for the per-token head what a trainer computes without a
        # fused head (TRL's own fused head runs on CPU too when trl imports)
        stock = "full logits" if op == "token_logprobs" else "transformers"
        assert any(r["impl"].startswith(stock) for r in impls[1:]), impls
        assert all(r["impl"].startswith(("deltafuse (", stock, "trl ")) for r in impls), impls  # no CUDA here
        for r in impls:
            assert "error" not in r and "bwd_error" not in r, r
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
            assert r["max_abs_diff"] < 1e-4, r  # stock and deltafuse compute the same function
    sized = [r for r in rows if r["op"] == "fused_linear_cross_entropy"]
    assert sized[0]["dims"] == "B,T,H,V" and sized[0]["shape"][1] == 32  # --tokens reaches the sized cases
    assert "| chunk_gated_delta_rule" in text and "| moe_experts" in text and "not measured on CPU" in text


def test_bench_ops_op_choices_are_the_registry(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["ops", "--op", "no_such_op"])
    err = capsys.readouterr().err
    assert "--op" in err and all(op in err for op in REGISTRY.ops)
    with pytest.raises(SystemExit):
        main(["ops", "--tokens", "1"])
    assert "--tokens" in capsys.readouterr().err


def test_bench_ops_bad_shape_and_device(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["ops", "--shape", "1,80,3,4,16"])
    assert "HV=4 must be a multiple of H=3" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["ops", "--device", "cuda"]) == 2
        assert "no CUDA device is available here" in capsys.readouterr().err


def test_bench_ops_op_names_as_data_are_the_registrys_in_its_order():
    """``--op``'s choices are data (checked without the registry); they are the registry's, in its order, and
    every one of them has a case here or says why it has none."""
    from deltafuse.bench import ops, ops_args

    assert ops_args.OPS == tuple(REGISTRY.ops) == ops.routed_ops()
    cased = set(ops_args.GDN_OPS) | set(ops_args.SIZED_DIMS) | set(ops.TIMED_ELSEWHERE) | set(ops.ROUTED_ONLY_ON)
    assert cased == set(REGISTRY.ops)


def test_bench_ops_device_argument():
    import argparse

    import pytest
    import torch

    from deltafuse.bench.ops_args import parse_device

    for text in ("auto", "cpu", "cpu:0", "cuda", "cuda:0", "cuda:13"):
        assert parse_device(text) == text
        assert text == "auto" or torch.device(text).type in ("cpu", "cuda")
    for text in ("gpu", "xpu", "meta", "CUDA", "cuda:", "cuda:-1", "cuda:x", " cpu", "cpu:1", ""):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            parse_device(text)
        assert str(err.value) == f"{text!r} is not a device; allowed: auto, cpu, cpu:0, cuda, cuda:N"
