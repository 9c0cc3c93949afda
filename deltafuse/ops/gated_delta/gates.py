"""FLA's in-kernel gate options, ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel``, as the GDN ops hand them
to an implementation.

With ``gate`` the op's ``g`` is the raw gate ``a`` and the log-space decay is ``-exp(A_log) * softplus(a + dt_bias)``
(A_log and dt_bias [HV], dt_bias optional), in fp32; with ``beta_sigmoid`` the op's ``beta`` holds logits and
``beta = sigmoid(beta)`` in fp32. Both are differentiable: A_log and dt_bias get gradients.

An implementation that computes them inside its kernels says so with a true attribute ``gates_in_kernel`` and takes
them as the keyword ``gates=Gates(...)``; every other one is given g and beta from ``in_torch`` (inside the op, so
that autograd records them as it records the backend).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Gates(NamedTuple):
    A_log: torch.Tensor | None  # [HV]; read when ``gate``
    dt_bias: torch.Tensor | None  # [HV] or None; read when ``gate``
    gate: bool  # g is the raw gate a: g = -exp(A_log) * softplus(a + dt_bias)
    beta_sigmoid: bool  # beta is logits: beta = sigmoid(beta)

    @property
    def any(self) -> bool:
        return self.gate or self.beta_sigmoid


NONE = Gates(None, None, False, False)


def in_torch(g: torch.Tensor, beta: torch.Tensor, gates: Gates) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) with the options of ``gates`` applied, in fp32 where an option applies (FLA's formulas; torch's
    softplus: x itself above 20)."""
    if gates.gate:
        x = g.float()
        if gates.dt_bias is not None:
            x = x + gates.dt_bias.float()
        g = -gates.A_log.float().exp() * torch.nn.functional.softplus(x)
    if gates.beta_sigmoid:
        beta = beta.float().sigmoid()
    return g, beta
