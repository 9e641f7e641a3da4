"""The hold-up horizon, span differences with episode-level intervals, the gradient ratio by span and the split by
context views (arvdm/evaluation/holdup.py, arvdm/evaluation/baselines.py) on hand-made curves, videos and poses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from arvdm.evaluation.baselines import gradient_ratio_by_span
from arvdm.evaluation.holdup import context_views, hold_up, hold_up_horizon, span_differences
from arvdm.evaluation.metrics import psnr_per_frame
from arvdm.evaluation.probes import pooled_rate


def test_horizon_on_hand_made_curves():
    base = np.full(64, 15.0)
    model = np.concatenate([np.full(16, 20.0), np.full(16, 16.0), np.full(16, 14.0), np.full(16, 18.0)])
    h = hold_up_horizon(model, base, span=16)
    assert h == {"span_index": 2, "start": 32, "end": 48, "label": "32-48", "model": 14.0, "baseline": 15.0}
    assert hold_up_horizon(model, base - 2.0, span=16) is None  # never below
    assert hold_up_horizon(model, base, span=8)["label"] == "32-40"


def test_horizon_averages_episodes_first():
    # episode 0 falls below in the first span, episode 1 is far above: the mean over episodes holds up there
    model = np.array([[14.0] * 4 + [10.0] * 4, [20.0] * 4 + [10.0] * 4])
    base = np.full((2, 8), 15.0)
    assert hold_up_horizon(model, base, span=4)["start"] == 4
    assert hold_up_horizon(model.mean(0), base.mean(0), span=4) == hold_up_horizon(model, base, span=4)


def test_span_differences_mean_and_episode_bootstrap():
    rng = np.random.default_rng(0)
    base = rng.normal(15, 2, (12, 32))
    model = base + np.linspace(2, -2, 32)[None] + rng.normal(0, 0.3, (12, 32))
    rows = span_differences(model, base, span=16, seed=0)
    assert [r["label"] for r in rows] == ["0-16", "16-32"]
    for r, (a, e) in zip(rows, [(0, 16), (16, 32)]):
        d = model[:, a:e] - base[:, a:e]
        assert r["mean"] == pytest.approx(d.mean())
        assert (r["n_episodes"], r["n_frames"]) == (12, 12 * 16)
        # episode-level bootstrap = pooled_rate of one value (its mean) per episode, with equal frame counts
        ref = pooled_rate(d.mean(1), np.arange(12), seed=0)
        assert (r["lo"], r["hi"]) == pytest.approx((ref["lo"], ref["hi"]))
    assert rows[0]["lo"] > 0 > rows[1]["hi"]


def test_gradient_ratio_is_one_on_real_and_below_one_when_blurred():
    g = torch.Generator().manual_seed(0)
    real = torch.rand(2, 32, 3, 16, 16, generator=g) * 2 - 1  # (B, N, C, H, W)
    same = gradient_ratio_by_span(real, real, span=16)
    assert [s["mean"] for s in same] == pytest.approx([1.0, 1.0])
    flat = real.reshape(-1, 3, 16, 16)
    blurred = F.avg_pool2d(F.pad(flat, (1, 1, 1, 1), mode="replicate"), 3, stride=1).reshape(real.shape)
    assert all(s["mean"] < 0.6 for s in gradient_ratio_by_span(blurred, real, span=16))


def test_hold_up_from_videos():
    g = torch.Generator().manual_seed(1)
    real = torch.rand(3, 4 + 32, 3, 16, 16, generator=g) * 2 - 1  # 4 context + 32 generated frames
    gen = real[:, 4:].clone()
    gen[:, 16:] = real[:, :4].mean(1, keepdim=True) + 0.5  # worse than context-mean from frame 16 on
    r = hold_up(gen, real, context=4, span=16)
    assert r["hold_up_horizon"]["label"] == "16-32"
    assert set(r["psnr_minus"]) == {"copy_last", "context_mean"}
    first = r["psnr_minus"]["context_mean"][0]
    assert first["lo"] > 0 and first["mean"] > 30  # perfect frames, clipped at PSNR_CAP, vs ~8 dB
    assert r["gradient_ratio_by_span"][0]["mean"] == pytest.approx(1.0)


def _views_episodes(n: int = 12):
    """2 episodes, 4 context + n generated frames. Poses: the context stands at (0, 0) facing 0; generated frame t
    stands at (0, 0) facing 0 when t is even (a view the context shows) and 3 cells away when odd. The model draws
    seen frames exactly and unseen ones as context-mean + 0.5."""
    g = torch.Generator().manual_seed(2)
    real = torch.rand(2, 4 + n, 3, 8, 8, generator=g) * 2 - 1  # (B, 4 + n, C, H, W)
    poses = torch.zeros(2, 4 + n, 3)
    odd = torch.arange(n) % 2 == 1
    poses[:, 4:][:, odd, 0] = 3.0
    gen = real[:, 4:].clone()
    gen[:, odd] = real[:, :4].mean(1, keepdim=True) + 0.5
    return gen, real, poses, odd


def test_context_views_splits_the_span_by_pose():
    gen, real, poses, odd = _views_episodes()
    v = context_views(gen, real, context=4, poses=poses, start=2, end=10)
    assert (v["start"], v["end"], v["label"]) == (2, 10, "3-10")
    assert v["share_seen"] == pytest.approx(0.5)
    mean = real[:, :4].mean(1, keepdim=True).expand(-1, 12, -1, -1, -1)
    base = psnr_per_frame(mean, real[:, 4:]).clamp(max=60.0)  # (B, 12)
    model = psnr_per_frame(gen, real[:, 4:]).clamp(max=60.0)
    seen, unseen = torch.zeros(12, dtype=torch.bool), torch.zeros(12, dtype=torch.bool)
    seen[2:10], unseen[2:10] = ~odd[2:10], odd[2:10]
    assert v["seen"]["mean"] == pytest.approx(float((model - base)[:, seen].mean()), rel=1e-5)
    assert v["seen"]["mean"] > 20 and v["seen"]["n_probes"] == 8 and v["seen"]["n_events"] == 2
    assert v["unseen"]["mean"] == pytest.approx(float((model - base)[:, unseen].mean()), rel=1e-5)
    assert v["unseen"]["mean"] < 0  # context-mean + 0.5 is worse than context-mean
    # the whole span: the frame-weighted mean of its two parts (half the frames each), and the direct mean
    assert v["all"]["mean"] == pytest.approx(0.5 * (v["seen"]["mean"] + v["unseen"]["mean"]), rel=1e-5)
    assert v["all"]["mean"] == pytest.approx(float((model - base)[:, 2:10].mean()), rel=1e-5)
    assert v["all"]["n_probes"] == 16 and v["all"]["lo"] <= v["all"]["mean"] <= v["all"]["hi"]
    # the heading counts too: the same place looking the other way is not a view the context shows
    poses[:, 4:, 2] = 3.0
    assert context_views(gen, real, context=4, poses=poses, start=2, end=10)["seen"] is None


def test_context_views_in_hold_up_and_its_edges():
    gen, real, poses, _ = _views_episodes()
    assert "context_views" not in hold_up(gen, real, context=4, span=4)
    assert hold_up(gen, real, context=4, span=4, poses=poses)["context_views"] is None  # no frame 17 in 12
    gen, real, poses, _ = _views_episodes(n=24)
    r = hold_up(gen, real, context=4, span=4, poses=poses)["context_views"]
    assert r == context_views(gen, real, context=4, poses=poses, start=16, end=24)
    assert r["label"] == "17-24" and r["share_seen"] == pytest.approx(0.5)
    assert context_views(gen, real, context=4, poses=poses, start=0, end=64)["end"] == 24  # clipped to N
    assert context_views(gen, real, context=4, poses=poses, start=24) is None
    with pytest.raises(ValueError, match=r"poses \(2, 27, 3\)"):
        context_views(gen, real, context=4, poses=poses[:, :27], start=0)
    with pytest.raises(ValueError, match="NaN"):
        context_views(gen, real, context=4, poses=torch.full_like(poses, float("nan")), start=0)


def test_bad_input():
    with pytest.raises(ValueError, match="same"):
        hold_up_horizon(np.zeros(16), np.zeros(15))
    with pytest.raises(ValueError, match="NaN"):
        hold_up_horizon([np.nan] * 4, [1.0] * 4)
    with pytest.raises(ValueError, match="span must be > 0"):
        hold_up_horizon([1.0] * 4, [1.0] * 4, span=0)
    with pytest.raises(ValueError, match="inf"):
        span_differences([[np.inf, 1.0]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="context 4"):
        hold_up(torch.zeros(1, 8, 3, 16, 16), torch.zeros(1, 10, 3, 16, 16), context=4)
