"""Ctrl-C or SIGTERM loses no step of `deltafuse train`: the current step finishes, the Trainer's own checkpoint-N
is saved, one line on stderr says where and the exact command that continues (exit 130 / 143), and that command
continues the same run exactly. A second Ctrl-C while saving is ignored. Every state a run can leave in
--output-dir gets a one-line way forward from the next run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from deltafuse.train import outdir, setup, stopping
from deltafuse.train import progress as progress_mod
from deltafuse.train.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["--model", "tiny", "--max-steps", "30", "--seq-len", "128", "--num-examples", "40", "--no-progress",
       "--no-deltafuse", "--log-every", "1"]
TINY = ["--seq-len", "128", "--num-examples", "10", "--no-progress", "--no-deltafuse"]


def records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def own_lines(stderr: str) -> list[str]:
    """stderr without transformers' own load-time warnings (``[transformers] ...``)."""
    return [x for x in stderr.splitlines() if x.strip() and not x.startswith("[transformers]")]


def env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def interrupted_run(out: str, signum: int, argv=RUN):
    """`python -m deltafuse train` sent ``signum`` once its metrics.jsonl holds a step; (returncode, stdout,
    stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "deltafuse", "train", *argv, "--output-dir", out], cwd=ROOT,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=600)
    return proc.returncode, stdout, stderr


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """The uninterrupted run that the interrupted-and-continued ones must equal."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    assert main([*RUN, "--output-dir", out]) == 0
    return records(out)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_printed_command_continues_the_run(tmp_path, straight, signum, code):
    out = str(tmp_path / "run")
    rc, stdout, stderr = interrupted_run(out, signum)
    assert rc == code, stdout[-2000:] + stderr[-2000:]
    lines = own_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    step = records(out)[-1]["step"]
    ckpt = os.path.join(out, f"checkpoint-{step}")
    assert line.startswith(f"deltafuse train: {'terminated' if signum == signal.SIGTERM else 'interrupted'}; "), line
    assert f"after step {step} of 30: saved checkpoint {ckpt}; continue with: " in line, line
    assert 1 <= step < 30 and [r["step"] for r in records(out)] == list(range(1, step + 1))
    assert outdir.check_checkpoint(ckpt, "lora") == step  # complete: weights, optimizer, scheduler, state
    assert sorted(os.listdir(out)) == [f"checkpoint-{step}", "metrics.jsonl", "train_args.json"]
    command = shlex.split(line.split("; continue with: ", 1)[1])
    assert command[-2:] == ["--resume", "latest"] and command[command.index("--output-dir") + 1] == out
    assert "finishing the current step, then saving a checkpoint" in stdout
    if signum == signal.SIGTERM:
        return  # the same path; continuing it is shown once, for Ctrl-C
    done = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"resuming from {ckpt}" in done.stdout
    got = records(out)
    assert [r["step"] for r in got] == list(range(1, 31))
    for a, b in zip(got, straight):  # the same run: the steps after the checkpoint equal the uninterrupted ones
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4, (a, b)
    assert os.path.isfile(os.path.join(out, "final", "adapter_model.safetensors"))


class _Hooks:
    """Send real signals to this process from inside a run: at the start of a step, in the middle of a save."""

    def __init__(self, monkeypatch, *, at_step=None, during_save=False, before_training=None):
        from transformers import Trainer

        make = progress_mod.make_step_logger
        self.saves = 0

        def make_signalling():
            base = make()

            class Signalling(base):
                def on_step_begin(self_, args, state, control, **kw):
                    super().on_step_begin(args, state, control, **kw)
                    if at_step is not None and state.global_step + 1 == at_step:
                        os.kill(os.getpid(), signal.SIGINT)

            return Signalling

        monkeypatch.setattr(progress_mod, "make_step_logger", make_signalling)
        if during_save:  # after the weights, before the optimizer, scheduler and trainer state are written
            real = Trainer._save_optimizer_and_scheduler

            def save_with_a_signal(trainer, output_dir):
                self.saves += 1
                os.kill(os.getpid(), signal.SIGINT)
                return real(trainer, output_dir)

            monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_with_a_signal)
        if before_training is not None:  # inside trainer.train(), before the training loop starts
            real_loader = Trainer.get_train_dataloader

            def loader(trainer):
                os.kill(os.getpid(), before_training)
                return real_loader(trainer)

            monkeypatch.setattr(Trainer, "get_train_dataloader", loader)


