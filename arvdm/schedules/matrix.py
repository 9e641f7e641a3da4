"""Meta-ARVDM scheduling matrices: which noise level every window frame has at every denoising step.

An auto-regressive video diffusion model generates a long video with a sliding window of ``w`` frames.
Meta-ARVDM (Wang, Zhang, Li et al., arXiv 2503.10704, Sec. 3) describes every such sampler by

* ``Δ`` (``delta``): frames finished per auto-regressive (AR) step,
* ``w`` (``window``): frames the denoiser sees at once,
* the AR-step scheduling matrix ``S`` of shape ``(M+1, w)``: ``S[m, j]`` is the integer noise level of
  window frame ``j`` after ``m`` of the step's ``M`` denoising calls (0 = clean, ``K`` = pure noise).
  Row 0 is the input levels ``t^I``, row ``M`` the output levels ``t^O``,
* an initialization stage that brings a pure-noise window (all ``K``) to ``t^I`` in ``M_init`` calls,
* the context level ``k_ctx`` (``context_level``, default 0): the level at which finished frames sit in memory.
  The Δ frames leave the window clean (``t^O[0:Δ] = 0``, and they are emitted clean); they are committed to
  memory re-noised to ``k_ctx`` (fresh noise), and the model is told their level. Context frames too. With
  ``k_ctx = 0`` memory is clean, the paper's setting; a small ``k_ctx > 0`` is the noisy context of GameNGen
  (2024) and Diffusion Forcing (2024), which keeps errors of generated frames from being read as fact.

A valid matrix satisfies the framework's conditions, checked when an :class:`ARSchedule` is built:

* column monotonicity: every column is non-increasing down the rows (a frame is never re-noised);
* monotonicity: within a row, levels are non-decreasing with the frame index (older frames are cleaner);
* circularity: ``t^O[j+Δ] = t^I[j]`` (after the step the window shifts by Δ and keeps its levels);
* 0–T boundary: ``t^O[0:Δ] = 0`` (Δ frames leave clean) and ``t^I[w−Δ:w] = K`` (new frames enter as noise);
  the memory side of the boundary is at ``k_ctx``, with ``0 <= k_ctx < K`` (a frame at K would carry nothing).

This file is the schedule object and its conditions; the presets and the lookup by name are in
arvdm.schedules.presets, schedule files in arvdm.schedules.files, pictures in arvdm.schedules.plots.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from arvdm.errors import ArvdmError
from data.atomic import atomic_write

__all__ = ["ARSchedule", "ScheduleError", "Transition", "check_context_level", "integer_arg", "round_half_up"]


class ScheduleError(ArvdmError):
    """A scheduling matrix violates one of the Meta-ARVDM conditions, or a schedule cannot be built/loaded.

    ``condition`` names the violated condition (``"shape"``, ``"integer"``, ``"range"``, ``"delta"``,
    ``"column monotonicity"``, ``"monotonicity"``, ``"0-T boundary"``, ``"circularity"``, ``"init_steps"``,
    ``"degenerate"``, ``"argument"``, ``"context_level"``, ``"file"``); the message also says where
    (row/column) and the values.
    """

    def __init__(self, condition: str, message: str):
        super().__init__(f"{condition}: {message}")
        self.condition = condition


class Transition(NamedTuple):
    """One denoising call of a rollout: every window frame goes from ``levels_from[j]`` to ``levels_to[j]``.

    ``stage`` is ``"init"`` or ``"ar"``; ``ar_step`` counts AR steps (``-1`` in the init stage); ``row`` is
    the row index ``m`` of ``levels_from`` in its matrix; ``frame_offset`` is the absolute index (among the
    generated frames) of the window's first frame.
    """

    stage: str
    ar_step: int
    row: int
    frame_offset: int
    levels_from: np.ndarray  # (w,) int64
    levels_to: np.ndarray  # (w,) int64


class ARSchedule:
    """An AR-step scheduling matrix ``S`` (M+1, w) with Δ, K and the initialization stage; immutable.

    Args:
        matrix: integer noise levels (M+1, w) — a nested list, numpy array or torch tensor; M >= 1.
        delta: Δ, frames that leave the window clean after each AR step, ``1 <= Δ <= w``.
        num_levels: K, the pure-noise level (levels are ``0..K``).
        init_steps: M_init, denoising calls that take an all-K window to ``t^I``. ``None`` picks the
            default: 0 when ``t^I`` is all K (e.g. chunked, pyramid), otherwise as many calls as needed
            for the initialization to descend no faster per call than the fastest column of ``S``
            (for FIFO with one call per shift: ``w − 1``).
        name: a label (``"chunked"``, ``"fifo"``, ``"pyramid"``, ``"custom"``, a file name).
        context_level: k_ctx, the level finished frames sit at in memory, ``0 <= k_ctx < K`` (0 = clean).

    Raises:
        ScheduleError: naming the violated condition, the row/column and the offending values.
    """

    __slots__ = ("_context_level", "_delta", "_init_steps", "_matrix", "_name", "_num_levels")

    def __init__(self, matrix: Any, delta: int, num_levels: int, init_steps: int | None = None,
                 name: str = "custom", context_level: int = 0):
        num_levels = integer_arg("num_levels", num_levels)
        if num_levels < 1:
            raise ScheduleError("argument", f"num_levels K must be >= 1, got {num_levels}")
        m = _as_level_array(matrix)
        _check_matrix(m, integer_arg("delta", delta), num_levels)
        m.setflags(write=False)
        object.__setattr__(self, "_matrix", m)
        object.__setattr__(self, "_delta", int(delta))
        object.__setattr__(self, "_num_levels", num_levels)
        object.__setattr__(self, "_name", str(name))
        object.__setattr__(self, "_init_steps", self._resolve_init_steps(init_steps))
        object.__setattr__(self, "_context_level", check_context_level(context_level, num_levels))

    def __setattr__(self, key: str, value: Any) -> None:  # frozen, like a frozen dataclass
        raise AttributeError(f"ARSchedule is immutable; build a new one instead of setting {key!r}")

    # -- the definition ---------------------------------------------------------------------------
    @property
    def matrix(self) -> np.ndarray:
        """The AR-step matrix S, int64 (M+1, w), read-only."""
        return self._matrix

    @property
    def delta(self) -> int:
        """Δ: frames finished (and committed to memory) per AR step."""
        return self._delta

    @property
    def num_levels(self) -> int:
        """K: the pure-noise level."""
        return self._num_levels

    @property
    def init_steps(self) -> int:
        """M_init: denoising calls of the initialization stage (0 when t^I is all K)."""
        return self._init_steps

    @property
    def context_level(self) -> int:
        """k_ctx: the noise level finished (and context) frames are committed to memory at (0 = clean)."""
        return self._context_level

    def with_context_level(self, context_level: int) -> ARSchedule:
        """The same schedule with finished frames committed to memory at ``context_level`` (checked)."""
        return ARSchedule(self._matrix, self._delta, self._num_levels, self._init_steps, self._name, context_level)

    @property
    def name(self) -> str:
        return self._name

    @property
    def window(self) -> int:
        """w: frames in the window."""
        return self._matrix.shape[1]

    @property
    def num_steps(self) -> int:
        """M: denoising calls (model evaluations) per AR step."""
        return self._matrix.shape[0] - 1

    @property
    def t_in(self) -> np.ndarray:
        """t^I = S[0], the window's levels when an AR step starts, (w,)."""
        return self._matrix[0]

    @property
    def t_out(self) -> np.ndarray:
        """t^O = S[M], the window's levels when an AR step ends, (w,)."""
        return self._matrix[-1]

    # -- derived matrices ---------------------------------------------------------------------------
    def init_matrix(self) -> np.ndarray:
        """The initialization stage: (M_init + 1, w) int64 levels from an all-K window to ``t^I``.

        Row ``s`` is ``max(t^I, round(K − s·(K − min t^I)/M_init))`` (rounded half up): a ceiling that falls
        evenly from K to the cleanest input level, clipped below by t^I. Row 0 is all K, row M_init is
        ``t^I``, every column is non-increasing and (for M_init <= K − min t^I) no call is wasted. For FIFO
        this grows the ramp from the noise end. With ``t^I`` all K (chunked, pyramid) the stage is empty:
        a single all-K row, no transitions.
        """
        K, n, t_in = self._num_levels, self._init_steps, self._matrix[0]
        if n == 0:
            return np.full((1, self.window), K, dtype=np.int64)
        lo = int(t_in.min())
        ceiling = np.array([round_half_up(K - Fraction(s * (K - lo), n)) for s in range(n + 1)], dtype=np.int64)
        return np.maximum(t_in[None, :], ceiling[:, None])  # (M_init+1, w)

    def num_ar_steps(self, n_frames: int) -> int:
        """AR steps needed to emit ``n_frames`` frames: ceil(n_frames / Δ)."""
        return -(-int(n_frames) // self._delta)

    def num_calls(self, n_frames: int) -> int:
        """Model evaluations a rollout of ``n_frames`` frames makes: M_init + ceil(n / Δ)·M."""
        return self._init_steps + self.num_ar_steps(n_frames) * self.num_steps

    def transitions(self, n_frames: int) -> Iterator[Transition]:
        """Every denoising call of a rollout that emits ``n_frames`` frames, in order.

        The initialization rows come first, then ceil(n_frames/Δ) AR steps of M calls each; after each AR
        step the window moves by Δ frames (``frame_offset`` grows by Δ).
        """
        init = self.init_matrix()
        for s in range(init.shape[0] - 1):
            yield Transition("init", -1, s, 0, init[s], init[s + 1])
        for a in range(self.num_ar_steps(n_frames)):
            for m in range(self.num_steps):
                yield Transition("ar", a, m, a * self._delta, self._matrix[m], self._matrix[m + 1])

    def timeline(self, n_frames: int) -> np.ndarray:
        """Level of every frame at every call of a rollout, for plots: float (calls + 1, frames).

        Columns are absolute frame indices (all frames that ever enter the window); row ``i`` holds the
        levels *before* call ``i`` (the last row: after the last call). ``nan`` marks a frame not yet in the
        window; a frame that has left the window is clean and reads ``-1`` (so plots can grey it out).
        """
        trans = list(self.transitions(n_frames))
        total = self.num_ar_steps(n_frames) * self._delta + self.window - self._delta
        out = np.full((len(trans) + 1, total), np.nan)
        for i, t in enumerate(trans):
            out[i, :t.frame_offset] = -1.0
            out[i, t.frame_offset:t.frame_offset + self.window] = t.levels_from
        last = trans[-1]
        out[-1, :last.frame_offset] = -1.0
        out[-1, last.frame_offset:last.frame_offset + self.window] = last.levels_to
        return out

    # -- (de)serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self._name, "delta": self._delta, "num_levels": self._num_levels,
                "init_steps": self._init_steps, "context_level": self._context_level, "matrix": self._matrix.tolist()}

    def to_json(self) -> str:
        """JSON with one matrix row per line (so a schedule file reads like the matrix it holds)."""
        rows = ",\n    ".join(json.dumps(r) for r in self._matrix.tolist())
        head = {k: v for k, v in self.to_dict().items() if k != "matrix"}
        body = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
        return "{\n  " + body + ',\n  "matrix": [\n    ' + rows + "\n  ]\n}\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the schedule as JSON (see :func:`load_schedule`), atomically: temp file, fsync, rename."""
        path = Path(path)
        if path.suffix.lower() != ".json":
            raise ScheduleError("file", f"{path}: ARSchedule.save writes JSON; use a .json file name")
        atomic_write(path, lambda tmp: tmp.write_text(self.to_json()))  # readers see old or whole new file
        return path

    # -- python protocol ----------------------------------------------------------------------------
    def _key(self) -> tuple:
        return (self._delta, self._num_levels, self._init_steps, self._context_level, self._matrix.shape,
                self._matrix.tobytes())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ARSchedule):
            return NotImplemented
        return self._key() == other._key()  # the name is a label, not part of the schedule

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        rows = "\n".join("    " + " ".join(f"{v:>{len(str(self._num_levels))}d}" for v in r) for r in self._matrix)
        return (f"ARSchedule(name={self._name!r}, window={self.window}, delta={self._delta}, "
                f"num_levels={self._num_levels}, num_steps={self.num_steps}, init_steps={self._init_steps},"
                f" context_level={self._context_level}, matrix=\n{rows})")

    # -- internals ----------------------------------------------------------------------------------
    def _resolve_init_steps(self, init_steps: int | None) -> int:
        K, t_in, t_out = self._num_levels, self._matrix[0], self._matrix[-1]
        all_noise = bool((t_in == K).all())
        if init_steps is None:
            if all_noise:
                return 0
            # Descend no faster per call than the fastest column of S does during an AR step.
            # (Some column drops: the boundary forces t^O[0] = 0 < K = t^I[w-1] and circularity links them.)
            rate = Fraction(int((t_in - t_out).max()), self.num_steps)
            return max(1, math.ceil(Fraction(K - int(t_in.min())) / rate))
        init_steps = integer_arg("init_steps", init_steps)
        if all_noise and init_steps != 0:
            raise ScheduleError("init_steps", f"t^I (row 0) is already all K={K}, so the initialization "
                                f"stage is empty and init_steps must be 0; got {init_steps}")
        if not all_noise and init_steps < 1:
            j = int(np.argmax(t_in != K))
            raise ScheduleError("init_steps", f"t^I (row 0) is not all K={K} (column {j} is {int(t_in[j])}), "
                                f"so init_steps must be >= 1 to bring a pure-noise window to t^I; got {init_steps}")
        return init_steps


