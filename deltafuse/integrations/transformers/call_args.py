"""What the forward wrappers share: the arguments of a wrapped call by parameter name (``self`` excluded), and
the marks that name a wrapper's original and its factory (``patcher.describe`` reads them)."""

from __future__ import annotations

import inspect

import torch


def call_signature(fn) -> inspect.Signature:
    """The signature of ``fn`` as its callers see it, through decorators that hide it: ``functools.wraps``
    (``__wrapped__``, which ``inspect.signature`` follows) and a plain closure over the decorated function (from
    5.14 transformers decorates the GDN layers' forward with ``force_accelerate_hooks``, whose wrapper is
    ``(self, *args, **kwargs)``; a positional ``hidden_states`` would then be unreadable)."""
    sig = inspect.signature(fn)
    rest = list(sig.parameters.values())[1:]
    if rest and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if inspect.isfunction(inner) and inner is not fn:
                return call_signature(inner)
    return sig


def call_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, default=None):
    """The value of parameter ``name`` in a call (self excluded from ``args``)."""
    if name in kwargs:
        return kwargs[name]
    params = list(signature.parameters)[1:]  # drop self
    if name in params:
        index = params.index(name)
        if index < len(args):
            return args[index]
    return default


def set_call_argument(signature: inspect.Signature, args: tuple, kwargs: dict, name: str, value) -> tuple:
    params = list(signature.parameters)[1:]
    if name in params and params.index(name) < len(args):
        args = list(args)
        args[params.index(name)] = value
        return tuple(args)
    kwargs[name] = value
    return args


def all_ones_mask(mask) -> bool:
    """A 2-D attention mask that masks nothing (what tokenizers and many collators return for unpadded rows)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask == 1).all())


def mark_wrapper(wrapper, original, factory: str):
    """``wrapper``, marked as built by ``deltafuse.<factory>`` around ``original``."""
    wrapper.__deltafuse_wraps__ = original
    wrapper.__deltafuse_factory__ = f"deltafuse.{factory}"
    return wrapper
