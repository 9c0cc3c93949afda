"""GPU benchmark of the block ops around the GDN layer at Qwen3.5-35B-A3B sizes (4096 tokens, bf16).

For each op: deltafuse's Triton kernel, the stock transformers implementation, and Liger's kernel when
``liger_kernel`` imports. Measures forward and forward+backward time (median of
``triton.testing.do_bench``, after warm-up, on random data) and the peak memory of one forward+backward
above what the inputs already hold; checks every output against the stock one before timing so that a
wrong kernel cannot post a time. Prints a table and writes JSON to the path given.

    python benchmarks/bench_block_ops.py results/block_ops.json [--tokens 4096] [--ops rms_norm,rope]
    python benchmarks/bench_block_ops.py out.json --dry-run     # CPU: parse, list the cases, exit
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from deltafuse.bench.cases import (  # noqa: E402  (shared with `deltafuse bench ops`)
    Sizes,
    liger_partial_rope,
    liger_rms_norm,
    liger_swiglu,
    rope_cos_sin,
)

OPS = ("rms_norm", "rms_norm_gated", "swiglu", "rope", "conv1d")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Case:
    op: str
    name: str
    shape: str
    make: Callable[[], dict]  # builds inputs on the GPU: {"inputs": [...], "grad_out": ...}
    impls: dict[str, Callable] = field(default_factory=dict)  # name -> fn(*inputs) -> tensor or tuple
    const: tuple[int, ...] = ()  # inputs that never need a gradient (RoPE's cos/sin)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="where to write the JSON results")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (default 4096)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    p.add_argument("--no-liger", action="store_true", help="skip Liger even when it imports")
    p.add_argument("--dry-run", action="store_true", help="list the cases and exit (no GPU needed)")
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        p.error(f"--ops has unknown op(s) {bad}; allowed: {', '.join(OPS)}")
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    args.ops = ops
    return args


# --- implementations ------------------------------------------------------------------------------------
def _liger():
    try:
        import liger_kernel  # noqa: F401
    except Exception as exc:  # not installed or broken: recorded, not fatal
        return None, f"liger_kernel does not import: {type(exc).__name__}: {exc}"
    return True, None


def build_cases(sizes: Sizes, dtype: torch.dtype, ops: list[str], use_liger: bool,
                dev: str = "cuda") -> tuple[list[Case], dict]:
    """Cases with their implementations; imports of GPU-only code happen here (call on the GPU machine)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    from deltafuse.ops.norm import api as norm_api
    from deltafuse.ops.norm.kernel import rms_norm_gated_triton, rms_norm_zero_centered_triton
    from deltafuse.ops.rope import api as rope_api
    from deltafuse.ops.swiglu import api as swiglu_api
    from deltafuse.ops.rope.kernel import apply_rotary_pos_emb_triton
    from deltafuse.ops.swiglu.kernel import swiglu_triton

    notes = {"deltafuse": "public op (argument checks + registry lookup, backend='triton'); "
                          "'deltafuse kernel' calls the Triton autograd function directly"}
    liger_ok = False
    if use_liger:
        liger_ok, why = _liger()
        if not liger_ok:
            notes["liger"] = why
    N, Hd, D = sizes.tokens, sizes.hidden, sizes.head_dim
    cases: list[Case] = []

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    if "rms_norm" in ops:
        for label, shape, view in (("hidden (input/post-attn/final)", (N, Hd), None),
                                   ("q_norm (strided q half)", (N, sizes.q_heads, D), "q"),
                                   ("k_norm", (N, sizes.kv_heads, D), None)):
            Dn = shape[-1]
            stock = hf.Qwen3_5MoeRMSNorm(Dn, eps=sizes.eps).to(dev, dtype)
            with torch.no_grad():
                stock.weight.normal_(0, 0.1)

            def make(shape=shape, view=view, stock=stock):
                if view == "q":  # q_proj output [N, H, 2D] split into query and gate halves, as transformers does
                    x = rnd(shape[0], shape[1], 2 * shape[2], scale=2)[..., : shape[2]]
                else:
                    x = rnd(*shape, scale=2)
                return {"inputs": [x, stock.weight], "grad_out": rnd(*shape)}

            impls = {"deltafuse": lambda x, w: norm_api.rms_norm_zero_centered(x, w, sizes.eps, backend="triton"),
                     "deltafuse kernel": lambda x, w: rms_norm_zero_centered_triton(x, w, sizes.eps),
                     "stock": lambda x, w, m=stock: m(x)}
            if liger_ok:
                try:
                    lmod = liger_rms_norm(Dn, sizes.eps).to(dev, dtype)
                    with torch.no_grad():
                        lmod.weight.copy_(stock.weight)
                    impls["liger"] = lambda x, w, m=lmod: m(x)
                except Exception as exc:
                    notes[f"liger rms_norm {label}"] = f"{type(exc).__name__}: {exc}"
            cases.append(Case("rms_norm", label, str(shape), make, impls))

    if "rms_norm_gated" in ops:
        rows, Dv = N * sizes.linear_value_heads, sizes.linear_value_head_dim
        stock = hf.Qwen3_5MoeRMSNormGated(Dv, eps=sizes.eps).to(dev, dtype)
        with torch.no_grad():
            stock.weight.normal_(1, 0.1)

        def make_g(stock=stock):
            return {"inputs": [rnd(rows, Dv), rnd(rows, Dv, scale=2), stock.weight], "grad_out": rnd(rows, Dv)}

        cases.append(Case("rms_norm_gated", "GDN output norm", str((rows, Dv)), make_g, {
            "deltafuse": lambda x, g, w: norm_api.rms_norm_gated(x, g, w, sizes.eps, backend="triton"),
            "deltafuse kernel": lambda x, g, w: rms_norm_gated_triton(x, g, w, sizes.eps),
            "stock": lambda x, g, w, m=stock: m(x, g)}))
        notes["liger rms_norm_gated"] = "Liger has no gated RMSNorm"

    if "swiglu" in ops:
        for label, rows, C, fused in (("shared expert", N, sizes.shared_expert_intermediate, False),
                                      ("routed experts (chunked gate_up)", N * sizes.experts_per_token,
                                       sizes.moe_intermediate, True)):
            def make_s(rows=rows, C=C, fused=fused):
                if fused:
                    gu = rnd(rows, 2 * C, scale=2)
                    g, u = gu.chunk(2, dim=-1)
                else:
                    g, u = rnd(rows, C, scale=2), rnd(rows, C)
                return {"inputs": [g, u], "grad_out": rnd(rows, C)}

            impls = {"deltafuse": lambda g, u: swiglu_api.swiglu(g, u, backend="triton"),
                     "deltafuse kernel": swiglu_triton,
                     "stock": lambda g, u: torch.nn.functional.silu(g) * u}
            if liger_ok:
                try:
                    impls["liger"] = liger_swiglu()
                except Exception as exc:
                    notes["liger swiglu"] = f"{type(exc).__name__}: {exc}"
            cases.append(Case("swiglu", label, str((rows, C)), make_s, impls))

    if "rope" in ops:
        rd = sizes.rotary_dim

        def make_r():
            q = rnd(1, N, sizes.q_heads, D).transpose(1, 2)  # transformers' [B, H, T, D] view
            k = rnd(1, N, sizes.kv_heads, D).transpose(1, 2)
            cos, sin = rope_cos_sin(N, rd, dev, dtype)
            return {"inputs": [q, k, cos, sin],
                    "grad_out": (rnd(1, sizes.q_heads, N, D), rnd(1, sizes.kv_heads, N, D))}

        impls = {"deltafuse": lambda q, k, c, s: rope_api.apply_rotary_pos_emb(q, k, c, s, backend="triton"),
                 "deltafuse kernel": apply_rotary_pos_emb_triton, "stock": hf.apply_rotary_pos_emb}
        if liger_ok:
            try:
                impls["liger (rotary slice + cat)"] = liger_partial_rope(rd)
            except Exception as exc:
                notes["liger rope"] = f"{type(exc).__name__}: {exc}"
        cases.append(Case("rope", f"partial RoPE q+k (rotary_dim {rd})",
                          f"q (1,{sizes.q_heads},{N},{D}) k (1,{sizes.kv_heads},{N},{D})", make_r, impls,
                          const=(2, 3)))
    if "conv1d" in ops:
        from deltafuse.ops.conv1d.kernel import causal_conv1d_fn_triton

        C = 2 * sizes.linear_key_heads * sizes.linear_key_head_dim + sizes.linear_value_heads * \
            sizes.linear_value_head_dim
        Wk = sizes.conv_kernel

        def make_c():
            x = rnd(1, N, C).transpose(1, 2)  # in_proj output [B, T, C] seen as [B, C, T], as transformers does
            return {"inputs": [x, rnd(C, Wk, scale=0.5)], "grad_out": rnd(1, C, N)}

        def stock_conv(x, w):
            # transformers' fallback without the causal-conv1d package: nn.Conv1d(padding=W-1) then SiLU
            return torch.nn.functional.silu(
                torch.nn.functional.conv1d(x, w.unsqueeze(1), None, padding=Wk - 1, groups=C)[..., :N])

        impls = {"deltafuse kernel": lambda x, w: causal_conv1d_fn_triton(x, w, None, "silu"),
                 "stock": stock_conv}
        try:
            from causal_conv1d import causal_conv1d_fn as cc_fn

            impls["causal-conv1d"] = lambda x, w: cc_fn(x, w, None, activation="silu")
        except Exception as exc:
            notes["causal-conv1d"] = f"not used: {type(exc).__name__}: {exc}"
        cases.append(Case("conv1d", f"GDN causal conv (W={Wk}) + SiLU", f"x (1,{C},{N})", make_c, impls))
    return cases, notes


