"""Memory after drift: the ground-truth past up to k frames before each revisit, then the model's own k frames.

    python -m arvdm.experiments.memory_drift_test --run runs/tiny --data datasets/random_seed4 --episodes 32 \\
        --free 0,8,24 --stride 2

Teacher-forced (``memory_probe_test``) the model retrieves a remembered view; in free rollouts it may not. The two
differ in how long the model has run on its own before the revisit, and they score different probe sets. This test
holds everything else fixed and varies only that. For each memory probe frame t (``memory_probes``: an earlier
frame s beyond the last ``memory.length`` frames shows t's view, none of those recent frames does) and each k in
``--free``, the model rolls out from the ground truth [0, t - k) with the episode's own actions and poses, generates
frames t - k .. t (the chunked schedule, the run's eta and context level, exactly ``rollout``), and frame t is
scored against the truth, memory chosen by:

    pose   the run's own choice (memory.select=pose)
    time   the frames just before the recent ones
    none   only the recent frames

with the same noise in every mode and every k (one generator per probe, seeded by (seed, episode, t)). Only probes
whose matching frame s lies before t - max(k) are kept, so the remembered view is a true frame at every k and the
probe set is the same for every k: what changes with k is how many frames the model drew itself before t (k = 0: a
rollout's first frame after the true past, where a ``copy_gate=observed`` run gates). References: copy-last (the
true frame t - 1) and the oracle (the true frame s). Consecutive probe frames are one event; means and the paired
differences pose - time, pose - none, pose - copy-last and pose at k - pose at 0 come with 95% event-bootstrap
intervals. Writes ``memory_drift_test.json`` and ``memory_drift_test.png`` (PSNR of each mode against k) into --out
(default RUN/memory_drift_test/).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from arvdm.config import SamplingError
from arvdm.errors import USER_ERRORS
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame
from arvdm.evaluation.probes import MIN_EVENTS, format_interval, memory_probes, paired_difference, pooled_rate
from arvdm.experiments.memory_probe_test import keep_every, load_episodes, probe_seed
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import add_anchor_flags, use_anchor, with_anchor_runs
from arvdm.pipeline.rollout import rollout
from arvdm.pipeline.runs import load_for_inference
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.matrix import ARSchedule
from arvdm.schedules.presets import get_schedule
from data.atomic import atomic_write, atomic_write_json

__all__ = ["MODES", "DriftProbe", "drift_probes", "generate_after_drift", "main", "memory_drift_test",
           "parse_free", "run_memory_drift_test"]

MODES = ("pose", "time", "none")
COMPARED = ("time", "none", "copy_last")  # pose minus each


@dataclass(frozen=True)
class DriftProbe:
    """Probe frame ``t`` of episode ``e`` (an index into the loaded episodes), its matching earlier frame ``s``,
    in event ``event``."""

    e: int
    t: int
    s: int
    event: int


def parse_free(text: str) -> tuple[int, ...]:
    """``--free`` "0,8,24" -> (0, 8, 24): distinct integers >= 0, sorted."""
    try:
        values = sorted({int(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        raise SamplingError(f"--free {text!r}: give frame counts >= 0 separated by commas, e.g. 0,8,24") from None
    if not values or values[0] < 0:
        raise SamplingError(f"--free {text!r}: give frame counts >= 0 separated by commas, e.g. 0,8,24")
    return tuple(values)


def drift_probes(eps: list[dict[str, Any]], recent: int, max_free: int, stride: int = 1) -> list[DriftProbe]:
    """The memory probes of every episode whose matching frame s comes before t - max_free (so it is a true frame
    whatever k <= max_free) and whose true past t - max_free holds at least one frame; every ``stride``-th probe of
    each event kept (its first always). Event ids run over all episodes."""
    out: list[DriftProbe] = []
    for e, ep in enumerate(eps):
        first = out[-1].event + 1 if out else 0
        for p in memory_probes(ep["video"], ep["pose"], recent, first_event=first, b=e):
            if p.s < p.t - max_free and p.t - max_free >= 1:
                out.append(DriftProbe(e, p.t, p.s, p.event))
    return keep_every(out, stride)


@torch.no_grad()
def generate_after_drift(model, diffusion: PerFrameDiffusion, schedule: ARSchedule, eps: list[dict[str, Any]],
                         probes: list[DriftProbe], free: tuple[int, ...], modes: tuple[str, ...] = MODES,
                         seed: int = 0, progress: bool = True) -> dict[int, dict[str, torch.Tensor]]:
    """``{k: {mode: (P, C, H, W)}}``: frame t of every probe, rolled out from the ground truth [0, t - k) through
    the model's own frames t - k .. t - 1 (a batch-1 ``rollout`` to the end of t's window, the probe's own
    generator)."""
    shape = tuple(eps[0]["video"].shape[1:])
    out = {k: {m: torch.empty(len(probes), *shape) for m in modes} for k in free}
    bar = tqdm(total=len(probes) * len(free) * len(modes), desc="rollouts after drift", unit="rollout",
               disable=not progress)
    device, w = model.device, schedule.window
    for i, p in enumerate(probes):
        ep = eps[p.e]
        for k in free:
            c = p.t - k  # true frames before the model's own
            # to the end of frame t's window: its later frames' actions and poses (which choose its memory) are
            # the episode's, as in a long rollout; the schedule generates whole windows anyway
            n = min(-(-(k + 1) // w) * w, ep["video"].shape[0] - c)
            for mode in modes:
                gen = rollout(model, diffusion, schedule, ep["video"][None, :c].to(device),
                              ep["actions"][None, :c].to(device), ep["actions"][None, c:c + n].to(device), n,
                              generator=torch.Generator().manual_seed(probe_seed(seed, p.e, p.t)), progress=False,
                              poses=ep["pose"][None, :c + n].to(device), memory_select=mode)  # (1, n, C, H, W)
                out[k][mode][i] = gen[0, k].float().cpu()  # frame t
                bar.update(1)
    bar.close()
    return out


def _psnr(fake: torch.Tensor, real: torch.Tensor) -> np.ndarray:
    """(P,) capped PSNR of frames (P, C, H, W) against (P, C, H, W)."""
    return psnr_per_frame(fake[:, None], real[:, None]).clamp(max=PSNR_CAP)[:, 0].double().numpy()


def run_memory_drift_test(model, diffusion: PerFrameDiffusion, schedule: ARSchedule, eps: list[dict[str, Any]],
                          free: tuple[int, ...], stride: int = 1, seed: int = 0, n_boot: int = 2000,
                          progress: bool = True) -> dict[str, Any]:
    """The test on loaded episodes with a pose-aware model (module docstring). Raises SamplingError when the kept
    probes come in fewer than MIN_EVENTS events (checked before any rollout)."""
    recent = int(model.cfg.memory.length)
    probes = drift_probes(eps, recent, max(free), stride)
    events = [p.event for p in probes]
    if len(set(events)) < MIN_EVENTS:
        raise SamplingError(f"{len(probes)} memory probes in {len(set(events))} events whose remembered view lies "
                            f"more than {max(free)} frames back: fewer than {MIN_EVENTS} events (use more episodes, "
                            "or a smaller largest --free)")
    gen = generate_after_drift(model, diffusion, schedule, eps, probes, free, MODES, seed, progress)
    real = torch.stack([eps[p.e]["video"][p.t] for p in probes])  # (P, C, H, W)
    refs = {"copy_last": _psnr(torch.stack([eps[p.e]["video"][p.t - 1] for p in probes]), real),
            "oracle": _psnr(torch.stack([eps[p.e]["video"][p.s] for p in probes]), real)}
    scores = {k: {m: _psnr(gen[k][m], real) for m in MODES} for k in free}
    rows = []
    for k in free:
        sc = {**scores[k], **refs}
        row: dict[str, Any] = {
            "free": k, "psnr": {name: pooled_rate(v, events, n_boot, seed) for name, v in sc.items()},
            "paired": {f"pose_minus_{b}": paired_difference(sc["pose"], sc[b], events, n_boot, seed) for b in COMPARED}}
        row["paired"]["pose_minus_pose_at_0"] = paired_difference(sc["pose"], scores[free[0]]["pose"], events,
                                                                   n_boot, seed)
        row["memory_helps"] = all(row["paired"][f"pose_minus_{b}"]["lo"] > 0 for b in ("time", "none"))
        rows.append(row)
    per_probe = [{"episode": p.e, "path": eps[p.e]["path"], "t": p.t, "s": p.s, "event": p.event,
                  "psnr": {str(k): {m: float(scores[k][m][i]) for m in MODES} for k in free},
                  **{name: float(v[i]) for name, v in refs.items()}} for i, p in enumerate(probes)]
    return {"episodes": len(eps), "stride": stride, "recent": recent, "free": list(free), "probes": len(probes),
            "events": len(set(events)), "window": schedule.window, "steps": schedule.num_steps, "seed": seed,
            "context_level": schedule.context_level, "rows": rows, "verdict": _verdict(rows), "per_probe": per_probe}


def _verdict(rows: list[dict[str, Any]]) -> str:
    """Where memory chosen by pose is above time and none with 95% confidence, in words."""
    helps = [r["free"] for r in rows if r["memory_helps"]]
    fails = [r["free"] for r in rows if not r["memory_helps"]]
    if not fails:
        return f"memory by pose helps after every drift tested ({', '.join(map(str, helps))} frames)"
    if not helps:
        return f"memory by pose does NOT help after any drift tested ({', '.join(map(str, fails))} frames)"
    return (f"memory by pose helps after {', '.join(map(str, helps))} frames of the model's own and NOT after "
            f"{', '.join(map(str, fails))}")


def format_drift(result: dict[str, Any]) -> str:
    """The test as a few lines of text (what the CLI prints)."""
    lines = [f"{result['probes']} probes in {result['events']} events ({result['episodes']} episodes, stride "
             f"{result['stride']}); PSNR dB; copy-last {result['rows'][0]['psnr']['copy_last']['mean']:.2f}, oracle "
             f"{result['rows'][0]['psnr']['oracle']['mean']:.2f}",
             f"{'free k':>6}  {'pose':>6}  {'time':>6}  {'none':>6}  {'pose - time':<22}  {'pose - none':<22}  "
             f"{'pose - copy-last':<22}  pose - pose at k={result['free'][0]}"]
    for r in result["rows"]:
        p, d = r["psnr"], r["paired"]
        lines.append(f"{r['free']:>6}  {p['pose']['mean']:6.2f}  {p['time']['mean']:6.2f}  {p['none']['mean']:6.2f}  "
                     f"{format_interval(d['pose_minus_time']):<22}  {format_interval(d['pose_minus_none']):<22}  "
                     f"{format_interval(d['pose_minus_copy_last']):<22}  {format_interval(d['pose_minus_pose_at_0'])}")
    lines.append(result["verdict"])
    return "\n".join(lines)


def plot_drift(result: dict[str, Any], path: str | Path) -> Path:
    """PSNR of each memory mode against the frames the model drew itself before the revisit (95% intervals), with
    copy-last and the oracle as lines; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["free"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for mode, style in zip(MODES, ("o-", "s--", "^:")):
        mean = np.array([r["psnr"][mode]["mean"] for r in result["rows"]])
        lo = np.array([r["psnr"][mode]["lo"] for r in result["rows"]])
        hi = np.array([r["psnr"][mode]["hi"] for r in result["rows"]])
        ax.errorbar(ks, mean, yerr=[mean - lo, hi - mean], fmt=style, capsize=3, label=f"memory by {mode}")
    for ref, color, label in (("copy_last", "gray", "copy-last (the true frame t-1)"),
                              ("oracle", "black", "oracle (the true frame s)")):
        ax.axhline(result["rows"][0]["psnr"][ref]["mean"], color=color, lw=1, ls="-.", label=label)
    ax.set_xlabel("frames the model drew itself before the revisit (k)")
    ax.set_ylabel("PSNR of the revisit frame (dB)")
    ax.set_title(f"{result['probes']} revisit probes, {result['events']} events", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return path


def memory_drift_test(run: str, data: str, free: tuple[int, ...], episodes: int | None = None, stride: int = 1,
                      steps: int = SampleSettings.steps, seed: int = 0, device: str = "cpu", n_boot: int = 2000,
                      progress: bool = True, anchor_sigma: float | None = None,
                      anchor_floor: int | None = None, anchor_runs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a pose-aware run and its episodes, then ``run_memory_drift_test`` (module docstring); the rollouts'
    anchor is ``anchor_sigma`` / ``anchor_floor`` (None = the run's), averaged over ``anchor_runs`` too if any."""
    for flag, value in (("--stride", stride), ("--steps", steps), ("--episodes", episodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SamplingError(f"{flag} must be an integer >= 1, got {value!r}")
    model, cfg = load_for_inference(run, use_ema=True, device=torch.device(device))
    if cfg.memory.select != "pose":
        raise SamplingError(f"{run}: trained with memory.select={cfg.memory.select}; the memory drift test compares "
                            "memory choices of a pose-aware run (memory.select=pose)")
    anchor = use_anchor(cfg, anchor_sigma, anchor_floor)  # before the diffusion: its rollouts read it there
    model = with_anchor_runs(model, anchor_runs, cfg.diffusion.anchor_sigma, device=torch.device(device), run=run)
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, steps,
                            context_level=cfg.diffusion.context_level)  # as sample.py rolls out
    eps = load_episodes(data, episodes, cfg.model.image_size)
    result = run_memory_drift_test(model, diffusion, schedule, eps, free, stride, seed, n_boot, progress)
    return {"run": str(run), "data": str(data), **anchor, "anchor_runs": list(anchor_runs), **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.experiments.memory_drift_test",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a pose-aware run folder (memory.select=pose)")
    p.add_argument("--data", required=True, help="a folder of episodes with poses (its training split if any)")
    p.add_argument("--free", default="0,8,24", help="frames the model draws itself before each revisit, "
                                                    "comma-separated (default 0,8,24)")
    p.add_argument("--episodes", type=int, default=None, help="the first N episodes (default: all)")
    p.add_argument("--stride", type=int, default=1, help="keep every S-th probe of each event (default 1: all)")
    p.add_argument("--steps", type=int, default=SampleSettings.steps, help="denoising calls from K to 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="output folder (default RUN/memory_drift_test)")
    add_anchor_flags(p)
    args = p.parse_args(argv)
    try:
        result = memory_drift_test(args.run, args.data, parse_free(args.free), args.episodes, args.stride,
                                   args.steps, args.seed, args.device, anchor_sigma=args.anchor_sigma,
                                   anchor_floor=args.anchor_floor, anchor_runs=args.anchor_runs)
        out = Path(args.out or Path(args.run) / "memory_drift_test")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "memory_drift_test.json", result)
        plot_drift(result, out / "memory_drift_test.png")
    except USER_ERRORS as err:
        print(f"memory_drift_test: error: {err}", file=sys.stderr)
        return 2
    print(format_drift(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
