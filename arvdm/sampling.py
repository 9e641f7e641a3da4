"""Long rollouts of a trained run against ground-truth episodes: videos, TECO-style arrays, metrics.

    from arvdm.sampling import SampleSettings, sample_run
    paths = sample_run("runs/tiny", "runs/tiny/samples/chunked", SampleSettings(schedule="fifo", frames=120))

For each of the first ``episodes`` validation episodes: condition on ``context`` ground-truth frames, roll
out ``frames`` more with the episode's own actions under a Meta-ARVDM schedule, and write into ``out_dir``

- ``rollout.mp4``  ground truth (left) beside generated (right), one episode per row;
- ``rollout.png``  a filmstrip: for up to 4 episodes, ground truth above generated, 10 frames over time;
- ``rollout.npz``  ``real`` and ``fake`` uint8 (N, T, H, W, 3), context included (the fake's context frames
  are the ground truth it was given), as TECO's evaluation scripts read them;
- ``metrics.csv``  per generated frame index (0 = first generated frame), mean over episodes: the model's
  PSNR and SSIM, the copy-last and context-mean baselines' (``psnr_copy_last``, ...) and the
  spatial-gradient ratio generated / real (``arvdm.baselines``);
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

from .baselines import BASELINES, baseline_frames, compare_with_baselines
from .checkpoint import parse_device, resolve_data_path
from .diffusion import PerFrameDiffusion
from .evaluate import evaluate_rollout, write_eval_json
from .hybrid import HybridModel, wrap_for_sampling
from .metrics import psnr_per_frame, spatial_gradient_per_frame, ssim_per_frame, write_metrics_csv
from .pipeline import rollout
from .runs import SamplingError, load_for_inference, load_validation_episodes
from .schedules import get_schedule
from .video import filmstrip, side_by_side, to_uint8, write_image, write_video


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
    split: str = "validation"  # which split of the data folder to roll out (validation | training)
    use_ema: bool = True
    device: str = "auto"
    progress: bool = True
    hybrid: dict[str, Any] | None = None  # hybrid-attention overrides, e.g. {"fraction": 0.5} (arvdm.hybrid)

    def validate(self) -> SampleSettings:
        """Check every setting before any work starts; errors name the sample.py flag."""
        from .schedules import PRESETS

        for flag, value, lo in (("--frames", self.frames, 1), ("--steps", self.steps, 1),
                                ("--context", self.context, 0), ("--episodes", self.episodes, 1),
                                ("--batch-size", self.batch_size, 1), ("--seed", self.seed, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
                raise SamplingError(f"{flag} must be an integer >= {lo}, got {value!r}")
        if not 0.0 <= float(self.eta) <= 1.0:  # also refuses NaN
            raise SamplingError(f"--eta must be in [0, 1] (0 = DDIM, 1 = DDPM-like), got {self.eta!r}")
        if str(self.schedule) not in PRESETS and not Path(self.schedule).is_file():
            raise SamplingError(f"--schedule {self.schedule}: unknown schedule, not a preset "
                                f"({', '.join(PRESETS)}) and no such file")
        if self.data is not None and not Path(self.data).is_dir():
            raise SamplingError(f"--data {self.data}: folder does not exist")
        parse_device(self.device)
        return self


def sample_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, settings: SampleSettings) -> dict[str, Any]:
    """Roll out a run's model on validation episodes; returns the paths written and summary numbers."""
    settings.validate()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SamplingError(f"--out {out}: exists and is not a folder")
    device = parse_device(settings.device)
    model, cfg = load_for_inference(run_dir, use_ema=settings.use_ema, device=device)
    model, _ = wrap_for_sampling(model, cfg, run_dir, settings.hybrid)  # lazy layers stream when asked
    data_root = resolve_data_path(cfg, run_dir, settings.data)  # the run's data, found from any directory
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule(settings.schedule, cfg.train.window, cfg.diffusion.num_levels, settings.steps)
    model.check_schedule(schedule.delta, schedule.window)

    c = cfg.model.frames_per_chunk
    context = settings.context if settings.context is not None else max(cfg.memory.length, c)
    if context < 0 or context % c:
        raise SamplingError(f"--context {context} must be a non-negative multiple of the checkpoint's "
                            f"frames_per_chunk={c}")
    real, actions, poses = load_validation_episodes(data_root, cfg, settings.episodes,
                                                    context, settings.frames, split=settings.split)
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

    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "video": write_video(out / "rollout.mp4", side_by_side(real, fake)),
        "filmstrip": write_image(out / "rollout.png", filmstrip(real[:4], fake[:4])),
        "arrays": _write_npz(out / "rollout.npz", real=to_uint8(real), fake=to_uint8(fake)),
    }
    target = real[:, context:]  # (N, n_gen, C, H, W)
    psnr, ssim = psnr_per_frame(gen, target), ssim_per_frame(gen, target)  # (N, n_gen) each
    extra = {"gradient_ratio": spatial_gradient_per_frame(gen) / spatial_gradient_per_frame(target).clamp(min=1e-12)}
    if context >= 1:  # the trivial predictors, frame by frame, beside the model
        for kind in BASELINES:
            pred = baseline_frames(real, context, n_gen, kind)
            extra[f"psnr_{kind}"], extra[f"ssim_{kind}"] = psnr_per_frame(pred, target), ssim_per_frame(pred, target)
    paths["metrics"] = write_metrics_csv(out / "metrics.csv", psnr, ssim, extra=extra)
    summary: dict[str, Any] = {"psnr_mean": float(psnr[torch.isfinite(psnr)].mean()),
                               "ssim_mean": float(ssim.mean()), "frames": n_gen, "context": context,
                               "episodes": real.shape[0], "schedule": schedule.name}
    if context >= 1:
        cmp = compare_with_baselines(gen, real, context)
        summary.update(first_frames=cmp["first_frames"], gradient_ratio_first16=cmp["gradient_ratio_first16"],
                       verdict=cmp["verdict"]["message"])
    if isinstance(model, HybridModel):
        summary["hybrid"] = model.summary()
    if settings.evaluate:
        result = evaluate_rollout(fake, real, poses, context, window_reach=cfg.train.window)
        paths["eval"] = write_eval_json(out / "eval.json", result, extra={
            "run": str(run_dir), "settings": asdict(settings), "schedule": schedule.to_dict(),
            "config": cfg.to_dict(), **({"hybrid": summary["hybrid"]} if "hybrid" in summary else {})})
        summary["max_psnr_decay"] = result["max_psnr_decay"]
    return {"paths": {k: str(v) for k, v in paths.items()}, "summary": summary}


def _write_npz(path: Path, **arrays: np.ndarray) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to the temp name
            np.savez_compressed(f, **arrays)

    atomic_write(path, write)
    return path
