"""Sweep of the chunked GDN kernels' options on one GPU: accuracy, per-stage time and peak memory per variant.

Each variant is a set of ``ChunkOptions`` overrides. For each: the relative RMS error of o and of every gradient
against the float64 step-by-step oracle (computed once, at ``--check-shape``, on fresh random data), then at
every shape the forward and forward+backward medians (``triton.testing.do_bench``), the device time of every
stage (CUDA events between kernel launches, median of ``--iters`` runs) and the peak memory of one
forward+backward. Stages are timed separately so the best setting of each kernel can be read off across
variants; a combination is only adopted after it has passed the oracle itself (rerun it as a variant).

    python benchmarks/tune_gdn.py --out sweep.json                     # the built-in sweep, every shape
    python benchmarks/tune_gdn.py --out a.json --part 0/2              # half the variants (one GPU of two)
    python benchmarks/tune_gdn.py --out b.json --variants 'bv_hfwd=64,warps_hfwd=4;prod_wy=16'

Writes JSON and prints a markdown table (variant x shape: fwd, fwd+bwd, the slowest stages, errors).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_gdn  # noqa: E402
from bench_gdn import (GATES, SHAPES, breakdown, head_shape, make, ours, rel,  # noqa: E402
                       shape_indices, stack, timing, variant_overrides)

from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402

# Bundles that change one kind of setting across all kernels at once, so that one run per bundle gives every
# stage's time under that setting (stage times are read per kernel).
SWEEP = [
    "",  # the defaults
    "fwd_prod_wh=16,fwd_prod_kv=16",
    "prod_wy=16,prod_bo=16,bwd_partials=input",
    "bv_hfwd=64,warps_hfwd=4,bv_out=128,warps_out=8,bv_sbwd=64,warps_sbwd=4,"
    "bv_wy=64,bv_bo=64,warps_bo=4,bt_red=64",
    "bv_hfwd=16,warps_hfwd=4,bv_out=32,bv_sbwd=16,warps_sbwd=4,warps_wy=4,warps_bo=4",
    "bv_hfwd=32,warps_hfwd=4,bv_sbwd=32,warps_sbwd=4,bv_intra=64,warps_dvl=8",
    "stages=3,stages_hfwd=3,stages_out=3,stages_sbwd=3,stages_dvl=3,stages_wy=3,stages_bo=3",
    "stages=1,stages_hfwd=1,stages_out=1,stages_sbwd=1,stages_dvl=1,stages_wy=1,stages_bo=1",
    "bo_two_pass=1,bk_out=128,warps_intra=8,warps_red=8",
    "bv_hfwd=64,warps_hfwd=8,bv_sbwd=64,warps_sbwd=8,fwd_prod_wh=16,fwd_prod_kv=16",
]

TOL = {"o": 3e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 1e-2, "dbeta": 1e-2}


def parse_shape(text: str) -> tuple[int, ...]:
    """B,T,H,HV,D from "B,T,H,HV,D"; ValueError says what is allowed."""
    try:
        shape = tuple(int(x) for x in text.split(","))
        if len(shape) == 5 and min(shape) >= 1:
            return shape
    except ValueError:
        pass
    raise ValueError(f"{text!r}; allowed: five positive ints B,T,H,HV,D")


def shape_and_options(ap: argparse.ArgumentParser, shape: str, options: str):
    """(shape, ChunkOptions) of a tool's ``--shape`` and ``--options`` values, or ``ap.error`` naming the bad one."""
    try:
        parsed = parse_shape(shape)
    except ValueError as e:
        ap.error(f"--shape {e}")
    try:
        return parsed, parse_variant(options)
    except ValueError as e:
        ap.error(f"--options: {e}")


def parse_variant(spec: str) -> chunk_mod.ChunkOptions:
    """``ChunkOptions`` from "field=value,..." overrides of the defaults; ValueError names a bad field or value."""
    return dataclasses.replace(chunk_mod.DEFAULT_OPTIONS, **variant_overrides(spec))


