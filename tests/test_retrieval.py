"""Revisit matching on constructed trajectories, threshold calibration with known answers, binning, the
needle probe, and a whole evaluate_rollout on a synthetic episode whose retrieval rate is known."""

import json
import math

import pytest
import torch

from arvdm.evaluation.evaluate import evaluate_rollout, write_eval_json
from arvdm.evaluation.retrieval import calibrate_threshold, mean_retrieval_rate, retrieval_by_span
from arvdm.evaluation.revisits import Probe, find_revisits, needle_probe, wrap_angle


def _square_loop(side=10, laps=2):
    """Walk a square of side `side` (unit steps) `laps` times, heading along the path: frame t matches
    frame t - 4*side exactly, and no frame within a lap repeats a pose."""
    poses = []
    for _ in range(laps):
        for k, (dx, dy) in enumerate(((1, 0), (0, 1), (-1, 0), (0, -1))):
            for i in range(side):
                x0, y0 = [(0, 0), (side, 0), (side, side), (0, side)][k]
                poses.append((x0 + dx * i, y0 + dy * i, math.atan2(dy, dx)))
    return torch.tensor(poses, dtype=torch.float64)  # (4*side*laps, 3)


def test_wrap_angle():
    a = torch.tensor([0.0, math.pi / 2, 3 * math.pi / 2, -3 * math.pi / 2, 2 * math.pi + 0.1])
    assert torch.allclose(wrap_angle(a), torch.tensor([0.0, math.pi / 2, -math.pi / 2, math.pi / 2, 0.1]),
                          atol=1e-6)


def test_find_revisits_on_square_loop():
    poses = _square_loop(side=10, laps=2)  # T = 80; t matches t - 40
    probes = find_revisits(poses, pos_tol=0.1, heading_tol=0.1, window_reach=10, start=0)
    assert [(p.t, p.s, p.gap) for p in probes] == [(t, t - 40, 40) for t in range(40, 80)]
    # start: only generated frames t >= 60 are probes; before: only s < 5 may be matched
    assert [p.t for p in find_revisits(poses, 0.1, 0.1, 10, start=60)] == list(range(60, 80))
    before = find_revisits(poses, 0.1, 0.1, 10, before=5)
    assert [(p.t, p.s) for p in before] == [(t, t - 40) for t in range(40, 45)]
    # Out of reach: a reach of 40 frames covers the whole first lap, so nothing is a memory probe
    assert find_revisits(poses, 0.1, 0.1, window_reach=40) == []


def test_find_revisits_heading_and_position_tolerances():
    # Pass the same spot facing the other way: position matches, heading does not.
    poses = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, math.pi], [0.3, 0.0, 0.05]])
    assert find_revisits(poses, pos_tol=0.5, heading_tol=0.2, window_reach=0) == [Probe(3, 0)]
    # Tighter position tolerance: 0.3 away is no longer the same place
    assert find_revisits(poses, pos_tol=0.2, heading_tol=0.2, window_reach=0) == []
    # Heading wraps: 3.1 and -3.1 rad differ by 0.083 rad, not 6.2
    wrap = torch.tensor([[1.0, 1.0, 3.1], [9.0, 9.0, 0.0], [1.0, 1.0, -3.1]])
    assert find_revisits(wrap, pos_tol=0.1, heading_tol=0.1, window_reach=0) == [Probe(2, 0)]


def test_find_revisits_match_modes_and_batch():
    # Place A visited at 0, 3, 6, 9 (other frames far away and all different)
    poses = torch.tensor([[0.0, 0.0, 0.0] if t % 3 == 0 else [10.0 + t, 0.0, 0.0] for t in range(10)])
    latest = find_revisits(poses, 0.1, 0.1, window_reach=4)  # gap must be > 4
    assert [(p.t, p.s) for p in latest] == [(6, 0), (9, 3)]
    earliest = find_revisits(poses, 0.1, 0.1, window_reach=4, match="earliest")
    assert [(p.t, p.s) for p in earliest] == [(6, 0), (9, 0)]
    every = find_revisits(poses, 0.1, 0.1, window_reach=4, match="all")
    assert [(p.t, p.s) for p in every] == [(6, 0), (9, 0), (9, 3)]
    batch = find_revisits(torch.stack([poses, poses + torch.tensor([0.0, 0.0, 1.0])]), 0.1, 0.1, 4)
    assert [(p.b, p.t, p.s) for p in batch] == [(0, 6, 0), (0, 9, 3), (1, 6, 0), (1, 9, 3)]
    with pytest.raises(ValueError, match=r"\(T, 3\)"):
        find_revisits(torch.zeros(10, 2))


def test_calibrate_threshold_separable_case_is_middle_of_gap():
    cal = calibrate_threshold([0.6, 0.7, 0.9, 0.8], [0.1, 0.4, 0.2])
    assert cal["threshold"] == pytest.approx(0.5)
    assert cal["balanced_accuracy"] == 1.0 and cal["tpr"] == 1.0 and cal["tnr"] == 1.0
    assert cal["true_pairs"]["n"] == 4 and cal["random_pairs"]["mean"] == pytest.approx(0.7 / 3)
    assert "warning" not in cal


