"""The look-around revisit test: does the model draw a place from memory when it comes back to it?

    python -m data.generate memory_maze --out datasets/look_around_seed7 --episodes 24 --length 112 --size 32 \\
        --seed 7 --policy look_around
    python -m arvdm.experiments.revisit_test --run runs/tiny --data datasets/look_around_seed7

Each look-around episode turns fully on the spot, walks out ~24 steps and back to the start, and turns fully
again (`data.policies`, the ranges in the episode's `turns` array). Everything before the second turn is the
context; the second turn is generated, and every one of its views was seen during the first turn. The same
weights roll it out with memory chosen by pose, by time (the frames just before the recent ones), taken from
another episode (`other`, by pose) and with no chosen frames (`none`), from the same noise; references:
copy-last (the last context frame) and the **oracle** (per generated frame, the best-matching frame of the
first turn: what a perfect memory could copy). Episodes are rolled out in pairs (the `other` mode takes memory
from the pair's other episode), both cut to the shorter context. Reported: mean PSNR over the second turn per
mode, paired differences with 95% episode-level bootstrap intervals, and the share of the oracle's gap over
copy-last that pose selection closes. Writes `revisit_test.json` into --out (default RUN/revisit_test/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from arvdm.config import SamplingError
from arvdm.errors import USER_ERRORS
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame
from arvdm.evaluation.probes import paired_difference, psnr_matrix
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import add_anchor_flags, use_anchor, with_anchor_runs
from arvdm.pipeline.rollout import episode_generators, rollout
from arvdm.pipeline.runs import load_for_inference
from arvdm.schedules.presets import get_schedule
from data.atomic import atomic_write_json
from data.dataset import resolve_split, to_float_video
from data.episodes import load_episode, read_turns

__all__ = ["look_around_test"]

MODES = ("pose", "time", "other", "none")


def _episodes(root: Path, n: int, size: int) -> list[dict[str, Any]]:
    """The first `n` look-around episodes: video (T, C, H, W) in [-1, 1], actions, poses, the two turns."""
    split = resolve_split(root, "training") if (root / "training").is_dir() or (root / "train").is_dir() else root
    out = []
    for path in sorted(split.glob("*.npz"))[:n]:
        turns = read_turns(path)
        if turns.shape[0] < 2:
            raise SamplingError(f"{path}: not a look-around episode (needs two turns in its 'turns' array; generate "
                                f"with --policy look_around)")
        ep = load_episode(path)
        if ep.pose is None:
            raise SamplingError(f"{path}: has no poses")
        video = to_float_video(torch.from_numpy(np.array(ep.video)).permute(0, 3, 1, 2))  # (T, C, H, W)
        if video.shape[-1] != size:
            raise SamplingError(f"{path}: frames are {video.shape[-1]} px, the run was trained at {size} px")
        out.append({"video": video, "actions": torch.as_tensor(np.asarray(ep.actions)).long(),
                    "pose": torch.as_tensor(np.asarray(ep.pose)).float(), "turns": turns, "path": str(path)})
    if len(out) < 2:
        raise SamplingError(f"{root}: needs at least 2 look-around episodes, found {len(out)}")
    return out[: len(out) // 2 * 2]


def _pair(a: dict, b: dict) -> tuple[torch.Tensor, ...]:
    """Both episodes aligned on the start of their second turn: (video, actions, poses) with C context frames
    (the shorter context) and N generated frames (the shorter second turn), and C, N, each first turn's range."""
    c = min(int(e["turns"][1][0]) for e in (a, b))
    n = min(int(e["turns"][1][1] - e["turns"][1][0]) for e in (a, b))
    cut = [(int(e["turns"][1][0]) - c, int(e["turns"][1][0]) + n) for e in (a, b)]
    stack = [torch.stack([e[key][lo:hi] for e, (lo, hi) in zip((a, b), cut)]) for key in ("video", "actions", "pose")]
    first = [(max(0, int(e["turns"][0][0]) - lo), max(0, int(e["turns"][0][1]) - lo))
             for e, (lo, _) in zip((a, b), cut)]
    return (*stack, c, n, first)


