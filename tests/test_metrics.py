"""Metrics against hand-computed values: PSNR, SSIM, spans, metrics.csv, Fréchet distance, FVD, LPIPS."""

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F

from arvdm.evaluation.evaluate import REQUIRED_EVAL_KEYS, read_eval_json, write_eval_json
from arvdm.evaluation.metrics import (
    frechet_distance,
    fvd,
    gaussian_stats,
    lpips_per_frame,
    max_psnr_decay,
    psnr_per_frame,
    ssim_per_frame,
    summarise_by_span,
    write_metrics_csv,
)


def _video(b=1, t=3, c=3, h=16, w=16, seed=0, lo=-0.5, hi=0.5):
    g = torch.Generator().manual_seed(seed)
    return lo + (hi - lo) * torch.rand(b, t, c, h, w, generator=g)


# ---------------------------------------------------------------------------------------------- PSNR


def test_psnr_constant_offset_matches_hand_value():
    real = _video(b=2, t=3)
    fake = real + 0.1  # stays inside [-1, 1]: MSE = 0.01 exactly -> 10*log10(4 / 0.01) = 26.0206 dB
    p = psnr_per_frame(fake, real)
    assert p.shape == (2, 3)
    assert torch.allclose(p, torch.full((2, 3), 10 * math.log10(400.0)), atol=1e-3)


def test_psnr_per_frame_offsets_and_half_image():
    real = torch.zeros(1, 3, 1, 4, 4)
    fake = real.clone()
    fake[0, 0] += 0.2  # MSE 0.04 -> 10*log10(100) = 20 dB
    fake[0, 1, :, :2] += 0.2  # half the pixels: MSE 0.02 -> 10*log10(200) = 23.0103 dB
    p = psnr_per_frame(fake, real)[0]
    assert p[0].item() == pytest.approx(20.0, abs=1e-3)
    assert p[1].item() == pytest.approx(23.0103, abs=1e-3)
    assert math.isinf(p[2].item())  # identical frame: MSE 0


def test_psnr_data_range_and_clamping():
    real = torch.zeros(1, 1, 1, 2, 2)
    fake = torch.full((1, 1, 1, 2, 2), 0.5)
    want = 10 * math.log10(1 / 0.25)
    assert psnr_per_frame(fake, real, data_range=1.0).item() == pytest.approx(want, abs=1e-4)
    # A value overshooting [-1, 1] is clamped first: 3.0 -> 1.0, MSE 1 -> 10*log10(4)
    assert psnr_per_frame(fake * 6, real).item() == pytest.approx(10 * math.log10(4.0), abs=1e-4)


def test_metric_shape_errors_are_clear():
    with pytest.raises(ValueError, match="differ in shape"):
        psnr_per_frame(_video(t=3), _video(t=4))
    with pytest.raises(ValueError, match=r"\(B, T, C, H, W\)"):
        ssim_per_frame(torch.zeros(3, 3, 16, 16), torch.zeros(3, 3, 16, 16))
    with pytest.raises(ValueError, match="11x11"):
        ssim_per_frame(torch.zeros(1, 1, 3, 8, 8), torch.zeros(1, 1, 3, 8, 8))


# ---------------------------------------------------------------------------------------------- SSIM


def test_ssim_identical_is_one():
    v = _video(b=2, t=2, lo=-1, hi=1)
    assert torch.allclose(ssim_per_frame(v, v), torch.ones(2, 2), atol=1e-5)


def test_ssim_constant_images_hand_value():
    # Constant images a and b: variances and covariance are 0, so
    # SSIM = (2ab + C1) / (a^2 + b^2 + C1) with C1 = (0.01 * data_range)^2 = 4e-4.
    c1 = (0.01 * 2.0) ** 2
    real = torch.full((1, 2, 3, 16, 16), 0.5)
    fake = torch.stack([torch.full((3, 16, 16), 0.25), torch.zeros(3, 16, 16)])[None]
    s = ssim_per_frame(fake, real)[0]
    assert s[0].item() == pytest.approx((2 * 0.5 * 0.25 + c1) / (0.25 + 0.0625 + c1), abs=1e-5)  # 0.80026
    assert s[1].item() == pytest.approx(c1 / (0.25 + c1), abs=1e-6)  # 0.0015974


