"""Bad inputs to the public ops: each a clear error naming the argument, before any kernel runs."""

import inspect

import numpy as np
import pytest
import torch

from deltafuse import ops
from deltafuse.backends import REGISTRY, BackendError, UnknownBackendError


def gdn_inputs(B=1, T=10, H=2, HV=4, K=8, V=8, dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = -torch.rand(B, T, HV) - 0.01
    beta = torch.rand(B, T, HV) * 0.9 + 0.05
    return q, k, v, g, beta


@pytest.mark.parametrize("op", [ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule])
@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(q=a["q"][0]), r"q must have 4 dimensions, got shape \(10, 2, 8\)"),
    (lambda a: a.update(k=a["k"][:, :, :1]), r"k must have q's shape \(1, 10, 2, 8\)"),
    (lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][:, :, :3]),
     r"HV=3 value heads, which is not a multiple of the H=2"),
    (lambda a: a.update(v=a["v"][:, :9]), r"v must be \[B, T, HV, V\] with B=1, T=10"),
    (lambda a: a.update(g=a["g"][:, :, :2]), r"g must be \[B, T, HV\] = \(1, 10, 4\), got \(1, 10, 2\)"),
    (lambda a: a.update(beta=a["beta"][..., None]), r"beta must have 3 dimensions"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), r"q has dtype int32; allowed: float16, bfloat16"),
    (lambda a: a.update(k=a["k"].double()), r"q and k must share a dtype"),
    (lambda a: a.update(q=a["q"].to("meta")), r"k is on cpu but q is on meta"),
    (lambda a: a.update(initial_state=torch.randn(2, 4, 8, 8)),
     r"initial_state must be \[N, HV, K, V\] = \(1, 4, 8, 8\) with N = B, got \(2, 4, 8, 8\)"),
    (lambda a: a.update(scale="big"), r"scale must be a float or None"),
    (lambda a: a.update(head_first=True), r"head_first=True is not supported"),
    (lambda a: a.update(frobnicate=1), r"unexpected keyword argument\(s\) \['frobnicate'\]"),
])
def test_gdn_bad_arguments(op, mutate, match):
    q, k, v, g, beta = gdn_inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        op(**args)


@pytest.mark.parametrize("cu,B,match", [
    (torch.tensor([0, 4, 10]), 2, r"cu_seqlens needs the batch dimension to be 1.*B=2"),
    (torch.tensor([1, 4, 10]), 1, r"cu_seqlens must start at 0, got 1"),
    (torch.tensor([0, 6, 4, 10]), 1, r"cu_seqlens must be strictly increasing"),
    (torch.tensor([0, 4, 4, 10]), 1, r"cu_seqlens must be strictly increasing"),
    (torch.tensor([0, 10, 10, 4]), 1, r"cu_seqlens must be strictly increasing"),
    (torch.tensor([0, 4, 9]), 1, r"cu_seqlens must end at T=10 \(the packed length\), got 9"),
    (torch.tensor([0.0, 10.0]), 1, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([[0, 10]]), 1, r"cu_seqlens must be a 1-D integer tensor"),
    (torch.tensor([0]), 1, r"at least 2 offsets"),
])
def test_gdn_bad_cu_seqlens(cu, B, match):
    q, k, v, g, beta = gdn_inputs(B=B)
    with pytest.raises(ValueError, match=match):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gdn_empty_sequences_at_the_end(backend):
    """Offsets that repeat T after the last sequence (a fixed-size offsets tensor with room to spare) are empty
    sequences: the real ones' outputs, every final state (an empty sequence's is its initial state) and every
    gradient equal the float64 oracle's."""
    from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule
    from tests.helpers import INTERPRETED, rel_rms

    if backend == "triton" and not (INTERPRETED or torch.cuda.is_available()):
        pytest.skip("Triton needs CUDA or the interpreter")
    dev = "cuda" if backend == "triton" and not INTERPRETED else "cpu"
    q, k, v, g, beta = (t.to(dev) for t in gdn_inputs())
    cu = torch.tensor([0, 3, 10, 10, 10], device=dev)
    h0 = torch.randn(4, v.shape[2], q.shape[3], v.shape[3], device=dev)
    xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, ht = ops.chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend=backend)
    ro, rht = naive_gated_delta_rule(*ref[:5], None, ref[5], True, True, cu)
    tol = 1e-5 if dev == "cpu" else 1e-4  # the GPU's fp32 products are three-pass tf32
    assert rel_rms(o, ro) < tol and rel_rms(ht, rht) < tol
    assert torch.equal(ht[2:], h0[2:])
    do, dht = torch.randn_like(ro), torch.randn_like(rht)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((ro * do).sum() + (rht * dht).sum()).backward()
    for mine, theirs in zip(xs, ref):
        assert rel_rms(mine.grad, theirs.grad) < tol


