"""Gated delta rule kernels on one GPU: correctness against float64, then forward / forward+backward
time and peak memory, for the HF torch fallback, FLA and deltafuse's Triton kernels, side by side.

    python3 benchmarks/bench_gdn.py --out $OUT/gdn.json

Correctness: relative RMS error vs the float64 step-by-step oracle at a small shape, for o and for each
gradient (random upstream gradient). Timing: median of ``triton.testing.do_bench`` after warm-up, on
random non-zero bf16 data, with use_qk_l2norm_in_kernel=True; ``--gates`` sets how fast the gates decay (see
``make``). Memory: peak allocated during one
forward+backward minus what was allocated before it (inputs and upstream gradient excluded; the gradients it
produces included: up to session 18 the base still held the warm-up call's gradients, so the figures of those
runs are lower by about their size).

Packed rows (``--packed``): one row of ``--packed-tokens`` tokens cut into many sequences (cu_seqlens):
one sequence, all of length 1, lengths uniform in 1..16, and a mix of long and short; each implementation's
time is compared with its own time on the one-sequence row (the cost of many short sequences). The HF
fallback has no cu_seqlens support (it ignores or refuses them), so it has no packed rows; deltafuse's torch
reference (the backend where Triton is unavailable) has.

FLA 0.6 refuses the GDN backward on Hopper with Triton < 3.7.1 (its outputs are wrong there). For the
timing rows only, its guard ``fla.ops.common.chunk_o.IS_NVIDIA_HOPPER`` is set to False; those rows are
labelled "fla (guard off)" and their correctness column shows what that backward computes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402

SHAPES = [(1, 4096, 16, 32, 128), (1, 16384, 16, 32, 128), (8, 2048, 16, 32, 128), (1, 65536, 16, 32, 128)]


def _uniform_lengths(total, lo, hi, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def _mixed_lengths(total):
    """Half the tokens in one sequence, a quarter in a second, the rest in 1, 3, 64, 65, 200 and 1..16."""
    lengths = [total // 2, total // 4]
    rest = total - sum(lengths)
    pattern = [1, 3, 64, 65, 200]
    while rest >= sum(pattern):
        lengths += pattern
        rest -= sum(pattern)
    return lengths + (_uniform_lengths(rest, 1, 16, 2) if rest else [])


# packed layouts: name -> sequence lengths for a row of ``total`` tokens
PACKED = {
    "one": lambda total: [total],
    "all1": lambda total: [1] * total,
    "u1-16": lambda total: _uniform_lengths(total, 1, 16, 1),
    "mix": _mixed_lengths,
}


def cu_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64, device="cuda")


# How fast the inputs' gates decay (--gates): "fast", g = -softplus(1.5 z - 0.5) with z standard normal (about
# -0.7 a token, e^-45 a 64-token chunk: a state is forgotten within one chunk); "spread", the same times a
# factor per value head, 10^u with u uniform in [-4, 0] (one draw per head and run): from that fast decay down
# to 1e-4 of it (about e^-0.005 a chunk), heads that keep their state over the whole sequence. The kernels'
# arithmetic does not depend on the gates' values, but an implementation that skips history that has decayed
# away (FlashQLA's auto_cp cuts it at e^-10) does.
GATES = ("fast", "spread")
gates_mode = "fast"


def make(B, T, H, HV, D, dtype=torch.bfloat16, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = r(B, T, H, D).to(dtype)
    k = r(B, T, H, D).to(dtype)
    v = r(B, T, HV, D).to(dtype)
    g = -torch.nn.functional.softplus(r(B, T, HV) * 1.5 - 0.5)
    beta = torch.sigmoid(r(B, T, HV)).to(dtype)
    if gates_mode == "spread":  # drawn last: every other input is the same as with "fast"
        g = g * 10.0 ** (-4.0 * torch.rand(HV, device=device, generator=gen))
    elif gates_mode != "fast":
        raise ValueError(f"gates_mode={gates_mode!r}; allowed: {', '.join(GATES)}")
    return q, k, v, g.to(dtype), beta


# ---------------------------------------------------------------------------------------------------
# implementations: each takes (q, k, v, g, beta) with q/k at H heads and returns o
# ---------------------------------------------------------------------------------------------------


def ours(q, k, v, g, beta, cu_seqlens=None):
    return chunk_mod.chunk_gated_delta_rule_triton(q, k, v, g, beta, q.shape[-1] ** -0.5, None, False, True,
                                                   cu_seqlens)[0]


def segmented(segment, long):
    """Ours with sequences of at least ``long`` tokens cut into parallel segments of ``segment`` tokens."""
    from gdn_segments import chunk_gated_delta_rule_segmented

    def fn(q, k, v, g, beta, cu_seqlens=None):
        return chunk_gated_delta_rule_segmented(q, k, v, g, beta, q.shape[-1] ** -0.5, None, False, True, cu_seqlens,
                                                long=long, segment=segment)[0]

    return fn


def load_flash_qla():
    """FlashQLA's own chunked op (TileLang; its intra-card context parallelism on, as FLA calls it)."""
    try:
        import flash_qla
    except Exception as e:  # noqa: BLE001
        return None, f"flash_qla not importable: {type(e).__name__}: {e}"

    def fn(q, k, v, g, beta, cu_seqlens=None):
        # its backward asserts an fp32 g (what the models pass: they compute the gate in fp32)
        return flash_qla.chunk_gated_delta_rule(q, k, v, g.float(), beta, scale=q.shape[-1] ** -0.5,
                                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]

    return fn, f"flash-qla {getattr(flash_qla, '__version__', '?')} alone"


