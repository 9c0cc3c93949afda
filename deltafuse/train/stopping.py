"""Stopping a `deltafuse train` run by a signal without losing work.

SIGINT/SIGTERM while the Trainer trains: the current step finishes, the Trainer saves its own checkpoint-N, and the
run ends with ``Interrupted`` (one line: the step, the checkpoint, the command that continues the run exactly).
A signal before the training loop stops at once (``Signalled``); the run's first files are removed so the same
command runs again. ``--save-minutes`` adds timed saves (a kill without warning loses at most that long). Under
torchrun the ranks agree on the step to stop after.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

from deltafuse.train.outdir import OutputPlan, checkpoints


def is_main_process() -> bool:
    """Rank 0 of a torchrun/accelerate launch, or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a run; the message says what was kept. ``exit_code``: 128 + the signal."""

    def __init__(self, message: str = "", exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the training loop (loading, building): the run stops where it is."""

    def __init__(self, signum: int):
        super().__init__("")
        self.signum, self.exit_code = signum, 128 + signum


def signal_name(signum: int) -> str:
    import signal

    return {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}.get(signum, f"signal {signum}")


def _note(line: str) -> None:
    """A line on stdout from a signal handler (os.write: no buffered stream is re-entered)."""
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture): the stream then
        try:
            sys.stdout.write(line + "\n")
        except Exception:  # noqa: BLE001 - a signal handler must not raise for a report line
            pass


def make_stopper():
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        """SIGINT/SIGTERM during training: finish the step, have the Trainer save its own checkpoint-N (exactly
        resumable by --resume) and stop. Further signals are ignored until the run has exited (a second Ctrl-C
        cannot cut the save short). Outside the training loop a signal stops the run at once (``Signalled``).

        With ``save_minutes``, also a checkpoint after the first step that ends that long after the last save (a
        run killed without a chance to save, e.g. by the OOM killer, then loses at most that much).

        In a launch of several processes every rank gets the terminal's Ctrl-C, not necessarily between the same
        steps, and the ranks' clocks differ: the ranks agree (one max all-reduce of two flags per step) so they
        all save and stop after the same step.
        """

        def __init__(self, world: int = 1, main: bool = True, save_minutes: float = 0.0):
            self.world, self.main = world, main
            self.save_after_s = save_minutes * 60 if save_minutes else None
            self.last_save = time.monotonic()
            self.timed_saves = 0
            self.signum = None  # the signal that stops the run
            self.armed = False  # inside the training loop: defer
            self.stopped_at = None  # the step after which the run stopped for a signal
            self.saved = None  # the checkpoint saved then
            self.ignored = 0
            self.stopping = False  # a first signal came: the ones after it are ignored
            self.final = False  # writing the final output

        # --- the handler ------------------------------------------------------------------------------
        def handle(self, signum, frame):
            if self.stopping:
                self.ignored += 1
                if self.main and self.ignored == 1:
                    what = "the checkpoint is being saved" if self.signum is not None else "the run is stopping"
                    _note(f"deltafuse train: {signal_name(signum)} again: ignored; {what}, the run exits as soon "
                          "as it is done")
                return
            self.stopping = True
            if not self.armed:
                raise Signalled(signum)
            self.signum = signum
            if self.main and self.final:
                _note(f"deltafuse train: {signal_name(signum)}: training is done; writing final/ and summary.json "
                      "first (another Ctrl-C is ignored until they are written)")
            elif self.main:
                _note(f"deltafuse train: {signal_name(signum)}: finishing the current step, then saving a "
                      "checkpoint and exiting (another Ctrl-C is ignored until the checkpoint is written)")

        @contextlib.contextmanager
        def finishing(self):
            """Signals wait while the body writes the run's final output (final/, summary.json stay whole)."""
            self.armed = self.final = True
            try:
                yield
            finally:
                self.armed = False

        @contextlib.contextmanager
        def installed(self):
            """The handler for SIGINT and SIGTERM while the body runs (main thread only), the old ones after."""
            import signal
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)

        # --- the Trainer's events ---------------------------------------------------------------------
        def on_train_begin(self, args, state, control, **kw):
            self.armed = True
            self.last_save = time.monotonic()

        def _agreed(self, args) -> tuple[bool, bool]:
            """(stop, save): a signal came / the save interval has passed, on any rank."""
            stop = self.signum is not None
            due = self.save_after_s is not None and time.monotonic() - self.last_save >= self.save_after_s
            if self.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
                flags = torch.tensor([int(stop), int(due)], device=args.device)
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
                stop, due = (bool(v) for v in flags.tolist())
                if stop and self.signum is None:  # another rank was signalled: this one stops with it
                    import signal

                    self.signum = signal.SIGINT
            return stop, due

        def on_step_end(self, args, state, control, **kw):
            stop, due = self._agreed(args)
            if stop and self.stopped_at is None:
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
            elif due and not control.should_save:
                control.should_save = True
                self.timed_saves += 1

        def on_save(self, args, state, control, **kw):
            self.last_save = time.monotonic()
            if self.stopped_at is not None and state.global_step == self.stopped_at:
                self.saved = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

        def on_train_end(self, args, state, control, **kw):
            self.armed = False

    return StopOnSignal


