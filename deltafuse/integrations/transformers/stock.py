"""Stock transformers as a baseline that always runs: its own pure-torch GDN functions when its fast path
cannot run on the tensors in hand.

Stock transformers picks flash-linear-attention (FLA) and causal-conv1d for the GDN layers of Qwen3.5,
Qwen3.5-MoE and Qwen3-Next on its own, without looking at the device:

* transformers 5.15+ ("new design") decorates the module functions ``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` and ``causal_conv1d_update``; the decorator calls
  FLA's / causal-conv1d's kernel whenever ``import fla`` / ``import causal_conv1d`` worked at import time, so a
  CPU-only box with FLA installed crashes inside FLA ("0 active drivers"). From 5.25 the decorator calls the
  package only for tensors on a device it serves (its ``supported_devices``; FLA: cuda, xpu, mlu, npu) and the
  torch function for others, and with the ``kernels`` package (which 5.25 requires) each decorated function is a
  ``Func`` module around the decorator's wrapper (``held_function`` finds the wrapper).
* transformers 5.2-5.14 ("old design", the modeling module defines ``is_fast_path_available``) binds module
  globals (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``causal_conv1d_fn``,
  ``causal_conv1d_update``, ``FusedRMSNormGated``) at import when CUDA and the package are there, and every
  ``*GatedDeltaNet.__init__`` caches them on the instance (``self.chunk_gated_delta_rule`` ...,
  ``self.norm`` an FLA ``FusedRMSNormGated``); a model moved to CPU keeps calling FLA.

FLA can also refuse a call on CUDA: on Hopper with Triton >= 3.4, < 3.7.1 FLA 0.6 refuses the gated delta rule
backward (deltafuse's FLA candidate knows this, ``deltafuse.ops.gated_delta.candidates.fla_backward_known_bad``).

API:

* ``stock_choices(model)`` - what stock calls at each place the GDN layers look their ops up: ``"torch"`` for
  transformers' own pure-torch function, else the package whose kernel it calls (``"fla"``,
  ``"causal_conv1d"``, ...).
* ``stock_fast_path_problems(model, device, dtype, needs_grad=True)`` - for each place where stock's own
  choice cannot serve calls on ``device`` / ``dtype``, why; empty when stock can run as it is (the predicate).
* ``stock_torch_baseline(model, deltafuse_applied=...)`` - a context manager that puts transformers' own pure-torch functions at
  every place where stock chose another package (module globals in both designs; the instance attributes
  of ``model``'s GDN layers and the forward of their FLA gated norms in the old design), yields the list of
  what it swapped, and restores every object on exit.

Nothing here patches deltafuse in: it is what stock transformers does without FLA and causal-conv1d
installed. It refuses to run while deltafuse is applied (there is no stock to speak of then).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from unittest import mock

import torch

__all__ = ["Place", "held_function", "stock_choices", "stock_fast_path_problems", "stock_places",
           "stock_torch_baseline"]

TORCH = "torch"
# op names (deltafuse's, the FLA ones) of the places, for the usability check
CHUNK, RECURRENT, CONV, CONV_UPDATE, NORM = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                             "causal_conv1d_fn", "causal_conv1d_update", "rms_norm_gated")
# new design: module function -> op
NEW_GLOBALS = {"torch_chunk_gated_delta_rule": CHUNK, "torch_recurrent_gated_delta_rule": RECURRENT,
               "causal_conv1d_fn": CONV, "causal_conv1d_update": CONV_UPDATE}
# old design: module global -> op (stock sets it to None when the package is missing or there is no CUDA)
OLD_GLOBALS = {"chunk_gated_delta_rule": CHUNK, "fused_recurrent_gated_delta_rule": RECURRENT,
               "causal_conv1d_fn": CONV, "causal_conv1d_update": CONV_UPDATE, "FusedRMSNormGated": NORM}
# old design: GDN instance attribute -> (op, name of the module's pure-torch function, None = attribute None)
OLD_INSTANCE = {"chunk_gated_delta_rule": (CHUNK, "torch_chunk_gated_delta_rule"),
                "recurrent_gated_delta_rule": (RECURRENT, "torch_recurrent_gated_delta_rule"),
                "causal_conv1d_fn": (CONV, None),  # None: the layer runs its nn.Conv1d + SiLU (torch)
                "causal_conv1d_update": (CONV_UPDATE, "torch_causal_conv1d_update")}


@dataclass
class Place:
    """One place a GDN layer looks an op up: ``owner.attr`` (a modeling module or a layer instance)."""

    name: str  # e.g. "modeling_qwen3_5.torch_chunk_gated_delta_rule", "model.layers.0.linear_attn.norm.forward"
    op: str
    owner: Any
    attr: str
    choice: str  # "torch", or the package stock calls there ("fla", "causal_conv1d", ...)
    torch_value: Any  # what to put there for the pure-torch baseline
    # the device types on which stock calls ``choice`` there; on others its own wrapper calls the torch function
    # (transformers 5.25+); None: on every device
    devices: tuple[str, ...] | None = None


def _package(obj) -> str:
    """The top-level package an object (function, class, instance) comes from."""
    if obj is None:
        return TORCH
    module = getattr(obj, "__module__", None) or type(obj).__module__
    top = module.split(".")[0]
    return TORCH if top in ("transformers", "torch") else top


def _gdn_layers(model) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("GatedDeltaNet")
            and type(m).__module__.startswith("transformers.")]


def _modeling_modules(model) -> list[types.ModuleType]:
    seen, out = set(), []
    for _, layer in _gdn_layers(model):
        name = type(layer).__module__
        if name not in seen and name in sys.modules:
            seen.add(name)
            out.append(sys.modules[name])
    return out


def _short(module: types.ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


# --- new design ------------------------------------------------------------------------------------------
def held_function(obj) -> Callable | None:
    """The function a callable object without a name calls, from its class's ``forward`` closure: transformers
    5.25+ with the ``kernels`` package turns each decorated module function into such an object (a ``Func``
    module whose forward calls the decorator's wrapper); None for anything else."""
    if getattr(obj, "__qualname__", None) is not None:
        return None
    forward = vars(type(obj)).get("forward")
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(held) and getattr(held, "__qualname__", None):
            return held
    return None


def _new_design_choice(fn: Callable) -> tuple[str, Callable, tuple[str, ...] | None]:
    """(stock's choice, transformers' pure-torch function, the device types stock calls that choice on, None for
    all) for a decorated module function."""
    fn = held_function(fn) or fn
    torch_fn = inspect.unwrap(fn)
    if fn is torch_fn or getattr(fn, "__deltafuse_stock_torch__", False):  # (already) the torch function
        return TORCH, torch_fn, None
    # the decorator's wrapper keeps the implementation it picked at import in its closure (5.25+: also the device
    # types that implementation runs on; on any other its wrapper calls the torch function)
    layer = fn
    while layer is not None:
        try:
            nonlocals = inspect.getclosurevars(layer).nonlocals
        except (TypeError, ValueError):
            nonlocals = {}
        picked = nonlocals.get("implementation")
        if picked is not None:
            devices = nonlocals.get("supported_devices")
            devices = tuple(devices) if isinstance(devices, (tuple, list)) else None
            return (TORCH if picked is torch_fn else _package(picked)), torch_fn, devices
        layer = getattr(layer, "__wrapped__", None)
        if layer is torch_fn:
            break
    # an unknown wrapper: assume it may call something else than torch
    return f"unknown ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')})", torch_fn, None


def _torch_only(torch_fn: Callable, name: str) -> Callable:
    """transformers' pure-torch ``torch_fn`` called as the decorated function would call it: keyword arguments
    it does not take are dropped, and packed-sequence boundaries are refused (the torch functions cannot keep
    packed sequences apart; stock's own wrapper refuses them too)."""
    params = inspect.signature(torch_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(torch_fn)
    def call(*args, **kwargs):
        for key in ("cu_seqlens", "seq_idx"):
            if kwargs.get(key) is not None:
                raise ValueError(f"the stock pure-torch baseline of {name} got {key}: transformers' torch functions "
                                 "cannot keep packed sequences apart; run each sequence alone")
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_fn(*args, **kwargs)

    call.__deltafuse_stock_torch__ = True
    return call


# --- old design ------------------------------------------------------------------------------------------
def _torch_norm_class(module: types.ModuleType):
    """The modeling module's own pure-torch gated RMSNorm class (``*RMSNormGated``)."""
    for name, obj in vars(module).items():
        if name.endswith("RMSNormGated") and isinstance(obj, type) and obj.__module__ == module.__name__:
            return obj
    return None


def _torch_norm_forward(norm_cls, norm: torch.nn.Module) -> Callable:
    """A forward for an FLA ``FusedRMSNormGated`` instance that runs transformers' own torch gated norm on
    the instance's weight and eps."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    activation = getattr(norm, "activation", "silu")
    activation = "silu" if activation in ("swish", "silu") else activation

    def forward(hidden_states, gate=None, *args, **kwargs):
        view = types.SimpleNamespace(weight=norm.weight, variance_epsilon=eps, activation=activation)
        return norm_cls.forward(view, hidden_states, gate)

    forward.__deltafuse_stock_torch__ = True
    return forward


# --- the places ------------------------------------------------------------------------------------------
def stock_places(model) -> list[Place]:
    """Every place ``model``'s GDN layers look a hot op up, with stock's choice there and its torch value."""
    places: list[Place] = []
    for module in _modeling_modules(model):
        short = _short(module)
        if hasattr(module, "is_fast_path_available"):  # old design
            for attr, op in OLD_GLOBALS.items():
                if hasattr(module, attr):
                    places.append(Place(f"{short}.{attr}", op, module, attr, _package(getattr(module, attr)), None))
        else:
            for attr, op in NEW_GLOBALS.items():
                fn = getattr(module, attr, None)
                if fn is None:
                    continue
                choice, torch_fn, devices = _new_design_choice(fn)
                places.append(Place(f"{short}.{attr}", op, module, attr, choice, _torch_only(torch_fn, attr),
                                    devices))
    for path, layer in _gdn_layers(model):
        module = sys.modules.get(type(layer).__module__)
        if module is None or not hasattr(module, "is_fast_path_available"):
            continue
        for attr, (op, torch_name) in OLD_INSTANCE.items():
            if attr not in vars(layer):
                continue
            torch_value = None if torch_name is None else getattr(module, torch_name, None)
            if torch_name is not None and torch_value is None:
                continue
            places.append(Place(f"{path}.{attr}", op, layer, attr, _package(vars(layer)[attr]), torch_value))
        norm = getattr(layer, "norm", None)
        norm_cls = _torch_norm_class(module)
        if isinstance(norm, torch.nn.Module) and norm_cls is not None and not isinstance(norm, norm_cls):
            own = vars(norm).get("forward")
            choice = TORCH if getattr(own, "__deltafuse_stock_torch__", False) else _package(norm)
            places.append(Place(f"{path}.norm.forward", NORM, norm, "forward", choice,
                                _torch_norm_forward(norm_cls, norm)))
    return places


def stock_choices(model) -> dict[str, str]:
    """Place name -> what stock transformers calls there for ``model`` ("torch", "fla", "causal_conv1d" ...)."""
    return {p.name: p.choice for p in stock_places(model)}


def _place_problem(place: Place, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str | None:
    if place.choice == TORCH:
        return None
    if place.devices is not None and device.type not in place.devices:
        return None  # stock's own wrapper calls the torch function on this device (transformers 5.25+)
    if place.choice == "fla":
        from deltafuse.backends import REGISTRY
        from deltafuse.backends.registry import CallInfo

        call = CallInfo(device, dtype, needs_grad)
        op = place.op if place.op in (CHUNK, RECURRENT) else CHUNK  # FLA's norm: FLA's device rules
        fla = next((c for c in REGISTRY.candidates(op) if c.name == "fla"), None)
        if fla is not None:
            why = fla.supports(call) or (fla.known_bad(call) if place.op == op else None)
            if why:
                return why
            return None
    if device.type != "cuda":
        package = place.choice.replace("_", "-") if place.choice == "causal_conv1d" else place.choice
        return f"{package}'s kernels need a CUDA device; the tensors are on {device.type}"
    return None


def stock_fast_path_problems(model, device: str | torch.device, dtype: torch.dtype = torch.float32,
                             needs_grad: bool = True) -> dict[str, str]:
    """Place name -> why stock's own choice there cannot serve ``model``'s calls on ``device`` / ``dtype``
    (with a backward when ``needs_grad``). Empty: stock runs as it is."""
    device = torch.device(device)
    out = {}
    for place in stock_places(model):
        why = _place_problem(place, device, dtype, needs_grad)
        if why:
            out[place.name] = f"{place.choice}: {why}"
    return out


@contextlib.contextmanager
def stock_torch_baseline(model, *, deltafuse_applied: bool) -> Iterator[list[str]]:
    """Within the block, stock transformers runs ``model``'s GDN layers with its own pure-torch functions
    wherever it had picked another package; yields ``["place: package -> torch", ...]`` (empty when stock
    already ran pure torch everywhere) and restores every swapped object on exit. ``deltafuse_applied``: whether
    deltafuse is applied in this process (the caller, above the patcher, knows; then there is no stock to run)."""
    if deltafuse_applied:
        raise RuntimeError("stock_torch_baseline: deltafuse is applied in this process, so there is no stock to "
                           "run; call deltafuse.revert() first")
    swapped = []
    with contextlib.ExitStack() as stack:
        for place in stock_places(model):
            if place.choice == TORCH:
                continue
            stack.enter_context(mock.patch.object(place.owner, place.attr, place.torch_value))
            swapped.append(f"{place.name}: {place.choice} -> torch")
        yield swapped
