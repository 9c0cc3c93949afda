"""Ascend NPU route for the MoE experts through ``torch_npu.npu_grouped_matmul``.

NOT RUN ON NPU HARDWARE. The argument mappings below come from Ascend's torch_npu / aclnnGroupedMatmul
documentation and from how MindSpeed / MindSpeed-MM call the op; they were verified only against a stand-in
``torch_npu`` (tests/ops/test_moe.py) that implements the documented semantics with plain torch loops.

The autograd Function, routing plan, SiLU * up and un-permute are the torch reference's (``_MoeExperts``);
only its two grouped matmuls are replaced:

- ``mm(x [S, K], w [E, K, M], offs)``: ``npu_grouped_matmul([x], [w], group_list=offs (int64),
  split_item=3, group_type=0, group_list_type=0)[0]``: one x split along its rows (the M axis) by the
  cumulative group ends, one 3-D weight, one [S, M] output. ``w`` is often a transposed view of the expert
  parameter (documented as supported for non-quantised weights by aclnnGroupedMatmulV3 and later, and passed
  that way by MindSpeed-MM); no copy is made here.
- ``wgrad(a [S, P], b [S, Q], offs)``: ``npu_grouped_matmul([a.t()], [b], group_list=offs (int64),
  split_item=3, group_type=2, group_list_type=0)[0]`` -> [E, P, Q], one a_e^T b_e per group (group_type=2
  splits the K axis, here the S rows). What the kernel writes for an empty group is not documented, so the
  experts that received no token are zeroed explicitly afterwards.

Documented limits that this route cannot check without hardware: fp32 inputs are listed only for Atlas A2/A3
parts with single-tensor x/weight/y (fp16 and bf16 elsewhere), and some releases cap the number of groups
(128 in older documentation; Qwen3.5-35B-A3B has 256 experts).
"""

from __future__ import annotations

import torch

from deltafuse.ops.moe.reference import ExpertKernels, run_experts


class _NpuMatmuls(ExpertKernels):
    """The kernels of ``_MoeExperts`` with the grouped matmuls through torch_npu.npu_grouped_matmul (the
    per-token sums and the activation step are the reference's torch ones)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts

    def mm(self, x, w, offs):
        """x [S, K] @ w[e] ([K, M], possibly a transposed view) per group of rows -> [S, M]."""
        import torch_npu

        return torch_npu.npu_grouped_matmul([x], [w], group_list=offs.to(torch.int64), split_item=3,
                                            group_type=0, group_list_type=0)[0]

    def wgrad(self, a, b, offs):
        """sum over each group's rows of a[s]^T b[s]: a [S, P], b [S, Q] -> [E, P, Q]; empty groups are 0."""
        import torch_npu

        out = torch_npu.npu_grouped_matmul([a.t()], [b], group_list=offs.to(torch.int64), split_item=3,
                                           group_type=2, group_list_type=0)[0]
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        return torch.where((counts > 0).view(-1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def moe_experts_npu(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """The torch reference's autograd Function with its grouped matmuls on torch_npu.npu_grouped_matmul."""
    return run_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                       lambda: _NpuMatmuls(gate_up_proj.shape[0]))
