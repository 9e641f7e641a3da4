"""Revisits from ground-truth poses: which generated frames show a place the episode has shown before.

    probes = find_revisits(poses, window_reach=8, start=context)     # [Probe(t, s, b), ...]
    needle = needle_probe(video, poses, context)                     # one distinctive view and a return to it

A *revisit* (probe) is a frame t whose pose (position and heading) matches an earlier frame s with
t - s > window_reach: frames within the network's window are visible without memory, so only a match
farther back tests memory. Pairing uses ground-truth poses only: the generated video has no poses.
How a probe is scored is ``arvdm.evaluation.retrieval``.

Poses are (T, 3) or (B, T, 3) = (x, y, heading in radians); heading differences are wrapped to [-pi, pi).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from memory.select import wrap_angle  # one definition: the memory's pose selection wraps headings the same way

__all__ = [
    "DEFAULT_HEADING_TOL",
    "DEFAULT_POS_TOL",
    "Probe",
    "check_poses",
    "find_revisits",
    "needle_probe",
    "pose_match_matrix",
    "random_pairs",
    "wrap_angle",
]

#: Default pose tolerances of a revisit: position distance (pose units) and heading difference (radians).
DEFAULT_POS_TOL = 0.5
DEFAULT_HEADING_TOL = math.radians(20.0)
# A small slack so that tolerances stated exactly (e.g. pos_tol=1 on a grid) are inclusive despite
# float round-off in cdist / wrapping.
_TOL_SLACK = 1e-9


@dataclass(frozen=True)
class Probe:
    """One revisit: frame ``t`` (absolute index in episode ``b``) shows the place seen at frame ``s``."""

    t: int
    s: int
    b: int = 0

    @property
    def gap(self) -> int:
        """How far back the match is, in frames (t - s > 0)."""
        return self.t - self.s

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "gap": self.gap}


def check_poses(poses: Tensor, name: str) -> Tensor:
    """Poses as float64 (T, 3) or (B, T, 3), finite; a clear error naming the caller otherwise."""
    poses = torch.as_tensor(poses, dtype=torch.float64)
    if poses.ndim not in (2, 3) or poses.shape[-1] != 3:
        raise ValueError(
            f"{name}: poses must be (T, 3) or (B, T, 3) = (x, y, heading), got {tuple(poses.shape)}"
        )
    if not torch.isfinite(poses).all():
        raise ValueError(f"{name}: poses contain NaN or inf")
    return poses


def pose_match_matrix(poses: Tensor, pos_tol: float, heading_tol: float) -> Tensor:
    """(T, 3) poses -> (T, T) bool: entry [t, s] is True when frames t and s show the same view
    (Euclidean position distance <= pos_tol and wrapped heading difference <= heading_tol)."""
    p = check_poses(poses, "pose_match_matrix")
    if p.ndim != 2:
        raise ValueError(f"pose_match_matrix: expected (T, 3) poses, got {tuple(p.shape)}")
    dist = torch.cdist(p[:, :2], p[:, :2])  # (T, T)
    dh = wrap_angle(p[:, None, 2] - p[None, :, 2]).abs()  # (T, T)
    return (dist <= pos_tol + _TOL_SLACK) & (dh <= heading_tol + _TOL_SLACK)


def find_revisits(
    poses: Tensor,
    pos_tol: float = DEFAULT_POS_TOL,
    heading_tol: float = DEFAULT_HEADING_TOL,
    window_reach: int = 0,
    start: int = 0,
    before: int | None = None,
    match: Literal["latest", "earliest", "all"] = "latest",
) -> list[Probe]:
    """Revisit probes from ground-truth poses.

    Frame t (``start <= t < T``, typically ``start`` = number of context frames, so t is a generated frame)
    is a probe when some earlier frame s has a matching pose (``pose_match_matrix``) and
    ``t - s > window_reach``: frames within the reach are visible to the network without memory (its
    denoising window), so a match there tests nothing about memory. ``before`` optionally restricts s to
    ``s < before`` (e.g. only ground-truth context frames).

    ``match`` picks s when several frames qualify: ``"latest"`` (default) the most recent one, i.e. the
    smallest gap -- the least far back memory has to reach, which is what the gap bins should measure --
    ``"earliest"`` the first visit, ``"all"`` one probe per qualifying pair.

    Args:
        poses: (T, 3) or (B, T, 3); with a batch, probes carry the episode index ``b``.
    Returns:
        Probes sorted by (b, t, s).
    """
    p = check_poses(poses, "find_revisits")
    if window_reach < 0:
        raise ValueError(f"find_revisits: window_reach must be >= 0, got {window_reach}")
    if match not in ("latest", "earliest", "all"):
        raise ValueError(f"find_revisits: match must be 'latest', 'earliest' or 'all', got {match!r}")
    if p.ndim == 2:
        p = p[None]  # (1, T, 3)
    t_len = p.shape[1]
    idx = torch.arange(t_len)
    gap = idx[:, None] - idx[None, :]  # (T, T): gap[t, s] = t - s
    allowed = (gap > window_reach) & (idx[:, None] >= start)  # (T, T)
    if before is not None:
        allowed &= idx[None, :] < before
    probes: list[Probe] = []
    for b in range(p.shape[0]):
        valid = pose_match_matrix(p[b], pos_tol, heading_tol) & allowed  # (T, T)
        if match == "all":
            probes += [Probe(int(t), int(s), b) for t, s in valid.nonzero().tolist()]
            continue
        has = valid.any(1)  # (T,)
        if match == "latest":
            s_pick = torch.where(valid, idx[None, :], -1).max(1).values  # (T,)
        else:
            s_pick = torch.where(valid, idx[None, :], t_len).min(1).values  # (T,)
        probes += [Probe(int(t), int(s_pick[t]), b) for t in has.nonzero().flatten().tolist()]
    return probes



def needle_probe(
    video: Tensor,
    poses: Tensor,
    context: int,
    pos_tol: float = DEFAULT_POS_TOL,
    heading_tol: float = DEFAULT_HEADING_TOL,
    window_reach: int = 0,
) -> dict[str, Any] | None:
    """Needle-in-a-haystack probe (paper v2): a distinctive view early in the context, a return to it late.

    The needle is the context frame (index < ``context``) furthest in pixel space (RMS difference) from the
    episode's mean frame -- a view unlike the rest of the episode, so a rollout cannot reproduce it by
    chance. Among context frames in decreasing distinctiveness, the first that the agent returns to (a
    frame t >= context with a matching pose and t - s > window_reach) is taken, with its *latest* return.

    Args:
        video: ground-truth episode (T, C, H, W).
        poses: (T, 3).
    Returns:
        ``{"t", "s", "gap", "b": 0, "distinctiveness", "rank"}`` (rank 0 = the most distinctive context
        frame), or None if no context frame is ever revisited.
    """
    p = check_poses(poses, "needle_probe")
    if video.ndim != 4 or p.ndim != 2 or video.shape[0] != p.shape[0]:
        raise ValueError(
            f"needle_probe: need video (T, C, H, W) and poses (T, 3) of equal T, got {tuple(video.shape)}"
            f" and {tuple(p.shape)}"
        )
    t_len = video.shape[0]
    if not 0 < context <= t_len:
        raise ValueError(f"needle_probe: context must be in [1, {t_len}], got {context}")
    v = video.double()
    mean = v.mean(0, keepdim=True)  # (1, C, H, W)
    dist = (v[:context] - mean).pow(2).mean(dim=(1, 2, 3)).sqrt()  # (context,) RMS distance
    match = pose_match_matrix(p, pos_tol, heading_tol)  # (T, T)
    later = torch.arange(t_len)
    for rank, s in enumerate(torch.argsort(dist, descending=True).tolist()):
        returns = match[:, s] & (later >= context) & (later - s > window_reach)  # (T,)
        if returns.any():
            t = int(returns.nonzero().max())
            return {"t": t, "s": s, "gap": t - s, "b": 0, "distinctiveness": float(dist[s]), "rank": rank}
    return None


def random_pairs(
    match: Tensor, probes: Sequence[Probe], window_reach: int, k: int, gen: torch.Generator
) -> list[tuple[int, int]]:
    """k random non-revisit partners r per probe frame t: pose does not match t and |t - r| > window_reach.

    The gap condition keeps random pairs as far apart in time as true pairs, so that temporal continuity
    (neighbouring frames look alike) does not make the random pairs look easier to tell apart than they are.
    """
    t_len = match.shape[0]
    idx = torch.arange(t_len)
    pairs = []
    for pr in probes:
        ok = ~match[pr.t] & ((idx - pr.t).abs() > window_reach)  # (T,)
        cand = ok.nonzero().flatten()
        if cand.numel() == 0:
            continue
        pick = cand[torch.randint(cand.numel(), (k,), generator=gen)]
        pairs += [(pr.t, int(r)) for r in pick]
    return pairs

