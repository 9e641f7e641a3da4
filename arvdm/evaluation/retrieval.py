"""Memory-bottleneck probes: does a rollout reproduce a place when the agent comes back to it?

The paper's *memory bottleneck* ("history forgetting" in v2) is measured on revisits: frames whose pose
(position and heading) matches an earlier frame. A model that remembers should render the place as it
was. This module

1. takes the revisits found from ground-truth poses (``arvdm.evaluation.revisits.find_revisits``): for each
   generated frame t, the earlier frame s < t with a matching pose that lies *out of the network's direct
   reach* (t - s > window_reach), so that only memory can supply it;
2. calibrates the SSIM threshold that says "same place" (``calibrate_threshold``) on the ground truth:
   true revisit pairs SSIM(real[t], real[s]) against random non-revisit pairs SSIM(real[t], real[r]),
   choosing the threshold with the best balanced accuracy;
3. scores a probe as retrieved -- by default when SSIM(generated[t], real[t]) beats SSIM(generated[t], real[d])
   for every distractor frame d, else when it reaches the threshold -- and reports the rate binned by the
   gap t - s (``retrieval_by_span``: 0-16, 16-48, 48-112, 112+).

Why compare generated[t] with real[t] (and not with real[s]): at a revisit real[t] *is* what was seen at s,
up to the pose tolerance (a few degrees of heading, a fraction of a cell) and anything that moved. Comparing
with real[t] asks for exactly the view at t and so does not penalise a model for the legitimate small
difference between the two views; the calibration measures how large that difference is (true pairs
real[t] vs real[s]) and sets the threshold so that "generated[t] is as close to real[t] as a true revisit
view is" counts as retrieval. Pairing uses ground-truth poses only: the generated video has no poses.

Tensors: generated frames (B, N, C, H, W), ground truth (B, context + N, C, H, W) in [-1, 1], poses
(B, context + N, 3) = (x, y, heading in radians).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from arvdm.evaluation.metrics import span_label, ssim_per_frame
from arvdm.evaluation.revisits import (
    DEFAULT_HEADING_TOL,
    DEFAULT_POS_TOL,
    Probe,
    check_poses,
    find_revisits,
    needle_probe,
    pose_match_matrix,
    random_pairs,
)

__all__ = [
    "DEFAULT_BINS",
    "MIN_RELIABLE_BALANCED_ACCURACY",
    "calibrate_threshold",
    "evaluate_retrieval",
    "mean_retrieval_rate",
    "pair_ssim",
    "retrieval_by_span",
]

#: Gap bins (frames back) of the retrieval rates: the paper's 0-16 / 16-48 / 48-112, plus everything beyond.
DEFAULT_BINS: tuple[tuple[float, float], ...] = ((0, 16), (16, 48), (48, 112), (112, math.inf))

# Balanced accuracies this close to the best count as ties (float round-off of (TPR + TNR) / 2).
_TIE_TOL = 1e-12

#: Below this balanced accuracy a calibration carries a "warning" (chance level is 0.5).
MIN_RELIABLE_BALANCED_ACCURACY = 0.75


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
    best = np.flatnonzero(ba >= ba.max() - _TIE_TOL)
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


def _rank_retrieved(gen, real, poses, probes, scores, context, window_reach, pos_tol, heading_tol, k, seed):
    """Rank criterion: probe i is retrieved when its score beats SSIM(generated[t], real[d]) for all of
    k distractors d (``random_pairs``: pose unlike t's, |t - d| > window_reach). Returns the probes that
    had distractors and a bool tensor of their outcomes."""
    g = torch.Generator().manual_seed(seed + 1)  # a stream apart from the calibration's (seed)
    match = {e: pose_match_matrix(poses[e], pos_tol, heading_tol) for e in {pr.b for pr in probes}}  # (T, T) each
    kept, ok = [], []
    for i, pr in enumerate(probes):
        pairs = random_pairs(match[pr.b], [pr], window_reach, k, g)
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
    pos_tol: float = DEFAULT_POS_TOL,
    heading_tol: float = DEFAULT_HEADING_TOL,
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
      ``retrieval_chance``. It needs no absolute SSIM level: views of one maze can score similar SSIMs
      whether or not they show the same place, which a single threshold separates poorly.
    - ``threshold``: SSIM(generated[t], real[t]) >= a calibrated (or given) threshold.

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
    _check_fit(gen, real, context)
    settings = _retrieval_settings(pos_tol, heading_tol, window_reach, match, criterion, n_distractors)
    empty = _empty_result(bins, threshold, settings, criterion, n_distractors)
    if poses is None:
        return {**empty, "retrieval_skipped": "no poses given"}
    p = check_poses(poses, "evaluate_retrieval")
    if p.shape[:2] != real.shape[:2]:
        raise ValueError(f"evaluate_retrieval: poses {tuple(p.shape)} do not fit real {tuple(real.shape)}")

    probes = find_revisits(p, pos_tol, heading_tol, window_reach, start=context, match=match)
    needles = [{**nd, "b": e} for e in range(real.shape[0])
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
        result = {**_rates(probes, ok, bins), "retrieval_threshold": threshold,
                  "retrieval_calibration": calibration, "retrieval_settings": settings, "n_probes": len(probes),
                  "retrieval_chance": empty["retrieval_chance"]}
    result["needle"] = _score_needles(gen, real, needles, context, threshold)
    return result


def _check_fit(gen: Tensor, real: Tensor, context: int) -> None:
    """gen (B, N, ...) must be the frames after ``context`` of real (B, context + N, ...)."""
    b, n = gen.shape[:2]
    if real.shape[0] != b or real.shape[1] != context + n:
        raise ValueError(
            f"evaluate_retrieval: gen {tuple(gen.shape)} and real {tuple(real.shape)} "
            f"do not fit context={context}"
        )


def _retrieval_settings(pos_tol, heading_tol, window_reach, match, criterion, n_distractors) -> dict[str, Any]:
    """eval.json's ``retrieval_settings`` (how probes were found and scored), after checking the criterion."""
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
    return settings


def _rates(probes: Sequence[Probe], ok: Tensor, bins: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The scored probes' retrieval rate per gap bin, their mean over bins, and the rate over all probes."""
    by_span = retrieval_by_span(probes, ok, bins)
    return {"retrieval_by_span": by_span, "retrieval_mean": mean_retrieval_rate(by_span),
            "retrieval_overall": float(ok.float().mean())}


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
        rp = random_pairs(pose_match_matrix(poses[e], pos_tol, heading_tol), mine, window_reach,
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
