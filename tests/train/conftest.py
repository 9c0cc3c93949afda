"""One torch thread per test process: the CI machine has 2 cores shared with other jobs, where OpenMP's
spinning threads slow small models down by an order of magnitude. Subprocesses get OMP_NUM_THREADS=1."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)
