"""`deltafuse bench ops`: forward and forward+backward time and peak memory of every op deltafuse routes.

For each op in deltafuse's registry it times deltafuse's public op (whatever the registry selects for the
call, named in the table) against the stock transformers code that computes the same thing in the Qwen3.5
models, and against Liger-Kernel (on CUDA, when ``liger_kernel`` imports) and flash-linear-attention /
causal-conv1d (on CUDA, when installed) where they have a kernel for the op:

* GDN ops: transformers' torch fallbacks (``torch_chunk_gated_delta_rule`` ...), at ``--shape`` B,T,H,HV,D.
* ``rms_norm_zero_centered`` / ``rms_norm_gated``: ``Qwen3_5RMSNorm.forward`` / ``Qwen3_5RMSNormGated.forward``.
* ``apply_rotary_pos_emb``: the modeling module's ``apply_rotary_pos_emb`` (partial RoPE).
* ``swiglu``: the MLP's ``act_fn(gate) * up``.
* ``fused_linear_cross_entropy``: ``lm_head`` (``F.linear``) then transformers' ``ForCausalLMLoss``.
* ``token_logprobs``: full logits (``F.linear``), ``log_softmax`` gathered at the targets and the entropy (what
  a trainer computes without a fused head), and TRL's ``ChunkedLogProbFunction`` when ``trl`` imports.
* ``moe_experts``: ``Qwen3_5MoeExperts`` with the ``grouped_mm`` and the eager experts forward.

These run at ``Sizes`` (``deltafuse/bench/cases.py``): Qwen3.5-35B-A3B at ``--tokens`` tokens on CUDA, a small
model of the same structure on CPU. Inputs are random (never zeros).
On CUDA: ``triton.testing.do_bench`` (median) when Triton is there, else CUDA events; peak memory is
``max_memory_allocated`` above what the inputs hold. On CPU: a plain ``perf_counter`` median; memory is not
measured. Each row also gives the largest absolute difference of the forward output from deltafuse's.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from deltafuse.backends import REGISTRY, probes
from deltafuse.bench.cases import CPU_SIZES, QWEN35_35B_A3B, Sizes, rope_cos_sin
from deltafuse.bench.impls import (CHUNK_GDN, implementations, lifted_fla_hopper_guard, selected_backend,
                                   sized_implementations)
from deltafuse.bench.ops_args import CPU_SHAPES, DEVICES, GDN_OPS, GPU_SHAPES, SIZED_DIMS, parse_shape
from deltafuse.train.errors import TrainInputError

CONV_WIDTH = 4
# ops Liger-Kernel has a kernel for (compared on CUDA)
LIGER_OPS = ("rms_norm_zero_centered", "apply_rotary_pos_emb", "swiglu", "fused_linear_cross_entropy")
# ops deltafuse routes only on some device types (elsewhere the model's own function runs, untouched)
ROUTED_ONLY_ON = {"sdpa_attention": ("npu",)}
# ops that only make sense inside a whole model step
TIMED_ELSEWHERE = {"packed_causal_attention": "used by the sdpa route for long packed rows; its effect is a "
                                              "whole-step effect: `deltafuse bench e2e --seq-len 16384`"}


def untimed(op: str, device) -> tuple[str, str] | None:
    """(impl label, note) of an op this benchmark does not time on ``device``, else None."""
    if op in TIMED_ELSEWHERE:
        return "deltafuse (inside the sdpa route)", TIMED_ELSEWHERE[op]
    if op in ROUTED_ONLY_ON and device.type not in ROUTED_ONLY_ON[op]:
        return "transformers (not routed)", (f"routed only on {', '.join(ROUTED_ONLY_ON[op])} devices; "
                                             f"transformers' own function serves {device.type}, so there is "
                                             "nothing to compare")
    return None
# inputs that never get a gradient (states the ops read, RoPE's tables)
NO_GRAD = ("conv_state", "initial_state", "cos", "sin")


def routed_ops() -> tuple[str, ...]:
    """Every op deltafuse's registry routes, in registration order."""
    return tuple(REGISTRY.ops)


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


def sized_shape(op: str, s: Sizes) -> list[int]:
    """The dimensions (named by ``SIZED_DIMS[op]``) of ``op``'s case at sizes ``s``."""
    N = s.tokens
    return {"rms_norm_zero_centered": [N, s.hidden],
            "rms_norm_gated": [N * s.linear_value_heads, s.linear_value_head_dim],
            "apply_rotary_pos_emb": [1, s.q_heads, s.kv_heads, N, s.head_dim, s.rotary_dim],
            "swiglu": [N, s.shared_expert_intermediate],
            "fused_linear_cross_entropy": [1, N, s.hidden, s.vocab],
            "token_logprobs": [N, s.hidden, s.vocab],
            "moe_experts": [N, s.hidden, s.num_experts, s.experts_per_token, s.moe_intermediate]}[op]


