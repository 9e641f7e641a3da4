r"""Train an auto-regressive video diffusion model (diffusion forcing, with memory).

One CPU (the `tiny` preset; generates a small Memory Maze data set first if datasets/memory_maze_32_mixed is absent,
then trains as 2 data-parallel ranks of one thread each, train.cpu_ranks; --set train.cpu_ranks=1 for one process):
    python train.py
One GPU:
    python train.py --preset paper --data datasets/memory_maze --out runs/paper
Several GPUs on one node (DistributedDataParallel; batch_size is per GPU):
    torchrun --standalone --nproc_per_node 8 train.py --preset paper --data datasets/memory_maze
A model that outgrows one GPU: shard weights, gradients and optimizer state over the ranks (FSDP) instead of DDP:
    torchrun --standalone --nproc_per_node 8 train.py --preset paper --data datasets/memory_maze --set train.fsdp=true
Several nodes (run on every node; data and --out on a shared filesystem):
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint HOST:29500 train.py --preset paper --data datasets/memory_maze
Resume a killed run exactly (the newest complete checkpoint in --out):
    python train.py --out runs/tiny --resume
Overrides (any Config key, repeatable):
    python train.py --set memory.length=16 --set memory.structure=cross_attention --max-steps 500
Hybrid-attention fine-tune (the lazy layers of RUN/lazy_ratios.json train with streaming masks):
    python train.py --out RUN --resume --max-steps 600 --set hybrid.fraction=0.5 --set hybrid.select=offline
Rollout-trained fine-tune (the EMA model generates each clip's recent memory frames; docs/training.md):
    cp -r runs/tiny runs/tiny_ft && python train.py --out runs/tiny_ft --resume --max-steps 1450 \
        --set train.rollout_frames=4

Writes to --out: checkpoints/step_NNNNNNN/ (last two kept), log.csv, samples/step_NNNNNNN.mp4; with train.members=M
(tiny: 2, the second forked from step 875, train.member_fork, and trained on the anchor's level-K call,
train.member_top_level_p) members/k/ for k = 1..M-1, each a run folder of its own.
Then: python sample.py --run runs/tiny
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from arvdm.runtime import setup_environment

ENV_ACTIONS = {"memory_maze": 6, "crafter": 17}
MEMBER_ENV = "ARVDM_TRAIN_MEMBER"  # which member of the run (train.members) the ranks train.py launches train


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    p.add_argument("--preset", default="tiny",
                   help="tiny (CPU, minutes; memory chosen by pose), tiny_time (the same, time-based memory) or paper "
                        "(GPU); default tiny")
    p.add_argument("--data", help="TECO-layout folder with training/ and validation/ (default: the stand-in "
                                  "for --env, generated when absent)")
    p.add_argument("--env", choices=sorted(ENV_ACTIONS), help="stand-in environment to generate data from "
                                                            "(default memory_maze)")
    p.add_argument("--out", help="run folder (default runs/<preset>)")
    p.add_argument("--max-steps", type=int, help="train.max_steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. memory.length=16 (repeatable)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available; torchrun sets it per rank)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, member: int = 0):
    """The run's Config: the preset (or, with --resume, the checkpoint's config) plus the overrides. ``member`` k >= 1
    (a rank launched for member k, MEMBER_ENV): the run folder is member 0's, whose checkpoints are not checked."""
    # arvdm's imports sit inside the functions: main() calls setup_environment() before torch loads.
    from arvdm.config import ConfigError, apply_overrides, get_preset, parse_device
    from arvdm.model.checkpoint import CheckpointError, latest_checkpoint, load_config

    out = args.out or f"runs/{args.preset}"
    # Every flag is checked here, before data generation, process groups or training start.
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.data is not None and not Path(args.data).is_dir():
        raise ConfigError(f"--data {args.data}: folder does not exist (it must hold training/ and validation/)")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    parse_device(args.device)
    ckpt = latest_checkpoint(out)
    if args.resume and ckpt is None:
        raise CheckpointError(f"--resume: {out} has no complete checkpoint to resume from")
    if not args.resume and ckpt is not None and member == 0:
        raise CheckpointError(f"{out} already holds checkpoints (newest {ckpt.name}); pass --resume to continue "
                              f"it or choose another --out")
    cfg = load_config(ckpt) if args.resume else get_preset(args.preset)
    if args.env:
        cfg.data.env = args.env
        cfg.model.num_actions = max(cfg.model.num_actions, ENV_ACTIONS[args.env])
        if not args.data:
            # one folder per environment and resolution, so presets never mix frame sizes
            cfg.data.path = f"datasets/{args.env}_{cfg.data.resize or cfg.model.image_size}"
    if args.data:
        cfg.data.path = args.data
    apply_overrides(cfg, args.overrides)
    if args.max_steps is not None:
        cfg.train.max_steps = args.max_steps
    return cfg.validate(), out


