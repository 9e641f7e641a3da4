"""Speculative denoising rows against plain sampling in frames/s, side by side in one run, with the repeat spread.

    python benchmarks/speculation.py --run RUN                            # plain, fixed:2/3/4, UCBSpec, EXP3Spec
    python benchmarks/speculation.py --run RUN --frames 200 --steps 50 --repeats 1 --configs plain,fixed:2,ucb,exp3
    python benchmarks/speculation.py --run RUN --draft-run SMALL_RUN      # + a smaller trained Denoiser as draft
    python benchmarks/speculation.py --run RUN --quick                    # 1 episode, 8 frames, 10 steps

On validation episodes of the run's data (the run's own config, poses passed for pose-aware models), with the
same context, actions and seeds, the configurations are (eta > 0, default 1):

- ``plain``: ``pipeline.rollout`` without speculation (one sequential target call per row);
- ``fixed:L <draft>``: every round drafts L rows and verifies them in one batched target call on L windows;
- ``ucb`` / ``exp3``: BanditSpec over the arms (L = 1 = no speculation, and every (L, draft));
- ``ucb/Nbins`` / ``exp3/Nbins`` (``--level-bins N``): one bandit per noise-level bin of the round's start.

**Timing.** Each repeat runs all configurations in lockstep (``benchmarks.common.Lockstep``): one thread per
configuration, one at a time, handing over at every target call, each charged only its own time, so a busy
stretch of a shared machine hits all of them alike. Frames/s are per repeat; the speed-up over plain is the
ratio within a repeat; the table gives the median and the range over ``--repeats``. A bandit learns over the
episodes of one repeat and starts afresh in the next. Episodes shorter than ``--context`` + ``--frames`` are
extended by repeating their last action and pose (as the rollout does past its last frame).

The bandits' reward is rows advanced per unit of cost (``arvdm.speculative.cost.CostModel``): ``--cost
measured`` (default) calibrates it here (``--calib``: whole one-AR-step rollouts of each fixed L in lockstep, or
each arm's median round timed alone), ``--cost linear:R`` uses 1 + R·(L − 1) (R = 0: the GPU model).

Also measured: one bare target call on L stacked windows over one on one window (KV state tiled as a round
does), the draft's cost per drafted row and the tile's, in target calls. Modelled, not measured: the speed-up
where a batch of L windows costs one call (rows per round, R = 0). Every configuration samples the target's
exact law (tests/test_speculative_rollout.py). Writes ``speculation.json`` and two plots into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from benchmarks.common import Lockstep, interleaved, print_table, set_threads  # noqa: E402
from data.atomic import atomic_write, atomic_write_json  # noqa: E402

MODEL_RATIOS = (0.0, 0.25, 0.5, 1.0)  # batch-cost ratios R of the modelled rows per cost of the fixed arms


class PausingModel:
    """Counts the target's calls and hands the CPU to the next configuration before each (``Lockstep.pause``);
    everything else is forwarded to the model."""

    def __init__(self, model, lockstep: Lockstep | None = None):
        self.model, self.lockstep, self.calls = model, lockstep, 0

    def __call__(self, *args, **kwargs):
        if self.lockstep is not None:
            self.lockstep.pause()
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
    p.add_argument("--episodes", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1, help="rollouts per call (acceptance is per sample)")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--schedule", default="chunked")
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--lookaheads", default="2,3,4")
    p.add_argument("--configs", default=None, help="comma list of configurations (default: plain, every fixed "
                   "arm, ucb, exp3 and the level-binned bandits); a fixed arm is fixed:L")
    p.add_argument("--repeats", type=int, default=3, help="independent repeats of the whole comparison")
    p.add_argument("--level-bins", type=int, default=0, help="also run the bandits with one copy per noise-level "
                   "bin (0: skip)")
    p.add_argument("--cost", default="measured", help="measured (calibrate on this machine) or linear:R")
    p.add_argument("--calib-steps", type=int, default=40, help="rows of the calibration AR step per arm")
    p.add_argument("--calib", default="lockstep", choices=("lockstep", "alone"), help="--cost measured prices a "
                   "round by whole calibration rollouts run in lockstep (charged time per round over plain's), or "
                   "by the median round of each arm timed alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="default RUN/benchmarks/speculation")
    p.add_argument("--quick", action="store_true", help="1 episode, 8 frames, 10 steps, 1 repeat")
    return p


def config_names(args, bench: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(every configuration, the bandits among them) from ``--configs`` or the defaults."""
    bins = [f"ucb/{args.level_bins}bins", f"exp3/{args.level_bins}bins"] if args.level_bins > 1 else []
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        names = [f"{n} {FROZEN}" if n.startswith("fixed:") and " " not in n else n for n in names]
    else:
        names = ["plain"] + [f"fixed:{L} {d}" for d in bench["drafts"] for L in bench["lookaheads"]] + ["ucb", "exp3"]
        names += bins
    if "plain" not in names:
        raise SystemExit("--configs must include plain (the speed-ups are against it)")
    return names, [n for n in names if n.split("/")[0] in ("ucb", "exp3")]


