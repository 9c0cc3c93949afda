"""Several GPUs against one: `deltafuse train` with FSDP2 on N GPUs, the same training on one GPU.

Runs, each a separate `deltafuse train` process (group) with the same model, data, seed and flags:
  one-b1   one GPU, batch 1                 -> the per-GPU throughput of one GPU
  one-bN   one GPU, batch N                 -> the same global batch as the N-GPU run: its loss curve
  fsdp     N GPUs, FSDP2, batch 1 per GPU    (torchrun; deltafuse's default FSDP2 config)
  ddp      N GPUs, DDP, batch 1 per GPU      (with --ddp)
The two one-GPU runs go to different GPUs at the same time when there are two or more. Writes DIR/fsdp.json
and prints a markdown table: median step (steps after --warmup), tokens/s, scaling of tokens/s over one-b1,
peak memory (rank 0), and the loss of every step against one-bN's (same data, same weights at step 1).

    python benchmarks/fsdp_scaling.py DIR --model dense8 --lora --seq-len 4096 --max-steps 30 [--ddp] \
        [-- EXTRA deltafuse train FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def command(run: str, args, out_dir: str, extra: list[str]) -> tuple[list[str], dict]:
    nproc = args.nproc if run in ("fsdp", "ddp") else 1
    batch = args.nproc if run == "one-bN" else 1
    train = ["-m", "deltafuse.train", "--model", args.model, f"--{args.mode}", "--seq-len", str(args.seq_len),
             "--max-steps", str(args.max_steps), "--batch-size", str(batch), "--output-dir", out_dir, "--overwrite", "--no-progress", *extra]
    if run == "fsdp":
        train += ["--fsdp", "full_shard"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *train]
    else:
        cmd = [sys.executable, *train]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return cmd, env


def read(out_dir: str) -> tuple[list[dict], dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(os.path.join(out_dir, "summary.json")) as fh:
        return records, json.load(fh)


def row(run: str, records: list[dict], summary: dict, warmup: int) -> dict:
    timed = records[warmup:]
    step = statistics.median(r["step_time_s"] for r in timed)
    tokens = statistics.median(r["tokens"] for r in timed)
    return {"run": run, "world_size": summary["world_size"], "wrapped_model": summary["wrapped_model"],
            "distributed_type": summary["distributed_type"], "median_step_s": step, "tokens_per_step": tokens,
            "tokens_per_s": tokens / step, "peak_mem_gib": summary["peak_mem_bytes"] / 2**30,
            "losses": [r["loss"] for r in records], "final_loss": summary["final_loss"]}


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for the runs and fsdp.json")
    parser.add_argument("--model", default="dense8")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="mode", action="store_const", const="lora", default="lora")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--ddp", action="store_true", help="also the N-GPU DDP run")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count()
    if gpus < args.nproc:
        parser.error(f"--nproc {args.nproc}: this machine has {gpus} CUDA device(s)")
    os.makedirs(args.out, exist_ok=True)
    runs = ["one-b1", "one-bN", "fsdp"] + (["ddp"] if args.ddp else [])
    dirs = {run: os.path.join(args.out, f"{args.model}-{args.mode}-{run}") for run in runs}
    logs = {run: open(os.path.join(args.out, f"{args.model}-{args.mode}-{run}.log"), "w") for run in runs}
    failed = []

    def start(run: str, gpu: str | None):
        cmd, env = command(run, args, dirs[run], extra)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        print("==", " ".join(cmd), flush=True)
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=logs[run], stderr=subprocess.STDOUT)

    t0 = time.perf_counter()
    singles = [start("one-b1", "0"), start("one-bN", "1" if gpus > 1 else "0")] if gpus > 1 else []
    for run, proc in zip(("one-b1", "one-bN"), singles):
        if proc.wait() != 0:
            failed.append(run)
    if gpus == 1:
        for run in ("one-b1", "one-bN"):
            if start(run, "0").wait() != 0:
                failed.append(run)
    for run in runs[2:]:
        if start(run, None).wait() != 0:
            failed.append(run)
    rows = {}
    for run in runs:
        if run not in failed:
            records, summary = read(dirs[run])
            rows[run] = row(run, records, summary, args.warmup)
    base, same_batch = rows.get("one-b1"), rows.get("one-bN")
    print(f"\n{args.model} {args.mode}, {args.seq_len} tokens per row, {args.nproc} GPUs, steps "
          f"{args.warmup + 1}-{args.max_steps} timed ({time.perf_counter() - t0:.0f} s in all)\n")
    print("| run | GPUs | wrapped | median step (s) | tokens/step | tokens/s | x one-b1 | peak GiB (rank 0) | "
          "max abs loss diff vs one-bN | step-1 loss diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run, r in rows.items():
        scale = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        if same_batch and run not in ("one-b1", "one-bN"):
            diffs = [abs(a - b) for a, b in zip(r["losses"], same_batch["losses"])]
            r["loss_diff_max"], r["loss_diff_step1"] = max(diffs), diffs[0]
            dl = f"{r['loss_diff_max']:.4f} | {r['loss_diff_step1']:.5f}"
        else:
            dl = "- | -"
        r["scaling"] = scale
        print(f"| {run} | {r['world_size']} | {r['wrapped_model']} | {r['median_step_s']:.4f} | "
              f"{r['tokens_per_step']:.0f} | {r['tokens_per_s']:,.0f} | {scale:.2f} | {r['peak_mem_gib']:.2f} | {dl} |")
    for run in failed:
        print(f"| {run} | failed: see {logs[run].name} |")
    with open(os.path.join(args.out, f"fsdp-{args.model}-{args.mode}.json"), "w") as fh:
        json.dump({"args": vars(args), "extra": extra, "rows": rows, "failed": failed,
                   "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}, fh, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
