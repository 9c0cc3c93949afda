import pytest
import torch

from deltafuse import backends
from deltafuse.ops.gated_delta import candidates as gd
from deltafuse.backends import probes
from deltafuse.backends.registry import BackendError, CallInfo, Candidate, Registry
from tests.helpers import input_gen

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


# --- FLA on Ascend NPUs (triton-ascend): routing and argument mapping with stand-ins ---------------------
def test_fla_ascend_availability_needs_torch_npu_triton_ascend_and_fla(monkeypatch):
    present = {"torch_npu": None, "fla.ops.gated_delta_rule": None}
    monkeypatch.setattr(probes, "import_error", lambda m: present.get(m, f"{m} is not installed"))
    monkeypatch.setattr(gd, "_triton_ascend_version", lambda: None)
    assert "triton-ascend" in gd._fla_ascend_available()
    monkeypatch.setattr(gd, "_triton_ascend_version", lambda: "3.2.0")
    assert gd._fla_ascend_available() is None
    present["fla.ops.gated_delta_rule"] = "fla.ops.gated_delta_rule is not installed"
    assert gd._fla_ascend_available() == "fla.ops.gated_delta_rule is not installed"
    present["torch_npu"] = "torch_npu is not installed"
    assert gd._fla_ascend_available() == "torch_npu is not installed"


@pytest.mark.parametrize("op,fn", [(gd.CHUNK, "chunk_gated_delta_rule"),
                                   (gd.RECURRENT, "fused_recurrent_gated_delta_rule")])
def test_fla_ascend_route_serves_npu_tensors_only(monkeypatch, op, fn):
    import sys
    import types

    from tests.helpers import npu_device

    calls = []

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append(dict(args=(q, k, v, g, beta), scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, l2=use_qk_l2norm_in_kernel, cu=cu_seqlens))
        return v * 2, None

    mod = types.ModuleType("fla.ops.gated_delta_rule")
    setattr(mod, fn, fake)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", mod)
    reg = Registry()
    gd.register(reg)
    reg._available[(op, "npu")] = None  # torch_npu, triton-ascend and FLA present (stand-ins)
    reg._available[(op, "fla")] = None
    npu = CallInfo(npu_device(), torch.bfloat16, op == gd.CHUNK)
    rows = {r.candidate: r for r in reg.explain(op, npu)}
    assert rows["npu"].chosen and rows["npu"].verified is False
    assert "CUDA" in rows["fla"].reason and "npu" in rows["triton"].reason
    # CPU and CUDA tensors never go to the Ascend route
    for dev in (CPU, torch.device("cuda", 0)):
        reason = {r.candidate: r for r in reg.explain(op, CallInfo(dev, torch.bfloat16, False))}["npu"].reason
        assert reason and "npu device" in reason
    impl = reg.select(op, npu)
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    v, g, beta = torch.randn(1, 5, 4, 8), -torch.rand(1, 5, 4), torch.rand(1, 5, 4)
    h0, cu = torch.randn(2, 4, 8, 8), torch.tensor([0, 2, 5])
    out, _ = impl(q, k, v, g, beta, 0.25, h0, True, True, cu)
    c = calls[-1]
    assert all(a is b for a, b in zip(c["args"], (q, k, v, g, beta)))
    assert c["scale"] == 0.25 and c["initial_state"] is h0 and c["output_final_state"] is True
    assert c["l2"] is True and c["cu"] is cu and torch.equal(out, v * 2)


def test_backend_names_in_registration_order():
    reg = _registry(Candidate("b", lambda: "B"), Candidate("a", lambda: "A"))
    reg.register("other", Candidate("c", lambda: "C"))
    reg.register("other", Candidate("a", lambda: "A2"))
    assert reg.backend_names() == ("b", "a", "c") and reg.backend_names("other") == ("c", "a")
    version = reg.version
    reg.unregister("other", "c")
    assert reg.backend_names() == ("b", "a") and reg.version > version


@pytest.mark.parametrize("op", sorted(backends.REGISTRY.ops))
@pytest.mark.parametrize("value", [3, 2.5, ["torch"], ("torch",), b"torch", torch.tensor(1), True])
def test_per_call_backend_of_the_wrong_type_names_op_value_and_backends(op, value):
    with pytest.raises(TypeError) as err:
        backends.select(op, CallInfo(CPU, torch.float32, False), value)
    msg = str(err.value)
    assert msg.startswith(f"{op}: backend must be a backend name (a str), got {type(value).__name__}")
    assert repr(value) in msg
    for name in backends.REGISTRY.backend_names(op):
        assert repr(name) in msg


