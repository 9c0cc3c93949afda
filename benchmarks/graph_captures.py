"""How often the CUDA-graph capture of the decoder layers succeeds, and how far replays are from eager steps.

Each round builds a fresh bf16 LoRA model of a tiny family on the GPU (the LoRA set-up and packed rows of
``tests/integrations/test_graphed_layers.py``), runs seven packed batches eagerly (the first one twice: the eager
step's own run-to-run spread), captures its
decoder layers (``graph_layers``, two warm-up calls) and runs the same batches again, replayed. Per round it prints
whether the capture succeeded, the eager spread and the largest relative RMS between a replayed and an eager
gradient; a round whose replays differ by 5e-3 or more (the GPU test's bound) lists every such gradient. Rounds
run in one process until ``--seconds`` have passed, which is what exposes failures that depend on the state of
the process (the cycle collector's counters).

    python benchmarks/graph_captures.py [--model tiny-moe] [--tokens 2048] [--seconds 150] [--every-expert]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.helpers import rel_rms  # noqa: E402


def one_round(name: str, T: int, every_expert: bool) -> tuple[str | None, float, list]:
    import deltafuse
    from deltafuse import models
    from deltafuse.integrations.transformers import graphed_layers as gl
    from tests.integrations.test_graphed_layers import _lora, _packed

    config = models.build_config(name)
    over = {"num_experts_per_tok": config.num_experts} if every_expert and hasattr(config, "num_experts") else {}
    model = models.build_model(name, dtype=torch.bfloat16, device="cuda", seed=int(torch.randint(0, 1000, ())),
                               **over).train()
    model.config.use_cache = False
    model = _lora(model)
    vocab = model.config.vocab_size

    def batch(k):
        cuts = sorted(torch.randperm(T - 2)[:k].add(1).tolist())
        return {key: v.cuda() for key, v in _packed(vocab, T, cuts).items()}

    def step(b):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    with deltafuse.patched(model):
        batches = [batch(k) for k in (3, 1, 5, 2, 4, 7, 30)]
        eager = [step(b) for b in batches]
        again = step(batches[0])
        graphs = gl.graph_layers(model, warmup=2)
        try:
            replayed = [step(b) for b in batches]
        finally:
            graphs.remove()
    spread = max(rel_rms(again[k], eager[0][k]) for k in again)
    errors = [(i, k, rel_rms(r[k], e[k])) for i, (e, r) in enumerate(zip(eager, replayed)) for k in e]
    return graphs.failed, spread, [max(err for *_, err in errors), [x for x in errors if x[2] >= 5e-3]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-moe", choices=["tiny", "tiny-moe", "tiny-next"])
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each packed row (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=150.0, help="rounds start until this much time has passed")
    p.add_argument("--every-expert", action="store_true", help="route every token to every expert (MoE families)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if args.tokens < 40 or args.seconds <= 0:
        p.error(f"--tokens must be >= 40 and --seconds > 0, got --tokens {args.tokens} --seconds {args.seconds}")
    end, rounds, failed, off = time.time() + args.seconds, 0, 0, 0
    while time.time() < end:
        rounds += 1
        why, spread, (worst, over_bound) = one_round(args.model, args.tokens, args.every_expert)
        failed += why is not None
        off += bool(over_bound)
        print(f"round {rounds}: capture {'FAILED (' + why + ')' if why else 'ok'}; eager spread {spread:.1e}; "
              f"replay vs eager max {worst:.1e}", flush=True)
        for i, k, err in over_bound:
            print(f"    batch {i} {k}: {err:.2e}", flush=True)
        torch.cuda.empty_cache()
    print(f"{args.model}, {args.tokens} tokens, every expert {args.every_expert}: {rounds} rounds, "
          f"{failed} failed captures, {off} rounds with a replayed gradient >= 5e-3 from eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
