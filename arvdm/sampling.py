"""Long rollouts of a trained run against ground-truth episodes: videos, TECO-style arrays, metrics.

    from arvdm.sample_settings import SampleSettings
    from arvdm.sampling import sample_run
    paths = sample_run("runs/tiny", "runs/tiny/samples/chunked", SampleSettings(schedule="fifo", frames=120))

For each of the first ``episodes`` validation episodes: condition on ``context`` ground-truth frames, roll
out ``frames`` more with the episode's own actions under a Meta-ARVDM schedule, and write into ``out_dir``

- ``rollout.mp4``  ground truth (left) beside generated (right), one episode per row;
- ``rollout.png``  a filmstrip: for up to 4 episodes, ground truth above generated: the last context frame,
  8 consecutive generated frames, then 3 later ones;
- ``rollout.npz``  ``real`` and ``fake`` uint8 (N, T, H, W, 3), context included (the fake's context frames
  are the ground truth it was given), as TECO's evaluation scripts read them;
- ``metrics.csv``  per generated frame index (0 = first generated frame), mean over episodes: the model's
  PSNR and SSIM, the copy-last and context-mean baselines' (``psnr_copy_last``, ...) and the
  spatial-gradient ratio generated / real (``arvdm.evaluation.baselines``);
- ``eval.json``    with ``evaluate=True``: spans, max PSNR decay, revisit retrieval, baselines
  (see arvdm.evaluation.evaluate);
- ``speculation.json`` and ``speculation_arms.png`` with ``speculate``: per rollout the target rounds
  (sequential calls) and batched evaluations, rows per round, acceptance per noise level, the arms chosen
  over time, the regret against the best fixed arm (estimated from the observed rounds) and frames/s.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arvdm.config import FROZEN_DRAFT as FROZEN
from arvdm.config import Config, SamplingError, parse_device
from arvdm.evaluation.baselines import compare_with_baselines
from arvdm.evaluation.evaluate import evaluate_rollout, write_eval_json
from arvdm.evaluation.holdup import hold_up
from arvdm.evaluation.metrics import psnr_per_frame, ssim_per_frame, write_metrics_csv
from arvdm.evaluation.revisit_score import revisit_score
from arvdm.hybrid.convert import HybridModel, wrap_for_sampling
from arvdm.model.checkpoint import resolve_data_path
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import with_anchor_runs
from arvdm.pipeline.rollout import episode_generators, rollout
from arvdm.pipeline.rollout_model import RolloutModel
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes
from arvdm.pipeline.video import filmstrip, side_by_side, to_uint8, write_image, write_video
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.matrix import ARSchedule, check_context_level
from arvdm.schedules.presets import get_schedule
from arvdm.speculative.rows import (
    Speculation,
    SpeculativeRows,
    make_speculation,
    plot_arms,
    report_bin_width,
    speculation_report,
)
from data.atomic import atomic_write, atomic_write_text

__all__ = ["sample_run", "compile_for_sampling", "FILMSTRIP_EPISODES"]

FILMSTRIP_EPISODES = 4  # episodes (rows of ground truth over generated) in rollout.png
STRIP_CONSECUTIVE = 8  # filmstrip: consecutive generated frames after the last context frame
STRIP_LATER = 3  # filmstrip: frames spread over the rest of the rollout


def sample_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, settings: SampleSettings) -> dict[str, Any]:
    """Roll out a run's model on validation episodes; returns the paths written and summary numbers."""
    settings.validate()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SamplingError(f"--out {out}: exists and is not a folder")
    device = parse_device(settings.device)
    model, cfg = load_for_inference(run_dir, use_ema=settings.use_ema, device=device)
    settings = settings.with_run_defaults(cfg)  # the run's eta, k_ctx and anchor where a flag says "the run's"
    model, _ = wrap_for_sampling(model, cfg, run_dir, settings.hybrid)  # lazy layers stream when asked
    hybrid = model if isinstance(model, HybridModel) else None  # before compiling wraps it
    data_root = resolve_data_path(cfg, run_dir, settings.data)  # the run's data, found from any directory
    if settings.compile:
        model = compile_for_sampling(model)
    # the anchor from the run's members' and --anchor-runs' level-K predictions (arvdm.pipeline.anchor); the model
    # itself for a one-member run without --anchor-runs
    model = with_anchor_runs(model, settings.anchor_runs, settings.anchor_sigma, use_ema=settings.use_ema,
                             device=device, run=run_dir)
    if settings.context_level is not None:
        check_context_level(settings.context_level, cfg.diffusion.num_levels, "--context-level")
    schedule = get_schedule(settings.schedule, cfg.train.window, cfg.diffusion.num_levels, settings.steps,
                            context_level=settings.context_level)
    model.check_schedule(schedule.delta, schedule.window)
    context = _context_frames(settings, cfg)
    real, actions, poses = load_validation_episodes(data_root, cfg, settings.episodes,
                                                    context, settings.frames, split=settings.split)
    if real.shape[1] - context < 1:
        raise SamplingError(f"nothing to generate: episodes hold {real.shape[1]} frames and --context is {context}")

    gen, specs, reports = roll_out_episodes(model, cfg, schedule, real, actions, context, settings, device, poses)
    fake = torch.cat([real[:, :context], gen], dim=1)  # (N, T, C, H, W): context frames are the given truth
    out.mkdir(parents=True, exist_ok=True)
    paths = write_rollout_files(out, real, fake, context)
    cmp = compare_with_baselines(gen, real, context) if context >= 1 else None
    paths["metrics"], summary = write_metrics(out / "metrics.csv", gen, real, context, cmp)
    summary["schedule"] = schedule.name
    if cmp is not None:
        summary.update(first_frames=cmp["first_frames"], first_frames_minus=cmp["first_frames_minus"],
                       gradient_ratio_first16=cmp["gradient_ratio_first16"],
                       verdict=cmp["verdict"]["message"])
    if context >= 1:  # the frames only memory can supply (recent = the memory length: beyond any time window)
        summary["revisits"] = revisit_score(gen, real, context, recent=max(cfg.memory.length, 1), poses=poses)
        # first span below context-mean, gradient ratio by span; with poses frames 17-64 split by context views
        summary["hold_up"] = hold_up(gen, real, context, poses=poses)
        summary["memory_select"] = settings.memory_select or ("pose" if cfg.memory.select == "pose" else "time")
    if hybrid is not None:
        summary["hybrid"] = hybrid.summary()
    if specs:
        paths.update(write_speculation(out, settings, schedule, specs, reports))
        summary["speculation"] = [{k: v for k, v in rep.items() if not k.endswith("_trace") and k != "arm_per_round"}
                                  for rep in reports]
    if settings.evaluate:
        result = evaluate_rollout(fake, real, poses, context, window_reach=cfg.train.window, baselines=cmp)
        for key in ("revisits", "hold_up"):
            if key in summary:
                result[key] = summary[key]
        paths["eval"] = write_eval_json(out / "eval.json", result, extra={
            "run": str(run_dir), "settings": asdict(settings), "schedule": schedule.to_dict(),
            "config": cfg.to_dict(), **({"hybrid": summary["hybrid"]} if "hybrid" in summary else {})})
        summary["max_psnr_decay"] = result["max_psnr_decay"]
    return {"paths": {k: str(v) for k, v in paths.items()}, "summary": summary}


