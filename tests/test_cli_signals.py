"""Ctrl-C (SIGINT) and SIGTERM at any point of a `deltafuse` command: one line on stderr, exit 130 / 143, no
traceback; the same for the `python -m` entry points and the training processes `bench e2e` starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from deltafuse import cli
from tests.helpers import clean_subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `python -m MODULE ARGS` in this process after arranging that SIGNAL is sent to it when MODULE_TRIPPED
# starts being imported: the signal arrives in the middle of that import, as a Ctrl-C does.
_TRIP = """
import os, runpy, signal, sys
module, tripped, signum = sys.argv[1], sys.argv[2], getattr(signal, sys.argv[3])

class Trip:
    def find_spec(self, name, path=None, target=None):
        if name == tripped:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signum)
        return None

sys.meta_path.insert(0, Trip())
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _env() -> dict:
    return clean_subprocess_env()


def _as_from_a_terminal() -> None:
    """The child starts with SIGINT at its default, as a terminal's foreground command does (Python then turns it
    into KeyboardInterrupt). A test run started as a background job of a non-interactive shell has SIGINT ignored,
    and its children would inherit that: every Ctrl-C case below then ran to the end with exit 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tripped(module: str, tripped: str, signame: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _TRIP, module, tripped, signame, *argv], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600, preexec_fn=_as_from_a_terminal)


def _stop_line(err: str) -> str:
    """The one line an interruption printed: no traceback, nothing after it, and only one such line."""
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    stops = [x for x in lines if x.endswith(("interrupted", "terminated")) or ": interrupted; " in x]
    assert len(stops) == 1 and lines[-1] == stops[0], err
    return stops[0]


@pytest.mark.parametrize("module, tripped, argv, line", [
    # while the arguments are checked: TrainingArguments' names come from transformers
    ("deltafuse", "transformers", ["train", "--gradient_accumulation_steps", "1", "--output-dir", "{tmp}/o"],
     "deltafuse train: interrupted"),
    ("deltafuse", "torch", ["info"], "deltafuse info: interrupted"),
    # building the model
    ("deltafuse", "transformers", ["verify", "--model", "tiny"], "deltafuse verify: interrupted"),
    ("deltafuse.verify", "transformers", ["--model", "tiny"], "deltafuse verify: interrupted"),
    ("deltafuse.bench", "torch", ["ops", "--op", "swiglu"], "deltafuse bench ops: interrupted"),
    # the OFF run of `bench e2e` (its peer entry), setting up its training
    ("deltafuse.bench.peers", "transformers", ["--run", "off", "--report", "{tmp}/r.json", "--",
                                               "--output-dir", "{tmp}/o", "--max-steps", "1"],
     "deltafuse train: interrupted"),
])
def test_ctrl_c_while_importing_is_one_line_and_130(module, tripped, argv, line, tmp_path):
    proc = _tripped(module, tripped, "SIGINT", *[a.format(tmp=tmp_path) for a in argv])
    assert proc.returncode == 130, proc.stderr
    assert _stop_line(proc.stderr) == line
    assert not (tmp_path / "o").exists()


TRAIN = ["--max-steps", "1", "--seq-len", "256", "--num-examples", "8", "--no-progress"]


@pytest.mark.parametrize("signame, code, line", [("SIGINT", 130, "deltafuse train: interrupted"),
                                                 ("SIGTERM", 143, "deltafuse train: terminated")])
def test_a_signal_while_the_model_is_built_is_one_line(signame, code, line, tmp_path):
    """`python -m deltafuse.train` (what `bench e2e` starts for its ON run), stopped while it builds the model
    (the tiny models' tokenizer module is imported then)."""
    proc = _tripped("deltafuse.train", "deltafuse.train.tokenizer", signame, "--output-dir", str(tmp_path / "o"),
                    *TRAIN)
    assert proc.returncode == code, proc.stderr
    assert _stop_line(proc.stderr) == line
    assert not (tmp_path / "o").exists()


def test_sigterm_while_importing_is_one_line_and_143():
    proc = _tripped("deltafuse", "torch", "SIGTERM", "info")
    assert proc.returncode == 143 and _stop_line(proc.stderr) == "deltafuse info: terminated"


@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")])
def test_a_signal_while_benchmarking_is_one_line(signum, code, word):
    """A real signal from outside once the benchmark has printed its first timing, while it times the next."""
    proc = subprocess.Popen([sys.executable, "-m", "deltafuse", "bench", "ops", "--device", "cpu", "--op", "swiglu",
                             "--op", "rms_norm_gated", "--reps", "20000"], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_terminal)
    try:
        first = proc.stdout.readline()
        assert first.startswith("swiglu "), first
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert _stop_line(err) == f"deltafuse bench ops: {word}"
    assert "| rms_norm_gated" not in out  # it stopped there: no table


# --- in this process: the handler passes a command's own line through and leaves the process as it was ------
def test_an_interruption_keeps_what_it_says(monkeypatch, capsys):
    from deltafuse.bench import e2e

    def interrupted(args):
        raise KeyboardInterrupt("the previous benchmark in 'b' is restored as it was")

    monkeypatch.setattr(e2e, "run_e2e", interrupted)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert cli.main(["bench", "e2e", "--output-dir", "b"]) == 130
    err = capsys.readouterr().err
    assert err == "deltafuse bench e2e: interrupted; the previous benchmark in 'b' is restored as it was\n"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_the_training_commands_own_interruption_line_is_not_replaced(monkeypatch, capsys):
    from deltafuse.train import stopping, trainer

    def interrupted(args):
        raise stopping.Interrupted("checkpoints so far are in 'o' (latest checkpoint-3); --resume continues")

    monkeypatch.setattr(trainer, "train", interrupted)
    assert cli.main(["train", "--output-dir", "o"]) == 130
    assert capsys.readouterr().err == ("deltafuse train: interrupted; checkpoints so far are in 'o' (latest "
                                       "checkpoint-3); --resume continues\n")


def test_sigterm_raises_terminated_inside_a_command(monkeypatch, capsys):
    """SIGTERM is an exception where the command is (so its clean-up runs), then one line and 143."""
    cleaned = []

    def body():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between two bytecodes
                pass
        finally:
            cleaned.append(True)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert cli.guarded("deltafuse bench ops", body) == 143
    assert cleaned == [True]
    assert capsys.readouterr().err == "deltafuse bench ops: terminated\n"
    assert signal.getsignal(signal.SIGTERM) == before
