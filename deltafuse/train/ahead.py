"""`deltafuse train --compile-ahead`: the first step's Triton kernels compiled in parallel before it runs.

On an empty Triton cache the first step of a run compiles each kernel when it is first launched, one after
another. With compile-ahead the Trainer's first ``training_step`` first runs the same forward and backward on
the same batch once with every Triton launch compiled in a pool of threads instead of run
(``deltafuse.ops._compile_ahead``), drops the gradients that pass leaves, then runs the real step, which finds
its kernels compiled. The step's losses and gradients are those of a run without it.

``auto`` (the default) turns it on where it can help and is known to be safe: deltafuse on, a CUDA device, one
process. A stock run (``--no-deltafuse``) never compiles ahead. Several processes (DDP, FSDP, context
parallelism) would run the collectives of the throw-away pass too, so an explicit thread count there is
refused.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def workers_arg(text: str) -> int | str:
    """An argparse type: ``auto``, ``off`` (0) or a whole number of threads >= 1."""
    if text in ("auto", "off"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: auto, off, or a number of threads "
                                         ">= 1") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed: auto, off, or a number of threads >= 1")
    return "off" if value == 0 else value


def _cpus() -> int:
    from deltafuse.ops._compile_ahead import default_workers

    return default_workers()


def resolve(value, *, enabled: bool, device: str, world: int) -> int:
    """The number of compile threads for ``--compile-ahead VALUE`` (0: off), or a ValueError naming what is
    wrong with an explicit request."""
    if value in ("off", 0) or not enabled:  # a stock run (e.g. bench e2e's OFF run) has no kernels of ours
        return 0
    if value == "auto":
        return _cpus() if device.startswith("cuda") and world == 1 else 0
    if world > 1:
        raise ValueError(f"--compile-ahead {value} runs with one process only; this run has {world} (WORLD_SIZE); "
                         "allowed there: off or auto")
    return int(value)


def trainer_class(base, workers: int):
    """``base`` (a transformers Trainer class) whose first ``training_step`` compiles ahead in ``workers``
    threads; ``base`` itself when ``workers`` is 0."""
    if not workers:
        return base

    class CompileAheadTrainer(base):
        _deltafuse_ahead = None

        def training_step(self, model, inputs, *args, **kwargs):
            if self._deltafuse_ahead is None:
                self._deltafuse_ahead = _compile_first_step(self, model, inputs, workers)
            return super().training_step(model, inputs, *args, **kwargs)

    CompileAheadTrainer.__qualname__ = CompileAheadTrainer.__name__ = f"CompileAhead{base.__name__}"
    return CompileAheadTrainer


def _compile_first_step(trainer, model, inputs, workers: int):
    from deltafuse.ops._compile_ahead import compile_ahead

    def throw_away_step():
        # what Trainer.training_step does first, and the Trainer nowhere earlier: until then the base model's
        # modules are in eval mode as built or loaded (a PEFT model around them has only its own flag on), and in
        # eval mode the decoder layers skip gradient checkpointing: the pass held every layer's activations (moe8
        # LoRA on one 65,536-token sequence with --gradient-checkpointing, H200: 69.3 GiB against the steps' 26.7)
        model.train()
        batch = trainer._prepare_inputs(inputs)
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, batch)
        loss.backward()

    try:
        report = compile_ahead(throw_away_step, workers=workers)
    finally:
        # nothing has accumulated before the first step: every gradient there is the throw-away pass's
        model.zero_grad(set_to_none=True)
    if report.skipped:
        log.info("compile ahead: skipped (%s)", report.skipped)
    else:
        log.info("compile ahead: %d Triton kernels compiled in %.1f s on %d threads", report.compiled,
                 report.seconds, report.workers)
    return report
