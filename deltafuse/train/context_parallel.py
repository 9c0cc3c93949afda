"""`deltafuse train --context-parallel N`: every row split along the sequence over N processes.

The launch has W = N * D processes (torchrun / accelerate); ranks [d*N, (d+1)*N) form context-parallel group d and
together hold data-parallel replica d. Three pieces make the Trainer run that exactly:

* ``Sampler``: the training rows in the order a D-process run would take them, each batch repeated N times in a
  row. accelerate gives the k-th batch of the sampler to process k % W (``BatchSamplerShard``), so the N ranks of a
  group receive the same batches and replica d the batches rank d of a D-process data-parallel run would get.
  The order is the one accelerate's ``SeedableRandomSampler`` gives a run without context parallelism (a
  permutation seeded with data_seed + epoch), so with D = 1 the rows are those of a one-process run, except that
  an epoch's last batch is completed from its first rows (a one-process run takes a smaller last batch).
* ``ShardCollator``: the batch's whole rows (packed: restarting ``position_ids``; ``--no-packing``: right padding
  turned into a pad sequence of its own), filled to a multiple of N tokens by a pad sequence (labels ignored,
  positions from 0, so it never joins a real sequence), then cut: rank r keeps tokens [r*T/N, (r+1)*T/N) of every
  row with their global ``position_ids``, what ``deltafuse.apply(model, context_parallel=group)`` expects. A small
  tensor under ``META`` describes the whole rows (a digest, the width, the shard, the counted targets).
* the Trainer subclass (``trainer_class``): checks that the ranks of a group got the same rows, and scales the
  loss to the token mean of the global batch. The model's loss is the mean over its group's rows (the same on the
  N ranks, each rank's gradients N times its share); multiplied by D * targets(group) / targets(global batch, all
  gradient-accumulation micro-batches and replicas), its gradients averaged over the W processes (what DDP and
  FSDP do) are the gradients of the global token-mean loss, as one process on the whole batch computes them, and
  the logged loss (the mean over the processes) is that loss.
"""

from __future__ import annotations

import logging
import math

import torch

from deltafuse.train.data import IGNORE_INDEX
from deltafuse.train.errors import TrainInputError

log = logging.getLogger(__name__)

META = "deltafuse_context_parallel"  # batch key of the row description, removed before the model call
DIGEST, WIDTH, START, LENGTH, TARGETS = range(5)


# --- arguments ---------------------------------------------------------------------------------------------
def check_arguments(args, *, world: int, device: str, enabled: bool, overrides: dict) -> None:
    """Refuse what --context-parallel cannot serve, before anything is built (one line each)."""
    n = args.context_parallel
    if n == 1:
        return
    flag = f"--context-parallel {n}"
    if world % n:
        raise TrainInputError(
            f"{flag}: the launch has {world} process(es) (WORLD_SIZE), not a multiple of {n}; allowed: a divisor of "
            f"the process count, e.g. torchrun --nproc_per_node {n} -m deltafuse.train ... (or accelerate launch "
            f"--num_processes {n}), or --context-parallel 1")
    if world > n and not device.startswith("cuda"):
        # torch.distributed.nn.functional.all_gather's gloo backward scatters from a group rank given as a global
        # rank, which fails in every group but the one holding rank 0
        raise TrainInputError(f"{flag} with {world} processes on {device}: {world // n} context-parallel groups need "
                              f"GPUs (on CPU, gloo serves one group only); allowed here: {n} processes")
    if not enabled:
        raise TrainInputError(f"{flag} with --no-deltafuse (or DELTAFUSE_PATCH off): stock transformers has no exact "
                              "context parallelism for packed rows; allowed: deltafuse on")
    if args.eval_data is not None:
        raise TrainInputError(f"{flag} with --eval-data: evaluation is not split over the context-parallel ranks; "
                              "allowed: no --eval-data (evaluate the saved adapter or model in a separate run)")
    if overrides.get("torch_compile"):
        raise TrainInputError(f"{flag} with --torch_compile: the context-parallel layers run eagerly; allowed: "
                              "--torch_compile false")
    for field in ("group_by_length", "train_sampling_strategy"):
        if field in overrides and overrides[field] not in (False, "random"):
            raise TrainInputError(f"{flag} with --{field} {overrides[field]}: the rows are sampled in random order "
                                  "for every context-parallel group alike; allowed: leave it out")


