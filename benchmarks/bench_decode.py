"""Decoding with gated delta rule models on one GPU: the recurrent op (one token per sequence per call) and
``model.generate`` of the dense8 model, deltafuse against FLA and transformers' torch fallback.

    python3 benchmarks/bench_decode.py --out $OUT/decode.json            # op level + generate
    python3 benchmarks/bench_decode.py --out $OUT/decode.json --sweep    # + RecurrentOptions sweep
    python3 benchmarks/bench_decode.py --smoke --out /tmp/decode.json    # CPU, tiny, interpreted (CI)

Op level (T=1, Qwen3.5 / dense8 GDN shapes H=16, HV=32, K=V=128, batch 1 / 32 / 128): the inputs are laid
out as transformers' GDN layer hands them to the op (q/k/v strided views of the conv output, bf16; g fp32,
beta bf16; the cache's fp32 state; l2norm in the kernel). Each implementation is first checked against the
float64 oracle (o and the new state, relative RMS error), then timed two ways with CUDA events (medians):
``eager``, one call after another (what a Python decoding loop pays: launch and host overhead included);
``graph``, a CUDA graph replaying ``--layers`` calls on distinct per-layer states (launch latency gone,
what a CUDA-graphed decoder pays). ``+cache`` rows add what the transformers cache does with the result
(``state.copy_(new_state)``); deltafuse's route writes the new state in place, so its copy is a copy onto
itself (free). Tokens/s = batch / (time of one token through ``--layers`` GDN layers).

A row whose check fails (error above the tolerance, or not finite) shows FAIL and is not timed.

Generate: dense8 (Qwen3.5-9B text config, 8 layers, random init, bf16) with a fixed random prompt, greedy,
batch 1 and 32, stock transformers and with deltafuse applied. The GDN column is read from the model's
GatedDeltaNet layer (the recurrent op and conv update it calls: FLA, causal_conv1d or the torch fallbacks;
the JSON lists each function's module). Each (impl, batch) first runs an untimed generate at the timed shapes
(warm-up), then times one new token (prefill) and ``--new-tokens`` new tokens, each ``--gen-reps`` times
(min). Decode tokens/s and ms per decode step come from the difference; none is reported when the full run
is not slower than the prefill (a note says so). Whether the token ids match is reported (else the first
position where a row differs). A last table lists ms per decode step by batch: equal across batches means
the step is host-bound.

Writes JSON (``--out``) and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # the interpreter must be chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltafuse.ops.gated_delta import kernel_recurrent as kr  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402


# --- inputs ------------------------------------------------------------------------------------------------
def make_step(B, H, HV, K, V, device, dtype=torch.bfloat16, seed=0):
    """One decode step's inputs in transformers' layout: q/k/v views of one [B, 1, 2HK + HV*V] conv output,
    g fp32 (the layer computes it in fp32), beta in the model dtype, an fp32 state [B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(B, 1, 2 * H * K + HV * V, generator=gen).to(device=device, dtype=dtype)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q.reshape(B, 1, H, K), k.reshape(B, 1, H, K), v.reshape(B, 1, HV, V)
    g = (-torch.nn.functional.softplus(torch.randn(B, 1, HV, generator=gen) * 1.5 - 0.5)).to(device)
    beta = torch.sigmoid(torch.randn(B, 1, HV, generator=gen)).to(device=device, dtype=dtype)
    # a state of the size decoding reaches (entries ~ 1/sqrt(K) per unit-norm key written)
    h0 = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


# --- implementations: fn(step, state) -> (o, new_state) -----------------------------------------------------
def impl_ours(inplace: bool, options=None):
    def fn(x, state):
        return kr.fused_recurrent_gated_delta_rule_triton(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                          x["q"].shape[-1] ** -0.5, state, True, True,
                                                          inplace_final_state=inplace, options=options)
    return fn


def impl_ours_op(backend=None):
    """Through deltafuse's public op with the transformers adapter's request (what the patched model runs);
    ``backend``: None (the registry's choice) or a forced one (the CPU smoke run forces Triton)."""
    from deltafuse import ops

    def fn(x, state):
        return ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                    inplace_final_state=True, backend=backend)
    return fn


