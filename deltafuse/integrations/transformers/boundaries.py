"""Packed sequences: the boundaries of a [B, T] batch, read once into one ``Packing``.

A batch [B, T] may hold several sequences per row. Without a cache, boundaries come from, in order of
precedence, ``cu_seq_lens_q`` (offsets on the flat B*T axis), ``seq_idx`` ([B, T], a sequence id per token) or
``position_ids``: a new sequence starts wherever the position does not grow by exactly 1 (transformers' own
rule for its packed attention mask). position_ids count when there is no attention mask or a 2-D mask of all
ones; they are read from [B, T] / [1, T] / [T], from the first (text) row of [4, B, T], and from [3, B, T] when
its three rows are equal (text; rows that differ are a multimodal RoPE layout, no boundary signal). Every row
start is a boundary too: sequences never span rows. For a packed batch, an all-ones 2-D mask is dropped and
equal [3, B, T] positions are passed as their one [B, T] row, so that transformers builds its block-causal
mask for the full-attention layers from the restarting positions in every version. A mask with zeros (padding)
or a 4-D mask is kept as given: position_ids are then positions only, and only ``cu_seq_lens_q`` / ``seq_idx``
separate sequences (in the GDN and conv layers; the full-attention layers follow the given mask).

One object, ``Packing``, carries the boundaries from the text model to the op adapters, validated when it is
built (``packing_from_*``); nothing downstream derives or validates them again. It also holds the host copy
of the offsets (``offsets``), which the ops read through ``deltafuse.ops._checks.host_offsets`` instead of
copying them back from the accelerator.

Under ``torch.compile`` the boundaries are derived on the device and never read back while tracing: the
Packing holds only ``seq_idx`` (a cumulative sum; fixed size), not ``cu_seqlens`` (whose size is the number of
sequences: data-dependent) nor ``offsets``; the GDN adapter hands ``seq_idx`` to the custom op
``deltafuse::packed_gated_delta_rule``, which derives the offsets when the graph runs. A batch is then treated
as packed whenever boundaries were looked for (a batch whose rows are its sequences gives the same results
through the packed call). Explicit ``cu_seq_lens_q`` are checked and marked by ``deltafuse::packing_starts``
when the graph runs. Two readings need values and are made as stock makes them while tracing, so that a
traced graph (``torch.compile(fullgraph=True)``, ``torch.export``) holds for every value its inputs may take:
a 2-D ``attention_mask`` is a padding mask (position_ids given with it mark no boundaries, all ones or not),
and [3, B, T] position_ids mark none (equal rows or not). Packed rows under tracing pass no mask, [B, T] or
[4, B, T] position_ids, or ``cu_seq_lens_q`` / ``seq_idx``.

``packing.py`` carries the Packing from the text model to the op adapters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deltafuse.ops._checks import remember_host_offsets


class PackingError(ValueError):
    """Packed-sequence arguments that do not describe the batch they come with."""


@dataclass(frozen=True)
class Packing:
    """Sequence boundaries of a [B, T] batch.

    seq_idx: [B, T] int64, the sequence of every token; ids grow along the flat B*T axis and differ between
        rows, so it serves both causal-conv1d's per-row convention and a flattened call.
    cu_seqlens: [N + 1] int32 offsets of the N sequences on the flat B*T axis; None when derived inside a
        compiled graph (their number is data-dependent there; the ops derive them from seq_idx when it runs).
    offsets: the same offsets as Python ints (known when the boundaries were found: no device read); None
        when derived inside a compiled graph.
    block_causal: the attention mask transformers builds for this batch is exactly "causal within each
        sequence" (no attention mask, no cache, position_ids restarting at these boundaries), so attention may
        be computed sequence by sequence.
    context: under context parallelism, this rank's ``Shard`` (``context_parallel.py``): the batch is one
        contiguous shard of every row, and a row's first sequence may continue the previous rank's last one.
    padded: ``cu_seqlens`` has a fixed number of entries, the real sequences' offsets followed by empty
        sequences at B*T, and ``offsets`` is None: the form a captured CUDA graph is handed (``padded_to``), whose
        shapes must not follow the number of sequences. Its ``num_sequences`` counts the empty ones too.
    """

    seq_idx: torch.Tensor
    cu_seqlens: torch.Tensor | None
    batch: int
    length: int
    offsets: tuple[int, ...] | None = ()
    block_causal: bool = False
    context: object = dataclasses.field(default=None, compare=False, repr=False)
    padded: bool = False

    def __post_init__(self):
        if self.offsets is not None and len(self.offsets) != self.cu_seqlens.numel():
            # not given: read once from the tensor
            object.__setattr__(self, "offsets", tuple(int(v) for v in self.cu_seqlens.tolist()))

    @property
    def num_sequences(self) -> int | None:
        """The number of sequences (None when derived inside a compiled graph)."""
        return None if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @property
    def rows_are_sequences(self) -> bool:
        """Every row holds exactly one sequence (the ordinary batched call is then exact). False when the
        offsets are not known on the host (compiled): the packed call is exact in every case."""
        if self.offsets is None:
            return False
        return self.num_sequences == self.batch and all(
            b - a == self.length for a, b in zip(self.offsets, self.offsets[1:]))

    def row_sequences(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of the first and of the last sequence of every row: the sequences of its first and its last
        token."""
        seq_idx = self.seq_idx.to(device=device, dtype=torch.long)
        return seq_idx[:, 0].contiguous(), seq_idx[:, -1].contiguous()

    def positions(self) -> torch.Tensor:
        """[B, T] int64 position of every token within its sequence (0 at each sequence start)."""
        flat = torch.arange(self.batch * self.length, device=self.seq_idx.device)
        if self.cu_seqlens is None:  # compiled: the start of every token's sequence, by a running maximum
            sid = self.seq_idx.reshape(-1)
            is_start = torch.ones_like(sid, dtype=torch.bool)
            is_start[1:] = sid[1:] != sid[:-1]
            first = torch.cummax(torch.where(is_start, flat, torch.zeros_like(flat)), 0).values
            return (flat - first).view(self.batch, self.length)
        starts = self.cu_seqlens.to(device=flat.device, dtype=torch.int64)[:-1]
        return (flat - starts[self.seq_idx.reshape(-1)]).view(self.batch, self.length)

    def padded_to(self, capacity: int) -> "Packing":
        """This Packing in the ``padded`` form: its offsets as a device tensor of ``capacity`` + 1 entries (the
        real ones, then B*T for every empty sequence), no host copy. Needs the offsets on the host and at most
        ``capacity`` sequences."""
        n = self.num_sequences
        if self.offsets is None or self.context is not None or self.padded:
            raise PackingError("padded_to: only a Packing whose offsets the host holds, outside context "
                               "parallelism and not padded already, can be padded")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < n:
            raise PackingError(f"padded_to(capacity={capacity!r}): the batch holds {n} sequences; allowed: an int "
                               f">= {n}")
        total = self.batch * self.length
        host = torch.tensor(self.offsets + (total,) * (capacity - n), dtype=torch.int32)
        if self.seq_idx.is_cuda:
            host = host.pin_memory()
        cu = host.to(self.seq_idx.device, non_blocking=True)
        return dataclasses.replace(self, cu_seqlens=cu, offsets=None, padded=True)

    def check(self, batch: int, length: int | None, where: str) -> None:
        """Raise unless this Packing describes a [batch, length] batch (``length`` None: any length)."""
        if batch != self.batch or (length is not None and length != self.length):
            got = f"[{batch}, {length if length is not None else '?'}]"
            raise PackingError(f"{where} got a {got} batch but its packed-sequence boundaries describe "
                               f"[{self.batch}, {self.length}]")



