"""Long rollouts of a trained run: ground-truth context, the episodes' own actions, videos and metrics.

    python sample.py --run runs/tiny                                   # chunked AR, 4 validation episodes
    python sample.py --run runs/tiny --schedule fifo --frames 120 --eval
    python sample.py --run runs/tiny --schedule my_schedule.json       # any valid Meta-ARVDM matrix
    python sample.py --run runs/tiny --no-cache                        # recompute memory every call (DF)
    python sample.py --run runs/tiny --hybrid 0.5 --eval               # half the temporal layers stream
    python sample.py --run runs/tiny --set hybrid.fraction=0.5 --set hybrid.select=offline --set hybrid.sink=1
    python sample.py --run runs/tiny --eta 1 --speculate ucb           # exact speculative rows, UCBSpec
    python sample.py --run runs/tiny --eta 1 --speculate fixed:3 --draft runs/small   # a smaller draft model
    python sample.py --run runs/tiny --anchor-sigma 0                  # the plain sampler (tiny: the anchor on)

Writes rollout.mp4, rollout.npz (`real`, `fake`), metrics.csv and, with --eval, eval.json into --out
(default RUN/samples/<schedule>); with --speculate also speculation.json and speculation_arms.png. The logic
lives in arvdm.sampling.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from arvdm.runtime import setup_environment


def build_parser() -> argparse.ArgumentParser:
    """sample.py's flags (each maps onto a field of ``arvdm.config.SampleSettings``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run folder written by train.py (or one checkpoint folder)")
    p.add_argument("--frames", type=int, default=None, help="frames to generate (default: all the episodes hold)")
    p.add_argument("--schedule", default="chunked", help="chunked | fifo | pyramid | path to a schedule file")
    p.add_argument("--steps", type=int, default=20, help="denoising calls per frame from K to 0")
    p.add_argument("--context", type=int, default=None, help="ground-truth frames to condition on")
    p.add_argument("--episodes", type=int, default=4, help="validation episodes to roll out")
    p.add_argument("--batch-size", type=int, default=4,
                   help="episodes per rollout batch (speed only: each episode has its own noise generator, "
                        "seeded by --seed and its index; docs/sampling.md)")
    p.add_argument("--eta", type=float, default=None,
                   help="0 = DDIM, 1 = DDPM-like (default: the run's diffusion.eta, 1 for the presets)")
    p.add_argument("--context-level", type=int, default=None, metavar="K",
                   help="finished frames sit at this noise level in memory (noisy context; default: the run's "
                        "diffusion.context_level for a preset schedule, 20 for tiny; a schedule file's own)")
    p.add_argument("--history-guidance", type=float, default=0.0, metavar="W",
                   help="v = v_mem + W (v_mem - v_nomem) (history guidance, DFoT); 0 = off, one model call per row")
    p.add_argument("--action-guidance", type=float, default=0.0, metavar="W",
                   help="v += W (v - v_noact), v_noact with the null action (classifier-free guidance over the "
                        "actions; a run trained with train.action_dropout > 0); 0 = off, one model call per row")
    p.add_argument("--candidates", type=int, default=1, metavar="N",
                   help="N candidates per episode; each AR step keeps the one closest to the others (minimum Bayes "
                        "risk under squared error) and goes on from it: less of a sample's spread, N times the compute")
    p.add_argument("--anchor-sigma", type=float, default=None, metavar="S",
                   help="hold every frame's low frequencies (Gaussian blur of S pixels) at its first prediction, the "
                        "model's conditional mean; the sampler draws the rest (docs/sampling.md); 0 = off (default: "
                        "the run's diffusion.anchor_sigma, 1 for tiny; 0 with --speculate)")
    p.add_argument("--anchor-floor", type=int, default=None, metavar="L",
                   help="with an anchor: pull only in the denoising calls that start above noise level L (the last "
                        "details drawn freely, sharper frames); 0 = every call (default: the run's "
                        "diffusion.anchor_floor, 100 for tiny)")
    p.add_argument("--anchor-runs", default="", metavar="RUN,RUN",
                   help="other runs of the same config (e.g. training seeds) whose level-K predictions are averaged "
                        "with this run's into the anchor; this run draws the rest (docs/sampling.md)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (episode e draws from its own generator, "
                   "seeded by (seed, e))")
    p.add_argument("--data", default=None, help="TECO-layout data folder (default: the run's)")
    p.add_argument("--split", default="validation", choices=["validation", "training"],
                   help="which split of the data folder to roll out (default validation; e.g. training of a "
                        "freshly generated folder the run never saw)")
    p.add_argument("--out", default=None, help="output folder (default: RUN/samples/<schedule>)")
    p.add_argument("--no-cache", action="store_true", help="no KV cache: recompute the memory at every call")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA weights")
    p.add_argument("--eval", action="store_true", help="also write eval.json (spans, decay, retrieval)")
    p.add_argument("--device", default="auto")
    p.add_argument("--hybrid", type=float, default=None, metavar="F",
                   help="hybrid attention: the fraction F of temporal layers (the laziest) that stream")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="hybrid.KEY=VALUE",
                   help="hybrid-attention setting (fraction, select, layers, sink, recent, last_frames, ratios)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the denoiser (a GPU speed-up; the first frames are slow to compile)")
    p.add_argument("--speculate", default=None, metavar="ucb|exp3|fixed:L",
                   help="exact speculative denoising rows, arm chosen by UCBSpec / EXP3Spec or fixed lookahead L "
                        "(needs --eta > 0)")
    p.add_argument("--draft", default="frozen", help="frozen (reuse the target's v) or a smaller run folder")
    p.add_argument("--lookaheads", default="1,2,3,4", help="the bandits' lookahead arms, comma-separated")
    p.add_argument("--memory-select", default=None, choices=["pose", "time", "none", "other"],
                   help="runs trained with memory.select=pose: choose memory frames by pose (default), by time (the "
                        "frames just before the recent ones), none (recent frames only) or other (by pose, from "
                        "another episode): the same weights, the memory ablation")
    p.add_argument("--level-bins", type=int, default=1,
                   help="> 1: one bandit per bin of the noise level a round starts from")
    return p