def _reference_ssim(x, y, data_range=2.0):
    """Wang et al. SSIM written out independently: 11x11 Gaussian window (sigma 1.5), population
    statistics, borders reflect-padded by 5 pixels (torchmetrics' convention; skimage crops them instead),
    mean over channels and all pixels."""
    x, y = x.double(), y.double()  # (N, C, H, W)
    x, y = F.pad(x, (5, 5, 5, 5), mode="reflect"), F.pad(y, (5, 5, 5, 5), mode="reflect")
    r = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(r**2) / (2 * 1.5**2))
    g = g / g.sum()
    k = (g[:, None] * g[None, :])[None, None].repeat(x.shape[1], 1, 1, 1)  # (C, 1, 11, 11)

    def filt(z):
        return F.conv2d(z, k, groups=x.shape[1])

    mx, my = filt(x), filt(y)
    vx, vy, cxy = filt(x * x) - mx**2, filt(y * y) - my**2, filt(x * y) - mx * my
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    m = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return m.mean(dim=(1, 2, 3))


def test_ssim_matches_independent_reference_on_textured_frames():
    real = _video(b=1, t=3, h=20, w=24, lo=-1, hi=1, seed=1)
    fake = (0.6 * real + 0.4 * _video(b=1, t=3, h=20, w=24, lo=-1, hi=1, seed=2)).clamp(-1, 1)
    got = ssim_per_frame(fake, real)[0].double()
    want = _reference_ssim(fake[0], real[0])
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    assert 0.1 < got.min() and got.max() < 0.95  # a genuinely partial similarity, not a trivial case


# ------------------------------------------------------------------------------------- spans and decay


def test_summarise_by_span_means_counts_and_partial_last_span():
    x = torch.arange(40, dtype=torch.float32)
    spans = summarise_by_span(x, span=16)
    assert [(s["start"], s["end"], s["label"], s["n"]) for s in spans] == [
        (0, 16, "0-16", 16), (16, 32, "16-32", 16), (32, 40, "32-40", 8)]
    assert [s["mean"] for s in spans] == [7.5, 23.5, 35.5]
    # Batch: row 2 = row 1 + 100 -> span means +50 and twice the values behind each
    xb = torch.stack([x, x + 100])
    assert [s["mean"] for s in summarise_by_span(xb, 16)] == [57.5, 73.5, 85.5]
    assert [s["n"] for s in summarise_by_span(xb, 16)] == [32, 32, 16]


def test_summarise_by_span_skips_nan_and_rejects_bad_span():
    spans = summarise_by_span([1.0, float("nan"), 3.0, 4.0], span=2)
    assert spans[0]["mean"] == 1.0 and spans[0]["n"] == 1
    assert spans[1]["mean"] == 3.5 and spans[1]["n"] == 2
    with pytest.raises(ValueError):
        summarise_by_span([1.0], span=0)


def test_max_psnr_decay():
    assert max_psnr_decay([10.24, 9.0, 7.88, 8.5]) == pytest.approx(2.36)  # first - worst, not - last
    assert max_psnr_decay(summarise_by_span(torch.tensor([10.0] * 16 + [7.0] * 16 + [8.0] * 16))) == 3.0
    assert max_psnr_decay([5.0]) == 0.0
    assert max_psnr_decay([5.0, 6.0]) == 0.0  # improving rollout: no decay
    with pytest.raises(ValueError):
        max_psnr_decay([])


def test_write_metrics_csv_roundtrip(tmp_path):
    psnr = torch.tensor([[10.0, 20.0, 30.0], [12.0, 22.0, 32.0]])
    ssim = torch.tensor([[0.5, 0.25, 0.0], [0.7, 0.75, 1.0]])
    path = write_metrics_csv(tmp_path / "run" / "metrics.csv", psnr, ssim, frame_offset=4)
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["frame", "psnr", "ssim", "n"]
    assert [(int(r["frame"]), float(r["psnr"]), float(r["ssim"]), int(r["n"])) for r in rows] == [
        (4, 11.0, 0.6, 2), (5, 21.0, 0.5, 2), (6, 31.0, 0.5, 2)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.csv"]  # no temp file left


# ------------------------------------------------------------------------------------------------- FVD


def test_frechet_distance_known_answers():
    # 1-D: (mu1 - mu2)^2 + (s1 - s2)^2 = 9 + (1 - 2)^2 = 10
    assert frechet_distance(torch.tensor([0.0]), torch.tensor([[1.0]]), torch.tensor([3.0]),
                            torch.tensor([[4.0]])) == pytest.approx(10.0)
    # Diagonal: |dmu|^2 + sum (sqrt(a_i) - sqrt(b_i))^2 = (1 + 4) + ((1-3)^2 + (2-1)^2) = 10
    d = frechet_distance(torch.tensor([1.0, 0.0]), torch.diag(torch.tensor([1.0, 4.0])),
                         torch.tensor([0.0, 2.0]), torch.diag(torch.tensor([9.0, 1.0])))
    assert d == pytest.approx(10.0)
    s = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    assert frechet_distance(torch.zeros(2), s, torch.zeros(2), s) == pytest.approx(0.0, abs=1e-9)


def test_frechet_distance_non_commuting_matches_scipy():
    linalg = pytest.importorskip("scipy.linalg")
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(5, 5, generator=g, dtype=torch.float64) for _ in range(2))
    s1, s2 = a @ a.T + 0.1 * torch.eye(5), b @ b.T + 0.1 * torch.eye(5)
    mu1, mu2 = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(2))
    covmean = linalg.sqrtm((s1 @ s2).numpy()).real
    want = float(((mu1 - mu2) ** 2).sum() + torch.trace(s1) + torch.trace(s2) - 2 * covmean.trace())
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(want, rel=1e-8)


