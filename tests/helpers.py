"""Small helpers shared by the test suite."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from deltafuse.backends.probes import triton_interpreting
from deltafuse.backends.registry import CallInfo, Registry


# Where kernel tests run: the GPU when there is one, else the Triton interpreter on CPU (tests/conftest.py
# sets TRITON_INTERPRET=1 without CUDA).
INTERPRETED = triton_interpreting()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (not interpreted)")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error rms(a - b) / rms(b), computed in float64 over every element.

    ``b`` is the reference. Shapes must match exactly. Returns 0.0 when both are all zeros (or empty) and
    inf when only the reference is; NaN or inf anywhere in ``a`` gives NaN/inf, never a small number.
    """
    if a.shape != b.shape:
        raise ValueError(f"rel_rms needs equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0
    err = (a - b).pow(2).mean().sqrt().item()
    ref = b.pow(2).mean().sqrt().item()
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / ref


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "tensor",
                     peak: float = 30.0) -> None:
    """Assert ``actual`` matches the reference ``expected`` element by element.

    Checks that shapes match, every element of ``actual`` is finite, rel_rms(actual, expected) <= tol, and
    no single element is off by more than ``peak * tol * rms(expected)`` (so one wrong token or head cannot
    hide inside a small average).
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: rel_rms {err:.3e} > {tol:.1e}"
    if actual.numel():
        a, b = actual.detach().double(), expected.detach().double()
        scale = b.pow(2).mean().sqrt().item()
        worst = (a - b).abs().max().item()
        assert worst <= peak * tol * scale, (
            f"{name}: max abs error {worst:.3e} > {peak:g} * {tol:.1e} * rms(reference) {scale:.3e}")


def triton_kernel_module(name: str, kernel: str):
    """The Triton kernel module ``name`` (a dotted path); skips the test when Triton does not import, or when there
    is no CUDA and the module's jit function ``kernel`` was compiled for a GPU (TRITON_INTERPRET=1 was not set
    before its import)."""
    triton = pytest.importorskip("triton")
    module = importlib.import_module(name)
    if DEVICE == "cpu" and not isinstance(getattr(module, kernel), triton.runtime.interpreter.InterpretedFunction):
        pytest.skip("no CUDA and the kernels were compiled for a GPU (set TRITON_INTERPRET=1 before import)")
    return module


class StandInDevice:
    """What selection reads of a device (type, index), for torch builds that reject 'npu' without torch_npu
    (torch_npu renames the privateuse1 backend on import; doing that here would be irreversible)."""

    def __init__(self, type_: str, index: int):
        self.type, self.index = type_, index

    def __str__(self):
        return f"{self.type}:{self.index}"


def npu_device():
    """torch.device('npu', 0) where this torch accepts it, else a stand-in with the same type and index."""
    try:
        return torch.device("npu", 0)
    except RuntimeError:
        return StandInDevice("npu", 0)


def npu_registry(monkeypatch, torch_npu, register) -> Registry:
    """A fresh Registry holding the candidates that ``register`` (an op folder's) adds, with ``torch_npu`` (a
    stand-in module, or None: ``import torch_npu`` fails) in sys.modules for the rest of the test."""
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    reg = Registry()
    register(reg)
    return reg


def npu_route(monkeypatch, torch_npu, register, op):
    """Such a registry and what it picks for ``op`` in a bf16 call that needs gradients on an npu device, after
    checking that it is the npu candidate, marked unverified on hardware, and that the Triton candidate says why
    not."""
    reg = npu_registry(monkeypatch, torch_npu, register)
    call = CallInfo(npu_device(), torch.bfloat16, True)
    rows = {d.candidate: d for d in reg.explain(op, call)}
    assert rows["npu"].chosen and rows["npu"].verified is False and rows["triton"].reason
    return reg, reg.select(op, call)


class Float64Everywhere(torch.overrides.TorchFunctionMode):
    """Inside this mode every request for float32 asks for float64 instead: ``Tensor.float()``, a ``dtype``
    argument or keyword of ``torch.float32`` (``x.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``).

    transformers' modeling code casts to float32 on purpose (its RMSNorms, the gate ``-A_log.float().exp()``,
    the torch GDN fallback converts every input with ``.to(torch.float32)``), so a stock model converted with
    ``.double()`` still computes those parts in float32. Run a float64 copy under this mode to get a float64
    oracle of the whole model, independent of deltafuse."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_subprocess_env() -> dict:
    """The environment for a `deltafuse` child process: no DELTAFUSE_* / TWINKLE_NPU_* switch of the caller's, no
    TRITON_INTERPRET, this checkout first on PYTHONPATH, one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFUSE_", "TWINKLE_NPU_"))}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env
