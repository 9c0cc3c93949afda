"""``deltafuse verify``: stock transformers vs deltafuse on the same model and batch.

Runs forward + backward twice on one model with the same weights and the same random batch: once stock
(nothing patched), once with ``deltafuse.apply(model)``; then compares the loss, the logits and the gradient
of every trainable parameter.

With ``--packed`` the deltafuse run gets a padding-free packed batch (several sequences per row, B = 2,
``position_ids`` restarting at 0, no attention mask, a length-1 sequence included, each sequence's first
label set to -100 as padding-free collators do) and the reference is stock transformers run on every
sequence alone (stock would leak state across the packed sequences). The reference loss is the token-
weighted mean of the per-sequence losses, its gradients are those of that loss.

Metrics per tensor: ``max_abs`` = max |a - b|, ``rel`` = max |a - b| / max |b| (b = stock). A tensor passes
on ``rel <= rtol``; a parameter gradient may instead pass on the absolute floor ``max_abs <= atol`` while
``rel <= 0.5`` (see below and ``deltafuse.verify.report``). The report names the criterion of every tensor
(``passed_on`` in the JSON) and counts both in its last line. Default tolerances:

=========  =============  ==============
dtype      CPU rtol       CUDA rtol
=========  =============  ==============
float32    1e-4           2e-3
bfloat16   5e-2           5e-2
float16    1e-2           1e-2
=========  =============  ==============

Mixture-of-experts models: a token whose top-k router scores tie within 16-bit rounding can go to a
different expert in each run, which moves its whole gradient to another expert (a discontinuity, not an
error). verify records the experts stock chose for every token and, in 16-bit runs, routes the deltafuse
run's tokens the same way (scores recomputed from its own router logits with the router's formula), and
reports how many tokens that touched. In fp32 any token routed differently is a failure.

The stock side is stock transformers as installed, unless its own fast path cannot run here: transformers
calls FLA / causal-conv1d whenever they import (FLA on a CPU-only box fails with "0 active drivers"), and
FLA 0.6 refuses the GDN backward on Hopper with Triton >= 3.4, < 3.7.1. Then the stock side runs
transformers' own pure-torch GDN functions (``deltafuse.integrations.transformers.stock``), and the result
says so (``baseline``, ``baseline_swapped``, ``baseline_reason``; a ``baseline:`` line in the text report).

A tensor that fails both criteria is settled by a float64 run of the stock model (a copy under
``deltafuse.verify.float64.Float64Everywhere``, eager MoE experts, transformers' own torch GDN where its fast path
takes no float64; in 16 bits routed to stock's experts): it passes ("float64") when deltafuse's result is no
farther from the float64 one than stock's is (1.5x stock's in 16 bits, ``F64_SLACK``), or within rtol of it, or
(a parameter gradient that the run's precision does not resolve: stock's own result over half its size from float64,
or the float64 one under the floor) within the absolute floor of it and not all zeros (``report.float64_verdict``).
Stock's GDN gate gradients can be the inaccurate side: in fp32 on one fresh tiny-moe model 1.5x and 1.9x their own
size from float64, where deltafuse's were 4e-6 off; in bf16 on fresh tiny models 1.2x-1.8x, deltafuse's 0.015-1.0.
The copy takes twice the model's fp32 memory (four times its 16-bit memory) and is made only when a tensor failed;
``result.float64`` says whether it ran or why it could not.

Exit codes: 0 every tensor within tolerance, 1 out of tolerance (and nothing else), 2 verify cannot run as
asked: one line on stderr naming the argument or variable, its value and what is allowed, reported before a
model is built (every ``DELTAFUSE_*`` variable, a forced backend that cannot serve the device, --rtol, --seed,
a local --model's config.json and family), 3 verify itself failed (its traceback is shown).

atol is 1e-6 (fp32) or 1e-3 (16-bit) times the largest |b| over all gradients: a gradient that is small
against the largest one (the GDN decay parameters ``A_log`` and ``dt_bias`` sum terms over every token that
cancel) carries the rounding of the terms it sums, set by the model's scale rather than its own size; on the
tiny models those gradients pass on the floor with rel up to ~1e-2 (CPU fp32) and 0.11 (H200 fp32). The floor also requires
``rel <= 0.5``: without that bound a gradient set to zero passed whenever stock's was below the floor, which in
16-bit runs is the case for the ``A_log`` / ``dt_bias`` gradients of most GDN layers. The stock and the deltafuse
GDN compute the same maths in different orders (chunked WY forms, flattened packing), so fp32 agreement is
to rounding, not bitwise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import torch

# the command line (arguments, help, exit codes) is deltafuse.verify.args, which imports no torch;
# SEED_LIMIT: the batch generator is seeded with seed + 1
from deltafuse.verify.args import SEED_LIMIT, add_arguments, model_problem  # noqa: F401 (add_arguments: API)
# (Comparison: part of this module's API)
from deltafuse.verify.report import F64_SLACK, Comparison, VerifyResult, float64_verdict  # noqa: F401
from deltafuse.verify.report import compare as _compare

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
RTOL = {("cpu", torch.float32): 1e-4, ("cuda", torch.float32): 2e-3,
        ("cpu", torch.bfloat16): 5e-2, ("cuda", torch.bfloat16): 5e-2,
        ("cpu", torch.float16): 1e-2, ("cuda", torch.float16): 1e-2}
ATOL_SCALE = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}

# Packed batch: rows of sequence lengths (B = 2, equal row lengths; a length-1 sequence and one that
# crosses a 64-token chunk boundary are included).
PACKED_ROWS = ((23, 1, 66, 6), (40, 56))
UNPACKED_SHAPE = (2, 70)


class VerifyError(ValueError):
    """verify cannot run as asked (bad model name, dtype or device, deltafuse already applied ...)."""


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _Routing:
    """Top-k routers of a mixture-of-experts model (modules returning (logits, scores, indices)): records
    the experts stock chose per token, then compares (and, when ``pin``, overrides) the deltafuse run's."""

    def __init__(self, model, pin: bool):
        self.routers = [(n, m) for n, m in model.named_modules()
                        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]
        self.pin = pin
        self.mode = None
        self.stock: dict[str, list[torch.Tensor]] = {n: [] for n, _ in self.routers}
        self.cursor: dict[str, int] = {}
        self.counts: dict[str, list[int]] = {n: [0, 0] for n, _ in self.routers}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.routers]

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def start(self, mode: str | None) -> None:
        """``record`` (stock's run), ``compare`` (the deltafuse run: count, and pin when ``pin``), ``pin`` (another
        forward of the same tokens, the logits forward or the float64 run: pin when ``pin``, count nothing) or None
        (hooks idle)."""
        self.mode = mode
        if mode in ("compare", "pin"):
            self.reference = {n: torch.cat(v) if v else None for n, v in self.stock.items()}
            self.cursor = {n: 0 for n in self.stock}

    def _hook(self, name: str):
        def hook(module, args, out):
            if self.mode is None or not (isinstance(out, tuple) and len(out) == 3):
                return None
            logits, scores, idx = out
            # inside backward: a recomputation under gradient checkpointing, of routing already seen
            again = _in_backward()
            if self.mode == "record":
                if not again:
                    self.stock[name].append(idx.detach().clone())
                return None
            ref_all = self.reference[name]
            start = self.cursor[name]
            if again and ref_all is not None and start >= ref_all.shape[0]:
                start = 0
            ref = None if ref_all is None else ref_all[start:start + idx.shape[0]]
            if ref is None or ref.shape != idx.shape:
                raise VerifyError(f"router {name}: the deltafuse run routed {tuple(idx.shape)} tokens but the stock "
                                  f"run(s) recorded {None if ref is None else tuple(ref.shape)} at this point")
            self.cursor[name] = start + idx.shape[0]
            ref = ref.to(idx.device)
            differ = (idx.sort(-1).values != ref.sort(-1).values).any(-1)
            n = int(differ.sum())
            if not again and self.mode == "compare":
                self.counts[name][0] += n
                self.counts[name][1] += idx.shape[0]
            if not (n and self.pin):
                return None
            # the router's own formula (fp32 softmax, top-k renormalised unless norm_topk_prob is False),
            # evaluated at stock's experts for the tokens that differ
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, ref)
            if getattr(module, "norm_topk_prob", True):
                probs = probs / probs.sum(-1, keepdim=True)
            pinned = torch.where(differ[:, None], probs.to(scores.dtype), scores)
            return logits, pinned, torch.where(differ[:, None], ref, idx)

        return hook


