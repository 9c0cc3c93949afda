"""One rank of the FSDP2 tests (tests/integrations/test_fsdp.py), launched by torch.distributed.run.

Each rank trains on its own packed row (two sequences, position_ids restarting at 0, the first label of each
sequence ignored as padding-free collators do). Two kinds of runs, named by the data file:

* ``orders``: deltafuse applied before or after ``fully_shard`` (each decoder layer, then the model).
* ``wraps``: deltafuse applied, then the decoder layers sharded, ``lm_head`` sharded as accelerate shards it
  (``head``: its own FSDP module, resharded after its forward; ``tail``: one module group with the final
  norm, not resharded after forward, as accelerate's FSDP2 does; ``root``: left to the model's group), then
  the model; optionally LoRA (on lm_head too when the case says so). Each records whether the fused loss
  ran (the output logits are None) and how many all-gathers the head's FSDP group made (forward + backward).

Rank 0 writes the mean loss and every full (unsharded) gradient to the file named on the command line. With
FSDP_WORKER_DEVICE=cuda the ranks run on GPUs r (NCCL); a case with "mixed": True shards with accelerate's bf16
policy (parameters, reduction and every FSDP module's output in bf16).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import deltafuse
from deltafuse.models import build_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"]


def row(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, labels) [1, T] of the sequences of ``ids`` packed in one row."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids[None].clone()
    start = 0
    for n in lengths:
        labels[0, start] = -100
        start += n
    return ids[None], pos, labels


def build(family: str, seed: int, lora: str | None = None):
    """``build_model(family, seed=seed)``; ``lora`` "layers" (r=4 on the attention and GDN projections) or
    "head" (also on lm_head), both factors random so that every adapter gradient is non-zero."""
    model = build_model(family, seed=seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        targets = LORA_TARGETS + (["lm_head"] if lora == "head" else [])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return model


def gathers_counted() -> dict:
    """Count the all-gathers each FSDP2 parameter group makes (keyed by the group)."""
    counts: dict = {}
    unshard = FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        before = self._all_gather_result
        out = unshard(self, *args, **kwargs)
        if before is None and self._all_gather_result is not None:
            counts[self] = counts.get(self, 0) + 1
        return out

    FSDPParamGroup.unshard = counted
    counts["restore"] = lambda: setattr(FSDPParamGroup, "unshard", unshard)
    return counts


def shard(model, wrap: str, mixed: bool = False) -> None:
    """fully_shard each decoder layer, then lm_head as ``wrap`` says (see the module docstring), then the model;
    ``mixed``: with accelerate's bf16 policy."""
    bf16 = torch.bfloat16
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)} if mixed else {}
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in causal.model.layers:
        fully_shard(layer, **kw)
    head = causal.get_output_embeddings()
    if wrap == "head":
        fully_shard(head, reshard_after_forward=True, **kw)
    elif wrap == "tail":
        fully_shard([causal.model.norm, head], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)


def run_wrap(family: str, seed: int, inputs: dict, case: dict) -> dict:
    model = build(family, seed, case.get("lora")).to(DEVICE)
    deltafuse.apply(model)
    try:
        shard(model, case["wrap"], case.get("mixed", False))
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = causal.get_output_embeddings()
        counts = gathers_counted()
        try:
            out = model(**inputs)
            out.loss.backward()
        finally:
            counts.pop("restore")()
        group = head._get_fsdp_state()._fsdp_param_group if isinstance(head, FSDPModule) else None
        mean = out.loss.detach().float()
        dist.all_reduce(mean)
        return {"loss": (mean / dist.get_world_size()).item(), "logits": out.logits, "loss_dtype": str(out.loss.dtype),
                "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None},
                "param_types": sorted({type(p).__name__ for p in model.parameters()}),
                "head_type": type(head).__name__, "head_gathers": counts.get(group) if group else None}
    finally:
        deltafuse.revert()


def run_order(family: str, seed: int, inputs: dict, order: str) -> dict:
    model = build_model(family, seed=seed)
    if order == "apply-then-shard":
        deltafuse.apply(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if order == "shard-then-apply":
        deltafuse.apply(model)
    out = model(**inputs)
    out.loss.backward()
    mean = out.loss.detach().clone()
    dist.all_reduce(mean)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    deltafuse.revert()
    return {"loss": (mean / dist.get_world_size()).item(), "grads": grads, "logits": out.logits,
            "param_types": sorted({type(p).__name__ for p in model.parameters()})}


DEVICE = os.environ.get("FSDP_WORKER_DEVICE", "cpu")


def main(family: str, seed: int, out_path: str) -> None:
    global DEVICE
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank = dist.get_rank()
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        DEVICE = f"cuda:{rank}"
    data = torch.load(out_path + ".data")
    input_ids, position_ids, labels = row(data["rows"][rank], data["lengths"][rank])
    inputs = {"input_ids": input_ids.to(DEVICE), "position_ids": position_ids.to(DEVICE), "labels": labels.to(DEVICE)}
    if "wraps" in data:
        results = {name: run_wrap(family, seed, inputs, case) for name, case in data["wraps"].items()}
    else:
        results = {order: run_order(family, seed, inputs, order) for order in ("apply-then-shard", "shard-then-apply")}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