@pytest.mark.parametrize("op", sorted(backends.REGISTRY.ops))
def test_per_call_backend_the_op_lacks_is_refused(op):
    own = backends.REGISTRY.backend_names(op)
    for name in [n for n in backends.REGISTRY.backend_names() if n not in own] + ["gpu", ""]:
        with pytest.raises(backends.UnknownBackendError) as err:
            backends.select(op, CallInfo(CPU, torch.float32, False), name)
        msg = str(err.value)
        assert isinstance(err.value, ValueError) and isinstance(err.value, BackendError)
        assert msg.startswith(f"{op}: backend={name!r} is not one of its backends; allowed: 'auto', ")
        assert all(repr(n) in msg for n in own)
    # its own names (any case) are accepted: torch serves CPU calls for every op that has it
    if "torch" in own:
        assert backends.select(op, CallInfo(CPU, torch.float32, False), " Torch ") is \
            backends.select(op, CallInfo(CPU, torch.float32, False), "torch")


def test_global_backend_ops_without_it_keep_their_choice(monkeypatch):
    """DELTAFUSE_BACKEND / apply(backend=) force every op that has the backend; the others choose as usual."""
    call = CallInfo(CPU, torch.float32, False)
    auto = {op: backends.select(op, call, "auto") for op in ("swiglu", "rms_norm_zero_centered", "causal_conv1d_fn")}
    monkeypatch.setenv("DELTAFUSE_BACKEND", "fla")
    for op, impl in auto.items():
        assert "fla" not in backends.REGISTRY.backend_names(op)
        assert backends.select(op, call) is impl
    # an op that has it and cannot serve the call: an error, as documented
    with pytest.raises(BackendError, match="backend 'fla' cannot serve chunk_gated_delta_rule"):
        backends.select(gd.CHUNK, call)
    monkeypatch.setenv("DELTAFUSE_BACKEND", "npu")  # registered, so it can be forced
    assert backends.current_backend() == "npu"
    with pytest.raises(BackendError, match="backend 'npu' cannot serve swiglu"):
        backends.select("swiglu", call)
    assert backends.select("causal_conv1d_fn", call) is auto["causal_conv1d_fn"]


@pytest.mark.parametrize("word,interpreting", [("1", True), ("true", True), ("TRUE", True), ("on", True),
                                               ("yes", True), ("0", False), ("false", False), ("off", False),
                                               ("no", False), ("", False)])
def test_triton_interpret_read_one_way(monkeypatch, word, interpreting):
    """deltafuse's registry and both GDN kernels read TRITON_INTERPRET as Triton itself does."""
    knobs = pytest.importorskip("triton").knobs
    chunk = pytest.importorskip("deltafuse.ops.gated_delta.chunk_launch")
    monkeypatch.setenv("TRITON_INTERPRET", word)
    assert knobs.runtime.interpret is interpreting
    assert probes.triton_interpreting() is interpreting and chunk._interpreting() is interpreting
    triton_row = next(c for c in backends.REGISTRY.candidates(gd.CHUNK) if c.name == "triton")
    assert (triton_row.supports(CallInfo(CPU, torch.float32, True)) is None) is interpreting


def test_validate_switch_is_parsed_where_values_are_checked(monkeypatch):
    from deltafuse.config import SettingsError
    from deltafuse.ops import _checks

    meta = torch.empty(3, dtype=torch.int32, device="meta")
    monkeypatch.setenv("DELTAFUSE_VALIDATE", "garbage")
    with pytest.raises(SettingsError, match="DELTAFUSE_VALIDATE='garbage'"):
        _checks.values_checkable(meta)
    for word, expected in (("ON", True), ("off", False), ("Yes", True), ("0", False)):
        monkeypatch.setenv("DELTAFUSE_VALIDATE", word)
        assert _checks.values_checkable(meta) is expected
    assert _checks.values_checkable(torch.zeros(1)) is True  # CPU values are always checked


# --- layering: backends know no op; every op registers from its own folder ---------------------------------
def _run_python(code: str) -> str:
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_backends_imports_no_op_and_asking_registers_every_op():
    out = _run_python(
        "import sys\n"
        "import deltafuse.backends\n"
        "print(sorted(m for m in sys.modules if m.startswith('deltafuse.ops')))\n"
        "from deltafuse.backends.settings import forceable_backends\n"
        "print(forceable_backends())\n"
        "print(len(deltafuse.backends.REGISTRY.ops))\n")
    ops_before, names, n_ops = out.splitlines()
    assert ops_before == "[]"
    assert names == "('auto', 'triton', 'fla', 'npu', 'flash_qla', 'torch', 'transformers', 'varlen')"
    assert int(n_ops) == len(backends.REGISTRY.ops) == 13