def make_spec(name: str, bench: dict[str, Any], seed: int, args):
    """The ``Speculation`` of configuration ``name`` (None for plain)."""
    if name == "plain":
        return None
    mode, _, draft = name.partition(" ")
    mode, _, binned = mode.partition("/")
    drafts = {draft: bench["drafts"][draft]} if draft else bench["drafts"]
    return make_speculation(mode, [1] + bench["lookaheads"], drafts, seed=seed,
                            level_bins=args.level_bins if binned else 1, cost=bench["cost"])


def run_config(name: str, bench: dict[str, Any], ep: tuple, seed: int, args, result: dict[str, Any],
               model: PausingModel) -> None:
    """One rollout of configuration ``name`` on the episodes ``ep`` = (video, actions, poses); counts into
    ``result`` (its time is charged by the caller's ``Lockstep``)."""
    r, a, p = ep
    spec = make_spec(name, bench, seed, args)
    if spec is not None and result["specs"] and len(result["specs"]) % bench["batches_per_repeat"]:
        # a bandit learns over the episodes of one repeat
        spec.policy = result["specs"][-1].policy
    context = bench["context"]
    rollout(model, bench["diffusion"], bench["schedule"], r[:, :context], a[:, :context], a[:, context:], args.frames,
            eta=args.eta, generator=torch.Generator().manual_seed(seed), progress=False, poses=p,
            rows=None if spec is None else SpeculativeRows(spec))
    result["frames_now"] += r.shape[0] * args.frames
    if spec is None:
        for key in ("rounds", "rows", "cost"):
            result[key] += model.calls  # one target call per row
        result["evaluations"] += model.calls * r.shape[0]
        return
    s = spec.summary()
    for key, value in (("cost", s["cost"]), ("rounds", s["target_rounds"]), ("evaluations", s["target_evaluations"]),
                       ("rows", s["rows"]), ("accepted", sum(c.accepted for c in spec.checks)),
                       ("checked", sum(c.checked for c in spec.checks))):
        result[key] += value
    width = report_bin_width(bench["num_levels"])
    for c in spec.checks:
        acc = result["levels"].setdefault(int(c.level) // width * width, [0, 0])
        acc[0] += c.accepted
        acc[1] += c.checked
    result["specs"].append(spec)
    result["batches"].append(r.shape[0])


def run_repeat(names: list[str], bench: dict[str, Any], episodes: list[tuple], args,
               results: dict[str, dict[str, Any]]) -> None:
    """One repeat: every episode batch, all configurations in lockstep; frames/s of each into its results."""
    for res in results.values():
        res["frames_now"], res["seconds_now"] = 0, 0.0
    for i, ep in enumerate(episodes):
        ls = Lockstep()
        models = {n: PausingModel(bench["model"], ls) for n in names}
        seed = args.seed + i * args.batch_size

        def job(n, ep=ep, seed=seed, models=models):
            return lambda: run_config(n, bench, ep, seed, args, results[n], models[n])

        ls.run({n: job(n) for n in names})
        for n in names:
            results[n]["seconds_now"] += ls.spent[n]
    for res in results.values():
        res["seconds"] += res["seconds_now"]
        res["frames"] += res["frames_now"]
        res["fps"].append(res["frames_now"] / res["seconds_now"])


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.3f} [{min(values):.3f}-{max(values):.3f}]" if len(values) > 1 else f"{med:.3f}"


