"""History guidance (issue 21.2, DFoT): memory dropout in the loss, v = v_mem + W (v_mem - v_nomem) at sampling.

W = 0 is the plain rollout bit for bit with one model call per row; W != 0 equals the combination of the two
calls computed by hand; the loss at dropout p = 1 is the loss without memory and p = 0 draws nothing; runners
that cannot guide and weights that are not finite numbers are refused.
"""

import pytest
import torch

from arvdm.config import SamplingError, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.pipeline.rows import RolloutContext
from arvdm.schedules.presets import chunked, fifo
from arvdm.training.objective import diffusion_forcing_loss

K = 100
B, C, S, A = 2, 3, 16, 5


def make(*overrides, seed=0):
    """A tiny model with every parameter random (the zero-initialised output conv would give v = 0)."""
    base = ["model.image_size=16", "model.unet_channels=[8,16]", "model.patch_size=2", "model.dim=32",
            "model.depth=2", "model.heads=2", f"model.num_actions={A}", f"diffusion.num_levels={K}",
            "memory.length=4", "memory.retention=all"]
    torch.manual_seed(seed)
    model = Denoiser(apply_overrides(get_preset("tiny_time"), base + list(overrides))).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def clip(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, t, C, S, S, generator=g) * 2 - 1, torch.randint(0, A, (B, t), generator=g)


class Counting:
    """Counts the model calls of a rollout (everything else passes through)."""

    def __init__(self, model):
        self.model, self.calls = model, 0
        self.cfg, self.frames_per_chunk = model.cfg, model.frames_per_chunk

    def check_schedule(self, delta, window):
        self.model.check_schedule(delta, window)

    def init_state(self, batch_size, **kw):
        return self.model.init_state(batch_size, **kw)

    def commit(self, *args, **kw):
        self.model.commit(*args, **kw)

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.model(*args, **kw)


def go(model, sched, n_frames=5, seed=1, **kw):
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(n_frames, seed=4)
    kw.setdefault("eta", 0.5)
    return rollout(model, PerFrameDiffusion(model.cfg.diffusion), sched, ctx, ctx_a, act, n_frames, progress=False,
                   generator=torch.Generator().manual_seed(seed), **kw)


# -- sampling --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_weight_zero_is_the_plain_rollout_with_one_call_per_row(use_cache):
    model, sched = make(), fifo(4, K, 1)
    plain, zero = Counting(model), Counting(model)
    a = go(plain, sched, use_cache=use_cache)
    b = go(zero, sched, use_cache=use_cache, history_guidance=0.0)
    assert torch.equal(a, b) and zero.calls == plain.calls == sched.num_calls(5)
    guided = Counting(model)
    c = go(guided, sched, use_cache=use_cache, history_guidance=1.5)
    assert guided.calls == 2 * plain.calls and (c - a).abs().max() > 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("weight", [1.5, -0.5])
def test_guided_step_equals_the_hand_computed_combination(use_cache, weight):
    """Chunked with one call and eta = 0: the rollout is one DDIM step of the guided v from pure noise."""
    model, sched = make(), chunked(2, K, 1)
    dif = PerFrameDiffusion(model.cfg.diffusion)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(2, seed=4)
    out = go(model, sched, n_frames=2, eta=0.0, use_cache=use_cache, history_guidance=weight)
    x = torch.randn((B, 2, C, S, S), generator=torch.Generator().manual_seed(1))  # the window's only draw
    top, clean = torch.full((B, 2), K), torch.zeros(B, 2, dtype=torch.long)
    state = model.init_state(B)
    with torch.no_grad():
        model.commit(state, ctx, ctx_a)
        v_mem = model(x, top, act, state=state)
        v_nomem = model(x, top, act)  # the same window with no memory
    assert (v_mem - v_nomem).abs().max() > 1e-3  # the memory matters, so the test can tell W apart
    want = dif.step(x, v_mem + weight * (v_mem - v_nomem), top, clean, 0.0)
    assert (out - want).abs().max() < 1e-5


