"""Sampling speed: KV-cached rollout vs recomputing the past at every call, and per-frame cost over time.

    python benchmarks/sampling_speed.py --quick                      # smoke test, < 1 min on 2 cores
    python benchmarks/sampling_speed.py                              # full run: ~5 min (tiny_time, busy 2-core CPU)
    python benchmarks/sampling_speed.py --set model.image_size=64 --frames 64 --steps 16

The model is the preset's `Denoiser`, randomly initialised (cost does not depend on the weights). Its
zero-initialised layers (AdaLN-Zero gates, the output layer) get random weights too, so that the past
really changes the prediction and the cached-vs-recomputed comparison is not vacuous.

1. Throughput. `arvdm.pipeline.rollout` with `use_cache=True` (per-layer KV cache of committed frames)
   vs `use_cache=False` (the Diffusion Forcing reference: the remembered past frames are re-encoded at
   every denoising call), for the chunked and FIFO schedules, the preset's retention (`last`, m frames)
   and `all`; same weights, same seed; the 8 rollouts run in lockstep (`benchmarks.common.Lockstep`: one
   at a time, switching at every model call, each charged only its own time), median of `--repeats`.
   Frames/s include the schedule's initialization stage (FIFO: w - 1 extra calls to build the ramp).
   max|diff| is between the two paths' outputs: ~1e-6 for `all` (they compute the same
   thing). For `last` the two are different functions by design: a cached frame's K/V were computed when
   it was committed, while it could still see frames that have since been evicted; the recomputing path
   re-encodes the kept frames without them.
2. Per-frame cost during one long FIFO rollout (Δ = 1, cached; `last` and `all` in lockstep): the model
   is wrapped so every denoising call is timestamped on the rollout's own clock; an AR step's cost is
   the time between the ends of consecutive AR steps (its commit, shift and M calls). Reported: the
   median cost per generated frame over the frames
   [f − span/2, f + span/2) around f = 32 and f = 256 and their ratio, for retention `last` (sliding
   window: flat, ratio ≈ 1) and `all` (the cache grows with the video: ratio > 1). The machine's load
   drifts between frame 32 and frame 256, so a third lockstep workload, a fixed-cost probe (one window
   call without memory, every other round), measures it: "load-corrected" is the ratio of step cost /
   probe cost in the same stretch. `all / last` at the same frame needs no correction.
   2b. The same contrast without drift: cached states at frame 32 and 256 (`last`, `all`) are built by
   committing frames, then one FIFO AR step (a window call + a 1-frame commit) is timed on copies of the
   four states round-robin, so they all see the same load.

Calls per generated frame are equal for both schedules (`--steps` = window: chunked M = w calls per w
frames, FIFO 1 call per frame). Threads default to 1: on a shared 2-core CPU, intra-op threads cost more
than they give at these sizes.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from arvdm.config import apply_overrides, get_preset  # noqa: E402
from arvdm.model.denoiser import Denoiser  # noqa: E402
from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.rollout import rollout  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from benchmarks.common import Lockstep, median, print_table, random_weights, set_threads  # noqa: E402


class TimedModel:
    """Delegates to a Denoiser; at every forward call hands the CPU over (`Lockstep.pause`) first, and
    records the workload's own clock (`Lockstep.clock`) when the call ends."""

    def __init__(self, model: Denoiser, lockstep: Lockstep):
        self._model, self._lockstep = model, lockstep
        self.stamps: list[float] = []  # own clock at the end of each call
        self.walls: list[float] = []  # wall clock at the end of each call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._lockstep.pause()
        out = self._model(*args, **kwargs)
        self.stamps.append(self._lockstep.clock())
        self.walls.append(time.perf_counter())
        return out


def build_models(args: argparse.Namespace) -> tuple[dict[str, Denoiser], Any]:
    """One model per retention (`last` = the preset's, `all`), identical weights."""
    cfg = apply_overrides(get_preset(args.preset), list(args.set))
    cfg.validate()
    torch.manual_seed(args.seed)
    base = random_weights(Denoiser(cfg).eval())  # AdaLN-Zero / zero output layer: random too
    models = {}
    for retention in ("last", "all"):
        c = apply_overrides(get_preset(args.preset), list(args.set) + [f"memory.retention={retention}"])
        m = Denoiser(c).eval()
        m.load_state_dict(base.state_dict())
        models[retention] = m
    return models, cfg


