"""CUDA graphs of the decoder layers of a training step (``graph_layers``).

What is captured, and why it can be. Each decoder layer maps its hidden states to new ones; whatever else it reads
arrives in its call: the rotary cos / sin, the attention mask, the position ids and, for a packed batch, the
sequence boundaries (the ``Packing`` of ``boundaries.py``). Handed to a layer in their ``padded`` form (the offsets
as a device tensor of ``max_sequences`` + 1 entries, empty sequences after the real ones), the boundaries no longer
set any shape, and no op of the layer reads them on the host: the GDN chunk tables are then built on the device
(``chunk_launch.DevicePlan``) and long packed rows' attention runs ``varlen_attn`` on the device offsets (the
block-causal mask is then not passed at all). With constant-width rows (``deltafuse train`` fills every row to one
width) every step calls every layer with the same shapes, so each layer's forward and backward replay from CUDA
graphs: one launch each, instead of the host work of every kernel of the layer (on the full-depth Qwen3.5-35B-A3B
step the host took longer than the GPU; BENCHMARKS.md). The text model around the layers (embeddings, masks,
rotary), the final norm, the LM head and loss, and the optimizer stay eager.

How. The layers run eagerly for ``warmup`` training calls of the first layer (Triton compilation, autotuning, the
experts' one-time probes); each layer's last eligible call is kept as its template. At the next training call of
the first layer every layer is captured at once with ``torch.cuda.make_graphed_callables`` (forwards in layer order,
backwards in reverse: the order of a step, sharing one memory pool), each on random hidden states shaped as its
template's and on copies of the template's other inputs, under the call's autocast state (its cache off, which
capture needs). From then on a layer's call replays its graphs when it matches what was captured; anything else
runs eagerly and stays correct:

* other shapes, dtypes, devices or ``requires_grad`` of its tensors, other values of its other arguments, an
  argument a graph cannot take (a cache, an object), another autocast state; grad mode off, the layer in eval mode,
  dynamo tracing, or a stream capture already in progress;
* a packed batch of more sequences than ``max_sequences``, or boundaries the host does not hold (derived inside a
  compiled graph);
* a second forward of a layer before the backward of its previous replay (two forwards, then one backward over
  both): a replay would overwrite the saved activations that backward reads. A replay whose outputs were freed
  without a backward no longer counts.

``max_sequences`` (default: twice the most sequences a warm-up batch held, as a power of two, at least 8) sets the
room of the padded offsets: every GDN layer then launches its chunk kernels for (T + 63 N) / 64 chunks with
N = ``max_sequences``, the rows past the real chunks returning at once. If the capture itself fails, one warning
names the error and every layer stays eager (the run goes on).

Unsafe set-ups are refused in one line before anything is captured (``GraphError``): a model not on CUDA, gradient
checkpointing (its recompute replays forwards during the backward, out of the pool's order), module hooks in a
layer (accelerate's offloading, FSDP: what they do would not run in a replay), router logits recorded for an
auxiliary loss (by hooks inside the layers), or layers already graphed.
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import dataclass

import torch

from deltafuse.integrations.transformers.adapters_fused import padded_rows_use_varlen
from deltafuse.integrations.transformers.boundaries import Packing
from deltafuse.integrations.transformers.packing import PACKING_KWARG

logger = logging.getLogger("deltafuse")

__all__ = ["GraphError", "GraphedLayers", "decoder_layers", "graph_layers"]

# Loss keywords that transformers passes down through the layers' **kwargs and no layer reads: left out of the
# graphed call (an int that changes every step would otherwise stop every replay).
UNREAD_KWARGS = ("num_items_in_batch",)
# Plain values a graphed call may carry as they are (they must then equal the captured call's).
_LITERALS = (type(None), bool, int, float, str)


class GraphError(ValueError):
    """A set-up in which capturing the layers would not be safe (one line: what, the value, what is allowed)."""


def _pretrained(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost transformers model inside ``model`` (PEFT and other wrappers hold it as a submodule): the
    first module with a config and transformers' checkpointing switch; ``model`` itself when there is none."""
    if not isinstance(model, torch.nn.Module):
        raise GraphError(f"graph_layers: model is a {type(model).__name__}; allowed: a torch.nn.Module (a Qwen3.5, "
                         "Qwen3.5-MoE or Qwen3-Next model, or a wrapper of one)")
    for module in model.modules():
        if hasattr(module, "config") and hasattr(type(module), "gradient_checkpointing_enable"):
            return module
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` (its text model's ``layers``), in the order a forward calls them."""
    for module in _pretrained(model).modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers):
            return list(layers)
    raise GraphError(f"graph_layers: {type(model).__name__} has no decoder layers (a 'layers' ModuleList); allowed: "
                     "a Qwen3.5, Qwen3.5-MoE or Qwen3-Next model")


def _checkpointing(base) -> bool:
    """Whether activation checkpointing is on (the attribute's name depends on the transformers version)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated on newer releases
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(type(base), name) or hasattr(base, name):
                return bool(getattr(base, name))
    return False


def check_model(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """Refuses (``GraphError``, one line) a model whose layers cannot be captured safely."""
    base = _pretrained(model)
    if _checkpointing(base):
        raise GraphError("graph_layers: gradient checkpointing is on; its recompute replays forwards during the "
                         "backward, out of the order the captured graphs share memory in; allowed: checkpointing "
                         "off (model.gradient_checkpointing_disable()), or no CUDA graphs")
    config = getattr(base, "config", None)
    text = getattr(config, "text_config", None) or config
    if getattr(text, "output_router_logits", False):
        raise GraphError("graph_layers: config.output_router_logits=True (the router logits of an auxiliary loss "
                         "are recorded by hooks inside the layers, which a replay skips); allowed: False")
    for i, layer in enumerate(layers):
        if "forward" in vars(layer):
            raise GraphError(f"graph_layers: decoder layer {i} has its own forward already "
                             f"({getattr(vars(layer)['forward'], '__qualname__', '?')}: graphed, or replaced by "
                             "another library); allowed: layers with their class's forward")
        hooked = [name or "the layer" for name, m in layer.named_modules()
                  if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or hasattr(m, "_hf_hook")]
        if hooked:
            raise GraphError(f"graph_layers: decoder layer {i} has module hooks on {hooked[:3]} (offloading, FSDP "
                             "or another library's), which a replay would not run; allowed: layers without module "
                             "hooks")
    device = next((p.device for p in layers[0].parameters()), None)
    if device is None or device.type != "cuda":
        raise GraphError(f"graph_layers: the model's layers are on {device}; allowed: a model on a CUDA device "
                         "(CUDA graphs)")


def _autocast_state() -> tuple:
    if torch.is_autocast_enabled("cuda"):
        return (True, torch.get_autocast_dtype("cuda"))
    return (False, None)


# --- a call as a graph's inputs ---------------------------------------------------------------------------------
class _Unfit(Exception):
    """A call a graph cannot take (the reason is its message); it runs eagerly."""


@dataclass
class _Call:
    """One layer call taken apart: ``tensors`` (the hidden states first) and ``spec``, which says how to put the
    call back together from them (hashable: literals, names, tensor indices, and for a Packing its form)."""
    tensors: list
    spec: tuple
    packing: Packing | None  # the call's eager Packing (its padded form is made with the room decided)
    grads: tuple = ()  # a template's: the requires_grad of the tensors it was kept from

    def key(self) -> tuple:
        return (self.spec, tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in self.tensors),
                _autocast_state())

    def kept(self) -> "_Call":
        """This call as a template: its tensors detached (the hidden states as one element of their shape: only
        their shape, dtype and device are read), their ``requires_grad`` kept in ``grads``. A template holds no
        autograd history: a warm-up step's graph kept alive would keep the parameters' gradient accumulators of
        that step, whose stream (the default one) a capture on another stream must not wait on."""
        first = self.tensors[0]
        hidden = torch.empty((), dtype=first.dtype, device=first.device).expand(first.shape)
        return _Call([hidden, *(t.detach() for t in self.tensors[1:])], self.spec, self.packing,
                     tuple(t.requires_grad for t in self.tensors))


def _take_apart(args: tuple, kwargs: dict, pad) -> _Call:
    """The call ``(args, kwargs)`` of a layer as a ``_Call``; ``pad(packing)`` gives a Packing's padded form (or
    raises ``_Unfit``). Raises ``_Unfit`` for what a graph cannot take."""
    tensors: list = []

    def tensor(t):
        tensors.append(t)
        return ("t", len(tensors) - 1)

    def part(value):
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, _LITERALS):
            return ("v", value)
        if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
            return ("s", type(value).__name__, tuple(tensor(v) for v in value))
        raise _Unfit(f"an argument of type {type(value).__name__}")

    if not args or not isinstance(args[0], torch.Tensor):
        raise _Unfit("no hidden-states tensor first")
    spec_args = tuple(part(a) for a in args)
    packing = kwargs.get(PACKING_KWARG)
    padded = None
    if packing is not None:
        if not isinstance(packing, Packing):
            raise _Unfit(f"{PACKING_KWARG} of type {type(packing).__name__}")
        padded = pad(packing)
    drop_mask = padded is not None and padded_rows_use_varlen(padded, args[0].device)
    spec_kwargs = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if name in UNREAD_KWARGS:
            continue
        if name == PACKING_KWARG:
            spec_kwargs.append((name, ("p", tensor(padded.seq_idx), tensor(padded.cu_seqlens), padded.batch,
                                       padded.length, padded.block_causal)))
        elif name == "attention_mask" and drop_mask:
            # the block-causal mask transformers built from the restarting positions: varlen_attn on the padded
            # offsets replaces it in every full-attention layer (and a linear-attention layer gets none then)
            spec_kwargs.append((name, ("v", None)))
        else:
            spec_kwargs.append((name, part(value)))
    return _Call(tensors, (spec_args, tuple(spec_kwargs)), packing)


def _put_together(spec: tuple, tensors) -> tuple[tuple, dict]:
    """The (args, kwargs) that ``spec`` describes, from ``tensors``."""
    def value(p):
        kind = p[0]
        if kind == "t":
            return tensors[p[1]]
        if kind == "v":
            return p[1]
        if kind == "s":
            seq = [tensors[q[1]] for q in p[2]]
            return tuple(seq) if p[1] == "tuple" else seq
        _, si, ci, batch, length, block_causal = p  # a padded Packing
        return Packing(tensors[si[1]], tensors[ci[1]], batch, length, None, block_causal, padded=True)

    spec_args, spec_kwargs = spec
    return tuple(value(p) for p in spec_args), {name: value(p) for name, p in spec_kwargs}


def _end_failed_capture(device: torch.device) -> None:
    """After a capture that failed: one small capture that succeeds. A failed capture leaves the CUDA random
    generators in their capturing state (torch ends it only when a capture ends well), and every later use of
    them, eager ones too (dropout, initialisation), then raises."""
    if device.type != "cuda":
        return
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph):
            torch.empty(1, device=device).zero_()
        del graph
    except Exception as exc:  # pragma: no cover - reported, the run goes on
        logger.warning("deltafuse: could not end the failed capture cleanly (%s: %s)", type(exc).__name__, exc)


class _LayerCall(torch.nn.Module):
    """A decoder layer as a callable of tensors alone (what ``make_graphed_callables`` takes): the call of ``spec``
    rebuilt from them, through the layer's class forward. The layer is its submodule, so its parameters are the
    graph's too (the trainable ones get their gradients from the backward graph)."""

    def __init__(self, layer: torch.nn.Module, spec: tuple):
        super().__init__()
        self.layer = layer
        self.spec = spec

    def forward(self, *tensors):
        args, kwargs = _put_together(self.spec, tensors)
        return type(self.layer).forward(self.layer, *args, **kwargs)


# --- the layers' dispatch ---------------------------------------------------------------------------------------
class GraphedLayers:
    """The decoder layers of one model, graphed after ``warmup`` training calls (see the module docstring).
    ``remove()`` puts their class forwards back and frees the graphs."""

    def __init__(self, layers: list[torch.nn.Module], warmup: int = 2, max_sequences: int | None = None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise GraphError(f"graph_layers: warmup={warmup!r}; allowed: an int >= 1 (eager training calls before "
                             "the capture)")
        if max_sequences is not None and (isinstance(max_sequences, bool) or not isinstance(max_sequences, int)
                                          or max_sequences < 1):
            raise GraphError(f"graph_layers: max_sequences={max_sequences!r}; allowed: None (from the warm-up "
                             "batches) or an int >= 1 (the most sequences of a packed row)")
        self.layers = list(layers)
        self.warmup = warmup
        self.max_sequences = max_sequences  # the padded offsets' room once captured (None: decided then)
        self.calls = 0  # eager training calls of the first layer before the capture
        self.most_sequences = 0  # the most sequences of a packed batch the warm-up calls held
        self.templates: list[_Call | None] = [None] * len(self.layers)
        self.graphed: list | None = None  # the replaying callables, once captured
        self._wrappers: list = []  # the captured _LayerCall modules (remove() takes their graphed forwards off)
        self.keys: list | None = None  # what each layer's graphs were captured for
        self.failed: str | None = None  # why the capture failed (every layer then stays eager)
        self.replays = 0  # graphed calls so far (all layers)
        self.eager_after_capture = 0  # calls that ran eagerly once the graphs existed
        self.eager_reasons: dict[str, int] = {}  # why, counted (the first few reasons)
        self._pending = [None] * len(self.layers)  # weakref to a replay's output awaiting its backward
        self._padded: tuple = (None, None)  # (the Packing of the step in progress, its padded form)
        self.restore: list = []  # (config, use_cache) that remove() puts back
        for i, layer in enumerate(self.layers):
            layer.forward = self._forward_of(i, layer)

    def _forward_of(self, i: int, layer: torch.nn.Module):
        def original(*args, **kwargs):  # the class's forward as it is at call time (patches come and go)
            return type(layer).forward(layer, *args, **kwargs)

        def forward(*args, **kwargs):
            if self.failed is not None:  # no graphs this run: the layer as it is, nothing taken apart
                return original(*args, **kwargs)
            if not (args and self._eligible(layer, args[0])):
                return self._eager(original, args, kwargs, "not a training call")
            try:
                call = _take_apart(args, kwargs, self._pad)
            except _Unfit as exc:
                return self._eager(original, args, kwargs, str(exc))
            if self.graphed is None:
                self.templates[i] = call.kept()
                if i == 0:
                    self.calls += 1
                    if self.calls > self.warmup:
                        self._capture()
                if self.graphed is None:
                    return original(*args, **kwargs)
                try:  # captured just now: this call again, its boundaries padded to the room decided
                    call = _take_apart(args, kwargs, self._pad)
                except _Unfit as exc:
                    return self._eager(original, args, kwargs, str(exc))
            if call.key() != self.keys[i]:
                return self._eager(original, args, kwargs, "inputs other than the captured ones")
            if self._waiting(i):
                return self._eager(original, args, kwargs, "a second forward before the backward")
            out = self.graphed[i](*call.tensors)
            self.replays += 1
            self._track(i, out)
            return out

        forward.__deltafuse_graphed__ = True
        forward.__wrapped__ = original
        return forward

    def _eager(self, original, args, kwargs, why: str):
        if self.graphed is not None:
            self.eager_after_capture += 1
            if why in self.eager_reasons or len(self.eager_reasons) < 8:
                self.eager_reasons[why] = self.eager_reasons.get(why, 0) + 1
        return original(*args, **kwargs)

    @staticmethod
    def _eligible(layer, x) -> bool:
        return (isinstance(x, torch.Tensor) and layer.training and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing()))

    def _pad(self, packing: Packing) -> Packing:
        """The padded form of the step's Packing (made once for all its layers), or ``_Unfit``. While warming up it
        has room for just its own sequences (the templates' are made again with the capacity at the capture)."""
        if self._padded[0] is packing:
            return self._padded[1]
        if packing.offsets is None or packing.context is not None:
            raise _Unfit("boundaries the host does not hold" if packing.offsets is None else "context parallelism")
        n = packing.num_sequences
        if self.graphed is None:
            self.most_sequences = max(self.most_sequences, n)
            room = n
        elif n > self.max_sequences:
            raise _Unfit(f"more sequences than max_sequences={self.max_sequences}")
        else:
            room = self.max_sequences
        padded = packing.padded_to(room)
        self._padded = (packing, padded)
        return padded

    def _waiting(self, i: int) -> bool:
        """Whether layer i's previous replay still awaits its backward: the replay's autograd node is alive (its
        graph can still run the backward) and has not run yet."""
        ref = self._pending[i]
        if ref is None:
            return False
        if ref() is None:  # the graph was freed without a backward
            self._pending[i] = None
            return False
        return True

    def _track(self, i: int, out) -> None:
        """Marks layer i's replay as awaiting its backward until the replay's autograd node runs (a pre-hook on the
        node; it lives as long as the graph that can run it)."""
        first = out if isinstance(out, torch.Tensor) else next(
            (t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
        node = None if first is None else first.grad_fn
        if node is None:
            return
        try:
            self._pending[i] = weakref.ref(node)
        except TypeError:  # a node that cannot be referred to weakly: nothing to track it by
            return

        def ran(grad_outputs, i=i):
            self._pending[i] = None

        node.register_prehook(ran)

    # -- the capture -----------------------------------------------------------------------------------------
    def _capture(self) -> None:
        missing = [i for i, t in enumerate(self.templates) if t is None]
        if missing:
            self._fail(f"decoder layers {missing[:4]} had no training call a graph can take")
            return
        if self.max_sequences is None:
            most = max(self.most_sequences, 1)
            self.max_sequences = max(8, 1 << (2 * most - 1).bit_length())
        self._padded = (None, None)
        try:
            calls = [_take_apart(*self._template_call(t), self._pad_template) for t in self.templates]
        except _Unfit as exc:
            self._fail(str(exc))
            return
        wrappers = [_LayerCall(layer, call.spec) for layer, call in zip(self.layers, calls)]
        samples = []
        for call in calls:
            hidden = call.tensors[0]
            first = torch.randn(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            samples.append((first.requires_grad_(hidden.requires_grad),
                            *(t.detach().clone().requires_grad_(t.requires_grad) for t in call.tensors[1:])))
        enabled, dtype = _autocast_state()
        # Python's cycle collector must not run inside the capture. On the H200 (transformers 5.24, tiny-moe LoRA
        # steps, a new graphed model each round in one process) 26 of 178 captures failed with "operation failed due
        # to a previous error during capture", in runs of every third capture as the collector's counters came
        # round: what a collection frees there (the dropped graphed models of earlier rounds, which torch's
        # make_graphed_callables leaves in reference cycles, their CUDA graphs and memory with them) presumably
        # makes CUDA calls a capture forbids. With the garbage collected first and the collector held off until the
        # capture is over, 124 of 124 succeeded.
        gc.collect()
        torch.cuda.empty_cache()  # the eager steps' cached blocks, for the graphs' own pool
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=enabled, cache_enabled=False):
                torch.cuda.make_graphed_callables(tuple(wrappers), tuple(samples), num_warmup_iters=3,
                                                  allow_unused_input=True)
        except Exception as exc:  # the run goes on eagerly: nothing is lost, one warning says why
            _end_failed_capture(calls[0].tensors[0].device)
            self._fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return
        finally:
            if collecting:
                gc.enable()
        self.graphed = [w.forward for w in wrappers]
        self._wrappers = wrappers
        self.keys = [c.key() for c in calls]
        self.templates = [None] * len(self.layers)  # nothing of the warm-up steps is kept
        logger.info("deltafuse: captured CUDA graphs of %d decoder layers for hidden states %s, %d sequences at "
                    "most per packed batch", len(self.layers), tuple(calls[0].tensors[0].shape), self.max_sequences)

    @staticmethod
    def _template_call(template: _Call) -> tuple[tuple, dict]:
        """A template's call (its tensors as they required gradients, detached) with its eager Packing back in
        place of the padded one made while warming up."""
        tensors = [t.detach().requires_grad_(g) if g else t for t, g in zip(template.tensors, template.grads)]
        args, kwargs = _put_together(template.spec, tensors)
        if template.packing is not None:
            kwargs[PACKING_KWARG] = template.packing
        return args, kwargs

    def _pad_template(self, packing: Packing) -> Packing:
        if packing.num_sequences > self.max_sequences:
            raise _Unfit(f"the last warm-up batch holds {packing.num_sequences} sequences, more than "
                         f"max_sequences={self.max_sequences}")
        return packing.padded_to(self.max_sequences)

    def _fail(self, why: str) -> None:
        self.failed = why
        self.templates = [None] * len(self.layers)
        logger.warning("deltafuse: capturing CUDA graphs of the decoder layers failed (%s); they run eagerly", why)

    def remove(self) -> None:
        """The class forwards back on every layer; the graphs (and their memory pool) are freed as soon as nothing
        else holds the layers. torch's make_graphed_callables gives each captured module a forward that refers to
        the module itself, a reference cycle that only the cycle collector would free (the layer, its graphs and
        their static buffers with it); those forwards are taken off here."""
        for layer in self.layers:
            fwd = vars(layer).get("forward")
            if getattr(fwd, "__deltafuse_graphed__", False):
                del layer.forward
        for wrapper in self._wrappers:
            vars(wrapper).pop("forward", None)
        self._wrappers = []
        self.graphed = None
        self.templates = [None] * len(self.layers)
        self._pending = [None] * len(self.layers)
        self._padded = (None, None)
        for cfg, value in self.restore:
            cfg.use_cache = value
        self.restore = []

    def summary(self) -> str:
        """One line: captured or not, replays, eager calls since and why."""
        n = len(self.layers)
        if self.failed:
            return f"CUDA graphs: capture failed ({self.failed}); {n} decoder layers eager"
        if self.keys is None:
            return f"CUDA graphs: {n} decoder layers not captured yet ({self.calls} of {self.warmup} warm-up calls)"
        why = "; ".join(f"{k}: {v}" for k, v in self.eager_reasons.items())
        return (f"CUDA graphs: {n} decoder layers captured for {tuple(self.keys[0][1][0][0])} "
                f"(max_sequences={self.max_sequences}); {self.replays} replays, {self.eager_after_capture} eager "
                f"calls since" + (f" ({why})" if why else ""))


def graph_layers(model: torch.nn.Module, *, warmup: int = 2, max_sequences: int | None = None) -> GraphedLayers:
    """Graphs the decoder layers of ``model`` for training (module docstring): checked now (``GraphError`` in one
    line), captured at the first training call after ``warmup`` eager ones. ``max_sequences``: the most sequences a
    packed row may hold to replay (None: from the warm-up batches). The model's ``use_cache`` is off meanwhile (a
    training step has no use for a cache, and a replay could not update one: a call with one runs eagerly).
    Returns the controller; ``.remove()`` undoes it all."""
    layers = decoder_layers(model)
    check_model(model, layers)
    graphs = GraphedLayers(layers, warmup, max_sequences)
    config = getattr(_pretrained(model), "config", None)
    for cfg in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
        if getattr(cfg, "use_cache", None):
            graphs.restore.append((cfg, cfg.use_cache))
            cfg.use_cache = False
    return graphs
