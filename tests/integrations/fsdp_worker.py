"""One rank of the FSDP2 test (tests/integrations/test_fsdp.py), launched by torch.distributed.run.

Each rank trains on its own packed row (two sequences, position_ids restarting at 0, the first label of each
sequence ignored as padding-free collators do), with deltafuse applied before or after ``fully_shard``. Rank 0
writes the mean loss and every full (unsharded) gradient to the file named on the command line.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import deltafuse
from deltafuse.models import build_model


def row(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, labels) [1, T] of the sequences of ``ids`` packed in one row."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids[None].clone()
    start = 0
    for n in lengths:
        labels[0, start] = -100
        start += n
    return ids[None], pos, labels


def main(family: str, seed: int, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.load(out_path + ".data")
    ids, lengths = data["rows"][rank], data["lengths"][rank]
    results = {}
    for order in ("apply-then-shard", "shard-then-apply"):
        torch.manual_seed(seed)
        model = build_model(family)
        if order == "apply-then-shard":
            deltafuse.apply(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if order == "shard-then-apply":
            deltafuse.apply(model)
        input_ids, position_ids, labels = row(ids, lengths)
        loss = model(input_ids=input_ids, position_ids=position_ids, labels=labels).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
        param_types = sorted({type(p).__name__ for p in model.parameters()})
        deltafuse.revert()
        results[order] = {"loss": (mean / dist.get_world_size()).item(), "grads": grads,
                          "param_types": param_types}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
