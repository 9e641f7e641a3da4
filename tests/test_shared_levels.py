"""train.shared_level_p: clips whose window frames share one level (a chunked rollout's window pattern), and
train.top_level_p: clips whose window frames all sit at level K (the anchor's call), against the loss's own draws;
the trainer's coins."""

from __future__ import annotations

import math

import pytest
import torch
from test_history_guidance import B, C, K, S, clip, make
from test_training import POSE, tiny_cfg, write_episodes

from arvdm.config import ConfigError, apply_overrides, get_preset
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.trainer import Trainer

M, W = 4, 4


class WindowSpy(torch.nn.Module):
    """Records the window and levels the loss gives the model; v = a fixed function of the window."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, levels, actions, memory=None):
        self.calls.append((x.clone(), levels.clone()))
        return 0.5 * x


def _loss(shared, top=None):
    dif = PerFrameDiffusion(make().cfg.diffusion)
    video, act = clip(M + W, seed=7)
    spy, g = WindowSpy(), torch.Generator().manual_seed(3)
    total, _ = diffusion_forcing_loss(spy, dif, video, act, M, K, g, shared_levels=shared, top_levels=top)
    return spy.calls[0], g, dif, video, total


def test_shared_clips_take_their_first_frames_level_and_draw_nothing_more():
    (x_plain, lv_plain), g_plain, dif, video, _ = _loss(None)
    shared = torch.tensor([True, False])
    (x_sh, lv_sh), g_sh, _, _, total = _loss(shared)
    assert not (lv_plain[0] == lv_plain[0, 0]).all()  # the draw itself has several levels in row 0
    assert torch.equal(lv_sh[0], lv_plain[0, :1].expand(W)) and torch.equal(lv_sh[1], lv_plain[1])
    assert torch.equal(x_sh[1], x_plain[1])  # the other clip: same levels, same noise
    assert torch.equal(g_sh.get_state(), g_plain.get_state())  # nothing drawn for the lever
    # row 0 noised with the same noise, to its first frame's level
    g = torch.Generator().manual_seed(3)
    torch.randint(0, K + 1, (B, W), generator=g)
    noise = torch.randn((B, W, C, S, S), generator=g)
    torch.testing.assert_close(x_sh[0], dif.add_noise(video[:1, M:], noise[:1], lv_sh[:1])[0])


def test_top_clips_sit_at_level_k_with_the_same_noise_and_draw_nothing_more():
    (x_plain, lv_plain), g_plain, dif, video, _ = _loss(None)
    (x_top, lv_top), g_top, _, _, _ = _loss(None, top=torch.tensor([False, True]))
    assert not (lv_plain[1] == K).all()  # the draw itself is not all at K
    assert torch.equal(lv_top[1], torch.full((W,), K)) and torch.equal(lv_top[0], lv_plain[0])
    assert torch.equal(x_top[0], x_plain[0])  # the other clip: same levels, same noise
    assert torch.equal(g_top.get_state(), g_plain.get_state())  # nothing drawn for the lever
    g = torch.Generator().manual_seed(3)
    torch.randint(0, K + 1, (B, W), generator=g)
    noise = torch.randn((B, W, C, S, S), generator=g)
    torch.testing.assert_close(x_top[1], dif.add_noise(video[1:, M:], noise[1:], lv_top[1:])[0])
    # top wins over shared: a clip given both sits at K
    (_, lv_both), _, _, _, _ = _loss(torch.tensor([True, True]), top=torch.tensor([False, True]))
    assert torch.equal(lv_both[1], torch.full((W,), K)) and torch.equal(lv_both[0], lv_plain[0, :1].expand(W))


@pytest.mark.parametrize("key", ["shared_level_p", "top_level_p", "member_top_level_p"])
def test_level_shares_are_checked(key):
    for bad in (-0.5, 2, math.nan):
        with pytest.raises(ConfigError, match=rf"train\.{key}"):
            apply_overrides(get_preset("tiny"), [f"train.{key}={bad}"]).validate()


@pytest.mark.parametrize("key,arg", [("shared_level_p", "shared_levels"), ("top_level_p", "top_levels")])
def test_the_trainer_gives_the_share_it_was_told(tmp_path, monkeypatch, key, arg):
    from arvdm.training import trainer as trainer_module
    data = write_episodes(tmp_path / "data", poses=True)
    seen, original = [], trainer_module.diffusion_forcing_loss
    monkeypatch.setattr(trainer_module, "diffusion_forcing_loss",
                        lambda *a, **kw: seen.append(kw.get(arg)) or original(*a, **kw))
    got = {}
    for p in (0.0, 1.0, 0.5):
        seen.clear()
        cfg = tiny_cfg(data, *POSE, f"train.{key}={p}", "train.max_steps=4", "train.val_every=0",
                       "train.ckpt_every=4")
        Trainer(cfg, tmp_path / f"run{p}", device="cpu").fit()
        got[p] = list(seen)
    assert got[0.0] == [None] * 4
    assert all(bool(s.all()) for s in got[1.0])
    half = torch.cat(got[0.5])
    assert 0 < int(half.sum()) < len(half)
