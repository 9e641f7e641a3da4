"""Speculative denoising rows: sequential target rounds, frames/s and acceptance, all arms in one run.

    python benchmarks/speculation.py --run RUN                          # frozen draft
    python benchmarks/speculation.py --run RUN --draft-run SMALL_RUN    # + a smaller trained Denoiser as draft
    python benchmarks/speculation.py --run RUN --quick                  # 1 episode, 8 frames

On validation episodes of the run's data (the run's own config), with the same context, actions and seeds,
the rollouts are (eta > 0, default 1):

- ``plain``: ``pipeline.rollout`` without speculation (one sequential target call per row);
- ``fixed:L <draft>``: every round drafts L rows, one batched target call on the L drafted states;
- ``ucb`` / ``exp3``: BanditSpec over the arms (L = 1 = no speculation, and every (L, draft));
- ``ucb/Nbins`` / ``exp3/Nbins`` (``--level-bins N``): one bandit per noise-level bin of the round's start.

Reported per configuration: sequential target rounds per AR step (the latency a GPU cannot batch away),
windows evaluated by the target (total compute), rows per round, acceptance of drafted rows, frames/s on
this machine, the speed-up in rounds over plain; per fixed arm the acceptance per noise level; for the
bandits the gap to the best fixed arm in rounds (stopping-time regret measured against the fixed-arm runs)
and the hindsight estimate from the bandit's own rounds. Every configuration samples the target's exact
distribution (tests/test_speculative_rollout.py), so the rows are comparable at equal output quality.
The configurations run round-robin per episode batch so that drift of the machine's load hits all alike.
Writes ``speculation.json``, ``speculation_arms.png`` (bandits' arms over time) and
``speculation_acceptance.png`` (acceptance vs noise level per fixed arm) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.rollout import rollout  # noqa: E402
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from arvdm.speculative.bandits import hindsight_regret  # noqa: E402
from arvdm.speculative.rows import FROZEN, SpeculativeRows, make_speculation, plot_arms, report_bin_width  # noqa: E402
from benchmarks.common import print_table, set_threads  # noqa: E402
from data.atomic import atomic_write, atomic_write_text  # noqa: E402


class CountingModel:
    """Counts the target's calls (plain rollouts) and forwards everything else to the model."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the target: a run folder written by train.py")
    p.add_argument("--draft-run", default=None, help="a smaller trained run used as a second draft")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1, help="rollouts per call (acceptance is per sample)")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--schedule", default="chunked")
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--lookaheads", default="2,3,4")
    p.add_argument("--level-bins", type=int, default=4, help="also run the bandits with one copy per noise-level "
                   "bin (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="default RUN/benchmarks/speculation")
    p.add_argument("--quick", action="store_true", help="1 episode, 8 frames, 10 steps")
    return p


def run_config(name: str, bench: dict[str, Any], r: torch.Tensor, a: torch.Tensor, seed: int, args,
               result: dict[str, Any]) -> None:
    """One rollout of configuration ``name`` on the episodes ``r`` / actions ``a``; its counts into ``result``."""
    spec = None
    if name != "plain":
        mode, _, draft = name.partition(" ")
        mode, _, binned = mode.partition("/")
        drafts = {draft: bench["drafts"][draft]} if draft else bench["drafts"]
        spec = make_speculation(mode, [1] + bench["lookaheads"], drafts, seed=seed,
                                level_bins=args.level_bins if binned else 1)
        if result["specs"]:  # a bandit learns over the whole run
            spec.policy = result["specs"][-1].policy
    counter, context = bench["counter"], bench["context"]
    counter.calls = 0
    t0 = time.perf_counter()
    rollout(counter if spec is None else bench["model"], bench["diffusion"], bench["schedule"], r[:, :context],
            a[:, :context], a[:, context:], args.frames, eta=args.eta, generator=torch.Generator().manual_seed(seed),
            progress=False, rows=None if spec is None else SpeculativeRows(spec))
    result["seconds"] += time.perf_counter() - t0
    result["frames"] += r.shape[0] * args.frames
    if spec is None:
        result["rounds"] += counter.calls
        result["evaluations"] += counter.calls * r.shape[0]
        result["rows"] += counter.calls
        return
    s = spec.summary()
    result["rounds"] += s["target_rounds"]
    result["evaluations"] += s["target_evaluations"]
    result["rows"] += s["rows"]
    result["accepted"] += sum(c.accepted for c in spec.checks)
    result["checked"] += sum(c.checked for c in spec.checks)
    width = report_bin_width(bench["num_levels"])
    for c in spec.checks:
        acc = result["levels"].setdefault(int(c.level) // width * width, [0, 0])
        acc[0] += c.accepted
        acc[1] += c.checked
    result["specs"].append(spec)


def summarise(results: dict[str, dict[str, Any]], rounds_per_rollout: int) -> dict[str, dict[str, Any]]:
    """Per configuration the JSON row; prints the table. ``rounds_per_rollout``: rollouts x AR steps."""
    plain_rounds = results["plain"]["rounds"]
    table, out_json = [], {}
    for name, res in results.items():
        acceptance = res["accepted"] / res["checked"] if res["checked"] else float("nan")
        row = {"rounds_per_ar_step": res["rounds"] / rounds_per_rollout, "target_rounds": res["rounds"],
               "windows_evaluated": res["evaluations"], "rows_per_round": res["rows"] / max(1, res["rounds"]),
               "acceptance": acceptance, "frames_per_s": res["frames"] / res["seconds"],
               "round_speedup_vs_plain": plain_rounds / max(1, res["rounds"]),
               "acceptance_by_level": {str(k): a / n for k, (a, n) in sorted(res["levels"].items())}}
        out_json[name] = row
        table.append([name, f"{row['rounds_per_ar_step']:.1f}", str(res["evaluations"]), f"{row['rows_per_round']:.2f}",
                      f"{acceptance:.3f}", f"{row['frames_per_s']:.3f}", f"{row['round_speedup_vs_plain']:.2f}x"])
    print_table(["config", "target rounds / AR step", "windows evaluated", "rows / round", "acceptance",
                 "frames/s", "fewer rounds vs plain"], table)
    return out_json


def compare_bandits(results: dict[str, dict[str, Any]], out_json: dict[str, dict[str, Any]],
                    bandits: list[str]) -> None:
    """The bandits against the best fixed arm (into ``out_json``) and acceptance by noise level, printed."""
    fixed = {n: row["target_rounds"] for n, row in out_json.items() if n.startswith("fixed:")}
    best = min(fixed, key=fixed.get)
    print(f"\nbest fixed arm: {best} ({fixed[best]} rounds); plain: {results['plain']['rounds']} rounds")
    for bandit in bandits:
        gap = out_json[bandit]["target_rounds"] / fixed[best] - 1
        hind = [_hindsight(s) for s in results[bandit]["specs"]]
        out_json[bandit]["gap_to_best_fixed_arm"] = gap
        out_json[bandit]["hindsight_regret_rounds"] = [h["regret"] for h in hind]
        print(f"{bandit}: {out_json[bandit]['target_rounds']} rounds, {100 * gap:+.1f}% vs the best fixed arm; "
              f"hindsight regret estimate per rollout: {[round(h['regret'], 1) for h in hind]}")
    levels = sorted({int(k) for n in fixed for k in out_json[n]["acceptance_by_level"]})
    print("\nacceptance of drafted rows by the noise level they start from")
    print_table(["config"] + [str(k) for k in levels],
                [[n] + [f"{out_json[n]['acceptance_by_level'].get(str(k), float('nan')):.2f}" for k in levels]
                 for n in fixed])


def plot_acceptance(results: dict, path: Path) -> Path:
    # lazy: matplotlib is slow to import and only this figure needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, r in results.items():
        if name.startswith("fixed:") and r["acceptance_by_level"]:
            levels = sorted(int(k) for k in r["acceptance_by_level"])
            ax.plot(levels, [r["acceptance_by_level"][str(k)] for k in levels], "o-", ms=3, label=name)
    ax.set_xlabel("noise level the drafted row starts from (K = pure noise)")
    ax.set_ylabel("acceptance of drafted rows")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def write_outputs(out: Path, args, results: dict[str, dict[str, Any]], out_json: dict[str, dict[str, Any]],
                  bandits: list[str], schedule_name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "speculation.json", json.dumps({"args": vars(args), "results": out_json}, indent=1))
    panels = {"UCBSpec": results["ucb"]["specs"], "EXP3Spec": results["exp3"]["specs"]}
    if len(bandits) > 2:
        panels[f"UCBSpec, {args.level_bins} level bins"] = results[bandits[2]]["specs"]
    plot_arms(panels, out / "speculation_arms.png", f"{schedule_name}, {args.steps} steps, eta {args.eta}")
    plot_acceptance(out_json, out / "speculation_acceptance.png")
    print(f"\nwrote {out}/speculation.json, speculation_arms.png, speculation_acceptance.png")


def load_bench(args, device: torch.device) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """The target, its diffusion and schedule, the drafts; and the validation episodes and actions."""
    model, cfg = load_for_inference(args.run, device=device)
    schedule = get_schedule(args.schedule, cfg.train.window, cfg.diffusion.num_levels, args.steps)
    context = cfg.default_context()
    real, actions, _ = load_validation_episodes(cfg.data.path, cfg, args.episodes, context, args.frames)
    drafts = {FROZEN: None}
    if args.draft_run:
        drafts[Path(args.draft_run).name] = load_for_inference(args.draft_run, device=device)[0]
    bench = {"model": model, "counter": CountingModel(model), "diffusion": PerFrameDiffusion(cfg.diffusion),
             "schedule": schedule, "context": context, "drafts": drafts, "num_levels": cfg.diffusion.num_levels,
             "lookaheads": [int(v) for v in args.lookaheads.split(",")]}
    return bench, real, actions


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.eta <= 0:
        p.error("--eta must be > 0: with eta = 0 the transitions are deterministic and nothing can be accepted")
    if args.quick:
        args.episodes, args.frames, args.steps = 1, 8, 10
    set_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    bench, real, actions = load_bench(args, device)
    schedule, drafts, lookaheads = bench["schedule"], bench["drafts"], bench["lookaheads"]
    bandits = ["ucb", "exp3"] + ([f"ucb/{args.level_bins}bins", f"exp3/{args.level_bins}bins"]
                                 if args.level_bins > 1 else [])
    names = ["plain"] + [f"fixed:{L} {d}" for d in drafts for L in lookaheads] + bandits
    results = {n: {"rounds": 0, "evaluations": 0, "rows": 0, "seconds": 0.0, "frames": 0, "accepted": 0,
                   "checked": 0, "levels": {}, "specs": []} for n in names}
    print(f"target {args.run} ({bench['model'].num_params() / 1e6:.2f}M params), schedule {schedule.name} "
          f"(w={schedule.window}, M={schedule.num_steps}), eta {args.eta}, {args.episodes} episodes x "
          f"{args.frames} frames, batch {args.batch_size}, lookaheads {lookaheads}, drafts {list(drafts)}")
    for i in range(0, real.shape[0], args.batch_size):
        r, a = real[i:i + args.batch_size].to(device), actions[i:i + args.batch_size].to(device)
        for name in names:  # round-robin: load drift hits every configuration alike
            run_config(name, bench, r, a, args.seed + i, args, results[name])
        print(f"  episodes {i}..{i + r.shape[0] - 1} done")
    n_rollouts = -(-real.shape[0] // args.batch_size)
    out_json = summarise(results, n_rollouts * schedule.num_ar_steps(args.frames))
    compare_bandits(results, out_json, bandits)
    write_outputs(Path(args.out or Path(args.run) / "benchmarks" / "speculation"), args, results, out_json, bandits,
                  schedule.name)
    return 0


def _hindsight(spec):
    return hindsight_regret([r.arm for r in spec.rounds], [r.rows for r in spec.rounds], len(spec.arms))


if __name__ == "__main__":
    sys.exit(main())
