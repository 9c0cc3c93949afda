"""Registers, spills and shared memory of the chunked GDN op's kernels, compiled for a GPU on any machine.

The op runs once forward and backward with every Triton kernel replaced by a recorder (as in
``gdn_memory_plan.py``: the launcher allocates its buffers, no kernel runs), so each launch is seen with exactly the
arguments, compile-time constants, warps and stages the launcher gives it under the chosen options. Each distinct
launch is then compiled ahead of time for ``--arch`` (default 90, the H200's sm_90) by Triton itself, no GPU
needed, and the cubin's resource usage is read with the ``cuobjdump`` that Triton ships: registers per thread,
the stack (registers spilled to local memory, bytes per thread) and shared memory. A kernel at 255 registers with a
stack has spilled: its tiles do not fit the register file, and it waits on local memory.

    python benchmarks/gdn_registers.py                                    # 1x4096, H=16, HV=32, D=128, bf16
    python benchmarks/gdn_registers.py --options bv_wy=16,warps_bo=4 --json regs.json

Shared memory per program is taken as ``--shared-memory`` bytes (default the H200's 232,448) where the launcher fits
the sequential passes' stages to the device (``chunk_launch.pass_stages``). Registers do not depend on the token
count; the shape sets the head sizes and the value heads per q/k head. The register allocation is that of the
Triton installed here: compile with the GPU's Triton (on the GPU machine, where this runs too) to read its own.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from gdn_memory_plan import kernels_replaced  # noqa: E402

from deltafuse.ops.gated_delta import chunk_launch  # noqa: E402
from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.chunk_options import ChunkOptions  # noqa: E402

H200_SHARED = 232448  # bytes per program (Triton's max_shared_mem for an H200)
_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
            torch.int64: "*i64"}


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch and runs nothing."""

    def __init__(self, name: str, kernel, launches: list):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.name, self.kernel, grid, args, kwargs))
        return record


@contextmanager
def recording(shared_memory: int | None):
    """Every kernel of ``chunk_launch`` recorded instead of run, and the device's shared memory per program set to
    ``shared_memory`` bytes, until the block ends; yields the list of launches."""
    launches: list = []
    saved_shared = chunk_launch._shared_memory
    try:
        chunk_launch._shared_memory = lambda index: shared_memory
        chunk_launch.pass_stages.cache_clear()
        with kernels_replaced(lambda name, kernel: _Recorder(name, kernel, launches)):
            yield launches
    finally:
        chunk_launch._shared_memory = saved_shared
        chunk_launch.pass_stages.cache_clear()


def launches_of(shape: tuple[int, ...], options: ChunkOptions, dtype=torch.bfloat16, shared_memory=H200_SHARED):
    """(launches, forward) of one forward+backward of the op at ``shape`` (B, T, H, HV, D), l2norm in the kernel,
    initial state and final state included: every launch in order, and how many of them the forward made (the
    backward's, its recompute of the forward's first kernels included, follow)."""
    if chunk_launch._interpreting():
        raise SystemExit("gdn_registers.py: TRITON_INTERPRET is set; unset it (this compiles for a GPU, the "
                         "interpreter's tiles are not the GPU's)")
    B, T, H, HV, D = shape
    leaf = lambda *s: torch.empty(*s, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v, g, beta = leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, HV, D), leaf(B, T, HV), leaf(B, T, HV)
    h0 = torch.empty(B, HV, D, D, dtype=torch.float32).requires_grad_()
    with recording(shared_memory) as launches:
        o, ht = chunk_mod.chunk_gated_delta_rule_triton(q, k, v, g, beta, D**-0.5, h0, True, True, None,
                                                        options=options)
        forward = len(launches)
        torch.autograd.backward([o, ht], [torch.empty_like(o), torch.empty_like(ht)])
    return launches, forward


def _signature(kernel, args, kwargs):
    """(signature, constexprs, attributes, num_warps, num_stages) of one launch, as Triton's ahead-of-time compiler
    takes them, with the specialisation its just-in-time launch gives the same arguments: pointers and integers
    divisible by 16 marked so (without it no load is vectorised or copied asynchronously, and the report would show
    spills the GPU's kernel does not have), an integer 1 made a constant."""
    bound = inspect.signature(kernel.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                   if k not in ("num_warps", "num_stages")})
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs, attrs, kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)


