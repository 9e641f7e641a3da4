"""Lazy layers (LightTransfer, arXiv 2410.13846, Eq. 1): measuring, selecting and storing lazy ratios.

The lazy ratio of a temporal-attention layer is the attention mass that the queries of the last frames put
on the first (sink) and the most recent key frames, averaged over heads and queries. It is measured from the
log-sum-exp of the layer's own kernel calls, through the layer's generic seam (arvdm.model.layers): a
:class:`LazyRatioMeter` is an ``lse_observer``. Layers with the highest ratios are the ones to make streaming
(arvdm.hybrid.convert).

    layers = temporal_layers(model)
    with measuring(layers, sink=2, recent=4, last_frames=2) as meters:
        model.commit(state, context, context_actions)          # the prefill analogue: online ratios
    chosen = select_layers([m.ratio for m in meters], fraction=0.5)

A layer qualifies when it has ``retention`` (a ``memory.RetentionPolicy`` or None: the key frames its queries
read) and ``lse_observers`` (a list of callables, each called with an ``arvdm.model.layers.AttentionCall``
after every attention kernel call).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kernels
from arvdm.config import HybridConfig
from arvdm.errors import ArvdmError
from arvdm.model.checkpoint import run_folder
from arvdm.model.layers import AttentionCall

__all__ = ["RATIOS_NAME", "HybridError", "LazyRatioMeter", "check_layers", "load_lazy_ratios", "measuring",
           "num_streaming", "ratios_path", "resolve_layers", "select_layers", "temporal_layers"]

RATIOS_NAME = "lazy_ratios.json"


class HybridError(ArvdmError):
    """A hybrid-attention setting cannot be served (no ratios, too short a context, a bad layer index...)."""


# ------------------------------------------------------------------------------------------------
# layers and measurement
# ------------------------------------------------------------------------------------------------


def _is_switchable(module: Any) -> bool:
    return hasattr(module, "retention") and hasattr(module, "lse_observers")


def temporal_layers(model: Any) -> list[Any]:
    """The model's temporal-attention layers, in depth order.

    ``model.blocks[i].temporal`` when the model has it (the denoiser); otherwise every submodule that has
    both ``retention`` and ``lse_observers``, in ``named_modules`` order.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is not None and all(_is_switchable(getattr(b, "temporal", None)) for b in blocks):
        return [b.temporal for b in blocks]
    found = [m for _, m in model.named_modules() if _is_switchable(m)] if hasattr(model, "named_modules") else []
    if not found:
        raise HybridError(f"{type(model).__name__} has no temporal-attention layer with `retention` and "
                          "`lse_observers` attributes: hybrid attention cannot switch any layer")
    return found


@dataclass
class LazyRatioMeter:
    """An ``lse_observer`` that accumulates one layer's lazy ratio (LightTransfer, Eq. 1).

    For each full-attention call it takes the kept mass ``exp(lse_streaming - lse_full)`` of the query tokens
    of the call's last ``last_frames`` frames (reusing the call's own ``lse`` as ``lse_full``: one extra
    log-sum-exp per layer, no extra pass) and keeps its sum and count per call in ``calls``. Calls made
    while the layer already streams are skipped (their lse is not the full one).
    """

    sink: int
    recent: int
    last_frames: int
    calls: list[tuple[float, int]] = field(default_factory=list)

    @torch.no_grad()
    def __call__(self, call: AttentionCall) -> None:
        if call.recent_frames is not None:
            return
        tpf = call.tokens_per_frame
        kept = kernels.kept_attention_mass(
            call.q.detach(), call.k.detach(), tokens_per_frame=tpf, frames_per_chunk=call.frames_per_chunk,
            q_frame_offset=call.q_frame_offset, sink_frames=self.sink, recent_frames=self.recent,
            lse_full=call.lse.detach())  # (B', H, Lq)
        n_frames = call.q.shape[2] // tpf
        take = min(self.last_frames, n_frames)
        last = kept[:, :, (n_frames - take) * tpf:]  # (B', H, take * tpf)
        self.calls.append((float(last.double().sum()), last.numel()))

    @property
    def ratio(self) -> float:
        """Mean kept mass over every measured query (NaN when nothing was measured)."""
        total, count = sum(c[0] for c in self.calls), sum(c[1] for c in self.calls)
        return total / count if count else float("nan")

    def last_call_ratio(self) -> float:
        """Mean kept mass of the last measured call's queries (NaN when nothing was measured)."""
        total, count = self.calls[-1] if self.calls else (0.0, 0)
        return total / count if count else float("nan")