def summarise(results: dict[str, dict[str, Any]], rounds_per_rollout: int) -> dict[str, dict[str, Any]]:
    """Per configuration the JSON row; prints the table. ``rounds_per_rollout``: rollouts x AR steps x repeats."""
    plain = results["plain"]
    table, out_json = [], {}
    for name, res in results.items():
        acceptance = res["accepted"] / res["checked"] if res["checked"] else float("nan")
        speedups = [f / p for f, p in zip(res["fps"], plain["fps"])]
        row = {"rounds_per_ar_step": res["rounds"] / rounds_per_rollout, "target_rounds": res["rounds"],
               "windows_evaluated": res["evaluations"], "rows_per_round": res["rows"] / max(1, res["rounds"]),
               "cost": res["cost"], "rows_per_cost": res["rows"] / res["cost"], "acceptance": acceptance,
               "frames_per_s": statistics.median(res["fps"]), "frames_per_s_repeats": res["fps"],
               "speedup_vs_plain": statistics.median(speedups), "speedup_vs_plain_repeats": speedups,
               "acceptance_by_level": {str(k): a / n for k, (a, n) in sorted(res["levels"].items())}}
        out_json[name] = row
        gpu = "-"
        if name.startswith("fixed:"):
            row["modelled_rows_per_cost"] = _modelled(res["specs"], res["batches"])
            gpu = f"{row['modelled_rows_per_cost']['0.0']:.2f}x"
        table.append([name, f"{row['rounds_per_ar_step']:.1f}", str(res["evaluations"]), f"{row['rows_per_round']:.2f}",
                      f"{row['rows_per_cost']:.3f}", f"{acceptance:.3f}", _spread(res["fps"]), _spread(speedups), gpu])
    print_table(["config", "rounds / AR step", "windows", "rows / round", "rows / cost", "acceptance",
                 "frames/s median [range]", "speed-up vs plain [range]", "GPU model (R=0)"], table)
    return out_json