def check_model_arg(name_or_path: str, trust_remote_code: bool = False) -> str:
    """The family of ``--model`` (a known name or a local directory), found without building or loading
    the model; VerifyError / FileNotFoundError name the argument, the value and what is allowed."""
    from deltafuse import models

    if os.path.isdir(name_or_path):
        try:
            config = models.check_local_model(name_or_path, trust_remote_code=trust_remote_code)
        except models.LocalModelError as exc:
            raise VerifyError(f"--model {name_or_path!r}: {exc}") from None
        family = models.config_family(config)
        if family is None:
            raise VerifyError(f"--model {name_or_path!r} is a {type(config).__name__} model (model_type "
                              f"{getattr(config, 'model_type', None)!r}); allowed: {models.supported_families()}")
        return family
    if name_or_path in models.NAMED_MODELS:
        return models.NAMED_MODELS[name_or_path].family
    raise VerifyError(model_problem(name_or_path))


def _build(name_or_path: str, device: torch.device, dtype: torch.dtype, seed: int):
    from deltafuse import models

    check_model_arg(name_or_path)
    if os.path.isdir(name_or_path):
        model = models.load_local_model(name_or_path, dtype=dtype, device=device)
    else:
        model = models.build_model(name_or_path, dtype=dtype, device=device, seed=seed)
    family = models.model_family(model)
    if family is None:
        raise VerifyError(f"--model {name_or_path!r} is a {type(model).__name__}; allowed: "
                          f"{models.supported_families()}")
    return model, family


