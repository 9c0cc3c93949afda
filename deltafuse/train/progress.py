"""What a `deltafuse train` run shows and records while it trains, on transformers' Trainer callbacks.

* The progress bars are transformers' own ``ProgressCallback`` (training steps, evaluation batches, rank 0 only),
  on when ``--progress`` turns the Trainer's ``disable_tqdm`` off; ``ProgressBar`` only keeps it from writing
  every per-step log dict above the bar (the step's loss is shown beside it).
* The Trainer logs every step (``logging_steps=1``: its loss, grad norm and learning rate); ``StepLogger`` adds
  the fields it has not got (step time, tokens of the step, wall clock, peak memory), appends the step's record
  to metrics.jsonl, and prints a line every ``--log-every`` steps with the means of the steps since the last one.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch

log = logging.getLogger(__name__)  # what a run reports; `deltafuse train` prints it on stdout


def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, what was measured): CUDA's peak allocated memory, or the process's peak RSS on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device))), "cuda max allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def make_progress_bar():
    """transformers' ``ProgressCallback`` with the step's loss beside the bar instead of each log dict above it."""
    from transformers import ProgressCallback

    class ProgressBar(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if self.training_bar is not None and logs and "loss" in logs:
                self.training_bar.set_postfix(loss=f"{float(logs['loss']):.4f}", refresh=False)

    return ProgressBar


def make_step_logger():
    """The ``StepLogger`` class (transformers is imported when it is made)."""
    from transformers import TrainerCallback

    class StepLogger(TrainerCallback):
        """Per-step record (the Trainer's loss, grad norm and lr; step time, tokens, wall clock, peak memory) in
        metrics.jsonl, and a line every ``log_every`` steps; above the progress bar when ``progress``."""

        def __init__(self, *, device: str, log_every: int, metrics_path: str, progress: bool, max_steps: int,
                     history: list[dict] = ()):
            self.device, self.log_every, self.metrics_path = device, log_every, metrics_path
            self.history = list(history)  # the records of the resumed run up to its checkpoint
            self.progress, self.max_steps = progress, max_steps
            self.window: list[dict] = []
            self.records: list[dict] = []
            self.evals: list[dict] = []
            self._t_step = self._tokens0 = None
            self._pending: dict = {}

        def _sync(self):
            if self.device.startswith("cuda"):
                torch.cuda.synchronize(torch.device(self.device))

        def _show(self, line: str) -> None:
            if self.progress:  # above the Trainer's bar, which is drawn on stderr
                from tqdm.auto import tqdm

                tqdm.write(line, file=sys.stdout)
            else:
                log.info(line)

        def on_train_begin(self, args, state, control, **kw):
            if self.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(torch.device(self.device))
            self.t0 = time.perf_counter()
            if state.is_world_process_zero:  # here, once the checkpoint (if any) has loaded: start the file
                with open(self.metrics_path, "w") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in self.history)

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self._t_step = time.perf_counter()
            self._tokens0 = state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            now = time.perf_counter()
            mem, _ = peak_memory(self.device)
            self._pending = {"step": state.global_step, "step_time_s": now - self._t_step,
                             "wall_s": now - self.t0, "tokens": int(state.num_input_tokens_seen - self._tokens0),
                             "peak_mem_bytes": mem}

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs or self._pending.get("step") != state.global_step:
                return
            rec = dict(self._pending)
            rec["loss"] = float(logs["loss"])
            rec["grad_norm"] = float(logs["grad_norm"]) if logs.get("grad_norm") is not None else float("nan")
            rec["lr"] = float(logs.get("learning_rate", float("nan")))
            self._pending = {}
            if not state.is_world_process_zero:
                return
            self.records.append(rec)
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            self.window.append(rec)
            if rec["step"] % self.log_every == 0 or rec["step"] == self.max_steps:
                self._print_window()

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            if not metrics or not state.is_world_process_zero:
                return
            rec = {"step": state.global_step, **{k: float(v) for k, v in metrics.items()
                                                  if isinstance(v, (int, float))}}
            self.evals.append(rec)
            self._show(f"eval at step {rec['step']} | loss {rec.get('eval_loss', float('nan')):.4f}")

        def _print_window(self):
            w, self.window = self.window, []
            time_s = sum(r["step_time_s"] for r in w)
            tokens = sum(r["tokens"] for r in w)
            self._show(f"step {w[-1]['step']:>{len(str(self.max_steps))}}/{self.max_steps}"
                       f" | loss {sum(r['loss'] for r in w) / len(w):.4f}"
                       f" | grad norm {sum(r['grad_norm'] for r in w) / len(w):.4f}"
                       f" | {tokens / time_s if time_s > 0 else float('nan'):,.0f} tok/s"
                       f" | step {time_s / len(w):.3f} s"
                       f" | peak mem {fmt_bytes(w[-1]['peak_mem_bytes'])}")

        def on_train_end(self, args, state, control, **kw):
            if self.window and state.is_world_process_zero:
                self._print_window()

    return StepLogger


def install(trainer) -> None:
    """The Trainer's bars as ``ProgressBar`` where its arguments turn them on (``disable_tqdm`` off), and no
    ``PrinterCallback`` (its ``disable_tqdm`` case): each would repeat every step's log dict, which
    ``StepLogger`` records and summarises."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(make_progress_bar())
