"""Memory chosen by camera pose: which remembered frames a window gets, and a bank that can choose them.

    from memory.select import PoseBank, select_by_pose, relative_pose
    bank = PoseBank(length=6, pose_frames=4, capacity=1024)     # 4 chosen by pose + 2 most recent frames
    bank.append(frames, actions, poses)                         # (B,n,C,H,W), (B,n), (B,n,3)
    mem = bank.memory(target_poses)                             # MemoryFrames for a window at poses (B,w,3)

Time-based retention (memory/retention.py) keeps the last m frames; when the agent comes back to a place it
saw 60 frames ago, that view is long gone. Pose-aware world models (WorldMem, Context-as-Memory) instead pick
the remembered frames whose camera state matches the frames about to be generated. Here a window's memory is
`pose_frames` = k frames chosen from everything older than the recent ones, plus the `length - k` most recent
frames (which carry the motion). Selection is one function, `select_by_pose`, used by the bank at rollout and
by the training clips (`arvdm.training.pose_clips`), so training asks for memory exactly as a rollout offers it.

Selection modes (`SELECTIONS`), all with the same number of frames so that they compare on the same weights:
    pose   k frames nearest in pose to the window's frames (round robin over the window's frames)
    time   the k frames just before the recent ones (= retention "last m")
    none   no chosen frames: only the recent ones
    other  pose selection, but from another sample's bank (batch rolled by one): a wrong-episode control

Chosen frames are placed just before the recent frames on the time axis (canonical positions), so the
temporal attention's distances stay those of training; *when* and *where* they were seen reach the model as
their `ages` and their `poses` relative to the window (`relative_pose`).

The bank is bounded: past `capacity` frames it drops, per sample, the older frame whose pose is most
redundant (nearest to a newer frame's pose), so long rollouts keep one view per place rather than the latest.
Poses are (x, y, heading in radians); positions in the data set's units (Memory Maze: cells).
"""

from __future__ import annotations

import math

import torch

from .bank import MemoryBank, MemoryFrames
from .retention import RetentionError, RetentionPolicy

__all__ = ["SELECTIONS", "PoseBank", "SelectionError", "make_bank", "pose_distance", "relative_pose", "select_by_pose"]

SELECTIONS = ("pose", "time", "none", "other")
# One unit of pose distance: half a cell of position, or 20 degrees of heading (a view changes about as much).
POSITION_SCALE = 0.5
HEADING_SCALE = math.radians(20.0)


class SelectionError(RetentionError):
    """A pose-selection request is malformed: unknown mode, missing / non-finite poses, k out of range. (A
    `RetentionError`: the memory package's user errors share that base, which the CLIs catch.)"""


def wrap_angle(a: torch.Tensor) -> torch.Tensor:
    """Angles wrapped to [-pi, pi)."""
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def check_poses(poses: torch.Tensor, name: str) -> None:
    """Raise `SelectionError` unless `poses` is a float (..., 3) tensor of finite values."""
    if not torch.is_tensor(poses) or poses.shape[-1:] != (3,) or not poses.is_floating_point():
        shape = tuple(poses.shape) if torch.is_tensor(poses) else type(poses).__name__
        raise SelectionError(f"{name} must be a float tensor (..., 3) of (x, y, heading), got {shape}")
    if not bool(torch.isfinite(poses).all()):
        raise SelectionError(f"{name} holds NaN or infinite values")


def pose_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pose distance (..., Fa, 3) x (..., Fb, 3) -> (..., Fa, Fb): position / POSITION_SCALE + |heading| /
    HEADING_SCALE. (Written out: torch.cdist is ~50x slower on these small shapes.)"""
    dxy = (a[..., :, None, :2].float() - b[..., None, :, :2].float()).norm(dim=-1)  # (..., Fa, Fb)
    dh = wrap_angle(a[..., :, None, 2].float() - b[..., None, :, 2].float()).abs()  # (..., Fa, Fb)
    return dxy / POSITION_SCALE + dh / HEADING_SCALE


def relative_pose(poses: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Poses (B, T, 3) in the frame of `ref` (B, 3): (forward, left, heading change), heading wrapped."""
    d = poses[..., :2] - ref[:, None, :2]  # (B, T, 2)
    c, s = torch.cos(ref[:, None, 2]), torch.sin(ref[:, None, 2])  # (B, 1) each
    fwd, left = c * d[..., 0] + s * d[..., 1], -s * d[..., 0] + c * d[..., 1]  # rotate by -heading
    return torch.stack([fwd, left, wrap_angle(poses[..., 2] - ref[:, None, 2])], dim=-1)  # (B, T, 3)


