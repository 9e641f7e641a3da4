"""Training throughput: steps/s and frames/s of the diffusion-forcing step for a preset.

    python benchmarks/train_speed.py                          # tiny, on this machine's CPU
    python benchmarks/train_speed.py --set data.resize=32 --set model.image_size=32 --set model.patch_size=4
    python benchmarks/train_speed.py --preset paper --device cuda

A few warm-up steps, then timed steps of the real Trainer (data loading, forward, backward, AdamW,
EMA). Without --data it times on a small synthetic data set in a temporary folder (random frames: the
cost of a step does not depend on the pixels). frames/s counts window frames (the ones with a loss):
batch_size x window per step; memory frames are extra input on top.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arvdm.runtime import setup_environment
from data.episodes import write_episode


def synthetic_data(root: Path, cfg, episodes: int = 4) -> Path:
    size = cfg.data.resize or cfg.model.image_size
    length = (cfg.memory.length + cfg.train.window) * cfg.data.frame_skip + 8
    rng = np.random.default_rng(0)
    for split in ("training", "validation"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for e in range(episodes):
            video = rng.integers(0, 256, (length, size, size, 3), dtype=np.uint8)
            write_episode(root / split / f"ep{e:04d}.npz", video,
                          rng.integers(0, min(6, cfg.model.num_actions), length))
    return root


def main() -> None:
    setup_environment()  # before torch loads (OMP_WAIT_POLICY; see arvdm/runtime.py)
    import torch

    from arvdm.config import apply_overrides, get_preset
    from arvdm.training import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", help="a real data set (default: synthetic frames in a temp folder)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default=None)
    args = p.parse_args()

    cfg = apply_overrides(get_preset(args.preset), args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.data.path = args.data or str(synthetic_data(Path(tmp) / "data", cfg))
        cfg.train.max_steps = args.warmup + args.steps + 1
        cfg.train.val_every = cfg.train.sample_every = 0
        cfg.train.ckpt_every = 10 ** 9
        trainer = Trainer(cfg.validate(), Path(tmp) / "run", device=args.device)
        loader = torch.utils.data.DataLoader(trainer.train_ds, batch_sampler=trainer.sampler,
                                             collate_fn=lambda items: {
                                                 "video": torch.stack([i["video"] for i in items]),
                                                 "actions": torch.stack([i["actions"] for i in items])},
                                             num_workers=cfg.data.num_workers)
        batches = iter(loader)
        for _ in range(args.warmup):
            trainer.train_step(next(batches))
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss, _ = trainer.train_step(next(batches))
        loss.item()
        sync()
        dt = time.perf_counter() - t0
    sps = args.steps / dt
    frames = cfg.train.batch_size * cfg.train.window
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(f"preset {cfg.preset} {' '.join(args.overrides)}".strip())
    print(f"  device {trainer.device}, torch threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"  {n_params / 1e6:.2f}M params, {cfg.model.image_size}px, patch {cfg.model.patch_size}, batch "
          f"{cfg.train.batch_size} x ({cfg.memory.length} memory + {cfg.train.window} window) frames")
    print(f"  {sps:.2f} steps/s, {sps * frames:.1f} frames/s ({args.steps} timed steps after {args.warmup} warm-up)")


if __name__ == "__main__":
    main()
