"""Packing and collation of the encoded examples (``deltafuse.train.data``) for the Trainer.

Packing is padding-free: examples are grouped (best-fit decreasing) into bins of at most ``seq_len``
tokens, and a batch of bins is flattened into one row whose ``position_ids`` restart at 0 at every example
(transformers' ``DataCollatorWithFlattening``). No ``cu_seq_lens``/``seq_idx`` are passed, so the stock and the
deltafuse runs of `deltafuse bench e2e` see the very same inputs; deltafuse derives the sequence boundaries
from the restarting ``position_ids`` for the GDN and conv layers, and full attention builds its packed mask
from them.

The bins are packed here, not by TRL's ``pack_dataset(strategy="bfd")``: that needs ``datasets`` (not a dependency
of deltafuse) and leaves every packed row as wide as its own bin, where ``PackedCollator`` fills every row to one
width so that every step has the same shape.
"""

from __future__ import annotations

import heapq

import torch

from deltafuse.train.data import IGNORE_INDEX

# Batch key of the number of real tokens (no filler, no padding) a collator counted on the host; the Trainer of
# ``steps.trainer_class`` takes it out of the batch before the model sees it.
TOKENS_KEY = "deltafuse_tokens"


class _RoomIndex:
    """Open bins by free room 0..capacity: the fullest bin an example fits in, in O(log capacity + log bins).

    A segment tree over the room values counts the open bins per room; a heap per room value holds their ids,
    so ties go to the earliest bin (deterministic).
    """

    def __init__(self, capacity: int):
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)
        self.bins: dict[int, list[int]] = {}

    def _add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.count[i] += delta
            i //= 2

    def push(self, room: int, bin_id: int) -> None:
        heapq.heappush(self.bins.setdefault(room, []), bin_id)
        self._add(room, 1)

    def pop_fitting(self, need: int) -> tuple[int, int] | None:
        """(room, bin id) of the open bin with the least room >= need (removed from the index), or None."""
        lo = need
        if lo >= self.size or not self.count[1]:
            return None
        # depth-first, left before right: the leftmost non-empty leaf at index >= lo
        stack, found = [(1, 0, self.size)], None
        while stack:
            node, start, width = stack.pop()
            if not self.count[node] or start + width <= lo:
                continue
            if width == 1:
                found = start
                break
            half = width // 2
            stack.append((2 * node + 1, start + half, half))  # pushed first, so the left half is tried first
            stack.append((2 * node, start, half))
        if found is None:
            return None
        bin_id = heapq.heappop(self.bins[found])
        self._add(found, -1)
        return found, bin_id