def test_calibrate_threshold_hand_computed_overlap():
    # Candidates (midpoints) and balanced accuracy (TPR + TNR) / 2, by hand:
    #   .15: (4/4 + 1/3)/2 = .667   .25: (3/4 + 1/3)/2 = .542   .45: (3/4 + 2/3)/2 = .708
    #  .625: (2/4 + 2/3)/2 = .583  .675: (2/4 + 3/3)/2 = .750   .75: (1/4 + 3/3)/2 = .625
    cal = calibrate_threshold([0.2, 0.6, 0.7, 0.8], [0.1, 0.3, 0.65])
    assert cal["threshold"] == pytest.approx(0.675)
    assert cal["balanced_accuracy"] == pytest.approx(0.75)
    assert (cal["tpr"], cal["tnr"]) == (0.5, 1.0)
    assert "warning" not in cal


def test_calibrate_threshold_gaussians_and_warning():
    # Equal-variance Gaussians at 0.7 and 0.3: the balanced-accuracy optimum is the midpoint 0.5.
    g = torch.Generator().manual_seed(0)
    true = 0.7 + 0.08 * torch.randn(3000, generator=g)
    rand = 0.3 + 0.08 * torch.randn(3000, generator=g)
    cal = calibrate_threshold(true, rand)
    assert cal["threshold"] == pytest.approx(0.5, abs=0.03)
    assert cal["balanced_accuracy"] == pytest.approx(0.9938, abs=0.005)  # Phi(0.2 / 0.08)
    # Indistinguishable distributions: flagged as unreliable
    a, b = (0.5 + 0.1 * torch.randn(500, generator=g) for _ in range(2))
    same = calibrate_threshold(a, b)
    assert "warning" in same
    with pytest.raises(ValueError, match="at least one"):
        calibrate_threshold([], [0.1])


def test_retrieval_by_span_counts_and_rates():
    gaps = [3, 10, 15, 16, 20, 47, 48, 111, 112, 500]
    ok = [True, False, True, True, True, False, False, False, True, False]
    by = retrieval_by_span(gaps, ok)
    assert [(b["bin"], b["n"], b["hits"]) for b in by] == [
        ("0-16", 3, 2), ("16-48", 3, 2), ("48-112", 2, 0), ("112+", 2, 1)]
    assert [b["rate"] for b in by] == [pytest.approx(2 / 3), pytest.approx(2 / 3), 0.0, 0.5]
    assert by[3]["hi"] is None
    assert mean_retrieval_rate(by) == pytest.approx((2 / 3 + 2 / 3 + 0 + 0.5) / 4)
    # Probe objects work too; an empty bin has rate None and is left out of the mean
    by2 = retrieval_by_span([Probe(20, 0), Probe(30, 25)], [True, False], bins=((0, 16), (16, 48), (48, 112)))
    assert [b["rate"] for b in by2] == [0.0, 1.0, None]
    assert mean_retrieval_rate(by2) == 0.5
    with pytest.raises(ValueError, match="2 probes but 1"):
        retrieval_by_span([1, 2], [True])


def test_needle_probe_picks_distinctive_view_and_latest_return():
    t_len, context = 60, 8
    video = torch.zeros(t_len, 1, 4, 4)
    video[2] = 1.0  # the one bright frame: the needle
    video[5] = 0.3  # less distinctive
    poses = torch.zeros(t_len, 3)
    poses[:, 0] = torch.arange(t_len, dtype=torch.float32)  # a corridor: every pose new ...
    poses[[40, 55], 0] = 2.0  # ... except returns to the needle's pose at 40 and 55
    poses[50, 0] = 5.0  # and one to frame 5's pose
    probe = needle_probe(video, poses, context, pos_tol=0.1, heading_tol=0.1)
    assert (probe["s"], probe["t"], probe["gap"], probe["rank"]) == (2, 55, 53, 0)
    # If the needle is never revisited, the next most distinctive revisited view is used
    poses[[40, 55], 0] = 100.0
    probe = needle_probe(video, poses, context, pos_tol=0.1, heading_tol=0.1)
    assert (probe["s"], probe["t"], probe["rank"]) == (5, 50, 1)
    poses[50, 0] = 100.0
    assert needle_probe(video, poses, context, pos_tol=0.1, heading_tol=0.1) is None


def _periodic_episode(t_len=48, period=20, size=16, seed=0):
    """An episode whose frame is a fixed random texture per place: the agent walks places 0..19 and starts
    over, so frame t shows exactly what frame t - 20 showed."""
    g = torch.Generator().manual_seed(seed)
    textures = torch.rand(period, 3, size, size, generator=g) * 2 - 1
    place = torch.arange(t_len) % period
    video = textures[place]  # (T, 3, H, W)
    poses = torch.stack([place.double(), torch.zeros(t_len, dtype=torch.float64),
                         torch.zeros(t_len, dtype=torch.float64)], -1)  # (T, 3)
    return video, poses


