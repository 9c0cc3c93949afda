"""Every public op is a torch.library custom op (namespace deltafuse) that passes torch.library.opcheck: schema,
fake (meta) implementation, autograd registration and AOT dispatch, on CPU fp32 with the torch backends (the
backends CPU selects by default), on fresh random inputs, with and without gradients."""

from __future__ import annotations

import pytest
import torch

import deltafuse.ops as ops
from deltafuse.ops.conv1d import api as conv_api
from deltafuse.ops.cross_entropy import api as ce_api
from deltafuse.ops.gated_delta import api as gdn_api
from deltafuse.ops.moe import api as moe_api
from deltafuse.ops.norm import api as norm_api
from deltafuse.ops.rope import api as rope_api
from deltafuse.ops.swiglu import api as swiglu_api
from tests.helpers import input_seed


def _r(*shape, grad=False, low=None):
    t = torch.randn(*shape, dtype=torch.float32)
    if low is not None:
        t = t.abs() + low
    return t.requires_grad_(grad)


def _cases(grad):
    torch.manual_seed(input_seed("cases"))
    B, T, H, HV, K, V = 1, 7, 2, 4, 8, 8
    q, k = _r(B, T, H, K, grad=grad), _r(B, T, H, K, grad=grad)
    v = _r(B, T, HV, V, grad=grad)
    gd = (-torch.rand(B, T, HV)).requires_grad_(grad)
    beta = torch.rand(B, T, HV).requires_grad_(grad)
    h0 = _r(2, HV, K, V, grad=grad)
    cu = torch.tensor([0, 3, T], dtype=torch.int32)
    m = [grad] * 8
    a_log, dt_bias = _r(HV, grad=grad), _r(HV, grad=grad)  # FLA's in-kernel gate (chunk: raw g and beta logits)
    x, w, b = _r(2, 6, 9, grad=grad), _r(6, 4, grad=grad), _r(6, grad=grad)
    init = _r(2, 6, 3, grad=grad)
    hidden, head = _r(10, 8, grad=grad), _r(13, 8, grad=grad)
    targets = torch.randint(0, 13, (10,))
    targets[3] = -100
    N, E, I, kk = 6, 3, 4, 2
    return {
        "chunk_gated_delta_rule": (gdn_api._chunk_op.op, (q, k, v, gd, beta, h0, a_log, dt_bias, cu, 0.3, True, True,
                                                           True, True, None, m, False)),
        "fused_recurrent_gated_delta_rule": (gdn_api._recurrent_op.op,
                                             (q, k, v, gd, beta, None, None, None, None, 0.3, True, False, False, False,
                                              None, m[:5] + [False] * 3, False, False)),
        "causal_conv1d_fn": (conv_api._conv_op.op, (x, w, b, init, None, None, True, "silu", None, [grad] * 4, False)),
        "causal_conv1d_update": (conv_api._conv_update_op,
                                 (x[..., :1].detach(), _r(2, 6, 4), w.detach(), b.detach(), "silu", None)),
        "rms_norm_zero_centered": (norm_api._rms_norm_op.op, (_r(3, 5, 8, grad=grad), _r(8, grad=grad), 1e-6, None,
                                                           [grad] * 2)),
        "rms_norm_gated": (norm_api._rms_norm_gated_op.op, (_r(3, 8, grad=grad), _r(3, 8, grad=grad), _r(8, grad=grad),
                                                         1e-6, None, [grad] * 3)),
        "apply_rotary_pos_emb": (rope_api._rope_op.op, (_r(2, 3, 5, 8, grad=grad), _r(2, 1, 5, 8, grad=grad),
                                                     _r(2, 5, 4), _r(2, 5, 4), 1, None, [grad, grad, False, False])),
        "swiglu": (swiglu_api._swiglu_op.op, (_r(4, 6, grad=grad), _r(4, 6, grad=grad), None, [grad] * 2)),
        "fused_linear_cross_entropy": (ce_api._fused_ce_op.op,
                                       (hidden, head, None, targets, None, None, -100, "mean", 4, None, True, True,
                                        None, [grad, grad, False], False)),
        "token_logprobs": (ce_api._token_logprobs_op.op,
                           (hidden, head, None, targets, -100, 0.7, True, True, 4, None, None, [grad, grad, False],
                            False)),
        "moe_experts": (moe_api._moe_op.op, (_r(N, 8, grad=grad), torch.randint(0, E, (N, kk)),
                                          torch.rand(N, kk).requires_grad_(grad), _r(E, 2 * I, 8, grad=grad),
                                          _r(E, 8, I, grad=grad), None, [grad] * 4, False)),
    }


