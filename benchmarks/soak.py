"""Soak: one 1,000-frame cached rollout keeps its memory flat under sink + recent retention.

    python benchmarks/soak.py                          # random tiny model (what is measured is memory)
    python benchmarks/soak.py --run runs/tiny          # a trained run's EMA weights
    python benchmarks/soak.py --frames 1000 --every 50 --warmup 100 --sink 2 --recent 6

One `pipeline.rollout` of `--frames` frames with the KV cache on (prepend memory, chunked schedule). Every
commit (Δ frames leaving the window) is watched: at each multiple of `--every` frames the script samples
the process's resident memory (RSS), the frames held by the per-layer KV caches and by the memory bank,
and the model-side state bytes, and it checks the committed frames for NaN/Inf. Pass criteria (exit 1
otherwise): RSS last / first sample after `--warmup` frames <= `--max-growth` (1.1), KV-cache frames never
above sink + recent, no NaN/Inf anywhere. The same rollout with retention `all` runs beside it (unless
`--no-contrast`) to show what an unbounded cache does over the same frames.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/soak.py` from the repo root

from arvdm.config import apply_overrides, get_preset  # noqa: E402
from arvdm.model.denoiser import Denoiser  # noqa: E402
from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.rollout import rollout  # noqa: E402
from arvdm.pipeline.runs import load_for_inference  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from benchmarks.common import print_table, set_threads  # noqa: E402


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil  # lazy: optional, only where /proc is missing

        return psutil.Process().memory_info().rss


def build_model(args) -> Denoiser:
    """The run's EMA model with its retention switched to the one asked for, or a random tiny model.

    Retention only decides which past frames the caches keep, not the weights, so a trained run can be
    soaked under any policy.
    """
    retention = [f"memory.retention={args.retention}", f"memory.sink={args.sink}", f"memory.recent={args.recent}",
                 f"memory.length={args.sink + args.recent}"]
    if args.run:
        model, cfg = load_for_inference(args.run, device="cpu")
        if cfg.memory.structure != "prepend" or cfg.memory.compressor != "none":
            raise SystemExit(f"soak.py: error: {args.run} uses memory.structure={cfg.memory.structure}, "
                             f"compressor={cfg.memory.compressor}; the KV-cache soak needs raw prepend memory")
        model.cfg = apply_overrides(cfg, retention).validate()
        return model.eval()
    cfg = apply_overrides(get_preset("tiny_time"), [f"model.image_size={args.image}", "model.num_actions=6",
                                               "memory.structure=prepend", *retention]).validate()
    torch.manual_seed(0)
    return Denoiser(cfg).eval()


def soak(model: Denoiser, args) -> list[dict]:
    """One cached rollout; a row per `--every` frames: frames, RSS, cache/bank frames, state bytes, finite."""
    cfg = model.cfg
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, args.steps)
    rows: list[dict] = []
    state_ref: dict = {}
    commit, init_state = model.commit, model.init_state

    def watched_init_state(*a, **kw):
        state_ref["state"] = init_state(*a, **kw)
        return state_ref["state"]

    def watched_commit(state, frames, actions, *a, **kw):
        finite = bool(torch.isfinite(frames).all())
        before = state.n_committed
        commit(state, frames, actions, *a, **kw)
        if before // args.every != state.n_committed // args.every or not finite:
            gc.collect()
            rows.append({"frames": state.n_committed, "rss": rss_bytes(),
                         "cache_frames": max((c.num_frames for c in state.caches), default=0),
                         "bank_frames": len(state.bank), "state_bytes": state.nbytes(), "finite": finite})

    model.init_state, model.commit = watched_init_state, watched_commit  # instance attributes: this model only
    try:
        g = torch.Generator().manual_seed(args.seed)
        shape = (1, args.context, cfg.model.channels, cfg.model.image_size, cfg.model.image_size)
        context = torch.rand(shape, generator=g) * 2 - 1  # (1, ctx, C, H, W)
        context_actions = torch.randint(0, cfg.model.num_actions, (1, args.context), generator=g)
        actions = torch.randint(0, cfg.model.num_actions, (1, args.frames), generator=g)
        video = rollout(model, diffusion, schedule, context, context_actions, actions, args.frames,
                        generator=g, progress=True)  # (1, frames, C, H, W)
    finally:
        del model.init_state, model.commit
    rows.append({"frames": args.context + args.frames, "rss": rss_bytes(), "cache_frames": rows[-1]["cache_frames"],
                 "bank_frames": rows[-1]["bank_frames"], "state_bytes": rows[-1]["state_bytes"],
                 "finite": bool(torch.isfinite(video).all()), "output": True})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="run folder (default: a random tiny model)")
    p.add_argument("--frames", type=int, default=1000, help="frames to generate (default 1000)")
    p.add_argument("--every", type=int, default=50, help="sample every N committed frames (default 50)")
    p.add_argument("--warmup", type=int, default=100, help="frames before the first RSS sample that counts")
    p.add_argument("--sink", type=int, default=2)
    p.add_argument("--recent", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="denoising calls per frame (memory does not depend on it)")
    p.add_argument("--context", type=int, default=8)
    p.add_argument("--image", type=int, default=32, help="frame size of the random model")
    p.add_argument("--max-growth", type=float, default=1.1)
    p.add_argument("--no-contrast", action="store_true", help="skip the retention=all run beside it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for flag, value in (("--frames", args.frames), ("--every", args.every), ("--recent", args.recent),
                        ("--steps", args.steps), ("--context", args.context)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.sink < 0 or args.warmup < 0 or args.warmup >= args.frames:
        p.error("need --sink >= 0 and 0 <= --warmup < --frames")
    set_threads(args.threads)

    results = {}
    for retention in ["sink_recent"] + ([] if args.no_contrast else ["all"]):
        args.retention = retention
        model = build_model(args)
        print(f"soak: {retention}, {args.frames} frames, {model.num_params() / 1e6:.2f}M params, "
              f"window {model.cfg.train.window}, {args.steps} steps", file=sys.stderr)
        results[retention] = soak(model, args)
        del model
        gc.collect()

    rows = results["sink_recent"]
    counted = [r for r in rows if r["frames"] >= args.warmup]
    growth = counted[-1]["rss"] / counted[0]["rss"]
    bound = args.sink + args.recent
    table = []
    for r in rows:
        other = next((o for o in results.get("all", []) if o["frames"] == r["frames"]), None)
        table.append([r["frames"], f"{r['rss'] / 2**20:.1f}", r["cache_frames"], r["bank_frames"],
                      f"{r['state_bytes'] / 2**10:.0f}", "yes" if r["finite"] else "NO",
                      f"{other['rss'] / 2**20:.1f}" if other else "", other["cache_frames"] if other else "",
                      f"{other['state_bytes'] / 2**10:.0f}" if other else ""])
    print_table(["frames", "RSS MiB", "cache frames", "bank frames", "state KiB", "finite",
                 "all: RSS MiB", "all: cache frames", "all: state KiB"], table)
    max_cache = max(r["cache_frames"] for r in rows)
    finite = all(r["finite"] for r in rows)
    print(f"\nsink_recent (sink {args.sink} + recent {args.recent}): RSS last/first after {args.warmup} frames = "
          f"{growth:.3f} (limit {args.max_growth}); max KV-cache frames {max_cache} (bound {bound}); "
          f"all finite: {finite}")
    if "all" in results:
        a = [r for r in results["all"] if r["frames"] >= args.warmup]
        print(f"retention all, same frames: RSS last/first = {a[-1]['rss'] / a[0]['rss']:.3f}; "
              f"KV-cache frames {a[0]['cache_frames']} -> {a[-1]['cache_frames']}; state bytes x"
              f"{a[-1]['state_bytes'] / max(1, a[0]['state_bytes']):.1f}")
    ok = growth <= args.max_growth and max_cache <= bound and finite
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