def test_a_second_ctrl_c_during_the_save_is_ignored_and_the_checkpoint_is_complete(tmp_path, monkeypatch,
                                                                                   capsys):
    out = str(tmp_path / "run")
    args = ["--max-steps", "4", "--output-dir", out, *TINY]
    with monkeypatch.context() as m:
        hooks = _Hooks(m, at_step=2, during_save=True)
        rc = main(args)
        assert hooks.saves == 1
    captured = capsys.readouterr()
    assert rc == 130, captured.err
    (line,) = own_lines(captured.err)
    ckpt = os.path.join(out, "checkpoint-2")
    assert f"after step 2 of 4: saved checkpoint {ckpt}; 1 more signal(s) ignored while saving" in line, line
    assert "Ctrl-C (SIGINT) again: ignored; the checkpoint is being saved" in captured.out
    assert outdir.check_checkpoint(ckpt, "lora") == 2  # the save ran to its end
    assert main(args + ["--resume", "latest"]) == 0
    got = records(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    ref = str(tmp_path / "ref")
    assert main(["--max-steps", "4", "--output-dir", ref, *TINY]) == 0
    for a, b in zip(got, records(ref)):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


def test_a_signal_before_the_first_step_leaves_the_directory_ready_for_the_same_command(tmp_path, monkeypatch,
                                                                                        capsys):
    out = str(tmp_path / "run")
    args = ["--max-steps", "2", "--output-dir", out, *TINY]
    with monkeypatch.context() as m:
        _Hooks(m, before_training=signal.SIGTERM)
        rc = main(args)
    err = capsys.readouterr().err
    assert rc == 143, err
    assert own_lines(err) == [f"deltafuse train: terminated; stopped before the first step: nothing was saved in "
                              f"{out!r}; run the same command again"]
    assert outdir.run_entries(out) == []  # its arguments file is gone: nothing blocks the rerun
    assert main(args) == 0 and [r["step"] for r in records(out)] == [1, 2]


def test_a_signal_during_overwrite_keeps_both_runs_and_the_resumed_run_completes_the_replacement(
        tmp_path, monkeypatch, capsys):
    b = str(tmp_path / "B")
    assert main(["--max-steps", "2", "--output-dir", b, *TINY]) == 0
    with open(os.path.join(b, "notes.txt"), "w") as fh:
        fh.write("mine")
    old = records(b)
    args = ["--overwrite", "--max-steps", "3", "--seed", "4", "--output-dir", b, *TINY]
    capsys.readouterr()
    with monkeypatch.context() as m:
        _Hooks(m, at_step=1)
        rc = main(args)
    err = capsys.readouterr().err
    aside = os.path.join(b, outdir.ASIDE)
    assert rc == 130, err
    (line,) = own_lines(err)
    assert f"saved checkpoint {os.path.join(b, 'checkpoint-1')}; the run --overwrite replaces is kept in {aside} " \
           "until this one finishes; continue with: " in line, line
    assert "--overwrite" not in line.split("continue with: ")[1] and line.endswith("--resume latest")
    assert records(aside) == old and os.path.isdir(os.path.join(aside, "final"))  # the previous run, intact
    assert sorted(os.listdir(b)) == [outdir.ASIDE, "checkpoint-1", "metrics.jsonl", "notes.txt", "train_args.json"]
    # the next run without --resume is told how to continue; with it, the replacement completes
    assert main(args) == 2
    assert "pass --resume latest to continue the run that replaced it" in capsys.readouterr().err
    assert main(args[1:] + ["--resume", "latest"]) == 0
    assert "is deleted now that this one has finished" in capsys.readouterr().out
    assert not os.path.exists(aside)
    assert [r["step"] for r in records(b)] == [1, 2, 3] and open(os.path.join(b, "notes.txt")).read() == "mine"


# --- what the next run says about each state a run can leave ------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("finished") / "run")
    assert main(["--max-steps", "2", "--save-every", "1", "--output-dir", out, *TINY]) == 0
    return out


@pytest.fixture
def no_model_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was built before the input was refused")

    monkeypatch.setattr(setup, "load_model_and_tokenizer", refuse)


def refused(argv, capsys) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = own_lines(err)
    assert len(lines) == 1 and lines[0].startswith("deltafuse train: error: "), err
    return lines[0]


def test_every_state_a_run_leaves_has_one_way_forward(finished, tmp_path, capsys, no_model_build):
    d = str(tmp_path / "d")
    shutil.copytree(finished, d)
    base = ["--max-steps", "2", "--output-dir", d, *TINY]
    c1, c2 = os.path.join(d, "checkpoint-1"), os.path.join(d, "checkpoint-2")

    line = refused(base, capsys)  # finished
    assert f"holds a finished run (final/, latest checkpoint {c2}); pass --overwrite to replace it, --resume " \
           "latest with a --max-steps above 2 to train it further" in line, line

    shutil.rmtree(os.path.join(d, "final"))  # stopped with a checkpoint (a signal, or a kill after a save)
    os.remove(os.path.join(d, "summary.json"))
    line = refused(base, capsys)
    assert f"holds an unfinished run (latest checkpoint {c2}, step 2); pass --resume latest to continue it" in line

    state2 = os.path.join(c2, "trainer_state.json")  # the Trainer writes the state last
    text = open(state2).read()
    # killed while saving: before the state was written (no file), or while it was (empty or cut short)
    for cut in (None, "", text[:len(text) // 2], '{"global_step": "2"}'):
        if cut is None:
            os.remove(state2)
        else:
            with open(state2, "w") as fh:
                fh.write(cut)
        line = refused(base, capsys)
        assert f"(latest checkpoint {c1}, step 1; checkpoint-2 has no complete trainer_state.json: a save cut off)" \
            in line, (cut, line)
        plan = outdir.plan_output_dir(d, overwrite=False, resume="latest")
        assert plan.resume_from == c1 and plan.skipped == ["checkpoint-2"], cut
        assert [p for _, p in outdir.checkpoints(d)] == [c1]

    for name in ("checkpoint-1", "checkpoint-2"):  # killed before any checkpoint: arguments and metrics only
        shutil.rmtree(os.path.join(d, name))
    line = refused(base, capsys)
    assert "holds a run that saved no complete checkpoint (metrics.jsonl, train_args.json): nothing to resume; " \
           "pass --overwrite to replace it" in line, line
    line = refused(base + ["--resume"], capsys)
    assert "nothing to resume; pass --overwrite instead of --resume to replace it" in line, line


def test_the_continue_command_is_the_given_one_with_resume_latest():
    cc = stopping.continue_command
    py = os.path.basename(sys.executable)
    py = py if shutil.which(py) == sys.executable else sys.executable
    main_py = os.path.join(ROOT, "deltafuse", "__main__.py")
    assert cc("o", argv=[main_py, "train", "--model", "tiny", "--overwrite", "--output-dir", "o"]) == \
        f"{shlex.quote(py)} -m deltafuse train --model tiny --output-dir o --resume latest"
    train_py = os.path.join(ROOT, "deltafuse", "train", "__main__.py")
    assert cc("runs/train", argv=[train_py, "--resume", "/x/checkpoint-3", "--lr", "1e-3"]) == \
        f"{shlex.quote(py)} -m deltafuse.train --lr 1e-3 --output-dir runs/train --resume latest"
    assert cc("my run", argv=["/usr/local/bin/deltafuse", "train", "--resume", "--output-dir=my run"]) == \
        "/usr/local/bin/deltafuse train '--output-dir=my run' --resume latest"


def test_a_killed_run_resumes_from_its_last_timed_checkpoint(tmp_path, straight):
    """SIGKILL gives no chance to save: --save-minutes (default 30) has saved along the way; here every ~2 s."""
    out = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "deltafuse", "train", *RUN, "--save-minutes", "0.0005",
                             "--output-dir", out], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.isfile(metrics) and open(metrics).read().count("\n") >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.kill()
    proc.wait(timeout=60)
    saved = outdir.checkpoints(out)
    # a complete checkpoint saved along the way (a kill during a later save leaves that one incomplete: skipped)
    assert saved and saved[-1][0] >= 1, os.listdir(out)
    assert main([*RUN, "--output-dir", out, "--resume", "latest"]) == 0
    got = records(out)
    assert [r["step"] for r in got] == list(range(1, 31))
    for a, b in zip(got, straight):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


def test_timed_saves_are_off_with_zero_and_not_taken_in_a_short_run(tmp_path):
    for minutes, want in (("0", 0), ("30", 0)):
        out = str(tmp_path / f"m{minutes}")
        assert main(["--max-steps", "3", "--save-minutes", minutes, "--output-dir", out, *TINY]) == 0
        with open(os.path.join(out, "summary.json")) as fh:
            s = json.load(fh)
        assert s["timed_saves"] == want and [os.path.basename(p) for p in s["checkpoints"]] == ["checkpoint-3"]
    out = str(tmp_path / "often")
    assert main(["--max-steps", "3", "--save-minutes", "1e-9", "--save-total-limit", "5", "--output-dir", out,
                 *TINY]) == 0
    with open(os.path.join(out, "summary.json")) as fh:
        s = json.load(fh)
    assert [os.path.basename(p) for p in s["checkpoints"]] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert s["timed_saves"] == 2  # steps 1 and 2; step 3 is the end's own save


def test_a_signal_while_the_final_output_is_written_waits_for_it(tmp_path, monkeypatch, capsys):
    from transformers import Trainer

    out = str(tmp_path / "run")
    real = Trainer.save_model

    def save_model(trainer, output_dir=None, *a, **k):
        if output_dir and output_dir.endswith("final"):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while final/ is being written
        return real(trainer, output_dir, *a, **k)

    monkeypatch.setattr(Trainer, "save_model", save_model)
    assert main(["--max-steps", "2", "--output-dir", out, *TINY]) == 0
    captured = capsys.readouterr()
    assert "SIGTERM: training is done; writing final/ and summary.json first" in captured.out
    assert "SIGTERM while the final output was written: it is complete" in captured.out
    assert os.path.isfile(os.path.join(out, "summary.json"))
    assert os.path.isfile(os.path.join(out, "final", "adapter_model.safetensors"))
