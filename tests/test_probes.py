"""Memory probes (arvdm/evaluation/probes.py): known answers on synthetic videos, events, pooled rates with
event-level bootstrap intervals, gap bins under MIN_EVENTS dropped, and clear errors on bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arvdm.evaluation.metrics import psnr_per_frame
from arvdm.evaluation.probes import (
    MIN_EVENTS,
    binned,
    gaps,
    memory_probes,
    memory_probes_batch,
    paired_difference,
    pooled_rate,
    psnr_matrix,
    values_at,
)


def _video(t_len: int = 40, seed: int = 0) -> torch.Tensor:
    """(T, 3, 8, 8) independent uniform frames in [-1, 1]: any two differ by ~8 dB PSNR."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t_len, 3, 8, 8, generator=g) * 2 - 1


def _poses(t_len: int = 40) -> torch.Tensor:
    """(T, 3) poses on a line, 1 unit apart, heading 0: no two frames match by pose."""
    return torch.stack([torch.arange(t_len, dtype=torch.float64), torch.zeros(t_len), torch.zeros(t_len)], 1)


def test_psnr_matrix_equals_psnr_per_frame():
    v = _video(6)
    m = psnr_matrix(v)
    ref = psnr_per_frame(v[:, None].expand(6, 6, -1, -1, -1), v[None].expand(6, 6, -1, -1, -1))  # (6, 6)
    off = ~torch.eye(6, dtype=torch.bool)
    assert torch.allclose(m[off].float(), ref[off], rtol=1e-5)
    assert torch.isinf(m.diagonal()).all()


def test_repeated_frame_is_a_probe_with_known_answer():
    v, p = _video(), _poses()
    v[30], p[30] = v[2], p[2]  # frame 30 shows exactly what frame 2 showed
    probes = memory_probes(v, p, recent=8, start=20)
    assert len(probes) == 1
    pr = probes[0]
    assert (pr.t, pr.s, pr.gap, pr.event, pr.b) == (30, 2, 28, 0, 0)
    assert math.isinf(pr.psnr) and pr.recent_psnr < 12.0  # random frames are ~8 dB apart
    assert pr.pose_probe is True and pr.pose_match is True


def test_noisy_repeat_matches_by_threshold_and_pose_flag_is_separate():
    v, p = _video(), _poses()
    g = torch.Generator().manual_seed(1)
    v[30] = v[2] + 0.02 * torch.randn(v[2].shape, generator=g)  # ~34 dB: a match, not identical
    (pr,) = memory_probes(v, p, recent=8, start=20)
    assert pr.s == 2 and 30.0 < pr.psnr < 40.0
    assert pr.pose_probe is False and pr.pose_match is False  # pose 30 matches nothing: a look-alike view
    p[30] = p[2] + torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64)
    (pr,) = memory_probes(v, p, recent=8, start=20)
    assert pr.pose_probe is True and pr.pose_match is True
    p[25] = p[2]  # a recent frame at t's pose: no pose probe, though the pixel probe and its pose match stand
    (pr,) = memory_probes(v, p, recent=8, start=20)
    assert pr.pose_probe is False and pr.pose_match is True
    assert memory_probes(v, p, recent=8, start=20, psnr_threshold=45.0) == []
    (pr,) = memory_probes(v, None, recent=8, start=20)
    assert pr.pose_probe is None and pr.pose_match is None


def test_a_recent_match_disqualifies_and_start_and_recent_bound_probes():
    v = _video()
    v[30] = v[2]
    v[25] = v[2]  # frame 25 lies in frame 30's recent range [22, 30): the model sees it without memory
    assert [pr.t for pr in memory_probes(v, None, recent=8, start=20)] == [25]  # 25 itself: 2 is 23 back
    assert [pr.t for pr in memory_probes(v, None, recent=8, start=26)] == []  # 25 before start
    assert memory_probes(v, None, recent=23, start=20) == []  # 2 is now in 25's recent range too


def test_consecutive_probes_share_an_event_and_batch_ids_are_unique():
    v = _video()
    v[30:33] = v[2:5]  # one return of three frames
    v[37] = v[10]  # another return
    probes = memory_probes(v, None, recent=8, start=20)
    assert [(pr.t, pr.s, pr.event) for pr in probes] == [(30, 2, 0), (31, 3, 0), (32, 4, 0), (37, 10, 1)]
    videos = torch.stack([v, _video(seed=5), v])  # the middle episode has no probes
    batch = memory_probes_batch(videos, None, recent=8, start=20)
    assert [(pr.b, pr.event) for pr in batch] == [(0, 0)] * 3 + [(0, 1)] + [(2, 2)] * 3 + [(2, 3)]
    assert gaps(batch).tolist() == [28, 28, 28, 27] * 2
    per_frame = torch.arange(3 * 20, dtype=torch.float64).reshape(3, 20)  # generated frames 20..39
    assert list(values_at(per_frame, batch, offset=20)) == [10, 11, 12, 17, 50, 51, 52, 57]


