"""The flags of FLA 0.6's Hopper guard; the stand-in is 'on Hopper' when DELTAFUSE_TEST_FAKE_HOPPER=1."""

import os

IS_NVIDIA_HOPPER = os.environ.get("DELTAFUSE_TEST_FAKE_HOPPER") == "1"
TRITON_ABOVE_3_4_0 = True
TRITON_ABOVE_3_7_1 = False


def check_backward():
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        raise RuntimeError(
            "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for "
            "gated chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1 or "
            "install tilelang: `pip install tilelang`"
        )
