"""Host (CPU) time per call of every public op, and of one decode / training step of the tiny model.

    python3 benchmarks/host_overhead.py --out /tmp/host.json                 # full run (a few minutes of CPU)
    python3 benchmarks/host_overhead.py --smoke --out /tmp/host.json         # a few calls of each (CI)

Op level: each public op of ``deltafuse.ops`` with tiny CPU tensors (so the arithmetic is negligible and what
is left is host work: Python, argument checks, backend selection, torch's dispatch), timed two ways:

* ``public``: the public function as users and the patched models call it (``deltafuse.ops.<op>``);
* ``direct``: the implementation the registry selects for that call (looked up once, before timing), called
  with the arguments the op hands it (the same work on the tensors, none of the op's own layer).

``overhead`` = public - direct is what the op's own layer costs per call (argument checks, backend
selection, the ``_library`` run path). Each is timed for the forward alone (inference: no input requires
grad) and, for differentiable ops, forward + backward (inputs require grad; ``backward()`` of the sum of the
outputs). The two are timed in alternation, and each time is the minimum over ``--reps`` repetitions of the
mean over ``--calls`` calls (µs per call), after warm-up. The difference of two times of ~1 ms on a busy
host is noisy, so the op layer is also timed alone: ``layer`` is the public op served by a stand-in backend
registered first for the op (it returns the outputs the real implementation gave, precomputed) minus a
call of that stand-in, with the inputs as in the mode (requiring grad or not; the backward is not run: in
an eager call the op layer adds nothing to it, the backend's own autograd graph runs).

Model level: the tiny model (``deltafuse.models``' ``tiny``: 3 GDN layers, 1 attention layer, hidden 64),
stock transformers vs ``deltafuse.patching.patched``: one decode step (one new token with a cache of
``--prompt`` tokens, no grad) and one training step (forward, loss, backward on ``--prompt`` tokens). On a
CPU with these sizes the wall time is host time.

Writes JSON (``--out``) and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deltafuse import ops  # noqa: E402
from deltafuse.backends import REGISTRY, Candidate, current_backend  # noqa: E402
from deltafuse.ops import _library  # noqa: E402


def _r(*shape, grad=False, dtype=torch.float32, gen=None):
    t = torch.randn(*shape, dtype=dtype, generator=gen)
    return t.requires_grad_(grad)


def _impl(op, *tensors, grad):
    """The implementation the registry selects for a call of ``op`` on ``tensors`` (as the op asks)."""
    mask = [bool(grad and t is not None and t.is_floating_point()) for t in tensors]
    return REGISTRY.select(op, _library.call_info(mask, *tensors), current_backend())


# --- the op cases: (name, build(grad, generator) -> (public(), direct(), the selected implementation)) ------------------------
def _gdn(op_name, public, T):
    def build(grad, gen):
        B, H, HV, K, V = 1, 2, 4, 16, 16
        q, k = _r(B, T, H, K, grad=grad, gen=gen), _r(B, T, H, K, grad=grad, gen=gen)
        v = _r(B, T, HV, V, grad=grad, gen=gen)
        g = (-torch.rand(B, T, HV, generator=gen)).requires_grad_(grad)
        beta = torch.rand(B, T, HV, generator=gen).requires_grad_(grad)
        h0 = _r(B, HV, K, V, gen=gen)
        impl = _impl(op_name, q, k, v, g, beta, h0, grad=grad)
        scale = K ** -0.5
        return (lambda: public(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                lambda: impl(q, k, v, g, beta, scale, h0, True, False, None), impl)
    return build


def _conv(grad, gen):
    x, w, b = _r(1, 8, 16, grad=grad, gen=gen), _r(8, 4, grad=grad, gen=gen), _r(8, grad=grad, gen=gen)
    impl = _impl("causal_conv1d_fn", x, w, b, None, grad=grad)
    return (lambda: ops.causal_conv1d_fn(x, w, b, activation="silu"),
            lambda: impl(x, w, b, activation="silu", seq_idx=None, cu_seqlens=None, initial_states=None,
                         return_final_states=False), impl)


def _conv_update(grad, gen):
    x, w, b = _r(2, 8, 1, gen=gen), _r(8, 4, gen=gen), _r(8, gen=gen)
    state = _r(2, 8, 3, gen=gen)
    impl = _impl("causal_conv1d_update", x, w, b, grad=False)
    return (lambda: ops.causal_conv1d_update(x, state, w, b, "silu"),
            lambda: impl(x, state, w, b, "silu"), impl)


def _rms(grad, gen):
    x, w = _r(2, 4, 16, grad=grad, gen=gen), _r(16, grad=grad, gen=gen)
    impl = _impl("rms_norm_zero_centered", x, w, grad=grad)
    return lambda: ops.rms_norm_zero_centered(x, w, 1e-6), lambda: impl(x, w, 1e-6), impl


def _rms_gated(grad, gen):
    x, z, w = _r(2, 4, 16, grad=grad, gen=gen), _r(2, 4, 16, grad=grad, gen=gen), _r(16, grad=grad, gen=gen)
    impl = _impl("rms_norm_gated", x, z, w, grad=grad)
    return lambda: ops.rms_norm_gated(x, z, w, 1e-6), lambda: impl(x, z, w, 1e-6), impl


def _rope(grad, gen):
    q, k = _r(1, 4, 8, 16, grad=grad, gen=gen), _r(1, 2, 8, 16, grad=grad, gen=gen)
    cos, sin = _r(1, 8, 8, gen=gen), _r(1, 8, 8, gen=gen)
    impl = _impl("apply_rotary_pos_emb", q, k, cos, sin, grad=grad)
    return lambda: ops.apply_rotary_pos_emb(q, k, cos, sin), lambda: impl(q, k, cos, sin, 1), impl


def _swiglu(grad, gen):
    a, b = _r(2, 4, 32, grad=grad, gen=gen), _r(2, 4, 32, grad=grad, gen=gen)
    impl = _impl("swiglu", a, b, grad=grad)
    return lambda: ops.swiglu(a, b), lambda: impl(a, b), impl


def _ce(grad, gen):
    h, w = _r(1, 8, 16, grad=grad, gen=gen), _r(32, 16, grad=grad, gen=gen)
    labels = torch.randint(0, 32, (1, 8), generator=gen)
    targets = torch.cat([labels[:, 1:], torch.full((1, 1), -100)], 1).reshape(-1)
    h2 = h.reshape(-1, 16)
    impl = _impl("fused_linear_cross_entropy", h2, w, None, grad=grad)
    return (lambda: ops.fused_linear_cross_entropy(h, w, labels),
            lambda: impl(h.reshape(-1, 16), w, None, targets, -100, "mean", None, None, False, None,
                         token_accuracy=False)[0], impl)


def _logprobs(grad, gen):
    h, w = _r(1, 8, 16, grad=grad, gen=gen), _r(32, 16, grad=grad, gen=gen)
    targets = torch.randint(0, 32, (1, 8), generator=gen)
    impl = _impl("token_logprobs", h.reshape(-1, 16), w, None, grad=grad)
    return (lambda: ops.token_logprobs(h, w, targets).log_probs,
            lambda: impl(h.reshape(-1, 16), w, None, targets.reshape(-1), -100, 1.0, False, False, None,
                         None)[0], impl)


def _moe(grad, gen):
    N, Hd, E, inter, k = 8, 16, 4, 8, 2
    hidden = _r(N, Hd, grad=grad, gen=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    wts = torch.rand(N, k, generator=gen).requires_grad_(grad)
    gu, down = _r(E, 2 * inter, Hd, grad=grad, gen=gen), _r(E, Hd, inter, grad=grad, gen=gen)
    impl = _impl("moe_experts", hidden, wts, gu, down, grad=grad)
    return lambda: ops.moe_experts(hidden, idx, wts, gu, down), lambda: impl(hidden, idx, wts, gu, down), impl


# (op, build, differentiable)
CASES = (
    ("chunk_gated_delta_rule", _gdn("chunk_gated_delta_rule", ops.chunk_gated_delta_rule, 8), True),
    ("fused_recurrent_gated_delta_rule",
     _gdn("fused_recurrent_gated_delta_rule", ops.fused_recurrent_gated_delta_rule, 1), True),
    ("causal_conv1d_fn", _conv, True),
    ("causal_conv1d_update", _conv_update, False),
    ("rms_norm_zero_centered", _rms, True),
    ("rms_norm_gated", _rms_gated, True),
    ("apply_rotary_pos_emb", _rope, True),
    ("swiglu", _swiglu, True),
    ("fused_linear_cross_entropy", _ce, True),
    ("token_logprobs", _logprobs, True),
    ("moe_experts", _moe, True),
)


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]


def _time(fns, calls, reps, backward):
    """For each of ``fns``: the minimum over ``reps`` of the mean µs per call of it (and the backward of its
    outputs' sum), the functions timed in alternation so that a slower phase of the host hits them alike."""
    def once(fn):
        out = fn()
        if backward:
            sum(o.sum() for o in _outputs(out)).backward()

    for fn in fns:
        for _ in range(max(2, calls // 10)):  # warm-up
            once(fn)
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(calls):
                once(fn)
            best[i] = min(best[i], (time.perf_counter() - t) / calls)
    return [b * 1e6 for b in best]


STUB = "host-overhead-stand-in"


class StandIn:
    """A backend that returns what the real implementation returned on its first call (the same objects on
    every call): the op's own layer is then all that a public call costs."""

    def __init__(self, real):
        self.real, self.saved, self.args = real, None, None

    def __call__(self, *args, **kwargs):
        if self.saved is None:
            self.saved, self.args = self.real(*args, **kwargs), (args, kwargs)
        return self.saved

    def again(self):
        """The stand-in called as the op called it first."""
        args, kwargs = self.args
        return self(*args, **kwargs)


@contextlib.contextmanager
def stand_in(op, real):
    """``StandIn(real)`` registered first for ``op`` (selected automatically) while the context lasts."""
    stub = StandIn(real)
    REGISTRY.register(op, Candidate(STUB, load=lambda: stub), before=REGISTRY.candidates(op)[0].name)
    try:
        yield stub
    finally:
        REGISTRY.unregister(op, STUB)


def op_rows(names, calls, reps, seed=0):
    rows = []
    for name, build, differentiable in CASES:
        if names and name not in names:
            continue
        for mode in (("forward", "forward+backward") if differentiable else ("forward",)):
            grad = mode != "forward"
            public, direct, impl = build(grad, torch.Generator().manual_seed(seed))
            ctx = contextlib.nullcontext() if grad else torch.no_grad()
            with ctx:
                p, d = _time([public, direct], calls, reps, grad)
                with stand_in(name, impl) as stub:
                    public()  # the stand-in keeps the real outputs and the arguments the op passed
                    layer_public, layer_stub = _time([public, stub.again], calls, reps, False)
            row = {"section": "op", "op": name, "mode": mode, "public_us": p, "direct_us": d,
                   "overhead_us": p - d, "layer_us": layer_public - layer_stub}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# --- model level ----------------------------------------------------------------------------------------------
def model_rows(prompt, calls, reps):
    from deltafuse import patching
    from deltafuse.models import build_model

    rows = []
    model = build_model("tiny", dtype=torch.float32, device="cpu", seed=0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    for impl in ("stock", "deltafuse"):
        ctx = patching.patched(model) if impl == "deltafuse" else contextlib.nullcontext()
        with ctx:
            model.eval()
            with torch.no_grad():
                out = model(ids, use_cache=True)
                # the cache's name: ``cache`` from transformers 5.24 on (``past_key_values`` is deprecated there)
                key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
                cache, nxt = getattr(out, key), out.logits[:, -1:].argmax(-1)
                # every timed step re-runs one decode step from the same cache state: a fresh copy per step
                # would time the copy, so each step decodes one token onto the growing cache (the tiny model's
                # per-step host work does not depend on the cache length)

                def decode():
                    return model(nxt, use_cache=True, **{key: cache}).logits

                dec, = _time([decode], calls, reps, False)
            model.train()
            labels = ids.clone()

            def train():
                model.zero_grad(set_to_none=True)
                model(ids, labels=labels).loss.backward()

            trn, = _time([train], max(1, calls // 4), reps, False)
            model.eval()
        for step, us in (("decode step", dec), ("training step", trn)):
            row = {"section": "model", "model": "tiny", "step": step, "impl": impl, "prompt": prompt, "us": us}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(results):
    lines = ["| op | mode | public µs/call | selected impl direct µs/call | public - direct µs | "
             "op layer alone µs/call (stand-in backend) |", "|---|---|---|---|---|---|"]
    for r in results:
        if r["section"] == "op":
            lines.append(f"| {r['op']} | {r['mode']} | {r['public_us']:.1f} | {r['direct_us']:.1f} | "
                         f"{r['overhead_us']:.1f} | {r['layer_us']:.1f} |")
    model = [r for r in results if r["section"] == "model"]
    if model:
        lines += ["", "| tiny model | stock µs | deltafuse µs | deltafuse - stock µs |", "|---|---|---|---|"]
        for step in dict.fromkeys(r["step"] for r in model):
            by = {r["impl"]: r["us"] for r in model if r["step"] == step}
            if len(by) == 2:
                lines.append(f"| {step} | {by['stock']:.0f} | {by['deltafuse']:.0f} | "
                             f"{by['deltafuse'] - by['stock']:+.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the JSON results here")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: every public op)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timed repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (the minimum is reported)")
    ap.add_argument("--prompt", type=int, default=16, help="tokens of the tiny model's prompt / training row")
    ap.add_argument("--no-model", action="store_true", help="skip the tiny model's decode and training steps")
    ap.add_argument("--smoke", action="store_true", help="a few calls of each (a CI check of the script)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls, args.reps, args.prompt = 3, 1, 8
    torch.set_num_threads(1)  # host time of one thread: what an accelerator's launching thread pays
    names = {n.strip() for n in args.ops.split(",") if n.strip()}
    unknown = names - {c[0] for c in CASES}
    if unknown:
        ap.error(f"--ops: unknown op(s) {sorted(unknown)}; known: {', '.join(c[0] for c in CASES)}")
    results = op_rows(names, args.calls, args.reps)
    if not args.no_model:
        results += model_rows(args.prompt, args.calls, args.reps)
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "backend": current_backend(),
            "calls": args.calls, "reps": args.reps, "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
