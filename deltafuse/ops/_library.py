"""The public ops as ``torch.library`` custom ops (namespace ``deltafuse``), so that ``torch.compile`` traces
through them: each op has a fake (meta) implementation and registered autograd.

How an op runs. The public function checks its arguments (unchanged), then calls its custom op
``deltafuse::<op>``. The op's implementation asks the registry for the backend of the call (per call, cached
as before) and runs it. Its fake implementation gives the outputs' shapes and dtypes, which are the op's
contract whatever backend serves it.

Autograd. Every backend already carries its own backward: the Triton backends and the fused losses as
``torch.autograd.Function`` classes, the torch references as ordinary differentiable torch code, FLA and
torch_npu as their libraries' functions. The forward op runs the backend with autograd recording on
detached inputs (no copy), so the backend keeps exactly what its own backward needs, and returns, after the
outputs, a one-element int64 CPU *handle* that refers to that record. ``deltafuse::backward`` takes the
handle and the outputs' gradients and runs the backend's own backward (the same kernels as eagerly; nothing
is recomputed). The record lives as long as the handle tensor: autograd frees the handle with the graph
that saved it (after the backward, or with the outputs when no backward runs), so a backward with
``retain_graph=True`` can run again and a forward whose backward never runs keeps nothing alive.

Values the checks read on the host (labels in range, offsets increasing, expert ids) cannot be read while
dynamo traces a graph; there the ops hand ``validate=True`` to their implementation, which checks them when
the compiled graph runs.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from deltafuse import backends
from deltafuse.ops import _amp

NAMESPACE = "deltafuse"

_records: dict[int, tuple] = {}
_lock = threading.Lock()


class _Holder(bytearray):
    """The memory of a handle tensor; its lifetime is the handle's (torch.frombuffer keeps it alive)."""


def _handle_for(record) -> torch.Tensor:
    """A handle: a one-element int64 tensor holding 0 (so that two runs compare equal) whose memory, an
    object of its own, identifies the record while the tensor lives."""
    holder = _Holder(8)
    handle = torch.frombuffer(holder, dtype=torch.int64)
    key = handle.data_ptr()
    with _lock:
        _records[key] = record
    weakref.finalize(holder, _records.pop, key, None)
    return handle


def _no_handle() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


_NO_HANDLE = _no_handle()  # an eager call's placeholder (never read)


def _autograd_recording():
    """A context in which autograd records inside an op's implementation as in an eager call: the dispatcher
    runs custom ops' implementations with the autograd keys (and, from a compiled graph, more: the
    in-place/view tracking among them) excluded. Only autocast stays excluded (the ops never let it reach
    their implementations)."""
    C = torch._C
    current = C._dispatch_tls_local_exclude_set()
    exclude = C.DispatchKeySet.from_raw_repr(0)
    for key in _AUTOCAST_KEYS:
        if current.has(key):
            exclude = exclude.add(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


_AUTOCAST_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in dir(torch._C.DispatchKey)
                       if name.startswith("Autocast"))


def run_forward(tensors: Sequence[torch.Tensor | None], grad_mask: Sequence[bool],
                run: Callable[..., Sequence[torch.Tensor | None]], device_type: str) -> list[torch.Tensor]:
    """The body of a forward op: ``run(*inputs)`` on the op's tensor arguments (detached; those marked in
    ``grad_mask`` recorded by autograd), autocast off. Returns the outputs (None as a 0-element placeholder
    on the first input's device) and the handle of the backward record."""
    if _EAGER.on:  # an eager call (see ``define``): the backend on the caller's tensors, autograd as usual
        if _amp.autocast_dtype(device_type) is None:
            outs = run(*tensors)
        else:
            with torch.autocast(device_type, enabled=False):
                outs = run(*tensors)
        result = list(outs)
        for i, o in enumerate(result):
            if o is None:
                result[i] = next(t for t in tensors if t is not None).new_empty(0)
        result.append(_NO_HANDLE)
        return result
    ref = next(t for t in tensors if t is not None)
    needs = any(grad_mask)
    inputs = [None if t is None else (t.detach().requires_grad_() if m else t) for t, m in zip(tensors, grad_mask)]
    with _autograd_recording(), torch.set_grad_enabled(needs), _amp.disabled(device_type):
        outs = run(*inputs)
    result, edges = [], []
    for i, o in enumerate(outs):
        if o is None:
            result.append(ref.new_empty(0))
            continue
        if needs and o.requires_grad:
            # the output tensor itself, not its gradient edge: torch < 2.13's autograd.grad cannot take the edge
            # of a torch.autograd.Function's output (it reads metadata such nodes do not expose). The detached
            # output returned shares its storage; holding it keeps that memory until the backward has run
            # (the ops' consumers save their inputs for their own backward anyway)
            edges.append((i, o))
        result.append(o.detach())
    if edges:
        leaves = [t for t, m in zip(inputs, grad_mask) if m and t is not None]
        result.append(_handle_for((edges, leaves, device_type)))
    else:
        result.append(_no_handle())
    return result


