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

Generate: dense8 (Qwen3.5-9B text config, 8 layers, random init, bf16) with a fixed random prompt, greedy,
batch 1 and 32, stock transformers (its fallback, or FLA when importable: the JSON says which) and with
deltafuse applied; decode tokens/s from the time of ``max_new_tokens`` minus the time of one new token
(prefill), and whether the token ids match (else the first position where a row differs).

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
        return fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                scale=x["q"].shape[-1] ** -0.5, initial_state=state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)

    import importlib.metadata as md

    return fn, f"fla {md.version('flash-linear-attention') if _has_dist('flash-linear-attention') else ''}".strip()


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
        q, k = x["q"], x["k"]
        return fn0(q, k, x["v"], x["g"], x["beta"], initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)

    return fn, "hf torch fallback"


# --- measurement -------------------------------------------------------------------------------------------
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def check(fn, x):
    ro, rh = naive_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5,
                                    x["h0"], True, True)
    state = x["h0"].clone()
    with torch.no_grad():
        o, ht = fn(x, state)
    return {"rel_o": rel(o, ro), "rel_state": rel(ht, rh), "finite": bool(torch.isfinite(o).all())}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_eager(fn, x, states, with_copy, reps, device, warmup=3):
    """Median time of one pass of len(states) calls (one token through that many layers), one call after
    another. ``with_copy``: each layer's state.copy_(new_state) as transformers' cache does."""
    def once():
        for s in states:
            _, ht = fn(x, s)
            if with_copy:
                s.copy_(ht)

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
        for s in states:
            _, ht = fn(x, s)
            if with_copy:
                s.copy_(ht)

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
                    row.update(check(fn, x))
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
                    err = check(fn, x)
                    t = time_graph(fn, x, states, False, args.reps)
                    row.update(err, us_per_call=t / args.layers * 1e6)
                    if err["rel_o"] < 1e-2 and (best is None or t < best[0]):
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
def which_stock_gdn():
    """What stock transformers' qwen3_5 decode step calls: FLA or its torch fallback."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"
    fn = getattr(m, "torch_recurrent_gated_delta_rule", None) or getattr(m, "fused_recurrent_gated_delta_rule", None)
    mod = getattr(getattr(fn, "__wrapped__", fn), "__module__", "") if fn is not None else ""
    resolved = getattr(fn, "__module__", "")
    return "fla" if "fla" in (resolved + mod) and "transformers" not in resolved else "torch fallback"


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


def generate_rows(args, device, results):
    from deltafuse import patching
    from deltafuse.models import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.model, dtype=dtype, device=device, seed=0).eval()
    stock_gdn = which_stock_gdn()
    for B in args.gen_batches:
        ids = torch.randint(0, model.config.vocab_size, (B, args.prompt), generator=torch.Generator().manual_seed(B))
        ids = ids.to(device)
        kwargs = dict(do_sample=False, min_new_tokens=args.new_tokens, max_new_tokens=args.new_tokens,
                      pad_token_id=0)
        seqs = {}
        for name in ("stock", "deltafuse"):
            ctx = patching.patched(model) if name == "deltafuse" else contextlib.nullcontext()
            row = {"section": "generate", "model": args.model, "batch": B, "prompt": args.prompt,
                   "new_tokens": args.new_tokens, "impl": name, "dtype": str(dtype).replace("torch.", ""),
                   "gdn": stock_gdn if name == "stock" else f"deltafuse {deltafuse_backend(device, dtype)}"}
            try:
                with ctx, torch.no_grad():
                    model.generate(ids[:, :8], **dict(kwargs, min_new_tokens=2, max_new_tokens=2))  # warm-up
                    _sync(device)
                    t0 = time.perf_counter()
                    model.generate(ids, **dict(kwargs, min_new_tokens=1, max_new_tokens=1))
                    _sync(device)
                    t1 = time.perf_counter()
                    out = model.generate(ids, **kwargs)
                    _sync(device)
                    t2 = time.perf_counter()
                prefill, total = t1 - t0, t2 - t1
                decode = max(total - prefill, 1e-9)
                seqs[name] = out[:, args.prompt:].cpu()
                row.update(prefill_s=prefill, total_s=total, decode_tok_s=B * (args.new_tokens - 1) / decode,
                           total_tok_s=B * args.new_tokens / total)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            results.append(row)
            print(json.dumps(row), flush=True)
        if len(seqs) == 2:
            pos = first_divergence(seqs["deltafuse"], seqs["stock"])
            results[-1].update(ids_match=pos is None, first_divergence=pos)
            print(json.dumps({"batch": B, "ids_match": pos is None, "first_divergence": pos}), flush=True)


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
        lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | {r['rel_o']:.1e} / {r['rel_state']:.1e} | "
                     f"{_f(r.get('eager_us_per_call'), '.1f')} | {_f(r.get('eager+cache_us_per_call'), '.1f')} | "
                     f"{_f(r.get('graph_us_per_call'), '.1f')} | {_f(r.get('graph+cache_us_per_call'), '.1f')} | "
                     f"{_f(r.get('graph+cache_tok_s'), ',.0f')} |")
    gen = [r for r in results if r.get("section") == "generate"]
    if gen:
        lines += ["", "| model | batch | impl | GDN op | prefill s | decode tok/s | total tok/s | ids match |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in gen:
            match = "" if "ids_match" not in r else ("yes" if r["ids_match"] else f"from {r['first_divergence']}")
            if "error" in r:
                lines.append(f"| {r['model']} | {r['batch']} | {r['impl']} | {r['gdn']} | error: {r['error'][:60]} "
                             "| | | |")
                continue
            lines.append(f"| {r['model']} | {r['batch']} | {r['impl']} | {r['gdn']} | {r['prefill_s']:.3f} | "
                         f"{r['decode_tok_s']:,.1f} | {r['total_tok_s']:,.1f} | {match} |")
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
    args = ap.parse_args(argv)
    args.dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter emulates fp32 only
    if args.smoke:
        args.batches, args.layers, args.reps, args.warmup, args.no_graph = "1,2", 1, 1, 1, True
        args.model, args.gen_batches, args.prompt, args.new_tokens = "tiny", "1,2", 8, 4
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
