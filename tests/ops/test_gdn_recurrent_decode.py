"""The recurrent (decoding) gated delta rule kernel against the float64 oracle, its options, its host side
(strided inputs, no copies, the in-place final state) and a decoding model with it against stock transformers.

Without CUDA the kernel runs under the Triton interpreter in fp32 on tiny shapes; every check draws fresh
random inputs and compares every element of o and of the final state.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

triton = pytest.importorskip("triton")

from deltafuse import ops  # noqa: E402
from deltafuse.ops.gated_delta import kernel_recurrent as kr  # noqa: E402
from deltafuse.ops.gated_delta.kernel_recurrent import (  # noqa: E402
    RecurrentOptions, fused_recurrent_gated_delta_rule_triton, launch_config,
)
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402
from tests.helpers import DEVICE, INTERPRETED, assert_rel_close, input_gen, input_seed  # noqa: E402

if not torch.cuda.is_available() and not isinstance(kr._recurrent_fwd, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("no CUDA and the Triton kernels were compiled for a GPU (set TRITON_INTERPRET=1 before import)",
                allow_module_level=True)

TOL = 1e-5 if INTERPRETED else 1e-4


def make(B, T, H, HV, K, V, *, N=None, h0=True, l2=True, seed=None):
    gen = input_gen() if seed is None else input_gen(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K)
    if not l2:  # the models hand unit-norm rows when the kernel does not normalise
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    xs = dict(q=q, k=k, v=r(B, T, HV, V), g=-torch.nn.functional.softplus(r(B, T, HV) * 1.5 - 0.5),
              beta=torch.sigmoid(r(B, T, HV)))
    xs = {n: x.to(DEVICE) for n, x in xs.items()}
    xs["h0"] = r(B if N is None else N, HV, K, V).to(DEVICE) if h0 else None
    return xs


def oracle(xs, scale, l2, cu=None):
    return naive_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale, xs["h0"], True, l2,
                                  cu_seqlens=cu)


CASES = {  # (B, T, H, HV, K, V, cu)
    "T1": (3, 1, 2, 2, 16, 16, None),
    "T1-grouped": (2, 1, 2, 4, 16, 32, None),
    "T-few": (2, 3, 1, 2, 16, 16, None),
    "odd-sizes": (2, 2, 1, 3, 12, 24, None),  # K and V not powers of two: masked lanes
    "varlen": (1, 6, 2, 4, 16, 16, [0, 1, 1, 4, 6]),  # a length-0 and a length-1 sequence
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("l2", [True, False], ids=["l2", "no-l2"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "zero-h0"])
@pytest.mark.parametrize("final", [True, False], ids=["final", "no-final"])
def test_matches_the_oracle(case, l2, h0, final):
    B, T, H, HV, K, V, cu = CASES[case]
    N = None if cu is None else len(cu) - 1
    xs = make(B, T, H, HV, K, V, N=N, h0=h0, l2=l2)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = 0.7 * K**-0.5
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale,
                                                        xs["h0"], final, l2, cu_t)
    ro, rh = oracle(xs, scale, l2, cu_t)
    assert o.dtype == xs["q"].dtype
    assert_rel_close(o, ro, TOL, "o")
    if final:
        assert ht.dtype == torch.float32
        assert_rel_close(ht, rh, TOL, "final state")
    else:
        assert ht is None


def test_int64_offsets():
    xs = make(1, 5, 1, 2, 16, 16, N=3)
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int64, device=DEVICE)
    o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, xs["h0"],
                                                    True, True, cu)
    ro, rh = oracle(xs, 0.25, True, cu)
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(ht, rh, TOL, "final state")


def _hf_layout(B, T, H, HV, K, V, seed=None):
    """q, k, v as transformers hands them to the decode op: views of one [B, T, 2HK + HV*V] conv output (the
    batch stride is the whole row, not H*K); g and beta here are strided views too (transformers' are dense)."""
    gen = input_gen() if seed is None else input_gen(seed)
    mixed = torch.randn(B, T, 2 * H * K + HV * V, generator=gen).to(DEVICE)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
    ab = torch.randn(B, T, 2 * HV, generator=gen)
    ab = torch.cat([ab[..., :HV].sigmoid(), -torch.nn.functional.softplus(ab[..., HV:])], -1).to(DEVICE)
    beta, g = ab[..., :HV], ab[..., HV:]  # views of one [B, T, 2HV] tensor: strided over tokens
    h0 = torch.randn(B, HV, K, V, generator=gen).to(DEVICE)
    assert not q.is_contiguous() and not v.is_contiguous() and not g.is_contiguous()
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def _assert_kernel_gives_the_oracle(xs, q):
    """The kernel on ``q`` (the same values as xs["q"], in another layout) and the rest of ``xs`` (scale 0.25, with
    the final state and the in-kernel l2 norm) matches the oracle on ``xs``."""
    o, ht = fused_recurrent_gated_delta_rule_triton(q, xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, xs["h0"], True,
                                                    True)
    ro, rh = oracle(xs, 0.25, True)
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(ht, rh, TOL, "final state")


def test_strided_inputs_as_transformers_passes_them():
    xs = _hf_layout(3, 2, 2, 4, 16, 16)
    _assert_kernel_gives_the_oracle(xs, xs["q"])


def test_inner_dimension_not_dense_is_copied_and_still_right():
    xs = make(2, 1, 2, 2, 16, 16)
    q_t = xs["q"].transpose(-1, -2).contiguous().transpose(-1, -2)  # stride 1 on heads, not on K
    _assert_kernel_gives_the_oracle(xs, q_t)


def test_inplace_final_state_overwrites_the_initial_state():
    xs = _hf_layout(2, 1, 2, 4, 16, 32)
    before = xs["h0"].clone()
    ro, rh = oracle(dict(xs, h0=before), 0.25, True)
    state = xs["h0"]
    o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, state,
                                                    True, True, inplace_final_state=True)
    assert ht is state
    assert_rel_close(o, ro, TOL, "o")
    assert_rel_close(state, rh, TOL, "state written in place")
    # without output_final_state nothing is written (there is no final state)
    state2 = before.clone()
    o2, ht2 = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, state2,
                                                      False, True, inplace_final_state=True)
    assert ht2 is None and torch.equal(state2, before)
    assert_rel_close(o2, ro, TOL, "o")