def in_layout_of(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` in the memory layout of ``torch.empty_like(like)`` (what a fake implementation built with
    ``empty_like`` promises a compiled graph), copied only when its strides differ."""
    if out.stride() == like.stride():
        return out
    return torch.empty_like(like, dtype=out.dtype).copy_(out)


def fake_outputs(*outs: torch.Tensor | None, like: torch.Tensor) -> list[torch.Tensor]:
    """The fake implementation's outputs: placeholders for None, then the handle."""
    return [like.new_empty(0) if o is None else o for o in outs] + [torch.empty(1, dtype=torch.int64)]


# --- the backward op ---------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.custom_op(f"{NAMESPACE}::backward", mutates_args=())
def backward(handle: torch.Tensor, grads: list[torch.Tensor | None], sizes: list[int], ndims: list[int],
             dtypes: list[int], device: torch.device, keep: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the inputs a forward op recorded (in ``grad_mask`` order) for the outputs' ``grads``.

    ``keep``: in a compiled graph, the forward op's tensor inputs and outputs, unused here: passing them keeps
    their memory alive until this op runs, as the record may hold them (the compiler would otherwise reuse the
    memory of a buffer it thinks dead, and the record would read other data)."""
    key = handle.data_ptr()
    record = _records.get(key)
    if record is None:
        raise RuntimeError("deltafuse: the backward record of this op was freed with its handle")
    edges, leaves, device_type = record
    outs, grad_outs = [], []
    for i, edge in edges:
        if i < len(grads) and grads[i] is not None:
            outs.append(edge)
            grad_outs.append(grads[i])
    if outs:
        with _autograd_recording(), torch.enable_grad(), _amp.disabled(device_type):
            got = torch.autograd.grad(outs, leaves, grad_outs, retain_graph=True, allow_unused=True)
    else:
        got = (None,) * len(leaves)
    # a custom op may not return its inputs or one tensor twice: a gradient passed through unchanged (or
    # shared by two inputs) is copied
    seen = {t.untyped_storage().data_ptr() for t in grad_outs if t.numel()}
    result = []
    for g, leaf in zip(got, leaves):
        if g is None:
            g = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        elif g.numel() and g.untyped_storage().data_ptr() in seen:
            g = g.clone(memory_format=torch.contiguous_format)
        elif not g.is_contiguous():
            g = g.contiguous()  # the fake's layout (a compiled graph relies on it)
        if g.numel():
            seen.add(g.untyped_storage().data_ptr())
        result.append(g)
    return result


@backward.register_fake
def _(handle, grads, sizes, ndims, dtypes, device, keep):
    out, start = [], 0
    for nd, dt in zip(ndims, dtypes):
        out.append(torch.empty(sizes[start:start + nd], dtype=_DTYPES[dt], device=device))
        start += nd
    return out


def register_autograd(op, tensor_args: Sequence[str], no_grad_outputs: Sequence[int] = (),
                      mask_arg: str = "grad_mask") -> None:
    """Autograd of a forward op: the inputs named ``tensor_args`` (in the op's order) that its ``grad_mask``
    marks get gradients from ``deltafuse::backward``; the outputs at ``no_grad_outputs`` (and the handle)
    carry no gradient."""
    names = tuple(tensor_args)
    arg_names = [a.name for a in op._opoverload._schema.arguments]
    positions = [arg_names.index(n) for n in names]

    def setup_context(ctx, inputs, output):
        args = dict(zip(arg_names, inputs))
        mask = args[mask_arg]
        ts = [args[n] for n in names]
        ctx.marked = [i for i, (t, m) in enumerate(zip(ts, mask)) if m and t is not None]
        ctx.meta = [(tuple(ts[i].shape), _DTYPES.index(ts[i].dtype)) for i in ctx.marked]
        ctx.device = next(ts[i].device for i in ctx.marked) if ctx.marked else None
        ctx.n_inputs = len(inputs)
        ctx.mark_non_differentiable(*[output[i] for i in no_grad_outputs], output[-1])
        keep = []
        if is_fake(output[-1]):  # traced for a compiled graph: keep the memory the record may hold alive
            keep = [t for t in (*inputs, *output[:-1]) if isinstance(t, torch.Tensor) and t.numel()]
        ctx.n_keep = len(keep)
        ctx.save_for_backward(output[-1], *keep)

    def backward_fn(ctx, grads):
        result = [None] * ctx.n_inputs
        if not ctx.marked:
            return tuple(result)
        handle, *keep = ctx.saved_tensors
        sizes = [s for shape, _ in ctx.meta for s in shape]
        got = globals()["backward"](handle, list(grads[:-1]), sizes, [len(shape) for shape, _ in ctx.meta],
                                    [dt for _, dt in ctx.meta], ctx.device, keep)
        for i, g in zip(ctx.marked, got):
            result[positions[i]] = g
        return tuple(result)

    op.register_autograd(backward_fn, setup_context=setup_context)


# --- defining the ops ----------------------------------------------------------------------------------------
def define(name: str, tensor_args: Sequence[str], fake: Callable, mutates_args: Sequence[str] = (),
           no_grad_outputs: Sequence[int] = ()):
    """Decorator: the function (annotated with the op's schema, ending in ``grad_mask: list[bool]``) becomes
    the custom op ``deltafuse::<name>`` with fake implementation ``fake`` and autograd through the inputs
    ``tensor_args`` (none for an op that writes into an argument: torch gives such ops no autograd)."""

    def wrap(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
        if not mutates_args:
            register_autograd(op, tensor_args, no_grad_outputs)

        @functools.wraps(fn)
        def call(*args):
            # dynamo tracing a graph: the custom op. Eager: the implementation itself, its backend recorded by
            # autograd as any torch code (the same kernels and backward; none of the custom-op dispatch, the
            # backward record or the nested autograd call, which cost ~0.5-1 ms of CPU per op call)
            if torch.compiler.is_compiling():
                return op(*args)
            token = _EAGER.on
            _EAGER.on = True
            try:
                return fn(*args)
            finally:
                _EAGER.on = token

        call.op = op  # the custom op (torch.ops.deltafuse.<name>), for opcheck and compiled graphs
        return call

    return wrap


class _Eager(threading.local):
    on = False  # an eager call of an op's implementation is running (run_forward records directly)


_EAGER = _Eager()


def grad_mask(*tensors: torch.Tensor | None) -> list[bool]:
    """Which of the tensors autograd must differentiate this call (grad mode on and requires_grad)."""
    grad = torch.is_grad_enabled()
    return [bool(grad and t is not None and t.requires_grad) for t in tensors]


def select(op: str, backend: str | None, mask: Sequence[bool], *tensors: torch.Tensor | None):
    """The implementation that serves a call of ``op`` inside the op (``backend`` as the op got it; ``mask``
    its grad mask; ``tensors`` as ``call_info`` takes them): the registry's cached decision, one dictionary
    lookup once decided (no CallInfo built)."""
    return backends.select_tensors(op, backend, True in mask, tensors)


def call_info(mask: Sequence[bool], *tensors: torch.Tensor | None):
    """The registry's CallInfo of a call inside an op (the tensors there do not carry requires_grad)."""
    from deltafuse.backends import CallInfo

    first = next(t for t in tensors if t is not None)
    shapes = tuple(None if t is None else t.shape for t in tensors)  # the op's shape facts come from these
    return CallInfo(first.device, first.dtype, any(mask), (), shapes)


def named_errors(name: str, check: Callable, *args) -> None:
    """Runs the value checks ``check(*args)`` of op ``name`` inside its implementation (compiled graphs), with
    the op's name in front of their errors as ``public_op`` puts it in eager calls."""
    from deltafuse.ops._checks import ArgumentError

    try:
        check(*args)
    except ArgumentError as exc:
        if exc.op is None and exc.args and isinstance(exc.args[0], str):
            exc.op = name
            exc.args = (f"{name}: {exc.args[0]}",) + exc.args[1:]
        raise
