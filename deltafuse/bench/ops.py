"""`deltafuse bench ops`: forward and forward+backward time and peak memory of every op deltafuse routes.

For each op and shape it times deltafuse's public op (whatever the registry selects for the call, named in
the table), stock transformers' torch fallback (the function the Qwen3.5 modeling module falls back to when no
kernel package is installed), and flash-linear-attention / causal-conv1d when installed. Liger-Kernel has no
gated-delta-rule or causal-conv1d kernel, so it has no column here. Inputs are random (never zeros).
On CUDA: ``triton.testing.do_bench`` (median) when Triton is there, else CUDA events; peak memory is
``max_memory_allocated`` above what the inputs hold. On CPU: a plain ``perf_counter`` median; memory is not
measured. Each row also gives the largest absolute difference of the forward output from deltafuse's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deltafuse.train.errors import TrainInputError

OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
CPU_SHAPES = ("1,512,4,8,32",)
GPU_SHAPES = ("1,4096,16,32,128", "1,16384,16,32,128", "8,2048,16,32,128", "1,65536,16,32,128")
CONV_WIDTH = 4


def _shape(text: str) -> tuple[int, int, int, int, int]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape; allowed: B,T,H,HV,D with positive integers, "
                                         "e.g. 1,4096,16,32,128")
    if dims[3] % dims[2]:
        raise argparse.ArgumentTypeError(f"{text!r}: HV={dims[3]} must be a multiple of H={dims[2]}")
    return dims


# --- inputs ------------------------------------------------------------------------------------------
def make_inputs(op: str, shape, dtype, device, seed: int = 0) -> dict:
    B, T, H, HV, D = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dt)

    if op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        T = T if op == "chunk_gated_delta_rule" else 1
        q, k, v = rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, HV, D)
        g = torch.nn.functional.logsigmoid(rnd(B, T, HV, dt=torch.float32) + 4.0)  # decays near 1, as trained
        beta = torch.sigmoid(rnd(B, T, HV, dt=torch.float32)).to(dtype)
        state = rnd(B, HV, D, D, scale=0.1, dt=torch.float32) if op == "fused_recurrent_gated_delta_rule" else None
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}
    C = 2 * H * D + HV * D
    if op == "causal_conv1d_fn":
        return {"x": rnd(B, C, T), "weight": rnd(C, CONV_WIDTH, scale=0.5), "bias": rnd(C, scale=0.1)}
    return {"x": rnd(B, C, 1), "conv_state": rnd(B, C, CONV_WIDTH), "weight": rnd(C, CONV_WIDTH, scale=0.5),
            "bias": rnd(C, scale=0.1)}


# --- implementations ---------------------------------------------------------------------------------
def _stock_module():
    import importlib

    return importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")


def _stock_conv_fallback(x, weight, bias=None, activation=None):
    """What the GDN layer of the older design (transformers < 5.15) runs without causal-conv1d:
    F.silu(self.conv1d(x)[..., :T]) with the layer's depthwise Conv1d (padding W-1)."""
    out = torch.nn.functional.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[1] - 1,
                                     groups=x.shape[1])[..., : x.shape[-1]]
    return torch.nn.functional.silu(out) if activation is not None else out


def _stock_fn(name: str):
    """transformers' own torch path for ``name``, in either modeling design."""
    module = _stock_module()
    fn = getattr(module, name, None)
    if fn is None and name == "causal_conv1d_fn":
        return _stock_conv_fallback  # older design: the global is None and the layer calls its Conv1d
    if fn is None and name == "causal_conv1d_update":
        fn = module.torch_causal_conv1d_update  # older design: the layer's fallback
    return getattr(fn, "__wrapped__", fn)  # the torch path under the kernel-hub decorator


def _gdn_call(fn, style: str):
    def call(t):
        q, k = t["q"], t["k"]
        HV = t["v"].shape[2]
        if style == "stock_repeat" and q.shape[2] != HV:
            q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
        out = fn(q, k, t["v"], g=t["g"], beta=t["beta"], initial_state=t["initial_state"],
                 output_final_state=t["initial_state"] is not None, use_qk_l2norm_in_kernel=True)
        return out[0]

    return call


