"""The tests' random inputs: fresh each pytest run, drawn again with ``--test-seed`` (tests/helpers.py, conftest.py)."""

import subprocess
import sys
import textwrap

import torch

from tests import helpers
from tests.helpers import REPO_ROOT, clean_subprocess_env, input_gen, input_seed

PROBE = textwrap.dedent("""
    import pytest
    import torch

    from tests.helpers import input_gen, input_seed


    @pytest.mark.parametrize("case", ["a", "b"])
    def test_draws(case):
        print("DRAW", case, input_seed(7), input_seed(), input_seed(), float(torch.randn((), generator=input_gen(7))),
              float(torch.randn(())))
""")


def _draws(tmp_path, *args) -> tuple[int, dict[str, list[str]]]:
    """(exit status, {case: the values it printed}) of a pytest run of the probe module with this suite's
    conftest as a plugin."""
    probe = tmp_path / "test_probe_seeds.py"
    probe.write_text(PROBE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "--rootdir", str(tmp_path), str(probe), *args],
                         cwd=REPO_ROOT, env=clean_subprocess_env(), capture_output=True, text=True, timeout=300)
    assert "DRAW" in run.stdout, run.stdout + run.stderr
    # (pytest's progress dots share the printed lines)
    draws = [line.split("DRAW ", 1)[1].split() for line in run.stdout.splitlines() if "DRAW " in line]
    return run.returncode, {d[0]: d[1:] for d in draws}


def test_same_salt_same_seed_other_salt_or_turn_another():
    assert input_seed(3) == input_seed(3)
    assert input_seed(3) != input_seed(4)
    assert input_seed("a", 1) != input_seed("a", 2)
    turns = [input_seed() for _ in range(4)]
    assert len(set(turns)) == 4
    assert all(0 <= s < 2**31 for s in turns + [input_seed(3)])
    a, b = torch.randn(5, generator=input_gen(9)), torch.randn(5, generator=input_gen(9))
    assert torch.equal(a, b)


def test_the_base_seed_changes_every_seed(monkeypatch):
    before = input_seed(3)
    monkeypatch.setattr(helpers, "_BASE_SEED", helpers.base_seed() + 1)
    assert input_seed(3) != before


def test_a_named_base_seed_repeats_every_draw_and_a_fresh_one_does_not(tmp_path):
    rc1, first = _draws(tmp_path, "--test-seed", "12345")
    rc2, again = _draws(tmp_path, "--test-seed", "12345")
    rc3, fresh = _draws(tmp_path)
    assert (rc1, rc2, rc3) == (0, 0, 0)
    assert sorted(first) == ["a", "b"] and first == again
    # each test its own seeds: the two cases of one parametrised test draw differently
    assert first["a"] != first["b"]
    assert all(first[c][i] != fresh[c][i] for c in "ab" for i in range(5))


def test_a_bad_test_seed_is_one_usage_line(tmp_path):
    for bad in ("x", str(2**31)):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                              "tests/test_config.py", "--test-seed", bad], cwd=REPO_ROOT, env=clean_subprocess_env(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 4
        errors = [line for line in run.stderr.splitlines() if "error:" in line]
        assert errors == [f"__main__.py: error: argument --test-seed: {bad!r}; allowed: a whole number from 0 to "
                          f"{2**31 - 1}"], run.stderr
