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
verdict, the output says the timings are noise and that speed is measured on the GPU (BENCHMARKS.md), and the
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
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from deltafuse.argtypes import int_at_least
from deltafuse.bench import peers as peers_mod
from deltafuse.train.errors import TrainInputError


class BenchRunError(RuntimeError):
    """One of the two training processes failed or recorded fewer steps than asked."""


RUNS = (("off", "OFF (stock)"), ("on", "ON (deltafuse)"))
NOT_FORWARDED = {"deltafuse", "resume", "output_dir", "overwrite", "progress"}
MARKER = ".deltafuse-bench-e2e"  # written first into --output-dir: the directory holds a bench e2e result
RESULT_FILES = ("e2e.md", "e2e.json", "e2e.png")
TIMED = ("avg_interval_s", "median_step_s", "tokens_per_s")
DEFAULT_MAX_STEPS = 20
DEFAULT_REPEATS = 3


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
    train_args = [*forward_train_args(args), "--output-dir", run_dir, "--overwrite",
                  "--deltafuse" if run == "on" else "--no-deltafuse"]
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


# --- aggregation -------------------------------------------------------------------------------------
def read_records(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def intervals(records: list[dict], size: int) -> list[dict]:
    """Complete intervals of ``size`` steps: wall-clock duration and tokens of each."""
    out, prev_wall = [], 0.0
    for k in range(len(records) // size):
        chunk = records[k * size:(k + 1) * size]
        end = chunk[-1]["wall_s"]
        out.append({"steps": [chunk[0]["step"], chunk[-1]["step"]], "duration_s": end - prev_wall,
                    "tokens": sum(r["tokens"] for r in chunk),
                    "compute_s": sum(r["step_time_s"] for r in chunk)})
        prev_wall = end
    return out


def _mean(xs):
    xs = [x for x in xs if x == x]  # NaN grad norms (none logged) are left out
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(records: list[dict], size: int, warmup: int) -> dict:
    """One run (one repeat): its intervals, timing, memory, loss and grad norm."""
    ivs = intervals(records, size)
    measured = ivs[warmup:]
    duration = sum(i["duration_s"] for i in measured)
    timed = records[warmup * size:]
    return {
        "steps": len(records),
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "intervals": ivs,
        "measured_intervals": len(measured),
        "avg_interval_s": duration / len(measured),
        "tokens_per_s": sum(i["tokens"] for i in measured) / duration if duration > 0 else float("nan"),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "avg_loss": _mean([r["loss"] for r in records]),
        "first_loss": _mean([r["loss"] for r in records[:size]]),
        "final_loss": _mean([r["loss"] for r in records[-size:]]),
        "avg_grad_norm": _mean([r["grad_norm"] for r in records]),
    }


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "values": list(values)}


def aggregate(repeats: list[dict]) -> dict:
    """One side over its repeats: timings as min/median/max (with every value), memory the peak, the rest medians."""
    out = {"repeats": repeats, "steps": repeats[0]["steps"], "measured_intervals": repeats[0]["measured_intervals"]}
    out.update({key: spread([r[key] for r in repeats]) for key in TIMED})
    out["peak_mem_bytes"] = max(r["peak_mem_bytes"] for r in repeats)
    for key in ("avg_loss", "first_loss", "final_loss", "avg_grad_norm"):
        if all(key in r for r in repeats):
            out[key] = statistics.median(r[key] for r in repeats)
    return out


def speed_verdict(off_times: list[float], on_times: list[float], device: str) -> dict:
    """What the interval times of the interleaved OFF/ON pairs say about speed on ``device``.

    On CUDA: the speedup is the median of the pairs' OFF/ON ratios, and the verdict says in how many pairs ON
    was faster ("faster" / "slower" only when all pairs agree). Elsewhere no speedup: the timings are noise.
    """
    n = len(off_times)
    if not str(device).startswith("cuda"):
        if n > 1:
            own = max((max(ts) / min(ts) for ts in (off_times, on_times) if min(ts) > 0), default=float("nan"))
            seen = (f"OFF and ON ran {n} times each, interleaved, and the same run's own repeats differ by up to "
                    f"{own:.2f}x in interval time here")
        else:
            seen = "OFF and ON ran once each (--repeats 1: not even the spread of the noise was measured)"
        text = (f"timing on {device} is noise, not deltafuse's speed: {seen}; on a CPU the step time of a small model "
                "is mostly Python overhead and whatever else the machine runs. A CPU run checks that deltafuse's "
                "path trains like stock (the loss above); speed is a GPU property, measured on an H200 in "
                "BENCHMARKS.md")
        return {"device": device, "speedup": None, "verdict": f"{device}: noise", "text": text}
    pairs = [a / b for a, b in zip(off_times, on_times)]
    median = statistics.median(pairs)
    faster = sum(p > 1 for p in pairs)
    span = f"{min(pairs):.2f}x-{max(pairs):.2f}x"
    what = "(OFF time / ON time per interval; OFF and ON run one after the other in each repeat)"
    if n == 1:
        verdict = "one pair"
        text = (f"speed ({device}): speedup {median:.2f}x from one OFF/ON pair {what}; --repeats 1 measures no "
                "spread: --repeats 3 or more gives a verdict from interleaved pairs")
    elif faster in (0, n):
        verdict = "faster" if faster else "slower"
        text = (f"speed ({device}): deltafuse {verdict} in {n} of {n} interleaved repeats: median speedup "
                f"{median:.2f}x ({span}) {what}")
    else:
        verdict = "no clear verdict"
        text = (f"speed ({device}): no clear verdict: deltafuse faster in {faster} of {n} interleaved repeats, "
                f"slower in {n - faster}; median speedup {median:.2f}x ({span}) {what}; pass more --repeats or "
                "--max-steps")
    return {"device": device, "speedup": median, "pair_speedups": pairs, "faster_in": faster, "pairs": n,
            "verdict": verdict, "text": text}


def _delta(on: float, off: float, fmt: str) -> str:
    d = on - off
    rel = f" ({d / off * 100:+.1f}%)" if off else ""
    return f"{d:+{fmt}}{rel}"


def _spread_cell(sp: dict, fmt: str, scale: float = 1.0) -> str:
    med = format(sp["median"] * scale, fmt)
    if len(sp["values"]) == 1:
        return med
    return f"{med} [{format(sp['min'] * scale, fmt)}-{format(sp['max'] * scale, fmt)}]"


def table_rows(off: dict, on: dict, size: int, mem_kind: str, speed: dict) -> list[list[str]]:
    """The OFF/ON table: timing cells are median [min-max] over the repeats; on CUDA a speedup row closes it."""
    from deltafuse.train.trainer import fmt_bytes

    mib = 1024 ** 2
    noise = speed["speedup"] is None

    def timed(label, key, fmt, scale=1.0):
        delta = (f"({speed['verdict']})" if noise else
                 _delta(on[key]["median"] * scale, off[key]["median"] * scale, fmt))
        return [label, _spread_cell(off[key], fmt, scale), _spread_cell(on[key], fmt, scale), delta]

    rows = [
        timed(f"avg duration per {size}-step interval (s)", "avg_interval_s", ".3f"),
        timed("median step time (ms; robust to stalls)", "median_step_s", ".1f", 1000.0),
        timed("tokens/s", "tokens_per_s", ",.0f"),
        [f"peak memory ({mem_kind})", fmt_bytes(off["peak_mem_bytes"]), fmt_bytes(on["peak_mem_bytes"]),
         _delta(on["peak_mem_bytes"] / mib, off["peak_mem_bytes"] / mib, ".1f").replace(" (", " MiB (", 1)],
        ["avg loss (all steps)", f"{off['avg_loss']:.4f}", f"{on['avg_loss']:.4f}",
         _delta(on["avg_loss"], off["avg_loss"], ".4f")],
        [f"final loss (last {size} steps)", f"{off['final_loss']:.4f}", f"{on['final_loss']:.4f}",
         _delta(on["final_loss"], off["final_loss"], ".4f")],
        ["avg grad norm", f"{off['avg_grad_norm']:.4f}", f"{on['avg_grad_norm']:.4f}",
         _delta(on["avg_grad_norm"], off["avg_grad_norm"], ".4f")],
    ]
    if not noise:
        pairs = speed["pair_speedups"]
        label = ("speedup (OFF time / ON time), one pair" if len(pairs) == 1 else
                 f"speedup (OFF time / ON time), median of {len(pairs)} pairs")
        value = (f"{speed['speedup']:.2f}x" if len(pairs) == 1 else
                 f"{speed['speedup']:.2f}x ({min(pairs):.2f}x-{max(pairs):.2f}x)")
        rows.append([label, "", "", value])
    return rows


def _step_loss_diffs(first: list[list[dict]], second: list[list[dict]]) -> list[float]:
    """|loss difference| of every step of every repeat (repeat k of one run against repeat k of the other)."""
    return [abs(a["loss"] - b["loss"]) for x, y in zip(first, second) for a, b in zip(x, y)]


def loss_line(args, stats: dict, records: dict, cpu: bool) -> str:
    """The loss comparison of OFF and ON over every repeat (the headline of a CPU run)."""
    diffs = _step_loss_diffs(records["off"], records["on"])
    scale = _mean([abs(r["loss"]) for recs in records["off"] for r in recs]) or 1.0
    n = len(records["off"])
    off, on = stats["off"], stats["on"]
    line = (f"loss{' (what a CPU run checks)' if cpu else ''}: max per-step |loss OFF - loss ON| {max(diffs):.3g} "
            f"(relative {max(diffs) / scale:.2g}) over {n} repeat{'s' if n > 1 else ''} of {args.max_steps} steps; "
            f"OFF {off['first_loss']:.4f} -> {off['final_loss']:.4f}, ON {on['first_loss']:.4f} -> "
            f"{on['final_loss']:.4f} (first -> last {args.interval}-step interval)")
    if args.packing:
        line += ("; with packing the difference is stock's: transformers lets GDN/conv state leak across the "
                 "sequences packed in a row, deltafuse keeps them apart (--no-packing compares like with like; "
                 f"`deltafuse verify --model {shlex.quote(str(args.model))} --packed` checks deltafuse's packed "
                 "batch against each sequence run alone)")
    return line


def peer_table_rows(runs: list[str], stats: dict, status: dict, records: dict, size: int,
                    speed: dict) -> list[list[str]]:
    """One row per run (OFF, ON, then each peer): its numbers and deltafuse's speedup over it, or the reason."""
    from deltafuse.train.trainer import fmt_bytes

    rows = []
    for run in runs:
        label = peers_mod.LABELS[run]
        if run not in stats:
            rows.append([label] + ["-"] * 8 + [status[run]])
            continue
        s = stats[run]
        dloss = "-" if run == "off" else f"{max(_step_loss_diffs(records['off'], records[run])):.4g}"
        over = peer_speedup(stats, run, speed)
        rows.append([label, _spread_cell(s["avg_interval_s"], ".3f"), _spread_cell(s["median_step_s"], ".1f", 1000.0),
                     _spread_cell(s["tokens_per_s"], ",.0f"), fmt_bytes(s["peak_mem_bytes"]), f"{s['avg_loss']:.4f}",
                     f"{s['final_loss']:.4f}", dloss, f"({speed['verdict']})" if over is None else f"{over:.2f}x",
                     status[run]])
    return rows


def peer_speedup(stats: dict, run: str, speed: dict) -> float | None:
    """deltafuse's speedup over ``run`` on CUDA: the median over the repeats of its time / ON's time; else None."""
    if speed["speedup"] is None or run not in stats:
        return None
    theirs, ours = stats[run]["avg_interval_s"]["values"], stats["on"]["avg_interval_s"]["values"]
    return statistics.median(a / b for a, b in zip(theirs, ours))


def peer_table_head(size: int, mem_kind: str) -> list[str]:
    return ["run", f"avg {size}-step interval (s)", "median step (ms)", "tokens/s", f"peak memory ({mem_kind})",
            "avg loss", f"final loss (last {size})", "max step |loss - OFF|",
            "deltafuse speedup (its time / ON time)", "status"]


def markdown_table(rows: list[list[str]], head: list[str] | None = None) -> str:
    head = head or ["metric", "OFF (stock)", "ON (deltafuse)", "delta (ON - OFF)"]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def plot(records: dict[str, list[list[dict]]], path: str, title: str) -> None:
    """Loss and grad norm per step of every run's first repeat, and the step time of every repeat."""
    try:
        import matplotlib
    except ImportError:
        raise TrainInputError("the PNG needs matplotlib (pip install 'deltafuse[train]'); the table and JSON "
                              "were written") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("loss", "loss", 1.0), ("grad_norm", "grad norm", 1.0),
              ("step_time_s", "step time (ms), every repeat", 1000.0))
    for ax, (key, label, scale) in zip(axes, panels):
        for k, (run, reps) in enumerate(records.items()):
            style = "-" if run == "on" else "--" if run == "off" else ":"
            for i, recs in enumerate(reps if key == "step_time_s" else reps[:1]):
                ax.plot([r["step"] for r in recs], [r[key] * scale for r in recs], color=f"C{k}", linestyle=style,
                        linewidth=1.4 if i == 0 else 0.9, alpha=1.0 if i == 0 else 0.6,
                        label=peers_mod.LABELS[run] if i == 0 else None)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    times = [r["step_time_s"] for reps in records.values() for recs in reps for r in recs if r["step_time_s"] > 0]
    if times and max(times) / min(times) > 20:  # a long first step would flatten the rest
        axes[2].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.train.cli import add_arguments as add_train_arguments

    add_train_arguments(parser)
    parser.description = ("Run the same training in separate processes, stock transformers (OFF) and deltafuse "
                          "(ON), --repeats times each, interleaved, and compare: loss, grad norm, peak memory, "
                          "interval time and tokens/s as median [min-max]. On CUDA it gives the speedup (median of "
                          "the OFF/ON pairs); on a CPU the timings are noise and the loss comparison is the check. "
                          "Writes e2e.md, e2e.json and e2e.png to --output-dir. Every `deltafuse train` flag "
                          "applies to every run.")
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
            return _run_all(args, setup.training_device())
        except BaseException as exc:
            if previous:  # this run's partial output goes, so that the previous result can go back
                for name in bench_entries():
                    _remove(os.path.join(args.output_dir, name))
            if type(exc) is KeyboardInterrupt and not str(exc):  # Ctrl-C: the one line says what is kept
                raise KeyboardInterrupt(f"the previous bench e2e result in {args.output_dir!r} is put back as it was"
                                        if previous else f"this run's partial output is in {args.output_dir!r}"
                                        ) from exc
            raise


