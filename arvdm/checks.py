"""When to run value checks (ranges, consistency) that read tensor values back to the host.

Shape and dtype checks are free and always run. A *value* check (``int(levels.max()) > K``) needs the
tensor's values on the host: on a GPU that is a host-device synchronisation that stalls the launch queue
(and breaks ``torch.compile``'s graph), so the hot path (model forward, per-call transitions, the kernels)
must not do it on every call. The rule:

    ARVDM_DEBUG_CHECKS=1   value checks everywhere (debugging: slow on a GPU)
    ARVDM_DEBUG_CHECKS=0   no value checks on the hot path, on any device
    unset (default)        value checks on CPU tensors only: there reading a value costs no device sync

and never while ``torch.compile`` traces (a check would break the graph). API entry points that run once
per rollout or per batch (``pipeline.rollout``, the schedules, the data loader) check their inputs always.
"""

from __future__ import annotations

import os

import torch

__all__ = ["DEBUG_CHECKS_ENV_VAR", "value_checks_enabled"]

DEBUG_CHECKS_ENV_VAR = "ARVDM_DEBUG_CHECKS"


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether a hot-path function should check the values of ``t`` (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    env = os.environ.get(DEBUG_CHECKS_ENV_VAR, "").strip()
    if env == "1":
        return True
    if env == "0":
        return False
    if env:
        raise ValueError(f"environment variable {DEBUG_CHECKS_ENV_VAR}={env!r}: expected 1, 0 or unset")
    return t.device.type == "cpu"