def test_frechet_distance_of_sampled_gaussian_features():
    # Features from N(0, I) and N(m, 4I) in 4-D: d^2 = |m|^2 + 4 * (1 - 2)^2 = 4 + 4 = 8.
    g = torch.Generator().manual_seed(0)
    f1 = torch.randn(20000, 4, generator=g, dtype=torch.float64)
    f2 = 2 * torch.randn(20000, 4, generator=g, dtype=torch.float64) + torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert frechet_distance(*gaussian_stats(f1), *gaussian_stats(f2)) == pytest.approx(8.0, rel=0.03)


class _MeanI3D(torch.nn.Module):
    """Stand-in for a TorchScript I3D with the common port's signature: features = per-channel means."""

    def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False,
                return_features: bool = True) -> torch.Tensor:
        return x.mean(dim=(2, 3, 4))  # (B, 3, T, H, W) -> (B, 3)


def test_fvd_requires_user_checkpoint(tmp_path):
    v = _video(b=2, t=4)
    with pytest.raises(ValueError, match="i3d_path"):
        fvd(v, v, None)
    with pytest.raises(FileNotFoundError, match="not found"):
        fvd(v, v, tmp_path / "missing_i3d.pt")


@pytest.mark.filterwarnings("ignore:.*torch.jit.*:FutureWarning")
def test_fvd_with_a_scripted_stand_in(tmp_path):
    path = tmp_path / "i3d.pt"
    torch.jit.script(_MeanI3D()).save(str(path))
    real = _video(b=6, t=4, h=8, w=8, seed=3)
    assert fvd(real, real, path) == pytest.approx(0.0, abs=1e-9)
    # A constant shift of 0.2 moves every channel mean by 0.2 (bilinear resizing preserves it) and leaves
    # the covariance unchanged: FVD = 3 * 0.2^2 = 0.12.
    assert fvd(real, real + 0.2, path) == pytest.approx(0.12, rel=1e-4)


# ----------------------------------------------------------------------------------------------- LPIPS


def test_lpips_requires_local_weights(tmp_path):
    v = _video(b=1, t=2)
    with pytest.raises(ValueError, match="weights_path"):
        lpips_per_frame(v, v)
    with pytest.raises(FileNotFoundError, match="not found"):
        lpips_per_frame(v, v, weights_path=tmp_path / "alexnet.pth")
    bad = tmp_path / "bad.pth"
    torch.save({"features.0.weight": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match="does not match"):
        lpips_per_frame(v, v, weights_path=bad)


def test_lpips_with_a_local_backbone(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    path = tmp_path / "alexnet_features.pth"
    torch.save(torchvision.models.alexnet(weights=None).features.state_dict(), path)  # keys "0.weight", ...
    real = _video(b=2, t=2, h=32, w=32, lo=-1, hi=1, seed=4)
    d_same = lpips_per_frame(real, real, weights_path=path)
    assert d_same.shape == (2, 2)
    assert torch.allclose(d_same, torch.zeros(2, 2), atol=1e-6)
    d_diff = lpips_per_frame(real, _video(b=2, t=2, h=32, w=32, lo=-1, hi=1, seed=5), weights_path=path)
    assert (d_diff > 0).all()


# ------------------------------------------------------------------------------------------- eval.json


def test_write_eval_json_requires_fields_and_writes_strict_json(tmp_path):
    result = {k: 0 for k in REQUIRED_EVAL_KEYS}
    result.update(max_psnr_decay=float("nan"), retrieval_threshold=None, psnr_curve=torch.tensor([1.0, 2.5]))
    path = write_eval_json(tmp_path / "out" / "eval.json", result, extra={"config": {"memory": "prepend"}})
    text = path.read_text()
    data = json.loads(text)  # strict: NaN became null
    assert "NaN" not in text and data["max_psnr_decay"] is None
    assert data["psnr_curve"] == [1.0, 2.5] and data["config"] == {"memory": "prepend"}
    assert data["format"] == "arvdm.eval/1"
    assert read_eval_json(path)["n_frames"] == 0
    bad = dict(result)
    del bad["n_probes"]
    with pytest.raises(KeyError, match="n_probes"):
        write_eval_json(tmp_path / "bad.json", bad)
    assert not (tmp_path / "bad.json").exists()
