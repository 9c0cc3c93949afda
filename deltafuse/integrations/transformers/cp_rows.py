"""The context-parallel rows (switch ``context_parallel``), built from a family's class names.

``apply(model, context_parallel=group)`` applies them (they need the ``gdn`` and ``fused_ops`` rows, which
``apply`` then requires): layer 1 over the plain rows of the same targets, whose values they wrap (forwards and
the ``sdpa`` attention function) or replace with op adapters that call the plain ones (``cp_adapters.py``).
A model's calls reach context parallelism only through them, so a process that never asked for it runs none of
its checks. Old design (5.2-5.14): the op rows cover the module globals and what built GDN layers cached in
``__init__`` (``gdn_rows.CACHED_OPS``); new design (5.15+): the module functions looked up at call time.
"""

from __future__ import annotations

from deltafuse.integrations.transformers import cp_adapters as c
from deltafuse.integrations.transformers.fused_rows import ATTENTION_MAPPING
from deltafuse.integrations.transformers.gdn_rows import CACHED_OPS
from deltafuse.integrations.transformers.patcher import Route

SWITCH = "context_parallel"

# the GDN layer's cached ops a shard's call reaches (attribute -> context-parallel op adapter)
CACHED_CP_OPS = {
    "chunk_gated_delta_rule": c.chunk_gated_delta_rule,
    "recurrent_gated_delta_rule": c.recurrent_gated_delta_rule,
    "causal_conv1d_fn": c.causal_conv1d_fn,
}


def _row(kind: str, owner: str, attr: str, replacement, **kwargs) -> Route:
    return Route(SWITCH, kind, owner, attr, replacement, layer=1, **kwargs)


def context_parallel_routes(gdn: str, text_model: str, causal_lm: str, attention: str) -> tuple[Route, ...]:
    """The rows for a family whose GDN layer class is ``gdn``, decoder stack ``text_model``, causal LM
    ``causal_lm`` and full attention layer ``attention`` (the classes of its ``gdn`` and ``fused_ops`` rows)."""
    return (
        # old design: module globals (models built after apply) ...
        _row("global", "", "chunk_gated_delta_rule", c.chunk_gated_delta_rule, design="old"),
        _row("global", "", "fused_recurrent_gated_delta_rule", c.recurrent_gated_delta_rule, design="old"),
        _row("global", "", "causal_conv1d_fn", c.causal_conv1d_fn, design="old"),
        # ... and what built models cached in __init__
        *(_row("instance", gdn, attr, op, design="old", init_from=CACHED_OPS[attr][1])
          for attr, op in CACHED_CP_OPS.items()),
        # new design: module functions looked up at call time
        _row("global", "", "torch_chunk_gated_delta_rule", c.chunk_gated_delta_rule, design="new"),
        _row("global", "", "torch_recurrent_gated_delta_rule", c.recurrent_gated_delta_rule, design="new"),
        _row("global", "", "causal_conv1d_fn", c.causal_conv1d_fn, design="new"),
        # both designs
        _row("class", text_model, "forward", c.wrap_text_model_forward, wrap=True),
        _row("class", gdn, "forward", c.wrap_gdn_forward, wrap=True),
        _row("class", causal_lm, "forward", c.wrap_causal_lm_forward, wrap=True),
        _row("mapping", attention, "sdpa", c.wrap_sdpa_attention, wrap=True, mapping=ATTENTION_MAPPING),
    )
