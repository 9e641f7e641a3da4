"""The one check of each setting that a config key and a CLI flag share (sampling's η, guidance weights, the
low-frequency anchor): `Config.validate` calls them with `ConfigError` and the key's name, the CLIs and
`pipeline.rollout` with `SamplingError` and the flag's name, so both refuse the same values with the same words.

    check_eta(0.5, "--eta", SamplingError)      # -> 0.5
    check_guidance(float("nan"), "--history-guidance", SamplingError)   # raises, naming the flag
"""

from __future__ import annotations

import math
from typing import Any

from arvdm.errors import ArvdmError, ConfigError

__all__ = ["as_number", "check_anchor_floor", "check_anchor_sigma", "check_eta", "check_guidance", "parse_anchor_runs"]


def as_number(value: Any) -> float:
    """float(value); NaN for what is not a number, bools included (float() would take them as 0 / 1)."""
    try:
        return float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return float("nan")


def check_eta(eta: Any, name: str, error: type[ArvdmError] = ConfigError) -> float:
    """The one check of DDIM's stochasticity: a number in [0, 1] (0 = DDIM, 1 = DDPM-like); NaN is refused."""
    if not 0.0 <= (value := as_number(eta)) <= 1.0:
        raise error(f"{name} must be in [0, 1] (0 = DDIM, 1 = DDPM-like), got {eta!r}")
    return value


def check_guidance(weight: Any, name: str, error: type[ArvdmError] = ConfigError) -> float:
    """The one check of a guidance weight W (history or actions): a finite number (0 = none; NaN / inf refused)."""
    if not math.isfinite(value := as_number(weight)):
        raise error(f"{name} must be a finite number (0 = no guidance), got {weight!r}")
    return value


def check_anchor_sigma(sigma: Any, name: str, error: type[ArvdmError] = ConfigError) -> float:
    """The one check of the low-frequency anchor's blur σ (arvdm.pipeline.anchor): a finite number of pixels >= 0
    (0 = no anchor; NaN / inf refused)."""
    if not (math.isfinite(value := as_number(sigma)) and value >= 0):
        raise error(f"{name} must be a finite number of pixels >= 0 (0 = no low-frequency anchor), got {sigma!r}")
    return value


def check_anchor_floor(floor: Any, num_levels: int, name: str, error: type[ArvdmError] = ConfigError) -> int:
    """The one check of the level the anchor's pull stops at: an integer in 0..K-1 (0 = it pulls in every call)."""
    if isinstance(floor, bool) or not isinstance(floor, int) or not 0 <= floor < num_levels:
        raise error(f"{name} must be an integer noise level in 0..K-1 = 0..{num_levels - 1} (the anchor pulls in "
                    f"the calls that start above it; 0 = every call), got {floor!r}")
    return floor


def parse_anchor_runs(text: str) -> tuple[str, ...]:
    """``--anchor-runs`` as written on a command line: comma-separated run folders ("" = none). Torch-free, so
    sample.py can parse it before torch loads."""
    return tuple(r.strip() for r in text.split(",") if r.strip())
