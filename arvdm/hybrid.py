"""Hybrid attention (LightTransfer, arXiv 2410.13846) for the temporal attention of a video model.

Some temporal-attention layers are "lazy": their queries put almost all their attention on the first
(sink) frames and the most recent ones. Those layers become streaming layers (sink + recent frames, their
KV caches cut at once and bounded from then on); the others keep the full memory.

    python -m arvdm.hybrid calibrate --run RUN      # offline lazy ratios -> RUN/lazy_ratios.json
    python -m arvdm.hybrid report --run RUN         # heat map + fraction x selection table, plots
    python sample.py --run RUN --hybrid 0.5         # roll out with half of the layers streaming

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

import argparse
import contextlib
import copy
import dataclasses
import heapq
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kernels
from memory import RetentionPolicy

from .config import Config, HybridConfig

__all__ = [
    "HybridError",
    "HybridModel",
    "LazyRatioMeter",
    "RATIOS_NAME",
    "apply_for_training",
    "calibrate",
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


class HybridError(ValueError):
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


# ------------------------------------------------------------------------------------------------
# offline calibration
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def calibrate(model: Any, diffusion: Any, clips: torch.Tensor, actions: torch.Tensor, *, memory: int,
              levels: Sequence[int], hybrid: HybridConfig, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Lazy ratios per layer and denoising level over calibration clips (LightTransfer Eq. 1, offline).

    Each clip (T = memory + window frames) is split into ``memory`` clean frames, given as ``memory=``, and
    a window noised to one ``level`` for every frame; the meters read the window queries of the last
    ``hybrid.last_frames`` frames. Returns the lazy_ratios.json content: per layer the mean and standard
    deviation over (clip, level) pairs and the mean per level.
    """
    from tqdm.auto import tqdm

    from memory import MemoryFrames

    layers = temporal_layers(model)
    n, t = clips.shape[:2]
    w = t - memory
    if w < 1:
        raise HybridError(f"calibration clips of {t} frames leave no window after {memory} memory frames")
    if memory + w - hybrid.last_frames <= hybrid.sink + hybrid.recent:
        raise HybridError(f"calibration sees {memory} memory + {w} window frames: with hybrid.last_frames="
                          f"{hybrid.last_frames} no query reaches past sink + recent = "
                          f"{hybrid.sink + hybrid.recent} frames, so every ratio would be 1; use more --memory")
    was_streaming = [layer.streaming for layer in layers]
    convert(layers, [], sink=hybrid.sink, recent=hybrid.recent)
    gen = torch.Generator().manual_seed(seed)
    per = torch.full((len(layers), len(levels), n), float("nan"), dtype=torch.float64)  # (L, levels, clips)
    try:
        bar = tqdm(total=n * len(levels), desc="calibrate lazy ratios", disable=not progress, leave=False)
        with measuring(layers, sink=hybrid.sink, recent=hybrid.recent, last_frames=hybrid.last_frames) as meters:
            for c in range(n):
                x0 = clips[c:c + 1, memory:]  # (1, w, C, H, W)
                mem = MemoryFrames(clips[c:c + 1, :memory], actions[c:c + 1, :memory]) if memory else None
                noise = torch.randn(x0.shape, generator=gen).to(x0)
                for j, level in enumerate(levels):
                    lv = torch.full((1, w), int(level), dtype=torch.long, device=x0.device)  # (1, w)
                    x = diffusion.add_noise(x0, noise, lv) if level > 0 else x0
                    model(x, lv, actions[c:c + 1, memory:], memory=mem)
                    for i, m in enumerate(meters):  # the window call is each layer's last call
                        per[i, j, c] = m.last_call_ratio()
                        m.calls.clear()
                    bar.update()
        bar.close()
    finally:
        for layer, s in zip(layers, was_streaming):
            layer.streaming = s
    flat = per.reshape(len(layers), -1)  # (L, levels * clips)
    return {
        "format": "arvdm-lazy-ratios/1",
        "sink": hybrid.sink, "recent": hybrid.recent, "last_frames": hybrid.last_frames,
        "memory": memory, "window": w, "levels": [int(v) for v in levels], "clips": n,
        "ratios": flat.mean(1).tolist(),
        "layers": [{"layer": i, "mean": float(flat[i].mean()), "std": float(flat[i].std(unbiased=False)),
                    "min": float(flat[i].min()), "max": float(flat[i].max()),
                    "by_level": per[i].mean(1).tolist()} for i in range(len(layers))],
    }


