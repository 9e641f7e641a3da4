"""Pose-aware memory (memory/select.py, the denoiser's pose tags, PoseMemoryClips, rollout(poses=, memory_select=))."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arvdm.config import ConfigError, SamplingError, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser, DenoiserError
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.presets import get_schedule
from arvdm.training import pose_clips
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.pose_clips import PoseMemoryClips
from data.dataset import ClipDataset, DatasetError
from data.episodes import write_episode
from memory import MemoryBank, PoseBank, SelectionError, make_bank, relative_pose, select_by_pose

K = 10


def _poses(headings, xy=(0.0, 0.0)):
    return torch.tensor([[xy[0], xy[1], h] for h in headings], dtype=torch.float32)


def test_select_by_pose_picks_the_nearest_view_per_target_round_robin():
    # candidates look at 0, 90, 180, 270 degrees from one spot, then one at 0 degrees far away
    cands = torch.cat([_poses([0, math.pi / 2, math.pi, -math.pi / 2]), _poses([0.0], xy=(5.0, 5.0))])[None]
    targets = _poses([math.pi - 0.1, 0.05])[None]  # look ~180, then ~0
    idx = select_by_pose(cands, targets, 2)
    assert idx.tolist() == [[0, 2]]  # 180 -> candidate 2, 0 -> candidate 0 (not the far one); ascending
    assert select_by_pose(cands, targets, 9).shape == (1, 5)  # k is clipped to the candidates there are


def test_relative_pose_is_the_pose_in_the_reference_frame():
    ref = torch.tensor([[1.0, 1.0, math.pi / 2]])  # at (1, 1) facing +y
    rel = relative_pose(torch.tensor([[[1.0, 3.0, math.pi / 2], [0.0, 1.0, 0.0]]]), ref)
    assert torch.allclose(rel[0, 0], torch.tensor([2.0, 0.0, 0.0]), atol=1e-6)  # 2 ahead, same heading
    assert torch.allclose(rel[0, 1], torch.tensor([0.0, 1.0, -math.pi / 2]), atol=1e-6)  # 1 to the left


def _bank_with(n, select="pose", capacity=64, b=2):
    bank = PoseBank(length=4, pose_frames=2, capacity=capacity, select=select)
    frames = torch.arange(n, dtype=torch.float32).view(1, n, 1, 1, 1).expand(b, n, 3, 4, 4).clone()
    headings = torch.linspace(0, 2 * math.pi, n + 1)[:-1]
    poses = _poses(headings.tolist())[None].expand(b, n, 3).clone()
    poses[1, :, 0] += 10.0  # sample 1 is elsewhere
    bank.append(frames, torch.zeros(b, n, dtype=torch.long), poses)
    return bank, poses


def test_pose_bank_modes():
    bank, poses = _bank_with(12)
    target = poses[:, 3:4].clone()  # looking where frame 3 looked
    mem = bank.memory(target)
    ids = mem.frames[:, :, 0, 0, 0].long()  # each frame's value is its index
    assert ids[0].tolist()[-2:] == [10, 11]  # the 2 recent frames
    assert 3 in ids[0].tolist()[:2]  # the pose match is chosen
    assert mem.ages[0].tolist()[-2:] == [2, 1] and mem.positions.tolist() == [8, 9, 10, 11]
    assert mem.next_index == 12 and mem.target_poses is target
    bank.select = "time"
    assert bank.memory(target).frames[0, :, 0, 0, 0].long().tolist() == [8, 9, 10, 11]  # = retention "last 4"
    bank.select = "none"
    assert bank.memory(target).frames[0, :, 0, 0, 0].long().tolist() == [10, 11]
    bank.select = "other"  # chosen from the other sample's bank (which is 10 cells away): its frames, its poses
    other = bank.memory(target)
    assert torch.equal(other.poses[0, :2, 0], poses[1, other.ages.new_tensor(12) - other.ages[0, :2], 0])


def test_pose_bank_is_bounded_and_drops_redundant_views():
    bank = PoseBank(length=2, pose_frames=1, capacity=5, select="pose")
    # frames 0..3 at four distinct views, then frames 4..7 repeat view 0 from the same spot
    headings = [0, math.pi / 2, math.pi, -math.pi / 2, 0, 0, 0, 0]
    for i, h in enumerate(headings):
        bank.append(torch.full((1, 1, 3, 2, 2), float(i)), torch.zeros(1, 1, dtype=torch.long), _poses([h])[None])
    assert len(bank) == 5
    kept = bank.index[0].tolist()
    assert {1, 2, 3} <= set(kept) and kept[-1] == 7  # the distinct views and the newest frame survive


def test_pose_bank_errors():
    bank = PoseBank(length=4, pose_frames=2, capacity=8)
    with pytest.raises(SelectionError, match="poses"):
        bank.append(torch.zeros(1, 2, 3, 2, 2), torch.zeros(1, 2, dtype=torch.long))
    bad = torch.zeros(1, 2, 3)
    bad[0, 1, 2] = float("nan")
    with pytest.raises(SelectionError, match="NaN"):
        bank.append(torch.zeros(1, 2, 3, 2, 2), torch.zeros(1, 2, dtype=torch.long), bad)
    with pytest.raises(SelectionError, match="pose_frames"):
        PoseBank(length=2, pose_frames=3, capacity=8)
    with pytest.raises(SelectionError, match="unknown"):
        PoseBank(length=2, pose_frames=1, capacity=8, select="age")
    cfg = get_preset("tiny")
    cfg.memory.select = "time"
    with pytest.raises(SelectionError, match="memory.select=pose"):
        make_bank(cfg.memory, "pose")
    assert isinstance(make_bank(cfg.memory), MemoryBank)


def test_config_checks_pose_memory():
    for key, value in (("memory.pose_frames", 9), ("memory.pose_frames", 0), ("memory.bank_size", 2),
                       ("memory.match_share", 1.0), ("memory.select", "place"), ("memory.stop_share", -0.1),
                       ("memory.stop_share", 0.5)):  # with match_share 0.5 nothing is left for the other windows
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            apply_overrides(get_preset("tiny"), [f"{key}={value}"]).validate()
    with pytest.raises(SamplingError, match="--memory-select"):
        SampleSettings(memory_select="oldest").validate()


def _model(**over):
    cfg = apply_overrides(get_preset("tiny"), ["model.unet_channels=[8,16]", "model.dim=32", "model.depth=1",
                                               f"diffusion.num_levels={K}", "diffusion.context_level=0",
                                               "diffusion.anchor_sigma=0", "diffusion.anchor_floor=0",
                                               "train.context_noise_max=0", *[f"{k}={v}" for k, v in over.items()]])
    torch.manual_seed(0)
    model = Denoiser(cfg).eval()
    with torch.no_grad():  # every parameter random: a fresh model's zero-initialised output layers predict v = 0
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model, cfg


def _episode_inputs(b=2, n_ctx=12, n_gen=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.rand(b, n_ctx, 3, 32, 32, generator=g) * 2 - 1
    acts = torch.randint(0, 6, (b, n_ctx + n_gen), generator=g)
    poses = torch.randn(b, n_ctx + n_gen, 3, generator=g)
    return ctx, acts, poses


def test_pose_aware_rollout_cached_equals_recomputed_and_selection_matters():
    model, cfg = _model()
    assert model.pose_aware
    diffusion = PerFrameDiffusion(cfg.diffusion)
    sched = get_schedule("chunked", 4, K, steps=3)
    ctx, acts, poses = _episode_inputs()

    def run(**kw):
        return rollout(model, diffusion, sched, ctx, acts[:, :12], acts[:, 12:], 12, poses=poses,
                       generator=torch.Generator().manual_seed(1), progress=False, **kw)

    cached = run()
    assert torch.equal(cached, run(use_cache=False))  # memory chosen per window, K/V built once per window
    for mode in ("time", "none", "other"):
        assert torch.equal(run(memory_select=mode), run(memory_select=mode, use_cache=False))
        assert not torch.equal(run(memory_select=mode), cached)
    with pytest.raises(ValueError, match="poses"):
        rollout(model, diffusion, sched, ctx, acts[:, :12], acts[:, 12:], 12, progress=False)
    nan = poses.clone()
    nan[0, 3, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        run_poses = dict(poses=nan)
        rollout(model, diffusion, sched, ctx, acts[:, :12], acts[:, 12:], 12, progress=False, **run_poses)


def test_pose_tags_start_at_zero_and_then_carry_the_pose():
    model, cfg = _model()
    ctx, acts, poses = _episode_inputs(n_ctx=6, n_gen=4)
    levels = torch.full((2, 4), 5)
    x = torch.randn(2, 4, 3, 32, 32)
    from memory import MemoryFrames

    def v(p):
        ages = torch.arange(6, 0, -1).expand(2, 6)
        mem = MemoryFrames(ctx, acts[:, :6], poses=p[:, :6], target_poses=p[:, 6:], ages=ages)
        return model(x, levels, acts[:, 6:], memory=mem)

    assert not torch.equal(v(poses), v(poses + 1.0))  # random tag weights: the pose reaches the output
    with torch.no_grad():
        for last in (model.pose_tags.pose[-1], model.pose_tags.age[-1]):
            last.weight.zero_()
            last.bias.zero_()
    assert torch.equal(v(poses), v(poses + 1.0))  # zero-initialised tags: poses change nothing
    with pytest.raises(DenoiserError, match="target_poses"):
        model(x, levels, acts[:, 6:], memory=MemoryFrames(ctx, acts[:, :6]))


def _write_turning_episodes(root, n=3, length=48):
    rng = np.random.default_rng(0)
    for e in range(n):
        headings = np.concatenate([np.linspace(0, 2 * np.pi, 20, endpoint=False),  # a full turn on the spot
                                   np.zeros(8),  # walk out along +x ...
                                   np.full(8, np.pi),  # ... and back
                                   np.linspace(0, 2 * np.pi, length - 36, endpoint=False)])  # turn again
        x = np.concatenate([np.zeros(20), np.arange(8) * 0.3, 2.4 - np.arange(8) * 0.3, np.zeros(length - 36)])
        pose = np.stack([x + 1.5, np.full(length, 1.5), headings], -1).astype(np.float32)
        video = rng.integers(0, 255, (length, 8, 8, 3), dtype=np.uint8)
        write_episode(root / f"ep{e:03d}.npz", video, rng.integers(0, 6, length), pose)


def test_pose_memory_clips_choose_matching_views_and_oversample_them(tmp_path, monkeypatch):
    monkeypatch.setattr(pose_clips, "DISTRACTOR_SHARE", 0.0)
    _write_turning_episodes(tmp_path)
    clips = ClipDataset(tmp_path, n_frames=2 + 4, progress=False, video_dtype="uint8")
    ds = PoseMemoryClips(clips, pose_frames=4, window=4, match_share=0.5, seed=0)
    assert ds.n_matching > 0 and ds.n_other > 0
    share = (ds.n_matching * ds.repeat) / len(ds)
    assert 0.35 <= share <= 0.65  # oversampled from a minority to about half
    item = ds[len(ds) - 1]  # a matching window (they come last): the second turn
    pose = torch.as_tensor(clips.track(int(ds.entries[-1][0]))[1])
    assert item["video"].shape == (10, 3, 8, 8) and item["ages"].shape == (6,)
    assert item["ages"][-2:].tolist() == [2, 1]
    window, chosen = item["pose"][6:], item["pose"][:4]
    d = (chosen[:, None, 2] - window[None, :, 2] + math.pi).remainder(2 * math.pi) - math.pi
    assert d.abs().min(dim=0).values.max() < math.radians(20)  # every window frame has a matching chosen view
    e, start = (int(v) for v in ds.entries[-1])
    idx = (start + 2 - item["ages"][:4]).tolist()  # the window starts at start + r (r = 2 recent frames)
    assert torch.equal(item["pose"][:4], pose[idx].float())
    assert torch.equal(item["video"][:4], clips.frames_at(e, idx))
    monkeypatch.setattr(pose_clips, "DISTRACTOR_SHARE", 1.0)  # one slot holds a random older frame instead
    assert not torch.equal(ds[len(ds) - 1]["pose"][:4], item["pose"][:4])
    assert torch.equal(ds[len(ds) - 1]["video"], ds[len(ds) - 1]["video"])  # an item is a function of its index


def _write_stop_and_go_episodes(root, n=3, length=48):
    """Walk along +x for 12 frames (0.25 cells a frame), stand still for 12, and again; random pixels."""
    rng = np.random.default_rng(1)
    for e in range(n):
        moving = (np.arange(length) // 12) % 2 == 0
        x = 1.5 + np.concatenate([[0.0], np.cumsum(0.25 * moving[1:])])
        pose = np.stack([x, np.full(length, 1.5 + e), np.zeros(length)], -1).astype(np.float32)
        video = rng.integers(0, 255, (length, 8, 8, 3), dtype=np.uint8)
        write_episode(root / f"ep{e:03d}.npz", video, rng.integers(0, 6, length), pose)


def test_pose_memory_clips_oversample_windows_where_the_agent_stops(tmp_path):
    _write_stop_and_go_episodes(tmp_path)
    clips = ClipDataset(tmp_path, n_frames=2 + 4, progress=False, video_dtype="uint8")
    plain = PoseMemoryClips(clips, pose_frames=4, window=4, match_share=0.0, seed=0)
    ds = PoseMemoryClips(clips, pose_frames=4, window=4, match_share=0.0, seed=0, stop_share=0.5)
    windows = [(e, s) for e in range(3) for s in range(4, 48 - 6 + 1)]
    # stop_share 0: every window once, in index order (the index of a run without the option)
    assert plain.entries.tolist() == [list(w) for w in windows] and plain.n_stopping == plain.n_matching == 0
    # a stop: moving into the last recent frame (s + 1), still at some window frame (s + 2 .. s + 5)
    speed = np.r_[0.0, np.full(47, 0.25) * ((np.arange(1, 48) // 12) % 2 == 0)]
    stops = [(e, s) for e, s in windows if speed[s + 1] > 0.05 and speed[s + 2:s + 6].min() < 0.01]
    assert ds.n_stopping == len(stops) > 0 and ds.n_other == len(windows) - len(stops)
    assert sorted({tuple(w) for w in ds.entries[ds.n_other:].tolist()}) == stops  # the oversampled copies
    share = ds.n_stopping * ds.stop_repeat / len(ds)
    assert ds.stop_repeat > 1 and abs(share - 0.5) < 0.1  # a minority oversampled to about half
    with pytest.raises(DatasetError, match="stop_share"):
        PoseMemoryClips(clips, pose_frames=4, window=4, match_share=0.6, seed=0, stop_share=0.4)


def test_loss_with_pose_memory_reads_poses_and_ages():
    model, cfg = _model()
    ctx, acts, poses = _episode_inputs(n_ctx=6, n_gen=4)
    video = torch.cat([ctx, torch.rand(2, 4, 3, 32, 32) * 2 - 1], dim=1)
    diffusion = PerFrameDiffusion(cfg.diffusion)
    ages = torch.arange(6, 0, -1).expand(2, 6)

    def loss(p):
        total, _ = diffusion_forcing_loss(model, diffusion, video, acts, 6, K, torch.Generator().manual_seed(0),
                                          poses=p, ages=ages)
        return total

    assert not torch.equal(loss(poses), loss(poses + 0.5))
    assert torch.equal(loss(poses), loss(poses))