def test_every_public_op_has_a_case():
    assert set(_cases(False)) == set(ops.__all__)
    for name in ops.__all__:
        assert hasattr(torch.ops.deltafuse, name), name


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", sorted(ops.__all__))
def test_opcheck(name, grad):
    if grad and name == "causal_conv1d_update":
        pytest.skip("writes into conv_state: torch gives in-place custom ops no autograd (a differentiable "
                    "decoding step runs the backend directly)")
    op, args = _cases(grad)[name]
    torch.library.opcheck(op, args, **(_rounding_allowance(op, args) if grad else {}))


def _rounding_allowance(op, args) -> dict:
    """opcheck's tolerances for an op with gradients: its default rtol, and an atol of 1e-6 (about eight float32
    ulps) of the largest output or gradient magnitude, at least its default 1e-5. Its AOT check compares the
    gradients of sum |out| from two fp32 runs that may round differently (a traced backward, other summation
    orders); elementwise against its default atol, elements much smaller than the largest fail on rounding alone
    (a recurrent op's gradients of several hundred, with both runs as close to float64 as each other)."""
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    outs = [o for o in op(*args) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    grads = torch.autograd.grad(sum(o.sum().abs() for o in outs), inputs, allow_unused=True)
    largest = max(t.detach().abs().max().item() for t in outs + [g for g in grads if g is not None] if t.numel())
    return {"rtol": 1.3e-6, "atol": max(1e-5, 1e-6 * largest)}


@pytest.mark.parametrize("route", ["eager", "custom-op"])
def test_backward_matches_the_backend_run_directly(route):
    """The op's gradients are the backend's own (here the torch reference's autograd), called eagerly (the
    implementation itself) or through the custom op a compiled graph calls."""
    from deltafuse.ops.norm import api as norm_api
    from deltafuse.ops.norm.reference import rms_norm_gated_torch

    x, gate, w = _r(3, 8, grad=True), _r(3, 8, grad=True), _r(8, grad=True)
    if route == "eager":
        y = ops.rms_norm_gated(x, gate, w, 1e-6)
    else:
        y = norm_api._rms_norm_gated_op.op(x, gate, w, 1e-6, None, [True, True, True])[0]
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, gate, w), dy)
    want = torch.autograd.grad(rms_norm_gated_torch(x, gate, w, 1e-6), (x, gate, w), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_eager_call_records_nothing_outside_autograd():
    """Eagerly the op is its implementation: no backward record, no custom-op dispatch."""
    from deltafuse.ops import _library

    before = len(_library._records)
    x, w = _r(4, 8, grad=True), _r(8, grad=True)
    y = ops.rms_norm_zero_centered(x, w)
    assert len(_library._records) == before and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_backward_record_is_freed_with_the_graph():
    from deltafuse.ops import _library

    before = len(_library._records)
    x, w = _r(4, 8, grad=True), _r(8, grad=True)
    from deltafuse.ops.norm import api as norm_api

    def op(x, w):  # the custom op, as a compiled graph calls it
        return norm_api._rms_norm_op.op(x, w, 1e-6, None, [True, True])[0]

    y = op(x, w)
    assert len(_library._records) == before + 1
    y.sum().backward()
    del y
    assert len(_library._records) == before
    y = op(x, w)  # no backward at all
    del y
    assert len(_library._records) == before
