"""The output directory of `deltafuse train`: checked up front, never mixed from two runs, replaced safely.

``plan_output_dir`` looks at --output-dir, --overwrite and --resume and changes nothing: it refuses (with a
``TrainInputError`` naming the argument, the value and what is allowed) a directory that cannot be written,
a directory holding another run that this one would write into, and a checkpoint that cannot be resumed
exactly (unreadable ``trainer_state.json``, missing weights, optimizer or scheduler state). It returns what
the run will do: the checkpoint, the metric records kept from the checkpoint's run, and the entries of a
previous run that --overwrite replaces.

``replacing`` is where a previous run goes away: only once the new run is ready to write (inputs validated,
model built), its entries are moved into a hidden folder inside --output-dir; they are deleted when the new
run has finished, and put back (the new run's partial output removed) when it fails or is interrupted.
A folder left behind by a killed process is reported by the next run, never silently deleted.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

from deltafuse.train import jsonfile
from deltafuse.train.errors import TrainInputError

ARTIFACTS = ("final", "metrics.jsonl", "summary.json", "train_args.json")
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
ASIDE = ".deltafuse-replaced-run"  # a previous run set aside by --overwrite while the new one runs
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _state_is_complete(checkpoint: str) -> bool:
    """The checkpoint's trainer_state.json exists and holds an integer global_step.

    The Trainer writes that file last, so a save cut off before it leaves none, and a kill while it is being
    written leaves it empty or truncated: either way the checkpoint is incomplete.
    """
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    step = state.get("global_step") if isinstance(state, dict) else None
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint-N folders holding a complete trainer_state.json, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = CHECKPOINT_RE.match(name)
        if m and _state_is_complete(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def run_entries(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that belong to a training run (checkpoint-N, final, metrics, summary, args)."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if CHECKPOINT_RE.match(n) or n in ARTIFACTS]
    return sorted(names, key=lambda n: (not CHECKPOINT_RE.match(n), int(n.split("-")[1]) if CHECKPOINT_RE.match(n)
                                        else 0, n))


def check_writable(output_dir: str) -> None:
    """--output-dir is a directory (or can be made one) this process can write to."""
    if not output_dir:
        raise TrainInputError("--output-dir '' is empty; pass a directory path")
    path = os.path.abspath(output_dir)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        if probe == path:
            raise TrainInputError(f"--output-dir {output_dir!r} is a file; pass a directory")
        raise TrainInputError(f"--output-dir {output_dir!r} cannot be created: {probe!r} is a file, not a "
                              "directory; pass a directory path")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".deltafuse-write-test-"):
            pass
    except OSError as exc:
        where = "it" if probe == path else f"{probe!r}, where it would be created,"
        raise TrainInputError(f"--output-dir {output_dir!r} is not writable: {where} refuses new files "
                              f"({exc.strerror or exc}); pass a directory you can write to") from None


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file cannot be opened (header and size checked; no tensor is read), or None."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            fh.keys()
    except ImportError:
        return None
    except Exception as exc:  # safetensors raises its own error types for a truncated or foreign file
        return f"{os.path.basename(path)} cannot be read as safetensors ({str(exc).splitlines()[0][:120]})"
    return None


def weights_problem(path: str, files: list[str]) -> str | None:
    for name in files:
        full = os.path.join(path, name)
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(full)
            if problem:
                return problem
        elif name.endswith(".index.json"):
            try:
                with open(full) as fh:
                    shards = set(json.load(fh)["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"{name} is not a readable weight index"
            missing = sorted(s for s in shards if not os.path.isfile(os.path.join(path, s)))
            if missing:
                return f"{name} lists {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} missing"
    return None


def check_checkpoint(path: str, mode: str) -> int:
    """The step of a checkpoint that can be resumed exactly in ``mode`` ('lora' or 'full'); else TrainInputError."""
    flag = f"--resume {path!r}"
    if not os.path.exists(path):
        raise TrainInputError(f"{flag}: no such directory; checkpoints are the checkpoint-N folders inside "
                              "--output-dir")
    if not os.path.isdir(path):
        raise TrainInputError(f"{flag} is a file; pass a checkpoint-N folder")
    state_path = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state_path):
        raise TrainInputError(f"{flag} is not a checkpoint directory (no trainer_state.json); checkpoints are the "
                              "checkpoint-N folders inside --output-dir")
    try:
        with open(state_path, encoding="utf-8") as fh:
            state = json.load(fh)
    except json.JSONDecodeError as exc:
        raise TrainInputError(f"{flag}: {state_path} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                              f"{exc.colno}); the checkpoint is damaged (an interrupted save?); resume from an "
                              "earlier checkpoint-N") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainInputError(f"{flag}: {state_path} cannot be read ({exc})") from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise TrainInputError(f"{flag}: {state_path} has no integer global_step (found {step!r}); the checkpoint "
                              "is damaged; resume from an earlier checkpoint-N")
    names = os.listdir(path)
    adapter = [n for n in ADAPTER_WEIGHTS if n in names]
    model = [n for n in MODEL_WEIGHTS if n in names] + [n for n in names if n.startswith("pytorch_model_fsdp")]
    if mode == "lora" and not adapter:
        if model:
            raise TrainInputError(f"{flag} holds full-model weights ({model[0]}) and no LoRA adapter; it was saved "
                                  "by a --full run: resume it with --full")
        raise TrainInputError(f"{flag} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)}); the checkpoint "
                              "is incomplete; resume from another checkpoint-N")
    if mode == "full" and not model:
        if adapter:
            raise TrainInputError(f"{flag} holds LoRA adapter weights ({adapter[0]}), not a full model; it was "
                                  "saved by a LoRA run: resume it without --full")
        raise TrainInputError(f"{flag} has no model weights ({' or '.join(MODEL_WEIGHTS)}); the checkpoint is "
                              "incomplete; resume from another checkpoint-N")
    problem = weights_problem(path, adapter if mode == "lora" else model)
    if problem:
        raise TrainInputError(f"{flag}: {problem}; the checkpoint is damaged; resume from another checkpoint-N")
    has_optimizer = (any(n in names for n in ("optimizer.pt", "optimizer.bin"))
                     or glob.glob(os.path.join(path, "optimizer.pt_*"))
                     or glob.glob(os.path.join(path, "rank*-of-*-optimizer.pt"))
                     or any(n.startswith("optimizer") and os.path.isdir(os.path.join(path, n)) for n in names))
    if not has_optimizer:
        raise TrainInputError(f"{flag} has no optimizer state (optimizer.pt): resuming would restart the "
                              "optimizer instead of continuing the run; resume from a complete checkpoint-N")
    if "scheduler.pt" not in names:
        raise TrainInputError(f"{flag} has no learning-rate scheduler state (scheduler.pt): resuming would "
                              "restart the schedule; resume from a complete checkpoint-N")
    return step


def read_metrics(path: str) -> list[dict]:
    """The per-step records of a metrics.jsonl (none if it does not exist); a bad line is a TrainInputError."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                    raise ValueError("no integer 'step'")
            except ValueError as exc:
                raise TrainInputError(f"{path} line {lineno} is not a metrics record ({exc}); the run's history "
                                      "cannot be continued; move the file away to resume without it") from None
            records.append(rec)
    return records


