"""`deltafuse bench ops`'s arguments, checked without importing torch, transformers or the backend registry.

A bad argument (an unknown option or op, a shape that is not B,T,H,HV,D, a --device that is not one) is one line
and exit status 2 at once; ``deltafuse.bench.ops`` (torch, the registry) is imported only to run the benchmark.
The op names are data here: ``tests/bench/test_ops.py`` holds them equal to the registry's, in its order.
"""

from __future__ import annotations

import argparse
import re

from deltafuse.argtypes import int_at_least
from deltafuse.bench.cases import CPU_SIZES, QWEN35_35B_A3B

# every op deltafuse's registry routes, in registration order (``tuple(deltafuse.backends.REGISTRY.ops)``)
OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update",
       "rms_norm_zero_centered", "rms_norm_gated", "apply_rotary_pos_emb", "swiglu", "fused_linear_cross_entropy",
       "token_logprobs", "moe_experts", "sdpa_attention", "packed_causal_attention")
GDN_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
           "causal_conv1d_update")
CPU_SHAPES = ("1,512,4,8,32",)
GPU_SHAPES = ("1,4096,16,32,128", "1,16384,16,32,128", "8,2048,16,32,128", "1,65536,16,32,128")
GPU_TOKENS = QWEN35_35B_A3B.tokens
CPU_TOKENS = CPU_SIZES.tokens
# Ops timed at model sizes (``Sizes``), with the names of the dimensions their "shape" lists.
SIZED_DIMS = {
    "rms_norm_zero_centered": "N,D",
    "rms_norm_gated": "N*HV,Dv",
    "apply_rotary_pos_emb": "B,HQ,HK,T,D,rotary_dim",
    "swiglu": "N,I",
    "fused_linear_cross_entropy": "B,T,H,V",
    "token_logprobs": "N,H,V",
    "moe_experts": "N,H,E,k,I",
}
DEVICES = "auto, cpu, cpu:0, cuda, cuda:N"


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``B,T,H,HV,D`` as five positive integers with HV a multiple of H; else a one-line argparse error."""
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


def parse_device(text: str) -> str:
    """``auto``, ``cpu`` (or ``cpu:0``), ``cuda`` or ``cuda:N`` (whether CUDA is there is checked when the benchmark
    runs)."""
    if not re.fullmatch(r"auto|cpu(:0)?|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; allowed: {DEVICES}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Per-op forward and forward+backward time (median) and peak memory of every op "
                          "deltafuse routes: deltafuse's selected implementation vs the stock transformers code "
                          "for the same computation, vs Liger-Kernel / flash-linear-attention / causal-conv1d "
                          "(on CUDA, when installed) where they have the op.")
    parser.add_argument("--op", action="append", choices=OPS, default=None,
                        help="op to time (repeatable; default: every op in deltafuse's registry)")
    parser.add_argument("--shape", action="append", type=parse_shape, default=None, metavar="B,T,H,HV,D",
                        help=f"shape of the GDN and conv ops ({', '.join(GDN_OPS)}) (repeatable; default: "
                             f"{' '.join(CPU_SHAPES)} on CPU; on CUDA the Qwen3.5-35B-A3B GDN heads (H=16, HV=32, "
                             f"D=128) at 4k to 64k tokens: {' '.join(GPU_SHAPES)})")
    parser.add_argument("--tokens", metavar="N", type=int_at_least(2), default=None,
                        help=f"tokens of the other ops' cases ({', '.join(SIZED_DIMS)}) (default: {GPU_TOKENS} "
                             f"at Qwen3.5-35B-A3B sizes on CUDA, {CPU_TOKENS} at small sizes on CPU)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="input dtype (default auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", default="auto", metavar="DEVICE", type=parse_device,
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--reps", metavar="N", type=int_at_least(1), default=5,
                        help="timed repetitions on CPU / without Triton (default: 5)")
    parser.add_argument("--fla-unguarded", action="store_true",
                        help="set FLA's Hopper guard off so its backward can be timed (its gradients are wrong "
                             "there; marked in the table)")
    parser.add_argument("--output", default=None, metavar="JSON", help="also write the rows as JSON here")