def implementations(op: str, device: torch.device, fla_unguarded: bool) -> list[tuple[str, object, str]]:
    """(name, callable(inputs) -> output tensor, note) for every implementation that can be tried here."""
    import deltafuse.ops as dops
    from deltafuse.backends import probes

    impls = []
    gdn = op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
    if gdn:
        impls.append(("deltafuse", _gdn_call(getattr(dops, op), "fla"), ""))
        stock_name = ("torch_chunk_gated_delta_rule" if op == "chunk_gated_delta_rule"
                      else "torch_recurrent_gated_delta_rule")
        from transformers import __version__ as tv

        style = "fla" if probes.version_tuple(tv) >= (5, 23) else "stock_repeat"
        impls.append(("transformers torch", _gdn_call(_stock_fn(stock_name), style), ""))
        if device.type == "cuda" and probes.import_error("fla.ops.gated_delta_rule") is None:
            import fla.ops.gated_delta_rule as fla_gdr

            note = ""
            if fla_unguarded and op == "chunk_gated_delta_rule":
                import fla.ops.common.chunk_o as chunk_o

                if getattr(chunk_o, "IS_NVIDIA_HOPPER", False):
                    chunk_o.IS_NVIDIA_HOPPER = False
                    note = "FLA's Hopper guard set off for timing (its backward is wrong on this stack)"
            impls.append(("fla", _gdn_call(getattr(fla_gdr, op), "fla"), note))
        return impls
    if op == "causal_conv1d_fn":
        impls.append(("deltafuse", lambda t: dops.causal_conv1d_fn(t["x"], t["weight"], t["bias"],
                                                                  activation="silu"), ""))
        stock = _stock_fn("causal_conv1d_fn")
        impls.append(("transformers torch", lambda t: stock(t["x"], t["weight"], t["bias"], activation="silu"), ""))
        if device.type == "cuda" and probes.import_error("causal_conv1d") is None:
            import causal_conv1d

            impls.append(("causal-conv1d", lambda t: causal_conv1d.causal_conv1d_fn(
                t["x"], t["weight"], t["bias"], activation="silu"), ""))
        return impls
    # causal_conv1d_update mutates conv_state: every call gets its own copy (the copy is timed for all alike)
    impls.append(("deltafuse", lambda t: dops.causal_conv1d_update(t["x"], t["conv_state"].clone(), t["weight"],
                                                                   t["bias"], activation="silu"), ""))
    stock = _stock_fn("causal_conv1d_update")
    impls.append(("transformers torch", lambda t: stock(t["x"], t["conv_state"].clone(), t["weight"], t["bias"],
                                                        activation="silu"), ""))
    if device.type == "cuda" and probes.import_error("causal_conv1d") is None:
        import causal_conv1d

        impls.append(("causal-conv1d", lambda t: causal_conv1d.causal_conv1d_update(
            t["x"], t["conv_state"].clone(), t["weight"], t["bias"], activation="silu"), ""))
    return impls


def selected_backend(op: str, inputs: dict, needs_grad: bool) -> str:
    from deltafuse import backends

    first = inputs.get("q", inputs.get("x"))
    call = backends.CallInfo(first.device, first.dtype, needs_grad)
    chosen = [d.candidate for d in backends.REGISTRY.explain(op, call, backends.current_backend()) if d.chosen]
    return chosen[0] if chosen else "none"


