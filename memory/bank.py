"""The memory bank: past frames (+ actions, poses, noise levels) kept under a retention policy.

During a rollout every frame that leaves the window is committed here; the bank keeps the frames its
`RetentionPolicy` says to keep and hands them to the denoiser as a `MemoryFrames` (the same object a
trainer builds by hand from the first m frames of a clip). Frames are clean (level 0) unless committed with
their noise `levels` (noisy context: a rollout may commit frames re-noised to a small level k_ctx, and the
model is told each frame's level). The bank stores raw frames only; how they
reach the network (prefix, channel concat, cross-attention, compressed or not) is the model's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .retention import RetentionPolicy


@dataclass
class MemoryFrames:
    """Past frames given to the denoiser as conditioning.

    Args:
        frames: (B, m, C, H, W) frames in [-1, 1], oldest first: clean, or noised to `levels`.
        actions: (B, m) int64 actions of those frames.
        positions: (m,) int64 absolute frame indices, ascending; `None` means `0..m-1`. The window that
            follows starts at `positions[-1] + 1` (or at m), which fixes the temporal (RoPE) distances.
        poses: optional (B, m, 3) float poses (x, y, heading). A pose-aware model (memory.select=pose) reads
            them relative to the window's first target pose; other models ignore them.
        next_index: the window's start as a Python int, when the caller knows it (the bank does): then
            `window_start` need not read `positions[-1]` back from the device (a host-device sync per call).
        ages: optional (B, m) int64 frames between each memory frame and the window (per sample; frames
            chosen by pose sit at canonical positions, so their real age is given here). None = from positions.
        target_poses: optional (B, w, 3) poses of the window's frames the memory was chosen for.
        levels: optional (B, m) int64 noise level of each memory frame (noisy context, GameNGen / Diffusion
            Forcing); the model conditions each frame on its level. None = every frame clean (level 0).
        last: optional (B, C, H, W) the most recent past frame, clean (before noisy context noised it); a model
            with model.copy_gate reads it as its last frame. None = `frames[:, -1]`.
        last_observed: whether the last frame is a real (observed) frame rather than a generated one: (B,) bool or
            one bool; model.copy_gate=observed gates only real ones. None = real (frames a caller gives by hand).
    """

    frames: torch.Tensor
    actions: torch.Tensor
    positions: torch.Tensor | None = None
    poses: torch.Tensor | None = None
    next_index: int | None = None
    ages: torch.Tensor | None = None
    target_poses: torch.Tensor | None = None
    levels: torch.Tensor | None = None
    last: torch.Tensor | None = None
    last_observed: torch.Tensor | bool | None = None

    def __len__(self) -> int:
        return self.frames.shape[1]

    @property
    def window_start(self) -> int:
        """Absolute frame index of the first window frame that follows this memory."""
        if self.next_index is not None:
            return self.next_index
        if self.positions is None:
            return self.frames.shape[1]
        return int(self.positions[-1]) + 1 if self.positions.numel() else 0

    def frame_positions(self) -> torch.Tensor:
        """(m,) int64 absolute indices (`positions`, or `0..m-1`)."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.frames.shape[1], device=self.frames.device)

    @classmethod
    def of_clip(cls, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None = None,
                ages: torch.Tensor | None = None, levels: torch.Tensor | None = None,
                last: torch.Tensor | None = None) -> MemoryFrames:
        """The memory of a clip whose first m frames (B,m,C,H,W) are the past and the rest the window (positions
        0..m-1; the window follows at m): training's clips and the hybrid calibration's.

        Pose-chosen memory (memory.select=pose) also gives `poses` (B,m+w,3) of memory and window frames and the
        memory frames' `ages` (B,m) (None = from positions: m..1 for a contiguous clip): the window's poses become
        the memory's `target_poses`. Noised memory frames come with their `levels` (B,m) int64 (None = clean) and
        the last frame before noising, `last` (B,C,H,W).
        """
        m = frames.shape[1]
        if poses is None:
            return cls(frames, actions, levels=levels, last=last)
        return cls(frames, actions, poses=poses[:, :m], ages=ages, target_poses=poses[:, m:], levels=levels,
                   last=last)


