"""A rollout's whole evaluation and the ``eval.json`` format.

    result = evaluate_rollout(fake, real, poses, context=8, window_reach=8)   # a JSON-ready dict
    write_eval_json("out/eval.json", result, extra={"config": cfg.to_dict()})

``evaluate_rollout`` puts together the per-frame measures of ``arvdm.evaluation.metrics`` (PSNR/SSIM by span, max
PSNR decay), the trivial baselines and sharpness of ``arvdm.evaluation.baselines`` (copy-last, context-mean,
spatial-gradient ratio, a verdict in words) and the revisit retrieval of ``arvdm.evaluation.retrieval``.
Every field is described in docs/evaluation.md.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from arvdm.evaluation.baselines import baseline_frames, compare_with_baselines
from arvdm.evaluation.metrics import (
    check_videos,
    max_psnr_decay,
    psnr_per_frame,
    ssim_per_frame,
    summarise_by_span,
)
from arvdm.evaluation.retrieval import evaluate_retrieval
from arvdm.evaluation.revisits import DEFAULT_HEADING_TOL, DEFAULT_POS_TOL
from data.atomic import atomic_write_text

__all__ = ["EVAL_FORMAT", "REQUIRED_EVAL_KEYS", "evaluate_rollout", "read_eval_json", "to_jsonable",
           "write_eval_json"]

#: Version tag written into every eval.json so readers can tell formats apart.
EVAL_FORMAT = "arvdm.eval/1"

#: Keys every eval.json must carry (the experiment tables read them); write_eval_json refuses a result without them.
REQUIRED_EVAL_KEYS = (
    "psnr_by_span",
    "ssim_by_span",
    "max_psnr_decay",
    "retrieval_by_span",
    "retrieval_threshold",
    "n_frames",
    "n_probes",
)


def _split_generated(fake: Tensor, real: Tensor, context: int) -> Tensor:
    """Return the generated part of ``fake`` (B, T - context, ...) given a full ground-truth ``real``."""
    t_real, t_fake = real.shape[1], fake.shape[1]
    if not 0 <= context < t_real:
        raise ValueError(f"evaluate_rollout: context={context} must be in [0, {t_real}) (frames of real)")
    if t_fake == t_real:
        return fake[:, context:]  # full video: context frames then generated ones
    if t_fake == t_real - context:
        return fake  # generated frames only
    raise ValueError(
        f"evaluate_rollout: fake has {t_fake} frames; expected {t_real} (context + generated, like real) "
        f"or {t_real - context} (generated only, real has {t_real} = {context} context + generated)"
    )


def evaluate_rollout(
    fake: Tensor,
    real: Tensor,
    poses: Tensor | None,
    context: int,
    window_reach: int,
    threshold: float | None = None,
    *,
    span: int = 16,
    pos_tol: float = DEFAULT_POS_TOL,
    heading_tol: float = DEFAULT_HEADING_TOL,
    bins: Sequence[tuple[float, float]] | None = None,
    n_random_per_probe: int = 4,
    seed: int = 0,
    criterion: str = "rank",
    n_distractors: int = 4,
    baselines: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything eval.json reports for a batch of rollouts against their ground-truth episodes.

    Args:
        fake: generated frames, either (B, T - context, C, H, W) or the full (B, T, C, H, W) whose first
            ``context`` frames are the conditioning frames.
        real: ground-truth episodes (B, T, C, H, W) in [-1, 1], context frames included.
        poses: ground-truth poses (B, T, 3) = (x, y, heading in radians), or None to skip retrieval.
        context: number of ground-truth frames the rollout was conditioned on.
        window_reach: frames the network sees without its memory (revisits with gap <= this are not
            probes; see ``arvdm.evaluation.retrieval.find_revisits``).
        threshold: retrieval SSIM threshold; None calibrates it on the ground truth of these episodes
            (true revisit pairs vs random pairs, ``arvdm.evaluation.retrieval.calibrate_threshold``).
        span: frames per span of the PSNR / SSIM summaries.
        pos_tol, heading_tol: pose tolerances of a revisit (position units of the pose, radians).
        bins: gap bins of the retrieval rates (default ``arvdm.evaluation.retrieval.DEFAULT_BINS``).
        n_random_per_probe, seed: random (non-revisit) pairs drawn per probe for calibration.
        criterion, n_distractors: when a revisit counts as retrieved
            (``arvdm.evaluation.retrieval.evaluate_retrieval``);
            the copy-last predictor is scored the same way (``retrieval_baselines``).
        baselines: ``compare_with_baselines(gen, real, context, span)`` if the caller already has it
            (``sample_run`` does), so it is not computed twice.
    Returns:
        A JSON-ready dict; see docs/evaluation.md for every field.
    """
    check_videos(real, real, "evaluate_rollout")
    gen = _split_generated(fake, real, context)  # (B, N, C, H, W)
    target = real[:, context:]  # (B, N, C, H, W)
    check_videos(gen, target, "evaluate_rollout")
    n = gen.shape[1]
    result = _frame_measures(gen, target, context, span)
    # Beside the model, always: copy-last, context-mean, sharpness and a verdict (arvdm.evaluation.baselines).
    if context >= 1:
        result.update(baselines or compare_with_baselines(gen, real[:, :context + n], context, span))
    kw = dict(context=context, window_reach=window_reach, threshold=threshold, pos_tol=pos_tol,
              heading_tol=heading_tol, bins=bins, n_random_per_probe=n_random_per_probe, seed=seed,
              criterion=criterion, n_distractors=n_distractors)
    result.update(_retrieval_fields(gen, real, poses, kw))
    return result


