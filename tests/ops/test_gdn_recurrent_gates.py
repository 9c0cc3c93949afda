"""The recurrent (decoding) Triton kernel computing FLA's in-kernel gate options itself (``gates=Gates(...)``):
the raw gate a with g = -exp(A_log) * softplus(a + dt_bias), and beta logits with beta = sigmoid(beta), against
the float64 oracle fed g and beta computed by those formulas in float64.

Without CUDA the kernel runs under the Triton interpreter in fp32 on tiny shapes; every check draws fresh random
inputs and compares every element of o and of the final state.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from deltafuse.ops.gated_delta import gates as gates_mod  # noqa: E402
from deltafuse.ops.gated_delta import kernel_recurrent as kr  # noqa: E402
from deltafuse.ops.gated_delta.gates import Gates  # noqa: E402
from deltafuse.ops.gated_delta.kernel_recurrent import fused_recurrent_gated_delta_rule_triton  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402
from tests.helpers import DEVICE, INTERPRETED, assert_rel_close, gpu, input_gen, needs_cuda  # noqa: E402

if not torch.cuda.is_available() and not isinstance(kr._recurrent_fwd, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("no CUDA and the Triton kernels were compiled for a GPU (set TRITON_INTERPRET=1 before import)",
                allow_module_level=True)

TOL = 1e-5 if INTERPRETED else 1e-4
BF16_TOL = 3e-3  # the bf16 GPU tolerance of this kernel's other tests (tests/ops/test_gdn_triton.py)


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus in float64, written out: x itself above 20, else log1p(exp(x))."""
    x = x.double()
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def make(B, T, H, HV, K, V, *, N=None, gate=True, dt=True, bsig=True, dtype=torch.float32, gen):
    """Inputs of one call: what the kernel is handed (``xs``: raw gate / logits where the option is on) and the
    Gates. The raw gates spread far enough that a + dt_bias lands above 20 (softplus is x itself) and far below
    zero (softplus underflows towards 0), besides the usual range; the logits reach saturation both ways."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    n_state = B if N is None else N
    xs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V))
    A_log = r(HV) * 0.5 if gate else None
    dt_bias = r(HV) if gate and dt else None
    if gate:
        a = r(B, T, HV) * 3
        pick = torch.rand(B, T, HV, generator=gen)
        a = torch.where(pick < 0.25, 22 + 30 * torch.rand(B, T, HV, generator=gen), a)  # x > 20
        a = torch.where(pick > 0.75, -30 - 90 * torch.rand(B, T, HV, generator=gen), a)  # very negative x
        special = torch.tensor([120.0, -80.0, 40.0])[:a.numel()]  # each at least once (exp(120) overflows fp32)
        a.view(-1)[:special.numel()] = special
        xs["g"] = a
    else:
        xs["g"] = -torch.nn.functional.softplus(r(B, T, HV) * 1.5 - 0.5)
    if bsig:
        logits = r(B, T, HV) * 3
        pick = torch.rand(B, T, HV, generator=gen)
        logits = torch.where(pick < 0.15, torch.full_like(logits, 60.0), logits)
        logits = torch.where(pick > 0.85, torch.full_like(logits, -60.0), logits)
        xs["beta"] = logits
    else:
        xs["beta"] = torch.sigmoid(r(B, T, HV))
    xs = {n: x.to(device=DEVICE, dtype=dtype) for n, x in xs.items()}
    xs["h0"] = r(n_state, HV, K, V).to(DEVICE)
    if A_log is not None:
        A_log = A_log.to(DEVICE)
    if dt_bias is not None:
        dt_bias = dt_bias.to(DEVICE)
    return xs, Gates(A_log, dt_bias, gate, bsig)


def oracle(xs, gates, scale, cu=None, h0=None):
    """The float64 oracle on the (already rounded) inputs, g and beta computed from them in float64."""
    g, beta = xs["g"].double(), xs["beta"].double()
    if gates.gate:
        x = g if gates.dt_bias is None else g + gates.dt_bias.double()
        g = -gates.A_log.double().exp() * _softplus64(x)
    if gates.beta_sigmoid:
        beta = beta.sigmoid()
    h0 = xs["h0"] if h0 is None else h0
    return naive_gated_delta_rule(xs["q"].double(), xs["k"].double(), xs["v"].double(), g, beta, scale,
                                  h0.double(), True, True, cu_seqlens=cu)


def _gen():
    return input_gen()


OPTIONS = {  # gate, dt_bias, beta_sigmoid
    "gate+dt": (True, True, False),
    "gate-nodt": (True, False, False),
    "bsig": (False, False, True),
    "both+dt": (True, True, True),
    "both-nodt": (True, False, True),
}
LAYOUTS = {  # (B, T, H, HV, K, V, cu): both with grouped heads, HV = 2 H
    "rows": (2, 3, 1, 2, 16, 16, None),
    "varlen": (1, 7, 2, 4, 16, 32, [0, 2, 3, 7]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("opt", sorted(OPTIONS))
def test_gates_in_kernel_match_the_oracle(opt, layout):
    gate, dt, bsig = OPTIONS[opt]
    B, T, H, HV, K, V, cu = LAYOUTS[layout]
    xs, gates = make(B, T, H, HV, K, V, N=None if cu is None else len(cu) - 1, gate=gate, dt=dt, bsig=bsig,
                     gen=_gen())
    if gate:  # the softplus branches this case is meant to reach
        x = xs["g"] if gates.dt_bias is None else xs["g"] + gates.dt_bias
        assert (x > 20).any() and (x < -25).any()
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = 0.7 * K**-0.5
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale,
                                                        xs["h0"], True, True, cu_t, gates=gates)
    ro, rh = oracle(xs, gates, scale, cu_t)
    assert o.dtype == xs["q"].dtype and ht.dtype == torch.float32
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(ht, rh, TOL, "final state")


def test_gate_parameters_strided_and_of_another_dtype():
    """A_log a strided view, dt_bias float64: both read as fp32 (the strided one through a dense copy)."""
    xs, gates = make(2, 2, 1, 2, 16, 16, gen=_gen())
    a_log = torch.stack([gates.A_log, torch.full_like(gates.A_log, 5.0)], -1)[:, 0]  # stride 2
    assert not a_log.is_contiguous()
    gates = gates._replace(A_log=a_log, dt_bias=gates.dt_bias.double())
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                        xs["h0"], True, True, gates=gates)
    ro, rh = oracle(xs, gates, 0.25)
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(ht, rh, TOL, "final state")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gates_in_kernel_with_the_state_written_in_place(layout):
    B, T, H, HV, K, V, cu = LAYOUTS[layout]
    xs, gates = make(B, T, H, HV, K, V, N=None if cu is None else len(cu) - 1, gen=_gen())
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    before = xs["h0"].clone()
    ro, rh = oracle(xs, gates, 0.25, cu_t, h0=before)
    state = xs["h0"]
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, state,
                                                        True, True, cu_t, inplace_final_state=True, gates=gates)
    assert ht is state
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(state, rh, TOL, "state written in place")


@pytest.mark.parametrize("given", ["None", "NONE"])
def test_without_gate_options_g_and_beta_are_used_as_given(given):
    """gates=None (and a Gates with both options off) runs the plain kernel: g and beta as handed."""
    xs, plain = make(1, 6, 1, 2, 16, 16, N=3, gate=False, bsig=False, gen=_gen())
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                        xs["h0"], True, True, cu,
                                                        gates=None if given == "None" else gates_mod.NONE)
    ro, rh = oracle(xs, plain, 0.25, cu)
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(ht, rh, TOL, "final state")


def test_in_kernel_gates_agree_with_in_torch():
    """The kernel with gates= and the kernel handed gates.in_torch's g and beta give the same results."""
    xs, gates = make(2, 3, 1, 2, 16, 16, gen=_gen())
    g, beta = gates_mod.in_torch(xs["g"], xs["beta"], gates)
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                        xs["h0"], True, True, gates=gates)
        o2, ht2 = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], g, beta, 0.25, xs["h0"], True,
                                                          True)
    assert_rel_close(o, o2, TOL, "o")
    assert_rel_close(ht, ht2, TOL, "final state")