def _cuobjdump() -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise SystemExit(f"gdn_registers.py: Triton's cuobjdump is not at {path} (a Triton without the NVIDIA tools)")
    return path


def resources(kernel, launch_signature, arch: int) -> dict:
    """Registers, stack bytes (spills) and shared memory of one launch (its ``_signature``) compiled for
    sm_``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, warps, stages = launch_signature
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        dump = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True,
                              check=True).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", dump))
    return dict(warps=warps, stages=stages, registers=int(usage["REG"]), stack=int(usage["STACK"]),
                shared=int(compiled.metadata.shared))


def report(shape, options: ChunkOptions, arch: int = 90, shared_memory: int | None = H200_SHARED,
           dtype=torch.bfloat16, kernels: tuple[str, ...] | None = None) -> tuple[list[dict], list]:
    """(rows, sequence) of a forward+backward. One row per distinct launch (kernel and compile-time constants): the
    kernel, the pass that launched it ("fwd", or "bwd" for the backward's, its recompute of the forward's first
    kernels included), its programs (first grid axis times the rest) and its resources
    (``resources``); only the kernels named in ``kernels`` when given. The sequence: every launch in order, as
    (kernel, grid)."""
    rows, seen = [], {}
    launches, forward = launches_of(shape, options, dtype, shared_memory)
    sequence = [(name, [int(n) for n in grid]) for name, _, grid, _, _ in launches]
    for i, (name, kernel, grid, args, kwargs) in enumerate(launches):
        if kernels is not None and name not in kernels:
            continue
        launch_signature = _signature(kernel, args, kwargs)
        signature, constexprs, attrs, warps, stages = launch_signature
        key = (name, tuple(sorted(signature.items())), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
               tuple(sorted(attrs)), warps, stages, i < forward)
        if key in seen:
            seen[key]["launches"] += 1
            continue
        programs = 1
        for n in grid:
            programs *= int(n)
        row = dict(kernel=name, passes="fwd" if i < forward else "bwd", programs=programs, launches=1,
                   **resources(kernel, launch_signature, arch))
        seen[key] = row
        rows.append(row)
    return rows, sequence


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tune_gdn import shape_and_options

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,4096,16,32,128", help="B,T,H,HV,D")
    ap.add_argument("--options", default="", help="ChunkOptions overrides, FIELD=VALUE,...")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (90: H100/H200)")
    ap.add_argument("--shared-memory", type=int, default=H200_SHARED,
                    help="shared memory per program in bytes, for the sequential passes' stage fit")
    ap.add_argument("--kernels", default="", help="compile only these kernels, NAME,NAME,... (default: all)")
    ap.add_argument("--json", default="", help="also write the rows and the launch sequence to this JSON file")
    args = ap.parse_args()
    shape, options = shape_and_options(ap, args.shape, args.options)
    if args.arch < 70:
        ap.error(f"--arch {args.arch}; allowed: a CUDA compute capability of 70 or more, as an int (90 for sm_90)")
    if args.shared_memory < 1:
        ap.error(f"--shared-memory {args.shared_memory}; allowed: a positive number of bytes")
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else ""
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
        ap.error(f"--json {args.json!r}; allowed: a file path in an existing, writable folder (it is written after "
                 "the compilations)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    known = {name for name, obj in vars(chunk_launch).items() if type(obj).__name__ == "JITFunction"}
    kernels = tuple(filter(None, args.kernels.split(","))) or None
    if kernels is not None and not set(kernels) <= known:
        ap.error(f"--kernels: {sorted(set(kernels) - known)} not among the op's kernels; allowed: "
                 f"{', '.join(sorted(known))}")
    rows, sequence = report(shape, options, args.arch, args.shared_memory, dtype, kernels)
    print(f"shape {args.shape}, {args.dtype}, options {args.options or 'defaults'}, sm_{args.arch}, "
          f"Triton {triton.__version__}")
    print("| kernel | pass | programs | warps | stages | registers | spilled (stack bytes) | shared bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['kernel']} | {r['passes']} | {r['programs']} | {r['warps']} | {r['stages']} | {r['registers']} "
              f"| {r['stack']} | {r['shared']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=shape, dtype=args.dtype, options=args.options, arch=args.arch,
                           shared_memory=args.shared_memory, triton=triton.__version__, sequence=sequence,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
