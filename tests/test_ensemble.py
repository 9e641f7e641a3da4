"""python -m arvdm.evaluation.ensemble: K rollouts of the same episodes, one sample against their mean and the
model's own mean, against known values; the seen / unseen split of frames 17-64; folders that cannot be pooled
are refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from arvdm.evaluation.compare import RolloutFileError
from arvdm.evaluation.ensemble import (
    PAIRS,
    ensemble_difference,
    ensemble_report,
    episode_poses,
    main,
    model_mean_psnr,
    shrink_frontier,
)
from arvdm.evaluation.metrics import PSNR_CAP
from data.episodes import write_episode

EPISODES, CONTEXT, T, SIZE = 3, 8, 8 + 70, 8
D = 10  # pixel offset of a sample from the truth (uint8 levels)
ONE_OFF = 20 * math.log10(255 / D)  # PSNR of a frame off by D everywhere: 28.13 dB
SEEN = range(20, 30)  # generated frames (0-based) that stand where the context stood


def episodes(seed: int = 0) -> np.ndarray:
    """(B, T, H, W, 3) uint8 truth: a still context (every context frame the same), then random frames, the SEEN
    ones a copy of the context frame (the agent back where it started)."""
    rng = np.random.default_rng(seed)
    real = rng.integers(50, 200, (EPISODES, T, SIZE, SIZE, 3), dtype=np.uint8)
    real[:, 1:CONTEXT] = real[:, :1]
    for t in SEEN:
        real[:, CONTEXT + t] = real[:, 0]
    return real


def poses() -> np.ndarray:
    """(T, 3): the context at the origin, the generated frames far away except the SEEN ones."""
    p = np.zeros((T, 3), dtype=np.float32)
    p[CONTEXT:, 0] = 100 + np.arange(T - CONTEXT)
    for t in SEEN:
        p[CONTEXT + t] = 0
    return p


def write_rollout(folder, real: np.ndarray, offset: int) -> None:
    """A sample.py folder whose generated frames are the truth + offset (in uint8 levels)."""
    folder.mkdir(parents=True)
    fake = real.astype(np.int16)
    fake[:, CONTEXT:] += offset
    np.savez(folder / "rollout.npz", real=real, fake=fake.astype(np.uint8))
    (folder / "eval.json").write_text(json.dumps({"n_generated": T - CONTEXT}))


def test_two_samples_either_side_of_the_truth_have_an_exact_mean(tmp_path):
    real = episodes()
    write_rollout(tmp_path / "plus", real, D)
    write_rollout(tmp_path / "minus", real, -D)
    r = ensemble_report([tmp_path / "plus", tmp_path / "minus"], n_boot=200)
    assert (r["k"], r["episodes"], r["context"], r["generated"]) == (2, EPISODES, CONTEXT, T - CONTEXT)
    assert [s["span"] for s in r["spans"]] == ["first 1", "first 4", "5-16", "17-64", "65-120"]
    assert r["spans"][-1]["end"] == T - CONTEXT  # clipped to the 70 generated frames
    for s in r["spans"]:
        assert s["one_sample"] == pytest.approx(ONE_OFF, abs=1e-3)
        assert s["mean_of_k"] == pytest.approx(PSNR_CAP)  # (x + d + x - d) / 2 = x
        assert s["model_mean"] == pytest.approx(PSNR_CAP)  # no bias, all spread
        assert s["agreement"] == pytest.approx(ONE_OFF - 20 * math.log10(2), abs=1e-3)  # 2d apart
        d = s["paired"]["mean of K - one sample"]
        assert d["mean"] == pytest.approx(PSNR_CAP - ONE_OFF, abs=1e-3) and d["hi"] - d["lo"] < 1e-6
        assert s["gradient_ratio_one_sample"] == pytest.approx(1.0, abs=1e-6)  # an offset keeps every edge
    assert r["context_views"] is None  # no poses given
    by_lambda = {f["lambda"]: f["spans"] for f in r["shrink"]}  # blends towards the other sample (K = 2)
    assert sorted(by_lambda) == [0.0, 0.5, 0.7, 0.85, 1.0]
    for span in ("first 4", "17-64"):
        assert by_lambda[1.0][span]["psnr"] == pytest.approx(ONE_OFF, abs=1e-3)  # the sample itself
        assert by_lambda[0.0][span]["psnr"] == pytest.approx(ONE_OFF, abs=1e-3)  # the other sample
        assert by_lambda[0.5][span]["psnr"] == pytest.approx(PSNR_CAP)  # halfway: the truth
        # lambda = 0.7: off by |2 * 0.7 - 1| D = 0.4 D
        assert by_lambda[0.7][span]["psnr"] == pytest.approx(ONE_OFF - 20 * math.log10(0.4), abs=1e-2)
        assert by_lambda[1.0][span]["gradient_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_identical_samples_have_no_spread_and_a_biased_mean(tmp_path):
    real = episodes()
    for name in ("a", "b", "c"):
        write_rollout(tmp_path / name, real, D)
    r = ensemble_report([tmp_path / n for n in ("a", "b", "c")], n_boot=200)
    for s in r["spans"]:
        assert s["one_sample"] == pytest.approx(ONE_OFF, abs=1e-3)
        assert s["mean_of_k"] == pytest.approx(ONE_OFF, abs=1e-3)
        assert s["model_mean"] == pytest.approx(ONE_OFF, abs=1e-3)  # all bias: more samples would not help
        assert s["agreement"] == pytest.approx(PSNR_CAP)
        assert s["paired"]["mean of K - one sample"]["mean"] == pytest.approx(0, abs=1e-4)  # float32 rounding
        diff = s["paired"][PAIRS[0][0]]
        assert diff["mean"] == pytest.approx(s["mean_of_k"] - s["context_mean"], abs=1e-6)


def test_model_mean_removes_the_spread_of_k_samples():
    """Samples truth + bias + noise: the estimate recovers the bias alone, where the mean of K still holds
    noise / K."""
    g = torch.Generator().manual_seed(0)
    truth = torch.zeros(2, 3, 3, 16, 16)
    bias, sd, k = 0.1, 0.3, 8
    gen = truth + bias + sd * torch.randn(k, *truth.shape, generator=g)  # (K, B, N, C, H, W)
    est = model_mean_psnr(gen, truth)  # (B, N)
    known = 20 * math.log10(2 / bias)  # 26.02 dB
    assert float(est.mean()) == pytest.approx(known, abs=0.6)
    mean_k = 10 * math.log10(4 / (bias ** 2 + sd ** 2 / k))  # what the plain mean of K scores: 3 dB less
    assert float(est.mean()) > mean_k + 2
    with pytest.raises(ValueError, match="K >= 2"):
        model_mean_psnr(gen[:1], truth)


def test_frames_17_64_split_by_context_views(tmp_path):
    real = episodes()
    data = tmp_path / "data"
    for i in range(EPISODES):
        write_episode(data / f"ep{i:03d}.npz", real[i], np.zeros(T, dtype=np.int64), poses())
    for name, off in (("a", D), ("b", -D)):
        write_rollout(tmp_path / name, real, off)
    from arvdm.evaluation.compare import read_rollout
    truth, _ = read_rollout(tmp_path / "a")
    p = episode_poses(data, None, truth)
    assert p.shape == (EPISODES, T, 3) and torch.equal(p[0], torch.from_numpy(poses()))
    r = ensemble_report([tmp_path / "a", tmp_path / "b"], poses=p, n_boot=200)
    v = r["context_views"]
    assert v["label"] == "17-64" and v["share_seen"] == pytest.approx(len(SEEN) / 48)
    assert v["seen"]["context_mean"] == pytest.approx(PSNR_CAP)  # the still context's mean is those frames
    assert v["unseen"]["context_mean"] < 30
    assert v["seen"]["one_sample"] == pytest.approx(ONE_OFF, abs=1e-3)
    # the ground truth of other episodes is refused
    other = tmp_path / "other"
    for i in range(EPISODES):
        write_episode(other / f"ep{i:03d}.npz", episodes(seed=1)[i], np.zeros(T, dtype=np.int64), poses())
    with pytest.raises(RolloutFileError, match="not episode 0's ground truth"):
        episode_poses(other, None, truth)


def test_the_frontier_trades_sharpness_for_psnr():
    """Samples = truth + independent noise: pulling each towards the others' mean lowers its error as the known
    quadratic in lambda (minimum at 1/K, the mean of all K) and its sharpness with it; the context-mean column is the
    blend's PSNR minus the baseline's."""
    g = torch.Generator().manual_seed(0)
    truth = torch.rand(2, 70, 3, 16, 16, generator=g) * 0.6 - 0.3  # far from the [-1, 1] clip at sd 0.15
    k, sd = 4, 0.15
    gen = truth + sd * torch.randn(k, *truth.shape, generator=g)  # (K, B, N, C, H, W)
    base = torch.full((2, 70), 10.0)
    f = {r["lambda"]: r["spans"]["17-64"] for r in shrink_frontier(gen, truth, base, [("17-64", 16, 64)],
                                                                    (1.0, 0.7, 0.5, 0.25, 0.0))}
    for lam, r in f.items():  # E (m + lam (x - m) - t)^2 = sd^2 (lam^2 + (1 - lam)^2 / (K - 1))
        known = 10 * math.log10(4 / (sd ** 2 * (lam ** 2 + (1 - lam) ** 2 / (k - 1))))
        assert r["psnr"] == pytest.approx(known, abs=0.05)
        assert r["minus_context_mean"] == pytest.approx(r["psnr"] - 10.0, abs=1e-9)
    assert f[0.25]["psnr"] == max(r["psnr"] for r in f.values())
    ratios = [f[lam]["gradient_ratio"] for lam in (1.0, 0.7, 0.5, 0.25)]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] > ratios[-1] + 0.1  # noise is edges: less of it


def test_folders_that_cannot_be_pooled_are_refused(tmp_path, capsys):
    write_rollout(tmp_path / "a", episodes(0), D)
    write_rollout(tmp_path / "b", episodes(1), D)
    with pytest.raises(RolloutFileError, match="at least 2"):
        ensemble_report([tmp_path / "a"])
    with pytest.raises(RolloutFileError, match="does not roll out the ground truth"):
        ensemble_report([tmp_path / "a", tmp_path / "b"])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "ensemble: error" in capsys.readouterr().err
    assert main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    for bad in ("1,2", "x", ""):
        assert main([str(tmp_path / "a"), str(tmp_path / "a"), "--shrink", bad]) == 2
        assert "--shrink" in capsys.readouterr().err


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    real = episodes()
    write_rollout(tmp_path / "a", real, D)
    write_rollout(tmp_path / "b", real, -D)
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--boot", "200", "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "2 rollouts of 3 episodes" in out and "17-64" in out and "lambda" in out
    saved = json.loads((tmp_path / "e.json").read_text())
    assert saved["spans"][3]["mean_of_k"] == pytest.approx(PSNR_CAP)


def test_against_pairs_two_models_means_and_spreads(tmp_path):
    """A: two samples either side of the truth (its mean exact); B: two identical samples off by D (all bias, no
    spread). One sample ties; A's mean and own mean are at the cap, B's at ONE_OFF; B's samples agree perfectly."""
    real = episodes()
    for name, offset in (("a1", D), ("a2", -D), ("b1", D), ("b2", D)):
        write_rollout(tmp_path / name, real, offset)
    r = ensemble_difference([tmp_path / "a1", tmp_path / "a2"], [tmp_path / "b1", tmp_path / "b2"], n_boot=200)
    assert (r["k_a"], r["k_b"], r["episodes"]) == (2, 2, EPISODES)
    assert [s["span"] for s in r["spans"]] == ["first 1", "first 4", "5-16", "17-64", "65-120"]
    for s in r["spans"]:
        assert s["one_sample"]["mean"] == pytest.approx(0, abs=1e-4)
        for name in ("mean_of_k", "model_mean"):
            assert s[name]["mean"] == pytest.approx(PSNR_CAP - ONE_OFF, abs=1e-3)
            assert s[name]["mean_a"] == pytest.approx(PSNR_CAP)
            assert s[name]["mean_b"] == pytest.approx(ONE_OFF, abs=1e-3)
        assert s["agreement"]["mean"] == pytest.approx(ONE_OFF - 20 * math.log10(2) - PSNR_CAP, abs=1e-3)
        assert s["agreement"]["lo"] <= s["agreement"]["mean"] <= s["agreement"]["hi"]
    swapped = ensemble_difference([tmp_path / "b1", tmp_path / "b2"], [tmp_path / "a1", tmp_path / "a2"], n_boot=200)
    assert swapped["spans"][3]["model_mean"]["mean"] == pytest.approx(-r["spans"][3]["model_mean"]["mean"])


