"""Small helpers shared by the test suite."""

from __future__ import annotations

import hashlib
import importlib
import os
import secrets
import sys

import pytest
import torch

from deltafuse.backends.probes import triton_interpreting
from deltafuse.backends.registry import CallInfo, Registry
from deltafuse.verify import float64


# --- random inputs ----------------------------------------------------------------------------------------------
# Every test draws fresh random inputs each run, reproducibly: its seeds derive from one base seed per pytest run
# (fresh unless ``--test-seed`` names it; tests/conftest.py sets it and prints it in the header and beside each
# failure), the test's id and a salt that tells its draws apart, or the draw's turn where there is no salt. A rerun
# with the same base and test gives the same inputs; the same salt twice in one test gives the same seed (two runs
# that must see the same data).
_BASE_SEED = secrets.randbelow(2**31)  # outside pytest (a worker script importing this module): fresh


def set_base_seed(seed: int) -> None:
    global _BASE_SEED
    _BASE_SEED = seed


def base_seed() -> int:
    return _BASE_SEED


_DRAWS: dict[str, int] = {}


def input_seed(*salt) -> int:
    """A seed in [0, 2**31) for the running test's random inputs, fresh each pytest run. With a ``salt`` (values
    with a stable repr: ints, strings, tuples) the same for the same base seed, test and salt; without one, the
    test's next seed in turn (each call another, the same sequence again for the same base seed and test)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if not salt:
        _DRAWS[test] = _DRAWS.get(test, 0) + 1
        salt = ("draw", _DRAWS[test])
    digest = hashlib.blake2b(repr((_BASE_SEED, test, salt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def input_gen(*salt, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded with ``input_seed(*salt)``."""
    return torch.Generator(device=device).manual_seed(input_seed(*salt))


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


# fp32 rounding of a gradient through a few layers: errors below it are noise whose ratio between two runs means nothing
FP32_ROUNDING = 16 * torch.finfo(torch.float32).eps