def pack(examples: list[dict], seq_len: int) -> list[list[dict]]:
    """Best-fit-decreasing bins of at most ``seq_len`` tokens, O(n log n); deterministic for the same input.

    Longest example first, each into the open bin it fills most tightly (the earliest such bin on ties), a new
    bin when none has room. Uses at most 11/9 OPT + 6/9 bins (the first-fit-decreasing bound). Bins come in
    the order they were opened; the examples of a bin in their input order.
    """
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]["input_ids"]), i))
    bins: list[list[int]] = []
    # the index spans the room values that can occur: a bin wider than all the tokens together packs exactly as
    # one of that width (everything fits in the first bin), so a huge --seq-len costs nothing here
    cap = min(seq_len, sum(len(ex["input_ids"]) for ex in examples))
    index = _RoomIndex(cap)
    for i in order:
        n = len(examples[i]["input_ids"])
        if n > seq_len:
            raise ValueError(f"example {i} has {n} tokens, more than the bin size {seq_len}")
        hit = index.pop_fitting(n)
        if hit is None:
            bins.append([i])
            room, b = cap - n, len(bins) - 1
        else:
            room, b = hit
            bins[b].append(i)
            room -= n
        if room > 0:
            index.push(room, b)
    return [[examples[i] for i in sorted(b)] for b in bins]


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PackedCollator:
    """A batch of bins -> one padding-free row: input_ids, labels, position_ids restarting at 0 per example.

    With ``row_tokens``, the row is filled up to ``row_tokens`` per bin by one more sequence of pad tokens
    (its own positions from 0, labels ignored), so every step has the same shape: a packed row whose length
    changes from step to step makes cuDNN attention build a new plan and Triton kernels specialise again
    (measured on an H200: dense8 Trainer steps of 0.25 s against 0.115 s for repeated shapes). The pad sequence
    is a sequence of its own for the GDN, conv and attention layers and adds nothing to the loss, so the
    real sequences' loss and gradients are unchanged.
    """

    def __init__(self, pad_token_id: int | None = None, row_tokens: int | None = None, count_tokens: bool = False):
        from transformers import DataCollatorWithFlattening

        if row_tokens is not None and pad_token_id is None:
            raise ValueError("PackedCollator: row_tokens needs a pad_token_id to fill the row with")
        self.pad_token_id = pad_token_id
        self.row_tokens = row_tokens
        self.count_tokens = count_tokens
        self.flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)

    def __call__(self, bins):
        examples = [ex for b in bins for ex in b]
        batch = self.flatten(examples)
        if self.count_tokens:
            batch[TOKENS_KEY] = sum(len(ex["input_ids"]) for ex in examples)
        if self.row_tokens is None:
            return batch
        width = self.row_tokens * len(bins)
        fill = width - batch["input_ids"].shape[1]
        if fill < 0:
            raise ValueError(f"PackedCollator: {len(bins)} bin(s) hold {batch['input_ids'].shape[1]} tokens, more "
                             f"than row_tokens={self.row_tokens} per bin")
        if fill:
            pads = {"input_ids": torch.full((1, fill), self.pad_token_id, dtype=batch["input_ids"].dtype),
                    "labels": torch.full((1, fill), IGNORE_INDEX, dtype=batch["labels"].dtype),
                    "position_ids": torch.arange(fill, dtype=batch["position_ids"].dtype)[None]}
            for key, pad in pads.items():
                batch[key] = torch.cat([batch[key], pad], dim=1)
        return batch


class PaddedCollator:
    """A batch of examples -> right-padded rows with attention_mask; padded labels are ignored.

    Not transformers' ``DataCollatorForSeq2Seq``: it pads through the tokenizer on the tokenizer's padding side,
    which is the left for some models' tokenizers; these rows are right-padded whatever the tokenizer says."""

    def __init__(self, pad_token_id: int, count_tokens: bool = False):
        self.pad_token_id = pad_token_id
        self.count_tokens = count_tokens

    def __call__(self, examples):
        width = max(len(ex["input_ids"]) for ex in examples)
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for r, ex in enumerate(examples):
            n = len(ex["input_ids"])
            ids[r, :n] = torch.tensor(ex["input_ids"])
            labels[r, :n] = torch.tensor(ex["labels"])
            mask[r, :n] = 1
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if self.count_tokens:
            batch[TOKENS_KEY] = sum(len(ex["input_ids"]) for ex in examples)
        return batch


def max_sequences_per_row(dataset: ListDataset, batch_size: int) -> int:
    """The most sequences a row of ``PackedCollator`` can hold for this dataset of bins: ``batch_size`` of its
    fullest bins, and the filler sequence."""
    counts = sorted((len(b) for b in dataset.items), reverse=True)
    return sum(counts[:batch_size]) + 1


def build_dataset(examples: list[dict], seq_len: int, packing: bool, pad_token_id: int, count_tokens: bool = False):
    """(dataset, collator) for the Trainer.

    Packed: every bin is filled to the width of the fullest bin built (at most ``seq_len``): all steps have one
    shape, and no row is wider than the data needs (``--seq-len 1000000000`` on short rows allocates short rows).
    ``count_tokens``: every batch carries its number of real tokens under ``TOKENS_KEY`` (``steps.trainer_class``).
    """
    if packing:
        bins = pack(examples, seq_len)
        width = max(sum(len(ex["input_ids"]) for ex in b) for b in bins)
        return ListDataset(bins), PackedCollator(pad_token_id, width, count_tokens=count_tokens)
    return ListDataset(examples), PaddedCollator(pad_token_id, count_tokens=count_tokens)