def make_inputs(cfg: Any, n_ctx: int, n_frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    s, ch = cfg.model.image_size, cfg.model.channels
    ctx = torch.rand(1, n_ctx, ch, s, s, generator=g) * 2 - 1  # (1, C, ch, H, W)
    ctx_act = torch.randint(0, cfg.model.num_actions, (1, n_ctx), generator=g)
    act = torch.randint(0, cfg.model.num_actions, (1, n_frames), generator=g)
    return ctx, ctx_act, act


@torch.no_grad()
def warm_up(model: Denoiser, ctx: torch.Tensor, ctx_act: torch.Tensor, w: int) -> None:
    x = torch.randn(1, w, *ctx.shape[2:])
    levels = torch.full((1, w), model.num_levels // 2, dtype=torch.long)
    acts = torch.zeros(1, w, dtype=torch.long)
    state = model.init_state(1)
    if ctx.shape[1]:
        model.commit(state, ctx, ctx_act)
    model(x, levels, acts, state=state)
    model(x, levels, acts, memory=state.bank.memory())


def part1_throughput(args, models, cfg, diffusion) -> None:
    w = cfg.train.window
    ctx, ctx_act, act = make_inputs(cfg, args.context, args.frames, args.seed)
    configs = [(name, ret) for name in args.schedules for ret in args.retentions]
    scheds = {name: get_schedule(name, w, cfg.diffusion.num_levels, steps=args.steps) for name in args.schedules}
    ls = Lockstep()

    def go(name: str, ret: str, use_cache: bool, n: int = args.frames, context: torch.Tensor = ctx):
        return lambda: rollout(TimedModel(models[ret], ls), diffusion, scheds[name], context, ctx_act, act, n,
                               eta=args.eta, generator=torch.Generator().manual_seed(args.seed + 1),
                               use_cache=use_cache, progress=False)

    for ret in args.retentions:  # warm-up: one window call per path and a commit, untimed
        warm_up(models[ret], ctx, ctx_act, w)
    fns = {(name, ret, mode): go(name, ret, mode == "cache")
           for name, ret in configs for mode in ("cache", "recompute")}
    t0 = time.perf_counter()
    times: dict[Any, list[float]] = {key: [] for key in fns}
    outs: dict[Any, torch.Tensor] = {}
    for r in range(args.repeats):  # all 8 rollouts in lockstep, switching at every model call
        res = ls.run(fns)
        if r == 0:
            outs = res
        for key in fns:
            times[key].append(ls.spent[key])
    print(f"(part 1 took {time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for name, ret in configs:
        fc = args.frames / median(times[(name, ret, "cache")])
        fr = args.frames / median(times[(name, ret, "recompute")])
        diff = (outs[(name, ret, "cache")] - outs[(name, ret, "recompute")]).abs().max().item()
        mem = f"last {cfg.memory.length}" if ret == "last" else "all"
        rows.append([name, scheds[name].delta, mem, f"{fc:.2f}", f"{fr:.2f}", f"{fc / fr:.2f}x", f"{diff:.1e}"])
    print_table(["schedule", "delta", "retention", "cache fr/s", "recompute fr/s", "speedup", "max|diff|"], rows,
                title=f"\n[1] throughput: {args.frames} frames after {args.context} context frames, median of "
                      f"{args.repeats} (the {len(fns)} rollouts run in lockstep, switching at every model call)")
    print("max|diff| = cached vs recomputed output: equal up to fp32 rounding for `all`; for `last` they differ by "
          "design (a cached frame's K/V were computed while since-evicted frames were still visible)", flush=True)
    # not vacuous: the past changes what is generated (same seed, context negated)
    n = min(args.frames, 2 * w)
    name, ret = configs[0]
    flipped = go(name, ret, True, n=n, context=-ctx)()
    base = outs[(name, ret, "cache")][:, :n]
    print(f"past matters: max|rollout(context) - rollout(-context)| = {(base - flipped).abs().max().item():.2f} "
          f"({name}, {ret}, first {n} frames)", flush=True)


def part2_flat(args, models, cfg, diffusion) -> None:
    w, early, late, half = cfg.train.window, args.early, args.late, args.span // 2
    n = late + half
    sched = get_schedule("fifo", w, cfg.diffusion.num_levels, steps=args.steps)
    ctx, ctx_act, act = make_inputs(cfg, args.context, n, args.seed)
    M, n_init = sched.num_steps, sched.init_steps
    ls = Lockstep()
    rets = ("last", "all")
    # steps[ret] = one list per repeat of (frame, seconds per frame, wall clock at the step's end)
    steps: dict[str, list[list[tuple[int, float, float]]]] = {ret: [] for ret in rets}
    probes: list[list[tuple[float, float]]] = []  # per repeat: (wall clock, seconds of one probe call)
    done: set[str] = set()

    def go(ret: str):
        def fn():
            tm = TimedModel(models[ret], ls)
            try:
                rollout(tm, diffusion, sched, ctx, ctx_act, act, n, eta=args.eta,
                        generator=torch.Generator().manual_seed(args.seed + 1), use_cache=True, progress=False)
            finally:
                done.add(ret)  # also on an error: the probe stops when both rollouts have ended
            ends = [n_init + (a + 1) * M - 1 for a in range(sched.num_ar_steps(n))]  # call index ending step a
            rec = []
            for a in range(1, len(ends)):  # AR step a: commit of step a-1, shift, M calls
                dt = (tm.stamps[ends[a]] - tm.stamps[ends[a - 1]]) / sched.delta
                rec += [(f, dt, tm.walls[ends[a]]) for f in range(a * sched.delta, (a + 1) * sched.delta)]
            steps[ret].append(rec)
        return fn

    @torch.no_grad()
    def probe():  # a fixed-cost call (the window alone, no memory) every other round: the machine's load
        x = torch.randn(1, w, *ctx.shape[2:])
        levels = torch.full((1, w), cfg.diffusion.num_levels // 2, dtype=torch.long)
        rec = []
        while len(done) < len(rets):
            ls.pause()
            ls.pause()
            t0 = ls.clock()
            models["last"](x, levels, act[:, :w])
            rec.append((time.perf_counter(), ls.clock() - t0))
        probes.append(rec)

    for ret in rets:
        warm_up(models[ret], ctx, ctx_act, w)
    t0 = time.perf_counter()
    for _ in range(args.long_repeats):  # the two rollouts + the probe in lockstep, switching at every call
        done.clear()
        ls.run({**{ret: go(ret) for ret in rets}, "probe": probe})
    print(f"(part 2 took {time.perf_counter() - t0:.0f} s)", flush=True)

    def around(ret: str, f: int) -> tuple[float, float]:
        """Median seconds/frame over frames f-half..f+half-1, raw and divided by the probe's median then."""
        raw, norm = [], []
        for rec, prb in zip(steps[ret], probes):
            sel = [(dt, wall) for g, dt, wall in rec if f - half <= g < f + half]
            lo, hi = min(wl for _, wl in sel) - 1e-9, max(wl for _, wl in sel)
            p = [pt for wl, pt in prb if lo - (hi - lo) / len(sel) <= wl <= hi]  # the probe calls of that stretch
            raw += [dt for dt, _ in sel]
            norm += [dt / median(p) for dt, _ in sel] if p else []
        return median(raw), (median(norm) if norm else float("nan"))

    rows, cost = [], {}
    for ret in rets:
        (e, en), (l_, ln) = cost[ret] = around(ret, early), around(ret, late)
        kept = (lambda f: min(cfg.memory.length, args.context + f)) if ret == "last" else (lambda f: args.context + f)
        rows.append([f"last {cfg.memory.length}" if ret == "last" else "all", f"{kept(early)} -> {kept(late)}",
                     f"{1e3 * e:.1f}", f"{1e3 * l_:.1f}", f"{l_ / e:.2f}", f"{ln / en:.2f}"])
    print_table(["retention", "cached frames", f"ms/frame @{early}", f"ms/frame @{late}", f"ratio {late}/{early}",
                 "load-corrected"],
                rows, title=f"\n[2] per-frame cost in one {n}-frame cached FIFO rollout (median over frames "
                            f"f-{half}..f+{half - 1}, {args.long_repeats} rollout(s) each, last and all in lockstep)")
    print(f"load-corrected = ratio of (step cost / median cost of a fixed probe call run in the same stretch); "
          f"all / last at the same frame (same moments, load cancels): "
          f"@{early} {cost['all'][0][0] / cost['last'][0][0]:.2f}, "
          f"@{late} {cost['all'][1][0] / cost['last'][1][0]:.2f}", flush=True)


@torch.no_grad()
def part2b_same_moment(args, models, cfg) -> None:
    """One FIFO AR step (1 call on the window + a 1-frame commit) on states at frame `early` and `late`,
    timed round-robin on copies of the states, so every state sees the same machine load."""
    w, early, late = cfg.train.window, args.early, args.late
    ctx, ctx_act, act = make_inputs(cfg, args.context, late + 1, args.seed)
    g = torch.Generator().manual_seed(args.seed + 2)
    x = torch.randn(1, w, *ctx.shape[2:], generator=g)
    levels = torch.arange(1, w + 1).mul(cfg.diffusion.num_levels // w).unsqueeze(0)  # (1, w) a FIFO ramp
    snaps = {}
    for ret in ("last", "all"):
        model, state = models[ret], models[ret].init_state(1)
        if ctx.shape[1]:
            model.commit(state, ctx, ctx_act)
        for f in range(late):  # commit frames one at a time, as FIFO does (content does not matter for cost)
            if f == early:
                snaps[(ret, early)] = copy.deepcopy(state)
            model.commit(state, x[:, :1], act[:, f:f + 1])
        snaps[(ret, late)] = copy.deepcopy(state)
    times: dict[Any, list[float]] = {key: [] for key in snaps}
    for r in range(1 + args.check_repeats):  # round 0 is a warm-up
        for (ret, f), snap in snaps.items():
            state = copy.deepcopy(snap)  # untimed: the step mutates its state
            t0 = time.perf_counter()
            models[ret](x, levels, act[:, f:f + w] if f + w <= act.shape[1] else act[:, -w:], state=state)
            models[ret].commit(state, x[:, :1], act[:, f:f + 1])
            if r:
                times[(ret, f)].append(time.perf_counter() - t0)
    rows = []
    for ret in ("last", "all"):
        a, b = median(times[(ret, early)]), median(times[(ret, late)])
        rows.append([f"last {cfg.memory.length}" if ret == "last" else "all",
                     f"{len(snaps[(ret, early)].bank)} -> {len(snaps[(ret, late)].bank)}",
                     f"{1e3 * a:.1f}", f"{1e3 * b:.1f}", f"{b / a:.2f}"])
    print_table(["retention", "cached frames", f"ms/step @{early}", f"ms/step @{late}", f"ratio {late}/{early}"],
                rows, title=f"\n[2b] one FIFO AR step (1 call + 1-frame commit) on the cached state at frame {early} "
                            f"vs {late}, the 4 states timed round-robin, median of {args.check_repeats}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    # tiny_time: retention `last` against `all` needs memory chosen by time (the tiny preset's pose-chosen memory
    # keeps every frame as a candidate and refuses memory.retention=all)
    p.add_argument("--preset", default="tiny_time", help="config preset with time-chosen memory (default tiny_time)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--frames", type=int, default=None, help="frames per rollout in part 1 (default 32; quick 16)")
    p.add_argument("--steps", type=int, default=None, help="denoising calls per frame from K to 0 (default: window)")
    p.add_argument("--context", type=int, default=None, help="context frames (default: the window)")
    p.add_argument("--early", type=int, default=None, help="part 2: early frame (default 32; quick 16)")
    p.add_argument("--late", type=int, default=None, help="part 2: late frame (default 256; quick 16)")
    p.add_argument("--span", type=int, default=None, help="part 2: frames around early/late to take the median of "
                   "(default 16; quick 8)")
    p.add_argument("--repeats", type=int, default=None, help="part 1 timed repeats (default 5; quick 1)")
    p.add_argument("--long-repeats", type=int, default=None, help="part 2 rollouts per retention (default 3; quick 1)")
    p.add_argument("--eta", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke test (< 1 min): 16 frames, 1 repeat, frames 8 vs 16 in part 2")
    p.add_argument("--check-repeats", type=int, default=None,
                   help="part 2b: same-moment AR steps timed per state (default 30; quick 5)")
    p.add_argument("--skip", choices=("1", "2"), default=None, help="skip part 1 or part 2")
    p.add_argument("--schedules", nargs="+", default=["chunked", "fifo"], choices=["chunked", "fifo"],
                   help="part 1: schedules to compare (default both)")
    p.add_argument("--retentions", nargs="+", default=["last", "all"], choices=["last", "all"],
                   help="part 1: retentions to compare (default both; `last` = memory.length frames)")
    args = p.parse_args(argv)
    q = args.quick
    args.frames = args.frames or (16 if q else 32)
    args.early = args.early if args.early is not None else (8 if q else 32)
    args.late = args.late if args.late is not None else (16 if q else 256)
    args.check_repeats = args.check_repeats or (5 if q else 30)
    args.span = args.span or (8 if q else 16)
    args.repeats = args.repeats or (1 if q else 5)
    args.long_repeats = args.long_repeats or (1 if q else 3)
    if args.late <= args.early or args.early < args.span // 2 + 1:
        p.error(f"need span/2 < early < late, got early={args.early}, late={args.late}, span={args.span}")

    threads = set_threads(args.threads)
    models, cfg = build_models(args)
    args.context = cfg.train.window if args.context is None else args.context
    args.steps = args.steps or cfg.train.window
    diffusion = PerFrameDiffusion(cfg.diffusion)
    mc = cfg.model
    print(f"sampling_speed: preset={args.preset} overrides={args.set or '-'} | {mc.image_size}px patch {mc.patch_size} "
          f"dim {mc.dim} depth {mc.depth} {mc.temporal_attention} | window {cfg.train.window}, memory "
          f"{cfg.memory.structure} m={cfg.memory.length}, K={cfg.diffusion.num_levels}, steps/frame={args.steps}, "
          f"eta={args.eta} | {models['last'].num_params() / 1e6:.2f}M params | torch {torch.__version__}, "
          f"threads={threads}, batch 1, fp32, cpu", flush=True)
    t0 = time.perf_counter()
    if args.skip != "1":
        part1_throughput(args, models, cfg, diffusion)
    if args.skip != "2":
        part2_flat(args, models, cfg, diffusion)
        part2b_same_moment(args, models, cfg)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
