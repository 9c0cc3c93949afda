"""The implementations ``deltafuse bench ops`` times for each op: deltafuse's public op, the stock transformers
code for the same computation, and Liger-Kernel / flash-linear-attention / causal-conv1d where they have it."""

from __future__ import annotations

import contextlib

import torch

from deltafuse import backends
from deltafuse.backends import probes
from deltafuse.bench import cases
from deltafuse.bench.cases import Sizes

CHUNK_GDN = "chunk_gated_delta_rule"


@contextlib.contextmanager
def lifted_fla_hopper_guard(lift: bool):
    """Inside the block, FLA's Hopper guard (``fla.ops.common.chunk_o.IS_NVIDIA_HOPPER``) is off when ``lift``
    and FLA is installed, so its GDN backward can be timed where it refuses it; restored on exit."""
    chunk_o = None
    if lift and probes.import_error("fla.ops.common.chunk_o") is None:
        import fla.ops.common.chunk_o as chunk_o
    if chunk_o is None or not hasattr(chunk_o, "IS_NVIDIA_HOPPER"):
        yield
        return
    saved = chunk_o.IS_NVIDIA_HOPPER
    chunk_o.IS_NVIDIA_HOPPER = False
    try:
        yield
    finally:
        chunk_o.IS_NVIDIA_HOPPER = saved

def _stock_module():
    import importlib

    return importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")


def _stock_conv_fallback(x, weight, bias=None, activation=None):
    """What the GDN layer of the older design (transformers < 5.15) runs without causal-conv1d:
    F.silu(self.conv1d(x)[..., :T]) with the layer's depthwise Conv1d (padding W-1)."""
    out = torch.nn.functional.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[1] - 1,
                                     groups=x.shape[1])[..., : x.shape[-1]]
    return torch.nn.functional.silu(out) if activation is not None else out


def _stock_fn(name: str):
    """transformers' own torch path for ``name``, in either modeling design."""
    module = _stock_module()
    fn = getattr(module, name, None)
    if fn is None and name == "causal_conv1d_fn":
        return _stock_conv_fallback  # older design: the global is None and the layer calls its Conv1d
    if fn is None and name == "causal_conv1d_update":
        fn = module.torch_causal_conv1d_update  # older design: the layer's fallback
    return getattr(fn, "__wrapped__", fn)  # the torch path under the kernel-hub decorator


