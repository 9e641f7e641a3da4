"""The action test: does a rollout follow the actions it is given, and is its error drift or uncertainty?

    python -m arvdm.experiments.action_test --run runs/tiny --data datasets/random_seed4

From the same true context, every episode is rolled out three times (chunked schedule, the run's k_ctx):

* ``own``   with its own actions and noise seed s,
* ``noise`` with its own actions and another noise seed (s + 1),
* ``other`` with another episode's actions (the set's actions shifted by one episode) and noise seed s.

A pose-aware run keeps choosing memory by the episode's own poses in all three, so ``other`` changes the actions
only, with the memory choice held: the test isolates what the actions do.

The **direction check** (``--swap 2:3,4:5``, Memory Maze's left and right turns) adds a fourth rollout,
``swapped``: the episode's own actions with each named pair exchanged after the context, noise seed s. Own −
swapped is what knowing the direction buys: a model that only knows *that* the agent turns, not which way, scores
the same on both. (The poses are the episode's own in every rollout: a pose-aware run's pose tags still say the
true motion, so a model that read motion from them would pass this check without using its actions.)

Per span of generated frames (first 4, 5-16, 17-64, 65-120, as far as the rollout reaches), PSNR against the
truth of ``own`` and ``other`` with their paired difference (what the true actions buy; 95% episode-bootstrap
interval), and two agreements between rollouts: ``own`` vs ``noise`` (how far the noise alone moves a rollout) and
``own`` vs ``other`` (how far the actions move it). A model that follows its actions has its rollouts moved more
by the actions than by the noise, and the true actions buy PSNR. The **self-agreement gap**, PSNR(own, noise)
minus PSNR(own, truth), reads the error: two samples of a calibrated model are as far from each other as from the
truth (gap ~ 0: what is left is uncertainty, which no sampler setting removes); a gap > 0 means the samples agree
on something the truth does not do (drift, a systematic error). Writes ``action_test.json`` into --out (default
RUN/action_test/).
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
from arvdm.evaluation.probes import paired_difference
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import add_anchor_flags, use_anchor, with_anchor_runs
from arvdm.pipeline.rollout import episode_generators, rollout
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes
from arvdm.schedules.presets import get_schedule
from data.atomic import atomic_write_json

__all__ = ["action_test", "parse_swap", "run_action_test", "summarise"]

SPANS = ((0, 4), (4, 16), (16, 64), (64, 120))  # generated frames [a, b): first 4, 5-16, 17-64, 65-120


def parse_swap(text: str, num_actions: int) -> dict[int, int]:
    """``"2:3,4:5"`` -> {2: 3, 3: 2, 4: 5, 5: 4}: pairs of action ids exchanged by the direction check."""
    swap: dict[int, int] = {}
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise SamplingError(f"--swap {text!r}: expected pairs of action ids like 2:3,4:5, got {part!r}") from None
        if not (0 <= a < num_actions and 0 <= b < num_actions) or a == b or a in swap or b in swap:
            raise SamplingError(f"--swap {text!r}: {part!r} must pair two different action ids in 0..{num_actions - 1}"
                                f", each named once")
        swap[a], swap[b] = b, a
    return swap


def _psnr(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """(N, T) per-frame PSNR of (N, T, C, H, W) videos, capped at PSNR_CAP (identical frames are not infinite)."""
    return psnr_per_frame(a.float(), b.float()).clamp(max=PSNR_CAP).double().numpy()


def run_action_test(model: Any, cfg: Any, real: torch.Tensor, actions: torch.Tensor, context: int,
                    poses: torch.Tensor | None = None, steps: int = 20, seed: int = 0, batch_size: int = 8,
                    progress: bool = True, swap: dict[int, int] | None = None,
                    action_guidance: float = 0.0) -> dict[str, torch.Tensor]:
    """The three rollouts of every episode of ``real`` (N, T, C, H, W) with ``actions`` (N, T) after its first
    ``context`` frames: {"own", "noise", "other"} -> (N, T - context, C, H, W), plus "real" (the truth's part);
    with ``swap`` (``parse_swap``) a fourth, "swapped": own actions with the pairs exchanged, own noise.
    ``action_guidance`` W: every rollout guided along its actions (``rollout(action_guidance=W)``)."""
    n, t = actions.shape
    if n < 2:
        raise SamplingError(f"the action test needs at least 2 episodes (one lends its actions to another), got {n}")
    if not 1 <= context < t:
        raise SamplingError(f"--context {context}: must be >= 1 and leave frames to generate (episodes hold {t})")
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, steps,
                            context_level=cfg.diffusion.context_level)
    other = actions.roll(1, dims=0)  # episode i gets episode i-1's actions after the context
    other[:, :context] = actions[:, :context]
    kinds = [("own", actions, seed), ("noise", actions, seed + 1), ("other", other, seed)]
    if swap:
        swapped = actions.clone()
        for a, b in swap.items():
            swapped[:, context:][actions[:, context:] == a] = b
        kinds.append(("swapped", swapped, seed))
    n_gen = t - context
    out: dict[str, list[torch.Tensor]] = {k: [] for k, _, _ in kinds}
    for i in tqdm(range(0, n, batch_size), desc="action test", unit="batch", disable=not progress):
        r, p = real[i:i + batch_size], None if poses is None else poses[i:i + batch_size]
        for kind, acts, s in kinds:
            a = acts[i:i + batch_size]
            gen = rollout(model, diffusion, schedule, r[:, :context], a[:, :context], a[:, context:], n_gen,
                          generator=episode_generators(s, range(i, i + r.shape[0])), progress=False,
                          poses=p if cfg.memory.select == "pose" else None,
                          action_guidance=action_guidance)  # (b, n_gen, C, H, W)
            out[kind].append(gen.float().cpu())
    return {**{k: torch.cat(v) for k, v in out.items()}, "real": real[:, context:].float(),
            "last": real[:, context - 1:context].float()}


def summarise(videos: dict[str, torch.Tensor], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per span: PSNR vs truth (own, other, copy-last), own − other with a 95% episode-bootstrap interval, the
    agreements own–noise and own–other, and the self-agreement gap; with a "swapped" rollout also its PSNR and
    own − swapped; each span's per-episode means under "per_episode" (own, other, copy-last, swapped), for pairing
    two runs on the same episodes. Spans past the rollout are left out."""
    real, own = videos["real"], videos["own"]
    curves = {"own": _psnr(own, real), "other": _psnr(videos["other"], real),
              "copy_last": _psnr(videos["last"].expand_as(real), real),
              "agree_noise": _psnr(own, videos["noise"]), "agree_actions": _psnr(own, videos["other"])}
    if "swapped" in videos:
        curves["swapped"] = _psnr(videos["swapped"], real)
    n, t = curves["own"].shape
    episodes = np.arange(n)
    spans = []
    for a, b in SPANS:
        if a >= t:
            break
        m = {k: v[:, a:min(b, t)].mean(axis=1) for k, v in curves.items()}  # (N,) per-episode span means
        diff = paired_difference(m["own"], m["other"], episodes, n_boot=n_boot, seed=seed)
        spans.append({"span": f"{a + 1}-{min(b, t)}", **{k: float(v.mean()) for k, v in m.items()},
                      "own_minus_other": {k: diff[k] for k in ("mean", "lo", "hi")},
                      "self_agreement_gap": float((m["agree_noise"] - m["own"]).mean()),
                      "actions_move_less_than_noise": bool(m["agree_actions"].mean() > m["agree_noise"].mean())})
        if "swapped" in m:
            d = paired_difference(m["own"], m["swapped"], episodes, n_boot=n_boot, seed=seed)
            spans[-1]["own_minus_swapped"] = {k: d[k] for k in ("mean", "lo", "hi")}
        # per-episode span means, so two runs' results on the same episodes can be paired later
        spans[-1]["per_episode"] = {k: [float(x) for x in v] for k, v in m.items()
                                    if k in ("own", "other", "swapped", "copy_last")}
    return {"episodes": n, "generated_frames": t, "spans": spans}


def action_test(run: str, data: str, episodes: int = 32, context: int = 8, frames: int = 64, steps: int = 20,
                seed: int = 0, split: str = "training", device: str = "cpu", progress: bool = True,
                swap: str | None = None, anchor_sigma: float | None = None,
                anchor_floor: int | None = None, action_guidance: float = 0.0,
                anchor_runs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load ``run`` and ``episodes`` episodes of ``data``, roll them out three ways (four with ``swap``, e.g.
    "2:3,4:5"), summarise. ``anchor_sigma`` / ``anchor_floor``: the rollouts' anchor (None = the run's),
    ``anchor_runs`` other runs averaged into it (sample.py's --anchor-runs); ``action_guidance`` W: guidance along
    the actions (a run trained with ``train.action_dropout``)."""
    model, cfg = load_for_inference(run, use_ema=True, device=torch.device(device))
    anchor = use_anchor(cfg, anchor_sigma, anchor_floor)  # the rollouts read it from cfg.diffusion
    model = with_anchor_runs(model, anchor_runs, cfg.diffusion.anchor_sigma, device=torch.device(device), run=run)
    pairs = parse_swap(swap, cfg.model.num_actions) if swap else None
    real, actions, poses = load_validation_episodes(data, cfg, episodes, context, frames, split=split)
    if cfg.memory.select == "pose" and poses is None:
        raise SamplingError(f"{data}: the run chooses memory by pose, but the episodes have no 'pose' array")
    videos = run_action_test(model, cfg, real.to(device), actions.to(device), context,
                             None if poses is None else poses.to(device), steps, seed, progress=progress, swap=pairs,
                             action_guidance=action_guidance)
    return {"run": str(run), "data": str(data), "split": split, "context": context, "seed": seed, "swap": swap,
            "action_guidance": action_guidance, "anchor_runs": list(anchor_runs),
            **anchor, **summarise(videos, seed=seed)}


def describe(result: dict[str, Any]) -> str:
    """The result in lines a person reads."""
    lines = [f"{result['episodes']} episodes, {result['generated_frames']} generated frames after "
             f"{result['context']} context frames (PSNR dB; agreements = PSNR between two rollouts)"]
    for s in result["spans"]:
        d = s["own_minus_other"]
        lines.append(f"frames {s['span']:>7}: own actions {s['own']:.2f}, other actions {s['other']:.2f} "
                     f"(true actions buy {d['mean']:+.2f} [95% {d['lo']:+.2f}, {d['hi']:+.2f}]), copy-last "
                     f"{s['copy_last']:.2f}; agreement noise {s['agree_noise']:.2f} / actions {s['agree_actions']:.2f}"
                     f"{' (actions move the rollout LESS than the noise)' if s['actions_move_less_than_noise'] else ''}"
                     f"; self-agreement gap {s['self_agreement_gap']:+.2f}")
        if "own_minus_swapped" in s:
            d = s["own_minus_swapped"]
            lines.append(f"{'':>21}swapped ({result['swap']}) {s['swapped']:.2f}: the true direction buys "
                         f"{d['mean']:+.2f} [95% {d['lo']:+.2f}, {d['hi']:+.2f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--data", required=True, help="a TECO-layout folder of episodes (e.g. --policy random)")
    p.add_argument("--split", default="training", choices=["training", "validation"])
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--context", type=int, default=8)
    p.add_argument("--frames", type=int, default=64, help="frames to generate")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--swap", default=None, metavar="A:B,...",
                   help="direction check: a fourth rollout with these action pairs exchanged (Memory Maze: 2:3,4:5)")
    p.add_argument("--out", default=None)
    p.add_argument("--action-guidance", type=float, default=0.0, metavar="W",
                   help="guide every rollout along its actions (sample.py's flag; train.action_dropout > 0)")
    add_anchor_flags(p)
    args = p.parse_args(argv)
    for flag in ("episodes", "frames", "steps"):
        if getattr(args, flag) < 1:
            print(f"action_test: error: --{flag} must be >= 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    try:
        result = action_test(args.run, args.data, args.episodes, args.context, args.frames, args.steps, args.seed,
                             args.split, args.device, swap=args.swap, anchor_sigma=args.anchor_sigma,
                             anchor_floor=args.anchor_floor, action_guidance=args.action_guidance,
                             anchor_runs=args.anchor_runs)
    except USER_ERRORS as err:
        print(f"action_test: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(args.run) / "action_test")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "action_test.json", result, indent=2)
    print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
