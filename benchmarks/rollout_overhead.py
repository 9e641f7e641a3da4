"""Per-call and per-commit overhead of a rollout outside the network: transitions, cache and bank bookkeeping.

    python benchmarks/rollout_overhead.py                          # this tree
    python benchmarks/rollout_overhead.py --compare-tree /tmp/old  # and another checkout of the code, side by side

Times, in microseconds (median of --repeats rounds of --iters calls, 1 thread):
  transition   `PerFrameDiffusion.step` on a (1, 8, 3, 32, 32) window (the work of a rollout between two
               model calls);
  commit m     one sliding-window commit to a `KVCache` holding m frames (`last m`): append one frame of
               (64, 4, 1, 16) keys/values (tiny's factorized layout) + evict, for m = 16, 112, 448: a cost
               that grows with m is a copy of the whole cache per commit;
  bank read m  `MemoryBank.memory()` + `window_start` (what the recomputing path does per call) at m frames.
With --compare-tree the same script runs in a subprocess whose imports come from that tree (e.g. a
`git archive` of an older commit); the two take turns per round, so load drifts hit both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(iters: int) -> dict[str, float]:
    """One round of every measurement in this process (whatever tree its imports come from)."""
    # Imported here, after --one-round has put the tree to measure first on sys.path.
    import torch

    from arvdm.config import DiffusionConfig  # lazy: from the tree under measurement
    from arvdm.model.diffusion import PerFrameDiffusion  # lazy: from the tree under measurement
    from memory import KVCache, MemoryBank, RetentionPolicy  # lazy: from the tree under measurement

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    d = PerFrameDiffusion(DiffusionConfig(num_levels=1000))
    x, v = torch.randn(1, 8, 3, 32, 32), torch.randn(1, 8, 3, 32, 32)
    a = torch.arange(1, 9).mul(125).unsqueeze(0)  # (1, 8) a FIFO ramp
    b = a - 125
    t0 = time.perf_counter()
    for _ in range(iters):
        d.step(x, v, a, b)
    out["transition"] = (time.perf_counter() - t0) / iters * 1e6
    for m in (16, 112, 448):
        cache = KVCache(RetentionPolicy("last", length=m))
        bank = MemoryBank(RetentionPolicy("last", length=m))
        k = torch.randn(64, 4, 1, 16)
        frame, act = torch.randn(1, 1, 3, 32, 32), torch.zeros(1, 1, dtype=torch.long)
        for f in range(m + 8):  # fill to the window (untimed)
            cache.append(k, k, [f])
            cache.evict(f + 1)
            bank.append(frame, act)
        n = m + 8
        t0 = time.perf_counter()
        for i in range(iters):
            cache.append(k, k, [n + i])
            cache.evict(n + i + 1)
        out[f"commit {m}"] = (time.perf_counter() - t0) / iters * 1e6
        t0 = time.perf_counter()
        for _ in range(iters):
            mem = bank.memory()
            _ = mem.window_start  # what the model reads per call
        out[f"bank read {m}"] = (time.perf_counter() - t0) / iters * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare-tree", default=None, help="another checkout of the code to time side by side")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--one-round", default=None, help=argparse.SUPPRESS)  # subprocess mode: the tree to import
    args = p.parse_args(argv)
    if args.one_round:
        sys.path.insert(0, args.one_round)  # arvdm, memory, ... from that tree only
        print(json.dumps(measure(args.iters)))
        return 0
    here = str(Path(__file__).resolve().parents[1])
    trees = {"this tree": here}
    if args.compare_tree:
        trees["compare"] = str(Path(args.compare_tree).resolve())
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    for _ in range(args.repeats):
        for name, tree in trees.items():  # a fresh process per round and tree, imports from that tree only
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one-round", tree, "--iters", str(args.iters)]
            res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
            rounds[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
    keys = list(rounds["this tree"][0])
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rounds.items()}
    print(f"rollout overhead, microseconds per call (median of {args.repeats} rounds x {args.iters} calls, 1 thread)")
    head = f"{'what':<15} {'this tree':>10}" + (f" {'compare':>10} {'compare/this':>12}" if args.compare_tree else "")
    print(head)
    for k in keys:
        line = f"{k:<15} {med['this tree'][k]:>10.1f}"
        if args.compare_tree:
            line += f" {med['compare'][k]:>10.1f} {med['compare'][k] / med['this tree'][k]:>11.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
