"""FSDP2 (``fully_shard`` per decoder layer, then the model) with deltafuse applied, two gloo processes on CPU:
the loss and every gradient equal stock transformers' run on one process over the same sequences, one at a
time (so no state can cross a packed boundary in the reference)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deltafuse.models import build_model
from tests.integrations import assert_grads_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTHS = [[30, 18], [20, 28]]  # rank 0's row, rank 1's row: the same count of trained targets (46) each


def stock_per_sequence(family: str, seed: int, rows: list[torch.Tensor]):
    """Stock model, one sequence per call: the mean loss over every trained target and its gradients."""
    torch.manual_seed(seed)
    model = build_model(family)
    total, count = 0.0, 0
    for ids, lengths in zip(rows, LENGTHS):
        start = 0
        for n in lengths:
            seq = ids[start:start + n][None]
            start += n
            total = total + model(input_ids=seq, labels=seq).loss * (n - 1)
            count += n - 1
    loss = total / count
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # two processes each; the full run only
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("family", ["tiny", "tiny-moe"])
def test_fsdp2_two_processes_equal_stock_on_one(tmp_path, family):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    vocab = build_model(family).config.vocab_size
    rows = [torch.randint(0, vocab, (sum(lengths),)) for lengths in LENGTHS]
    out = str(tmp_path / "fsdp.pt")
    torch.save({"rows": rows, "lengths": LENGTHS}, out + ".data")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "tests", "integrations", "fsdp_worker.py"), family, str(seed), out],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(out)
    ref_loss, ref_grads = stock_per_sequence(family, seed, rows)
    for order, got in results.items():
        assert got["param_types"] == ["DTensor"], (order, got["param_types"])  # really sharded
        assert abs(got["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (order, got["loss"], ref_loss)
        assert sorted(got["grads"]) == sorted(ref_grads), order
        assert_grads_close(got["grads"], ref_grads)
