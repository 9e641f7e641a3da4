"""Process settings a CLI makes once, first thing, before torch starts its thread pool.

    from arvdm.runtime import setup_environment
    setup_environment()      # first line of every CLI's main(), before anything imports torch

Importing this module loads nothing heavy (``arvdm/__init__.py`` is empty), so a CLI can call it first.
"""

from __future__ import annotations

import contextlib
import os

# Values a CLI sets unless the user's environment already does (the user's wins).
THREAD_ENVIRONMENT = {
    # Idle OpenMP threads spin-wait by default; on a CPU shared with other jobs that made a tiny model's
    # training step many times slower (benchmarks/RESULTS.md). Read when torch loads OpenMP.
    "OMP_WAIT_POLICY": "PASSIVE",
}


def setup_environment() -> dict[str, str]:
    """Set the thread/OpenMP environment (`THREAD_ENVIRONMENT`, user values win); returns what is in effect.

    Call before torch is imported: OpenMP reads these variables once, when it starts.
    """
    for key, value in THREAD_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in THREAD_ENVIRONMENT}


def native_bf16(device) -> bool:
    """Whether `device` computes bf16 natively, so that bf16 autocast speeds training up rather than down.

    CUDA: yes. CPU: only with AVX512-BF16 or AMX (oneDNN's bf16 kernels; measured 1.45x faster training steps
    on the tiny preset, benchmarks/RESULTS.md); without them bf16 is emulated and slower than fp32.
    """
    import torch  # here, not at the top: this module is imported before torch starts (setup_environment)

    kind = torch.device(device).type
    if kind == "cuda":
        return True
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # private: a torch upgrade may move it
    return kind == "cpu" and supported is not None and bool(supported())


@contextlib.contextmanager
def bf16_autocast(device):
    """bf16 autocast on `device` (for a device where `native_bf16` holds).

    On the CPU attention also takes PyTorch's math path: its flash kernel is slower in bf16 than in fp32 for
    the short sequences of these models (64 tokens a frame, ~10 frames; forward + backward 34 vs 12 ms in
    bf16 vs fp32, 15 ms on the math path), which cost a tenth of the tiny preset's step.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = torch.device(device).type
    with torch.autocast(kind, dtype=torch.bfloat16):
        if kind == "cpu":
            with sdpa_kernel([SDPBackend.MATH]):
                yield
        else:
            yield