@pytest.mark.parametrize("bad", ["none", "bf16", "strided"])
def test_inplace_final_state_refuses_what_it_cannot_write(bad):
    xs = make(2, 1, 1, 2, 16, 16)
    h0 = {"none": None, "bf16": xs["h0"].bfloat16(), "strided": xs["h0"].transpose(-1, -2)}[bad]
    with pytest.raises(ValueError, match="inplace_final_state=True needs"):
        fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, h0, True, True,
                                                inplace_final_state=True)


def test_empty_sequences_keep_the_state():
    xs = make(1, 0, 1, 2, 16, 16, N=2)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, xs["h0"],
                                                    True, True, cu)
    assert o.shape == (1, 0, 2, 16) and torch.equal(ht, xs["h0"]) and ht is not xs["h0"]


# --- options ---------------------------------------------------------------------------------------------------
def test_launch_config_fills_the_gpu_at_batch_one():
    # Qwen3.5 decode: 32 value heads of 128 x 128; on a GPU the tile narrows until >= min_programs programs
    BK, BV, warps, _ = launch_config(1, 32, 128, 128, interpreting=False)
    assert (BK, BV) == (128, 8) and 32 * (128 // BV) >= DEFAULT_MIN_PROGRAMS and warps == 1
    BK, BV, warps, _ = launch_config(32, 32, 128, 128, interpreting=False)
    assert (BV, warps) == (32, 4)  # 4096 programs already: the wide tile
    opts = RecurrentOptions(bv=64, bv_min=16, min_programs=4096, warps=2, stages=3)
    assert launch_config(1, 32, 128, 128, opts, interpreting=False) == (128, 16, 2, 3)
    assert launch_config(128, 32, 128, 128, opts, interpreting=False) == (128, 64, 2, 3)
    # head sizes under 64: at most 2 warps
    assert launch_config(64, 4, 32, 32, RecurrentOptions(warps=8), interpreting=False)[2] == 2
    # the interpreter's fixed tile with the defaults
    assert launch_config(1, 32, 128, 128, interpreting=True) == (128, 16, 1, 1)


DEFAULT_MIN_PROGRAMS = RecurrentOptions().min_programs


@pytest.mark.parametrize("opts", [RecurrentOptions(bv=8, bv_min=8), RecurrentOptions(bv=32, bv_min=32, warps=2),
                                  RecurrentOptions(bv=32, bv_min=8, min_programs=10**6, stages=2)],
                         ids=["bv8", "bv32-2warps", "narrowed-stages2"])
def test_every_option_gives_the_oracle(opts):
    xs = make(2, 2, 2, 4, 16, 32)
    with torch.no_grad(), kr.configured(opts):
        o, ht = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                        xs["h0"], True, True)
    o2, ht2 = fused_recurrent_gated_delta_rule_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25,
                                                      xs["h0"], True, True, options=opts)
    ro, rh = oracle(xs, 0.25, True)
    for got, want, name in ((o, ro, "o"), (ht, rh, "state"), (o2, ro, "o (options=)"), (ht2, rh, "state (options=)")):
        assert_rel_close(got, want, TOL, name)
    assert kr.options_in_effect() is kr.DEFAULT_OPTIONS


@pytest.mark.parametrize("field,value", [("bv", 0), ("bv", 24), ("bv_min", 3), ("min_programs", 0),
                                         ("warps", -1), ("warps", 3), ("stages", 0), ("bv", True)])
def test_options_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=f"RecurrentOptions.{field}="):
        RecurrentOptions(**{field: value})
    with pytest.raises(ValueError, match="bv_min=64 is over bv=32"):
        RecurrentOptions(bv=32, bv_min=64)
    with pytest.raises(TypeError, match="RecurrentOptions"):
        with kr.configured(dataclasses.asdict(RecurrentOptions())):
            pass


