"""Helpers shared by the transformers-integration tests."""

from __future__ import annotations

import torch

from deltafuse.maps import FAMILY_MAPS, PATCHER

# fp32 rounding: the stock and deltafuse GDN compute the same maths in different orders
RTOL = 1e-4


def grads(model) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (b is the reference)."""
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def assert_grads_close(got: dict, ref: dict, rtol: float = RTOL) -> None:
    """Every parameter gradient agrees: rel <= rtol, or an absolute error at fp32 rounding of the largest
    gradient (for gradients that are all but zero). Missing gradients must be missing on both sides."""
    assert got.keys() == ref.keys()
    scale = max(g.abs().max().item() for g in ref.values() if g is not None)
    bad = []
    for name, r in ref.items():
        g = got[name]
        if r is None or g is None:
            if (r is None) != (g is None):
                bad.append(f"{name}: gradient present on one side only")
            continue
        err = (g.double() - r.double()).abs().max().item()
        if not (rel_max(g, r) <= rtol or err <= 1e-6 * scale):
            bad.append(f"{name}: rel {rel_max(g, r):.3e} abs {err:.3e}")
    assert not bad, "gradients differ:\n" + "\n".join(bad)


def per_sequence_stock(model, rows: list[list[torch.Tensor]]):
    """Stock reference of a packed batch: each sequence alone, loss = token-weighted mean of the sequence
    losses (each sequence's first label ignored, as padding-free collators do). Leaves the gradients of
    that loss in the model; returns (loss, logits laid out like the packed batch)."""
    total = sum(len(s) - 1 for row in rows for s in row)
    loss = 0.0
    out_rows = []
    for row in rows:
        parts = []
        for seq in row:
            ids = seq[None]
            out = model(input_ids=ids, labels=ids if len(seq) > 1 else None, use_cache=False)
            if len(seq) > 1:
                part = out.loss * (len(seq) - 1) / total
                part.backward()
                loss = loss + part.detach()
            parts.append(out.logits.detach())
        out_rows.append(torch.cat(parts, 1))
    return torch.as_tensor(loss), torch.cat(out_rows, 0)


def packed_inputs(rows: list[list[torch.Tensor]]):
    """input_ids, position_ids (restarting), labels (-100 on every sequence start), cu_seq_lens_q (flat over
    B*T) and seq_idx for rows of equal total length."""
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in rows])
    labels = ids.clone()
    lengths = [len(s) for r in rows for s in r]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    labels.view(-1)[offsets[:-1]] = -100
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(ids.shape)
    return ids, pos, labels, offsets.to(torch.int32), seq_idx


def family_modules():
    """The imported modeling module of every mapped family."""
    mods = PATCHER.modules()
    return {f.family: mods[f.family] for f in FAMILY_MAPS if not isinstance(mods[f.family], str)}


def snapshot(model=None) -> dict:
    """Identity snapshot of everything a map row may touch: module globals, class attributes (own dict) and
    instance attributes of the model's layers."""
    snap = {}
    mods = family_modules()
    for fmap in FAMILY_MAPS:
        module = mods.get(fmap.family)
        if module is None:
            continue
        for route in fmap.routes:
            if route.kind == "global":
                snap[(fmap.module, route.attr)] = vars(module).get(route.attr, "<absent>")
            else:
                cls = getattr(module, route.owner)
                snap[(fmap.module, route.owner, route.attr)] = vars(cls).get(route.attr, "<absent>")
                if model is not None:
                    for i, m in enumerate(model.modules()):
                        if isinstance(m, cls):
                            snap[(fmap.module, route.owner, i, route.attr)] = vars(m).get(route.attr, "<absent>")
                            snap[(fmap.module, route.owner, i, "_old_forward")] = vars(m).get("_old_forward",
                                                                                             "<absent>")
    return snap


def assert_same_objects(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if before[k] is not after[k]]
    assert not changed, f"objects not restored: {changed}"


def count_op_calls(monkeypatch, names) -> dict[str, int]:
    """Counts the calls into each named public deltafuse op (the adapters look the ops up at call time)."""
    import deltafuse.ops

    counts = {name: 0 for name in names}
    for name in names:
        real = getattr(deltafuse.ops, name)

        def counting(*args, _name=name, _real=real, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(deltafuse.ops, name, counting)
    return counts


def record_op_kwarg(monkeypatch, name: str, kwarg: str) -> list:
    """The ``kwarg`` of every call into the named public deltafuse op (None where a call does not pass it), in
    call order (the adapters look the ops up at call time)."""
    import deltafuse.ops

    seen = []
    real = getattr(deltafuse.ops, name)

    def recording(*args, **kwargs):
        seen.append(kwargs.get(kwarg))
        return real(*args, **kwargs)

    monkeypatch.setattr(deltafuse.ops, name, recording)
    return seen
