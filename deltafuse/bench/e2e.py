"""`deltafuse bench e2e`: the same training stock (OFF) and deltafuse (ON), repeated, interleaved, and compared.

Each run is its own process (``python -m deltafuse.train``), so no patch can leak from one into the other;
all get the same model, seed, data, steps and flags. The OFF run has ``DELTAFUSE_PATCH=0`` and
``--no-deltafuse``; the ON run has ``DELTAFUSE_PATCH=1`` and ``--deltafuse`` (the other DELTAFUSE_* switches are
passed through from the environment). ``--repeats N`` makes every run N times, interleaved (OFF, ON, OFF, ON, ...),
so that a drift of the machine (other processes, clocks, thermals) falls on both sides alike. From the per-step
records the table gives, per side, the average duration of a ``--interval``-step interval (wall clock, warm-up
intervals excluded), the median step time and tokens/s as median [min-max] over the repeats, peak memory, average
loss and grad norm with the ON-OFF deltas; it is written as Markdown, JSON and a PNG.

What the numbers can say depends on the device. On CUDA the speedup is the median of the N interleaved OFF/ON
pairs, with their range, and the verdict says in how many pairs deltafuse was faster. On a CPU the timings of
these small models are dominated by Python overhead and by whatever else the machine runs: there is no speedup
verdict, the output says the timings are noise and that speed is measured on the GPU (BENCHMARKS.md#current), and the
headline is the loss comparison, which is what a CPU run really checks.

--output-dir holds one benchmark: a new run replaces a previous bench e2e result there (set aside until the new
one has finished, put back if it fails). A directory holding anything else (a `deltafuse train` run, other
files) is refused before anything runs, unless --overwrite, which replaces a training run's entries and the
benchmark's and leaves every other file alone.

``--peers fla,liger,fla+liger`` adds runs with deltafuse OFF and FLA and/or Liger-Kernel on (see peers.py), with
the same flags, in the same rounds, and a second table with one row per run: its numbers and deltafuse's speedup
over it (CUDA), or why it has none. The OFF run and every run that is not an FLA run start through
``deltafuse.bench.peers`` too, which keeps FLA out of them: they use transformers' torch fallback even where FLA
is installed.

This module is the command (its arguments, their checks, --output-dir); ``e2e_runs`` starts the processes and
collects their records, ``e2e_report`` turns them into the tables and files.
"""

from __future__ import annotations

import argparse
import os
import shutil

from deltafuse.argtypes import int_at_least
from deltafuse.bench import e2e_report, e2e_runs
from deltafuse.bench import peers as peers_mod
from deltafuse.train.errors import TrainInputError, cuda_graphs_refusal


MARKER = ".deltafuse-bench-e2e"  # written first into --output-dir: the directory holds a bench e2e result
RESULT_FILES = ("e2e.md", "e2e.json", "e2e.png")
DEFAULT_MAX_STEPS = 20
DEFAULT_REPEATS = 3


