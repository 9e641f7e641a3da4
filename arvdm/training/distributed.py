"""The process group of a training run: join it under torchrun, wait on it, gather from it, name its failures.

    info = setup_distributed("cuda", timeout_s=600)   # DistInfo(rank, local_rank, world_size, device)
    barrier(info)                                     # a no-op on one process
    cleanup_distributed()

Contract: without torchrun (no RANK / WORLD_SIZE > 1) everything here is a no-op on one process, so the
trainer calls these helpers unconditionally. A collective that waits longer than `timeout_s` for a rank
that died or hung raises; `distributed_error` turns that into a `DistributedError` the CLI reports in one line.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from arvdm.errors import ArvdmError


class DistributedError(ArvdmError, RuntimeError):
    """Under DDP, this rank lost the others: one died, hung past train.dist_timeout_s, or cannot be reached."""


# Words in a collective's error that mean "another rank is gone", not a bug in this process.
_COMM_FAILURE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "peer", "socket")


@dataclass
class DistInfo:
    """Where this process sits in the run: its rank, its rank on the node, how many ranks, its device."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set); else one process.

    NCCL on GPUs, gloo on CPUs. Each rank uses cuda:LOCAL_RANK when CUDA is available. A collective
    that waits `timeout_s` for a rank that died or hung raises instead of hanging the job.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return DistInfo(rank, local, world, torch.device(f"cuda:{local}" if use_cuda else "cpu"))
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DistInfo(device=dev)


def cleanup_distributed() -> None:
    """Leave the process group and free it now, while Python is fully alive.

    A DDP wrapper's reducer holds the group; a gloo group that is only freed at interpreter shutdown can
    abort the process ("terminate called without an active exception": 3 runs in 20 of a two-rank DDP script).
    Drop the wrappers first (`Trainer.close`), then call this.
    """
    if dist.is_initialized():
        gc.collect()  # wrappers already dropped but held in reference cycles
        dist.destroy_process_group()
        gc.collect()


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (nothing to wait for on one process)."""
    if info.enabled:
        dist.barrier()


def gather(obj: dict[str, torch.Tensor], info: DistInfo) -> list[dict[str, torch.Tensor]]:
    """Every rank's `obj` (tensors moved to the CPU), in rank order; a collective under DDP."""
    obj = {k: v.cpu() for k, v in obj.items()}
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def distributed_error(e: RuntimeError, info: DistInfo, timeout_s: float) -> DistributedError | None:
    """A DistributedError that says this rank lost the others, when `e` means that; else None (a real bug)."""
    if not info.enabled:
        return None
    if not (isinstance(e, dist.DistError) or any(w in str(e).lower() for w in _COMM_FAILURE_WORDS)):
        return None
    return DistributedError(f"rank {info.rank} of {info.world_size} lost the other ranks (one died, hung "
                            f"longer than train.dist_timeout_s={timeout_s:g} s, or is "
                            f"unreachable): {str(e).strip().splitlines()[0]}; continue the run with "
                            f"--resume from its last checkpoint")
