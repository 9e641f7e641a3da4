"""model.copy_gate: a per-pixel gate on the predicted clean frame that copies the last past frame.

The decoder gives v̂ and a gate logit; the model returns the v whose clean frame is x̂0 + g (last − x̂0). Checked
against hand values: a closed gate gives v̂ (the same weights without the gate), an open one gives the last frame
as the clean frame at every level, a half-open one the midpoint; level-0 frames and calls without memory get v̂;
cached rollouts equal recomputing ones; the loss reaches the gate; the config refuses it without the last frame.
"""

import pytest
import torch
import torch.nn.functional as F
from test_noisy_context import B, K, S, clip, poses, tiny_cfg
from test_noisy_context import make as make_random

from arvdm.config import ConfigError
from arvdm.model.copy_gate import COPY_GATE_BIAS
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import fifo
from arvdm.training.objective import _memory, copy_target, diffusion_forcing_loss
from memory import MemoryFrames

GATED = ("model.last_frame_input=true", "model.copy_gate=pixel")


def make(*overrides, logit=None, seed=0, gate="pixel"):
    """test_noisy_context's all-random tiny model with the gate; `logit` given: the gate's output channel is that
    constant (weights 0, bias `logit`), so the gate is sigmoid(logit + COPY_GATE_BIAS) everywhere."""
    model = make_random(*GATED, f"model.copy_gate={gate}", *overrides, seed=seed)
    if logit is not None:
        with torch.no_grad():
            model.decoder.out.weight[-1].zero_()
            model.decoder.out.bias[-1] = logit
    return model


def window(levels):
    (mem, mem_a), (x, a) = clip(4, seed=1), clip(len(levels), seed=2)
    return MemoryFrames(mem, mem_a), x, torch.tensor(levels).expand(B, -1), a


