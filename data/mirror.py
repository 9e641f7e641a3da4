"""The left-right mirror image of a clip: the same world seen reflected (frames flipped, left and right swapped).

    from data.mirror import MEMORY_MAZE_MIRROR, mirror_clip, mirror_permutation
    video, actions, poses = mirror_clip(video, actions, poses, mirror_permutation(MEMORY_MAZE_MIRROR, num_actions))

A first-person maze is left-right symmetric as a distribution: the reflection of a random maze is another random
maze, and an agent in it that turns left is the reflected agent turning right. So a clip's mirror image is as
likely a clip as the clip itself, which training can use as data (``train.mirror_p``; measured, not adopted:
benchmarks/RESULTS.md, "mirrored clips"). What the mirror needs to know about the data is
which action each action becomes (``data.mirror_actions``): for Memory Maze :data:`MEMORY_MAZE_MIRROR`. A world
that is not symmetric (text on walls, a sun on one side; Crafter's sprites are drawn facing one way) has no mirror
and keeps ``data.mirror_actions`` empty.

Poses (x, y, heading) are reflected across the world's x axis, (x, −y, −heading): every relative pose
(``memory.relative_pose``: forward, left, heading change) becomes (forward, −left, −change), as the flipped image
shows it, and pose distances (which frames memory picks) are unchanged.
"""

from __future__ import annotations

import torch

from .envs import MM_FORWARD, MM_FORWARD_LEFT, MM_FORWARD_RIGHT, MM_LEFT, MM_NOOP, MM_RIGHT

__all__ = ["MEMORY_MAZE_MIRROR", "mirror_clip", "mirror_permutation", "mirror_poses"]

# action i becomes MEMORY_MAZE_MIRROR[i] in the mirror image: turns swap, the rest stay
MEMORY_MAZE_MIRROR = (MM_NOOP, MM_FORWARD, MM_RIGHT, MM_LEFT, MM_FORWARD_RIGHT, MM_FORWARD_LEFT)


def mirror_permutation(mirror_actions: list[int] | tuple[int, ...], num_actions: int) -> torch.Tensor:
    """``data.mirror_actions`` as an int64 permutation (num_actions,) for :func:`mirror_clip`: the actions it does
    not list stay themselves."""
    perm = torch.arange(num_actions)  # (num_actions,)
    perm[:len(mirror_actions)] = torch.as_tensor(list(mirror_actions), dtype=torch.long)
    return perm


def mirror_poses(poses: torch.Tensor | None) -> torch.Tensor | None:
    """Poses (..., 3) = (x, y, heading) reflected across the x axis: (x, −y, −heading); None stays None."""
    if poses is None:
        return None
    return torch.stack([poses[..., 0], -poses[..., 1], -poses[..., 2]], dim=-1)  # (..., 3)


def mirror_clip(video: torch.Tensor | None, actions: torch.Tensor | None, poses: torch.Tensor | None,
                permutation: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The mirror image of frames (..., C, H, W) (flipped along W), their int64 actions (action i becomes
    ``permutation[i]``) and poses (..., 3) (:func:`mirror_poses`); any of them may be None. Its own inverse when
    ``permutation`` is (every mirror's is: mirroring twice is the identity)."""
    frames = None if video is None else video.flip(-1)
    acts = None if actions is None else permutation.to(actions.device)[actions]
    return frames, acts, mirror_poses(poses)
