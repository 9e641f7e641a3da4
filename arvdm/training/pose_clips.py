"""Training clips whose memory is chosen by pose, as a rollout chooses it (memory.select=pose).

    ds = PoseMemoryClips(clips, pose_frames=4, window=4, match_share=0.5, seed=0)  # clips: r + w frames
    item = ds[i]   # video (k+r+w, C, H, W), actions (k+r+w,), pose (k+r+w, 3), ages (k+r,)

With time-based memory a clip is m + w consecutive frames, and a memory frame almost never shows something
the recent frames do not (revisits are 33-179 frames apart in the generated data): the loss never asks
for memory, so the model learns to ignore it. Here a clip is

    [k frames chosen from the episode's past by `memory.select_by_pose` against the window's poses]
    + [r = m - k recent frames] + [w window frames]      (the last r + w consecutive)

exactly what `memory.PoseBank.memory` hands a rollout. Windows with a frame that only memory can
supply (a frame older than the recent ones is within MATCH_POSITION cells and MATCH_HEADING of it, and no
recent frame is) are oversampled to `match_share` of the index; in a DISTRACTOR_SHARE of clips one chosen slot
holds a random older frame instead, so the model also sees memory frames it must not copy and learns from the
pose tags when a memory frame is relevant.

Windows where the agent comes to a stop (it moves at the last recent frame, pose speed > MOVING, and is still,
speed < STILL, at some window frame: Memory Maze's agent coasts for 2-3 frames after its last move) can be
oversampled to `stop_share` of the index: 196 of the mixed data's 5,117 windows (4%), where a random exploration agent
stops far more often (issue 21). A window that is both keeps its place among the matching ones.

Items are a pure function of the index (the distractor draw is seeded by (seed, index)), so the trainer's
resumable sampler restarts the stream exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from arvdm.evaluation.revisits import DEFAULT_HEADING_TOL, DEFAULT_POS_TOL, pose_match_matrix
from data.dataset import ClipDataset, DatasetError
from memory.select import select_by_pose, wrap_angle

__all__ = ["PoseMemoryClips"]

# an earlier frame this close in position (cells) and heading shows (nearly) the same view: the revisit rule
MATCH_POSITION, MATCH_HEADING = DEFAULT_POS_TOL, DEFAULT_HEADING_TOL
DISTRACTOR_SHARE = 0.25  # clips with one chosen slot replaced by a random older frame
# pose speed per frame (cells moved + radians turned): a walking agent moves ~0.25 cells and turns ~0.3 rad a frame
MOVING, STILL = 0.05, 0.01


class PoseMemoryClips(Dataset):
    """Clips of k pose-chosen + r recent memory frames and w window frames (see the module docstring).

    Args:
        clips: a `ClipDataset` of r + w consecutive frames (frame_skip 1, episodes with poses).
        pose_frames: k, memory frames chosen by pose from before the recent ones.
        window: w (the rest of the clip's frames, r = n_frames - w, are the recent memory frames).
        match_share: share of the index given to windows with an earlier matching view (0 = no oversampling).
        seed: seeds the distractor draws.
        stop_share: share of the index given to windows where the agent comes to a stop (0 = no oversampling:
            they stay among the others, and the index is the one without this argument).
    """

    def __init__(self, clips: ClipDataset, pose_frames: int, window: int, match_share: float = 0.5, seed: int = 0,
                 stop_share: float = 0.0):
        if not clips.has_pose:
            raise DatasetError(f"{clips.split_dir}: memory.select=pose needs episodes with a 'pose' array")
        if clips.frame_skip != 1:
            raise DatasetError("memory.select=pose needs data.frame_skip=1")
        if not clips.random_start:
            raise DatasetError("PoseMemoryClips needs a random-start ClipDataset")
        self.clips, self.k, self.w, self.seed = clips, int(pose_frames), int(window), seed
        self.r = clips.n_frames - self.w
        if self.r < 0 or self.k < 1:
            raise DatasetError(f"PoseMemoryClips: need pose_frames >= 1 and clips of >= window={self.w} frames")
        if not (0 <= match_share and 0 <= stop_share and match_share + stop_share < 1):
            raise DatasetError(f"PoseMemoryClips: match_share={match_share} and stop_share={stop_share} must be "
                               ">= 0 with a sum < 1")
        matching, stopping, other = self._index()
        if stop_share == 0:  # not a group of their own: back among the others, in index order
            other, stopping = sorted(other + stopping), []
        if not matching and not stopping and not other:
            raise DatasetError(f"{clips.split_dir}: no episode is long enough for {self.k} chosen + "
                               f"{clips.n_frames} consecutive frames")
        rest = 1 - match_share - stop_share  # copies of each group's windows to reach its share of the index:
        # n_group * repeat = share / rest * n_other
        repeat, stop_repeat = ((max(1, round(share / rest * len(other) / len(group))) if group and other and share > 0
                                else 1) for group, share in ((matching, match_share), (stopping, stop_share)))
        entries = other + stopping * stop_repeat + matching * repeat
        self.entries = np.array(entries, dtype=np.int64).reshape(-1, 2)  # (N, 2) episode, start
        self.n_matching, self.n_other, self.repeat = len(matching), len(other), repeat
        self.n_stopping, self.stop_repeat = len(stopping), stop_repeat

    def _index(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(episode, start) of every clip, split into windows with an earlier matching view, windows where the
        agent comes to a stop, and the others."""
        matching, stopping, other = [], [], []
        n = self.clips.n_frames
        for e, length in enumerate(self.clips.lengths.tolist()):
            if length < self.k + n:
                continue
            pose = torch.from_numpy(np.asarray(self.clips.track(e)[1], dtype=np.float32))  # (T, 3)
            match = pose_match_matrix(pose, MATCH_POSITION, MATCH_HEADING).numpy()  # (T, T): i shows what j shows
            seen = np.concatenate([np.zeros((length, 1), np.int64), match.cumsum(axis=1)], axis=1)  # (T, T+1)
            rows = np.arange(length)
            step = pose[1:] - pose[:-1]  # (T-1, 3)
            speed = np.concatenate([[0.0], (step[:, :2].norm(dim=1) + wrap_angle(step[:, 2]).abs()).numpy()])  # (T,)
            for s in range(self.k, length - n + 1):
                # window frame t needs memory: a frame older than the recent ones (< s) matches it and none of
                # the recent ones (s..s+r-1) does (the window's frames are generated together)
                t = rows[s + self.r:s + n]
                needs = (seen[t, s] > 0) & (seen[t, s + self.r] - seen[t, s] == 0)
                stops = self.r > 0 and speed[s + self.r - 1] > MOVING and speed[t].min() < STILL
                (matching if needs.any() else stopping if stops else other).append((e, s))
        return matching, stopping, other

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict:
        e, s = (int(v) for v in self.entries[int(index)])
        clips = self.clips
        actions, pose = (torch.as_tensor(np.asarray(a)) for a in clips.track(e))  # (T,), (T, 3)
        pose = pose.float()
        window_poses = pose[s + self.r:s + clips.n_frames]  # (w, 3)
        chosen = select_by_pose(pose[None, :s], window_poses[None], self.k)[0]  # (k,) ascending, all < s
        rng = np.random.default_rng([self.seed, int(index)])
        if rng.random() < DISTRACTOR_SHARE:
            free = np.setdiff1d(np.arange(s), chosen.numpy())
            if free.size:  # one slot gets a random older frame (kept in time order)
                chosen[int(rng.integers(self.k))] = int(rng.choice(free))
                chosen = chosen.sort().values
        window_start = s + self.r
        ages = torch.cat([window_start - chosen, torch.arange(self.r, 0, -1)])  # (k + r,)
        frames = chosen.tolist() + list(range(s, s + clips.n_frames))  # k chosen, then r recent + w window
        return {"video": clips.frames_at(e, frames), "actions": actions[frames].long(), "pose": pose[frames],
                "ages": ages.long()}

    def __repr__(self) -> str:
        return (f"PoseMemoryClips({self.clips.split_dir}: {len(self):,} clips; k={self.k} chosen + r={self.r} "
                f"recent + w={self.w}; {self.n_matching:,} windows with an earlier matching view x{self.repeat}, "
                f"{self.n_stopping:,} where the agent stops x{self.stop_repeat}, {self.n_other:,} others)")