def test_gdn_initial_state_count_follows_cu_seqlens():
    q, k, v, g, beta = gdn_inputs()
    cu = torch.tensor([0, 3, 10])
    with pytest.raises(ValueError, match=r"N = len\(cu_seqlens\) - 1, got \(1, 4, 8, 8\)"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=torch.randn(1, 4, 8, 8))


def test_forced_backend_that_cannot_serve_raises():
    q, k, v, g, beta = gdn_inputs()
    with pytest.raises(BackendError, match="backend 'fla' cannot serve chunk_gated_delta_rule"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, backend="fla")
    with pytest.raises(ValueError, match="backend='gpu'"):
        ops.chunk_gated_delta_rule(q, k, v, g, beta, backend="gpu")
    assert "fla" in [c.name for c in REGISTRY.candidates("chunk_gated_delta_rule")]


@pytest.mark.parametrize("kw,match", [
    (dict(x=torch.randn(2, 6)), r"x must have 3 dimensions"),
    (dict(weight=torch.randn(5, 4)), r"weight must be \[C, W\] with C=6 channels of x, got \(5, 4\)"),
    (dict(bias=torch.randn(5)), r"bias must be \[C\] = \(6,\), got \(5,\)"),
    (dict(activation="gelu"), r"activation='gelu' is not supported; allowed: None, 'silu', 'swish'"),
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int32)), r"seq_idx must be \[B, T\] = \(2, 10\)"),
    (dict(seq_idx=torch.zeros(2, 10)), r"seq_idx has dtype float32; allowed: int32, int64"),
    (dict(cu_seqlens=torch.tensor([0, 10])), r"cu_seqlens needs the batch dimension to be 1"),
    (dict(initial_states=torch.randn(2, 6, 4)), r"initial_states must be \[B, C, W-1\] = \(2, 6, 3\)"),
])
def test_conv_bad_arguments(kw, match):
    args = dict(x=torch.randn(2, 6, 10), weight=torch.randn(6, 4), bias=None)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        ops.causal_conv1d_fn(**args)


def test_conv_update_bad_state():
    with pytest.raises(ValueError, match=r"conv_state must be \[B, C, S\] with B=2, C=6, S >= W-1 = 3"):
        ops.causal_conv1d_update(torch.randn(2, 6, 1), torch.randn(2, 6, 2), torch.randn(6, 4))


# --- every argument of every public op, given a value of the wrong kind ------------------------------------
# kinds: T tensor, T? tensor or None, B bool, I int, I? int or None, F float, F? float or None, S str,
# S? str or None, N a number, a one-element tensor or None, O a tuple of output names (N and O are checked by the
# op itself: a ValueError)
def _gdn_args():
    q, k, v, g, beta = gdn_inputs()
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=0.3, initial_state=torch.randn(2, 4, 8, 8),
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 4, 10]))


_GDN_GATES = dict(use_gate_in_kernel=True, A_log=torch.randn(4), dt_bias=torch.randn(4), use_beta_sigmoid_in_kernel=True)
_GDN_KINDS = dict(q="T", k="T", v="T", g="T", beta="T", scale="F?", initial_state="T?", output_final_state="B",
                  use_qk_l2norm_in_kernel="B", cu_seqlens="T?")
_GATE_KINDS = dict(use_gate_in_kernel="B", A_log="T?", dt_bias="T?", use_beta_sigmoid_in_kernel="B")

