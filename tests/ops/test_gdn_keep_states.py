"""The chunked GDN op's kept states (``ChunkOptions.keep_states``): a forward that keeps its l2norm factors, gates,
w, v', T and chunk states gives a backward that skips its recompute and returns, bit for bit, the recompute's
gradients; under checkpointing it keeps only where checkpointing compares nothing it saves.

Fresh random inputs every run; every gradient element compared (``torch.equal``), and each run also against the
float64 oracle. Runs under the Triton interpreter without CUDA (fp32 and fp16 inputs, tiny shapes).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint as checkpoint

pytest.importorskip("triton")

from deltafuse.ops.gated_delta import kernel as chunk_mod  # noqa: E402
from deltafuse.ops.gated_delta.gates import Gates  # noqa: E402
from deltafuse.ops.gated_delta.kernel import ChunkOptions, chunk_gated_delta_rule_triton  # noqa: E402
from deltafuse.ops.gated_delta.naive import naive_gated_delta_rule  # noqa: E402
from tests.helpers import gpu, input_gen, needs_cuda, rel_rms  # noqa: E402
from tests.ops.test_gdn_triton import BF16, GPU_CASES, check_chunk, make_inputs, rel_max  # noqa: E402

RECOMPUTE = ["l2norm", "intra", "state"]  # the backward's rerun of the forward's kernels (no "out")
RECOMPUTE_NO_L2 = ["intra", "state"]  # (no l2norm in the kernels)
BACKWARD = ["dv_local", "state_bwd", "bwd_wy", "bwd_out"]

# id, (B, T, H, HV, K, V), layout
CASES = [
    ("varlen_G2", (1, 130, 1, 2, 16, 16), dict(cu=[0, 1, 65, 130], l2=True)),
    ("B2_G1_nol2", (2, 70, 2, 2, 16, 32), dict(cu=None, l2=False)),
    # K = V = 64 at fp32: the dk partials take T's bytes and the dq partials v''s (the buffers the backward shares)
    ("qwen_bytes_fp32", (1, 100, 1, 2, 64, 64), dict(cu=[0, 30, 100], l2=True)),
]
OPTIONS = [dict(), dict(wy_recompute_t=True), dict(sbwd_from_t=True), dict(bwd_group_loop=True),
           dict(fwd_store_v="input")]


def _draw(shape, layout, dtype):
    B, T, H, HV, K, V = shape
    xs, cu = make_inputs(B, T, H, HV, K, V, dtype=dtype, h0=True, cu=layout["cu"], l2=layout["l2"])
    gen = input_gen()
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    dht = torch.randn(xs["initial_state"].shape, generator=gen, dtype=torch.float64)
    return xs, cu, do.to(xs["q"].device), dht.to(xs["q"].device)


def _run(xs, cu, do, dht, l2, options, wrap=None, backwards=1):
    """Every input's gradient, and the stages run (forward, then backward), under ``options``; ``wrap(fn, *xs)``
    runs the op (a checkpoint); ``backwards`` backward passes of one retained graph."""
    seen = []
    ours = {n: x.clone().requires_grad_() for n, x in xs.items()}

    def op(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, 0.25, h0, True, l2, cu, options=options,
                                             stage_hook=seen.append)

    args = [ours[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    o, ht = op(*args) if wrap is None else wrap(op, *args)
    forward = len(seen)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return {n: x.grad for n, x in ours.items()}, seen[:forward], seen[forward:]


def _oracle(xs, cu, do, dht, l2):
    ref = {n: x.detach().double().requires_grad_() for n, x in xs.items()}
    ro, rht = naive_gated_delta_rule(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], 0.25, ref["initial_state"],
                                     True, l2, cu)
    ((ro * do).sum() + (rht * dht).sum()).backward()
    return {n: x.grad for n, x in ref.items()}


def _close_to_oracle(grads, ref, tol, tol_gb):
    for n, grad in grads.items():
        t = tol_gb if n in ("g", "beta") else tol
        e, m = rel_rms(grad, ref[n]), rel_max(grad, ref[n])
        assert e <= t and m <= 20 * t, f"d{n}: rel rms {e:.2e}, max {m:.2e} over {t:.0e}"


@pytest.mark.parametrize("more", OPTIONS, ids=["defaults", "recompute_t", "from_t", "group_loop", "store_v_input"])
@pytest.mark.parametrize("shape,layout", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kept_states_give_the_recompute_gradients(shape, layout, more):
    """keep_states on against off on fp32 inputs: the backward runs none of the forward's kernels again,
    every gradient is bit-equal to the recompute's, and both are within the fp32 bound of float64."""
    xs, cu, do, dht = _draw(shape, layout, torch.float32)
    kept, fwd, bwd = _run(xs, cu, do, dht, layout["l2"], ChunkOptions(keep_states=True, **more))
    again, fwd_r, bwd_r = _run(xs, cu, do, dht, layout["l2"], ChunkOptions(keep_states=False, **more))
    recompute = RECOMPUTE if layout["l2"] else RECOMPUTE_NO_L2
    assert fwd == fwd_r == recompute + ["out"]
    assert bwd_r[:len(recompute)] == recompute and bwd == bwd_r[len(recompute):] and bwd[:4] == BACKWARD, (bwd, bwd_r)
    for n in xs:
        assert torch.equal(kept[n], again[n]), n
    _close_to_oracle(kept, _oracle(xs, cu, do, dht, layout["l2"]), 1e-5, 1e-5)