def stopped_by_signal(args, stopper, plan: OutputPlan, world: int) -> Interrupted:
    """The one line of a run stopped by a signal after saving its checkpoint (kept, also under --overwrite)."""
    from deltafuse.train.outdir import ASIDE

    step = stopper.stopped_at
    found = checkpoints(args.output_dir)
    ckpt = stopper.saved or (found[-1][1] if found else None)
    text = f"{signal_name(stopper.signum)} after step {step} of {args.max_steps}: saved checkpoint {ckpt}"
    if plan.replace or plan.aside_left:
        text += (f"; the run --overwrite replaces is kept in {os.path.join(args.output_dir, ASIDE)} until this "
                 "one finishes")
    if stopper.ignored:
        text += f"; {stopper.ignored} more signal(s) ignored while saving"
    text += f"; continue with: {continue_command(args.output_dir, world)}"
    exc = Interrupted(text, exit_code=128 + stopper.signum)
    exc.keep_new_run = True
    return exc


def continue_command(output_dir: str, world: int = 1, argv: list[str] | None = None) -> str:
    """The command line that continues this run: the one given, without --overwrite/--resume, with
    ``--resume latest`` and --output-dir."""
    import shlex
    import shutil

    argv = list(sys.argv if argv is None else argv)
    prog, rest = (argv[0] if argv else ""), argv[1:]
    parts = os.path.normpath(os.path.abspath(prog)).split(os.sep) if prog else []
    py = os.path.basename(sys.executable)
    py = py if shutil.which(py) == sys.executable else sys.executable
    if parts[-2:] == ["deltafuse", "__main__.py"]:
        head = [py, "-m", "deltafuse"]
    elif parts[-3:] == ["deltafuse", "train", "__main__.py"]:
        head = [py, "-m", "deltafuse.train"]
    elif os.path.basename(prog) == "deltafuse":
        head = ["deltafuse" if shutil.which("deltafuse") == os.path.abspath(prog) else prog]
    else:  # called as a library: the arguments are not this process's command line
        head, rest = ["deltafuse", "train", "..."], []
    kept, skip = [], False
    for i, tok in enumerate(rest):
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if len(name) > 4 and "--overwrite".startswith(name):
            continue
        if len(name) > 4 and "--resume".startswith(name):
            skip = "=" not in tok and i + 1 < len(rest) and not rest[i + 1].startswith("-")
            continue
        kept.append(tok)
    if not any(t.split("=", 1)[0] in ("--output-dir", "--output_dir") for t in kept):
        kept += ["--output-dir", output_dir]
    line = shlex.join(head + kept + ["--resume", "latest"])
    if world > 1:
        return f"the same launch (torchrun/accelerate, {world} processes) of {line.split(' -m ', 1)[-1]}"
    return line


@contextlib.contextmanager
def say_what_was_kept(output_dir: str, replacing_a_run: bool, max_steps: int | None = None):
    """Turn Ctrl-C into ``Interrupted`` saying what --output-dir holds now (entered before ``replacing``).

    A run stopped before its first checkpoint leaves nothing to resume: what it wrote (its arguments, an
    empty metrics file) is removed, so nothing of it blocks the same command from running again."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted):
            raise
        code = getattr(exc, "exit_code", 130)
        if replacing_a_run:
            kept = f"the previous run in {output_dir!r} is restored as it was; this run's partial output was removed"
        else:
            found = checkpoints(output_dir)
            if found and max_steps is not None and found[-1][0] >= max_steps:  # in the final evaluation
                kept = (f"training had reached --max-steps {max_steps}: {found[-1][1]} holds the trained weights; "
                        "final/ and summary.json were not written")
            elif found:
                kept = (f"checkpoints so far are in {output_dir!r} (latest {found[-1][1]}); continue with: "
                        f"{continue_command(output_dir)}")
            else:
                from deltafuse.train.outdir import remove_partial_run

                if is_main_process():  # the one writer of the run's files
                    remove_partial_run(output_dir)
                kept = (f"stopped before the first step: nothing was saved in {output_dir!r}; run the same "
                        "command again")
        raise Interrupted(kept, exit_code=code) from exc
