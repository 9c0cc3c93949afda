"""Where a ``configured`` block reaches (``deltafuse.ops._scoped``): the calls in its own context, and the calls
during a backward pass that no block of their own reaches, as a checkpoint's recompute on autograd's CUDA thread.

A CUDA backward's thread is stood in for by a Python thread, which starts with no block of its own: the same
context a GPU's autograd thread gives the op.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint as checkpoint

from deltafuse.ops._scoped import ScopedDefault

pytest.importorskip("triton")

from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.kernel import chunk_gated_delta_rule_triton  # noqa: E402
from tests.helpers import gpu, needs_cuda  # noqa: E402
from tests.ops.test_gdn_keep_states import BACKWARD, RECOMPUTE, _draw, _run  # noqa: E402


def _on_thread(fn):
    """fn() on a new thread (no block of its own); its result, or its exception raised here."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised below
            out["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _seen_in_backward(scoped):
    """What ``scoped.get()`` returns inside the backward of a call made here, with the backward on another thread."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(scoped.get())
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    loss = Probe.apply(x).sum()
    _on_thread(loss.backward)
    return seen


def test_scoped_default_reaches_its_context_and_backward_passes_only():
    scoped = ScopedDefault("test_scoped", "default")
    assert scoped.get() == "default"
    with scoped.block("outer"):
        assert scoped.get() == "outer"
        assert _on_thread(scoped.get) == "default"  # another thread, not in a backward: not reached
        assert _seen_in_backward(scoped) == ["outer"]  # a backward with no block of its own: reached
        with scoped.block("inner"):
            assert scoped.get() == "inner"
            assert _seen_in_backward(scoped) == ["inner"]

            def own_block():
                with scoped.block("own"):
                    return scoped.get(), _seen_in_backward(scoped)

            # a thread's own block wins over the process's innermost, also in a backward it runs
            assert _on_thread(own_block) == ("own", ["own"])
        assert scoped.get() == "outer" and _seen_in_backward(scoped) == ["outer"]
    assert scoped.get() == "default"
    assert _seen_in_backward(scoped) == ["default"]  # closed: nothing reaches any more


def test_scoped_default_closing_out_of_order_keeps_the_other_block():
    """Blocks of two threads closing in any order: each removes its own entry, not the newest."""
    scoped = ScopedDefault("test_scoped_order", 0)
    opened, release, done = threading.Event(), threading.Event(), []

    def other():
        with scoped.block(2):
            opened.set()
            release.wait(10)
        done.append(True)

    with scoped.block(1):
        worker = threading.Thread(target=other)
        worker.start()
        assert opened.wait(10)
        assert _seen_in_backward(scoped) == [2]  # the innermost (newest) open block of the process
    assert _seen_in_backward(scoped) == [2]  # ours closed first: the other thread's stays
    release.set()
    worker.join()
    assert done and _seen_in_backward(scoped) == [0]


@pytest.mark.parametrize("inside", [True, False], ids=["backward_inside_block", "backward_after_block"])
def test_configured_reaches_a_checkpoints_recompute_on_autograds_thread(inside):
    """The chunked op under a non-reentrant checkpoint in a ``configured`` block with a stage hook, its backward on
    another thread. The op's backward runs with what its first forward read, in either case. The checkpoint's rerun
    of the forward is a new call: inside the block it runs with the block's hook (and options), and its stages are
    seen; after the block has closed it runs with the defaults (no hook). The gradients are bit-equal to those
    without checkpointing either way."""
    xs, cu, do, dht = _draw((1, 70, 1, 2, 16, 16), dict(cu=[0, 5, 70], l2=True), torch.float32)
    plain, _, _ = _run(xs, cu, do, dht, True, chunk_mod.ChunkOptions())
    ours = {n: x.clone().requires_grad_() for n, x in xs.items()}
    seen = []

    def op(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, 0.25, h0, True, True, cu)

    with chunk_mod.configured(stage_hook=seen.append):
        o, ht = checkpoint.checkpoint(op, *(ours[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                                      use_reentrant=False)
        loss = (o.double() * do).sum() + (ht.double() * dht).sum()
        assert seen == RECOMPUTE + ["out"]
        if inside:
            _on_thread(loss.backward)
    if not inside:
        _on_thread(loss.backward)
    backward = seen[len(RECOMPUTE) + 1:]
    rerun = RECOMPUTE + ["out"] if inside else []
    assert backward == rerun + RECOMPUTE + BACKWARD + ["bwd_reduce"], backward
    for n in xs:
        assert torch.equal(ours[n].grad, plain[n]), n


@gpu
@needs_cuda
@pytest.mark.parametrize("inside", [True, False], ids=["backward_inside_block", "backward_after_block"])
def test_configured_reaches_the_recompute_on_the_cuda_backward_thread(inside):
    """On a GPU, where autograd runs the backward on its own device thread: a ``configured`` block's stage hook sees
    the checkpoint's rerun of the forward when the backward runs inside the block, and not after it has closed;
    the op's backward runs with its first forward's hook either way. bf16, gradients bit-equal to those without
    checkpointing."""
    xs, cu, do, dht = _draw((1, 300, 2, 4, 128, 128), dict(cu=[0, 100, 300], l2=True), torch.bfloat16)
    plain, _, _ = _run(xs, cu, do, dht, True, chunk_mod.ChunkOptions())
    ours = {n: x.clone().requires_grad_() for n, x in xs.items()}
    seen = []

    def hook(stage):
        seen.append((stage, threading.get_ident()))

    def op(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, 0.25, h0, True, True, cu)

    with chunk_mod.configured(stage_hook=hook):
        o, ht = checkpoint.checkpoint(op, *(ours[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                                      use_reentrant=False)
        loss = (o.double() * do).sum() + (ht.double() * dht).sum()
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    forward = len(RECOMPUTE) + 1
    stages = [s for s, _ in seen[forward:]]
    rerun = RECOMPUTE + ["out"] if inside else []
    assert stages == rerun + RECOMPUTE + BACKWARD + ["bwd_reduce"], stages
    assert {t for _, t in seen[forward:]} != {threading.get_ident()}  # the backward ran on autograd's thread
    for n in xs:
        assert torch.equal(ours[n].grad, plain[n]), n