def test_closed_gate_is_the_same_weights_without_it():
    gated = make(logit=-60.0)
    plain = Denoiser(tiny_cfg("model.last_frame_input=true")).eval()
    weights = gated.state_dict()
    weights["decoder.out.weight"], weights["decoder.out.bias"] = weights["decoder.out.weight"][:-1], \
        weights["decoder.out.bias"][:-1]
    plain.load_state_dict(weights)  # the gate adds one output channel and nothing else (its tables are not saved)
    mem, x, levels, a = window([0, 1, 40, K])
    with torch.no_grad():
        out, ref = gated(x, levels, a, memory=mem), plain(x, levels, a, memory=mem)
    assert ref.abs().max() > 1e-2 and (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("gate", ["pixel", "frame"])
@pytest.mark.parametrize("logit, share", [(60.0, 1.0), (-COPY_GATE_BIAS, 0.5)])
def test_open_gate_copies_the_last_frame(logit, share, gate):
    """x0 of the returned v is x̂0 + g (last − x̂0): the last frame (g = 1) or the midpoint (g = 1/2) at every level
    above 0; a frame at level 0 keeps v̂."""
    gated, closed = make(logit=logit, gate=gate), make(logit=-60.0)
    diffusion = PerFrameDiffusion(gated.cfg.diffusion)
    mem, x, levels, a = window([1, 5, 40, K, 0])  # a window of 5: frames_per_chunk is 1 in this preset
    with torch.no_grad():
        v, v_hat = gated(x, levels, a, memory=mem), closed(x, levels, a, memory=mem)
    x0, x0_hat = diffusion.pred_x0(x, v, levels), diffusion.pred_x0(x, v_hat, levels)  # (B, 5, C, H, W)
    want = x0_hat + share * (mem.frames[:, -1:] - x0_hat)
    assert (x0[:, :4] - want[:, :4]).abs().max() < 1e-4
    assert (x0_hat[:, :4] - want[:, :4]).abs().max() > 0.1  # the gate changed them
    assert torch.equal(v[:, 4], v_hat[:, 4])  # level 0: untouched


def test_without_memory_the_gate_is_not_used():
    gated, closed = make(logit=60.0), make(logit=-60.0)
    _, x, levels, a = window([3, 40])
    with torch.no_grad():
        assert torch.equal(gated(x, levels, a), closed(x, levels, a))


@pytest.mark.parametrize("overrides", [
    ("memory.structure=prepend", "memory.retention=all"),
    ("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2", "memory.length=4"),
], ids=["prepend", "pose"])
@pytest.mark.parametrize("k_ctx", [0, 15])
def test_cached_equals_recomputed(overrides, k_ctx):
    model = make(*overrides, logit=2.0)
    sched = fifo(4, K, 1).with_context_level(k_ctx)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(9, seed=4)
    extra = {"poses": poses(2 + 9, seed=5)} if model.pose_aware else {}

    def run(m, use_cache):
        return rollout(m, PerFrameDiffusion(m.cfg.diffusion), sched, ctx, ctx_a, act, 9, progress=False, eta=0.5,
                       generator=torch.Generator().manual_seed(1), use_cache=use_cache, **extra)

    cached = run(model, True)
    assert (cached - run(model, False)).abs().max() < 1e-5
    assert (cached - run(make(*overrides, logit=-60.0), True)).abs().max() > 1e-3  # the gate mattered


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("overrides", [("memory.structure=prepend", "memory.retention=all"),
                                       ("memory.select=pose", "memory.pose_frames=2", "memory.length=4")],
                         ids=["time", "pose"])
def test_an_open_gate_holds_the_clean_last_frame_under_noisy_context(overrides, use_cache):
    """Noisy context commits every frame re-noised; the gate copies the frame as it was before (the bank keeps the
    newest clean): with the gate open, every generated frame is the last context frame, to float error."""
    model = make(*overrides, logit=60.0)
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(6, seed=4)
    extra = {"poses": poses(2 + 6, seed=5)} if model.pose_aware else {}
    out = rollout(model, PerFrameDiffusion(model.cfg.diffusion), fifo(4, K, 1).with_context_level(30), ctx, ctx_a,
                  act, 6, progress=False, eta=1.0, generator=torch.Generator().manual_seed(1), use_cache=use_cache,
                  **extra)  # (B, 2 + 6, C, H, W)
    assert (out[:, 2:] - ctx[:, -1:]).abs().max() < 1e-3


def test_a_frame_gate_is_one_share_per_frame_and_a_pixel_gate_is_not():
    """copy_gate=frame: x0 − x̂0 = g (last − x̂0) with one g per frame (the logit's mean); pixel: g varies."""
    closed = make(logit=-60.0)
    mem, x, levels, a = window([3, 40, K])
    with torch.no_grad():
        v_hat = closed(x, levels, a, memory=mem)
        for gate in ("frame", "pixel"):
            model = make(gate=gate)  # all-random: the logit channel varies over pixels
            with torch.no_grad():  # the same v̂ as `closed`
                model.decoder.out.weight[:-1].copy_(closed.decoder.out.weight[:-1])
                model.decoder.out.bias[:-1].copy_(closed.decoder.out.bias[:-1])
            diffusion = PerFrameDiffusion(model.cfg.diffusion)
            x0 = diffusion.pred_x0(x, model(x, levels, a, memory=mem), levels)
            x0_hat = diffusion.pred_x0(x, v_hat, levels)
            share = ((x0 - x0_hat) / (mem.frames[:, -1:] - x0_hat)).mean(dim=2)  # (B, 3, H, W): g per pixel
            spread = (share.amax(dim=(-2, -1)) - share.amin(dim=(-2, -1))).max()
            assert (spread < 1e-3) if gate == "frame" else (spread > 1e-2), (gate, spread)
            assert share.min() > 0 and share.max() < 1


def test_hybrid_attention_passes_the_clean_frames_on():
    """`HybridModel.commit` forwards `clean=`: through it too an open gate holds the clean last context frame."""
    from arvdm.config import HybridConfig
    from arvdm.hybrid import HybridModel

    model = make("memory.structure=prepend", "memory.retention=all", logit=60.0)
    hybrid = HybridModel(model, HybridConfig(fraction=0.5, select="online", sink=1, recent=2))
    ctx, ctx_a = clip(4, seed=3)  # more than sink + recent: the online choice of streaming layers is made
    _, act = clip(6, seed=4)
    out = rollout(hybrid, PerFrameDiffusion(model.cfg.diffusion), fifo(4, K, 1).with_context_level(30), ctx, ctx_a,
                  act, 6, progress=False, eta=1.0, generator=torch.Generator().manual_seed(1), use_cache=True)
    assert (out[:, 4:] - ctx[:, -1:]).abs().max() < 1e-3


def test_the_loss_gives_the_memory_its_clean_last_frame():
    video, act = clip(6, seed=1)
    mem = _memory(PerFrameDiffusion(tiny_cfg().diffusion), video[:, :4], act[:, :4], None, None,
                  torch.Generator().manual_seed(0), context_noise_max=50, memory_dropout=0.0)
    assert torch.equal(mem.last, video[:, 3]) and (mem.frames[:, -1] - video[:, 3]).abs().max() > 0.01


def test_the_loss_reaches_the_gate():
    model = make(logit=0.0).train()
    video, act = clip(6, seed=1)
    total, counted = diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), video, act, 4, K,
                                            torch.Generator().manual_seed(0), weight="min_snr")
    assert counted > 0 and torch.isfinite(total)
    total.backward()
    assert model.decoder.out.bias.grad[-1].abs() > 0 and torch.isfinite(model.decoder.out.weight.grad).all()