def integer_arg(what: str, value: Any) -> int:
    """``value`` as an int when it is an integer (an integral float too), else ScheduleError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            return int(value)
        raise ScheduleError("argument", f"{what} must be an integer, got {value!r}")
    return int(value)


def check_context_level(context_level: Any, num_levels: int, what: str = "context_level") -> int:
    """k_ctx as an int in ``0..K-1``, else ScheduleError (condition ``"context_level"``) naming ``what``."""
    try:
        k = integer_arg(what, context_level)
    except ScheduleError as e:
        raise ScheduleError("context_level", str(e).split(": ", 1)[1]) from None
    if not 0 <= k < num_levels:
        raise ScheduleError("context_level", f"{what} must be in 0..K-1 = 0..{num_levels - 1} (the level finished "
                            f"frames sit at in memory; K={num_levels} would be pure noise), got {k}")
    return k


def _as_level_array(matrix: Any) -> np.ndarray:
    """Convert to an int64 (M+1, w) array, checking shape and integrality (not yet the range)."""
    if hasattr(matrix, "detach"):  # a torch tensor, without importing torch here
        matrix = matrix.detach().cpu().numpy()
    try:
        a = np.array(matrix)
    except ValueError as e:  # ragged nested lists
        raise ScheduleError("shape", f"matrix must be a rectangular (M+1, w) grid: {e}") from None
    if a.ndim != 2 or a.shape[0] < 2 or a.shape[1] < 1:
        raise ScheduleError("shape", f"matrix must be 2-D (M+1, w) with M >= 1 denoising steps and w >= 1 "
                            f"frames; got shape {tuple(a.shape)}")
    if a.dtype == bool or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ScheduleError("integer", f"matrix must hold integer noise levels; got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.floating):
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            r, c = map(int, np.argwhere(bad)[0])
            raise ScheduleError("integer", f"matrix[{r}][{c}] = {a[r, c].item()!r} is not an integer noise level")
    return a.astype(np.int64)


def _check_matrix(S: np.ndarray, delta: int, K: int) -> None:
    """Raise ScheduleError for the first violated condition (order: range, delta, columns, rows, boundary,
    circularity), naming the row/column and the values."""
    M, w = S.shape[0] - 1, S.shape[1]
    bad = (S < 0) | (S > K)
    if bad.any():
        r, c = map(int, np.argwhere(bad)[0])
        raise ScheduleError("range", f"matrix[{r}][{c}] = {int(S[r, c])} is outside the levels 0..K={K}")
    if not 1 <= delta <= w:
        raise ScheduleError("delta", f"need 1 <= delta <= w={w} (frames finished per AR step); got delta={delta}")
    # Column monotonicity: a frame's level never goes up during a step (the sampler only denoises).
    up = np.argwhere(S[1:] > S[:-1])
    if len(up):
        r, c = map(int, up[0])
        raise ScheduleError("column monotonicity", f"column {c} must be non-increasing down the rows, but "
                            f"row {r} -> row {r + 1} goes {int(S[r, c])} -> {int(S[r + 1, c])}")
    # Monotonicity: within a row, later frames are at least as noisy as earlier ones.
    dec = np.argwhere(S[:, 1:] < S[:, :-1])
    if len(dec):
        r, c = map(int, dec[0])
        raise ScheduleError("monotonicity", f"row {r} must be non-decreasing with the frame index, but "
                            f"column {c} -> column {c + 1} goes {int(S[r, c])} -> {int(S[r, c + 1])}")
    t_in, t_out = S[0], S[M]
    for j in range(delta):
        if t_out[j] != 0:
            raise ScheduleError("0-T boundary", f"t^O[0:delta={delta}] must be 0 (the Δ frames that leave the "
                                f"window are clean), but row {M} (t^O), column {j} is {int(t_out[j])}")
    for j in range(w - delta, w):
        if t_in[j] != K:
            raise ScheduleError("0-T boundary", f"t^I[w-delta:w] = t^I[{w - delta}:{w}] must be K={K} (new frames "
                                f"enter as pure noise), but row 0 (t^I), column {j} is {int(t_in[j])}")
    for j in range(w - delta):
        if t_out[j + delta] != t_in[j]:
            raise ScheduleError("circularity", f"t^O[j+delta] must equal t^I[j] (the window shifts by "
                                f"delta={delta} and keeps its levels), but t^O[{j + delta}] (row {M}, column "
                                f"{j + delta}) = {int(t_out[j + delta])} != t^I[{j}] (row 0, column {j}) = "
                                f"{int(t_in[j])}")


def round_half_up(x: Fraction) -> int:
    """Exact rounding of a rational level (no float drift between t^O[j+Δ] and t^I[j])."""
    return math.floor(x + Fraction(1, 2))
