"""What an exact resume checks and restores besides the weights: which checkpoint, whether the config still fits
it, where the data stream stood, and every rank's random generators.

    ckpt = checkpoint_to_resume(run_dir, cfg, resume)     # None for a fresh run; refuses to overwrite
    rngs = rng_states(generator, device, info)            # a collective under DDP: every rank's states
    restore_rng(rngs, generator, device, info)            # this rank's, when the rank count is the same
    start = fork.start(cfg)                               # train.member_fork: member 0's step-F checkpoint

Contract: a fresh run (`resume=False`) never writes into a folder that holds checkpoints; a resume refuses a
config whose model, memory or diffusion sections differ from the checkpoint's (the weights depend on them) and
only warns about a different data set size, batch size or rank count (it trains on, but not bit for bit).

A fork (step F = ``train.member_fork`` x max_steps; arvdm.training.members) starts member k >= 1 of a run from
member 0's step-F checkpoint as a resume would (weights, EMA, optimizer, step, data position), except that its
generators are not restored (it draws its own noise and data order from its own seed) and its lr schedule is set
back B = ``train.member_fork_lr_back`` x max_steps steps: it trains steps F+1.. with the lr of steps F-B+1..
(`Fork.set_lr_back`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from arvdm.config import Config, ConfigError
from arvdm.model.checkpoint import CheckpointError, checkpoint_step, latest_checkpoint, load_config
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


class Fork(NamedTuple):
    """Where a forked member starts: member 0's step-F checkpoint, its lr schedule set back ``lr_back`` steps."""

    checkpoint: Path
    lr_back: int

    def start(self, cfg: Config) -> Path:
        """The checkpoint the member starts from, checked as a resume's would be."""
        if not (self.checkpoint / "state.pt").is_file():
            raise CheckpointError(
                f"train.member_fork: {self.checkpoint} (member 0's step-{checkpoint_step(self.checkpoint)} checkpoint, "
                "which the other members start from) is missing; train member 0 past that step first (python "
                "train.py --out RUN --resume keeps it)")
        check_resumable(load_config(self.checkpoint), cfg, self.checkpoint)
        return self.checkpoint

    def set_lr_back(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Move a loaded lr schedule ``lr_back`` steps back: the optimizer's lr and every later step's are those
        ``lr_back`` steps earlier in the schedule (the fork trains on with the larger lr of an earlier step)."""
        scheduler.last_epoch -= self.lr_back
        for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)


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