def roll_out_episodes(model: RolloutModel, cfg: Config, schedule: ARSchedule, real: torch.Tensor,
                      actions: torch.Tensor, context: int, settings: SampleSettings, device: torch.device,
                      poses: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, list[Speculation], list[dict[str, Any]]]:
    """Roll out every episode in batches from its first ``context`` frames with its own actions (one generator per
    episode, seeded by (``settings.seed``, episode index): an episode's rollout does not depend on the batch size).
    Returns the generated frames (N, n_gen, C, H, W)
    float on the CPU and, with ``settings.speculate``, each batch's :class:`Speculation` and report. ``poses``
    (N, T, 3) go to pose-aware models, which choose memory by them (``settings.memory_select``)."""
    if cfg.memory.select == "pose" and poses is None:
        raise SamplingError("this run chooses memory by camera pose (memory.select=pose), but the episodes have no "
                            "'pose' array: give --data episodes with poses")
    n_gen = real.shape[1] - context
    diffusion = PerFrameDiffusion(cfg.diffusion)
    draft_model = _load_draft(settings, cfg, schedule, device) if settings.speculate else None
    fakes, specs, reports = [], [], []
    for i in range(0, real.shape[0], settings.batch_size):
        r, a = real[i:i + settings.batch_size].to(device), actions[i:i + settings.batch_size].to(device)
        spec = _speculation(settings, draft_model, seed=settings.seed + i, previous=specs[-1] if specs else None)
        t0 = time.perf_counter()
        p = poses[i:i + settings.batch_size].to(device) if poses is not None else None
        gen = rollout(model, diffusion, schedule, r[:, :context], a[:, :context], a[:, context:], n_gen,
                      eta=settings.eta, generator=episode_generators(settings.seed, range(i, i + r.shape[0])),
                      use_cache=settings.use_cache,
                      progress=settings.progress, rows=None if spec is None else SpeculativeRows(spec),
                      poses=p if cfg.memory.select == "pose" else None,
                      memory_select=settings.memory_select,
                      history_guidance=settings.history_guidance, action_guidance=settings.action_guidance,
                      candidates=settings.candidates, anchor_sigma=settings.anchor_sigma,
                      anchor_floor=settings.anchor_floor)  # (b, n_gen, C, H, W)
        if spec is not None:
            specs.append(spec)
            reports.append(speculation_report(spec, time.perf_counter() - t0, gen.shape[0] * n_gen,
                                              level_bin=report_bin_width(cfg.diffusion.num_levels)))
        fakes.append(gen.float().cpu())
    return torch.cat(fakes), specs, reports  # (N, n_gen, C, H, W)