class Oracle:
    """float64 outputs and gradients at one shape, for one fixed random draw (computed once)."""

    def __init__(self, shape):
        B, T, H, HV, D = shape
        self.xs = make(B, T, H, HV, D, seed=1)
        b = [x.double().requires_grad_() for x in self.xs]
        ro, _ = naive_gated_delta_rule(*b, D**-0.5, None, False, True)
        self.do = torch.randn_like(ro)
        (ro * self.do).sum().backward()
        self.o = ro.detach()
        self.grads = [x.grad for x in b]

    def errors(self):
        a = [x.clone().requires_grad_() for x in self.xs]
        o = ours(*a)
        (o.double() * self.do).sum().backward()
        errs = {"o": rel(o, self.o)}
        for n, x, y in zip(("q", "k", "v", "g", "beta"), a, self.grads):
            errs["d" + n] = rel(x.grad, y)
        return errs, all(errs[n] <= t for n, t in TOL.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--variants", default=None, help="semicolon-separated ChunkOptions overrides (an empty item "
                    "is the defaults); default: the built-in sweep")
    ap.add_argument("--part", default="0/1", help="i/n: run every n-th variant starting at i (split over GPUs)")
    ap.add_argument("--shapes", default="all", type=shape_indices,
                    help="'all' or indices into bench_gdn.SHAPES, e.g. 0,1")
    ap.add_argument("--check-shape", default="1,1024,16,32,128", type=lambda x: head_shape(x, 5),
                    help="B,T,H,HV,D of the oracle check")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--iters", type=int, default=8, help="runs per stage timing")
    ap.add_argument("--gates", default="fast", choices=GATES,
                    help="how fast the inputs' gates decay (bench_gdn.py --gates): 'fast' or 'spread'")
    args = ap.parse_args()
    bench_gdn.gates_mode = args.gates
    specs = SWEEP if args.variants is None else args.variants.split(";")
    try:
        i, n = (int(x) for x in args.part.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise SystemExit(f"--part must be i/n with 0 <= i < n, got {args.part!r}") from None
    specs = specs[i::n]
    try:
        opts = [parse_variant(s) for s in specs]  # every spec checked before the GPU work starts
    except ValueError as e:
        ap.error(f"--variants: {e}")
    shapes = [SHAPES[j] for j in args.shapes]
    oracle = Oracle(args.check_shape)
    result = {"stack": stack(), "check_shape": args.check_shape, "gates": args.gates, "variants": []}
    for spec, opt in zip(specs, opts):
        row = {"variant": spec or "defaults", "shapes": {}}
        with chunk_mod.configured(opt):
            try:
                row["errors"], row["correct"] = oracle.errors()
                for shape in shapes:
                    t_f, t_fb, peak = timing(ours, shape, args.rep_ms)
                    row["shapes"][str(shape)] = dict(fwd_ms=t_f, fwdbwd_ms=t_fb, peak_gib=peak / 2**30,
                                                     stages=breakdown(shape, args.iters))
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["variants"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    lines = ["| variant | ok | max err (o, dq, dk) | " + " | ".join(f"{s[0]}x{s[1]} fwd / f+b ms" for s in shapes)
             + " |", "| --- | --- | --- | " + " | ".join("---" for _ in shapes) + " |"]
    for row in result["variants"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | error | {row['error'][:80]} |")
            continue
        e = row["errors"]
        cells = [f"{row['shapes'][str(s)]['fwd_ms']:.2f} / {row['shapes'][str(s)]['fwdbwd_ms']:.2f}"
                 for s in shapes if str(s) in row["shapes"]]
        lines.append(f"| {row['variant']} | {'yes' if row['correct'] else 'NO'} | "
                     f"{e['o']:.1e}, {e['dq']:.1e}, {e['dk']:.1e} | " + " | ".join(cells) + " |")
    result["table"] = "\n".join(lines)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(result["table"])


if __name__ == "__main__":
    main()
