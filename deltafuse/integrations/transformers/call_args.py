"""What the forward wrappers share: the arguments of a wrapped call by parameter name (``self`` excluded), and
the marks that name a wrapper's original and its factory (``patcher.describe`` reads them)."""

from __future__ import annotations

import inspect

import torch


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
