"""Causal conv1d kernels (the GDN layer's short convolution) against the torch route and causal-conv1d.

For each shape (B, T, C) with W = 4, SiLU, no bias, x in the [B, T, C]-major transposed view transformers
passes: checks deltafuse's Triton forward and backward against the float64 torch reference (relative RMS
error, outputs allocated over poisoned memory so an element left unwritten shows), then times forward and
forward+backward (median of ``triton.testing.do_bench``) for deltafuse, the torch route and the
``causal-conv1d`` package when it imports, with and without sequence resets (packed rows). Then the decoding
update (one token, C = 8192) at batch 1, 32, 128, Triton vs the torch route. ``--sweep`` times a grid of
``ConvOptions`` per shape and prints the best. Writes JSON (``--out``) and prints a markdown table last.

    python benchmarks/bench_conv1d.py --out results/conv1d.json
    python benchmarks/bench_conv1d.py --out results/conv1d-sweep.json --sweep --shapes "1,4096,8192"
    python benchmarks/bench_conv1d.py --smoke --out /tmp/conv.json     # CPU: tiny shapes, Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = [(1, 4096, 8192), (1, 16384, 8192), (1, 65536, 8192), (8, 2048, 8192)]
SMOKE_SHAPES = [(1, 11, 12), (2, 6, 9)]
UPDATE_BATCHES = [1, 32, 128]
SMOKE_UPDATE_BATCHES = [1, 3]
W = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    p.add_argument("--sweep", action="store_true", help="time a grid of ConvOptions per shape, print the best")
    p.add_argument("--shapes", default=None, help="B,T,C triples separated by ';' (default: the four reference "
                                                  "shapes, or tiny ones with --smoke)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    args = p.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip()]
        except ValueError:
            p.error(f"--shapes must be B,T,C triples separated by ';', got {args.shapes!r}")
        if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
            p.error(f"--shapes must be B,T,C triples of positive ints separated by ';', got {args.shapes!r}")
    args.shape_list = shapes
    if args.warmup < 0 or args.rep < 1:
        p.error(f"--warmup must be >= 0 and --rep >= 1, got {args.warmup} and {args.rep}")
    return args


def _environment(torch, triton):
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import causal_conv1d

        env["causal_conv1d"] = getattr(causal_conv1d, "__version__", "unknown")
    except Exception as exc:  # not installed or broken: recorded, not fatal
        env["causal_conv1d"] = f"does not import ({type(exc).__name__})"
    return env


def _causal_conv1d_package():
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    except Exception:
        return None, None
    return causal_conv1d_fn, causal_conv1d_update


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    if not args.smoke and not torch.cuda.is_available():
        print("bench_conv1d: no CUDA device here; run with --smoke on a CPU", file=sys.stderr)
        return 2
    import triton

    from deltafuse.ops.conv1d import kernel as K
    from deltafuse.ops.conv1d import kernel_update as KU
    from deltafuse.ops.conv1d.reference import causal_conv1d_fn_torch, causal_conv1d_update_torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter emulates fp32 only
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-6
    pkg_fn, pkg_update = _causal_conv1d_package() if device == "cuda" else (None, None)

    def timed(fn):
        if device == "cuda":
            return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))
        times = []
        for _ in range(1 if args.smoke else 3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def poison():
        """Fill the allocator's free memory with NaN so that an output element left unwritten is caught."""
        if device == "cuda":
            free = torch.cuda.mem_get_info()[0]
            block = torch.full((min(free // 4, 2 << 30) // 2,), float("nan"), dtype=torch.bfloat16, device=device)
            del block

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300))

    rows, sweeps, checks = [], [], []
    gen = torch.Generator().manual_seed(0)
    for B, T, C in args.shape_list:
        x = torch.randn(B, T, C, generator=gen).transpose(1, 2).to(device, dtype)
        w = (torch.randn(C, W, generator=gen) * 0.5).to(device, dtype)
        dy = torch.randn(B, T, C, generator=gen).transpose(1, 2).to(device, dtype)
        bounds = sorted({0, T} | {int(v) for v in torch.randint(1, max(T, 2), (max(T // 512, 3),), generator=gen)
                                  if 0 < int(v) < T})
        cu = torch.tensor(bounds, dtype=torch.int32, device=device) if B == 1 else None
        seq_idx = None
        if B > 1:  # rows of two sequences each
            seq_idx = (torch.arange(T, device=device) >= T // 3).int()[None].expand(B, T).contiguous()
        gb = B * T * C * x.element_size() / 1e9  # one pass over x
        for packed in (False, True):
            kw = dict(cu_seqlens=cu, seq_idx=seq_idx) if packed else {}
            shape = f"B={B} T={T} C={C}" + (" packed" if packed else "")

            def ours(xl, wl):
                return K.causal_conv1d_fn_triton(xl, wl, None, "silu", **kw)

            def torch_route(xl, wl):
                return causal_conv1d_fn_torch(xl, wl, None, "silu", **kw)

            impls = {"deltafuse triton": ours, "torch route": torch_route}
            if pkg_fn is not None:
                pkg_seq = seq_idx if seq_idx is not None else (
                    torch.searchsorted(cu[1:], torch.arange(T, device=device), right=True).int()[None]
                    if cu is not None else None)

                def package(xl, wl, pkg_seq=pkg_seq):
                    return pkg_fn(xl, wl, None, seq_idx=pkg_seq if packed else None, activation="silu")

                impls["causal-conv1d"] = package
            # correctness against the float64 torch reference, over poisoned memory
            xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
            ref = causal_conv1d_fn_torch(xr, wr, None, "silu", **kw)
            ref.backward(dy.double())
            for name, fn in impls.items():
                xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
                poison()
                try:
                    out = fn(xl, wl)
                    out.backward(dy)
                except Exception as exc:  # e.g. the package refusing a layout: recorded, not fatal
                    checks.append({"shape": shape, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                errs = {"out": rel(out, ref), "dx": rel(xl.grad, xr.grad), "dweight": rel(wl.grad, wr.grad)}
                finite = bool(torch.isfinite(out).all() and torch.isfinite(xl.grad).all()
                              and torch.isfinite(wl.grad).all())
                checks.append({"shape": shape, "impl": name, **errs, "finite": finite,
                               "ok": finite and max(errs.values()) <= tol})
            # timing
            for name, fn in impls.items():
                if not any(c["impl"] == name and c["shape"] == shape and c.get("ok") for c in checks):
                    continue  # a wrong or failing implementation posts no time
                xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
                fwd = timed(lambda: fn(x, w))

                def step():
                    xl.grad = wl.grad = None
                    fn(xl, wl).backward(dy)

                both = timed(step)
                rows.append({"kind": "fn", "shape": shape, "impl": name, "fwd_ms": fwd, "fwd_bwd_ms": both,
                             "bwd_ms": both - fwd, "fwd_TBps": 2 * gb / fwd if fwd else None,
                             "bwd_TBps": 3 * gb / (both - fwd) if both > fwd else None})
            if args.sweep and not packed:
                sweeps.append(_sweep(K, x, w, dy, timed, shape, args.smoke))

    # the decoding update: one token, C = 8192 (tiny under --smoke)
    C = 8192 if device == "cuda" else 12
    for B in (UPDATE_BATCHES if device == "cuda" else SMOKE_UPDATE_BATCHES):
        w = (torch.randn(C, W, generator=gen) * 0.5).to(device, dtype)
        bias = torch.randn(C, generator=gen).to(device, dtype)
        state0 = torch.randn(B, C, W, generator=gen).to(device, dtype)
        x = torch.randn(B, 1, C, generator=gen).transpose(1, 2).to(device, dtype)
        shape = f"update B={B} C={C}"
        s_ref = state0.clone()
        ref = causal_conv1d_update_torch(x, s_ref, w, bias, "silu")
        s64 = state0.double()
        ref64 = causal_conv1d_update_torch(x.double(), s64, w.double(), bias.double(), "silu")
        impls = {"deltafuse triton": KU.causal_conv1d_update_triton, "torch route": causal_conv1d_update_torch}
        if pkg_update is not None:
            impls["causal-conv1d"] = lambda x_, s_, w_, b_, a_: pkg_update(x_, s_, w_, b_, a_)
        for name, fn in impls.items():
            state = state0.clone()
            poison()
            try:
                out = fn(x, state, w, bias, "silu")
            except Exception as exc:
                checks.append({"shape": shape, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            err = rel(out, ref64)
            same_state = bool(torch.equal(state, s_ref))
            checks.append({"shape": shape, "impl": name, "out": err, "state_equal_torch": same_state,
                           "ok": bool(torch.isfinite(out).all()) and err <= tol and same_state})
            if checks[-1]["ok"]:
                rows.append({"kind": "update", "shape": shape, "impl": name,
                             "fwd_ms": timed(lambda: fn(x, state, w, bias, "silu"))})
        del ref

    result = {"environment": _environment(torch, triton), "device": device, "dtype": str(dtype),
              "defaults": asdict(K.DEFAULT_OPTIONS), "checks": checks, "rows": rows, "sweeps": sweeps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    bad = [c for c in checks if not c.get("ok")]
    for c in bad:
        print(f"CHECK FAILED: {c}")
    for s in sweeps:
        print(f"best options for {s['shape']}: fwd {s['best_fwd']} ({s['best_fwd_ms']:.4f} ms), "
              f"bwd {s['best_bwd']} ({s['best_bwd_ms']:.4f} ms)")
    print(_table(rows, device))
    return 1 if any(c["impl"] == "deltafuse triton" for c in bad) else 0


def _sweep(K, x, w, dy, timed, shape, smoke):
    """Forward and backward grids of ConvOptions (the backward timed alone: autograd.grad over a kept graph)."""
    if smoke:
        fwd_grid = [dict(fwd_block_c=c, fwd_block_t=t, fwd_prefetch=p) for c, t, p in [(8, 4, 2), (4, 3, 0)]]
        bwd_grid = [dict(bwd_block_c=c, bwd_block_t=t, bwd_prefetch=p) for c, t, p in [(8, 4, 3), (4, 5, 1)]]
    else:
        # 30 configurations per pass (about a minute and a half with compilation per shape); Triton's
        # pipelining (stages) is tried once on the default tiles, it does not take these loads in Triton 3.9
        fwd_grid = [dict(fwd_block_c=c, fwd_warps=nw, fwd_block_t=t, fwd_prefetch=p)
                    for c, nw, t, p in itertools.product((128, 256, 512), (1, 2), (32, 64, 128), (2, 4))
                    if c // (32 * nw) >= 2] + [dict(fwd_stages=3)]
        bwd_grid = [dict(bwd_block_c=c, bwd_warps=nw, bwd_block_t=t, bwd_prefetch=p)
                    for c, nw, t, p in itertools.product((64, 128, 256), (1, 2), (32, 64, 128), (2, 4))
                    if c // (32 * nw) >= 2] + [dict(bwd_stages=3)]
    base = K.INTERPRET_OPTIONS if smoke else K.DEFAULT_OPTIONS
    out = {"shape": shape, "fwd": [], "bwd": []}
    for grid, which in ((fwd_grid, "fwd"), (bwd_grid, "bwd")):
        for change in grid:
            opts = replace(base, **change)
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            try:
                with K.configured(opts):
                    if which == "fwd":
                        ms = timed(lambda: K.causal_conv1d_fn_triton(x, w, None, "silu"))
                    else:
                        y = K.causal_conv1d_fn_triton(xl, wl, None, "silu")
                        ms = timed(lambda: torch_autograd_grad(y, (xl, wl), dy))
            except Exception as exc:  # a configuration the compiler refuses (registers, shared memory)
                out[which].append({**change, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            out[which].append({**change, "ms": ms})
        timed_rows = [r for r in out[which] if "ms" in r]
        best = min(timed_rows, key=lambda r: r["ms"]) if timed_rows else None
        out[f"best_{which}"] = {k: v for k, v in best.items() if k != "ms"} if best else None
        out[f"best_{which}_ms"] = best["ms"] if best else float("nan")
    return out


def torch_autograd_grad(y, inputs, dy):
    import torch

    return torch.autograd.grad(y, inputs, dy, retain_graph=True)


def _table(rows, device) -> str:
    lines = [f"| shape | implementation | fwd ms | fwd+bwd ms | bwd ms | fwd TB/s | bwd TB/s |  ({device})",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for r in rows:
        lines.append(f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.4f} | {f(r.get('fwd_bwd_ms'), '.4f')} | "
                     f"{f(r.get('bwd_ms'), '.4f')} | {f(r.get('fwd_TBps'), '.2f')} | {f(r.get('bwd_TBps'), '.2f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
