"""`deltafuse bench e2e`: two real (very small) runs, then the table, JSON and PNG; and its arithmetic."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from deltafuse.bench import e2e, e2e_report, e2e_runs
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
               "--num-examples", "30", "--output-dir", out, "--no-progress", "--repeats", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text
    md = open(os.path.join(out, "e2e.md")).read()
    assert md in text  # the table is printed too
    for metric in ("avg duration per 2-step interval (s)", "median step time (ms", "tokens/s",
                   "peak memory (process peak RSS)", "avg loss (all steps)", "avg grad norm"):
        assert metric in md
    with open(os.path.join(out, "e2e.json")) as fh:
        res = json.load(fh)
    assert res["off"]["measured_intervals"] == 1 and res["on"]["measured_intervals"] == 1
    assert res["speedup"] is None and "speedup" not in md  # CPU timings give no verdict
    assert "not even the spread of the noise was measured" in md  # --repeats 1 says what it lacks
    assert res["loss_delta"] == pytest.approx(res["on"]["avg_loss"] - res["off"]["avg_loss"])
    assert [r["step"] for r in res["steps"]["off"][0]] == [1, 2, 3, 4] == [r["step"] for r in res["steps"]["on"][0]]
    # same seed, data and order: the first step sees the same batch; the runs differ only by the patching
    assert res["steps"]["off"][0][0]["tokens"] == res["steps"]["on"][0][0]["tokens"]
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

    monkeypatch.setattr(e2e_runs.subprocess, "call", failing_child)
    for extra in ([], ["--overwrite"]):
        assert main(["e2e", "--model", "tiny", "--max-steps", "4", "--interval", "2", "--seq-len", "256",
                     "--num-examples", "30", "--output-dir", out, "--no-progress", "--repeats", "1", *extra]) == 1
        assert "the OFF (stock) run (repeat 1 of 1) failed with exit code 1" in capsys.readouterr().err
        assert _snapshot(out) == before
    # Ctrl-C while a run trains: the previous benchmark is put back, and the one line says so
    from deltafuse import cli

    def interrupted_child(cmd, env=None):
        failing_child(cmd)
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e_runs.subprocess, "call", interrupted_child)
    assert cli.main(["bench", "e2e", "--model", "tiny", "--max-steps", "4", "--interval", "2", "--seq-len", "256",
                     "--num-examples", "30", "--output-dir", out, "--no-progress", "--repeats", "1"]) == 130
    assert capsys.readouterr().err == (f"deltafuse bench e2e: interrupted; the previous bench e2e result in {out!r} "
                                       "is put back as it was\n")
    assert _snapshot(out) == before


def test_forwarded_flags_reproduce_the_arguments():
    parser = e2e_runs.train_parser()
    args = parser.parse_args(["--model", "tiny-moe", "--full", "--no-packing", "--lora-targets", "q_proj,o_proj",
                              "--seq-len", "300", "--gradient-checkpointing", "--lr", "0.01"])
    again = parser.parse_args(e2e_runs.forward_train_args(args))
    for key, value in vars(args).items():
        if key not in e2e_runs.NOT_FORWARDED:
            assert getattr(again, key) == value, key


def test_interval_arithmetic():
    recs = [{"step": i, "wall_s": 1.0 * i + (5.0 if i > 0 else 0), "tokens": 100, "step_time_s": 0.5,
             "loss": 10.0 - i, "grad_norm": 1.0, "peak_mem_bytes": 1000 + i} for i in range(1, 7)]
    # wall clock: step 1 ends at 6 s (5 s of warm-up), then 1 s per step
    s = e2e_report.summarize(recs, size=2, warmup=1)
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
    cmd = [sys.executable, "-m", "deltafuse", "bench", "e2e", *SMALL, "--repeats", "1"]
    for attempt in (1, 2):
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"run {attempt}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "replacing the previous bench e2e result in 'runs/bench-e2e'" in done.stdout
    # the tiny model's runs on one CPU thread, and the commands shown say so
    assert "\n=== OFF (stock), repeat 1 of 1: OMP_NUM_THREADS=1 DELTAFUSE_PATCH=0 python -m " in done.stdout
    out = tmp_path / "runs" / "bench-e2e"
    assert sorted(os.listdir(out)) == BENCH_FILES  # the previous result replaced, nothing set aside left behind
    res = json.load(open(out / "e2e.json"))
    assert [r["step"] for r in res["steps"]["on"][0]] == [1, 2] and res["stack"]["cpu_threads"] == 1


def test_tiny_cpu_runs_get_one_thread_unless_the_user_chose():
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny"])
    assert e2e_runs.child_threads(args, "cpu", {}) == "1"
    assert e2e_runs.child_threads(args, "cpu", {"OMP_NUM_THREADS": "2"}) is None  # the user's choice stands
    assert e2e_runs.child_threads(args, "cuda:0", {}) is None
    assert e2e_runs.child_threads(parser.parse_args(["--model", "dense8"]), "cpu", {}) is None
    _, env = e2e_runs.child_command(args, "on", "x", "1")
    assert env["OMP_NUM_THREADS"] == "1"


def test_cuda_graphs_reach_the_deltafuse_run_alone():
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--model", "dense8", "--cuda-graphs"])
    on, _ = e2e_runs.child_command(args, "on", "x")
    off, _ = e2e_runs.child_command(args, "off", "x")
    fla, _ = e2e_runs.child_command(args, "fla+liger", "x")
    assert "--cuda-graphs" in on and "--cuda-graphs" not in off and "--cuda-graphs" not in fla
    assert on[on.index("--model") + 1] == off[off.index("--model") + 1] == "dense8"


@pytest.mark.parametrize("extra,needle", [([], "--cuda-graphs: the device is cpu; allowed: a CUDA device"),
                                          (["--gradient-checkpointing"], "--cuda-graphs: --gradient-checkpointing recomputes "
                                                                      "forwards during the backward")])
def test_cuda_graphs_refused_before_any_run(tmp_path, capsys, extra, needle):
    if torch.cuda.is_available() and not extra:
        pytest.skip("the device refusal is for machines without CUDA")
    out = tmp_path / "b"
    assert main(["e2e", "--model", "tiny", "--cuda-graphs", *extra, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "error:" in x][-1]
    assert needle in line and "Traceback" not in err
    assert not (out / "off").exists()


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


def test_output_dir_holding_a_set_aside_run_is_refused_naming_only_bench_flags(tmp_path, capsys):
    """What an interrupted replacement left behind, beside a newer run's checkpoint: refused, nothing moved."""
    from deltafuse.train.outdir import ASIDE

    out = tmp_path / "b"
    (out / ASIDE / "off").mkdir(parents=True)
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
    assert main(["e2e", "--output-dir", str(out), "--max-steps", "2", "--interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ASIDE in err and "move its contents back" in err, err
    assert _suggested_flags(err) <= _bench_flags(), err
    assert sorted(os.listdir(out)) == [ASIDE, "checkpoint-1"] and os.listdir(out / ASIDE) == ["off"]


# --- item: honest output: interleaved repeats; on CPU the loss is the headline and the timings are called noise ---
def test_cpu_run_interleaves_repeats_and_reports_noise_not_a_speedup(tmp_path, capsys):
    out = str(tmp_path / "bench")
    assert main(["e2e", *SMALL, "--output-dir", out, "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    order = re.findall(r"^=== (OFF \(stock\)|ON \(deltafuse\)), repeat (\d) of 2: ", text, re.M)
    assert order == [("OFF (stock)", "1"), ("ON (deltafuse)", "1"), ("OFF (stock)", "2"), ("ON (deltafuse)", "2")]
    md = open(os.path.join(out, "e2e.md")).read()
    lines = md.splitlines()
    assert lines[0].startswith("# deltafuse bench e2e: tiny,")
    assert "2 steps x 2 repeats (OFF, ON interleaved)" in lines[0]
    assert lines[2].startswith("- loss (what a CPU run checks): max per-step |loss OFF - loss ON| ")
    assert lines[3].startswith("- timing on cpu is noise, not deltafuse's speed:") and "BENCHMARKS.md" in lines[3]
    assert "speedup" not in md.lower()  # no verdict from CPU timings
    res = json.load(open(os.path.join(out, "e2e.json")))
    assert res["speedup"] is None and res["repeats"] == 2 and res["speed"]["verdict"] == "cpu: noise"
    for side in ("off", "on"):
        spread = res[side]["avg_interval_s"]
        assert spread["values"] == [r["avg_interval_s"] for r in res[side]["repeats"]] and len(spread["values"]) == 2
        assert spread["min"] <= spread["median"] <= spread["max"]
        assert f"{spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}]" in md
        assert [[r["step"] for r in recs] for recs in res["steps"][side]] == [[1, 2], [1, 2]]
    # the same seed and data in every repeat: the first step's batch and loss are the same each time
    assert res["steps"]["off"][0][0]["tokens"] == res["steps"]["off"][1][0]["tokens"]
    assert res["max_step_loss_delta"] == pytest.approx(max(
        abs(a["loss"] - b["loss"]) for r in range(2) for a, b in zip(res["steps"]["off"][r], res["steps"]["on"][r])))


def test_cuda_verdict_comes_from_the_interleaved_pairs():
    faster = e2e_report.speed_verdict([2.0, 2.2, 1.9], [1.0, 1.0, 1.0], "cuda:0")
    assert faster["speedup"] == pytest.approx(2.0) and faster["pair_speedups"] == pytest.approx([2.0, 2.2, 1.9])
    assert faster["verdict"] == "faster" and "faster in 3 of 3 interleaved repeats" in faster["text"]
    assert "median speedup 2.00x (1.90x-2.20x)" in faster["text"]
    mixed = e2e_report.speed_verdict([1.1, 0.9, 1.05], [1.0, 1.0, 1.0], "cuda:0")
    assert mixed["verdict"] == "no clear verdict" and "faster in 2 of 3" in mixed["text"]
    slower = e2e_report.speed_verdict([0.5, 0.6], [1.0, 1.0], "cuda:0")
    assert slower["verdict"] == "slower" and "slower in 2 of 2" in slower["text"]
    one = e2e_report.speed_verdict([2.0], [1.0], "cuda:0")
    assert "one OFF/ON pair" in one["text"] and "--repeats" in one["text"]
    cpu = e2e_report.speed_verdict([2.0, 2.2, 1.9], [1.0, 1.0, 1.0], "cpu")
    assert cpu["speedup"] is None and cpu["verdict"] == "cpu: noise" and "pair_speedups" not in cpu
    assert "BENCHMARKS.md" in cpu["text"]


def test_cuda_table_has_the_speedup_row_with_its_range():
    reps = lambda ts: [{"avg_interval_s": t, "median_step_s": t / 10, "tokens_per_s": 1000 / t,  # noqa: E731
                        "peak_mem_bytes": 2 ** 30, "avg_loss": 5.0, "final_loss": 4.0, "avg_grad_norm": 1.0,
                        "steps": 20, "measured_intervals": 1} for t in ts]
    off, on = e2e_report.aggregate(reps([2.0, 2.2, 1.9])), e2e_report.aggregate(reps([1.0, 1.0, 1.0]))
    speed = e2e_report.speed_verdict([2.0, 2.2, 1.9], [1.0, 1.0, 1.0], "cuda:0")
    rows = e2e_report.table_rows(off, on, 10, "cuda max allocated", speed)
    assert rows[0][1] == "2.000 [1.900-2.200]" and rows[0][2] == "1.000 [1.000-1.000]"
    assert rows[-1] == ["speedup (OFF time / ON time), median of 3 pairs", "", "", "2.00x (1.90x-2.20x)"]
    cpu_rows = e2e_report.table_rows(off, on, 10, "process peak RSS", e2e_report.speed_verdict([2.0], [1.0], "cpu"))
    assert not any("speedup" in r[0] for r in cpu_rows) and cpu_rows[0][3] == "(cpu: noise)"
    # deltafuse's speedup over a peer: on CUDA the median of the peer's / ON's time per repeat; none on a CPU
    stats = {"on": on, "fla": off}
    assert e2e_report.peer_speedup(stats, "fla", speed) == pytest.approx(2.0)
    assert e2e_report.peer_speedup(stats, "fla", e2e_report.speed_verdict([2.0], [1.0], "cpu")) is None
