"""model.copy_gate=observed: the copy gate only while the last frame is an observed (real) one.

A rollout's context is committed as observed, its generated frames are not: with the gate held open, the first
generated frame is the last context frame and the ones after are not (cached and recomputing paths alike, time- and
pose-chosen memory, through hybrid attention). Per call, a last frame flagged as generated gives the network's v̂
whatever the gate's logit; a learned vector tells the network which it is. The loss draws which clips are gated, last
of all, and supervises the gate only on those.
"""

import pytest
import torch
from test_copy_gate import GATED, make, window
from test_noisy_context import B, K, clip, poses, tiny_cfg

from arvdm.config import ConfigError
from arvdm.model import copy_gate
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import fifo
from arvdm.training.objective import diffusion_forcing_loss
from memory import MemoryBank, MemoryFrames, RetentionPolicy
from memory.select import PoseBank

TIME = ("memory.structure=prepend", "memory.retention=all")
POSE = ("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2", "memory.length=4")


def observed(*overrides, logit=None, embed=0.0, seed=0):
    """test_copy_gate's model with copy_gate=observed; `embed`: every entry of the "gate on" vector."""
    model = make(*overrides, logit=logit, seed=seed, gate="observed")
    with torch.no_grad():
        model.gate_on_embed.fill_(embed)
    return model


def with_flag(mem: MemoryFrames, flag) -> MemoryFrames:
    return MemoryFrames(mem.frames, mem.actions, last_observed=flag)


def test_the_gate_copies_an_observed_last_frame_only():
    """Open gate: a sample whose last frame is observed gets it as its clean frame; one flagged as generated gets v̂,
    the same whatever the gate's logit. None (frames a caller gives by hand) counts as observed."""
    opened, closed = observed(logit=60.0), observed(logit=-60.0)
    diffusion = PerFrameDiffusion(opened.cfg.diffusion)
    mem, x, levels, a = window([1, 40, K])
    flags = torch.tensor([True, False])  # B = 2: sample 0 observed, sample 1 generated
    with torch.no_grad():
        v = opened(x, levels, a, memory=with_flag(mem, flags))
        v_none = opened(x, levels, a, memory=mem)
        v_closed = closed(x, levels, a, memory=with_flag(mem, flags))
    x0 = diffusion.pred_x0(x, v, levels)  # (B, 3, C, H, W)
    assert (x0[0] - mem.frames[0, -1:]).abs().max() < 1e-4  # observed: the last frame itself
    assert (x0[1] - mem.frames[1, -1:]).abs().max() > 0.1  # generated: the network's own
    assert torch.equal(v[1], v_closed[1])  # ... whatever the gate says
    assert torch.equal(v_none[0], v[0])


def test_the_network_is_told_whether_the_gate_is_on():
    """The "gate on" vector is the only other difference: zero, a closed gate gives the same v either way; not zero,
    the network's v̂ changes with the flag."""
    mem, x, levels, a = window([3, 40])
    for embed, differs in ((0.0, False), (0.5, True)):
        model = observed(logit=-60.0, embed=embed)
        with torch.no_grad():
            on, off = (model(x, levels, a, memory=with_flag(mem, f)) for f in (True, False))
        assert ((on - off).abs().max() > 1e-3) == differs


def rollout_of(model, use_cache, n=6, k_ctx=0):
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(n, seed=4)
    extra = {"poses": poses(2 + n, seed=5)} if getattr(model, "pose_aware", False) else {}
    diffusion = PerFrameDiffusion(model.cfg.diffusion)
    out = rollout(model, diffusion, fifo(4, K, 1).with_context_level(k_ctx), ctx, ctx_a, act, n, progress=False,
                  eta=1.0, generator=torch.Generator().manual_seed(1), use_cache=use_cache, **extra)
    return out, ctx


