"""What :func:`arvdm.pipeline.rollout.rollout` needs of a model: the :class:`RolloutModel` protocol.

    from arvdm.pipeline.rollout_model import RolloutModel

A structural type (``typing.Protocol``; runtime-checkable, so ``isinstance(m, RolloutModel)`` checks that the
members are there): nothing inherits from it. The denoiser (``arvdm.model.Denoiser``), the hybrid-attention
wrapper (``arvdm.hybrid.convert.HybridModel``) and ``torch.compile`` of either
(``arvdm.sampling.compile_for_sampling``: attribute access is forwarded) satisfy it as they are; a test stub
needs the same six members. The rollout uses exactly these and probes for nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from arvdm.config import Config
from memory import MemoryFrames

__all__ = ["RolloutModel"]


@runtime_checkable
class RolloutModel(Protocol):
    """A denoiser a rollout can drive (docs/INTERFACES.md).

    Attributes:
        cfg: the run ``Config`` the model was built from. The rollout reads ``cfg.model.num_actions`` (the
            actions' range, checked once per rollout) and ``cfg.memory`` (the retention policy of the
            recomputing ``use_cache=False`` path, so both paths remember the same past frames).
        frames_per_chunk: the model commits whole chunks of this many frames; the context length must be a
            multiple of it.
    """

    cfg: Config
    frames_per_chunk: int

    def check_schedule(self, delta: int, window: int) -> None:
        """Raise when the model cannot serve a schedule that finishes ``delta`` frames per AR step of a
        ``window``-frame window (e.g. ``delta`` not a multiple of ``frames_per_chunk``)."""

    def init_state(self, batch_size: int, memory_select: str | None = None) -> Any:
        """A fresh rollout state (memory bank + per-layer KV caches) for ``batch_size`` videos; ``memory_select``
        (pose-aware models: pose, time, none, other) is passed only when the caller overrides the model's choice."""

    def commit(self, state: Any, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None = None,
               target_poses: torch.Tensor | None = None, *, levels: torch.Tensor | None = None,
               clean: torch.Tensor | None = None, observed: bool = False) -> None:
        """Write (B, n, C, H, W) frames and their (B, n) actions that left the window into ``state``;
        pose-aware models (``cfg.memory.select == "pose"``) also get their poses (B, n, 3) and the next window's
        poses (B, w, 3), by which they choose its memory. Others are called with the first three only. With a
        context level (noisy context) the frames come noised, with their ``levels`` (B, n) and the ``clean`` frames
        (B, n, C, H, W) before noising; without one these are not passed. ``observed=True`` (passed only to a model with
        ``cfg.model.copy_gate == "observed"``): the frames are the rollout's real context, not generated ones."""

    def __call__(self, x: torch.Tensor, levels: torch.Tensor, actions: torch.Tensor, *,
                 memory: MemoryFrames | None = None, state: Any = None,
                 drop_actions: torch.Tensor | None = None) -> torch.Tensor:
        """The v-prediction (B, w, C, H, W) for a window ``x`` (B, w, C, H, W) at ``levels`` (B, w) int64 with
        ``actions`` (B, w) int64; the past comes from ``state`` (KV-cached) or ``memory`` (recomputed).
        ``drop_actions`` (B,) bool (passed only with action guidance): those samples' actions are the null action."""