OP_TABLE = {
    "chunk_gated_delta_rule": (lambda: dict(_gdn_args(), **_GDN_GATES), dict(_GDN_KINDS, **_GATE_KINDS)),
    "fused_recurrent_gated_delta_rule": (lambda: dict(_gdn_args(), inplace_final_state=False, **_GDN_GATES),
                                         dict(_GDN_KINDS, inplace_final_state="B", **_GATE_KINDS)),
    "causal_conv1d_fn": (
        lambda: dict(x=torch.randn(1, 6, 10), weight=torch.randn(6, 4), bias=torch.randn(6), seq_idx=None,
                     initial_states=torch.randn(1, 6, 3), return_final_states=True,
                     final_states_out=torch.empty(1, 6, 3), activation="silu", cu_seqlens=torch.tensor([0, 3, 10])),
        dict(x="T", weight="T", bias="T?", seq_idx="T?", initial_states="T?", return_final_states="B",
             final_states_out="T?", activation="S?", cu_seqlens="T?")),
    "causal_conv1d_update": (
        lambda: dict(x=torch.randn(2, 6, 1), conv_state=torch.randn(2, 6, 3), weight=torch.randn(6, 4),
                     bias=torch.randn(6), activation="silu"),
        dict(x="T", conv_state="T", weight="T", bias="T?", activation="S?")),
    "rms_norm_zero_centered": (
        lambda: dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=1e-5),
        dict(x="T", weight="T", eps="F")),
    "rms_norm_gated": (
        lambda: dict(x=torch.randn(3, 8), gate=torch.randn(3, 8), weight=torch.randn(8), eps=1e-5),
        dict(x="T", gate="T", weight="T", eps="F")),
    "apply_rotary_pos_emb": (
        lambda: dict(q=torch.randn(1, 2, 3, 16), k=torch.randn(1, 1, 3, 16), cos=torch.randn(1, 3, 8),
                     sin=torch.randn(1, 3, 8), unsqueeze_dim=1),
        dict(q="T", k="T", cos="T", sin="T", unsqueeze_dim="I")),
    "swiglu": (lambda: dict(gate=torch.randn(3, 8), up=torch.randn(3, 8)), dict(gate="T", up="T")),
    "fused_linear_cross_entropy": (
        lambda: dict(hidden=torch.randn(2, 5, 8), weight=torch.randn(13, 8), labels=torch.randint(0, 13, (2, 5)),
                     bias=torch.randn(13), ignore_index=-100, reduction="mean", num_items_in_batch=7, shift=True,
                     chunk_size=4, vocab_chunk_size=8, return_logits=True, return_token_accuracy=True),
        dict(hidden="T", weight="T", labels="T", bias="T?", ignore_index="I", reduction="S",
             num_items_in_batch="N", shift="B", chunk_size="I?", vocab_chunk_size="I?", return_logits="B",
             return_token_accuracy="B")),
    "token_logprobs": (
        lambda: dict(hidden=torch.randn(2, 5, 8), weight=torch.randn(13, 8), targets=torch.randint(0, 13, (2, 5)),
                     bias=torch.randn(13), temperature=0.7, outputs=("log_probs", "entropy", "is_top1"),
                     ignore_index=-100, chunk_size=4, vocab_chunk_size=8),
        dict(hidden="T", weight="T", targets="T", bias="T?", temperature="F", outputs="O", ignore_index="I",
             chunk_size="I?", vocab_chunk_size="I?")),
    "moe_experts": (
        lambda: dict(hidden=torch.randn(5, 8), top_k_index=torch.randint(0, 4, (5, 2)),
                     top_k_weights=torch.rand(5, 2), gate_up_proj=torch.randn(4, 8, 8),
                     down_proj=torch.randn(4, 8, 4), act="silu"),
        dict(hidden="T", top_k_index="T", top_k_weights="T", gate_up_proj="T", down_proj="T", act="S")),
}

WRONG = {
    "T": [[[0.5, 1.5]], np.ones((2, 3), np.float32), 3, None],
    "T?": [[0, 10, 20], np.ones((2, 3), np.float32), 3, 2.5],
    "B": [torch.tensor(True), "yes", 1, None],
    "I": [torch.tensor(1), "1", [1], None],
    "I?": [torch.tensor(4), "4", [4]],
    "F": [torch.tensor(0.5), "0.5", [0.5], None],
    "F?": [torch.tensor(0.5), "0.5", [0.5]],
    "S": [3, torch.tensor(1), ["silu"], None],
    "S?": [3, torch.tensor(1), ["silu"]],
    "N": ["3", [3]],
    "O": ["entropy", ("log_probs", 3), ("mean_logits",), 3],
}
WRONG_CASES = [(op, arg, value) for op, (_, kinds) in OP_TABLE.items() for arg, kind in kinds.items()
               for value in WRONG[kind]]


def test_every_public_op_and_argument_is_covered():
    assert set(OP_TABLE) == set(ops.__all__)
    for op, (make, kinds) in OP_TABLE.items():
        signature = inspect.signature(getattr(ops, op)).parameters
        params = [p.name for p in signature.values() if p.kind is not p.VAR_KEYWORD and p.name != "backend"]
        assert params == list(kinds) and set(make()) == set(kinds), op
        # the per-call backend: a keyword-only parameter of every op, checked against the op's own names
        assert signature["backend"].kind is inspect.Parameter.KEYWORD_ONLY and signature["backend"].default is None


@pytest.mark.parametrize("op", sorted(OP_TABLE))
def test_valid_arguments_of_the_table_are_accepted(op):
    """The baseline every wrong-kind case below starts from runs (so each error is due to the one change)."""
    out = getattr(ops, op)(**OP_TABLE[op][0]())
    for t in out if isinstance(out, tuple) else (out,):
        assert t is None or bool(torch.isfinite(t).all())


@pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
@pytest.mark.parametrize("op,arg,value", WRONG_CASES,
                         ids=[f"{op}-{arg}-{type(v).__name__}" for op, arg, v in WRONG_CASES])
def test_wrong_kind_of_argument_names_op_argument_and_value(op, arg, value, positional):
    fn = getattr(ops, op)
    make, kinds = OP_TABLE[op]
    kwargs = make()
    kwargs[arg] = value
    args = []
    if positional:  # everything up to and including the bad argument by position, where the signature allows
        for p in inspect.signature(fn).parameters.values():
            if p.kind is not p.POSITIONAL_OR_KEYWORD:
                break
            args.append(kwargs.pop(p.name))
            if p.name == arg:
                break
    expected = ValueError if kinds[arg] in ("N", "O") else TypeError
    with pytest.raises(expected) as err:
        fn(*args, **kwargs)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)  # every argument error of the ops is also a ValueError
    assert msg.startswith(f"{op}: {arg} must be "), msg
    assert type(value).__name__ in msg or kinds[arg] in ("N", "O"), msg
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        assert repr(value) in msg, msg
    else:
        assert str(tuple(value.shape)) in msg, msg


def test_value_errors_name_the_op():
    g = torch.randn(3, 20)
    with pytest.raises(ValueError) as err:
        ops.swiglu(g, torch.randn(3, 3))
    assert str(err.value) == "swiglu: up must have gate's shape (3, 20), got (3, 3)"
    with pytest.raises(ValueError, match=r"^moe_experts: top_k_index must hold expert ids in \[0, 4\), got values "
                                         r"in \[0, 9\]$"):
        args = OP_TABLE["moe_experts"][0]()
        args["top_k_index"][0, 0] = 9
        args["top_k_index"][0, 1] = 0  # the lowest id in the message is fixed, not left to the random draw
        ops.moe_experts(**args)


# --- backend= on every op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(OP_TABLE))
@pytest.mark.parametrize("value", [3, ["torch"], torch.tensor(0)])
def test_backend_of_the_wrong_type_is_a_type_error(op, value):
    with pytest.raises(TypeError) as err:
        getattr(ops, op)(**OP_TABLE[op][0](), backend=value)
    msg = str(err.value)
    assert msg.startswith(f"{op}: backend must be a backend name (a str), got {type(value).__name__}")
    assert repr(value) in msg and "'auto'" in msg
    assert all(repr(n) in msg for n in REGISTRY.backend_names(op))


@pytest.mark.parametrize("op", sorted(OP_TABLE))
def test_backend_the_op_lacks_is_an_error(op):
    own = REGISTRY.backend_names(op)
    lacking = [n for n in ("triton", "fla", "npu", "torch") if n not in own] + ["cuda"]
    for name in lacking:
        with pytest.raises(UnknownBackendError) as err:
            getattr(ops, op)(**OP_TABLE[op][0](), backend=name)
        msg = str(err.value)
        assert msg.startswith(f"{op}: backend={name!r} is not one of its backends; allowed: 'auto'")
        assert all(repr(n) in msg for n in own)


def _silu64(x):
    x = x.double()
    return x / (1 + torch.exp(-x))


def test_global_backend_leaves_ops_without_it_on_their_own_choice(monkeypatch):
    """DELTAFUSE_BACKEND=fla forces FLA where an op has it; swiglu, the RMSNorm and the conv keep their own
    (correct) choice. Checked against float64 oracles on fresh inputs."""
    monkeypatch.setenv("DELTAFUSE_BACKEND", "fla")
    gate, up = torch.randn(4, 24), torch.randn(4, 24)
    got = ops.swiglu(gate, up)
    torch.testing.assert_close(got.double(), _silu64(gate) * up.double(), rtol=1e-6, atol=1e-6)
    x, w = torch.randn(4, 24), torch.randn(24)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    torch.testing.assert_close(ops.rms_norm_zero_centered(x, w).double(), ref, rtol=1e-5, atol=1e-5)
    xc, wc = torch.randn(1, 6, 9), torch.randn(6, 4)
    padded = torch.nn.functional.pad(xc.double(), (3, 0))
    conv = sum(wc.double()[:, j, None] * padded[:, :, j:j + 9] for j in range(4))
    torch.testing.assert_close(ops.causal_conv1d_fn(xc, wc, activation="silu").double(), _silu64(conv),
                               rtol=1e-5, atol=1e-5)
    # an op that has the backend: forced, and FLA cannot serve CPU tensors, so it is an error
    with pytest.raises(BackendError, match="backend 'fla' cannot serve chunk_gated_delta_rule"):
        ops.chunk_gated_delta_rule(*gdn_inputs())
