"""One LoRA training step of a patched model, eager vs ``torch.compile(model)`` (default inductor).

The step is forward + backward of the causal-LM loss on one packed row (``--tokens`` tokens made of
``--sequences`` sequences of random lengths, position_ids restarting at 0 at each), LoRA r=16 on the
attention and GDN projections as ``deltafuse train`` sets it up (peft), no optimizer (both modes then see
the same weights at every step). Reports the median step time over ``--steps`` steps after warm-up
(synchronised on CUDA), the compile time (the first compiled step, backward included), the peak memory of a
step, the graph and graph-break counts of ``torch._dynamo.explain`` (with the breaks whose stack passes
through deltafuse's own files), and the difference of the losses and of the LoRA gradients of the first
step. Writes JSON and prints a markdown table.

    python benchmarks/compile_step.py benchmarks/results/compile_step.json              # H200: dense8, 4096
    python benchmarks/compile_step.py out.json --model tiny --device cpu --steps 3      # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import deltafuse  # noqa: E402
from deltafuse.models import build_model  # noqa: E402
from deltafuse.train.setup import add_lora, lora_targets  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--model", default="dense8", help="a named model of deltafuse.models (default dense8)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the packed row (default 4096)")
    p.add_argument("--sequences", type=int, default=8, help="sequences packed in the row (default 8)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("tokens", "sequences", "steps", "lora_r"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.sequences > args.tokens:
        p.error(f"--sequences {args.sequences} cannot exceed --tokens {args.tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for the smoke test)")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def _batch(vocab: int, tokens: int, sequences: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=g)[: sequences - 1] + 1
    bounds = [0] + sorted(int(c) for c in cuts) + [tokens]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    return ids.to(device), pos.to(device), [b - a for a, b in zip(bounds, bounds[1:])]


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(fn, model, ids, pos):
    loss = fn(input_ids=ids, labels=ids, position_ids=pos).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def _timed(fn, model, ids, pos, args) -> dict:
    for _ in range(args.warmup):
        _step(fn, model, ids, pos)
    _sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        _step(fn, model, ids, pos)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "peak_gib": peak}


def _breaks(model, ids, pos) -> dict:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(input_ids=ids, labels=ids, position_ids=pos)
    ours = os.path.dirname(deltafuse.__file__) + os.sep
    from_ours = sorted({f"{r.reason.splitlines()[0]} at {os.path.relpath(f.filename, REPO)}:{f.lineno}"
                        for r in ex.break_reasons for f in r.user_stack if f.filename.startswith(ours)})
    reasons = sorted({r.reason.splitlines()[0] for r in ex.break_reasons})
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons, "from_deltafuse": from_ours}


def main(argv=None) -> int:
    args = _args(argv)
    torch.manual_seed(args.seed)
    model = build_model(args.model, dtype=DTYPES[args.dtype], device=args.device, seed=args.seed)
    deltafuse.apply(model)
    model = add_lora(model, r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0,
                     targets=lora_targets(model, None, False), experts=False)
    model.train()
    ids, pos, lengths = _batch(model.config.vocab_size, args.tokens, args.sequences, args.device, args.seed)

    eager_loss, eager_grads = _step(model, model, ids, pos)
    eager = _timed(model, model, ids, pos, args)

    counts = _breaks(model, ids, pos)
    torch._dynamo.reset()
    compiled_model = torch.compile(model)
    _sync(args.device)
    t0 = time.perf_counter()
    loss, grads = _step(compiled_model, model, ids, pos)
    _sync(args.device)
    compile_s = time.perf_counter() - t0
    compiled = _timed(compiled_model, model, ids, pos, args)
    compiled["compile_s"] = compile_s

    grad_diff = max(((grads[n].float() - eager_grads[n].float()).norm() / eager_grads[n].float().norm().clamp_min(1e-30))
                    .item() for n in eager_grads)
    result = {
        "date": datetime.date.today().isoformat(),
        "stack": {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                  "torch": torch.__version__, "transformers": transformers.__version__, "triton": _triton_version()},
        "config": {"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "sequence_lengths": lengths,
                   "lora_r": args.lora_r, "steps": args.steps, "warmup": args.warmup},
        "eager": eager, "compiled": compiled, "explain": counts,
        "loss": {"eager": eager_loss.item(), "compiled": loss.item(), "abs_diff": abs(eager_loss - loss).item()},
        "lora_grad_max_rel_diff": grad_diff, "lora_grads": len(eager_grads),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    mem = lambda r: "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"  # noqa: E731
    print(f"{args.model}, {args.dtype}, 1 x {args.tokens} tokens ({args.sequences} sequences), LoRA r={args.lora_r}, "
          f"{result['stack']['device']}, torch {torch.__version__}")
    print("| mode | median step (ms) | compile (s) | peak memory (GiB) | graphs | graph breaks |")
    print("|---|---|---|---|---|---|")
    print(f"| eager | {eager['median_ms']:.1f} | - | {mem(eager)} | - | - |")
    print(f"| torch.compile | {compiled['median_ms']:.1f} | {compile_s:.1f} | {mem(compiled)} | {counts['graphs']} "
          f"| {counts['breaks']} ({len(counts['from_deltafuse'])} from deltafuse) |")
    print(f"loss eager {eager_loss.item():.6f} compiled {loss.item():.6f}; LoRA gradients: max relative "
          f"difference {grad_diff:.2e} over {len(eager_grads)} tensors; wrote {out}")
    for reason in counts["reasons"]:
        print(f"  break: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