class MemoryBank:
    """Committed frames (clean, or at their noise levels) under a retention policy.

    Args:
        policy: which committed frames to keep.

    Example:
        >>> bank = MemoryBank(RetentionPolicy("last", length=8))
        >>> bank.append(frames, actions)        # frames (B, n, C, H, W), actions (B, n)
        >>> mem = bank.memory()                 # MemoryFrames of the kept frames, or None if empty
    """

    def __init__(self, policy: RetentionPolicy):
        self.policy = policy
        self.n_committed = 0  # frames ever committed; the next window starts at this absolute index
        self.frames: torch.Tensor | None = None  # (B, F, C, H, W) kept frames
        self.actions: torch.Tensor | None = None  # (B, F)
        self.poses: torch.Tensor | None = None  # (B, F, P) or None
        self.levels: torch.Tensor | None = None  # (B, F) int64 noise level of each kept frame (0 = clean)
        self.positions: list[int] = []  # absolute index of each kept frame
        self.last: torch.Tensor | None = None  # (B, C, H, W) the newest committed frame, clean
        self.last_observed = False  # whether that frame was observed (the context), not generated
        self._positions_tensor: torch.Tensor | None = None  # `positions` on the frames' device, built once

    def __len__(self) -> int:
        return len(self.positions)

    def append(self, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None = None,
               levels: torch.Tensor | None = None, clean: torch.Tensor | None = None, observed: bool = False) -> None:
        """Commit frames (B, n, C, H, W) with actions (B, n) [and poses (B, n, P)], then evict.

        `levels` (B, n) int64: the frames' noise levels (noisy context); None = clean (level 0). `clean`: the same
        frames before they were noised (None = `frames`); the newest is kept as `MemoryFrames.last`. `observed`:
        the frames are real (a rollout's context), not generated (`MemoryFrames.last_observed`).
        """
        if frames.dim() != 5:
            raise ValueError(f"MemoryBank.append: frames must be (B, n, C, H, W), got {tuple(frames.shape)}")
        b, n = frames.shape[:2]
        if actions.shape != (b, n):
            raise ValueError(f"MemoryBank.append: actions must be (B, n) = {(b, n)}, got {tuple(actions.shape)}")
        if poses is not None and poses.shape[:2] != (b, n):
            raise ValueError(f"MemoryBank.append: poses must start with (B, n) = {(b, n)}, got "
                             f"{tuple(poses.shape)}")
        if levels is not None and (tuple(levels.shape) != (b, n) or levels.is_floating_point()):
            raise ValueError(f"MemoryBank.append: levels must be integer (B, n) = {(b, n)}, got "
                             f"{tuple(levels.shape)} {levels.dtype}")
        levels = torch.zeros_like(actions) if levels is None else levels.detach().to(actions.device, torch.long)
        if self.frames is not None:
            if frames.shape[0] != self.frames.shape[0] or frames.shape[2:] != self.frames.shape[2:]:
                raise ValueError(f"MemoryBank.append: frames {tuple(frames.shape)} do not match the bank's "
                                 f"(B, C, H, W) = {(self.frames.shape[0], *self.frames.shape[2:])}")
            if (poses is None) != (self.poses is None):
                raise ValueError("MemoryBank.append: give poses for every commit or for none")
        frames, actions = frames.detach(), actions.detach()
        self.last = (frames if clean is None else clean.detach())[:, -1]  # (B, C, H, W)
        self.last_observed = bool(observed)
        if self.frames is None or len(self.positions) == 0:
            self.frames, self.actions, self.levels = frames, actions, levels
            self.poses = poses.detach() if poses is not None else None
        else:
            self.frames = torch.cat([self.frames, frames], dim=1)  # (B, F+n, C, H, W)
            self.actions = torch.cat([self.actions, actions], dim=1)  # (B, F+n)
            self.levels = torch.cat([self.levels, levels], dim=1)  # (B, F+n)
            if poses is not None:
                self.poses = torch.cat([self.poses, poses.detach()], dim=1)  # (B, F+n, P)
        self.positions += list(range(self.n_committed, self.n_committed + n))
        self.n_committed += n
        self._positions_tensor = None
        self._evict()

    def _evict(self) -> None:
        keep = set(self.policy.kept_indices(self.n_committed))
        slots = [i for i, p in enumerate(self.positions) if p in keep]
        if len(slots) == len(self.positions):
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.frames.device)
        self.frames = self.frames.index_select(1, idx)  # (B, kept, C, H, W)
        self.actions = self.actions.index_select(1, idx)  # (B, kept)
        self.levels = self.levels.index_select(1, idx)  # (B, kept)
        if self.poses is not None:
            self.poses = self.poses.index_select(1, idx)  # (B, kept, P)
        self.positions = [self.positions[i] for i in slots]

    def memory(self, target_poses: torch.Tensor | None = None) -> MemoryFrames | None:
        """The kept frames as `MemoryFrames` (with their absolute positions); None when empty.

        `target_poses` (B, w, 3), the poses of the window to come, is passed on (time-based retention does not
        depend on it; `memory.select.PoseBank.memory` does).
        """
        if not self.positions:
            return None
        if self._positions_tensor is None:  # one host-to-device copy per commit, not one per denoising call
            self._positions_tensor = torch.tensor(self.positions, dtype=torch.long, device=self.frames.device)
        return MemoryFrames(self.frames, self.actions, positions=self._positions_tensor, poses=self.poses,
                            next_index=self.positions[-1] + 1, target_poses=target_poses, levels=self.levels,
                            last=self.last, last_observed=self.last_observed)

    def nbytes(self) -> int:
        """Bytes held by the kept frames, actions, levels and poses."""
        if self.frames is None:
            return 0
        total = self.frames.numel() * self.frames.element_size() + (self.actions.numel() + self.levels.numel()) * 8
        if self.poses is not None:
            total += self.poses.numel() * self.poses.element_size()
        return total

    def __repr__(self) -> str:
        return f"MemoryBank(policy={self.policy}, kept={len(self)}, committed={self.n_committed})"
