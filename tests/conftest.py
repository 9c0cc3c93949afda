"""Without CUDA, deltafuse's Triton kernels are tested through the Triton interpreter (fp32, tiny shapes).

TRITON_INTERPRET must be set before triton is first imported, so it is set here, before any test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