def test_evaluate_rollout_known_retrieval_rate(tmp_path):
    context = 4
    video, poses = _periodic_episode()
    real = video[None]  # (1, 48, 3, 16, 16)
    fake = video[context:].clone()[None]  # (1, 44, ...): generated frames only
    g = torch.Generator().manual_seed(1)
    # The model "remembers" until frame 33 and produces unrelated frames from 34 on.
    fake[0, 34 - context:] = torch.rand(48 - 34, 3, 16, 16, generator=g) * 2 - 1
    r = evaluate_rollout(fake, real, poses[None], context=context, window_reach=8,
                         pos_tol=0.1, heading_tol=0.1, criterion="threshold")
    # Probes: t = 20..47 revisit t - 20 (gap 20 > reach 8) -> 28 probes, all in the 16-48 bin;
    # t = 20..33 are reproduced exactly -> 14 hits.
    by = {b["bin"]: b for b in r["retrieval_by_span"]}
    assert r["n_probes"] == 28
    assert (by["16-48"]["n"], by["16-48"]["hits"], by["16-48"]["rate"]) == (28, 14, 0.5)
    assert by["0-16"]["n"] == 0 and by["0-16"]["rate"] is None
    assert r["retrieval_mean"] == 0.5 and r["retrieval_overall"] == 0.5
    # True pairs are identical (SSIM 1), random pairs unrelated textures (SSIM ~ 0): separable.
    cal = r["retrieval_calibration"]
    assert cal["balanced_accuracy"] == 1.0 and cal["true_pairs"]["min"] == pytest.approx(1.0, abs=1e-5)
    assert cal["random_pairs"]["max"] < r["retrieval_threshold"] < 1.0
    # Error accumulation side: exact frames (PSNR inf) for 0..29, then noise; 44 frames behind the spans
    assert r["n_frames"] == 44 and [s["n"] for s in r["psnr_by_span"]] == [16, 16, 12]
    assert r["ssim_by_span"][0]["mean"] == pytest.approx(1.0, abs=1e-5)
    # Needle: the most distinctive context frame is revisited at 20 + s and last at 40 + s
    assert r["needle"]["n"] == 1 and r["needle"]["probes"][0]["t"] >= 40
    assert r["needle"]["hits"] == 0  # its latest return is in the forgotten part

    path = write_eval_json(tmp_path / "eval.json", r)
    data = json.loads(path.read_text())
    assert data["retrieval_by_span"][1]["rate"] == 0.5 and data["n_probes"] == 28
    assert data["psnr_by_span"][0]["mean"] is None  # inf PSNR of exact frames is written as null


def test_evaluate_rollout_given_threshold_full_fake_and_no_poses():
    context = 4
    video, poses = _periodic_episode(seed=2)
    real = video[None]
    # fake given as the full video (context frames included) is accepted and split the same way
    r = evaluate_rollout(real.clone(), real, poses[None], context=context, window_reach=8, threshold=0.9,
                         pos_tol=0.1, heading_tol=0.1)
    assert r["retrieval_threshold"] == 0.9 and r["retrieval_calibration"] == {"source": "given"}
    assert r["retrieval_overall"] == 1.0 and r["n_generated"] == 44
    r = evaluate_rollout(real[:, context:], real, None, context=context, window_reach=8)
    assert r["n_probes"] == 0 and r["retrieval_mean"] is None and "retrieval_skipped" in r
    with pytest.raises(ValueError, match="expected 48"):
        evaluate_rollout(real[:, :10], real, None, context=context, window_reach=8)


def test_rank_criterion_perfect_memory_scores_one_and_noise_scores_chance():
    context = 4
    video, poses = _periodic_episode(t_len=200, seed=3)
    real = video[None]  # (1, 200, 3, 16, 16): 180 probes (t = 20..199), each revisiting its place 20 frames back
    perfect = evaluate_rollout(real[:, context:].clone(), real, poses[None], context=context, window_reach=8,
                               pos_tol=0.1, heading_tol=0.1)
    assert perfect["retrieval_settings"]["criterion"] == "rank" and perfect["retrieval_chance"] == 0.2
    assert perfect["n_probes"] == 180 and perfect["retrieval_overall"] == 1.0
    g = torch.Generator().manual_seed(4)
    noise = torch.rand(1, 196, 3, 16, 16, generator=g) * 2 - 1  # a model with no memory at all
    r = evaluate_rollout(noise, real, poses[None], context=context, window_reach=8, pos_tol=0.1, heading_tol=0.1)
    # chance is 1/(4+1): 0.2 +- 4 standard errors (sqrt(0.2 * 0.8 / 180) = 0.03)
    assert abs(r["retrieval_overall"] - 0.2) < 4 * 0.03
    # the copy-last predictor is scored on the same probes
    assert r["retrieval_baselines"]["copy_last"]["retrieval_mean"] is not None
    with pytest.raises(ValueError, match="criterion"):
        evaluate_rollout(noise, real, poses[None], context=context, window_reach=8, criterion="best")