def hybrid_overrides(items: list[str], fraction: float | None) -> dict[str, Any]:
    """``--set hybrid.KEY=VALUE`` (VALUE as JSON when it parses) and ``--hybrid F``; ValueError names the flag."""
    hybrid: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().startswith("hybrid."):
            raise ValueError(f"--set {item!r}: expected hybrid.KEY=VALUE (sampling changes only hybrid.*)")
        try:
            hybrid[key.strip()[len("hybrid."):]] = json.loads(raw)
        except json.JSONDecodeError:
            hybrid[key.strip()[len("hybrid."):]] = raw
    if fraction is not None:
        hybrid["fraction"] = fraction
    return hybrid


def main(argv: list[str] | None = None) -> int:
    setup_environment()  # before torch loads: OpenMP reads it once
    args = build_parser().parse_args(argv)
    try:
        hybrid = hybrid_overrides(args.overrides, args.hybrid)
    except ValueError as err:
        print(f"sample.py: error: {err}", file=sys.stderr)
        return 2
    try:
        lookaheads = tuple(int(v) for v in args.lookaheads.split(","))
    except ValueError:
        print(f"sample.py: error: --lookaheads {args.lookaheads!r}: expected comma-separated integers such as 1,2,4",
              file=sys.stderr)
        return 2

    # lazy: torch loads with these imports, after setup_environment (OpenMP reads its variables once)
    from arvdm.errors import USER_ERRORS
    from arvdm.hybrid.convert import describe
    from arvdm.sample_settings import SampleSettings
    from arvdm.sampling import sample_run
    from arvdm.setting_checks import parse_anchor_runs

    settings = SampleSettings(frames=args.frames, schedule=args.schedule, steps=args.steps, context=args.context,
                              episodes=args.episodes, batch_size=args.batch_size, eta=args.eta, seed=args.seed,
                              use_cache=not args.no_cache, evaluate=args.eval, data=args.data, split=args.split,
                              use_ema=not args.no_ema, device=args.device, hybrid=hybrid or None,
                              compile=args.compile, speculate=args.speculate, draft=args.draft,
                              lookaheads=lookaheads, level_bins=args.level_bins, memory_select=args.memory_select,
                              context_level=args.context_level, history_guidance=args.history_guidance,
                              action_guidance=args.action_guidance,
                              candidates=args.candidates, anchor_sigma=args.anchor_sigma,
                              anchor_floor=args.anchor_floor,
                              anchor_runs=parse_anchor_runs(args.anchor_runs))
    out = args.out or str(Path(args.run) / "samples" / Path(args.schedule).stem)
    try:
        settings.validate()  # every flag, before the model loads
        result = sample_run(args.run, out, settings)
    except USER_ERRORS as err:  # flags, config, schedule, data, checkpoint, --out
        print(f"sample.py: error: {err}", file=sys.stderr)
        return 2
    if "hybrid" in result["summary"]:
        print(describe(result["summary"]["hybrid"]))
    print(json.dumps(result, indent=2))
    for i, rep in enumerate(result["summary"].get("speculation", [])):
        print(speculation_line(i, rep))
    if "verdict" in result["summary"]:  # the model against copy-last and context-mean, in words
        print(f"sample.py: {result['summary']['verdict']}", file=sys.stderr)
    if "revisits" in result["summary"]:  # memory on the frames only memory can supply, in words
        print(f"sample.py: {result['summary']['revisits']['message']}", file=sys.stderr)
    if "hold_up" in result["summary"]:
        horizon = result["summary"]["hold_up"]["hold_up_horizon"]  # the first span below the context-mean baseline
        print("sample.py: hold-up horizon: " + (f"the model falls below context-mean in frames {horizon['label']} "
              f"({horizon['model']:.2f} vs {horizon['baseline']:.2f} dB)" if horizon else
              "the model stays at or above context-mean over every span"), file=sys.stderr)
        views = result["summary"]["hold_up"].get("context_views")
        if views:  # how much of the span the context could supply; a sharp model must invent the rest
            print("sample.py: " + context_views_line(views), file=sys.stderr)
    return 0


