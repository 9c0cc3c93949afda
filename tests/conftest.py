"""Shared test set-up.

Without CUDA, deltafuse's Triton kernels are tested through the Triton interpreter (fp32, tiny shapes).
TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any test module.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk caches key a compiled graph on its traced forward, not on the schema of the custom ops
# its backward calls: a cache written by an earlier deltafuse could hand these tests a stale backward. One
# fresh cache per test session (not for the whole machine: the caches' directory stays the user's).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="deltafuse-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
else:
    _INDUCTOR_CACHE = None


def _seed_arg(text: str) -> int:
    import argparse

    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**31:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: a whole number from 0 to {2**31 - 1}")
    return seed


def pytest_addoption(parser):
    parser.addoption("--test-seed", type=_seed_arg, default=None, metavar="N",
                     help="base seed of the tests' random inputs (tests/helpers.py input_seed); default: a fresh one "
                          "each run, printed in the header and beside every failure")


def pytest_configure(config):
    from tests import helpers

    if config.option.test_seed is None:  # (pytest-xdist workers get the controller's, drawn here first)
        config.option.test_seed = helpers.base_seed()
    helpers.set_base_seed(config.option.test_seed)


def pytest_report_header(config):
    return f"test seed: {config.option.test_seed} (--test-seed {config.option.test_seed} repeats these inputs)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("test seed", f"this test's inputs again: pytest --test-seed "
                                             f"{item.config.option.test_seed} '{item.nodeid}'"))
    return report


@pytest.fixture(autouse=True)
def _seed_torch():
    """torch's global generator seeded per test from the run's base seed: draws without a generator of their own
    (module initialisation, dropout) are fresh each run and repeat with ``--test-seed``."""
    from tests.helpers import input_seed

    torch.manual_seed(input_seed("torch global"))


def pytest_sessionfinish(session, exitstatus):
    if _INDUCTOR_CACHE is not None:
        import shutil

        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a ``gpu`` test, hand the memory its process's caching allocator kept back to the device: pytest-xdist
    workers share one GPU, and a worker that held a large float64 oracle once would otherwise keep that memory for
    the rest of the run while the others run out."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


DELTAFUSE_ENV = ("DELTAFUSE_PATCH", "DELTAFUSE_GDN", "DELTAFUSE_FUSED_OPS", "DELTAFUSE_MOE", "DELTAFUSE_BACKEND",
                 "DELTAFUSE_VALIDATE",
                 "TWINKLE_NPU_PATCH", "TWINKLE_NPU_FLA", "TWINKLE_NPU_FUSED_OPS", "TWINKLE_NPU_MOE_PATCH")


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread (and OMP_NUM_THREADS=1 for subprocesses): on a small shared CPU, OpenMP's spinning
    threads slow tiny models down by an order of magnitude."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clean_deltafuse(monkeypatch, one_thread):
    """No deltafuse switch from the caller's environment, nothing patched before or after the test."""
    from deltafuse import backends, patching
    from deltafuse.maps import PATCHER

    for name in DELTAFUSE_ENV:
        monkeypatch.delenv(name, raising=False)
    patching.revert()  # start clean even if an earlier test left deltafuse applied
    assert not PATCHER.has_records()
    yield
    patching.revert()
    assert backends.current_backend() == "auto"
