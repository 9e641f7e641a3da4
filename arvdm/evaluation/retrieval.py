"""Memory-bottleneck probes: does a rollout reproduce a place when the agent comes back to it?

The paper's *memory bottleneck* ("history forgetting" in v2) is measured on revisits: frames whose pose
(position and heading) matches an earlier frame. A model that remembers should render the place as it
was. This module

1. finds revisits from ground-truth poses (``find_revisits``): for each generated frame t, the earlier frame
   s < t with a matching pose that lies *out of the network's direct reach* (t - s > window_reach), so that
   only memory can supply it;
2. calibrates the SSIM threshold that says "same place" (``calibrate_threshold``) on the ground truth:
   true revisit pairs SSIM(real[t], real[s]) against random non-revisit pairs SSIM(real[t], real[r]),
   choosing the threshold with the best balanced accuracy;
3. scores a probe as retrieved when SSIM(generated[t], real[t]) >= threshold, and reports the rate binned
   by the gap t - s (``retrieval_by_span``: 0-16, 16-48, 48-112, 112+).

Why compare generated[t] with real[t] (and not with real[s]): at a revisit real[t] *is* what was seen at s,
up to the pose tolerance (a few degrees of heading, a fraction of a cell) and anything that moved. Comparing
with real[t] asks for exactly the view at t and so does not penalise a model for the legitimate small
difference between the two views; the calibration measures how large that difference is (true pairs
real[t] vs real[s]) and sets the threshold so that "generated[t] is as close to real[t] as a true revisit
view is" counts as retrieval. Pairing uses ground-truth poses only: the generated video has no poses.

Poses are (T, 3) = (x, y, heading in radians); heading differences are wrapped to [-pi, pi).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from arvdm.evaluation.metrics import span_label, ssim_per_frame

__all__ = [
    "DEFAULT_BINS",
    "MIN_RELIABLE_BALANCED_ACCURACY",
    "Probe",
    "calibrate_threshold",
    "evaluate_retrieval",
    "find_revisits",
    "mean_retrieval_rate",
    "needle_probe",
    "pair_ssim",
    "pose_match_matrix",
    "retrieval_by_span",
    "wrap_angle",
]

#: Gap bins (frames back) of the retrieval rates: the paper's 0-16 / 16-48 / 48-112, plus everything beyond.
DEFAULT_BINS: tuple[tuple[float, float], ...] = ((0, 16), (16, 48), (48, 112), (112, math.inf))


#: Below this balanced accuracy a calibration carries a "warning" (chance level is 0.5).
MIN_RELIABLE_BALANCED_ACCURACY = 0.75


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


def wrap_angle(a: Tensor) -> Tensor:
    """Wrap angles (radians) to [-pi, pi)."""
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def _check_poses(poses: Tensor, name: str) -> Tensor:
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
    p = _check_poses(poses, "pose_match_matrix")
    if p.ndim != 2:
        raise ValueError(f"pose_match_matrix: expected (T, 3) poses, got {tuple(p.shape)}")
    dist = torch.cdist(p[:, :2], p[:, :2])  # (T, T)
    dh = wrap_angle(p[:, None, 2] - p[None, :, 2]).abs()  # (T, T)
    # A small slack so that tolerances stated exactly (e.g. pos_tol=1 on a grid) are inclusive despite
    # float round-off in cdist / wrapping.
    eps = 1e-9
    return (dist <= pos_tol + eps) & (dh <= heading_tol + eps)


def find_revisits(
    poses: Tensor,
    pos_tol: float = 0.5,
    heading_tol: float = math.radians(20.0),
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
    p = _check_poses(poses, "find_revisits")
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


def pair_ssim(frames_a: Tensor, frames_b: Tensor) -> Tensor:
    """SSIM of paired frames (P, C, H, W) vs (P, C, H, W) in [-1, 1] -> (P,) (empty in, empty out)."""
    if frames_a.shape[0] == 0:
        return torch.zeros(0)
    return ssim_per_frame(frames_a[None], frames_b[None])[0]


def _summary(x: np.ndarray) -> dict[str, Any]:
    """n / mean / std / quartiles of a set of SSIM values, for stating a calibration in the output."""
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "q25": float(np.quantile(x, 0.25)),
        "median": float(np.median(x)),
        "q75": float(np.quantile(x, 0.75)),
        "max": float(x.max()),
    }


def calibrate_threshold(
    true_pair_ssims: Sequence[float] | Tensor, random_pair_ssims: Sequence[float] | Tensor
) -> dict[str, Any]:
    """The SSIM threshold that best separates true revisit pairs from random pairs.

    Rule: predict "same place" when SSIM >= threshold; choose the threshold that maximises balanced
    accuracy ``(TPR + TNR) / 2`` (insensitive to how many pairs of each kind there are). Candidates are the
    midpoints between consecutive distinct pooled values (plus the two ends), so a separable case gets the
    middle of the gap; when several non-adjacent candidates tie, the middle one (lower median) is taken.

    Returns:
        ``{"threshold", "balanced_accuracy", "tpr", "tnr", "method", "true_pairs": summary,
        "random_pairs": summary}`` where a summary is n / mean / std / min / q25 / median / q75 / max.
    """
    pos = np.sort(np.asarray(torch.as_tensor(true_pair_ssims, dtype=torch.float64)).reshape(-1))
    neg = np.sort(np.asarray(torch.as_tensor(random_pair_ssims, dtype=torch.float64)).reshape(-1))
    if pos.size == 0 or neg.size == 0:
        raise ValueError(
            f"calibrate_threshold: need at least one true and one random pair, got {pos.size} and {neg.size}"
        )
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise ValueError("calibrate_threshold: SSIM values must be finite")
    pooled = np.unique(np.concatenate([pos, neg]))  # sorted, distinct
    cands = np.concatenate([pooled[:1], (pooled[1:] + pooled[:-1]) / 2, [np.nextafter(pooled[-1], np.inf)]])
    tpr = 1.0 - np.searchsorted(pos, cands, side="left") / pos.size  # fraction of true pairs >= c
    tnr = np.searchsorted(neg, cands, side="left") / neg.size  # fraction of random pairs < c
    ba = (tpr + tnr) / 2
    best = np.flatnonzero(ba >= ba.max() - 1e-12)
    i = int(best[(len(best) - 1) // 2])
    out = {
        "threshold": float(cands[i]),
        "balanced_accuracy": float(ba[i]),
        "tpr": float(tpr[i]),
        "tnr": float(tnr[i]),
        "method": "max balanced accuracy (TPR+TNR)/2; retrieved when SSIM >= threshold",
        "true_pairs": _summary(pos),
        "random_pairs": _summary(neg),
    }
    if ba[i] < MIN_RELIABLE_BALANCED_ACCURACY:
        # SSIM cannot tell revisits from random views here (e.g. textureless or very noisy frames, or pose
        # tolerances too loose): say so in the output instead of reporting rates that mean little.
        out["warning"] = (
            f"true revisit pairs and random pairs are hard to separate by SSIM (balanced accuracy "
            f"{ba[i]:.3f} < {MIN_RELIABLE_BALANCED_ACCURACY}); retrieval rates are unreliable"
        )
    return out


def retrieval_by_span(
    probes: Sequence[Probe] | Sequence[int],
    successes: Sequence[bool] | Tensor,
    bins: Sequence[tuple[float, float]] = DEFAULT_BINS,
) -> list[dict[str, Any]]:
    """Retrieval rate per gap bin.

    Args:
        probes: ``Probe`` objects or plain gaps (t - s).
        successes: one bool per probe.
        bins: ``(lo, hi)`` pairs; a probe falls in the bin with ``lo <= gap < hi`` (hi may be ``math.inf``).
            Probes outside every bin are not counted.
    Returns:
        ``[{"bin": "0-16", "lo", "hi" (None = open), "n", "hits", "rate" (None when n = 0)}, ...]``.
    """
    gaps = [p.gap if isinstance(p, Probe) else int(p) for p in probes]
    ok = [bool(x) for x in torch.as_tensor(successes, dtype=torch.bool).reshape(-1).tolist()]
    if len(gaps) != len(ok):
        raise ValueError(f"retrieval_by_span: {len(gaps)} probes but {len(ok)} successes")
    out = []
    for lo, hi in bins:
        if not lo < hi:
            raise ValueError(f"retrieval_by_span: bin ({lo}, {hi}) is empty")
        inside = [k for g, k in zip(gaps, ok) if lo <= g < hi]
        n, hits = len(inside), sum(inside)
        out.append(
            {
                "bin": span_label(int(lo), hi),
                "lo": int(lo),
                "hi": None if math.isinf(hi) else int(hi),
                "n": n,
                "hits": hits,
                "rate": hits / n if n else None,
            }
        )
    return out


def mean_retrieval_rate(by_span: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean of the per-bin rates over bins that have probes (None when none has).

    Each bin weighs the same whatever its probe count, so the many short-gap revisits do not drown the
    long-gap ones; this is the y axis of the Pareto plot.
    """
    rates = [b["rate"] for b in by_span if b.get("rate") is not None]
    return sum(rates) / len(rates) if rates else None


