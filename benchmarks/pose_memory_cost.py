"""Per-frame rollout cost with memory chosen by pose, at frame 32 vs frame 1,000 (and past the bank's capacity).

    python benchmarks/pose_memory_cost.py                  # the tiny preset, CPU, ~2 minutes
    python benchmarks/pose_memory_cost.py --device cuda

A pose-aware model (memory.select=pose) chooses each window's memory from its bank by pose, then builds the
memory's keys/values once per window (memory/select.py, `Denoiser.commit`). The cost of one AR step is the
commit (append to the bank, choose, run the chosen + recent frames through the network) plus `--steps` denoising
calls on the window; the bank grows to `memory.bank_size` frames and then drops redundant views. The script
fills a rollout state with L frames along a random walk (commits of one window each), then times AR steps at
that point; per-frame cost = step time / window. Timings are interleaved over the fill lengths and repeated
(`--repeats`), so the ratios compare like with like on a noisy machine; the spread (min-max of the repeats) is
printed beside each median.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from arvdm.config import get_preset
from arvdm.model.denoiser import Denoiser


def walk(n: int, b: int, g: torch.Generator) -> torch.Tensor:
    """(B, n, 3) poses of a random walk in a 9 x 9 maze: 0.25 cells a step, turns of 18 degrees."""
    turn = (torch.randint(-1, 2, (b, n), generator=g) * math.radians(18)).cumsum(1)  # (B, n)
    step = torch.stack([turn.cos(), turn.sin()], -1) * 0.25  # (B, n, 2)
    xy = (step.cumsum(1) % 9.0)  # (B, n, 2) wrapped inside the maze
    return torch.cat([xy, turn[..., None]], -1)


@torch.no_grad()
def fill(model: Denoiser, n: int, args, g: torch.Generator):
    """A rollout state with n committed frames (commits of one window), and the poses of the walk."""
    b, w, s = args.batch, args.window, model.image_size
    poses = walk(n + 2 * w * (args.repeats + 1), b, g)
    state = model.init_state(b)
    for i in range(0, n, w):
        frames = torch.rand(b, w, 3, s, s, generator=g).to(args.device) * 2 - 1
        model.commit(state, frames, torch.zeros(b, w, dtype=torch.long, device=args.device),
                     poses[:, i:i + w].to(args.device), poses[:, i + w:i + 2 * w].to(args.device))
    return state, poses


@torch.no_grad()
def ar_step_seconds(model: Denoiser, state, poses, n: int, args) -> float:
    """Wall-clock of one AR step at frame n: `--steps` denoising calls, then the commit (choose + memory K/V)."""
    b, w, s = args.batch, args.window, model.image_size
    x = torch.randn(b, w, 3, s, s, device=args.device)
    levels = torch.full((b, w), 500 % (model.num_levels + 1), dtype=torch.long, device=args.device)
    acts = torch.zeros(b, w, dtype=torch.long, device=args.device)
    _sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        model(x, levels, acts, state=state)
    model.commit(state, x, acts, poses[:, n:n + w].to(args.device), poses[:, n + w:n + 2 * w].to(args.device))
    _sync(args.device)
    return time.perf_counter() - t0


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fills", default="32,1000,3000", help="frames committed before timing")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="denoising calls per AR step (chunked schedule)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    model = Denoiser(cfg).to(args.device).eval()
    args.window = cfg.train.window
    fills = [int(v) // args.window * args.window for v in args.fills.split(",")]
    g = torch.Generator().manual_seed(0)
    states = {n: fill(model, n, args, g) for n in fills}
    times = {n: [] for n in fills}
    for _ in range(args.repeats):  # interleaved: each repeat times every fill length once
        for n in fills:
            state, poses = states[n]
            # the walk's poses past the fill are the window's (a timed commit grows the state by one window)
            times[n].append(ar_step_seconds(model, state, poses, n, args) / args.window)
    base = statistics.median(times[fills[0]])
    print(f"tiny preset, memory.select=pose (k={cfg.memory.pose_frames} chosen + "
          f"{cfg.memory.length - cfg.memory.pose_frames} recent), bank_size={cfg.memory.bank_size}, "
          f"window {args.window}, {args.steps} calls per AR step, batch {args.batch}, {args.device}")
    print(f"{'frame':>6} {'bank frames':>12} {'ms/frame (median)':>18} {'spread':>16} {'ratio vs first':>15}")
    for n in fills:
        med = statistics.median(times[n])
        kept = len(states[n][0].bank)
        print(f"{n:>6} {kept:>12} {1e3 * med:>18.2f} {1e3 * min(times[n]):>7.2f}-{1e3 * max(times[n]):<8.2f} "
              f"{med / base:>15.3f}")


if __name__ == "__main__":
    main()
