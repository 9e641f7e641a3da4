"""Hybrid attention (LightTransfer, arXiv 2410.13846) for the temporal attention of a video model.

Some temporal-attention layers are "lazy": their queries put almost all their attention on the first
(sink) frames and the most recent ones. Those layers become streaming layers (sink + recent frames, their
KV caches cut at once and bounded from then on); the others keep the full memory.

    python -m arvdm.hybrid calibrate --run RUN      # offline lazy ratios -> RUN/lazy_ratios.json
    python -m arvdm.hybrid report --run RUN         # heat map + fraction x selection table, plots
    python sample.py --run RUN --hybrid 0.5         # roll out with half of the layers streaming

This module is the model side (measure, select, convert, wrap for sampling/training); calibration, the
report and the CLI are in arvdm.hybrid.report.

Library use (generic: any model whose temporal layers expose ``streaming`` and ``attention_probe``)::

    layers = temporal_layers(model)
    with measuring(layers, sink=2, recent=4, last_frames=2) as meters:
        model.commit(state, context, context_actions)          # the prefill analogue: online ratios
    chosen = select_layers([m.ratio for m in meters], fraction=0.5)
    convert(layers, chosen, sink=2, recent=4, caches=state.caches, n_committed=state.n_committed)

A layer qualifies when it has ``streaming`` (None or ``(sink, recent)``) and ``attention_probe`` (None or a
callable ``probe(q, k, lse, *, streaming, tokens_per_frame, frames_per_chunk, q_frame_offset)`` that the
layer calls after each attention kernel call with that call's log-sum-exp).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
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
from arvdm.config import Config, HybridConfig
from arvdm.errors import ArvdmError
from memory import RetentionPolicy

__all__ = [
    "HybridError",
    "HybridModel",
    "LazyRatioMeter",
    "RATIOS_NAME",
    "apply_for_training",
    "convert",
    "layer_policies",
    "load_lazy_ratios",
    "measuring",
    "num_streaming",
    "resolve_layers",
    "select_layers",
    "temporal_layers",
]

RATIOS_NAME = "lazy_ratios.json"


class HybridError(ArvdmError):
    """A hybrid-attention setting cannot be served (no ratios, too short a context, a bad layer index...)."""


# ------------------------------------------------------------------------------------------------
# layers and measurement
# ------------------------------------------------------------------------------------------------


def _is_switchable(module: Any) -> bool:
    return hasattr(module, "streaming") and hasattr(module, "attention_probe")


def temporal_layers(model: Any) -> list[Any]:
    """The model's temporal-attention layers, in depth order.

    ``model.blocks[i].temporal`` when the model has it (the denoiser); otherwise every submodule that has
    both ``streaming`` and ``attention_probe``, in ``named_modules`` order.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is not None and all(_is_switchable(getattr(b, "temporal", None)) for b in blocks):
        return [b.temporal for b in blocks]
    found = [m for _, m in model.named_modules() if _is_switchable(m)] if hasattr(model, "named_modules") else []
    if not found:
        raise HybridError(f"{type(model).__name__} has no temporal-attention layer with `streaming` and "
                          "`attention_probe` attributes: hybrid attention cannot switch any layer")
    return found


