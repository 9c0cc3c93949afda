"""One rank of the context-parallel test (tests/integrations/test_context_parallel.py), launched by
torch.distributed.run.

For every case of the data file (a family, a seed, [B, T] input_ids / position_ids / labels of whole rows, and
how the model is set up: LoRA, gradient checkpointing, FSDP2 with lm_head in the model's group, its own
module or accelerate's [final norm, lm_head] group), rank r runs tokens [r*T/W, (r+1)*T/W) of every
row through the model with ``deltafuse.apply(model, context_parallel=WORLD)``: once with logits
(``skip_logits=False``: the stock loss path) when the case asks for it, once with the fused loss. Rank 0 writes
the loss, the gathered logits and every parameter gradient averaged over the ranks (by FSDP2's reduce-scatter
for the FSDP2 cases).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import deltafuse
from deltafuse.integrations.transformers import cp_exchange
from deltafuse.models import build_model

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"]


def build_case_model(family: str, seed: int, lora: bool = False):
    """The case's model: ``build_model(family, seed)``, with LoRA adapters (r=4, both factors random so that
    every adapter gradient is non-zero) on the attention and GDN projections when ``lora``."""
    model = build_model(family, seed=seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                 init_lora_weights=False))
    return model


def enable_checkpointing(model, mode: str) -> None:
    """HF gradient checkpointing of every decoder layer, ``mode`` "reentrant" or "non-reentrant"."""
    model.train()
    kwargs = {"use_reentrant": mode == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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


def fsdp_grads(model) -> dict:
    """The full gradients of a fully_shard model (FSDP2's reduce-scatter already averaged them over the ranks)."""
    return {name: (p.grad.full_tensor() if p.grad is not None else None) for name, p in model.named_parameters()}


_RECEIVED_ONCE = cp_exchange.received_once


def _count_reuse() -> dict:
    """Count, per kind ("halo", "state"), the exchanges a recomputation took from the first forward."""
    counts = {"halo": 0, "state": 0}

    def received_once(shard, kind, layer, receive):
        if (kind, layer) in shard.received:
            counts[kind] += 1
        return _RECEIVED_ONCE(shard, kind, layer, receive)

    cp_exchange.received_once = received_once
    return counts


def run_case(case: dict, rank: int, world: int) -> dict:
    model = build_case_model(case["family"], case["seed"], case.get("lora", False))
    report = deltafuse.apply(model, context_parallel=dist.group.WORLD)
    if case.get("checkpointing"):
        enable_checkpointing(model, case["checkpointing"])
    if case.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in causal.model.layers:
            fully_shard(layer)
        if case["fsdp"] == "head":  # lm_head its own FSDP module
            fully_shard(causal.get_output_embeddings())
        elif case["fsdp"] == "tail":  # accelerate's FSDP2: [final norm, lm_head] one group, kept after forward
            fully_shard([causal.model.norm, causal.get_output_embeddings()], reshard_after_forward=False)
        fully_shard(model)
        result_head = type(causal.get_output_embeddings()).__name__
    cp_exchange.DISABLED.clear()
    cp_exchange.DISABLED.update(case["disabled"])
    T = case["ids"].shape[1]
    shard = slice(rank * T // world, (rank + 1) * T // world)
    inputs = {"input_ids": case["ids"][:, shard], "position_ids": case["pos"][:, shard],
              "labels": case["labels"][:, shard]}
    if case.get("num_items_in_batch") is not None:
        inputs["num_items_in_batch"] = case["num_items_in_batch"]
    result = {"settings": report.settings}
    reused = _count_reuse()
    grads = fsdp_grads if case.get("fsdp") else (lambda m: averaged_grads(m, world))
    try:
        if case.get("stock_path", True):
            out = model(**inputs, skip_logits=False)
            out.loss.backward()
            parts = [torch.empty_like(out.logits) for _ in range(world)]
            dist.all_gather(parts, out.logits.detach().contiguous())
            result["logits"] = torch.cat(parts, dim=1)
            result["local_logits_shape"] = tuple(out.logits.shape)
            result["loss_stock_path"] = out.loss.item()
            result["grads_stock_path"] = grads(model)
            model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("autocast", False)):
            out = model(**inputs)
        result["fused_logits"] = out.logits
        out.loss.backward()
        result["loss"] = out.loss.item()
        result["grads"] = grads(model)
        counts = [None] * world
        dist.all_gather_object(counts, dict(reused))
        result["reused"] = counts  # per rank
        if case.get("fsdp"):
            result["head_type"] = result_head
            result["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    finally:
        cp_exchange.received_once = _RECEIVED_ONCE
        cp_exchange.DISABLED.clear()
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
