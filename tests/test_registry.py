import pytest
import torch

from deltafuse import backends
from deltafuse.backends import gated_delta as gd
from deltafuse.backends import probes
from deltafuse.backends.registry import BackendError, CallInfo, Candidate, Registry

CPU = torch.device("cpu")


def _registry(*cands):
    reg = Registry()
    for c in cands:
        reg.register("op", c)
    return reg


def test_first_passing_candidate_wins_and_reasons_are_kept():
    reg = _registry(
        Candidate("a", lambda: "A", available=lambda: "a is not installed"),
        Candidate("b", lambda: "B", supports=lambda call: "b needs cuda" if call.device.type == "cpu" else None),
        Candidate("c", lambda: "C"),
        Candidate("d", lambda: "D"),
    )
    call = CallInfo(CPU, torch.float32, True)
    assert reg.select("op", call) == "C"
    rows = reg.explain("op", call)
    assert [(r.candidate, r.chosen) for r in rows] == [("a", False), ("b", False), ("c", True), ("d", False)]
    assert rows[0].reason == "a is not installed" and rows[1].reason == "b needs cuda"
    assert "earlier" in rows[3].reason


def test_known_bad_is_per_call():
    reg = _registry(
        Candidate("fast", lambda: "F", known_bad=lambda call: "wrong gradients" if call.needs_grad else None),
        Candidate("safe", lambda: "S"),
    )
    assert reg.select("op", CallInfo(CPU, torch.float32, True)) == "S"
    assert reg.select("op", CallInfo(CPU, torch.float32, False)) == "F"


def test_forced_backend_serves_or_raises_with_reason():
    reg = _registry(Candidate("x", lambda: "X", supports=lambda call: "x needs cuda"), Candidate("y", lambda: "Y"))
    call = CallInfo(CPU, torch.float32, False)
    assert reg.select("op", call, "y") == "Y"
    with pytest.raises(BackendError, match="backend 'x' cannot serve op.*x needs cuda"):
        reg.select("op", call, "x")
    # a forced name the op does not have falls back to automatic selection
    assert reg.select("op", call, "fla") == "Y"


def test_no_candidate_error_lists_every_reason():
    reg = _registry(Candidate("x", lambda: "X", available=lambda: "missing x"),
                    Candidate("y", lambda: "Y", supports=lambda call: "bad dtype"))
    with pytest.raises(BackendError, match="no implementation of op.*x: missing x; y: bad dtype"):
        reg.select("op", CallInfo(CPU, torch.float16, True))


def test_selection_is_cached_and_availability_checked_once():
    calls = {"avail": 0, "load": 0}

    def avail():
        calls["avail"] += 1

    def load():
        calls["load"] += 1
        return "Z"

    reg = _registry(Candidate("z", load, available=avail))
    call = CallInfo(CPU, torch.float32, True)
    for _ in range(5):
        assert reg.select("op", call) == "Z"
    assert calls == {"avail": 1, "load": 1}


def test_duplicate_and_unknown():
    reg = _registry(Candidate("a", lambda: "A"))
    with pytest.raises(ValueError, match="already has a candidate named 'a'"):
        reg.register("op", Candidate("a", lambda: "A"))
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        reg.candidates("nope")
    reg.register("op", Candidate("first", lambda: "F"), before="a")
    assert [c.name for c in reg.candidates("op")] == ["first", "a"]


def test_fla_never_serves_cpu_tensors(monkeypatch):
    """With FLA installed (simulated as available), a model on CPU must still get the torch reference."""
    reg = Registry()
    gd.register(reg)
    reg._available[(gd.CHUNK, "fla")] = None  # pretend `import fla` works
    call = CallInfo(CPU, torch.float32, True)
    rows = {r.candidate: r for r in reg.explain(gd.CHUNK, call)}
    assert rows["torch"].chosen and "CUDA" in rows["fla"].reason


@pytest.mark.parametrize("triton_version,bad", [((3, 3, 1), False), ((3, 4, 0), True), ((3, 6, 0), True),
                                                ((3, 7, 0), True), ((3, 7, 1), False), ((3, 9, 0), False)])
def test_fla_backward_refused_on_hopper_with_affected_triton(monkeypatch, triton_version, bad):
    monkeypatch.setattr(probes, "triton_version", lambda: triton_version)
    monkeypatch.setattr(probes, "is_hopper", lambda device: True)
    monkeypatch.setattr(probes, "cuda_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    reason = gd.fla_backward_known_bad(CallInfo(cuda, torch.bfloat16, True))
    assert (reason is not None) is bad
    if bad:
        assert "Hopper" in reason and "3.7.1" in reason
    # inference (forward only) is fine on every version
    assert gd.fla_backward_known_bad(CallInfo(cuda, torch.bfloat16, False)) is None


def test_fla_backward_fine_off_hopper(monkeypatch):
    monkeypatch.setattr(probes, "triton_version", lambda: (3, 6, 0))
    monkeypatch.setattr(probes, "is_hopper", lambda device: False)
    assert gd.fla_backward_known_bad(CallInfo(torch.device("cuda", 0), torch.bfloat16, True)) is None


def test_interpreted_triton_only_when_forced(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reg = Registry()
    gd.register(reg)
    call = CallInfo(CPU, torch.float32, True)
    rows = {r.candidate: r for r in reg.explain(gd.CHUNK, call)}
    assert rows["torch"].chosen and "forced" in rows["triton"].reason
    assert next(r for r in reg.explain(gd.CHUNK, call, "triton") if r.chosen).candidate == "triton"


def test_backend_env_and_override(monkeypatch):
    monkeypatch.setenv("DELTAFUSE_BACKEND", "torch")
    assert backends.current_backend() == "torch"
    backends.set_backend_override("fla")
    try:
        assert backends.current_backend() == "fla"
    finally:
        backends.set_backend_override(None)
    monkeypatch.setenv("DELTAFUSE_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="DELTAFUSE_BACKEND='nonsense'"):
        backends.current_backend()
