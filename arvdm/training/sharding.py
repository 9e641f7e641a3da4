"""Fully sharded data parallel training (`train.fsdp`, FSDP2 `fully_shard`), for a model that outgrows one GPU.

    torchrun --standalone --nproc_per_node 8 train.py --preset paper --set train.fsdp=true

DistributedDataParallel keeps the whole model, its gradients and AdamW's two moments on every rank; FSDP keeps
1/N of each on each of N ranks and all-gathers a unit's weights just before its forward (and again for its
backward), reduce-scattering the gradients after. The units are the transformer blocks (and their
cross-attention, when the memory is read that way) and the conv encoder / decoder; the embeddings, memory stems
and final layer form the root unit. The arithmetic is DDP's: gradients are
averaged over ranks, so a run under FSDP follows the same trajectory as one under DDP (to float rounding; tested).

What stays the same for everything around training, so one checkpoint format serves both:
- Checkpoints hold full weights (`full_model_state`, gathered to rank 0) and the optimizer state in
  `optimizer.state_dict()`'s own layout (`full_optimizer_state`: parameter indices, full tensors), so a run saved
  under FSDP resumes under DDP or in one process, and the other way round (`load_optimizer_state`).
- The EMA is sharded like the model (`ShardedEMA`: each rank averages its own slices) and gathered into the full
  EMA module only for the span of a read (validation, sample videos, checkpoints, rollout-trained context):
  `with ema.read() as m:`, a collective that every rank enters; between reads the full module holds no weights.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from arvdm.model.checkpoint import unwrap
from arvdm.training.objective import EMA

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0, on its CPU


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """Shard the denoiser in place over `world_size` ranks: one FSDP unit per transformer block, the conv encoder
    and decoder, and the root.

    FSDP gathers a unit's weights in its forward hook, so a unit's weights are there when it runs through `__call__`;
    a block's cross-attention (memory.structure=cross_attention) is also called from the root, for the memory's keys
    and values (`CrossAttention.memory_kv`), so it is a unit of its own with that method registered as a forward.
    The root holds everything else. The mesh is the training device's (FSDP's default is CUDA whenever a GPU is
    present, even for a run on the CPU). Build the optimizer after this: it must see the sharded parameters.
    """
    mesh = init_device_mesh(device.type, (world_size,))
    for blk in model.blocks:
        if blk.cross is not None:
            fully_shard(blk.cross, mesh=mesh)
            register_fsdp_forward_method(blk.cross, "memory_kv")
    units = list(model.blocks) + [m for m in (model.encoder, model.decoder) if m is not None]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(net: torch.nn.Module, sync: bool):
    """Gradient accumulation: with `sync` False, gradients stay local (DDP's `no_sync`, FSDP's
    `set_requires_gradient_sync(False)`); the last micro-batch syncs. A plain module has nothing to sync."""
    if sync:
        yield
    elif isinstance(net, torch.nn.parallel.DistributedDataParallel):
        with net.no_sync():
            yield
    elif is_sharded(unwrap(net)):  # (under torch.compile's wrapper)
        unwrap(net).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            unwrap(net).set_requires_gradient_sync(True)
    else:
        yield


def local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients this rank holds (its shards under FSDP), as plain tensors that in-place ops update."""
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in model.parameters() if p.grad is not None]


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (a collective: every rank calls it); a plain tensor as it is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's full state dict on rank 0's CPU (empty on the others). A collective."""
    return get_model_state_dict(model, options=FULL)


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its own order (the indices of `optimizer.state_dict()`)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The sharded optimizer's state as an unsharded `optimizer.state_dict()` would hold it (parameter indices, full
    tensors), on rank 0's CPU; {} on the others. A collective."""
    named = get_optimizer_state_dict(model, optimizer, options=FULL)
    if not named:
        return {}
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}
    return {"state": {index[n]: s for n, s in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an `optimizer.state_dict()` (parameter indices, full tensors; saved under FSDP, DDP or one process)
    into the optimizer of a sharded model: every rank keeps its slices."""
    names = _param_names(model, optimizer)
    named = {"state": {names[int(i)]: s for i, s in state["state"].items()},
             "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):  # as saved (it turns tuples to lists)
        group.update({k: v for k, v in saved.items() if k != "params"})


class ShardedEMA(EMA):
    """The EMA of a sharded model: each rank averages its own slices (`shards`, DTensors placed like the model's
    parameters); `model` is the full EMA module, whose parameters are empty (0 elements) except inside `read()`."""

    def __init__(self, ema: EMA, sharded: torch.nn.Module):
        """`ema.model` holds the starting weights (the initial model's, or a checkpoint's EMA); they move into the
        shards and the full module's copy is freed."""
        self.decay, self.warmup, self.model = ema.decay, ema.warmup, ema.model
        self.decay_at = ema.decay_at  # the wrapped EMA's rule (the warm-up, or a power EMA's profile)
        self.shards = [distribute_tensor(e.detach(), p.device_mesh, p.placements)
                       for e, p in zip(self.model.parameters(), sharded.parameters())]
        self._free()

    def averages(self) -> list[torch.Tensor]:
        return self.shards

    def _free(self) -> None:
        for e in self.model.parameters():
            e.data = e.data.new_empty(0)

    @contextlib.contextmanager
    def read(self):
        with torch.no_grad():
            for e, s in zip(self.model.parameters(), self.shards):
                e.data = s.full_tensor()  # (full shape) gathered from every rank's slice
        try:
            yield self.model
        finally:
            self._free()
