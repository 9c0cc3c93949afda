"""GPU benchmark: the experts' four grouped matmuls, torch's grouped kernel against deltafuse's Triton one.

At Qwen3.5-35B-A3B sizes (256 experts, top-8, H = 2,048, I = 512, bf16), for each token count and routing:

  gate_up      x[token] @ gate_up[e]^T  ([S, H] x [H, 2I]; the rows gathered from token order)
  down         act @ down[e]^T          ([S, I] x [I, H])
  dx_down      dout[token] @ down[e]    ([S, H] x [H, I]; gathered)
  dx_gate_up   dgu @ gate_up[e]         ([S, 2I] x [2I, H])

torch: ``torch.nn.functional.grouped_mm`` (CUTLASS on Hopper), after the gather ``x[token]`` where the row is
gathered (timed with the gather, as the experts op runs it, and without). triton: ``kernel_mm.grouped_mm_triton``
for each tile configuration in ``--configs`` (the gather inside the kernel). Each result is checked against
torch's: relative RMS, and both against a float64 product on a sample of experts.

Routing: ``uniform`` (each token's k experts uniformly at random: about S / E rows each, as a randomly
initialised router gives) and ``skewed`` (expert popularity ~ 1 / (rank + 8): a few experts with several times
the mean, many with few rows, as trained routers are).

Then the whole experts op (forward + backward, LoRA: no expert weight gradients, and full fine-tuning) with the
Triton matmuls on and off. Medians of ``triton.testing.do_bench`` (its L2 flush before each run).

    python benchmarks/bench_grouped_mm.py OUT.json [--tokens 4096 16384] [--configs 64x128x64x4x4 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from deltafuse.bench.cases import QWEN35_35B_A3B as SIZES  # noqa: E402

DEFAULT_CONFIGS = ["128x256x64x8x3", "128x256x64x8x4", "128x256x128x8x2", "256x128x64x8x3", "128x256x32x8x5",
                   "64x256x64x4x3", "128x128x64x8x4", "64x128x64x4x3"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tokens", type=int, nargs="+", default=[SIZES.tokens, 16384])
    p.add_argument("--routing", nargs="+", choices=["uniform", "skewed"], default=["uniform", "skewed"])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                   help="BMxBNxBKxWARPSxSTAGES tile configurations of the Triton kernel (default: %(default)s)")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time in ms (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        args.configs = [tuple(int(v) for v in c.lower().split("x")) for c in args.configs]
    except ValueError:
        p.error(f"--configs must be BMxBNxBKxWARPSxSTAGES, got {args.configs}")
    if any(len(c) != 5 for c in args.configs):
        p.error(f"--configs must have five parts each (BMxBNxBKxWARPSxSTAGES), got {args.configs}")
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must all be >= 1, got {args.tokens}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False); the CPU tests cover the kernel interpreted")
    return args


def routing(n_tokens, n_experts, k, kind, gen):
    if kind == "uniform":
        scores = torch.rand(n_tokens, n_experts, generator=gen)
    else:
        pop = 1.0 / (torch.arange(n_experts, dtype=torch.float64) + 8.0)
        pop = pop[torch.randperm(n_experts, generator=gen)]
        # Gumbel top-k: k distinct experts per token drawn with probability ~ popularity
        scores = pop.log() - torch.log(-torch.log(torch.rand(n_tokens, n_experts, generator=gen, dtype=torch.float64)))
    return scores.topk(k, dim=1).indices


def main(argv=None):
    args = parse_args(argv)
    import triton
    import triton.testing

    from deltafuse.ops.moe import kernel, kernel_mm, reference

    dev = "cuda"
    H, I, E, k = SIZES.hidden, SIZES.moe_intermediate, SIZES.num_experts, SIZES.experts_per_token
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
              "sizes": {"hidden": H, "intermediate": I, "experts": E, "top_k": k}, "cases": [], "op": []}
    bench = lambda fn: triton.testing.do_bench(fn, rep=args.rep, return_mode="median")  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dev, torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dev, torch.bfloat16)
    for n in args.tokens:
        for kind in args.routing:
            idx = routing(n, E, k, kind, gen).to(dev)
            plan = reference._Plan(idx, E)
            S = plan.token.numel()
            counts = torch.diff(plan.offs, prepend=plan.offs.new_zeros(1))
            x = torch.randn(n, H, generator=gen).to(dev, torch.bfloat16)
            act = torch.randn(S, I, generator=gen).to(dev, torch.bfloat16)
            dgu = torch.randn(S, 2 * I, generator=gen).to(dev, torch.bfloat16)
            mats = {"gate_up": (x, plan.token, gate_up.transpose(1, 2)), "down": (act, None, down.transpose(1, 2)),
                    "dx_down": (x, plan.token, down), "dx_gate_up": (dgu, None, gate_up)}
            sample = [int(e) for e in torch.topk(counts, 2).indices] + [int(counts.argmin())]
            for name, (a, rows, w) in mats.items():
                case = {"tokens": n, "routing": kind, "matmul": name, "rows_max": int(counts.max()),
                        "rows_min": int(counts.min()), "K": w.shape[1], "N": w.shape[2]}
                flops = 2.0 * S * w.shape[1] * w.shape[2]
                ag = a if rows is None else a[rows]
                want = reference._grouped_call(ag, w, plan.offs)
                case["torch_ms"] = bench(lambda: reference._grouped_call(a if rows is None else a[rows], w,
                                                                         plan.offs))
                if rows is not None:
                    case["torch_no_gather_ms"] = bench(lambda: reference._grouped_call(ag, w, plan.offs))
                ends = plan.offs.tolist()

                def f64_err(out):
                    errs = []
                    for e in sample:
                        lo, hi = (ends[e - 1] if e else 0), ends[e]
                        if hi > lo:
                            ref = ag[lo:hi].double() @ w[e].double()
                            errs.append(((out[lo:hi].double() - ref).norm() / ref.norm()).item())
                    return max(errs) if errs else 0.0

                case["torch_f64_err"] = f64_err(want)
                case["triton"] = []
                for bm, bn, bk, warps, stages in args.configs:
                    cfg = kernel_mm.MMConfig(bm, bn, bk, warps, stages)
                    row = {"config": f"{bm}x{bn}x{bk}x{warps}x{stages}"}
                    try:
                        tiles = kernel_mm.tile_map(plan.offs, S, bm)
                        got = kernel_mm.grouped_mm_triton(a, w, plan.offs, rows, tiles, cfg)
                        row["rel_rms_vs_torch"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
                        row["f64_err"] = f64_err(got)
                        row["ms"] = bench(lambda: kernel_mm.grouped_mm_triton(a, w, plan.offs, rows, tiles, cfg))
                        row["ms_with_tile_map"] = bench(lambda: kernel_mm.grouped_mm_triton(a, w, plan.offs, rows,
                                                                                             None, cfg))
                        row["tflops"] = flops / row["ms"] / 1e9
                    except Exception as exc:  # noqa: BLE001  (a config over the shared memory fails to compile)
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    case["triton"].append(row)
                ok = [r for r in case["triton"] if "ms" in r]
                best = min(ok, key=lambda r: r["ms"]) if ok else None
                case["best"] = best["config"] if best else None
                print(f"{n:6d} {kind:8s} {name:11s} torch {case['torch_ms']:.4f} ms"
                      + (f" (no gather {case['torch_no_gather_ms']:.4f})" if rows is not None else "")
                      + (f" | best triton {best['config']} {best['ms']:.4f} ms ({best['ms_with_tile_map']:.4f} with "
                         f"tile map) {best['tflops']:.0f} TFLOP/s rel {best['rel_rms_vs_torch']:.1e} f64 "
                         f"{best['f64_err']:.1e} vs torch {case['torch_f64_err']:.1e}" if best else " | no config ran"),
                      flush=True)
                result["cases"].append(case)
            # the whole op, forward + backward: LoRA (no expert weight gradients) and full fine-tuning
            for full in (False, True):
                for on in (True, False):
                    saved = kernel.TRITON_MM_CAPABILITIES
                    kernel.TRITON_MM_CAPABILITIES = saved if on else ()
                    try:
                        h = torch.randn(n, H, generator=gen).to(dev, torch.bfloat16).requires_grad_()
                        wts = torch.rand(n, k, generator=gen).softmax(-1).to(dev, torch.bfloat16).requires_grad_()
                        gu_p = gate_up.detach().requires_grad_(full)
                        dn_p = down.detach().requires_grad_(full)
                        dy = torch.randn(n, H, generator=gen).to(dev, torch.bfloat16)
                        leaves = [t for t in (h, wts, gu_p, dn_p) if t.requires_grad]

                        def step():
                            out = kernel.moe_experts_triton(h, idx, wts, gu_p, dn_p)
                            torch.autograd.grad(out, leaves, dy)

                        ms = bench(step)
                    finally:
                        kernel.TRITON_MM_CAPABILITIES = saved
                    row = {"tokens": n, "routing": kind, "full_finetune": full, "triton_mm": on, "ms": ms}
                    result["op"].append(row)
                    print(f"{n:6d} {kind:8s} op fwd+bwd {'full' if full else 'lora'} triton_mm={on}: {ms:.3f} ms",
                          flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
