"""Baselines (copy-last, context-mean), the spatial-gradient ratio and the verdict, against hand-computed values."""

import csv
import math

import pytest
import torch

from arvdm.evaluation.baselines import (
    baseline_frames,
    compare_with_baselines,
    first_frames_difference,
    gradient_ratio_by_span,
    verdict,
)
from arvdm.evaluation.evaluate import evaluate_rollout
from arvdm.evaluation.metrics import PSNR_CAP, spatial_gradient_per_frame, write_metrics_csv


def _constant_video(values, c=3, h=12, w=12):
    """(1, T, C, H, W) whose frame t is the constant values[t]."""
    return torch.tensor(values, dtype=torch.float32)[None, :, None, None, None].expand(1, len(values), c, h, w)


def _psnr(mse, data_range=2.0):
    return 10 * math.log10(data_range ** 2 / mse)


def test_copy_last_and_context_mean_frames():
    real = _constant_video([0.0, 0.1, 0.2, 0.5, 0.6])
    copy = baseline_frames(real, context=3, n=2, kind="copy_last")
    mean = baseline_frames(real, context=3, n=2, kind="context_mean")
    assert copy.shape == (1, 2, 3, 12, 12)
    assert torch.allclose(copy, torch.full_like(copy, 0.2))
    assert torch.allclose(mean, torch.full_like(mean, 0.1))  # (0 + 0.1 + 0.2) / 3
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_frames(real, 3, 2, "copy_first")
    with pytest.raises(ValueError, match="context=0"):
        baseline_frames(real, 0, 2, "copy_last")


def test_compare_with_baselines_hand_values():
    real = _constant_video([0.0, 0.1, 0.2, 0.5, 0.6])  # context 3, then 2 generated frames at 0.5, 0.6
    gen = _constant_video([0.5, 0.8])  # model: exact on frame 0, off by 0.2 on frame 1
    r = compare_with_baselines(gen, real, context=3, span=1)
    first = r["first_frames"]
    assert first["copy_last"]["psnr"]["1"] == pytest.approx(_psnr(0.3 ** 2), abs=1e-3)  # 0.2 vs 0.5
    assert first["context_mean"]["psnr"]["1"] == pytest.approx(_psnr(0.4 ** 2), abs=1e-3)  # 0.1 vs 0.5
    copy_curve = r["baselines"]["copy_last"]["psnr_curve"]
    assert copy_curve[1] == pytest.approx(_psnr(0.4 ** 2), abs=1e-3)  # 0.2 vs 0.6
    # only 2 generated frames: "4" and "16" are not reported
    assert set(first["model"]["psnr"]) == {"1"}
    # constant frames have no gradient: ratio 0/0 guarded, reported as 0
    assert r["gradient_ratio_first16"] == pytest.approx(0.0)


def test_spatial_gradient_ramp_and_checkerboard():
    w = 8
    ramp = (torch.arange(w, dtype=torch.float32) * 0.1).expand(1, 1, 3, w, w)  # x[..., j] = 0.1 j
    assert spatial_gradient_per_frame(ramp).item() == pytest.approx(0.5 * 0.1)  # dx = 0.1, dy = 0
    i = torch.arange(w)
    board = ((i[:, None] + i[None, :]) % 2 * 2 - 1).float().expand(1, 2, 3, w, w)  # ±1 checkerboard
    assert torch.allclose(spatial_gradient_per_frame(board), torch.full((1, 2), 2.0))


def test_gradient_ratio_by_span_doubles_with_contrast():
    g = torch.Generator().manual_seed(0)
    real = torch.rand(2, 5, 3, 8, 8, generator=g) - 0.5
    spans = gradient_ratio_by_span(2 * real, real, span=2)
    assert [s["label"] for s in spans] == ["0-2", "2-4", "4-5"]
    assert all(s["mean"] == pytest.approx(2.0, rel=1e-5) for s in spans)


def test_verdict_flags_a_model_that_loses_or_is_noisy():
    def first(model, copy):
        return {"model": {"psnr": {"1": model, "4": model}}, "copy_last": {"psnr": {"1": copy, "4": copy}}}

    good = verdict(first(22.0, 20.0), 1.0)
    assert good["beats_copy_last"] and good["sharp"] and "beats" in good["message"]
    assert "do not read" not in good["message"]
    lose = verdict(first(15.0, 20.0), 1.0)
    assert not lose["beats_copy_last"] and "LOSES TO copy-last" in lose["message"] and "do not read" in lose["message"]
    noisy = verdict(first(22.0, 20.0), 3.0)
    assert not noisy["sharp"] and "NOISY" in noisy["message"]
    assert "BLURRY" in verdict(first(22.0, 20.0), 0.3)["message"]


def test_first_frames_difference_is_paired_by_episode_with_known_interval():
    # every frame of episode 0 beats the baseline by 2 dB, of episode 1 by 4 dB: the mean is 3 and resampling
    # two episodes can only give means 2, 3 or 4, so the 95% interval is exactly [2, 4]
    base = torch.tensor([[20.0, 21.0, 22.0, 23.0, 24.0], [10.0, 12.0, 14.0, 16.0, 18.0]])
    model = base + torch.tensor([[2.0], [4.0]])
    d = first_frames_difference(model, base, ks=(1, 4, 16))
    assert set(d) == {"1", "4"}  # 16 > N frames: not reported
    assert (d["4"]["mean"], d["4"]["lo"], d["4"]["hi"]) == pytest.approx((3.0, 2.0, 4.0))
    assert d["4"]["n_events"] == 2 and d["4"]["n_probes"] == 8
    assert d["1"]["mean_a"] == pytest.approx((22.0 + 14.0) / 2) and d["1"]["mean_b"] == pytest.approx(15.0)
    # inf (an exact frame) is clipped at the cap, as first_frames is
    exact = torch.tensor([[math.inf, 30.0]])
    assert first_frames_difference(exact, torch.tensor([[40.0, 30.0]]))["1"]["mean"] == pytest.approx(PSNR_CAP - 40)


