"""`deltafuse bench e2e`: the same training twice, stock (OFF) then deltafuse (ON), and the comparison.

Each run is its own process (``python -m deltafuse.train``), so no patch can leak from one into the other;
both get the same model, seed, data, steps and flags. The OFF run has ``DELTAFUSE_PATCH=0`` and
``--no-deltafuse``; the ON run has ``DELTAFUSE_PATCH=1`` and ``--deltafuse`` (the other DELTAFUSE_* switches are
passed through from the environment). From their per-step records the table gives the average duration of a
``--interval``-step interval (wall clock, warm-up intervals excluded), tokens/s, peak memory, average loss and
grad norm with the ON-OFF deltas, and the speedup; it is written as Markdown, JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from deltafuse.train.errors import TrainInputError


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


def child_command(args, run: str, run_dir: str) -> tuple[list[str], dict]:
    train_cmd = ["-m", "deltafuse.train", *forward_train_args(args), "--output-dir", run_dir, "--overwrite",
                 "--deltafuse" if run == "on" else "--no-deltafuse"]
    if args.progress is not None:
        train_cmd.append("--progress" if args.progress else "--no-progress")
    if args.nproc_per_node > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc_per_node}", *train_cmd]
    else:
        cmd = [sys.executable, *train_cmd]
    env = dict(os.environ)
    env.pop("TWINKLE_NPU_PATCH", None)  # one spelling of the master switch, set explicitly per run
    env["DELTAFUSE_PATCH"] = "1" if run == "on" else "0"
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
        "final_loss": _mean([r["loss"] for r in records[-size:]]),
        "avg_grad_norm": _mean([r["grad_norm"] for r in records]),
    }


def _delta(on: float, off: float, fmt: str) -> str:
    d = on - off
    rel = f" ({d / off * 100:+.1f}%)" if off else ""
    return f"{d:+{fmt}}{rel}"


def table_rows(off: dict, on: dict, size: int, mem_kind: str) -> list[list[str]]:
    from deltafuse.train.trainer import fmt_bytes

    mib = 1024 ** 2
    rows = [
        [f"avg duration per {size}-step interval (s)", f"{off['avg_interval_s']:.3f}", f"{on['avg_interval_s']:.3f}",
         _delta(on["avg_interval_s"], off["avg_interval_s"], ".3f")],
        ["median step time (ms; robust to stalls)", f"{off['median_step_s'] * 1000:.1f}",
         f"{on['median_step_s'] * 1000:.1f}", _delta(on["median_step_s"] * 1000, off["median_step_s"] * 1000, ".1f")],
        ["tokens/s", f"{off['tokens_per_s']:,.0f}", f"{on['tokens_per_s']:,.0f}",
         _delta(on["tokens_per_s"], off["tokens_per_s"], ",.0f")],
        [f"peak memory ({mem_kind})", fmt_bytes(off["peak_mem_bytes"]), fmt_bytes(on["peak_mem_bytes"]),
         _delta(on["peak_mem_bytes"] / mib, off["peak_mem_bytes"] / mib, ".1f").replace(" (", " MiB (", 1)],
        ["avg loss (all steps)", f"{off['avg_loss']:.4f}", f"{on['avg_loss']:.4f}",
         _delta(on["avg_loss"], off["avg_loss"], ".4f")],
        [f"final loss (last {size} steps)", f"{off['final_loss']:.4f}", f"{on['final_loss']:.4f}",
         _delta(on["final_loss"], off["final_loss"], ".4f")],
        ["avg grad norm", f"{off['avg_grad_norm']:.4f}", f"{on['avg_grad_norm']:.4f}",
         _delta(on["avg_grad_norm"], off["avg_grad_norm"], ".4f")],
        ["speedup (OFF time / ON time)", "", "", f"{off['avg_interval_s'] / on['avg_interval_s']:.2f}x"],
    ]
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    head = ["metric", "OFF (stock)", "ON (deltafuse)", "delta (ON - OFF)"]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def plot(records: dict[str, list[dict]], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise TrainInputError("the PNG needs matplotlib (pip install 'deltafuse[train]'); the table and JSON "
                              "were written") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("loss", "loss", 1.0), ("grad_norm", "grad norm", 1.0), ("step_time_s", "step time (ms)", 1000.0))
    for ax, (key, label, scale) in zip(axes, panels):
        for run, name in RUNS:
            recs = records[run]
            ax.plot([r["step"] for r in recs], [r[key] * scale for r in recs], label=name,
                    linestyle="-" if run == "on" else "--", linewidth=1.4)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    times = [r["step_time_s"] for recs in records.values() for r in recs if r["step_time_s"] > 0]
    if times and max(times) / min(times) > 20:  # a long first step would flatten the rest
        axes[2].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.train.cli import _int_at_least, add_arguments as add_train_arguments

    add_train_arguments(parser)
    parser.description = ("Run the same training twice in separate processes, stock transformers (OFF) then "
                          "deltafuse (ON), and compare: interval time, tokens/s, peak memory, loss, grad norm, "
                          "speedup. Writes e2e.md, e2e.json and e2e.png to --output-dir. Every `deltafuse train` "
                          "flag applies to both runs.")
    parser.set_defaults(max_steps=60, output_dir="runs/bench-e2e")
    for action in parser._actions:  # the same flags as `deltafuse train`, with the benchmark's defaults
        if action.dest == "max_steps":
            action.help = "optimizer steps of each run (default: 60)"
        elif action.dest == "output_dir":
            action.help = "where off/, on/ and e2e.md/json/png go (default: runs/bench-e2e)"
        elif action.dest == "overwrite":
            action.help = "replace a previous benchmark in --output-dir"
        elif action.dest in ("deltafuse", "resume"):
            action.help = "(not for bench e2e: it makes fresh OFF and ON runs)"
    g = parser.add_argument_group("benchmark")
    g.add_argument("--interval", metavar="N", type=_int_at_least(1), default=10,
                   help="steps per timed interval (default: 10)")
    g.add_argument("--warmup-intervals", metavar="N", type=_int_at_least(0), default=1,
                   help="first intervals left out of the timing (warm-up, kernel compilation; default: 1)")
    g.add_argument("--nproc-per-node", metavar="N", type=_int_at_least(1), default=1,
                   help="processes per run through torch.distributed.run (DDP; default: 1 = no launcher)")


def check_args(args) -> None:
    if args.deltafuse is not None:
        raise TrainInputError("bench e2e runs both OFF and ON; drop --deltafuse/--no-deltafuse "
                              "(use `deltafuse train` for one run)")
    if args.resume is not None:
        raise TrainInputError("bench e2e starts fresh runs; --resume is for `deltafuse train`")
    need = args.interval * (args.warmup_intervals + 1)
    if args.max_steps < need:
        raise TrainInputError(f"--max-steps {args.max_steps} leaves no timed interval; allowed: --max-steps >= "
                              f"--interval x (--warmup-intervals + 1) = {args.interval} x "
                              f"{args.warmup_intervals + 1} = {need}")


def run_e2e(args) -> dict:
    from deltafuse.train import data as data_mod
    from deltafuse.train import setup
    from deltafuse.train.trainer import prepare_output_dir

    from deltafuse.train.trainer import resolve_defaults

    check_args(args)
    setup.check_model_arg(args.model, patched=True)  # the ON run patches it
    resolve_defaults(args)
    if args.data is not None:  # fail here, once, rather than in the first child
        data_mod.load_jsonl(args.data, skip_bad_rows=args.skip_bad_rows)
    prepare_output_dir(args.output_dir, overwrite=args.overwrite, resume=None)
    for name in ("off", "on", "e2e.md", "e2e.json", "e2e.png"):
        path = os.path.join(args.output_dir, name)
        if args.overwrite and os.path.exists(path):
            import shutil

            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(args.output_dir, exist_ok=True)

    commands, records, summaries, wall = {}, {}, {}, {}
    for run, name in RUNS:
        run_dir = os.path.join(args.output_dir, run)
        cmd, env = child_command(args, run, run_dir)
        shown = f"DELTAFUSE_PATCH={env['DELTAFUSE_PATCH']} " + shlex.join(["python", *cmd[1:]])
        commands[run] = shown
        print(f"\n=== {name}: {shown}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        wall[run] = time.perf_counter() - t0
        if rc != 0:
            raise BenchRunError(f"the {name} run failed with exit code {rc} (its output is above); "
                               f"command: {shown}")
        records[run] = read_records(os.path.join(run_dir, "metrics.jsonl"))
        with open(os.path.join(run_dir, "summary.json")) as fh:
            summaries[run] = json.load(fh)
        if len(records[run]) != args.max_steps:
            raise BenchRunError(f"the {name} run recorded {len(records[run])} of {args.max_steps} steps")

    size, warm = args.interval, args.warmup_intervals
    stats = {run: summarize(records[run], size, warm) for run, _ in RUNS}
    mem_kind = summaries["on"].get("peak_mem_kind", "peak memory")
    rows = table_rows(stats["off"], stats["on"], size, mem_kind)
    on_report = summaries["on"].get("deltafuse", {})
    step_dloss = [abs(a["loss"] - b["loss"]) for a, b in zip(records["off"], records["on"])]
    first = stats["off"]["intervals"][0]["steps"][1] if warm else 0
    stack = summaries["on"].get("stack", {})
    title = (f"deltafuse bench e2e: {args.model}, {summaries['on']['mode']}, {summaries['on']['dtype']}, "
             f"{'packed' if args.packing else 'padded'} seq {args.seq_len} x {args.batch_size}, "
             f"{args.max_steps} steps, {stack.get('device', '')}")
    notes = [
        f"timing: intervals of {size} steps, wall clock; the first {warm} interval(s) (steps 1-{first}) are "
        f"warm-up and left out" if warm else f"timing: intervals of {size} steps, wall clock, all counted",
        f"max per-step |loss OFF - loss ON|: {max(step_dloss):.4g} (same seed, data and order; stock "
        "transformers lets GDN/conv state leak across packed sequences, deltafuse keeps them apart)"
        if args.packing else f"max per-step |loss OFF - loss ON|: {max(step_dloss):.4g}",
        f"deltafuse ON: {on_report.get('text', '').splitlines()[0] if on_report.get('text') else 'no report'}",
        "stack: " + ", ".join(f"{k} {v}" for k, v in stack.items()),
    ]
    md = "\n".join([f"# {title}", "", markdown_table(rows), ""] + [f"- {n}" for n in notes]
                   + ["", "commands:", ""] + [f"    {commands[r]}" for r, _ in RUNS]) + "\n"
    out = {
        "title": title, "table": [dict(zip(("metric", "off", "on", "delta"), r)) for r in rows],
        "off": stats["off"], "on": stats["on"],
        "speedup": stats["off"]["avg_interval_s"] / stats["on"]["avg_interval_s"],
        "loss_delta": stats["on"]["avg_loss"] - stats["off"]["avg_loss"],
        "grad_norm_delta": stats["on"]["avg_grad_norm"] - stats["off"]["avg_grad_norm"],
        "max_step_loss_delta": max(step_dloss), "interval": size, "warmup_intervals": warm,
        "commands": commands, "process_wall_s": wall, "stack": stack, "deltafuse_report": on_report,
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_func")},
        "steps": {run: records[run] for run, _ in RUNS},
    }
    paths = {ext: os.path.join(args.output_dir, f"e2e.{ext}") for ext in ("md", "json", "png")}
    with open(paths["md"], "w") as fh:
        fh.write(md)
    with open(paths["json"], "w") as fh:
        json.dump(out, fh, indent=2, default=str)
    print("\n" + md)
    plot(records, paths["png"], title)
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return out
