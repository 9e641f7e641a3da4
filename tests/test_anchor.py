"""The low-frequency anchor (arvdm.pipeline.anchor, rollout(anchor_sigma=), sample.py --anchor-sigma).

The blur against a 2-D reference; one call's v moves x̂0 by exactly the blurred pull and leaves frames at level K
alone; the anchor follows the window (FIFO shift, candidate choice); a rollout equals an independent per-window
reference on the chunked schedule, where every window starts at K; refusals name the flag.
"""

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from test_noisy_context import B, K, clip, make

import sample
from arvdm.config import Config, ConfigError, SamplingError, get_preset
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import LowFrequencyAnchor, gaussian_lowpass, use_anchor
from arvdm.pipeline.rollout import episode_generators, rollout
from arvdm.pipeline.rows import PlainRows
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.presets import chunked, fifo
from arvdm.speculative.rows import SpeculativeRows, make_speculation


def go(model, sched, n_frames, generator, **kw):
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(n_frames, seed=4)
    kw.setdefault("eta", 1.0)
    return rollout(model, PerFrameDiffusion(model.cfg.diffusion), sched, ctx, ctx_a, act, n_frames, progress=False,
                   generator=generator, **kw)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.5])
def test_lowpass_is_the_2d_gaussian_with_replicated_edges(sigma):
    x = torch.randn(2, 3, 11, 9, dtype=torch.float64)
    r = max(1, int(torch.tensor(3 * sigma).ceil()))
    t = torch.arange(-r, r + 1, dtype=torch.float64)
    g = torch.exp(-(t[:, None] ** 2 + t[None, :] ** 2) / (2 * sigma ** 2))
    g = g / g.sum()  # (2r+1, 2r+1) the 2-D kernel, not separated
    ref = F.conv2d(F.pad(x.reshape(-1, 1, 11, 9), (r, r, r, r), mode="replicate"), g[None, None]).reshape(x.shape)
    torch.testing.assert_close(gaussian_lowpass(x, sigma), ref)
    torch.testing.assert_close(gaussian_lowpass(torch.full_like(x, 0.3), sigma), torch.full_like(x, 0.3))


def test_one_call_moves_x0_by_the_blurred_pull_and_leaves_level_k_alone():
    d = PerFrameDiffusion(make().cfg.diffusion)
    g = torch.Generator().manual_seed(0)
    x, v1, v2 = (torch.randn(B, 3, 3, 8, 8, generator=g) for _ in range(3))
    anchor = LowFrequencyAnchor(d, 1.5)
    top = torch.full((B, 3), K)
    assert torch.equal(anchor.apply(x, v1, top), v1)  # at level K x̂0 is its own anchor
    a = d.pred_x0(x, v1, top)
    levels = torch.tensor([[40, 70, K]] * B)  # the third frame is entering again: anchored anew, not pulled
    got = anchor.apply(x, v2, levels)
    x0 = d.pred_x0(x, v2, levels)
    want = x0 + gaussian_lowpass(a - x0, 1.5)
    torch.testing.assert_close(d.pred_x0(x, got, levels)[:, :2], want[:, :2], atol=1e-5, rtol=0)
    assert torch.equal(got[:, 2], v2[:, 2])
    torch.testing.assert_close(anchor.anchor[:, 2], x0[:, 2])
    assert (got[:, :2] - v2[:, :2]).abs().max() > 1e-2  # the pull did move v
    floored = LowFrequencyAnchor(d, 1.5, floor=50)  # calls from level <= 50 are not pulled
    floored.apply(x, v1, top)
    got = floored.apply(x, v2, levels)
    assert torch.equal(got[:, 0], v2[:, 0]) and torch.equal(got[:, 2], v2[:, 2])
    torch.testing.assert_close(d.pred_x0(x, got, levels)[:, 1], want[:, 1], atol=1e-5, rtol=0)


def test_the_anchor_moves_with_the_window_and_with_the_chosen_candidates():
    d = PerFrameDiffusion(make().cfg.diffusion)
    anchor = LowFrequencyAnchor(d, 1.0)
    x = torch.randn(3, 4, 3, 8, 8)
    anchor.apply(x, torch.randn_like(x), torch.tensor([[K, K, K, 50]] * 3))  # position 3 never started at K
    first = anchor.anchor.clone()
    assert anchor.held.tolist() == [[True, True, True, False]] * 3
    anchor.shift(2)
    assert anchor.held.tolist() == [[True, False, False, False]] * 3
    assert torch.equal(anchor.anchor[:, 0], first[:, 2])
    anchor.select(torch.tensor([2, 2, 0]))
    assert torch.equal(anchor.anchor[0, 0], first[2, 2]) and torch.equal(anchor.anchor[2, 0], first[0, 2])
    # a frame that never sat at K is not pulled
    v = torch.randn_like(x)
    levels = torch.tensor([[30, 30, 30, 30]] * 3)
    assert torch.equal(anchor.apply(x, v, levels)[:, 1:], v[:, 1:])