def launches_cpu_ranks(cfg, device) -> bool:
    """Whether this call launches train.cpu_ranks ranks: training on the CPU (`device`, a torch.device as
    `parse_device` resolves --device), more than one rank asked for, and not already a rank (torchrun sets RANK)."""
    return device.type == "cpu" and cfg.train.cpu_ranks > 1 and "RANK" not in os.environ


def run_cpu_ranks(cfg, argv: list[str], generate_data: bool, member: int = 0) -> int:
    """Run this script as cfg.train.cpu_ranks ranks of one thread each under torchrun (gloo) to train ``member`` of
    the run; returns its exit status. The data set is generated here first, with every core, rather than by one
    rank while the others wait."""
    from arvdm.training.loader import prepare_data

    if generate_data:
        prepare_data(cfg)
    n = cfg.train.cpu_ranks
    print(f"train.py: {n} CPU ranks of one thread each (train.cpu_ranks; batch_size {cfg.train.batch_size} per rank)",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", MEMBER_ENV: str(member)}).returncode


def main(argv=None) -> int:
    setup_environment()  # before torch loads: OpenMP reads it once
    args = parse_args(argv)
    # Imported after setup_environment() (torch reads it once) and after parsing, so that --help is instant.
    from arvdm.config import parse_device
    from arvdm.errors import USER_ERRORS
    from arvdm.training import DistributedError, train
    from arvdm.training.distributed import cleanup_distributed, setup_distributed
    from arvdm.training.members import member_plan, record_members

    launched = os.environ.get(MEMBER_ENV)  # set in the ranks launched for one member of the run
    try:
        cfg, out = build_config(args, member=int(launched or 0))
        # train.members (1: the run alone); the ranks launched for one member train that one
        plan = member_plan(cfg, out, args.resume, only=None if launched is None else int(launched))
        if len(plan) > 1 and "RANK" in os.environ:  # under torchrun the members share one process group: a
            setup_distributed(args.device, cfg.train.dist_timeout_s)  # group made again per member hung at exit
        for m in plan:
            # Data is generated only for the default stand-in folder; an explicit --data must exist.
            if launches_cpu_ranks(m.cfg, parse_device(args.device)):
                if rc := run_cpu_ranks(m.cfg, sys.argv[1:] if argv is None else argv, not args.data, m.index):
                    return rc
            else:
                train(m.cfg, m.folder, resume=m.resume, generate_data=not args.data, device=args.device, fork=m.fork)
        # every member trained: member 0's newest checkpoint tells the sampler how many there are (a resume may have
        # changed train.members after member 0 finished; arvdm.training.members.record_members)
        changed = None if launched or os.environ.get("RANK", "0") != "0" else record_members(out, cfg.train.members)
        if changed:
            print(f"train.py: {out} has {cfg.train.members} member(s) now (train.members recorded in {changed})",
                  file=sys.stderr)
    except DistributedError as e:  # another rank died or hung: say so instead of a traceback or a hang
        print(f"train.py: error: {e}", file=sys.stderr)
        # leave now: at interpreter exit gloo's threads may still hold the dead peer's socket, and their teardown can
        # abort the process (SIGABRT, "terminate called without an active exception") instead of exiting with 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except USER_ERRORS as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("train.py: interrupted; continue with --resume from the last checkpoint", file=sys.stderr)
        return 130
    finally:
        cleanup_distributed()  # the members' shared group (a no-op when train() left its own)
    return 0


if __name__ == "__main__":
    sys.exit(main())
