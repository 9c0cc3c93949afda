"""GPU benchmark: fused linear cross-entropy and MoE experts, forward + backward, time and peak memory.

Loss path (hidden 2,048, vocab 248,320, bf16, random data) at 4,096 and 16,384 tokens, with a frozen head
(LoRA training) and a trainable head:
  stock   lm_head (F.linear) + transformers' ForCausalLMLoss
  liger   Liger-Kernel's fused linear cross-entropy (when ``liger_kernel`` imports)
  trl     TRL's fused LM head (``ChunkedLogProbFunction``, when ``trl`` imports): the fields its SFTTrainer
          asks for (log_probs, entropy, is_top1) and log_probs alone
  ours    deltafuse.ops.cross_entropy with backend 'triton' and 'torch', by default (vocabulary blocks) and
          with whole-vocabulary token chunks, plus the block sizes given by --blocks; and
          deltafuse-tokenlogprobs-sft: ops.token_logprobs with the SFT fields and TRL's loss (lines up with trl-sft)
Experts at Qwen3.5-35B-A3B sizes (256 experts, top-8, I = 512, H = 2,048), 4,096 tokens, bf16:
  stock   transformers' Qwen3_5MoeExperts with experts_implementation 'grouped_mm'
  ours    the same module served by deltafuse.ops.moe through the experts interface: its automatic choice,
          then each candidate forced (torch: embedding_bag per-token sums; triton: those sums in Triton)

Times are medians of ``triton.testing.do_bench`` (after its warm-up); peak memory is the maximum allocated
during one forward + backward minus what was allocated before it (inputs and weights excluded).

    python benchmarks/bench_loss_moe.py results.json
    python benchmarks/bench_loss_moe.py --dry-run          # imports and parses arguments only (CPU is fine)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from deltafuse.bench.cases import QWEN35_35B_A3B as SIZES  # noqa: E402  (shared with `deltafuse bench ops`)
from deltafuse.bench.cases import TRL_SFT_OUTPUTS, liger_fused_linear_cross_entropy  # noqa: E402
from deltafuse.bench.cases import trl_chunked_logprob_loss  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="bench_loss_moe.json", help="JSON file to write (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[SIZES.tokens, 16384], help="loss-path token counts")
    p.add_argument("--hidden", type=int, default=SIZES.hidden)
    p.add_argument("--vocab", type=int, default=SIZES.vocab)
    p.add_argument("--head", choices=["frozen", "trainable", "both"], default="both")
    p.add_argument("--chunk-sizes", type=int, nargs="*", default=[],
                   help="also time the Triton loss with whole-vocabulary chunks of these many tokens "
                        "(default: none)")
    p.add_argument("--blocks", nargs="*", default=["512x4096", "2048x4096", "1024x2048", "1024x8192"],
                   help="also time the Triton loss with these TOKENSxCOLUMNS vocabulary blocks, to tune the "
                        "default (default: %(default)s; give the flag alone for none)")
    p.add_argument("--moe-tokens", type=int, default=SIZES.tokens)
    p.add_argument("--experts", type=int, default=SIZES.num_experts)
    p.add_argument("--top-k", type=int, default=SIZES.experts_per_token)
    p.add_argument("--moe-intermediate", type=int, default=SIZES.moe_intermediate)
    p.add_argument("--skip-loss", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time in ms (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="import everything, print the plan, run nothing")
    args = p.parse_args(argv)
    for name in ("hidden", "vocab", "moe_tokens", "experts", "top_k", "moe_intermediate", "rep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(c < 1 for c in args.chunk_sizes):
        p.error(f"--chunk-sizes must all be >= 1, got {args.chunk_sizes}")
    try:
        args.blocks = [tuple(int(x) for x in b.lower().split("x", 1)) for b in args.blocks]
    except ValueError:
        p.error(f"--blocks must be TOKENSxCOLUMNS pairs such as 1024x4096, got {args.blocks}")
    if any(len(b) != 2 or min(b) < 1 for b in args.blocks):
        p.error(f"--blocks must be TOKENSxCOLUMNS pairs of positive ints, got {args.blocks}")
    if any(t < 2 for t in args.tokens):
        p.error(f"--tokens must all be >= 2, got {args.tokens}")
    if args.top_k > args.experts:
        p.error(f"--top-k ({args.top_k}) must not exceed --experts ({args.experts})")
    return args


def _stack() -> dict:
    import transformers

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": None, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        info["triton"] = f"not importable: {exc}"
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        info["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001
        info["liger_kernel"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _measure(fn, grad_to_none, rep):
    """(median ms, peak MiB above the allocation before the call) of fn (forward + backward)."""
    import triton.testing

    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    for t in grad_to_none:
        t.grad = None
    ms = triton.testing.do_bench(fn, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    for t in grad_to_none:
        t.grad = None
    return ms, peak


def token_logprobs_loss(outputs, ignore_index: int = -100):
    """fn(hidden [..., T, H], weight [V, H], labels [..., T]) -> mean loss computed as TRL's fused head computes it
    (``deltafuse.bench.cases.trl_chunked_logprob_loss``), with ``deltafuse.ops.token_logprobs`` (default
    backend) in place of TRL's ``ChunkedLogProbFunction``."""
    from deltafuse.ops import token_logprobs

    def apply(hidden, weight, labels):
        h = hidden[..., :-1, :].reshape(-1, hidden.shape[-1])
        y = labels[..., 1:].reshape(-1)
        mask = y != ignore_index
        log_probs = token_logprobs(h[mask], weight, y[mask], outputs=outputs).log_probs
        return -log_probs.sum() / mask.sum().clamp(min=1)

    return apply


