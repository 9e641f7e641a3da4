"""Noisy context (issue 21.1): memory frames at a noise level k the model is told, trained and sampled.

k_ctx = 0 is the plain rollout bit for bit; with k_ctx > 0 the committed frames are x_k = add_noise(frame, z, k)
with z drawn from the rollout's generator at the commit, and the cached and recomputing paths agree; the loss's
context noise draws after the window's draws and reaches the model as `MemoryFrames.levels`; the schedule keeps
its context level through a file; bad values are refused naming the flag or key.
"""

import json

import pytest
import torch

from arvdm.config import ConfigError, SamplingError, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser, DenoiserError
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.files import load_schedule
from arvdm.schedules.matrix import ScheduleError
from arvdm.schedules.presets import chunked, fifo, get_schedule
from arvdm.training.objective import diffusion_forcing_loss
from memory import MemoryFrames

K = 100
B, C, S, A = 2, 3, 16, 5


def tiny_cfg(*overrides):
    base = ["model.image_size=16", "model.unet_channels=[8,16]", "model.patch_size=2", "model.dim=32",
            "model.depth=2", "model.heads=2", f"model.num_actions={A}", f"diffusion.num_levels={K}",
            "memory.length=4", "memory.retention=last"]
    return apply_overrides(get_preset("tiny_time"), base + list(overrides))


