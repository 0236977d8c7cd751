"""Test setup: run the Triton kernels in the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before ``ucm.kernels.triton_copy`` imports triton (the
``@triton.jit`` decorator decides then); nox sets it, this covers a bare ``pytest`` run.
Hypothesis settings are applied per test (a global profile would leak into the other
packages' tests of the same run).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