@dataclass
class OutputPlan:
    """What a run does with --output-dir (decided before anything is written)."""

    output_dir: str
    resume_from: str | None = None  # the checkpoint to resume
    resume_step: int = 0
    source_run: str | None = None  # the run directory that checkpoint belongs to
    in_place: bool = False  # the checkpoint is one of --output-dir's own
    history: list = field(default_factory=list)  # metric records of the checkpoint's run, up to its step
    replace: list = field(default_factory=list)  # a previous run's entries that --overwrite replaces
    aside_left: bool = False  # a run that an interrupted --overwrite set aside: deleted when this run finishes
    skipped: list = field(default_factory=list)  # incomplete checkpoint-N folders past the one resumed


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _listing(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def plan_output_dir(output_dir: str, *, overwrite: bool, resume: str | None, mode: str = "lora",
                    main: bool = True) -> OutputPlan:
    """Check --output-dir against --overwrite/--resume; changes nothing (see the module docstring).

    Only the main process checks what the directory holds (the others would see what it starts writing).
    """
    check_writable(output_dir)
    aside = os.path.join(output_dir, ASIDE)
    aside_left = main and os.path.exists(aside)
    found = checkpoints(output_dir)
    if aside_left and not (resume is not None and not overwrite and found
                           and (resume == "latest" or _same_dir(os.path.dirname(os.path.abspath(resume)),
                                                                output_dir))):
        cont = (f"pass --resume latest to continue the run that replaced it (latest {found[-1][1]}; the folder "
                "is deleted when that run finishes), or " if found else "")
        raise TrainInputError(f"--output-dir {output_dir!r} holds {aside!r}, a previous run that an interrupted "
                              f"--overwrite set aside; {cont}move its contents back into {output_dir!r} to keep "
                              "that run, or delete the folder, then run again")
    entries = run_entries(output_dir)
    occupied = main and os.path.isdir(output_dir) and bool(os.listdir(output_dir))
    if resume is None:
        if occupied and not overwrite:
            raise TrainInputError(describe_occupied(output_dir))
        return OutputPlan(output_dir, replace=entries if overwrite and main else [])

    if resume == "latest":
        if overwrite:
            raise TrainInputError("--resume and --overwrite contradict each other: resuming keeps the previous "
                                  "run, overwriting deletes it; pass one of them")
        if not found:
            if entries:
                raise TrainInputError(f"--resume: --output-dir {output_dir!r} holds a run that saved no complete "
                                      f"checkpoint ({_listing(entries)}{_incomplete_note(output_dir)}): nothing to "
                                      "resume; pass --overwrite instead of --resume to replace it, or choose "
                                      "another directory")
            raise TrainInputError(f"--resume: --output-dir {output_dir!r} has no checkpoint-N folder to resume "
                                  "from; start a new run without --resume")
        checkpoint = found[-1][1]
    else:
        checkpoint = resume.rstrip(os.sep) or resume
    source = os.path.dirname(os.path.abspath(checkpoint))
    in_place = _same_dir(source, output_dir)
    if in_place and overwrite:
        raise TrainInputError(f"--resume {resume!r} is a checkpoint of --output-dir {output_dir!r}, whose run "
                              "--overwrite would replace; resume without --overwrite, or start afresh without "
                              "--resume")
    step = check_checkpoint(checkpoint, mode)
    if not in_place and occupied and not overwrite:
        held = _listing(entries) if entries else _listing(sorted(os.listdir(output_dir)))
        raise TrainInputError(f"--output-dir {output_dir!r} holds another run ({held}) and --resume {resume!r} "
                              f"is a checkpoint of {source!r}; continuing there would mix the two runs; pass a "
                              f"new or empty --output-dir, or --overwrite to replace what {output_dir!r} holds")
    history = [r for r in read_metrics(os.path.join(source, "metrics.jsonl")) if r["step"] <= step]
    return OutputPlan(output_dir, resume_from=checkpoint, resume_step=step, source_run=source, in_place=in_place,
                      history=history, replace=entries if (overwrite and main and not in_place) else [],
                      aside_left=aside_left, skipped=_incomplete(output_dir, after=step) if in_place else [])


def check_resume_compatible(args, plan: OutputPlan) -> None:
    """The checkpoint is below --max-steps and its run was trained with the settings this run asks for."""
    step, checkpoint = plan.resume_step, plan.resume_from
    if step >= args.max_steps:
        raise TrainInputError(f"--resume: {checkpoint!r} is at step {step}, which is not below --max-steps "
                              f"{args.max_steps}; raise --max-steps to train further")
    saved_path = os.path.join(plan.source_run, "train_args.json")
    if not os.path.isfile(saved_path):
        return
    try:
        saved = jsonfile.read_object(saved_path)
    except (OSError, ValueError) as exc:
        raise TrainInputError(f"--resume {checkpoint!r}: {saved_path} (the settings of its run) cannot be read "
                              f"({exc}); the run directory is damaged") from None
    for key in ("model", "mode", "lora_r", "lora_targets", "lora_mlp", "lora_experts"):
        if key in saved and str(saved[key]) != str(getattr(args, key, None)):
            flag = "--" + key.replace("_", "-")
            raise TrainInputError(f"--resume: the checkpoint was trained with {flag} {saved[key]!r}, this run asks "
                                  f"for {getattr(args, key, None)!r}; resume with the same setting")


def _incomplete(output_dir: str, after: int = -1) -> list[str]:
    """checkpoint-N folders without a complete trainer_state.json (the Trainer writes it last: a save cut off)."""
    if not os.path.isdir(output_dir):
        return []
    out = []
    for name in os.listdir(output_dir):
        m = CHECKPOINT_RE.match(name)
        if m and int(m.group(1)) > after and not _state_is_complete(os.path.join(output_dir, name)):
            out.append((int(m.group(1)), name))
    return [n for _, n in sorted(out)]


def _incomplete_note(output_dir: str) -> str:
    cut = _incomplete(output_dir)
    if not cut:
        return ""
    return f"; {', '.join(cut)} {'has' if len(cut) == 1 else 'have'} no complete trainer_state.json: a save cut off"


def describe_occupied(output_dir: str) -> str:
    """The refusal of a run into a non-empty --output-dir: what it holds, and the one way forward for that."""
    found, entries = checkpoints(output_dir), run_entries(output_dir)
    d = f"--output-dir {output_dir!r}"
    if found and "final" in entries:
        step, path = found[-1]
        return (f"{d} holds a finished run (final/, latest checkpoint {path}); pass --overwrite to replace it, "
                f"--resume latest with a --max-steps above {step} to train it further, or choose another directory")
    if found:
        step, path = found[-1]
        return (f"{d} holds an unfinished run (latest checkpoint {path}, step {step}{_incomplete_note(output_dir)}); "
                "pass --resume latest to continue it, --overwrite to replace it, or choose another directory")
    if entries:
        return (f"{d} holds a run that saved no complete checkpoint ({_listing(entries)}"
                f"{_incomplete_note(output_dir)}): nothing to resume; pass --overwrite to replace it, or choose "
                "another directory")
    held = sorted(os.listdir(output_dir))
    return (f"{d} exists and is not empty ({_listing(held)}) and holds no checkpoint to resume; pass --overwrite "
            "to replace its previous run, or choose another directory")


def remove_partial_run(output_dir: str) -> None:
    """Remove a run's entries that no checkpoint backs (its arguments, its metrics so far): nothing to resume."""
    if checkpoints(output_dir):
        return
    for name in run_entries(output_dir):
        if not CHECKPOINT_RE.match(name):
            _remove(os.path.join(output_dir, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def replacing(output_dir: str, names: list[str]):
    """Set a previous run's entries aside for the body; delete them after it, put them back if it raises.

    On an exception (KeyboardInterrupt included) the new run's entries are removed first, so the directory
    holds exactly the previous run again. Files that are not run entries are never touched. An exception with
    ``keep_new_run`` (a run stopped by a signal after saving a resumable checkpoint) keeps both: the new run in
    place, the previous one in the hidden folder until the new one, resumed, finishes (``plan_output_dir``).
    """
    if not names:
        yield
        return
    aside = os.path.join(output_dir, ASIDE)
    os.mkdir(aside)
    moved: list[str] = []
    try:
        for name in names:
            os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
            moved.append(name)
        yield
    except BaseException as exc:
        if getattr(exc, "keep_new_run", False) and len(moved) == len(names):
            raise  # the new run stopped with a resumable checkpoint: both runs are kept, the old one set aside
        unmoved = set(names) - set(moved)  # still the previous run's (interrupted while setting aside)
        for name in run_entries(output_dir):
            if name not in unmoved:
                _remove(os.path.join(output_dir, name))
        for name in moved:
            os.rename(os.path.join(aside, name), os.path.join(output_dir, name))
        os.rmdir(aside)
        raise
    shutil.rmtree(aside)