def _frame_measures(gen: Tensor, target: Tensor, context: int, span: int) -> dict[str, Any]:
    """PSNR / SSIM per frame of gen vs target (B, N, C, H, W) each: by span, curves, means, max PSNR decay."""
    b, n = gen.shape[:2]
    psnr = psnr_per_frame(gen, target)  # (B, N)
    ssim = ssim_per_frame(gen, target)  # (B, N)
    psnr_spans = summarise_by_span(psnr, span)
    ssim_spans = summarise_by_span(ssim, span)
    # Label the worst span for the reader; NaN spans (no values) cannot be the worst.
    ranked = [s for s in psnr_spans if not math.isnan(s["mean"])] or psnr_spans
    first, worst = psnr_spans[0], min(ranked, key=lambda s: s["mean"])
    return {
        "format": EVAL_FORMAT,
        "n_episodes": b,
        "context": context,
        "n_generated": n,
        "n_frames": b * n,
        "span": span,
        "psnr_by_span": psnr_spans,
        "ssim_by_span": ssim_spans,
        "max_psnr_decay": max_psnr_decay(psnr_spans),
        "max_psnr_decay_spans": {"first": first["label"], "worst": worst["label"]},
        "psnr_mean": float(psnr.double().mean()),
        "ssim_mean": float(ssim.double().mean()),
        "psnr_curve": psnr.double().mean(0).tolist(),
        "ssim_curve": ssim.double().mean(0).tolist(),
    }


def _retrieval_fields(gen: Tensor, real: Tensor, poses: Tensor | None, kw: dict[str, Any]) -> dict[str, Any]:
    """`evaluate_retrieval` of the model and, when there are probes, of copy-last on the same probes."""
    result = evaluate_retrieval(gen, real, poses, **kw)
    context, n = kw["context"], gen.shape[1]
    if context >= 1 and result.get("n_probes"):
        # the same probes scored on a predictor without memory: what retrieval a still world gets
        kw = {**kw, "threshold": result["retrieval_threshold"]}  # calibrated once, on the ground truth, above
        copy = evaluate_retrieval(baseline_frames(real, context, n, "copy_last"), real, poses, **kw)
        result["retrieval_baselines"] = {"copy_last": {"retrieval_mean": copy["retrieval_mean"],
                                                       "retrieval_by_span": copy["retrieval_by_span"]}}
    return result


def to_jsonable(obj: Any) -> Any:
    """Recursively turn tensors / numpy values / tuples into JSON types; NaN and ±inf become None.

    Strict JSON has no NaN or Infinity, and other tools (jq, JavaScript) reject Python's extensions.
    """
    if isinstance(obj, Tensor) or (hasattr(obj, "tolist") and not isinstance(obj, (str, bytes))):
        obj = obj.tolist()
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_eval_json(
    path: str | os.PathLike, result: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> Path:
    """Write an evaluation result (``evaluate_rollout``'s dict, plus ``extra`` such as the run's config)
    to ``path`` as indented JSON, atomically. Raises ``KeyError`` naming any of ``REQUIRED_EVAL_KEYS``
    that is missing, so a partial result never reaches the experiment tables.
    """
    data = dict(result)
    if extra:
        data.update(extra)
    missing = [k for k in REQUIRED_EVAL_KEYS if k not in data]
    if missing:
        raise KeyError(f"write_eval_json: result lacks required fields {missing}")
    data.setdefault("format", EVAL_FORMAT)
    text = json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def read_eval_json(path: str | os.PathLike) -> dict[str, Any]:
    """Load an eval.json written by ``write_eval_json`` (clear error naming the file if it is not one)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"read_eval_json: cannot read {path}: {e}") from None
    missing = [k for k in REQUIRED_EVAL_KEYS if k not in data]
    if missing:
        raise ValueError(f"read_eval_json: {path} lacks required fields {missing}")
    return data