@pytest.mark.parametrize("k_ctx", [0, 30])
@pytest.mark.parametrize("overrides", [TIME, POSE], ids=["time", "pose"])
def test_a_rollout_gates_while_the_context_frame_is_the_last_one(overrides, k_ctx):
    """fifo, Δ = 1: the first generated frame is denoised entirely while the last context frame is the last frame
    (open gate: it is that frame); the next ones finish after a generated frame was committed (not it). Cached and
    recomputing rollouts agree."""
    model = observed(*overrides, logit=60.0, embed=0.3)
    cached, ctx = rollout_of(model, True, k_ctx=k_ctx)
    recomputed, _ = rollout_of(model, False, k_ctx=k_ctx)
    assert (cached - recomputed).abs().max() < 1e-5
    assert (cached[:, 0] - ctx[:, -1]).abs().max() < 1e-3
    assert (cached[:, 1:] - ctx[:, -1:]).abs().amax(dim=(2, 3, 4)).min() > 0.1


def test_hybrid_attention_passes_the_flag_on():
    from arvdm.config import HybridConfig
    from arvdm.hybrid import HybridModel

    model = observed(*TIME, logit=60.0)
    hybrid = HybridModel(model, HybridConfig(select="fixed", layers=[0], sink=1, recent=1))
    out, ctx = rollout_of(hybrid, True)
    assert (out[:, 0] - ctx[:, -1]).abs().max() < 1e-3
    assert (out[:, 1:] - ctx[:, -1:]).abs().amax(dim=(2, 3, 4)).min() > 0.1


@pytest.mark.parametrize("bank", [MemoryBank(RetentionPolicy("all")), PoseBank(length=4, pose_frames=2, capacity=8)],
                         ids=["time", "pose"])
def test_banks_keep_whether_the_newest_frame_was_observed(bank):
    frames, act = clip(2, seed=1)
    pose = poses(4, seed=2)
    bank.append(frames, act, pose[:, :2], observed=True)
    assert bank.memory(pose[:, 2:]).last_observed is True
    bank.append(frames, act, pose[:, 2:])
    assert bank.memory(pose[:, 2:]).last_observed is False


def test_the_loss_draws_the_gated_clips_last_and_supervises_only_their_gate(monkeypatch):
    """One (B,) draw after everything else; with no clip gated the gate's BCE adds nothing, with every clip gated it
    does (and the loss is then the plain pixel gate's, the "gate on" vector aside: zero here)."""
    video, act = clip(6, seed=1)

    def loss(model, lam):
        g = torch.Generator().manual_seed(0)
        total, _ = diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), video, act, 4, K, g,
                                          copy_gate_loss=lam)
        return total.item(), g

    pixel = make()
    model = observed()
    model.load_state_dict(pixel.state_dict() | {"gate_on_embed": model.gate_on_embed.detach()})
    _, g_pixel = loss(pixel, 0.0)
    _, g_obs = loss(model, 0.0)
    torch.rand((B,), generator=g_pixel)
    assert torch.equal(g_pixel.get_state(), g_obs.get_state())  # exactly one (B,) draw more
    monkeypatch.setattr(copy_gate, "OBSERVED_GATE_SHARE", 0.0)
    monkeypatch.setattr("arvdm.training.objective.OBSERVED_GATE_SHARE", 0.0)
    assert loss(model, 0.5)[0] == pytest.approx(loss(model, 0.0)[0], rel=1e-6)
    monkeypatch.setattr("arvdm.training.objective.OBSERVED_GATE_SHARE", 1.1)
    assert loss(model, 0.5)[0] == pytest.approx(loss(pixel, 0.5)[0], rel=1e-5)
    assert loss(model, 0.5)[0] > loss(model, 0.0)[0]


