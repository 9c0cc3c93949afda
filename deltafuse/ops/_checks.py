"""Argument checks shared by the public ops. Every error names the op, the argument, its value and what is
allowed.

``public_op`` wraps every public op: it checks each argument's *kind* against the op's annotations
(``torch.Tensor``, ``torch.Tensor | None``, ``bool``, ``int``, ``float``, ``str``) before the op's own checks
run, and puts the op's name in front of every ``ArgumentError`` the op raises. The op's own checks then judge
values (shapes, dtypes, ranges). A ``backend=`` argument is checked by ``deltafuse.backends.select``.

Checks that would read tensor values (and so synchronise an accelerator) run only for CPU tensors, or
everywhere when DELTAFUSE_VALIDATE is on.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import types
import typing

import torch
from torch.utils.weak import WeakIdKeyDictionary

from deltafuse import config

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ArgumentError(ValueError):
    """A public op was given an argument it does not accept (the message names the op and the argument)."""

    op: str | None = None


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong kind (a list or array where a tensor goes, a tensor where a number goes...).
    Both a TypeError and, like every argument error of the ops, a ValueError."""


def fail(message: str) -> None:
    raise ArgumentError(message)


def short_repr(value, limit: int = 80) -> str:
    """repr(value), cut to ``limit`` characters (tensors and arrays show their shape and dtype, not values)."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    shape_, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape_, tuple) and dtype is not None:  # numpy (and other) arrays
        return f"array of shape {shape_} {dtype}"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = object.__repr__(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain_tensor(t) -> bool:
    """A torch.Tensor or Parameter itself: DTensor (FSDP2, tensor parallelism) and other subclasses are not."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


# --- argument kinds from annotations -----------------------------------------------------------------------
_SYM_BOOL = tuple(t for t in (getattr(torch, "SymBool", None),) if t is not None)
_SYM_NUM = tuple(t for t in (getattr(torch, "SymInt", None), getattr(torch, "SymFloat", None)) if t is not None)


def _kind_ok(kind: type, value) -> bool:
    if kind is torch.Tensor:
        return isinstance(value, torch.Tensor)
    if kind is bool:
        return isinstance(value, (bool,) + _SYM_BOOL)
    if kind in (int, float):
        # only the kind here: a number that is not a bool; the op's own check judges floats given for ints,
        # ranges and finiteness
        return isinstance(value, (numbers.Real,) + _SYM_NUM) and not isinstance(value, (bool, torch.Tensor))
    if kind is str:
        return isinstance(value, str)
    return True


_KIND_TEXT = {torch.Tensor: "a torch.Tensor", bool: "True or False", int: "an int", float: "a float",
              str: "a str"}


def _rule(hint) -> tuple[tuple[type, ...], bool] | None:
    """(kinds, None allowed) for an annotation this module checks, else None (the op checks it itself)."""
    optional = False
    members = (hint,)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
    kinds = []
    for m in members:
        if m is type(None):
            optional = True
        elif m in _KIND_TEXT:
            kinds.append(m)
        else:
            return None
    return (tuple(kinds), optional) if kinds else None


def _allowed_text(kinds, optional) -> str:
    words = [_KIND_TEXT[k] for k in kinds] + (["None"] if optional else [])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


# the exact types each kind accepts outright (every value of these types passes ``_kind_ok``)
_EXACT = {torch.Tensor: frozenset({torch.Tensor, torch.nn.Parameter}), bool: frozenset({bool}),
          int: frozenset({int, float}), float: frozenset({int, float}), str: frozenset({str})}


def _check_kind(name: str, rule, value) -> None:
    """The full kind check of one argument of op ``name`` (``rule`` as ``public_op`` builds them)."""
    arg, _position, kinds, optional, allowed = rule
    if value is None:
        if optional:
            return
    elif any(_kind_ok(k, value) for k in kinds):
        return
    got = (f"{type(value).__name__} ({short_repr(value)})" if torch.Tensor in kinds else
           f"{short_repr(value)} ({type(value).__name__})")
    raise ArgumentTypeError(f"{name}: {arg} must be {allowed}, got {got}")