def _gdn_call(fn, style: str):
    def call(t):
        q, k = t["q"], t["k"]
        HV = t["v"].shape[2]
        if style == "stock_repeat" and q.shape[2] != HV:
            q, k = (x.repeat_interleave(HV // x.shape[2], dim=2) for x in (q, k))
        out = fn(q, k, t["v"], g=t["g"], beta=t["beta"], initial_state=t["initial_state"],
                 output_final_state=t["initial_state"] is not None, use_qk_l2norm_in_kernel=True)
        return out[0]

    return call


def implementations(op: str, device: torch.device, fla_unguarded: bool) -> list[tuple[str, object, str]]:
    """(name, callable(inputs) -> output tensor, note) for every implementation that can be tried here."""
    import deltafuse.ops as dops

    impls = []
    gdn = op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
    if gdn:
        impls.append(("deltafuse", _gdn_call(getattr(dops, op), "fla"), ""))
        stock_name = ("torch_chunk_gated_delta_rule" if op == "chunk_gated_delta_rule"
                      else "torch_recurrent_gated_delta_rule")
        from transformers import __version__ as tv

        style = "fla" if probes.version_tuple(tv) >= (5, 23) else "stock_repeat"
        impls.append(("transformers torch", _gdn_call(_stock_fn(stock_name), style), ""))
        if device.type == "cuda" and probes.import_error("fla.ops.gated_delta_rule") is None:
            import fla.ops.gated_delta_rule as fla_gdr

            note = ""
            if fla_unguarded and op == CHUNK_GDN:
                import fla.ops.common.chunk_o as chunk_o

                if getattr(chunk_o, "IS_NVIDIA_HOPPER", False):  # bench_one lifts it around the timing
                    note = "FLA's Hopper guard set off for timing (its backward is wrong on this stack)"
            impls.append(("fla", _gdn_call(getattr(fla_gdr, op), "fla"), note))
        return impls
    # the CUDA package causal-conv1d, when it is installed and the tensors are on a GPU
    cc1d = None
    if device.type == "cuda" and probes.import_error("causal_conv1d") is None:
        import causal_conv1d as cc1d
    if op == "causal_conv1d_fn":
        impls.append(("deltafuse", lambda t: dops.causal_conv1d_fn(t["x"], t["weight"], t["bias"],
                                                                  activation="silu"), ""))
        stock = _stock_fn("causal_conv1d_fn")
        impls.append(("transformers torch", lambda t: stock(t["x"], t["weight"], t["bias"], activation="silu"), ""))
        if cc1d is not None:
            impls.append(("causal-conv1d", lambda t: cc1d.causal_conv1d_fn(
                t["x"], t["weight"], t["bias"], activation="silu"), ""))
        return impls
    # causal_conv1d_update mutates conv_state: every call gets its own copy (the copy is timed for all alike)
    impls.append(("deltafuse", lambda t: dops.causal_conv1d_update(t["x"], t["conv_state"].clone(), t["weight"],
                                                                   t["bias"], activation="silu"), ""))
    stock = _stock_fn("causal_conv1d_update")
    impls.append(("transformers torch", lambda t: stock(t["x"], t["conv_state"].clone(), t["weight"], t["bias"],
                                                        activation="silu"), ""))
    if cc1d is not None:
        impls.append(("causal-conv1d", lambda t: cc1d.causal_conv1d_update(
            t["x"], t["conv_state"].clone(), t["weight"], t["bias"], activation="silu"), ""))
    return impls


def _stock(fn):
    """The stock code under deltafuse's patch wrapper (when one is applied) and transformers' decorators."""
    while True:
        inner = getattr(fn, "__deltafuse_wraps__", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner


def _holder(cls, *args, params=("weight",)):
    """An instance of the stock module ``cls`` (built on the meta device) whose parameters ``params`` are
    plain attributes, so every call can hand it the benchmark's tensors (and their gradients)."""
    with torch.device("meta"):
        module = cls(*args)
    for name in params:
        delattr(module, name)
    return module


def _liger(make, *args):
    """Liger's implementation from ``make(*args)``, or the reason it is not there."""
    try:
        return make(*args), ""
    except Exception as exc:  # not installed or broken: said in the output, not fatal
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def sized_implementations(op: str, s: Sizes, device: torch.device) -> list[tuple[str, object, str]]:
    """(name, callable(inputs) -> output tensor or tuple, note) of every implementation of a ``SIZED_DIMS`` op."""
    import deltafuse.ops as dops


    hf = _stock_module()
    liger = device.type == "cuda" and probes.import_error("liger_kernel") is None  # a row only when it imports
    impls = []
    if op == "rms_norm_zero_centered":
        impls.append(("deltafuse", lambda t: dops.rms_norm_zero_centered(t["x"], t["weight"], s.eps), ""))
        norm, forward = _holder(hf.Qwen3_5RMSNorm, s.hidden, s.eps), _stock(hf.Qwen3_5RMSNorm.forward)

        def stock_norm(t):
            norm.weight = t["weight"]
            return forward(norm, t["x"])

        impls.append(("transformers Qwen3_5RMSNorm", stock_norm, ""))
        if liger:
            lnorm, why = _liger(cases.liger_rms_norm, s.hidden, s.eps)
            if lnorm is not None:
                del lnorm.weight  # set per call, as for the stock module

            def liger_norm(t):
                lnorm.weight = t["weight"]
                return lnorm(t["x"])

            impls.append(("liger LigerRMSNorm", lnorm and liger_norm, why))
    elif op == "rms_norm_gated":
        impls.append(("deltafuse", lambda t: dops.rms_norm_gated(t["x"], t["gate"], t["weight"], s.eps), ""))
        gnorm = _holder(hf.Qwen3_5RMSNormGated, s.linear_value_head_dim, s.eps)
        forward = _stock(hf.Qwen3_5RMSNormGated.forward)

        def stock_gated(t):
            gnorm.weight = t["weight"]
            return forward(gnorm, t["x"], t["gate"])

        impls.append(("transformers Qwen3_5RMSNormGated", stock_gated, ""))
    elif op == "apply_rotary_pos_emb":
        impls.append(("deltafuse", lambda t: dops.apply_rotary_pos_emb(t["q"], t["k"], t["cos"], t["sin"]), ""))
        rope = _stock(hf.apply_rotary_pos_emb)
        impls.append(("transformers apply_rotary_pos_emb", lambda t: rope(t["q"], t["k"], t["cos"], t["sin"]), ""))
        if liger:
            lrope, why = _liger(cases.liger_partial_rope, s.rotary_dim)
            impls.append(("liger rotary slice + cat", lrope and (lambda t: lrope(t["q"], t["k"], t["cos"], t["sin"])),
                          why))
    elif op == "swiglu":
        from transformers.activations import ACT2FN

        act = ACT2FN["silu"]  # the Qwen3.5 MLPs' act_fn (hidden_act "silu")
        impls.append(("deltafuse", lambda t: dops.swiglu(t["gate"], t["up"]), ""))
        impls.append(("transformers act_fn(gate) * up", lambda t: act(t["gate"]) * t["up"], ""))
        if liger:
            lswiglu, why = _liger(cases.liger_swiglu)
            impls.append(("liger LigerSiLUMulFunction", lswiglu and (lambda t: lswiglu(t["gate"], t["up"])), why))
    elif op == "fused_linear_cross_entropy":
        from transformers.loss.loss_utils import ForCausalLMLoss

        impls.append(("deltafuse", lambda t: dops.fused_linear_cross_entropy(t["hidden"], t["weight"], t["labels"]),
                      ""))
        impls.append(("transformers lm_head + ForCausalLMLoss", lambda t: ForCausalLMLoss(
            torch.nn.functional.linear(t["hidden"], t["weight"]), t["labels"], s.vocab), ""))
        if liger:
            lce, why = _liger(cases.liger_fused_linear_cross_entropy)
            impls.append(("liger LigerFusedLinearCrossEntropyLoss",
                          lce and (lambda t: lce(t["hidden"], t["weight"], t["labels"])), why))
    elif op == "token_logprobs":  # log-probs and entropy (is_top1 too, as TRL's SFT asks; not differentiable)
        fields = ("log_probs", "entropy", "is_top1")
        impls.append(("deltafuse", lambda t: tuple(dops.token_logprobs(t["hidden"], t["weight"], t["targets"],
                                                                       outputs=fields)[:2]), ""))

        def full_logits(t):
            logp = torch.nn.functional.linear(t["hidden"], t["weight"]).float().log_softmax(-1)
            return logp.gather(-1, t["targets"][:, None])[:, 0], -(logp.exp() * logp).sum(-1)

        impls.append(("full logits + log_softmax", full_logits, ""))
        if probes.import_error("trl") is None:
            trl = cases.trl_token_logprobs(fields)
            impls.append(("trl ChunkedLogProbFunction", lambda t: trl(t["hidden"], t["weight"], t["targets"]), ""))
    elif op == "moe_experts":
        from transformers.integrations.moe import grouped_mm_experts_forward
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        impls.append(("deltafuse", lambda t: dops.moe_experts(t["hidden"], t["top_k_index"], t["top_k_weights"],
                                                              t["gate_up_proj"], t["down_proj"]), ""))
        config = Qwen3_5MoeTextConfig(hidden_size=s.hidden, moe_intermediate_size=s.moe_intermediate,
                                      num_experts=s.num_experts, num_experts_per_tok=s.experts_per_token)
        experts = _holder(hf_moe.Qwen3_5MoeExperts, config, params=("gate_up_proj", "down_proj"))

        def stock_experts(forward):
            def call(t):
                experts.gate_up_proj, experts.down_proj = t["gate_up_proj"], t["down_proj"]
                return forward(experts, t["hidden"], t["top_k_index"], t["top_k_weights"])

            return call

        impls.append(("transformers experts grouped_mm", stock_experts(grouped_mm_experts_forward), ""))
        impls.append(("transformers experts eager", stock_experts(_stock(hf_moe.Qwen3_5MoeExperts.forward)), ""))
    else:
        raise KeyError(op)
    return impls


def _first_float(inputs: dict) -> torch.Tensor:
    return next(t for t in inputs.values() if isinstance(t, torch.Tensor) and t.is_floating_point())


def selected_backend(op: str, inputs: dict, needs_grad: bool) -> str:
    first = _first_float(inputs)
    call = backends.CallInfo(first.device, first.dtype, needs_grad)
    chosen = [d.candidate for d in backends.REGISTRY.explain(op, call, backends.current_backend()) if d.chosen]
    return chosen[0] if chosen else "none"
