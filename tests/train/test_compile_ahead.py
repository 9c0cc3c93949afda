"""`deltafuse train --compile-ahead`: where it turns on, what it refuses, and on a GPU that the throw-away pass
leaves the training exactly as it is without it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deltafuse.train import ahead
from deltafuse.train.cli import main
from tests.helpers import gpu, needs_cuda
from tests.train.test_train_run import records


def test_auto_turns_on_for_deltafuse_on_one_cuda_process_only(monkeypatch):
    monkeypatch.setattr(ahead, "_cpus", lambda: 12)
    assert ahead.resolve("auto", enabled=True, device="cuda", world=1) == 12
    assert ahead.resolve("auto", enabled=True, device="cuda:1", world=1) == 12
    assert ahead.resolve("auto", enabled=True, device="cpu", world=1) == 0
    assert ahead.resolve("auto", enabled=True, device="cuda", world=2) == 0
    assert ahead.resolve("auto", enabled=False, device="cuda", world=1) == 0
    assert ahead.resolve(3, enabled=False, device="cuda", world=1) == 0  # a stock run has no kernels of ours
    assert ahead.resolve("off", enabled=True, device="cuda", world=1) == 0
    assert ahead.resolve(3, enabled=True, device="cpu", world=1) == 3  # asked for: the interpreter skips it


def test_threads_with_several_processes_are_refused_in_one_line(monkeypatch, capsys, tmp_path):
    with pytest.raises(ValueError, match=r"^--compile-ahead 4 runs with one process only; this run has 2 "
                                         r"\(WORLD_SIZE\); allowed there: off or auto$"):
        ahead.resolve(4, enabled=True, device="cuda", world=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    assert main(["--compile-ahead", "4", "--output-dir", str(out), "--deltafuse"]) == 2
    err = capsys.readouterr().err
    assert "deltafuse train: error: --compile-ahead 4 runs with one process only" in err and "Traceback" not in err
    assert not out.exists()


def test_argument_values():
    assert ahead.workers_arg("auto") == "auto" and ahead.workers_arg("off") == "off"
    assert ahead.workers_arg("0") == "off" and ahead.workers_arg("7") == 7


def test_off_leaves_the_trainer_class_as_it_is():
    class Base:
        pass

    assert ahead.trainer_class(Base, 0) is Base
    sub = ahead.trainer_class(Base, 2)
    assert issubclass(sub, Base) and sub.__name__ == "CompileAheadBase"


def test_the_throw_away_pass_runs_every_module_in_training_mode(monkeypatch):
    """The pass runs the model as Trainer.training_step does, every module in training mode. A PEFT model arrives
    with its own flag on and the base model's modules still in eval mode (as built or loaded), and in eval mode
    the decoder layers skip gradient checkpointing: the pass then held every layer's activations (moe8 LoRA on one
    65,536-token sequence on the H200: 69.3 GiB against the training steps' 26.7). Its gradients are dropped."""
    from deltafuse.ops import _compile_ahead

    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    model.training = True  # the wrapper's flag only, as a PEFT model built around an eval-mode base has it
    seen = []

    class Trainer:
        def _prepare_inputs(self, inputs):
            return inputs

        def compute_loss_context_manager(self):
            return contextlib.nullcontext()

        def compute_loss(self, model, batch):
            seen.append([m.training for m in model.modules()])
            return model(batch["x"]).square().sum()

    def run_step(step, workers):
        step()
        assert model[0].weight.grad is not None  # the pass ran forward and backward
        return _compile_ahead.AheadReport(0, 0, 0.0, workers)

    monkeypatch.setattr(_compile_ahead, "compile_ahead", run_step)
    ahead._compile_first_step(Trainer(), model, {"x": torch.randn(4, 3)}, 2)
    assert seen == [[True, True]] and model[0].weight.grad is None


@gpu
@needs_cuda
def test_gpu_training_with_compile_ahead_equals_training_without(tmp_path, capsys):
    from tests.ops.test_compile_ahead import _forget_compiled

    args = ["--model", "tiny", "--max-steps", "3", "--seq-len", "512", "--num-examples", "40", "--log-every", "1",
            "--no-progress", "--deltafuse", "--dtype", "bf16"]
    assert main([*args, "--compile-ahead", "off", "--output-dir", str(tmp_path / "off")]) == 0
    _forget_compiled()
    assert main([*args, "--compile-ahead", "4", "--output-dir", str(tmp_path / "ahead")]) == 0
    text = capsys.readouterr().out
    assert "compile ahead: " in text and "Triton kernels compiled in" in text, text
    off, on = records(tmp_path / "off"), records(tmp_path / "ahead")
    for a, b in zip(off, on):  # a gradient of the throw-away pass left behind would change step 1's norm
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * a["loss"], (a, b)
    assert len(off) == len(on) == 3
