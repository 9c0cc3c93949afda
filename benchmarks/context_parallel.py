"""Context parallelism on two GPUs against one: `deltafuse train --context-parallel 2` on single long sequences.

One sequence per row (``benchmarks/long_rows.py`` data, ``--no-packing``, batch 1), the same model, data and seed
in every run, each run its own `deltafuse train` process (group) under a timeout; a run that fails, runs out of
memory or times out is recorded as such and the others still run:

  one-L   one GPU, rows of L tokens                   for every L in --lengths
  cp2-L   two GPUs, --context-parallel 2 (torchrun)   for every L in --lengths and --cp-only
          (with --fsdp: and FSDP2 over the same two GPUs, --fsdp full_shard)
The default (4 steps, 3 above 65,536 tokens; 120 s / 150 s per run) fits about 8 minutes on 2 H200s.
Rows of at least --checkpointing-from tokens train with --gradient-checkpointing (in both runs of a length).
The one-GPU runs of different lengths go to different GPUs at the same time. Writes DIR/context_parallel.json and
DIR/context_parallel.md: median step time (steps after --warmup), tokens/s, peak memory per GPU (every rank), the
first-step loss, and per length the ratios the issue targets: tokens/s cp2 / one (>= 1.6) and peak memory per
GPU cp2 / one (<= 0.6), and the first-step loss difference (same rows, same weights).

    python benchmarks/context_parallel.py DIR                       # moe8 LoRA, 32K/64K both ways, 128K/256K on 2
    python benchmarks/context_parallel.py DIR --model tiny --lengths 256,512 --cp-only 1024 --steps 3 \\
        --checkpointing-from 100000 --cpu                            # the same machinery on a CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET_SPEEDUP, TARGET_MEMORY = 1.6, 0.6
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED|out of memory", re.I)


def lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: comma-separated token counts") from None
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: token counts >= 2")
    return values


def plan(args) -> list[dict]:
    runs = []
    for n in args.lengths:
        runs.append({"name": f"one-{n}", "gpus": 1, "seq_len": n})
    for n in args.lengths + args.cp_only:
        runs.append({"name": f"cp2-{n}", "gpus": 2, "seq_len": n})
    for r in runs:
        r["checkpointing"] = r["seq_len"] >= args.checkpointing_from
        r["steps"] = args.long_steps if r["seq_len"] > 65536 else args.steps
        r["dir"] = os.path.join(args.out, r["name"])
        r["log"] = os.path.join(args.out, r["name"] + ".log")
    return runs


def command(run: dict, args, data: str) -> list[str]:
    train = ["-m", "deltafuse.train", "--model", args.model, "--lora", "--data", data, "--no-packing",
             "--batch-size", "1", "--seq-len", str(run["seq_len"]), "--max-steps", str(run["steps"]),
             "--seed", str(args.seed), "--log-every", "1", "--no-progress", "--output-dir", run["dir"],
             "--overwrite", "--deltafuse"]
    if run["checkpointing"]:
        train.append("--gradient-checkpointing")
    if run["gpus"] > 1:
        fsdp = ["--fsdp", "full_shard"] if args.fsdp else []
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run['gpus']}",
                *train, "--context-parallel", str(run["gpus"]), *fsdp]
    return [sys.executable, *train]


def start(run: dict, args, data: str, gpu: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    cmd = command(run, args, data)
    run["command"] = " ".join(cmd)
    print("==", run["command"], flush=True)
    run["t0"] = time.perf_counter()
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(run["log"], "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: a timeout ends all of it


def finish(run: dict, proc: subprocess.Popen, timeout: float) -> None:
    left = max(1.0, timeout - (time.perf_counter() - run["t0"]))
    try:
        rc = proc.wait(timeout=left)
        run["status"] = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        run["status"] = f"timeout ({timeout:.0f} s)"
    run["wall_s"] = time.perf_counter() - run.pop("t0")
    with open(run["log"], errors="replace") as fh:
        text = fh.read()
    if run["status"] != "ok" and OOM.search(text):
        run["status"] = "out of memory"
    if run["status"] != "ok":
        tail = [line for line in text.splitlines() if line.strip()][-3:]
        run["error_tail"] = tail
    measure(run)


def measure(run: dict, warmup: int | None = None) -> None:
    warmup = run.get("warmup", 1) if warmup is None else warmup
    path = os.path.join(run["dir"], "metrics.jsonl")
    records = []
    if os.path.isfile(path):
        with open(path) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    run["steps_done"] = len(records)
    run["losses"] = [r["loss"] for r in records]
    run["first_loss"] = records[0]["loss"] if records else None
    timed = records[warmup:] or records[-1:]
    if timed:
        run["median_step_s"] = statistics.median(r["step_time_s"] for r in timed)
        run["tokens_per_step"] = statistics.median(r["tokens"] for r in timed)
        run["tokens_per_s"] = run["tokens_per_step"] / run["median_step_s"]
        run["timed_steps"] = [r["step"] for r in timed]
    summary = os.path.join(run["dir"], "summary.json")
    if os.path.isfile(summary):
        with open(summary) as fh:
            s = json.load(fh)
        per_rank = s.get("peak_mem_bytes_per_rank") or [s["peak_mem_bytes"]]
        run["peak_mem_gib_per_rank"] = [m / 2**30 for m in per_rank]
        run["peak_mem_gib"] = max(run["peak_mem_gib_per_rank"])
        run["peak_mem_kind"] = s.get("peak_mem_kind")
        run["context_parallel"] = s.get("context_parallel")
        run["stack"] = s.get("stack")
    elif records:  # rank 0's peak of the steps it finished
        run["peak_mem_gib"] = max(r["peak_mem_bytes"] for r in records) / 2**30


def compare(runs: list[dict], lengths_: list[int]) -> list[dict]:
    by = {r["name"]: r for r in runs}
    out = []
    for n in lengths_:
        one, two = by.get(f"one-{n}"), by.get(f"cp2-{n}")
        row = {"seq_len": n}
        if one and two and one.get("tokens_per_s") and two.get("tokens_per_s"):
            row["speedup"] = two["tokens_per_s"] / one["tokens_per_s"]
            row["speedup_met"] = row["speedup"] >= TARGET_SPEEDUP
        if one and two and one.get("peak_mem_gib") and two.get("peak_mem_gib") and two["status"] == "ok":
            row["memory_ratio"] = two["peak_mem_gib"] / one["peak_mem_gib"]
            row["memory_met"] = row["memory_ratio"] <= TARGET_MEMORY
        if one and two and one.get("first_loss") is not None and two.get("first_loss") is not None:
            row["first_loss_one"], row["first_loss_cp2"] = one["first_loss"], two["first_loss"]
            row["first_loss_rel_diff"] = abs(two["first_loss"] - one["first_loss"]) / abs(one["first_loss"])
        out.append(row)
    return out


def markdown(args, runs: list[dict], ratios: list[dict], wall: float) -> str:
    def f(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"{args.model} LoRA, one sequence per row, batch 1, {args.steps} steps per run ({args.long_steps} above "
             f"65,536 tokens; the median of the steps after the first {args.warmup}), {wall:.0f} s in all; two-GPU "
             f"runs: --context-parallel 2" + (" with FSDP2 (--fsdp full_shard) on the same GPUs" if args.fsdp else ""),
             "",
             "| run | GPUs | tokens | grad ckpt | status | steps | median step (s) | tokens/s | peak GiB per GPU "
             "(rank 0, 1) | first loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        mem = ", ".join(f"{m:.1f}" for m in r.get("peak_mem_gib_per_rank", [])) or f(r.get("peak_mem_gib"), ".1f")
        lines.append(f"| {r['name']} | {r['gpus']} | {r['seq_len']:,} | {'yes' if r['checkpointing'] else 'no'} | "
                     f"{r.get('status', 'not run')} | {r.get('steps_done', 0)} | {f(r.get('median_step_s'), '.3f')} | "
                     f"{f(r.get('tokens_per_s'), ',.0f')} | {mem} | {f(r.get('first_loss'), '.5f')} |")
    lines += ["", f"| tokens | tokens/s 2 GPUs / 1 (target >= {TARGET_SPEEDUP}) | peak memory per GPU 2 / 1 (target "
                  f"<= {TARGET_MEMORY}) | first loss 1 GPU | first loss 2 GPUs | relative difference |",
              "|---|---|---|---|---|---|"]
    for x in ratios:
        speed = f(x.get("speedup"), ".2f") + ("" if "speedup" not in x else " met" if x["speedup_met"] else " missed")
        mem = f(x.get("memory_ratio"), ".2f") + ("" if "memory_ratio" not in x else
                                                 " met" if x["memory_met"] else " missed")
        lines.append(f"| {x['seq_len']:,} | {speed} | {mem} | {f(x.get('first_loss_one'), '.5f')} | "
                     f"{f(x.get('first_loss_cp2'), '.5f')} | {f(x.get('first_loss_rel_diff'), '.2e')} |")
    for r in runs:
        if r.get("error_tail"):
            lines.append(f"\n{r['name']}: {r['status']}: " + " / ".join(r["error_tail"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory for the runs, the data, context_parallel.json and .md")
    p.add_argument("--model", default="moe8")
    p.add_argument("--lengths", type=lengths, default=[32768, 65536],
                   help="sequence lengths run on one GPU and on two (default: %(default)s)")
    p.add_argument("--cp-only", type=lengths, default=[131072, 262144],
                   help="sequence lengths run on two GPUs only (default: %(default)s)")
    p.add_argument("--checkpointing-from", type=int, default=262144,
                   help="rows of at least this many tokens train with --gradient-checkpointing (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--long-steps", type=int, default=3,
                   help="optimizer steps per run of rows above 65,536 tokens (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120, help="seconds per run (default: %(default)s)")
    p.add_argument("--long-timeout", type=float, default=150,
                   help="seconds per run of rows above 65,536 tokens (default: %(default)s)")
    p.add_argument("--fsdp", action="store_true",
                   help="two-GPU runs also shard the parameters over the same GPUs (--fsdp full_shard, FSDP2)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo): checks the machinery only")
    p.add_argument("--dry-run", action="store_true", help="write the data and print the commands; run nothing")
    args = p.parse_args(argv)
    if min(args.steps, args.long_steps) < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} --long-steps {args.long_steps} --warmup {args.warmup}: allowed: steps >= 1, "
                "--warmup >= 0")
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "long_rows.jsonl")
    longest = max(args.lengths + args.cp_only)
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "long_rows.py"), data, "--rows", "4", "--chars",
                    str(longest + 64), "--seed", str(args.seed)], check=True)
    runs = plan(args)
    for r in runs:
        r["warmup"] = args.warmup
    if args.dry_run:
        for r in runs:
            print(" ".join(command(r, args, data)))
        return 0
    gpus = 0
    if not args.cpu:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:
            p.error(f"this machine has {gpus} CUDA device(s); the benchmark needs 2 (or --cpu)")
    t0 = time.perf_counter()

    def timeout(run):
        return args.long_timeout if run["seq_len"] > 65536 else args.timeout

    singles = [r for r in runs if r["gpus"] == 1]
    for i in range(0, len(singles), max(gpus, 1)):  # one-GPU runs side by side, one per GPU
        batch = singles[i:i + max(gpus, 1)]
        procs = [start(r, args, data, None if args.cpu else str(k)) for k, r in enumerate(batch)]
        for r, proc in zip(batch, procs):
            finish(r, proc, timeout(r))
            print(f"   {r['name']}: {r['status']} in {r['wall_s']:.0f} s", flush=True)
    for r in runs:
        if r["gpus"] > 1:
            finish(r, start(r, args, data, None if args.cpu else "0,1"), timeout(r))
            print(f"   {r['name']}: {r['status']} in {r['wall_s']:.0f} s", flush=True)
    ratios = compare(runs, args.lengths)
    wall = time.perf_counter() - t0
    text = markdown(args, runs, ratios, wall)
    print("\n" + text)
    stack = next((r["stack"] for r in runs if r.get("stack")), None)
    with open(os.path.join(args.out, "context_parallel.json"), "w") as fh:
        json.dump({"args": vars(args), "runs": runs, "ratios": ratios, "wall_s": wall, "stack": stack,
                   "targets": {"speedup": TARGET_SPEEDUP, "memory_ratio": TARGET_MEMORY}}, fh, indent=2)
    with open(os.path.join(args.out, "context_parallel.md"), "w") as fh:
        fh.write(text)
    for r in runs:  # the adapters and checkpoints are not results
        if os.path.isdir(r["dir"]):
            for name in os.listdir(r["dir"]):
                if name == "final" or name.startswith("checkpoint-"):
                    shutil.rmtree(os.path.join(r["dir"], name), ignore_errors=True)
    os.remove(data)
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
