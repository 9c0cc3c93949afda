"""A float64 run of a stock model: the reference ``deltafuse verify`` and the tests judge fp32 results against."""

from __future__ import annotations

import torch


class Float64Everywhere(torch.overrides.TorchFunctionMode):
    """Inside this mode every request for float32 asks for float64 instead: ``Tensor.float()``, a ``dtype``
    argument or keyword of ``torch.float32`` (``x.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``).

    transformers' modeling code casts to float32 on purpose (its RMSNorms, the gate ``-A_log.float().exp()``,
    the torch GDN fallback converts every input with ``.to(torch.float32)``), so a stock model converted with
    ``.double()`` still computes those parts in float32. Run a float64 copy under this mode to get a float64
    oracle of the whole model, independent of deltafuse."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def float64_copy(model):
    """A float64 copy of ``model`` for a run under ``Float64Everywhere``; its MoE experts compute eagerly (torch's
    grouped_mm takes no float64). ``model`` itself is left as it is."""
    import copy

    oracle = copy.deepcopy(model).double()
    oracle.config._experts_implementation = "eager"
    return oracle
