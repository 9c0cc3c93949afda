"""The ops' per-call host path: cached selection from the tensors (``backends.select_tensors``), the fast kind
checks of ``public_op``, the environment read per call, and the host-overhead benchmark's smoke mode."""

import json
import os
import sys

import pytest
import torch

from deltafuse import backends, config, ops
from deltafuse.backends import settings
from deltafuse.backends import REGISTRY, BackendError, CallInfo, Candidate
from deltafuse.ops import _checks
from deltafuse.ops.gated_delta.candidates import CHUNK
from deltafuse.ops.swiglu.candidates import SWIGLU
from tests.helpers import assert_rel_close, input_gen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Probe:
    """An implementation of swiglu that counts its calls (computed in float64 as an independent oracle)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gate, up):
        self.calls += 1
        g = gate.double()
        return (g * torch.sigmoid(g) * up.double()).to(gate.dtype)


@pytest.fixture
def probe():
    """A candidate 'probe' registered first for swiglu (removed afterwards)."""
    p = Probe()
    REGISTRY.register(SWIGLU, Candidate("probe", load=lambda: p), before=REGISTRY.candidates(SWIGLU)[0].name)
    yield p
    REGISTRY.unregister(SWIGLU, "probe")


def _pair(*shape, dtype=torch.float32, grad=False):
    gen = input_gen(sum(shape))
    a = torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)
    b = torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)
    return a, b


def _oracle(a, b):
    g = a.detach().double()
    return g * torch.sigmoid(g) * b.detach().double()


def test_select_tensors_gives_the_decision_of_select(probe):
    a, b = _pair(2, 8)
    for grad in (False, True):
        call = CallInfo(a.device, a.dtype, grad)
        assert REGISTRY.select_tensors(SWIGLU, "auto", grad, (a, b)) is REGISTRY.select(SWIGLU, call, "auto")
        assert REGISTRY.select_tensors(SWIGLU, "torch", grad, (a, b)) is REGISTRY.select(SWIGLU, call, "torch")
    assert REGISTRY.select_tensors(SWIGLU, "auto", False, (None, a, b)) is probe  # the first present tensor


def test_registering_and_unregistering_invalidates_the_cached_choice(probe):
    a, b = _pair(3, 16)
    out = ops.swiglu(a, b)
    assert probe.calls == 1
    assert_rel_close(out, _oracle(a, b), 1e-6, "probe")
    ops.swiglu(a, b)
    assert probe.calls == 2  # cached: the probe serves again
    REGISTRY.unregister(SWIGLU, "probe")
    try:
        out = ops.swiglu(a, b)
        assert probe.calls == 2  # not the stale cached probe
        assert_rel_close(out, _oracle(a, b), 1e-6, "torch after unregister")
    finally:
        REGISTRY.register(SWIGLU, Candidate("probe", load=lambda: probe), before=REGISTRY.candidates(SWIGLU)[0].name)
    ops.swiglu(a, b)
    assert probe.calls == 3


@pytest.fixture
def forced_only_probe():
    """A swiglu candidate 'probe' that serves only when forced (auto selection passes it over)."""
    p = Probe()
    REGISTRY.register(SWIGLU, Candidate("probe", load=lambda: p, auto_skip=lambda call: "forced only"),
                      before=REGISTRY.candidates(SWIGLU)[0].name)
    yield p
    REGISTRY.unregister(SWIGLU, "probe")
    backends.set_backend_override(None)


def test_env_backend_and_apply_override_are_honoured_per_call(forced_only_probe, monkeypatch):
    p = forced_only_probe
    a, b = _pair(2, 4)
    monkeypatch.delenv("DELTAFUSE_BACKEND", raising=False)
    ops.swiglu(a, b)
    assert p.calls == 0
    monkeypatch.setenv("DELTAFUSE_BACKEND", "probe")
    assert_rel_close(ops.swiglu(a, b), _oracle(a, b), 1e-6, "env-forced probe")
    assert p.calls == 1
    monkeypatch.setenv("DELTAFUSE_BACKEND", "auto")
    ops.swiglu(a, b)
    assert p.calls == 1
    monkeypatch.delenv("DELTAFUSE_BACKEND")
    backends.set_backend_override("probe")
    ops.swiglu(a, b)
    assert p.calls == 2
    backends.set_backend_override(None)
    ops.swiglu(a, b)
    assert p.calls == 2
    ops.swiglu(a, b, backend="probe")  # a per-call name
    assert p.calls == 3
    monkeypatch.setenv("DELTAFUSE_BACKEND", "no-such-backend")
    with pytest.raises(config.SettingsError, match="DELTAFUSE_BACKEND='no-such-backend' is not a backend"):
        ops.swiglu(a, b)


def test_dtype_and_grad_are_part_of_the_cached_decision():
    p = Probe()
    REGISTRY.register(SWIGLU, Candidate("probe", load=lambda: p,
                                        supports=lambda call: None if call.dtype == torch.float64 else "fp64 only",
                                        known_bad=lambda call: "no backward" if call.needs_grad else None),
                      before=REGISTRY.candidates(SWIGLU)[0].name)
    try:
        ops.swiglu(*_pair(2, 4, dtype=torch.float64))
        assert p.calls == 1
        ops.swiglu(*_pair(2, 4))  # fp32: not the probe
        assert p.calls == 1
        a, b = _pair(2, 4, dtype=torch.float64, grad=True)
        out = ops.swiglu(a, b)  # needs grad: not the probe, and differentiable
        assert p.calls == 1
        out.sum().backward()
        g = a.detach()
        s = torch.sigmoid(g)
        assert_rel_close(b.grad, g * s, 1e-12, "d up")
        assert_rel_close(a.grad, b.detach() * s * (1 + g * (1 - s)), 1e-12, "d gate")
        with torch.no_grad():
            ops.swiglu(a, b)
        assert p.calls == 2
        with pytest.raises(BackendError, match="backend 'probe' cannot serve swiglu.*fp64 only"):
            ops.swiglu(*_pair(2, 4), backend="probe")
    finally:
        REGISTRY.unregister(SWIGLU, "probe")


def _gdn_inputs(K, V=8, T=3):
    gen = input_gen(K + V + T)
    q = torch.randn(1, T, 1, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen), dim=-1)
    v = torch.randn(1, T, 2, V, generator=gen)
    g = -torch.rand(1, T, 2, generator=gen)
    beta = torch.rand(1, T, 2, generator=gen)
    return q, k, v, g, beta


def test_shape_facts_are_part_of_the_cached_decision_and_still_refuse():
    seen = []
    reference = REGISTRY.select(CHUNK, CallInfo(torch.device("cpu"), torch.float32, False, (("K", 8), ("V", 8))),
                                "torch")

    def small(*args, **kwargs):
        seen.append(args[0].shape[-1])
        return reference(*args, **kwargs)

    REGISTRY.register(CHUNK, Candidate("small-k", load=lambda: small,
                                       supports=lambda call: None if call.fact("K") <= 8 else
                                       f"K={call.fact('K')} is over 8"), before=REGISTRY.candidates(CHUNK)[0].name)
    try:
        o8, _ = ops.chunk_gated_delta_rule(*_gdn_inputs(8))
        assert seen == [8]
        o16, _ = ops.chunk_gated_delta_rule(*_gdn_inputs(16))  # another K: decided anew, the torch reference
        assert seen == [8]
        ref16, _ = reference(*_gdn_inputs(16), 16 ** -0.5, None, False, False, None)
        assert_rel_close(o16, ref16, 1e-6, "K=16 output")
        with pytest.raises(BackendError, match="backend 'small-k' cannot serve chunk_gated_delta_rule.*K=16 is over 8"):
            ops.chunk_gated_delta_rule(*_gdn_inputs(16), backend="small-k")
        ops.chunk_gated_delta_rule(*_gdn_inputs(8), backend="small-k")
        assert seen == [8, 8]
    finally:
        REGISTRY.unregister(CHUNK, "small-k")


class _TensorSub(torch.Tensor):
    pass


def test_kind_checks_fast_path_accepts_and_refuses_as_the_full_check():
    a, b = _pair(2, 4)
    want = _oracle(a, b)
    # subclasses and Parameters take the full check (or the exact-type set) and pass
    assert_rel_close(ops.swiglu(torch.nn.Parameter(a.clone()), b).detach(), want, 1e-6, "parameter")
    assert_rel_close(ops.swiglu(a.as_subclass(_TensorSub), b), want, 1e-6, "subclass")
    with pytest.raises(_checks.ArgumentTypeError,
                       match=r"^swiglu: up must be a torch.Tensor, got list \(\[1.0, 2.0\]\)$"):
        ops.swiglu(a, [1.0, 2.0])
    with pytest.raises(_checks.ArgumentTypeError, match=r"^swiglu: gate must be a torch.Tensor, got NoneType"):
        ops.swiglu(None, b)
    with pytest.raises(_checks.ArgumentTypeError, match=r"^rms_norm_zero_centered: eps must be a float, "
                                                         r"got True \(bool\)$"):
        ops.rms_norm_zero_centered(a, torch.randn(4), True)
    with pytest.raises(_checks.ArgumentTypeError, match=r"^rms_norm_zero_centered: eps must be a float, "
                                                         r"got '1e-6' \(str\)$"):
        ops.rms_norm_zero_centered(a, torch.randn(4), eps="1e-6")
    w = torch.randn(4)
    x = torch.randn(2, 4)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1) * (1 + w.double())
    assert_rel_close(ops.rms_norm_zero_centered(x, w, 1), ref, 1e-6, "int eps")  # an int where a float goes


@pytest.mark.parametrize("value", [None, "", "torch", "TORCH ", "auto"])
def test_environ_read_matches_os_environ(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("DELTAFUSE_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DELTAFUSE_BACKEND", value)
    assert settings.env_backend() == ("auto" if value is None else settings.parse_backend("DELTAFUSE_BACKEND", value))


def test_environ_read_with_a_plain_mapping_in_place_of_os_environ(monkeypatch):
    monkeypatch.setattr(os, "environ", {"DELTAFUSE_BACKEND": "torch", "DELTAFUSE_VALIDATE": "yes"})
    assert settings.env_backend() == "torch"
    assert config.env_switch("DELTAFUSE_VALIDATE") is True
    monkeypatch.setattr(os, "environ", {})
    assert settings.env_backend() == "auto"
    assert config.env_switch("DELTAFUSE_VALIDATE") is False


def test_conv_update_eager_writes_the_state_in_place_as_the_custom_op():
    gen = input_gen(5)
    x, w, b = torch.randn(2, 6, 1, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    state = torch.randn(2, 6, 3, generator=gen)
    s1, s2 = state.clone(), state.clone()
    out = ops.causal_conv1d_update(x, s1, w, b, "silu")
    want = torch.ops.deltafuse.causal_conv1d_update(x, s2, w, b, "silu", None)
    window = torch.cat([state, x], -1).double()  # the oracle: the last W inputs against the weight
    y = (window * w.double()).sum(-1, keepdim=True) + b.double()[:, None]
    assert_rel_close(out, y * torch.sigmoid(y), 1e-6, "out")
    assert_rel_close(out, want, 1e-6, "out vs custom op")
    assert torch.equal(s1, s2) and torch.equal(s1, torch.cat([state[..., 1:], x], -1))


def test_host_overhead_smoke(tmp_path, one_thread):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import host_overhead
    finally:
        sys.path.pop(0)
    out = tmp_path / "host.json"
    names = ["swiglu", "causal_conv1d_update", "rms_norm_gated"]
    assert host_overhead.main(["--smoke", "--out", str(out), "--ops", ",".join(names)]) == 0
    data = json.loads(out.read_text())
    rows = [r for r in data["results"] if r["section"] == "op"]
    assert [(r["op"], r["mode"]) for r in rows] == [
        ("causal_conv1d_update", "forward"), ("rms_norm_gated", "forward"), ("rms_norm_gated", "forward+backward"),
        ("swiglu", "forward"), ("swiglu", "forward+backward")]
    for r in rows:
        assert 0 < r["direct_us"] < 1e6 and 0 < r["public_us"] < 1e6, r
        assert r["overhead_us"] == pytest.approx(r["public_us"] - r["direct_us"])
    model = [(r["step"], r["impl"]) for r in data["results"] if r["section"] == "model"]
    assert sorted(model) == sorted((s, i) for s in ("decode step", "training step") for i in ("stock", "deltafuse"))
    assert "host-overhead-stand-in" not in REGISTRY.backend_names()  # the stand-in is gone again
    with pytest.raises(SystemExit):
        host_overhead.main(["--smoke", "--ops", "nope"])