def needle_probe(
    video: Tensor,
    poses: Tensor,
    context: int,
    pos_tol: float = 0.5,
    heading_tol: float = math.radians(20.0),
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
    p = _check_poses(poses, "needle_probe")
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


def _random_pairs(
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


def _rank_retrieved(gen, real, poses, probes, scores, context, window_reach, pos_tol, heading_tol, k, seed):
    """Rank criterion: probe i is retrieved when its score beats SSIM(generated[t], real[d]) for all of
    k distractors d (``_random_pairs``: pose unlike t's, |t - d| > window_reach). Returns the probes that
    had distractors and a bool tensor of their outcomes."""
    g = torch.Generator().manual_seed(seed + 1)
    match = {e: pose_match_matrix(poses[e], pos_tol, heading_tol) for e in {pr.b for pr in probes}}  # (T, T) each
    kept, ok = [], []
    for i, pr in enumerate(probes):
        pairs = _random_pairs(match[pr.b], [pr], window_reach, k, g)
        if not pairs:
            continue
        d = [r for _, r in pairs]
        rival = pair_ssim(gen[pr.b, pr.t - context][None].expand(len(d), -1, -1, -1), real[pr.b, d])  # (k,)
        kept.append(pr)
        ok.append(bool(scores[i] > rival.max()))
    return kept, torch.tensor(ok, dtype=torch.bool)


def evaluate_retrieval(
    gen: Tensor,
    real: Tensor,
    poses: Tensor | None,
    context: int,
    window_reach: int,
    threshold: float | None = None,
    pos_tol: float = 0.5,
    heading_tol: float = math.radians(20.0),
    bins: Sequence[tuple[float, float]] | None = None,
    n_random_per_probe: int = 4,
    seed: int = 0,
    match: Literal["latest", "earliest", "all"] = "latest",
    criterion: Literal["rank", "threshold"] = "rank",
    n_distractors: int = 4,
) -> dict[str, Any]:
    """Retrieval fields of eval.json for a batch of rollouts (see ``arvdm.evaluation.evaluate.evaluate_rollout``).

    ``criterion`` says when a probe (generated frame t at a revisit) counts as retrieved:

    - ``rank`` (default): SSIM(generated[t], real[t]) beats SSIM(generated[t], real[d]) for every one of
      ``n_distractors`` distractor frames d of the same episode (pose unlike t's, farther than the
      window's reach; seeded). A frame that looks like *the right place* wins even when blurry; a frame
      that looks like any place wins by chance only, 1 / (n_distractors + 1), reported as
      ``retrieval_chance``. On Memory Maze a true revisit view scores SSIM 0.62 against 0.43 for a
      random pair, too close for an absolute threshold to separate them well (balanced accuracy 0.745).
    - ``threshold``: SSIM(generated[t], real[t]) >= a calibrated (or given) threshold (the first design).

    Args:
        gen: generated frames (B, N, C, H, W); gen[:, i] is episode frame ``context + i``.
        real: ground truth (B, context + N, C, H, W).
        poses: (B, context + N, 3) ground-truth poses, or None (retrieval is then reported as skipped).
        threshold: given, or None to calibrate on these episodes' ground truth.
    Returns:
        ``retrieval_by_span``, ``retrieval_mean``, ``retrieval_overall``, ``retrieval_threshold``,
        ``retrieval_calibration``, ``retrieval_settings``, ``n_probes``, ``needle``.
    """
    bins = DEFAULT_BINS if bins is None else tuple(bins)
    b, n = gen.shape[:2]
    t_len = real.shape[1]
    if real.shape[0] != b or t_len != context + n:
        raise ValueError(
            f"evaluate_retrieval: gen {tuple(gen.shape)} and real {tuple(real.shape)} "
            f"do not fit context={context}"
        )
    settings = {
        "pos_tol": pos_tol, "heading_tol": heading_tol, "window_reach": window_reach, "match": match,
        "criterion": criterion, "n_distractors": n_distractors if criterion == "rank" else None,
        "compare": ("SSIM(generated[t], real[t]) > SSIM(generated[t], real[d]) for every distractor d"
                    if criterion == "rank" else "SSIM(generated[t], real[t]) >= threshold"),
    }
    if criterion not in ("rank", "threshold"):
        raise ValueError(f"evaluate_retrieval: criterion must be rank or threshold, got {criterion!r}")
    if criterion == "rank" and n_distractors < 1:
        raise ValueError(f"evaluate_retrieval: n_distractors must be >= 1, got {n_distractors}")
    empty = _empty_result(bins, threshold, settings, criterion, n_distractors)
    if poses is None:
        return {**empty, "retrieval_skipped": "no poses given"}
    p = _check_poses(poses, "evaluate_retrieval")
    if p.shape[:2] != (b, t_len):
        raise ValueError(f"evaluate_retrieval: poses {tuple(p.shape)} do not fit real {tuple(real.shape)}")

    probes = find_revisits(p, pos_tol, heading_tol, window_reach, start=context, match=match)
    needles = [{**nd, "b": e} for e in range(b)
               if (nd := needle_probe(real[e], p[e], context, pos_tol, heading_tol, window_reach)) is not None]

    if threshold is not None:
        calibration: dict[str, Any] = {"source": "given"}
    else:
        calibration = _calibrate_on_ground_truth(real, p, probes, pos_tol, heading_tol, window_reach,
                                                 n_random_per_probe, seed)
        if calibration is None:
            return {**empty, "retrieval_skipped": "no revisit probes (or no random pairs) to calibrate on",
                    "n_probes": len(probes)}
        threshold = calibration["threshold"]

    if not probes:
        result = {**empty, "retrieval_threshold": threshold, "retrieval_calibration": calibration}
    else:
        probes, ok = _score_probes(gen, real, p, probes, context, threshold, criterion, window_reach, pos_tol,
                                   heading_tol, n_distractors, seed)
        by_span = retrieval_by_span(probes, ok, bins)
        result = {
            "retrieval_by_span": by_span,
            "retrieval_mean": mean_retrieval_rate(by_span),
            "retrieval_overall": float(ok.float().mean()),
            "retrieval_threshold": threshold,
            "retrieval_calibration": calibration,
            "retrieval_settings": settings,
            "n_probes": len(probes),
            "retrieval_chance": empty["retrieval_chance"],
        }
    result["needle"] = _score_needles(gen, real, needles, context, threshold)
    return result


def _empty_result(bins, threshold, settings, criterion, n_distractors) -> dict[str, Any]:
    """The retrieval fields when nothing could be scored (no poses, no probes)."""
    return {
        "retrieval_by_span": retrieval_by_span([], [], bins),
        "retrieval_mean": None,
        "retrieval_overall": None,
        "retrieval_threshold": threshold,
        "retrieval_calibration": {"source": "given"} if threshold is not None else None,
        "retrieval_settings": settings,
        "n_probes": 0,
        "retrieval_chance": 1.0 / (n_distractors + 1) if criterion == "rank" else None,
        "needle": {"n": 0, "hits": 0, "rate": None, "probes": []},
    }


def _score_probes(gen, real, poses, probes, context, threshold, criterion, window_reach, pos_tol, heading_tol,
                  n_distractors, seed):
    """(probes kept, retrieved bool per probe) under `criterion` (see `evaluate_retrieval`)."""
    # One SSIM per probe: generated frame t against ground-truth frame t.
    ga = torch.stack([gen[pr.b, pr.t - context] for pr in probes])  # (P, C, H, W)
    ra = torch.stack([real[pr.b, pr.t] for pr in probes])  # (P, C, H, W)
    scores = pair_ssim(ga, ra)  # (P,)
    if criterion == "threshold":
        return probes, scores >= threshold
    # probes without any distractor frame cannot be ranked: _rank_retrieved drops them
    return _rank_retrieved(gen, real, poses, probes, scores, context, window_reach, pos_tol, heading_tol,
                           n_distractors, seed)


def _calibrate_on_ground_truth(real, poses, probes, pos_tol, heading_tol, window_reach, n_random_per_probe,
                               seed) -> dict[str, Any] | None:
    """`calibrate_threshold` on the ground truth: the probes' true pairs (real[t], real[s]) against random
    pairs drawn from the same episodes with a fixed seed (reproducible). None when either set is empty."""
    g = torch.Generator().manual_seed(seed)
    true_a, true_b, rand_a, rand_b = [], [], [], []
    for e in range(real.shape[0]):
        mine = [pr for pr in probes if pr.b == e]
        if not mine:
            continue
        true_a.append(real[e, [pr.t for pr in mine]])
        true_b.append(real[e, [pr.s for pr in mine]])
        rp = _random_pairs(pose_match_matrix(poses[e], pos_tol, heading_tol), mine, window_reach,
                           n_random_per_probe, g)
        if rp:
            rand_a.append(real[e, [t for t, _ in rp]])
            rand_b.append(real[e, [r for _, r in rp]])
    if not true_a or not rand_a:
        return None
    calibration = calibrate_threshold(
        pair_ssim(torch.cat(true_a), torch.cat(true_b)), pair_ssim(torch.cat(rand_a), torch.cat(rand_b))
    )
    calibration["source"] = "calibrated on ground-truth revisit pairs vs random pairs of these episodes"
    return calibration


def _score_needles(gen, real, needles, context: int, threshold: float) -> dict[str, Any]:
    """The needle probes (`needle_probe`) scored by SSIM(generated[t], real[t]) >= threshold."""
    hits = []
    for nd in needles:
        score = float(pair_ssim(gen[nd["b"], nd["t"] - context][None], real[nd["b"], nd["t"]][None])[0])
        nd.update(ssim=score, retrieved=score >= threshold)
        hits.append(nd["retrieved"])
    return {"n": len(needles), "hits": sum(hits), "rate": sum(hits) / len(needles) if needles else None,
            "probes": needles}