@dataclass
class LazyRatioMeter:
    """An ``attention_probe`` that accumulates one layer's lazy ratio (LightTransfer, Eq. 1).

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
    def __call__(self, q, k, lse, *, streaming, tokens_per_frame, frames_per_chunk, q_frame_offset):
        if streaming is not None:
            return
        kept = kernels.kept_attention_mass(
            q.detach(), k.detach(), tokens_per_frame=tokens_per_frame, frames_per_chunk=frames_per_chunk,
            q_frame_offset=q_frame_offset, sink_frames=self.sink, recent_frames=self.recent,
            lse_full=lse.detach())  # (B', H, Lq)
        n_frames = q.shape[2] // tokens_per_frame
        take = min(self.last_frames, n_frames)
        last = kept[:, :, (n_frames - take) * tokens_per_frame:]  # (B', H, take * tpf)
        self.calls.append((float(last.double().sum()), last.numel()))

    @property
    def ratio(self) -> float:
        """Mean kept mass over every measured query (NaN when nothing was measured)."""
        total, count = sum(c[0] for c in self.calls), sum(c[1] for c in self.calls)
        return total / count if count else float("nan")

    def last_call_ratio(self) -> float:
        total, count = self.calls[-1] if self.calls else (0.0, 0)
        return total / count if count else float("nan")


@contextlib.contextmanager
def measuring(layers: Sequence[Any], *, sink: int, recent: int, last_frames: int) -> Iterator[list[LazyRatioMeter]]:
    """Install a :class:`LazyRatioMeter` as every layer's ``attention_probe`` for the ``with`` body."""
    previous = [layer.attention_probe for layer in layers]
    meters = [LazyRatioMeter(sink, recent, last_frames) for _ in layers]
    try:
        for layer, meter in zip(layers, meters):
            layer.attention_probe = meter
        yield meters
    finally:
        for layer, probe in zip(layers, previous):
            layer.attention_probe = probe


# ------------------------------------------------------------------------------------------------
# selection and conversion
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


def streaming_policy(sink: int, recent: int) -> RetentionPolicy:
    """The cache policy of a streaming layer: the first ``sink`` frames + the last ``recent``."""
    return RetentionPolicy("sink_recent", sink=sink, recent=recent)


def layer_policies(base: RetentionPolicy, n_layers: int, chosen: Sequence[int], sink: int,
                   recent: int) -> list[RetentionPolicy]:
    """Per-layer cache policies: streaming for ``chosen``, ``base`` (the memory's policy) for the rest."""
    return [streaming_policy(sink, recent) if i in set(chosen) else base for i in range(n_layers)]


def convert(layers: Sequence[Any], chosen: Sequence[int], *, sink: int, recent: int,
            caches: Sequence[Any] | None = None, n_committed: int | None = None) -> None:
    """Make ``chosen`` layers streaming (sink + recent) and the others full; cut the chosen caches at once.

    With ``caches`` (one per layer, e.g. ``RolloutState.caches``) the chosen layers' caches switch to the
    sink + recent policy and drop what it does not keep now (``n_committed`` frames committed so far); the
    other caches are left exactly as they are.
    """
    chosen = set(_check_layers(chosen, len(layers)))
    for i, layer in enumerate(layers):
        layer.streaming = (sink, recent) if i in chosen else None
    if caches:
        if len(caches) != len(layers):
            raise HybridError(f"{len(caches)} caches for {len(layers)} temporal layers")
        for i in chosen:
            caches[i].policy = streaming_policy(sink, recent)
            caches[i].evict(n_committed)


def _check_layers(chosen: Sequence[int], n_layers: int) -> list[int]:
    bad = [i for i in chosen if not 0 <= int(i) < n_layers]
    if bad:
        raise HybridError(f"hybrid.layers {list(chosen)}: {bad} out of range; the model has {n_layers} temporal "
                          f"layers (0..{n_layers - 1})")
    return [int(i) for i in chosen]


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
    if hybrid.ratios:
        return Path(hybrid.ratios)
    return None if run_dir is None else _run_root(Path(run_dir)) / RATIOS_NAME


def _run_root(path: Path) -> Path:
    """A run folder from a run folder or one of its checkpoint folders."""
    return path.parent.parent if path.parent.name == "checkpoints" else path


def resolve_layers(hybrid: HybridConfig, n_layers: int,
                   offline: dict[str, Any] | None) -> tuple[list[int], list[float]]:
    """Streaming layers and their ratios for ``select=offline|fixed`` (online selects during the rollout)."""
    if hybrid.select == "fixed":
        chosen = _check_layers(hybrid.layers, n_layers)
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
# a rollout-ready hybrid model
# ------------------------------------------------------------------------------------------------


