from deltafuse.ops.cross_entropy import candidates  # noqa: F401  (registers the op's candidates first)
from deltafuse.ops.cross_entropy.api import TokenLogProbs, fused_linear_cross_entropy, token_logprobs

__all__ = ["TokenLogProbs", "fused_linear_cross_entropy", "token_logprobs"]
