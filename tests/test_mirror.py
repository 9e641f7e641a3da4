"""The left-right mirror (data.mirror): an involution that keeps relative poses consistent with the flipped frames,
the config's checks, and the trainer's train.mirror_p (which clips, exactly what the loss sees)."""

from __future__ import annotations

import math

import pytest
import torch
from test_training import POSE, tiny_cfg, write_episodes

from arvdm.config import ConfigError, apply_overrides, get_preset
from arvdm.training.trainer import Trainer
from data.mirror import MEMORY_MAZE_MIRROR, mirror_clip, mirror_permutation, mirror_poses
from memory.select import relative_pose, select_by_pose

PERM = mirror_permutation(MEMORY_MAZE_MIRROR, 18)


def _clip(seed: int = 0, b: int = 2, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    video = torch.rand(b, t, 3, 8, 8, generator=g)  # (B, T, C, H, W)
    actions = torch.randint(0, 18, (b, t), generator=g)  # (B, T)
    poses = torch.randn(b, t, 3, generator=g)  # (B, T, 3)
    return video, actions, poses


def test_mirroring_twice_is_the_identity_and_once_flips_and_swaps_the_turns():
    video, actions, poses = _clip()
    m_video, m_actions, m_poses = mirror_clip(video, actions, poses, PERM)
    assert torch.equal(m_video[..., 0], video[..., -1]) and not torch.equal(m_video, video)
    # Memory Maze: 2 (left) <-> 3 (right), 4 (forward+left) <-> 5 (forward+right); the rest, and actions 6..17
    # that the permutation does not list, stay
    expected = {0: 0, 1: 1, 2: 3, 3: 2, 4: 5, 5: 4, **{a: a for a in range(6, 18)}}
    assert m_actions.tolist() == [[expected[a] for a in row] for row in actions.tolist()]
    back = mirror_clip(m_video, m_actions, m_poses, PERM)
    assert torch.equal(back[0], video) and torch.equal(back[1], actions) and torch.equal(back[2], poses)
    assert mirror_clip(None, None, None, PERM) == (None, None, None)


def test_mirrored_poses_are_seen_mirrored_and_memory_picks_the_same_frames():
    """relative_pose (what the pose tags read) of mirrored poses = (forward, -left, -heading change) of the
    originals, as the flipped frames show it; pose distances, so the frames memory picks, do not change."""
    _, _, poses = _clip(1, b=3, t=9)
    ref = poses[:, 4]  # (B, 3)
    rel, m_rel = relative_pose(poses, ref), relative_pose(mirror_poses(poses), mirror_poses(ref))
    torch.testing.assert_close(m_rel[..., 0], rel[..., 0])
    torch.testing.assert_close(m_rel[..., 1], -rel[..., 1])
    # heading changes of ±pi wrap to either sign: compare as angles
    assert torch.allclose(torch.cos(m_rel[..., 2] + rel[..., 2]), torch.ones(()), atol=1e-5)
    picks = select_by_pose(poses[:, :6], poses[:, 6:], 4)
    assert torch.equal(select_by_pose(mirror_poses(poses[:, :6]), mirror_poses(poses[:, 6:]), 4), picks)


@pytest.mark.parametrize("perm,why", [([0, 2, 3, 1, 4, 5], "swapped both ways"), ([1], "each once"),
                                      ([0.0, 1.0], "each once"), (list(range(19)), "L <= model.num_actions")])
def test_a_mirror_that_is_not_an_involution_is_refused(perm, why):
    with pytest.raises(ConfigError, match=rf"data\.mirror_actions=.*{why}"):
        apply_overrides(get_preset("tiny"), [f"data.mirror_actions={perm}"]).validate()


def test_mirror_p_needs_a_mirror_and_a_share():
    with pytest.raises(ConfigError, match=r"train\.mirror_p=0\.5 needs data\.mirror_actions"):
        apply_overrides(get_preset("tiny"), ["data.mirror_actions=[]", "train.mirror_p=0.5"]).validate()
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match=r"train\.mirror_p"):
            apply_overrides(get_preset("tiny"), [f"train.mirror_p={bad}"]).validate()
    assert get_preset("tiny").data.mirror_actions == []  # measured, not adopted: no preset mirrors
    cfg = apply_overrides(get_preset("tiny"), [f"data.mirror_actions={list(MEMORY_MAZE_MIRROR)}", "train.mirror_p=0.5"])
    assert cfg.validate().data.mirror_actions == [0, 1, 3, 2, 5, 4]


def test_the_trainer_mirrors_the_clips_it_was_told_to(tmp_path, monkeypatch):
    """With train.mirror_p = 1 the loss gets exactly the mirror image of the clips it gets with 0 (frames flipped,
    turns swapped, poses reflected; ages and noise draws unchanged); with 0.5 a share of them, the same share
    again on a second run of the same seed."""
    from arvdm.training import trainer as trainer_module
    data = write_episodes(tmp_path / "data", poses=True)
    seen, original = [], trainer_module.diffusion_forcing_loss

    def spy(net, diffusion, video, actions, *a, **kw):
        seen.append((video.clone(), actions.clone(), kw["poses"].clone(), kw["ages"].clone()))
        return original(net, diffusion, video, actions, *a, **kw)

    monkeypatch.setattr(trainer_module, "diffusion_forcing_loss", spy)
    runs = {}
    for name, p in (("plain", 0.0), ("all", 1.0), ("half", 0.5), ("half_again", 0.5)):
        seen.clear()
        cfg = tiny_cfg(data, *POSE, "data.mirror_actions=[0,1,3,2,5,4]", f"train.mirror_p={p}",
                       "train.max_steps=4", "train.val_every=0", "train.ckpt_every=4")
        Trainer(cfg, tmp_path / name, device="cpu").fit()
        runs[name] = list(seen)
    perm = mirror_permutation(MEMORY_MAZE_MIRROR, 6)
    flipped = []
    for (v, a, p, ages), (mv, ma, mp, mages) in zip(runs["plain"], runs["all"]):
        ev, ea, ep = mirror_clip(v, a, p, perm)
        assert torch.equal(mv, ev) and torch.equal(ma, ea) and torch.equal(mp, ep) and torch.equal(mages, ages)
    for (v, *_), (hv, *_), (hv2, *_) in zip(runs["plain"], runs["half"], runs["half_again"]):
        assert torch.equal(hv, hv2)
        for clip, half in zip(v, hv):
            flipped.append(not torch.equal(clip, half))
            assert torch.equal(half, clip) or torch.equal(half, clip.flip(-1))
    assert 0 < sum(flipped) < len(flipped)  # 16 clips at p = 0.5: some of each
