"""model.last_frame_input: the most recent past frame at full resolution beside every window frame.

It is the memory's last frame (banks and training clips put the recent frames last), enters through a
zero-initialised conv added to the encoder stem's output, and is absent whenever memory is (memory dropout,
history guidance's memory-free call). A fresh model computes exactly what the same weights without it compute;
cached rollouts (which keep the last committed frame in the state) equal recomputing ones; the loss trains it.
"""

import pytest
import torch
from test_noisy_context import B, K, clip, poses, tiny_cfg
from test_noisy_context import make as make_random

from arvdm.config import ConfigError
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import chunked, fifo
from arvdm.training.objective import diffusion_forcing_loss
from memory import MemoryFrames


def cfg_of(*overrides):
    return tiny_cfg("model.last_frame_input=true", *overrides)


def make(*overrides, seed=0, zero_stem=False):
    """test_noisy_context's all-random tiny model with the last-frame input; `zero_stem`: the same weights with the
    stem at its initial zero (the rest of the draw unchanged)."""
    model = make_random("model.last_frame_input=true", *overrides, seed=seed)
    if zero_stem:
        with torch.no_grad():
            for p in model.last_frame_stem.parameters():
                p.zero_()
    return model


def assert_fresh_part_changes_nothing(with_it: Denoiser, without: Denoiser, prefix: str, keys: set[str]) -> None:
    """`with_it` is `without` plus fresh (zero-initialised) parameters named `keys`, all under `prefix`: given the
    same other weights (made non-trivial: the output conv starts at zero), the two compute the same v."""
    without.load_state_dict({k: v for k, v in with_it.state_dict().items() if not k.startswith(prefix)})
    assert set(with_it.state_dict()) - set(without.state_dict()) == keys
    with torch.no_grad():
        for m in (with_it, without):
            for name, p in m.named_parameters():
                if not name.startswith(prefix):
                    p.copy_(torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p) * 0.2)
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.full((B, 2), 40)
    with torch.no_grad():
        out = with_it(x, levels, a, memory=MemoryFrames(mem, mem_a))
        ref = without(x, levels, a, memory=MemoryFrames(mem, mem_a))
    assert out.abs().max() > 1e-3 and torch.equal(out, ref)


def test_fresh_model_equals_the_same_weights_without_it():
    assert_fresh_part_changes_nothing(Denoiser(cfg_of()), Denoiser(cfg_of("model.last_frame_input=false")),
                                      "last_frame_stem", {"last_frame_stem.weight", "last_frame_stem.bias"})


def test_it_reads_the_last_memory_frame_and_nothing_without_memory():
    model, zero = make(), make(zero_stem=True)
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.full((B, 2), 40)
    with torch.no_grad():
        base = model(x, levels, a, memory=MemoryFrames(mem, mem_a))
        assert (base - zero(x, levels, a, memory=MemoryFrames(mem, mem_a))).abs().max() > 1e-3  # the stem is live
        # only the last frame enters through the stem: the same frames' stem contribution, shifted, differs
        other = mem.clone()
        other[:, -1] = -other[:, -1]
        changed = model(x, levels, a, memory=MemoryFrames(other, mem_a)) - base
        changed_zero = zero(x, levels, a, memory=MemoryFrames(other, mem_a)) - zero(x, levels, a,
                                                                                    memory=MemoryFrames(mem, mem_a))
        assert (changed - changed_zero).abs().max() > 1e-3
        # no memory (memory dropout, history guidance's v_nomem): no last frame, whatever the stem's weights
        assert torch.equal(model(x, levels, a), zero(x, levels, a))


@pytest.mark.parametrize("overrides", [
    ("memory.structure=prepend", "memory.retention=all"),  # raw prepend: the cached path never asks the bank
    ("memory.structure=prepend", "memory.compressor=joint", "memory.budget=2"),
    ("memory.structure=channel_concat",),
    ("memory.structure=cross_attention",),
    ("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2", "memory.length=4"),
], ids=["prepend", "prepend-joint", "concat", "cross", "pose"])
@pytest.mark.parametrize("k_ctx", [0, 15])
def test_cached_equals_recomputed(overrides, k_ctx):
    model = make(*overrides)
    sched = fifo(4, K, 1).with_context_level(k_ctx)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(9, seed=4)
    extra = {"poses": poses(2 + 9, seed=5)} if model.pose_aware else {}

    def run(m, use_cache, **kw):
        return rollout(m, PerFrameDiffusion(m.cfg.diffusion), sched, ctx, ctx_a, act, 9, progress=False, eta=0.5,
                       generator=torch.Generator().manual_seed(1), use_cache=use_cache, **extra, **kw)

    cached = run(model, True)
    assert (cached - run(model, False)).abs().max() < 1e-5
    assert (cached - run(make(*overrides, zero_stem=True), True)).abs().max() > 1e-3  # the last frame mattered
    if model.pose_aware:
        for mode in ("time", "none", "other"):
            assert (run(model, True, memory_select=mode) - run(model, False, memory_select=mode)).abs().max() < 1e-5


def test_history_guidance_call_without_memory_drops_it_too():
    model = make()
    sched = chunked(2, K, 3)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(4, seed=4)

    def run(m):
        return rollout(m, PerFrameDiffusion(m.cfg.diffusion), sched, ctx, ctx_a, act, 4, progress=False, eta=0.0,
                       history_guidance=1.0, generator=torch.Generator().manual_seed(1), use_cache=False)

    assert torch.isfinite(run(model)).all()
    assert (run(model) - run(make(zero_stem=True))).abs().max() > 1e-3


def test_the_loss_trains_the_stem():
    model = make(zero_stem=True).train()  # the stem at its initial zero, the rest trained-like: its gradient is not 0
    video, act = clip(6, seed=1)
    total, counted = diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), video, act, 4, K,
                                            torch.Generator().manual_seed(0))
    (total / counted).backward()
    assert model.last_frame_stem.weight.grad.abs().max() > 0
    assert torch.equal(model.last_frame_stem.weight, torch.zeros_like(model.last_frame_stem.weight))


@pytest.mark.parametrize("overrides, match", [
    (("model.unet_channels=[]", "model.patch_size=4"), "model.unet_channels"),
    (("memory.length=0",), "memory.length"),
    (("model.last_frame_input=2",), "bool"),
])
def test_bad_config_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match="last_frame_input"):
        try:
            cfg_of(*overrides).validate()
        except ConfigError as e:
            assert match in str(e)
            raise
