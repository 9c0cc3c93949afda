from deltafuse.ops.rope import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.rope.api import apply_rotary_pos_emb

__all__ = ["apply_rotary_pos_emb"]
