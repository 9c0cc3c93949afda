import sys

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models: one torch thread (see tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _transformers_logs_to_open_stderr():
    """transformers' log handler keeps the sys.stderr it first saw, which pytest closes after that test;
    a later warning would print a logging error into another test's output. Point it at the current one."""
    from transformers.utils import logging as hf_logging

    handler = getattr(hf_logging, "_default_handler", None)
    if handler is not None:
        handler.flush = sys.stderr.flush
        handler.stream = sys.stderr
    yield


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """An interrupted in-process `deltafuse train` leaves SIGINT/SIGTERM ignored for the exit it expects; the
    test process gets its own handlers back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