def _loss_cases(args):
    from transformers.loss.loss_utils import ForCausalLMLoss

    from deltafuse.ops.cross_entropy import fused_linear_cross_entropy

    dev, dt = "cuda", torch.bfloat16
    rows = []
    heads = ["frozen", "trainable"] if args.head == "both" else [args.head]
    for n in args.tokens:
        for head in heads:
            gen = torch.Generator(device=dev).manual_seed(n)
            hidden = torch.randn(1, n, args.hidden, device=dev, dtype=dt, generator=gen).requires_grad_()
            weight = (torch.randn(args.vocab, args.hidden, device=dev, dtype=dt, generator=gen)
                      / math.sqrt(args.hidden)).requires_grad_(head == "trainable")
            labels = torch.randint(0, args.vocab, (1, n), device=dev, generator=gen)
            labels[:, ::13] = -100
            leaves = [hidden] + ([weight] if head == "trainable" else [])
            V = args.vocab

            def stock():
                ForCausalLMLoss(F.linear(hidden, weight), labels, V).backward()

            def ours(**cfg):
                return lambda: fused_linear_cross_entropy(hidden, weight, labels, **cfg).backward()

            configs = [("deltafuse-triton", dict(backend="triton")),
                       ("deltafuse-triton-wholevocab", dict(backend="triton", vocab_chunk_size=V)),
                       ("deltafuse-torch", dict(backend="torch")),
                       ("deltafuse-torch-wholevocab", dict(backend="torch", vocab_chunk_size=V))]
            configs += [(f"deltafuse-triton-wholevocab-c{c}", dict(backend="triton", vocab_chunk_size=V,
                                                                    chunk_size=c)) for c in args.chunk_sizes]
            configs += [(f"deltafuse-triton-c{c}-v{v}", dict(backend="triton", chunk_size=c, vocab_chunk_size=v))
                        for c, v in args.blocks]
            # (name, forward + backward, None (stock) | the op's arguments | a peer's loss function)
            impls = [("stock", stock, None)] + [(name, ours(**cfg), cfg) for name, cfg in configs]
            try:
                liger = liger_fused_linear_cross_entropy(ignore_index=-100)

                def liger_fn():
                    liger(hidden, weight, labels).backward()

                impls.insert(1, ("liger", liger_fn, None))
            except Exception as exc:  # noqa: BLE001
                rows.append({"bench": "loss", "tokens": n, "head": head, "impl": "liger",
                             "error": f"not run: {type(exc).__name__}: {exc}"})
            for name, fields in (("trl-sft", TRL_SFT_OUTPUTS), ("trl-logprobs", ("log_probs",))):
                try:
                    trl_loss = trl_chunked_logprob_loss(fields)
                    impls.insert(2, (name, lambda f=trl_loss: f(hidden, weight, labels).backward(),
                                     lambda f=trl_loss: f(hidden, weight, labels)))
                except Exception as exc:  # noqa: BLE001
                    rows.append({"bench": "loss", "tokens": n, "head": head, "impl": name,
                                 "error": f"not run: {type(exc).__name__}: {exc}"})
            # deltafuse's per-token op (what serves TRL's fused head once deltafuse is applied), same loss as trl-sft
            tok_loss = token_logprobs_loss(TRL_SFT_OUTPUTS)
            impls.insert(3, ("deltafuse-tokenlogprobs-sft", lambda f=tok_loss: f(hidden, weight, labels).backward(),
                             lambda f=tok_loss: f(hidden, weight, labels)))
            with torch.no_grad():
                ref = float(ForCausalLMLoss(F.linear(hidden, weight), labels, V))
            for name, fn, cfg in impls:
                row = {"bench": "loss", "tokens": n, "head": head, "impl": name}
                try:
                    ms, peak = _measure(fn, leaves, args.rep)
                    row.update(ms=ms, peak_mib=peak)
                    if callable(cfg):  # a peer: its loss function
                        with torch.no_grad():
                            row["loss_abs_diff_vs_stock"] = abs(float(cfg()) - ref)
                    elif cfg is not None:
                        got = float(fused_linear_cross_entropy(hidden, weight, labels, **cfg).detach())
                        row["chunk_size"] = cfg.get("chunk_size", "default")
                        row["vocab_chunk_size"] = cfg.get("vocab_chunk_size", "default")
                        row["loss_abs_diff_vs_stock"] = abs(got - ref)
                except Exception as exc:  # noqa: BLE001  (e.g. out of memory): record and go on
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                rows.append(row)
                torch.cuda.empty_cache()
            del hidden, weight, labels
    return rows