def public_op(name: str):
    """Decorator of a public op named ``name``: argument kinds checked from its annotations, and its name
    in every ArgumentError it raises."""

    def wrap(fn):
        hints = typing.get_type_hints(fn)
        rules = []
        for index, param in enumerate(inspect.signature(fn).parameters.values()):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == "backend":
                continue  # backend: checked against the op's own backend names (backends.call_backend)
            rule = _rule(hints.get(param.name))
            if rule is not None:
                position = index if param.kind != param.KEYWORD_ONLY else None
                rules.append((param.name, position, rule[0], rule[1], _allowed_text(*rule)))
        rules = tuple(rules)
        # per call, the common case costs one set lookup per argument: a value whose exact type is one the
        # rule accepts outright (see _EXACT) passes; anything else (None, subclasses, SymInts, wrong kinds)
        # takes the full check
        fast = tuple((arg, position, frozenset().union(*(_EXACT[k] for k in kinds)) | ({type(None)} if optional
                      else set())) for arg, position, kinds, optional, _ in rules)
        slow = {arg: rule for arg, rule in zip((r[0] for r in rules), rules)}

        @functools.wraps(fn)
        def op(*args, **kwargs):
            n = len(args)
            for arg, position, exact in fast:
                if position is not None and position < n:
                    if type(args[position]) in exact:
                        continue
                    _check_kind(name, slow[arg], args[position])
                elif kwargs and arg in kwargs:
                    if type(kwargs[arg]) in exact:
                        continue
                    _check_kind(name, slow[arg], kwargs[arg])
            try:
                return fn(*args, **kwargs)
            except ArgumentError as exc:
                if exc.op is None and exc.args and isinstance(exc.args[0], str):
                    exc.op = name
                    exc.args = (f"{name}: {exc.args[0]}",) + exc.args[1:]
                raise

        op.rules = rules
        return op

    return wrap


def shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def tensor(name: str, t, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__} ({short_repr(t)})")
    if ndim is not None and t.dim() != ndim:
        fail(f"{name} must have {ndim} dimensions, got shape {shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; allowed: {allowed}")


def same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            fail(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all tensors must share a device")


def values_checkable(t: torch.Tensor) -> bool:
    """Whether checks may read ``t``'s values: always on CPU, elsewhere when DELTAFUSE_VALIDATE is on; never
    while dynamo traces a graph (the op's implementation checks them when the graph runs)."""
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or config.env_switch("DELTAFUSE_VALIDATE")


# Host copies of offsets tensors, kept by whoever built them (the packing layer, a benchmark): tensor ->
# (its version when remembered, the values). Weakly keyed by identity, so an entry goes with its tensor, and an
# entry of a tensor changed in place since (a new version) is not used.
_HOST_OFFSETS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember_host_offsets(cu: torch.Tensor, offsets) -> None:
    """Keep ``offsets``, the values of the offsets tensor ``cu`` its caller built, on the host for the ops while
    ``cu`` lives unchanged (the ops then never read ``cu`` back from the accelerator)."""
    _HOST_OFFSETS[cu] = (cu._version, tuple(offsets))


def known_host_offsets(cu: torch.Tensor) -> tuple[int, ...] | None:
    """The values of ``cu`` as remembered (no device read), else None."""
    known = _HOST_OFFSETS.get(cu)
    if known is not None and known[0] == cu._version and len(known[1]) == cu.numel():
        return known[1]
    return None


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """The values of a 1-D offsets tensor as Python ints: as remembered (``remember_host_offsets``), else read
    from the tensor (which waits for the accelerator)."""
    known = known_host_offsets(cu)
    return known if known is not None else tuple(int(x) for x in cu.tolist())


def cu_seqlens(cu: torch.Tensor, batch: int, total: int) -> int:
    """Validate cu_seqlens for a [1, total, ...] packed batch; returns the number of sequences (empty ones at the
    end included: offsets strictly increasing up to T, then T repeated, which is how a fixed-size offsets tensor
    holds fewer sequences than it has room for; each empty sequence's final state is its initial state)."""
    if not isinstance(cu, torch.Tensor):
        raise ArgumentTypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu).__name__} "
                                f"({short_repr(cu)})")
    if cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.dtype.is_complex:
        fail(f"cu_seqlens must be a 1-D integer tensor, got shape {shape(cu)} dtype {cu.dtype}")
    if cu.numel() < 2:
        fail(f"cu_seqlens must hold at least 2 offsets (0 and T), got {cu.numel()}")
    if batch != 1:
        fail(f"cu_seqlens needs the batch dimension to be 1 (sequences packed along T), got B={batch}")
    if values_checkable(cu) or (not torch.compiler.is_compiling() and known_host_offsets(cu) is not None):
        vals = list(host_offsets(cu))
        if vals[0] != 0:
            fail(f"cu_seqlens must start at 0, got {vals[0]}")
        if any((b <= a) if a != total else (b != total) for a, b in zip(vals, vals[1:])):
            fail(f"cu_seqlens must be strictly increasing (after T only T again: empty sequences at the end), got "
                 f"{vals if len(vals) <= 16 else vals[:16] + ['...']}")
        if vals[-1] != total:
            fail(f"cu_seqlens must end at T={total} (the packed length), got {vals[-1]}")
    return cu.numel() - 1
