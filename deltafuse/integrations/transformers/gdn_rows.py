"""The GDN rows every family shares, built from the family's class names.

Old design (transformers 5.2-5.14, module defines ``is_fast_path_available``): the FLA / causal-conv1d names
are module globals read once by the ``*GatedDeltaNet.__init__``, which caches them on the instance.
New design (5.15+): the layer's forward looks up the decorated module functions by name at call time.
Both: the text model's forward derives packed-sequence boundaries, the GDN forward holds them for its ops; in
the old design the decoder layer's forward also holds them for its ``linear_attn`` (5.2-5.8 do not forward the
decoder layer's keywords to it). ``packing.py`` describes the route.
"""

from __future__ import annotations

from deltafuse.integrations.transformers import adapters as a
from deltafuse.integrations.transformers import packing as p
from deltafuse.integrations.transformers.patcher import Route

# What an old-design GDN layer caches in __init__: attribute -> (deltafuse's adapter, the module globals the
# stock __init__ reads it from, first non-None wins).
CACHED_OPS = {
    "chunk_gated_delta_rule": (a.chunk_gated_delta_rule, ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule")),
    "recurrent_gated_delta_rule": (a.recurrent_gated_delta_rule,
                                   ("fused_recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
    "causal_conv1d_fn": (a.causal_conv1d_fn, ("causal_conv1d_fn",)),
    "causal_conv1d_update": (a.causal_conv1d_update, ("causal_conv1d_update", "torch_causal_conv1d_update")),
}


def gdn_routes(gdn: str, text_model: str, decoder_layer: str) -> tuple[Route, ...]:
    """The gated delta rule and causal conv1d rows for a family whose GDN layer class is ``gdn``, whose
    decoder stack (the module that receives ``position_ids``) is ``text_model`` and whose decoder layer (which
    holds the GDN layer as ``linear_attn``) is ``decoder_layer``."""
    return (
        # old design: module globals (models built after apply) ...
        Route("gdn", "global", "", "chunk_gated_delta_rule", a.chunk_gated_delta_rule, design="old"),
        Route("gdn", "global", "", "fused_recurrent_gated_delta_rule", a.recurrent_gated_delta_rule,
              design="old"),
        Route("gdn", "global", "", "causal_conv1d_fn", a.causal_conv1d_fn, design="old"),
        Route("gdn", "global", "", "causal_conv1d_update", a.causal_conv1d_update, design="old"),
        Route("gdn", "global", "", "FusedRMSNormGated", None, design="old",
              note="FLA's norm is built on torch.cuda.current_device(); models built after apply use "
                   "the torch one", note_if="FusedRMSNormGated"),
        # ... and what built models cached in __init__
        *(Route("gdn", "instance", gdn, attr, op, design="old", init_from=sources)
          for attr, (op, sources) in CACHED_OPS.items()),
        # new design: module functions looked up at call time
        Route("gdn", "global", "", "torch_chunk_gated_delta_rule", a.chunk_gated_delta_rule, design="new"),
        Route("gdn", "global", "", "torch_recurrent_gated_delta_rule", a.recurrent_gated_delta_rule,
              design="new"),
        Route("gdn", "global", "", "causal_conv1d_fn", a.causal_conv1d_fn, design="new"),
        Route("gdn", "global", "", "causal_conv1d_update", a.causal_conv1d_update, design="new"),
        # packed sequences, both designs
        Route("gdn", "class", text_model, "forward", p.wrap_text_model_forward, wrap=True),
        # old design only: 5.2-5.8 do not pass the decoder layer's keywords to linear_attn (5.9+ do). Newer
        # releases checkpoint the class's own forward and check its identity ("outermost"): a wrapper there
        # would silently turn gradient checkpointing off.
        Route("gdn", "class", decoder_layer, "forward", p.wrap_decoder_layer_forward, wrap=True, design="old"),
        Route("gdn", "class", gdn, "forward", p.wrap_gdn_forward, wrap=True),
    )