def load_fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable: {type(e).__name__}: {e}"

    def fn(x, state):
        # FLA's signature is (q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, ...): everything after
        # g goes by keyword (a positional beta would land in gk, the per-key decay, and leave beta unset).
        # FLA handles HV > H itself (grouped value heads: value head i reads q/k head i // (HV // H), the
        # same grouping as transformers' repeat_interleave), and its input guard makes the strided views
        # contiguous (inside the timed region).
        return fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                scale=x["q"].shape[-1] ** -0.5, initial_state=state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)

    return fn, f"fla {_fla_version()} fused_recurrent".replace("  ", " ")


def _fla_version():
    import importlib.metadata as md

    for dist in ("fla-core", "flash-linear-attention"):
        if _has_dist(dist):
            return md.version(dist)
    try:
        import fla

        return getattr(fla, "__version__", "")
    except Exception:  # noqa: BLE001
        return ""


def _has_dist(name):
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def load_hf():
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    except Exception as e:  # noqa: BLE001
        return None, f"transformers qwen3_5 not importable: {e}"
    fn0 = getattr(m, "torch_recurrent_gated_delta_rule", None)
    if fn0 is None:
        return None, "this transformers has no torch_recurrent_gated_delta_rule"
    fn0 = getattr(fn0, "__wrapped__", fn0)  # the torch fallback itself, not a hub kernel

    def fn(x, state):
        # transformers <= 5.22's GDN layer repeats q/k ([B, T, H, K]) to the value heads before calling the
        # op and its torch fallback assumes H == HV; later versions repeat inside the op (then H == HV here
        # and they do nothing more). Done inside the timed region, as in the layer.
        q, k = x["q"], x["k"]
        G = x["v"].shape[2] // q.shape[2]
        if G > 1:
            q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
        return fn0(q, k, x["v"], x["g"], x["beta"], initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)

    return fn, "hf torch fallback"


# --- measurement -------------------------------------------------------------------------------------------
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def check(fn, x, tol):
    ro, rh = naive_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                                    x["h0"], True, True)
    state = x["h0"].clone()
    with torch.no_grad():
        o, ht = fn(x, state)
    out = {"rel_o": rel(o, ro), "rel_state": rel(ht, rh),
           "finite": bool(torch.isfinite(o).all() and torch.isfinite(ht).all())}
    out["check"] = "ok" if out["finite"] and out["rel_o"] < tol and out["rel_state"] < tol else "FAIL"
    return out


def tolerance(dtype):
    """Relative RMS error allowed against the float64 oracle: the output's rounding to the input dtype (bf16:
    ~3e-3) with margin; fp32 (the smoke run) must be near exact."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _layer_pass(fn, x, states, with_copy):
    """One token through len(states) layers: one call per state; ``with_copy``: each layer's
    state.copy_(new_state), as transformers' cache does."""
    for s in states:
        _, ht = fn(x, s)
        if with_copy:
            s.copy_(ht)


