"""The state of a cached rollout: what a `Denoiser` remembers between auto-regressive steps.

`Denoiser.init_state(batch_size)` makes one, `Denoiser.commit(state, frames, actions)` writes finished frames
into it and `Denoiser(x, levels, actions, state=state)` reads it. Which fields are used depends on
memory.structure: per-layer KV caches (prepend), one projected memory vector (channel_concat) or per-layer
cross-attention K/V (cross_attention); the bank of clean frames is always there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memory import KVCache, MemoryBank, PoseBank

__all__ = ["RolloutState"]


@dataclass
class RolloutState:
    """Everything a cached rollout remembers between AR steps (from `Denoiser.init_state`).

    Attributes:
        bank: the clean committed frames under the retention policy.
        caches: per-layer `KVCache` (prepend only; empty list otherwise).
        batch_size: B of the rollout.
        memory_vec: channel_concat only: the projected memory (B,N,D) added to every window token.
        cross_kv: cross_attention only: per layer (K, V) of the memory tokens.
        target_poses: pose-aware models only: (B,w,3) poses of the window the memory was chosen for.
        last_frame: model.last_frame_input only: (B,C,H,W) the most recent committed frame, as committed (the
            last frame of the bank's memory, as an uncached call would get it).
    """

    bank: MemoryBank | PoseBank
    caches: list[KVCache] = field(default_factory=list)
    batch_size: int = 1
    memory_vec: torch.Tensor | None = None
    cross_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    target_poses: torch.Tensor | None = None
    last_frame: torch.Tensor | None = None

    @property
    def n_committed(self) -> int:
        """Frames committed so far = absolute frame index of the next window's first frame."""
        return self.bank.n_committed

    def nbytes(self) -> int:
        """Bytes of the model-side caches (KV caches, memory projection, cross K/V); not the bank."""
        total = sum(c.nbytes() for c in self.caches)
        if self.memory_vec is not None:
            total += self.memory_vec.numel() * self.memory_vec.element_size()
        for k, v in self.cross_kv or []:
            total += (k.numel() + v.numel()) * k.element_size()
        return total
