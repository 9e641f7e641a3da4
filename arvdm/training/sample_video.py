"""The periodic sample video of a training run: the EMA model rolls out from a few validation clips.

    video = SampleVideo(cfg, run_dir, device)
    video.write(ema_model, diffusion, step)     # RUN/samples/step_NNNNNNN.mp4: ground truth | generated

Contract: the rollout conditions on `cfg.default_context()` ground-truth frames (the memory the model is trained
with, as sample.py does) and generates SAMPLE_WINDOWS windows with the chunked schedule; its noise comes from
a generator seeded by train.seed alone, so it draws nothing from the training's random streams. When the
validation episodes are too short for context + generated frames, sample videos are skipped with a note.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm import tqdm

from arvdm.config import Config
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.pipeline.video import side_by_side, write_video
from arvdm.schedules.presets import get_schedule
from arvdm.training.loader import collate, make_dataset, mix_seed, to_device
from data.dataset import ClipDataset, DatasetError

SAMPLE_WINDOWS = 2  # windows of frames the sample video generates
SAMPLE_STEPS = 20  # denoising steps per AR step for the sample video (chunked schedule)
SAMPLE_CLIPS = 2  # validation clips in the sample video (stacked vertically)
SAMPLE_MIN_PX = 128  # frames smaller than this are upscaled by a whole factor so the video is watchable


def write_side_by_side(path: str | os.PathLike, real: torch.Tensor, fake: torch.Tensor, fps: int = 8) -> Path:
    """mp4 with ground truth (left) beside generated (right), one row per clip; (B,T,C,H,W) in [-1, 1]."""
    scale = max(1, SAMPLE_MIN_PX // real.shape[-2])
    return write_video(path, side_by_side(real.cpu(), fake.cpu(), scale=scale), fps=fps)


class SampleVideo:
    """Writes RUN/samples/step_NNNNNNN.mp4; the validation clips are opened on the first call."""

    def __init__(self, cfg: Config, run_dir: Path, device: torch.device):
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.context = cfg.default_context()  # the frames the model remembers in training, as sample.py
        self.n_gen = SAMPLE_WINDOWS * cfg.train.window
        self._ds: ClipDataset | None = None
        self._opened = False

    def _dataset(self) -> ClipDataset | None:
        if not self._opened:
            self._opened = True
            try:
                self._ds = make_dataset(self.cfg, "validation", self.context + self.n_gen, random_start=False)
            except DatasetError as e:  # e.g. validation episodes shorter than context + 2 windows
                tqdm.write(f"note: sample videos skipped: {e}")
        return self._ds

    @torch.no_grad()
    def write(self, model: torch.nn.Module, diffusion: PerFrameDiffusion, step: int) -> Path | None:
        """Roll out `model` from the first frames of a few validation clips; the mp4's path (None: skipped)."""
        ds = self._dataset()
        if ds is None:
            return None
        ctx, w = self.context, self.cfg.train.window
        picks = [round(i * len(ds) / SAMPLE_CLIPS) for i in range(min(SAMPLE_CLIPS, len(ds)))]
        video, actions = to_device(collate([ds[i] for i in picks]), self.device)  # (B, ctx+n_gen, C, H, W)
        schedule = get_schedule("chunked", w, self.cfg.diffusion.num_levels, SAMPLE_STEPS,
                                context_level=self.cfg.diffusion.context_level)
        g = torch.Generator(device=self.device).manual_seed(mix_seed(self.cfg.train.seed, "sample"))
        items = [ds[i] for i in picks]
        poses = torch.stack([it["pose"] for it in items]).to(self.device) if "pose" in items[0] else None
        fake = rollout(model, diffusion, schedule, video[:, :ctx], actions[:, :ctx], actions[:, ctx:], self.n_gen,
                       eta=self.cfg.diffusion.eta, generator=g, progress=False, poses=poses)  # (B, n_gen, C, H, W)
        real = video[:, ctx:]  # (B, n_gen, C, H, W)
        path = self.run_dir / "samples" / f"step_{step:07d}.mp4"
        write_side_by_side(path, real, fake)
        tqdm.write(f"step {step}: sample video {path}")
        return path
