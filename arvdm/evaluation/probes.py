"""Memory probes: the frames that only memory can supply, grouped into events, and rates with intervals.

    probes = memory_probes_batch(real, poses, recent=8, start=context)      # [MemoryProbe(t, s, ...), ...]
    ids = [p.event for p in probes]
    pose = values_at(psnr_pose, probes, offset=context)                      # (P,) one value per probe
    time = values_at(psnr_time, probes, offset=context)
    print(pooled_rate(pose, ids), paired_difference(pose, time, ids), binned(pose - time, ids, gaps(probes)))

A **memory probe** is a frame t (t >= ``start``, typically the first generated frame) of a ground-truth episode
that an earlier frame s < t - ``recent`` matches (PSNR(frame_t, frame_s) >= ``psnr_threshold``) while no frame
of the recent range [t - recent, t) does: a model that sees its ``recent`` frames directly can only draw
frame t right from memory. The matching is by pixels; the same definition by pose (position and heading within
tolerance, ``arvdm.evaluation.revisits.pose_match_matrix``) is reported alongside as ``pose_probe``, and
``pose_match`` says whether the matched frame s is at t's pose (a true revisit, not a look-alike view).

Probes are correlated: consecutive probe frames t, t+1, ... show one return to a place, an **event**. Rates
are therefore pooled over probes (every probe weighs the same) with a 95% interval from an **event-level
bootstrap**: events are resampled with replacement, never single probes, so an interval reflects how many
independent returns there are. ``binned`` splits the probes by how far back the match is and reports no number
for a bin with fewer than ``MIN_EVENTS`` events.

Conventions: frames are float in [-1, 1] (PSNR data range 2, as ``arvdm.evaluation.metrics.psnr_per_frame``);
videos (T, C, H, W) per episode or (B, T, C, H, W); poses (T, 3) or (B, T, 3) = (x, y, heading in radians).
Everything is deterministic given ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from arvdm.evaluation.metrics import span_label
from arvdm.evaluation.retrieval import DEFAULT_BINS
from arvdm.evaluation.revisits import DEFAULT_HEADING_TOL, DEFAULT_POS_TOL, check_poses, pose_match_matrix

__all__ = [
    "DEFAULT_PSNR_THRESHOLD",
    "MIN_EVENTS",
    "MemoryProbe",
    "binned",
    "format_interval",
    "gaps",
    "memory_probes",
    "memory_probes_batch",
    "paired_difference",
    "pooled_rate",
    "psnr_matrix",
    "values_at",
]

#: PSNR (dB) at which two 32 px frames count as the same view (Memory Maze: a revisit's view scores 27-30 dB,
#: a recent frame at a return 19-20 dB).
DEFAULT_PSNR_THRESHOLD = 25.0
#: A gap bin with fewer events than this reports "too few" instead of a rate.
MIN_EVENTS = 10
# Pixel values per chunk of the pairwise distance computation: bounds its memory (~128 MiB of float64).
_CHUNK_VALUES = 1 << 24


@dataclass(frozen=True)
class MemoryProbe:
    """Frame ``t`` of episode ``b`` that only memory can supply: earlier frame ``s`` (s < t - recent) matches it.

    ``psnr`` is PSNR(frame_t, frame_s) (``inf`` for identical frames), ``recent_psnr`` the best PSNR of a
    frame in [t - recent, t) (below the threshold, or t would not be a probe), ``pose_probe`` whether t is a
    probe by pose too (a frame before t - recent within the pose tolerances, none in the recent range),
    ``pose_match`` whether s itself is within them (both None without poses), ``event`` the id of its run of
    consecutive probe frames.
    """

    t: int
    s: int
    psnr: float
    recent_psnr: float
    pose_probe: bool | None
    pose_match: bool | None
    event: int
    b: int = 0

    @property
    def gap(self) -> int:
        """How far back the match is, in frames (t - s > recent)."""
        return self.t - self.s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gap": self.gap}


def psnr_matrix(video: Tensor, data_range: float = 2.0) -> Tensor:
    """PSNR (dB) of every pair of frames: (T, C, H, W) in [-1, 1] -> (T, T) float64, ``inf`` on identical frames.

    Entry [t, s] equals ``psnr_per_frame(video[t], video[s])`` (frames clamped to [-1, 1] first, like it);
    squared differences are summed exactly (no |a|^2 + |b|^2 - 2ab shortcut), so a repeated frame gives inf.
    """
    if not isinstance(video, Tensor) or video.ndim != 4:
        raise ValueError(f"psnr_matrix: video must be a (T, C, H, W) tensor, got {_shape(video)}")
    x = video.reshape(video.shape[0], -1).double().clamp(-1.0, 1.0)  # (T, D)
    t_len, d = x.shape
    rows = max(1, _CHUNK_VALUES // max(1, t_len * d))
    mse = torch.empty(t_len, t_len, dtype=torch.float64)
    for i in range(0, t_len, rows):
        diff = x[i : i + rows, None, :] - x[None, :, :]  # (rows, T, D)
        mse[i : i + rows] = diff.pow(2).mean(-1)  # (rows, T)
    return 10.0 * torch.log10(data_range**2 / mse)  # (T, T); mse 0 -> inf


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__


def _check_probe_args(video: Tensor, poses: Tensor | None, recent: int, start: int, psnr_threshold: float) -> None:
    """Clear errors for memory_probes' inputs (poses are checked by check_poses)."""
    if not isinstance(video, Tensor) or video.ndim != 4 or not video.is_floating_point():
        raise ValueError(f"memory_probes: video must be a float (T, C, H, W) tensor in [-1, 1], got {_shape(video)}")
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < 1:
        raise ValueError(f"memory_probes: recent must be an int >= 1 (frames the model sees directly), got {recent!r}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= video.shape[0]:
        raise ValueError(f"memory_probes: start must be an int in [0, {video.shape[0]}] (frames), got {start!r}")
    if not math.isfinite(psnr_threshold):
        raise ValueError(f"memory_probes: psnr_threshold must be a finite number of dB, got {psnr_threshold!r}")
    if poses is not None and (poses.ndim != 2 or poses.shape[0] != video.shape[0]):
        raise ValueError(f"memory_probes: poses {_shape(poses)} do not fit video {_shape(video)}: "
                         f"need ({video.shape[0]}, 3)")


def memory_probes(
    video: Tensor,
    poses: Tensor | None,
    recent: int,
    start: int = 0,
    psnr_threshold: float = DEFAULT_PSNR_THRESHOLD,
    pos_tol: float = DEFAULT_POS_TOL,
    heading_tol: float = DEFAULT_HEADING_TOL,
    match_size: int | None = None,
    b: int = 0,
    first_event: int = 0,
) -> list[MemoryProbe]:
    """Memory probes of one ground-truth episode (see the module docstring).

    Args:
        video: (T, C, H, W) in [-1, 1], the whole episode (context included).
        poses: (T, 3) finite poses, or None (``pose_probe`` and ``pose_match`` are then None).
        recent: frames the model sees without memory (>= 1): a match in [t - recent, t) disqualifies t.
        start: first frame that may be a probe (the number of context frames, for generated frames only).
        psnr_threshold: PSNR (dB) from which two frames show the same view; stated for 32 px frames.
        match_size: if given, frames are area-resized to match_size x match_size before matching, so that
            one threshold serves any resolution.
        b, first_event: episode index and first event id written into the probes (the batched wrapper's).
    Returns:
        Probes sorted by t; s is the earlier frame of highest PSNR (the latest on ties).
    """
    poses = None if poses is None else check_poses(poses, "memory_probes")  # (T, 3) float64, finite
    _check_probe_args(video, poses, recent, start, psnr_threshold)
    frames = video if match_size is None else F.interpolate(video.float(), size=(match_size, match_size),
                                                            mode="area")  # (T, C, m, m)
    psnr = psnr_matrix(frames)  # (T, T)
    t_len = video.shape[0]
    idx = torch.arange(t_len)
    gap = idx[:, None] - idx[None, :]  # (T, T): gap[t, s] = t - s
    earlier, in_recent = gap > recent, (gap >= 1) & (gap <= recent)  # (T, T) each
    best_earlier = torch.where(earlier, psnr, -math.inf)  # (T, T)
    # latest s on ties: argmax of the row reversed along s
    s_best = (t_len - 1) - best_earlier.flip(1).argmax(1)  # (T,)
    earlier_psnr = best_earlier.max(1).values  # (T,)
    recent_psnr = torch.where(in_recent, psnr, -math.inf).max(1).values  # (T,)
    is_probe = (earlier_psnr >= psnr_threshold) & (recent_psnr < psnr_threshold) & (idx >= start)  # (T,)
    pose_flag = s_match = None
    if poses is not None:
        match = pose_match_matrix(poses, pos_tol, heading_tol)  # (T, T)
        pose_flag = (match & earlier).any(1) & ~(match & in_recent).any(1)  # (T,)
        s_match = match[idx, s_best]  # (T,): the pixel match's frame is at t's pose
    probes, event, last_t = [], first_event - 1, None
    for t in is_probe.nonzero().flatten().tolist():
        event += 0 if last_t == t - 1 else 1  # consecutive probe frames share an event
        last_t = t
        probes.append(MemoryProbe(t=t, s=int(s_best[t]), psnr=float(earlier_psnr[t]),
                                  recent_psnr=float(recent_psnr[t]),
                                  pose_probe=None if pose_flag is None else bool(pose_flag[t]),
                                  pose_match=None if s_match is None else bool(s_match[t]), event=event, b=b))
    return probes


def memory_probes_batch(videos: Tensor, poses: Tensor | None, recent: int, start: int = 0,
                        **kwargs: Any) -> list[MemoryProbe]:
    """``memory_probes`` over episodes: videos (B, T, C, H, W), poses (B, T, 3) or None. Probes carry their
    episode ``b``, and event ids are unique over the batch (0, 1, ... in order of episode, then t)."""
    if not isinstance(videos, Tensor) or videos.ndim != 5:
        raise ValueError(f"memory_probes_batch: videos must be (B, T, C, H, W), got {_shape(videos)}")
    if poses is not None:
        poses = check_poses(poses, "memory_probes_batch")
        if poses.ndim != 3 or tuple(poses.shape[:2]) != tuple(videos.shape[:2]):
            raise ValueError(f"memory_probes_batch: poses {_shape(poses)} do not fit videos {_shape(videos)}: "
                             f"need {tuple(videos.shape[:2]) + (3,)}")
    out: list[MemoryProbe] = []
    for e in range(videos.shape[0]):
        first = out[-1].event + 1 if out else 0
        out += memory_probes(videos[e], None if poses is None else poses[e], recent, start, b=e, first_event=first,
                             **kwargs)
    return out


def values_at(per_frame: Tensor | np.ndarray, probes: Sequence[MemoryProbe], offset: int = 0) -> np.ndarray:
    """One value per probe from a per-frame measure: per_frame (B, N) (or (N,) for episode 0) indexed by
    episode and frame; ``offset`` is the episode frame of per_frame's column 0 (the context length when
    per_frame covers the generated frames only). Returns (P,) float64."""
    x = np.asarray(torch.as_tensor(per_frame, dtype=torch.float64))
    x = x[None] if x.ndim == 1 else x
    if x.ndim != 2:
        raise ValueError(f"values_at: per_frame must be (B, N) or (N,), got {x.shape}")
    out = np.empty(len(probes))
    for i, p in enumerate(probes):
        col = p.t - offset
        if not (0 <= p.b < x.shape[0] and 0 <= col < x.shape[1]):
            raise ValueError(f"values_at: probe (b={p.b}, t={p.t}) is outside per_frame {x.shape} with offset "
                             f"{offset}")
        out[i] = x[p.b, col]
    return out


def gaps(probes: Sequence[MemoryProbe]) -> np.ndarray:
    """(P,) int64: how far back each probe's match is (t - s)."""
    return np.array([p.gap for p in probes], dtype=np.int64)


# --------------------------------------------------------------------------------------------------------
# Pooled rates with event-level bootstrap intervals
# --------------------------------------------------------------------------------------------------------


def _check_values(values: Any, event_ids: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(P,) float64 values and (P,) event indices 0..E-1 (in order of sorted id), or a clear error."""
    v, ids = np.atleast_1d(np.asarray(values, dtype=np.float64)).reshape(-1), np.atleast_1d(event_ids).reshape(-1)
    if v.shape != ids.shape:
        raise ValueError(f"{name}: {v.size} values but {ids.size} event ids (need one per probe)")
    if v.size == 0:
        raise ValueError(f"{name}: no probes (values are empty)")
    bad = int((~np.isfinite(v)).sum())
    if bad:
        raise ValueError(f"{name}: {bad} of {v.size} values are NaN or infinite (an identical frame has PSNR inf: "
                         "clip such values first, e.g. np.minimum(values, 60.0))")
    _, inverse = np.unique(ids, return_inverse=True)
    return v, inverse.reshape(-1)


def _check_boot(n_boot: int, level: float, name: str) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"{name}: n_boot must be an int >= 1, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"{name}: level must be in (0, 1), got {level!r}")


def _event_bootstrap(v: np.ndarray, events: np.ndarray, n_boot: int, seed: int, level: float) -> tuple[float, float]:
    """Percentile interval of the pooled mean when whole events are resampled with replacement."""
    n_events = int(events.max()) + 1
    sums = np.bincount(events, weights=v, minlength=n_events)  # (E,) sum of values per event
    counts = np.bincount(events, minlength=n_events).astype(np.float64)  # (E,) probes per event
    pick = np.random.default_rng(seed).integers(0, n_events, size=(n_boot, n_events))  # (n_boot, E)
    boot = sums[pick].sum(1) / counts[pick].sum(1)  # (n_boot,) pooled mean of each resample
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def pooled_rate(values: Any, event_ids: Any, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """Mean of ``values`` over probes with an event-level bootstrap interval.

    Args:
        values: (P,) one finite value per probe (a PSNR, or 0/1 for a rate).
        event_ids: (P,) the probe's event (any hashable ids; probes with the same id are resampled together).
        n_boot, seed, level: bootstrap resamples, generator seed, interval coverage.
    Returns:
        ``{"mean", "lo", "hi", "n_probes", "n_events", "level", "n_boot"}``; lo/hi are the percentile interval.
    """
    _check_boot(n_boot, level, "pooled_rate")
    v, events = _check_values(values, event_ids, "pooled_rate")
    lo, hi = _event_bootstrap(v, events, n_boot, seed, level)
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n_probes": int(v.size), "n_events": int(events.max()) + 1,
            "level": level, "n_boot": n_boot}


def paired_difference(a: Any, b: Any, event_ids: Any, n_boot: int = 1000, seed: int = 0,
                      level: float = 0.95) -> dict[str, Any]:
    """``a - b`` on the same probes (e.g. PSNR with memory chosen by pose minus by time): the pooled mean
    difference with an event-level bootstrap interval (``pooled_rate`` of the differences), plus each side's
    mean. The interval excluding 0 is the evidence that a differs from b."""
    a_v = np.asarray(a, dtype=np.float64).reshape(-1)
    b_v = np.asarray(b, dtype=np.float64).reshape(-1)
    if a_v.shape != b_v.shape:
        raise ValueError(f"paired_difference: a has {a_v.size} values, b has {b_v.size} (need the same probes)")
    out = pooled_rate(a_v - b_v, event_ids, n_boot, seed, level)
    return {**out, "mean_a": float(a_v.mean()), "mean_b": float(b_v.mean())}


def format_interval(d: Mapping[str, Any]) -> str:
    """A difference with its interval, as the reports print it: ``+0.91 [+0.50, +1.30]`` from ``{mean, lo, hi}``."""
    return f"{d['mean']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"


def binned(values: Any, event_ids: Any, gap: Any, bins: Sequence[tuple[float, float]] = DEFAULT_BINS,
           min_events: int = MIN_EVENTS, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> list[dict]:
    """``pooled_rate`` per gap bin (0-16, 16-48, 48-112, 112+ frames back by default; ``lo <= gap < hi``).

    A bin whose probes belong to fewer than ``min_events`` events carries ``"too_few": True`` and no mean or
    interval (None): a rate from a handful of returns is not a measurement. Pass differences (``a - b``) as
    values for paired differences by bin.
    Returns:
        ``[{"bin", "lo", "hi" (None = open), "n_probes", "n_events", "too_few", "mean", "lo_ci", "hi_ci"}]``.
    """
    if isinstance(min_events, bool) or not isinstance(min_events, int) or min_events < 1:
        raise ValueError(f"binned: min_events must be an int >= 1, got {min_events!r}")
    v = np.atleast_1d(np.asarray(values, dtype=np.float64)).reshape(-1)
    ids, g = np.atleast_1d(event_ids).reshape(-1), np.atleast_1d(gap).reshape(-1)
    if not v.size == ids.size == g.size:
        raise ValueError(f"binned: {v.size} values, {ids.size} event ids and {g.size} gaps (need one each per probe)")
    out = []
    for lo, hi in bins:
        if not lo < hi:
            raise ValueError(f"binned: bin ({lo}, {hi}) is empty")
        inside = (g >= lo) & (g < hi)  # (P,)
        n_events = len(np.unique(ids[inside]))
        row = {"bin": span_label(int(lo), hi), "lo": int(lo), "hi": None if math.isinf(hi) else int(hi),
               "n_probes": int(inside.sum()), "n_events": n_events, "too_few": n_events < min_events,
               "mean": None, "lo_ci": None, "hi_ci": None}
        if not row["too_few"]:
            r = pooled_rate(v[inside], ids[inside], n_boot, seed, level)
            row.update(mean=r["mean"], lo_ci=r["lo"], hi_ci=r["hi"])
        out.append(row)
    return out
