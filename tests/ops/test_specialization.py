"""A new packing of a row of the same width reuses the kernels compiled for the last one.

Triton compiles a kernel once per *specialisation*: besides the constexpr arguments, every integer argument is
marked by whether it equals 1 or is divisible by 16, and every pointer by whether it is 16-byte aligned. A
training step with constant-width packed rows (``deltafuse train``) must then compile nothing after its first
step. An argument whose mark follows the number of sequences compiles a second variant of the kernel at some
later step, for seconds (the GDN chunk tables did: 13.6 s at step 2 of a moe8 run on the H200).

The kernels run interpreted here; every launch's marks are recorded as Triton computes them, and each kernel
must show one set for packings whose numbers of sequences fill the 16-byte lines of an int32 table differently,
with one-token sequences, and for one whole row.
"""

from __future__ import annotations

import collections
import inspect

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from deltafuse.ops import causal_conv1d_fn, chunk_gated_delta_rule  # noqa: E402
from tests.helpers import INTERPRETED, input_gen  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="records launches of the Triton interpreter")

T = 128
# offset tables of 4, 5, 3, 6 and 2 entries: every remainder modulo 4 (four int32 entries fill 16 bytes); one-token
# sequences; one whole row
PACKINGS = [[40, 24, 64], [10, 30, 50, 38], [7, 121], [1, 60, 3, 1, 63], [T]]


def _mark(value) -> str:
    """Triton's specialisation of one non-constexpr argument."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "1" if value == 1 else "16k" if value % 16 == 0 else "int"
    if isinstance(value, float):
        return "float"
    if value is None:
        return "None"
    if torch.is_tensor(value):
        return f"{value.dtype}{'/16B' if value.data_ptr() % 16 == 0 else ''}"
    return type(value).__name__


@pytest.fixture
def launches(monkeypatch):
    """kernel name -> the set of argument marks of its launches."""
    seen = collections.defaultdict(set)
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        params = list(inspect.signature(self.fn).parameters.values())
        fixed = set(self.kwargs.get("do_not_specialize") or ())
        marks = tuple(f"{p.name}={_mark(a)}" for p, a in zip(params, args)
                      if "constexpr" not in str(p.annotation) and p.name not in fixed)
        seen[self.fn.__name__].add(marks)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def _offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _one_variant_each(seen):
    assert seen, "no Triton kernel ran"
    many = {name: sorted(marks) for name, marks in seen.items() if len(marks) > 1}
    assert not many, "kernels specialised differently for another packing of the same width: " + "; ".join(
        f"{name}: " + " | ".join(" ".join(sorted(set(m) - set.intersection(*map(set, ms)))) for m in ms)
        for name, ms in many.items())


def test_chunked_gdn_compiles_once_for_every_packing(launches):
    gen = input_gen(0)
    for lengths in PACKINGS:
        H, HV, K, V = 1, 2, 16, 16
        q, k = (torch.randn(1, T, H, K, generator=gen).requires_grad_() for _ in range(2))
        v = torch.randn(1, T, HV, V, generator=gen).requires_grad_()
        g = (-torch.rand(1, T, HV, generator=gen) - 0.05).requires_grad_()
        beta = torch.rand(1, T, HV, generator=gen).add(0.1).requires_grad_()
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_offsets(lengths), use_qk_l2norm_in_kernel=True,
                                      backend="triton")
        o.backward(torch.randn(o.shape, generator=gen))
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, g, beta))
    _one_variant_each(launches)


def test_conv1d_compiles_once_for_every_packing(launches):
    gen = input_gen(1)
    for lengths in PACKINGS:
        C, W = 8, 4
        x = torch.randn(1, C, T, generator=gen).requires_grad_()
        w = torch.randn(C, W, generator=gen).requires_grad_()
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                          torch.tensor(lengths))[None]
        y = causal_conv1d_fn(x, w, None, seq_idx=seq_idx, activation="silu", backend="triton")
        y.backward(torch.randn(y.shape, generator=gen))
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    _one_variant_each(launches)