def test_backend_names_do_not_depend_on_the_op_module_imported_first():
    for first in ("deltafuse.ops.swiglu.kernel", "deltafuse.ops.moe.reference", "deltafuse.ops.attention.route"):
        out = _run_python(f"import {first}\nfrom deltafuse.backends import REGISTRY\nprint(REGISTRY.backend_names())")
        assert out == str(backends.REGISTRY.backend_names()), first


def test_no_backends_module_imports_an_op():
    import ast
    import pathlib

    root = pathlib.Path(backends.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            assert not any(n.startswith("deltafuse.ops") for n in names), (path.name, names)


# --- shape facts: a head size the Triton kernels cannot take is a refusal, not a crash ------------------
def _gdn_call(device, K, V=32, needs_grad=True, dtype=torch.bfloat16):
    shapes = (torch.Size([1, 8, 2, K]), torch.Size([1, 8, 2, K]), torch.Size([1, 8, 4, V]), torch.Size([1, 8, 4]),
              torch.Size([1, 8, 4]), None)
    return CallInfo(device, dtype, needs_grad, (), shapes)


@pytest.mark.parametrize("op", [gd.CHUNK, gd.RECURRENT])
def test_triton_refuses_a_head_size_over_its_limit_and_selection_falls_back(op):
    reg = Registry()
    gd.register(reg)
    reg._available[(op, "fla")] = "fla is not installed"  # the same answer on every machine
    cuda = torch.device("cuda", 0)
    needs_grad = op == gd.CHUNK
    fits = reg.explain(op, _gdn_call(cuda, 256, needs_grad=needs_grad))
    assert next(d for d in fits if d.chosen).candidate == "triton"
    too_big = {d.candidate: d for d in reg.explain(op, _gdn_call(cuda, 512, needs_grad=needs_grad))}
    assert too_big["torch"].chosen and not too_big["triton"].chosen
    assert "K=512" in too_big["triton"].reason and "256" in too_big["triton"].reason
    # the cache key holds the facts: the same device and dtype gives each head size its own answer
    torch_impl = reg.select(op, _gdn_call(cuda, 512, needs_grad=needs_grad))
    triton_impl = reg.select(op, _gdn_call(cuda, 128, needs_grad=needs_grad))
    assert torch_impl is not triton_impl
    assert reg.select(op, _gdn_call(cuda, 512, needs_grad=needs_grad)) is torch_impl
    with pytest.raises(BackendError) as err:
        reg.select(op, _gdn_call(cuda, 512, needs_grad=needs_grad), "triton")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"backend 'triton' cannot serve {op} for cuda:0 bfloat16")
    assert "K=512" in msg and "over 256" in msg


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_public_gdn_op_forced_triton_with_a_too_large_head_is_one_line(name):
    import deltafuse.ops as dops

    if not probes.triton_interpreting():
        pytest.skip("CPU tensors reach the Triton candidate only under TRITON_INTERPRET=1")
    gen = input_gen(7)
    B, T, H, HV, K, V = 1, 3, 1, 2, 320, 4
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g, beta = -torch.rand(B, T, HV, generator=gen), torch.rand(B, T, HV, generator=gen)
    op = getattr(dops, name)
    with pytest.raises(BackendError) as err:
        op(q, k, v, g, beta, backend="triton")
    msg = str(err.value)
    assert "\n" not in msg and f"cannot serve {name}" in msg and "K=320" in msg and "over 256" in msg
    # a head size the kernel takes is served by the Triton kernel when forced
    small = [t[..., :16].contiguous() for t in (q, k)]
    out, _ = op(*small, v, g, beta, backend="triton")
    ref, _ = op(*small, v, g, beta, backend="torch")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# --- FlashQLA: requirements, forced only, argument mapping (a stand-in module) ---------------------------
def _flash_qla_call(dtype=torch.bfloat16, grad=True, K=128, V=128, device=torch.device("cuda", 0)):
    return CallInfo(device, dtype, grad, (("K", K), ("V", V)))


def test_flash_qla_never_serves_automatically_and_says_why(monkeypatch):
    monkeypatch.setattr(probes, "cuda_capability", lambda index: (9, 0))
    reg = Registry()
    gd.register(reg)
    reg._available[(gd.CHUNK, "flash_qla")] = None  # installed (stand-in)
    rows = {r.candidate: r for r in reg.explain(gd.CHUNK, _flash_qla_call())}
    assert not rows["flash_qla"].chosen
    assert "3.7e-3" in rows["flash_qla"].reason and "backend='flash_qla'" in rows["flash_qla"].reason
    forced = {r.candidate: r for r in reg.explain(gd.CHUNK, _flash_qla_call(), backend="flash_qla")}
    assert forced["flash_qla"].chosen