def write_rollout_files(out: Path, real: torch.Tensor, fake: torch.Tensor, context: int) -> dict[str, Path]:
    """rollout.mp4 (side by side), rollout.png (filmstrip) and rollout.npz (uint8 ``real``, ``fake``) of
    (N, T, C, H, W) ground truth and generated videos, context included."""
    strip = filmstrip(real[:FILMSTRIP_EPISODES], fake[:FILMSTRIP_EPISODES], indices=_strip_frames(context,
                                                                                                  fake.shape[1]))
    return {"video": write_video(out / "rollout.mp4", side_by_side(real, fake)),
            "filmstrip": write_image(out / "rollout.png", strip),
            "arrays": _write_npz(out / "rollout.npz", real=to_uint8(real), fake=to_uint8(fake))}


def write_metrics(path: Path, gen: torch.Tensor, real: torch.Tensor, context: int,
                  cmp: dict[str, Any] | None) -> tuple[Path, dict[str, Any]]:
    """metrics.csv: per generated frame the model's PSNR / SSIM, the baselines' (from ``cmp``, a
    ``compare_with_baselines`` result or None) and the gradient ratio. Returns the path and the summary's
    first numbers (means, frames, context, episodes)."""
    target = real[:, context:]  # (N, n_gen, C, H, W)
    psnr, ssim = psnr_per_frame(gen, target), ssim_per_frame(gen, target)  # (N, n_gen) each
    extra: dict[str, torch.Tensor] = {}
    if cmp is not None:  # sharpness per frame (generated / real over all episodes)
        extra["gradient_ratio"] = torch.tensor(cmp["gradient_ratio_curve"])  # (n_gen,)
    for kind, curves in (cmp or {}).get("baselines", {}).items():  # the trivial predictors, frame by frame
        extra[f"psnr_{kind}"] = torch.tensor(curves["psnr_curve"])  # (n_gen,) mean over episodes
        extra[f"ssim_{kind}"] = torch.tensor(curves["ssim_curve"])
    summary = {"psnr_mean": float(psnr[torch.isfinite(psnr)].mean()), "ssim_mean": float(ssim.mean()),
               "frames": gen.shape[1], "context": context, "episodes": real.shape[0]}
    return write_metrics_csv(path, psnr, ssim, extra=extra), summary