def test_a_generated_last_frame_is_never_gated_in_the_loss(monkeypatch):
    """train.rollout_frames: clips whose last memory frame the model generated (`rollout_context`'s
    generated_last) train the network alone whatever the draw: an open and a closed gate give the same loss, BCE
    included; the draw is still made. Without the flag (every clip gated here) they differ."""
    monkeypatch.setattr("arvdm.training.objective.OBSERVED_GATE_SHARE", 1.1)
    video, act = clip(6, seed=1)

    def loss(model, generated):
        g = torch.Generator().manual_seed(0)
        total, _ = diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), video, act, 4, K, g,
                                          copy_gate_loss=0.5, generated_last=generated)
        return total.item(), g.get_state()

    opened, closed = observed(logit=60.0), observed(logit=-60.0)
    every, none = torch.ones(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    assert loss(opened, every)[0] == pytest.approx(loss(closed, every)[0], rel=1e-6)
    assert loss(opened, none)[0] == pytest.approx(loss(opened, None)[0], rel=1e-6)
    assert abs(loss(opened, None)[0] - loss(closed, None)[0]) > 0.1 * loss(closed, None)[0]
    assert torch.equal(loss(opened, every)[1], loss(opened, None)[1])  # the same draws


def test_own_v_is_the_network_before_the_gate():
    """`copy_gate.own_v` recovers v̂ from the x̂0 `copy_last` returns: an open gate's own v is the closed gate's v (the
    two models differ only in the gate's channel), while the gated v the open model returns is not."""
    opened, closed = make(logit=60.0), make(logit=-60.0)  # the same v̂ channels: only the gate's channel differs
    mem, x, levels, a = window([1, 40, 70, K])
    v_open, _, x0_hat, _ = opened(x, levels, a, memory=mem, return_extras=True)
    v_closed = closed(x, levels, a, memory=mem)
    torch.testing.assert_close(copy_gate.own_v(opened, x, levels, x0_hat), v_closed.float(), rtol=1e-4, atol=1e-4)
    assert (v_open.float() - v_closed.float()).abs().amax() > 0.1
    assert torch.equal(copy_gate.own_v(opened, x, torch.zeros_like(levels), x0_hat), torch.zeros_like(x0_hat))


@pytest.mark.parametrize("gate", ["pixel", "observed"])
def test_a_detached_gate_leaves_the_v_loss_to_the_network(gate, monkeypatch):
    """train.copy_gate_detach: the v-MSE no longer sees the gate. With a negligible BCE weight an open and a closed
    gate give the same loss (the network's own v̂ is scored); without it they do not. Every clip gated here."""
    monkeypatch.setattr("arvdm.training.objective.OBSERVED_GATE_SHARE", 1.1)
    video, act = clip(6, seed=1)

    def loss(model, detach):
        g = torch.Generator().manual_seed(0)
        return diffusion_forcing_loss(model, PerFrameDiffusion(model.cfg.diffusion), video, act, 4, K, g,
                                      copy_gate_loss=1e-9, copy_gate_detach=detach)[0].item()

    opened, closed = make(logit=60.0, gate=gate), make(logit=-60.0, gate=gate)
    assert loss(opened, True) == pytest.approx(loss(closed, True), rel=1e-5)
    assert loss(opened, False) > 1.5 * loss(closed, False)
    assert loss(closed, True) == pytest.approx(loss(closed, False), rel=1e-4)  # a closed gate changes nothing


def test_copy_gate_detach_needs_the_gate_loss():
    with pytest.raises(ConfigError, match="train.copy_gate_detach.*copy_gate_loss > 0"):
        tiny_cfg(*GATED, "train.copy_gate_detach=true").validate()
    with pytest.raises(ConfigError, match="train.copy_gate_detach.*bool"):
        tiny_cfg(*GATED, "train.copy_gate_loss=0.1", "train.copy_gate_detach=1").validate()
    tiny_cfg(*GATED, "train.copy_gate_loss=0.1", "train.copy_gate_detach=true").validate()


def test_the_flag_vector_round_trips_and_the_config_needs_the_last_frame(tmp_path):
    model = observed(embed=0.25)
    model.save_pretrained(tmp_path / "m")
    back = Denoiser.from_pretrained(tmp_path / "m")
    assert torch.equal(back.gate_on_embed, model.gate_on_embed) and back.cfg.model.copy_gate == "observed"
    assert make().gate_on_embed is None  # pixel / frame gates: no flag, checkpoints unchanged
    with pytest.raises(ConfigError, match="model.copy_gate.*model.last_frame_input"):
        Denoiser(tiny_cfg("model.copy_gate=observed"))
    tiny_cfg(*GATED[:1], "model.copy_gate=observed", "train.copy_gate_loss=0.1").validate()