def _modelled(specs: list, batches: list[int]) -> dict[str, float]:
    """Rows per cost of a fixed arm's rounds under the linear model 1 + R·(L − 1) for each R of MODEL_RATIOS
    (draft calls free: the frozen draft's model). At R = 0 this is the modelled speed-up over plain."""
    rows = sum(s.rows for s in specs)
    out = {}
    for ratio in MODEL_RATIOS:
        model = CostModel(batch_ratio=ratio)
        cost = sum(model.round_cost(1 if r.lookahead == 1 else r.target_states // b, FROZEN)
                   for s, b in zip(specs, batches) for r in s.rounds)
        out[str(ratio)] = rows / cost
    return out


def make_cost(args, bench: dict[str, Any], ep: tuple) -> CostModel:
    """The cost model of ``--cost``: ``linear:R``, or ``measured`` (:func:`calibrate` on these episodes)."""
    if args.cost.startswith("linear:"):
        try:
            return CostModel(batch_ratio=float(args.cost.split(":", 1)[1]))
        except ValueError as err:
            raise SystemExit(f"--cost {args.cost!r}: expected linear:R with a number R >= 0 ({err})") from err
    if args.cost != "measured":
        raise SystemExit(f"--cost {args.cost!r}: expected measured or linear:R")
    alone = calibrate(args, bench, ep)
    if args.calib == "alone":
        return alone
    return CostModel(verify_costs=calibrate_lockstep(args, bench, ep), draft_costs=alone.draft_costs)


def calibrate_lockstep(args, bench: dict[str, Any], ep: tuple, turns: int = 3) -> dict[int, float]:
    """Cost of a round of each fixed frozen arm in plain rounds: one ``--calib-steps``-row AR step per arm, all
    arms in lockstep (as the comparison runs them), charged time per round over plain's per row; median of
    ``turns`` turns after a warm-up turn."""
    schedule = get_schedule(args.schedule, bench["schedule"].window, bench["num_levels"], args.calib_steps)
    (r, a, p), context = ep, bench["context"]
    names = ["fixed:1"] + [f"fixed:{L}" for L in bench["lookaheads"]]

    def job(mode: str, model: PausingModel):
        def run():
            spec = make_speculation(mode, seed=args.seed)
            rollout(model, bench["diffusion"], schedule, r[:, :context], a[:, :context], a[:, context:], 1,
                    eta=args.eta, generator=torch.Generator().manual_seed(args.seed), progress=False, poses=p,
                    rows=SpeculativeRows(spec))
            return len(spec.rounds)
        return run

    ratios: dict[int, list[float]] = {L: [] for L in bench["lookaheads"]}
    for turn in range(turns + 1):  # turn 0 warms up
        ls = Lockstep()
        rounds = ls.run({n: job(n, PausingModel(bench["model"], ls)) for n in names})
        per_round = {n: ls.spent[n] / rounds[n] for n in names}
        for L in ratios if turn else ():
            ratios[L].append(per_round[f"fixed:{L}"] / per_round["fixed:1"])
    cost = {L: statistics.median(v) for L, v in ratios.items()}
    print(f"calibration in lockstep ({args.calib_steps} rows, {turns} turns): round cost in plain rounds: "
          + ", ".join(f"L={L}: {c:.2f}" for L, c in cost.items()) + " (the bandits' cost model)")
    return cost


@torch.no_grad()
def measure_verify_calls(bench: dict[str, Any], ep: tuple, repeats: int = 7) -> dict[str, Any]:
    """Median wall-clock of one target call on L stacked windows per sample (the KV-cached context tiled, as a
    round verifies) over one call on one window, for the lookaheads; and of tiling the state for L. The
    candidates run round-robin (``interleaved``), so drift of the machine's load hits them alike."""
    (r, a, p), model, w, ctx = ep, bench["model"], bench["schedule"].window, bench["context"]
    b = r.shape[0]
    state = model.init_state(b)
    model.commit(state, r[:, :ctx], a[:, :ctx], *([] if p is None else [p[:, :ctx], p[:, ctx:ctx + w]]))
    levels = torch.linspace(bench["num_levels"], 1, w).long().to(r.device)  # (w,)
    fns = {}
    for n in [1] + bench["lookaheads"]:
        st = state if n == 1 else tile_state(state, n)
        x = torch.randn(n * b, w, *r.shape[2:], device=r.device)  # (L·B, w, C, H, W)
        acts = a[:, ctx:ctx + w].repeat(n, 1)  # (L·B, w)
        lv = levels.expand(n * b, w)  # (L·B, w)
        fns[f"call {n}"] = lambda x=x, lv=lv, acts=acts, st=st: model(x, lv, acts, state=st)
        if n > 1:
            fns[f"tile {n}"] = lambda n=n: tile_state(state, n)
    med = {k: statistics.median(v) for k, v in interleaved(fns, repeats=repeats, warmup=1).items()}
    one = med["call 1"]
    return {"call_seconds": one, "verify_call_cost": {str(n): med[f"call {n}"] / one for n in bench["lookaheads"]},
            "tile_state_cost": {str(n): med[f"tile {n}"] / one for n in bench["lookaheads"]}}


def calibrate(args, bench: dict[str, Any], ep: tuple, repeats: int = 3) -> CostModel:
    """Median wall-clock of a full round of each fixed arm over a plain round's, on one AR step of
    ``--calib-steps`` rows, the arms in turn ``repeats`` times (the ratio to the plain round of the same turn,
    then the median over turns): verify_costs[L] from the frozen draft, each draft network's cost per call
    from its extra time over the frozen round of the same L."""
    schedule = get_schedule(args.schedule, bench["schedule"].window, bench["num_levels"], args.calib_steps)
    (r, a, p), context = ep, bench["context"]

    def median_round(mode: str, draft: str) -> float:
        spec = make_speculation(mode, drafts={draft: bench["drafts"][draft]} if draft else None, seed=args.seed)
        rollout(bench["model"], bench["diffusion"], schedule, r[:, :context], a[:, :context], a[:, context:], 1,
                eta=args.eta, generator=torch.Generator().manual_seed(args.seed), progress=False, poses=p,
                rows=SpeculativeRows(spec))
        lookahead = spec.arms[0][0]
        full = [x.seconds for x in spec.rounds if x.lookahead == 1 or x.target_states == lookahead * r.shape[0]]
        bench["calib_specs"][mode if not draft or draft == FROZEN else f"{mode} {draft}"] = (spec, r.shape[0])
        return statistics.median(full)

    bench["calib_specs"] = {}  # what round_split reads: each arm's rounds, timed outside the lockstep
    arms = [(f"fixed:{L}", d) for d in bench["drafts"] for L in bench["lookaheads"]]
    median_round("fixed:1", "")  # warm-up
    ratios: dict[tuple[str, str], list[float]] = {arm: [] for arm in arms}
    plains = []
    for _ in range(repeats):
        plains.append(median_round("fixed:1", ""))
        for arm in arms:
            ratios[arm].append(median_round(*arm) / plains[-1])
    cost = {arm: statistics.median(v) for arm, v in ratios.items()}
    verify = {L: cost[(f"fixed:{L}", FROZEN)] for L in bench["lookaheads"]}
    draft_costs = {name: max(0.0, statistics.mean((cost[(f"fixed:{L}", name)] - verify[L]) / L
                                                   for L in bench["lookaheads"]))
                   for name in bench["drafts"] if name != FROZEN}
    print(f"calibration ({args.calib_steps} rows, one AR step, batch {r.shape[0]}, {repeats} turns): plain round "
          f"{1e3 * statistics.median(plains):.1f} ms; round cost in plain rounds: "
          + ", ".join(f"L={L}: {c:.2f}" for L, c in verify.items())
          + "".join(f"; draft {n}: {c:.2f} per call" for n, c in draft_costs.items()))
    return CostModel(verify_costs=verify, draft_costs=draft_costs)


def round_split(calib: dict[str, tuple]) -> dict[str, dict[str, float]]:
    """Per fixed arm of the calibration (rounds timed alone, not in lockstep): the draft's cost per drafted row
    and the verification's per round, both over a plain row's target call (median of the fixed:1 rows)."""
    if "fixed:1" not in calib:
        return {}
    call = statistics.median(r.verify_seconds for r in calib["fixed:1"][0].rounds)
    out = {}
    for name, (spec, b) in calib.items():
        rounds = [r for r in spec.rounds if r.lookahead > 1 and r.target_states == r.lookahead * b]  # whole rounds
        if rounds:
            drafted = sum(r.lookahead for r in rounds)
            out[name] = {"draft_per_row": sum(r.draft_seconds for r in rounds) / drafted / call,
                         "verify_per_round": statistics.median(r.verify_seconds for r in rounds) / call}
    print(f"\nmeasured in the calibration rounds (plain row's target call {1e3 * call:.1f} ms): "
          + "; ".join(f"{n}: draft {v['draft_per_row']:.4f} per drafted row, verification {v['verify_per_round']:.2f}"
                      " per round" for n, v in out.items()))
    return out


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
        gaps = [f / b - 1 for f, b in zip(row["frames_per_s_repeats"], out_json[best_fps]["frames_per_s_repeats"])]
        row["gap_fps_to_best_fixed_arm"] = statistics.median(gaps)
        row["gap_fps_to_best_fixed_arm_repeats"] = gaps
        row["gap_rows_per_cost_to_best_fixed_arm"] = row["rows_per_cost"] / out_json[best_rate]["rows_per_cost"] - 1
        rounds = [r for s in results[bandit]["specs"] for r in s.rounds]
        row["regret_over_time"] = regret_over_time([r.rows for r in rounds], [r.cost for r in rounds],
                                                   out_json[best_rate]["rows_per_cost"])
        last, n_arms = [r.arm for r in rounds[len(rounds) // 2:]], len(results[bandit]["specs"][0].arms)
        row["arm_share_last_half"] = [round(last.count(i) / len(last), 3) for i in range(n_arms)]
        print(f"{bandit}: frames/s {100 * row['gap_fps_to_best_fixed_arm']:+.1f}% vs {best_fps} (repeats: "
              + ", ".join(f"{100 * g:+.1f}%" for g in gaps) + f"), rows per cost "
              f"{100 * row['gap_rows_per_cost_to_best_fixed_arm']:+.1f}% vs {best_rate}; arms' share over the last "
              f"half of the rounds {row['arm_share_last_half']}; relative cost regret at tenths of the rounds: "
              + " ".join(f"{p['relative_regret']:+.3f}" for p in row["regret_over_time"]))
    levels = sorted({int(k) for n in fixed for k in out_json[n]["acceptance_by_level"]})
    if levels:
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
                  bandits: list[str], schedule_name: str, extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "speculation.json", {"args": vars(args), **extra, "results": out_json})
    panels = {n: results[n]["specs"] for n in bandits}
    if panels:
        plot_arms(panels, out / "speculation_arms.png", f"{schedule_name}, {args.steps} steps, eta {args.eta}")
    plot_acceptance(out_json, out / "speculation_acceptance.png")
    print(f"\nwrote {out}/speculation.json, speculation_arms.png, speculation_acceptance.png")


def load_bench(args, device: torch.device) -> tuple[dict[str, Any], list[tuple]]:
    """The target, its diffusion and schedule, the drafts; the validation episode batches (video, actions,
    poses or None), actions and poses past an episode's end repeated from its last."""
    model, cfg = load_for_inference(args.run, device=device)
    schedule = get_schedule(args.schedule, cfg.train.window, cfg.diffusion.num_levels, args.steps)
    context = cfg.default_context()
    real, actions, poses = load_validation_episodes(args.data or cfg.data.path, cfg, args.episodes, context, None)
    need = context + args.frames
    if actions.shape[1] < need:  # the rollout only reads actions / poses past the context; no frame is needed
        actions = torch.cat([actions, actions[:, -1:].expand(-1, need - actions.shape[1])], dim=1)
        if poses is not None:
            poses = torch.cat([poses, poses[:, -1:].expand(-1, need - poses.shape[1], -1)], dim=1)
    drafts = {FROZEN: None}
    if args.draft_run:
        drafts[Path(args.draft_run).name] = load_for_inference(args.draft_run, device=device)[0]
    bench = {"model": model, "diffusion": PerFrameDiffusion(cfg.diffusion), "schedule": schedule, "context": context,
             "drafts": drafts, "num_levels": cfg.diffusion.num_levels,
             "lookaheads": [int(v) for v in args.lookaheads.split(",")]}
    episodes = [(real[i:i + args.batch_size, :need].to(device), actions[i:i + args.batch_size, :need].to(device),
                 None if poses is None else poses[i:i + args.batch_size, :need].to(device))
                for i in range(0, real.shape[0], args.batch_size)]
    return bench, episodes


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.eta <= 0:
        p.error("--eta must be > 0: with eta = 0 the transitions are deterministic and nothing can be accepted")
    if args.quick:
        args.episodes, args.frames, args.steps, args.repeats = 1, 8, 10, 1
    set_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    bench, episodes = load_bench(args, device)
    bench["batches_per_repeat"] = len(episodes)
    calls = measure_verify_calls(bench, episodes[0])
    print(f"one target call on one window: {1e3 * calls['call_seconds']:.1f} ms; on L stacked windows, in calls on "
          "one window (median of 7): " + ", ".join(f"L={k}: {v:.2f}" for k, v in calls["verify_call_cost"].items())
          + "; tiling the KV state for L (once per AR step): "
          + ", ".join(f"L={k}: {v:.3f}" for k, v in calls["tile_state_cost"].items()))
    bench["cost"] = make_cost(args, bench, episodes[0])
    names, bandits = config_names(args, bench)
    schedule = bench["schedule"]
    results = {n: {"rounds": 0, "evaluations": 0, "rows": 0, "seconds": 0.0, "frames": 0, "accepted": 0,
                   "checked": 0, "levels": {}, "specs": [], "batches": [], "cost": 0.0, "fps": []} for n in names}
    print(f"target {args.run} ({bench['model'].num_params() / 1e6:.2f}M params, {torch.get_num_threads()} thread(s)), "
          f"schedule {schedule.name} (w={schedule.window}, M={schedule.num_steps}), eta {args.eta}, {args.episodes} "
          f"episode(s) x {args.frames} frames, batch {args.batch_size}, {args.repeats} repeat(s), configs {names}")
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        run_repeat(names, bench, episodes, args, results)
        print(f"  repeat {rep + 1}/{args.repeats} ({time.perf_counter() - t0:.0f} s): frames/s "
              + ", ".join(f"{n} {results[n]['fps'][-1]:.3f}" for n in names), flush=True)
    out_json = summarise(results, args.repeats * len(episodes) * schedule.num_ar_steps(args.frames))
    split = round_split(bench.get("calib_specs", {}))
    compare_bandits(results, out_json, bandits)
    write_outputs(Path(args.out or Path(args.run) / "benchmarks" / "speculation"), args, results, out_json, bandits,
                  schedule.name, {"cost_model": bench["cost"].to_dict(), **calls, "round_split": split})
    return 0


if __name__ == "__main__":
    sys.exit(main())
