"""Scheduling matrices by name: the paper's presets from one builder, a user's own matrix, a preset or a file.

The three presets of Meta-ARVDM (arXiv 2503.10704) come out of one builder (:func:`from_level_fn`):

    >>> chunked(window=4, num_levels=1000, steps=4).matrix      # outpainting, Δ = w
    >>> fifo(window=4, num_levels=1000).matrix                   # FIFO / rolling diffusion, Δ = 1
    >>> pyramid(window=4, num_levels=1000, steps=4).matrix       # Diffusion Forcing pyramid, Δ = w
    >>> get_schedule("fifo", window=4, num_levels=1000, steps=8)  # a preset (or a file) at equal steps
    >>> get_schedule("fifo", 4, 1000, 8, context_level=20)  # finished frames sit at level 20 in memory

The schedule object and its conditions are :class:`arvdm.schedules.matrix.ARSchedule`; files are read by
arvdm.schedules.files. ``python -m arvdm.schedules --plot docs/schedules.png`` draws the presets
(arvdm.schedules.plots).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from arvdm.config import SCHEDULE_PRESETS
from arvdm.schedules.files import load_schedule
from arvdm.schedules.matrix import ARSchedule, ScheduleError, integer_arg, round_half_up

__all__ = ["PRESETS", "ARSchedule", "ScheduleError", "chunked", "fifo", "from_level_fn", "from_matrix",
           "get_schedule", "load_schedule", "pyramid"]

PRESETS = SCHEDULE_PRESETS  # the preset names get_schedule builds


def from_level_fn(level: Callable[[int, int], Fraction | int], *, window: int, delta: int, num_levels: int,
                  num_steps: int, init_steps: int | None = None, name: str = "custom") -> ARSchedule:
    """Build a schedule from a level function: ``S[m, j] = clip(round(level(m, j)), 0, K)``.

    ``level`` gets the row ``m`` in ``0..num_steps`` and the frame ``j`` in ``0..window-1`` and returns a
    rational (``fractions.Fraction``) or integer level; rounding is exact, half up. All presets go through
    here. A preset whose rounding makes two consecutive rows equal (a model call that changes nothing) is
    refused: use fewer steps or more levels.
    """
    for what, v, lo in (("window", window, 1), ("num_levels", num_levels, 1), ("num_steps", num_steps, 1)):
        if integer_arg(what, v) < lo:
            raise ScheduleError("argument", f"{name}: {what} must be >= {lo}, got {v}")
    K = int(num_levels)
    S = np.array([[min(max(round_half_up(Fraction(level(m, j))), 0), K) for j in range(window)]
                  for m in range(num_steps + 1)], dtype=np.int64)  # (M+1, w)
    same = np.flatnonzero((S[1:] == S[:-1]).all(axis=1))
    if len(same):
        r = int(same[0])
        raise ScheduleError("degenerate", f"{name}: rows {r} and {r + 1} are identical ({S[r].tolist()}), so "
                            f"a model call would change nothing; {num_steps} steps over K={K} levels and "
                            f"w={window} frames is too fine — use fewer steps or more levels")
    return ARSchedule(S, delta, K, init_steps=init_steps, name=name)


def from_matrix(matrix: Any, delta: int, num_levels: int, init_steps: int | None = None,
                name: str = "custom", context_level: int = 0) -> ARSchedule:
    """A schedule from a user's own matrix (nested list / numpy / torch, (M+1, w) integer levels), checked.

    Public API for matrices that no preset makes; the same as ``ARSchedule(matrix, delta, num_levels, ...)``.
    """
    return ARSchedule(matrix, delta, num_levels, init_steps=init_steps, name=name, context_level=context_level)


def chunked(window: int, num_levels: int, steps: int, *, init_steps: int | None = None) -> ARSchedule:
    """Chunked AR / outpainting: Δ = w, all frames move together from K to 0 in ``steps`` calls.

    ``S[m, j] = round(K·(M − m)/M)`` with M = ``steps``; t^I is all K so there is no initialization stage.
    """
    M = integer_arg("steps", steps)
    return from_level_fn(lambda m, j: Fraction(num_levels * (M - m), max(M, 1)), window=window, delta=window,
                         num_levels=num_levels, num_steps=M, init_steps=init_steps, name="chunked")


def fifo(window: int, num_levels: int, steps_per_shift: int = 1, *, init_steps: int | None = None) -> ARSchedule:
    """FIFO-Diffusion / rolling diffusion: Δ = 1, a diagonal ramp of levels that slides one frame per step.

    ``S[m, j] = round(K·(j + 1 − m/M)/w)`` with M = ``steps_per_shift``: frame j of the window enters a step
    at ``K(j+1)/w`` and leaves it at ``Kj/w``, so t^O[0] = 0, t^I[w−1] = K and t^O[j+1] = t^I[j]. Every
    frame takes ``w·M`` calls from K to 0.
    """
    M = integer_arg("steps_per_shift", steps_per_shift)
    w = integer_arg("window", window)
    return from_level_fn(lambda m, j: Fraction(num_levels * ((j + 1) * M - m), w * max(M, 1)), window=w,
                         delta=1, num_levels=num_levels, num_steps=M, init_steps=init_steps, name="fifo")


def pyramid(window: int, num_levels: int, steps: int, stagger: int = 1, *,
            init_steps: int | None = None) -> ARSchedule:
    """Diffusion Forcing's pyramid: Δ = w, frame j starts denoising ``stagger`` calls after frame j − 1.

    Each frame takes ``steps`` (= M0) calls from K to 0, so the step has ``M = M0 + (w−1)·stagger`` rows:
    ``S[m, j] = clip(K − (m − j·stagger)·K/M0, 0, K)``. ``stagger = 0`` is :func:`chunked`; ``stagger``
    must be at most ``steps`` (otherwise some calls would change nothing).
    """
    M0, d, w = integer_arg("steps", steps), integer_arg("stagger", stagger), integer_arg("window", window)
    if M0 < 1 or d < 0:
        raise ScheduleError("argument", f"pyramid: need steps >= 1 and stagger >= 0, got steps={M0}, stagger={d}")
    return from_level_fn(lambda m, j: Fraction(num_levels * (M0 - m + j * d), max(M0, 1)), window=w, delta=w,
                         num_levels=num_levels, num_steps=M0 + (w - 1) * d, init_steps=init_steps,
                         name="pyramid")


def get_schedule(name_or_path: str | os.PathLike | ARSchedule, window: int | None, num_levels: int,
                 steps: int | None = None, context_level: int | None = None, **kwargs: Any) -> ARSchedule:
    """A preset by name, or a schedule file (see :func:`load_schedule`), for a ``window``-frame model.

    ``steps`` is the number of denoising calls every frame takes from K to 0, so the presets compare at
    equal quality: ``chunked(steps)``, ``pyramid(steps, stagger)`` and ``fifo(steps_per_shift =
    ceil(steps / window))`` (FIFO frames take a multiple of w calls). ``kwargs`` go to the preset
    (``stagger``, ``init_steps``). A file's schedule must match ``num_levels`` and (unless None) ``window``.
    ``context_level`` (k_ctx, 0..K-1) sets the level finished frames sit at in memory; None = the preset's 0 or
    the file's own.
    """
    sched = _lookup(name_or_path, window, num_levels, steps, **kwargs)
    return sched if context_level is None else sched.with_context_level(context_level)


def _lookup(name_or_path: str | os.PathLike | ARSchedule, window: int | None, num_levels: int,
            steps: int | None, **kwargs: Any) -> ARSchedule:
    """`get_schedule` without the context level: a preset, a file or a schedule, checked against the model."""
    if isinstance(name_or_path, ARSchedule):
        sched = name_or_path
    elif str(name_or_path) in PRESETS:
        if window is None or steps is None:
            raise ScheduleError("argument", f"preset {name_or_path!r} needs window and steps")
        name, steps = str(name_or_path), integer_arg("steps", steps)
        if name == "chunked":
            return chunked(window, num_levels, steps, **kwargs)
        if name == "pyramid":
            return pyramid(window, num_levels, steps, **kwargs)
        return fifo(window, num_levels, max(1, -(-steps // int(window))), **kwargs)
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ScheduleError("argument", f"unknown schedule {str(name_or_path)!r}: not a preset "
                                f"({', '.join(PRESETS)}) and no such file")
        sched = load_schedule(path, **kwargs)
    if sched.num_levels != num_levels:
        raise ScheduleError("argument", f"schedule {sched.name!r} has K={sched.num_levels} levels but the model "
                            f"uses num_levels={num_levels}")
    if window is not None and sched.window != window:
        raise ScheduleError("argument", f"schedule {sched.name!r} has a {sched.window}-frame window but the model "
                            f"uses window={window}")
    return sched