def make_sized_inputs(op: str, s: Sizes, dtype, device, seed: int = 0) -> dict:
    """Inputs of ``op`` as the Qwen3.5 layers hand them over, at sizes ``s`` (random, drawn on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N = s.tokens

    def rnd(*size, scale=1.0, shift=0.0, dt=dtype):
        t = torch.randn(*size, generator=gen, device=device, dtype=torch.float32)
        return (t * scale + shift).to(dt)

    if op == "rms_norm_zero_centered":  # input/post-attention/final norm over the hidden size
        return {"x": rnd(N, s.hidden, scale=2.0), "weight": rnd(s.hidden, scale=0.1)}
    if op == "rms_norm_gated":  # the GDN output norm, one row per token and value head
        rows, D = N * s.linear_value_heads, s.linear_value_head_dim
        return {"x": rnd(rows, D), "gate": rnd(rows, D, scale=2.0), "weight": rnd(D, scale=0.1, shift=1.0)}
    if op == "apply_rotary_pos_emb":  # q/k in transformers' [B, H, T, D] view of the projections' [B, T, H, D]
        cos, sin = rope_cos_sin(N, s.rotary_dim, device, dtype)
        return {"q": rnd(1, N, s.q_heads, s.head_dim).transpose(1, 2),
                "k": rnd(1, N, s.kv_heads, s.head_dim).transpose(1, 2), "cos": cos, "sin": sin}
    if op == "swiglu":  # the shared expert's (and dense MLP's) gate_proj(x), up_proj(x)
        return {"gate": rnd(N, s.shared_expert_intermediate, scale=2.0), "up": rnd(N, s.shared_expert_intermediate)}
    if op == "fused_linear_cross_entropy":  # final hidden states, a trainable lm_head, labels with some ignored
        labels = torch.randint(0, s.vocab, (1, N), generator=gen, device=device)
        labels[:, ::13] = -100
        return {"hidden": rnd(1, N, s.hidden), "weight": rnd(s.vocab, s.hidden, scale=s.hidden ** -0.5),
                "labels": labels}
    if op == "token_logprobs":  # the counted positions a fused LM head scores (TRL gathers them first)
        return {"hidden": rnd(N, s.hidden), "weight": rnd(s.vocab, s.hidden, scale=s.hidden ** -0.5),
                "targets": torch.randint(0, s.vocab, (N,), generator=gen, device=device)}
    if op == "moe_experts":  # router output of a softmax top-k router, renormalised, in the model dtype
        probs = torch.randn(N, s.num_experts, generator=gen, device=device).softmax(-1)
        top_w, top_i = probs.topk(s.experts_per_token, dim=-1)
        return {"hidden": rnd(N, s.hidden), "top_k_index": top_i,
                "top_k_weights": (top_w / top_w.sum(-1, keepdim=True)).to(dtype),
                "gate_up_proj": rnd(s.num_experts, 2 * s.moe_intermediate, s.hidden, scale=s.hidden ** -0.5),
                "down_proj": rnd(s.num_experts, s.hidden, s.moe_intermediate, scale=s.moe_intermediate ** -0.5)}
    raise KeyError(op)


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
        if isinstance(t, torch.Tensor) and t.is_floating_point() and key not in NO_GRAD:
            t = t.detach().clone().requires_grad_(True)
        out[key] = t
    return out


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def case_of(op: str, shape, sizes: Sizes, dtype, device):
    """(dims, shape, inputs, implementations) of ``op``: GDN ops at ``shape``, the others at ``sizes``."""
    if op in GDN_OPS:
        return "B,T,H,HV,D", list(shape), make_inputs(op, shape, dtype, device), None
    if op in SIZED_DIMS:
        return SIZED_DIMS[op], sized_shape(op, sizes), make_sized_inputs(op, sizes, dtype, device), \
            sized_implementations(op, sizes, device)
    return None, [], None, None


def bench_one(op: str, shape, dtype, device, reps: int, fla_unguarded: bool, sizes: Sizes | None = None) -> list[dict]:
    sizes = sizes or CPU_SIZES
    skip = untimed(op, device)
    if skip is not None:
        return [{"op": op, "dims": "-", "shape": [], "dtype": str(dtype).replace("torch.", ""),
                 "impl": skip[0], "note": skip[1]}]
    dims, dims_shape, inputs, impls = case_of(op, shape, sizes, dtype, device)
    base = {"op": op, "dims": dims or "-", "shape": dims_shape, "dtype": str(dtype).replace("torch.", "")}
    if inputs is None:  # an op registered after this benchmark was written
        return [{**base, "impl": "deltafuse", "note": "",
                 "error": "bench ops has no case for this op; nothing timed"}]
    if impls is None:
        impls = implementations(op, device, fla_unguarded)
    with lifted_fla_hopper_guard(fla_unguarded and op == CHUNK_GDN and device.type == "cuda"):
        return _time_implementations(base, inputs, impls, op, device, reps)


def _time_implementations(base: dict, inputs: dict, impls, op: str, device, reps: int) -> list[dict]:
    rows = []
    reference = None
    for name, call, note in impls:
        row = {**base, "impl": name, "note": note}
        if call is None:
            row["error"] = f"not available: {note}"
            row["note"] = ""
            rows.append(row)
            continue
        if name == "deltafuse":
            row["impl"] = f"deltafuse ({selected_backend(op, inputs, False)} fwd, " \
                          f"{selected_backend(op, inputs, True)} fwd+bwd)"
        try:
            with torch.no_grad():
                out = _as_tuple(call(inputs))
                row["fwd_ms"] = time_ms(lambda: call(inputs), device, reps)
                row["fwd_mem_bytes"] = peak_mem(lambda: call(inputs), device)
            if reference is None:
                reference = [o.float() for o in out]
            row["max_abs_diff"] = max(float((o.float() - r).abs().max()) for o, r in zip(out, reference))
        except Exception as exc:  # a kernel that cannot serve this shape/device: say why in its row
            row["error"] = "fwd: " + _error(exc)
            rows.append(row)
            continue
        try:
            ginputs = _with_grad(inputs)
            leaves = [t for t in ginputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
            grad_out = [torch.randn_like(o) for o in out]
            del out

            def fwd_bwd():
                torch.autograd.backward(_as_tuple(call(ginputs)), grad_out)

            row["fwd_bwd_ms"] = time_ms(fwd_bwd, device, reps, grad_to_none=leaves)
            row["fwd_bwd_mem_bytes"] = peak_mem(fwd_bwd, device)
        except Exception as exc:
            row["bwd_error"] = _error(exc)
        rows.append(row)
    return rows


def _ms(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def format_table(rows: list[dict]) -> str:
    head = ["op", "shape", "dtype", "implementation", "fwd ms", "fwd+bwd ms", "fwd MiB", "fwd+bwd MiB",
            "max |diff|", "note"]
    lines = []
    for r in rows:
        note = r.get("error") or (("bwd: " + r["bwd_error"]) if r.get("bwd_error") else "") or r.get("note", "")
        shape = ",".join(map(str, r["shape"]))
        shape = f"{r['dims']}={shape}" if r.get("dims", "-") != "-" else shape
        lines.append([r["op"], shape, r["dtype"], r["impl"], _ms(r.get("fwd_ms")),
                      _ms(r.get("fwd_bwd_ms")), _mib(r.get("fwd_mem_bytes")), _mib(r.get("fwd_bwd_mem_bytes")),
                      f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "-", note])
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(x) for x in lines])


# --- the command (its arguments: ``ops_args``) -------------------------------------------------------
def run_ops(args) -> list[dict]:
    from deltafuse.train.setup import DTYPES

    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device_name)
    except RuntimeError:
        raise TrainInputError(f"--device {args.device!r} is not a device; allowed: {DEVICES}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainInputError(f"--device {args.device!r}: no CUDA device is available here; allowed: auto, cpu")
    if device.type not in ("cpu", "cuda"):
        raise TrainInputError(f"--device {args.device!r}: allowed: {DEVICES}")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shapes = args.shape or [parse_shape(s) for s in (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)]
    base_sizes = QWEN35_35B_A3B if device.type == "cuda" else CPU_SIZES
    sizes = base_sizes.with_tokens(args.tokens) if getattr(args, "tokens", None) else base_sizes
    if args.output and os.path.isdir(args.output):
        raise TrainInputError(f"--output {args.output!r} is a directory; pass a JSON file path")
    rows = []
    for op in args.op or routed_ops():
        for shape in (shapes if op in GDN_OPS else [None]):
            got = bench_one(op, shape, dtype, device, args.reps, args.fla_unguarded, sizes)
            rows += got
            for r in got:
                print(f"{op} {r['dims']}={','.join(map(str, r['shape']))} {r['impl']}: fwd {_ms(r.get('fwd_ms'))} ms, "
                      f"fwd+bwd {_ms(r.get('fwd_bwd_ms'))} ms" + (f" ({r['error']})" if r.get("error") else ""),
                      flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    timer = "triton.testing.do_bench median" if device.type == "cuda" else f"perf_counter median of {args.reps}"
    print(f"\ndevice {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{str(dtype).replace('torch.', '')}, timer: {timer}; memory: "
          f"{'peak allocated above the inputs' if device.type == 'cuda' else 'not measured on CPU'}")
    print(format_table(rows))
    print(f"sizes of the non-GDN ops: {'Qwen3.5-35B-A3B' if device.type == 'cuda' else 'small CPU model'} "
          f"{sizes}")
    if device.type == "cuda":
        liger = probes.package_version("liger-kernel")
        print(f"Liger-Kernel {liger}: " if liger else "Liger-Kernel is not installed; ", end="")
        print(f"it has no kernel for {', '.join(o for o in routed_ops() if o not in LIGER_OPS)}")
    else:
        print("Liger-Kernel, flash-linear-attention and causal-conv1d are compared on CUDA only")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as fh:
            json.dump({"device": str(device), "dtype": str(dtype), "timer": timer, "sizes": sizes.__dict__,
                       "rows": rows}, fh, indent=2)
        print(f"wrote {args.output}")
    return rows
