"""Host time per call on a CUDA device: a torch op, Triton launches, and deltafuse's ops on tiny tensors.

Every call runs on tensors so small that the GPU finishes each kernel long before the host issues the next, so
the wall time per call (``--calls`` calls after a warm-up, one synchronisation at the end) is host time: what
torch's dispatch, Triton's launcher and deltafuse's Python around each kernel cost.

    python benchmarks/host_per_call.py [--calls 3000]
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _two_args(X, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(X + o, tl.load(X + o, mask=o < n) + 1, mask=o < n)


@triton.jit
def _twelve_args(X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, n, BLOCK: tl.constexpr, C1: tl.constexpr,
                 C2: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(X + o, tl.load(X + o, mask=o < n) + 1, mask=o < n)


def _time(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="timed calls per case (default: %(default)s)")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls must be >= 1, got {args.calls}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: on a CPU there is no launch to time")
    from deltafuse import ops
    from deltafuse.ops.norm import kernel as norm_kernel

    dev = "cuda"
    x = torch.randn(64, device=dev)
    ys = [torch.randn(64, device=dev) for _ in range(10)]
    h = torch.randn(8, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    q, k = (torch.randn(1, 64, 2, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 64, 4, 128, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(1, 64, 4, device=dev)
    beta = torch.rand(1, 64, 4, device=dev, dtype=torch.bfloat16)
    cases = [
        ("torch x.add_(1)", lambda: x.add_(1)),
        ("Triton launch, 2 arguments", lambda: _two_args[(1,)](x, 64, BLOCK=64)),
        ("Triton launch, 12 arguments", lambda: _twelve_args[(1,)](x, *ys, 64, BLOCK=64, C1=1, C2=2)),
        ("RMSNorm autograd Function, no gradient", lambda: norm_kernel.rms_norm_zero_centered_triton(h, w, 1e-6)),
        ("RMSNorm public op, no gradient", lambda: ops.rms_norm_zero_centered(h, w, 1e-6)),
        ("chunked GDN public op forward, no gradient",
         lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)),
    ]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    with torch.no_grad():
        for name, fn in cases:
            print(f"{name:<46} {_time(fn, args.calls):8.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