def test_copy_target_is_the_share_of_the_last_frame_that_is_best():
    """g* = <x0 − x̂0, last − x̂0> / |last − x̂0|² clipped to [0, 1]: the last frame itself 1, x̂0 itself 0, their
    midpoint 1/2, beyond the last frame 1, beyond x̂0 0; per pixel each pixel on its own."""
    last = clip(1, seed=3)[0][:, 0]  # (B, C, S, S)
    x0_hat = clip(5, seed=4)[0]  # (B, 5, C, S, S)
    d = last[:, None] - x0_hat
    frames = x0_hat + torch.tensor([1.0, 0.0, 0.5, 1.7, -0.3])[None, :, None, None, None] * d
    assert copy_target(frames, last[:, None], x0_hat).flatten(1) == pytest.approx(
        torch.tensor([[1.0, 0, 0.5, 1, 0]] * B), abs=1e-5)
    mixed = frames[:, 2].clone()  # the midpoint, with the left half at the last frame
    mixed[..., : S // 2] = last[..., : S // 2]
    per_pixel = copy_target(mixed[:, None], last[:, None], x0_hat[:, 2:3], per_pixel=True)  # (B, 1, 1, S, S)
    assert per_pixel.shape == (B, 1, 1, S, S)
    assert per_pixel[..., : S // 2] == pytest.approx(torch.ones(B, 1, 1, S, S // 2), abs=1e-4)
    assert per_pixel[..., S // 2:] == pytest.approx(torch.full((B, 1, 1, S, S // 2), 0.5), abs=1e-4)


@pytest.mark.parametrize("gate", ["pixel", "frame"])
def test_the_gate_loss_adds_the_bce_of_the_gate_and_draws_nothing(gate):
    """total(λ) − total(0) = λ Σ over counted frames of BCE(gate logit, copy_target), recomputed here from the same
    draws (levels, then noise); the term draws nothing; on a clip that stands still it pulls the gate open."""
    video, act = clip(6, seed=1)
    still = video.clone()
    still[:, 3:] = video[:, 3:4]  # memory's last frame held through the window
    for clip_video in (video, still):
        grads, totals, states = [], [], []
        for lam in (0.0, 0.5):
            model = make(gate=gate).train()
            g = torch.Generator().manual_seed(0)
            total, counted = diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), clip_video, act, 4,
                                                    K, g, weight="min_snr", copy_gate_loss=lam)
            total.backward()
            grads.append(model.decoder.out.bias.grad[-1].item())
            totals.append(total.item())
            states.append(g.get_state())
        assert torch.equal(states[0], states[1])  # the term drew nothing
        g = torch.Generator().manual_seed(0)
        levels = torch.randint(0, K + 1, (B, 2), generator=g)
        noise = torch.randn(clip_video[:, 4:].shape, generator=g)
        diffusion = PerFrameDiffusion(model.cfg.diffusion)
        with torch.no_grad():
            _, logit, x0_hat, _ = model(diffusion.add_noise(clip_video[:, 4:], noise, levels), levels, act[:, 4:],
                                        memory=MemoryFrames(clip_video[:, :4], act[:, :4]), return_extras=True)
        share = copy_target(clip_video[:, 4:], clip_video[:, 3, None], x0_hat, per_pixel=gate == "pixel")
        bce = F.binary_cross_entropy_with_logits(logit, share, reduction="none").mean(dim=(2, 3, 4))  # (B, 2)
        assert totals[1] - totals[0] == pytest.approx(0.5 * float((bce * (levels > 0)).sum()), rel=1e-4)
        if clip_video is still:
            assert share.min() == 1 and grads[1] < grads[0]  # copying is exact: the term opens the gate
        else:
            assert share.mean() < 0.5  # a moving clip: mostly the network


def test_config_refuses_a_bad_gate_loss():
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(ConfigError, match="train.copy_gate_loss"):
            tiny_cfg(*GATED, f"train.copy_gate_loss={bad}").validate()
    with pytest.raises(ConfigError, match="train.copy_gate_loss.*needs model.copy_gate"):
        tiny_cfg("train.copy_gate_loss=0.1").validate()
    tiny_cfg(*GATED, "train.copy_gate_loss=0.1").validate()


def test_config_needs_the_last_frame_and_a_known_gate():
    with pytest.raises(ConfigError, match="model.copy_gate.*model.last_frame_input"):
        Denoiser(tiny_cfg("model.copy_gate=frame"))
    for bad in ("true", "1", "pixels"):
        with pytest.raises(ConfigError, match="model.copy_gate.*one of"):
            Denoiser(tiny_cfg(*GATED[:1], f"model.copy_gate={bad}"))