class ReferenceAnchorRows(PlainRows):
    """An independent reference for the chunked schedule: every window starts at level K at its first row, so one
    anchor per run_rows call, taken at that row, is what LowFrequencyAnchor keeps per position."""

    def __init__(self, sigma, floor=0):
        self.sigma, self.floor = sigma, floor

    def run_rows(self, x, rows, win_actions, stage, ar_step, frame_offset):
        r, d = self.rollout, self.rollout.diffusion
        assert bool((rows[0] == d.num_levels).all())
        rows_b = rows.unsqueeze(1).expand(-1, r.batch_size, -1)
        a = None
        for m in range(rows.shape[0] - 1):
            v = r.predict(x, rows_b[m], win_actions)
            x0 = d.pred_x0(x, v, rows_b[m])
            if m == 0:
                a = x0
            elif int(rows[m][0]) > self.floor:  # v for x̂0 + G(a − x̂0) at the same x_t
                std = (1 - d.alpha_bar(rows_b[m])).sqrt().float()[..., None, None, None]
                v = v - gaussian_lowpass(a - x0, self.sigma) / std
            x = d.step(x, v, rows_b[m], rows_b[m + 1], r.eta, noise=r.noise(x.shape) if r.eta > 0 else None)
        return x


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "recomputed"])
def test_rollout_equals_the_per_window_reference_on_the_chunked_schedule(use_cache):
    model, sched = make(), chunked(2, K, 3).with_context_level(10)  # rows at levels 100, 67, 33, 0
    plain = go(model, sched, 6, episode_generators(1, range(B)), use_cache=use_cache)
    ref = go(model, sched, 6, episode_generators(1, range(B)), use_cache=use_cache, rows=ReferenceAnchorRows(1.0))
    got = go(model, sched, 6, episode_generators(1, range(B)), use_cache=use_cache, anchor_sigma=1.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert (got - plain).abs().max() > 1e-2  # the anchor changed the frames
    ref40 = go(model, sched, 6, episode_generators(1, range(B)), use_cache=use_cache,
               rows=ReferenceAnchorRows(1.0, floor=40))
    got40 = go(model, sched, 6, episode_generators(1, range(B)), use_cache=use_cache, anchor_sigma=1.0,
               anchor_floor=40)  # the call from level 33 is not pulled
    torch.testing.assert_close(got40, ref40, atol=1e-5, rtol=0)
    assert (got40 - got).abs().max() > 1e-2 and (got40 - plain).abs().max() > 1e-2
    # low frequencies closer to the level-K predictions means less spread between seeds, not more
    other = go(model, sched, 6, episode_generators(2, range(B)), use_cache=use_cache, anchor_sigma=1.0)
    plain_other = go(model, sched, 6, episode_generators(2, range(B)), use_cache=use_cache)
    spread = lambda a, b: gaussian_lowpass(a - b, 1.0).square().mean()  # noqa: E731
    assert spread(got, other) < spread(plain, plain_other)


def test_fifo_rollout_with_the_same_noise_in_every_candidate_is_the_single_anchored_rollout(monkeypatch):
    """FIFO frames enter at K at different rows (the anchor shifts with the window); N candidates that draw the same
    noise keep candidate 0 and the anchors' rows follow the choice, so the result is the single rollout's."""
    model, sched = make(), fifo(4, K, 2)
    single = go(model, sched, 7, episode_generators(3, range(B)), anchor_sigma=0.8)
    assert (single - go(model, sched, 7, episode_generators(3, range(B)))).abs().max() > 1e-2

    def same_seed(generator, n_candidates, batch_size):
        return [torch.Generator().manual_seed(g.initial_seed()) for g in generator for _ in range(n_candidates)]

    monkeypatch.setattr(sys.modules["arvdm.pipeline.rollout"], "candidate_generators", same_seed)
    copies = go(model, sched, 7, episode_generators(3, range(B)), anchor_sigma=0.8, candidates=3)
    torch.testing.assert_close(copies, single, atol=1e-5, rtol=0)
    monkeypatch.undo()
    chosen = go(model, sched, 7, episode_generators(3, range(B)), anchor_sigma=0.8, candidates=3)
    assert (chosen - single).abs().max() > 1e-2  # with their own noise the candidates do differ


def test_bad_anchor_sigma_is_refused_naming_the_flag(tmp_path, capsys):
    model, sched = make(), fifo(4, K, 2)
    for bad in (-0.5, float("nan"), float("inf"), "wide", True):
        with pytest.raises(SamplingError, match="anchor_sigma"):
            go(model, sched, 2, None, anchor_sigma=bad)
        with pytest.raises(SamplingError, match="--anchor-sigma must be a finite number of pixels >= 0"):
            SampleSettings(anchor_sigma=bad).validate()
    spec = make_speculation("fixed:2", (1, 2), seed=0)
    with pytest.raises(SamplingError, match="plain row runner"):
        go(model, sched, 2, None, anchor_sigma=1.0, rows=SpeculativeRows(spec))
    for bad in (-1, K, 2.5, True):
        with pytest.raises(SamplingError, match="rollout anchor_floor must be an integer noise level in 0..K-1"):
            go(model, sched, 2, None, anchor_sigma=1.0, anchor_floor=bad)
    with pytest.raises(SamplingError, match="--anchor-floor must be an integer >= 0"):
        SampleSettings(anchor_floor=-1).validate()
    with pytest.raises(SamplingError, match="rollout anchor_floor 30 needs an anchor, but rollout anchor_sigma is 0"):
        go(model, sched, 2, None, anchor_floor=30)  # the model's run has no anchor (diffusion.anchor_sigma 0)
    with pytest.raises(SamplingError, match="--anchor-floor 300 needs --anchor-sigma > 0"):
        SampleSettings(anchor_sigma=0.0, anchor_floor=300).validate()
    with pytest.raises(SamplingError, match="--anchor-floor 30 needs an anchor, but --anchor-sigma is 0"):
        SampleSettings(anchor_floor=30).with_run_defaults(model.cfg)  # None = the run's σ, 0 here
    with pytest.raises(SamplingError, match="--anchor-sigma 1.0 cannot go with --speculate"):
        SampleSettings(anchor_sigma=1.0, speculate="ucb").validate()
    SampleSettings(anchor_sigma=0.0, speculate="ucb").validate()  # off: nothing to refuse
    assert sample.main(["--run", str(tmp_path), "--anchor-sigma", "-1"]) == 2
    assert "--anchor-sigma must be a finite number of pixels >= 0" in capsys.readouterr().err


def test_the_runs_anchor_is_the_default_as_eta_is():
    """rollout(anchor_sigma=None) is the run's anchor (diffusion.cfg.anchor_sigma / anchor_floor, as eta):
    exactly the explicit one; an explicit 0 is the plain sampler; speculative rows and --speculate fall back to
    no anchor rather than refuse; SampleSettings fills and records the same values."""
    model, sched = make(), chunked(4, K, 3)
    cfg = model.cfg
    cfg.diffusion.anchor_sigma, cfg.diffusion.anchor_floor = 1.0, 30
    cfg.validate()
    own = go(model, sched, 6, episode_generators(1, range(B)))
    torch.testing.assert_close(own, go(model, sched, 6, episode_generators(1, range(B)), anchor_sigma=1.0,
                                       anchor_floor=30), atol=0, rtol=0)
    plain = go(model, sched, 6, episode_generators(1, range(B)), anchor_sigma=0.0)
    assert (own - plain).abs().max() > 1e-2
    spec = make_speculation("fixed:2", (1, 2), seed=0)
    go(model, sched, 2, None, rows=SpeculativeRows(spec))  # the run's anchor does not apply: no refusal
    s = SampleSettings().with_run_defaults(cfg)
    assert (s.anchor_sigma, s.anchor_floor, s.eta, s.context_level) == (1.0, 30, cfg.diffusion.eta, 0)
    assert (SampleSettings(anchor_sigma=2.0).with_run_defaults(cfg).anchor_floor,
            SampleSettings(anchor_sigma=0.0).with_run_defaults(cfg).anchor_floor) == (30, 0)
    spec_settings = SampleSettings(speculate="ucb").with_run_defaults(cfg)
    assert (spec_settings.anchor_sigma, spec_settings.anchor_floor) == (0.0, 0)
    # a run saved before the anchor keys existed samples as it always did: no anchor
    old = cfg.to_dict()
    for key in ("anchor_sigma", "anchor_floor"):
        del old["diffusion"][key]
    assert Config.from_dict(old).diffusion.anchor() == (0.0, 0)
    assert get_preset("tiny").diffusion.anchor() == (1.0, 100)
    bad = dataclasses.replace(cfg.diffusion, anchor_sigma=0.0, anchor_floor=30)
    with pytest.raises(ConfigError, match="anchor_floor 30 needs an anchor, but diffusion.anchor_sigma is 0;"):
        bad.validate()
    for key, value in (("anchor_sigma", -1.0), ("anchor_sigma", float("nan")), ("anchor_floor", K)):
        with pytest.raises(ConfigError, match=f"diffusion.{key} must be"):
            dataclasses.replace(cfg.diffusion, **{key: value}).validate()


def test_use_anchor_sets_the_runs_anchor_checked_and_named_by_the_flags():
    """The experiments' --anchor-sigma / --anchor-floor: None keeps the run's, σ = 0 drops the floor with it, and a
    bad value or a floor without an anchor is refused naming sample.py's flag."""
    cfg = make().cfg
    cfg.diffusion.anchor_sigma, cfg.diffusion.anchor_floor = 1.0, 30
    assert use_anchor(cfg, None, None) == {"anchor_sigma": 1.0, "anchor_floor": 30}
    assert use_anchor(cfg, 2.0, None) == {"anchor_sigma": 2.0, "anchor_floor": 30}
    assert use_anchor(cfg, 0.0, None) == {"anchor_sigma": 0.0, "anchor_floor": 0}
    assert (cfg.diffusion.anchor_sigma, cfg.diffusion.anchor_floor) == (0.0, 0)
    for sigma, floor, flag in ((-1.0, None, "--anchor-sigma"), (1.0, K, "--anchor-floor"), (None, 5, "--anchor-floor")):
        with pytest.raises(SamplingError, match=flag):
            use_anchor(cfg, sigma, floor)
