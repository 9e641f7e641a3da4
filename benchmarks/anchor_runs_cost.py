"""What `sample.py --anchor-runs` costs at sampling: one rollout with the run's anchor alone and with the anchor
averaged over 1, 2, ... more runs' level-K predictions (`arvdm.pipeline.anchor.AnchorEnsemble`), side by side.

    python benchmarks/anchor_runs_cost.py                                              # random tiny models
    python benchmarks/anchor_runs_cost.py --run runs/tiny --members runs/seed1,runs/seed2   # trained runs

Each round rolls out the same episodes with 0, 1, ..., M members in turn (round-robin, so load drifts hit all
alike); prints the median seconds per rollout and its ratio to the anchor alone. A member adds one call in each
call that has a frame at level K (1 in --steps on the chunked schedule) and its commits (a forward pass over
the committed frames, KV caches, memory), so the expected ratio is about 1 + M (1 / steps + commit share).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arvdm.config import get_preset  # noqa: E402
from arvdm.model.denoiser import Denoiser  # noqa: E402
from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.anchor import AnchorEnsemble  # noqa: E402
from arvdm.pipeline.rollout import episode_generators, rollout  # noqa: E402
from arvdm.pipeline.runs import load_for_inference  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from arvdm.setting_checks import parse_anchor_runs  # noqa: E402
from benchmarks.common import interleaved, median, print_table, random_weights, set_threads  # noqa: E402


def random_models(n: int) -> list[Denoiser]:
    """``n`` tiny-preset denoisers with random weights (the zero-initialised layers random too)."""
    cfg = get_preset("tiny").validate()
    models = []
    for seed in range(n):
        torch.manual_seed(seed)
        models.append(random_weights(Denoiser(cfg).eval()))
    return models


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="the sampled run (default: random tiny-preset models)")
    p.add_argument("--members", default="", help="other runs, comma-separated (with --run)")
    p.add_argument("--random-members", type=int, default=2, help="without --run: members besides the first")
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--context", type=int, default=8)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    if args.run:
        models = [load_for_inference(r)[0] for r in [args.run, *parse_anchor_runs(args.members)]]
    else:
        models = random_models(1 + args.random_members)
    cfg = models[0].cfg
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, args.steps,
                            context_level=cfg.diffusion.context_level)
    g = torch.Generator().manual_seed(0)
    b, t, s = args.episodes, args.context + args.frames, cfg.model.image_size
    video = torch.rand(b, t, cfg.model.channels, s, s, generator=g) * 2 - 1  # (B, T, C, H, W)
    actions = torch.randint(0, cfg.model.num_actions, (b, t), generator=g)  # (B, T)
    poses = torch.cumsum(torch.randn(b, t, 3, generator=g) * 0.1, dim=1)  # (B, T, 3) a random walk

    def go(members: int):
        model = models[0] if members == 0 else AnchorEnsemble(models[0], models[1:1 + members])

        @torch.no_grad()
        def fn() -> torch.Tensor:
            return rollout(model, diffusion, schedule, video[:, :args.context], actions[:, :args.context],
                           actions[:, args.context:], args.frames, poses=poses, anchor_sigma=1.0, anchor_floor=100,
                           generator=episode_generators(0, range(b)), progress=False)
        return fn

    fns = {f"anchor + {m} run(s)" if m else "anchor alone": go(m) for m in range(len(models))}
    times = interleaved(fns, repeats=args.repeats, warmup=1)
    base = median(times["anchor alone"])
    print(f"{b} episodes x {args.frames} frames, chunked, {args.steps} steps, {args.threads} thread(s); "
          f"{'runs ' + args.run if args.run else 'random tiny models'}; median of {args.repeats} rounds")
    print_table(["rollout", "s", "ratio"], [[k, f"{median(v):.2f}", f"{median(v) / base:.2f}"]
                                            for k, v in times.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
