"""model.action_advection: the last past frame moved along the window's actions by learned per-action kernels.

Window frame j sees the last frame convolved with the kernels of actions a_0..a_j in turn (CDNA advection), borders
replicated; each kernel sums to 1. Checked against hand-made shifts, for mass conservation, for "a fresh model
computes what the same weights without it compute", cached == recomputed rollouts, and the loss's
reconstruction term that trains the kernels.
"""

import pytest
import torch
from test_last_frame_input import assert_fresh_part_changes_nothing
from test_noisy_context import A, B, K, S, clip, poses, tiny_cfg
from test_noisy_context import make as make_random

from arvdm.config import ConfigError
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.model.unet import ADVECTION_LOGIT_SCALE, ActionAdvection
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import fifo
from arvdm.training.objective import ADVECTION_LOSS_WEIGHT, diffusion_forcing_loss
from memory import MemoryFrames

R = 2  # kernel radius of these tests: 5x5 kernels
ON = ("model.last_frame_input=true", f"model.action_advection={R}")


def shift_kernels(advection: ActionAdvection, shifts: dict[int, int]) -> None:
    """Make action a's kernel (all but exactly) the content shift dx = shifts[a] pixels to the right."""
    k = 2 * R + 1
    with torch.no_grad():
        advection.logits.fill_(-1e3 / ADVECTION_LOGIT_SCALE)
        for a, dx in shifts.items():
            # cross-correlation: out[x] = in[x + (tap - R)], so a shift right by dx is the tap at column R - dx
            advection.logits.view(-1, k, k)[a, R, R - dx] = 0.0


def shifted(img: torch.Tensor, dx: int) -> torch.Tensor:
    """img (B,C,H,W) shifted right by dx pixels, the revealed columns copying the border column (by hand)."""
    out = torch.roll(img, dx, dims=-1)
    if dx > 0:
        out[..., :dx] = img[..., :1]
    elif dx < 0:
        out[..., dx:] = img[..., -1:]
    return out


def test_shift_kernels_move_the_frame_and_compound_along_the_window():
    adv = ActionAdvection(A, R, 3, 8)
    shift_kernels(adv, {0: 0, 1: 1, 2: -2})
    last = torch.rand(B, 3, S, S) * 2 - 1
    actions = torch.tensor([[1, 1, 0, 2], [2, 0, 1, 1]])  # (B, T)
    out = adv(last, actions)  # (B, 4, 3, S, S)
    expected = [[1, 2, 2, 0], [-2, -2, -1, 0]]  # cumulative shifts per window frame
    for b in range(B):
        f = last[b:b + 1]
        for j, dx in enumerate(expected[b]):
            step = {0: 0, 1: 1, 2: -2}[int(actions[b, j])]
            f = shifted(f, step)
            assert torch.allclose(out[b, j], f[0], atol=1e-6), (b, j, dx)
    # the direction is the action's: a right turn and a left turn move the same frame apart
    assert (out[0, 0] - out[1, 0]).abs().max() > 0.1


def test_kernels_start_uniform_sum_to_one_and_keep_a_flat_frame_flat():
    adv = ActionAdvection(A, R, 3, 8)
    k = adv.kernels()
    assert k.shape == (A + 1, 2 * R + 1, 2 * R + 1)
    assert torch.allclose(k, torch.full_like(k, 1 / (2 * R + 1) ** 2))
    with torch.no_grad():
        adv.logits.copy_(torch.randn(adv.logits.shape))
    assert torch.allclose(adv.kernels().sum(dim=(1, 2)), torch.ones(A + 1), atol=1e-6)
    flat = torch.full((B, 3, S, S), 0.3)  # replicated borders + kernels summing to 1: nothing is created or lost
    assert torch.allclose(adv(flat, torch.randint(0, A, (B, 3))), torch.full((B, 3, 3, S, S), 0.3), atol=1e-6)
    # zero padding would darken the edge columns instead: the border rule is what keeps it flat
    assert adv.stem.weight.abs().max() == 0 and adv.stem.bias.abs().max() == 0


def test_fresh_model_equals_the_same_weights_without_it():
    keys = {"advection.logits", "advection.stem.weight", "advection.stem.bias"}
    assert_fresh_part_changes_nothing(Denoiser(tiny_cfg(*ON)), Denoiser(tiny_cfg("model.last_frame_input=true")),
                                      "advection.", keys)