def select_by_pose(candidates: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (B, min(k, F)) of the candidate poses (B, F, 3) that best match the target poses (B, w, 3).

    Round robin over the targets: pick i goes to target i mod w and takes its nearest candidate not yet
    taken, so a window whose frames look in several directions gets a match for each. Returned ascending
    (oldest candidate first). Deterministic: ties go to the older candidate.
    """
    b, f = candidates.shape[:2]
    w = targets.shape[1]
    k = min(int(k), f)
    if k <= 0:
        return torch.zeros(b, 0, dtype=torch.long, device=candidates.device)
    dist = pose_distance(candidates, targets)  # (B, F, w)
    picks = []
    for i in range(k):
        col = dist[:, :, i % w]  # (B, F)
        j = col.argmin(dim=1)  # (B,) first minimum = the older candidate on ties
        picks.append(j)
        dist.scatter_(1, j[:, None, None].expand(b, 1, w), math.inf)  # taken: never again
    return torch.stack(picks, dim=1).sort(dim=1).values  # (B, k)


def recent_frames(length: int, pose_frames: int, select: str) -> int:
    """How many of a window's m memory frames are the most recent past ones: all m by time, m - k by pose."""
    return length - (pose_frames if select == "pose" else 0)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, F, ...) at per-sample indices idx (B, n) -> (B, n, ...)."""
    shape = idx.shape + x.shape[2:]
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(shape))


class PoseBank:
    """Committed frames with their poses, from which each window's memory is chosen (see the module docstring).

    Args:
        length: m, memory frames a window gets (k chosen + m - k recent).
        pose_frames: k, frames chosen from the older past (0 <= k <= m).
        capacity: most frames kept per sample to choose from (>= m).
        select: the selection mode, one of `SELECTIONS`.
    """

    def __init__(self, length: int, pose_frames: int, capacity: int, select: str = "pose"):
        if select not in SELECTIONS:
            raise SelectionError(f"memory selection {select!r} is unknown; choose one of {SELECTIONS}")
        if not 0 <= pose_frames <= length:
            raise SelectionError(f"memory.pose_frames={pose_frames} must be in 0..memory.length={length}")
        if capacity < length:
            raise SelectionError(f"memory.bank_size={capacity} must be >= memory.length={length}")
        self.length, self.pose_frames, self.capacity, self.select = length, pose_frames, capacity, select
        self.recent = length - pose_frames
        self.n_committed = 0
        self.frames: torch.Tensor | None = None  # (B, F, C, H, W)
        self.actions: torch.Tensor | None = None  # (B, F)
        self.poses: torch.Tensor | None = None  # (B, F, 3)
        self.index: torch.Tensor | None = None  # (B, F) absolute frame index, ascending per sample
        self.levels: torch.Tensor | None = None  # (B, F) int64 noise level of each kept frame (0 = clean)
        self.last: torch.Tensor | None = None  # (B, C, H, W) the newest committed frame, clean
        self.last_observed = False  # whether that frame was observed (the context), not generated

    def __len__(self) -> int:
        return 0 if self.index is None else self.index.shape[1]

    def append(self, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None = None,
               levels: torch.Tensor | None = None, clean: torch.Tensor | None = None, observed: bool = False) -> None:
        """Commit frames (B, n, C, H, W) with actions (B, n) and poses (B, n, 3) [and noise levels (B, n), None =
        clean; `clean`: the frames before noising, the newest kept as `MemoryFrames.last`; `observed`: real frames,
        not generated, `MemoryFrames.last_observed`]; drop redundant old ones."""
        if poses is None:
            raise SelectionError("pose-aware memory needs the poses of committed frames (episodes with a 'pose' "
                                 "array, passed to rollout(poses=...))")
        b, n = frames.shape[:2]
        if actions.shape != (b, n) or poses.shape[:2] != (b, n):
            raise SelectionError(f"PoseBank.append: frames {tuple(frames.shape)}, actions {tuple(actions.shape)} "
                                 f"and poses {tuple(poses.shape)} disagree on (B, n)")
        check_poses(poses, "poses of committed frames")
        idx = torch.arange(self.n_committed, self.n_committed + n, device=frames.device).expand(b, n)
        levels = torch.zeros_like(actions) if levels is None else levels.detach().to(actions.device, torch.long)
        parts = [frames.detach(), actions.detach(), poses.detach().float(), idx, levels.expand(b, n)]
        self.last = (frames if clean is None else clean).detach()[:, -1]  # (B, C, H, W): recent frames are own
        self.last_observed = bool(observed)
        if self.frames is None:
            self.frames, self.actions, self.poses, self.index, self.levels = parts
        else:
            self.frames, self.actions, self.poses, self.index, self.levels = (
                torch.cat([old, new], dim=1) for old, new in
                zip((self.frames, self.actions, self.poses, self.index, self.levels), parts))
        self.n_committed += n
        while len(self) > self.capacity:
            self._drop_most_redundant()

    def _drop_most_redundant(self) -> None:
        """Per sample, drop the frame older than the recent ones whose pose is nearest a newer frame's."""
        f = len(self)
        older = f - self.recent  # candidates: never the recent frames
        dist = pose_distance(self.poses[:, :older], self.poses)  # (B, older, F)
        newer = torch.arange(f, device=dist.device)[None, :] > torch.arange(older, device=dist.device)[:, None]
        nearest = dist.masked_fill(~newer, math.inf).min(dim=2).values  # (B, older)
        drop = nearest.argmin(dim=1)  # (B,)
        keep = torch.arange(f, device=drop.device).expand(drop.shape[0], f)
        keep = keep[keep != drop[:, None]].view(drop.shape[0], f - 1)  # (B, F-1)
        self.frames, self.actions = _gather(self.frames, keep), _gather(self.actions, keep)
        self.poses, self.index = _gather(self.poses, keep), _gather(self.index, keep)
        self.levels = _gather(self.levels, keep)

    def chosen(self, target_poses: torch.Tensor) -> torch.Tensor:
        """Indices (B, k') into the bank of the frames chosen for a window at `target_poses` (B, w, 3)."""
        f = len(self)
        older = max(0, f - self.recent)
        k = min(self.pose_frames, older)
        b = self.frames.shape[0]
        if self.select == "none" or k == 0:
            return torch.zeros(b, 0, dtype=torch.long, device=self.frames.device)
        if self.select == "time":
            return torch.arange(older - k, older, device=self.frames.device).expand(b, k)
        source = self.poses[:, :older]
        if self.select == "other":
            if b < 2:
                raise SelectionError("memory selection 'other' takes memory from another sample: needs batch >= 2")
            source = source.roll(1, dims=0)
        return select_by_pose(source, target_poses.float(), k)

    def memory(self, target_poses: torch.Tensor | None = None) -> MemoryFrames | None:
        """The window's memory: chosen frames (at canonical positions) + the recent ones; None when empty."""
        if len(self) == 0:
            return None
        if target_poses is None:
            raise SelectionError("pose-aware memory needs the poses of the frames to generate (target_poses)")
        check_poses(target_poses, "poses of the frames to generate")
        f = len(self)
        chosen = self.chosen(target_poses)  # (B, k')
        recent = torch.arange(max(0, f - self.recent), f, device=chosen.device).expand(chosen.shape[0], -1)
        frames, actions, poses, index, levels = self.frames, self.actions, self.poses, self.index, self.levels
        if self.select == "other":  # the chosen frames come from the neighbouring sample's bank
            frames, actions, poses, index, levels = (t.roll(1, dims=0) for t in (frames, actions, poses, index, levels))
        parts = [torch.cat([_gather(a, chosen), _gather(b_, recent)], dim=1) for a, b_ in
                 ((frames, self.frames), (actions, self.actions), (poses, self.poses), (index, self.index),
                  (levels, self.levels))]
        m = parts[0].shape[1]
        start = self.n_committed
        return MemoryFrames(parts[0], parts[1], positions=torch.arange(start - m, start, device=chosen.device),
                            poses=parts[2], next_index=start, ages=start - parts[3], target_poses=target_poses,
                            levels=parts[4], last=self.last, last_observed=self.last_observed)

    def nbytes(self) -> int:
        """Bytes held by the kept frames, actions, poses, indices and levels."""
        if self.frames is None:
            return 0
        kept = (self.frames, self.actions, self.poses, self.index, self.levels)
        return sum(t.numel() * t.element_size() for t in kept)

    def __repr__(self) -> str:
        return (f"PoseBank(length={self.length}, pose_frames={self.pose_frames}, select={self.select!r}, "
                f"kept={len(self)}, committed={self.n_committed})")


def make_bank(mem, select: str | None = None):
    """The bank a rollout keeps for a memory config `mem` (anything with `select`, `length`, `pose_frames`,
    `bank_size` and the retention fields, e.g. `MemoryConfig`): a `PoseBank` for pose-aware memory
    (`mem.select == "pose"`, choosing by `select`, default "pose"), else a `MemoryBank` under the retention
    policy (`select`, if given, must be "time": such a model was never trained to read chosen frames)."""
    if mem.select == "pose":
        return PoseBank(mem.length, mem.pose_frames, mem.bank_size, select or "pose")
    if select not in (None, "time"):
        raise SelectionError(f"memory selection {select!r} needs a model trained with memory.select=pose; this one "
                             f"has memory.select={mem.select} (time-based retention only)")
    return MemoryBank(RetentionPolicy.from_config(mem))
