"""CUDA graphs of the decoder layers (graphed_layers): the refusals; the dispatch between replays and eager calls
on CPU, with the capture replaced by a recorder that replays through the graphed callables it was handed (so a
"replayed" step runs exactly what a graph would hold: the padded boundaries, rebuilt from the captured tensors);
and on a GPU LoRA steps of the three tiny families whose layers replay from real graphs against the same steps run
eagerly: the loss and every gradient."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from deltafuse import models
from deltafuse.integrations.transformers import graphed_layers as gl
from tests.helpers import gpu, needs_cuda, rel_rms

# a replayed bf16 step's gradients against the eager step's (relative RMS): four bf16 roundings
BF16_REPLAY = 4 * 2.0**-8


def _model(name="tiny-moe", device="cpu", dtype=torch.float32):
    model = models.build_model(name, dtype=dtype, device=device, seed=int(torch.randint(0, 1000, ()))).train()
    model.config.use_cache = False  # what graph_layers does (and deltafuse train); GraphedLayers alone does not
    return model


def test_the_layers_are_the_decoder_layers():
    model = _model()
    layers = gl.decoder_layers(model)
    assert layers == list(model.model.layers) and len(layers) == model.config.num_hidden_layers


@pytest.mark.parametrize("case", ["checkpointing", "router_logits", "hooks", "own_forward", "cpu", "warmup",
                                  "max_sequences"])
def test_unsafe_set_ups_are_refused_in_one_line(case):
    model = _model()
    if case == "checkpointing":
        model.gradient_checkpointing_enable()
        needle = "gradient checkpointing is on"
    elif case == "router_logits":
        model.config.output_router_logits = True
        needle = "output_router_logits=True"
    elif case == "hooks":
        model.model.layers[1].mlp.experts.register_forward_hook(lambda *a: None)
        needle = "decoder layer 1 has module hooks on ['mlp.experts']"
    elif case == "own_forward":
        model.model.layers[2].forward = lambda x: x
        needle = "decoder layer 2 has its own forward already"
    elif case == "cpu":
        needle = "the model's layers are on cpu; allowed: a model on a CUDA device"
    elif case == "warmup":
        needle = "warmup=0; allowed: an int >= 1"
    else:
        needle = "max_sequences=0; allowed: None (from the warm-up batches) or an int >= 1"
    with pytest.raises(gl.GraphError) as info:
        if case == "warmup":
            gl.GraphedLayers(gl.decoder_layers(model), warmup=0)
        elif case == "max_sequences":
            gl.GraphedLayers(gl.decoder_layers(model), max_sequences=0)
        else:
            gl.graph_layers(model)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert all("forward" not in vars(b) or case == "own_forward" for b in gl.decoder_layers(model))


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Recorder:
    """Stands in for torch.cuda.make_graphed_callables on CPU: what it captures replays through the callable it was
    handed (the layer's call rebuilt from the graph's tensors alone, the padded boundaries among them) and counts,
    so the tests see which calls would replay and what a replay computes."""

    def __init__(self, at_capture=None):
        self.captures, self.replays, self.samples = [], [], []
        self.at_capture = at_capture  # called when the capture starts; what it returns is kept in self.seen
        self.seen = []

    def __call__(self, modules, samples, num_warmup_iters=3, allow_unused_input=False):
        if self.at_capture is not None:
            self.seen.append(self.at_capture())
        assert not torch.is_autocast_enabled("cuda") or not torch.is_autocast_cache_enabled()
        assert allow_unused_input  # cos / sin reach the GDN layers, which do not read them
        self.captures.append([tuple(s[0].shape) for s in samples])
        self.samples.append(samples)
        for i, m in enumerate(modules):
            assert isinstance(m, gl._LayerCall) and all(isinstance(t, torch.Tensor) for t in samples[i])

            def replay(*tensors, i=i, m=m):
                self.replays.append(i)
                out = type(m).forward(m, *tensors)
                return _Replayed.apply(out) if isinstance(out, torch.Tensor) else tuple(
                    _Replayed.apply(o) for o in out)

            m.forward = replay
        return modules


def _packed(vocab, T, cuts):
    ids = torch.randint(1, vocab, (1, T))
    pos = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, T])]).view(1, T)
    return dict(input_ids=ids, labels=ids, position_ids=pos)


def _step(model, kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Cycle:
    """An object that refers to itself: only the cycle collector frees it."""

    def __init__(self):
        self.me = self


@pytest.mark.parametrize("collector", ["on", "off"])
def test_the_cycle_collector_never_runs_inside_the_capture(monkeypatch, collector):
    """Garbage in reference cycles (a dropped graphed model's, for one) is collected before the capture, and the
    automatic collector is off while it runs (on the H200 captures failed in runs as its counters came round), then
    back as the user had it."""
    cycle = None
    rec = _Recorder(at_capture=lambda: (gc.isenabled(), cycle()))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", rec)
    model = _model()
    graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=2)
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    kw = dict(input_ids=ids, labels=ids)
    was = gc.isenabled()
    (gc.enable if collector == "on" else gc.disable)()
    try:
        _step(model, kw)
        _step(model, kw)
        gc.disable()  # nothing but the capture may collect the cycle made now
        cycle = weakref.ref(_Cycle())
        assert cycle() is not None
        if collector == "on":
            gc.enable()
        _step(model, kw)  # captures
        assert rec.seen == [(False, None)] and graphs.replays == model.config.num_hidden_layers
        assert gc.isenabled() == (collector == "on")
    finally:
        (gc.enable if was else gc.disable)()
        graphs.remove()


def test_removed_graphs_leave_no_reference_cycle(monkeypatch):
    """make_graphed_callables gives each captured module a forward that refers to the module (the recorder does
    the same): after remove(), dropping the model frees its layers at once, without the cycle collector. Left to
    it, a dropped graphed model (its layers, graphs and their memory) was freed whenever a collection ran, inside a
    later capture too."""
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _Recorder())
    model = _model()
    graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=2)
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    for _ in range(3):
        _step(model, dict(input_ids=ids, labels=ids))
    assert graphs.replays == model.config.num_hidden_layers
    layer = weakref.ref(gl.decoder_layers(model)[0])
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        graphs.remove()
        del model, graphs
        assert layer() is None
    finally:
        if was:
            gc.enable()


def test_dispatch_warms_up_captures_once_and_replays_only_what_matches(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", rec)
    model = _model()
    n = model.config.num_hidden_layers
    layers = gl.decoder_layers(model)
    graphs = gl.GraphedLayers(layers, warmup=2)
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    kw = dict(input_ids=ids, labels=ids)
    _step(model, kw)
    _step(model, kw)
    assert rec.captures == [] and graphs.graphed is None and graphs.calls == 2
    _step(model, kw)  # the third training call of layer 0 captures every layer, then replays
    assert rec.captures == [[(2, 24, model.config.hidden_size)] * n]
    assert rec.replays == list(range(n)) and graphs.replays == n
    _step(model, dict(input_ids=ids[:, :16], labels=ids[:, :16]))  # another shape: eager
    assert graphs.replays == n and graphs.eager_after_capture == n
    with torch.no_grad():
        model(input_ids=ids)  # grad mode off: eager
    model.eval()
    model(**kw).loss.backward()  # eval mode: eager
    model.train()
    assert graphs.replays == n and graphs.eager_after_capture == 3 * n
    # two forwards before one backward: the second is eager (a replay would overwrite the first's activations)
    first = model(**kw).loss
    second = model(**kw).loss
    assert graphs.replays == 2 * n and graphs.eager_after_capture == 4 * n
    (first + second).backward()
    _step(model, kw)  # the backward ran: replays again
    assert graphs.replays == 3 * n
    # a replay whose outputs were freed without a backward does not hold the next one back
    model(**kw)
    _step(model, kw)
    assert graphs.replays == 5 * n and len(rec.captures) == 1
    summary = graphs.summary()
    assert "captured for (2, 24," in summary and f"{5 * n} replays" in summary
    assert "inputs other than the captured ones: " in summary and "a second forward before the backward: " in summary
    graphs.remove()
    assert all("forward" not in vars(b) for b in layers)
    _step(model, kw)
    assert graphs.replays == 5 * n


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-next"])
def test_replays_of_packed_rows_take_the_boundaries_of_each_step(monkeypatch, name):
    """Packed rows (boundaries from restarting position_ids, other cuts every step): the capture pads the offsets to
    the room for the most sequences, and every replayed step (the layers called with the padded boundaries rebuilt
    from the graphs' tensors) gives the loss and gradients of the same step run eagerly; a row of more sequences
    than that room runs eagerly."""
    import deltafuse

    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", rec)
    model = _model(name)
    vocab, T, n = model.config.vocab_size, 96, model.config.num_hidden_layers
    batches = [_packed(vocab, T, [30]), _packed(vocab, T, [10, 50, 51]), _packed(vocab, T, [64]),
               _packed(vocab, T, [5, 70]), _packed(vocab, T, [1, 2, 40, 90])]
    with deltafuse.patched(model):
        eager = [_step(model, kw) for kw in batches]
        graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=2)
        got = [_step(model, kw) for kw in batches]
        assert graphs.max_sequences == 8  # 4 sequences at most in the warm-up rows: twice that, a power of two
        assert graphs.replays == 3 * n and graphs.eager_after_capture == 0
        cu = [s for s in rec.samples[0][0] if s.dtype == torch.int32]
        assert [tuple(t.shape) for t in cu] == [(9,)]  # the padded offsets: room for 8 sequences
        crowded = _packed(vocab, T, list(range(4, 80, 8)))  # 11 sequences
        want = _step(model, crowded)
        graphs.remove()
        _step(model, batches[0])
    for (wl, wg), (gl_, gg) in zip(eager, got):
        assert torch.allclose(gl_, wl, rtol=1e-6, atol=0), (gl_, wl)
        assert gg.keys() == wg.keys()
        for k in wg:
            assert rel_rms(gg[k], wg[k]) < 1e-5, (k, rel_rms(gg[k], wg[k]))
    assert graphs.replays == 3 * n and "more sequences than max_sequences=8: " in graphs.summary()
    assert torch.isfinite(want[0])


def test_the_room_given_is_kept(monkeypatch):
    import deltafuse

    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", rec)
    model = _model("tiny")
    vocab = model.config.vocab_size
    with deltafuse.patched(model):
        graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=1, max_sequences=3)
        _step(model, _packed(vocab, 40, [20]))
        _step(model, _packed(vocab, 40, [20]))
        assert graphs.max_sequences == 3
        assert [t.shape for t in rec.samples[0][0] if t.dtype == torch.int32] == [(4,)]
        _step(model, _packed(vocab, 40, [5, 10, 20]))  # 4 sequences: eager
        assert graphs.eager_after_capture == model.config.num_hidden_layers
        graphs.remove()
        # a warm-up batch of more sequences than the room: no capture (one warning), every step eager and correct
        graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=1, max_sequences=2)
        want = _step(model, _packed(vocab, 40, [5, 10, 20]))
        got = _step(model, _packed(vocab, 40, [5, 10, 20]))
        assert graphs.failed == "the last warm-up batch holds 4 sequences, more than max_sequences=2"
        assert rec.captures == [[(1, 40, model.config.hidden_size)] * model.config.num_hidden_layers]
        assert torch.isfinite(want[0]) and torch.isfinite(got[0])
        graphs.remove()


def test_a_failed_capture_warns_and_leaves_every_layer_eager(monkeypatch, caplog):
    def broken(modules, samples, num_warmup_iters=3, allow_unused_input=False):
        modules[0].forward = lambda *x: x[0]  # a half-done capture
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", broken)
    model = _model()
    graphs = gl.GraphedLayers(gl.decoder_layers(model), warmup=1)
    ids = torch.randint(1, model.config.vocab_size, (1, 20))
    kw = dict(input_ids=ids, labels=ids)
    want = _step(model, kw)
    with caplog.at_level("WARNING", logger="deltafuse"):
        got = _step(model, kw)
    assert torch.equal(got[0], want[0])
    assert "capturing CUDA graphs of the decoder layers failed (RuntimeError: operation not permitted" in caplog.text
    assert graphs.failed and graphs.graphed is None and "capture failed" in graphs.summary()
    assert all(getattr(vars(b).get("forward"), "__deltafuse_graphed__", False) for b in graphs.layers)
    _step(model, kw)
    assert graphs.replays == 0


def test_train_refuses_cuda_graphs_on_cpu_in_one_line(tmp_path, capsys):
    from deltafuse.train.cli import main

    assert main(["--model", "tiny", "--cuda-graphs", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("deltafuse train: error: ")][-1]
    assert "--cuda-graphs: the device is cpu; allowed: a CUDA device" in line
    assert not (tmp_path / "o").exists()


def test_the_packed_rows_room_of_deltafuse_train():
    from deltafuse.train.packing import ListDataset, max_sequences_per_row

    bins = ListDataset([[{}] * 3, [{}] * 5, [{}], [{}] * 4])
    assert max_sequences_per_row(bins, 1) == 6 and max_sequences_per_row(bins, 2) == 10


def test_callback_refusals():
    from types import SimpleNamespace

    from deltafuse.integrations.trainer import DeltafuseCallback

    with pytest.raises(ValueError, match=r"cuda_graphs='yes'\); allowed: True or False"):
        DeltafuseCallback(cuda_graphs="yes")
    with pytest.raises(ValueError, match=r"max_sequences=4\); allowed: None, or an int >= 1 with cuda_graphs=True"):
        DeltafuseCallback(max_sequences=4)
    cb = DeltafuseCallback(cuda_graphs=True)
    with pytest.raises(gl.GraphError, match=r"DeltafuseCallback\(cuda_graphs=True\): gradient checkpointing \(on in the "
                                            r"training arguments\) recomputes forwards during the backward"):
        cb.on_init_end(SimpleNamespace(gradient_checkpointing=True, n_gpu=1), None, None, model=_model())
    with pytest.raises(gl.GraphError, match=r"fsdp='full_shard': FSDP gathers each layer's weights .*allowed: no FSDP"):
        cb.on_init_end(SimpleNamespace(fsdp="full_shard", n_gpu=1), None, None, model=_model())


def test_callback_names_the_trainer_settings_that_wait_for_the_gpu():
    from transformers import TrainingArguments

    from deltafuse.integrations.trainer import step_waits

    def args(**kw):
        return TrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kw)

    line = step_waits(args())  # transformers' defaults: the NaN / inf filter on, no token count
    assert line.startswith("deltafuse: cuda_graphs: logging_nan_inf_filter=True (tests the loss) read the GPU back")
    assert "include_num_input_tokens_seen" not in line
    line = step_waits(args(include_num_input_tokens_seen="non_padding"))
    assert "logging_nan_inf_filter=True (tests the loss) and include_num_input_tokens_seen='non_padding'" in line
    assert step_waits(args(logging_nan_inf_filter=False)) is None


# --- GPU: real graphs ------------------------------------------------------------------------------------------
def _lora(model):
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-next"])
@pytest.mark.parametrize("rows", ["rows", "packed", "packed-2048"])
def test_replayed_layers_give_the_eager_loss_and_gradients(name, rows):
    """A LoRA step (deltafuse applied, bf16 under autocast) whose decoder layers replay from CUDA graphs: the loss and
    every gradient equal those of the same step run eagerly, for several batches after the capture. Packed rows
    bring other boundaries every step (the graphs recompute the GDN chunk tables on the device; from 2,048 tokens
    attention runs varlen_attn on the padded offsets, below it the block-causal mask is a graph input); a row of
    more sequences than the room runs eagerly and still matches."""
    import deltafuse

    model = _lora(_model(name, device="cuda", dtype=torch.bfloat16))
    vocab = model.config.vocab_size
    T = 2048 if rows == "packed-2048" else 256

    def batch(k):
        if rows == "rows":
            ids = torch.randint(1, vocab, (2, T), device="cuda")
            return dict(input_ids=ids, labels=ids)
        cuts = sorted(torch.randperm(T - 2)[:k].add(1).tolist())
        return {key: v.cuda() for key, v in _packed(vocab, T, cuts).items()}

    def step(kw):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**kw).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                       if p.grad is not None}

    with deltafuse.patched(model):
        batches = [batch(k) for k in (3, 1, 5, 2, 4, 7, 30)]
        eager = [step(kw) for kw in batches]
        graphs = gl.graph_layers(model, warmup=2)
        try:
            got = [step(kw) for kw in batches]
            assert graphs.failed is None, graphs.failed
            n = len(graphs.layers)
            crowded = 0 if rows == "rows" else 1  # 31 sequences: more than the room of 8 (twice the warm-up's 4)
            assert graphs.replays == (5 - crowded) * n and graphs.eager_after_capture == crowded * n, graphs.summary()
        finally:
            graphs.remove()
    # The replays run the same kernels on the same data, except where the padded boundaries change a launch:
    # varlen_attn then gets the row's length as the longest sequence and schedules its backward differently, so
    # bf16 roundings may differ: H200, 2,048-token rows, 1.1e-3 and 1.8e-3 in one LoRA gradient; H100 with fresh
    # weights, 5.1e-3 (a LoRA B of a GDN output projection: bf16 gradients, each element a rounded sum over the
    # row). Such a gradient may differ by a few bf16 roundings (2^-8 each); a replay holding the wrong boundaries
    # differs by the size of the gradients themselves.
    exact, worst = 0, 0.0
    for i, ((wl, wg), (gl_, gg)) in enumerate(zip(eager, got)):
        assert torch.allclose(gl_, wl, rtol=2e-3, atol=0), (i, gl_, wl)
        assert gg.keys() == wg.keys() and len(gg) >= 8
        for k in wg:
            err = rel_rms(gg[k], wg[k])
            assert err < BF16_REPLAY, (i, k, err)
            exact += bool(torch.equal(gg[k], wg[k]))
            worst = max(worst, err)
    print(f"[graphed layers {name} {rows}] {exact} of {sum(len(w) for _, w in eager)} gradients bit-equal, "
          f"the largest difference {worst:.2e}")