def torch_ref(q, k, v, g, beta, cu_seqlens=None):
    from deltafuse.ops.gated_delta.reference import chunk_gated_delta_rule_torch

    return chunk_gated_delta_rule_torch(q, k, v, g, beta, q.shape[-1] ** -0.5, None, False, True, cu_seqlens)[0]


def load_fla(guards: contextlib.ExitStack, flash_qla: bool = False):
    """FLA's chunked op, with its Hopper guard lifted (timing only) until ``guards`` closes. FLA 0.6 hands the call
    to FlashQLA by itself when ``flash_qla`` imports on Hopper; ``flash_qla=False`` keeps it on its own Triton
    kernels (``FLA_FLASH_QLA=0``, which FLA reads per call), True lets it dispatch (and needs flash_qla)."""
    try:
        import fla  # noqa: F401
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable: {type(e).__name__}: {e}"
    guard_off = bool(getattr(fla_chunk_o, "IS_NVIDIA_HOPPER", False))
    if guard_off:  # timing only: FLA refuses this backward on this stack
        saved = fla_chunk_o.IS_NVIDIA_HOPPER
        fla_chunk_o.IS_NVIDIA_HOPPER = False
        guards.callback(setattr, fla_chunk_o, "IS_NVIDIA_HOPPER", saved)

    if flash_qla:
        try:
            import flash_qla as _fq  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return None, f"flash_qla not importable: {type(e).__name__}: {e}"

    def fla_fn(q, k, v, g, beta, cu_seqlens=None):
        saved = os.environ.get("FLA_FLASH_QLA")
        os.environ["FLA_FLASH_QLA"] = "1" if flash_qla else "0"
        try:
            # an fp32 g, as the models pass it (FlashQLA's backward asserts one)
            return chunk_gated_delta_rule(q, k, v, g.float() if flash_qla else g, beta, scale=q.shape[-1] ** -0.5,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]
        finally:
            if saved is None:
                os.environ.pop("FLA_FLASH_QLA")
            else:
                os.environ["FLA_FLASH_QLA"] = saved

    if flash_qla:
        return fla_fn, "fla with flash-qla (its default)"
    return fla_fn, ("fla, FLA_FLASH_QLA=0 (guard off)" if guard_off else "fla, FLA_FLASH_QLA=0")


def load_hf():
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        return None, f"transformers qwen3_5 not importable: {e}"
    fn = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)

    def hf_fn(q, k, v, g, beta):
        # transformers <= 5.22 repeats q/k to the value heads before calling the kernel; done here too
        # (inside the timed region, as in the model's layer).
        G = v.shape[2] // q.shape[2]
        if G > 1:
            q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    return hf_fn, "hf torch fallback"


# ---------------------------------------------------------------------------------------------------


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def correctness(fn, shape, seed=1, cu=None):
    B, T, H, HV, D = shape
    xs = make(B, T, H, HV, D, seed=seed)
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.double().requires_grad_() for x in xs]
    o = fn(*a, cu_seqlens=cu) if cu is not None else fn(*a)
    ro, _ = naive_gated_delta_rule(*b, D**-0.5, None, False, True, cu)
    do = torch.randn_like(ro)
    (o.double() * do).sum().backward()
    (ro * do).sum().backward()
    errs = {"o": rel(o, ro)}
    for n, x, y in zip(("q", "k", "v", "g", "beta"), a, b):
        errs["d" + n] = rel(x.grad, y.grad) if x.grad is not None else float("nan")
    tol = {"o": 3e-3, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3, "dg": 1e-2, "dbeta": 1e-2}
    ok = all(errs[n] <= t for n, t in tol.items())
    return errs, ok