def _moe_cases(args):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, grouped_mm_experts_forward
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    from deltafuse.ops.moe import moe_experts

    forced = {"backend": None}  # the deltafuse candidate a row forces (None: the automatic choice)

    def deltafuse_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        if self.has_bias or not self.has_gate or self.is_transposed or not self.is_concatenated:
            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           backend=forced["backend"])

    added = "deltafuse" not in ALL_EXPERTS_FUNCTIONS
    if added:
        ExpertsInterface.register("deltafuse", deltafuse_experts_forward)
    dev, dt = "cuda", torch.bfloat16
    cfg = Qwen3_5MoeTextConfig(hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                               num_experts=args.experts, num_experts_per_tok=args.top_k)
    mod = Qwen3_5MoeExperts(cfg).to(dev, dt)
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, args.hidden ** -0.5, generator=gen)
        mod.down_proj.normal_(0, args.moe_intermediate ** -0.5, generator=gen)
    n = args.moe_tokens
    hidden = torch.randn(n, args.hidden, device=dev, dtype=dt, generator=gen).requires_grad_()
    logits = torch.randn(n, args.experts, device=dev, generator=gen)
    probs = logits.softmax(-1)
    top_w, top_i = probs.topk(args.top_k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dt).requires_grad_()
    dy = torch.randn(n, args.hidden, device=dev, dtype=dt, generator=gen)
    leaves = [hidden, top_w, mod.gate_up_proj, mod.down_proj]
    rows, outs = [], {}
    try:
        # deltafuse's automatic choice, then each of its candidates forced (torch: the grouped matmuls with
        # embedding_bag sums; triton: the same with the per-token sums in Triton)
        for label in ("grouped_mm", "deltafuse", "deltafuse:torch", "deltafuse:triton"):
            impl = "grouped_mm" if label == "grouped_mm" else "deltafuse"
            forced["backend"] = label.split(":")[1] if ":" in label else None
            mod.config._experts_implementation = impl

            def fn():
                mod(hidden, top_i, top_w).backward(dy)

            row = {"bench": "moe_experts", "tokens": n, "experts": args.experts, "top_k": args.top_k,
                   "impl": "stock-grouped_mm" if impl == "grouped_mm" else label}
            try:
                ms, peak = _measure(fn, leaves, args.rep)
                row.update(ms=ms, peak_mib=peak)
                for t in leaves:
                    t.grad = None
                out = mod(hidden, top_i, top_w)
                out.backward(dy)
                outs[label] = [out.detach()] + [t.grad.detach().clone() for t in leaves]
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            rows.append(row)
        names = ("out", "d_hidden", "d_weights", "d_gate_up", "d_down")
        for row in rows:
            if row["impl"] == "stock-grouped_mm" or row["impl"] not in outs or "grouped_mm" not in outs:
                continue
            diffs = {}
            for name, a, b in zip(names, outs[row["impl"]], outs["grouped_mm"]):
                a, b = a.double(), b.double()
                diffs[name] = float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
            row["rel_rms_vs_stock"] = diffs
    finally:
        forced["backend"] = None
        if added:
            del ExpertsInterface._global_mapping["deltafuse"]
    return rows


def _table(rows):
    lines = [f"{'bench':<12} {'tokens':>7} {'case':<10} {'impl':<18} {'ms':>9} {'peak MiB':>10}  note"]
    for r in rows:
        case = r.get("head", f"E{r.get('experts', '')}k{r.get('top_k', '')}")
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
        note = r.get("error", "")
        if "loss_abs_diff_vs_stock" in r:
            note = f"|loss - stock| = {r['loss_abs_diff_vs_stock']:.2e}"
        if "rel_rms_vs_stock" in r:
            note = "rel_rms vs stock: " + ", ".join(f"{k} {v:.1e}" for k, v in r["rel_rms_vs_stock"].items())
        lines.append(f"{r['bench']:<12} {r['tokens']:>7} {case:<10} {r['impl']:<32} {ms:>9} {peak:>10}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import deltafuse.ops.cross_entropy  # noqa: F401  (imports must work everywhere)
    import deltafuse.ops.moe  # noqa: F401

    plan = ([f"loss: tokens={t} hidden={args.hidden} vocab={args.vocab} head={args.head} "
             f"extra Triton whole-vocabulary chunks={args.chunk_sizes} vocabulary blocks="
             f"{['x'.join(map(str, b)) for b in args.blocks]}" for t in args.tokens]
            if not args.skip_loss else []) + \
        ([f"experts: tokens={args.moe_tokens} E={args.experts} top-{args.top_k} I={args.moe_intermediate} "
          f"H={args.hidden}"] if not args.skip_moe else [])
    if args.dry_run:
        print("dry run; would benchmark:\n  " + "\n  ".join(plan) + f"\nand write {args.out}")
        return 0
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU (use --dry-run to check arguments on CPU)", file=sys.stderr)
        return 2
    rows = []
    if not args.skip_loss:
        rows += _loss_cases(args)
    if not args.skip_moe:
        rows += _moe_cases(args)
    print(_table(rows))
    result = {"stack": _stack(), "args": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
