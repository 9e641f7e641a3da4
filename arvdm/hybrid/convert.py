"""Hybrid attention (LightTransfer, arXiv 2410.13846) for the temporal attention of a video model.

Some temporal-attention layers are "lazy": their queries put almost all their attention on the first
(sink) frames and the most recent ones (arvdm.hybrid.lazy measures that). Those layers become streaming
layers (sink + recent frames, their KV caches cut at once and bounded from then on); the others keep the
full memory.

    python -m arvdm.hybrid calibrate --run RUN      # offline lazy ratios -> RUN/lazy_ratios.json
    python -m arvdm.hybrid report --run RUN         # heat map + fraction x selection table, plots
    python sample.py --run RUN --hybrid 0.5         # roll out with half of the layers streaming

This module converts layers and wraps a model for sampling (:class:`HybridModel`) and fine-tuning
(:func:`apply_for_training`); calibration, the report and the CLI are in arvdm.hybrid.report.
A layer is switched through its generic seam (arvdm.model.layers.TemporalAttention): its ``retention``
policy says which key frames its queries read, and its KV cache gets the same policy.

    convert_layers(layers, chosen, sink=2, recent=4, caches=state.caches, n_committed=state.n_committed)
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from arvdm.config import Config, ConfigError, HybridConfig
from arvdm.hybrid.lazy import (
    HybridError,
    check_layers,
    load_lazy_ratios,
    measuring,
    ratios_path,
    resolve_layers,
    select_layers,
    temporal_layers,
)
from memory import RetentionPolicy

__all__ = ["HybridModel", "apply_for_training", "convert_layers", "describe", "keeping_sinks", "layer_policies",
           "streaming_policy", "wrap_for_sampling"]


def streaming_policy(sink: int, recent: int) -> RetentionPolicy:
    """The key frames of a streaming layer (and what its cache keeps): the first ``sink`` + the last ``recent``."""
    return RetentionPolicy("sink_recent", sink=sink, recent=recent)


def layer_policies(base: RetentionPolicy, n_layers: int, chosen: Sequence[int], sink: int,
                   recent: int) -> list[RetentionPolicy]:
    """Per-layer cache policies: streaming for ``chosen``, ``base`` (the memory's policy) for the rest."""
    return [streaming_policy(sink, recent) if i in set(chosen) else base for i in range(n_layers)]


def keeping_sinks(base: RetentionPolicy, sink: int, recent: int) -> RetentionPolicy:
    """The smallest policy that keeps what ``base`` keeps and what ``streaming_policy(sink, recent)`` keeps.

    A cache that may become streaming after the commit under way (online selection) uses it, so that a
    ``last`` memory shorter than the context does not evict the absolute sink frames 0..sink-1 first.
    """
    if base.kind == "all":
        return base
    if base.kind == "last":  # recent < length (HybridModel checks sink + recent < capacity)
        return RetentionPolicy("sink_recent", sink=sink, recent=max(base.length, recent))
    return RetentionPolicy("sink_recent", sink=max(base.sink, sink), recent=max(base.recent, recent))


def convert_layers(layers: Sequence[Any], chosen: Sequence[int], *, sink: int, recent: int,
                   caches: Sequence[Any] | None = None, n_committed: int | None = None) -> None:
    """Make ``chosen`` layers streaming (sink + recent) and the others full; cut the chosen caches at once.

    With ``caches`` (one per layer, e.g. ``RolloutState.caches``) the chosen layers' caches switch to the
    sink + recent policy, drop what it does not keep now (``n_committed`` frames committed so far) and
    release their long buffers (``KVCache.shrink_to_fit``); the other caches are left exactly as they are.
    A chosen cache must still hold every frame the streaming policy keeps (the absolute sinks 0..sink-1
    included), else HybridError and nothing is changed.
    """
    chosen = set(check_layers(chosen, len(layers)))
    stream = streaming_policy(sink, recent)
    if caches:
        if len(caches) != len(layers):
            raise HybridError(f"{len(caches)} caches for {len(layers)} temporal layers")
        for i in sorted(chosen):
            held = set(caches[i].frame_ids)
            missing = [f for f in stream.kept_indices(n_committed) if f not in held]
            if missing:
                raise HybridError(f"layer {i}'s KV cache no longer holds frames {missing} (it holds "
                                  f"{caches[i].frame_ids} of {n_committed} committed; its policy was "
                                  f"{caches[i].policy}): a streaming layer needs the absolute sink frames "
                                  f"0..{sink - 1} and the last {recent}; keep them before the cut")
    for i, layer in enumerate(layers):
        layer.retention = stream if i in chosen else None
    for i in sorted(chosen) if caches else ():
        caches[i].policy = stream
        caches[i].evict(n_committed)
        caches[i].shrink_to_fit()


class HybridModel(torch.nn.Module):
    """A denoiser whose lazy temporal layers stream; drop-in for :func:`arvdm.pipeline.rollout`.

    ``select=online``: every rollout's first commit (the context) runs with all layers full and meters on
    (the prefill analogue), then the top ``fraction`` by lazy ratio convert and their caches are cut at
    once. A context of at most ``sink + recent`` frames drops no key (every ratio would be 1), so it falls
    back to the offline ratios. ``offline`` / ``fixed``: the layers are chosen up front and stream from the
    start (their caches never grow past ``sink + recent``). ``selections`` records every rollout's choice.

    An ``nn.Module`` holding the model as ``self.model``, so ``torch.compile`` takes it (sample.py
    ``--compile``): the compiled forward is this one, ``init_state`` / ``commit`` stay eager.
    """

    def __init__(self, model: Any, hybrid: HybridConfig, offline: dict[str, Any] | None = None):
        super().__init__()
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
        """Set the layers' key rules to this wrapper's choice (several wrappers may share one model)."""
        stream = streaming_policy(self.hybrid.sink, self.hybrid.recent)
        for i, layer in enumerate(self.layers):
            want = stream if i in self.streaming_layers else None
            if layer.retention != want:
                layer.retention = want

    def check_schedule(self, *args, **kwargs):
        return self.model.check_schedule(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self._activate()
        return self.model(*args, **kwargs)

    def init_state(self, batch_size: int, memory_select: str | None = None):
        h = self.hybrid
        if self.fixed is not None:
            chosen, ratios = self.fixed
            self.streaming_layers = list(chosen)
            self._activate()
            state = self.model.init_state(batch_size, layer_policies=layer_policies(
                self.base_policy, len(self.layers), chosen, h.sink, h.recent), memory_select=memory_select)
            self._record(chosen, ratios, h.select)
        else:
            self.streaming_layers = []  # measure with every layer full
            self._activate()
            state = self.model.init_state(batch_size, memory_select=memory_select)
            for cache in state.caches:  # any layer may stream after the context: keep the sinks until then
                cache.policy = keeping_sinks(self.base_policy, h.sink, h.recent)
            self._pending.add(id(state))
        self.last_state = state
        return state

    def commit(self, state, frames, actions, poses=None, target_poses=None, levels=None, clean=None,
               observed=False) -> None:
        self._activate()
        if id(state) not in self._pending:
            self.model.commit(state, frames, actions, poses, target_poses, levels, clean, observed)
            return
        self._pending.discard(id(state))
        h = self.hybrid
        with measuring(self.layers, sink=h.sink, recent=h.recent, last_frames=h.last_frames) as meters:
            self.model.commit(state, frames, actions, poses, target_poses, levels, clean, observed)
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
        convert_layers(self.layers, chosen, sink=h.sink, recent=h.recent, caches=state.caches,
                       n_committed=state.n_committed)
        for i, cache in enumerate(state.caches):  # the full layers drop the sinks their memory does not keep
            if i not in chosen:
                cache.policy = self.base_policy
                cache.evict(state.n_committed)
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
        convert_layers(self.layers, [], sink=self.hybrid.sink, recent=self.hybrid.recent)


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
    convert_layers(layers, chosen, sink=h.sink, recent=h.recent)
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
    except ConfigError as e:
        raise HybridError(str(e)) from e
    if not h.active:
        return model, h
    path = ratios_path(h, run_dir)
    offline = load_lazy_ratios(path) if path is not None and (h.select == "offline" or path.is_file()) else None
    return HybridModel(model, h, offline), h
