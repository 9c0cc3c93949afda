"""The processes of `deltafuse bench e2e`: their command lines and environments, the interleaved rounds, their records.

Every run is a process of its own: ON is ``python -m deltafuse.train``, OFF and the peers start through
``python -m deltafuse.bench.peers``; each gets the benchmark's `deltafuse train` flags, every value explicit
(``forward_train_args``). ``run_rounds`` makes every run ``--repeats`` times, interleaved, and returns what each
recorded: an OFF or ON run that fails or records fewer steps than asked is a ``BenchRunError``; a peer that cannot
run keeps its reason for its row and is not tried again.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from deltafuse.bench import peers as peers_mod


class BenchRunError(RuntimeError):
    """One of the two training processes failed or recorded fewer steps than asked."""


RUNS = (("off", "OFF (stock)"), ("on", "ON (deltafuse)"))
NOT_FORWARDED = {"deltafuse", "resume", "output_dir", "overwrite", "progress"}


# --- forwarding the train flags ----------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    from deltafuse.train.cli import add_arguments

    parser = argparse.ArgumentParser(prog="python -m deltafuse.train")
    add_arguments(parser)
    return parser


def forward_train_args(args) -> list[str]:
    """The `deltafuse train` flags that reproduce ``args`` exactly (every value explicit)."""
    out: list[str] = []
    for action in train_parser()._actions:
        dest = action.dest
        if not action.option_strings or dest in NOT_FORWARDED or dest == "help" or not hasattr(args, dest):
            continue
        if dest.startswith("hf:"):  # a transformers TrainingArguments option: [option, raw values...]
            out += getattr(args, dest)
            continue
        value = getattr(args, dest)
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
            if value is not None and value == action.const:
                out.append(flag)
        elif value is not None:
            out += [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return out


def peer_report_path(run_dir: str) -> str:
    return os.path.join(run_dir, "peer_run.json")


def child_threads(args, device: str, environ=os.environ) -> str | None:
    """OMP_NUM_THREADS for the runs, or None to leave the environment as it is.

    The tiny models (hidden size 64) gain nothing from a second CPU thread, and on a shared CPU OpenMP's spinning
    threads make their steps several times slower: on a CPU, unless OMP_NUM_THREADS is set, they run on one thread.
    """
    from deltafuse.model_names import TINY_NAMES

    tiny = args.model in TINY_NAMES and not os.path.isdir(args.model)
    return "1" if tiny and not device.startswith("cuda") and "OMP_NUM_THREADS" not in environ else None


def child_command(args, run: str, run_dir: str, threads: str | None = None) -> tuple[list[str], dict]:
    """The command and environment of one run: ``on`` is `deltafuse train`; off and the peers start through
    ``deltafuse.bench.peers`` (FLA kept out unless the run names it, peers set up and counted). ``threads``
    sets OMP_NUM_THREADS (see ``child_threads``)."""
    forwarded = forward_train_args(args)
    if run != "on":  # CUDA graphs of the layers need deltafuse's ops (stock and the peers read values on the host)
        forwarded = [a for a in forwarded if a != "--cuda-graphs"]
    train_args = [*forwarded, "--output-dir", run_dir, "--overwrite", "--deltafuse" if run == "on" else "--no-deltafuse"]
    if args.progress is not None:
        train_args.append("--progress" if args.progress else "--no-progress")
    if run == "on":
        train_cmd = ["-m", "deltafuse.train", *train_args]
    else:
        lift = ["--fla-lift-hopper-guard"] if getattr(args, "fla_lift_hopper_guard", False) and "fla" in \
            peers_mod.parts(run) else []
        train_cmd = ["-m", "deltafuse.bench.peers", "--run", run, "--report", peer_report_path(run_dir), *lift,
                     "--", *train_args]
    if args.nproc_per_node > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc_per_node}", *train_cmd]
    else:
        cmd = [sys.executable, *train_cmd]
    env = dict(os.environ)
    env.pop("TWINKLE_NPU_PATCH", None)  # one spelling of the master switch, set explicitly per run
    env["DELTAFUSE_PATCH"] = "1" if run == "on" else "0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return cmd, env


# --- the records -------------------------------------------------------------------------------------
def read_records(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# --- the rounds --------------------------------------------------------------------------------------
def run_rounds(args, device: str) -> dict:
    """Every run ``--repeats`` times, interleaved (OFF, ON, then the peers, in each round), on ``device``.

    Returns the arguments of ``e2e_report.write_report``: the runs, each run's records per repeat, the first
    repeat's summary.json, the peers' status and reports, the commands shown, process wall times and the order.
    """
    runs = [run for run, _ in RUNS] + list(args.peers)
    n = args.repeats
    commands, summaries, status, reports = {}, {}, {}, {}
    records: dict[str, list[list[dict]]] = {run: [] for run in runs}
    wall: dict[str, list[float]] = {run: [] for run in runs}
    order: list[str] = []
    names = ", ".join(["OFF", "ON"] + [peers_mod.LABELS[p] for p in args.peers])
    cpu = not device.startswith("cuda")
    threads = child_threads(args, device)
    print(f"bench e2e: {names}, {n} time{'s' if n > 1 else ''} each, interleaved, {args.max_steps} steps per run, on "
          f"{device}" + ("; on a CPU the timings are noise and the loss comparison is the check (speed is measured "
                         "on the GPU: BENCHMARKS.md#current)" if cpu else "")
          + ("; the tiny model runs on one CPU thread (OMP_NUM_THREADS=1; set OMP_NUM_THREADS to choose)"
             if threads else ""), flush=True)
    active = list(runs)
    for rep in range(1, n + 1):
        for run in list(active):
            name = peers_mod.LABELS[run]
            run_dir = os.path.join(args.output_dir, peers_mod.run_dir_name(run))
            cmd, env = child_command(args, run, run_dir, threads)
            shown = (f"OMP_NUM_THREADS={threads} " if threads else "") + \
                f"DELTAFUSE_PATCH={env['DELTAFUSE_PATCH']} " + shlex.join(["python", *cmd[1:]])
            commands[run] = shown
            print(f"\n=== {name}, repeat {rep} of {n}: {shown}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, env=env)
            wall[run].append(time.perf_counter() - t0)
            order.append(run)
            if run in args.peers:
                kind, reason, report, recs = _read_peer(run, run_dir, rc, args.max_steps)
                if rep == 1 or kind != "ran":
                    reports[run] = {"status": kind, "reason": reason,
                                    "report": {k: v for k, v in (report or {}).items() if k != "traceback"} or None}
                if kind == "ran":
                    records[run].append(recs)
                    if rep == 1:
                        status[run] = peers_mod.ran_note(run, report)
                        with open(os.path.join(run_dir, "summary.json")) as fh:
                            summaries[run] = json.load(fh)
                else:  # a peer that cannot run is a row with the reason, and is not tried again
                    status[run] = reason if rep == 1 else f"repeat {rep} of {n}: {reason}"
                    del records[run]
                    active.remove(run)
                    print(f"=== {name}: {status[run]}", flush=True)
                continue
            if rc != 0:
                raise BenchRunError(f"the {name} run (repeat {rep} of {n}) failed with exit code {rc} (its output is "
                                    f"above); command: {shown}")
            recs = read_records(os.path.join(run_dir, "metrics.jsonl"))
            if len(recs) != args.max_steps:
                raise BenchRunError(f"the {name} run (repeat {rep} of {n}) recorded {len(recs)} of {args.max_steps} "
                                    "steps")
            records[run].append(recs)
            if rep == 1:
                with open(os.path.join(run_dir, "summary.json")) as fh:
                    summaries[run] = json.load(fh)
    return {"runs": runs, "records": records, "summaries": summaries, "status": status, "reports": reports,
            "commands": commands, "wall": wall, "order": order}


def _read_peer(run, run_dir, rc, max_steps) -> tuple[str, str, dict | None, list[dict]]:
    """One peer run: (status, reason, its report, its records); records only when it really ran with its peer."""
    report = None
    if os.path.isfile(peer_report_path(run_dir)):
        with open(peer_report_path(run_dir)) as fh:
            report = json.load(fh)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    recs = read_records(metrics) if os.path.isfile(metrics) and rc == 0 else []
    kind, reason = peers_mod.peer_status(run, report, rc, len(recs), max_steps)
    return kind, reason, report, recs if kind == "ran" else []