def forced_backend_problems(backend: str, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """op -> why the forced ``backend`` cannot serve verify's training calls on ``device`` / ``dtype``.

    An op whose forced candidate serves only inference (a decoding kernel) is not counted unless it is known
    to be wrong with a backward: a training step does not call it.
    """
    from deltafuse.backends import REGISTRY
    from deltafuse.backends.registry import CallInfo

    if backend == "auto":
        return {}
    problems = {}
    train, infer = CallInfo(device, dtype, True), CallInfo(device, dtype, False)
    for op in sorted(REGISTRY.ops):
        cand = next((c for c in REGISTRY.candidates(op) if c.name == backend), None)
        if cand is None:
            continue
        mine = next(d for d in REGISTRY.explain(op, train, backend) if d.candidate == backend)
        if mine.chosen:
            continue
        decode = next(d for d in REGISTRY.explain(op, infer, backend) if d.candidate == backend)
        if decode.chosen and not cand.known_bad(train):
            continue
        # rejected in both modes: the inference verdict is the device-level reason
        problems[op] = (mine.reason if decode.chosen else decode.reason) or "it cannot serve this call"
    return problems


def _servable_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    from deltafuse.backends.settings import forceable_backends

    return [b for b in forceable_backends() if not forced_backend_problems(b, device, dtype)]


def preflight(name_or_path: str | None, device: torch.device, dtype: torch.dtype, rtol: float | None,
              seed: int) -> str | None:
    """Every check that needs no model: the environment (all DELTAFUSE_* switches), the forced backend
    against the device, the tolerance, the seed, the device, and ``--model`` (its config only). Returns the
    model's family (None when ``name_or_path`` is None). Raises VerifyError / SettingsError /
    FileNotFoundError."""
    from deltafuse.backends import current_backend
    from deltafuse.backends.settings import load_settings
    from deltafuse.maps import PATCHER

    settings = load_settings()  # SettingsError names the variable, the value and what is allowed
    if not settings.patch:
        raise VerifyError("DELTAFUSE_PATCH is off in the environment, so deltafuse cannot be applied; unset it "
                          "(or set it to 1) to verify")
    if rtol is not None:
        check_rtol("rtol", rtol)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise VerifyError(f"seed={seed!r} is not allowed; allowed: an integer 0 <= seed < 2**63 - 1")
    if device.type not in ("cpu", "cuda"):
        raise VerifyError(f"device={str(device)!r} is not supported; allowed: cpu, cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VerifyError("device='cuda' was asked for but torch sees no CUDA device; allowed here: cpu")
    if PATCHER.has_records():
        raise VerifyError("deltafuse is already applied in this process, so no stock run is possible; call "
                          "deltafuse.revert() first")
    backend = current_backend()
    problems = forced_backend_problems(backend, device, dtype)
    if problems:
        reasons = "; ".join(dict.fromkeys(problems.values()))
        what = str(dtype).replace("torch.", "")
        ok = [b for b in _servable_backends(device, dtype) if b != backend]
        on_cuda = device.type != "cuda" and not forced_backend_problems(backend, torch.device("cuda"), dtype)
        raise VerifyError(f"DELTAFUSE_BACKEND={backend!r} cannot serve {', '.join(problems)} on {device} {what} "
                          f"with a backward: {reasons}; allowed for {device.type} {what}: {', '.join(ok)}"
                          + (f" (or --device cuda with {backend})" if on_cuda else ""))
    return None if name_or_path is None else check_model_arg(name_or_path)


def check_rtol(name: str, value) -> float:
    """A tolerance: a finite number > 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise VerifyError(f"{name}={value!r} is not a number; allowed: a finite number > 0") from None
    if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
        raise VerifyError(f"{name}={value!r} is not allowed; allowed: a finite number > 0 (e.g. 1e-4)")
    return number


def _param_grads(model) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters() if p.requires_grad}


def _packed_batch(vocab: int, device, generator):
    rows, pos, labels = [], [], []
    for lengths in PACKED_ROWS:
        ids = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        rows.append(ids)
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
        lab = []
        for seq in ids:
            seq_labels = seq.clone()
            seq_labels[0] = -100
            lab.append(seq_labels)
        labels.append(torch.cat(lab))
    input_ids = torch.stack([torch.cat(r) for r in rows]).to(device)
    return rows, input_ids, torch.stack(pos).to(device), torch.stack(labels).to(device)


def _stock_per_sequence(model, rows, device):
    """Reference for a packed batch: every sequence alone through stock transformers.

    Returns (loss = token-weighted mean of the per-sequence losses, logits laid out like the packed batch);
    gradients of that loss are left in the parameters.
    """
    counts = [len(seq) - 1 for row in rows for seq in row]
    total = sum(counts)
    logits_rows, loss_sum = [], 0.0
    for row in rows:
        parts = []
        for seq in row:
            ids = seq[None].to(device)
            out = model(input_ids=ids, labels=ids if len(seq) > 1 else None, use_cache=False)
            if len(seq) > 1:
                weighted = out.loss * (len(seq) - 1) / total
                weighted.backward()
                loss_sum = loss_sum + weighted.detach()
            else:
                # no next token to predict: contributes no loss, but its logits are compared
                (out.logits.sum() * 0.0).backward()
            parts.append(out.logits.detach())
        logits_rows.append(torch.cat(parts, 1))
    return torch.as_tensor(loss_sum), torch.cat(logits_rows, 0)


def verify_model(name_or_path: str, packed: bool = False, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, seed: int = 0, rtol: float | None = None,
                 model=None) -> VerifyResult:
    """Stock vs deltafuse on one model (named, local directory, or a ready ``model``); see the module doc."""
    from deltafuse import patching

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise VerifyError(f"dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in ATOL_SCALE:
        raise VerifyError(f"dtype={dtype} is not supported; allowed: float32, bfloat16, float16")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise VerifyError(f"device={device!r} is not a device ({exc}); allowed: cpu, cuda") from None
    preflight(None if model is not None else name_or_path, device, dtype, rtol, seed)
    if model is None:
        model, family = _build(name_or_path, device, dtype, seed)
    else:
        from deltafuse.models import model_family

        family = model_family(patching.find_model(model))
    model.train()
    rtol = RTOL[(device.type, dtype)] if rtol is None else float(rtol)

    generator = torch.Generator().manual_seed(seed + 1)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = config.vocab_size

    routing = _Routing(model, pin=dtype in (torch.bfloat16, torch.float16))
    try:
        return _verify(model, name_or_path, family, packed, device, dtype, rtol, generator, vocab, routing)
    finally:
        routing.close()


def _stock_run(model, packed, device, generator, vocab):
    """The reference: (loss, logits, parameter gradients, batch description, the deltafuse run's call, the
    reference's sequences: per-sequence rows when packed, else None)."""
    if packed:
        rows, input_ids, position_ids, labels = _packed_batch(vocab, device, generator)
        batch = {"rows": [list(r) for r in PACKED_ROWS], "position_ids": "restarting at 0, no attention mask"}
        call = dict(input_ids=input_ids, position_ids=position_ids, labels=labels)
    else:
        rows = None
        B, T = UNPACKED_SHAPE
        input_ids = torch.randint(0, vocab, (B, T), generator=generator).to(device)
        call = dict(input_ids=input_ids, labels=input_ids, use_cache=False)
        batch = {"B": B, "T": T}
    return (*_reference(model, call, rows, device), batch, call, rows)


def _reference(model, call, rows, device):
    """Stock's loss, logits and parameter gradients: every sequence of ``rows`` alone, or ``call`` as it is."""
    model.zero_grad(set_to_none=True)
    if rows is not None:
        loss, logits = _stock_per_sequence(model, rows, device)
    else:
        out = model(**call)
        out.loss.backward()
        loss, logits = out.loss.detach(), out.logits.detach()
    return loss, logits, _param_grads(model)


def _settle_with_float64(result: VerifyResult, model, call, rows, device, baseline_applied: bool,
                         ours: dict, stock: dict, dtype: torch.dtype, routing: _Routing) -> None:
    """A float64 run of the stock model decides the tensors that failed both criteria, by ``float64_verdict``:
    each passes ("float64") when deltafuse's result is no farther from the float64 one than F64_SLACK[dtype] times
    stock's, or within rtol of it (``rel`` metric, float64 as the reference), or, as a gradient this precision does
    not resolve, within the floor of it (``result.f64_atol``); where stock's gradients overflowed, also within the
    floor of it while rel <= FLOOR_REL (the floor's own test, which stock's result could not serve). ``ours`` /
    ``stock``: name -> tensor, as compared. In 16 bits the float64 run takes stock's experts (``routing``), as the
    deltafuse run did. The copy costs twice the model's fp32 memory (four times its 16-bit memory), so it runs only
    when needed; where it cannot, ``result.float64`` says why."""
    from deltafuse.integrations.transformers import stock as stock_paths
    from deltafuse.verify.float64 import Float64Everywhere, float64_copy

    failed = [c for c in result.comparisons if not c.ok and c.name in ours]
    if not failed:
        return
    try:
        oracle = float64_copy(model)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        result.float64 = f"a float64 copy of the model could not be made: {type(exc).__name__}: {exc}".splitlines()[0]
        return
    try:
        # FLA / causal-conv1d take no float64: transformers' own pure-torch GDN functions, as the fp32 baseline may
        problems = stock_paths.stock_fast_path_problems(oracle, device, torch.float64, needs_grad=True)
        swap = (stock_paths.stock_torch_baseline(oracle, deltafuse_applied=baseline_applied) if problems
                else contextlib.nullcontext([]))
        routing.start("pin")
        with swap, Float64Everywhere():
            loss, logits, grads = _reference(oracle, call, rows, device)
    except Exception as exc:  # noqa: BLE001 (out of memory, or an op without float64: the failures then stand)
        result.float64 = f"the float64 run failed: {type(exc).__name__}: {exc}".splitlines()[0]
        return
    finally:
        routing.start(None)
        del oracle
    exact = {"loss": loss, "logits": logits, **{f"grad {n}": g for n, g in grads.items()}}
    atol = result.atol
    if not math.isfinite(atol):  # stock's gradients overflowed (fp16): the floor from the float64 run's scale
        atol = ATOL_SCALE[dtype] * max([g.abs().max().item() for g in grads.values() if g is not None] + [0.0])
    result.f64_atol = atol
    for c in failed:
        want = exact.get(c.name)
        if want is None or ours[c.name] is None or stock[c.name] is None:
            continue
        mine, theirs = (_compare(c.name, t, want, 0.0, 0.0) for t in (ours[c.name], stock[c.name]))
        c.f64_rel, c.stock_f64_rel, c.f64_abs = mine.rel, theirs.rel, mine.max_abs
        got = ours[c.name]
        lost = not got.any().item() and mine.ref_max >= torch.finfo(got.dtype).tiny
        verdict = float64_verdict(mine.rel, mine.max_abs, theirs.rel, F64_SLACK[dtype], result.rtol,
                                  atol if c.name.startswith("grad ") else 0.0, mine.ref_max, lost,
                                  floor=not math.isfinite(result.atol))
        if verdict:
            c.ok, c.passed_on = True, "float64"
            c.unresolved, c.f64_floor = verdict == "unresolved", verdict == "floor"
    settled = sum(c.passed_on == "float64" for c in failed)
    result.float64 = f"a float64 run judged {len(failed)} tensor(s) that failed both, {settled} passed"


def _verify(model, name_or_path, family, packed, device, dtype, rtol, generator, vocab, routing) -> VerifyResult:
    import transformers

    from deltafuse import patching
    from deltafuse.integrations.transformers import stock

    settings_report = None
    # stock's own fast path (FLA, causal-conv1d) may not run here (CPU tensors, FLA's Hopper refusal): then
    # the reference is stock transformers with its own pure-torch GDN functions
    problems = stock.stock_fast_path_problems(model, device, dtype, needs_grad=True)
    from deltafuse.maps import PATCHER

    baseline = (stock.stock_torch_baseline(model, deltafuse_applied=PATCHER.has_records()) if problems
                else contextlib.nullcontext([]))
    with baseline as swapped:
        routing.start("record")
        ref_loss, ref_logits, ref_grads, batch, call, rows = _stock_run(model, packed, device, generator, vocab)
    model.zero_grad(set_to_none=True)
    with patching.patched(model, gdn=True) as settings_report:
        if not settings_report.enabled:  # preflight refuses this; the environment changed since
            raise VerifyError("DELTAFUSE_PATCH is off in the environment, so deltafuse cannot be applied; "
                              "unset it (or set it to 1) to verify")
        routing.start("compare")
        out = model(**call)
        out.loss.backward()
        logits = out.logits
        if logits is None:
            # the fused loss (fused_ops) returns no logits when training; an evaluation call returns them, its
            # tokens routed as the compared run's were (in 16 bits pinned to stock's experts) and not counted again
            routing.start("pin")
            with torch.no_grad():
                logits = model(**call).logits
        routing.start(None)
    loss, logits = out.loss.detach(), logits.detach()
    grads = _param_grads(model)
    model.zero_grad(set_to_none=True)

    grad_scale = max([g.abs().max().item() for g in ref_grads.values() if g is not None] + [0.0])
    atol = ATOL_SCALE[dtype] * max(grad_scale, 1e-30)
    result = VerifyResult(model=name_or_path, family=family, packed=packed, device=str(device),
                          dtype=str(dtype).replace("torch.", ""), rtol=rtol, atol=atol,
                          transformers=transformers.__version__, batch=batch,
                          patch_rows=len(settings_report.applied) if settings_report else 0,
                          routing={n: list(c) for n, c in routing.counts.items()}, routing_pinned=routing.pin,
                          baseline="stock-torch" if swapped else "stock", baseline_swapped=list(swapped),
                          baseline_reason="; ".join(dict.fromkeys(problems.values())) if swapped else "",
                          grad_scale=grad_scale, atol_scale=ATOL_SCALE[dtype])
    result.comparisons.append(_compare("loss", loss, ref_loss, rtol, 0.0))
    result.comparisons.append(_compare("logits", logits, ref_logits, rtol, 0.0))
    for name, ref in ref_grads.items():
        result.comparisons.append(_compare(f"grad {name}", grads.get(name), ref, rtol, atol))
    ours = {"loss": loss, "logits": logits, **{f"grad {n}": g for n, g in grads.items()}}
    theirs = {"loss": ref_loss, "logits": ref_logits, **{f"grad {n}": g for n, g in ref_grads.items()}}
    _settle_with_float64(result, model, call, rows, device, PATCHER.has_records(), ours, theirs, dtype, routing)
    return result


# exit codes: 0 every tensor within tolerance, 1 out of tolerance, 2 verify cannot run as asked (one line on
# stderr), 3 verify itself failed (a bug: the traceback is shown)
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CRASH = 0, 1, 2, 3


def run(args) -> int:
    """0 when every tensor is within tolerance, 1 when one is not, 2 when verify cannot run as asked, 3 when
    verify itself failed (with the traceback)."""
    from deltafuse.backends import BackendError
    from deltafuse.config import SettingsError
    from deltafuse.models import UnknownModelError

    try:
        result = verify_model(args.model, packed=args.packed, device=args.device, dtype=args.dtype,
                              seed=args.seed, rtol=args.rtol)
    except (VerifyError, SettingsError, FileNotFoundError, UnknownModelError, BackendError) as exc:
        # BackendError: a forced backend (or this device) cannot serve an op; the message names the op,
        # the device and every candidate's reason
        print(f"deltafuse verify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:
        import traceback

        traceback.print_exc()
        print("deltafuse verify: internal error (the traceback is above); exit code 3, not a verdict",
              file=sys.stderr)
        return EXIT_CRASH
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format())
    return EXIT_PASS if result.ok else EXIT_FAIL
