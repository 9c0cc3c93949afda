"""`benchmarks/bench_gdn.py --gates`: the inputs' gate decay, fast for every head or spread over heads."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("bench_gdn", os.path.join(ROOT, "benchmarks", "bench_gdn.py"))
bench_gdn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_gdn)


def _make(monkeypatch, mode, seed):
    monkeypatch.setattr(bench_gdn, "gates_mode", mode)
    return bench_gdn.make(1, 300, 2, 16, 8, dtype=torch.float32, seed=seed, device="cpu")


def test_fast_gates_forget_within_a_chunk(monkeypatch):
    g = _make(monkeypatch, "fast", int(torch.randint(0, 2**31 - 1, ())))[3]
    assert (g < 0).all()
    # every head's decay over any one 64-token chunk is below e^-13
    chunks = g[0, :256].double().reshape(4, 64, -1).sum(1)
    assert chunks.max().item() < -13


def test_spread_is_fast_times_a_per_head_factor(monkeypatch):
    """Same seed, same draws: "spread" is "fast" times one factor per value head, in [1e-4, 1], spread over
    more than a decade across 16 heads; q, k, v and beta are unchanged."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    fast = _make(monkeypatch, "fast", seed)
    spread = _make(monkeypatch, "spread", seed)
    for name, a, b in zip(("q", "k", "v", "beta"), fast[:3] + fast[4:], spread[:3] + spread[4:]):
        assert torch.equal(a, b), name
    assert (spread[3] < 0).all()
    factor = spread[3] / fast[3]  # [1, T, HV]
    per_head = factor[0, 0]
    torch.testing.assert_close(factor, per_head.expand_as(factor), rtol=1e-6, atol=0)
    assert (per_head >= 1e-4 * (1 - 1e-6)).all() and (per_head <= 1).all()
    assert per_head.max() / per_head.min() > 10  # 16 heads spread over four decades, not one value


def test_unknown_gates_mode_is_refused(monkeypatch):
    monkeypatch.setattr(bench_gdn, "gates_mode", "slow")
    with pytest.raises(ValueError, match="gates_mode='slow'; allowed: fast, spread"):
        bench_gdn.make(1, 4, 1, 2, 8, dtype=torch.float32, device="cpu")


def test_variant_overrides_parse_strictly():
    """`--variants` items (bench_gdn.py and tune_gdn.py): typed overrides, and one-line errors that name the field or
    value and what is allowed, instead of a misspelt boolean read as False."""
    over = bench_gdn.variant_overrides("keep_states=TRUE,bv_out=32,fwd_prod_wh=x2,bo_two_pass=0")
    assert over == {"keep_states": True, "bv_out": 32, "fwd_prod_wh": "x2", "bo_two_pass": False}
    assert bench_gdn.variant_overrides("") == {}
    with pytest.raises(ValueError, match=r"keep_states='yes'; allowed: true, false, 1, 0"):
        bench_gdn.variant_overrides("keep_states=yes")
    with pytest.raises(ValueError, match=r"bv_out='3x'; allowed: an int"):
        bench_gdn.variant_overrides("bv_out=3x")
    with pytest.raises(ValueError, match=r"'bv_outt' is not a ChunkOptions field; allowed: .*bv_out"):
        bench_gdn.variant_overrides("bv_outt=32")


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "4"], "argument --shapes: '4'; allowed: 'all' or comma-separated indices 0-3"),
    (["--shapes", "1,x"], "argument --shapes: '1,x'; allowed: 'all'"),
    (["--kernels", "-1"], "argument --kernels: '-1'; allowed:"),
    (["--breakdown", "0,4"], "argument --breakdown: '0,4'; allowed:"),
    (["--check-shape", "1,1024,16,32"], "argument --check-shape: '1,1024,16,32'; allowed: 5 comma-separated ints"),
    (["--check-shape", "1,64,3,4,64"], "argument --check-shape: '1,64,3,4,64': HV=4 is not a multiple of H=3"),
    (["--packed-heads", "16,32,x"], "argument --packed-heads: '16,32,x'; allowed: 3 comma-separated ints >= 1"),
    (["--packed-check", "3,0"], "argument --packed-check: '3,0'; allowed: comma-separated ints >= 1"),
    (["--segments", "2048,"], "argument --segments: '2048,'; allowed: comma-separated ints >= 1"),
])
def test_bad_shape_arguments_are_one_usage_error(monkeypatch, capsys, argv, message):
    """bench_gdn.py's shape arguments (tune_gdn.py takes the same types): a bad value is argparse's usage error,
    naming the argument, the value and what is allowed, before anything runs, instead of a traceback."""
    monkeypatch.setattr("sys.argv", ["bench_gdn.py", "--out", "unused.json", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_gdn.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


def test_shape_arguments_parse():
    assert bench_gdn.shape_indices("all") == [0, 1, 2, 3]
    assert bench_gdn.shape_indices("3,1") == [3, 1]
    assert bench_gdn.shape_indices("") == []
    assert bench_gdn.head_shape("2,512,4,8,64", 5) == (2, 512, 4, 8, 64)
    assert bench_gdn.ints("1,3,64") == (1, 3, 64)