@pytest.mark.parametrize("store_v", ["fp32", "input"])
@pytest.mark.parametrize("G", [2, 1])
def test_kept_states_fp16(G, store_v):
    """fp16 inputs: the kept v' is in the states' 16 bits, as the recompute stores it (with u in fp32, the default
    fwd_store_v, a copy the output kernel writes; else u's own buffer): every gradient bit-equal to the recompute's,
    within 2e-3 of float64 (dg and dbeta within 5e-3, as test_gdn_triton.test_intra_options_fp16 says why)."""
    shape = (1, 130, 2 // G, 2, 16, 16)
    layout = dict(cu=[0, 1, 65, 130], l2=True)
    xs, cu, do, dht = _draw(shape, layout, torch.float16)
    kept, _, bwd = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=True, fwd_store_v=store_v))
    again, _, bwd_r = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=False, fwd_store_v=store_v))
    assert bwd_r[:3] == RECOMPUTE and bwd == bwd_r[3:]
    for n in xs:
        assert torch.equal(kept[n], again[n]), n
    _close_to_oracle(kept, _oracle(xs, cu, do, dht, True), 2e-3, 5e-3)


def test_kept_states_with_gates_in_the_kernel():
    """FLA's in-kernel gate and beta (raw a, logits, A_log, dt_bias): kept states (the backward reruns no forward
    kernel) give the recompute's gradients of every input and of A_log and dt_bias, bit for bit."""
    xs, cu, do, dht = _draw((1, 70, 1, 2, 16, 16), dict(cu=[0, 5, 70], l2=True), torch.float32)
    gen = input_gen()
    xs["g"] = torch.randn(1, 70, 2, generator=gen)  # the raw gate a
    xs["beta"] = torch.randn(1, 70, 2, generator=gen)  # logits
    A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    grads = []
    for keep in (True, False):
        ours = {n: x.clone().requires_grad_() for n, x in xs.items()}
        a, dt = A_log.clone().requires_grad_(), dt_bias.clone().requires_grad_()
        seen = []
        o, ht = chunk_gated_delta_rule_triton(ours["q"], ours["k"], ours["v"], ours["g"], ours["beta"], 0.25,
                                              ours["initial_state"], True, True, cu, options=ChunkOptions(
                                                  keep_states=keep), stage_hook=seen.append,
                                              gates=Gates(a, dt, True, True))
        forward = len(seen)
        ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
        assert (seen[forward:forward + 3] == RECOMPUTE) is not keep, seen
        grads.append([x.grad for x in ours.values()] + [a.grad, dt.grad])
    for got, want in zip(*grads):
        assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointing(reentrant):
    """Under torch.utils.checkpoint, with keep_states on: the reentrant checkpoint's recompute (no saved-tensor hooks)
    keeps its states, so the op's backward runs none of the forward's kernels a third time; under the non-reentrant
    one's hooks nothing is kept (its recompute must save what the first forward saved). Either way the gradients are
    bit-equal to those of the op without checkpointing."""
    xs, cu, do, dht = _draw((1, 130, 1, 2, 16, 16), dict(cu=[0, 1, 65, 130], l2=True), torch.float32)
    plain, fwd_p, bwd_p = _run(xs, cu, do, dht, True, ChunkOptions())
    assert fwd_p == RECOMPUTE + ["out"] and bwd_p[:3] == RECOMPUTE  # the defaults keep nothing

    def wrap(fn, *args):
        return checkpoint.checkpoint(fn, *args, use_reentrant=reentrant)

    got, fwd, bwd = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=True), wrap=wrap)
    # the backward: the checkpoint's rerun of the whole forward, then the op's backward
    assert fwd == RECOMPUTE + ["out"] and bwd[:4] == RECOMPUTE + ["out"], bwd
    assert bwd[4:] == (BACKWARD if reentrant else RECOMPUTE + BACKWARD) + ["bwd_reduce"], bwd
    for n in xs:
        assert torch.equal(got[n], plain[n]), n