# --- measurement ----------------------------------------------------------------------------------------
def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _leaves(inputs, const=()):
    """Fresh leaves requiring grad (parameters keep their identity and grad; ``const`` ones need none)."""
    out = []
    for i, t in enumerate(inputs):
        if isinstance(t, torch.nn.Parameter):
            out.append(t)
        else:
            out.append(t.detach().requires_grad_(i not in const))
    return out


def _rel_rms(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def measure(case: Case, warmup: int, rep: int) -> list[dict]:
    from triton.testing import do_bench

    data = case.make()
    grad_out = _as_tuple(data["grad_out"])
    results = []
    with torch.no_grad():
        stock_out = _as_tuple(case.impls["stock"](*data["inputs"]))
    for name, fn in case.impls.items():
        row = {"op": case.op, "case": case.name, "shape": case.shape, "impl": name}
        try:
            leaves = _leaves(data["inputs"], case.const)
            with torch.no_grad():
                out = _as_tuple(fn(*leaves))
            row["rel_rms_vs_stock"] = max(_rel_rms(o, s) for o, s in zip(out, stock_out))
            if row["rel_rms_vs_stock"] > 2e-2 or not all(torch.isfinite(o).all() for o in out):
                row["error"] = f"output differs from stock (rel_rms {row['rel_rms_vs_stock']:.2e}); not timed"
                results.append(row)
                continue

            def fwd():
                with torch.no_grad():
                    fn(*leaves)

            def fwd_bwd():
                outs = _as_tuple(fn(*leaves))
                torch.autograd.backward(outs, grad_out)

            row["fwd_ms"] = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
            row["fwd_bwd_ms"] = do_bench(fwd_bwd, warmup=warmup, rep=rep,
                                         grad_to_none=[t for t in leaves if t.requires_grad],
                                         return_mode="median")
            grads = [t for t in leaves if t.requires_grad]
            for t in grads:
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            for t in grads:
                t.grad = None
        except Exception as exc:  # one failing implementation must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"
        results.append(row)
    stock = next((r for r in results if r["impl"] == "stock" and "fwd_bwd_ms" in r), None)
    for r in results:
        if stock and "fwd_bwd_ms" in r:
            r["speedup_fwd_vs_stock"] = stock["fwd_ms"] / r["fwd_ms"]
            r["speedup_fwd_bwd_vs_stock"] = stock["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return results


def stack() -> dict:
    def ver(dist):
        try:
            import importlib.metadata as md

            return md.version(dist)
        except Exception:
            return None

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "triton": ver("triton"),
            "transformers": ver("transformers"), "liger_kernel": ver("liger-kernel") or ver("liger_kernel")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def format_table(rows: list[dict]) -> str:
    head = f"{'op':<15} {'case':<34} {'impl':<27} {'fwd ms':>8} {'f+b ms':>8} {'x stock':>8} {'peak MiB':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['op']:<15} {r['case'][:34]:<34} {r['impl'][:27]:<27} {'-':>8} {'-':>8} {'-':>8} "
                         f"{'-':>9}  {r['error'][:80]}")
            continue
        lines.append(f"{r['op']:<15} {r['case'][:34]:<34} {r['impl'][:27]:<27} {r['fwd_ms']:>8.4f} "
                     f"{r['fwd_bwd_ms']:>8.4f} {r.get('speedup_fwd_bwd_vs_stock', float('nan')):>7.2f}x "
                     f"{r['peak_mib']:>9.1f}  rel_rms vs stock {r['rel_rms_vs_stock']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = Sizes(tokens=args.tokens)
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        print(f"ops: {', '.join(args.ops)}; dtype {args.dtype}; sizes {sizes}; output {args.out}")
        return 0
    if not torch.cuda.is_available():
        print("bench_block_ops needs a CUDA GPU (use --dry-run to check the arguments here)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    cases, notes = build_cases(sizes, dtype, args.ops, not args.no_liger)
    rows = []
    for case in cases:
        rows.extend(measure(case, args.warmup, args.rep))
    print(format_table(rows))
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"stack": stack(), "sizes": sizes.__dict__, "dtype": args.dtype,
                                    "rows": rows, "notes": notes}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