@contextlib.contextmanager
def measuring(layers: Sequence[Any], *, sink: int, recent: int, last_frames: int) -> Iterator[list[LazyRatioMeter]]:
    """Add a :class:`LazyRatioMeter` to every layer's ``lse_observers`` for the ``with`` body."""
    meters = [LazyRatioMeter(sink, recent, last_frames) for _ in layers]
    try:
        for layer, meter in zip(layers, meters):
            layer.lse_observers.append(meter)
        yield meters
    finally:
        for layer, meter in zip(layers, meters):
            if meter in layer.lse_observers:
                layer.lse_observers.remove(meter)


# ------------------------------------------------------------------------------------------------
# selection
# ------------------------------------------------------------------------------------------------


def num_streaming(n_layers: int, fraction: float) -> int:
    """How many of ``n_layers`` layers a ``fraction`` makes streaming (rounded half up)."""
    if not 0.0 <= fraction <= 1.0:
        raise HybridError(f"hybrid.fraction must be in [0, 1], got {fraction}")
    return min(n_layers, int(math.floor(fraction * n_layers + 0.5)))


def select_layers(ratios: Sequence[float], fraction: float) -> list[int]:
    """The layers with the highest lazy ratios, ``num_streaming(len(ratios), fraction)`` of them, ascending.

    LightTransfer's priority queue over layers: push (-ratio, index) and pop the top; the result equals
    sorting by ratio, high first, ties broken by the lower layer index. NaN ratios (never measured) rank last.
    """
    k = num_streaming(len(ratios), fraction)
    heap = [(-(r if math.isfinite(r) else -math.inf), i) for i, r in enumerate(ratios)]
    heapq.heapify(heap)
    return sorted(heapq.heappop(heap)[1] for _ in range(k))


def check_layers(chosen: Sequence[int], n_layers: int) -> list[int]:
    """``chosen`` as ints, each a layer index of a model with ``n_layers`` temporal layers (else HybridError)."""
    bad = [i for i in chosen if not 0 <= int(i) < n_layers]
    if bad:
        raise HybridError(f"hybrid.layers {list(chosen)}: {bad} out of range; the model has {n_layers} temporal "
                          f"layers (0..{n_layers - 1})")
    return [int(i) for i in chosen]


def resolve_layers(hybrid: HybridConfig, n_layers: int,
                   offline: dict[str, Any] | None) -> tuple[list[int], list[float]]:
    """Streaming layers and their ratios for ``select=offline|fixed`` (online selects during the rollout)."""
    if hybrid.select == "fixed":
        chosen = check_layers(hybrid.layers, n_layers)
        ratios = offline["ratios"] if offline else [float("nan")] * n_layers
        return sorted(chosen), ratios
    if offline is None:
        raise HybridError("hybrid.select=offline needs lazy ratios (hybrid.ratios=PATH or RUN/lazy_ratios.json "
                          "from `python -m arvdm.hybrid calibrate --run RUN`)")
    ratios = offline["ratios"]
    if len(ratios) != n_layers:
        raise HybridError(f"lazy ratios for {len(ratios)} layers, the model has {n_layers} temporal layers")
    return select_layers(ratios, hybrid.fraction), ratios


# ------------------------------------------------------------------------------------------------
# lazy_ratios.json
# ------------------------------------------------------------------------------------------------


def load_lazy_ratios(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``lazy_ratios.json`` (from ``python -m arvdm.hybrid calibrate``)."""
    path = Path(path)
    if not path.is_file():
        raise HybridError(f"{path}: no lazy ratios; run `python -m arvdm.hybrid calibrate --run RUN` first")
    try:
        data = json.loads(path.read_text())
        ratios = [float(x) for x in data["ratios"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise HybridError(f"{path}: not a lazy_ratios.json ({e})") from e
    data["ratios"] = ratios
    return data


def ratios_path(hybrid: HybridConfig, run_dir: str | os.PathLike | None) -> Path | None:
    """Where a run's lazy ratios are: ``hybrid.ratios`` when set, else RUN/lazy_ratios.json (None: no run)."""
    if hybrid.ratios:
        return Path(hybrid.ratios)
    return None if run_dir is None else run_folder(run_dir) / RATIOS_NAME
