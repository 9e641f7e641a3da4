"""The revisit score of a rollout: PSNR on the frames only memory can supply, beside copy-last and the oracle.

    score = revisit_score(gen, real, context, recent=6, poses=poses)
    print(score["message"])      # says in words whether memory helps on the revisits

`gen` (B, N, C, H, W) are the generated frames after `context` ground-truth frames of `real` (B, context + N,
...). The probes are `arvdm.evaluation.probes.memory_probes_batch(real, poses, recent, start=context)`: generated
frames whose view an earlier frame (older than the `recent` frames the model sees directly) shows and no recent
frame does. On them the model is compared with copy-last (the last context frame) and with the **oracle** (the
best-matching earlier ground-truth frame, what a perfect memory could copy); pooled over probes with event-level
bootstrap intervals, and `closes` = (model - copy-last) / (oracle - copy-last), the share of the oracle's gap the
model recovers. PSNRs are capped at PSNR_CAP dB (identical frames would be infinite).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from arvdm.evaluation.baselines import baseline_frames
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame
from arvdm.evaluation.probes import MIN_EVENTS, memory_probes_batch, paired_difference, pooled_rate, values_at

__all__ = ["revisit_score"]


def revisit_score(gen: Tensor, real: Tensor, context: int, recent: int, poses: Tensor | None = None,
                  n_boot: int = 1000, seed: int = 0, per_probe: bool = False) -> dict[str, Any]:
    """Model / copy-last / oracle PSNR on the memory probes of a rollout, with intervals and a verdict in words.

    ``per_probe``: also return ``"per_probe"``, {"b", "t", "s", "event", "model"} lists (episode, frame, its matching
    earlier frame, event id and the model's PSNR of every probe; t and s count from the episode's first frame), so
    that two rollouts of the same episodes can be paired probe by probe (``arvdm.experiments.paired``)."""
    n = gen.shape[1]
    if real.shape[1] < context + n or context < 1:
        raise ValueError(f"revisit_score: real has {real.shape[1]} frames, need context ({context} >= 1) + "
                         f"generated ({n})")
    real = real[:, :context + n]
    probes = memory_probes_batch(real.float(), None if poses is None else poses[:, :context + n], recent,
                                 start=context)
    events = len({p.event for p in probes})
    if events < MIN_EVENTS:
        return {"probes": len(probes), "events": events, "recent": recent,
                "message": f"revisits: {len(probes)} probes in {events} events (fewer than {MIN_EVENTS}): too few to "
                           f"read memory from this rollout"}
    ids = [p.event for p in probes]
    target = real[:, context:].float()

    def at(frames: Tensor) -> np.ndarray:
        return np.minimum(values_at(psnr_per_frame(frames.float(), target), probes, offset=context), PSNR_CAP)

    model = at(gen)
    copy = at(baseline_frames(real.float(), context, n, "copy_last"))
    oracle = np.minimum(np.array([p.psnr for p in probes], dtype=np.float64), PSNR_CAP)
    vs_copy = paired_difference(model, copy, ids, n_boot=n_boot, seed=seed)
    gap = float(oracle.mean() - copy.mean())
    closes = float(model.mean() - copy.mean()) / gap if gap > 0 else None
    helps = vs_copy["lo"] > 0
    message = (f"revisits ({len(probes)} probes, {events} events): model {model.mean():.2f} dB vs copy-last "
               f"{copy.mean():.2f} dB (difference {vs_copy['mean']:+.2f}, 95% [{vs_copy['lo']:+.2f}, "
               f"{vs_copy['hi']:+.2f}]), oracle {oracle.mean():.2f} dB"
               + (f"; the model closes {closes:.0%} of the oracle's gap" if closes is not None else "")
               + ("" if helps else "; memory does NOT help on these revisits (the model does not beat copy-last)"))
    extra = {"per_probe": {"b": [p.b for p in probes], "t": [p.t for p in probes], "s": [p.s for p in probes],
                           "event": ids,
                           "model": model.tolist()}} if per_probe else {}
    return {**extra, "probes": len(probes), "events": events, "recent": recent,
            "model": pooled_rate(model, ids, n_boot=n_boot, seed=seed),
            "copy_last": pooled_rate(copy, ids, n_boot=n_boot, seed=seed),
            "oracle": pooled_rate(oracle, ids, n_boot=n_boot, seed=seed),
            "model_minus_copy_last": vs_copy, "closes": closes, "helps": bool(helps), "message": message}