# --- timing ------------------------------------------------------------------------------------------
def time_ms(fn, device: torch.device, reps: int, grad_to_none=None) -> float:
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
        except ImportError:
            pass
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def peak_mem(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _with_grad(inputs: dict) -> dict:
    out = {}
    for key, t in inputs.items():
        if t is not None and t.is_floating_point() and key not in ("conv_state", "initial_state"):
            t = t.detach().clone().requires_grad_(True)
        out[key] = t
    return out


def bench_one(op: str, shape, dtype, device, reps: int, fla_unguarded: bool) -> list[dict]:
    inputs = make_inputs(op, shape, dtype, device)
    rows = []
    reference = None
    for name, call, note in implementations(op, device, fla_unguarded):
        row = {"op": op, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "impl": name,
               "note": note}
        if name == "deltafuse":
            row["impl"] = f"deltafuse ({selected_backend(op, inputs, False)} fwd, " \
                          f"{selected_backend(op, inputs, True)} fwd+bwd)"
        try:
            with torch.no_grad():
                out = call(inputs)
                row["fwd_ms"] = time_ms(lambda: call(inputs), device, reps)
                row["fwd_mem_bytes"] = peak_mem(lambda: call(inputs), device)
            if reference is None:
                reference = out.float()
            row["max_abs_diff"] = float((out.float() - reference).abs().max())
        except Exception as exc:  # a kernel that cannot serve this shape/device: say why in its row
            row["error"] = f"fwd: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            rows.append(row)
            continue
        try:
            ginputs = _with_grad(inputs)
            leaves = [t for t in ginputs.values() if t is not None and t.requires_grad]
            grad_out = torch.randn_like(out)

            def fwd_bwd():
                call(ginputs).backward(grad_out)

            row["fwd_bwd_ms"] = time_ms(fwd_bwd, device, reps, grad_to_none=leaves)
            row["fwd_bwd_mem_bytes"] = peak_mem(fwd_bwd, device)
        except Exception as exc:
            row["bwd_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        rows.append(row)
    return rows


def _ms(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def format_table(rows: list[dict]) -> str:
    head = ["op", "B,T,H,HV,D", "dtype", "implementation", "fwd ms", "fwd+bwd ms", "fwd MiB", "fwd+bwd MiB",
            "max |diff|", "note"]
    lines = []
    for r in rows:
        note = r.get("error") or (("bwd: " + r["bwd_error"]) if r.get("bwd_error") else "") or r.get("note", "")
        lines.append([r["op"], ",".join(map(str, r["shape"])), r["dtype"], r["impl"], _ms(r.get("fwd_ms")),
                      _ms(r.get("fwd_bwd_ms")), _mib(r.get("fwd_mem_bytes")), _mib(r.get("fwd_bwd_mem_bytes")),
                      f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "-", note])
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(x) for x in lines])


# --- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltafuse.train.cli import _int_at_least

    parser.description = ("Per-op forward and forward+backward time (median) and peak memory of every op "
                          "deltafuse routes: deltafuse's selected implementation vs stock transformers' torch "
                          "fallback vs flash-linear-attention / causal-conv1d when installed.")
    parser.add_argument("--op", action="append", choices=OPS, default=None,
                        help="op to time (repeatable; default: all)")
    parser.add_argument("--shape", action="append", type=_shape, default=None, metavar="B,T,H,HV,D",
                        help=f"shape (repeatable; default: {' '.join(CPU_SHAPES)} on CPU, the DESIGN.md "
                             f"reference shapes {' '.join(GPU_SHAPES)} on CUDA)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="input dtype (default auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--reps", metavar="N", type=_int_at_least(1), default=5,
                        help="timed repetitions on CPU / without Triton (default: 5)")
    parser.add_argument("--fla-unguarded", action="store_true",
                        help="set FLA's Hopper guard off so its backward can be timed (its gradients are wrong "
                             "there; marked in the table)")
    parser.add_argument("--output", default=None, metavar="JSON", help="also write the rows as JSON here")


def run_ops(args) -> list[dict]:
    from deltafuse.train.setup import DTYPES

    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_name)
    except RuntimeError:
        raise TrainInputError(f"--device {args.device!r} is not a device; allowed: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainInputError(f"--device {args.device!r}: no CUDA device is available here; allowed: auto, cpu")
    if device.type not in ("cpu", "cuda"):
        raise TrainInputError(f"--device {args.device!r}: allowed: auto, cpu, cuda, cuda:N")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shapes = args.shape or [_shape(s) for s in (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)]
    if args.output and os.path.isdir(args.output):
        raise TrainInputError(f"--output {args.output!r} is a directory; pass a JSON file path")
    rows = []
    for op in args.op or OPS:
        for shape in shapes:
            got = bench_one(op, shape, dtype, device, args.reps, args.fla_unguarded)
            rows += got
            for r in got:
                print(f"{op} {','.join(map(str, shape))} {r['impl']}: fwd {_ms(r.get('fwd_ms'))} ms, "
                      f"fwd+bwd {_ms(r.get('fwd_bwd_ms'))} ms" + (f" ({r['error']})" if r.get("error") else ""),
                      flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    timer = "triton.testing.do_bench median" if device.type == "cuda" else f"perf_counter median of {args.reps}"
    print(f"\ndevice {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{str(dtype).replace('torch.', '')}, timer: {timer}; memory: "
          f"{'peak allocated above the inputs' if device.type == 'cuda' else 'not measured on CPU'}")
    print(format_table(rows))
    from deltafuse.backends import probes

    liger = probes.package_version("liger-kernel")
    if liger:
        print(f"Liger-Kernel {liger} is installed; it has no gated-delta-rule or causal-conv1d kernel to compare")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as fh:
            json.dump({"device": str(device), "dtype": str(dtype), "timer": timer, "rows": rows}, fh, indent=2)
        print(f"wrote {args.output}")
    return rows