def test_against_other_episodes_is_refused_and_the_cli_prints_the_difference(tmp_path, capsys):
    real = episodes()
    for name, offset in (("a1", D), ("a2", -D), ("b1", D), ("b2", D)):
        write_rollout(tmp_path / name, real, offset)
    write_rollout(tmp_path / "o1", episodes(1), D)
    write_rollout(tmp_path / "o2", episodes(1), -D)
    a = [str(tmp_path / "a1"), str(tmp_path / "a2")]
    with pytest.raises(RolloutFileError, match="--against"):
        ensemble_difference(a, [tmp_path / "o1", tmp_path / "o2"], n_boot=200)
    assert main([*a, "--against", str(tmp_path / "o1"), str(tmp_path / "o2"), "--boot", "200"]) == 2
    assert "--against" in capsys.readouterr().err
    assert main([*a, "--against", str(tmp_path / "b1"), "--boot", "200"]) == 2  # one folder: no spread to estimate
    assert "at least 2" in capsys.readouterr().err
    js = tmp_path / "e.json"
    assert main([*a, "--against", str(tmp_path / "b1"), str(tmp_path / "b2"), "--boot", "200", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "A (2 rollouts) - B (2 rollouts) of the same 3 episodes" in out and "model mean" in out
    against = json.loads(js.read_text())["against"]
    assert against["spans"][3]["mean_of_k"]["mean"] == pytest.approx(PSNR_CAP - ONE_OFF, abs=1e-3)