def time_eager(fn, x, states, with_copy, reps, device, warmup=3):
    """Median time of one pass of len(states) calls (one token through that many layers), one call after
    another. ``with_copy``: each layer's state.copy_(new_state) as transformers' cache does."""
    def once():
        _layer_pass(fn, x, states, with_copy)

    with torch.no_grad():
        for _ in range(warmup):
            once()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                once()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            else:
                t = time.perf_counter()
                once()
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_graph(fn, x, states, with_copy, reps):
    """Median replay time of a CUDA graph of len(states) calls."""
    def once():
        _layer_pass(fn, x, states, with_copy)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                once()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            once()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def op_rows(args, device, impls, shapes, results):
    for (H, HV, K, V), label in shapes:
        for B in args.batches:
            x = make_step(B, H, HV, K, V, device, dtype=args.dtype, seed=B)
            states = [x["h0"].clone() for _ in range(args.layers)]
            state_mb = x["h0"].numel() * 4 / 2**20
            for name, fn in impls:
                row = {"section": "op", "shape": label, "H": H, "HV": HV, "K": K, "V": V, "batch": B,
                       "impl": name, "layers": args.layers, "state_MiB_per_layer": round(state_mb, 2)}
                try:
                    row.update(check(fn, x, tolerance(args.dtype)))
                    if row["check"] != "ok":  # a wrong computation is not timed, nor compared
                        row["note"] = (f"not timed: check failed against the float64 oracle (tolerance "
                                       f"{tolerance(args.dtype):g}, finite={row['finite']})")
                        results.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                    for with_copy in (False, True):
                        suffix = "+cache" if with_copy else ""
                        t = time_eager(fn, x, states, with_copy, args.reps, device, args.warmup)
                        row[f"eager{suffix}_us_per_call"] = t / args.layers * 1e6
                        row[f"eager{suffix}_tok_s"] = B / t
                        if device.type == "cuda" and not args.no_graph:
                            t = time_graph(fn, x, states, with_copy, args.reps)
                            row[f"graph{suffix}_us_per_call"] = t / args.layers * 1e6
                            row[f"graph{suffix}_tok_s"] = B / t
                            # bytes the call must move: state read + written, plus (+cache) the copy's read+write
                            moved = x["h0"].numel() * 4 * (4 if with_copy and "in place" not in name else 2)
                            row[f"graph{suffix}_GBps"] = moved / (t / args.layers) / 1e9
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"
                results.append(row)
                print(json.dumps(row), flush=True)


