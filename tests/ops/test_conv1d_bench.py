"""benchmarks/bench_conv1d.py in its CPU smoke mode (tiny shapes, Triton interpreter): it runs end to end, checks
every implementation, sweeps the options, writes its JSON and prints the table last."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_conv1d.py"
    spec = importlib.util.spec_from_file_location("bench_conv1d", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_smoke_mode_checks_times_sweeps_and_writes_json(tmp_path, capsys):
    out = tmp_path / "conv.json"
    assert _bench().main(["--smoke", "--sweep", "--shapes", "1,9,12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert {(c["shape"], c["impl"]) for c in checks} >= {
        ("B=1 T=9 C=12", "deltafuse triton"), ("B=1 T=9 C=12 packed", "deltafuse triton"),
        ("B=1 T=9 C=12 packed", "torch route"), ("update B=3 C=12", "deltafuse triton")}
    for c in checks:
        assert c["ok"], c
        if "dx" in c:
            assert c["out"] < 2e-6 and c["dx"] < 2e-6 and c["dweight"] < 2e-6
    rows = result["rows"]
    assert {r["impl"] for r in rows} == {"deltafuse triton", "torch route"}
    assert all(r["fwd_ms"] > 0 for r in rows) and all(r["fwd_bwd_ms"] > 0 for r in rows if r["kind"] == "fn")
    assert {r["shape"] for r in rows if r["kind"] == "update"} == {"update B=1 C=12", "update B=3 C=12"}
    (sweep,) = result["sweeps"]
    assert len(sweep["fwd"]) == len(sweep["bwd"]) == 2 and sweep["best_fwd"] and sweep["best_bwd"]
    assert "best options for B=1 T=9 C=12" in text
    assert text.rstrip().splitlines()[-1].startswith("| update B=3 C=12 | torch route |")  # the table comes last


def test_arguments_are_checked_by_name(capsys):
    bench = _bench()
    for bad, word in ((["--shapes", "1,2"], "--shapes"), (["--shapes", "1,0,4"], "--shapes"),
                      (["--rep", "0"], "--rep")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x.json"] + bad)
        assert word in capsys.readouterr().err