def check_model(model, size: int) -> None:
    """Refuse, after the model is built and before anything trains, what the context-parallel model refuses."""
    flag = f"--context-parallel {size}"
    from deltafuse.integrations.transformers import context_parallel as integration

    try:
        integration.check_model(model)
    except ValueError as exc:
        raise TrainInputError(f"{flag}: {exc}") from None
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False):
            raise TrainInputError(f"{flag}: {type(module).__name__}.config.output_router_logits is True (a router "
                                  "aux loss over one rank's tokens only); allowed: False")


def min_shard_tokens(model) -> int:
    """The fewest tokens a rank may hold: the causal conv's halo (kernel - 1) comes from the previous rank."""
    kernel = max([getattr(getattr(m, "config", None), "linear_conv_kernel_dim", 1) or 1 for m in model.modules()]
                 + [1])
    return max(1, kernel - 1)


# --- process groups ----------------------------------------------------------------------------------------
class Layout:
    """This process's place: context-parallel group ``group`` (ranks [replica*size, (replica+1)*size)), its rank
    in it, the data-parallel replica and their number."""

    def __init__(self, size: int):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs torch.distributed initialised (a torchrun or accelerate "
                               "launch)")
        world, rank = dist.get_world_size(), dist.get_rank()
        self.size, self.world = size, world
        self.rank, self.replica, self.replicas = rank % size, rank // size, world // size
        self.group = None
        for d in range(self.replicas):  # every process creates every group, in the same order
            group = dist.new_group(list(range(d * size, (d + 1) * size)))
            if d == self.replica:
                self.group = group


# --- data ----------------------------------------------------------------------------------------------------
class Sampler(torch.utils.data.Sampler):
    """Dataset indices: a permutation seeded with ``seed + epoch`` (accelerate's ``SeedableRandomSampler``), in the
    batches each of ``replicas`` data-parallel processes would get from accelerate (``BatchSamplerShard``: an
    epoch's last, incomplete round completed from its first rows), step by step, each batch ``copies`` times in a
    row. See the module docstring for why."""

    def __init__(self, length: int, batch_size: int, copies: int, replicas: int, seed: int, drop_last: bool = False):
        if length < 1:
            raise ValueError(f"Sampler: an empty dataset (length {length})")
        self.length, self.batch_size, self.copies, self.replicas = length, batch_size, copies, replicas
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shards(self, order):
        from accelerate.data_loader import BatchSamplerShard
        from torch.utils.data import BatchSampler

        plain = BatchSampler(order, self.batch_size, self.drop_last)
        return [BatchSamplerShard(plain, num_processes=self.replicas, process_index=d) for d in range(self.replicas)]

    def batches(self) -> list[list[int]]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.length, generator=generator).tolist()
        per_replica = [list(shard) for shard in self._shards(order)]
        return [batch for step in zip(*per_replica) for batch in step]

    def __iter__(self):
        for batch in self.batches():
            for _ in range(self.copies):
                yield from batch
        self.set_epoch(self.epoch + 1)

    def __len__(self) -> int:
        return len(self._shards(range(self.length))[0]) * self.replicas * self.batch_size * self.copies


def _digest(*tensors: torch.Tensor) -> int:
    """An integer that differs, in practice, between different tensors (wrapping int64 arithmetic)."""
    h = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        flat = t.reshape(-1).to(torch.int64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) * 1000003 + 7
        h = h * 1099511628211 + (flat * weights).sum() + flat.numel()
    return int(h)