def fp32_gradient_errors(got: dict, oracle: dict, *refs: dict, noise: float = 32) -> dict[str, tuple[float, float]]:
    """For every gradient of ``oracle`` (a float64 run): ``got``'s relative RMS error against it and the most it
    may be for ``got`` to be as accurate as the fp32 runs ``refs`` of the same computation. That bound is twice the
    largest of the refs' errors of the same gradient, plus ``noise`` times the median over all the gradients of
    that largest error (the runs' typical fp32 noise), plus FP32_ROUNDING. A missing gradient must be missing on
    every side.

    Per parameter, two fp32 runs that add the same terms in other orders differ from float64 by several times in
    either direction, more where a few tokens' gradients are ill-conditioned (the GDN's normalised q and k). Measured
    on tiny models (CPU, fresh draws; test_trl, test_trainer_switch, test_packing): the log ratio of deltafuse's
    error to stock's has a median of -0.17 to +0.15 per test and reaches +2.4 (11x) for single parameters; with
    a noise term of 8 medians one draw in 30 of a TRL case failed, at 32 the largest error was 0.46 of the bound
    (about 130 two-step runs). A leak across packed sequences lies 1,000x or more above it; a GDN g or beta off by
    1e-3 gave errors of 1e-3 - 6e-3 against medians of 3e-6."""
    assert refs and all(d.keys() == oracle.keys() for d in (got, *refs))
    assert all((d[n] is None) == (t is None) for n, t in oracle.items() for d in (got, *refs))
    present = {n: t for n, t in oracle.items() if t is not None}
    theirs = {n: max(rel_rms(r[n], t) for r in refs) for n, t in present.items()}
    median = sorted(theirs.values())[len(theirs) // 2]
    return {n: (rel_rms(got[n], t), 2 * theirs[n] + noise * median + FP32_ROUNDING) for n, t in present.items()}


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


def assert_within_term_sizes(actual: torch.Tensor, expected: torch.Tensor, size: torch.Tensor, tol: float,
                             name: str = "tensor") -> None:
    """Assert every element of ``actual`` is finite and within ``tol`` times ``size`` (float64: the size of the terms
    the element sums, e.g. sum |a_i b_i| for a dot product) of the reference ``expected``: for elements whose terms
    can cancel, where a relative error is unbounded at the rounding of the terms."""
    assert actual.shape == expected.shape == size.shape, f"{name}: shapes differ"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if actual.numel():
        err = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs()
        excess = (err - tol * size.detach().double().cpu()).max().item()
        assert excess <= 0, f"{name}: an element's error exceeds {tol:.1e} x the size of its terms by {excess:.3e}"


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


# a float64 run of a stock model (deltafuse verify uses it too)
Float64Everywhere, float64_copy = float64.Float64Everywhere, float64.float64_copy


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_subprocess_env() -> dict:
    """The environment for a `deltafuse` child process: no DELTAFUSE_* / TWINKLE_NPU_* switch of the caller's, no
    TRITON_INTERPRET, this checkout first on PYTHONPATH, one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFUSE_", "TWINKLE_NPU_"))}
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


# --- two-process runs ------------------------------------------------------------------------------------------
# a Python exception (faulthandler's dumps say "most recent call first")
_PYTHON_ERROR = "Traceback (most recent call last)"
_ABORT = "Fatal Python error: Aborted"  # faulthandler's line when a rank dies in native code (SIGABRT)


def _rank_logs(log_dir: str, stream: str) -> dict[int, str]:
    """Every rank's ``stream`` ("stdout" or "stderr") of a torch.distributed.run started with ``--log-dir log_dir
    --redirects 3`` (its files lie at <log_dir>/<run id>/attempt_<n>/<rank>/<stream>.log), by rank."""
    logs = {}
    for root, _, files in os.walk(log_dir):
        if f"{stream}.log" in files and os.path.basename(root).isdigit():
            with open(os.path.join(root, f"{stream}.log"), errors="replace") as f:
                logs[int(os.path.basename(root))] = f.read()
    return logs


def run_two_ranks(args: list[str], *, log_dir: str, env: dict, cwd: str, timeout: int = 600) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=2 <args>``: asserts that it exits 0, with
    each rank's own stderr (tail) in the failure message. Returns each rank's stdout, by rank.

    Every rank runs with faulthandler on, so a rank that dies in native code prints its Python stack. When a rank
    aborted inside a library (gloo's threads end a process with std::terminate now and then on a loaded 2-core
    machine: "terminate called without an active exception", with no Python exception on that rank) the run is
    started once more and must pass then; the first attempt's stacks are shown as a warning. A Python exception
    that ends a rank, a wrong result or a second abort fails."""
    import subprocess
    import warnings

    env = dict(env, PYTHONFAULTHANDLER="1")
    first = None
    for attempt in range(2):
        logs_at = os.path.join(log_dir, f"launch{attempt}")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "--log-dir", logs_at, "--redirects", "3", *args],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            if first is not None:
                warnings.warn(f"a rank aborted in native code; the second launch passed. The first launch:\n{first}")
            out = _rank_logs(logs_at, "stdout")
            return [out.get(rank, "") for rank in range(2)]
        logs = _rank_logs(logs_at, "stderr")
        report = "\n".join(f"--- rank {rank}'s stderr (last 4000 characters) ---\n{text[-4000:]}"
                           for rank, text in sorted(logs.items()))
        report += f"\n--- launcher's stderr (last 1500 characters) ---\n{proc.stderr[-1500:]}"
        # a rank that aborted with no Python exception of its own (the other rank's then fails on the lost peer)
        aborted = any(_ABORT in text and _PYTHON_ERROR not in text for text in logs.values())
        if attempt or not aborted:
            raise AssertionError(f"torch.distributed.run exited {proc.returncode}"
                                 + (" (again, after a first launch whose rank aborted)" if attempt else "")
                                 + f"\n{report}")
        first = report
