from deltafuse.ops.rope.api import apply_rotary_pos_emb

__all__ = ["apply_rotary_pos_emb"]