# --- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.train.cli import add_arguments as add_train_arguments

    add_train_arguments(parser)
    parser.description = ("Run the same training in separate processes, stock transformers (OFF) and deltafuse "
                          "(ON), --repeats times each, interleaved, and compare: loss, grad norm, peak memory, "
                          "interval time and tokens/s as median [min-max]. On CUDA it gives the speedup (median of "
                          "the OFF/ON pairs); on a CPU the timings are noise and the loss comparison is the check. "
                          "Writes e2e.md, e2e.json and e2e.png to --output-dir. Every `deltafuse train` flag "
                          "applies to every run, but --cuda-graphs to the deltafuse run alone.")
    parser.set_defaults(max_steps=DEFAULT_MAX_STEPS, output_dir="runs/bench-e2e")
    for action in parser._actions:  # the same flags as `deltafuse train`, with the benchmark's defaults
        if action.dest == "max_steps":
            action.help = (f"optimizer steps of each run (default: {DEFAULT_MAX_STEPS}: with the default --interval "
                           "and --warmup-intervals, one warm-up and one timed interval)")
        elif action.dest == "output_dir":
            action.help = ("where off/, on/ and e2e.md/json/png go (default: runs/bench-e2e); a previous bench e2e "
                           "result there is replaced, a directory holding anything else is refused")
        elif action.dest == "overwrite":
            action.help = ("also use an --output-dir that holds other things: a `deltafuse train` run there is "
                           "replaced, other files are kept")
        elif action.dest in ("deltafuse", "resume"):
            action.help = "(not for bench e2e: it makes fresh OFF and ON runs)"
    g = parser.add_argument_group("benchmark")
    g.add_argument("--repeats", metavar="N", type=int_at_least(1), default=DEFAULT_REPEATS,
                   help="make each run N times, interleaved (OFF, ON, OFF, ON, ...; peers after ON in each round): "
                        "timings are median [min-max] over the repeats; on CUDA the speedup is the median of the N "
                        f"OFF/ON pairs (default: {DEFAULT_REPEATS})")
    g.add_argument("--interval", metavar="N", type=int_at_least(1), default=10,
                   help="steps per timed interval (default: 10)")
    g.add_argument("--warmup-intervals", metavar="N", type=int_at_least(0), default=1,
                   help="first intervals left out of the timing (warm-up, kernel compilation; default: 1)")
    g.add_argument("--nproc-per-node", metavar="N", type=int_at_least(1), default=1,
                   help="processes per run through torch.distributed.run (DDP; default: 1 = no launcher)")
    g.add_argument("--peers", metavar="LIST", type=peers_mod.parse_peers, default=[],
                   help="also run the same training with deltafuse OFF and a peer on: none (default) or a "
                        "comma-separated list of fla (flash-linear-attention, which transformers picks by itself), "
                        "liger (Liger-Kernel's patches incl. its fused linear cross-entropy), fla+liger; a peer "
                        "that cannot run is a row with the reason")
    g.add_argument("--fla-lift-hopper-guard", action="store_true",
                   help="in the FLA runs, set fla.ops.common.chunk_o.IS_NVIDIA_HOPPER=False where FLA refuses its "
                        "backward (Hopper, Triton >= 3.4, < 3.7.1): for timing only, its gradients are known to be "
                        "wrong there; the table says so")


def check_args(args) -> None:
    if args.deltafuse is not None:
        raise TrainInputError("bench e2e runs both OFF and ON; drop --deltafuse/--no-deltafuse "
                              "(use `deltafuse train` for one run)")
    if args.resume is not None:
        raise TrainInputError("bench e2e starts fresh runs; --resume is for `deltafuse train`")
    if getattr(args, "context_parallel", 1) != 1:
        raise TrainInputError(f"--context-parallel {args.context_parallel} with bench e2e: its stock (OFF) run has no "
                              "exact context parallelism; allowed: 1 (benchmarks/context_parallel.py compares one "
                              "GPU with --context-parallel 2)")
    if args.fla_lift_hopper_guard and not any("fla" in peers_mod.parts(p) for p in args.peers):
        raise TrainInputError("--fla-lift-hopper-guard applies to FLA runs; add fla or fla+liger to --peers "
                              f"(now: {','.join(args.peers) or 'none'})")
    why = getattr(args, "cuda_graphs", False) and cuda_graphs_refusal(
        checkpointing="--gradient-checkpointing" if args.gradient_checkpointing else None)
    if why:
        raise TrainInputError(f"--cuda-graphs: {why}")
    need = args.interval * (args.warmup_intervals + 1)
    if args.max_steps < need:
        raise TrainInputError(f"--max-steps {args.max_steps} leaves no timed interval; allowed: --max-steps >= "
                              f"--interval x (--warmup-intervals + 1) = {args.interval} x "
                              f"{args.warmup_intervals + 1} = {need}")


def bench_entries() -> set[str]:
    """The names a bench e2e run writes into --output-dir."""
    return {MARKER, "off", "on", *RESULT_FILES, *(peers_mod.run_dir_name(r) for r in peers_mod.PEERS)}