def _run_all(args, device: str) -> dict:
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
                         "on the GPU: BENCHMARKS.md)" if cpu else "")
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
    return _report(args, runs, records, summaries, status, reports, commands, wall, order)


def _report(args, runs, records, summaries, status, reports, commands, wall, order) -> dict:
    size, warm, n = args.interval, args.warmup_intervals, args.repeats
    stats = {run: aggregate([summarize(recs, size, warm) for recs in records[run]]) for run in runs if run in records}
    stack = summaries["on"].get("stack", {})
    device = str(stack.get("device", "cpu"))
    speed = speed_verdict(stats["off"]["avg_interval_s"]["values"], stats["on"]["avg_interval_s"]["values"], device)
    cpu = speed["speedup"] is None
    mem_kind = summaries["on"].get("peak_mem_kind", "peak memory")
    rows = table_rows(stats["off"], stats["on"], size, mem_kind, speed)
    on_report = summaries["on"].get("deltafuse", {})
    step_dloss = _step_loss_diffs(records["off"], records["on"])
    first = stats["off"]["repeats"][0]["intervals"][0]["steps"][1] if warm else 0
    together = ", ".join(["OFF", "ON"] + [peers_mod.LABELS[p] for p in args.peers])
    title = (f"deltafuse bench e2e: {args.model}, {summaries['on']['mode']}, {summaries['on']['dtype']}, "
             f"{'packed' if args.packing else 'padded'} seq {args.seq_len} x {args.batch_size}, "
             f"{args.max_steps} steps x {n} repeats ({together} interleaved), {device}" if n > 1 else
             f"deltafuse bench e2e: {args.model}, {summaries['on']['mode']}, {summaries['on']['dtype']}, "
             f"{'packed' if args.packing else 'padded'} seq {args.seq_len} x {args.batch_size}, "
             f"{args.max_steps} steps, 1 repeat, {device}")
    headline = [loss_line(args, stats, records, cpu), speed["text"]]
    notes = [
        (f"timing: intervals of {size} steps, wall clock; the first {warm} interval(s) (steps 1-{first}) are "
         f"warm-up and left out" if warm else f"timing: intervals of {size} steps, wall clock, all counted")
        + (f"; timing cells are median [min-max] over the {n} repeats" if n > 1 else ""),
        f"deltafuse ON: {on_report.get('text', '').splitlines()[0] if on_report.get('text') else 'no report'}",
        "stack: " + ", ".join(f"{k} {v}" for k, v in stack.items()),
    ]
    peer_md, peer_rows = [], []
    if args.peers:
        status.update({"off": "ran (transformers' torch fallback; FLA kept out)", "on": "ran"})
        peer_rows = peer_table_rows(runs, stats, status, records, size, speed)
        peer_md = ["## peers: each with deltafuse OFF and the peer on; same model, seed, data, steps and flags", "",
                   markdown_table(peer_rows, peer_table_head(size, mem_kind)), ""]
        notes += [f"{peers_mod.LABELS[r]}: {peers_mod.GUARD_NOTE} (its numbers are timing only)" for r in args.peers
                  if ((reports[r]["report"] or {}).get("fla") or {}).get("hopper_guard_lifted")]
    md = "\n".join([f"# {title}", ""] + [f"- {h}" for h in headline] + ["", markdown_table(rows), ""] + peer_md
                   + [f"- {n_}" for n_ in notes]
                   + ["", f"commands (each run {n} time{'s' if n > 1 else ''}, in turn):", ""]
                   + [f"    {commands[r]}" for r in runs]) + "\n"
    out = {
        "title": title, "headline": headline, "table": [dict(zip(("metric", "off", "on", "delta"), r)) for r in rows],
        "repeats": n, "order": order, "off": stats["off"], "on": stats["on"],
        "speed": speed, "speedup": speed["speedup"],
        "loss_delta": stats["on"]["avg_loss"] - stats["off"]["avg_loss"],
        "grad_norm_delta": stats["on"]["avg_grad_norm"] - stats["off"]["avg_grad_norm"],
        "max_step_loss_delta": max(step_dloss), "interval": size, "warmup_intervals": warm,
        "commands": commands, "process_wall_s": wall, "stack": stack, "deltafuse_report": on_report,
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_func")},
        "steps": {run: records[run] for run in runs if run in records},
    }
    if args.peers:
        out["peers"] = {run: dict(reports[run], stats=stats.get(run), summary=summaries.get(run),
                                  speedup_of_deltafuse=peer_speedup(stats, run, speed))
                        for run in args.peers}
        out["peer_table"] = [dict(zip(peer_table_head(size, mem_kind), r)) for r in peer_rows]
    paths = {ext: os.path.join(args.output_dir, f"e2e.{ext}") for ext in ("md", "json", "png")}
    with open(paths["md"], "w") as fh:
        fh.write(md)
    with open(paths["json"], "w") as fh:
        json.dump(out, fh, indent=2, default=str)
    print("\n" + md)
    plot({run: records[run] for run in runs if run in records}, paths["png"], title)
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return out


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