def look_around_test(run: str, data: str, episodes: int = 24, steps: int = 20, seed: int = 0,
                     device: str = "cpu", n_boot: int = 2000, anchor_sigma: float | None = None,
                     anchor_floor: int | None = None, anchor_runs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Roll out the second turn of look-around episodes under each memory mode; PSNR per episode and paired tests.
    ``anchor_sigma`` / ``anchor_floor``: the rollouts' low-frequency anchor (``rollout``'s, arvdm.pipeline.anchor);
    None = the run's (diffusion.anchor_sigma / anchor_floor), as sample.py; ``anchor_runs``: other runs whose
    level-K predictions are averaged into it (sample.py's --anchor-runs)."""
    model, cfg = load_for_inference(run, use_ema=True, device=torch.device(device))
    anchor = use_anchor(cfg, anchor_sigma, anchor_floor)  # the rollouts below read it from cfg.diffusion
    model = with_anchor_runs(model, anchor_runs, cfg.diffusion.anchor_sigma, device=torch.device(device), run=run)
    if cfg.memory.select != "pose":
        raise SamplingError(f"{run}: trained with memory.select={cfg.memory.select}; the revisit test compares memory "
                            f"choices of a pose-aware run (memory.select=pose)")
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, steps,
                            context_level=cfg.diffusion.context_level)  # the run's own k_ctx
    eps = _episodes(Path(data), episodes, cfg.model.image_size)
    per = {k: [] for k in (*MODES, "copy_last", "oracle")}
    for i in tqdm(range(0, len(eps), 2), desc="look-around pairs", unit="pair"):
        video, actions, poses, c, n, first = _pair(eps[i], eps[i + 1])
        real = video[:, c:c + n]  # (2, N, C, H, W): the second turn
        for mode in MODES:
            gen = rollout(model, diffusion, schedule, video[:, :c], actions[:, :c], actions[:, c:], n, poses=poses,
                          memory_select=mode, generator=episode_generators(seed, (i, i + 1)), progress=False)
            per[mode] += psnr_per_frame(gen.float(), real).clamp(max=PSNR_CAP).tolist()
        per["copy_last"] += psnr_per_frame(video[:, c - 1:c].expand_as(real), real).clamp(max=PSNR_CAP).tolist()
        for b in range(2):  # oracle: each generated frame's best match among the first turn's frames
            lo, hi = first[b]
            sim = psnr_matrix(torch.cat([real[b], video[b, lo:hi]]))[:n, n:]  # (N, first turn)
            per["oracle"].append(sim.max(dim=1).values.clamp(max=PSNR_CAP).tolist())
    return {**_summarise(per, n_boot, seed, run, data), **anchor, "anchor_runs": list(anchor_runs)}


def _summarise(per: dict[str, list[list[float]]], n_boot: int, seed: int, run: str, data: str) -> dict[str, Any]:
    """Episode means per mode, paired differences (frames pooled, episodes resampled) and the oracle gap closed."""
    frames = {k: np.concatenate([np.asarray(v, dtype=np.float64) for v in vals]) for k, vals in per.items()}
    events = np.concatenate([np.full(len(v), e) for e, v in enumerate(per["pose"])])
    means = {k: float(v.mean()) for k, v in frames.items()}
    pairs = {f"pose_minus_{k}": paired_difference(frames["pose"], frames[k], events, n_boot=n_boot, seed=seed)
             for k in ("time", "other", "none", "copy_last")}
    gap = means["oracle"] - means["copy_last"]
    closes = (means["pose"] - means["copy_last"]) / gap if gap > 0 else None
    return {"run": run, "data": data, "episodes": len(per["pose"]), "frames": int(len(events)),
            "psnr": means, "paired": pairs, "pose_closes_oracle_gap": closes,
            "per_episode": {k: [float(np.mean(v)) for v in vals] for k, vals in per.items()}}


def _line(result: dict[str, Any]) -> str:
    m, p = result["psnr"], result["paired"]
    parts = [f"{result['episodes']} episodes, {result['frames']} second-turn frames: PSNR " +
             ", ".join(f"{k} {v:.2f}" for k, v in m.items())]
    for k, d in p.items():
        parts.append(f"{k}: {d['mean']:+.2f} dB [95% {d['lo']:+.2f}, {d['hi']:+.2f}]")
    if result["pose_closes_oracle_gap"] is not None:
        parts.append(f"pose selection closes {result['pose_closes_oracle_gap']:.0%} of the oracle's gap over copy-last")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--data", required=True, help="a folder of look-around episodes (--policy look_around)")
    p.add_argument("--episodes", type=int, default=24)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    add_anchor_flags(p)
    args = p.parse_args(argv)
    try:
        result = look_around_test(args.run, args.data, args.episodes, args.steps, args.seed, args.device,
                                  anchor_sigma=args.anchor_sigma, anchor_floor=args.anchor_floor,
                                  anchor_runs=args.anchor_runs)
    except USER_ERRORS as err:
        print(f"revisit_test: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(args.run) / "revisit_test")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "revisit_test.json", result, indent=2)
    print(_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
