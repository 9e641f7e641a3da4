"""A trained run, ready to use: its denoiser (newest checkpoint) and its validation episodes.

    from arvdm.pipeline.runs import load_for_inference, load_validation_episodes
    model, cfg = load_for_inference("runs/tiny")                       # EMA weights, eval mode
    video, actions, pose = load_validation_episodes(cfg.data.path, cfg, n_episodes=2, context=8, frames=48)
    member_folders("runs/tiny", cfg)           # a run trained as train.members = M: ("runs/tiny/members/1", ...)

This is where checkpoint I/O (arvdm.model.checkpoint) meets the model (arvdm.model) and the data (data.dataset);
sampling, hybrid attention and the benchmarks build on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from arvdm.config import SamplingError
from arvdm.model.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_config,
    load_weights,
    resolve_checkpoint,
    run_folder,
)
from arvdm.model.denoiser import Denoiser
from data.dataset import ClipDataset, resolve_split

MEMBERS_DIR = "members"  # member k >= 1 of a run trained as train.members = M lives in RUN/members/k


def member_folder(run_dir: str | os.PathLike, k: int) -> Path:
    """Member k's run folder: the run folder itself for k = 0, ``RUN/members/k`` otherwise."""
    return Path(run_dir) if k == 0 else Path(run_dir) / MEMBERS_DIR / str(k)


def member_folders(run_dir: str | os.PathLike, cfg) -> tuple[str, ...]:
    """The run folders of members 1..M-1 of a run trained as ``train.members`` = M (its config ``cfg``; () for M =
    1), whose level-K predictions join the anchor (arvdm.pipeline.anchor). ``run_dir`` may be one of the run's
    checkpoint folders. CheckpointError when a member has no complete checkpoint (training stopped before it)."""
    root = run_folder(run_dir)
    folders = []
    for k in range(1, cfg.train.members):
        folder = member_folder(root, k)
        if latest_checkpoint(folder) is None:
            raise CheckpointError(f"{root} was trained as {cfg.train.members} members (train.members) but member {k} "
                                  f"({folder}) has no complete checkpoint: finish it with python train.py --out "
                                  f"{root} --resume")
        folders.append(str(folder))
    return tuple(folders)


def load_for_inference(run_dir: str | os.PathLike, use_ema: bool = True, device: str | torch.device = "cpu"):
    """Rebuild the denoiser of a run (newest checkpoint) for sampling, in eval mode. Returns ``(model, cfg)``.

    `run_dir` may also be one checkpoint folder. With `use_ema` the EMA weights are loaded when the
    checkpoint has them (it does for every checkpoint train.py writes).
    """
    ckpt = resolve_checkpoint(run_dir)
    cfg = load_config(ckpt)
    model = Denoiser(cfg)
    weights = ckpt / "ema.safetensors" if use_ema and (ckpt / "ema.safetensors").is_file() \
        else ckpt / "model.safetensors"
    load_weights(model, weights, what="EMA weights" if weights.name.startswith("ema") else "weights")
    return model.to(device).eval(), cfg


def load_validation_episodes(root: str | os.PathLike, cfg, n_episodes: int, context: int, frames: int | None,
                             split: str = "validation") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first `n_episodes` episodes of `split` (default validation) from frame 0, at the run's resolution.

    Returns video (N, T, C, H, W) in [-1, 1], actions (N, T) int64 and pose (N, T, 3) or None, with
    T = context + frames (frames=None: the longest T every chosen episode holds).
    """
    split = resolve_split(root, split)
    skip = cfg.data.frame_skip
    probe = ClipDataset(split, n_frames=1, frame_skip=skip, random_start=True, resize=cfg.data.resize,
                        skip_bad=cfg.data.skip_bad_files, progress=False)
    available = [(int(n) - 1) // skip + 1 for n in probe.lengths[:n_episodes]]  # frames after frame_skip
    t = context + frames if frames is not None else min(available)
    if t > min(available):
        raise SamplingError(f"--context {context} + --frames {frames} = {t} frames, but validation episode(s) in "
                            f"{split} hold only {min(available)}; ask for fewer frames")
    ds = ClipDataset(split, n_frames=t, frame_skip=skip, random_start=True, resize=cfg.data.resize,
                     skip_bad=cfg.data.skip_bad_files, progress=False)
    # with random_start every valid start is a clip: the clip at (episode e, frame 0) comes after all
    # the clips of episodes 0..e-1
    starts = np.concatenate([[0], np.cumsum(np.maximum(ds.lengths - ds.span + 1, 0))])
    items = [ds[int(starts[e])] for e in range(len(available))]
    video = torch.stack([it["video"] for it in items])  # (N, T, C, H, W)
    if video.shape[-1] != cfg.model.image_size or video.shape[-2] != cfg.model.image_size:
        raise SamplingError(f"data at another resolution: {split} gives {tuple(video.shape[-2:])} frames, the "
                            f"checkpoint was trained at {cfg.model.image_size}x{cfg.model.image_size} "
                            f"(set data.resize when training, or pass matching data)")
    actions = torch.stack([it["actions"] for it in items])  # (N, T)
    if int(actions.max()) >= cfg.model.num_actions:
        raise SamplingError(f"{split} has action {int(actions.max())} but the checkpoint knows "
                            f"{cfg.model.num_actions} actions")
    poses = torch.stack([it["pose"] for it in items]) if all("pose" in it for it in items) else None
    return video, actions, poses