def sweep_rows(args, device, results):
    """RecurrentOptions sweep of the kernel (in place, CUDA graph of --layers calls) at each batch."""
    H, HV, K, V = 16, 32, 128, 128
    for B in args.batches:
        x = make_step(B, H, HV, K, V, device, seed=B)
        states = [x["h0"].clone() for _ in range(args.layers)]
        best = None
        for bv in (8, 16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                if bv * 128 // warps < 128 or bv * 128 // warps > 16384:
                    continue
                opts = kr.RecurrentOptions(bv=bv, bv_min=bv, warps=warps)
                row = {"section": "sweep", "batch": B, "bv": bv, "warps": warps}
                try:
                    fn = impl_ours(True, opts)
                    err = check(fn, x, tolerance(torch.bfloat16))
                    row.update(err)
                    if err["check"] != "ok":
                        row["note"] = "not timed: check failed"
                        results.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                    t = time_graph(fn, x, states, False, args.reps)
                    row.update(us_per_call=t / args.layers * 1e6)
                    if best is None or t < best[0]:
                        best = (t, bv, warps)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"
                results.append(row)
                print(json.dumps(row), flush=True)
        cfg = kr.launch_config(B, HV, K, V)
        results.append({"section": "sweep-best", "batch": B, "best": None if best is None else
                        {"bv": best[1], "warps": best[2], "us_per_call": best[0] / args.layers * 1e6},
                        "default": {"bv": cfg[1], "warps": cfg[2]}})


# --- generate ----------------------------------------------------------------------------------------------
_GDN_ROLES = {  # layer attribute (transformers <= 5.22) -> module-level function (later versions)
    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "causal_conv1d_update": "causal_conv1d_update",
    "causal_conv1d_fn": "causal_conv1d_fn",
}


def _resolved(fn):
    """The function a transformers hub-kernel fallback wrapper dispatches to (its ``implementation`` closure
    cell: the original package's function, else the torch one), else ``fn`` itself."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars if code is not None else (), cells):
        if name == "implementation":
            with contextlib.suppress(ValueError):
                return cell.cell_contents
    return fn


def _describe(fn):
    if fn is None:
        return "none (nn.Conv1d)"
    fn = _resolved(fn)
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{mod}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def gdn_functions(model):
    """What the model's first GatedDeltaNet layer object calls, read from the layer: the functions it holds as
    attributes (transformers <= 5.22: FLA / causal_conv1d when importable, else the torch fallbacks), or the
    module-level functions of its modeling file (later versions, where each is resolved through the
    hub-kernel fallback decorator)."""
    import sys as _sys

    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    if layer is None:
        return {"error": "no GatedDeltaNet layer in the model"}
    modeling = _sys.modules.get(type(layer).__module__)
    out = {"layer": f"{type(layer).__module__}.{type(layer).__qualname__}"}
    for attr, fname in _GDN_ROLES.items():
        if hasattr(layer, attr):
            out[attr] = _describe(getattr(layer, attr))
        elif modeling is not None and hasattr(modeling, fname):
            out[attr] = _describe(getattr(modeling, fname))
        else:
            out[attr] = "absent"
    return out


def gdn_label(fns):
    """Short label of the decode step's GDN op and conv update from ``gdn_functions``."""
    if "error" in fns:
        return f"unknown ({fns['error']})"

    def who(desc):
        if desc.startswith("fla."):
            return "fla"
        if desc.startswith("causal_conv1d"):
            return "causal_conv1d"
        if desc.startswith("deltafuse"):
            return "deltafuse"
        return "torch fallback" if desc.startswith("transformers") else desc

    return f"op: {who(fns['recurrent_gated_delta_rule'])}, conv: {who(fns['causal_conv1d_update'])}"


def deltafuse_backend(device, dtype):
    from deltafuse.backends import REGISTRY, CallInfo
    from deltafuse.ops.gated_delta.candidates import RECURRENT

    call = CallInfo(device, dtype, False, (("K", 128), ("V", 128)))
    chosen = [d.candidate for d in REGISTRY.explain(RECURRENT, call) if d.chosen]
    return chosen[0] if chosen else "none"


def first_divergence(a, b):
    """The first generated position where some row differs, or None."""
    if a.shape != b.shape:
        return 0
    diff = (a != b).any(0).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def _timed_generate(model, ids, kwargs, new_tokens, reps, device):
    """Min wall time of ``reps`` generate calls of ``new_tokens`` new tokens, and the last output."""
    best, out = float("inf"), None
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **dict(kwargs, min_new_tokens=new_tokens, max_new_tokens=new_tokens))
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def generate_rows(args, device, results):
    from deltafuse import patching
    from deltafuse.models import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, dtype=dtype, device=device, seed=0).eval()
    stock_fns = gdn_functions(model)
    for B in args.gen_batches:
        ids = torch.randint(0, model.config.vocab_size, (B, args.prompt), generator=torch.Generator().manual_seed(B))
        ids = ids.to(device)
        kwargs = dict(do_sample=False, pad_token_id=0)
        seqs = {}
        for name in ("stock", "deltafuse"):
            ctx = patching.patched(model) if name == "deltafuse" else contextlib.nullcontext()
            row = {"section": "generate", "model": args.model, "batch": B, "prompt": args.prompt,
                   "new_tokens": args.new_tokens, "impl": name, "dtype": str(dtype).replace("torch.", ""),
                   "reps": args.gen_reps}
            try:
                with ctx, torch.no_grad():
                    if name == "stock":
                        row.update(gdn=gdn_label(stock_fns), gdn_functions=stock_fns)
                    else:
                        row.update(gdn=f"deltafuse {deltafuse_backend(device, dtype)}",
                                   gdn_functions=gdn_functions(model))
                    # untimed warm-up at the timed shapes (prompt length and batch): kernel compiles and
                    # autotuning, cuBLAS init, first-call costs of the fallbacks
                    model.generate(ids, **dict(kwargs, min_new_tokens=4, max_new_tokens=4))
                    prefill, _ = _timed_generate(model, ids, kwargs, 1, args.gen_reps, device)
                    total, out = _timed_generate(model, ids, kwargs, args.new_tokens, args.gen_reps, device)
                seqs[name] = out[:, args.prompt:].cpu()
                row.update(prefill_s=prefill, total_s=total, total_tok_s=B * args.new_tokens / total)
                steps = args.new_tokens - 1
                if total > prefill and steps > 0:
                    decode = total - prefill
                    row.update(decode_s=decode, decode_tok_s=B * steps / decode, ms_per_step=decode / steps * 1e3)
                else:
                    row.update(decode_tok_s=None, ms_per_step=None,
                               note=f"no decode rate: total {total:.4f} s <= prefill {prefill:.4f} s "
                                    f"(timing noise larger than {steps} decode steps)")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            results.append(row)
            print(json.dumps(row), flush=True)
        if len(seqs) == 2:
            pos = first_divergence(seqs["deltafuse"], seqs["stock"])
            results[-1].update(ids_match=pos is None, first_divergence=pos)
            print(json.dumps({"batch": B, "ids_match": pos is None, "first_divergence": pos}), flush=True)
    # per decode step cost by batch: where batch 1 and the largest batch take about the same time per step,
    # the step is bound by the host (Python, launches), not by the device
    for name in ("stock", "deltafuse"):
        per = {r["batch"]: r.get("ms_per_step") for r in results
               if r.get("section") == "generate" and r["impl"] == name and "error" not in r}
        if per:
            row = {"section": "generate-step", "model": args.model, "impl": name, "ms_per_step_by_batch": per}
            results.append(row)
            print(json.dumps(row), flush=True)