def test_context_predict_is_the_guided_combination_of_two_calls():
    model, w = make("memory.structure=cross_attention", "memory.retention=last"), 0.75
    (past, past_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.tensor([[30, 60]] * B)
    dif = PerFrameDiffusion(model.cfg.diffusion)
    ctx = RolloutContext(model, dif, 0.0, None, B, x.device, x.dtype, state=model.init_state(B),
                         history_guidance=w)
    with torch.no_grad():
        model.commit(ctx.state, past, past_a)
        got = ctx.predict(x, levels, a)
        v_mem, v_nomem = model(x, levels, a, state=ctx.state), model(x, levels, a)
    torch.testing.assert_close(got, v_mem + w * (v_mem - v_nomem), atol=0, rtol=0)


class OtherRows:
    """A runner that is not PlainRows (as SpeculativeRows is not)."""

    def start(self, rollout):
        pass


@pytest.mark.parametrize("kw", [{"history_guidance": 1.0}, {"context_level": 5}])
def test_other_row_runners_refuse_the_levers(kw):
    with pytest.raises(SamplingError, match="OtherRows does not support them"):
        go(make(), fifo(4, K, 1), rows=OtherRows(), **kw)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "x", None, True])
def test_bad_guidance_weight_names_the_argument(bad):
    with pytest.raises(SamplingError, match="rollout history_guidance must be a finite number"):
        go(make(), fifo(4, K, 1), history_guidance=bad)


# -- training: memory dropout ------------------------------------------------------------------------------

class LossSpy(torch.nn.Module):
    """Records the memory the loss gives the model; v = a fixed function of the window (and memory's mean)."""

    def __init__(self):
        super().__init__()
        self.memories = []

    def forward(self, x, levels, actions, memory=None):
        self.memories.append(memory)
        past = 0.0 if memory is None else 1.0 + memory.frames.mean()
        return 0.5 * x + past


def loss(p, seed=0, m=4, **kw):
    dif = PerFrameDiffusion(make().cfg.diffusion)
    video, act = clip(m + 4, seed=7)
    spy, g = LossSpy(), torch.Generator().manual_seed(seed)
    total, counted = diffusion_forcing_loss(spy, dif, video, act, m, K, g, memory_dropout=p, **kw)
    return total, counted, spy.memories[0], g, dif, video, act


def test_dropout_one_is_the_loss_without_memory():
    total, counted, mem, _, dif, video, act = loss(1.0)
    assert mem is None
    # the same window draws, the model called without memory
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(0, K + 1, (B, 4), generator=g)
    noise = torch.randn((B, 4, C, S, S), generator=g)
    x0 = video[:, 4:]
    v = LossSpy()(dif.add_noise(x0, noise, levels), levels, act[:, 4:])
    per_frame = (v - dif.v_target(x0, noise, levels)).pow(2).mean(dim=(2, 3, 4))
    counted_want = (levels > 0).float()
    want = (per_frame * dif.loss_weight(levels, "uniform", 5.0) * counted_want).sum()
    torch.testing.assert_close(total, want, atol=1e-6, rtol=1e-6)
    assert counted == counted_want.sum()
    with_memory, *_ = loss(0.0)
    assert (with_memory - total).abs() > 1e-3  # the memory did change the loss: dropping it is visible


def test_dropout_zero_draws_nothing_and_dropout_draws_one_coin_after_the_rest():
    *_, mem, g0, _, _, _ = loss(0.0)
    g = torch.Generator().manual_seed(0)
    torch.randint(0, K + 1, (B, 4), generator=g)
    torch.randn((B, 4, C, S, S), generator=g)
    assert mem is not None and torch.equal(g.get_state(), g0.get_state())
    coin = torch.rand((), generator=g)
    *_, mem_half, g_half, _, _, _ = loss(0.5)
    assert torch.equal(g.get_state(), g_half.get_state())
    assert (mem_half is None) == bool(coin < 0.5)
    dropped = [loss(0.5, seed=s)[2] is None for s in range(12)]
    assert any(dropped) and not all(dropped)  # a coin per step, not a constant