def write_speculation(out: Path, settings: SampleSettings, schedule: ARSchedule, specs: list[Speculation],
                      reports: list[dict[str, Any]]) -> dict[str, Path]:
    """speculation.json (every rollout's report) and speculation_arms.png (the arms over the rounds)."""
    text = json.dumps({"settings": asdict(settings), "schedule": schedule.name, "rollouts": reports}, indent=1)
    return {"speculation": atomic_write_text(out / "speculation.json", text + "\n"),
            "speculation_arms": plot_arms({settings.speculate: specs}, out / "speculation_arms.png",
                                          f"{settings.speculate}, draft {Path(settings.draft).name}, "
                                          f"{schedule.name}, eta {settings.eta}")}


def compile_for_sampling(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` the denoiser's forward for rollouts; ``init_state``/``commit`` stay eager.

    The returned module forwards attribute access to the model, so ``pipeline.rollout`` takes it as is.
    Window shapes are static per schedule (every call has (B, w) levels); the memory / KV-cache length
    grows until the retention policy caps it, and dynamo's automatic dynamic shapes mark it dynamic after
    its first change, so a rollout compiles a handful of graphs, not one per frame.
    """
    return torch.compile(model)


def _context_frames(settings: SampleSettings, cfg: Config) -> int:
    """``--context`` or the run's default, checked to be whole chunks of the checkpoint."""
    c = cfg.model.frames_per_chunk
    context = settings.context if settings.context is not None else cfg.default_context()
    if context < 0 or context % c:
        raise SamplingError(f"--context {context} must be a non-negative multiple of the checkpoint's "
                            f"frames_per_chunk={c}")
    return context


def _speculation(settings: SampleSettings, draft_model: Any, seed: int,
                 previous: Speculation | None) -> Speculation | None:
    """One rollout's :class:`Speculation` (None without ``--speculate``); one policy learns over all the
    rollouts (``previous``'s), each rollout keeps its own record."""
    if not settings.speculate:
        return None
    drafts = {FROZEN: None} if draft_model is None else {Path(settings.draft).name: draft_model}
    spec = make_speculation(settings.speculate, settings.lookaheads, drafts, seed=seed,
                            level_bins=settings.level_bins)
    if previous is not None:
        spec.policy = previous.policy
    return spec


def _load_draft(settings: SampleSettings, cfg: Config, schedule: ARSchedule, device: torch.device) -> Any:
    """The draft network for ``--draft RUN`` (None for the frozen draft), checked against the target."""
    if settings.eta <= 0:
        raise SamplingError("--speculate needs --eta > 0: with eta = 0 every denoising transition is deterministic, "
                            "a drafted row is accepted only if it equals the target's bit for bit, so speculation "
                            "would save nothing (use e.g. --eta 1)")
    if settings.draft == FROZEN:
        return None
    draft, dcfg = load_for_inference(settings.draft, use_ema=settings.use_ema, device=device)
    for name, a, b in (("model.image_size", dcfg.model.image_size, cfg.model.image_size),
                       ("model.num_actions", dcfg.model.num_actions, cfg.model.num_actions),
                       ("diffusion.num_levels", dcfg.diffusion.num_levels, cfg.diffusion.num_levels)):
        if a != b:
            raise SamplingError(f"--draft {settings.draft}: its {name}={a} differs from the target's {b}")
    draft.check_schedule(schedule.delta, schedule.window)
    return draft


def _strip_frames(context: int, total: int) -> list[int]:
    """Filmstrip columns: the last context frame, 8 consecutive generated frames (does the view move with
    the actions?), then 3 frames spread over the rest of the rollout (does it hold up?)."""
    first = list(range(max(context - 1, 0), min(context + STRIP_CONSECUTIVE, total)))
    rest = (np.linspace(first[-1], total - 1, STRIP_LATER + 1).round().astype(int)[1:].tolist()
            if total - 1 > first[-1] else [])
    return first + rest


def _write_npz(path: Path, **arrays: np.ndarray) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to the temp name
            np.savez_compressed(f, **arrays)

    atomic_write(path, write)
    return path