def whole_rows(batch: dict, size: int, pad_token_id: int, min_shard: int = 1) -> dict:
    """input_ids, labels, position_ids of whole rows, T a multiple of ``size`` with at least ``min_shard`` tokens
    per rank. Right padding (an attention_mask) becomes a pad sequence of its own; the fill is another one."""
    extra = set(batch) - {"input_ids", "labels", "position_ids", "attention_mask"}
    if extra:
        raise ValueError(f"context parallelism: the batch has fields {sorted(extra)} that cannot be split; allowed: "
                         "input_ids, labels, position_ids, attention_mask")
    ids, labels = batch["input_ids"], batch["labels"]
    B, T = ids.shape
    positions = batch.get("position_ids")
    mask = batch.get("attention_mask")
    columns = torch.arange(T)
    if positions is None:
        positions = columns.expand(B, T).clone()
        if mask is not None:
            mask = mask.to(torch.bool)
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("context parallelism: an attention_mask that is not right padding; allowed: "
                                 "right-padded rows or packed rows with position_ids")
            real = mask.sum(1, keepdim=True)
            positions = torch.where(columns < real, columns, columns - real)  # the padding: positions from 0
            labels = labels.masked_fill(~mask, IGNORE_INDEX)
    elif mask is not None and not bool(mask.to(torch.bool).all()):
        raise ValueError("context parallelism: position_ids with a padding attention_mask; allowed: one of them")
    width = max(math.ceil(T / size), min_shard) * size
    fill = width - T
    if fill:
        ids = torch.cat([ids, torch.full((B, fill), pad_token_id, dtype=ids.dtype)], dim=1)
        labels = torch.cat([labels, torch.full((B, fill), IGNORE_INDEX, dtype=labels.dtype)], dim=1)
        positions = torch.cat([positions, torch.arange(fill, dtype=positions.dtype).expand(B, fill)], dim=1)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def shard(rows: dict, size: int, rank: int) -> dict:
    """Rank ``rank``'s tokens of every row, and the ``META`` row description."""
    ids, labels, positions = rows["input_ids"], rows["labels"], rows["position_ids"]
    width = ids.shape[1]
    length = width // size
    start = rank * length
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum())  # the causal loss predicts labels 1.. of every row
    meta = torch.tensor([_digest(ids, labels, positions), width, start, length, targets], dtype=torch.int64)
    part = slice(start, start + length)
    return {"input_ids": ids[:, part].contiguous(), "labels": labels[:, part].contiguous(),
            "position_ids": positions[:, part].contiguous(), META: meta}


class ShardCollator:
    """``base``'s batch, as whole rows (``whole_rows``), cut to this rank's shard (``shard``)."""

    def __init__(self, base, size: int, rank: int, pad_token_id: int, min_shard: int = 1):
        self.base, self.size, self.rank = base, size, rank
        self.pad_token_id, self.min_shard = pad_token_id, min_shard

    def __call__(self, items):
        rows = whole_rows(dict(self.base(items)), self.size, self.pad_token_id, self.min_shard)
        return shard(rows, self.size, self.rank)


# --- the Trainer -------------------------------------------------------------------------------------------
def trainer_class(base, layout: Layout, *, seed: int):
    """``base`` (transformers' Trainer) with the sampler, the row check and the loss scaling described above."""
    import torch.distributed as dist

    class ContextParallelTrainer(base):
        first_step_shards: list | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # compute_loss below scales the loss with the global target count from get_batch_samples
            self.model_accepts_loss_kwargs = True

        def _get_train_sampler(self, train_dataset=None, *args, **kwargs):
            dataset = self.train_dataset if train_dataset is None else train_dataset
            return Sampler(len(dataset), self._train_batch_size, layout.size, layout.replicas, seed,
                           drop_last=self.args.dataloader_drop_last)

        def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
            device = self.args.device
            local = sum(int(b[META][TARGETS]) for b in batches)
            total = torch.tensor(local, dtype=torch.int64, device=device)
            dist.all_reduce(total)  # every group's count, once from each of its ranks
            return batches, int(total) // layout.size

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            meta = inputs.pop(META)
            self._check_rows(meta)
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            if model.training and num_items_in_batch:
                loss = loss * (float(meta[TARGETS]) * layout.replicas / float(num_items_in_batch))
            return (loss, outputs) if return_outputs else loss

        def _check_rows(self, meta):
            parts = [torch.empty_like(meta) for _ in range(layout.size)]
            dist.all_gather(parts, meta.contiguous(), group=layout.group)
            got = [[int(v) for v in p.tolist()] for p in parts]
            expected = [[got[0][DIGEST], got[0][WIDTH], r * got[0][LENGTH], got[0][LENGTH], got[0][TARGETS]]
                        for r in range(layout.size)]
            if got != expected:
                raise TrainInputError(
                    f"--context-parallel {layout.size}: the ranks of context-parallel group {layout.replica} "
                    f"received different rows (row digest, width, shard start, length, targets per rank: {got}); "
                    "the launch must give them the same batches: leave accelerate's split_batches and "
                    "dispatch_batches off")
            if self.first_step_shards is None:
                self.first_step_shards = [{"rank": layout.replica * layout.size + r, "start": g[START],
                                           "tokens": g[LENGTH], "row_tokens": g[WIDTH]} for r, g in enumerate(got)]
                if dist.get_rank() == 0:
                    spans = " ".join(f"[{g[START]}, {g[START] + g[LENGTH]})" for g in got)
                    log.info(f"context parallel: {layout.size} ranks x {layout.replicas} data-parallel "
                             f"replica(s); the first rows of {got[0][WIDTH]} tokens are split as {spans}")

    return ContextParallelTrainer
