"""What an exact resume checks and restores besides the weights: which checkpoint, whether the config still fits
it, where the data stream stood, and every rank's random generators.

    ckpt = checkpoint_to_resume(run_dir, cfg, resume)     # None for a fresh run; refuses to overwrite
    rngs = rng_states(generator, device, info)            # a collective under DDP: every rank's states
    restore_rng(rngs, generator, device, info)            # this rank's, when the rank count is the same

Contract: a fresh run (`resume=False`) never writes into a folder that holds checkpoints; a resume refuses a
config whose model, memory or diffusion sections differ from the checkpoint's (the weights depend on them) and
only warns about a different data set size, batch size or rank count (it trains on, but not bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from arvdm.config import Config, ConfigError
from arvdm.model.checkpoint import CheckpointError, latest_checkpoint, load_config
from arvdm.training.distributed import DistInfo, gather


def checkpoint_to_resume(run_dir: Path, cfg: Config, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a fresh run); refuses to overwrite or to resume nothing."""
    ckpt = latest_checkpoint(run_dir)
    if resume and ckpt is None:
        raise CheckpointError(f"--resume: {run_dir} has no complete checkpoint to resume from")
    if not resume and ckpt is not None:
        raise CheckpointError(f"{run_dir} already holds checkpoints (newest {ckpt.name}); pass --resume "
                              f"to continue it or choose another --out")
    if resume:
        check_resumable(load_config(ckpt), cfg, ckpt)
    return ckpt


def check_resumable(saved: Config, cfg: Config, ckpt: Path) -> None:
    """The model, memory and diffusion sections must equal the checkpoint's (the weights depend on them)."""
    a, b = saved.to_dict(), cfg.to_dict()
    diff = [f"{s}.{k}: checkpoint {a[s][k]!r}, now {b[s].get(k)!r}"
            for s in ("model", "memory", "diffusion") for k in a[s] if a[s][k] != b[s].get(k)]
    if diff:
        raise ConfigError(f"cannot resume {ckpt}: the config differs from the checkpoint's: " + "; ".join(diff))


def warn_if_data_differs(saved: dict[str, Any], now: dict[str, int], ckpt: Path) -> None:
    """A resume with another data set size, batch size or rank count continues, but not as an unbroken run."""
    if any(saved[k] != v for k, v in now.items()):
        print(f"warning: resuming {ckpt} with a different data set size, batch size or number of ranks "
              f"({saved}); training continues but will not match an unbroken run", file=sys.stderr)


def rng_states(generator: torch.Generator, device: torch.device, info: DistInfo) -> list[dict[str, torch.Tensor]]:
    """Every rank's generators (noise, torch, CUDA), in rank order: ranks draw different noise, so all are kept."""
    rng = {"noise": generator.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return gather(rng, info)


def restore_rng(rngs: list[dict[str, torch.Tensor]], generator: torch.Generator, device: torch.device,
                info: DistInfo) -> None:
    """This rank's generators from a checkpoint (skipped when it was saved by another number of ranks)."""
    if len(rngs) != info.world_size:
        return
    mine = rngs[info.rank]
    generator.set_state(mine["noise"])
    torch.set_rng_state(mine["torch"])
    if device.type == "cuda" and "cuda" in mine:
        torch.cuda.set_rng_state(mine["cuda"], device)
