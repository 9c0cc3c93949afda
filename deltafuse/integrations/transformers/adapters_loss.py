"""The causal-LM loss route: ``*ForCausalLM.forward`` with ``ops.fused_linear_cross_entropy`` on the hidden states.

``wrap_causal_lm_forward`` builds the replacement forward (no [tokens, vocab] logits); ``fused_head`` /
``head_weight`` say which output embeddings the fused loss computes exactly (plain ``nn.Linear``, plain LoRA
around one, either possibly an FSDP2 module), ``fused_loss_blocker`` why a call takes the stock path. The
keywords of Liger's protocol (``SKIP_LOGITS_KWARG``, ``ACCURACY_KWARG`` ...) are removed before the stock
forward runs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from deltafuse import ops
from deltafuse.ops._checks import plain_tensor
from deltafuse.integrations.transformers.call_args import call_signature, mark_wrapper

# Keywords a patched ``*ForCausalLM.forward`` takes (Liger's protocol, and deltafuse's older alias):
# skip_logits=False (or deltafuse_logits=True) returns the logits with the loss, skip_logits=True skips them,
# return_token_accuracy=True adds ``token_accuracy`` (ACCURACY_FIELD) to the output.
SKIP_LOGITS_KWARG = "skip_logits"
LOGITS_KWARG = "deltafuse_logits"
ACCURACY_KWARG = "return_token_accuracy"
ACCURACY_FIELD = "token_accuracy"


def head_weight(head):
    """(weight, bias) the fused loss can use for ``lm_head``, or None when only the stock path is exact.

    A plain ``nn.Linear`` (a tied input embedding included): its parameters. A PEFT LoRA ``Linear`` around a
    plain ``nn.Linear``: the effective weight W + sum of the active adapters' delta (B @ A * scaling), built on
    every call so autograd reaches A and B (a [V, H] temporary, far below stock's [tokens, V] logits; never
    cached). None for LoRA dropout, DoRA and other LoRA variants, LoRA bias, merged or disabled adapters,
    fan_in_fan_out, any other wrapper (``modules_to_save`` ...), and a head with hooks or an instance
    ``forward`` (accelerate offloading, tensor parallelism), whose weight may not be the one the head uses.

    FSDP2: a head that is itself a ``fully_shard`` module (its only hooks FSDP's) qualifies (``fused_head``),
    but its parameters are whole only during its own call: there the weight is this function's answer; outside
    the call it would be built from the sharded parameters (``wrap_causal_lm_forward`` computes the loss inside
    the head's call).
    """
    return _effective_weight(head) if fused_head(head) else None


def fused_head(head) -> bool:
    """True when the fused loss computes ``head``'s logits exactly (the rules of ``head_weight``), judged from
    its structure alone (no weight is built): a plain ``nn.Linear`` or plain LoRA around one, which may itself
    be an FSDP2 module (``fully_shard``: a plain ``nn.Linear`` underneath, FSDP's own hooks only)."""
    if _hooked(head, allow_fsdp=True):
        return False
    if _unsharded_type(head) is torch.nn.Linear:
        return True
    base = getattr(head, "base_layer", None)
    if type(base) is not torch.nn.Linear or _hooked(base) or not hasattr(head, "get_delta_weight") \
            or not hasattr(head, "lora_A") or getattr(head, "merged", False) \
            or getattr(head, "disable_adapters", False) or getattr(head, "fan_in_fan_out", False):
        return False
    for a in _active_adapters(head):
        if type(head.lora_dropout[a]) is not torch.nn.Identity or getattr(head, "use_dora", {}).get(a) \
                or getattr(head, "lora_bias", {}).get(a) or a in getattr(head, "lora_variant", {}) \
                or type(head.lora_A[a]) is not torch.nn.Linear or type(head.lora_B[a]) is not torch.nn.Linear \
                or _hooked(head.lora_A[a]) or _hooked(head.lora_B[a]):
            return False
    return True


def _active_adapters(head) -> list:
    return [a for a in head.active_adapters if a in head.lora_A]


def _effective_weight(head):
    """(weight, bias) of a head ``fused_head`` accepts, built from its current parameters."""
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight, head.bias
    weight = base.weight
    for a in _active_adapters(head):
        weight = weight + head.get_delta_weight(a).to(weight.dtype)
    return weight, base.bias


def _head_rows(head) -> int:
    """The head's output size (the vocabulary): the global one for FSDP2-sharded parameters."""
    return getattr(head, "base_layer", head).weight.shape[0]


@functools.lru_cache(maxsize=None)
def _fsdp():
    """(FSDPModule, the FSDPState hook functions) of torch's FSDP2, or None where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return None
    return FSDPModule, tuple(inspect.unwrap(f) for f in (FSDPState._pre_forward, FSDPState._post_forward))


def _unsharded_type(module) -> type:
    """The module's class, looking through the class FSDP2 swaps in (``FSDP<cls>``, bases (FSDPModule, cls))."""
    cls, fsdp = type(module), _fsdp()
    if fsdp is not None and isinstance(module, fsdp[0]) and len(cls.__bases__) == 2 and cls.__bases__[0] is fsdp[0]:
        return cls.__bases__[1]
    return cls


def _hooked(module, allow_fsdp: bool = False) -> bool:
    """The module has forward hooks or an instance ``forward`` (with ``allow_fsdp``: other than the forward
    hooks of FSDP2 on an FSDP2 module, which gather its parameters around each call)."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    if "forward" in vars(module):
        return True
    fsdp = _fsdp() if allow_fsdp and hooks else None
    if fsdp is not None and isinstance(module, fsdp[0]):
        return not all(any(inspect.unwrap(hook) is f for f in fsdp[1]) for hook in hooks)
    return bool(hooks)


@functools.lru_cache(maxsize=None)
def _stock_causal_lm_loss():
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING

        return LOSS_MAPPING.get("ForCausalLM")
    except ImportError:
        return None


def fused_loss_blocker(model, kwargs: dict, skip_logits: bool | None = None) -> str | None:
    """Why a ``*ForCausalLM`` call must take the stock path (None: the fused loss computes it exactly).

    ``skip_logits``: the caller's ``skip_logits`` (None: not given; True: skip even without gradients or with
    ``return_dict=False``; False: logits wanted)."""
    labels = kwargs.get("labels")
    if labels is None:
        return "no labels"
    if not isinstance(labels, torch.Tensor):
        return "labels are not a tensor"
    if skip_logits is False:
        return f"the caller asked for logits ({SKIP_LOGITS_KWARG}=False or {LOGITS_KWARG}=True)"
    if skip_logits is None and not torch.is_grad_enabled():
        return "gradients are off (evaluation: logits are returned)"
    if skip_logits is None and kwargs.get("return_dict") is False:
        return f"return_dict=False (the tuple keeps stock's logits; {SKIP_LOGITS_KWARG}=True skips them)"
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep != 0:
        return f"logits_to_keep={keep!r}"
    if "_loss_function" in vars(model) or model.loss_function is not _stock_causal_lm_loss():
        return "the model has a custom loss function"
    if torch.compiler.is_compiling() and _TORCH < (2, 13):
        # the fused route lends the head an instance forward for one call; torch < 2.13's dynamo traces the
        # class forward instead, and would hand the logits to the fused loss as hidden states
        return "torch.compile on torch < 2.13 (the fused loss needs torch >= 2.13 inside a compiled graph)"
    return None


_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _flag(name: str, value, allow_none: bool):
    if value is None and allow_none or isinstance(value, bool):
        return value
    allowed = "True, False or None (the default)" if allow_none else "True or False"
    raise ValueError(f"{name}={value!r}; allowed: {allowed}")


def _skip_logits(kwargs: dict) -> bool | None:
    """The caller's ``skip_logits`` (None when not given), with ``deltafuse_logits=True`` as an alias of
    ``skip_logits=False``; both keywords are removed from kwargs."""
    skip = _flag(SKIP_LOGITS_KWARG, kwargs.pop(SKIP_LOGITS_KWARG, None), allow_none=True)
    want = _flag(LOGITS_KWARG, kwargs.pop(LOGITS_KWARG, False), allow_none=False)
    if want and skip:
        raise ValueError(f"{LOGITS_KWARG}=True asks for logits and {SKIP_LOGITS_KWARG}=True skips them; "
                         "pass one of them")
    return False if want else skip


def token_accuracy_from_logits(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels, ignore_index: int):
    """Fraction of counted targets (not ``ignore_index``) whose logits' argmax is the target, with stock's
    causal shift unless ``shift_labels`` is given (fp32, no gradient, NaN when every target is ignored)."""
    with torch.no_grad():
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.to(logits.device)
        valid = targets != ignore_index
        hits = ((logits.argmax(-1) == targets) & valid).sum()
        return hits.to(torch.float32) / valid.sum().to(torch.float32)


def _as_tuple(out, keep_logits_slot: bool) -> tuple:
    """``out.to_tuple()`` (the set fields in declaration order, then ``token_accuracy``), with a None where the
    logits go when ``keep_logits_slot``: positional readers find every other field where stock puts it."""
    names = [f.name for f in dataclasses.fields(out)] + [k for k in out.keys() if k == ACCURACY_FIELD]
    return tuple(out.get(n) for n in names if out.get(n) is not None or (keep_logits_slot and n == "logits"))


def positional_names(signature: inspect.Signature) -> list[str]:
    """The parameters of a forward's ``signature`` that a call may pass by position, ``self`` excluded."""
    return [p.name for p in list(signature.parameters.values())[1:]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def wrap_causal_lm_forward(original):
    """``*ForCausalLM.forward`` whose loss is ``ops.fused_linear_cross_entropy``: no [tokens, vocab] logits.

    The fused path runs when labels are given, gradients are on, ``logits_to_keep`` is 0, the model uses the
    stock causal-LM loss and the head is a plain ``nn.Linear`` or a plain LoRA around one, either of them
    possibly an FSDP2 module (``fused_head``). It calls the stock forward with ``labels=None`` while the head
    computes the loss instead of the logits (an instance ``forward`` on the head for this call only, taking the
    stock keywords ``num_items_in_batch``, ``ignore_index``, ``shift_labels``), so the "logits" the stock
    forward returns are the loss; then adds ``router_aux_loss_coef * aux_loss`` when the model returns a router
    aux loss, as stock does. The output is the stock output class with ``logits=None``. Computing the loss
    inside the head's call is what keeps FSDP2 exact and cheap: its hooks gather the weight once, as for
    stock's call, and the loss's backward finds it gathered again. (A head whose weight is a tensor subclass
    during its call, e.g. a DTensor under FSDP2 with tensor parallelism, computes stock's logits and loss.)
    The instance ``forward`` lives on the head for the duration of the call: two threads running the same
    model object at once are not supported.

    Keywords (Liger's protocol), removed before the stock forward runs:

    * ``skip_logits``: None (default) skips the logits exactly when the fused path can serve the call and
      ``return_dict`` is not False; True also skips them without gradients and with ``return_dict=False``
      (the tuple then has None in the logits slot); False returns logits as stock (the stock loss path).
      ``deltafuse_logits=True`` is an alias of ``skip_logits=False``.
    * ``return_token_accuracy=True`` adds ``token_accuracy`` to the output (last in a tuple): the fraction of
      counted target tokens whose argmax prediction is the label, computed inside the fused loss (or from
      the logits on the stock path). Needs labels and ``logits_to_keep=0``.

    Logits: whoever needs them gets the stock path, which returns them (with their gradient): every call
    without gradients (evaluation, generation), without labels, with ``logits_to_keep`` != 0, with
    ``return_dict=False``, and with ``skip_logits=False`` -- unless ``skip_logits=True`` says otherwise.
    """
    signature = call_signature(original)
    positional = positional_names(signature)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip = _skip_logits(kwargs)
        accuracy = _flag(ACCURACY_KWARG, kwargs.pop(ACCURACY_KWARG, False), allow_none=False)
        if args:
            if len(args) > len(positional) or any(n in kwargs for n in positional[:len(args)]):
                return original(self, *args, **kwargs)  # let the stock forward report the bad call
            kwargs = {**dict(zip(positional, args)), **kwargs}
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        if (skip or accuracy) and not has_labels:
            raise ValueError(f"{SKIP_LOGITS_KWARG if skip else ACCURACY_KWARG}=True needs labels (or shift_labels); "
                             "got none")
        keep = kwargs.get("logits_to_keep", 0)
        if accuracy and (isinstance(keep, bool) or not isinstance(keep, int) or keep != 0):
            raise ValueError(f"{ACCURACY_KWARG}=True needs the logits of every position; got "
                             f"logits_to_keep={keep!r} (allowed: 0)")
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        head = None
        if fused_loss_blocker(self, {**kwargs, "return_dict": return_dict}, skip) is None:
            head = self.get_output_embeddings()
            vocab = getattr(self.config, "vocab_size", None)
            if head is not None and (not fused_head(head) or _head_rows(head) != vocab):
                head = None
        if head is None:  # the stock path
            if not accuracy:
                return original(self, **kwargs)
            out = original(self, **{**kwargs, "return_dict": True})
            out[ACCURACY_FIELD] = token_accuracy_from_logits(out.logits, kwargs.get("labels"),
                                                             kwargs.get("shift_labels"),
                                                             kwargs.get("ignore_index", -100))
            return out if return_dict else _as_tuple(out, keep_logits_slot=False)
        labels = kwargs.pop("labels")
        kwargs.pop("return_dict", None)
        shift_labels = kwargs.get("shift_labels")
        call = {}

        def loss_forward(hidden):
            """The head's forward for this call: the loss instead of the logits."""
            if call:
                raise RuntimeError(f"{type(self).__name__}.forward called its output embeddings twice; the fused "
                                   "loss expects one call (deltafuse's causal-LM route does not serve this model)")
            weight, bias = _effective_weight(head)
            if not plain_tensor(weight) or bias is not None and not plain_tensor(bias):
                # a tensor subclass (DTensor: FSDP2 with tensor parallelism, an embedding sharded elsewhere):
                # the head computes its logits as stock does, and the stock loss follows
                call["logits"] = True
                return type(head).forward(head, hidden)
            call["fused"] = True
            loss = ops.fused_linear_cross_entropy(
                hidden, weight, labels if shift_labels is None else shift_labels, bias=bias,
                ignore_index=kwargs.get("ignore_index", -100),
                num_items_in_batch=kwargs.get("num_items_in_batch"), shift=shift_labels is None,
                return_token_accuracy=accuracy)
            if accuracy:
                loss, call["accuracy"] = loss
            return loss

        # The loss is computed inside the head's own call (an instance ``forward`` for this call only, shadowing
        # the class forward), where the stock forward calls the head: hooks around the head see the call as
        # stock's. FSDP2's gather the whole weight before it, reshard after it, gather again before the loss's
        # backward (a hook on the call's output, the loss) and reduce-scatter the head's gradient after it (on
        # the input, the hidden states); autograd saves only the head's own (re-gathered) parameters.
        head.forward = loss_forward
        try:
            out = original(self, labels=None, return_dict=True, **kwargs)
        finally:
            vars(head).pop("forward", None)
        if not call:
            raise RuntimeError(f"{type(self).__name__}.forward did not call its output embeddings "
                               f"({type(head).__name__}); deltafuse's causal-LM route does not serve this model")
        if call.get("logits"):
            logits = out.logits
            extra = {k: v for k, v in kwargs.items() if k not in signature.parameters}
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **extra)
            acc = token_accuracy_from_logits(logits, labels, shift_labels, kwargs.get("ignore_index", -100)) \
                if accuracy else None
        else:
            logits, loss, acc = None, out.logits, call.get("accuracy")
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        result = type(out)(loss=loss, logits=logits, **fields)
        if accuracy:
            result[ACCURACY_FIELD] = acc
        return result if return_dict else _as_tuple(result, keep_logits_slot=True)

    return mark_wrapper(forward, original, "wrap_causal_lm_forward")
