"""The results of `deltafuse bench e2e`: per-run statistics, the speed verdict, the tables, the plot, the files.

From the per-step records of every run and repeat (``e2e_runs.run_rounds``): the intervals and their timing,
aggregated over the repeats as median [min-max]; what the interleaved OFF/ON pairs say about speed on the device
(a speedup only on CUDA); the OFF/ON table and, with --peers, one row per run; the loss comparison; and
``write_report``, which writes e2e.md, e2e.json and e2e.png into --output-dir and prints the Markdown.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics

from deltafuse.bench import peers as peers_mod
from deltafuse.train.errors import TrainInputError

TIMED = ("avg_interval_s", "median_step_s", "tokens_per_s")


# --- statistics --------------------------------------------------------------------------------------
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
                "BENCHMARKS.md#current")
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


# --- the files ---------------------------------------------------------------------------------------
def write_report(args, runs, records, summaries, status, reports, commands, wall, order) -> dict:
    """The benchmark's result from what ``e2e_runs.run_rounds`` returned: e2e.md (printed too), e2e.json and
    e2e.png in --output-dir; returns what e2e.json holds."""
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
