"""benchmarks/bench_decode.py --smoke: the decode benchmark end to end on CPU (interpreted Triton, the tiny
model), its correctness columns and its table."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

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
        assert r["decode_tok_s"] > 0
    assert all(r["ids_match"] and r["first_divergence"] is None for r in gen if r["impl"] == "deltafuse")
    printed = capsys.readouterr().out
    assert "| shape | batch | impl |" in printed and "| model | batch | impl |" in printed
