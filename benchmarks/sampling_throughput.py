"""Sampling throughput on a device: cached rollouts eager and torch.compile'd, against recomputing the past.

    python benchmarks/sampling_throughput.py --device cuda --bf16          # paper preset, 64 px, on a GPU
    python benchmarks/sampling_throughput.py --smoke                       # tiny shapes on the CPU (< 1 min)
    python benchmarks/sampling_throughput.py --run RUN_DIR --device cuda   # a trained model instead

Rollouts of `--frames` frames after a window of context frames with `pipeline.rollout`, batch `--batch`,
for three modes: the KV-cached rollout (eager), the same with `arvdm.sampling.compile_for_sampling`, and
the recomputing rollout (`use_cache=False`, the Diffusion Forcing reference). Every mode first runs one
untimed rollout (torch.compile compiles there), then `--repeats` timed ones, CUDA-synchronised; the table
gives the median frames/s (batch x frames / seconds) and the ratio to the eager cached rollout. Random
weights (zero-initialised layers randomised) unless --run: the cost does not depend on the weights.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arvdm.config import apply_overrides, get_preset  # noqa: E402
from arvdm.model.denoiser import Denoiser  # noqa: E402
from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.rollout import rollout  # noqa: E402
from arvdm.pipeline.runs import load_for_inference  # noqa: E402
from arvdm.sampling import compile_for_sampling  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from benchmarks.common import random_weights  # noqa: E402

SMOKE = ["model.image_size=16", "model.patch_size=4", "model.dim=32", "model.depth=1", "model.heads=2",
         "memory.length=4", "train.window=4"]


def build(args) -> tuple[torch.nn.Module, object]:
    if args.run:
        return load_for_inference(args.run, device=args.device)
    cfg = apply_overrides(get_preset(args.preset), (SMOKE if args.smoke else []) + list(args.set)).validate()
    torch.manual_seed(0)
    model = random_weights(Denoiser(cfg).eval())  # AdaLN-Zero / zero output layer random too: v depends on the past
    return model.to(args.device), cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="paper")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--run", default=None, help="a train.py run folder (default: random weights of --preset)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument("--schedule", default="fifo")
    p.add_argument("--steps", type=int, default=None, help="denoising calls per frame (default: the window)")
    p.add_argument("--frames", type=int, default=None, help="frames per rollout (default 64; smoke 8)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="timed rollouts per mode (default 3; smoke 1)")
    p.add_argument("--modes", nargs="+", default=["cached", "compiled", "recompute"],
                   choices=["cached", "compiled", "recompute"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU check that the script runs")
    args = p.parse_args(argv)
    args.frames = args.frames or (8 if args.smoke else 64)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    model, cfg = build(args)
    dev = torch.device(args.device)
    w = cfg.train.window
    sched = get_schedule(args.schedule, w, cfg.diffusion.num_levels, args.steps or w)
    diffusion = PerFrameDiffusion(cfg.diffusion)
    g = torch.Generator().manual_seed(0)
    s, ch = cfg.model.image_size, cfg.model.channels
    ctx = (torch.rand(args.batch, w, ch, s, s, generator=g) * 2 - 1).to(dev)  # (B, w, ch, H, W)
    ctx_act = torch.randint(0, cfg.model.num_actions, (args.batch, w), generator=g).to(dev)
    act = torch.randint(0, cfg.model.num_actions, (args.batch, args.frames), generator=g).to(dev)
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    nets = {"cached": model, "recompute": model}
    if "compiled" in args.modes:
        nets["compiled"] = compile_for_sampling(model)

    def run(mode: str, n: int) -> torch.Tensor:
        with autocast():
            return rollout(nets[mode], diffusion, sched, ctx, ctx_act, act, n, eta=0.0,
                           use_cache=mode != "recompute", generator=torch.Generator().manual_seed(1), progress=False)

    times: dict[str, list[float]] = {m: [] for m in args.modes}
    outs, warm = {}, {}
    for mode in args.modes:
        t0 = time.perf_counter()
        run(mode, args.frames)
        sync()
        warm[mode] = time.perf_counter() - t0
    for _ in tqdm(range(args.repeats), desc="repeats", leave=False):
        for mode in args.modes:  # modes take turns, so load drifts hit them alike
            sync()
            t0 = time.perf_counter()
            outs[mode] = run(mode, args.frames)
            sync()
            times[mode].append(time.perf_counter() - t0)
    mc = cfg.model
    print(f"sampling_throughput: {'run ' + args.run if args.run else 'preset ' + cfg.preset} "
          f"{' '.join(args.set)} | {mc.image_size}px patch {mc.patch_size} dim {mc.dim} depth {mc.depth} "
          f"{mc.temporal_attention} | {args.schedule} w={w} steps/frame={args.steps or w}, "
          f"memory {cfg.memory.structure} "
          f"{cfg.memory.retention} {cfg.memory.length} | {args.frames} frames x batch {args.batch} | {dev}"
          f"{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}")
    base = statistics.median(times["cached"]) if "cached" in times else None
    print(f"{'mode':<10} {'first s':>8} {'frames/s':>9} {'vs cached':>9} {'max|diff| vs cached':>20}")
    for mode in args.modes:
        t = statistics.median(times[mode])
        diff = (outs[mode].float() - outs["cached"].float()).abs().max().item() if "cached" in outs else float("nan")
        ratio = f"{base / t:.2f}x" if base else "n/a"
        print(f"{mode:<10} {warm[mode]:>8.1f} {args.batch * args.frames / t:>9.2f} {ratio:>9} {diff:>20.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