# --- report ------------------------------------------------------------------------------------------------
def stack(device):
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except Exception:  # noqa: BLE001
            return "absent"

    import triton

    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreted Triton)",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": ver("transformers"),
            "flash-linear-attention": ver("flash-linear-attention"), "fla-core": ver("fla-core"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def table(results):
    lines = ["| shape | batch | impl | rel err o / state | eager µs/call | eager +cache | graph µs/call | "
             "graph +cache | tok/s (graph +cache) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("section") != "op":
            continue
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | error: {r['error'][:60]} | | | | | |")
            continue
        if r.get("check") != "ok":
            lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | FAIL {r['rel_o']:.1e} / "
                         f"{r['rel_state']:.1e} (finite {r['finite']}) | not timed | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | {r['rel_o']:.1e} / {r['rel_state']:.1e} | "
                     f"{_f(r.get('eager_us_per_call'), '.1f')} | {_f(r.get('eager+cache_us_per_call'), '.1f')} | "
                     f"{_f(r.get('graph_us_per_call'), '.1f')} | {_f(r.get('graph+cache_us_per_call'), '.1f')} | "
                     f"{_f(r.get('graph+cache_tok_s'), ',.0f')} |")
    gen = [r for r in results if r.get("section") == "generate"]
    if gen:
        lines += ["", "| model | batch | impl | GDN op | prefill s | total s | decode tok/s | ms / decode step | "
                  "total tok/s | ids match |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in gen:
            match = "" if "ids_match" not in r else ("yes" if r["ids_match"] else f"from {r['first_divergence']}")
            if "error" in r:
                lines.append(f"| {r['model']} | {r['batch']} | {r['impl']} | {r.get('gdn', '?')} | "
                             f"error: {r['error'][:60]} | | | | | |")
                continue
            rate = "n/a (total <= prefill)" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:,.1f}"
            lines.append(f"| {r['model']} | {r['batch']} | {r['impl']} | {r['gdn']} | {r['prefill_s']:.3f} | "
                         f"{r['total_s']:.3f} | {rate} | {_f(r.get('ms_per_step'), '.2f')} | "
                         f"{r['total_tok_s']:,.1f} | {match} |")
    steps = [r for r in results if r.get("section") == "generate-step"]
    if steps:
        lines += ["", "| model | impl | ms per decode step, by batch (equal across batches: host-bound) |",
                  "|---|---|---|"]
        for r in steps:
            per = ", ".join(f"batch {b}: {_f(v, '.2f')}" for b, v in r["ms_per_step_by_batch"].items())
            lines.append(f"| {r['model']} | {r['impl']} | {per} |")
    best = [r for r in results if r.get("section") == "sweep-best"]
    if best:
        lines += ["", "| batch | best bv / warps (µs/call) | default bv / warps |", "|---|---|---|"]
        for r in best:
            b = r["best"]
            got = "-" if b is None else "{} / {} ({:.1f})".format(b["bv"], b["warps"], b["us_per_call"])
            lines.append(f"| {r['batch']} | {got} | {r['default']['bv']} / {r['default']['warps']} |")
    return "\n".join(lines)


def _ints(text):
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreted Triton (a CI check)")
    ap.add_argument("--batches", default="1,32,128", help="op-level batch sizes")
    ap.add_argument("--layers", type=int, default=24, help="GDN layers per token (calls per timed pass); "
                    "24 = the Qwen3.5-9B stack")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA graph timing")
    ap.add_argument("--sweep", action="store_true", help="also sweep RecurrentOptions (bv, warps)")
    ap.add_argument("--skip", default="", help="comma list to skip: ours,op,fla,hf,generate")
    ap.add_argument("--model", default="dense8")
    ap.add_argument("--gen-batches", default="1,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gen-reps", type=int, default=3, help="timed generate runs each (prefill, full); min taken")
    args = ap.parse_args(argv)
    args.dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter emulates fp32 only
    if args.smoke:
        args.batches, args.layers, args.reps, args.warmup, args.no_graph = "1,2", 1, 1, 1, True
        args.model, args.gen_batches, args.prompt, args.new_tokens, args.gen_reps = "tiny", "1,2", 8, 4, 2
    if args.gen_reps < 2:
        ap.error(f"--gen-reps must be >= 2 (min of repeated timings), got {args.gen_reps}")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens must be >= 2 (a decode rate needs decode steps after prefill), got {args.new_tokens}")
    try:
        args.batches, args.gen_batches = _ints(args.batches), _ints(args.gen_batches)
    except ValueError:
        ap.error(f"--batches / --gen-batches must be comma-separated ints, got {args.batches!r}, "
                 f"{args.gen_batches!r}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"ours", "op", "fla", "hf", "generate"}
    if unknown:
        ap.error(f"--skip: unknown {sorted(unknown)}; allowed: ours, op, fla, hf, generate")
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        ap.error("no CUDA device here (use --smoke for the CPU check)")
    else:
        device = torch.device("cuda")

    results = []
    notes = {}
    shapes = [((16, 32, 128, 128), "Qwen3.5 / dense8 GDN (16,32,128,128)")]
    if args.smoke:
        shapes = [((2, 4, 16, 16), "tiny (2,4,16,16)")]
    impls = []
    if "ours" not in skip:
        impls += [("deltafuse triton", impl_ours(False)), ("deltafuse triton in place", impl_ours(True))]
    if "op" not in skip:
        impls.append(("deltafuse op in place", impl_ours_op("triton" if args.smoke else None)))
    if "fla" not in skip and device.type == "cuda":
        fn, label = load_fla()
        if fn is None:
            notes["fla"] = label
        else:
            impls.append((label, fn))
    if "hf" not in skip:
        fn, label = load_hf()
        if fn is None:
            notes["hf"] = label
        else:
            impls.append((label, fn))
    op_rows(args, device, impls, shapes, results)
    if args.sweep and device.type == "cuda":
        sweep_rows(args, device, results)
    if "generate" not in skip:
        generate_rows(args, device, results)
    settings = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
    doc = {"stack": stack(device), "notes": notes, "args": settings,
           "results": results}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
