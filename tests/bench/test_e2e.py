"""`deltafuse bench e2e`: two real (very small) runs, then the table, JSON and PNG; and its arithmetic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from deltafuse.bench import e2e
from deltafuse.bench.cli import main


def _snapshot(root):
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


def test_bench_e2e_writes_table_json_and_png(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "bench")
    rc = main(["e2e", "--model", "tiny", "--max-steps", "4", "--interval", "2", "--seq-len", "256",
               "--num-examples", "30", "--output-dir", out, "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    md = open(os.path.join(out, "e2e.md")).read()
    assert md in text  # the table is printed too
    for metric in ("avg duration per 2-step interval (s)", "median step time (ms", "tokens/s",
                   "peak memory (process peak RSS)", "avg loss (all steps)", "avg grad norm",
                   "speedup (OFF time / ON time)"):
        assert metric in md
    with open(os.path.join(out, "e2e.json")) as fh:
        res = json.load(fh)
    assert res["off"]["measured_intervals"] == 1 and res["on"]["measured_intervals"] == 1
    assert res["speedup"] == pytest.approx(res["off"]["avg_interval_s"] / res["on"]["avg_interval_s"])
    assert res["loss_delta"] == pytest.approx(res["on"]["avg_loss"] - res["off"]["avg_loss"])
    assert [r["step"] for r in res["steps"]["off"]] == [1, 2, 3, 4] == [r["step"] for r in res["steps"]["on"]]
    # same seed, data and order: the first step sees the same batch; the runs differ only by the patching
    assert res["steps"]["off"][0]["tokens"] == res["steps"]["on"][0]["tokens"]
    assert res["deltafuse_report"]["enabled"] is True
    off = json.load(open(os.path.join(out, "off", "summary.json")))
    # the OFF run measures stock as installed (FLA kept off its path), never a substitute
    assert off["deltafuse"] == {"enabled": False, "stock": "as installed"}
    assert res["commands"]["off"].startswith("DELTAFUSE_PATCH=0 ") and res["commands"]["on"].startswith(
        "DELTAFUSE_PATCH=1 ")
    with open(os.path.join(out, "e2e.png"), "rb") as fh:
        png = fh.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # a new run whose runs fail (after writing part of their output) keeps the previous benchmark, byte for
    # byte, with and without --overwrite
    before = _snapshot(out)

    def failing_child(cmd, env=None):
        run_dir = cmd[cmd.index("--output-dir") + 1]
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
            fh.write('{"step": 1}\n')
        return 1

    monkeypatch.setattr(e2e.subprocess, "call", failing_child)
    for extra in ([], ["--overwrite"]):
        assert main(["e2e", "--model", "tiny", "--max-steps", "4", "--interval", "2", "--seq-len", "256",
                     "--num-examples", "30", "--output-dir", out, "--no-progress", *extra]) == 1
        assert "the OFF (stock) run failed with exit code 1" in capsys.readouterr().err
        assert _snapshot(out) == before


def test_forwarded_flags_reproduce_the_arguments():
    parser = e2e.train_parser()
    args = parser.parse_args(["--model", "tiny-moe", "--full", "--no-packing", "--lora-targets", "q_proj,o_proj",
                              "--seq-len", "300", "--gradient-checkpointing", "--lr", "0.01"])
    again = parser.parse_args(e2e.forward_train_args(args))
    for key, value in vars(args).items():
        if key not in e2e.NOT_FORWARDED:
            assert getattr(again, key) == value, key


def test_interval_arithmetic():
    recs = [{"step": i, "wall_s": 1.0 * i + (5.0 if i > 0 else 0), "tokens": 100, "step_time_s": 0.5,
             "loss": 10.0 - i, "grad_norm": 1.0, "peak_mem_bytes": 1000 + i} for i in range(1, 7)]
    # wall clock: step 1 ends at 6 s (5 s of warm-up), then 1 s per step
    s = e2e.summarize(recs, size=2, warmup=1)
    assert [iv["duration_s"] for iv in s["intervals"]] == [7.0, 2.0, 2.0]
    assert s["avg_interval_s"] == 2.0 and s["tokens_per_s"] == 100.0 and s["measured_intervals"] == 2
    assert s["avg_loss"] == pytest.approx(sum(10.0 - i for i in range(1, 7)) / 6)
    assert s["final_loss"] == pytest.approx((5.0 + 4.0) / 2) and s["peak_mem_bytes"] == 1006
    assert s["median_step_s"] == 0.5


@pytest.mark.parametrize("argv, needle", [
    (["--max-steps", "10"], "--max-steps 10 leaves no timed interval; allowed: --max-steps >= --interval x"),
    (["--deltafuse"], "bench e2e runs both OFF and ON; drop --deltafuse/--no-deltafuse"),
    (["--resume"], "--resume is for `deltafuse train`"),
    (["--context-parallel", "2"], "--context-parallel 2 with bench e2e: its stock (OFF) run has no exact"),
    (["--model", "huge"], "known names: tiny"),
])
def test_bench_e2e_bad_input(argv, needle, tmp_path, capsys):
    assert main(["e2e", *argv, "--output-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


# --- item: the README's first command works twice; an occupied --output-dir is refused with bench's own flags ---
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--model", "tiny", "--max-steps", "2", "--interval", "1", "--seq-len", "256", "--num-examples", "30",
         "--no-progress"]
BENCH_FILES = [".deltafuse-bench-e2e", "e2e.json", "e2e.md", "e2e.png", "off", "on"]


def _bench_flags() -> set[str]:
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return {s for a in parser._actions for s in a.option_strings} - {"--resume", "--deltafuse", "--no-deltafuse"}


def _suggested_flags(message: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", message))


@pytest.mark.slow
def test_readme_command_twice_in_the_same_directory(tmp_path):
    """`deltafuse bench e2e --model tiny` (default --output-dir) run twice in a row in one cwd: both exit 0."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("DELTAFUSE_PATCH", "OMP_NUM_THREADS"):  # as a new user's shell has them
        env.pop(name, None)
    cmd = [sys.executable, "-m", "deltafuse", "bench", "e2e", *SMALL]
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"run {attempt}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "replacing the previous bench e2e result in 'runs/bench-e2e'" in done.stdout
    out = tmp_path / "runs" / "bench-e2e"
    assert sorted(os.listdir(out)) == BENCH_FILES  # the previous result replaced, nothing set aside left behind
    res = json.load(open(out / "e2e.json"))
    assert [r["step"] for r in res["steps"]["on"]] == [1, 2]


def test_output_dir_holding_a_train_run_is_refused_naming_only_bench_flags(tmp_path, capsys):
    from deltafuse.train.cli import main as train_main

    run = str(tmp_path / "run")
    assert train_main(["--model", "tiny", "--max-steps", "1", "--seq-len", "256", "--num-examples", "8",
                       "--output-dir", run, "--no-progress"]) == 0
    capsys.readouterr()
    before = _snapshot(run)
    assert main(["e2e", "--output-dir", run, "--max-steps", "2", "--interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(run) in err and "`deltafuse train` run" in err, err
    flags = _suggested_flags(err)
    assert "--overwrite" in flags and flags <= _bench_flags(), err  # never --resume, which bench e2e refuses
    assert _snapshot(run) == before


def test_output_dir_holding_other_files_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "e2e.json").write_text("{}")  # looks like a bench result, but notes.txt is not one
    assert main(["e2e", "--output-dir", str(out), "--max-steps", "2", "--interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "notes.txt" in err and repr(str(out)) in err, err
    assert _suggested_flags(err) <= _bench_flags(), err
    assert sorted(os.listdir(out)) == ["e2e.json", "notes.txt"] and (out / "notes.txt").read_text() == "keep me"