def _load_run(run: str, device: str, use_ema: bool = True):
    from .checkpoint import load_for_inference
    from .diffusion import PerFrameDiffusion

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else ("cpu" if device == "auto" else device))
    model, cfg = load_for_inference(run, use_ema=use_ema, device=dev)
    return model, cfg, PerFrameDiffusion(cfg.diffusion), dev


def _hybrid_from_args(cfg: Config, args) -> HybridConfig:
    from .config import ConfigError, apply_overrides

    c = copy.deepcopy(cfg)
    sets = list(args.overrides or [])
    bad = [s for s in sets if not s.strip().startswith("hybrid.")]
    if bad:
        raise HybridError(f"--set takes hybrid.* keys only here, got {bad}")
    try:
        apply_overrides(c, sets)
        c.hybrid.validate()
    except ConfigError as e:
        raise HybridError(str(e)) from e
    return c.hybrid


def run_calibration(run: str, *, clips: int = 4, memory: int | None = None, levels: int = 5, data: str | None = None,
                    overrides: Sequence[str] = (), device: str = "auto", out: str | None = None,
                    progress: bool = True) -> Path:
    """Calibrate a run's model on validation clips and write ``lazy_ratios.json`` (atomically)."""
    from data.episodes import atomic_write

    from .sampling import load_validation_episodes

    model, cfg, diffusion, dev = _load_run(run, device)
    h = _hybrid_from_args(cfg, argparse.Namespace(overrides=overrides))
    m = cfg.memory.length if memory is None else memory
    video, actions, _ = load_validation_episodes(data or cfg.data.path, cfg, clips, m, cfg.train.window)
    K = cfg.diffusion.num_levels
    lv = sorted({int(round(x)) for x in torch.linspace(0, K, levels).tolist()})
    result = calibrate(model, diffusion, video.to(dev), actions.to(dev), memory=m, levels=lv, hybrid=h,
                       progress=progress)
    result["run"] = str(run)
    path = Path(out) if out else _run_root(Path(run)) / RATIOS_NAME
    text = json.dumps(result, indent=2)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def plot_heatmap(ratios: dict[str, Any], path: str | os.PathLike) -> Path:
    """Heat map of lazy ratios, layers (rows) x denoising levels (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [layer["by_level"] for layer in ratios["layers"]]  # (L, levels)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(ratios["levels"]), 1.2 + 0.5 * len(grid)))
    im = ax.imshow(grid, vmin=min(min(r) for r in grid), vmax=1.0, cmap="viridis", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="w" if v < 0.5 * (1 + min(row)) else "k",
                    fontsize=8)
    ax.set_xticks(range(len(ratios["levels"])), [str(v) for v in ratios["levels"]])
    ax.set_yticks(range(len(grid)), [f"layer {i}" for i in range(len(grid))])
    ax.set_xlabel("denoising level of the window (0 = clean)")
    ax.set_title(f"lazy ratio (kept mass, sink {ratios['sink']} + recent {ratios['recent']} frames)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def selection_strategies(ratios: Sequence[float], fraction: float, seed: int = 0) -> dict[str, list[int]]:
    """LightTransfer Fig. 7's comparison: lazy-ratio selection vs a random choice vs the last layers."""
    n, k = len(ratios), num_streaming(len(ratios), fraction)
    return {"lazy": select_layers(ratios, fraction),
            "random": sorted(random.Random(seed).sample(range(n), k)),
            "last": list(range(n - k, n))}