def test_pooled_rate_interval_contains_the_mean_and_shrinks_with_events():
    rng = np.random.default_rng(0)
    small_ids = np.repeat(np.arange(20), 3)
    large_ids = np.repeat(np.arange(500), 3)
    small = pooled_rate(rng.normal(20, 3, small_ids.size), small_ids, seed=1)
    large = pooled_rate(rng.normal(20, 3, large_ids.size), large_ids, seed=1)
    for r in (small, large):
        assert r["lo"] <= r["mean"] <= r["hi"]
    assert (small["n_probes"], small["n_events"]) == (60, 20)
    assert large["hi"] - large["lo"] < 0.5 * (small["hi"] - small["lo"])


def test_pooled_rate_is_deterministic_given_the_seed():
    rng = np.random.default_rng(2)
    v, ids = rng.normal(size=90), np.repeat(np.arange(30), 3)
    assert pooled_rate(v, ids, seed=7) == pooled_rate(v, ids, seed=7)
    assert pooled_rate(v, ids, seed=7)["lo"] != pooled_rate(v, ids, seed=8)["lo"]


def test_bootstrap_resamples_events_not_probes():
    rng = np.random.default_rng(3)
    per_event = rng.normal(25, 4, 15)
    ids = np.repeat(np.arange(15), 4)  # 4 identical probes per event
    pooled = pooled_rate(np.repeat(per_event, 4), ids, seed=0)
    one_each = pooled_rate(per_event, np.arange(15), seed=0)
    assert pooled["lo"] == pytest.approx(one_each["lo"]) and pooled["hi"] == pytest.approx(one_each["hi"])
    assert pooled["mean"] == pytest.approx(one_each["mean"])
    # a probe-level bootstrap would believe it has 60 independent values: a narrower interval
    per_probe = pooled_rate(np.repeat(per_event, 4), np.arange(60), seed=0)
    assert per_probe["hi"] - per_probe["lo"] < 0.75 * (pooled["hi"] - pooled["lo"])


def test_paired_difference_is_the_pooled_difference():
    rng = np.random.default_rng(4)
    ids = np.repeat(np.arange(25), 2)
    b = rng.normal(20, 3, 50)
    a = b + 2.0 + rng.normal(0, 0.1, 50)
    d = paired_difference(a, b, ids, seed=0)
    assert d["mean"] == pytest.approx(a.mean() - b.mean())
    assert d["mean_a"] == pytest.approx(a.mean()) and d["mean_b"] == pytest.approx(b.mean())
    assert 1.8 < d["lo"] <= d["mean"] <= d["hi"] < 2.2  # pairing removes the large between-probe spread


def test_binned_drops_bins_with_too_few_events():
    ids = np.concatenate([np.repeat(np.arange(12), 2), [100, 101, 102]])  # 12 events at gap 20, 3 at gap 60
    gap = np.array([20] * 24 + [60] * 3)
    values = np.arange(27, dtype=float)
    rows = {r["bin"]: r for r in binned(values, ids, gap, seed=0)}
    assert list(rows) == ["0-16", "16-48", "48-112", "112+"]
    kept = rows["16-48"]
    assert (kept["n_probes"], kept["n_events"], kept["too_few"]) == (24, 12, False)
    assert kept["mean"] == pytest.approx(values[:24].mean()) and kept["lo_ci"] <= kept["mean"] <= kept["hi_ci"]
    few = rows["48-112"]
    assert (few["n_events"], few["too_few"], few["mean"], few["lo_ci"]) == (3, True, None, None)
    assert rows["0-16"]["n_events"] == 0 and rows["0-16"]["too_few"]
    assert MIN_EVENTS == 10 and binned(values, ids, gap, min_events=3)[2]["mean"] == pytest.approx(25.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"recent": 0}, "recent must be an int >= 1"),
        ({"poses": torch.full((40, 3), math.nan)}, "NaN or inf"),
        ({"poses": torch.zeros(39, 3)}, "do not fit video"),
        ({"video": torch.zeros(40, 8, 8)}, "video must be a float"),
        ({"start": 41}, "start must be an int in"),
    ],
)
def test_memory_probes_bad_input(kwargs, match):
    args = {"video": _video(), "poses": _poses(), "recent": 8, "start": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        memory_probes(**args)


def test_batch_and_rates_bad_input():
    with pytest.raises(ValueError, match="do not fit videos"):
        memory_probes_batch(_video()[None], torch.zeros(1, 39, 3), recent=8)
    with pytest.raises(ValueError, match="3 values but 2 event ids"):
        pooled_rate([1.0, 2.0, 3.0], [0, 1])
    with pytest.raises(ValueError, match="no probes"):
        pooled_rate([], [])
    with pytest.raises(ValueError, match="NaN or infinite"):
        pooled_rate([1.0, math.inf], [0, 1])
    with pytest.raises(ValueError, match="need the same probes"):
        paired_difference([1.0, 2.0], [1.0], [0, 1])
    with pytest.raises(ValueError, match="n_boot must be"):
        pooled_rate([1.0], [0], n_boot=0)
    with pytest.raises(ValueError, match="one each per probe"):
        binned([1.0, 2.0], [0, 1], [5])
