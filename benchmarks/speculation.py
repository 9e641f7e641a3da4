"""Speculative denoising rows: sequential target rounds, cost, frames/s and acceptance, all arms in one run.

    python benchmarks/speculation.py --run RUN                          # frozen draft
    python benchmarks/speculation.py --run RUN --draft-run SMALL_RUN    # + a smaller trained Denoiser as draft
    python benchmarks/speculation.py --run RUN --quick                  # 1 episode, 8 frames

On validation episodes of the run's data (the run's own config), with the same context, actions and seeds,
the rollouts are (eta > 0, default 1):

- ``plain``: ``pipeline.rollout`` without speculation (one sequential target call per row);
- ``fixed:L <draft>``: every round drafts L rows, one batched target call on the L drafted states;
- ``ucb`` / ``exp3``: BanditSpec over the arms (L = 1 = no speculation, and every (L, draft));
- ``ucb/Nbins`` / ``exp3/Nbins`` (``--level-bins N``): one bandit per noise-level bin of the round's start.

The bandits' reward is rows advanced per unit of cost (``arvdm.speculative.cost.CostModel``, in
target-equivalent calls). ``--cost measured`` (default) first **calibrates** the cost model on this machine:
one short AR step (``--calib-steps`` rows) per fixed arm, and the median wall-clock of a round of lookahead L
over the median of a plain round is the cost of L (the batched verification plus the round's own arithmetic;
for a draft network its calls too); ``--cost linear:R`` uses the model 1 + R·(L − 1) instead (R = 0: a batch
of L windows costs one call, a GPU model).

Reported per configuration: sequential target rounds per AR step (the latency a GPU cannot batch away),
windows evaluated by the target (total compute), rows per round, modelled cost and rows per cost,
acceptance of drafted rows, frames/s on this machine, the speed-up in rounds over plain; per fixed arm the
acceptance per noise level and its rows per cost under other batch-cost ratios (a model); for the bandits
the gap to the best fixed arm (plain = the L = 1 arm included) in frames/s and in rows per cost, and the
cost regret against that oracle arm over time (rounds played, in tenths). Every configuration samples the target's exact
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
from arvdm.speculative.cost import CostModel, regret_over_time  # noqa: E402
from arvdm.speculative.rows import (  # noqa: E402
    FROZEN,
    SpeculativeRows,
    make_speculation,
    plot_arms,
    report_bin_width,
    tile_state,
)
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
    p.add_argument("--data", default=None, help="the data set (default: the run's data.path)")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1, help="rollouts per call (acceptance is per sample)")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--schedule", default="chunked")
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--lookaheads", default="2,3,4")
    p.add_argument("--level-bins", type=int, default=4, help="also run the bandits with one copy per noise-level "
                   "bin (0: skip)")
    p.add_argument("--cost", default="measured", help="measured (calibrate on this machine) or linear:R")
    p.add_argument("--calib-steps", type=int, default=40, help="rows of the calibration AR step per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="default RUN/benchmarks/speculation")
    p.add_argument("--quick", action="store_true", help="1 episode, 8 frames, 10 steps")
    p.add_argument("--skip-fixed", action="store_true", help="no fixed:L runs (long rollouts): the bandits are "
                   "compared with plain only, the L = 1 arm")
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
                                level_bins=args.level_bins if binned else 1, cost=bench["cost"])
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
        result["cost"] += counter.calls  # one target call per row
        return
    s = spec.summary()
    result["cost"] += s["cost"]
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
    result["batches"].append(r.shape[0])


def summarise(results: dict[str, dict[str, Any]], rounds_per_rollout: int) -> dict[str, dict[str, Any]]:
    """Per configuration the JSON row; prints the table. ``rounds_per_rollout``: rollouts x AR steps."""
    plain_rounds = results["plain"]["rounds"]
    table, out_json = [], {}
    for name, res in results.items():
        acceptance = res["accepted"] / res["checked"] if res["checked"] else float("nan")
        row = {"rounds_per_ar_step": res["rounds"] / rounds_per_rollout, "target_rounds": res["rounds"],
               "windows_evaluated": res["evaluations"], "rows_per_round": res["rows"] / max(1, res["rounds"]),
               "cost": res["cost"], "rows_per_cost": res["rows"] / res["cost"],
               "acceptance": acceptance, "frames_per_s": res["frames"] / res["seconds"],
               "round_speedup_vs_plain": plain_rounds / max(1, res["rounds"]),
               "acceptance_by_level": {str(k): a / n for k, (a, n) in sorted(res["levels"].items())}}
        out_json[name] = row
        if name.startswith("fixed:"):
            row["modelled_rows_per_cost"] = _modelled(res["specs"], res["batches"])
        table.append([name, f"{row['rounds_per_ar_step']:.1f}", str(res["evaluations"]), f"{row['rows_per_round']:.2f}",
                      f"{row['rows_per_cost']:.3f}", f"{acceptance:.3f}", f"{row['frames_per_s']:.3f}",
                      f"{row['round_speedup_vs_plain']:.2f}x"])
    print_table(["config", "target rounds / AR step", "windows evaluated", "rows / round", "rows / cost",
                 "acceptance", "frames/s", "fewer rounds vs plain"], table)
    return out_json


MODEL_RATIOS = (0.0, 0.25, 0.5, 1.0)  # batch-cost ratios of the modelled rows per cost of the fixed arms


def _modelled(specs: list, batches: list[int]) -> dict[str, float]:
    """Rows per cost of a fixed arm's rounds under the linear model 1 + R·(L − 1) for each R of MODEL_RATIOS
    (draft calls free: the frozen draft's model)."""
    rows = sum(s.rows for s in specs)
    out = {}
    for ratio in MODEL_RATIOS:
        model = CostModel(batch_ratio=ratio)
        cost = sum(model.round_cost(1 if r.lookahead == 1 else r.target_states // b, FROZEN)
                   for s, b in zip(specs, batches) for r in s.rounds)
        out[str(ratio)] = rows / cost
    return out


def make_cost(args, bench: dict[str, Any], r: torch.Tensor, a: torch.Tensor) -> CostModel:
    """The cost model of ``--cost``: ``linear:R``, or ``measured`` (:func:`calibrate` on these episodes)."""
    if args.cost.startswith("linear:"):
        try:
            return CostModel(batch_ratio=float(args.cost.split(":", 1)[1]))
        except ValueError as err:
            raise SystemExit(f"--cost {args.cost!r}: expected linear:R with a number R >= 0 ({err})") from err
    if args.cost != "measured":
        raise SystemExit(f"--cost {args.cost!r}: expected measured or linear:R")
    return calibrate(args, bench, r, a)


def measure_verify_calls(bench: dict[str, Any], r: torch.Tensor, a: torch.Tensor, repeats: int = 7) -> dict[str, float]:
    """Median wall-clock of one target call on L stacked windows per sample (the KV-cached context tiled, as a
    round verifies) over one call on one window, for L = 1 and the lookaheads: the batched verification alone."""
    model, w, b = bench["model"], bench["schedule"].window, r.shape[0]
    state = model.init_state(b)
    model.commit(state, r[:, :bench["context"]], a[:, :bench["context"]])
    levels = torch.linspace(bench["num_levels"], 1, w).long()  # (w,)
    times = {}
    for lookahead in [1] + bench["lookaheads"]:
        tiled = state if lookahead == 1 else tile_state(state, lookahead)
        x = torch.randn(lookahead * b, w, *r.shape[2:], device=r.device)  # (L·B, w, C, H, W)
        acts = a[:, bench["context"]:bench["context"] + w].repeat(lookahead, 1)  # (L·B, w)
        lv = levels.to(r.device).expand(lookahead * b, w)
        with torch.no_grad():
            model(x, lv, acts, state=tiled)  # warm-up
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model(x, lv, acts, state=tiled)
                seconds.append(time.perf_counter() - t0)
        times[lookahead] = float(torch.tensor(seconds).median())
    return {str(k): v / times[1] for k, v in times.items() if k > 1}


def calibrate(args, bench: dict[str, Any], r: torch.Tensor, a: torch.Tensor) -> CostModel:
    """Median wall-clock of a full round of each fixed arm over a plain round's, on one AR step of
    ``--calib-steps`` rows (a plain round first as warm-up): verify_costs[L] from the frozen draft, each draft
    network's cost per call from its extra time over the frozen round of the same L."""
    schedule = get_schedule(args.schedule, bench["schedule"].window, bench["num_levels"], args.calib_steps)
    context = bench["context"]

    def median_round(mode: str, draft: str) -> float:
        spec = make_speculation(mode, drafts={draft: bench["drafts"][draft]} if draft else None, seed=args.seed)
        rollout(bench["model"], bench["diffusion"], schedule, r[:, :context], a[:, :context], a[:, context:], 1,
                eta=args.eta, generator=torch.Generator().manual_seed(args.seed), progress=False,
                rows=SpeculativeRows(spec))
        lookahead = spec.arms[0][0]
        full = [x.seconds for x in spec.rounds if x.lookahead == 1 or x.target_states == lookahead * r.shape[0]]
        return float(torch.tensor(full).median())

    median_round("fixed:1", "")  # warm-up
    plain = median_round("fixed:1", "")
    verify = {L: median_round(f"fixed:{L}", FROZEN) / plain for L in bench["lookaheads"]}
    draft_costs = {}
    for name in bench["drafts"]:
        if name != FROZEN:
            extra = [(median_round(f"fixed:{L}", name) / plain - verify[L]) / L for L in bench["lookaheads"]]
            draft_costs[name] = max(0.0, sum(extra) / len(extra))
    print(f"calibration ({args.calib_steps} rows, one AR step, batch {r.shape[0]}): plain round {1e3 * plain:.1f} ms;"
          " round cost in plain rounds: " + ", ".join(f"L={L}: {c:.2f}" for L, c in verify.items())
          + "".join(f"; draft {n}: {c:.2f} per call" for n, c in draft_costs.items()))
    return CostModel(verify_costs=verify, draft_costs=draft_costs)


def compare_bandits(results: dict[str, dict[str, Any]], out_json: dict[str, dict[str, Any]],
                    bandits: list[str]) -> None:
    """The bandits against the best fixed arm, plain (L = 1) included, in frames/s and in rows per cost, and
    their cost regret against it over time (into ``out_json``); acceptance by noise level, printed."""
    fixed = [n for n in out_json if n.startswith("fixed:")]
    arms = ["plain"] + fixed
    best_fps = max(arms, key=lambda n: out_json[n]["frames_per_s"])
    best_rate = max(arms, key=lambda n: out_json[n]["rows_per_cost"])
    print(f"\nbest fixed arm in frames/s: {best_fps} ({out_json[best_fps]['frames_per_s']:.3f}); in rows per "
          f"cost: {best_rate} ({out_json[best_rate]['rows_per_cost']:.3f}); largest L: {fixed[-1] if fixed else '-'}")
    for n in fixed:
        print(f"  {n}: rows per cost modelled with batch-cost ratio R (1 + R(L-1)): "
              + ", ".join(f"R={k}: {v:.3f}" for k, v in out_json[n]["modelled_rows_per_cost"].items()))
    for bandit in bandits:
        row = out_json[bandit]
        row["gap_fps_to_best_fixed_arm"] = row["frames_per_s"] / out_json[best_fps]["frames_per_s"] - 1
        row["gap_rows_per_cost_to_best_fixed_arm"] = row["rows_per_cost"] / out_json[best_rate]["rows_per_cost"] - 1
        rounds = [r for s in results[bandit]["specs"] for r in s.rounds]
        row["regret_over_time"] = regret_over_time([r.rows for r in rounds], [r.cost for r in rounds],
                                                   out_json[best_rate]["rows_per_cost"])
        row["arm_share_last_half"] = _share([r.arm for r in rounds[len(rounds) // 2:]],
                                            len(results[bandit]["specs"][0].arms))
        print(f"{bandit}: frames/s {100 * row['gap_fps_to_best_fixed_arm']:+.1f}% vs {best_fps}, rows per cost "
              f"{100 * row['gap_rows_per_cost_to_best_fixed_arm']:+.1f}% vs {best_rate}; arms' share over the last "
              f"half of the rounds {row['arm_share_last_half']}; relative cost regret at tenths of the rounds: "
              + " ".join(f"{p['relative_regret']:+.3f}" for p in row["regret_over_time"]))
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
                  bandits: list[str], schedule_name: str, cost: CostModel, verify_call_cost: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "speculation.json", json.dumps({"args": vars(args), "cost_model": cost.to_dict(),
                                                            "verify_call_cost": verify_call_cost,
                                                            "results": out_json}, indent=1))
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
    real, actions, _ = load_validation_episodes(args.data or cfg.data.path, cfg, args.episodes, context, args.frames)
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
    r0, a0 = real[:args.batch_size].to(device), actions[:args.batch_size].to(device)
    bench["verify_call_cost"] = measure_verify_calls(bench, r0, a0)
    print("one target call on L stacked windows per sample, in calls on one window (median of 7): "
          + ", ".join(f"L={k}: {v:.2f}" for k, v in bench["verify_call_cost"].items()))
    bench["cost"] = make_cost(args, bench, r0, a0)
    schedule, drafts, lookaheads = bench["schedule"], bench["drafts"], bench["lookaheads"]
    bandits = ["ucb", "exp3"] + ([f"ucb/{args.level_bins}bins", f"exp3/{args.level_bins}bins"]
                                 if args.level_bins > 1 else [])
    names = ["plain"] + ([] if args.skip_fixed else [f"fixed:{L} {d}" for d in drafts for L in lookaheads]) + bandits
    results = {n: {"rounds": 0, "evaluations": 0, "rows": 0, "seconds": 0.0, "frames": 0, "accepted": 0,
                   "checked": 0, "levels": {}, "specs": [], "batches": [], "cost": 0.0} for n in names}
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
                  schedule.name, bench["cost"], bench["verify_call_cost"])
    return 0


def _share(arms: list[int], n_arms: int) -> list[float]:
    return [round(arms.count(i) / max(1, len(arms)), 3) for i in range(n_arms)]


if __name__ == "__main__":
    sys.exit(main())