@torch.no_grad()
def run_report(run: str, *, fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75), episodes: int = 2,
               frames: int = 48, context: int | None = None, steps: int = 10, schedule: str = "chunked",
               data: str | None = None, overrides: Sequence[str] = (), device: str = "auto",
               out: str | None = None, seed: int = 0, memory: int | None = None,
               pareto_with: str | None = None, progress: bool = True) -> dict[str, Path]:
    """Heat map, table and plots of hybrid attention for a run (see the module docstring).

    ``memory`` (default: the run's) makes the full layers and the bank keep the last ``memory`` frames.
    ``pareto_with``: an ``arvdm.experiments`` output folder (or its pareto.csv) whose points join the
    hybrid points on one Pareto plot.
    """
    from data.episodes import atomic_write

    from .evaluate import evaluate_rollout
    from .pareto import plot_pareto, write_results_table
    from .pipeline import rollout
    from .sampling import load_validation_episodes
    from .schedules import get_schedule

    model, cfg, diffusion, dev = _load_run(run, device)
    h = _hybrid_from_args(cfg, argparse.Namespace(overrides=overrides))
    out_dir = Path(out) if out else _run_root(Path(run)) / "hybrid"
    out_dir.mkdir(parents=True, exist_ok=True)
    if memory is not None:
        for m in (model.cfg.memory, cfg.memory):
            m.retention, m.length = "last", memory
    rpath = ratios_path(h, run)
    if not rpath.is_file():
        rpath = run_calibration(run, overrides=overrides, device=device, data=data, progress=progress)
    ratios = load_lazy_ratios(rpath)
    if (ratios["sink"], ratios["recent"]) != (h.sink, h.recent):
        print(f"note: {rpath} was measured with sink {ratios['sink']} + recent {ratios['recent']}, the report "
              f"streams sink {h.sink} + recent {h.recent}", file=sys.stderr)
    paths = {"heatmap": plot_heatmap(ratios, out_dir / "lazy_ratios.png")}

    sched = get_schedule(schedule, cfg.train.window, cfg.diffusion.num_levels, steps)
    c = cfg.model.frames_per_chunk
    ctx = context if context is not None else max(min(cfg.memory.length, 16), c)
    real, actions, poses = load_validation_episodes(data or cfg.data.path, cfg, episodes, ctx, frames)
    configs, counts = [("base", 0.0, [])], {0}
    for f in fractions:  # a shallow model maps several fractions to one layer count: keep the first
        if num_streaming(len(ratios["ratios"]), f) not in counts:
            counts.add(num_streaming(len(ratios["ratios"]), f))
            configs += [(name, f, layers) for name, layers in selection_strategies(ratios["ratios"], f, seed).items()]
    rows, points = [], []
    # one untimed warm-up rollout, so the first configuration's frames/s does not pay for first calls
    rollout(model, diffusion, sched, real[:1, :ctx].to(dev), actions[:1, :ctx].to(dev), actions[:1, ctx:].to(dev),
            min(frames, sched.delta), generator=torch.Generator().manual_seed(seed), progress=False)
    for name, f, layers in tqdm_list(configs, "hybrid report", progress):
        hm = HybridModel(model, dataclasses.replace(h, fraction=f, select="fixed", layers=layers), ratios)
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        fake = rollout(hm, diffusion, sched, real[:, :ctx].to(dev), actions[:, :ctx].to(dev),
                       actions[:, ctx:].to(dev), frames, generator=gen, progress=False).float().cpu()
        seconds = time.perf_counter() - t0
        ev = evaluate_rollout(fake, real, poses, ctx, window_reach=cfg.train.window)
        row = {"selection": name, "fraction": f, "memory": cfg.memory.length,
               "layers": " ".join(map(str, layers)) or "-",
               "frames_per_s": real.shape[0] * frames / seconds, "kv_bytes": hm.last_state.nbytes(),
               "psnr_mean": ev["psnr_mean"], "ssim_mean": ev["ssim_mean"],
               "max_psnr_decay": ev["max_psnr_decay"], "retrieval_mean": ev.get("retrieval_mean")}
        for s_p, s_s in zip(ev["psnr_by_span"], ev["ssim_by_span"]):
            row[f"psnr {s_p['label']}"], row[f"ssim {s_s['label']}"] = s_p["mean"], s_s["mean"]
        rows.append(row)
        points.append({"name": f"hybrid {name} {f:g}" if f else "base", "x": ev["max_psnr_decay"],
                       "y": ev.get("retrieval_mean")})
        hm.restore()
    base = rows[0]
    for row in rows:
        row["kv_vs_base"] = row["kv_bytes"] / base["kv_bytes"] if base["kv_bytes"] else float("nan")
        row["speed_vs_base"] = row["frames_per_s"] / base["frames_per_s"]
        row["psnr_loss_db"] = base["psnr_mean"] - row["psnr_mean"]
    paths["table"] = write_results_table(rows, out_dir / "hybrid_report.csv", out_dir / "hybrid_report.md")[1]
    text = json.dumps({"run": str(run), "ratios_file": str(rpath), "sink": h.sink, "recent": h.recent,
                       "context": ctx, "frames": frames, "schedule": sched.name, "steps": steps,
                       "rows": rows}, indent=2, default=float)
    atomic_write(out_dir / "hybrid_report.json", lambda tmp: Path(tmp).write_text(text))
    paths["json"] = out_dir / "hybrid_report.json"
    paths["pareto"] = out_dir / "pareto_hybrid.png"
    if pareto_with:
        points = _experiment_points(pareto_with) + points
    plot_pareto(points, paths["pareto"], csv_path=out_dir / "pareto_hybrid.csv",
                title="hybrid attention: error accumulation vs memory bottleneck")
    paths["tradeoff"] = plot_tradeoff(rows, out_dir / "hybrid_tradeoff.png")
    return paths


