"""The hot path reads no tensor values back to the host (no .item() / int(t) / bool(t) / .tolist()).

On a GPU every such read is a host-device synchronisation: the launch queue drains, the GPU idles. The
checks run on the CPU with ``ARVDM_DEBUG_CHECKS=0`` (what a GPU run does by default, see arvdm.checks),
counting with a ``TorchDispatchMode`` the aten ops that hand a value to Python (``_local_scalar_dense`` is
what ``.item()``, ``int(t)``, ``float(t)`` and ``bool(t)`` become; ``nonzero`` has a data-dependent shape)
and, because a CPU tensor's ``tolist()``/``numpy()`` do not go through the dispatcher, wrapping those too.
Every counter is first shown to fire on a known sync, so a zero means something.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arvdm.config import DiffusionConfig, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules import chunked, fifo
from kernels import chunked_attention
from memory import KVCache, MemoryBank, MemoryFrames, RetentionPolicy

K = 100
SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero"}


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs():
    """Yields a list that collects the name of every host read inside the block."""
    mode = _CountSyncs()
    with pytest.MonkeyPatch.context() as mp:
        for attr in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, attr)

            def wrapped(self, *a, _orig=orig, _attr=attr, **kw):
                mode.ops.append(_attr)
                return _orig(self, *a, **kw)
            mp.setattr(torch.Tensor, attr, wrapped)
        with mode:
            yield mode.ops


@pytest.fixture(autouse=True)
def _gpu_default_checks(monkeypatch):
    monkeypatch.setenv("ARVDM_DEBUG_CHECKS", "0")


def test_counter_sees_each_kind_of_sync(monkeypatch):
    t = torch.arange(4)
    for fn, want in [(lambda: t.max().item(), "_local_scalar_dense"), (lambda: int(t[1]), "_local_scalar_dense"),
                     (lambda: bool((t > 2).any()), "_local_scalar_dense"), (lambda: t.nonzero(), "nonzero"),
                     (lambda: t.tolist(), "tolist")]:
        with count_syncs() as ops:
            fn()
        assert want in ops


def test_debug_switch_turns_value_checks_back_on(monkeypatch):
    d = PerFrameDiffusion(DiffusionConfig(num_levels=K))
    x = torch.randn(1, 2, 3, 4, 4)
    bad = torch.tensor([[K + 1, 3]])
    d.add_noise(x, x, bad.clamp(max=K))
    monkeypatch.setenv("ARVDM_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match="0..K=100"):
        d.add_noise(x, x, bad)
    monkeypatch.delenv("ARVDM_DEBUG_CHECKS")  # default: checked on CPU tensors (no device to wait for)
    with pytest.raises(ValueError, match="only denoises"):
        d.transition(x, x, torch.tensor([[1, 2]]), torch.tensor([[0, 5]]))


def test_diffusion_transitions_make_no_host_reads(monkeypatch):
    d = PerFrameDiffusion(DiffusionConfig(num_levels=K))
    x, v = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 4, 3, 8, 8)
    a = torch.tensor([[100, 80, 60, 0]] * 2)
    b = torch.tensor([[90, 70, 0, 0]] * 2)
    with count_syncs() as ops:
        d.add_noise(x, v, a)
        d.v_target(x, v, a)
        d.pred_x0(x, v, a)
        for eta in (0.0, 1.0):
            d.step(x, v, a, b, eta=eta, noise=torch.randn_like(x))
    assert ops == []


@pytest.mark.parametrize("recent", [None, 2])
def test_kernels_make_no_host_reads(monkeypatch, recent):
    q, k, v = (torch.randn(2, 2, n * 3, 8) for n in (4, 10, 10))
    with count_syncs() as ops:
        chunked_attention(q, k, v, tokens_per_frame=3, frames_per_chunk=2, q_frame_offset=6, sink_frames=1,
                          recent_frames=recent, return_lse=True, backend="reference")
    assert ops == []


def test_memory_reads_make_no_host_reads(monkeypatch):
    bank = MemoryBank(RetentionPolicy("last", length=4))
    cache = KVCache(RetentionPolicy("last", length=4))
    for i in range(3):
        bank.append(torch.randn(1, 2, 3, 4, 4), torch.zeros(1, 2, dtype=torch.long))
        cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), range(2 * i, 2 * i + 2))
        cache.evict(2 * i + 2)
    bank.memory()  # builds the positions tensor once per commit
    with count_syncs() as ops:
        for _ in range(3):  # what a denoising call reads
            mem = bank.memory()
            start = mem.window_start
            cache.keys_values()
            cache.keys_values_with(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    assert ops == [] and start == 6 and mem.positions.tolist() == [2, 3, 4, 5]


class _TensorOnlyModel(torch.nn.Module):
    """Denoiser API with a tensor-only body, so the pipeline's own host reads are what is counted."""

    def __init__(self):
        super().__init__()
        self.cfg = get_preset("tiny_time")
        self.cfg.memory.length = 4
        self.frames_per_chunk = 1

    def check_schedule(self, delta, window):
        pass  # every schedule: one frame per chunk

    def init_state(self, b):
        return {"bank": MemoryBank(RetentionPolicy("last", length=4))}

    def commit(self, state, frames, actions):
        state["bank"].append(frames, actions)

    def forward(self, x, levels, actions, memory=None, state=None):
        mem = memory if memory is not None else state["bank"].memory()
        past = mem.frames.mean(1, keepdim=True) if mem is not None else torch.zeros_like(x[:, :1])
        return 0.9 * x - 0.1 * past + levels[..., None, None, None] / K + 0.0 * mem.window_start


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("schedule", ["chunked", "fifo"])
def test_rollout_makes_no_host_reads_per_call(monkeypatch, use_cache, schedule):
    """Host reads of a rollout do not grow with its length: they are per-rollout boundary checks only."""
    model = _TensorOnlyModel()
    diffusion = PerFrameDiffusion(DiffusionConfig(num_levels=K))
    sched = chunked(4, K, steps=4) if schedule == "chunked" else fifo(4, K)
    ctx, ctx_a = torch.randn(1, 2, 3, 8, 8), torch.zeros(1, 2, dtype=torch.long)
    counts = []
    for n in (8, 16):
        acts = torch.ones(1, n, dtype=torch.long)
        with count_syncs() as ops:
            rollout(model, diffusion, sched, ctx, ctx_a, acts, n, eta=1.0, generator=torch.Generator().manual_seed(0),
                    use_cache=use_cache, progress=False)
        counts.append(len(ops))
    assert counts[0] == counts[1] <= 4, counts  # the once-per-rollout action range check: 2 min + 2 max


def _tiny_model(structure):
    cfg = apply_overrides(get_preset("tiny_time"), [
        "model.image_size=16", "model.patch_size=4", "model.dim=32", "model.depth=2", "model.heads=2",
        "model.num_actions=4", "diffusion.num_levels=100", "memory.length=4", f"memory.structure={structure}"])
    torch.manual_seed(0)
    return Denoiser(cfg).eval()


@pytest.mark.parametrize("structure", ["prepend", "cross_attention"])
def test_model_forward_makes_no_host_reads(monkeypatch, structure):
    model = _tiny_model(structure)
    x, levels, acts = torch.randn(1, 4, 3, 16, 16), torch.tensor([[0, 30, 60, 100]]), torch.zeros(1, 4).long()
    state = model.init_state(1)
    model.commit(state, torch.randn(1, 4, 3, 16, 16), torch.ones(1, 4).long())
    mem = MemoryFrames(torch.randn(1, 4, 3, 16, 16), torch.ones(1, 4).long(), positions=torch.arange(4),
                       next_index=4)
    with torch.no_grad(), count_syncs() as ops:
        model(x, levels, acts, state=state)
        model(x, levels, acts, memory=mem)
    assert ops == []
