"""Shared pytest setup for every test file. Keep this minimal and general.

Triton decides at import time whether ``@triton.jit`` kernels run through its CPU interpreter, so
``TRITON_INTERPRET`` must be set before anything imports triton; conftest.py is imported first.
``setdefault`` keeps an explicit choice (e.g. ``TRITON_INTERPRET=0`` to test compiled kernels on a GPU).
OpenMP's idle threads spin by default; on a busy 2-core machine that made a tiny model's step ~20x slower,
so tests let them sleep (``OMP_WAIT_POLICY=PASSIVE``, read when torch loads OpenMP).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