def timing(fn, shape, rep_ms, seed=0, cu=None):
    B, T, H, HV, D = shape
    xs = [x.requires_grad_() for x in make(B, T, H, HV, D, seed=seed)]
    do = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)
    extra = {} if cu is None else {"cu_seqlens": cu}

    def fwd():
        return fn(*xs, **extra)

    def fwdbwd():
        o = fn(*xs, **extra)
        torch.autograd.backward(o, do)

    fwdbwd()  # warm-up / compile / autotune
    for x in xs:  # freed before the base is read: the measured call's gradients count in its peak
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwdbwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for x in xs:
        x.grad = None
    t_f = triton.testing.do_bench(fwd, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")
    t_fb = triton.testing.do_bench(fwdbwd, warmup=max(rep_ms // 4, 5), rep=rep_ms, grad_to_none=xs,
                                   return_mode="median")
    return t_f, t_fb, peak


def breakdown(shape, iters=10):
    """Per-stage device time of our forward+backward (CUDA events between kernel launches), with the options in
    effect."""
    B, T, H, HV, D = shape
    xs = [x.requires_grad_() for x in make(B, T, H, HV, D, seed=0)]
    do = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)
    marks = []
    prefix = ["f:"]

    def hook(name):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((prefix[0] + name, e))

    def start():
        # the GPU sleeps (about 3 ms) before the start mark, while the host prepares the first launch: otherwise the
        # first stage's time would include the host's work before it (the GPU idle from the mark until that launch)
        torch.cuda._sleep(5_000_000)
        hook("start")

    per = {}
    for it in range(iters + 2):
        marks.clear()
        prefix[0] = "f:"
        with chunk_mod.configured(chunk_mod.options_in_effect(), stage_hook=hook):
            start()
            o = ours(*xs)
            prefix[0] = "b:"
            start()
            torch.autograd.backward(o, do)
        torch.cuda.synchronize()
        for x in xs:
            x.grad = None
        if it < 2:
            continue
        for (n0, e0), (n1, e1) in zip(marks[:-1], marks[1:]):
            if n1.endswith("start"):
                continue
            per.setdefault(n1, []).append(e0.elapsed_time(e1))
    return {n: sorted(v)[len(v) // 2] for n, v in per.items()}


def kernel_times(fn, shape, iters=5):
    """Device time of every kernel in one forward+backward (torch.profiler, the median over ``iters`` is not
    available per kernel, so the mean): {kernel name: ms per forward+backward}, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    B, T, H, HV, D = shape
    xs = [x.requires_grad_() for x in make(B, T, H, HV, D, seed=0)]
    do = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.backward(fn(*xs), do)
        for x in xs:
            x.grad = None

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    got = {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CPU:
            continue
        t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        got[e.key] = got.get(e.key, 0.0) + t / 1000 / iters
    return dict(sorted(got.items(), key=lambda kv: -kv[1]))


def kernel_table(shape, per_impl: dict) -> str:
    """Markdown: each implementation's kernels side by side (name, ms), largest first, with the total."""
    cols = list(per_impl)
    rows = max((len(v) for v in per_impl.values()), default=0)
    lines = [f"kernels per forward+backward at {tuple(shape)} (ms, torch.profiler)", "",
             "| " + " | ".join(f"{c} kernel | ms" for c in cols) + " |",
             "| " + " | ".join("--- | ---" for _ in cols) + " |",
             "| " + " | ".join(f"**total** | **{sum(per_impl[c].values()):.3f}**" for c in cols) + " |"]
    for i in range(rows):
        cells = []
        for c in cols:
            items = list(per_impl[c].items())
            cells.append(f"{items[i][0][:60]} | {items[i][1]:.3f}" if i < len(items) else " | ")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stack():
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except Exception:  # noqa: BLE001
            return "absent"

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": ver("transformers"), "fla-core": ver("fla-core"), "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def time_impl(name, fn, label, shapes, check_shape, args, results):
    """Correctness at ``check_shape``, then the timing rows of one implementation (appended to results)."""
    try:
        errs, ok = correctness(fn, check_shape)
    except Exception as e:  # noqa: BLE001
        errs, ok = {"error": f"{type(e).__name__}: {e}"[:300]}, False
    print(f"{name}: correctness at {check_shape}: {'PASS' if ok else 'FAIL'} {errs}", flush=True)
    for shape in shapes:
        row = {"impl": name, "label": label, "shape": shape, "correct": ok, "errors": errs}
        B, T = shape[:2]
        if name == "hf" and B * T > args.hf_max_tokens:
            row["skipped"] = f"B*T={B * T} > {args.hf_max_tokens}: the torch fallback would take minutes"
        elif name.startswith("ours[") and shape != shapes[0] and not args.variants_every_shape:
            continue
        elif name.startswith("seg") and B * T < 2 * int(name[3:]):
            continue  # nothing to cut: the same call as ours
        else:
            try:
                t_f, t_fb, peak = timing(fn, shape, args.rep_ms if name != "hf" else 50)
                row.update(fwd_ms=t_f, fwdbwd_ms=t_fb, peak_gib=peak / 2**30)
            except torch.cuda.OutOfMemoryError as e:
                row["skipped"] = f"OOM: {str(e)[:120]}"
            except Exception as e:  # noqa: BLE001
                row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
        results["rows"].append(row)
        print(json.dumps(row), flush=True)


def variant_overrides(spec: str) -> dict:
    """``ChunkOptions`` overrides from "field=value,..." (booleans as true / false / 1 / 0, ints as ints); ValueError
    names a bad field or value and what is allowed. The values themselves are checked by ``ChunkOptions``."""
    base = chunk_mod.DEFAULT_OPTIONS
    over = {}
    for kv in filter(None, spec.split(",")):
        key, _, val = kv.partition("=")
        if not hasattr(base, key):
            raise ValueError(f"{key!r} is not a ChunkOptions field; allowed: "
                             f"{', '.join(f.name for f in dataclasses.fields(base))}")
        old = getattr(base, key)
        if isinstance(old, bool):
            if val.lower() not in ("1", "true", "0", "false"):
                raise ValueError(f"{key}={val!r}; allowed: true, false, 1, 0")
            over[key] = val.lower() in ("1", "true")
        elif isinstance(old, int):
            try:
                over[key] = int(val)
            except ValueError:
                raise ValueError(f"{key}={val!r}; allowed: an int") from None
        else:
            over[key] = val
    return over


def ints(text: str, count: int | None = None) -> tuple[int, ...]:
    """Positive ints from "a,b,..." (exactly ``count`` of them when given): an argparse ``type``, so a bad value is one
    usage error naming the argument before any GPU work."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or (count is not None and len(values) != count):
        allowed = f"{count} comma-separated ints >= 1" if count else "comma-separated ints >= 1"
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: {allowed}")
    return values


def head_shape(text: str, count: int) -> tuple[int, ...]:
    """``ints`` whose last three are H, HV, D with HV a multiple of H (B,T,H,HV,D or H,HV,D)."""
    values = ints(text, count)
    if values[-2] % values[-3]:
        raise argparse.ArgumentTypeError(f"{text!r}: HV={values[-2]} is not a multiple of H={values[-3]}; "
                                         "allowed: HV a multiple of H")
    return values


def shape_indices(text: str) -> list[int]:
    """Indices into SHAPES from "i,j,..." (``--shapes`` also takes "all"; an empty string is none)."""
    if text == "all":
        return list(range(len(SHAPES)))
    try:
        idx = [int(x) for x in text.split(",") if x]
    except ValueError:
        idx = [-1]
    if any(not 0 <= i < len(SHAPES) for i in idx):
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: 'all' or comma-separated indices 0-{len(SHAPES) - 1} "
                                         "into " + ", ".join(f"{i}: {s}" for i, s in enumerate(SHAPES)))
    return idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--hf-max-tokens", type=int, default=16384,
                    help="skip the HF torch fallback above this many tokens (B*T)")
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--shapes", default="all", type=shape_indices,
                    help="'all' or indices into the reference list, e.g. 0,1")
    ap.add_argument("--check-shape", default="1,1024,16,32,128", type=lambda x: head_shape(x, 5),
                    help="B,T,H,HV,D for the correctness check")
    ap.add_argument("--variants", default="", help="semicolon-separated ChunkOptions overrides for extra rows "
                    "of ours, timed at the first shape only (and in --kernels tables), e.g. "
                    "'fwd_prod_wh=16,fwd_prod_kv=16;prod_wy=x2'; benchmarks/tune_gdn.py times options at every shape")
    ap.add_argument("--variants-every-shape", action="store_true",
                    help="time the --variants rows at every shape, next to the peers (default: the first shape)")
    ap.add_argument("--breakdown", default="", type=shape_indices,
                    help="shape indices for a per-stage timing of ours, e.g. 0,1")
    ap.add_argument("--kernels", default="", type=shape_indices,
                    help="shape indices for a per-kernel device-time table of ours and FLA side by side "
                    "(torch.profiler), e.g. 1,3")
    ap.add_argument("--skip", default="", help="comma list of impls to skip: hf,fla,fla+fq,fq,ours,ref")
    ap.add_argument("--segments", default=(), type=ints,
                    help="comma list of segment lengths: rows of ours with sequences of at least twice that cut into "
                    "parallel segments (benchmarks/gdn_segments.py)")
    ap.add_argument("--packed", default="one,all1,u1-16,mix",
                    help=f"packed-row layouts to time (comma list of {', '.join(PACKED)}; empty for none)")
    ap.add_argument("--packed-tokens", type=int, default=4096, help="tokens in the packed row")
    ap.add_argument("--packed-heads", default="16,32,128", type=lambda x: head_shape(x, 3),
                    help="H,HV,D of the packed rows")
    ap.add_argument("--packed-check", default="1,3,64,65,200,1,2,16,9,1", type=ints,
                    help="sequence lengths of the packed correctness check (same heads)")
    ap.add_argument("--gates", default="fast", choices=GATES,
                    help="how fast the inputs' gates decay: 'fast' (every head forgets within a 64-token chunk) "
                    "or 'spread' (per head, from that down to 1e-4 of it: long memories); see make()")
    args = ap.parse_args()
    global gates_mode
    gates_mode = args.gates
    shapes = [SHAPES[i] for i in args.shapes]
    layouts = [x for x in args.packed.split(",") if x]
    unknown = [x for x in layouts if x not in PACKED]
    if unknown:
        ap.error(f"--packed: unknown layout(s) {unknown}; allowed: {', '.join(PACKED)}")
    if args.packed_tokens < 1:
        ap.error(f"--packed-tokens must be >= 1, got {args.packed_tokens}")
    packed_heads = args.packed_heads
    check_lengths = list(args.packed_check)
    check_shape = args.check_shape
    variants = []  # every spec checked before any GPU work
    for spec in filter(None, args.variants.split(";")):
        try:
            over = variant_overrides(spec)
            variants.append((spec, over, dataclasses.replace(chunk_mod.DEFAULT_OPTIONS, **over)))
        except ValueError as e:
            ap.error(f"--variants {spec!r}: {e}")
    info = stack()
    info["gates"] = args.gates
    print("stack:", json.dumps(info))
    skip = set(filter(None, args.skip.split(",")))

    impls = []
    stack_guard = contextlib.ExitStack()
    base_opts = chunk_mod.DEFAULT_OPTIONS
    if "ours" not in skip:
        impls.append(("ours", ours, "deltafuse triton", base_opts))
    for spec, over, opts in variants:
        impls.append(("ours[" + spec + "]", ours, "deltafuse triton " + json.dumps(over), opts))
    if "fla" not in skip:
        fn, label = load_fla(stack_guard)
        impls.append(("fla", fn, label))
    if "fla+fq" not in skip:
        fn, label = load_fla(stack_guard, flash_qla=True)
        impls.append(("fla+fq", fn, label))
    if "fq" not in skip:
        fn, label = load_flash_qla()
        impls.append(("fq", fn, label))
    for seg in args.segments:
        impls.append((f"seg{seg}", segmented(seg, 2 * seg), f"deltafuse triton, segments of {seg}"))
    if "hf" not in skip:
        fn, label = load_hf()
        impls.append(("hf", fn, label))

    results = {"stack": info, "check_shape": check_shape, "rows": [], "breakdown": {}}
    for i in args.breakdown:
        shape = SHAPES[i]
        bd = breakdown(shape)
        results["breakdown"][str(shape)] = bd
        print(f"breakdown {shape}: total {sum(bd.values()):.3f} ms: " +
              ", ".join(f"{n} {t:.3f}" for n, t in bd.items()), flush=True)
    for entry in impls:
        name, fn, label = entry[:3]
        opts = entry[3] if len(entry) > 3 else base_opts
        if fn is None:
            print(f"{name}: unavailable ({label})")
            results["rows"].append({"impl": name, "label": label, "unavailable": True})
            continue
        with chunk_mod.configured(opts):
            time_impl(name, fn, label, shapes, check_shape, args, results)
        with open(args.out, "w") as f:  # after each implementation: a run cut short keeps what it measured
            json.dump(results, f, indent=1)
    results["kernels"] = {}
    for i in args.kernels:
        shape = SHAPES[i]
        per = {}
        for entry in impls:
            name, fn = entry[:2]
            if fn is None or name == "hf":
                continue
            with chunk_mod.configured(entry[3] if len(entry) > 3 else base_opts):
                per[name] = kernel_times(fn, shape)
        results["kernels"][str(shape)] = per
        print(kernel_table(shape, per), flush=True)
    stack_guard.close()  # FLA's Hopper guard back as it was

    # table
    by = {(r["impl"], tuple(r["shape"])): r for r in results["rows"] if "shape" in r}
    lines = [f"gates: {args.gates}", "",
             "| (B,T,H,HV,D) | impl | correct | fwd ms | fwd+bwd ms | peak GiB | fwd+bwd vs ours |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for shape in shapes:
        ref = by.get(("ours", tuple(shape)), {}).get("fwdbwd_ms")
        for entry in impls:
            r = by.get((entry[0], tuple(shape)))
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {tuple(shape)} | {r['label']} | {'yes' if r['correct'] else 'NO'} | - | - | - | "
                             f"skipped: {r['skipped']} |")
                continue
            ratio = f"{r['fwdbwd_ms'] / ref:.2f}x" if ref else "-"
            lines.append(f"| {tuple(shape)} | {r['label']} | {'yes' if r['correct'] else 'NO'} | "
                         f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {r['peak_gib']:.2f} | {ratio} |")
    table = "\n".join(lines)
    results["table"] = table
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table)

    if layouts:
        packed_rows(args, results, impls, layouts, packed_heads, check_lengths, skip, base_opts)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(results["packed_table"])


def packed_rows(args, results, impls, layouts, heads, check_lengths, skip, base_opts):
    """Many sequences in one row: time against each implementation's own one-sequence time."""
    H, HV, D = heads
    T = args.packed_tokens
    runs = [(name, fn, label) for name, fn, label, *_ in impls if name in ("ours", "fla") and fn is not None]
    if "ref" not in skip:
        runs.append(("ref", torch_ref, "deltafuse torch reference"))
    rows = results["packed"] = []
    check_cu = cu_of(check_lengths)
    check_shape = (1, sum(check_lengths), H, HV, D)
    for name, fn, label in runs:
        try:
            errs, ok = correctness(fn, check_shape, cu=check_cu)
        except Exception as e:  # noqa: BLE001
            errs, ok = {"error": f"{type(e).__name__}: {e}"[:300]}, False
        print(f"{name}: packed correctness at lengths {check_lengths}: {'PASS' if ok else 'FAIL'} {errs}", flush=True)
        for layout in layouts:
            lengths = PACKED[layout](T)
            row = {"impl": name, "label": label, "layout": layout, "tokens": T, "sequences": len(lengths),
                   "heads": heads, "correct": ok, "errors": errs}
            try:
                t_f, t_fb, peak = timing(fn, (1, T, H, HV, D), args.rep_ms, cu=cu_of(lengths))
                row.update(fwd_ms=t_f, fwdbwd_ms=t_fb, peak_gib=peak / 2**30)
            except torch.cuda.OutOfMemoryError as e:
                row["skipped"] = f"OOM: {str(e)[:120]}"
            except Exception as e:  # noqa: BLE001
                row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    one = {r["impl"]: r for r in rows if r["layout"] == "one" and "skipped" not in r}
    lines = [f"| packed row of {T} tokens, (H,HV,D)={heads} | impl | correct | fwd ms | fwd+bwd ms | peak GiB | "
             "fwd / fwd+bwd vs one sequence |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = f"{r['layout']} ({r['sequences']} sequences)"
        if "skipped" in r:
            lines.append(f"| {where} | {r['label']} | {'yes' if r['correct'] else 'NO'} | - | - | - | "
                         f"skipped: {r['skipped']} |")
            continue
        base = one.get(r["impl"])
        ratio = f"{r['fwd_ms'] / base['fwd_ms']:.2f}x / {r['fwdbwd_ms'] / base['fwdbwd_ms']:.2f}x" if base else "-"
        lines.append(f"| {where} | {r['label']} | {'yes' if r['correct'] else 'NO'} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {r['peak_gib']:.2f} | {ratio} |")
    results["packed_table"] = "\n".join(lines)


if __name__ == "__main__":
    main()
