"""compile_ahead: a step run once with its Triton launches compiled in threads instead of run, after which the
real step compiles nothing and computes what it computes without it."""

from __future__ import annotations

import sys

import pytest
import torch

from deltafuse.ops._compile_ahead import compile_ahead
from tests.helpers import DEVICE, INTERPRETED, gpu, input_gen, needs_cuda


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "4"])
def test_bad_workers_name_the_value(workers):
    with pytest.raises(ValueError, match=r"compile_ahead\(workers=.*\); allowed: a whole number >= 1, or None"):
        compile_ahead(lambda: None, workers=workers)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's case")
def test_interpreter_compiles_nothing_and_does_not_run_the_step():
    ran = []
    report = compile_ahead(lambda: ran.append(1), workers=2)
    assert ran == [] and report.compiled == 0 and report.launches == 0
    assert "TRITON_INTERPRET=1" in report.skipped


def _forget_compiled() -> int:
    """Drop every compiled deltafuse kernel held in memory (Triton's on-disk cache stays), so that the next
    launch of each goes through Triton's compile path again; returns how many kernels were dropped."""
    from triton.runtime.jit import JITFunction

    dropped = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("deltafuse.ops.") and mod is not None:
            for value in vars(mod).values():
                if isinstance(value, JITFunction) and value.device_caches:
                    dropped += 1
                    value.device_caches.clear()
    return dropped


def _step(seed: int):
    """GDN (packed, l2norm, gates in the kernel), conv1d, gated RMSNorm and the fused loss, forward and
    backward, on fresh random bf16 inputs; returns the outputs and every input gradient."""
    import deltafuse.ops as ops

    g = input_gen(seed, device=DEVICE)
    dt = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dt).requires_grad_(True)

    T, H, HV, K, V, C = 300, 2, 4, 64, 64, 96
    q, k, v = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, HV, V)
    a, b = rand(1, T, HV), rand(1, T, HV)
    A_log = (torch.rand(HV, generator=g, device=DEVICE) + 0.5).requires_grad_(True)
    dt_bias = torch.rand(HV, generator=g, device=DEVICE).requires_grad_(True)
    cu = torch.tensor([0, 70, 201, T], device=DEVICE, dtype=torch.int32)
    o, _ = ops.chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      use_beta_sigmoid_in_kernel=True)
    x, w = rand(1, C, T), rand(C, 4, scale=0.5)
    y = ops.causal_conv1d_fn(x, w, None, activation="silu", cu_seqlens=cu)
    z, nw = rand(T, HV * V), (1 + 0.1 * torch.randn(V, generator=g, device=DEVICE)).requires_grad_(True)
    n = ops.rms_norm_gated(o.reshape(T, HV, V), z.reshape(T, HV, V), nw, eps=1e-6)
    head = rand(50, HV * V, scale=0.05)
    labels = torch.randint(0, 50, (1, T), generator=g, device=DEVICE)
    loss = ops.fused_linear_cross_entropy(n.reshape(1, T, HV * V) + y.sum(1, keepdim=True).transpose(1, 2), head,
                                          labels)
    leaves = [q, k, v, a, b, A_log, dt_bias, x, w, z, nw, head]
    (loss + (o.float() ** 2).mean()).backward()
    return [o.detach(), y.detach(), n.detach(), loss.detach()] + [t.grad for t in leaves]


@gpu
@needs_cuda
def test_gpu_real_step_after_compile_ahead_compiles_nothing_and_matches():
    from triton import knobs

    want = _step(0)
    assert _forget_compiled() >= 5
    report = compile_ahead(lambda: _step(0), workers=4)
    assert report.skipped is None and report.compiled >= 5 and report.launches >= report.compiled, report
    compiled = []
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["fn"]) and False
    try:
        got = _step(0)
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert compiled == [], [getattr(f, "name", f) for f in compiled]
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), i
