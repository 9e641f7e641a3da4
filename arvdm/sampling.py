"""Long rollouts of a trained run against ground-truth episodes: videos, TECO-style arrays, metrics.

    from arvdm.sampling import SampleSettings, sample_run
    paths = sample_run("runs/tiny", "runs/tiny/samples/chunked", SampleSettings(schedule="fifo", frames=120))

For each of the first ``episodes`` validation episodes: condition on ``context`` ground-truth frames, roll
out ``frames`` more with the episode's own actions under a Meta-ARVDM schedule, and write into ``out_dir``

- ``rollout.mp4``  ground truth (left) beside generated (right), one episode per row;
- ``rollout.png``  a filmstrip: for up to 4 episodes, ground truth above generated, 10 frames over time;
- ``rollout.npz``  ``real`` and ``fake`` uint8 (N, T, H, W, 3), context included (the fake's context frames
  are the ground truth it was given), as TECO's evaluation scripts read them;
- ``metrics.csv``  PSNR and SSIM per generated frame index (0 = first generated frame), mean over episodes;
- ``eval.json``    with ``evaluate=True``: spans, max PSNR decay, revisit retrieval (see arvdm.metrics).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.episodes import atomic_write

from .checkpoint import load_for_inference
from .diffusion import PerFrameDiffusion
from .metrics import evaluate_rollout, psnr_per_frame, ssim_per_frame, write_eval_json, write_metrics_csv
from .pipeline import rollout
from .schedules import get_schedule
from .video import filmstrip, side_by_side, to_uint8, write_image, write_video


class SamplingError(ValueError):
    """The run, the data or the settings cannot produce the requested rollout."""


@dataclass
class SampleSettings:
    frames: int | None = None  # frames to generate; None = all the episodes hold after the context
    schedule: str = "chunked"  # chunked | fifo | pyramid | path to a schedule file
    steps: int = 20  # denoising calls each frame takes from K to 0 (the presets compare at equal steps)
    context: int | None = None  # ground-truth frames to condition on; None = max(memory length, 1 chunk)
    episodes: int = 4
    batch_size: int = 4
    eta: float = 0.0  # 0 = DDIM, 1 = DDPM-like
    seed: int = 0
    use_cache: bool = True  # False = recompute the memory at every denoising call (Diffusion Forcing)
    evaluate: bool = False
    data: str | None = None  # TECO-layout folder; None = the run's own cfg.data.path
    use_ema: bool = True
    device: str = "auto"
    progress: bool = True
    compile: bool = False  # torch.compile the denoiser's forward (the KV-cache length is marked dynamic)


def sample_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, settings: SampleSettings) -> dict[str, Any]:
    """Roll out a run's model on validation episodes; returns the paths written and summary numbers."""
    device = torch.device("cuda" if settings.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if settings.device == "auto" else settings.device))
    model, cfg = load_for_inference(run_dir, use_ema=settings.use_ema, device=device)
    if settings.compile:
        model = compile_for_sampling(model)
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule(settings.schedule, cfg.train.window, cfg.diffusion.num_levels, settings.steps)
    model.check_schedule(schedule.delta, schedule.window)

    c = cfg.model.frames_per_chunk
    context = settings.context if settings.context is not None else max(cfg.memory.length, c)
    if context < 0 or context % c:
        raise SamplingError(f"--context {context} must be a non-negative multiple of the checkpoint's "
                            f"frames_per_chunk={c}")
    real, actions, poses = load_validation_episodes(settings.data or cfg.data.path, cfg, settings.episodes,
                                                    context, settings.frames)
    n_gen = real.shape[1] - context
    if n_gen < 1:
        raise SamplingError(f"nothing to generate: episodes hold {real.shape[1]} frames and --context is {context}")

    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    fakes = []
    for i in range(0, real.shape[0], settings.batch_size):
        r, a = real[i:i + settings.batch_size].to(device), actions[i:i + settings.batch_size].to(device)
        gen = rollout(model, diffusion, schedule, r[:, :context], a[:, :context], a[:, context:], n_gen,
                      eta=settings.eta, generator=generator, use_cache=settings.use_cache,
                      progress=settings.progress)  # (b, n_gen, C, H, W)
        fakes.append(gen.float().cpu())
    gen = torch.cat(fakes)  # (N, n_gen, C, H, W)
    fake = torch.cat([real[:, :context], gen], dim=1)  # (N, T, C, H, W): context frames are the given truth

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "video": write_video(out / "rollout.mp4", side_by_side(real, fake)),
        "filmstrip": write_image(out / "rollout.png", filmstrip(real[:4], fake[:4])),
        "arrays": _write_npz(out / "rollout.npz", real=to_uint8(real), fake=to_uint8(fake)),
    }
    psnr = psnr_per_frame(gen, real[:, context:])  # (N, n_gen)
    ssim = ssim_per_frame(gen, real[:, context:])  # (N, n_gen)
    paths["metrics"] = write_metrics_csv(out / "metrics.csv", psnr, ssim)
    summary: dict[str, Any] = {"psnr_mean": float(psnr[torch.isfinite(psnr)].mean()),
                               "ssim_mean": float(ssim.mean()), "frames": n_gen, "context": context,
                               "episodes": real.shape[0], "schedule": schedule.name}
    if settings.evaluate:
        result = evaluate_rollout(fake, real, poses, context, window_reach=cfg.train.window)
        paths["eval"] = write_eval_json(out / "eval.json", result, extra={
            "run": str(run_dir), "settings": asdict(settings), "schedule": schedule.to_dict(),
            "config": cfg.to_dict()})
        summary["max_psnr_decay"] = result["max_psnr_decay"]
    return {"paths": {k: str(v) for k, v in paths.items()}, "summary": summary}


def compile_for_sampling(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` the denoiser's forward for rollouts; ``init_state``/``commit`` stay eager.

    The returned module forwards attribute access to the model, so ``pipeline.rollout`` takes it as is.
    Window shapes are static per schedule (every call has (B, w) levels); the memory / KV-cache length
    grows until the retention policy caps it, and dynamo's automatic dynamic shapes mark it dynamic after
    its first change, so a rollout compiles a handful of graphs, not one per frame.
    """
    return torch.compile(model)


def load_validation_episodes(root: str | os.PathLike, cfg, n_episodes: int, context: int,
                             frames: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first `n_episodes` validation episodes from frame 0, at the run's resolution.

    Returns video (N, T, C, H, W) in [-1, 1], actions (N, T) int64 and pose (N, T, 3) or None, with
    T = context + frames (frames=None: the longest T every chosen episode holds).
    """
    from data.dataset import ClipDataset, resolve_split

    split = resolve_split(root, "validation")
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


def _write_npz(path: Path, **arrays: np.ndarray) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to the temp name
            np.savez_compressed(f, **arrays)

    atomic_write(path, write)
    return path