@pytest.mark.parametrize("which", ["A_log", "dt_bias"])
def test_gate_parameters_that_require_grad_are_refused(which):
    xs, gates = make(1, 1, 1, 2, 16, 16, gen=_gen())
    gates = gates._replace(**{which: getattr(gates, which).clone().requires_grad_()})
    with pytest.raises(RuntimeError, match=f"gates.{which} requires grad"):
        fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, gates=gates)


def test_gate_without_A_log_is_refused():
    xs, gates = make(1, 1, 1, 2, 16, 16, gen=_gen())
    with torch.no_grad(), pytest.raises(ValueError, match="gates.gate=True needs gates.A_log.*got A_log=None"):
        fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                gates=gates._replace(A_log=None))


def test_the_entry_declares_it_takes_gates():
    assert fused_recurrent_gated_delta_rule_triton.gates_in_kernel is True


# --- GPU: bf16 ---------------------------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("T,cu", [(1, None), (4, None), (9, [0, 1, 5, 9])])
@pytest.mark.parametrize("K,V", [(128, 128), (16, 16)])
@pytest.mark.parametrize("opt", sorted(OPTIONS))
def test_gates_in_kernel_bf16_gpu(opt, T, cu, K, V):
    """bf16 q, k, v, raw gates and logits (dt_bias bf16 too, A_log fp32 as the models keep it); the oracle is fed
    the bf16-rounded values."""
    gate, dt, bsig = OPTIONS[opt]
    B = 1 if cu else 2
    xs, gates = make(B, T, 16, 32, K, V, N=None if cu is None else len(cu) - 1, gate=gate, dt=dt, bsig=bsig,
                     dtype=torch.bfloat16, gen=_gen())
    if gates.dt_bias is not None:
        gates = gates._replace(dt_bias=gates.dt_bias.bfloat16())
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], K**-0.5,
                                                        xs["h0"], True, True, cu_t, gates=gates)
    ro, rh = oracle(xs, gates, K**-0.5, cu_t)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_rel_close(o, ro, BF16_TOL, "o")
    assert_rel_close(ht, rh, BF16_TOL, "final state")