def plan_bench_dir(args) -> list[str]:
    """The entries of --output-dir that this run replaces; refuses, in one line, a directory it must not use.

    A directory that is missing, empty or holds a previous bench e2e result (its marker or e2e.json, and nothing
    but the benchmark's own names) is used, the previous result replaced. Anything else is refused unless
    --overwrite: then a training run's entries there are replaced too, other files are kept.
    """
    from deltafuse.train.outdir import ASIDE, check_writable, plan_output_dir, run_entries

    out = args.output_dir
    check_writable(out)
    aside = os.path.join(out, ASIDE)
    if os.path.exists(aside):  # said here: `deltafuse train`'s account of it may suggest its own flags
        raise TrainInputError(f"--output-dir {out!r} holds {aside!r}, what an interrupted run set aside (a previous "
                              f"benchmark or training run); move its contents back into {out!r} to keep them, or "
                              "delete the folder, then run again")
    plan = plan_output_dir(out, overwrite=True, resume=None)  # with overwrite=True it refuses nothing more here
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    ours = [n for n in names if n in bench_entries()]
    is_bench = MARKER in names or "e2e.json" in names
    if len(ours) == len(names) and (is_bench or not names):
        return ours
    if args.overwrite:
        return list(dict.fromkeys(plan.replace + ours))
    train_run = run_entries(out)
    if train_run:
        raise TrainInputError(f"--output-dir {out!r} holds a `deltafuse train` run ({_listing(train_run)}), not a "
                              "bench e2e result; choose another --output-dir, or pass --overwrite to replace that "
                              "run (other files there are kept)")
    others = [n for n in names if n not in bench_entries()] or names
    raise TrainInputError(f"--output-dir {out!r} holds files that are not a bench e2e result ({_listing(others)}); "
                          "choose another --output-dir, or pass --overwrite to write the benchmark beside them "
                          "(they are kept)")


def _listing(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def run_e2e(args) -> dict:
    from deltafuse.train import data as data_mod
    from deltafuse.train import setup

    from deltafuse.train.trainer import resolve_defaults

    check_args(args)
    if getattr(args, "cuda_graphs", False) and not setup.training_device().startswith("cuda"):
        # refused here rather than by the ON run, after the OFF run has already trained
        raise TrainInputError(f"--cuda-graphs: the device is {setup.training_device()}; allowed: a CUDA device")
    setup.check_model_arg(args.model, patched=True)  # the ON run patches it
    resolve_defaults(args)
    if args.data is not None:  # fail here, once, rather than in the first child
        data_mod.load_jsonl(args.data, skip_bad_rows=args.skip_bad_rows)
    from deltafuse.train.outdir import replacing

    previous = plan_bench_dir(args)
    os.makedirs(args.output_dir, exist_ok=True)
    if previous:
        print(f"bench e2e: replacing the previous bench e2e result in {args.output_dir!r} (set aside until this run "
              "has finished; put back if it fails)", flush=True)
    # the previous result is set aside, deleted once this one has finished, put back if it fails
    with replacing(args.output_dir, previous):
        try:
            with open(os.path.join(args.output_dir, MARKER), "w") as fh:
                fh.write("deltafuse bench e2e writes here; a new bench e2e run replaces what it wrote\n")
            return e2e_report.write_report(args, **e2e_runs.run_rounds(args, setup.training_device()))
        except BaseException as exc:
            if previous:  # this run's partial output goes, so that the previous result can go back
                for name in bench_entries():
                    _remove(os.path.join(args.output_dir, name))
            if type(exc) is KeyboardInterrupt and not str(exc):  # Ctrl-C: the one line says what is kept
                raise KeyboardInterrupt(f"the previous bench e2e result in {args.output_dir!r} is put back as it was"
                                        if previous else f"this run's partial output is in {args.output_dir!r}"
                                        ) from exc
            raise

