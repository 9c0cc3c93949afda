"""Reading a wrapped call's arguments by name, through decorators that hide the signature."""

from __future__ import annotations

import functools

from deltafuse.integrations.transformers.call_args import call_argument, call_signature


def _closure_decorator(forward_func):
    """As transformers' force_accelerate_hooks (5.14+): a (self, *args, **kwargs) wrapper, no functools.wraps."""
    def wrapped(self, *args, **kwargs):
        return forward_func(self, *args, **kwargs)

    return wrapped


def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    return hidden_states


def test_the_signature_is_seen_through_a_closure_and_through_wraps():
    for fn in (_closure_decorator(forward), functools.wraps(forward)(lambda self, *a, **k: None),
               _closure_decorator(_closure_decorator(forward))):
        sig = call_signature(fn)
        assert list(sig.parameters) == ["self", "hidden_states", "cache_params", "attention_mask", "kwargs"]
        assert call_argument(sig, ("h", None, "mask"), {}, "attention_mask") == "mask"
        assert call_argument(sig, ("h",), {}, "hidden_states") == "h"


def test_an_opaque_function_keeps_its_own_signature():
    def opaque(self, *args, **kwargs):
        return None

    assert list(call_signature(opaque).parameters) == ["self", "args", "kwargs"]
    assert call_argument(call_signature(opaque), ("h",), {}, "hidden_states", "absent") == "absent"
