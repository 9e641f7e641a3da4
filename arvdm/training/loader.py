"""Training data: the data set on disk, its clips, and the seeded, resumable order they are drawn in.

    prepare_data(cfg)                                    # generate the stand-in set when absent
    ds = make_dataset(cfg, "training", m + w)            # clips of m memory + w window frames (uint8)
    sampler = ResumableSampler(len(ds), batch_size, seed, rank, world_size, position)
    loader = make_loader(ds, sampler, cfg.data.num_workers, device, seed)   # batches {"video", "actions"}

Contract: the order of clips depends only on (seed, position): `position` (stream items consumed before the
first batch) is all a checkpoint needs to restart the stream exactly, on any number of loader workers.
Batches hold video uint8 (B, T, C, H, W) and actions int64 (B, T); the trainer converts the video to float
in [-1, 1] on the device.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arvdm.config import Config
from arvdm.errors import ArvdmError
from arvdm.training.pose_clips import PoseMemoryClips
from data.dataset import ClipDataset, DatasetError, to_float_video
from data.generate import ensure_dataset

# The stand-in generator runs in at most this many processes (fewer on a machine with fewer cores).
GENERATE_WORKERS_MAX = 2


class TrainingError(ArvdmError):
    """A user-facing problem with the data or the run folder (missing data, wrong resolution, ...)."""


def mix_seed(*parts: Any) -> int:
    """A 63-bit seed from several values (seed, epoch, rank, ...); stable across runs and machines."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 64 bits, halved: a non-negative int64 for manual_seed


class ResumableSampler:
    """An endless, seeded stream of dataset indices, sharded over ranks, that can start anywhere.

    The global stream is epoch 0's permutation, then epoch 1's, ... (torch.randperm with a generator
    seeded from (seed, epoch)). Step s consumes stream items [s*G, (s+1)*G) with G = batch_size *
    world_size, and rank r takes the r-th slice of batch_size of them. `position` (items consumed
    before the first batch) is all a checkpoint needs to restart the stream exactly.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 position: int = 0):
        if n < 1:
            raise TrainingError("the training split has no clips")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world_size, self.position = rank, world_size, position

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(self.seed, "epoch", epoch))
        return torch.randperm(self.n, generator=g)

    def take(self, start: int, count: int) -> list[int]:
        """Items [start, start + count) of the global stream."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.n)
            perm = self.permutation(epoch)
            out += perm[offset:offset + count - len(out)].tolist()
        return out

    def __iter__(self) -> Iterator[list[int]]:
        pos, global_batch = self.position, self.batch_size * self.world_size
        while True:
            chunk = self.take(pos, global_batch)
            yield chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            pos += global_batch


def prepare_data(cfg: Config) -> Path:
    """Generate the stand-in data set at cfg.data.path if it is absent or incomplete (resumable)."""
    size = cfg.data.resize or cfg.model.image_size
    workers = max(1, min(GENERATE_WORKERS_MAX, os.cpu_count() or 1))
    return Path(ensure_dataset(cfg.data.path, cfg.data.env, cfg.data.generate_episodes, cfg.data.generate_length,
                               cfg.data.generate_policy, cfg.data.generate_seed, size=size, workers=workers))


def make_dataset(cfg: Config, split: str, n_frames: int, random_start: bool = True,
                 progress: bool = False) -> ClipDataset:
    """ClipDataset of `split` with clips of `n_frames`; checks resolution and actions against the model."""
    root = Path(cfg.data.abs_path or cfg.data.path)  # Trainer sets abs_path to where it found the data
    if not root.is_dir():
        raise TrainingError(f"no data: {root} does not exist (data.path must hold training/ and validation/; "
                            f"run `python train.py` without --data to generate the stand-in, or "
                            f"`python -m data.generate memory_maze --out {root}`)")
    # uint8 clips: the loader only slices bytes; the trainer converts them on the device.
    ds = ClipDataset(root / split, n_frames, frame_skip=cfg.data.frame_skip, random_start=random_start,
                     resize=cfg.data.resize, skip_bad=cfg.data.skip_bad_files, progress=progress,
                     video_dtype="uint8")
    h, w = ds.frame_size
    if (h, w) != (cfg.model.image_size, cfg.model.image_size):
        raise TrainingError(
            f"data at another resolution: {ds.split_dir} has {h}x{w} frames but model.image_size="
            f"{cfg.model.image_size}; set data.resize={cfg.model.image_size} (or model.image_size={h})")
    if ds.num_actions > cfg.model.num_actions:
        raise TrainingError(f"{ds.split_dir} has actions up to {ds.num_actions - 1} but model.num_actions="
                            f"{cfg.model.num_actions}; set model.num_actions={ds.num_actions}")
    return ds


def make_clips(cfg: Config, split: str, progress: bool = False) -> ClipDataset | PoseMemoryClips:
    """The clips training draws from: m + w consecutive frames (memory.select=time), or k frames chosen by pose
    + r = m - k recent + w window frames (memory.select=pose, `PoseMemoryClips`). With train.rollout_frames G the
    window is G + w frames: the model generates the first G (`objective.rollout_context`)."""
    mem, w = cfg.memory, cfg.train.window + cfg.train.rollout_frames
    if mem.select != "pose":
        return make_dataset(cfg, split, mem.length + w, progress=progress)
    clips = make_dataset(cfg, split, mem.length - mem.pose_frames + w, progress=progress)
    try:
        return PoseMemoryClips(clips, mem.pose_frames, w, mem.match_share, cfg.train.seed, mem.stop_share)
    except DatasetError as e:
        raise TrainingError(f"memory.select=pose: {e}") from e


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Clips -> one batch: video (B, T, C, H, W) as the clips hold it, actions int64 (B, T); with pose-chosen
    memory also pose float (B, T, 3) and ages int64 (B, m)."""
    batch = {"video": torch.stack([it["video"] for it in items]),
             "actions": torch.stack([torch.as_tensor(it["actions"]) for it in items]).long()}
    if "ages" in items[0]:
        batch["pose"] = torch.stack([it["pose"] for it in items]).float()
        batch["ages"] = torch.stack([it["ages"] for it in items]).long()
    return batch


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A collated batch on `device`: video float (B, T, C, H, W) in [-1, 1] (uint8 converted there), actions."""
    video = to_float_video(batch["video"].to(device, non_blocking=True))  # (B, T, C, H, W)
    return video, batch["actions"].to(device, non_blocking=True)  # ..., (B, T)


def pose_memory(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The pose-chosen memory's extras of a batch on `device`: {"poses": (B, T, 3), "ages": (B, m)}, or {}."""
    if "ages" not in batch:
        return {}
    return {"poses": batch["pose"].to(device, non_blocking=True), "ages": batch["ages"].to(device, non_blocking=True)}


class BatchDataset(torch.utils.data.Dataset):
    """Adapts a clip dataset to the loader; the batch sampler hands in lists of indices."""

    def __init__(self, ds: ClipDataset):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.ds[i]


def make_loader(ds: ClipDataset, sampler: ResumableSampler, num_workers: int, device: torch.device,
                seed: int) -> torch.utils.data.DataLoader:
    """The training loader: batches in the sampler's order, `num_workers` processes (0 = in this one)."""
    return torch.utils.data.DataLoader(
        BatchDataset(ds), batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
        pin_memory=device.type == "cuda", persistent_workers=num_workers > 0,
        # Its own generator, so building the loader does not consume the global RNG (exact resume).
        generator=torch.Generator().manual_seed(mix_seed(seed, "loader")))