@pytest.mark.parametrize("cap,kwargs,match", [
    ((9, 0), dict(device=CPU), "need a CUDA device; the tensors are on cpu"),
    ((8, 0), {}, r"compute capability 9.0, 10.0, 10.3 and 12.x only; this GPU has \(8, 0\)"),
    ((12, 0), {}, "forward only, and this call needs a backward"),
    ((9, 0), dict(dtype=torch.float32), "fp16 and bf16 only, got float32"),
    ((9, 0), dict(K=64, V=64), "K = V = 128 only, got K=64, V=64"),
])
def test_flash_qla_requirements(monkeypatch, cap, kwargs, match):
    import re

    monkeypatch.setattr(probes, "cuda_capability", lambda index: cap)
    assert re.search(match, gd._flash_qla_supports(_flash_qla_call(**kwargs)))


def test_flash_qla_serves_what_it_takes(monkeypatch):
    monkeypatch.setattr(probes, "cuda_capability", lambda index: (12, 0))
    assert gd._flash_qla_supports(_flash_qla_call(grad=False, dtype=torch.float16)) is None
    monkeypatch.setattr(probes, "cuda_capability", lambda index: (9, 0))
    assert gd._flash_qla_supports(_flash_qla_call()) is None


def test_flash_qla_reports_a_slow_first_call_of_each_shape_once(monkeypatch, caplog):
    """TileLang compiles FlashQLA's kernels inside its first call of a shape (minutes on an H200): a first call over
    the threshold is reported once per shape, dtype and layout, with its time; later calls of that shape are not."""
    import logging
    import sys
    import types

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        return v * 2, None

    monkeypatch.setitem(sys.modules, "flash_qla", types.SimpleNamespace(chunk_gated_delta_rule=fake))
    monkeypatch.setattr(gd, "FLASH_QLA_COMPILE_NOTE_S", 0.0)  # every first call counts as slow
    run = gd._load_flash_qla()

    def call(T, packed=False):
        q = torch.randn(1, T, 2, 8, dtype=torch.bfloat16)
        v = torch.randn(1, T, 4, 8, dtype=torch.bfloat16)
        g, beta = -torch.rand(1, T, 4), torch.rand(1, T, 4, dtype=torch.bfloat16)
        run(q, q.clone(), v, g, beta, 0.25, cu_seqlens=torch.tensor([0, 2, T]) if packed else None)

    with caplog.at_level(logging.WARNING, logger="deltafuse"):
        for T, packed in ((5, False), (5, False), (7, False), (5, True), (7, False)):
            call(T, packed)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("deltafuse: FlashQLA's first call for q [1, 5, 2, 8], v [1, 5, 4, 8] (bfloat16) took ")
    assert "[1, 7, 2, 8]" in lines[1] and "(bfloat16, packed)" in lines[2]
    assert all("TileLang compiles its kernels on first use of a shape" in line for line in lines)
    monkeypatch.setattr(gd, "FLASH_QLA_COMPILE_NOTE_S", 1e9)  # a fast first call is not reported
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltafuse"):
        call(9)
    assert not caplog.records


def test_flash_qla_argument_mapping(monkeypatch):
    import sys
    import types

    calls = []

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        calls.append(dict(args=(q, k, v, g, beta), scale=scale, h0=initial_state, final=output_final_state,
                          l2=use_qk_l2norm_in_kernel, cu=cu_seqlens))
        return v * 2, (initial_state.to(torch.bfloat16) if output_final_state else None)

    monkeypatch.setitem(sys.modules, "flash_qla", types.SimpleNamespace(chunk_gated_delta_rule=fake))
    run = gd._load_flash_qla()
    q, k = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16), torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(1, 5, 4, 8, dtype=torch.bfloat16)
    g, beta = -torch.rand(1, 5, 4, dtype=torch.bfloat16), torch.rand(1, 5, 4, dtype=torch.bfloat16)
    h0, cu = torch.randn(2, 4, 8, 8), torch.tensor([0, 2, 5], dtype=torch.int32)
    out, final = run(q, k, v, g, beta, 0.25, h0, True, True, cu)
    c = calls[-1]
    assert c["args"][3].dtype == torch.float32 and torch.equal(c["args"][3], g.float())  # its backward asserts fp32
    assert c["cu"].dtype == torch.int64 and torch.equal(c["cu"], cu.long())
    assert c["scale"] == 0.25 and c["h0"] is h0 and c["final"] is True and c["l2"] is True
    assert torch.equal(out, v * 2) and final.dtype == torch.float32  # the op's contract: fp32 states
    with pytest.raises(BackendError, match=r"FlashQLA needs v in q's dtype torch.bfloat16, got v.dtype=torch.float32"):
        run(q, k, v.float(), g, beta, 0.25)
