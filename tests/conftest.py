"""Shared pytest setup for every test file. Keep this minimal and general.

Triton decides at import time whether ``@triton.jit`` kernels run through its CPU interpreter, so
``TRITON_INTERPRET`` must be set before anything imports triton; conftest.py is imported first.
``setdefault`` keeps an explicit choice (e.g. ``TRITON_INTERPRET=0`` to test compiled kernels on a GPU).
OpenMP's idle threads spin by default; on a busy 2-core machine that made a tiny model's step ~20x slower,
so tests let them sleep (``OMP_WAIT_POLICY=PASSIVE``, read when torch loads OpenMP).
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Test tensors are tiny: on a shared 2-core machine intra-op threads cost far more than they give
    (7-40x slower in our measurements), so every test runs torch on one thread."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
