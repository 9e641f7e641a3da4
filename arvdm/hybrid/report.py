"""Hybrid attention's offline tools: lazy-ratio calibration, the report (heat map, fraction x selection
table, trade-off and Pareto plots) and the CLI (LightTransfer, arXiv 2410.13846; the model side is
arvdm.hybrid).

    python -m arvdm.hybrid calibrate --run RUN      # offline lazy ratios -> RUN/lazy_ratios.json
    python -m arvdm.hybrid report --run RUN         # heat map + fraction x selection table, plots

See docs/hybrid.md.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from arvdm.config import Config, ConfigError, HybridConfig, apply_overrides, parse_device
from arvdm.errors import USER_ERRORS
from arvdm.evaluation.evaluate import evaluate_rollout
from arvdm.evaluation.pareto import plot_pareto
from arvdm.evaluation.tables import write_results_table
from arvdm.hybrid.convert import HybridModel, convert_layers
from arvdm.hybrid.lazy import (
    RATIOS_NAME,
    HybridError,
    load_lazy_ratios,
    measuring,
    num_streaming,
    ratios_path,
    select_layers,
    temporal_layers,
)
from arvdm.model.checkpoint import run_folder
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes
from arvdm.schedules.presets import get_schedule
from data.atomic import atomic_write_json, atomic_write_text
from memory import MemoryFrames

__all__ = ["calibrate", "hybrid_settings", "main", "plot_heatmap", "plot_tradeoff", "run_calibration", "run_report",
           "selection_strategies"]

PLOT_DPI = 120


# ------------------------------------------------------------------------------------------------
# offline calibration
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def calibrate(model: Any, diffusion: Any, clips: torch.Tensor, actions: torch.Tensor, *, memory: int,
              levels: Sequence[int], hybrid: HybridConfig, seed: int = 0, progress: bool = True,
              poses: torch.Tensor | None = None) -> dict[str, Any]:
    """Lazy ratios per layer and denoising level over calibration clips (LightTransfer Eq. 1, offline).

    Each clip (T = memory + window frames) is split into ``memory`` clean frames, given as ``memory=``, and
    a window noised to one ``level`` for every frame; the meters read the window queries of the last
    ``hybrid.last_frames`` frames. ``poses`` (N, >= T, 3): the clips' camera poses, required by a pose-aware model
    (memory.select=pose), which reads the memory frames' poses and ages as in training. Returns the
    lazy_ratios.json content: per layer the mean and standard deviation over (clip, level) pairs and the mean per
    level.
    """
    layers = temporal_layers(model)
    n, t = clips.shape[:2]
    w = t - memory
    if w < 1:
        raise HybridError(f"calibration clips of {t} frames leave no window after {memory} memory frames")
    if memory + w - hybrid.last_frames <= hybrid.sink + hybrid.recent:
        raise HybridError(f"calibration sees {memory} memory + {w} window frames: with hybrid.last_frames="
                          f"{hybrid.last_frames} no query reaches past sink + recent = "
                          f"{hybrid.sink + hybrid.recent} frames, so every ratio would be 1; use more --memory")
    pose_aware = model.cfg.memory.select == "pose"
    if pose_aware and (poses is None or poses.shape[0] != n or poses.shape[1] < t):
        raise HybridError("a pose-aware model (memory.select=pose) is calibrated on clips with their poses: give "
                          f"poses (N, >= T, 3) = ({n}, >= {t}, 3) (episodes with a 'pose' array)")
    was_retention = [layer.retention for layer in layers]
    convert_layers(layers, [], sink=hybrid.sink, recent=hybrid.recent)
    gen = torch.Generator().manual_seed(seed)
    per = torch.full((len(layers), len(levels), n), float("nan"), dtype=torch.float64)  # (L, levels, clips)
    try:
        bar = tqdm(total=n * len(levels), desc="calibrate lazy ratios", disable=not progress, leave=False)
        with measuring(layers, sink=hybrid.sink, recent=hybrid.recent, last_frames=hybrid.last_frames) as meters:
            for c in range(n):
                x0 = clips[c:c + 1, memory:]  # (1, w, C, H, W)
                # as training gives a clip's memory; a pose-aware model reads the poses (the window's are its targets)
                mem = MemoryFrames.of_clip(clips[c:c + 1, :memory], actions[c:c + 1, :memory],
                                           poses[c:c + 1, :t].to(clips) if pose_aware else None) if memory else None
                noise = torch.randn(x0.shape, generator=gen).to(x0)
                for j, level in enumerate(levels):
                    lv = torch.full((1, w), int(level), dtype=torch.long, device=x0.device)  # (1, w)
                    x = diffusion.add_noise(x0, noise, lv) if level > 0 else x0
                    model(x, lv, actions[c:c + 1, memory:], memory=mem)
                    for i, m in enumerate(meters):  # the window call is each layer's last call
                        per[i, j, c] = m.last_call_ratio()
                        m.calls.clear()
                    bar.update()
        bar.close()
    finally:
        for layer, retention in zip(layers, was_retention):
            layer.retention = retention
    flat = per.reshape(len(layers), -1)  # (L, levels * clips)
    return {
        "format": "arvdm-lazy-ratios/1",
        "sink": hybrid.sink, "recent": hybrid.recent, "last_frames": hybrid.last_frames,
        "memory": memory, "window": w, "levels": [int(v) for v in levels], "clips": n,
        "ratios": flat.mean(1).tolist(),
        "layers": [{"layer": i, "mean": float(flat[i].mean()), "std": float(flat[i].std(unbiased=False)),
                    "min": float(flat[i].min()), "max": float(flat[i].max()),
                    "by_level": per[i].mean(1).tolist()} for i in range(len(layers))],
    }


def _load_run(run: str, device: str, use_ema: bool = True):
    dev = parse_device(device)
    model, cfg = load_for_inference(run, use_ema=use_ema, device=dev)
    return model, cfg, PerFrameDiffusion(cfg.diffusion), dev


def hybrid_settings(cfg: Config, overrides: Sequence[str] = ()) -> HybridConfig:
    """A copy of the run's ``cfg.hybrid`` with ``hybrid.KEY=VALUE`` overrides (the CLI's ``--set``), checked."""
    c = copy.deepcopy(cfg)
    sets = list(overrides or [])
    bad = [s for s in sets if not s.strip().startswith("hybrid.")]
    if bad:
        raise HybridError(f"--set takes hybrid.* keys only here, got {bad}")
    try:
        apply_overrides(c, sets)
        c.hybrid.validate()
    except ConfigError as e:
        raise HybridError(str(e)) from e
    return c.hybrid


def run_calibration(run: str, *, clips: int = 4, memory: int | None = None, levels: int = 5, data: str | None = None,
                    overrides: Sequence[str] = (), device: str = "auto", out: str | None = None,
                    progress: bool = True) -> Path:
    """Calibrate a run's model on validation clips and write ``lazy_ratios.json`` (atomically)."""
    model, cfg, diffusion, dev = _load_run(run, device)
    h = hybrid_settings(cfg, overrides)
    m = cfg.memory.length if memory is None else memory
    video, actions, poses = load_validation_episodes(data or cfg.data.path, cfg, clips, m, cfg.train.window)
    K = cfg.diffusion.num_levels
    lv = sorted({int(round(x)) for x in torch.linspace(0, K, levels).tolist()})
    result = calibrate(model, diffusion, video.to(dev), actions.to(dev), memory=m, levels=lv, hybrid=h,
                       progress=progress, poses=poses)
    result["run"] = str(run)
    path = Path(out) if out else run_folder(run) / RATIOS_NAME
    return atomic_write_json(path, result, indent=2)


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def plot_heatmap(ratios: dict[str, Any], path: str | os.PathLike) -> Path:
    """Heat map of lazy ratios, layers (rows) x denoising levels (columns)."""
    import matplotlib  # lazy: matplotlib is slow to import and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [layer["by_level"] for layer in ratios["layers"]]  # (L, levels)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(ratios["levels"]), 1.2 + 0.5 * len(grid)))
    im = ax.imshow(grid, vmin=min(min(r) for r in grid), vmax=1.0, cmap="viridis", aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):  # white numbers on the darker half of the row's colour range
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="w" if v < 0.5 * (1 + min(row)) else "k",
                    fontsize=8)
    ax.set_xticks(range(len(ratios["levels"])), [str(v) for v in ratios["levels"]])
    ax.set_yticks(range(len(grid)), [f"layer {i}" for i in range(len(grid))])
    ax.set_xlabel("denoising level of the window (0 = clean)")
    ax.set_title(f"lazy ratio (kept mass, sink {ratios['sink']} + recent {ratios['recent']} frames)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return Path(path)


def selection_strategies(ratios: Sequence[float], fraction: float, seed: int = 0) -> dict[str, list[int]]:
    """LightTransfer Fig. 7's comparison: lazy-ratio selection vs a random choice vs the last layers."""
    n, k = len(ratios), num_streaming(len(ratios), fraction)
    return {"lazy": select_layers(ratios, fraction),
            "random": sorted(random.Random(seed).sample(range(n), k)),
            "last": list(range(n - k, n))}


def _report_configs(ratios: Sequence[float], fractions: Sequence[float], seed: int) -> list[tuple[str, float, list]]:
    """(selection, fraction, layers): the base, then every selection strategy at each distinct layer count."""
    configs, counts = [("base", 0.0, [])], {0}
    for f in fractions:  # a shallow model maps several fractions to one layer count: keep the first
        if num_streaming(len(ratios), f) not in counts:
            counts.add(num_streaming(len(ratios), f))
            configs += [(name, f, layers) for name, layers in selection_strategies(ratios, f, seed).items()]
    return configs


def _measure(hm: HybridModel, diffusion: Any, sched: Any, real: torch.Tensor, actions: torch.Tensor, poses: Any,
             ctx: int, frames: int, seed: int, window: int, eta: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Roll out one configuration: (its table row without names, eval.json-style result)."""
    dev = actions.device
    t0 = time.perf_counter()
    fake = rollout(hm, diffusion, sched, real[:, :ctx].to(dev), actions[:, :ctx], actions[:, ctx:], frames, eta=eta,
                   generator=torch.Generator().manual_seed(seed), progress=False,
                   poses=_rollout_poses(hm.cfg, poses)).float().cpu()
    seconds = time.perf_counter() - t0
    ev = evaluate_rollout(fake, real, poses, ctx, window_reach=window)
    row = {"frames_per_s": real.shape[0] * frames / seconds, "kv_bytes": hm.last_state.nbytes(),
           "psnr_mean": ev["psnr_mean"], "ssim_mean": ev["ssim_mean"],
           "max_psnr_decay": ev["max_psnr_decay"], "retrieval_mean": ev.get("retrieval_mean")}
    for s_p, s_s in zip(ev["psnr_by_span"], ev["ssim_by_span"]):
        row[f"psnr {s_p['label']}"], row[f"ssim {s_s['label']}"] = s_p["mean"], s_s["mean"]
    return row, ev


def _rollout_poses(cfg: Config, poses: torch.Tensor | None) -> torch.Tensor | None:
    """The episodes' poses for a pose-aware model (it chooses its memory by them), None for any other."""
    if cfg.memory.select != "pose":
        return None
    if poses is None:
        raise HybridError("a pose-aware run (memory.select=pose) is rolled out with the episodes' poses: give --data "
                          "episodes with a 'pose' array")
    return poses


def _load_report_ratios(run: str, h: HybridConfig, overrides: Sequence[str], device: str, data: str | None,
                        progress: bool) -> tuple[Path, dict[str, Any]]:
    """The run's lazy_ratios.json (calibrated now when missing) and its content."""
    rpath = ratios_path(h, run)
    if not rpath.is_file():
        rpath = run_calibration(run, overrides=overrides, device=device, data=data, progress=progress)
    ratios = load_lazy_ratios(rpath)
    if (ratios["sink"], ratios["recent"]) != (h.sink, h.recent):
        print(f"note: {rpath} was measured with sink {ratios['sink']} + recent {ratios['recent']}, the report "
              f"streams sink {h.sink} + recent {h.recent}", file=sys.stderr)
    return rpath, ratios


def _relative_to_base(rows: Sequence[dict[str, Any]]) -> None:
    base = rows[0]
    for row in rows:
        row["kv_vs_base"] = row["kv_bytes"] / base["kv_bytes"] if base["kv_bytes"] else float("nan")
        row["speed_vs_base"] = row["frames_per_s"] / base["frames_per_s"]
        row["psnr_loss_db"] = base["psnr_mean"] - row["psnr_mean"]


@torch.no_grad()
def run_report(run: str, *, fractions: Sequence[float] = (0.0, 0.25, 0.5, 0.75), episodes: int = 2,
               frames: int = 48, context: int | None = None, steps: int = 10, schedule: str = "chunked",
               data: str | None = None, overrides: Sequence[str] = (), device: str = "auto",
               out: str | None = None, seed: int = 0, memory: int | None = None,
               pareto_with: str | None = None, progress: bool = True) -> dict[str, Path]:
    """Heat map, table and plots of hybrid attention for a run (see the module docstring).

    ``memory`` (default: the run's) makes the full layers and the bank keep the last ``memory`` frames.
    ``pareto_with``: an ``arvdm.experiments`` output folder (or its pareto.csv) whose points join the
    hybrid points on one Pareto plot. Rollouts sample with the run's ``diffusion.eta``.
    """
    model, cfg, diffusion, dev = _load_run(run, device)
    h = hybrid_settings(cfg, overrides)
    out_dir = Path(out) if out else run_folder(run) / "hybrid"
    out_dir.mkdir(parents=True, exist_ok=True)
    if memory is not None:
        for m in (model.cfg.memory, cfg.memory):
            m.retention, m.length = "last", memory
    rpath, ratios = _load_report_ratios(run, h, overrides, device, data, progress)
    paths = {"heatmap": plot_heatmap(ratios, out_dir / "lazy_ratios.png")}

    sched = get_schedule(schedule, cfg.train.window, cfg.diffusion.num_levels, steps)
    ctx = context if context is not None else cfg.default_context()
    real, actions, poses = load_validation_episodes(data or cfg.data.path, cfg, episodes, ctx, frames)
    actions, eta = actions.to(dev), cfg.diffusion.eta
    # one untimed warm-up rollout (of the first episode), so the first configuration's frames/s does not pay
    # for first calls
    warm_poses = _rollout_poses(cfg, poses)
    rollout(model, diffusion, sched, real[:1, :ctx].to(dev), actions[:1, :ctx], actions[:1, ctx:],
            min(frames, sched.delta), eta=eta, generator=torch.Generator().manual_seed(seed), progress=False,
            poses=None if warm_poses is None else warm_poses[:1])
    rows, points = [], []
    configs = _report_configs(ratios["ratios"], fractions, seed)
    for name, f, layers in tqdm(configs, desc="hybrid report", disable=not progress, leave=False):
        hm = HybridModel(model, dataclasses.replace(h, fraction=f, select="fixed", layers=layers), ratios)
        row, ev = _measure(hm, diffusion, sched, real, actions, poses, ctx, frames, seed, cfg.train.window, eta)
        rows.append({"selection": name, "fraction": f, "memory": cfg.memory.length,
                     "layers": " ".join(map(str, layers)) or "-", **row})
        points.append({"name": f"hybrid {name} {f:g}" if f else "base", "x": ev["max_psnr_decay"],
                       "y": ev.get("retrieval_mean")})
        hm.restore()
    _relative_to_base(rows)
    paths["table"] = write_results_table(rows, out_dir / "hybrid_report.csv", out_dir / "hybrid_report.md")[1]
    text = json.dumps({"run": str(run), "ratios_file": str(rpath), "sink": h.sink, "recent": h.recent,
                       "context": ctx, "frames": frames, "schedule": sched.name, "steps": steps,
                       "rows": rows}, indent=2, default=float)
    paths["json"] = atomic_write_text(out_dir / "hybrid_report.json", text)
    paths["pareto"] = out_dir / "pareto_hybrid.png"
    if pareto_with:
        points = _experiment_points(pareto_with) + points
    plot_pareto(points, paths["pareto"], csv_path=out_dir / "pareto_hybrid.csv",
                title="hybrid attention: error accumulation vs memory bottleneck")
    paths["tradeoff"] = plot_tradeoff(rows, out_dir / "hybrid_tradeoff.png")
    return paths


def _experiment_points(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Pareto points of an ``arvdm.experiments`` report (its pareto.csv)."""
    path = Path(path)
    path = path / "pareto.csv" if path.is_dir() else path
    if not path.is_file():
        raise HybridError(f"{path}: no pareto.csv (write one with `python -m arvdm.experiments report`)")

    def num(v):
        return float(v) if v not in ("", None) else None

    with open(path, newline="") as f:
        return [{"name": r["name"], "x": num(r["max_psnr_decay"]), "y": num(r["mean_retrieval_rate"])}
                for r in csv.DictReader(f)]


def plot_tradeoff(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """PSNR vs KV-cache bytes (left) and vs frames/s (right), one line per selection strategy."""
    import matplotlib  # lazy: matplotlib is slow to import and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    base = [r for r in rows if r["selection"] == "base"]
    for name, marker in (("lazy", "o"), ("random", "s"), ("last", "^")):
        sel = base + sorted((r for r in rows if r["selection"] == name), key=lambda r: r["fraction"])
        for ax, key in zip(axes, ("kv_vs_base", "speed_vs_base")):
            ax.plot([r[key] for r in sel], [r["psnr_mean"] for r in sel], marker=marker, label=name)
            for r in sel:
                ax.annotate(f"{r['fraction']:g}", (r[key], r["psnr_mean"]), fontsize=7)
    axes[0].set_xlabel("KV-cache bytes / base")
    axes[1].set_xlabel("frames/s / base")
    for ax in axes:
        ax.set_ylabel("mean PSNR (dB)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("hybrid attention: streaming fraction (labels) by selection")
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return Path(path)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arvdm.hybrid", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("calibrate", "offline lazy ratios on validation clips -> RUN/lazy_ratios.json"),
                        ("report", "heat map + fraction x selection table (frames/s, KV bytes, PSNR/SSIM)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--run", required=True, help="run folder written by train.py (or one checkpoint)")
        s.add_argument("--data", default=None, help="TECO-layout data folder (default: the run's)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="hybrid.KEY=VALUE",
                       help="hybrid setting, e.g. hybrid.sink=2 (repeatable)")
        s.add_argument("--device", default="auto")
        s.add_argument("--out", default=None)
    cal = sub.choices["calibrate"]
    cal.add_argument("--clips", type=int, default=4, help="validation clips (one per episode)")
    cal.add_argument("--memory", type=int, default=None, help="memory frames per clip (default memory.length)")
    cal.add_argument("--levels", type=int, default=5, help="denoising levels, evenly spaced over 0..K")
    rep = sub.choices["report"]
    rep.add_argument("--episodes", type=int, default=2)
    rep.add_argument("--frames", type=int, default=48)
    rep.add_argument("--context", type=int, default=None)
    rep.add_argument("--steps", type=int, default=10)
    rep.add_argument("--schedule", default="chunked")
    rep.add_argument("--memory", type=int, default=None, help="frames the full layers keep (default: the run's)")
    rep.add_argument("--pareto-with", default=None, metavar="EXPERIMENTS_OUT",
                     help="an arvdm.experiments output folder: its points join the hybrid Pareto plot")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "calibrate":
            path = run_calibration(args.run, clips=args.clips, memory=args.memory, levels=args.levels,
                                   data=args.data, overrides=args.overrides, device=args.device, out=args.out)
            data = load_lazy_ratios(path)
            print(f"wrote {path}")
            for layer in data["layers"]:
                print(f"layer {layer['layer']}: lazy ratio {layer['mean']:.4f} +- {layer['std']:.4f} "
                      f"(by level {', '.join(f'{v:.3f}' for v in layer['by_level'])})")
        else:
            paths = run_report(args.run, episodes=args.episodes, frames=args.frames, context=args.context,
                               steps=args.steps, schedule=args.schedule, data=args.data, overrides=args.overrides,
                               device=args.device, out=args.out, memory=args.memory,
                               pareto_with=args.pareto_with)
            for k, v in paths.items():
                print(f"{k}: {v}")
    except USER_ERRORS as err:  # user errors: run, data, settings
        print(f"python -m arvdm.hybrid: error: {err}", file=sys.stderr)
        return 2
    return 0
