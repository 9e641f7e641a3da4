"""Training on a multi-core CPU: one process on every core vs data-parallel ranks of one thread each.

    python benchmarks/train_processes.py                        # tiny preset: 1 process x 2 threads vs 2 ranks x 1
    python benchmarks/train_processes.py --procs 2 4 --steps 80 --rounds 3
    python benchmarks/train_processes.py --fsdp                 # and the ranks sharding the model (train.fsdp)

Both sides train the same global batch (the preset's train.batch_size; each of P ranks takes batch_size / P)
with the real `train.py` (one process: train.cpu_ranks=1), the ranks under `torchrun --standalone` (DDP over
gloo), on a small synthetic data set.
Intra-op threads share a small model's many small ops badly (on the 2-core development CPU two threads gave
~1.2-1.45x one), while ranks of one thread each run whole steps side by side and pay one gradient all-reduce
per step. Each run's speed is taken from its log.csv between the first logged step at or after `--skip` and its
last, so start-up and warm-up are left out; the configurations take turns for `--rounds` rounds and the table
gives the median and range of global-batch steps/s and the ratio to one process. `--fsdp` adds each rank count
again with `train.fsdp=true` (weights, gradients and AdamW state sharded: all-gathers before each unit's forward and
backward, a reduce-scatter after, instead of one all-reduce).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from arvdm.config import apply_overrides, get_preset  # noqa: E402
from benchmarks.common import print_table  # noqa: E402
from benchmarks.train_speed import synthetic_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def steps_per_s(log: Path, skip: int) -> float:
    """Global steps per second between the first logged step >= skip and the last logged step."""
    rows = [(int(r["step"]), float(r["elapsed_s"])) for r in csv.DictReader(log.open())]
    rows = [r for r in rows if r[0] >= skip]
    if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
        raise SystemExit(f"{log}: too few logged steps after --skip {skip}; raise --steps")
    (s0, t0), (s1, t1) = rows[0], rows[-1]
    return (s1 - s0) / (t1 - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--procs", type=int, nargs="+", default=[2], help="rank counts to compare with 1 process")
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--skip", type=int, default=20, help="steps left out of the timing (start-up, warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="also time each rank count with train.fsdp=true")
    args = p.parse_args()

    cfg = apply_overrides(get_preset(args.preset), args.overrides).validate()
    batch, threads = cfg.train.batch_size, os.cpu_count() or 1
    for n in args.procs:
        if n < 2 or batch % n:
            raise SystemExit(f"--procs {n}: need >= 2 ranks that divide train.batch_size={batch}")
    common = ["--preset", args.preset, "--max-steps", str(args.steps), *sum((["--set", o] for o in args.overrides), []),
              "--set", "train.val_every=0", "--set", "train.sample_every=0", "--set", "train.log_every=10",
              "--set", f"train.ckpt_every={10 ** 9}", "--set", "train.members=1"]  # one model (tiny has 2)
    ranks = {"1 process": (1, False), **{f"{n} ranks": (n, False) for n in args.procs},  # configuration -> (ranks,
             **{f"{n} ranks, FSDP": (n, True) for n in (args.procs if args.fsdp else [])}}  # fsdp)
    speeds: dict[str, list[float]] = {name: [] for name in ranks}
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_data(Path(tmp) / "data", cfg, episodes=8)
        for r in range(args.rounds):
            for name, (n, fsdp) in ranks.items():
                out = Path(tmp) / f"run_{r}_{n}_{int(fsdp)}"
                env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
                if n == 1:
                    env["OMP_NUM_THREADS"] = str(threads)
                    cmd = [sys.executable, "train.py"]
                    extra = ["--set", "train.cpu_ranks=1"]  # tiny launches 2 ranks by itself otherwise
                else:
                    env["OMP_NUM_THREADS"] = "1"
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                           "train.py"]
                    extra = ["--set", f"train.batch_size={batch // n}", "--set", f"train.fsdp={str(fsdp).lower()}"]
                subprocess.run(cmd + common + extra + ["--data", str(data), "--out", str(out)], cwd=REPO, env=env,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                speeds[name].append(steps_per_s(out / "log.csv", args.skip))
                print(f"round {r + 1}/{args.rounds}: {name}: {speeds[name][-1]:.3f} steps/s", flush=True)
    base = statistics.median(speeds["1 process"])
    print(f"\npreset {args.preset}, global batch {batch}, {threads} cores, {args.steps} steps per run "
          f"(timed from step {args.skip}), {args.rounds} rounds")
    print_table(["configuration", "steps/s median [range]", "vs 1 process"],
                [[name, f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]",
                  f"{statistics.median(v) / base:.2f}x"] for name, v in speeds.items()])


if __name__ == "__main__":
    main()