def make(*overrides, seed=0):
    """A tiny model with every parameter random (the zero-initialised output conv would give v = 0)."""
    torch.manual_seed(seed)
    model = Denoiser(tiny_cfg(*overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def clip(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, t, C, S, S, generator=g) * 2 - 1, torch.randint(0, A, (B, t), generator=g)


def poses(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.rand(B, t, 2, generator=g) * 5, torch.rand(B, t, 1, generator=g) * 6 - 3], dim=2)


def diffusion(model):
    return PerFrameDiffusion(model.cfg.diffusion)


def go(model, sched, n_frames=6, seed=1, **kw):
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(n_frames, seed=4)
    kw.setdefault("eta", 0.5)
    return rollout(model, diffusion(model), sched, ctx, ctx_a, act, n_frames, progress=False,
                   generator=torch.Generator().manual_seed(seed), **kw)


# -- the model reads a memory frame's level ------------------------------------------------------------------

@pytest.mark.parametrize("structure", ["prepend", "channel_concat", "cross_attention"])
def test_memory_levels_zero_is_clean_and_a_level_changes_the_prediction(structure):
    model = make(f"memory.structure={structure}")
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.full((B, 2), 50)
    with torch.no_grad():
        clean = model(x, levels, a, memory=MemoryFrames(mem, mem_a))
        zeros = model(x, levels, a, memory=MemoryFrames(mem, mem_a, levels=torch.zeros(B, 4, dtype=torch.long)))
        noisy = model(x, levels, a, memory=MemoryFrames(mem, mem_a, levels=torch.full((B, 4), 30)))
    assert torch.equal(zeros, clean)  # level 0 given = no level given, bit for bit
    assert (noisy - clean).abs().max() > 1e-3  # the same pixels told at level 30 predict otherwise


def test_committed_levels_reach_the_cached_prefix_as_they_reach_explicit_memory():
    model = make("memory.structure=prepend", "memory.retention=all")
    (past, past_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    mem_levels, levels = torch.full((B, 4), 20), torch.full((B, 2), 70)
    state = model.init_state(B)
    with torch.no_grad():
        model.commit(state, past[:, :2], past_a[:, :2], levels=mem_levels[:, :2])
        model.commit(state, past[:, 2:], past_a[:, 2:], levels=mem_levels[:, 2:])
        cached = model(x, levels, a, state=state)
        explicit = model(x, levels, a, memory=MemoryFrames(past, past_a, levels=mem_levels))
        clean = model(x, levels, a, memory=MemoryFrames(past, past_a))
    assert (cached - explicit).abs().max() < 1e-5
    assert (cached - clean).abs().max() > 1e-3


@pytest.mark.parametrize("bad, match", [
    (torch.full((B, 4), K), "memory.levels must be in 0..99"),
    (torch.full((B, 4), -1), "memory.levels must be in 0..99"),
    (torch.full((B, 3), 1), r"memory.levels must be integer \(B, m\)"),
    (torch.full((B, 4), 1.0), r"memory.levels must be integer \(B, m\)"),
])
def test_bad_memory_levels_are_refused(bad, match):
    model = make()
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    with pytest.raises(DenoiserError, match=match):
        model(x, torch.zeros(B, 2, dtype=torch.long), a, memory=MemoryFrames(mem, mem_a, levels=bad))


# -- sampling: the context level --------------------------------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_context_level_zero_is_the_plain_rollout_bit_for_bit(use_cache):
    model = make()
    sched = fifo(4, K, 1)
    plain = go(model, sched, use_cache=use_cache)
    assert torch.equal(go(model, sched, use_cache=use_cache, context_level=0), plain)
    assert torch.equal(go(model, sched.with_context_level(0), use_cache=use_cache), plain)
    noisy = go(model, sched, use_cache=use_cache, context_level=10)
    assert (noisy - plain).abs().max() > 1e-3  # not vacuous: a context level changes the rollout


class Spy:
    """Wraps a Denoiser, recording each commit's frames and levels (the model's own `commit` does the work)."""

    def __init__(self, model):
        self.model, self.commits = model, []
        self.cfg, self.frames_per_chunk = model.cfg, model.frames_per_chunk

    def check_schedule(self, delta, window):
        self.model.check_schedule(delta, window)

    def init_state(self, batch_size, **kw):
        return self.model.init_state(batch_size, **kw)

    def commit(self, state, frames, actions, *args, levels=None, clean=None):
        self.commits.append((frames.clone(), None if levels is None else levels.clone()))
        self.model.commit(state, frames, actions, *args, levels=levels, clean=clean)

    def __call__(self, *args, **kw):
        return self.model(*args, **kw)


def test_committed_frames_are_renoised_with_the_draws_that_follow_the_windows():
    """Chunked, eta = 0 (the window draws only its initial noise and the entering frames): the context's noise
    comes first, then per AR step the window's, the commit's, then the entering frames'."""
    model, k = make(), 25
    spy, sched = Spy(model), chunked(2, K, 2)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(6, seed=4)
    out = rollout(spy, diffusion(model), sched, ctx, ctx_a, act, 6, eta=0.0, progress=False, context_level=k,
                  generator=torch.Generator().manual_seed(1))
    g, shape = torch.Generator().manual_seed(1), (B, 2, C, S, S)
    z_ctx = torch.randn(shape, generator=g)
    torch.randn(shape, generator=g)  # the initial window
    z_first = torch.randn(shape, generator=g)  # the first generated pair's commit (after its rows drew nothing)
    lv = torch.full((B, 2), k)
    dif = diffusion(model)
    assert [c[1].tolist() for c in spy.commits] == [lv.tolist()] * 3  # context + 2 commits (the last is skipped)
    torch.testing.assert_close(spy.commits[0][0], dif.add_noise(ctx, z_ctx, lv), atol=0, rtol=0)
    torch.testing.assert_close(spy.commits[1][0], dif.add_noise(out[:, :2], z_first, lv), atol=0, rtol=0)
    assert (out[:, :2] - spy.commits[1][0]).abs().max() > 1e-2  # emitted clean; memory holds the noised copy


@pytest.mark.parametrize("overrides", [
    ("memory.structure=prepend", "memory.retention=all"),  # raw prepend + 'last' streams (cached K/V saw more)
    ("memory.structure=prepend", "memory.compressor=joint", "memory.budget=2"),
    ("memory.structure=channel_concat",),
    ("memory.structure=cross_attention",),
    ("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2"),
], ids=["prepend", "prepend-joint", "concat", "cross", "pose"])
def test_cached_equals_recomputed_with_a_context_level(overrides):
    """use_cache=True (levels through commit: the prefix K/V or the bank) == False (the bank's noised frames)."""
    model = make(*overrides)
    sched = fifo(4, K, 1).with_context_level(15)
    extra = {"poses": poses(2 + 9, seed=5)} if model.pose_aware else {}
    cached = go(model, sched, n_frames=9, use_cache=True, **extra)
    recomputed = go(model, sched, n_frames=9, use_cache=False, **extra)
    assert (cached - recomputed).abs().max() < 1e-5
    assert (cached - go(model, sched.with_context_level(0), n_frames=9, **extra)).abs().max() > 1e-3


def test_bad_context_level_names_the_argument():
    model = make()
    for bad in (-1, K, 2.5, "3"):
        with pytest.raises(ScheduleError, match="rollout context_level"):
            go(model, fifo(4, K, 1), context_level=bad)


# -- the schedule property -----------------------------------------------------------------------------------

def test_context_level_is_part_of_the_schedule_and_survives_a_file(tmp_path):
    sched = get_schedule("fifo", 4, K, 8, context_level=12)
    assert sched.context_level == 12 and fifo(4, K, 2).context_level == 0
    assert sched != fifo(4, K, 2) and sched == fifo(4, K, 2).with_context_level(12)
    back = load_schedule(sched.save(tmp_path / "s.json"))
    assert back == sched and back.context_level == 12
    assert json.loads((tmp_path / "s.json").read_text())["context_level"] == 12
    txt = tmp_path / "s.txt"
    txt.write_text("# delta=2 num_levels=100 context_level=7\n100 100\n0 0\n")
    assert load_schedule(txt).context_level == 7
    assert load_schedule(tmp_path / "s.json", context_level=12).context_level == 12
    with pytest.raises(ScheduleError, match="context_level=12 but context_level=3"):
        load_schedule(tmp_path / "s.json", context_level=3)


@pytest.mark.parametrize("bad", [-1, K, K + 5, 1.5, "one", True])
def test_bad_schedule_context_level_is_refused(bad):
    with pytest.raises(ScheduleError, match="context_level") as err:
        fifo(4, K, 1).with_context_level(bad)
    assert err.value.condition == "context_level"


# -- training: context noise in the loss ---------------------------------------------------------------------

class LossSpy(torch.nn.Module):
    """Records what the loss gives the model; predicts v = 0."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, levels, actions, memory=None):
        self.calls.append((x.clone(), levels.clone(), memory))
        return torch.zeros_like(x)


def loss_call(context_noise_max, m=4, seed=0, **kw):
    dif = PerFrameDiffusion(tiny_cfg().diffusion)
    video, act = clip(m + 4, seed=7)
    spy, g = LossSpy(), torch.Generator().manual_seed(seed)
    total, counted = diffusion_forcing_loss(spy, dif, video, act, m, K, g, context_noise_max=context_noise_max, **kw)
    return spy.calls[0], (total, counted), g, video, dif


def test_context_noise_draws_after_the_window_and_reaches_the_model():
    (x0, lv0, mem0), loss0, g0, video, dif = loss_call(0)
    (x5, lv5, mem5), loss5, g5, _, _ = loss_call(5)
    assert torch.equal(x5, x0) and torch.equal(lv5, lv0) and torch.equal(loss5[0], loss0[0])  # first draws unchanged
    assert mem0.levels is None and torch.equal(mem0.frames, video[:, :4])  # off: clean memory, as before
    # on: the memory frames' levels and noise are the generator's next draws, after the window's
    g = torch.Generator().manual_seed(0)
    torch.randint(0, K + 1, (B, 4), generator=g)
    torch.randn((B, 4, C, S, S), generator=g)
    levels = torch.randint(0, 6, (B, 4), generator=g)
    noise = torch.randn((B, 4, C, S, S), generator=g)
    assert torch.equal(mem5.levels, levels) and int(levels.max()) > 0
    torch.testing.assert_close(mem5.frames, dif.add_noise(video[:, :4], noise, levels), atol=0, rtol=0)
    assert torch.equal(g.get_state(), g5.get_state())  # and nothing else was drawn


def test_context_noise_off_draws_nothing_extra():
    *_, g0, _, _ = loss_call(0)
    g = torch.Generator().manual_seed(0)
    torch.randint(0, K + 1, (B, 4), generator=g)
    torch.randn((B, 4, C, S, S), generator=g)
    assert torch.equal(g.get_state(), g0.get_state())


# -- bad input: config keys and sample flags -----------------------------------------------------------------

@pytest.mark.parametrize("key, value, match", [
    ("train.context_noise_max", K, "train.context_noise_max=100 must be an integer in 0..diffusion.num_levels-1"),
    ("train.context_noise_max", -1, "train.context_noise_max=-1"),
    ("train.memory_dropout", 1.0, r"train.memory_dropout=1.0 must be in \[0, 1\)"),
    ("train.memory_dropout", -0.1, "train.memory_dropout=-0.1"),
    ("diffusion.context_level", K, "diffusion.context_level=100 must be an integer in 0..99"),
    ("diffusion.context_level", -1, "diffusion.context_level=-1"),
])
def test_bad_lever_config_is_refused_naming_the_key(key, value, match):
    cfg = apply_overrides(tiny_cfg(), [f"{key}={value}"])
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_lever_defaults_validate_and_sample_flags_are_checked():
    tiny_cfg("train.context_noise_max=99", "train.memory_dropout=0.5").validate()
    with pytest.raises(SamplingError, match="--context-level must be an integer >= 0"):
        SampleSettings(context_level=-1).validate()
    for bad in (float("nan"), float("inf"), "x", None):
        with pytest.raises(SamplingError, match="--history-guidance must be a finite number"):
            SampleSettings(history_guidance=bad).validate()
    SampleSettings(context_level=3, history_guidance=-1.5).validate()