def test_verdict_quotes_the_paired_difference_against_copy_last():
    g = torch.Generator().manual_seed(2)
    real = torch.rand(3, 9, 3, 12, 12, generator=g) * 2 - 1
    gen = (real[:, 4:] + 0.05 * torch.randn(3, 5, 3, 12, 12, generator=g)).clamp(-1, 1)  # close to the truth
    r = compare_with_baselines(gen, real, context=4)
    diff = r["first_frames_minus"]["copy_last"]["4"]
    first = r["first_frames"]
    # the paired mean is the difference of the two means, and the verdict carries and quotes it
    assert diff["mean"] == pytest.approx(first["model"]["psnr"]["4"] - first["copy_last"]["psnr"]["4"])
    assert diff["lo"] <= diff["mean"] <= diff["hi"] and diff["n_events"] == 3
    assert r["verdict"]["difference"] == diff
    quoted = f"{diff['mean']:+.2f} [{diff['lo']:+.2f}, {diff['hi']:+.2f}] dB paired over 3 episodes"
    assert quoted in r["verdict"]["message"]
    ctx = r["first_frames_minus"]["context_mean"]["1"]
    assert ctx["mean"] == pytest.approx(first["model"]["psnr"]["1"] - first["context_mean"]["psnr"]["1"])


def test_first_frames_clip_an_exact_copy_last_at_the_psnr_cap():
    # episode 0: the agent stands still (copy-last exact, PSNR inf); episode 1: it moves. A model 0.02 off on
    # the first and exact on the second beats copy-last's 60 + 20 dB once inf is clipped; without the clip the
    # mean would be inf and no model could ever beat it.
    real = torch.cat([_constant_video([0.1, 0.2, 0.2, 0.2]), _constant_video([0.0, 0.0, 0.2, 0.4])])
    gen = torch.cat([_constant_video([0.22, 0.22]), _constant_video([0.2, 0.4])])
    r = compare_with_baselines(gen, real, context=2, span=1)
    copy, model = r["first_frames"]["copy_last"]["psnr"]["1"], r["first_frames"]["model"]["psnr"]["1"]
    assert copy == pytest.approx((PSNR_CAP + _psnr(0.2 ** 2)) / 2, abs=1e-3)
    assert model == pytest.approx((_psnr(0.02 ** 2) + PSNR_CAP) / 2, abs=1e-3)  # its exact frame clipped too
    assert r["verdict"]["beats_copy_last"] and math.isfinite(r["verdict"]["copy_last_psnr"])


def test_evaluate_rollout_reports_baselines_and_a_copying_model_ties_copy_last():
    g = torch.Generator().manual_seed(1)
    real = torch.rand(2, 12, 3, 12, 12, generator=g) * 2 - 1
    context = 4
    copying = real[:, context - 1:context].expand(-1, 8, -1, -1, -1)  # the model copies the last frame
    r = evaluate_rollout(copying, real, None, context=context, window_reach=4)
    assert r["first_frames"]["model"]["psnr"]["4"] == pytest.approx(r["first_frames"]["copy_last"]["psnr"]["4"])
    assert r["verdict"]["beats_copy_last"]  # a tie counts as "at or above"
    assert [s["label"] for s in r["baselines"]["context_mean"]["psnr_by_span"]] == ["0-8"]


def test_metrics_csv_extra_columns(tmp_path):
    psnr = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    path = write_metrics_csv(tmp_path / "m.csv", psnr, psnr / 100, extra={"psnr_copy_last": psnr + 1})
    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == ["frame", "psnr", "ssim", "psnr_copy_last", "n"]
    assert float(rows[1]["psnr_copy_last"]) == pytest.approx(31.0)  # mean of 21 and 41


def test_evaluate_rollout_takes_a_precomputed_comparison_unchanged():
    g = torch.Generator().manual_seed(2)
    real = torch.rand(2, 10, 3, 12, 12, generator=g) * 2 - 1
    gen = torch.rand(2, 6, 3, 12, 12, generator=g) * 2 - 1
    cmp = compare_with_baselines(gen, real, context=4)
    with_cmp = evaluate_rollout(gen, real, None, context=4, window_reach=4, baselines=cmp)
    assert with_cmp == evaluate_rollout(gen, real, None, context=4, window_reach=4)


def test_gradient_ratio_curve_per_frame_and_first16():
    g = torch.Generator().manual_seed(3)
    real = torch.rand(2, 7, 3, 12, 12, generator=g) - 0.5
    gen = real[:, 2:].clone()
    gen[:, 0] *= 3  # the first generated frame has 3x the contrast
    r = compare_with_baselines(gen, real, context=2)
    assert r["gradient_ratio_curve"][0] == pytest.approx(3.0, rel=1e-5)
    assert r["gradient_ratio_curve"][1:] == pytest.approx([1.0] * 4, rel=1e-5)
    assert r["gradient_ratio_first16"] > 1.0 and r["gradient_ratio_by_span"][0]["mean"] == r["gradient_ratio_first16"]