def test_configured_block_under_checkpointing_with_the_backward_on_another_thread():
    """A configured block with keep_states on around a non-reentrant checkpoint, its backward on another thread (as
    autograd runs a CUDA backward, where the block's options do not reach the recompute): the recompute saves what
    the first forward saved (no CheckpointError), and the gradients are bit-equal to those without checkpointing."""
    xs, cu, do, dht = _draw((1, 70, 1, 2, 16, 16), dict(cu=[0, 5, 70], l2=True), torch.float32)
    plain, _, _ = _run(xs, cu, do, dht, True, ChunkOptions())
    ours = {n: x.clone().requires_grad_() for n, x in xs.items()}

    def op(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule_triton(q, k, v, g, beta, 0.25, h0, True, True, cu)

    with chunk_mod.configured(ChunkOptions(keep_states=True)):
        o, ht = checkpoint.checkpoint(op, *(ours[n] for n in ("q", "k", "v", "g", "beta", "initial_state")),
                                      use_reentrant=False)
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    errors = []

    def backward():
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    assert not errors, errors
    for n in xs:
        assert torch.equal(ours[n].grad, plain[n]), n


def test_kept_through_other_saved_tensor_hooks():
    """Under saved-tensor hooks other than checkpointing's (offloading to the CPU) the kept states go through the
    hooks, and the backward writes nothing over what they hold: a second backward of the retained graph, which
    takes them from the hooks again, adds the same gradients (each is exactly twice one backward's)."""
    xs, cu, do, dht = _draw(*CASES[2][1:], torch.float32)
    once, _, _ = _run(xs, cu, do, dht, True, ChunkOptions())
    with torch.autograd.graph.save_on_cpu():
        twice, _, bwd = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=True), backwards=2)
    assert "intra" not in bwd, bwd
    for n in xs:
        assert torch.equal(twice[n], 2 * once[n]), n


def test_a_retained_graph_recomputes_what_its_first_backward_used():
    """keep_states=True without hooks: the first backward takes the kept states (and writes its own buffers
    over some of them), a second backward of the retained graph recomputes: each gradient is exactly twice one
    backward's."""
    xs, cu, do, dht = _draw(*CASES[2][1:], torch.float32)
    once, _, _ = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=False))
    twice, _, bwd = _run(xs, cu, do, dht, True, ChunkOptions(keep_states=True), backwards=2)
    assert bwd.count("l2norm") == 1 and bwd[:4] == BACKWARD, bwd  # the second backward's recompute alone
    for n in xs:
        assert torch.equal(twice[n], 2 * once[n]), n


def test_where_states_are_kept():
    """keep_states on: nothing kept where no input needs a gradient or grad mode is off (the forward then stores no
    T), on the context without hooks, through other saved-tensor hooks, never under checkpointing's. Off: never."""
    xs, cu, _, _ = _draw(*CASES[0][1:], torch.float32)
    args = [xs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    on = ChunkOptions(keep_states=True)
    assert chunk_mod.keep_states(on, args) is None
    with torch.no_grad():
        assert chunk_mod.keep_states(on, [args[0].requires_grad_()]) is None
    assert chunk_mod.keep_states(on, [args[0]]) == "context"
    assert chunk_mod.keep_states(ChunkOptions(), [args[0]]) is None
    for name, want in (("_checkpoint_hook.__init__.<locals>.pack_hook", None),
                       ("_recomputation_hook.__init__.<locals>.pack_hook", None), ("pack_to_cpu", "hooks")):
        with torch.autograd.graph.saved_tensors_hooks(*_hooks_named(name)):
            assert chunk_mod.keep_states(on, [args[0]]) == want, name


def _hooks_named(name):
    """An identity pack / unpack pair whose pack hook has the qualified name ``name`` (what is read)."""

    def pack(x):
        return x

    def unpack(x):
        return x

    pack.__qualname__ = name
    return pack, unpack


def test_keep_states_validated():
    """keep_states is a bool and, when on, refuses stores that differ between the passes, in one line naming the
    fields, the values and what is allowed."""
    with pytest.raises(ValueError, match=r"ChunkOptions.keep_states='yes'; allowed: True, False"):
        ChunkOptions(keep_states="yes")
    with pytest.raises(ValueError, match=r"keep_states=True with fwd_store='input' and bwd_store='fp32'.*"
                                         r"allowed: equal stores, or keep_states=False"):
        ChunkOptions(keep_states=True, bwd_store="fp32")
    assert ChunkOptions().keep_states is False


@gpu
@needs_cuda
@pytest.mark.parametrize("shape,opts", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_kept_states_bf16_gpu(shape, opts):
    """Kept states compiled for the GPU on the Qwen3.5 shapes of test_gdn_triton.test_chunk_bf16_gpu: forward and
    backward in bf16 within their bounds of the float64 oracle, and on one more draw every gradient bit-equal to
    the recompute's (the output kernel's 16-bit copy of v' is what the recompute stores)."""
    with chunk_mod.configured(ChunkOptions(keep_states=True)):
        check_chunk(*shape, dtype=torch.bfloat16, **BF16, **opts)
    layout = dict(cu=opts.get("cu"), l2=opts["l2"])
    xs, cu, do, dht = _draw(shape, layout, torch.bfloat16)
    kept, _, bwd = _run(xs, cu, do, dht, opts["l2"], ChunkOptions(keep_states=True))
    again, _, bwd_r = _run(xs, cu, do, dht, opts["l2"], ChunkOptions(keep_states=False))
    assert "intra" not in bwd and "intra" in bwd_r
    for n in xs:
        assert torch.equal(kept[n], again[n]), n
