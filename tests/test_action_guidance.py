"""Action guidance (classifier-free guidance over the actions): `train.action_dropout` in the loss, the null action in
the denoiser, v += W_a (v - v_noact) at sampling (`--action-guidance`).

The dropped samples' actions stop mattering and the others' outputs do not move; W_a = 0 is the plain rollout bit for
bit with one call per row, W_a != 0 the combination computed by hand (beside history guidance's term); p = 0 draws
nothing; runners that cannot guide, weights that are not finite and dropout shares outside [0, 1) are refused.
"""

import csv
import math

import pytest
import torch
from test_history_guidance import B, Counting, K, LossSpy, OtherRows, clip, go, make
from test_training import tiny_cfg, write_episodes

from arvdm.config import ConfigError, SamplingError, TrainConfig
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rows import RolloutContext
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.presets import fifo
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.trainer import Trainer

ADVECT = ("model.last_frame_input=true", "model.action_advection=2")


def test_dropped_samples_ignore_their_actions_and_the_others_are_unchanged():
    model = make(*ADVECT)
    (past, past_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    other = (a + 1) % model.null_action
    levels = torch.tensor([[30, 60]] * B)
    state = model.init_state(B)
    drop = torch.tensor([True, False])
    with torch.no_grad():
        model.commit(state, past, past_a)
        plain = model(x, levels, a, state=state)
        dropped = model(x, levels, a, state=state, drop_actions=drop)
        dropped_other = model(x, levels, other, state=state, drop_actions=drop)
    torch.testing.assert_close(dropped[1], plain[1], atol=0, rtol=0)  # not dropped: as before
    torch.testing.assert_close(dropped[0], dropped_other[0], atol=0, rtol=0)  # dropped: the actions do not matter
    assert (dropped[0] - plain[0]).abs().max() > 1e-3  # and the null action is not sample 0's own


@pytest.mark.parametrize("use_cache", [True, False])
def test_weight_zero_is_the_plain_rollout_and_a_weight_adds_one_call_per_row(use_cache):
    model, sched = make(), fifo(4, K, 1)
    plain, zero, guided = Counting(model), Counting(model), Counting(model)
    a = go(plain, sched, use_cache=use_cache)
    b = go(zero, sched, use_cache=use_cache, action_guidance=0.0)
    c = go(guided, sched, use_cache=use_cache, action_guidance=1.5)
    assert torch.equal(a, b) and zero.calls == plain.calls == sched.num_calls(5)
    assert guided.calls == 2 * plain.calls and (c - a).abs().max() > 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
def test_context_predict_adds_both_guidance_terms_to_the_conditional_v(use_cache):
    model, w_hist, w_act = make(*ADVECT), 0.75, 2.0
    (past, past_a), (x, a) = clip(4, seed=1), clip(2, seed=2)
    levels = torch.tensor([[30, 60]] * B)
    dif = PerFrameDiffusion(model.cfg.diffusion)
    ctx = RolloutContext(model, dif, 0.0, None, B, x.device, x.dtype, history_guidance=w_hist, action_guidance=w_act)
    if use_cache:
        ctx.state = model.init_state(B)
    else:
        from memory import make_bank
        ctx.bank = make_bank(model.cfg.memory, None)
    with torch.no_grad():
        if use_cache:
            model.commit(ctx.state, past, past_a)
            past_kw = {"state": ctx.state}
        else:
            ctx.bank.append(past, past_a, None)
            past_kw = {"memory": ctx.bank.memory(None)}
        got = ctx.predict(x, levels, a)
        v = model(x, levels, a, **past_kw)
        v_nomem = model(x, levels, a)
        v_noact = model(x, levels, a, drop_actions=torch.ones(B, dtype=torch.bool), **past_kw)
    assert (v - v_noact).abs().max() > 1e-3
    torch.testing.assert_close(got, v + w_hist * (v - v_nomem) + w_act * (v - v_noact), atol=1e-6, rtol=0)


def test_refusals_name_the_argument():
    with pytest.raises(SamplingError, match="OtherRows does not support them"):
        go(make(), fifo(4, K, 1), rows=OtherRows(), action_guidance=1.0)
    for bad in (float("nan"), float("inf"), "x", None):
        with pytest.raises(SamplingError, match="rollout action_guidance must be a finite number"):
            go(make(), fifo(4, K, 1), action_guidance=bad)
        with pytest.raises(SamplingError, match="--action-guidance must be a finite number"):
            SampleSettings(action_guidance=bad).validate()
    for bad in (1.0, -0.1, True, "0.1", math.nan):
        with pytest.raises(ConfigError, match="train.action_dropout"):
            TrainConfig(action_dropout=bad).validate()


# -- training ------------------------------------------------------------------------------------------------

class ActionSpy(LossSpy):
    def forward(self, x, levels, actions, memory=None, **kw):
        self.kwargs = kw
        return super().forward(x, levels, actions, memory)


def _loss(p, seed=0):
    dif = PerFrameDiffusion(make().cfg.diffusion)
    video, act = clip(8, seed=7)
    spy, g = ActionSpy(), torch.Generator().manual_seed(seed)
    diffusion_forcing_loss(spy, dif, video, act, 4, K, g, action_dropout=p)
    return spy.kwargs, g


def test_dropout_zero_draws_nothing_and_dropout_draws_one_flag_per_clip_last():
    kw0, g0 = _loss(0.0)
    assert kw0 == {}  # the model is called exactly as without the lever
    g = torch.Generator().manual_seed(0)
    torch.randint(0, K + 1, (B, 4), generator=g)
    torch.randn((B, 4, 3, 16, 16), generator=g)
    assert torch.equal(g.get_state(), g0.get_state())
    flags = torch.rand(B, generator=g) < 0.5
    kw, g_half = _loss(0.5)
    assert torch.equal(kw["drop_actions"], flags) and torch.equal(g.get_state(), g_half.get_state())
    seen = torch.stack([_loss(0.5, seed=s)[0]["drop_actions"] for s in range(12)])
    assert seen.any() and not seen.all()


def test_the_trainer_trains_the_null_action(tmp_path):
    """With action dropout the null action's embedding row gets a gradient and moves (from the second step: the output
    conv starts at zero); without, the loss never uses it and it stays where it started."""
    data = write_episodes(tmp_path / "data")
    rows = {}
    for p in (0.0, 0.9):
        cfg = tiny_cfg(data, f"train.action_dropout={p}", "train.max_steps=3", "train.val_every=0",
                       "train.sample_every=0", "train.log_every=1")
        t = Trainer(cfg, tmp_path / f"run{p}", device="cpu")
        null = t.model.null_action
        before = t.model.action_embed.weight[null].detach().clone()
        t.fit()
        rows[p] = (t.model.action_embed.weight[null] - before).abs().max().item()
        assert list(csv.DictReader(open(tmp_path / f"run{p}" / "log.csv")))
    assert rows[0.0] == 0.0 and rows[0.9] > 0.0


def test_a_drop_mask_of_the_wrong_shape_is_refused():
    from arvdm.model.denoiser import DenoiserError
    model = make()
    x, a = clip(2, seed=2)
    with pytest.raises(DenoiserError, match=r"drop_actions must be \(B,\) = \(2,\) bool"):
        model(x, torch.full((B, 2), 30), a, drop_actions=torch.ones(B, 2, dtype=torch.bool))


def test_sample_settings_carry_the_weight_into_the_rollouts():
    """sample.py's path (`roll_out_episodes`): W_a = 0 gives the default rollout, W_a = 1 another one."""
    from arvdm.sampling import roll_out_episodes
    from arvdm.schedules.presets import chunked
    model = make()
    real, actions = clip(6, seed=5)
    sched = chunked(2, K, 2)

    def go_settings(**kw):
        s = SampleSettings(frames=4, steps=2, context=2, progress=False, **kw)
        return roll_out_episodes(model, model.cfg, sched, real, actions, 2, s, torch.device("cpu"))[0]

    plain = go_settings()
    assert torch.equal(go_settings(action_guidance=0.0), plain)
    assert (go_settings(action_guidance=1.0) - plain).abs().max() > 1e-3