# --- host side: what one decoding call allocates and copies ---------------------------------------------------------
def _profiled_ops(fn) -> list[str]:
    """The aten ops ``fn`` runs (the kernel launch itself stubbed out: its interpreter would add its own)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


class _NoLaunch:
    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
        return launch


def test_a_decoding_call_allocates_only_its_output(monkeypatch):
    """A transformers-shaped decode step (strided q/k/v, no offsets): one launch, the output's allocation and,
    in place, nothing else: no contiguous copies, no offsets tensor, no state allocation or cast."""
    stub = _NoLaunch()
    monkeypatch.setattr(kr, "_recurrent_fwd", stub)
    xs = _hf_layout(4, 1, 2, 4, 16, 16)
    call = functools.partial(fused_recurrent_gated_delta_rule_triton, xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"],
                             0.25, xs["h0"], True, True)
    with torch.no_grad():
        inplace = _profiled_ops(lambda: call(inplace_final_state=True))
        fresh = _profiled_ops(call)
    assert stub.launches == 2
    assert inplace == ["aten::empty"], inplace
    assert fresh == ["aten::empty", "aten::empty"], fresh


def test_the_public_op_in_place(monkeypatch):
    """ops.fused_recurrent_gated_delta_rule(inplace_final_state=True): the Triton kernel writes the state in
    place (no copy), other backends copy; both return the initial state tensor holding the oracle's state."""
    xs = _hf_layout(2, 1, 2, 4, 16, 16)
    ro, rh = oracle(dict(xs, h0=xs["h0"].clone()), 0.25, True)
    args = (xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"])
    for backend in ("triton", "torch"):
        state = xs["h0"].clone()
        with torch.no_grad():
            o, ht = ops.fused_recurrent_gated_delta_rule(*args, scale=0.25, initial_state=state,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                         backend=backend, inplace_final_state=True)
        assert ht is state, backend
        assert_rel_close(o, ro, TOL, f"o ({backend})")
        assert_rel_close(state, rh, TOL, f"state ({backend})")
    stub = _NoLaunch()
    monkeypatch.setattr(kr, "_recurrent_fwd", stub)
    with torch.no_grad():
        names = _profiled_ops(lambda: ops.fused_recurrent_gated_delta_rule(
            *args, scale=0.25, initial_state=xs["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
            backend="triton", inplace_final_state=True))
    assert stub.launches == 1 and "aten::copy_" not in names and names.count("aten::empty") == 1, names


@pytest.mark.parametrize("bad,match", [("none", "needs an initial_state"), ("bf16", "contiguous fp32"),
                                       ("grad", "for inference")])
def test_the_public_op_refuses_an_impossible_in_place(bad, match):
    xs = make(1, 1, 1, 2, 16, 16)
    h0 = {"none": None, "bf16": xs["h0"].bfloat16(), "grad": xs["h0"].clone().requires_grad_()}[bad]
    with pytest.raises(ValueError, match=f"fused_recurrent_gated_delta_rule: inplace_final_state=True.*{match}"):
        ops.fused_recurrent_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=h0,
                                             output_final_state=True, backend="torch", inplace_final_state=True)


# --- a decoding model --------------------------------------------------------------------------------------------
def _recurrent_states(cache, layers):
    if hasattr(cache, "get_recurrent_state"):  # transformers with the cache's accessor
        return [cache.get_recurrent_state(i) for i in layers]
    # older releases: the layer's tensor, or (5.16-5.17, layers that may hold several) a dict by state index
    states = [cache.layers[i].recurrent_states for i in layers]
    return [s[0] if isinstance(s, dict) else s for s in states]


def test_generate_with_the_triton_decode_kernel_equals_stock(monkeypatch):
    """The tiny Qwen3.5 model (fp32) generating greedily: with deltafuse and the recurrent Triton kernel serving
    every decode step (state written in place), the token ids equal stock transformers', and so do the cached
    recurrent states after the last step."""
    from deltafuse import patching
    from deltafuse.integrations.transformers import adapters
    from deltafuse.models import build_model

    model = build_model("tiny", seed=input_seed("model", 3)).to(DEVICE).eval()  # a GPU's Triton needs CUDA tensors
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=input_gen(5)).to(DEVICE)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    calls = {"n": 0, "in_place": 0}
    original = adapters.ops.fused_recurrent_gated_delta_rule

    def triton_recurrent(*args, **kw):
        calls["n"] += 1
        o, final = original(*args, backend="triton", **kw)
        calls["in_place"] += int(final is not None and final is kw.get("initial_state"))
        return o, final

    monkeypatch.setattr(adapters.ops, "fused_recurrent_gated_delta_rule", triton_recurrent)
    with patching.patched(model), torch.no_grad():
        out = model.generate(ids, **kwargs)
    n_gdn = sum(t == "linear_attention" for t in model.config.layer_types)
    assert calls["n"] == 3 * n_gdn and calls["in_place"] == calls["n"]
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        assert_rel_close(got, want, 1e-4, "logits")
    layers = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    for got, want in zip(_recurrent_states(out.past_key_values, layers),
                         _recurrent_states(ref.past_key_values, layers), strict=True):
        assert got.dtype == torch.float32
        assert_rel_close(got, want, 1e-4, "cached recurrent state")
