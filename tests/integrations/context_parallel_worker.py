"""One rank of the context-parallel test (tests/integrations/test_context_parallel.py), launched by
torch.distributed.run.

For every case of the data file (a family, a seed, [B, T] input_ids / position_ids / labels of whole rows),
rank r runs tokens [r*T/W, (r+1)*T/W) of every row through the model with ``deltafuse.apply(model,
context_parallel=WORLD)``: once with logits (``skip_logits=False``: the stock loss path), once with the fused loss.
Rank 0 writes the loss, the gathered logits and every parameter gradient averaged over the ranks.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import deltafuse
from deltafuse.integrations.transformers import context_parallel
from deltafuse.models import build_model


def averaged_grads(model, world: int) -> dict:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        present = torch.tensor([float(param.grad is not None)])
        grad = grad.detach().clone()
        dist.all_reduce(grad)
        dist.all_reduce(present)
        grads[name] = grad / world if present.item() else None
    return grads


def run_case(case: dict, rank: int, world: int) -> dict:
    model = build_model(case["family"], seed=case["seed"])
    report = deltafuse.apply(model, context_parallel=dist.group.WORLD)
    context_parallel._DISABLED.clear()
    context_parallel._DISABLED.update(case["disabled"])
    T = case["ids"].shape[1]
    shard = slice(rank * T // world, (rank + 1) * T // world)
    inputs = {"input_ids": case["ids"][:, shard], "position_ids": case["pos"][:, shard],
              "labels": case["labels"][:, shard]}
    result = {"settings": report.settings}
    try:
        out = model(**inputs, skip_logits=False)
        out.loss.backward()
        parts = [torch.empty_like(out.logits) for _ in range(world)]
        dist.all_gather(parts, out.logits.detach().contiguous())
        result["logits"] = torch.cat(parts, dim=1)
        result["local_logits_shape"] = tuple(out.logits.shape)
        result["loss_stock_path"] = out.loss.item()
        result["grads_stock_path"] = averaged_grads(model, world)
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        result["fused_logits"] = out.logits
        out.loss.backward()
        result["loss"] = out.loss.item()
        result["grads"] = averaged_grads(model, world)
    finally:
        context_parallel._DISABLED.clear()
        deltafuse.revert()
    return result


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = torch.load(path + ".data")
    results = {name: run_case(case, rank, world) for name, case in cases.items()}
    if rank == 0:
        torch.save(results, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
