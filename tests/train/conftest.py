import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models: one torch thread (see tests/conftest.py)."""
