"""GPU benchmark: causal self-attention over one packed row, forward + backward, four ways.

  dense       transformers' ``sdpa`` path for packed rows: a [1, 1, T, T] block-causal boolean mask, all T x T
              pairs (key/value heads repeated to the query heads)
  by-seq      deltafuse's route for long packed rows (``causal_attention_by_sequence``), torch's backend choice
  by-seq-X    the same with SDPA restricted to backend X (flash, efficient, cudnn)
  varlen      ``torch.nn.attention.varlen.varlen_attn`` (one flash kernel over all sequences), when it exists

Shapes default to Qwen3.5-35B-A3B's full-attention layers (16 query heads, 2 key/value heads, head size
256), bf16, one row of --tokens tokens cut into sequences of random lengths around --mean-len. "fresh"
draws new lengths at every call (as packed training batches do: every step brings new sequence lengths,
so shape-specialised kernels meet new shapes), "repeat" reuses one set. Times are wall-clock means per
call after one warm-up call, with the GPU synchronised around each call.

    python benchmarks/bench_packed_attention.py out.json [--tokens 16384] [--mean-len 270] [--calls 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from deltafuse.ops.attention.packed import causal_attention_by_sequence  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default="bench_packed_attention.json")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--mean-len", type=int, default=270, help="mean sequence length (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--calls", type=int, default=8, help="timed calls per case (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("mean_len", "heads", "kv_heads", "head_dim", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if min(args.tokens) < 2:
        p.error(f"--tokens must all be >= 2, got {args.tokens}")
    return args


def _offsets(T, mean_len, gen):
    offs = [0]
    while offs[-1] < T:
        offs.append(min(T, offs[-1] + int(torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (1,),
                                                        generator=gen))))
    return offs


def _dense(q, k, v, offs):
    T = q.shape[2]
    seq = torch.zeros(T, dtype=torch.int64, device=q.device)
    seq[torch.tensor(offs[1:-1], device=q.device)] = 1
    seq = seq.cumsum(0)
    pos = torch.arange(T, device=q.device)
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None]).transpose(1, 2)


def _varlen(q, k, v, offs):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(offs, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(offs[:-1], offs[1:]))
    qf, kf, vf = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H, D]
    group = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    try:
        out = varlen_attn(qf, kf, vf, cu, cu, longest, longest, window_size=(-1, 0))
    except TypeError:  # older signature
        out = varlen_attn(qf, kf, vf, cu, cu, longest, longest, is_causal=True)
    return out.unsqueeze(0)


def _by_seq(backend):
    def run(q, k, v, offs):
        if backend is None:
            return causal_attention_by_sequence(q, k, v, offs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return causal_attention_by_sequence(q, k, v, offs)
    return run


def _case(fn, T, args, fresh, gen):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, args.heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, args.kv_heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, args.kv_heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    fixed = _offsets(T, args.mean_len, gen)
    times = []
    for i in range(args.calls + 1):
        offs = _offsets(T, args.mean_len, gen) if fresh else fixed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(q, k, v, offs)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        if i:  # the first call is the warm-up
            times.append((time.perf_counter() - t0) * 1e3)
        q.grad = k.grad = v.grad = None
    return sum(times) / len(times), max(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    impls = [("dense", _dense), ("by-seq", _by_seq(None)), ("by-seq-flash", _by_seq("FLASH_ATTENTION")),
             ("by-seq-efficient", _by_seq("EFFICIENT_ATTENTION")), ("by-seq-cudnn", _by_seq("CUDNN_ATTENTION")),
             ("varlen", _varlen)]
    rows = []
    for T in args.tokens:
        for fresh in (True, False):
            for name, fn in impls:
                row = {"tokens": T, "lengths": "fresh" if fresh else "repeat", "impl": name}
                try:
                    mean, worst = _case(fn, T, args, fresh, torch.Generator().manual_seed(T))
                    row.update(mean_ms=mean, max_ms=worst)
                except Exception as exc:  # noqa: BLE001  (a backend that does not take this shape)
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    traceback.print_exc()
                torch.cuda.empty_cache()
                rows.append(row)
                print(f"{T:>6} {row['lengths']:<7} {name:<17} " +
                      (f"{row['mean_ms']:9.2f} ms mean {row['max_ms']:9.2f} ms max" if "mean_ms" in row
                       else row["error"]), flush=True)
    stack = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    Path(args.out).write_text(json.dumps({"stack": stack, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