@torch.library.custom_op("deltafuse::packing_starts", mutates_args=())
def packing_starts(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[batch, length] bool: True at the first token of every sequence of the offsets ``cu_seqlens`` (on the
    flat axis) and at every row start; the offsets are checked (as ``packing_from_cu_seqlens`` does eagerly)
    when it runs, which inside a compiled graph is when the graph runs."""
    cu = cu_seqlens.to(torch.int64)
    total = batch * length
    _check_given_offsets(cu, total, batch, length)
    flat = torch.zeros(total + 1, dtype=torch.bool, device=cu.device)
    flat[cu] = True  # the end offset marks the extra last slot
    starts = flat[:total].view(batch, length).clone()
    starts[:, 0] = True
    return starts


@packing_starts.register_fake
def _(cu_seqlens, batch, length):
    return cu_seqlens.new_empty((batch, length), dtype=torch.bool)


def packing_from_starts(starts: torch.Tensor) -> Packing | None:
    """Packing from a [B, T] bool tensor marking the first token of every sequence (row starts implied).

    Returns None when every row holds exactly one sequence (the ordinary batched call is then exact). While
    dynamo traces a graph nothing is read back: the Packing holds only ``seq_idx`` and is returned even when
    the rows are the sequences.
    """
    B, T = starts.shape
    if T == 0:
        return None
    starts = starts.clone()
    starts[:, 0] = True
    flat = starts.reshape(-1)
    seq_idx = (flat.to(torch.int64).cumsum(0) - 1).view(B, T)
    if torch.compiler.is_compiling():
        return Packing(seq_idx, None, B, T, None)
    offsets = flat.nonzero().squeeze(1)
    if offsets.numel() == B:
        return None
    end = torch.tensor([B * T], device=offsets.device, dtype=offsets.dtype)
    cu_seqlens = torch.cat([offsets, end]).to(torch.int32)
    # nonzero() above already waited for the device: keep a host copy so that no layer reads it back again
    host = tuple(int(v) for v in offsets.tolist()) + (B * T,)
    remember_host_offsets(cu_seqlens, host)
    return Packing(seq_idx, cu_seqlens, B, T, host)


def text_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The positions that carry sequence boundaries: [B, T] / [1, T] / [T] as given, the first (text) row of
    [4, B, T], the common row of a [3, B, T] whose three rows are equal (text); None for a [3, B, T] whose
    rows differ (multimodal RoPE, where e.g. image tokens share a temporal position: no sequence signal)."""
    pos = position_ids
    if pos.dim() == 3:
        if pos.shape[0] == 4:
            return pos[0]
        if pos.shape[0] == 3:
            if torch.compiler.is_compiling():  # equal rows or not is unknown while tracing: stock's reading
                return None
            return pos[0] if bool((pos[1:] == pos[:1]).all()) else None
    return pos


def packing_from_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> Packing | None:
    """Boundaries where the position does not grow by 1 (transformers' ``find_packed_sequence_indices``),
    read from the rows ``text_positions`` picks."""
    if position_ids.dim() == 3 and position_ids.shape[0] not in (3, 4):
        raise PackingError(f"position_ids of shape {tuple(position_ids.shape)} do not fit a [{batch}, {length}] "
                           "batch; expected [B, T], [1, T], [T] or [3|4, B, T]")
    pos = text_positions(position_ids)
    if pos is None:
        return None
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
        raise PackingError(f"position_ids of shape {tuple(position_ids.shape)} do not fit a [{batch}, {length}] "
                           "batch; expected [B, T], [1, T], [T] or [3|4, B, T]")
    pos = pos.expand(batch, length)
    if length < 2:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    return packing_from_starts(starts)


def packing_from_seq_idx(seq_idx: torch.Tensor, batch: int, length: int) -> Packing | None:
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or tuple(seq_idx.shape) != (batch, length):
        got = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise PackingError(f"seq_idx must be a [B, T] = [{batch}, {length}] integer tensor, got {got}")
    if length < 2:
        return None
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return packing_from_starts(starts)


def _check_given_offsets(cu: torch.Tensor, total: int, batch, length) -> None:
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise PackingError(f"cu_seq_lens_q must run from 0 to B*T = {batch}*{length} = {total} (offsets on the "
                           f"flattened batch), got {first} ... {last}")
    if bool((cu[1:] < cu[:-1]).any()):  # (from 0 to B*T and never decreasing: every offset in range)
        raise PackingError(f"cu_seq_lens_q must not decrease (offsets of consecutive sequences), got "
                           f"{cu.tolist()}")


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> Packing | None:
    """cu_seqlens are offsets on the flat B*T axis; a row start that is not an offset still starts a sequence."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise PackingError(f"cu_seq_lens_q must be a 1-D tensor of at least 2 offsets, got {got}")
    cu = cu_seqlens.to(torch.int64)
    total = batch * length
    if torch.compiler.is_compiling():  # no host read while tracing: checked and marked when the graph runs
        return packing_from_starts(packing_starts(cu_seqlens, batch, length))
    _check_given_offsets(cu, total, batch, length)
    flat = torch.zeros(total, dtype=torch.bool, device=cu.device)
    offsets = cu[:-1]
    flat[offsets[offsets < total]] = True  # an empty trailing sequence starts at the end: no token to mark
    return packing_from_starts(flat.view(batch, length))


def packing_from_kwargs(kwargs: dict, batch: int, length: int, position_ids=None) -> Packing | None:
    """Boundaries from explicit packed-sequence keywords, else from restarting position_ids (or None)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return packing_from_cu_seqlens(kwargs["cu_seq_lens_q"], batch, length)
    if kwargs.get("seq_idx") is not None:
        return packing_from_seq_idx(kwargs["seq_idx"], batch, length)
    if position_ids is not None:
        return packing_from_position_ids(position_ids, batch, length)
    return None
