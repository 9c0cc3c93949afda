"""`deltafuse bench ops` on CPU: every routed op, deltafuse vs stock, timed, with matching outputs."""

from __future__ import annotations

import json

from deltafuse.bench.cli import main
from deltafuse.bench.ops import OPS


def test_bench_ops_times_every_routed_op_and_outputs_agree(tmp_path, capsys):
    path = tmp_path / "ops.json"
    assert main(["ops", "--shape", "1,80,2,4,16", "--reps", "1", "--output", str(path)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    for op in OPS:
        impls = [r for r in rows if r["op"] == op]
        assert impls[0]["impl"].startswith("deltafuse (") and impls[1]["impl"] == "transformers torch"
        for r in impls:
            assert "error" not in r, r
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
            assert r["max_abs_diff"] < 1e-4, r  # stock and deltafuse compute the same function
    assert "| chunk_gated_delta_rule" in text and "not measured on CPU" in text


def test_bench_ops_bad_shape_and_device(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["ops", "--shape", "1,80,3,4,16"])
    assert "HV=4 must be a multiple of H=3" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["ops", "--device", "cuda"]) == 2
        assert "no CUDA device is available here" in capsys.readouterr().err