class HybridModel:
    """A denoiser whose lazy temporal layers stream; drop-in for :func:`arvdm.pipeline.rollout`.

    ``select=online``: every rollout's first commit (the context) runs with all layers full and meters on
    (the prefill analogue), then the top ``fraction`` by lazy ratio convert and their caches are cut at
    once. A context of at most ``sink + recent`` frames drops no key (every ratio would be 1), so it falls
    back to the offline ratios. ``offline`` / ``fixed``: the layers are chosen up front and stream from the
    start (their caches never grow past ``sink + recent``). ``selections`` records every rollout's choice.
    """

    def __init__(self, model: Any, hybrid: HybridConfig, offline: dict[str, Any] | None = None):
        hybrid.validate()
        self.model, self.hybrid, self.offline = model, hybrid, offline
        self.layers = temporal_layers(model)
        self.frames_per_chunk = getattr(model, "frames_per_chunk", 1)
        self.cfg = getattr(model, "cfg", None)
        mem = getattr(self.cfg, "memory", None)
        if mem is not None and mem.compressor != "none":
            raise HybridError(f"hybrid attention needs raw memory frames (memory.compressor=none), the run has "
                              f"memory.compressor={mem.compressor}")
        self.base_policy = RetentionPolicy.from_config(mem) if mem is not None else RetentionPolicy("all")
        cap = self.base_policy.capacity
        if cap is not None and hybrid.sink + hybrid.recent >= cap:
            raise HybridError(f"hybrid.sink + hybrid.recent = {hybrid.sink + hybrid.recent} frames, but the full "
                              f"layers keep only {cap} (memory.length): a streaming layer would save nothing")
        self.selections: list[dict[str, Any]] = []
        self.last_state: Any = None
        self._pending: set[int] = set()
        self.fixed: tuple[list[int], list[float]] | None = None
        self.streaming_layers: list[int] = []  # this wrapper's current choice
        if hybrid.select != "online":
            self.fixed = resolve_layers(hybrid, len(self.layers), offline)
            self.streaming_layers = list(self.fixed[0])
        self._activate()

    def _activate(self) -> None:
        """Set the layers' switches to this wrapper's choice (several wrappers may share one model)."""
        for i, layer in enumerate(self.layers):
            want = (self.hybrid.sink, self.hybrid.recent) if i in self.streaming_layers else None
            if layer.streaming != want:
                layer.streaming = want

    def check_schedule(self, *args, **kwargs):
        return self.model.check_schedule(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self._activate()
        return self.model(*args, **kwargs)

    def init_state(self, batch_size: int):
        h = self.hybrid
        if self.fixed is not None:
            chosen, ratios = self.fixed
            self.streaming_layers = list(chosen)
            self._activate()
            state = self.model.init_state(batch_size, layer_policies=layer_policies(
                self.base_policy, len(self.layers), chosen, h.sink, h.recent))
            self._record(chosen, ratios, h.select)
        else:
            self.streaming_layers = []  # measure with every layer full
            self._activate()
            state = self.model.init_state(batch_size)
            self._pending.add(id(state))
        self.last_state = state
        return state

    def commit(self, state, frames, actions, poses=None) -> None:
        self._activate()
        if id(state) not in self._pending:
            self.model.commit(state, frames, actions, poses)
            return
        self._pending.discard(id(state))
        h = self.hybrid
        with measuring(self.layers, sink=h.sink, recent=h.recent, last_frames=h.last_frames) as meters:
            self.model.commit(state, frames, actions, poses)
        if state.n_committed > h.sink + h.recent:
            ratios = [m.ratio for m in meters]
            chosen, source = select_layers(ratios, h.fraction), "online"
        else:  # too short a context: no key would be dropped, every ratio would be 1
            if self.offline is None:
                raise HybridError(f"hybrid.select=online: the context has {state.n_committed} frames, not more "
                                  f"than hybrid.sink + hybrid.recent = {h.sink + h.recent}, and there are no "
                                  "offline lazy ratios to fall back to (run `python -m arvdm.hybrid calibrate`)")
            chosen, ratios = resolve_layers(dataclasses.replace(h, select="offline"), len(self.layers), self.offline)
            source = "offline (context too short)"
        convert(self.layers, chosen, sink=h.sink, recent=h.recent, caches=state.caches,
                n_committed=state.n_committed)
        self.streaming_layers = list(chosen)
        self._record(chosen, ratios, source)

    def _record(self, chosen: list[int], ratios: list[float], source: str) -> None:
        self.selections.append({"layers": list(chosen), "ratios": [None if not math.isfinite(r) else r
                                                                   for r in ratios], "source": source})

    def summary(self) -> dict[str, Any]:
        """What eval.json records: settings and, per rollout batch, the streaming layers and the ratios."""
        h = self.hybrid
        return {"fraction": h.fraction, "select": h.select, "sink": h.sink, "recent": h.recent,
                "last_frames": h.last_frames, "n_layers": len(self.layers), "selections": self.selections}

    def restore(self) -> None:
        """Every layer back to full attention."""
        self.streaming_layers = []
        convert(self.layers, [], sink=self.hybrid.sink, recent=self.hybrid.recent)


def describe(summary: dict[str, Any]) -> str:
    """One line per rollout batch: which layers stream, with their ratios."""
    lines = []
    for j, sel in enumerate(summary["selections"]):
        ratios = ", ".join(f"{i}:{'n/a' if r is None else f'{r:.3f}'}" for i, r in enumerate(sel["ratios"]))
        lines.append(f"hybrid batch {j}: streaming layers {sel['layers']} of {summary['n_layers']} "
                     f"(sink {summary['sink']} + recent {summary['recent']}; {sel['source']}); "
                     f"lazy ratios {ratios}")
    return "\n".join(lines)


def apply_for_training(model: Any, cfg: Config, run_dir: str | os.PathLike | None) -> list[int]:
    """Fine-tune mode: make the chosen layers stream during training; record them in ``cfg.hybrid``.

    ``select=offline`` reads the lazy ratios (``hybrid.ratios`` or RUN/lazy_ratios.json) and the chosen
    layers are written back as ``select=fixed, layers=[...]``, so the saved run config says exactly which
    layers the weights were trained to stream (and a resume picks the same ones).
    """
    h = cfg.hybrid
    layers = temporal_layers(model)
    if h.select == "online":
        raise HybridError("hybrid.select=online measures during a rollout's context commit; to fine-tune, use "
                          "hybrid.select=offline (lazy_ratios.json) or hybrid.select=fixed with hybrid.layers")
    path = ratios_path(h, run_dir) if h.select == "offline" else None
    offline = load_lazy_ratios(path) if path is not None else None
    chosen, _ = resolve_layers(h, len(layers), offline)
    convert(layers, chosen, sink=h.sink, recent=h.recent)
    for c in (cfg, getattr(model, "cfg", None)):
        if c is not None:
            c.hybrid.select, c.hybrid.layers = "fixed", list(chosen)
    return chosen


def wrap_for_sampling(model: Any, cfg: Config, run_dir: str | os.PathLike, overrides: dict[str, Any] | None):
    """``(model or HybridModel, hybrid config)`` for a run's config plus sample-time overrides."""
    h = copy.deepcopy(cfg.hybrid)
    for key, value in (overrides or {}).items():
        if not hasattr(h, key):
            raise HybridError(f"unknown hybrid key {key!r}; hybrid has {sorted(vars(h))}")
        setattr(h, key, value)
    try:
        h.validate()
    except ValueError as e:
        raise HybridError(str(e)) from e
    if not h.active:
        return model, h
    path = ratios_path(h, run_dir)
    offline = load_lazy_ratios(path) if path is not None and (h.select == "offline" or path.is_file()) else None
    return HybridModel(model, h, offline), h