def test_the_window_actions_change_the_output_through_it_and_no_memory_means_none():
    model = make_random(*ON)
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.full((B, 2), 40)
    memory = MemoryFrames(mem, mem_a)
    with torch.no_grad():
        out = model(x, levels, a, memory=memory, return_extras=True)
        v, adv = out.v, out.advected
        assert torch.allclose(adv, model.advection(mem[:, -1], a))  # the memory's last frame, the window's actions
        assert torch.equal(v, model(x, levels, a, memory=memory))
        # the same weights with the advected input cut: the output differs, so it is read
        stem = model.advection.stem.weight.clone()
        model.advection.stem.weight.zero_()
        model.advection.stem.bias.zero_()
        assert (v - model(x, levels, a, memory=memory)).abs().max() > 1e-3
        model.advection.stem.weight.copy_(stem)
        none = model(x, levels, a, return_extras=True).advected  # memory dropout / history guidance: no last frame
        assert none is None


@pytest.mark.parametrize("overrides", [
    ("memory.structure=prepend", "memory.retention=all"),
    ("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2", "memory.length=4"),
], ids=["prepend", "pose"])
def test_cached_equals_recomputed(overrides):
    model = make_random(*ON, *overrides)
    sched = fifo(4, K, 1).with_context_level(15)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(9, seed=4)
    extra = {"poses": poses(2 + 9, seed=5)} if model.pose_aware else {}

    def run(use_cache):
        return rollout(model, PerFrameDiffusion(model.cfg.diffusion), sched, ctx, ctx_a, act, 9, progress=False,
                       eta=0.5, generator=torch.Generator().manual_seed(1), use_cache=use_cache, **extra)

    assert (run(True) - run(False)).abs().max() < 1e-5


def test_the_loss_adds_the_reconstruction_term_and_trains_the_kernels():
    model = Denoiser(tiny_cfg(*ON)).train()  # fresh: stem zero, so the kernels learn only through the new term
    video, act = clip(6, seed=1)
    diff = PerFrameDiffusion(model.cfg.diffusion)
    total, counted = diffusion_forcing_loss(model, diff, video, act, 4, K, torch.Generator().manual_seed(0))
    (total / counted).backward()
    assert model.advection.logits.grad.abs().max() > 0
    # the same draw without the term: the difference is the weighted |advected - x0|^2 of the counted frames
    g = torch.Generator().manual_seed(0)
    levels = torch.randint(0, K + 1, (B, 2), generator=g)
    with torch.no_grad():
        adv = model.advection(video[:, 3], act[:, 4:])  # (B, 2, C, S, S)
        rec = ((adv - video[:, 4:]).pow(2).mean(dim=(2, 3, 4)) * (levels > 0)).sum()
        off, _ = diffusion_forcing_loss(model, diff, video, act, 4, K, torch.Generator().manual_seed(0),
                                        advection_loss=0.0)  # what validation computes
        model.advection = None
        bare, _ = diffusion_forcing_loss(model, diff, video, act, 4, K, torch.Generator().manual_seed(0))
    assert torch.allclose(total.detach(), bare + ADVECTION_LOSS_WEIGHT * rec, rtol=1e-5)
    assert torch.equal(off, bare) and rec > 0


@pytest.mark.parametrize("value, extra", [(-1, ()), (S, ()), (2, ("model.last_frame_input=false",))],
                         ids=["negative", "image-size", "no-last-frame"])
def test_bad_config_is_refused_naming_the_key(value, extra):
    with pytest.raises(ConfigError, match="model.action_advection"):
        tiny_cfg("model.last_frame_input=true", f"model.action_advection={value}", *extra).validate()


def test_an_open_copy_gate_copies_the_advected_frame_and_the_loss_targets_it():
    """With model.copy_gate the gate's source is each window frame's advected last frame (CDNA's compositing mask)."""
    model = make_random(*ON, "model.copy_gate=frame")
    shift_kernels(model.advection, {a: (a % 3) - 1 for a in range(A)})  # actions shift by -1, 0 or +1 pixels
    with torch.no_grad():
        model.decoder.out.weight[-1].zero_()
        model.decoder.out.bias[-1] = 60.0  # gate = 1 everywhere
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(3, seed=2)
    levels = torch.tensor([[5, 40, K]]).expand(B, -1)
    diff = PerFrameDiffusion(model.cfg.diffusion)
    with torch.no_grad():
        v, logit, x0_hat, adv = model(x, levels, a, memory=MemoryFrames(mem, mem_a), return_extras=True)
    x0 = diff.pred_x0(x, v, levels)
    assert (x0 - adv).abs().max() < 1e-4  # the advected frames, not the unmoved last frame
    assert (adv - mem[:, -1:]).abs().max() > 0.1