def context_views_line(views: dict[str, Any]) -> str:
    """`arvdm.evaluation.holdup.context_views` in one line: model minus context-mean on each part of the span."""
    def part(name: str, label: str) -> str:
        d = views.get(name)
        return f"{label}-" if d is None else f"{label}{d['mean']:+.2f} dB [{d['lo']:+.2f}, {d['hi']:+.2f}]"
    return (f"frames {views['label']}: model minus context-mean {part('all', '')}; {views['share_seen']:.0%} show a "
            f"view a context frame shows; on those and on the rest (views the model must invent): "
            f"{part('seen', 'seen ')}, {part('unseen', 'unseen ')}")


def speculation_line(i: int, rep: dict[str, Any]) -> str:
    """One rollout's speculation report in one line."""
    return (f"rollout {i}: {rep['target_rounds']} target rounds for {rep['rows']} rows "
            f"({rep['rows_per_round']:.2f} rows/round, {rep['accepted_rows_per_round']:.2f} drafted rows accepted "
            f"per round, {rep['target_evaluations']} windows evaluated), "
            f"acceptance {rep['acceptance']:.3f}, regret {rep['regret']['regret']:.1f} rounds vs best fixed arm "
            f"{rep['arms'][rep['regret']['best_arm']]}, {rep['frames_per_second']:.2f} frames/s")


if __name__ == "__main__":
    sys.exit(main())