def _experiment_points(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Pareto points of an ``arvdm.experiments`` report (its pareto.csv)."""
    import csv

    path = Path(path)
    path = path / "pareto.csv" if path.is_dir() else path
    if not path.is_file():
        raise HybridError(f"{path}: no pareto.csv (write one with `python -m arvdm.experiments report`)")

    def num(v):
        return float(v) if v not in ("", None) else None

    with open(path, newline="") as f:
        return [{"name": r["name"], "x": num(r["max_psnr_decay"]), "y": num(r["mean_retrieval_rate"])}
                for r in csv.DictReader(f)]


def tqdm_list(items, desc, progress):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=not progress, leave=False)


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """PSNR vs KV-cache bytes (left) and vs frames/s (right), one line per selection strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    base = [r for r in rows if r["selection"] == "base"]
    for name, marker in (("lazy", "o"), ("random", "s"), ("last", "^")):
        sel = base + sorted((r for r in rows if r["selection"] == name), key=lambda r: r["fraction"])
        for ax, key in zip(axes, ("kv_vs_base", "speed_vs_base")):
            ax.plot([r[key] for r in sel], [r["psnr_mean"] for r in sel], marker=marker, label=name)
            for r in sel:
                ax.annotate(f"{r['fraction']:g}", (r[key], r["psnr_mean"]), fontsize=7)
    axes[0].set_xlabel("KV-cache bytes / base")
    axes[1].set_xlabel("frames/s / base")
    for ax in axes:
        ax.set_ylabel("mean PSNR (dB)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("hybrid attention: streaming fraction (labels) by selection")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arvdm.hybrid", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("calibrate", "offline lazy ratios on validation clips -> RUN/lazy_ratios.json"),
                        ("report", "heat map + fraction x selection table (frames/s, KV bytes, PSNR/SSIM)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--run", required=True, help="run folder written by train.py (or one checkpoint)")
        s.add_argument("--data", default=None, help="TECO-layout data folder (default: the run's)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="hybrid.KEY=VALUE",
                       help="hybrid setting, e.g. hybrid.sink=2 (repeatable)")
        s.add_argument("--device", default="auto")
        s.add_argument("--out", default=None)
    cal = sub.choices["calibrate"]
    cal.add_argument("--clips", type=int, default=4, help="validation clips (one per episode)")
    cal.add_argument("--memory", type=int, default=None, help="memory frames per clip (default memory.length)")
    cal.add_argument("--levels", type=int, default=5, help="denoising levels, evenly spaced over 0..K")
    rep = sub.choices["report"]
    rep.add_argument("--episodes", type=int, default=2)
    rep.add_argument("--frames", type=int, default=48)
    rep.add_argument("--context", type=int, default=None)
    rep.add_argument("--steps", type=int, default=10)
    rep.add_argument("--schedule", default="chunked")
    rep.add_argument("--memory", type=int, default=None, help="frames the full layers keep (default: the run's)")
    rep.add_argument("--pareto-with", default=None, metavar="EXPERIMENTS_OUT",
                     help="an arvdm.experiments output folder: its points join the hybrid Pareto plot")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "calibrate":
            path = run_calibration(args.run, clips=args.clips, memory=args.memory, levels=args.levels,
                                   data=args.data, overrides=args.overrides, device=args.device, out=args.out)
            data = load_lazy_ratios(path)
            print(f"wrote {path}")
            for layer in data["layers"]:
                print(f"layer {layer['layer']}: lazy ratio {layer['mean']:.4f} +- {layer['std']:.4f} "
                      f"(by level {', '.join(f'{v:.3f}' for v in layer['by_level'])})")
        else:
            paths = run_report(args.run, episodes=args.episodes, frames=args.frames, context=args.context,
                               steps=args.steps, schedule=args.schedule, data=args.data, overrides=args.overrides,
                               device=args.device, out=args.out, memory=args.memory,
                               pareto_with=args.pareto_with)
            for k, v in paths.items():
                print(f"{k}: {v}")
    except (ValueError, FileNotFoundError) as err:  # user errors: run, data, settings
        print(f"python -m arvdm.hybrid: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
